/*
** The loader: the same batches in the same order for num_workers 0, 1 and 3; every
** sample once per epoch; new orders per epoch and the same order for the same seed and
** epoch, also when a worker made it ahead; drop_last and its batch count; a dataset error reported in order without
** stopping the epoch; custom collate; the prefetch bound; stopping mid-epoch (free and
** epoch restart) with no leak and no hang; bad arguments.
*/
#define _POSIX_C_SOURCE 200809L
#include <kiln.h>
#include <kiln_data.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "check.h"

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* A user dataset: sample i is (x: f32 (2) = {i, -i}, y: i64 scalar = i). Counts the
** samples fetched; fails on index `bad`; may sleep to make workers finish out of order. */
typedef struct my_ds {
  int64_t n;
  atomic_llong fetched;
  int64_t bad;
  int jitter;
} my_ds;

static int64_t my_len(void *self) { return ((my_ds *)self)->n; }

static kiln_status my_get(void *self, int64_t i, void *const *bufs) {
  my_ds *d = self;
  atomic_fetch_add(&d->fetched, 1);
  if (i == d->bad) return kiln_set_error(KILN_ERR_INDEX, "my_get: sample %lld is broken", (long long)i);
  if (d->jitter && (i * 7919) % 5 == 0) sleep_ms(1);
  float *x = bufs[0];
  x[0] = (float)i;
  x[1] = (float)-i;
  *(int64_t *)bufs[1] = i;
  return KILN_OK;
}

static kiln_dataset *my_dataset(my_ds *d) {
  kiln_dataset_vtable vt = {my_len, my_get, NULL};
  kiln_field_spec f[2] = {{KILN_F32, 1, {2}}, {KILN_I64, 0, {0}}};
  return kiln_dataset_new(&vt, d, 2, f);
}

/* Runs one epoch and writes the sample ids in delivery order (from field 1); returns the
** number of batches, or -1 on an error. Checks field 0 agrees with field 1. */
static int64_t run_epoch(kiln_loader *l, uint64_t epoch, int64_t *ids, int64_t *n_ids,
                         int64_t *sizes) {
  CHECK(kiln_loader_epoch(l, epoch) == KILN_OK);
  int64_t nb = 0, k = 0;
  for (;;) {
    kiln_scope_begin();
    kiln_tensor *b[2];
    int r = kiln_loader_next(l, b);
    if (r == 1) {
      int64_t bs = kiln_size(b[1], 0);
      CHECK(kiln_ndim(b[0]) == 2 && kiln_size(b[0], 0) == bs && kiln_size(b[0], 1) == 2);
      for (int64_t i = 0; i < bs; i++) {
        int64_t id = (int64_t)kiln_get(b[1], (int64_t[]){i});
        CHECK(kiln_get(b[0], (int64_t[]){i, 0}) == (double)id);
        CHECK(kiln_get(b[0], (int64_t[]){i, 1}) == (double)-id);
        ids[k++] = id;
      }
      if (sizes) sizes[nb] = bs;
      nb++;
    }
    kiln_scope_end();
    if (r == 0) break;
    if (r < 0) return -1;
  }
  *n_ids = k;
  return nb;
}

