/*
** .npy: kiln reads numpy's files exactly (every dtype kiln holds, 0-dim, size-0, Fortran
** order in 2 and 3 dims, format versions 1.0/2.0/3.0), refuses big-endian and dtypes it
** lacks with clear errors, round-trips its own files (strided tensors written in C order),
** and survives every truncation and bit flip of a fixture.
*/
#define _POSIX_C_SOURCE 200809L
#include "scratch.h"
#include <kiln.h>
#include <kiln_io.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "fixture.h"

static char g_tmp[256];

static int same(kiln_tensor *t, kiln_dtype dt, int nd, const int64_t *shape, const void *bytes) {
  if (!t) return 0;
  if (kiln_dtype_of(t) != dt || kiln_ndim(t) != nd) return 0;
  for (int i = 0; i < nd; i++)
    if (kiln_size(t, i) != shape[i]) return 0;
  if (!kiln_is_contiguous(t)) return 0;
  size_t nb = kiln_nbytes(t);
  unsigned char *buf = malloc(nb + 1);
  int ok = kiln_to_host(t, buf, nb) == KILN_OK && memcmp(buf, bytes, nb) == 0;
  free(buf);
  return ok;
}

static void test_numpy_files(void) {
  kiln_device cpu = kiln_device_cpu();
  kiln_scope_begin();
  float a[6];
  for (int i = 0; i < 6; i++) a[i] = (float)i * 0.5f - 1.25f;
  double b[3];
  for (int i = 0; i < 3; i++) b[i] = (i + 1) / 3.0;
  const uint16_t c[4] = {0xB800, 0xB400, 0x0000, 0x3400};
  const int64_t e[4] = {-(INT64_C(1) << 40), -1, 0, INT64_C(1) << 62};
  const int32_t f[3] = {-7, 0, 2147483647};
  const uint8_t g[5] = {0, 1, 127, 128, 255};
  const uint8_t h[3] = {1, 0, 1};
  const double s = 2.5;
  CHECK(same(kiln_npy_load(fixture("f4.npy"), cpu), KILN_F32, 2, (int64_t[]){2, 3}, a));
  CHECK(same(kiln_npy_load(fixture("v2.npy"), cpu), KILN_F32, 2, (int64_t[]){2, 3}, a));
  CHECK(same(kiln_npy_load(fixture("v3.npy"), cpu), KILN_F32, 2, (int64_t[]){2, 3}, a));
  CHECK(same(kiln_npy_load(fixture("f8.npy"), cpu), KILN_F64, 1, (int64_t[]){3}, b));
  CHECK(same(kiln_npy_load(fixture("f2.npy"), cpu), KILN_F16, 2, (int64_t[]){2, 2}, c));
  CHECK(same(kiln_npy_load(fixture("i8.npy"), cpu), KILN_I64, 2, (int64_t[]){2, 2}, e));
  CHECK(same(kiln_npy_load(fixture("i4.npy"), cpu), KILN_I32, 1, (int64_t[]){3}, f));
  CHECK(same(kiln_npy_load(fixture("u1.npy"), cpu), KILN_U8, 1, (int64_t[]){5}, g));
  CHECK(same(kiln_npy_load(fixture("b1.npy"), cpu), KILN_BOOL, 1, (int64_t[]){3}, h));
  CHECK(same(kiln_npy_load(fixture("scalar.npy"), cpu), KILN_F64, 0, NULL, &s));
  CHECK(same(kiln_npy_load(fixture("empty.npy"), cpu), KILN_F32, 2, (int64_t[]){0, 3}, ""));
  /* Fortran order: the logical array is arange in C order either way */
  float f2[12];
  for (int i = 0; i < 12; i++) f2[i] = (float)i;
  int32_t f3[24];
  for (int i = 0; i < 24; i++) f3[i] = i;
  CHECK(same(kiln_npy_load(fixture("fortran2.npy"), cpu), KILN_F32, 2, (int64_t[]){3, 4}, f2));
  CHECK(same(kiln_npy_load(fixture("fortran3.npy"), cpu), KILN_I32, 3, (int64_t[]){2, 3, 4}, f3));

  CHECK(kiln_npy_load(fixture("big_endian.npy"), cpu) == NULL && kiln_last_error() == KILN_ERR_FORMAT &&
        strstr(kiln_last_error_message(), "big-endian"));
  CHECK(kiln_npy_load(fixture("int16.npy"), cpu) == NULL && kiln_last_error() == KILN_ERR_DTYPE &&
        strstr(kiln_last_error_message(), "i2"));
  CHECK(kiln_npy_load("/nonexistent.npy", cpu) == NULL && kiln_last_error() == KILN_ERR_IO);
  CHECK(kiln_npy_load(NULL, cpu) == NULL && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT);
  kiln_scope_end();
}

