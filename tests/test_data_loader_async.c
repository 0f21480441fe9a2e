/*
** The loader's staged path (pinned blocks, a side copy stream, recycled device blocks) on
** the emulated device, so it runs on any machine and under valgrind: the same batches,
** bit for bit, as the synchronous loader over several epochs (shuffle and drop_last both
** ways, the smaller last batch, tensor and user datasets, strided fields, a custom
** collate, batches that outgrow the pinned blocks); a batch kept across next() calls is
** never overwritten and released blocks are reused; stopping mid-epoch (free, a new
** epoch) with copies in flight; and failures (a pinned or device allocation, the
** dataset's own) reported by the next kiln_loader_next. The emulated copies start late on
** purpose, so a missing wait shows as a wrong batch.
*/
#define _POSIX_C_SOURCE 200809L
#include <kiln.h>
#include <kiln_data.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/kiln_int.h"
#include "data/data_int.h"
#include "batch_record.h"
#include "check.h"

#define N 103

static void emulate(bool on, int delay_us, int fail_host, int fail_block) {
  kiln__copier_emulation e = {on, delay_us, fail_host, fail_block};
  kiln__copier_emulate(&e);
}

/* A user dataset: sample i is (x: f32 (3) = {i, i + 0.5, -i}, y: i64 = i, z: u8 = i * 7);
** sample `bad` fails. */
typedef struct my_ds {
  int64_t bad;
} my_ds;

static int64_t my_len(void *self) {
  (void)self;
  return N;
}

static kiln_status my_get(void *self, int64_t i, void *const *bufs) {
  if (i == ((my_ds *)self)->bad) return kiln_set_error(KILN_ERR_INDEX, "my_get: sample %lld is broken", (long long)i);
  float *x = bufs[0];
  x[0] = (float)i, x[1] = (float)i + 0.5f, x[2] = (float)-i;
  *(int64_t *)bufs[1] = i;
  *(uint8_t *)bufs[2] = (uint8_t)(i * 7);
  return KILN_OK;
}

static kiln_dataset *user_dataset(my_ds *d) {
  kiln_dataset_vtable vt = {my_len, my_get, NULL};
  kiln_field_spec f[3] = {{KILN_F32, 1, {3}}, {KILN_I64, 0, {0}}, {KILN_U8, 0, {0}}};
  return kiln_dataset_new(&vt, d, 3, f);
}

/* The same samples as tensors; strided: x is the transpose of a (3, N) tensor. */
static kiln_dataset *tensor_dataset(bool strided) {
  float x[N * 3];
  int64_t y[N];
  uint8_t z[N];
  for (int i = 0; i < N; i++) {
    float v[3] = {(float)i, (float)i + 0.5f, (float)-i};
    for (int j = 0; j < 3; j++) x[strided ? j * N + i : i * 3 + j] = v[j];
    y[i] = i;
    z[i] = (uint8_t)(i * 7);
  }
  kiln_scope_begin();
  kiln_device cpu = kiln_device_cpu();
  kiln_tensor *tx = strided ? kiln_transpose(kiln_from_data(x, KILN_SHAPE(3, N), KILN_F32, cpu), 0, 1)
                            : kiln_from_data(x, KILN_SHAPE(N, 3), KILN_F32, cpu);
  kiln_tensor *ty = kiln_from_data(y, KILN_SHAPE(N), KILN_I64, cpu);
  kiln_tensor *tz = kiln_from_data(z, KILN_SHAPE(N), KILN_U8, cpu);
  kiln_dataset *ds = kiln_tensor_dataset_new(3, (kiln_tensor *[]){tx, ty, tz});
  kiln_scope_end();
  return ds;
}