static void test_order_any_workers(void) {
  const int64_t N = 103;
  float *x = malloc(sizeof(float) * N * 2);
  int64_t *y = malloc(sizeof(int64_t) * N);
  for (int64_t i = 0; i < N; i++) {
    x[2 * i] = (float)i;
    x[2 * i + 1] = (float)-i;
    y[i] = i;
  }
  kiln_scope_begin();
  kiln_tensor *tx = kiln_from_data(x, KILN_SHAPE(N, 2), KILN_F32, kiln_device_cpu());
  kiln_tensor *ty = kiln_from_data(y, KILN_SHAPE(N), KILN_I64, kiln_device_cpu());
  kiln_dataset *tds = kiln_tensor_dataset_new(2, (kiln_tensor *[]){tx, ty});
  kiln_scope_end(); /* the dataset holds its own references */
  CHECK(tds && kiln_dataset_len(tds) == N);
  my_ds ud = {N, 0, -1, 1};
  kiln_dataset *uds = my_dataset(&ud);
  CHECK(uds && kiln_dataset_len(uds) == N);

  int64_t ref[2][103], got[103], nref[2] = {0, 0}, ngot = 0, sizes[20];
  int workers[3] = {0, 1, 3};
  for (int which = 0; which < 2; which++) {
    kiln_dataset *ds = which ? uds : tds;
    for (int epoch = 0; epoch < 2; epoch++) {
      for (int w = 0; w < 3; w++) {
        int is_ref = w == 0 && which == 0; /* the tensor dataset in the caller's thread */
        kiln_loader_opts o = kiln_loader_opts_default();
        o.batch_size = 10;
        o.shuffle = true;
        o.seed = 42;
        o.num_workers = workers[w];
        kiln_loader *l = kiln_loader_new(ds, &o);
        CHECK(l && kiln_loader_len(l) == 11 && kiln_loader_num_fields(l) == 2);
        int64_t nb = run_epoch(l, (uint64_t)epoch, is_ref ? ref[epoch] : got,
                               is_ref ? &nref[epoch] : &ngot, sizes);
        CHECK(nb == 11);
        CHECK(sizes[10] == 3);
        if (!is_ref) {
          CHECK(ngot == nref[epoch] && memcmp(ref[epoch], got, sizeof(int64_t) * (size_t)N) == 0);
        } else {
          /* every sample once, and shuffled */
          int seen[103] = {0}, moved = 0;
          for (int64_t i = 0; i < N; i++) {
            int64_t id = ref[epoch][i];
            CHECK(id >= 0 && id < N);
            if (id >= 0 && id < N) seen[id]++;
            moved += id != i;
          }
          for (int64_t i = 0; i < N; i++) CHECK(seen[i] == 1);
          CHECK(moved > N / 2);
        }
        kiln_loader_free(l);
      }
    }
  }
  CHECK(memcmp(ref[0], ref[1], sizeof ref[0]) != 0); /* a new order each epoch */
  /* two epochs of one loader differ; the same epoch again is the same */
  kiln_loader_opts o = kiln_loader_opts_default();
  o.batch_size = 7;
  o.shuffle = true;
  o.seed = 3;
  o.num_workers = 2;
  kiln_loader *l = kiln_loader_new(tds, &o);
  int64_t e0[103], e1[103], e0b[103], n0, n1, n0b;
  CHECK(run_epoch(l, 0, e0, &n0, NULL) == 15);
  CHECK(run_epoch(l, 1, e1, &n1, NULL) == 15);
  CHECK(run_epoch(l, 0, e0b, &n0b, NULL) == 15);
  CHECK(memcmp(e0, e1, sizeof e0) != 0 && memcmp(e0, e0b, sizeof e0) == 0);
  kiln_loader_free(l);
  /* no shuffle: 0..N-1 */
  o.shuffle = false;
  l = kiln_loader_new(uds, &o);
  CHECK(run_epoch(l, 5, e0, &n0, NULL) == 15);
  for (int64_t i = 0; i < N; i++) CHECK(e0[i] == i);
  kiln_loader_free(l);
  kiln_dataset_free(tds);
  kiln_dataset_free(uds);
  free(x);
  free(y);
}

