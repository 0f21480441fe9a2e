/* Shared by the tests: a tensor's values on the host in f64, and two tensors (on any
** device) compared to the bit or by their largest difference. Header-only. */
#ifndef KILN_TEST_TENSOR_CMP_H
#define KILN_TEST_TENSOR_CMP_H

#include <kiln.h>

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

/* t's values as f64 in C order (malloc'd; the caller frees). */
static inline double *host_f64(kiln_tensor *t) {
  kiln_scope_begin();
  kiln_tensor *d = kiln_contiguous(kiln_to_dtype(t, KILN_F64));
  double *v = malloc(kiln_nbytes(d) ? kiln_nbytes(d) : 8);
  kiln_to_host(d, v, kiln_nbytes(d));
  kiln_scope_end();
  return v;
}

/* max |a - b| over the elements, in f64; INFINITY when either is NULL or the counts differ. */
static inline double max_abs_diff(kiln_tensor *a, kiln_tensor *b) {
  if (!a || !b || kiln_numel(a) != kiln_numel(b)) return INFINITY;
  double *x = host_f64(a), *y = host_f64(b), d = 0;
  for (int64_t i = 0; i < kiln_numel(a); i++) d = fmax(d, fabs(x[i] - y[i]));
  free(x);
  free(y);
  return d;
}

/* The largest |a - ref| / (atol + rtol |ref|) over the elements of two tensors of one
** count (any devices), in f64; <= 1 passes. INFINITY when either is NULL, the counts
** differ or a copy fails; a NaN anywhere makes it INFINITY too. */
static inline double rel_err(kiln_tensor *a, kiln_tensor *ref, double rtol, double atol) {
  if (!a || !ref || kiln_numel(a) != kiln_numel(ref)) return INFINITY;
  int64_t n = kiln_numel(a);
  double *x = malloc(sizeof(double) * (size_t)(n ? n : 1)), *y = malloc(sizeof(double) * (size_t)(n ? n : 1));
  double worst = 0;
  kiln_tensor *a64 = kiln_contiguous(kiln_to_dtype(kiln_to_device(a, kiln_device_cpu()), KILN_F64));
  kiln_tensor *b64 = kiln_contiguous(kiln_to_dtype(kiln_to_device(ref, kiln_device_cpu()), KILN_F64));
  if (!x || !y || !a64 || !b64 || kiln_to_host(a64, x, sizeof(double) * (size_t)n) != KILN_OK ||
      kiln_to_host(b64, y, sizeof(double) * (size_t)n) != KILN_OK)
    worst = INFINITY;
  for (int64_t i = 0; worst < INFINITY && i < n; i++) {
    double e = fabs(x[i] - y[i]) / (atol + rtol * fabs(y[i]));
    if (!(e <= worst)) worst = isnan(e) ? INFINITY : e;
  }
  free(x), free(y);
  return worst;
}

/* The same dtype, element count and bytes (false too when a copy to the host fails). */
static inline bool bits_equal(kiln_tensor *a, kiln_tensor *b) {
  if (!a || !b || kiln_numel(a) != kiln_numel(b) || kiln_dtype_of(a) != kiln_dtype_of(b)) return false;
  size_t n = kiln_nbytes(a);
  char *x = malloc(n + 1), *y = malloc(n + 1);
  bool eq = x && y && kiln_to_host(a, x, n) == KILN_OK && kiln_to_host(b, y, n) == KILN_OK && memcmp(x, y, n) == 0;
  free(x);
  free(y);
  return eq;
}

#endif
