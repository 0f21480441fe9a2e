/*
** The checks of the KV-cache ops (kiln_index_copy_, kiln_kv_attention) on one device,
** shared by test_ops_kv (the CPU, or KILN_TEST_DEVICE) and test_cuda_kv (CUDA device 0).
** References are built on the CPU in f64 from other ops: kv_attention against
** kiln_scaled_dot_product_attention with the equivalent boolean mask, index_copy_ against
** narrow + copy_ at host-known positions. Shapes: the layouts a decode step uses (q a
** transposed view of a (B, T, H, D) projection), non-contiguous caches, D not a multiple
** of 32, Dv != D, Tq > 1, one length for all rows and one per row, empty rows.
** kiln_sample_tokens: the frequencies of 20000 draws against the probabilities that
** kiln_sample_filter's kept tokens have (f64 softmax), ties at the top-k cut, -inf logits;
** on a GPT-2-sized vocabulary every token drawn is one the filter keeps; same state, same
** tokens; the next offset, other tokens.
*/
#ifndef KILN_TEST_KV_CHECKS_H
#define KILN_TEST_KV_CHECKS_H

#include <kiln.h>
#include <kiln_nn.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

static double kv_max_diff(kiln_tensor *a, kiln_tensor *b) {
  kiln_scope_begin();
  kiln_device cpu = kiln_device_cpu();
  kiln_tensor *d = kiln_amax(kiln_abs(kiln_sub(kiln_to_dtype(kiln_to_device(a, cpu), KILN_F64),
                                               kiln_to_dtype(kiln_to_device(b, cpu), KILN_F64))),
                             0, NULL, false);
  double v = d ? kiln_item(d) : INFINITY;
  kiln_scope_end();
  return v;
}

static bool kv_equal(kiln_tensor *a, kiln_tensor *b) { return kv_max_diff(a, b) == 0.0; }

/* softmax over the keys j <= len_b - Tq + i of each row, in f64 on the CPU. */
static kiln_tensor *kv_reference(kiln_tensor *q, kiln_tensor *k, kiln_tensor *v, const int64_t *lens, int nlen) {
  kiln_device cpu = kiln_device_cpu();
  const int64_t B = kiln_size(q, 0), Tq = kiln_size(q, 2), M = kiln_size(k, 2);
  kiln_tensor *q64 = kiln_to_dtype(kiln_to_device(q, cpu), KILN_F64);
  kiln_tensor *k64 = kiln_to_dtype(kiln_to_device(k, cpu), KILN_F64);
  kiln_tensor *v64 = kiln_to_dtype(kiln_to_device(v, cpu), KILN_F64);
  kiln_tensor *rows[16];
  for (int64_t b = 0; b < B && b < 16; b++) {
    const int64_t L = lens[nlen == 1 ? 0 : b];
    bool *m = malloc((size_t)(Tq * M));
    for (int64_t i = 0; i < Tq; i++)
      for (int64_t j = 0; j < M; j++) m[i * M + j] = j <= L - Tq + i;
    kiln_tensor *mask = kiln_from_data(m, KILN_SHAPE(Tq, M), KILN_BOOL, cpu);
    free(m);
    rows[b] = kiln_scaled_dot_product_attention(kiln_narrow(q64, 0, b, 1), kiln_narrow(k64, 0, b, 1),
                                                kiln_narrow(v64, 0, b, 1), mask, false, 0.0, 0.0, NULL);
  }
  return kiln_cat((int)B, rows, 0);
}

/* tolerance of a dtype's result against the f64 reference (values of size ~1) */
static double kv_tol(kiln_dtype dt) {
  return dt == KILN_F64 ? 1e-12 : dt == KILN_F32 ? 2e-5 : dt == KILN_F16 ? 4e-3 : 3e-2;
}