/* The next epoch's order is made by a worker ahead of time; whatever epochs are asked for,
** in order, skipped, repeated or after an epoch left half done, each epoch's order is
** kiln_randperm(n) from a generator seeded seed + epoch. n above 8192, where the caller's
** shuffle draws in parallel and the worker's serially: the two must agree. */
static void test_order_made_ahead(void) {
  const int64_t N = 9001;
  int64_t *y = malloc(sizeof(int64_t) * N), *ids = malloc(sizeof(int64_t) * N);
  float *x = calloc((size_t)N * 2, sizeof(float));
  for (int64_t i = 0; i < N; i++) y[i] = i, x[2 * i] = (float)i, x[2 * i + 1] = (float)-i;
  kiln_scope_begin();
  kiln_tensor *tx = kiln_from_data(x, KILN_SHAPE(N, 2), KILN_F32, kiln_device_cpu());
  kiln_tensor *ty = kiln_from_data(y, KILN_SHAPE(N), KILN_I64, kiln_device_cpu());
  kiln_dataset *ds = kiln_tensor_dataset_new(2, (kiln_tensor *[]){tx, ty});
  kiln_scope_end();
  for (int workers = 0; workers <= 2; workers += 2) {
    kiln_loader_opts o = kiln_loader_opts_default();
    o.batch_size = 1000;
    o.shuffle = true;
    o.seed = 11;
    o.num_workers = workers;
    kiln_loader *l = kiln_loader_new(ds, &o);
    CHECK(l != NULL);
    const uint64_t epochs[] = {0, 1, 2, 7, 3, 3, 4, 5};
    for (int e = 0; e < 8 && l; e++) {
      int64_t n = 0;
      if (e == 5) { /* epoch 3 again, left after one batch; then 4 */
        CHECK(kiln_loader_epoch(l, epochs[e]) == KILN_OK);
        kiln_scope_begin();
        kiln_tensor *b[2];
        CHECK(kiln_loader_next(l, b) == 1);
        kiln_scope_end();
        continue;
      }
      CHECK(run_epoch(l, epochs[e], ids, &n, NULL) == 10);
      kiln_generator *g = kiln_generator_new(11 + epochs[e]);
      kiln_scope_begin();
      kiln_tensor *perm = kiln_randperm(N, g);
      int64_t bad = 0;
      for (int64_t i = 0; perm && i < N; i++) bad += ids[i] != (int64_t)kiln_get(perm, (int64_t[]){i});
      CHECK(perm && n == N && bad == 0);
      kiln_scope_end();
      kiln_generator_free(g);
    }
    kiln_loader_free(l);
  }
  kiln_dataset_free(ds);
  free(x);
  free(y);
  free(ids);
}

static void test_drop_last(void) {
  my_ds ud = {23, 0, -1, 0};
  kiln_dataset *ds = my_dataset(&ud);
  kiln_loader_opts o = kiln_loader_opts_default();
  o.batch_size = 5;
  o.drop_last = true;
  for (int w = 0; w < 2; w++) {
    o.num_workers = w * 2;
    kiln_loader *l = kiln_loader_new(ds, &o);
    CHECK(kiln_loader_len(l) == 4);
    int64_t ids[23], n, sizes[8];
    CHECK(run_epoch(l, 0, ids, &n, sizes) == 4);
    CHECK(n == 20 && sizes[3] == 5);
    kiln_loader_free(l);
  }
  /* a dataset shorter than one batch: 0 batches with drop_last, 1 without */
  o.batch_size = 50;
  kiln_loader *l = kiln_loader_new(ds, &o);
  CHECK(kiln_loader_len(l) == 0);
  kiln_tensor *b[2];
  CHECK(kiln_loader_next(l, b) == 0); /* first call starts epoch 0, which is empty */
  CHECK(kiln_loader_next(l, b) == 0);
  kiln_loader_free(l);
  o.drop_last = false;
  o.num_workers = 1;
  l = kiln_loader_new(ds, &o);
  CHECK(kiln_loader_len(l) == 1);
  int64_t ids[23], n, sizes[2];
  CHECK(run_epoch(l, 0, ids, &n, sizes) == 1 && sizes[0] == 23);
  kiln_loader_free(l);
  kiln_dataset_free(ds);
}

static void test_errors_in_order(void) {
  my_ds ud = {40, 0, 17, 0}; /* sample 17 fails: batch 1 of batch_size 10 (no shuffle) */
  kiln_dataset *ds = my_dataset(&ud);
  for (int w = 0; w < 4; w += 3) {
    kiln_loader_opts o = kiln_loader_opts_default();
    o.batch_size = 10;
    o.num_workers = w;
    kiln_loader *l = kiln_loader_new(ds, &o);
    int results[6], k = 0;
    kiln_tensor *b[2];
    for (;;) {
      kiln_scope_begin();
      int r = kiln_loader_next(l, b);
      if (r < 0) CHECK(kiln_last_error() == KILN_ERR_INDEX &&
                       strstr(kiln_last_error_message(), "sample 17 is broken"));
      kiln_scope_end();
      results[k++] = r;
      if (r == 0 || k == 6) break;
    }
    CHECK(k == 5 && results[0] == 1 && results[1] == -1 && results[2] == 1 && results[3] == 1 &&
          results[4] == 0);
    kiln_loader_free(l);
  }
  kiln_dataset_free(ds);
}

