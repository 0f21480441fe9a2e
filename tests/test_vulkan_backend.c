/*
** The Vulkan backend beyond the op harness (which compares every op case with the CPU on
** every Vulkan device): device choice, the caching allocator's statistics, limit and
** recoverable out-of-memory error, copies of odd sizes and of large blocks, the deferred
** index error, a short training run against the CPU, and "no loader" (a child process
** with KILN_VULKAN_LOADER pointing nowhere: a clean reason, the CPU still works).
** Skipped (77) without a Vulkan device; on CI it runs on lavapipe (mesa-vulkan-drivers).
*/
#define _POSIX_C_SOURCE 200809L
#include "check.h"
#include "tensor_cmp.h"

#include <kiln_nn.h>
#include <kiln_optim.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static kiln_device vk;

static void test_device_choice(void) {
  kiln_device_info info;
  CHECK(kiln_device_info_get(vk, &info) == KILN_OK);
  char name[24];
  kiln_device_str(vk, name, sizeof name);
  CHECK(strcmp(name, "vulkan:0") == 0);
  kiln_device parsed;
  CHECK(kiln_device_parse("vulkan:0", &parsed) == KILN_OK && kiln_device_equal(parsed, vk));
  CHECK(kiln_device_parse("vulkan:99", &parsed) == KILN_ERR_DEVICE);
  kiln_clear_error();
  /* lavapipe is a CPU: never the default device (KILN_DEVICE unset) */
  if (strstr(info.name, "llvmpipe") && !getenv("KILN_DEVICE"))
    CHECK(kiln_device_best().type == KILN_DEVICE_CPU);
}

static void test_memory(void) {
  kiln_scope_begin();
  kiln_memory_stats s0, s1;
  CHECK(kiln_memory_stats_get(vk, &s0) == KILN_OK);
  kiln_tensor *small = kiln_zeros(KILN_SHAPE(100), KILN_F32, vk);
  kiln_tensor *big = kiln_zeros(KILN_SHAPE(3 << 20), KILN_F32, vk); /* 12 MiB: a block of its own */
  CHECK(small && big);
  CHECK(kiln_memory_stats_get(vk, &s1) == KILN_OK);
  CHECK(s1.allocated >= s0.allocated + 12 * (1 << 20) && s1.reserved >= s1.allocated);
  CHECK(s1.num_allocs >= s0.num_allocs + 2 && s1.peak_allocated >= s1.allocated);
  /* the limit: an allocation past it fails with the numbers, and the program goes on */
  CHECK(kiln_memory_set_limit(vk, s1.reserved + (1 << 20)) == KILN_OK);
  kiln_tensor *huge = kiln_zeros(KILN_SHAPE(64 << 20), KILN_F32, vk);
  CHECK(huge == NULL && kiln_last_error() == KILN_ERR_OOM);
  CHECK(strstr(kiln_last_error_message(), "vulkan:0") && strstr(kiln_last_error_message(), "limit"));
  kiln_clear_error();
  kiln_memory_stats s2;
  CHECK(kiln_memory_stats_get(vk, &s2) == KILN_OK && s2.num_ooms == s1.num_ooms + 1);
  CHECK(kiln_memory_set_limit(vk, 0) == KILN_OK);
  kiln_tensor *again = kiln_full(KILN_SHAPE(5 << 20), 2.5, KILN_F32, vk);
  CHECK(again && kiln_item(kiln_sum_all(again)) == 2.5 * (5 << 20));
  kiln_scope_end();
  /* freed blocks stay cached until empty_cache gives them back */
  kiln_memory_stats s3, s4;
  CHECK(kiln_memory_stats_get(vk, &s3) == KILN_OK && s3.allocated <= s0.allocated);
  CHECK(kiln_memory_empty_cache(vk) == KILN_OK);
  CHECK(kiln_memory_stats_get(vk, &s4) == KILN_OK && s4.reserved < s3.reserved);
}