static void kv_check_attention_case(kiln_device dev, kiln_dtype dt, int64_t B, int64_t H, int64_t Tq, int64_t M,
                                    int64_t D, int64_t Dv, const int64_t *lens, int nlen, bool strided_cache) {
  kiln_scope_begin();
  kiln_generator *g = kiln_generator_new((uint64_t)(B * 1000 + M * 10 + D + Dv + nlen));
  /* q as a decode step makes it: a (B, Tq, H, D) projection viewed (B, H, Tq, D) */
  kiln_tensor *q = kiln_transpose(kiln_to_dtype(kiln_randn(KILN_SHAPE(B, Tq, H, D), KILN_F32, dev, g), dt), 1, 2);
  kiln_tensor *k, *v;
  if (strided_cache) { /* (B, M, H, D) caches viewed (B, H, M, D): no dim is contiguous with the next */
    k = kiln_transpose(kiln_to_dtype(kiln_randn(KILN_SHAPE(B, M, H, D), KILN_F32, dev, g), dt), 1, 2);
    v = kiln_transpose(kiln_to_dtype(kiln_randn(KILN_SHAPE(B, M, H, Dv), KILN_F32, dev, g), dt), 1, 2);
  } else {
    k = kiln_to_dtype(kiln_randn(KILN_SHAPE(B, H, M, D), KILN_F32, dev, g), dt);
    v = kiln_to_dtype(kiln_randn(KILN_SHAPE(B, H, M, Dv), KILN_F32, dev, g), dt);
  }
  kiln_generator_free(g);
  kiln_tensor *len = kiln_from_data(lens, 1, (const int64_t[]){nlen}, KILN_I64, dev);
  kiln_tensor *y = kiln_kv_attention(q, k, v, len, 0.0);
  kiln_tensor *ref = kv_reference(q, k, v, lens, nlen);
  double diff = y && ref ? kv_max_diff(y, ref) : INFINITY;
  if (!(diff <= kv_tol(dt)))
    printf("kv_attention %s B%lld H%lld Tq%lld M%lld D%lld Dv%lld nlen %d%s: max diff %g (tol %g)\n",
           kiln_dtype_name(dt), (long long)B, (long long)H, (long long)Tq, (long long)M, (long long)D, (long long)Dv,
           nlen, strided_cache ? " strided" : "", diff, kv_tol(dt));
  CHECK(diff <= kv_tol(dt));
  CHECK(y && kiln_size(y, 3) == Dv && kiln_dtype_of(y) == dt);
  kiln_scope_end();
}

static void kv_check_attention(kiln_device dev) {
  const kiln_dtype dts[] = {KILN_F32, KILN_BF16, KILN_F16, KILN_F64};
  for (int t = 0; t < 4; t++) {
    kiln_dtype dt = dts[t];
    kv_check_attention_case(dev, dt, 1, 12, 1, 96, 64, 64, (const int64_t[]){70}, 1, false);   /* GPT-2's decode */
    kv_check_attention_case(dev, dt, 3, 2, 1, 300, 40, 24, (const int64_t[]){300, 1, 257}, 3, true); /* per row */
    kv_check_attention_case(dev, dt, 2, 3, 4, 50, 33, 33, (const int64_t[]){37}, 1, false);  /* Tq > 1 */
    kv_check_attention_case(dev, dt, 2, 1, 3, 20, 128, 128, (const int64_t[]){2, 20}, 2, true); /* a row's first query has no key */
    /* batch 16 at GPT-2's heads, one length per row: 1 key, several steps of CUDA's
    ** 16-bit path (64 keys a step at D 64), the whole cache */
    kv_check_attention_case(dev, dt, 16, 12, 1, 300, 64, 64,
                            (const int64_t[]){1, 2, 63, 64, 65, 127, 128, 129, 191, 192, 193, 255, 256, 299, 300, 70},
                            16, false);
    kv_check_attention_case(dev, dt, 3, 4, 2, 90, 32, 32, (const int64_t[]){90, 2, 33}, 3, true); /* D 32 */
  }
}

/* kiln_kv_attention_append against kiln_index_copy_ then kiln_kv_attention on a copy of the
** cache: the same output and the same cache after. kv_new is made as the decode step makes
** it (a permuted view of a (B, Tq, 3C) projection); lens one for all rows or one per row. */
static void kv_check_append_case(kiln_device dev, kiln_dtype dt, int64_t B, int64_t H, int64_t Tq, int64_t M, int64_t D,
                                 const int64_t *lens, int nlen) {
  kiln_scope_begin();
  const int64_t C = H * D;
  kiln_generator *g = kiln_generator_new((uint64_t)(B * 100 + Tq * 10 + D + nlen));
  kiln_tensor *cache = kiln_to_dtype(kiln_randn(KILN_SHAPE(2, B, H, M, D), KILN_F32, dev, g), dt);
  kiln_tensor *qkv = kiln_to_dtype(kiln_randn(KILN_SHAPE(B, Tq, 3 * C), KILN_F32, dev, g), dt);
  kiln_generator_free(g);
  kiln_tensor *q = kiln_transpose(kiln_view(kiln_narrow(qkv, 2, 0, C), KILN_SHAPE(B, Tq, H, D)), 1, 2);
  kiln_tensor *kv_new = kiln_permute(kiln_view(kiln_narrow(qkv, 2, C, 2 * C), KILN_SHAPE(B, Tq, 2, H, D)), 5,
                                     (const int[]){2, 0, 3, 1, 4});
  kiln_tensor *len = kiln_from_data(lens, 1, (const int64_t[]){nlen}, KILN_I64, dev);
  kiln_tensor *ref_cache = kiln_contiguous(kiln_mul_scalar(cache, 1)); /* a copy */
  for (int64_t b = 0; b < (nlen == 1 ? 1 : B); b++) { /* the reference: rows written one by one at host slots */
    kiln_tensor *slots = kiln_arange((double)(lens[b] - Tq), (double)lens[b], 1, KILN_I64, dev);
    kiln_tensor *dst = nlen == 1 ? ref_cache : kiln_narrow(ref_cache, 1, b, 1);
    kiln_tensor *src = nlen == 1 ? kv_new : kiln_narrow(kv_new, 1, b, 1);
    CHECK(kiln_index_copy_(dst, 3, slots, src) == KILN_OK);
  }
  kiln_tensor *want = kiln_kv_attention(q, kiln_select(ref_cache, 0, 0), kiln_select(ref_cache, 0, 1), len, 0.0);
  kiln_tensor *got = kiln_kv_attention_append(q, cache, kv_new, len, 0.0);
  double dy = got && want ? kv_max_diff(got, want) : INFINITY, dc = kv_max_diff(cache, ref_cache);
  /* the fused kernel sums in another order than the plain one: the dtype's tolerance */
  if (!(dy <= kv_tol(dt) && dc == 0))
    printf("kv_attention_append %s B%lld H%lld Tq%lld M%lld D%lld nlen %d: output diff %g, cache diff %g\n",
           kiln_dtype_name(dt), (long long)B, (long long)H, (long long)Tq, (long long)M, (long long)D, nlen, dy, dc);
  CHECK(dy <= kv_tol(dt));
  CHECK(dc == 0);
  kiln_scope_end();
}