static void test_round_trip(void) {
  kiln_device cpu = kiln_device_cpu();
  char p[300];
  snprintf(p, sizeof p, "%s/rt.npy", g_tmp);
  kiln_scope_begin();
  float v[6] = {0, 1, 2, 3, 4, 5};
  kiln_tensor *m = kiln_from_data(v, KILN_SHAPE(2, 3), KILN_F32, cpu);
  CHECK(kiln_npy_save(p, m) == KILN_OK);
  CHECK(same(kiln_npy_load(p, cpu), KILN_F32, 2, (int64_t[]){2, 3}, v));
  size_t n;
  unsigned char *b = read_all(p, &n);
  CHECK(b && (n - 24) % 64 == 0); /* data starts 64-aligned */
  free(b);
  CHECK(kiln_npy_save(p, kiln_transpose(m, 0, 1)) == KILN_OK); /* strided -> C order */
  const float vt[6] = {0, 3, 1, 4, 2, 5};
  CHECK(same(kiln_npy_load(p, cpu), KILN_F32, 2, (int64_t[]){3, 2}, vt));
  int64_t iv[3] = {5, -6, 7};
  CHECK(kiln_npy_save(p, kiln_from_data(iv, KILN_SHAPE(3), KILN_I64, cpu)) == KILN_OK);
  CHECK(same(kiln_npy_load(p, cpu), KILN_I64, 1, (int64_t[]){3}, iv));
  double sv = -1.5;
  CHECK(kiln_npy_save(p, kiln_from_data(&sv, KILN_SHAPE0, KILN_F64, cpu)) == KILN_OK);
  CHECK(same(kiln_npy_load(p, cpu), KILN_F64, 0, NULL, &sv));
  CHECK(kiln_npy_save(p, kiln_zeros(KILN_SHAPE(0, 4), KILN_U8, cpu)) == KILN_OK);
  CHECK(same(kiln_npy_load(p, cpu), KILN_U8, 2, (int64_t[]){0, 4}, ""));
  uint8_t bv[4] = {1, 0, 0, 1};
  CHECK(kiln_npy_save(p, kiln_from_data(bv, KILN_SHAPE(2, 2), KILN_BOOL, cpu)) == KILN_OK);
  CHECK(same(kiln_npy_load(p, cpu), KILN_BOOL, 2, (int64_t[]){2, 2}, bv));
  CHECK(kiln_npy_save(p, kiln_zeros(KILN_SHAPE(2), KILN_BF16, cpu)) == KILN_ERR_DTYPE);
  CHECK(kiln_npy_save(NULL, m) == KILN_ERR_INVALID_ARGUMENT);
  CHECK(kiln_npy_save("/nonexistent/dir/x.npy", m) == KILN_ERR_IO);
  if (system("python3 -c 'import numpy' >/dev/null 2>&1") == 0) {
    CHECK(kiln_npy_save(p, kiln_from_data(v, KILN_SHAPE(1, 2, 3), KILN_F32, cpu)) == KILN_OK);
    char cmd[600];
    snprintf(cmd, sizeof cmd,
             "python3 -c \"import numpy as np; a = np.load('%s'); "
             "assert a.dtype == np.float32 and a.shape == (1, 2, 3) and "
             "(a.ravel() == np.arange(6)).all()\"", p);
    int rc = system(cmd);
    CHECK(rc == 0);
    printf("numpy opens kiln's file: %s\n", rc == 0 ? "ok" : "FAILED");
  } else {
    printf("numpy opens kiln's file: skipped (no numpy)\n");
  }
  kiln_scope_end();
}

