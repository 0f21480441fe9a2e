/*
** IDX: tiny files the test writes (every type byte, raw and gzip), errors with offsets,
** truncation/flip fuzz, and the real Fashion-MNIST files when installed (shapes, scaling,
** 6000 of each class in train and 1000 in test).
*/
#define _POSIX_C_SOURCE 200809L
#include "scratch.h"
#include <kiln.h>
#include <kiln_data.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zlib.h>

#include "check.h"

static char g_tmp[256];

static void write_raw(const char *path, const void *b, size_t n) {
  FILE *f = fopen(path, "wb");
  if (n) fwrite(b, 1, n, f);
  fclose(f);
}

static void write_gz(const char *path, const void *b, size_t n) {
  gzFile g = gzopen(path, "wb");
  if (n) gzwrite(g, b, (unsigned)n);
  gzclose(g);
}

/* An IDX image of 3 x 2 x 2 u8 values 0..11. */
static size_t make_u8(unsigned char *b) {
  const unsigned char h[] = {0, 0, 0x08, 3, 0, 0, 0, 3, 0, 0, 0, 2, 0, 0, 0, 2};
  memcpy(b, h, sizeof h);
  for (int i = 0; i < 12; i++) b[16 + i] = (unsigned char)(i * 20);
  return 28;
}

static void test_types(void) {
  char p[300], pg[300];
  snprintf(p, sizeof p, "%s/a.idx", g_tmp);
  snprintf(pg, sizeof pg, "%s/a.idx.gz", g_tmp);
  unsigned char b[256];
  size_t n = make_u8(b);
  kiln_scope_begin();
  for (int gz = 0; gz < 2; gz++) {
    if (gz) write_gz(pg, b, n);
    else write_raw(p, b, n);
    kiln_tensor *t = kiln_idx_load(gz ? pg : p);
    CHECK(t && kiln_dtype_of(t) == KILN_U8 && kiln_ndim(t) == 3 && kiln_size(t, 0) == 3 &&
          kiln_size(t, 1) == 2 && kiln_size(t, 2) == 2);
    if (t) CHECK(kiln_get(t, (int64_t[]){2, 1, 1}) == 11 * 20);
  }
  /* the other types, big-endian: i8 -3, i16 -300, i32 -70000, f32 1.5, f64 -0.25 */
  struct {
    unsigned char type;
    unsigned char bytes[8];
    size_t n;
    kiln_dtype want;
    double value;
  } cases[] = {
      {0x09, {0xFD}, 1, KILN_I32, -3},
      {0x0B, {0xFE, 0xD4}, 2, KILN_I32, -300},
      {0x0C, {0xFF, 0xFE, 0xEE, 0x90}, 4, KILN_I32, -70000},
      {0x0D, {0x3F, 0xC0, 0x00, 0x00}, 4, KILN_F32, 1.5},
      {0x0E, {0xBF, 0xD0, 0, 0, 0, 0, 0, 0}, 8, KILN_F64, -0.25},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    unsigned char f[32] = {0, 0, cases[i].type, 1, 0, 0, 0, 2};
    memcpy(f + 8, cases[i].bytes, cases[i].n);
    memcpy(f + 8 + cases[i].n, cases[i].bytes, cases[i].n);
    write_gz(pg, f, 8 + 2 * cases[i].n);
    kiln_tensor *t = kiln_idx_load(pg);
    CHECK(t && kiln_dtype_of(t) == cases[i].want && kiln_numel(t) == 2);
    if (t) CHECK(kiln_get(t, (int64_t[]){1}) == cases[i].value);
  }
  kiln_scope_end();
}

static void expect(const void *b, size_t n, kiln_status code, const char *needle) {
  char p[300];
  snprintf(p, sizeof p, "%s/e.idx", g_tmp);
  write_raw(p, b, n);
  kiln_clear_error();
  kiln_tensor *t = kiln_idx_load(p);
  int ok = !t && kiln_last_error() == code && strstr(kiln_last_error_message(), needle);
  if (!ok) fprintf(stderr, "want %s '%s', got %s\n", kiln_error_name(code), needle, kiln_last_error_message());
  CHECK(ok);
  kiln_tensor_free(t);
}