static void test_copies(void) {
  kiln_scope_begin();
  /* 7 bytes: fill and zeros of a size vkCmdFillBuffer cannot do */
  uint8_t b[7] = {1, 2, 3, 4, 5, 6, 7}, back[7] = {0};
  kiln_tensor *t = kiln_from_data(b, KILN_SHAPE(7), KILN_U8, vk);
  CHECK(t && kiln_to_host(t, back, sizeof back) == KILN_OK && memcmp(b, back, 7) == 0);
  kiln_tensor *z = kiln_zeros(KILN_SHAPE(7), KILN_U8, vk);
  CHECK(z && kiln_to_host(z, back, sizeof back) == KILN_OK);
  for (int i = 0; i < 7; i++) CHECK(back[i] == 0);
  /* a large round trip (more than the staging buffer on a discrete GPU) */
  int64_t n = 5 << 20;
  float *h = malloc((size_t)n * sizeof *h), *h2 = malloc((size_t)n * sizeof *h2);
  CHECK(h && h2);
  if (h && h2) {
    for (int64_t i = 0; i < n; i++) h[i] = (float)(i % 1000) * 0.5f;
    kiln_tensor *d = kiln_from_data(h, KILN_SHAPE(n), KILN_F32, vk);
    kiln_tensor *d2 = d ? kiln_contiguous(kiln_slice(d, 0, 1, n, 2)) : NULL; /* strided copy */
    CHECK(d && d2 && kiln_to_host(d, h2, (size_t)n * sizeof *h2) == KILN_OK);
    CHECK(memcmp(h, h2, (size_t)n * sizeof *h) == 0);
    CHECK(d2 && kiln_to_host(d2, h2, (size_t)(n / 2) * sizeof *h2) == KILN_OK);
    bool same = true;
    for (int64_t i = 0; i < n / 2; i++) same = same && h2[i] == h[1 + 2 * i];
    CHECK(same);
  }
  free(h);
  free(h2);
  kiln_scope_end();
}

static void test_bad_index(void) {
  kiln_scope_begin();
  kiln_tensor *src = kiln_ones(KILN_SHAPE(4, 3), KILN_F32, vk);
  int64_t idx[2] = {1, 9};
  kiln_tensor *ix = kiln_from_data(idx, KILN_SHAPE(2), KILN_I64, vk);
  kiln_tensor *out = kiln_index_select(src, 0, ix);
  /* the kernel cannot fail as it runs: the next sync reports it */
  kiln_status st = out ? kiln_device_synchronize(vk) : kiln_last_error();
  CHECK(st == KILN_ERR_INDEX);
  kiln_clear_error();
  CHECK(kiln_item(kiln_sum_all(src)) == 12.0); /* the device still works */
  kiln_scope_end();
}

