/*
** The batch loader. Batch b of an epoch holds samples order[b*B .. b*B+B) where order is
** fixed at kiln_loader_epoch from the seed, so the batches do not depend on how many
** workers make them or which finishes first.
**
** Workers (pthreads) claim batch numbers in increasing order under the lock and build
** them without it. A worker may claim batch b only while b < delivered + Q, where Q =
** prefetch_factor * num_workers and delivered counts batches handed to the caller: at
** most Q batches are being built or waiting, and batch b always has slot b % Q to itself
** (the batch that used it before, b - Q, has been delivered). The caller waits on the slot
** of the next batch, so delivery is in order.
**
** Tensors made in a worker belong to the worker (scopes are thread-local): each build runs
** in its own scope and kiln_keep()s its outputs, which the slot then owns until delivery
** moves them into the caller's scope (kiln_to_device returns a new, scope-owned reference)
** or kiln_loader_free / the next epoch frees them.
**
** Staged copies. When batches go to a GPU and the samples are on the host, the copy of
** batch b+1 to the device overlaps the step on batch b (DESIGN.md: "the loader copies the
** next batch from pinned host memory while the current step runs"):
**
** - Builder threads (the workers; one thread when num_workers is 0, Q = prefetch_factor)
**   write each batch straight into their slot's pinned host block: the dataset's rows, or
**   a custom collate's outputs packed, fields at 256-byte offsets as kiln_to_device_many
**   lays them out. A copy from pinned memory is truly asynchronous; from pageable memory
**   the driver stages it and the host waits.
** - The copy runs on a side stream, not on the device's compute stream: there it would
**   queue behind the last step's kernels and ahead of the next step's, which would wait
**   for it; on a stream of its own it runs on the copy engine beside the kernels. The two
**   streams meet only through events. kiln_loader_next issues batch b's copy if it is not
**   issued yet and b+1's if b+1 is built, makes the compute stream wait for b's copy (an
**   event: the host does not wait) and returns views of b's device block.
** - Every call on a stream, an event or the device's allocator happens in the caller's
**   thread, inside kiln_loader_next, which refuses to run while a graph capture is open:
**   work a builder thread enqueued during the caller's capture could be recorded into the
**   graph, and allocating during a capture needs the warm-up rule. Builders touch host
**   memory only, and wait on the host for a copy to finish.
** - A pinned block is written again only after the copy that read it has finished (its
**   builder waits for the copy's event first).
** - A device block is reused only when (1) the loader holds the sole reference to its
**   storage: each batch tensor the caller keeps, and each view or saved tensor made from
**   one, holds a reference, so a batch kept across next() calls is never overwritten; and
**   (2) the compute stream has passed its last use. When kiln_loader_next finds a block
**   released it records an event on the compute stream, behind every kernel the caller
**   queued with the batch before letting it go, and the side stream waits for that event
**   before copying into the block. (An event recorded when the batch is handed out would
**   not do: the step's kernels come after it.) A new block gets such an event too: the
**   caching allocator's blocks are safe for work queued later on the compute stream only.
**   When no free block fits, a new one is made; free blocks beyond Q + 1 go back.
** - A block whose batch was never delivered (an epoch stopped early) is reused or freed
**   only after its copy has finished.
*/
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "data_int.h"

#define MAX_WORKERS 256

/* READY holds built tensors (or an error); STAGED a batch in the slot's pinned block;
** ISSUED one whose copy to a device block has been queued. In this order: a slot at READY
** or after holds its batch. */
enum { SPEC_NONE = 0, SPEC_MAKING, SPEC_READY, SPEC_FAILED };

enum { SLOT_EMPTY = 0, SLOT_BUILDING, SLOT_READY, SLOT_STAGED, SLOT_ISSUED };

/* Where field f of a staged batch lies in its blocks. */
typedef struct field_layout {
  kiln_dtype dtype;
  int ndim;
  int64_t shape[KILN_MAX_DIMS];
  size_t offset; /* bytes */
} field_layout;

typedef struct slot {
  int state;
  int64_t batch;
  kiln_tensor *t[KILN__MAX_FIELDS];
  kiln_status err;
  char *msg;
  /* staged copies: the pinned block (kept across batches), the event behind the last copy
  ** that read it, and the batch in it */
  void *host;
  size_t host_cap;
  void *retired; /* a pinned block the builder outgrew, freed in the caller's thread */
  void *copy_ev;
  size_t bytes;
  field_layout *layout; /* n_out entries */
  struct dev_block *block; /* ISSUED: the device block the copy goes to */
} slot;

enum { BLOCK_FREE = 0, BLOCK_FILLING, BLOCK_OUT };

/* A device block for staged batches. */
typedef struct dev_block {
  kiln__storage *s; /* the loader's reference */
  size_t cap;
  void *ev;  /* FREE: recorded on the compute stream behind the block's last user */
  int state; /* FILLING: a copy into it is queued; OUT: handed to the caller */
} dev_block;

