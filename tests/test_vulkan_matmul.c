/*
** The Vulkan matrix-product kernels against an f64 CPU reference: every path the device
** takes (tensor cores for f16 where offered, the register-blocked 128x128 kernel for
** f32/f16/bf16, the general 64x64 kernel for odd strides and the mask), in all four
** layouts (A and B plain or transposed), on exact tiles, on edges that are not multiples of
** the tile, of K's step or of a vector (sliced views), batched, and with the fused bias and
** ReLU of linear. The fallback policy is at error, so a product that leaves the device
** fails. Prints which kernel each dtype's large products take (kiln_vulkan_matmul_path).
** Skipped (77) without a Vulkan device; on CI it runs on lavapipe.
*/
#include "check.h"
#include "tensor_cmp.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static kiln_device vk, cpu;
static kiln_generator *gen;

/* A random [rows, cols] operand of dtype dt, on the CPU (*host) and on vulkan:0 (*dev), as
** the same view of the same storage: transposed (the storage is [cols, rows + pad]) or not
** ([rows, cols + pad]); padded, the leading stride is the size rounded up to 8. */
static void operand(int64_t batch, int64_t rows, int64_t cols, bool padded, bool transposed, kiln_dtype dt,
                    kiln_tensor **host, kiln_tensor **dev) {
  int64_t r = transposed ? cols : rows, c0 = transposed ? rows : cols, pad = padded ? (8 - c0 % 8) % 8 : 0;
  int64_t c = c0 + pad;
  kiln_tensor *t = batch > 0 ? kiln_randn(KILN_SHAPE(batch, r, c), KILN_F32, cpu, gen)
                             : kiln_randn(KILN_SHAPE(r, c), KILN_F32, cpu, gen);
  int d = batch > 0 ? 1 : 0;
  t = kiln_to_dtype(t, dt);
  kiln_tensor *v[2] = {t, kiln_to_device(t, vk)};
  for (int i = 0; i < 2; i++) {
    v[i] = kiln_slice(v[i], d + 1, 0, c - pad, 1);
    if (transposed) v[i] = kiln_transpose(v[i], d, d + 1);
  }
  *host = v[0], *dev = v[1];
}

/* C = A @ B on vulkan:0 (A [m, k], B [k, n], each transposed or not) against f64 on the
** CPU computed from the same (rounded) inputs; the tolerance is the output dtype's
** rounding plus f32 accumulation over k terms of size ~1. */
static void check_product(const char *what, kiln_dtype dt, int64_t batch, int64_t m, int64_t n, int64_t k,
                          bool pad, bool at, bool bt) {
  kiln_scope_begin();
  kiln_tensor *a, *b, *a_dev, *b_dev;
  operand(batch, m, k, pad, at, dt, &a, &a_dev);
  operand(batch, k, n, pad, bt, dt, &b, &b_dev);
  kiln_tensor *got = kiln_matmul(a_dev, b_dev);
  kiln_tensor *ref = kiln_matmul(kiln_to_dtype(a, KILN_F64), kiln_to_dtype(b, KILN_F64));
  double rtol = dt == KILN_F32 ? 1e-5 : dt == KILN_F16 ? 2e-3 : 1e-2;
  double atol = (dt == KILN_F32 ? 1e-5 : 1e-3) * sqrt((double)k);
  double e = rel_err(got, ref, rtol, atol);
  if (!(e <= 1))
    fprintf(stderr, "  %s %s batch %lld [%lld, %lld]%s @ [%lld, %lld]%s%s: error %.3g of the tolerance\n",
            what, kiln_dtype_name(dt), (long long)batch, (long long)m, (long long)k, at ? "^T" : "",
            (long long)k, (long long)n, bt ? "^T" : "", pad ? " padded" : "", e);
  CHECK(e <= 1);
  kiln_scope_end();
}

static void test_products(void) {
  const kiln_dtype dts[3] = {KILN_F32, KILN_F16, KILN_BF16};
  for (int q = 0; q < 3; q++) {
    kiln_dtype dt = dts[q];
    for (int l = 0; l < 4; l++) {
      bool at = l & 1, bt = l & 2;
      /* whole 128x128 tiles */
      check_product("tiles", dt, 0, 128, 128, 64, false, at, bt);
      /* edges: m and n not multiples of 128, k of the kernels' steps (8 and 32); sizes
      ** multiples of 8 (what tensor cores need) */
      check_product("edges", dt, 0, 136, 200, 40, false, at, bt);
      /* odd sizes in a padded storage (leading strides multiples of 8, sizes not): the
      ** 128x128 kernel's element-wise edge loads */
      check_product("odd", dt, 0, 131, 133, 45, true, at, bt);
    }
    /* batched, and strides that are no multiple of 4 (the 64x64 kernel) */
    check_product("batched", dt, 3, 136, 144, 64, false, false, true);
    check_product("unaligned", dt, 0, 130, 129, 37, false, false, false);
  }
  /* a GPU takes the 128x128 kernels only from about one tile per multiprocessor (128 tiles):
  ** one product that large in each dtype there (a CPU device takes them at any size) */
  kiln_device_info info;
  if (kiln_device_info_get(vk, &info) == KILN_OK && !strstr(info.name, "llvmpipe"))
    for (int q = 0; q < 3; q++) check_product("large", dts[q], 0, 1536, 1544, 264, false, false, q == 2);
}