static void test_crafted(void) {
  char p[300];
  snprintf(p, sizeof p, "%s/c.npy", g_tmp);
  struct {
    const char *hdr;
    size_t ndata;
    kiln_status code;
    const char *needle;
  } cases[] = {
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }", 8, KILN_OK, ""},
      {"{\"descr\": \"<f4\", \"fortran_order\": False, \"shape\": (2,)}", 8, KILN_OK, ""},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }", 8, KILN_ERR_FORMAT, "truncated"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }", 8, KILN_ERR_FORMAT, "trailing"},
      {"{'descr': '<f4', 'shape': (2,), }", 8, KILN_ERR_FORMAT, "fortran_order"},
      {"{'descr': '<f4', 'fortran_order': Maybe, 'shape': (2,), }", 8, KILN_ERR_FORMAT, "syntax"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (-2,), }", 8, KILN_ERR_FORMAT, "syntax"},
      {"{'descr': '<c8', 'fortran_order': False, 'shape': (1,), }", 8, KILN_ERR_DTYPE, "c8"},
      {"{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (1,), }", 4, KILN_ERR_DTYPE, "structured"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'x': 1}", 8, KILN_ERR_FORMAT, "unknown header key"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (1,1,1,1,1,1,1,1,1), }", 4, KILN_ERR_SHAPE, "dims"},
      /* issue 17.1: no elements, but the other dims' product passes 2^63 (strides overflow) */
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (0, 281474976710656, 281474976710656), }", 0,
       KILN_ERR_SHAPE, "too large"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (281474976710656, 0, 65536), }", 0,
       KILN_ERR_SHAPE, "too large"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (0, 65536, 65536), }", 0, KILN_OK, ""},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    size_t hl = strlen(cases[i].hdr);
    unsigned char *b = calloc(10 + hl + cases[i].ndata, 1);
    memcpy(b, "\x93NUMPY\x01\x00", 8);
    b[8] = (unsigned char)hl;
    b[9] = (unsigned char)(hl >> 8);
    memcpy(b + 10, cases[i].hdr, hl);
    write_all(p, b, 10 + hl + cases[i].ndata);
    free(b);
    kiln_clear_error();
    kiln_tensor *t = kiln_npy_load(p, kiln_device_cpu());
    int ok = cases[i].code == KILN_OK ? t != NULL
                                      : t == NULL && kiln_last_error() == cases[i].code &&
                                            strstr(kiln_last_error_message(), cases[i].needle);
    if (!ok)
      fprintf(stderr, "case %zu (%s): got %s \"%s\"\n", i, cases[i].hdr,
              kiln_error_name(kiln_last_error()), kiln_last_error_message());
    CHECK(ok);
    kiln_tensor_free(t);
  }
  write_all(p, "\x93NUMPY\x04\x00\x00\x00", 10);
  CHECK(kiln_npy_load(p, kiln_device_cpu()) == NULL && kiln_last_error() == KILN_ERR_FORMAT &&
        strstr(kiln_last_error_message(), "version 4.0"));
  write_all(p, "PK\x03\x04", 4);
  CHECK(kiln_npy_load(p, kiln_device_cpu()) == NULL && kiln_last_error() == KILN_ERR_FORMAT &&
        strstr(kiln_last_error_message(), "magic"));
}

static void test_fuzz(void) {
  const char *names[] = {"f4.npy", "fortran3.npy", "v2.npy"};
  char p[300];
  snprintf(p, sizeof p, "%s/fuzz.npy", g_tmp);
  int bad = 0, loaded = 0, total = 0;
  int64_t live0 = kiln_live_tensors();
  for (int k = 0; k < 3; k++) {
    size_t n;
    unsigned char *orig = read_all(fixture(names[k]), &n);
    CHECK(orig != NULL);
    if (!orig) continue;
    unsigned char *b = malloc(n);
    for (size_t len = 0; len < n; len++) {
      write_all(p, orig, len);
      kiln_tensor *t = kiln_npy_load(p, kiln_device_cpu());
      if (t || kiln_last_error() != KILN_ERR_FORMAT) {
        bad++;
        fprintf(stderr, "%s truncated to %zu: %s\n", names[k], len, kiln_last_error_message());
      }
      kiln_tensor_free(t);
      total++;
    }
    for (size_t i = 0; i < n; i++)
      for (int bit = 0; bit < 8; bit++) {
        memcpy(b, orig, n);
        b[i] ^= (unsigned char)(1u << bit);
        write_all(p, b, n);
        kiln_clear_error();
        kiln_tensor *t = kiln_npy_load(p, kiln_device_cpu());
        kiln_status st = kiln_last_error();
        if (t) loaded++;
        else if (st != KILN_ERR_FORMAT && st != KILN_ERR_DTYPE && st != KILN_ERR_SHAPE) {
          bad++;
          fprintf(stderr, "%s flip %zu.%d: %s %s\n", names[k], i, bit, kiln_error_name(st),
                  kiln_last_error_message());
        }
        kiln_tensor_free(t);
        total++;
      }
    free(b);
    free(orig);
  }
  CHECK(bad == 0);
  CHECK(kiln_live_tensors() == live0);
  printf("fuzz: %d damaged files, %d still valid\n", total, loaded);
}

int main(void) {
  if (scratch_begin(g_tmp, sizeof g_tmp, "npy") != 0) return 1;
  int64_t live0 = kiln_live_tensors();
  test_numpy_files();
  test_round_trip();
  test_crafted();
  test_fuzz();
  CHECK(kiln_live_tensors() == live0);
  scratch_end(g_tmp);
  return check_finish("test_io_npy");
}