struct kiln_loader {
  kiln_dataset *ds;
  kiln_loader_opts o;
  int n_out;
  /* the epoch */
  int started;
  int64_t n, n_batches;
  int64_t *order;
  uint64_t epoch;
  int64_t delivered;
  /* the next epoch's order, made by a worker once this epoch's batches are all claimed
  ** (SPEC_*): kiln_loader_epoch(epoch + 1) then finds it made */
  int spec;
  int64_t *spec_order, spec_n;
  /* workers (num_workers of them, or one builder for staged copies) */
  int workers;
  pthread_t *threads;
  int n_threads;
  pthread_mutex_t mu;
  pthread_cond_t cv_ready, cv_space;
  int64_t next_claim;
  int stop;
  slot *slots;
  int q;
  /* staged copies (NULL copier: none) */
  kiln__copier *copier;
  dev_block **blocks;
  int n_blocks;
};

kiln_loader_opts kiln_loader_opts_default(void) {
  kiln_loader_opts o;
  memset(&o, 0, sizeof o);
  o.batch_size = 1;
  o.prefetch_factor = 2;
  o.device = kiln_device_cpu();
  return o;
}

static int64_t batches_for(const kiln_loader *l, int64_t n) {
  int64_t b = l->o.batch_size;
  return n / b + (!l->o.drop_last && n % b != 0); /* no n + b - 1: b may be near INT64_MAX */
}

/* Whether every sample is read on the host (a user dataset, or tensors on the CPU). */
static bool host_samples(const kiln_dataset *ds) {
  if (!ds->is_tensor) return true;
  for (int f = 0; f < ds->n_fields; f++)
    if (kiln_device_of(ds->fields[f]).type != KILN_DEVICE_CPU) return false;
  return true;
}

static void staging_free(kiln_loader *l);

kiln_loader *kiln_loader_new(kiln_dataset *ds, const kiln_loader_opts *opts) {
  kiln_loader_opts o = opts ? *opts : kiln_loader_opts_default();
  const char *bad = NULL;
  if (!ds) bad = "NULL dataset";
  else if (o.batch_size < 1) bad = "batch_size must be at least 1";
  else if (o.num_workers < 0 || o.num_workers > MAX_WORKERS) bad = "num_workers must be in [0, 256]";
  else if (o.prefetch_factor < 0) bad = "prefetch_factor must be >= 0 (0 means 2)";
  else if (o.collate_n_out < 0 || o.collate_n_out > KILN__MAX_FIELDS) bad = "collate_n_out must be in [0, 64]";
  else if (o.collate_n_out > 0 && !o.collate) bad = "collate_n_out needs a collate function";
  if (bad) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_loader_new: %s (batch_size %lld, num_workers %d)",
                   bad, (long long)o.batch_size, o.num_workers);
    return NULL;
  }
  if (o.prefetch_factor == 0) o.prefetch_factor = 2;
  kiln_loader *l = calloc(1, sizeof *l);
  if (!l) {
    kiln_set_error(KILN_ERR_OOM, "kiln_loader_new: out of memory");
    return NULL;
  }
  l->ds = ds;
  l->o = o;
  l->n_out = o.collate_n_out ? o.collate_n_out : ds->n_fields;
  if (host_samples(ds) && kiln__copier_new(o.device, &l->copier) != KILN_OK) {
    free(l);
    return NULL;
  }
  l->workers = o.num_workers > 0 ? o.num_workers : l->copier ? 1 : 0;
  if (l->workers > 0) {
    l->q = o.prefetch_factor * l->workers;
    l->slots = calloc((size_t)l->q, sizeof *l->slots);
    l->threads = calloc((size_t)l->workers, sizeof *l->threads);
    bool ok = l->slots && l->threads;
    for (int i = 0; ok && l->copier && i < l->q; i++) {
      slot *s = &l->slots[i];
      ok = (s->layout = calloc((size_t)l->n_out, sizeof *s->layout)) != NULL;
      if (!ok) kiln_set_error(KILN_ERR_OOM, "kiln_loader_new: out of memory");
      else ok = kiln__copier_event_new(l->copier, &s->copy_ev) == KILN_OK;
    }
    if (!l->slots || !l->threads) kiln_set_error(KILN_ERR_OOM, "kiln_loader_new: out of memory");
    if (!ok) {
      staging_free(l);
      free(l->slots);
      free(l->threads);
      free(l);
      return NULL;
    }
    pthread_mutex_init(&l->mu, NULL);
    pthread_cond_init(&l->cv_ready, NULL);
    pthread_cond_init(&l->cv_space, NULL);
  }
  return l;
}