/* collate: (x . (1, 3, 5) per sample (B) f64, y (B) i64, z (B) u8) made by hand; B <= 64 */
static kiln_status my_collate(void *user, int n, int nf, kiln_tensor *const *samples, kiln_tensor **out) {
  (void)user;
  double s[64];
  int64_t id[64];
  uint8_t z[64];
  for (int i = 0; i < n; i++) {
    kiln_tensor *x = samples[i * nf];
    s[i] = kiln_get(x, (int64_t[]){0}) + kiln_get(x, (int64_t[]){1}) * 3 + kiln_get(x, (int64_t[]){2}) * 5;
    id[i] = (int64_t)kiln_get(samples[i * nf + 1], NULL);
    z[i] = (uint8_t)kiln_get(samples[i * nf + 2], NULL);
  }
  out[0] = kiln_from_data(s, KILN_SHAPE(n), KILN_F64, kiln_device_cpu());
  out[1] = kiln_from_data(id, KILN_SHAPE(n), KILN_I64, kiln_device_cpu());
  out[2] = kiln_from_data(z, KILN_SHAPE(n), KILN_U8, kiln_device_cpu());
  return KILN_OK;
}

/* ---- an epoch as bytes: for each batch, each field's shape and contents (batch_record.h) ---- */
static void put_batch(record *r, kiln_tensor *const *b, int nf) {
  for (int f = 0; f < nf; f++) put_tensor(r, b[f]);
  r->batches++;
}

/* Whether a batch came by the staged path: its fields are views of one device block. */
static bool staged_batch(kiln_tensor *const *b, int nf) {
  for (int f = 0; f < nf; f++)
    if (b[f]->storage != b[0]->storage || !b[0]->storage->packed) return false;
  return true;
}

/* Runs one epoch of l into r; returns the number of staged batches, -1 on an error. */
static int run_epoch(kiln_loader *l, uint64_t epoch, record *r) {
  int nf = kiln_loader_num_fields(l), staged = 0;
  CHECK(kiln_loader_epoch(l, epoch) == KILN_OK);
  for (;;) {
    kiln_scope_begin();
    kiln_tensor *b[3];
    int rc = kiln_loader_next(l, b);
    if (rc == 1) {
      put_batch(r, b, nf);
      staged += staged_batch(b, nf);
    }
    kiln_scope_end();
    if (rc != 1) return rc == 0 ? staged : -1;
  }
}

static void test_same_batches(void) {
  my_ds ud = {-1};
  kiln_dataset *sets[4] = {tensor_dataset(false), user_dataset(&ud), tensor_dataset(true), NULL};
  sets[3] = sets[1]; /* the user dataset again, through a custom collate */
  static const char *names[4] = {"tensor", "user", "strided tensor", "collate"};
  int checked = 0;
  for (int d = 0; d < 4; d++) {
    CHECK(sets[d] != NULL);
    for (int shuffle = 0; shuffle < 2; shuffle++)
      for (int drop = 0; drop < 2; drop++)
        for (int w = 0; w < 3; w += 2) {
          kiln_loader_opts o = kiln_loader_opts_default();
          o.batch_size = 10;
          o.shuffle = shuffle;
          o.seed = 7;
          o.drop_last = drop;
          o.num_workers = w;
          if (d == 3) o.collate = my_collate;
          emulate(false, 0, 0, 0);
          kiln_loader *ref = kiln_loader_new(sets[d], &o);
          emulate(true, 150, 0, 0);
          kiln_loader *l = kiln_loader_new(sets[d], &o);
          emulate(false, 0, 0, 0);
          CHECK(ref && l && kiln_loader_len(l) == (drop ? 10 : 11));
          for (uint64_t e = 0; e < 3; e++) {
            record a = {0}, b = {0};
            int sa = run_epoch(ref, e, &a), sb = run_epoch(l, e, &b);
            CHECK(sa == 0);                      /* the reference copies as it always has */
            CHECK(sb == (drop ? 10 : 11));        /* every batch staged */
            CHECK(a.batches == b.batches && record_same(&a, &b));
            if (!record_same(&a, &b))
              fprintf(stderr, "  differs: %s dataset, shuffle %d, drop_last %d, workers %d, epoch %d\n",
                      names[d], shuffle, drop, w, (int)e);
            free(a.p);
            free(b.p);
            checked++;
          }
          kiln_loader_free(ref);
          kiln_loader_free(l);
        }
  }
  printf("same batches: %d epochs compared\n", checked);
  kiln_dataset_free(sets[0]);
  kiln_dataset_free(sets[1]);
  kiln_dataset_free(sets[2]);
}

