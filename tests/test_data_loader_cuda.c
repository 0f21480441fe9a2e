/*
** The loader delivering to cuda:0: batches of a CPU tensor dataset arrive on the GPU with
** the same values and order as on the CPU, for num_workers 0 and 2; a tensor dataset that
** lives on the GPU is gathered there (index_select on the device). Skipped (77) without
** a working CUDA device.
*/
#define _POSIX_C_SOURCE 200809L
#include <kiln.h>
#include <kiln_data.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures;
#define CHECK(c)                                                                          \
  do {                                                                                    \
    if (!(c)) {                                                                           \
      fprintf(stderr, "%s:%d: CHECK(%s) failed; last error: %s\n", __FILE__, __LINE__, #c, \
              kiln_last_error_message());                                                 \
      failures++;                                                                         \
    }                                                                                     \
  } while (0)

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
  CHECK(kiln_live_tensors() == live0);
  if (failures) {
    fprintf(stderr, "test_data_loader_cuda: %d failures\n", failures);
    return 1;
  }
  printf("test_data_loader_cuda: ok\n");
  return 0;
}