int64_t kiln_loader_len(const kiln_loader *l) {
  if (!l) return -1;
  int64_t n = kiln_dataset_len(l->ds);
  return n < 0 ? -1 : batches_for(l, n);
}

int kiln_loader_num_fields(const kiln_loader *l) { return l ? l->n_out : 0; }

/* ------------------------------------------------------------------------------------ */
/* Building one batch (any thread). Outputs are owned by the caller of build_batch. */

/* Writes samples idx[0..cnt) of a user dataset row by row into base[f], field f's (cnt,
** ...) block (NULL for a field of no bytes). */
static kiln_status read_rows(kiln_dataset *ds, const int64_t *idx, int64_t cnt, void *const *base) {
  size_t fb[KILN__MAX_FIELDS];
  for (int f = 0; f < ds->n_fields; f++) fb[f] = kiln__field_bytes(&ds->spec[f]);
  for (int64_t i = 0; i < cnt; i++) {
    void *bufs[KILN__MAX_FIELDS];
    for (int f = 0; f < ds->n_fields; f++)
      bufs[f] = base[f] ? (char *)base[f] + (size_t)i * fb[f] : NULL;
    kiln_status st = kiln__dataset_get_into(ds, idx[i], bufs);
    if (st != KILN_OK) return st;
  }
  return KILN_OK;
}

/* The default collate. Outputs are owned by the caller (kiln__own: out of any scope), and
** so is every intermediate: no scope is opened here, because a worker thread's scope
** frames would outlive the thread. */
static kiln_status build_default(kiln_loader *l, const int64_t *idx, int64_t cnt, kiln_tensor **out) {
  kiln_dataset *ds = l->ds;
  if (ds->is_tensor) {
    /* Fast path: one index_select per field, on the field's device. */
    kiln_tensor *ix =
        kiln__own(kiln_from_data(idx, 1, (const int64_t[]){cnt}, KILN_I64, kiln_device_cpu()));
    if (!ix) return kiln_last_error();
    kiln_status st = KILN_OK;
    for (int f = 0; f < ds->n_fields && st == KILN_OK; f++) {
      kiln_device dv = kiln_device_of(ds->fields[f]);
      kiln_tensor *ixd = dv.type == KILN_DEVICE_CPU ? ix : kiln__own(kiln_to_device(ix, dv));
      out[f] = ixd ? kiln__own(kiln_index_select(ds->fields[f], 0, ixd)) : NULL;
      if (!out[f]) st = kiln_last_error();
      if (ixd != ix) kiln_tensor_free(ixd);
    }
    kiln_tensor_free(ix);
    return st;
  }
  /* User dataset: (cnt, ...) CPU tensors, each sample written straight into its row. */
  void *base[KILN__MAX_FIELDS];
  for (int f = 0; f < ds->n_fields; f++) {
    const kiln_field_spec *s = &ds->spec[f];
    int64_t shape[KILN_MAX_DIMS];
    shape[0] = cnt;
    memcpy(shape + 1, s->shape, sizeof(int64_t) * (size_t)s->ndim);
    out[f] = kiln__own(kiln_empty(s->ndim + 1, shape, s->dtype, kiln_device_cpu()));
    if (!out[f]) return kiln_last_error();
    base[f] = kiln__field_bytes(s) && cnt ? kiln_data_ptr(out[f]) : NULL;
    if (kiln__field_bytes(s) && cnt && !base[f]) return kiln_last_error();
  }
  return read_rows(ds, idx, cnt, base);
}

static kiln_status build_custom(kiln_loader *l, const int64_t *idx, int64_t cnt, kiln_tensor **out) {
  kiln_dataset *ds = l->ds;
  int nf = ds->n_fields;
  kiln_tensor **samples = calloc((size_t)(cnt * nf) + 1, sizeof *samples);
  if (!samples) return kiln_set_error(KILN_ERR_OOM, "kiln_loader: out of memory");
  kiln_status st = KILN_OK;
  for (int64_t i = 0; i < cnt && st == KILN_OK; i++) {
    kiln_tensor **s = samples + i * nf;
    if (ds->is_tensor) {
      for (int f = 0; f < nf && st == KILN_OK; f++)
        if (!(s[f] = kiln_select(ds->fields[f], 0, idx[i]))) st = kiln_last_error();
    } else {
      void *bufs[KILN__MAX_FIELDS];
      for (int f = 0; f < nf && st == KILN_OK; f++) {
        const kiln_field_spec *sp = &ds->spec[f];
        s[f] = kiln_empty(sp->ndim, sp->ndim ? sp->shape : NULL, sp->dtype, kiln_device_cpu());
        if (!s[f]) st = kiln_last_error();
        else bufs[f] = kiln_numel(s[f]) ? kiln_data_ptr(s[f]) : NULL;
      }
      if (st == KILN_OK) st = kiln__dataset_get_into(ds, idx[i], bufs);
    }
  }
  if (st == KILN_OK) {
    st = l->o.collate(l->o.collate_user, (int)cnt, nf, samples, out);
    if (st == KILN_OK)
      for (int k = 0; k < l->n_out; k++)
        if (!out[k]) {
          st = kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                              "kiln_loader: collate returned KILN_OK but output %d is NULL", k);
          break;
        }
    if (st != KILN_OK && kiln_last_error() == KILN_OK)
      kiln_set_error(st, "kiln_loader: collate failed with %s", kiln_error_name(st));
  }
  free(samples); /* the samples live in the build's scope */
  return st;
}