/* The ids (field 1) of a batch. */
static int64_t ids_of(kiln_tensor *b1, int64_t *ids) {
  int64_t n = kiln_size(b1, 0);
  CHECK(kiln_to_host(b1, ids, sizeof(int64_t) * (size_t)n) == KILN_OK);
  return n;
}

static void test_hold_across_next(void) {
  kiln_dataset *ds = tensor_dataset(false);
  kiln_loader_opts o = kiln_loader_opts_default();
  o.batch_size = 10;
  o.shuffle = true;
  o.seed = 5;
  emulate(false, 0, 0, 0);
  kiln_loader *ref = kiln_loader_new(ds, &o);
  emulate(true, 300, 0, 0);
  kiln_loader *l = kiln_loader_new(ds, &o);
  emulate(false, 0, 0, 0);
  /* the reference order */
  int64_t want[N], got[10];
  int64_t k = 0;
  kiln_tensor *b[3];
  while (kiln_loader_next(ref, b) == 1) {
    k += ids_of(b[1], want + k);
    for (int f = 0; f < 3; f++) kiln_tensor_free(b[f]);
  }
  CHECK(k == N);
  /* keep batch 0 (no scope: ours) and one view of batch 1 while the epoch runs on */
  kiln_tensor *held[3], *view = NULL;
  CHECK(kiln_loader_next(l, held) == 1);
  kiln_scope_begin();
  CHECK(kiln_loader_next(l, b) == 1);
  view = kiln_keep(kiln_narrow(b[1], 0, 0, 5));
  kiln_scope_end();
  kiln__storage *seen[16];
  int n_seen = 0, r;
  int64_t at = 20;
  while (1) {
    kiln_scope_begin();
    r = kiln_loader_next(l, b);
    if (r == 1) {
      CHECK(b[0]->storage != held[0]->storage && b[0]->storage != view->storage);
      int64_t n = ids_of(b[1], got);
      CHECK(memcmp(got, want + at, sizeof(int64_t) * (size_t)n) == 0);
      at += n;
      bool known = false;
      for (int i = 0; i < n_seen; i++) known |= seen[i] == b[0]->storage;
      if (!known && n_seen < 16) seen[n_seen++] = b[0]->storage;
    }
    kiln_scope_end();
    if (r != 1) break;
    /* the held batches still hold what they held */
    CHECK(ids_of(held[1], got) == 10 && memcmp(got, want, sizeof(int64_t) * 10) == 0);
    CHECK(ids_of(view, got) == 5 && memcmp(got, want + 10, sizeof(int64_t) * 5) == 0);
  }
  CHECK(r == 0 && at == N);
  /* 9 batches released one by one, each before the next call: a few blocks go round */
  CHECK(n_seen >= 2 && n_seen <= 4);
  printf("hold: 9 batches in %d device blocks besides the 2 held\n", n_seen);
  kiln_loader_free(l); /* batches already delivered stay valid */
  CHECK(ids_of(held[1], got) == 10 && memcmp(got, want, sizeof(int64_t) * 10) == 0);
  CHECK(kiln_get(held[0], (int64_t[]){3, 2}) == (double)-want[3]);
  for (int f = 0; f < 3; f++) kiln_tensor_free(held[f]);
  kiln_tensor_free(view);
  kiln_loader_free(ref);
  kiln_dataset_free(ds);
}

