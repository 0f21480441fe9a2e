/*
** Printing matches PyTorch's repr (torch 2.x, default print options: precision 4,
** threshold 1000, edgeitems 3, linewidth 80). The dtype suffix is accepted as either
** "dtype=int32" or PyTorch's "dtype=torch.int32".
*/
#define _POSIX_C_SOURCE 200809L
#include "harness.h"

#include <stdlib.h>
#include <string.h>

static kiln_device cpu;

/* The printed text with any "torch." removed. */
static char *printed(kiln_tensor *t) {
  int n = kiln_snprint(NULL, 0, t);
  if (n < 0) return NULL;
  char *buf = malloc((size_t)n + 1);
  int m = kiln_snprint(buf, (size_t)n + 1, t);
  if (m != n) {
    free(buf);
    return NULL;
  }
  char *p;
  while ((p = strstr(buf, "torch.")) != NULL) memmove(p, p + 6, strlen(p + 6) + 1);
  return buf;
}

static void expect(const char *what, kiln_tensor *t, const char *want) {
  char *got = t ? printed(t) : NULL;
  H_CHECK(got && strcmp(got, want) == 0, "print %s:\n--- got\n%s\n--- want\n%s", what,
          got ? got : "(null)", want);
  free(got);
}

int main(int argc, char **argv) {
  h_init(argc, argv, "test_print");
  cpu = kiln_device_cpu();
  if (h_cross_only()) return h_finish();
  kiln_scope_begin();
  expect("2x2 f32", H_T(KILN_SHAPE(2, 2), KILN_F32, 1.5, 2, 3.25, 4),
         "tensor([[1.5000, 2.0000],\n        [3.2500, 4.0000]])");
  kiln_tensor *ints = H_T(KILN_SHAPE(2, 2), KILN_F32, 1, 2, 3, 4);
  expect("integer-valued f32", ints, "tensor([[1., 2.],\n        [3., 4.]])");
  expect("transposed view", kiln_transpose(ints, 0, 1), "tensor([[1., 3.],\n        [2., 4.]])");
  expect("int64", H_T(KILN_SHAPE(3), KILN_I64, 1, 2, 3), "tensor([1, 2, 3])");
  expect("int32", H_T(KILN_SHAPE(3), KILN_I32, 1, -20, 3), "tensor([  1, -20,   3], dtype=int32)");
  expect("uint8", H_T(KILN_SHAPE(2), KILN_U8, 1, 255), "tensor([  1, 255], dtype=uint8)");
  expect("bool", H_T(KILN_SHAPE(3), KILN_BOOL, 1, 0, 1), "tensor([ True, False,  True])");
  expect("0-dim", kiln_scalar(3.5, KILN_F32, cpu), "tensor(3.5000)");
  expect("0-dim int", kiln_scalar(7, KILN_I64, cpu), "tensor(7)");
  expect("float64", H_T(KILN_SHAPE(1), KILN_F64, 1.5), "tensor([1.5000], dtype=float64)");
  expect("float16", H_T(KILN_SHAPE(1), KILN_F16, 0.5), "tensor([0.5000], dtype=float16)");
  expect("bfloat16", H_T(KILN_SHAPE(2), KILN_BF16, 1, 2), "tensor([1., 2.], dtype=bfloat16)");
  expect("negative", H_T(KILN_SHAPE(2), KILN_F32, -1.5, 2), "tensor([-1.5000,  2.0000])");
  expect("scientific", H_T(KILN_SHAPE(2), KILN_F32, 1e-5, 1), "tensor([1.0000e-05, 1.0000e+00])");
  expect("wide range", H_T(KILN_SHAPE(2), KILN_F32, 12345.678, 1),
         "tensor([1.2346e+04, 1.0000e+00])");
  expect("nan and inf", H_T(KILN_SHAPE(3), KILN_F32, NAN, 1.5, INFINITY),
         "tensor([   nan, 1.5000,    inf])");
  expect("empty", kiln_zeros(KILN_SHAPE(0), KILN_F32, cpu), "tensor([])");
  expect("3-d", kiln_reshape(kiln_arange(1, 9, 1, KILN_F32, cpu), KILN_SHAPE(2, 2, 2)),
         "tensor([[[1., 2.],\n         [3., 4.]],\n\n        [[5., 6.],\n         [7., 8.]]])");
  expect("summarised 1-d", kiln_arange(0, 2000, 1, KILN_F32, cpu),
         "tensor([   0.,    1.,    2.,  ..., 1997., 1998., 1999.])");
  expect("summarised 2-d", kiln_zeros(KILN_SHAPE(100, 100), KILN_F32, cpu),
         "tensor([[0., 0., 0.,  ..., 0., 0., 0.],\n"
         "        [0., 0., 0.,  ..., 0., 0., 0.],\n"
         "        [0., 0., 0.,  ..., 0., 0., 0.],\n"
         "        ...,\n"
         "        [0., 0., 0.,  ..., 0., 0., 0.],\n"
         "        [0., 0., 0.,  ..., 0., 0., 0.],\n"
         "        [0., 0., 0.,  ..., 0., 0., 0.]])");
  expect("summarised int64", kiln_arange(0, 5000, 1, KILN_I64, cpu),
         "tensor([   0,    1,    2,  ..., 4997, 4998, 4999])");

  /* snprint: returns the length it needs, truncates and terminates */
  kiln_tensor *t = H_T(KILN_SHAPE(2), KILN_F32, 1.5, 2);
  char small[10];
  int need = kiln_snprint(small, sizeof small, t);
  H_CHECK(need == (int)strlen("tensor([1.5000, 2.0000])") && strlen(small) == 9 &&
              strncmp(small, "tensor([1", 9) == 0,
          "snprint into 10 bytes: needs %d, holds \"%s\"", need, small);
  H_CHECK(kiln_snprint(small, sizeof small, NULL) == -1 || kiln_snprint(small, sizeof small, NULL) > 0,
          "snprint of NULL does not crash");
  kiln_clear_error();
  /* fprint writes the same text */
  FILE *f = tmpfile();
  if (H_CHECK(f != NULL, "tmpfile")) {
    H_CHECK(kiln_fprint(f, t) == KILN_OK, "fprint");
    rewind(f);
    char line[128] = {0};
    size_t n = fread(line, 1, sizeof line - 1, f);
    line[n] = 0;
    H_CHECK(strncmp(line, "tensor([1.5000, 2.0000])", 24) == 0, "fprint text \"%s\"", line);
    fclose(f);
  }
  kiln_scope_end();
  return h_finish();
}