/* Builds batch b into out (n_out tensors owned by the caller). */
static kiln_status build_batch(kiln_loader *l, int64_t b, kiln_tensor **out) {
  int64_t start = b * l->o.batch_size;
  int64_t cnt = l->o.batch_size;
  if (start + cnt > l->n) cnt = l->n - start;
  for (int k = 0; k < l->n_out; k++) out[k] = NULL;
  kiln_status st;
  if (l->o.collate) {
    /* A user's collate runs in a scope of its own, so its intermediates go whatever the
    ** thread. The loader's own reference to each output then survives the scope's end
    ** (kiln_keep would be wrong for an output that is also a sample passed through). */
    kiln_scope_begin();
    st = build_custom(l, l->order + start, cnt, out);
    for (int k = 0; k < l->n_out; k++)
      if (out[k]) kiln_tensor_ref(out[k]);
    kiln_scope_end();
  } else {
    st = build_default(l, l->order + start, cnt, out);
  }
  if (st != KILN_OK)
    for (int k = 0; k < l->n_out; k++) {
      kiln_tensor_free(out[k]);
      out[k] = NULL;
    }
  return st;
}

/* ------------------------------------------------------------------------------------ */
/* Staged copies, the builder's half (any builder thread; host memory only). */

static size_t round256(size_t n) { return (n + 255) / 256 * 256; }

/* Grows slot s's pinned block to n bytes (the copy that last read it has finished). The
** old block is freed by the caller's thread: freeing pinned memory may synchronize the
** device, which a builder must not do while the caller captures a graph. */
static kiln_status host_reserve(kiln_loader *l, slot *s, int64_t b, size_t n) {
  if (s->host_cap >= n) return KILN_OK;
  kiln__copier_host_free(l->copier, s->retired); /* NULL: the caller freed the last one */
  s->retired = s->host;
  s->host = NULL;
  s->host_cap = 0;
  if (kiln__copier_host_alloc(l->copier, &s->host, n) != KILN_OK) {
    char msg[512];
    snprintf(msg, sizeof msg, "%s", kiln_last_error_message());
    return kiln_set_error(kiln_last_error(), "kiln_loader_next: batch %lld cannot be staged: %s",
                          (long long)b, msg);
  }
  s->host_cap = n;
  return KILN_OK;
}

/* Builds batch b into slot s's pinned block and sets *staged; or, when the batch cannot be
** staged (a custom collate's outputs on a device, or needing grad), leaves it in out as
** build_batch does. */
static kiln_status stage_batch(kiln_loader *l, slot *s, int64_t b, kiln_tensor **out, bool *staged) {
  kiln_dataset *ds = l->ds;
  int64_t start = b * l->o.batch_size;
  int64_t cnt = l->o.batch_size;
  if (start + cnt > l->n) cnt = l->n - start;
  const int64_t *idx = l->order + start;
  *staged = false;
  for (int k = 0; k < l->n_out; k++) out[k] = NULL;
  /* the copy that read this block last must have finished before it is written again */
  kiln_status st = kiln__copier_sync(l->copier, s->copy_ev);
  if (st != KILN_OK) return st;
  bool direct = !l->o.collate;
  for (int f = 0; direct && ds->is_tensor && f < ds->n_fields; f++)
    direct = kiln_is_contiguous(ds->fields[f]);
  size_t off = 0;
  if (direct) { /* the default collate: rows straight into the pinned block */
    for (int f = 0; f < ds->n_fields; f++) {
      const kiln_field_spec *sp = &ds->spec[f];
      field_layout *fl = &s->layout[f];
      fl->dtype = sp->dtype;
      fl->ndim = sp->ndim + 1;
      fl->shape[0] = cnt;
      memcpy(fl->shape + 1, sp->shape, sizeof(int64_t) * (size_t)sp->ndim);
      fl->offset = off;
      off += round256((size_t)cnt * kiln__field_bytes(sp));
    }
    if ((st = host_reserve(l, s, b, off)) != KILN_OK) return st;
    void *base[KILN__MAX_FIELDS];
    for (int f = 0; f < ds->n_fields; f++)
      base[f] = kiln__field_bytes(&ds->spec[f]) ? (char *)s->host + s->layout[f].offset : NULL;
    if (ds->is_tensor) { /* a gather of rows: the bytes index_select would make */
      for (int f = 0; f < ds->n_fields; f++) {
        size_t fb = kiln__field_bytes(&ds->spec[f]);
        const char *src = base[f] ? kiln_data_ptr(ds->fields[f]) : NULL;
        for (int64_t i = 0; src && i < cnt; i++)
          memcpy((char *)base[f] + (size_t)i * fb, src + (size_t)idx[i] * fb, fb);
      }
    } else if ((st = read_rows(ds, idx, cnt, base)) != KILN_OK) {
      return st;
    }
    s->bytes = off;
    *staged = true;
    return KILN_OK;
  }
  /* a custom collate, or strided fields: built as tensors, packed when all on the host */
  if ((st = build_batch(l, b, out)) != KILN_OK) return st;
  for (int k = 0; k < l->n_out; k++) {
    kiln_tensor *t = out[k];
    if (kiln_device_of(t).type != KILN_DEVICE_CPU || kiln_requires_grad(t)) return KILN_OK;
    field_layout *fl = &s->layout[k];
    fl->dtype = kiln_dtype_of(t);
    fl->ndim = kiln_ndim(t);
    memcpy(fl->shape, kiln_shape(t), sizeof(int64_t) * (size_t)fl->ndim);
    fl->offset = off;
    off += round256(kiln_nbytes(t));
  }
  st = host_reserve(l, s, b, off);
  for (int k = 0; k < l->n_out && st == KILN_OK; k++)
    st = kiln_to_host(out[k], (char *)s->host + s->layout[k].offset, kiln_nbytes(out[k]));
  for (int k = 0; k < l->n_out; k++) {
    kiln_tensor_free(out[k]);
    out[k] = NULL;
  }
  if (st != KILN_OK) return st;
  s->bytes = off;
  *staged = true;
  return KILN_OK;
}