/* scatter_add and index_add in f16 and bf16 add in place with compare-and-swap on the
** 32-bit word that holds each element: two invocations adding into the two halves of one
** word at once must both land, and the half nobody adds to must keep its value. Many +1
** and -1 into few cells (5 columns: words straddle the rows), every partial sum an integer
** under 256 (exact in both dtypes, in any order), column 4 never indexed and holding 7;
** the fallback at error, so a kernel that is not native fails here. */
static void test_half_adds(void) {
  kiln_fallback_policy saved = kiln_fallback_policy_get();
  kiln_set_fallback_policy(KILN_FALLBACK_ERROR);
  enum { R = 3, C = 5, S = 400 };
  int64_t idx[R * S];
  float src[R * S], want[R * C], base[R * C];
  uint32_t r = 12345;
  for (int i = 0; i < R * C; i++) base[i] = i % C == C - 1 ? 7.0f : 0.0f, want[i] = base[i];
  for (int i = 0; i < R * S; i++) {
    r = r * 1103515245u + 12345u;
    idx[i] = (int64_t)((r >> 16) % (C - 1));
    src[i] = (r >> 8) & 1 ? 1.0f : -1.0f;
    want[(i / S) * C + idx[i]] += src[i];
  }
  kiln_dtype dts[2] = {KILN_F16, KILN_BF16};
  for (int k = 0; k < 2; k++) {
    kiln_scope_begin();
    kiln_tensor *t = kiln_to_dtype(kiln_from_data(base, KILN_SHAPE(R, C), KILN_F32, vk), dts[k]);
    kiln_tensor *ix = kiln_from_data(idx, KILN_SHAPE(R, S), KILN_I64, vk);
    kiln_tensor *sv = kiln_to_dtype(kiln_from_data(src, KILN_SHAPE(R, S), KILN_F32, vk), dts[k]);
    kiln_tensor *out = kiln_to_dtype(kiln_scatter_add(t, 1, ix, sv), KILN_F32);
    float got[R * C];
    CHECK(out && kiln_to_host(out, got, sizeof got) == KILN_OK);
    for (int i = 0; out && i < R * C; i++) CHECK(got[i] == want[i]);
    /* index_add through embedding's backward: rows of a (4, 3) table, ids repeated */
    int64_t ids[64];
    for (int i = 0; i < 64; i++) ids[i] = i % 4 == 3 ? 1 : i % 4;
    kiln_tensor *w = kiln_zeros(KILN_SHAPE(4, 3), dts[k], vk);
    kiln_requires_grad_(w, true);
    kiln_tensor *e = kiln_embedding(w, kiln_from_data(ids, KILN_SHAPE(64), KILN_I64, vk));
    CHECK(e && kiln_backward(kiln_sum_all(e), NULL) == KILN_OK);
    float g[12];
    kiln_tensor *gw = kiln_grad(w);
    CHECK(gw && kiln_to_host(kiln_to_dtype(gw, KILN_F32), g, sizeof g) == KILN_OK);
    for (int i = 0; gw && i < 12; i++) CHECK(g[i] == (i / 3 == 1 ? 32.0f : i / 3 == 3 ? 0.0f : 16.0f));
    kiln_scope_end();
  }
  kiln_set_fallback_policy(saved);
}

static kiln_tensor *rg(kiln_tensor *t) {
  if (t) kiln_requires_grad_(t, true);
  return t;
}