static void test_errors(void) {
  unsigned char b[256];
  size_t n = make_u8(b);
  b[0] = 1;
  expect(b, n, KILN_ERR_FORMAT, "bad magic");
  b[0] = 0;
  b[2] = 0x0A;
  expect(b, n, KILN_ERR_FORMAT, "type byte 0x0a at offset 2");
  b[2] = 0x08;
  b[3] = 0;
  expect(b, n, KILN_ERR_FORMAT, "offset 3");
  b[3] = 3;
  expect(b, n - 1, KILN_ERR_FORMAT, "truncated: the data ends at offset 27");
  expect(b, 10, KILN_ERR_FORMAT, "the dims");
  b[n] = 7;
  expect(b, n + 1, KILN_ERR_FORMAT, "trailing bytes after the data at offset 28");
  b[4] = 0xFF; /* a huge dim with little data must not allocate it */
  expect(b, n, KILN_ERR_FORMAT, "truncated");
  { /* issue 17.1: (0, 2^32-1 x 7): no elements, but the strides' product passes 2^63 */
    unsigned char z[4 + 4 * 8] = {0, 0, 0x08, 8};
    for (int i = 1; i < 8; i++) memset(z + 4 + 4 * i, 0xFF, 4);
    expect(z, sizeof z, KILN_ERR_SHAPE, "2^40");
    unsigned char ok3[4 + 12] = {0, 0, 0x08, 3, 0, 0, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0};
    char p[300];
    snprintf(p, sizeof p, "%s/z.idx", g_tmp);
    write_raw(p, ok3, sizeof ok3); /* (0, 65536, 65536): empty and fine */
    kiln_tensor *t = kiln_idx_load(p);
    CHECK(t && kiln_numel(t) == 0 && kiln_size(t, 2) == 65536);
    kiln_tensor_free(t);
  }
  CHECK(kiln_idx_load("/nonexistent/x") == NULL && kiln_last_error() == KILN_ERR_IO);
  CHECK(kiln_idx_load(NULL) == NULL && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT);
}

static void test_fuzz(void) {
  unsigned char b[256], d[256];
  size_t n = make_u8(b);
  char p[300];
  snprintf(p, sizeof p, "%s/f.idx.gz", g_tmp);
  int bad = 0;
  int64_t live0 = kiln_live_tensors();
  for (size_t len = 0; len < n; len++) {
    write_gz(p, b, len);
    kiln_tensor *t = kiln_idx_load(p);
    if (t || kiln_last_error() != KILN_ERR_FORMAT) bad++;
    kiln_tensor_free(t);
  }
  for (size_t i = 0; i < 16; i++)
    for (int bit = 0; bit < 8; bit++) {
      memcpy(d, b, n);
      d[i] ^= (unsigned char)(1u << bit);
      write_raw(p, d, n);
      kiln_tensor *t = kiln_idx_load(p);
      if (!t && kiln_last_error() != KILN_ERR_FORMAT) bad++;
      kiln_tensor_free(t);
    }
  /* damage to the compressed stream itself: IO (a broken gzip stream) or FORMAT */
  write_gz(p, b, n);
  FILE *f = fopen(p, "rb");
  unsigned char z[512];
  size_t zn = fread(z, 1, sizeof z, f);
  fclose(f);
  for (size_t i = 0; i < zn; i++) {
    unsigned char y[512];
    memcpy(y, z, zn);
    y[i] ^= 0x5A;
    write_raw(p, y, zn);
    kiln_tensor *t = kiln_idx_load(p);
    if (!t && kiln_last_error() != KILN_ERR_FORMAT && kiln_last_error() != KILN_ERR_IO) bad++;
    kiln_tensor_free(t);
    write_raw(p, z, i); /* truncated .gz */
    t = kiln_idx_load(p);
    if (t || (kiln_last_error() != KILN_ERR_FORMAT && kiln_last_error() != KILN_ERR_IO)) {
      bad++;
      fprintf(stderr, "gz truncated at %zu: %s\n", i, kiln_last_error_message());
    }
    kiln_tensor_free(t);
  }
  CHECK(bad == 0);
  CHECK(kiln_live_tensors() == live0);
}