/* ------------------------------------------------------------------------------------ */
/* Workers. */

static char *dup_msg(const char *s) {
  size_t n = strlen(s) + 1;
  char *p = malloc(n);
  if (p) memcpy(p, s, n);
  return p;
}

/* The order of an epoch's samples: a function of (seed, epoch) only, from kiln's own RNG.
** parallel: the shuffle's draws may use the OpenMP team (the caller's thread only). */
static kiln_status make_order(const kiln_loader *l, uint64_t epoch, int64_t n, int64_t *order,
                              bool parallel) {
  if (!l->o.shuffle || n <= 0) {
    for (int64_t i = 0; i < n; i++) order[i] = i;
    return KILN_OK;
  }
  kiln_generator *g = kiln_generator_new(l->o.seed + epoch);
  if (!g) return kiln_last_error();
  kiln_status st = kiln__randperm_fill(n, g, order, parallel);
  kiln_generator_free(g);
  return st;
}

static void *worker_main(void *arg) {
  kiln_loader *l = arg;
  pthread_mutex_lock(&l->mu);
  while (!l->stop && l->next_claim < l->n_batches) {
    if (l->next_claim >= l->delivered + l->q) { /* the queue is full: wait for the caller */
      pthread_cond_wait(&l->cv_space, &l->mu);
      continue;
    }
    int64_t b = l->next_claim++;
    slot *s = &l->slots[b % l->q];
    s->state = SLOT_BUILDING;
    s->batch = b;
    pthread_mutex_unlock(&l->mu);

    kiln_tensor *t[KILN__MAX_FIELDS];
    bool staged = false;
    kiln_clear_error();
    uint64_t prev_epoch = kiln__data_epoch_swap(l->epoch); /* transforms draw from it */
    kiln_status st = l->copier ? stage_batch(l, s, b, t, &staged) : build_batch(l, b, t);
    kiln__data_epoch_swap(prev_epoch);
    char *msg = st != KILN_OK ? dup_msg(kiln_last_error_message()) : NULL;

    pthread_mutex_lock(&l->mu);
    memcpy(s->t, t, sizeof(kiln_tensor *) * (size_t)l->n_out);
    s->err = st;
    s->msg = msg;
    s->state = staged ? SLOT_STAGED : SLOT_READY;
    pthread_cond_broadcast(&l->cv_ready);
  }
  if (!l->stop && l->o.shuffle && l->n > 0 && l->spec == SPEC_NONE) {
    /* Every batch is claimed: make the next epoch's order now, off the caller's path (a
    ** shuffle of 20000 took 0.4 ms of each kiln_loader_epoch on the GPU machines). */
    l->spec = SPEC_MAKING;
    const int64_t n = l->n;
    const uint64_t next = l->epoch + 1;
    pthread_mutex_unlock(&l->mu);
    int64_t *order = malloc(sizeof(int64_t) * (size_t)n);
    bool ok = order && make_order(l, next, n, order, false) == KILN_OK;
    if (!ok) kiln_clear_error(); /* kiln_loader_epoch makes it again and reports */
    pthread_mutex_lock(&l->mu);
    l->spec_order = ok ? order : NULL;
    l->spec_n = n;
    l->spec = ok ? SPEC_READY : SPEC_FAILED;
    if (!ok) free(order);
  }
  pthread_mutex_unlock(&l->mu);
  return NULL;
}

