/*
** The loader delivering to cuda:0: batches of a CPU tensor dataset arrive on the GPU with
** the same values and order as on the CPU, for num_workers 0 and 2; a tensor dataset that
** lives on the GPU is gathered there (index_select on the device). Staged copies (pinned
** blocks, a side copy stream): bit for bit the CPU loader's batches over several epochs,
** shuffle and drop_last both ways, tensor, user and strided datasets and a collate; a
** kernel queued right after kiln_loader_next sees the whole batch (the compute stream
** waited for the copy); a batch kept across calls is not overwritten; kiln_loader_next
** and kiln_loader_epoch inside a graph capture are KILN_ERR_STATE and take nothing. It
** prints the host time of a kiln_loader_next call. Skipped (77) without a working CUDA
** device.
*/
#define _POSIX_C_SOURCE 200809L
#include <kiln.h>
#include <kiln_data.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/kiln_int.h"
#include "batch_record.h"
#include "check.h"

#define N 50

/* One epoch of (x (B, 3) f32, y (B) i64) batches: y in order into ids, checks x == y * 3 + j
** and that every batch is on dev. */
static int run(kiln_dataset *ds, int workers, kiln_device dev, int64_t *ids) {
  kiln_loader_opts o = kiln_loader_opts_default();
  o.batch_size = 8;
  o.shuffle = true;
  o.seed = 11;
  o.num_workers = workers;
  o.device = dev;
  kiln_loader *l = kiln_loader_new(ds, &o);
  if (!l) return -1;
  CHECK(kiln_loader_epoch(l, 0) == KILN_OK);
  int k = 0, r;
  kiln_tensor *b[2];
  for (;;) {
    kiln_scope_begin();
    r = kiln_loader_next(l, b);
    if (r == 1) {
      CHECK(kiln_device_equal(kiln_device_of(b[0]), dev) && kiln_device_equal(kiln_device_of(b[1]), dev));
      int64_t bs = kiln_size(b[1], 0);
      float x[8 * 3];
      int64_t y[8];
      CHECK(kiln_to_host(b[0], x, sizeof x) == KILN_OK && kiln_to_host(b[1], y, sizeof y) == KILN_OK);
      for (int64_t i = 0; i < bs; i++) {
        for (int j = 0; j < 3; j++) CHECK(x[i * 3 + j] == (float)(y[i] * 3 + j));
        ids[k++] = y[i];
      }
    }
    kiln_scope_end();
    if (r != 1) break;
  }
  kiln_loader_free(l);
  CHECK(r == 0 && k == N);
  return k;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- an epoch as bytes: for each batch, each field's shape and contents (batch_record.h) ---- */

/* Records the batch through a kernel queued at once (a copy on the device): it must see
** the whole batch, so the compute stream must have waited for the side stream's copy. */
static void put_batch(record *r, kiln_tensor *const *b, int nf) {
  bool staged = true;
  for (int f = 0; f < nf; f++) {
    staged &= b[f]->storage == b[0]->storage && b[0]->storage->packed;
    put_tensor(r, kiln_clone(b[f]));
  }
  r->batches++;
  r->staged += staged && kiln_device_of(b[0]).type == KILN_DEVICE_CUDA;
}

static void run_epoch(kiln_loader *l, uint64_t epoch, record *r) {
  int nf = kiln_loader_num_fields(l), rc;
  CHECK(kiln_loader_epoch(l, epoch) == KILN_OK);
  kiln_tensor *b[3];
  do {
    kiln_scope_begin();
    if ((rc = kiln_loader_next(l, b)) == 1) put_batch(r, b, nf);
    kiln_scope_end();
  } while (rc == 1);
  CHECK(rc == 0);
}

/* Samples: x f32 (W) = i * 1000 + j (+ 0.25), y i64 = i, z u8 = i * 7. */
#define BIG_N 1000
#define W 300
static int64_t user_len(void *self) {
  (void)self;
  return BIG_N;
}
static kiln_status user_get(void *self, int64_t i, void *const *bufs) {
  (void)self;
  for (int j = 0; j < W; j++) ((float *)bufs[0])[j] = (float)(i * 1000 + j) + 0.25f;
  *(int64_t *)bufs[1] = i;
  *(uint8_t *)bufs[2] = (uint8_t)(i * 7);
  return KILN_OK;
}
static kiln_status sum_collate(void *user, int n, int nf, kiln_tensor *const *samples, kiln_tensor **out) {
  (void)user;
  kiln_tensor *x[128], *y[128], *z[128];
  for (int i = 0; i < n; i++) x[i] = samples[i * nf], y[i] = samples[i * nf + 1], z[i] = samples[i * nf + 2];
  out[0] = kiln_mul_scalar(kiln_stack(n, x, 0), 2.0);
  out[1] = kiln_stack(n, y, 0);
  out[2] = kiln_stack(n, z, 0);
  return out[0] && out[1] && out[2] ? KILN_OK : kiln_last_error();
}

static kiln_dataset *big_tensor_dataset(bool strided) {
  float *x = malloc(sizeof(float) * BIG_N * W);
  int64_t y[BIG_N];
  uint8_t z[BIG_N];
  for (int i = 0; i < BIG_N; i++) {
    for (int j = 0; j < W; j++) x[strided ? j * BIG_N + i : i * W + j] = (float)(i * 1000 + j) + 0.25f;
    y[i] = i;
    z[i] = (uint8_t)(i * 7);
  }
  kiln_device cpu = kiln_device_cpu();
  kiln_scope_begin();
  kiln_tensor *tx = strided ? kiln_transpose(kiln_from_data(x, KILN_SHAPE(W, BIG_N), KILN_F32, cpu), 0, 1)
                            : kiln_from_data(x, KILN_SHAPE(BIG_N, W), KILN_F32, cpu);
  kiln_dataset *ds = kiln_tensor_dataset_new(
      3, (kiln_tensor *[]){tx, kiln_from_data(y, KILN_SHAPE(BIG_N), KILN_I64, cpu),
                           kiln_from_data(z, KILN_SHAPE(BIG_N), KILN_U8, cpu)});
  kiln_scope_end();
  free(x);
  return ds;
}

static void test_staged_same_batches(kiln_device gpu) {
  kiln_dataset_vtable vt = {user_len, user_get, NULL};
  kiln_field_spec f[3] = {{KILN_F32, 1, {W}}, {KILN_I64, 0, {0}}, {KILN_U8, 0, {0}}};
  kiln_dataset *sets[4] = {big_tensor_dataset(false), kiln_dataset_new(&vt, NULL, 3, f), big_tensor_dataset(true), NULL};
  sets[3] = sets[1];
  int compared = 0;
  for (int d = 0; d < 4; d++)
    for (int mode = 0; mode < 4; mode++)
      for (int w = 0; w < 3; w += 2) {
        kiln_loader_opts o = kiln_loader_opts_default();
        o.batch_size = 96; /* 10 full batches and one of 40 */
        o.shuffle = mode & 1;
        o.drop_last = mode & 2;
        o.seed = 3;
        o.num_workers = w;
        if (d == 3) o.collate = sum_collate;
        kiln_loader *ref = kiln_loader_new(sets[d], &o);
        o.device = gpu;
        kiln_loader *l = kiln_loader_new(sets[d], &o);
        CHECK(ref && l);
        for (uint64_t e = 0; e < 2; e++) {
          record a = {0}, b = {0};
          run_epoch(ref, e, &a);
          run_epoch(l, e, &b);
          CHECK(a.batches == (o.drop_last ? 10 : 11) && b.staged == a.batches);
          CHECK(record_same(&a, &b));
          if (!record_same(&a, &b))
            fprintf(stderr, "  differs: dataset %d, shuffle %d, drop_last %d, workers %d, epoch %d\n", d,
                    (int)o.shuffle, (int)o.drop_last, w, (int)e);
          free(a.p);
          free(b.p);
          compared++;
        }
        kiln_loader_free(ref);
        kiln_loader_free(l);
      }
  printf("staged: %d epochs the same as the CPU loader's\n", compared);
  kiln_dataset_free(sets[0]);
  kiln_dataset_free(sets[1]);
  kiln_dataset_free(sets[2]);
}

/* Whether two tensors (any devices) hold the same shape and bytes. */
static bool same_bytes(kiln_tensor *a, kiln_tensor *b) {
  size_t n = kiln_nbytes(a);
  if (kiln_ndim(a) != kiln_ndim(b) || kiln_nbytes(b) != n || kiln_dtype_of(a) != kiln_dtype_of(b)) return false;
  unsigned char *pa = malloc(n + 1), *pb = malloc(n + 1);
  bool same = kiln_to_host(a, pa, n) == KILN_OK && kiln_to_host(b, pb, n) == KILN_OK && memcmp(pa, pb, n) == 0;
  free(pa);
  free(pb);
  return same;
}

/* A batch kept across calls (and a view of another) while later batches are copied and
** used on the device; then the loader freed under them. */
static void test_staged_hold(kiln_device gpu) {
  kiln_dataset *ds = big_tensor_dataset(false);
  kiln_loader_opts o = kiln_loader_opts_default();
  o.batch_size = 100;
  o.shuffle = true;
  o.seed = 9;
  kiln_loader *ref = kiln_loader_new(ds, &o);
  o.device = gpu;
  kiln_loader *l = kiln_loader_new(ds, &o);
  kiln_tensor *want[2][3], *held[3], *b[3];
  CHECK(kiln_loader_next(ref, want[0]) == 1 && kiln_loader_next(ref, want[1]) == 1);
  CHECK(kiln_loader_next(l, held) == 1);
  kiln_scope_begin();
  CHECK(kiln_loader_next(l, b) == 1);
  kiln_tensor *view = kiln_keep(kiln_narrow(b[0], 0, 10, 50));
  kiln_scope_end();
  int n = 0, rc;
  do {
    kiln_scope_begin();
    if ((rc = kiln_loader_next(l, b)) == 1) {
      CHECK(b[0]->storage != held[0]->storage && b[0]->storage != view->storage);
      kiln_tensor *s = kiln_sum_all(kiln_mul_scalar(b[0], 0.5)); /* some work on the batch */
      CHECK(s != NULL);
      n++;
    }
    kiln_scope_end();
  } while (rc == 1);
  CHECK(rc == 0 && n == 8);
  kiln_loader_free(l); /* delivered batches stay valid */
  kiln_scope_begin();
  for (int f = 0; f < 3; f++) CHECK(same_bytes(held[f], want[0][f]));
  CHECK(same_bytes(view, kiln_narrow(want[1][0], 0, 10, 50)));
  kiln_scope_end();
  for (int f = 0; f < 3; f++) kiln_tensor_free(held[f]), kiln_tensor_free(want[0][f]), kiln_tensor_free(want[1][f]);
  kiln_tensor_free(view);
  kiln_loader_free(ref);
  kiln_dataset_free(ds);
}

/* Inside a capture the loader refuses and takes nothing; the batch comes after it. */
typedef struct capture_ctx {
  kiln_loader *l;
  int next_rc;
  kiln_status epoch_st;
} capture_ctx;

static kiln_status capture_step(void *p) {
  capture_ctx *c = p;
  kiln_tensor *b[3];
  c->next_rc = kiln_loader_next(c->l, b);
  kiln_status st = kiln_last_error();
  c->epoch_st = kiln_loader_epoch(c->l, 1);
  return c->next_rc < 0 ? kiln_set_error(st, "the loader refused: %s", "as it should") : KILN_OK;
}

static void test_staged_capture(kiln_device gpu) {
  kiln_dataset *ds = big_tensor_dataset(false);
  kiln_loader_opts o = kiln_loader_opts_default();
  o.batch_size = 100;
  o.device = gpu;
  capture_ctx c = {kiln_loader_new(ds, &o), 0, KILN_OK};
  kiln_tensor *b[3];
  kiln_scope_begin();
  CHECK(kiln_loader_next(c.l, b) == 1 && kiln_get(b[1], (int64_t[]){0}) == 0);
  kiln_scope_end();
  kiln_graph *g = kiln_graph_capture(gpu, capture_step, &c);
  CHECK(g == NULL && c.next_rc == -1 && c.epoch_st == KILN_ERR_STATE);
  kiln_graph_free(g);
  kiln_scope_begin();
  CHECK(kiln_loader_next(c.l, b) == 1 && kiln_get(b[1], (int64_t[]){0}) == 100); /* batch 1: nothing was taken */
  kiln_scope_end();
  kiln_loader_free(c.l);
  kiln_dataset_free(ds);
}

/* Host time of kiln_loader_next for the seed MLP's batch (128 x 64 f32, 128 i64), with a
** small step on each batch that reads the loss back (as training does). */
static void time_next(kiln_device gpu) {
  enum { NS = 20000, NF = 64 };
  kiln_scope_begin();
  kiln_tensor *x = kiln_randn(KILN_SHAPE(NS, NF), KILN_F32, kiln_device_cpu(), NULL);
  kiln_tensor *y = kiln_to_dtype(kiln_gt_scalar(kiln_sum(x, KILN_DIMS(1), false), 0.0), KILN_I64);
  kiln_tensor *wt = kiln_randn(KILN_SHAPE(NF, 128), KILN_F32, gpu, NULL);
  const char *names[3] = {"staged (host samples)", "host samples, workers 2", "samples on the GPU"};
  kiln_dataset *sets[3] = {kiln_tensor_dataset_new(2, (kiln_tensor *[]){x, y}), NULL,
                           kiln_tensor_dataset_new(2, (kiln_tensor *[]){kiln_to_device(x, gpu), kiln_to_device(y, gpu)})};
  sets[1] = sets[0];
  for (int k = 0; k < 3; k++) {
    kiln_loader_opts o = kiln_loader_opts_default();
    o.batch_size = 128;
    o.shuffle = true;
    o.device = gpu;
    o.num_workers = k == 1 ? 2 : 0;
    kiln_loader *l = kiln_loader_new(sets[k], &o);
    double t = 0, worst = 0;
    int n = 0, rc;
    for (uint64_t e = 0; e < 2; e++) {
      CHECK(kiln_loader_epoch(l, e) == KILN_OK);
      do {
        kiln_scope_begin();
        kiln_tensor *b[2];
        double t0 = now_s();
        rc = kiln_loader_next(l, b);
        double dt = now_s() - t0;
        if (rc == 1) {
          if (e > 0) t += dt, n++, worst = dt > worst ? dt : worst; /* the second epoch: warm */
          kiln_item(kiln_mean_all(kiln_relu(kiln_matmul(b[0], wt))));
        }
        kiln_scope_end();
      } while (rc == 1);
    }
    printf("kiln_loader_next, %s: %.1f us per call (max %.1f us, %d calls)\n", names[k], t / n * 1e6,
           worst * 1e6, n);
    kiln_loader_free(l);
  }
  kiln_dataset_free(sets[0]);
  kiln_dataset_free(sets[2]);
  kiln_scope_end();
}

int main(void) {
  const char *why = NULL;
  if (!kiln_backend_available(KILN_DEVICE_CUDA, &why) || kiln_device_count(KILN_DEVICE_CUDA) < 1) {
    printf("test_data_loader_cuda: skipped (%s)\n", why ? why : "no CUDA device");
    return 77;
  }
  kiln_device cpu = kiln_device_cpu(), gpu = kiln_device_cuda(0);
  float x[N * 3];
  int64_t y[N];
  for (int i = 0; i < N; i++) {
    y[i] = i;
    for (int j = 0; j < 3; j++) x[i * 3 + j] = (float)(i * 3 + j);
  }
  int64_t live0 = kiln_live_tensors();
  kiln_scope_begin();
  kiln_tensor *tx = kiln_from_data(x, KILN_SHAPE(N, 3), KILN_F32, cpu);
  kiln_tensor *ty = kiln_from_data(y, KILN_SHAPE(N), KILN_I64, cpu);
  kiln_dataset *host_ds = kiln_tensor_dataset_new(2, (kiln_tensor *[]){tx, ty});
  kiln_dataset *dev_ds =
      kiln_tensor_dataset_new(2, (kiln_tensor *[]){kiln_to_device(tx, gpu), kiln_to_device(ty, gpu)});
  kiln_scope_end();
  CHECK(host_ds && dev_ds);
  int64_t ref[N], got[N];
  CHECK(run(host_ds, 0, cpu, ref) == N);
  CHECK(run(host_ds, 0, gpu, got) == N && memcmp(ref, got, sizeof ref) == 0);
  CHECK(run(host_ds, 2, gpu, got) == N && memcmp(ref, got, sizeof ref) == 0);
  CHECK(run(dev_ds, 0, gpu, got) == N && memcmp(ref, got, sizeof ref) == 0);
  CHECK(run(dev_ds, 2, gpu, got) == N && memcmp(ref, got, sizeof ref) == 0);
  CHECK(run(dev_ds, 2, cpu, got) == N && memcmp(ref, got, sizeof ref) == 0);
  kiln_dataset_free(host_ds);
  kiln_dataset_free(dev_ds);
  test_staged_same_batches(gpu);
  test_staged_hold(gpu);
  test_staged_capture(gpu);
  time_next(gpu);
  CHECK(kiln_live_tensors() == live0);
  return check_finish("test_data_loader_cuda");
}