static void test_early_stop(void) {
  my_ds ud = {-1};
  kiln_dataset *ds = user_dataset(&ud);
  for (int w = 0; w < 3; w += 2) {
    kiln_loader_opts o = kiln_loader_opts_default();
    o.batch_size = 4;
    o.shuffle = true;
    o.num_workers = w;
    emulate(true, 2000, 0, 0); /* copies still queued when the loader goes */
    kiln_loader *l = kiln_loader_new(ds, &o);
    emulate(false, 0, 0, 0);
    kiln_tensor *b[3];
    CHECK(kiln_loader_next(l, b) == 1); /* ours: no scope */
    kiln_loader_free(l);
    CHECK(kiln_size(b[0], 0) == 4 && kiln_get(b[0], (int64_t[]){1, 2}) == -kiln_get(b[1], (int64_t[]){1}));
    for (int f = 0; f < 3; f++) kiln_tensor_free(b[f]);
    /* a new epoch mid-epoch, twice, then free without reading */
    emulate(true, 500, 0, 0);
    l = kiln_loader_new(ds, &o);
    emulate(false, 0, 0, 0);
    kiln_scope_begin();
    CHECK(kiln_loader_next(l, b) == 1 && kiln_loader_next(l, b) == 1);
    kiln_scope_end();
    CHECK(kiln_loader_epoch(l, 1) == KILN_OK);
    record a = {0};
    CHECK(run_epoch(l, 2, &a) == 26 && a.batches == 26);
    free(a.p);
    CHECK(kiln_loader_epoch(l, 3) == KILN_OK);
    kiln_loader_free(l);
  }
  /* never started */
  emulate(true, 0, 0, 0);
  kiln_loader_free(kiln_loader_new(ds, NULL));
  emulate(false, 0, 0, 0);
  kiln_dataset_free(ds);
}

/* Runs up to 6 calls of next (each in a scope) and writes their results. */
static int results(kiln_loader *l, int *res, kiln_status *err, char msg[][256]) {
  int k = 0;
  kiln_tensor *b[3];
  for (;;) {
    kiln_scope_begin();
    int r = kiln_loader_next(l, b);
    err[k] = r < 0 ? kiln_last_error() : KILN_OK;
    snprintf(msg[k], 256, "%s", r < 0 ? kiln_last_error_message() : "");
    kiln_scope_end();
    res[k++] = r;
    if (r == 0 || k == 6) return k;
  }
}

static void test_errors(void) {
  my_ds ud = {-1};
  kiln_dataset *ds = user_dataset(&ud);
  kiln_loader_opts o = kiln_loader_opts_default();
  o.batch_size = 25; /* 5 batches, the last of 3 */
  int res[6], k;
  kiln_status err[6];
  char msg[6][256];
  for (int w = 0; w < 3; w += 2) {
    o.num_workers = w;
    /* the first pinned block cannot be had: batch 0 fails, the rest come */
    emulate(true, 100, 1, 0);
    kiln_loader *l = kiln_loader_new(ds, &o);
    emulate(false, 0, 0, 0);
    k = results(l, res, err, msg);
    int failed = -1, ok = 0; /* with two builders, either may be first to ask */
    for (int i = 0; i < 5; i++) {
      if (res[i] == -1) failed = i;
      ok += res[i] == 1;
    }
    CHECK(k == 6 && ok == 4 && failed >= 0 && res[5] == 0 && (w > 0 || failed == 0));
    CHECK(failed >= 0 && err[failed] == KILN_ERR_OOM && strstr(msg[failed], "cannot be staged") &&
          strstr(msg[failed], "pin"));
    kiln_loader_free(l);
    /* the first device block cannot be had: next reports it, the epoch goes on */
    emulate(true, 100, 0, 1);
    l = kiln_loader_new(ds, &o);
    emulate(false, 0, 0, 0);
    k = results(l, res, err, msg);
    CHECK(k == 6 && res[0] == -1 && res[1] == 1 && res[4] == 1 && res[5] == 0);
    CHECK(err[0] == KILN_ERR_OOM && strstr(msg[0], "emulated device"));
    kiln_loader_free(l);
    /* the next batch's block fails while its copy is issued ahead: that batch's own call
    ** tries again (a new allocation) and succeeds; nothing is reported early */
    emulate(true, 100, 0, 2);
    l = kiln_loader_new(ds, &o);
    emulate(false, 0, 0, 0);
    k = results(l, res, err, msg);
    CHECK(k == 6 && res[0] == 1 && res[1] == 1 && res[2] == 1 && res[5] == 0);
    kiln_loader_free(l);
  }
  /* the dataset's error: that batch fails, in order, and the epoch goes on */
  ud.bad = 30; /* batch 1 */
  for (int w = 0; w < 3; w += 2) {
    o.num_workers = w;
    emulate(true, 100, 0, 0);
    kiln_loader *l = kiln_loader_new(ds, &o);
    emulate(false, 0, 0, 0);
    k = results(l, res, err, msg);
    CHECK(k == 6 && res[0] == 1 && res[1] == -1 && res[2] == 1 && res[4] == 1 && res[5] == 0);
    CHECK(err[1] == KILN_ERR_INDEX && strstr(msg[1], "sample 30 is broken"));
    kiln_loader_free(l);
  }
  kiln_dataset_free(ds);
}