static void kv_check_append(kiln_device dev) {
  const kiln_dtype dts[] = {KILN_BF16, KILN_F16, KILN_F32};
  for (int t = 0; t < 3; t++) {
    kv_check_append_case(dev, dts[t], 1, 12, 1, 96, 64, (const int64_t[]){70}, 1); /* GPT-2's step at batch 1 */
    kv_check_append_case(dev, dts[t], 16, 12, 1, 200, 64, /* batch 16, a length per row: the first and last slots */
                         (const int64_t[]){1, 2, 64, 65, 128, 129, 192, 193, 199, 200, 3, 100, 150, 77, 5, 9}, 16);
    kv_check_append_case(dev, dts[t], 2, 3, 1, 40, 128, (const int64_t[]){40}, 1);
    kv_check_append_case(dev, dts[t], 3, 2, 3, 30, 32, (const int64_t[]){3, 30, 17}, 3); /* Tq > 1: composed on CUDA */
  }
  kiln_scope_begin();
  kiln_tensor *cache = kiln_zeros(KILN_SHAPE(2, 1, 2, 8, 8), KILN_F32, dev);
  kiln_tensor *q = kiln_zeros(KILN_SHAPE(1, 2, 1, 8), KILN_F32, dev);
  CHECK(!kiln_kv_attention_append(q, kiln_zeros(KILN_SHAPE(1, 2, 8, 8), KILN_F32, dev),
                                   kiln_zeros(KILN_SHAPE(2, 1, 2, 1, 8), KILN_F32, dev),
                                   kiln_full(KILN_SHAPE(1), 3, KILN_I64, dev), 0) && kiln_last_error() == KILN_ERR_SHAPE);
  CHECK(!kiln_kv_attention_append(q, cache, kiln_zeros(KILN_SHAPE(2, 1, 2, 1, 8), KILN_BF16, dev),
                                  kiln_full(KILN_SHAPE(1), 3, KILN_I64, dev), 0) && kiln_last_error() == KILN_ERR_DTYPE);
  kiln_clear_error();
  kiln_scope_end();
}

static void kv_check_attention_errors(kiln_device dev) {
  kiln_scope_begin();
  kiln_tensor *q = kiln_zeros(KILN_SHAPE(1, 2, 1, 8), KILN_F32, dev);
  kiln_tensor *k = kiln_zeros(KILN_SHAPE(1, 2, 10, 8), KILN_F32, dev);
  kiln_tensor *len = kiln_full(KILN_SHAPE(1), 4, KILN_I64, dev);
  CHECK(!kiln_kv_attention(q, kiln_zeros(KILN_SHAPE(1, 3, 10, 8), KILN_F32, dev), k, len, 0) &&
        kiln_last_error() == KILN_ERR_SHAPE);
  CHECK(!kiln_kv_attention(q, k, kiln_to_dtype(k, KILN_BF16), len, 0) && kiln_last_error() == KILN_ERR_DTYPE);
  CHECK(!kiln_kv_attention(q, k, k, kiln_to_dtype(len, KILN_I32), 0) && kiln_last_error() == KILN_ERR_DTYPE);
  CHECK(!kiln_kv_attention(q, k, k, kiln_full(KILN_SHAPE(3), 4, KILN_I64, dev), 0) &&
        kiln_last_error() == KILN_ERR_SHAPE);
  CHECK(!kiln_kv_attention(q, k, k, len, -1) && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT);
  kiln_tensor *qg = kiln_zeros(KILN_SHAPE(1, 2, 1, 8), KILN_F32, dev);
  kiln_requires_grad_(qg, true);
  CHECK(!kiln_kv_attention(qg, k, k, len, 0) && kiln_last_error() == KILN_ERR_AUTOGRAD);
  kiln_clear_error();
  kiln_scope_end();
}

