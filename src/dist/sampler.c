/*
** Distributed sampling: each rank's shard of a per-epoch order (PyTorch's
** DistributedSampler rules, stated in kiln_dist.h), as an index list and as a dataset
** view that any loader reads without knowing about ranks.
*/
#define _POSIX_C_SOURCE 200809L /* pthread_rwlock_t */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "dist_int.h"
#include "ext/kiln_ext.h"

int64_t kiln_dist_shard_num_samples(int64_t n, int world, bool drop_last) {
  if (n < 0 || world < 1) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                   "kiln_dist_shard_num_samples: need n >= 0 and world >= 1 (got %lld, %d)",
                   (long long)n, world);
    return -1;
  }
  return drop_last ? n / world : (n + world - 1) / world;
}

/* The epoch's order of 0..n-1 into order (n entries). */
static kiln_status epoch_order(int64_t n, bool shuffle, uint64_t seed, uint64_t epoch,
                               int64_t *order) {
  if (!shuffle || n <= 1) {
    for (int64_t i = 0; i < n; i++) order[i] = i;
    return KILN_OK;
  }
  /* the loader's own rule (kiln_loader_epoch): randperm from a generator seeded
  ** seed + epoch, so a world of one sees exactly the order of a shuffling loader */
  kiln_generator *g = kiln_generator_new(seed + epoch);
  if (!g) return kiln_last_error();
  kiln_scope_begin();
  kiln_tensor *perm = kiln_randperm(n, g);
  kiln_status st = perm ? kiln_to_host(perm, order, sizeof(int64_t) * (size_t)n) : kiln_last_error();
  kiln_scope_end();
  kiln_generator_free(g);
  return st;
}

kiln_status kiln_dist_shard_indices(int64_t n, int rank, int world, bool shuffle, uint64_t seed,
                                    uint64_t epoch, bool drop_last, int64_t *out) {
  int64_t num = kiln_dist_shard_num_samples(n, world, drop_last);
  if (num < 0) return kiln_last_error();
  if (rank < 0 || rank >= world)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                          "kiln_dist_shard_indices: rank %d outside [0, %d)", rank, world);
  if (num == 0) return KILN_OK;
  if (!out) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_dist_shard_indices: NULL out");
  int64_t *order = malloc(sizeof *order * (size_t)n);
  if (!order) return kiln_set_error(KILN_ERR_OOM, "kiln_dist_shard_indices: out of memory "
                                                  "(%lld indices)", (long long)n);
  kiln_status st = epoch_order(n, shuffle, seed, epoch, order);
  /* position j of the padded (or cut) order is order[j mod n]: padding repeats the order
  ** from its start as often as needed; with drop_last every j < n */
  for (int64_t i = 0; i < num && st == KILN_OK; i++) out[i] = order[(rank + i * world) % n];
  free(order);
  return st;
}

/* ---- the dataset view ---- */
typedef struct shard {
  kiln_dataset *base;
  int rank, world;
  bool shuffle, drop_last;
  uint64_t seed;
  int64_t n, num;
  int64_t *idx; /* num entries; replaced by set_epoch under the write lock */
  pthread_rwlock_t lock;
} shard;

static int64_t shard_len(void *self) { return ((shard *)self)->num; }

static kiln_status shard_get(void *self, int64_t i, void *const *bufs) {
  shard *s = self;
  pthread_rwlock_rdlock(&s->lock);
  int64_t j = i >= 0 && i < s->num ? s->idx[i] : -1;
  pthread_rwlock_unlock(&s->lock);
  if (j < 0)
    return kiln_set_error(KILN_ERR_INDEX, "kiln_dist_shard_dataset: index %lld out of range [0, %lld)",
                          (long long)i, (long long)s->num);
  return kiln_dataset_read(s->base, j, bufs);
}

static void shard_destroy(void *self) {
  shard *s = self;
  if (!s) return;
  pthread_rwlock_destroy(&s->lock);
  free(s->idx);
  free(s);
}

static const kiln_dataset_vtable shard_vt = {shard_len, shard_get, shard_destroy};

static kiln_status shard_fill(shard *s, uint64_t epoch, int64_t **out) {
  int64_t *idx = malloc(sizeof *idx * (size_t)(s->num > 0 ? s->num : 1));
  if (!idx) return kiln_set_error(KILN_ERR_OOM, "kiln_dist_shard_dataset: out of memory");
  kiln_status st = kiln_dist_shard_indices(s->n, s->rank, s->world, s->shuffle, s->seed, epoch,
                                           s->drop_last, idx);
  if (st != KILN_OK) {
    free(idx);
    return st;
  }
  *out = idx;
  return KILN_OK;
}

kiln_dataset *kiln_dist_shard_dataset(kiln_dataset *base, int rank, int world, bool shuffle,
                                      uint64_t seed, bool drop_last) {
  if (!base) KILN__FAIL_NULL(KILN_ERR_INVALID_ARGUMENT, "kiln_dist_shard_dataset: NULL base");
  if (world < 1 || rank < 0 || rank >= world)
    KILN__FAIL_NULL(KILN_ERR_INVALID_ARGUMENT,
                    "kiln_dist_shard_dataset: rank %d of world %d (need 0 <= rank < world)",
                    rank, world);
  int64_t n = kiln_dataset_len(base);
  if (n < 0) return NULL;
  shard *s = calloc(1, sizeof *s);
  if (!s) KILN__FAIL_NULL(KILN_ERR_OOM, "kiln_dist_shard_dataset: out of memory");
  s->base = base;
  s->rank = rank;
  s->world = world;
  s->shuffle = shuffle;
  s->drop_last = drop_last;
  s->seed = seed;
  s->n = n;
  s->num = kiln_dist_shard_num_samples(n, world, drop_last);
  if (pthread_rwlock_init(&s->lock, NULL) != 0) {
    free(s);
    KILN__FAIL_NULL(KILN_ERR_INTERNAL, "kiln_dist_shard_dataset: pthread_rwlock_init failed");
  }
  if (shard_fill(s, 0, &s->idx) != KILN_OK) {
    shard_destroy(s);
    return NULL;
  }
  int nf = kiln_dataset_num_fields(base);
  kiln_field_spec specs[KILN__MAX_FIELDS];
  for (int f = 0; f < nf; f++) specs[f] = *kiln_dataset_field(base, f);
  kiln_dataset *ds = kiln_dataset_new(&shard_vt, s, nf, specs);
  if (!ds) shard_destroy(s);
  return ds;
}

kiln_status kiln_dist_shard_set_epoch(kiln_dataset *ds, uint64_t epoch) {
  shard *s = kiln__dataset_self(ds, shard_get);
  if (!s)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                          "kiln_dist_shard_set_epoch: not a dataset made by kiln_dist_shard_dataset");
  int64_t *idx = NULL;
  kiln_status st = shard_fill(s, epoch, &idx);
  if (st != KILN_OK) return st;
  pthread_rwlock_wrlock(&s->lock);
  int64_t *old = s->idx;
  s->idx = idx;
  pthread_rwlock_unlock(&s->lock);
  free(old);
  return KILN_OK;
}