/* Empties a slot, dropping its batch. A staged batch's copy is waited for: its block
** may go back to the allocator, and only work on the compute stream is ordered with that. */
static void slot_clear(kiln_loader *l, slot *s) {
  for (int k = 0; k < l->n_out; k++) {
    kiln_tensor_free(s->t[k]);
    s->t[k] = NULL;
  }
  if (s->state == SLOT_ISSUED) {
    if (kiln__copier_sync(l->copier, s->copy_ev) != KILN_OK) kiln_clear_error();
    s->block->state = BLOCK_FREE;
  }
  if (l->copier) {
    kiln__copier_host_free(l->copier, s->retired);
    s->retired = NULL;
  }
  free(s->msg);
  s->msg = NULL;
  s->err = KILN_OK;
  s->state = SLOT_EMPTY;
}

/* Stops the workers of the current epoch and drops undelivered batches. */
static void stop_epoch(kiln_loader *l) {
  if (l->n_threads > 0) {
    pthread_mutex_lock(&l->mu);
    l->stop = 1;
    pthread_cond_broadcast(&l->cv_space);
    pthread_cond_broadcast(&l->cv_ready);
    pthread_mutex_unlock(&l->mu);
    for (int i = 0; i < l->n_threads; i++) pthread_join(l->threads[i], NULL);
    l->n_threads = 0;
  }
  for (int i = 0; i < l->q; i++) slot_clear(l, &l->slots[i]);
  l->stop = 0;
  l->started = 0;
}

/* The loader must not queue copies or kernels into a graph being captured. */
static kiln_status refuse_capture(const kiln_loader *l, const char *who) {
  kiln_device dev = l->o.device;
  bool on = kiln__copier_capturing(dev);
  for (int f = 0; !on && l->ds->is_tensor && f < l->ds->n_fields; f++)
    on = kiln__copier_capturing(dev = kiln_device_of(l->ds->fields[f]));
  if (!on) return KILN_OK;
  char name[32];
  kiln_device_str(dev, name, sizeof name);
  return kiln_set_error(KILN_ERR_STATE,
                        "%s: a graph capture is open on %s; take batches outside the captured "
                        "step and copy them into its static inputs (the loader's copies are "
                        "not recorded into a graph)",
                        who, name);
}

kiln_status kiln_loader_epoch(kiln_loader *l, uint64_t epoch) {
  if (!l) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_loader_epoch: NULL loader");
  if (refuse_capture(l, "kiln_loader_epoch") != KILN_OK) return KILN_ERR_STATE;
  stop_epoch(l);
  int64_t n = kiln_dataset_len(l->ds);
  if (n < 0) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_loader_epoch: dataset length %lld", (long long)n);
  int64_t *order = NULL;
  if (l->spec == SPEC_READY && l->epoch + 1 == epoch && l->spec_n == n) { /* made ahead */
    order = l->spec_order;
    l->spec_order = NULL;
  } else {
    order = malloc(sizeof(int64_t) * (size_t)(n ? n : 1));
    if (!order) return kiln_set_error(KILN_ERR_OOM, "kiln_loader_epoch: out of memory for %lld indices", (long long)n);
    kiln_status st = make_order(l, epoch, n, order, true);
    if (st != KILN_OK) {
      free(order);
      return st;
    }
  }
  free(l->spec_order);
  l->spec_order = NULL;
  l->spec = SPEC_NONE;
  l->epoch = epoch;
  free(l->order);
  l->order = order;
  l->n = n;
  l->n_batches = batches_for(l, n);
  l->delivered = 0;
  l->next_claim = 0;
  l->started = 1;
  if (l->workers > 0 && l->n_batches > 0) {
    int want = l->workers;
    if (want > l->n_batches) want = (int)l->n_batches;
    for (int i = 0; i < want; i++) {
      if (pthread_create(&l->threads[i], NULL, worker_main, l) != 0) {
        stop_epoch(l);
        return kiln_set_error(KILN_ERR_INTERNAL, "kiln_loader_epoch: cannot start worker %d", i);
      }
      l->n_threads = i + 1;
    }
  }
  return KILN_OK;
}