/* dst[.., index[t], ..] = src[.., t, ..], checked against narrow + copy_ on the CPU. */
static void kv_check_index_copy_case(kiln_device dev, kiln_dtype dt, int dim, bool transposed_src) {
  kiln_scope_begin();
  kiln_device cpu = kiln_device_cpu();
  const int64_t shape[3] = {5, 7, 6};
  const int64_t idx[3] = {4, 0, 2}; /* src has 3 along dim */
  int64_t sshape[3] = {shape[0], shape[1], shape[2]};
  sshape[dim] = 3;
  kiln_generator *g = kiln_generator_new(11 + (uint64_t)dim);
  kiln_tensor *dst = kiln_to_dtype(kiln_mul_scalar(kiln_randn(3, shape, KILN_F32, dev, g), 8), dt);
  kiln_tensor *src;
  if (transposed_src) { /* a (.., b, a) tensor viewed (.., a, b) */
    int64_t tshape[3] = {sshape[0], sshape[2], sshape[1]};
    src = kiln_transpose(kiln_to_dtype(kiln_mul_scalar(kiln_randn(3, tshape, KILN_F32, dev, g), 8), dt), 1, 2);
  } else {
    src = kiln_to_dtype(kiln_mul_scalar(kiln_randn(3, sshape, KILN_F32, dev, g), 8), dt);
  }
  kiln_generator_free(g);
  kiln_tensor *ref = kiln_contiguous(kiln_to_device(dst, cpu));
  kiln_tensor *src_cpu = kiln_to_device(src, cpu);
  for (int t = 0; t < 3; t++) kiln_copy_(kiln_narrow(ref, dim, idx[t], 1), kiln_narrow(src_cpu, dim, t, 1));
  kiln_tensor *index = kiln_from_data(idx, KILN_SHAPE(3), KILN_I64, dev);
  CHECK(kiln_index_copy_(dst, dim, index, src) == KILN_OK);
  CHECK(kv_equal(dst, ref));
  /* one position (the decode step's write), from a one-element index */
  kiln_tensor *pos = kiln_full(KILN_SHAPE(1), 6 % shape[dim], KILN_I64, dev);
  kiln_tensor *one = kiln_narrow(src, dim, 1, 1);
  CHECK(kiln_index_copy_(dst, dim, pos, one) == KILN_OK);
  kiln_copy_(kiln_narrow(ref, dim, 6 % shape[dim], 1), kiln_narrow(src_cpu, dim, 1, 1));
  CHECK(kv_equal(dst, ref));
  kiln_scope_end();
}

static void kv_check_index_copy(kiln_device dev) {
  const kiln_dtype dts[] = {KILN_F32, KILN_BF16, KILN_F16, KILN_I64};
  for (int t = 0; t < 4; t++)
    for (int dim = 0; dim < 3; dim++) {
      kv_check_index_copy_case(dev, dts[t], dim, false);
      kv_check_index_copy_case(dev, dts[t], dim, true);
    }
}

static void kv_check_index_copy_errors(kiln_device dev) {
  kiln_scope_begin();
  kiln_tensor *dst = kiln_zeros(KILN_SHAPE(2, 6, 4), KILN_F32, dev);
  kiln_tensor *src = kiln_ones(KILN_SHAPE(2, 1, 4), KILN_F32, dev);
  kiln_tensor *pos = kiln_full(KILN_SHAPE(1), 2, KILN_I64, dev);
  CHECK(kiln_index_copy_(dst, 1, pos, kiln_ones(KILN_SHAPE(2, 1, 3), KILN_F32, dev)) == KILN_ERR_SHAPE);
  CHECK(kiln_index_copy_(dst, 1, pos, kiln_ones(KILN_SHAPE(2, 1, 4), KILN_BF16, dev)) == KILN_ERR_DTYPE);
  CHECK(kiln_index_copy_(dst, 1, kiln_to_dtype(pos, KILN_I32), src) == KILN_ERR_DTYPE);
  CHECK(kiln_index_copy_(dst, 1, kiln_full(KILN_SHAPE(2), 2, KILN_I64, dev), src) == KILN_ERR_SHAPE);
  CHECK(kiln_index_copy_(dst, 3, pos, src) == KILN_ERR_INVALID_ARGUMENT);
  CHECK(kiln_index_copy_(dst, -2, pos, src) == KILN_OK); /* negative dims count from the end */
  kiln_clear_error();
  kiln_scope_end();
}

