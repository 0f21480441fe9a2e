/*
** CSV: header detection, label by name / index / negative index / none, quotes, CRLF,
** blank lines, and errors naming the line and column; truncation fuzz never crashes.
*/
#define _POSIX_C_SOURCE 200809L
#include <kiln.h>
#include <kiln_data.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"

static char g_path[300];

static void put(const char *text) {
  FILE *f = fopen(g_path, "wb");
  fputs(text, f);
  fclose(f);
}

static int feat_is(kiln_tensor *x, int64_t n, int64_t f, const float *v) {
  if (!x || kiln_dtype_of(x) != KILN_F32 || kiln_ndim(x) != 2 || kiln_size(x, 0) != n ||
      kiln_size(x, 1) != f)
    return 0;
  for (int64_t i = 0; i < n * f; i++)
    if (kiln_get(x, (int64_t[]){i / f, i % f}) != v[i]) return 0;
  return 1;
}

static int lab_is(kiln_tensor *y, int64_t n, const int64_t *v) {
  if (!y || kiln_dtype_of(y) != KILN_I64 || kiln_ndim(y) != 1 || kiln_size(y, 0) != n) return 0;
  for (int64_t i = 0; i < n; i++)
    if (kiln_get(y, (int64_t[]){i}) != (double)v[i]) return 0;
  return 1;
}

static void test_good(void) {
  kiln_tensor *x, *y;
  kiln_scope_begin();
  /* defaults: header detected, label in column 0 */
  put("label,a,b\n1,0.5,2\n0,-1.5,3e2\n\n");
  CHECK(kiln_csv_load(g_path, NULL, &x, &y) == KILN_OK);
  CHECK(feat_is(x, 2, 2, (float[]){0.5f, 2, -1.5f, 300}));
  CHECK(lab_is(y, 2, (int64_t[]){1, 0}));
  /* by name, with CRLF, quotes and spaces */
  put("a, \"b\" ,y\r\n 1 ,\"2\", 7\r\n3,4,8\r\n");
  kiln_csv_opts o = {0};
  o.label_name = "y";
  CHECK(kiln_csv_load(g_path, &o, &x, &y) == KILN_OK);
  CHECK(feat_is(x, 2, 2, (float[]){1, 2, 3, 4}));
  CHECK(lab_is(y, 2, (int64_t[]){7, 8}));
  /* last column by negative index, no header, ';' delimiter */
  put("1;2;3\n4;5;6");
  memset(&o, 0, sizeof o);
  o.delimiter = ';';
  o.label_col = -1;
  CHECK(kiln_csv_load(g_path, &o, &x, &y) == KILN_OK);
  CHECK(feat_is(x, 2, 2, (float[]){1, 2, 4, 5}));
  CHECK(lab_is(y, 2, (int64_t[]){3, 6}));
  /* no label */
  memset(&o, 0, sizeof o);
  o.delimiter = ';';
  o.no_label = true;
  CHECK(kiln_csv_load(g_path, &o, &x, NULL) == KILN_OK);
  CHECK(feat_is(x, 2, 3, (float[]){1, 2, 3, 4, 5, 6}));
  /* forced header on an all-numeric first line */
  put("10,20\n1,2\n");
  memset(&o, 0, sizeof o);
  o.header = KILN_CSV_HEADER_YES;
  o.label_col = 1;
  CHECK(kiln_csv_load(g_path, &o, &x, &y) == KILN_OK);
  CHECK(feat_is(x, 1, 1, (float[]){1}));
  CHECK(lab_is(y, 1, (int64_t[]){2}));
  kiln_scope_end();
  /* without a scope the caller owns the results */
  int64_t live0 = kiln_live_tensors();
  put("1,2\n");
  CHECK(kiln_csv_load(g_path, NULL, &x, &y) == KILN_OK);
  CHECK(kiln_live_tensors() == live0 + 2);
  kiln_tensor_free(x);
  kiln_tensor_free(y);
  CHECK(kiln_live_tensors() == live0);
}