/* Moves the loader-owned batch into the caller's hands on opts.device. */
static int deliver(kiln_loader *l, kiln_tensor **t, kiln_tensor **fields) {
  kiln_tensor *r[KILN__MAX_FIELDS];
  /* every field in one transfer (staged batches go by deliver_staged) */
  int ok = kiln_to_device_many(l->n_out, t, l->o.device, r) == KILN_OK;
  for (int k = 0; k < l->n_out; k++) kiln_tensor_free(t[k]);
  if (!ok) return -1;
  memcpy(fields, r, sizeof(kiln_tensor *) * (size_t)l->n_out);
  return 1;
}

/* ------------------------------------------------------------------------------------ */
/* Staged copies, the caller's half (the caller's thread; never during a capture). */

static void block_free(kiln_loader *l, dev_block *d) {
  if (!d) return;
  kiln__storage_release(d->s);
  kiln__copier_event_free(l->copier, d->ev);
  free(d);
}

/* Blocks the caller has let go of become free. Their last users were queued on the
** compute stream before this call (the caller dropped its references first), so an event
** recorded now is behind them all. Free blocks beyond q + 1 go back to the allocator. */
static void reclaim(kiln_loader *l) {
  int n_free = 0;
  for (int i = 0; i < l->n_blocks; i++) {
    dev_block *d = l->blocks[i];
    if (d->state == BLOCK_OUT && !kiln__storage_in_use(d->s)) {
      if (kiln__copier_mark(l->copier, d->ev) != KILN_OK) {
        kiln_clear_error(); /* kept out; tried again next time */
        continue;
      }
      d->state = BLOCK_FREE;
    }
    n_free += d->state == BLOCK_FREE;
  }
  for (int i = l->n_blocks - 1; i >= 0 && n_free > l->q + 1; i--) {
    if (l->blocks[i]->state != BLOCK_FREE) continue;
    block_free(l, l->blocks[i]);
    l->blocks[i] = l->blocks[--l->n_blocks];
    n_free--;
  }
}

/* Queues the copy of staged slot s into a free device block that fits, or a new one. */
static kiln_status issue(kiln_loader *l, slot *s) {
  dev_block *d = NULL;
  for (int i = 0; i < l->n_blocks && !d; i++)
    if (l->blocks[i]->state == BLOCK_FREE && l->blocks[i]->cap >= s->bytes) d = l->blocks[i];
  if (!d) {
    dev_block **grown = realloc(l->blocks, sizeof *grown * (size_t)(l->n_blocks + 1));
    if (grown) l->blocks = grown;
    if (!grown || !(d = calloc(1, sizeof *d)))
      return kiln_set_error(KILN_ERR_OOM, "kiln_loader_next: out of memory");
    d->cap = s->bytes > 256 ? s->bytes : 256;
    d->state = BLOCK_FREE;
    /* the allocator may hand out a block whose last user is still queued on the compute
    ** stream: the copy waits for what is queued there now */
    if (!(d->s = kiln__copier_block_new(l->copier, d->cap)) ||
        kiln__copier_event_new(l->copier, &d->ev) != KILN_OK || kiln__copier_mark(l->copier, d->ev) != KILN_OK) {
      kiln_status st = kiln_last_error();
      block_free(l, d);
      return st;
    }
    kiln__storage_mark_packed(d->s); /* the batch's fields and padding between them (kiln_copy_many_) */
    l->blocks[l->n_blocks++] = d;
  }
  kiln_status st = kiln__copier_copy(l->copier, kiln__storage_data(d->s), s->host, s->bytes, d->ev, s->copy_ev);
  if (st != KILN_OK) return st;
  d->state = BLOCK_FILLING;
  pthread_mutex_lock(&l->mu);
  s->block = d;
  s->state = SLOT_ISSUED;
  pthread_mutex_unlock(&l->mu);
  return KILN_OK;
}

/* Hands the caller views of issued slot s's device block, once the compute stream has
** waited for the copy. */
static int deliver_staged(kiln_loader *l, slot *s, kiln_tensor **fields) {
  dev_block *d = s->block;
  d->state = BLOCK_OUT; /* from here the refcount says when it is free again */
  if (kiln__copier_join(l->copier, s->copy_ev) != KILN_OK) return -1;
  kiln_tensor *r[KILN__MAX_FIELDS];
  for (int k = 0; k < l->n_out; k++) {
    const field_layout *fl = &s->layout[k];
    r[k] = kiln__tensor_make(d->s, (int64_t)(fl->offset / kiln_dtype_size(fl->dtype)), fl->ndim,
                             fl->shape, NULL, fl->dtype);
    if (!r[k]) {
      for (int j = 0; j < k; j++) kiln__discard(r[j]);
      return -1;
    }
  }
  memcpy(fields, r, sizeof(kiln_tensor *) * (size_t)l->n_out);
  return 1;
}