/* kiln_add_layer_norm against kiln_add (rounded to dt) then kiln_layer_norm in f64. */
static void kv_check_add_ln_case(kiln_device dev, kiln_dtype dt, int rcase, bool xt, int wb, int64_t N) {
  kiln_scope_begin();
  kiln_device cpu = kiln_device_cpu();
  kiln_generator *g = kiln_generator_new((uint64_t)(rcase * 10 + wb + (xt ? 100 : 0)));
  kiln_tensor *x = xt ? kiln_transpose(kiln_randn(KILN_SHAPE(4, 3, N), KILN_F32, dev, g), 0, 1) /* (3, 4, N) view */
                      : kiln_randn(KILN_SHAPE(3, 4, N), KILN_F32, dev, g);
  kiln_tensor *r = rcase == 0   ? kiln_randn(KILN_SHAPE(3, 4, N), KILN_F32, dev, g)   /* same shape */
                   : rcase == 1 ? kiln_randn(KILN_SHAPE(4, N), KILN_F32, dev, g)      /* broadcast over dim 0 */
                   : rcase == 2 ? kiln_randn(KILN_SHAPE(1, 1, N), KILN_F32, dev, g)   /* one row for all */
                                : kiln_transpose(kiln_randn(KILN_SHAPE(4, 3, N), KILN_F32, dev, g), 0, 1);
  kiln_tensor *w = (wb & 1) ? kiln_add_scalar(kiln_randn(KILN_SHAPE(N), KILN_F32, dev, g), 1) : NULL;
  kiln_tensor *b = (wb & 2) ? kiln_randn(KILN_SHAPE(N), KILN_F32, dev, g) : NULL;
  kiln_generator_free(g);
  x = kiln_to_dtype(x, dt), r = kiln_to_dtype(r, dt);
  if (w) w = kiln_to_dtype(w, dt);
  if (b) b = kiln_to_dtype(b, dt);
  kiln_tensor *sum = NULL;
  kiln_tensor *y = kiln_add_layer_norm(x, r, w, b, 1e-5, &sum);
  CHECK(y && sum && kiln_dtype_of(y) == dt && kiln_ndim(y) == 3 && kiln_size(y, 2) == N);
  kiln_tensor *s64 = kiln_to_dtype(kiln_add(kiln_to_dtype(kiln_to_device(x, cpu), KILN_F64),
                                            kiln_to_dtype(kiln_to_device(r, cpu), KILN_F64)), KILN_F64);
  kiln_tensor *sr = kiln_to_dtype(kiln_to_dtype(s64, dt), KILN_F64); /* rounded as stored */
  kiln_tensor *yr = kiln_layer_norm(sr, 1, (const int64_t[]){N}, w ? kiln_to_dtype(kiln_to_device(w, cpu), KILN_F64) : NULL,
                                    b ? kiln_to_dtype(kiln_to_device(b, cpu), KILN_F64) : NULL, 1e-5);
  double ds = y ? kv_max_diff(sum, sr) : INFINITY, dy = y ? kv_max_diff(y, yr) : INFINITY;
  double tol = kv_tol(dt) * 2;
  if (!(ds <= tol && dy <= tol))
    printf("add_layer_norm %s r case %d%s wb %d N %lld: sum diff %g, y diff %g (tol %g)\n", kiln_dtype_name(dt), rcase,
           xt ? " x strided" : "", wb, (long long)N, ds, dy, tol);
  CHECK(ds <= tol && dy <= tol);
  kiln_scope_end();
}