static void expect(const char *text, const kiln_csv_opts *o, kiln_status code, const char *needle) {
  put(text);
  kiln_tensor *x = (kiln_tensor *)1, *y = (kiln_tensor *)1;
  kiln_status st = kiln_csv_load(g_path, o, &x, &y);
  int ok = st == code && x == NULL && y == NULL && strstr(kiln_last_error_message(), needle);
  if (!ok) fprintf(stderr, "want %s '%s', got %s '%s'\n", kiln_error_name(code), needle,
                   kiln_error_name(st), kiln_last_error_message());
  CHECK(ok);
}

static void test_errors(void) {
  kiln_csv_opts o = {0};
  expect("a,b\n1,2\n3,x\n", NULL, KILN_ERR_FORMAT, "line 3, column 2: not a number: 'x'");
  expect("1,2\n3,4,5\n", NULL, KILN_ERR_FORMAT, "line 2 has 3 fields, expected 2");
  expect("1,2\n3,,\n", NULL, KILN_ERR_FORMAT, "line 2 has 3 fields");
  expect("1,2\n,4\n", NULL, KILN_ERR_FORMAT, "line 2, column 1: empty field");
  expect("1.5,2\n", NULL, KILN_ERR_FORMAT, "line 1, column 1: label 1.5 is not an integer");
  expect("a,b\n", NULL, KILN_ERR_FORMAT, "no data rows");
  expect("", NULL, KILN_ERR_FORMAT, "no data rows");
  expect("1,\"2\n", NULL, KILN_ERR_FORMAT, "line 1: unterminated quote");
  o.label_name = "zz";
  expect("a,b\n1,2\n", &o, KILN_ERR_INVALID_ARGUMENT, "no column named 'zz'");
  expect("1,2\n", &o, KILN_ERR_INVALID_ARGUMENT, "no header");
  o.label_name = NULL;
  o.label_col = 5;
  expect("1,2\n", &o, KILN_ERR_INVALID_ARGUMENT, "label column 5 out of range for 2 columns");
  kiln_tensor *x;
  CHECK(kiln_csv_load("/nonexistent.csv", NULL, &x, &x) == KILN_ERR_IO);
  CHECK(kiln_csv_load(g_path, NULL, NULL, &x) == KILN_ERR_INVALID_ARGUMENT);
}

static void test_fuzz(void) {
  const char *base = "label,f1,\"f 2\"\r\n1,0.25,-3\r\n2,1e-3,\"4\"\r\n\r\n3,5,6\n";
  size_t n = strlen(base);
  char buf[256];
  int64_t live0 = kiln_live_tensors();
  int bad = 0;
  for (size_t len = 0; len <= n; len++)
    for (int flip = -1; flip < (int)len; flip++) {
      memcpy(buf, base, len);
      buf[len] = 0;
      if (flip >= 0) buf[flip] = "\",\n;x9\"\r"[flip % 8];
      put(buf);
      kiln_tensor *x = NULL, *y = NULL;
      kiln_status st = kiln_csv_load(g_path, NULL, &x, &y);
      if (st == KILN_OK) {
        if (!x || !y || kiln_size(x, 0) != kiln_size(y, 0)) bad++;
        kiln_tensor_free(x);
        kiln_tensor_free(y);
      } else if (x || y || (st != KILN_ERR_FORMAT && st != KILN_ERR_INVALID_ARGUMENT)) {
        bad++;
      }
    }
  CHECK(bad == 0);
  CHECK(kiln_live_tensors() == live0);
}

int main(void) {
  snprintf(g_path, sizeof g_path, "%s/kiln_test_csv_%ld.csv", access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp", (long)getpid());
  test_good();
  test_errors();
  test_fuzz();
  remove(g_path);
  return check_finish("test_data_csv");
}