static void test_fashion_mnist(void) {
  const char *dir = "/usr/share/datasets/fashion-mnist";
  char probe[400];
  snprintf(probe, sizeof probe, "%s/train-labels-idx1-ubyte.gz", dir);
  FILE *f = fopen(probe, "rb");
  if (!f) {
    snprintf(probe, sizeof probe, "%s/train-labels-idx1-ubyte", dir);
    f = fopen(probe, "rb");
  }
  /* the loader's own error names the files and the directories it tried */
  kiln_tensor *x = (kiln_tensor *)1, *y = NULL;
  CHECK(kiln_fashion_mnist_load(g_tmp, &x, &y, NULL, NULL) == KILN_ERR_IO && x == NULL &&
        strstr(kiln_last_error_message(), "train-images-idx3-ubyte"));
  if (!f) {
    printf("Fashion-MNIST: skipped (not installed at %s)\n", dir);
    return;
  }
  fclose(f);
  kiln_scope_begin();
  kiln_tensor *tx, *ty, *vx, *vy;
  CHECK(kiln_fashion_mnist_load(NULL, &tx, &ty, &vx, &vy) == KILN_OK);
  if (failures) {
    kiln_scope_end();
    return;
  }
  CHECK(kiln_dtype_of(tx) == KILN_F32 && kiln_ndim(tx) == 3 && kiln_size(tx, 0) == 60000 &&
        kiln_size(tx, 1) == 28 && kiln_size(tx, 2) == 28);
  CHECK(kiln_dtype_of(ty) == KILN_I64 && kiln_ndim(ty) == 1 && kiln_size(ty, 0) == 60000);
  CHECK(kiln_size(vx, 0) == 10000 && kiln_size(vy, 0) == 10000);
  const float *px = kiln_data_ptr(tx);
  float lo = 1, hi = 0;
  for (int64_t i = 0; i < kiln_numel(tx); i++) {
    if (px[i] < lo) lo = px[i];
    if (px[i] > hi) hi = px[i];
  }
  CHECK(lo == 0.0f && hi == 1.0f);
  int64_t count[10] = {0}, tcount[10] = {0};
  const int64_t *py = kiln_data_ptr(ty), *pv = kiln_data_ptr(vy);
  int range_ok = 1;
  for (int i = 0; i < 60000; i++) {
    if (py[i] < 0 || py[i] > 9) range_ok = 0;
    else count[py[i]]++;
  }
  for (int i = 0; i < 10000; i++) {
    if (pv[i] < 0 || pv[i] > 9) range_ok = 0;
    else tcount[pv[i]]++;
  }
  CHECK(range_ok);
  for (int c = 0; c < 10; c++) CHECK(count[c] == 6000 && tcount[c] == 1000);
  /* known first labels of the train set: 9 (ankle boot), 0, 0, 3, 0 */
  CHECK(py[0] == 9 && py[1] == 0 && py[2] == 0 && py[3] == 3 && py[4] == 0);
  kiln_scope_end();
  /* only the labels, through KILN_DATA_DIR */
  setenv("KILN_DATA_DIR", "/usr/share/datasets", 1);
  kiln_tensor *only = NULL;
  CHECK(kiln_fashion_mnist_load(NULL, NULL, NULL, NULL, &only) == KILN_OK && only &&
        kiln_size(only, 0) == 10000);
  kiln_tensor_free(only);
  unsetenv("KILN_DATA_DIR");
  printf("Fashion-MNIST: ok (60000 + 10000, 6000 / 1000 per class)\n");
}

int main(void) {
  if (scratch_begin(g_tmp, sizeof g_tmp, "idx") != 0) return 1;
  int64_t live0 = kiln_live_tensors();
  test_types();
  test_errors();
  test_fuzz();
  test_fashion_mnist();
  CHECK(kiln_live_tensors() == live0);
  scratch_end(g_tmp);
  return check_finish("test_data_idx");
}