static int next_staged(kiln_loader *l, kiln_tensor **fields) {
  reclaim(l);
  int64_t b = l->delivered;
  pthread_mutex_lock(&l->mu);
  slot *s = &l->slots[b % l->q];
  while (!(s->batch == b && s->state >= SLOT_READY)) pthread_cond_wait(&l->cv_ready, &l->mu);
  int state = s->state;
  pthread_mutex_unlock(&l->mu);
  /* the slot stays this thread's until delivered moves past b */
  int r;
  if (state == SLOT_READY) { /* an error, or a batch that could not be staged */
    kiln_tensor *t[KILN__MAX_FIELDS];
    memcpy(t, s->t, sizeof(kiln_tensor *) * (size_t)l->n_out);
    memset(s->t, 0, sizeof s->t);
    if (s->err != KILN_OK) kiln_set_error(s->err, "%s", s->msg ? s->msg : "kiln_loader_next: a worker failed");
    r = s->err != KILN_OK ? -1 : deliver(l, t, fields);
  } else {
    r = state == SLOT_STAGED && issue(l, s) != KILN_OK ? -1 : deliver_staged(l, s, fields);
  }
  kiln__copier_host_free(l->copier, s->retired);
  s->retired = NULL;
  pthread_mutex_lock(&l->mu);
  free(s->msg);
  s->msg = NULL;
  s->err = KILN_OK;
  s->state = SLOT_EMPTY;
  l->delivered++;
  slot *ahead = &l->slots[(b + 1) % l->q];
  bool go = l->q > 1 && ahead->batch == b + 1 && ahead->state == SLOT_STAGED;
  pthread_cond_broadcast(&l->cv_space);
  pthread_mutex_unlock(&l->mu);
  /* The next batch's copy goes now, to run beside this step. A failure here is not this
  ** batch's: that batch's own call tries again and reports it. */
  if (go && issue(l, ahead) != KILN_OK) {
    if (r == 1) kiln_clear_error();
  }
  return r;
}

int kiln_loader_next(kiln_loader *l, kiln_tensor **fields) {
  if (!l || !fields) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_loader_next: NULL %s", l ? "fields" : "loader");
    return -1;
  }
  if (refuse_capture(l, "kiln_loader_next") != KILN_OK) return -1;
  if (!l->order && kiln_loader_epoch(l, 0) != KILN_OK) return -1; /* never started */
  if (!l->started || l->delivered >= l->n_batches) return 0;
  if (l->copier) return next_staged(l, fields);
  kiln_tensor *t[KILN__MAX_FIELDS];
  int64_t b = l->delivered;
  if (l->workers == 0) {
    uint64_t prev_epoch = kiln__data_epoch_swap(l->epoch);
    kiln_status st = build_batch(l, b, t);
    kiln__data_epoch_swap(prev_epoch);
    l->delivered++;
    if (st != KILN_OK) return -1;
    return deliver(l, t, fields);
  }
  pthread_mutex_lock(&l->mu);
  slot *s = &l->slots[b % l->q];
  while (!(s->state == SLOT_READY && s->batch == b)) pthread_cond_wait(&l->cv_ready, &l->mu);
  memcpy(t, s->t, sizeof(kiln_tensor *) * (size_t)l->n_out);
  kiln_status err = s->err;
  char *msg = s->msg;
  memset(s->t, 0, sizeof s->t);
  s->msg = NULL;
  s->err = KILN_OK;
  s->state = SLOT_EMPTY;
  l->delivered++;
  pthread_cond_broadcast(&l->cv_space);
  pthread_mutex_unlock(&l->mu);
  if (err != KILN_OK) {
    kiln_set_error(err, "%s", msg ? msg : "kiln_loader_next: a worker failed");
    free(msg);
    return -1;
  }
  return deliver(l, t, fields);
}

/* Frees what staged copies hold: pinned blocks (once their copies have finished), events,
** the loader's references to its device blocks (batches the caller holds stay valid). */
static void staging_free(kiln_loader *l) {
  if (!l->copier) return;
  for (int i = 0; l->slots && i < l->q; i++) {
    slot *s = &l->slots[i];
    if (s->copy_ev && kiln__copier_sync(l->copier, s->copy_ev) != KILN_OK) kiln_clear_error();
    kiln__copier_host_free(l->copier, s->host);
    kiln__copier_host_free(l->copier, s->retired);
    kiln__copier_event_free(l->copier, s->copy_ev);
    free(s->layout);
  }
  for (int i = 0; i < l->n_blocks; i++) block_free(l, l->blocks[i]);
  free(l->blocks);
  kiln__copier_free(l->copier);
}

void kiln_loader_free(kiln_loader *l) {
  if (!l) return;
  if (l->q) {
    stop_epoch(l);
    pthread_mutex_destroy(&l->mu);
    pthread_cond_destroy(&l->cv_ready);
    pthread_cond_destroy(&l->cv_space);
  }
  staging_free(l);
  free(l->slots);
  free(l->threads);
  free(l->order);
  free(l->spec_order);
  free(l);
}