/* The kernels beyond the op families of the first version (creation, scans, norms, the
** window ops of convolution, the AMP and Adam list ops) run natively: the fallback is at
** error, so a kernel that falls back fails here; each result is compared with the CPU's
** (the harness compares every case too, but with the fallback allowed on Vulkan). */
static void test_native_ops(void) {
  kiln_fallback_policy saved = kiln_fallback_policy_get();
  kiln_set_fallback_policy(KILN_FALLBACK_ERROR);
  kiln_device cpu = kiln_device_cpu();
  kiln_scope_begin();
  kiln_generator *g = kiln_generator_new(11);
  kiln_tensor *xc = kiln_randn(KILN_SHAPE(2, 3, 7, 9), KILN_F32, cpu, g);
  kiln_tensor *xv = kiln_to_device(xc, vk);
  CHECK(xv != NULL);
  /* eye, tril/triu, cumsum (float and integer) */
  CHECK(rel_err(kiln_eye(5, 7, KILN_F32, vk), kiln_eye(5, 7, KILN_F32, cpu), 0, 1e-12) == 0);
  CHECK(rel_err(kiln_tril(xv, -1), kiln_tril(xc, -1), 0, 1e-12) == 0);
  CHECK(rel_err(kiln_triu(kiln_transpose(xv, 2, 3), 2), kiln_triu(kiln_transpose(xc, 2, 3), 2), 0, 1e-12) == 0);
  CHECK(rel_err(kiln_cumsum(xv, 3), kiln_cumsum(xc, 3), 1e-5, 1e-5) <= 1);
  CHECK(rel_err(kiln_cumsum(xv, 1), kiln_cumsum(xc, 1), 1e-5, 1e-5) <= 1);
  kiln_tensor *ic = kiln_randint(-50, 50, KILN_SHAPE(4, 33), KILN_I32, cpu, g);
  CHECK(rel_err(kiln_cumsum(kiln_to_device(ic, vk), 1), kiln_cumsum(ic, 1), 0, 1e-12) == 0);
  /* topk with ties and a NaN (largest and smallest): values and indices as the CPU's */
  float th[5 * 40];
  for (int e = 0; e < 5 * 40; e++) th[e] = (float)((e * 7919) % 13) - 6.0f;
  th[17] = NAN;
  kiln_tensor *tc = kiln_from_data(th, KILN_SHAPE(5, 40), KILN_F32, cpu), *tv = kiln_to_device(tc, vk);
  for (int lg2 = 0; lg2 < 2; lg2++) {
    kiln_tensor *ic2 = NULL, *iv2 = NULL;
    kiln_tensor *vc2 = kiln_topk(tc, 6, 1, lg2 == 1, true, &ic2), *vv2 = kiln_topk(tv, 6, 1, lg2 == 1, true, &iv2);
    CHECK(vc2 && vv2 && ic2 && iv2);
    double *hc = malloc(30 * sizeof(double)), *hv = malloc(30 * sizeof(double));
    int64_t jc[30], jv[30];
    CHECK(kiln_to_host(kiln_to_dtype(vc2, KILN_F64), hc, 240) == KILN_OK &&
          kiln_to_host(kiln_to_dtype(kiln_to_device(vv2, cpu), KILN_F64), hv, 240) == KILN_OK);
    CHECK(kiln_to_host(ic2, jc, sizeof jc) == KILN_OK && kiln_to_host(kiln_to_device(iv2, cpu), jv, sizeof jv) == KILN_OK);
    bool same = true;
    for (int e = 0; e < 30; e++) same = same && jc[e] == jv[e] && (hc[e] == hv[e] || (isnan(hc[e]) && isnan(hv[e])));
    CHECK(same);
    free(hc), free(hv);
  }
  /* integer sums are exact (int64), e.g. fashion-mnist's count of correct predictions */
  CHECK(rel_err(kiln_sum_all(kiln_to_device(ic, vk)), kiln_sum_all(ic), 0, 1e-12) == 0);
  CHECK(rel_err(kiln_sum_all(kiln_eq(kiln_to_device(ic, vk), kiln_to_device(ic, vk))), kiln_sum_all(kiln_eq(ic, ic)), 0,
                1e-12) == 0);
  /* layer norm and RMS norm, forward and gradients */
  kiln_tensor *wc = rg(kiln_randn(KILN_SHAPE(9), KILN_F32, cpu, g));
  kiln_tensor *bc = rg(kiln_randn(KILN_SHAPE(9), KILN_F32, cpu, g));
  kiln_tensor *wv = rg(kiln_to_device(kiln_detach(wc), vk));
  kiln_tensor *bv = rg(kiln_to_device(kiln_detach(bc), vk));
  kiln_tensor *x2c = rg(kiln_detach(xc)), *x2v = rg(kiln_detach(xv));
  kiln_tensor *lc = kiln_layer_norm(x2c, 1, (const int64_t[]){9}, wc, bc, 1e-5);
  kiln_tensor *lv = kiln_layer_norm(x2v, 1, (const int64_t[]){9}, wv, bv, 1e-5);
  CHECK(rel_err(lv, lc, 1e-4, 1e-5) <= 1);
  kiln_tensor *gc = kiln_randn(KILN_SHAPE(2, 3, 7, 9), KILN_F32, cpu, g);
  CHECK(kiln_backward(kiln_sum_all(kiln_mul(lc, gc)), NULL) == KILN_OK);
  CHECK(kiln_backward(kiln_sum_all(kiln_mul(lv, kiln_to_device(gc, vk))), NULL) == KILN_OK);
  CHECK(rel_err(kiln_grad(x2v), kiln_grad(x2c), 1e-4, 1e-4) <= 1);
  CHECK(rel_err(kiln_grad(wv), kiln_grad(wc), 1e-4, 1e-4) <= 1);
  CHECK(rel_err(kiln_grad(bv), kiln_grad(bc), 1e-4, 1e-4) <= 1);
  CHECK(rel_err(kiln_rms_norm(xv, 1, (const int64_t[]){9}, wv, 1e-6), kiln_rms_norm(xc, 1, (const int64_t[]){9}, wc, 1e-6),
                1e-4, 1e-5) <= 1);
  /* convolution through IM2COL + MATMUL, its gradient through COL2IM; max pooling */
  kiln_tensor *kc = rg(kiln_randn(KILN_SHAPE(4, 3, 3, 2), KILN_F32, cpu, g));
  kiln_tensor *kv = rg(kiln_to_device(kiln_detach(kc), vk));
  kiln_tensor *x3c = rg(kiln_detach(xc)), *x3v = rg(kiln_detach(xv));
  const int64_t st[2] = {2, 1}, pd[2] = {1, 0}, dl[2] = {1, 2};
  kiln_tensor *cc = kiln_conv2d(x3c, kc, NULL, st, pd, dl, 1), *cv = kiln_conv2d(x3v, kv, NULL, st, pd, dl, 1);
  CHECK(rel_err(cv, cc, 1e-4, 1e-4) <= 1);
  CHECK(kiln_backward(kiln_sum_all(kiln_mul(cc, cc)), NULL) == KILN_OK);
  CHECK(kiln_backward(kiln_sum_all(kiln_mul(cv, cv)), NULL) == KILN_OK);
  CHECK(rel_err(kiln_grad(x3v), kiln_grad(x3c), 1e-4, 1e-4) <= 1);
  CHECK(rel_err(kiln_grad(kv), kiln_grad(kc), 1e-4, 1e-4) <= 1);
  kiln_tensor *ixc = NULL, *ixv = NULL;
  const int64_t pk[2] = {3, 2}, ps[2] = {2, 2}, pp[2] = {1, 1}, pdl[2] = {1, 1};
  CHECK(rel_err(kiln_max_pool2d(xv, pk, ps, pp, pdl, &ixv), kiln_max_pool2d(xc, pk, ps, pp, pdl, &ixc), 0, 1e-12) == 0);
  CHECK(rel_err(ixv, ixc, 0, 1e-12) == 0);
  /* attention's forward: causal, a bool mask, dropout with
  ** the CPU's Philox mapping (the same generator state on both devices) */
  kiln_tensor *qc = kiln_randn(KILN_SHAPE(2, 3, 37, 16), KILN_F32, cpu, g);
  kiln_tensor *kc2 = kiln_randn(KILN_SHAPE(2, 3, 70, 16), KILN_F32, cpu, g);
  kiln_tensor *vc = kiln_randn(KILN_SHAPE(2, 3, 70, 8), KILN_F32, cpu, g);
  kiln_tensor *qv = kiln_to_device(qc, vk), *kv2 = kiln_to_device(kc2, vk), *vv = kiln_to_device(vc, vk);
  CHECK(rel_err(kiln_scaled_dot_product_attention(qv, kv2, vv, NULL, true, 0, 0, NULL),
                kiln_scaled_dot_product_attention(qc, kc2, vc, NULL, true, 0, 0, NULL), 1e-4, 1e-5) <= 1);
  kiln_tensor *mc = kiln_gt(kiln_rand(KILN_SHAPE(2, 1, 37, 70), KILN_F32, cpu, g), kiln_full(KILN_SHAPE0, 0.3, KILN_F32, cpu));
  kiln_generator *d1 = kiln_generator_new(9), *d2 = kiln_generator_new(9);
  CHECK(rel_err(kiln_scaled_dot_product_attention(qv, kv2, vv, kiln_to_device(mc, vk), false, 0.25, 0.3, d1),
                kiln_scaled_dot_product_attention(qc, kc2, vc, mc, false, 0.25, 0.3, d2), 1e-4, 1e-5) <= 1);
  kiln_generator_free(d1), kiln_generator_free(d2);
  /* and its backward: the gradients of q, k, v agree (the same dropout drawn again) */
  kiln_tensor *qa = rg(kiln_detach(qc)), *ka = rg(kiln_detach(kc2)), *va = rg(kiln_detach(vc));
  kiln_tensor *qb = rg(kiln_detach(qv)), *kb = rg(kiln_detach(kv2)), *vb = rg(kiln_detach(vv));
  kiln_tensor *go = kiln_randn(KILN_SHAPE(2, 3, 37, 8), KILN_F32, cpu, g);
  d1 = kiln_generator_new(4), d2 = kiln_generator_new(4);
  kiln_tensor *oa = kiln_scaled_dot_product_attention(qa, ka, va, mc, false, 0.2, 0, d1);
  kiln_tensor *ob = kiln_scaled_dot_product_attention(qb, kb, vb, kiln_to_device(mc, vk), false, 0.2, 0, d2);
  CHECK(kiln_backward(kiln_sum_all(kiln_mul(oa, go)), NULL) == KILN_OK);
  CHECK(kiln_backward(kiln_sum_all(kiln_mul(ob, kiln_to_device(go, vk))), NULL) == KILN_OK);
  CHECK(rel_err(kiln_grad(qb), kiln_grad(qa), 1e-4, 1e-5) <= 1);
  CHECK(rel_err(kiln_grad(kb), kiln_grad(ka), 1e-4, 1e-5) <= 1);
  CHECK(rel_err(kiln_grad(vb), kiln_grad(va), 1e-4, 1e-5) <= 1);
  kiln_generator_free(d1), kiln_generator_free(d2);
  /* the elementwise fast path (contiguous aligned f32, vec4s, a capped grid walked in
  ** strides) with a tail of 3, and the strided path on an unaligned view of the same */
  int64_t big = (1 << 21) + 3;
  kiln_tensor *ua = kiln_randn(KILN_SHAPE(big), KILN_F32, cpu, g), *ub = kiln_randn(KILN_SHAPE(big), KILN_F32, cpu, g);
  kiln_tensor *va2 = kiln_to_device(ua, vk), *vb2 = kiln_to_device(ub, vk);
  CHECK(rel_err(kiln_add(va2, vb2), kiln_add(ua, ub), 0, 1e-12) == 0);
  CHECK(rel_err(kiln_gelu_tanh(va2), kiln_gelu_tanh(ua), 1e-5, 1e-6) <= 1);
  CHECK(rel_err(kiln_mul(kiln_slice(va2, 0, 1, big, 1), kiln_slice(vb2, 0, 0, big - 1, 1)),
                kiln_mul(kiln_slice(ua, 0, 1, big, 1), kiln_slice(ub, 0, 0, big - 1, 1)), 0, 1e-12) == 0);
  /* matmul's 128x128 tiles (products of 128 or more each way; edges not multiples of the
  ** tile or of K's step of 8): batched with a transposed operand; linear with a fused
  ** bias and ReLU, and its backward (the mask of ReLU, dW with the bias's row sums) */
  kiln_tensor *ma = kiln_randn(KILN_SHAPE(2, 300, 141), KILN_F32, cpu, g);
  kiln_tensor *mb = kiln_randn(KILN_SHAPE(2, 260, 141), KILN_F32, cpu, g);
  CHECK(rel_err(kiln_matmul(kiln_to_device(ma, vk), kiln_transpose(kiln_to_device(mb, vk), 1, 2)),
                kiln_matmul(ma, kiln_transpose(mb, 1, 2)), 1e-4, 1e-4) <= 1);
  /* f16 products of whole 64x64 tiles: on tensor cores where the device enabled them
  ** (KILN_VK_COOPMAT=1 with VK_NV_cooperative_matrix), else the tiled shaders */
  kiln_tensor *ha = kiln_to_dtype(kiln_randn(KILN_SHAPE(3, 256, 96), KILN_F32, cpu, g), KILN_F16);
  kiln_tensor *hb = kiln_to_dtype(kiln_randn(KILN_SHAPE(3, 96, 192), KILN_F32, cpu, g), KILN_F16);
  CHECK(rel_err(kiln_matmul(kiln_to_device(ha, vk), kiln_to_device(hb, vk)), kiln_matmul(ha, hb), 1e-2, 1e-2) <= 1);
  kiln_tensor *lx = rg(kiln_randn(KILN_SHAPE(257, 133), KILN_F32, cpu, g)), *lw = rg(kiln_randn(KILN_SHAPE(190, 133), KILN_F32, cpu, g));
  kiln_tensor *lb = rg(kiln_randn(KILN_SHAPE(190), KILN_F32, cpu, g));
  kiln_tensor *vx = rg(kiln_to_device(kiln_detach(lx), vk)), *vw = rg(kiln_to_device(kiln_detach(lw), vk));
  kiln_tensor *vbias = rg(kiln_to_device(kiln_detach(lb), vk));
  kiln_tensor *ly = kiln_linear_relu(lx, lw, lb), *vy = kiln_linear_relu(vx, vw, vbias);
  CHECK(rel_err(vy, ly, 1e-4, 1e-4) <= 1);
  kiln_tensor *lg = kiln_randn(KILN_SHAPE(257, 190), KILN_F32, cpu, g);
  CHECK(kiln_backward(kiln_sum_all(kiln_mul(ly, lg)), NULL) == KILN_OK);
  CHECK(kiln_backward(kiln_sum_all(kiln_mul(vy, kiln_to_device(lg, vk))), NULL) == KILN_OK);
  CHECK(rel_err(kiln_grad(vx), kiln_grad(lx), 1e-4, 1e-4) <= 1);
  CHECK(rel_err(kiln_grad(vw), kiln_grad(lw), 1e-4, 1e-4) <= 1);
  CHECK(rel_err(kiln_grad(vbias), kiln_grad(lb), 1e-4, 1e-4) <= 1);
  /* AMP's unscale: values scaled, the flag set by an inf only */
  kiln_tensor *fv = kiln_zeros(KILN_SHAPE(1), KILN_F32, vk);
  kiln_tensor *g1 = kiln_to_device(xc, vk), *g2 = kiln_full(KILN_SHAPE(3), 4.0, KILN_F32, vk);
  CHECK(kiln_amp_unscale_(2, (kiln_tensor *const[]){g1, g2}, fv, 0.5) == KILN_OK);
  CHECK(rel_err(g1, kiln_mul_scalar(xc, 0.5), 0, 1e-12) == 0 && kiln_item(fv) == 0.0);
  kiln_tensor *g3 = kiln_full(KILN_SHAPE(3), INFINITY, KILN_F32, vk);
  CHECK(kiln_amp_unscale_(1, (kiln_tensor *const[]){g3}, fv, 0.5) == KILN_OK && kiln_item(fv) == 1.0);
  /* arange and randint compute in f64: natively only where the device has shaderFloat64 */
  kiln_tensor *av = kiln_arange(-3, 7.5, 0.1, KILN_F32, vk);
  if (av) {
    CHECK(rel_err(av, kiln_arange(-3, 7.5, 0.1, KILN_F32, cpu), 0, 1e-12) == 0);
    kiln_generator *ga = kiln_generator_new(5), *gb = kiln_generator_new(5);
    CHECK(rel_err(kiln_randint(-7, 1000, KILN_SHAPE(3, 1001), KILN_I64, vk, ga),
                  kiln_randint(-7, 1000, KILN_SHAPE(3, 1001), KILN_I64, cpu, gb), 0, 1e-12) == 0);
    kiln_generator_free(ga), kiln_generator_free(gb);
  } else {
    CHECK(kiln_last_error() == KILN_ERR_UNSUPPORTED);
    printf("test_vulkan_backend: arange/randint fall back on this device (no shaderFloat64)\n");
    kiln_clear_error();
  }
  CHECK(kiln_last_error() == KILN_OK);
  if (kiln_last_error() != KILN_OK) printf("  last error: %s\n", kiln_last_error_message());
  kiln_generator_free(g);
  kiln_scope_end();
  kiln_clear_error();
  kiln_set_fallback_policy(saved);
}

