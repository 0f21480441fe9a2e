/* Storage: a refcounted block of device memory, served by the device's backend. */
#include "kiln_int.h"

#include <stdlib.h>

kiln__storage *kiln__storage_new(kiln_device dev, size_t nbytes) {
  if (kiln__check_device(dev, "kiln: allocate") != KILN_OK) return NULL;
  const kiln__backend *b = kiln__backend_get(dev.type);
  kiln__storage *s = calloc(1, sizeof *s);
  if (!s) {
    kiln_set_error(KILN_ERR_OOM, "kiln: out of host memory for a storage handle");
    return NULL;
  }
  s->data = b->alloc(dev.index, nbytes);
  if (!s->data) {
    free(s);
    if (kiln_last_error() != KILN_ERR_OOM)
      kiln_set_error(KILN_ERR_OOM, "kiln: out of memory on %s: tried to allocate %zu bytes",
                     kiln__device_cstr(dev), nbytes);
    kiln__oom_annotate(dev);
    return NULL;
  }
  atomic_init(&s->refcount, 1);
  s->device = dev;
  s->backend = b;
  s->nbytes = nbytes;
  return s;
}

void kiln__storage_retain(kiln__storage *s) {
  if (s) atomic_fetch_add_explicit(&s->refcount, 1, memory_order_relaxed);
}

void kiln__storage_release(kiln__storage *s) {
  if (!s) return;
  if (atomic_fetch_sub_explicit(&s->refcount, 1, memory_order_acq_rel) != 1) return;
  if (!s->borrowed && s->data) s->backend->free(s->device.index, s->data, s->nbytes);
  free(s);
}

void *kiln__storage_data(const kiln__storage *s) {
  kiln__storage_bump(s); /* a raw pointer may write */
  return s->data;
}

/* The counter is atomic, so bumping through a const handle (the raw-pointer getters take
** one) changes no data the const promises. */
void kiln__storage_bump(const kiln__storage *s) {
  atomic_fetch_add_explicit(&((kiln__storage *)s)->version, 1, memory_order_relaxed);
}

uint64_t kiln__storage_version(const kiln__storage *s) {
  return atomic_load_explicit(&((kiln__storage *)s)->version, memory_order_relaxed);
}

static _Atomic uint64_t write_epoch;
uint64_t kiln__write_epoch(void) { return atomic_load_explicit(&write_epoch, memory_order_relaxed); }
void kiln__write_epoch_bump(void) { atomic_fetch_add_explicit(&write_epoch, 1, memory_order_relaxed); }

bool kiln__storage_in_use(const kiln__storage *s) {
  /* acquire: pairs with the release in kiln__storage_release of the last other holder, so
  ** the caller may reuse the bytes once this says false */
  return atomic_load_explicit(&((kiln__storage *)s)->refcount, memory_order_acquire) != 1;
}

void kiln__storage_mark_packed(kiln__storage *s) { s->packed = true; }