static void kv_check_add_ln(kiln_device dev) {
  const kiln_dtype dts[] = {KILN_F32, KILN_BF16, KILN_F16, KILN_F64};
  for (int t = 0; t < 4; t++)
    for (int rc = 0; rc < 4; rc++) kv_check_add_ln_case(dev, dts[t], rc, rc == 3, 3, 768);
  kv_check_add_ln_case(dev, KILN_F32, 2, true, 0, 40);
  kv_check_add_ln_case(dev, KILN_F32, 1, false, 1, 300);
  kv_check_add_ln_case(dev, KILN_BF16, 0, false, 2, 1);
  /* CUDA's 16-bit one-pass form: no weight, weight only, rows of 4096 (512 threads), 8200
  ** (past its 8192: the generic kernel), and N % 8 != 0 (generic) */
  kv_check_add_ln_case(dev, KILN_BF16, 2, false, 0, 1024);
  kv_check_add_ln_case(dev, KILN_F16, 1, false, 1, 4096);
  kv_check_add_ln_case(dev, KILN_BF16, 0, false, 3, 8200);
  kv_check_add_ln_case(dev, KILN_F16, 0, false, 3, 300);
  kiln_scope_begin();
  kiln_tensor *x = kiln_zeros(KILN_SHAPE(2, 8), KILN_F32, dev);
  CHECK(!kiln_add_layer_norm(x, kiln_zeros(KILN_SHAPE(3, 8), KILN_F32, dev), NULL, NULL, 1e-5, NULL) &&
        kiln_last_error() == KILN_ERR_SHAPE);
  CHECK(!kiln_add_layer_norm(x, x, kiln_ones(KILN_SHAPE(7), KILN_F32, dev), NULL, 1e-5, NULL) &&
        kiln_last_error() == KILN_ERR_SHAPE);
  CHECK(!kiln_add_layer_norm(x, kiln_to_dtype(x, KILN_BF16), NULL, NULL, 1e-5, NULL) && kiln_last_error() == KILN_ERR_DTYPE);
  CHECK(!kiln_add_layer_norm(x, x, NULL, NULL, -1, NULL) && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT);
  kiln_clear_error();
  kiln_scope_end();
}

/* kiln_linear_decode against x W^T + b in f64, rounded to dt, then the tanh GELU in f64. */
static void kv_check_linear_case(kiln_device dev, kiln_dtype dt, int64_t M, int64_t K, int64_t N, bool bias, bool gelu,
                                 bool strided_x) {
  kiln_scope_begin();
  kiln_device cpu = kiln_device_cpu();
  kiln_generator *g = kiln_generator_new((uint64_t)(M * 7 + K + N + bias + 2 * gelu));
  kiln_tensor *x = strided_x ? kiln_transpose(kiln_randn(KILN_SHAPE(K, M), KILN_F32, dev, g), 0, 1)
                             : kiln_randn(KILN_SHAPE(M, 1, K), KILN_F32, dev, g);
  kiln_tensor *w = kiln_mul_scalar(kiln_randn(KILN_SHAPE(N, K), KILN_F32, dev, g), 1.0 / sqrt((double)K));
  kiln_tensor *b = bias ? kiln_randn(KILN_SHAPE(N), KILN_F32, dev, g) : NULL;
  kiln_generator_free(g);
  x = kiln_to_dtype(x, dt), w = kiln_to_dtype(w, dt);
  if (b) b = kiln_to_dtype(b, dt);
  kiln_tensor *y = kiln_linear_decode(x, w, b, gelu);
  kiln_tensor *r = kiln_linear(kiln_to_dtype(kiln_to_device(x, cpu), KILN_F64), kiln_to_dtype(kiln_to_device(w, cpu), KILN_F64),
                               b ? kiln_to_dtype(kiln_to_device(b, cpu), KILN_F64) : NULL);
  r = kiln_to_dtype(kiln_to_dtype(r, dt), KILN_F64);
  if (gelu) r = kiln_gelu_tanh(r);
  double diff = y && r ? kv_max_diff(y, r) : INFINITY, tol = 2 * kv_tol(dt) + (dt == KILN_F32 ? 1e-5 : 0);
  if (!(diff <= tol))
    printf("linear_decode %s M %lld K %lld N %lld%s%s%s: max diff %g (tol %g)\n", kiln_dtype_name(dt), (long long)M,
           (long long)K, (long long)N, bias ? " bias" : "", gelu ? " gelu" : "", strided_x ? " strided" : "", diff, tol);
  CHECK(diff <= tol);
  CHECK(y && kiln_dtype_of(y) == dt && kiln_size(y, kiln_ndim(y) - 1) == N && kiln_numel(y) == M * N);
  kiln_scope_end();
}