/* collate: the sum of each sample's x as one (B) f32 tensor, plus the ids passed through. */
static kiln_status sum_collate(void *user, int n, int nf, kiln_tensor *const *samples, kiln_tensor **out) {
  (void)user;
  float s[64];
  int64_t id[64];
  for (int i = 0; i < n; i++) {
    s[i] = (float)(kiln_get(samples[i * nf], (int64_t[]){0}) + 10 * kiln_get(samples[i * nf], (int64_t[]){1}));
    id[i] = (int64_t)kiln_get(samples[i * nf + 1], NULL);
  }
  out[0] = kiln_from_data(s, KILN_SHAPE(n), KILN_F32, kiln_device_cpu());
  out[1] = kiln_from_data(id, KILN_SHAPE(n), KILN_I64, kiln_device_cpu());
  out[2] = samples[0]; /* passed through, borrowed */
  return KILN_OK;
}

static void test_collate(void) {
  my_ds ud = {12, 0, -1, 0};
  kiln_dataset *ds = my_dataset(&ud);
  int64_t live0 = kiln_live_tensors();
  for (int w = 0; w < 3; w += 2) {
    kiln_loader_opts o = kiln_loader_opts_default();
    o.batch_size = 5;
    o.num_workers = w;
    o.collate = sum_collate;
    o.collate_n_out = 3;
    kiln_loader *l = kiln_loader_new(ds, &o);
    CHECK(kiln_loader_num_fields(l) == 3);
    kiln_tensor *b[3];
    int64_t seen = 0;
    int r;
    while ((r = kiln_loader_next(l, b)) == 1) { /* no scope: the caller owns the batch */
      for (int64_t i = 0; i < kiln_size(b[0], 0); i++) {
        double id = kiln_get(b[1], (int64_t[]){i});
        CHECK(kiln_get(b[0], (int64_t[]){i}) == id - 10 * id);
        CHECK(id == (double)seen++);
      }
      CHECK(kiln_ndim(b[2]) == 1 && kiln_size(b[2], 0) == 2);
      for (int k = 0; k < 3; k++) kiln_tensor_free(b[k]);
    }
    CHECK(r == 0 && seen == 12);
    kiln_loader_free(l);
    CHECK(kiln_live_tensors() == live0);
  }
  kiln_dataset_free(ds);
}

static void test_prefetch_bound(void) {
  my_ds ud = {400, 0, -1, 0};
  kiln_dataset *ds = my_dataset(&ud);
  kiln_loader_opts o = kiln_loader_opts_default();
  o.batch_size = 4;
  o.num_workers = 2;
  o.prefetch_factor = 3; /* Q = 6 batches */
  kiln_loader *l = kiln_loader_new(ds, &o);
  CHECK(kiln_loader_epoch(l, 0) == KILN_OK);
  int64_t max_ahead = 0;
  kiln_tensor *b[2];
  for (int64_t k = 0; k < 30; k++) {
    kiln_scope_begin();
    CHECK(kiln_loader_next(l, b) == 1);
    kiln_scope_end();
    sleep_ms(3); /* a slow step: the workers run ahead and must stop at the bound */
    int64_t fetched = atomic_load(&ud.fetched);
    int64_t ahead = fetched - (k + 1) * 4;
    if (ahead > max_ahead) max_ahead = ahead;
    CHECK(fetched <= (k + 1 + 6) * 4);
  }
  CHECK(max_ahead > 4); /* they did prefetch */
  printf("prefetch: at most %lld samples ahead (bound %d)\n", (long long)max_ahead, 6 * 4);
  /* stop mid-epoch: free with batches queued and workers blocked on the full queue */
  kiln_loader_free(l);
  CHECK(atomic_load(&ud.fetched) <= (30 + 6) * 4);
  /* restart an epoch mid-way, then free without reading */
  l = kiln_loader_new(ds, &o);
  kiln_loader_next(l, b);
  kiln_tensor_free(b[0]);
  kiln_tensor_free(b[1]);
  CHECK(kiln_loader_epoch(l, 1) == KILN_OK);
  CHECK(kiln_loader_epoch(l, 2) == KILN_OK);
  kiln_loader_free(l);
  kiln_dataset_free(ds);
}