/* linear with a fused bias and ReLU, forward (x @ w^T: B is k-contiguous) and backward */
static void test_linear_relu(void) {
  kiln_scope_begin();
  kiln_tensor *x = kiln_randn(KILN_SHAPE(257, 136), KILN_F32, cpu, gen);
  kiln_tensor *w = kiln_randn(KILN_SHAPE(192, 136), KILN_F32, cpu, gen);
  kiln_tensor *bias = kiln_randn(KILN_SHAPE(192), KILN_F32, cpu, gen);
  kiln_tensor *ref =
      kiln_linear_relu(kiln_to_dtype(x, KILN_F64), kiln_to_dtype(w, KILN_F64), kiln_to_dtype(bias, KILN_F64));
  kiln_tensor *got = kiln_linear_relu(kiln_to_device(x, vk), kiln_to_device(w, vk), kiln_to_device(bias, vk));
  CHECK(rel_err(got, ref, 1e-5, 1e-4) <= 1);
  kiln_tensor *x16 = kiln_to_dtype(x, KILN_F16), *w16 = kiln_to_dtype(w, KILN_F16);
  kiln_tensor *b16 = kiln_to_dtype(bias, KILN_F16);
  kiln_tensor *h16 = kiln_linear_relu(kiln_to_device(x16, vk), kiln_to_device(w16, vk), kiln_to_device(b16, vk));
  kiln_tensor *r16 =
      kiln_linear_relu(kiln_to_dtype(x16, KILN_F64), kiln_to_dtype(w16, KILN_F64), kiln_to_dtype(b16, KILN_F64));
  CHECK(rel_err(h16, r16, 2e-3, 2e-2) <= 1);
  kiln_scope_end();
}

static void test_paths(void) {
  char path[512];
  const kiln_dtype dts[3] = {KILN_F16, KILN_BF16, KILN_F32};
  for (int q = 0; q < 3; q++) {
    CHECK(kiln_vulkan_matmul_path(0, dts[q], 8192, 8192, 8192, path, sizeof path) == KILN_OK && path[0]);
    printf("  matmul %s 8192^3 on vulkan:0: %s\n", kiln_dtype_name(dts[q]), path);
  }
  CHECK(kiln_vulkan_matmul_path(0, KILN_I64, 8, 8, 8, path, sizeof path) == KILN_ERR_INVALID_ARGUMENT);
  CHECK(strstr(kiln_last_error_message(), "kiln_vulkan_matmul_path") != NULL);
  kiln_clear_error();
  CHECK(kiln_vulkan_matmul_path(99, KILN_F32, 8, 8, 8, path, sizeof path) == KILN_ERR_DEVICE);
  kiln_clear_error();
  CHECK(kiln_vulkan_coop_shapes(0, path, sizeof path) == KILN_OK);
  if (path[0]) printf("  VK_NV_cooperative_matrix shapes: %s\n", path);
}

int main(void) {
  if (!kiln_backend_built(KILN_DEVICE_VULKAN)) {
    printf("test_vulkan_matmul: skipped (built without Vulkan)\n");
    return 77;
  }
  const char *why = NULL;
  if (!kiln_backend_available(KILN_DEVICE_VULKAN, &why) || kiln_device_count(KILN_DEVICE_VULKAN) < 1) {
    printf("test_vulkan_matmul: skipped (no Vulkan device: %s)\n", why ? why : "?");
    return 77;
  }
  vk = (kiln_device){KILN_DEVICE_VULKAN, 0};
  cpu = kiln_device_cpu();
  gen = kiln_generator_new(18);
  kiln_fallback_policy saved = kiln_fallback_policy_get();
  kiln_set_fallback_policy(KILN_FALLBACK_ERROR);
  test_paths();
  test_products();
  test_linear_relu();
  kiln_set_fallback_policy(saved);
  kiln_generator_free(gen);
  printf("test_vulkan_matmul: %d failures\n", failures);
  return failures ? 1 : 0;
}