static void kv_check_linear(kiln_device dev) {
  const kiln_dtype dts[] = {KILN_BF16, KILN_F16, KILN_F32};
  for (int t = 0; t < 3; t++) {
    kv_check_linear_case(dev, dts[t], 1, 768, 2304, true, false, false); /* GPT-2's c_attn at batch 1 */
    kv_check_linear_case(dev, dts[t], 16, 768, 3072, true, true, false); /* c_fc + GELU at batch 16 */
    kv_check_linear_case(dev, dts[t], 3, 3072, 768, true, false, false);
    kv_check_linear_case(dev, dts[t], 5, 64, 1001, false, false, false); /* lm_head-like, N odd */
    kv_check_linear_case(dev, dts[t], 17, 64, 40, true, true, false);    /* too many rows: composed */
    kv_check_linear_case(dev, dts[t], 2, 40, 9, true, true, true);       /* strided rows: composed */
  }
  /* CUDA's tensor-core kernel (3-16 rows): K not a multiple of its 32-wide chunks, 9 rows
  ** (the upper half of the mma's 16), the 4-tile blocks of wide outputs (N >= 128 per SM)
  ** with a partial last tile */
  kv_check_linear_case(dev, KILN_BF16, 7, 200, 37, true, true, false);
  kv_check_linear_case(dev, KILN_F16, 9, 1536, 100, true, false, false);
  kv_check_linear_case(dev, KILN_BF16, 16, 768, 17003, false, false, false);
  kv_check_linear_case(dev, KILN_F16, 5, 768, 16900, true, false, false);
  kv_check_linear_case(dev, KILN_BF16, 1, 768, 16900, true, false, false); /* 1 row: the warp kernel */
  kv_check_linear_case(dev, KILN_F64, 2, 32, 7, true, true, false); /* composed */
  kv_check_linear_case(dev, KILN_F32, 4, 36, 5, true, false, false); /* K not a multiple of 8 */
  kiln_scope_begin();
  kiln_tensor *x = kiln_zeros(KILN_SHAPE(2, 8), KILN_F32, dev);
  CHECK(!kiln_linear_decode(x, kiln_zeros(KILN_SHAPE(3, 7), KILN_F32, dev), NULL, false) && kiln_last_error() == KILN_ERR_SHAPE);
  kiln_clear_error();
  kiln_scope_end();
}

/* rng state (seed, offset) as a device tensor */
static kiln_tensor *kv_rng(kiln_device dev, uint64_t seed, uint64_t offset) {
  int64_t st[2];
  memcpy(&st[0], &seed, 8);
  memcpy(&st[1], &offset, 8);
  return kiln_from_data(st, KILN_SHAPE(2), KILN_I64, dev);
}

static int64_t *kv_host_i64(kiln_tensor *t) {
  int64_t *h = malloc((size_t)kiln_numel(t) * 8);
  if (h && kiln_to_host(kiln_contiguous(t), h, (size_t)kiln_numel(t) * 8) != KILN_OK) {
    free(h);
    return NULL;
  }
  return h;
}

static void kv_check_sample_case(kiln_device dev, double T, int64_t k, double p) {
  kiln_scope_begin();
  enum { V = 7, N = 20000 };
  const float l[V] = {2.0f, 1.0f, 0.5f, 0.5f, -1.0f, -INFINITY, 3.0f};
  kiln_tensor *row = kiln_from_data(l, KILN_SHAPE(1, V), KILN_F32, kiln_device_cpu());
  kiln_sample_opts o = kiln_sample_opts_default();
  o.temperature = T, o.top_k = k, o.top_p = p;
  kiln_tensor *pr = kiln_softmax(kiln_to_dtype(kiln_sample_filter(row, &o), KILN_F64), 1);
  double want[V];
  CHECK(pr && kiln_to_host(pr, want, sizeof want) == KILN_OK);
  kiln_tensor *logits = kiln_expand(kiln_to_device(row, dev), KILN_SHAPE(N, V)); /* stride 0 over rows */
  kiln_tensor *tok = kiln_sample_tokens(logits, kv_rng(dev, 5, 0), T, k, p);
  int64_t *h = tok ? kv_host_i64(tok) : NULL;
  CHECK(h != NULL);
  int count[V] = {0}, bad = 0;
  for (int i = 0; h && i < N; i++) {
    if (h[i] < 0 || h[i] >= V) bad++;
    else count[h[i]]++;
  }
  CHECK(bad == 0);
  for (int c = 0; h && c < V; c++) {
    double f = (double)count[c] / N, sd = sqrt(want[c] * (1 - want[c]) / N);
    if (want[c] == 0) CHECK(count[c] == 0); /* filtered out: never drawn */
    else CHECK(fabs(f - want[c]) <= 5 * sd + 1e-3);
    if (want[c] == 0 ? count[c] != 0 : fabs(f - want[c]) > 5 * sd + 1e-3)
      printf("sample_tokens T %g k %lld p %g: class %d drawn %.4f, expected %.4f\n", T, (long long)k, p, c, f, want[c]);
  }
  /* the same state draws the same tokens; the next offset other ones */
  kiln_tensor *again = kiln_sample_tokens(logits, kv_rng(dev, 5, 0), T, k, p);
  kiln_tensor *next = kiln_sample_tokens(logits, kv_rng(dev, 5, (N + 1) / 2), T, k, p);
  CHECK(again && kv_equal(tok, again));
  CHECK(next && (k == 1) == kv_equal(tok, next)); /* top-1 draws the argmax whatever the state */
  free(h);
  kiln_scope_end();
}