static void test_bad_args(void) {
  my_ds ud = {10, 0, -1, 0};
  kiln_dataset *ds = my_dataset(&ud);
  kiln_loader_opts o = kiln_loader_opts_default();
  CHECK(kiln_loader_new(NULL, &o) == NULL && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT &&
        strstr(kiln_last_error_message(), "NULL dataset"));
  o.batch_size = 0;
  CHECK(kiln_loader_new(ds, &o) == NULL && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT &&
        strstr(kiln_last_error_message(), "batch_size"));
  o = kiln_loader_opts_default();
  o.num_workers = -1;
  CHECK(kiln_loader_new(ds, &o) == NULL && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT);
  o = kiln_loader_opts_default();
  o.collate_n_out = 2;
  CHECK(kiln_loader_new(ds, &o) == NULL && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT);
  o = kiln_loader_opts_default();
  o.batch_size = INT64_MAX;
  kiln_loader *l = kiln_loader_new(ds, &o);
  CHECK(l && kiln_loader_len(l) == 1);
  kiln_tensor *one[2];
  CHECK(kiln_loader_next(l, one) == 1 && kiln_size(one[1], 0) == 10);
  kiln_tensor_free(one[0]);
  kiln_tensor_free(one[1]);
  kiln_loader_free(l);
  l = kiln_loader_new(ds, NULL); /* defaults */
  CHECK(l && kiln_loader_len(l) == 10);
  CHECK(kiln_loader_next(l, NULL) == -1 && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT);
  CHECK(kiln_loader_next(NULL, NULL) == -1);
  CHECK(kiln_loader_epoch(NULL, 0) == KILN_ERR_INVALID_ARGUMENT);
  CHECK(kiln_loader_len(NULL) == -1);
  kiln_loader_free(l);
  kiln_loader_free(NULL);

  kiln_field_spec bad = {KILN_F32, -1, {0}};
  kiln_dataset_vtable vt = {my_len, my_get, NULL};
  CHECK(kiln_dataset_new(&vt, &ud, 1, &bad) == NULL && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT);
  CHECK(kiln_dataset_new(NULL, &ud, 1, &bad) == NULL);
  CHECK(kiln_tensor_dataset_new(0, NULL) == NULL && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT);
  kiln_scope_begin();
  kiln_tensor *a = kiln_zeros(KILN_SHAPE(3, 2), KILN_F32, kiln_device_cpu());
  kiln_tensor *c = kiln_zeros(KILN_SHAPE(4), KILN_I64, kiln_device_cpu());
  kiln_tensor *s = kiln_zeros(KILN_SHAPE0, KILN_I64, kiln_device_cpu());
  CHECK(kiln_tensor_dataset_new(2, (kiln_tensor *[]){a, c}) == NULL && kiln_last_error() == KILN_ERR_SHAPE &&
        strstr(kiln_last_error_message(), "[3, 2]") && strstr(kiln_last_error_message(), "[4]"));
  CHECK(kiln_tensor_dataset_new(1, (kiln_tensor *[]){s}) == NULL && kiln_last_error() == KILN_ERR_SHAPE);
  kiln_tensor *out[2];
  CHECK(kiln_dataset_get(ds, 10, out) == KILN_ERR_INDEX);
  CHECK(kiln_dataset_get(ds, 3, out) == KILN_OK && kiln_get(out[0], (int64_t[]){1}) == -3 &&
        kiln_get(out[1], NULL) == 3);
  float rx[2] = {0, 0};
  int64_t ry = 0;
  CHECK(kiln_dataset_read(ds, 4, (void *[]){rx, &ry}) == KILN_OK && rx[1] == -4 && ry == 4);
  CHECK(kiln_dataset_read(ds, -1, (void *[]){rx, &ry}) == KILN_ERR_INDEX);
  CHECK(kiln_dataset_read(NULL, 0, (void *[]){rx, &ry}) == KILN_ERR_INVALID_ARGUMENT);
  kiln_scope_end();
  CHECK(kiln_dataset_len(NULL) == -1);
  kiln_dataset_free(NULL);
  kiln_dataset_free(ds);
}

int main(void) {
  int64_t live0 = kiln_live_tensors();
  test_order_any_workers();
  test_order_made_ahead();
  test_drop_last();
  test_errors_in_order();
  test_collate();
  test_prefetch_bound();
  test_bad_args();
  CHECK(kiln_live_tensors() == live0);
  return check_finish("test_data_loader");
}