/* A collate whose output needs grad is delivered as built (not staged), as before. */
static kiln_status grad_collate(void *user, int n, int nf, kiln_tensor *const *samples, kiln_tensor **out) {
  kiln_status st = my_collate(user, n, nf, samples, out);
  if (st == KILN_OK) st = kiln_requires_grad_(out[0], true);
  return st;
}

static void test_unstaged_collate(void) {
  my_ds ud = {-1};
  kiln_dataset *ds = user_dataset(&ud);
  kiln_loader_opts o = kiln_loader_opts_default();
  o.batch_size = 50;
  o.collate = grad_collate;
  emulate(true, 0, 0, 0);
  kiln_loader *l = kiln_loader_new(ds, &o);
  emulate(false, 0, 0, 0);
  kiln_tensor *b[3];
  int n = 0, r;
  kiln_scope_begin();
  while ((r = kiln_loader_next(l, b)) == 1) {
    CHECK(kiln_requires_grad(b[0]) && !staged_batch(b, 3));
    n++;
  }
  kiln_scope_end();
  CHECK(r == 0 && n == 3);
  kiln_loader_free(l);
  kiln_dataset_free(ds);
}

/* collate: (arange of 1 + 10 * the first id (f32), the ids): each batch bigger than the
** last, so the builders outgrow their pinned blocks */
static kiln_status growing_collate(void *user, int n, int nf, kiln_tensor *const *samples, kiln_tensor **out) {
  (void)user;
  int64_t id[64];
  for (int i = 0; i < n; i++) id[i] = (int64_t)kiln_get(samples[i * nf + 1], NULL);
  out[0] = kiln_arange(0, (double)(1 + 10 * id[0]), 1, KILN_F32, kiln_device_cpu());
  out[1] = kiln_from_data(id, KILN_SHAPE(n), KILN_I64, kiln_device_cpu());
  return out[0] && out[1] ? KILN_OK : kiln_last_error();
}

static void test_growing_batches(void) {
  my_ds ud = {-1};
  kiln_dataset *ds = user_dataset(&ud);
  kiln_loader_opts o = kiln_loader_opts_default();
  o.batch_size = 10;
  o.collate = growing_collate;
  o.collate_n_out = 2;
  for (int w = 0; w < 3; w += 2) {
    o.num_workers = w;
    emulate(false, 0, 0, 0);
    kiln_loader *ref = kiln_loader_new(ds, &o);
    emulate(true, 100, 0, 0);
    kiln_loader *l = kiln_loader_new(ds, &o);
    emulate(false, 0, 0, 0);
    for (uint64_t e = 0; e < 2; e++) {
      record a = {0}, b = {0};
      CHECK(run_epoch(ref, e, &a) == 0 && run_epoch(l, e, &b) == 11);
      CHECK(record_same(&a, &b));
      free(a.p);
      free(b.p);
    }
    kiln_loader_free(ref);
    kiln_loader_free(l);
  }
  kiln_dataset_free(ds);
}

int main(void) {
  int64_t live0 = kiln_live_tensors();
  test_same_batches();
  test_hold_across_next();
  test_early_stop();
  test_errors();
  test_unstaged_collate();
  test_growing_batches();
  CHECK(kiln_live_tensors() == live0);
  return check_finish("test_data_loader_async");
}
