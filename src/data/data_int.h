/*
** Internals of the data layer (not API): the dataset object, shared by dataset.c and
** loader.c.
*/
#ifndef KILN_DATA_INT_H
#define KILN_DATA_INT_H

#include "kiln_data.h"
#include "ext/kiln_ext.h"

/* KILN__MAX_FIELDS and kiln__dataset_self: ext/kiln_ext.h */

struct kiln_dataset {
  kiln_dataset_vtable vt; /* user datasets */
  void *self;
  int n_fields;
  kiln_field_spec spec[KILN__MAX_FIELDS];
  kiln_tensor *fields[KILN__MAX_FIELDS]; /* tensor datasets: one reference each; else NULL */
  int is_tensor;
};

/* Bytes of one sample's field f. */
size_t kiln__field_bytes(const kiln_field_spec *s);
/* Writes sample index into per-field host buffers (both kinds of dataset). */
kiln_status kiln__dataset_get_into(kiln_dataset *ds, int64_t index, void *const *bufs);

/* The epoch of the loader building a batch on this thread, for the transform dataset's
** randomness (transform.c): the loader sets it around each build and puts the previous
** value back. Returns the previous value. */
uint64_t kiln__data_epoch_swap(uint64_t epoch);

/* ---- the loader's copier (copier.c) ----
** What a staged batch needs from its device: pinned host blocks, device blocks, a side
** copy stream, and events on it and on the device's compute stream (the one every kiln
** op runs on). Every call but kiln__copier_sync and the host blocks' is made in the
** loader's caller's thread, outside graph capture. Functions return KILN_OK or set the
** last error. */
typedef struct kiln__copier kiln__copier;

/* *out := the copier for batches delivered to dev: CUDA's when dev is a working CUDA
** device, the emulated device's when dev is the CPU and the emulation is on, else NULL
** (that loader copies as before). KILN_ERR_OOM, KILN_ERR_INTERNAL. */
kiln_status kiln__copier_new(kiln_device dev, kiln__copier **out);
void kiln__copier_free(kiln__copier *c); /* NULL is a no-op; queued copies finish first */
/* Pinned (page-locked) host memory: copies from it are truly asynchronous. */
kiln_status kiln__copier_host_alloc(kiln__copier *c, void **p, size_t n);
void kiln__copier_host_free(kiln__copier *c, void *p);
/* A block of n bytes on the device: a storage holding one reference, the caller's. */
kiln__storage *kiln__copier_block_new(kiln__copier *c, size_t n);
kiln_status kiln__copier_event_new(kiln__copier *c, void **ev);
void kiln__copier_event_free(kiln__copier *c, void *ev);
/* ev := the point the compute stream has been queued to. */
kiln_status kiln__copier_mark(kiln__copier *c, void *ev);
/* On the side stream: wait for after (NULL: none), copy n bytes from the pinned src to
** the device's dst, record done. Returns at once. */
kiln_status kiln__copier_copy(kiln__copier *c, void *dst, const void *src, size_t n, void *after,
                              void *done);
/* The compute stream waits for ev (on CUDA the host does not wait). */
kiln_status kiln__copier_join(kiln__copier *c, void *ev);
/* The host waits for ev (any thread). An event never recorded is complete. */
kiln_status kiln__copier_sync(kiln__copier *c, void *ev);
/* Whether a graph capture is open on dev. */
bool kiln__copier_capturing(kiln_device dev);

/* Test hook: loaders made while the emulation is on and delivering to the CPU stage
** their batches through the emulated device (copier.c), so the staged path runs without
** a GPU. Each such loader keeps the settings it was made with (the allocations counted
** are its own). NULL or on == false turns it off. */
typedef struct kiln__copier_emulation {
  bool on;
  int copy_delay_us;    /* each emulated copy starts this late (0: at once) */
  int fail_host_alloc;  /* the loader's n-th pinned allocation fails with KILN_ERR_OOM (0: none) */
  int fail_block_alloc; /* the loader's n-th device block allocation fails likewise */
} kiln__copier_emulation;
void kiln__copier_emulate(const kiln__copier_emulation *e);

#endif /* KILN_DATA_INT_H */