/* A GPT-2-sized vocabulary: every token drawn survives kiln_sample_filter. Returns the
** tokens (kept by the caller's scope) for cross-device comparisons. */
static kiln_tensor *kv_check_sample_vocab(kiln_device dev, kiln_dtype dt) {
  enum { N = 64, V = 50257 };
  kiln_generator *g = kiln_generator_new(9);
  kiln_tensor *logits = kiln_to_dtype(kiln_mul_scalar(kiln_randn(KILN_SHAPE(N, V), KILN_F32, dev, g), 3), dt);
  kiln_generator_free(g);
  kiln_sample_opts o = kiln_sample_opts_default();
  o.temperature = 0.8, o.top_k = 50, o.top_p = 0.95;
  kiln_tensor *tok = kiln_sample_tokens(logits, kv_rng(dev, 77, 3), o.temperature, o.top_k, o.top_p);
  kiln_tensor *kept = kiln_sample_filter(kiln_to_device(logits, kiln_device_cpu()), &o); /* -inf: removed */
  kiln_tensor *at = tok ? kiln_gather(kept, 1, kiln_unsqueeze(kiln_to_device(tok, kiln_device_cpu()), 1)) : NULL;
  kiln_tensor *mn = at ? kiln_amin(at, 0, NULL, false) : NULL;
  CHECK(mn && isfinite(kiln_item(mn)));
  return tok;
}

/* temperature 0: the first maximum, NaN largest; equal to kiln_argmax on a vocabulary. */
static void kv_check_argmax(kiln_device dev) {
  kiln_scope_begin();
  const float l[4][6] = {{1, 3, 3, -2, 0, 3}, {-INFINITY, -INFINITY, -5, -INFINITY, -5, -6},
                         {2, NAN, 7, NAN, 1, 0}, {-1, -1, -1, -1, -1, -1}};
  const int64_t want[4] = {1, 2, 1, 0};
  kiln_tensor *t = kiln_sample_tokens(kiln_from_data(l, KILN_SHAPE(4, 6), KILN_F32, dev), NULL, 0, 5, 0.5);
  int64_t *h = t ? kv_host_i64(t) : NULL;
  CHECK(h && memcmp(h, want, sizeof want) == 0);
  free(h);
  const kiln_dtype dts[] = {KILN_F32, KILN_BF16, KILN_F16};
  for (int i = 0; i < 3; i++) {
    kiln_generator *g = kiln_generator_new(21 + (uint64_t)i);
    kiln_tensor *x = kiln_to_dtype(kiln_randn(KILN_SHAPE(16, 50257), KILN_F32, dev, g), dts[i]);
    kiln_generator_free(g);
    kiln_tensor *a = kiln_sample_tokens(x, NULL, 0, 0, 1);
    kiln_tensor *b = kiln_argmax(kiln_to_device(x, kiln_device_cpu()), 1, false);
    CHECK(a && b && kv_equal(a, b));
  }
  kiln_scope_end();
}

static void kv_check_sample(kiln_device dev) {
  kv_check_sample_case(dev, 1.0, 0, 1.0);
  kv_check_sample_case(dev, 0.7, 4, 1.0); /* the 4th largest is tied: 5 tokens stay */
  kv_check_sample_case(dev, 1.0, 0, 0.8);
  kv_check_sample_case(dev, 1.3, 5, 0.9);
  kv_check_sample_case(dev, 0.5, 1, 1.0); /* top-1: the argmax */
  kv_check_argmax(dev);
  kiln_scope_begin();
  CHECK(kv_check_sample_vocab(dev, KILN_BF16) != NULL);
  kiln_tensor *l = kiln_zeros(KILN_SHAPE(2, 5), KILN_F32, dev), *rng = kv_rng(dev, 1, 0);
  CHECK(!kiln_sample_tokens(l, rng, -1, 0, 1) && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT);
  CHECK(!kiln_sample_tokens(l, NULL, 1, 0, 1) && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT);
  CHECK(!kiln_sample_tokens(l, rng, 1, -1, 1) && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT);
  CHECK(!kiln_sample_tokens(l, rng, 1, 0, 1.5) && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT);
  CHECK(!kiln_sample_tokens(l, kiln_zeros(KILN_SHAPE(3), KILN_I64, dev), 1, 0, 1) && kiln_last_error() == KILN_ERR_SHAPE);
  CHECK(!kiln_sample_tokens(kiln_zeros(KILN_SHAPE(5), KILN_F32, dev), rng, 1, 0, 1) && kiln_last_error() == KILN_ERR_SHAPE);
  kiln_clear_error();
  kiln_scope_end();
}

/* Every check above on dev, in the order test_ops_kv and test_cuda_kv run them. */
static void kv_check_all(kiln_device dev) {
  kv_check_attention(dev);
  kv_check_attention_errors(dev);
  kv_check_append(dev);
  kv_check_index_copy(dev);
  kv_check_index_copy_errors(dev);
  kv_check_sample(dev);
  kv_check_add_ln(dev);
  kv_check_linear(dev);
}

#endif
