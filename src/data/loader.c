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
*/
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "../io/io_int.h"
#include "data_int.h"

#define MAX_WORKERS 256

enum { SLOT_EMPTY = 0, SLOT_BUILDING, SLOT_READY };

typedef struct slot {
  int state;
  int64_t batch;
  kiln_tensor *t[KILN__MAX_FIELDS];
  kiln_status err;
  char *msg;
} slot;

struct kiln_loader {
  kiln_dataset *ds;
  kiln_loader_opts o;
  int n_out;
  /* the epoch */
  int started;
  int64_t n, n_batches;
  int64_t *order;
  int64_t delivered;
  /* workers */
  pthread_t *threads;
  int n_threads;
  pthread_mutex_t mu;
  pthread_cond_t cv_ready, cv_space;
  int64_t next_claim;
  int stop;
  slot *slots;
  int q;
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
  if (o.num_workers > 0) {
    l->q = o.prefetch_factor * o.num_workers;
    l->slots = calloc((size_t)l->q, sizeof *l->slots);
    l->threads = calloc((size_t)o.num_workers, sizeof *l->threads);
    if (!l->slots || !l->threads) {
      free(l->slots);
      free(l->threads);
      free(l);
      kiln_set_error(KILN_ERR_OOM, "kiln_loader_new: out of memory");
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
  size_t fb[KILN__MAX_FIELDS];
  for (int f = 0; f < ds->n_fields; f++) {
    const kiln_field_spec *s = &ds->spec[f];
    int64_t shape[KILN_MAX_DIMS];
    shape[0] = cnt;
    memcpy(shape + 1, s->shape, sizeof(int64_t) * (size_t)s->ndim);
    out[f] = kiln__own(kiln_empty(s->ndim + 1, shape, s->dtype, kiln_device_cpu()));
    if (!out[f]) return kiln_last_error();
    fb[f] = kiln__field_bytes(s);
    base[f] = fb[f] && cnt ? kiln_data_ptr(out[f]) : NULL;
    if (fb[f] && cnt && !base[f]) return kiln_last_error();
  }
  for (int64_t i = 0; i < cnt; i++) {
    void *bufs[KILN__MAX_FIELDS];
    for (int f = 0; f < ds->n_fields; f++)
      bufs[f] = base[f] ? (char *)base[f] + (size_t)i * fb[f] : NULL;
    kiln_status st = kiln__dataset_get_into(ds, idx[i], bufs);
    if (st != KILN_OK) return st;
  }
  return KILN_OK;
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
/* Workers. */

static char *dup_msg(const char *s) {
  size_t n = strlen(s) + 1;
  char *p = malloc(n);
  if (p) memcpy(p, s, n);
  return p;
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
    kiln_clear_error();
    kiln_status st = build_batch(l, b, t);
    char *msg = st != KILN_OK ? dup_msg(kiln_last_error_message()) : NULL;

    pthread_mutex_lock(&l->mu);
    memcpy(s->t, t, sizeof(kiln_tensor *) * (size_t)l->n_out);
    s->err = st;
    s->msg = msg;
    s->state = SLOT_READY;
    pthread_cond_broadcast(&l->cv_ready);
  }
  pthread_mutex_unlock(&l->mu);
  return NULL;
}

static void slot_clear(kiln_loader *l, slot *s) {
  for (int k = 0; k < l->n_out; k++) {
    kiln_tensor_free(s->t[k]);
    s->t[k] = NULL;
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

kiln_status kiln_loader_epoch(kiln_loader *l, uint64_t epoch) {
  if (!l) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_loader_epoch: NULL loader");
  stop_epoch(l);
  int64_t n = kiln_dataset_len(l->ds);
  if (n < 0) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_loader_epoch: dataset length %lld", (long long)n);
  int64_t *order = malloc(sizeof(int64_t) * (size_t)(n ? n : 1));
  if (!order) return kiln_set_error(KILN_ERR_OOM, "kiln_loader_epoch: out of memory for %lld indices", (long long)n);
  if (l->o.shuffle && n > 0) {
    /* kiln's own RNG, so the order is a function of (seed, epoch) only */
    kiln_generator *g = kiln_generator_new(l->o.seed + epoch);
    kiln_tensor *perm = g ? kiln__own(kiln_randperm(n, g)) : NULL;
    kiln_status st = perm ? kiln_to_host(perm, order, sizeof(int64_t) * (size_t)n) : kiln_last_error();
    kiln_tensor_free(perm);
    kiln_generator_free(g);
    if (st != KILN_OK) {
      free(order);
      return st ? st : KILN_ERR_INTERNAL;
    }
  } else {
    for (int64_t i = 0; i < n; i++) order[i] = i;
  }
  free(l->order);
  l->order = order;
  l->n = n;
  l->n_batches = batches_for(l, n);
  l->delivered = 0;
  l->next_claim = 0;
  l->started = 1;
  if (l->o.num_workers > 0 && l->n_batches > 0) {
    int want = l->o.num_workers;
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
  /* every field in one transfer. TODO(pinned/async): copy from pinned host memory on a
  ** side stream, so the copy of batch b+1 overlaps the step on batch b. */
  int ok = kiln_to_device_many(l->n_out, t, l->o.device, r) == KILN_OK;
  for (int k = 0; k < l->n_out; k++) kiln_tensor_free(t[k]);
  if (!ok) return -1;
  memcpy(fields, r, sizeof(kiln_tensor *) * (size_t)l->n_out);
  return 1;
}

int kiln_loader_next(kiln_loader *l, kiln_tensor **fields) {
  if (!l || !fields) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_loader_next: NULL %s", l ? "fields" : "loader");
    return -1;
  }
  if (!l->order && kiln_loader_epoch(l, 0) != KILN_OK) return -1; /* never started */
  if (!l->started || l->delivered >= l->n_batches) return 0;
  kiln_tensor *t[KILN__MAX_FIELDS];
  int64_t b = l->delivered;
  if (l->o.num_workers == 0) {
    kiln_status st = build_batch(l, b, t);
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

void kiln_loader_free(kiln_loader *l) {
  if (!l) return;
  if (l->q) {
    stop_epoch(l);
    pthread_mutex_destroy(&l->mu);
    pthread_cond_destroy(&l->cv_ready);
    pthread_cond_destroy(&l->cv_space);
  }
  free(l->slots);
  free(l->threads);
  free(l->order);
  free(l);
}