/* The same small MLP and data on the CPU and the device: the losses agree. */
static double train(kiln_device dev, double *first) {
  kiln_manual_seed(7);
  kiln_module *net = kiln_sequential_new();
  kiln_sequential_append(net, kiln_linear_new(6, 16, true, KILN_F32, kiln_device_cpu(), NULL));
  kiln_sequential_append(net, kiln_relu_new());
  kiln_sequential_append(net, kiln_linear_new(16, 3, true, KILN_F32, kiln_device_cpu(), NULL));
  kiln_module_to(net, dev);
  kiln_optim_config cfg = kiln_adamw_config(1e-2);
  kiln_optimizer *opt = kiln_optimizer_new_module(&cfg, net);
  kiln_scope_begin(); /* owns the CPU originals */
  kiln_tensor *x = kiln_keep(kiln_to_device(kiln_randn(KILN_SHAPE(32, 6), KILN_F32, kiln_device_cpu(), NULL), dev));
  kiln_tensor *y = kiln_keep(kiln_to_device(kiln_randint(0, 3, KILN_SHAPE(32), KILN_I64, kiln_device_cpu(), NULL), dev));
  kiln_scope_end();
  double loss = NAN;
  for (int step = 0; step < 30; step++) {
    kiln_scope_begin();
    kiln_tensor *l = kiln_cross_entropy(kiln_module_forward(net, x), y, KILN_REDUCTION_MEAN, -100, 0.0);
    kiln_optimizer_zero_grad(opt);
    kiln_backward(l, NULL);
    kiln_optimizer_step(opt);
    loss = kiln_item(l);
    if (step == 0) *first = loss;
    kiln_scope_end();
  }
  kiln_tensor_free(x);
  kiln_tensor_free(y);
  kiln_optimizer_free(opt);
  kiln_module_free(net);
  return loss;
}

