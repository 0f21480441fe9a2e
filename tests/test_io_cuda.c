/*
** io with a GPU: safetensors and .npy load straight onto cuda:0 with the values the CPU
** load gives, and a dict holding GPU tensors saves to the same bytes as its CPU copy.
** Skipped (77) without a working CUDA device.
*/
#define _POSIX_C_SOURCE 200809L
#include <kiln.h>
#include <kiln_io.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "fixture.h"

static int same_bytes(kiln_tensor *a, kiln_tensor *b) {
  if (!a || !b || kiln_nbytes(a) != kiln_nbytes(b) || kiln_dtype_of(a) != kiln_dtype_of(b)) return 0;
  size_t n = kiln_nbytes(a);
  unsigned char *x = malloc(n + 1), *y = malloc(n + 1);
  int ok = kiln_to_host(a, x, n) == KILN_OK && kiln_to_host(b, y, n) == KILN_OK && memcmp(x, y, n) == 0;
  free(x);
  free(y);
  return ok;
}

int main(void) {
  const char *why = NULL;
  if (!kiln_backend_available(KILN_DEVICE_CUDA, &why) || kiln_device_count(KILN_DEVICE_CUDA) < 1) {
    printf("test_io_cuda: skipped (%s)\n", why ? why : "no CUDA device");
    return 77;
  }
  kiln_device cpu = kiln_device_cpu(), gpu = kiln_device_cuda(0);
  int64_t live0 = kiln_live_tensors();
  kiln_dict *dc = kiln_safetensors_load(fixture("all_dtypes.safetensors"), cpu);
  kiln_dict *dg = kiln_safetensors_load(fixture("all_dtypes.safetensors"), gpu);
  CHECK(dc && dg && kiln_dict_size(dc) == kiln_dict_size(dg));
  for (int i = 0; dc && dg && i < kiln_dict_size(dc); i++) {
    kiln_tensor *g = kiln_dict_get(dg, kiln_dict_key(dc, i));
    CHECK(g && kiln_device_equal(kiln_device_of(g), gpu));
    CHECK(same_bytes(kiln_dict_value(dc, i), g));
  }
  char pc[256], pg[256];
  snprintf(pc, sizeof pc, "/tmp/kiln_io_cuda_%ld_c.safetensors", (long)getpid());
  snprintf(pg, sizeof pg, "/tmp/kiln_io_cuda_%ld_g.safetensors", (long)getpid());
  CHECK(kiln_safetensors_save(pc, dc) == KILN_OK && kiln_safetensors_save(pg, dg) == KILN_OK);
  size_t nc = 0, ng = 0;
  unsigned char *bc = read_all(pc, &nc), *bg = read_all(pg, &ng);
  CHECK(bc && bg && nc == ng && memcmp(bc, bg, nc) == 0);
  free(bc);
  free(bg);
  remove(pc);
  remove(pg);
  kiln_dict_free(dc);
  kiln_dict_free(dg);
  kiln_scope_begin();
  kiln_tensor *a = kiln_npy_load(fixture("fortran3.npy"), cpu);
  kiln_tensor *b = kiln_npy_load(fixture("fortran3.npy"), gpu);
  CHECK(b && kiln_device_equal(kiln_device_of(b), gpu) && same_bytes(a, b));
  snprintf(pg, sizeof pg, "/tmp/kiln_io_cuda_%ld.npy", (long)getpid());
  CHECK(kiln_npy_save(pg, kiln_transpose(b, 0, 2)) == KILN_OK); /* strided, on the GPU */
  kiln_tensor *c = kiln_npy_load(pg, cpu);
  CHECK(c && same_bytes(c, kiln_contiguous(kiln_transpose(a, 0, 2))));
  remove(pg);
  kiln_scope_end();
  CHECK(kiln_live_tensors() == live0);
  return check_finish("test_io_cuda");
}