static void test_training(void) {
  double c0 = 0, v0 = 0;
  double c = train(kiln_device_cpu(), &c0);
  kiln_fallback_reset();
  double v = train(vk, &v0);
  CHECK(kiln_last_error() == KILN_OK);
  printf("cpu loss %.6f -> %.6f, vulkan loss %.6f -> %.6f\n", c0, c, v0, v);
  CHECK(fabs(c0 - v0) <= 1e-5 * fabs(c0) + 1e-6);
  CHECK(c < c0 && fabs(c - v) <= 1e-3 * fabs(c) + 1e-4);
}

/* Child: no loader. The backend says why, the CPU works. */
static int child_no_loader(void) {
  const char *why = NULL;
  bool ok = kiln_backend_available(KILN_DEVICE_VULKAN, &why);
  kiln_device d;
  int bad = ok || !why || !strstr(why, "loader") || kiln_device_parse("vulkan", &d) != KILN_ERR_DEVICE;
  kiln_clear_error();
  kiln_scope_begin();
  kiln_tensor *t = kiln_ones(KILN_SHAPE(3), KILN_F32, kiln_device_cpu());
  bad |= !t || kiln_item(kiln_sum_all(t)) != 3.0;
  kiln_scope_end();
  bad |= kiln_device_best().type != KILN_DEVICE_CPU && kiln_device_best().type != KILN_DEVICE_CUDA;
  printf("child: vulkan available=%d why='%s'\n", ok, why ? why : "");
  return bad;
}

static void test_no_loader(void) {
  pid_t pid = fork();
  if (pid == 0) {
    setenv("KILN_VULKAN_LOADER", "/nonexistent/libvulkan.so.1", 1);
    unsetenv("KILN_DEVICE");
    unsetenv("KILN_VULKAN_DISABLE"); /* else the backend gives that as its reason, not the loader */
    char *argv[] = {(char *)"test_vulkan_backend", (char *)"--no-loader", NULL};
    execv("/proc/self/exe", argv);
    _exit(3);
  }
  int status = 0;
  CHECK(pid > 0 && waitpid(pid, &status, 0) == pid);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "--no-loader") == 0) return child_no_loader();
  if (!kiln_backend_built(KILN_DEVICE_VULKAN)) {
    printf("test_vulkan_backend: skipped (built without Vulkan)\n");
    return 77;
  }
  test_no_loader(); /* works whether or not this machine has a device */
  const char *why = NULL;
  if (!kiln_backend_available(KILN_DEVICE_VULKAN, &why) || kiln_device_count(KILN_DEVICE_VULKAN) < 1) {
    printf("test_vulkan_backend: skipped (no Vulkan device: %s)\n", why ? why : "?");
    return failures ? 1 : 77;
  }
  vk = (kiln_device){KILN_DEVICE_VULKAN, 0};
  test_device_choice();
  test_memory();
  test_copies();
  test_bad_index();
  test_half_adds();
  test_native_ops();
  test_training();
  printf("test_vulkan_backend: %d failures\n", failures);
  return failures ? 1 : 0;
}
