/* The KV-cache ops (kiln_index_copy_, kiln_kv_attention) on the CPU, or on the device
** KILN_TEST_DEVICE names (vulkan:0 runs them through the CPU fallback), against f64
** references made of other ops (kv_checks.h); bad input; and, on the CPU, a position or
** length outside the cache is KILN_ERR_INDEX with nothing written. */
#include "kv_checks.h"

int main(void) {
  kiln_device dev = kiln_device_cpu();
  const char *e = getenv("KILN_TEST_DEVICE");
  if (e && *e && kiln_device_parse(e, &dev) != KILN_OK) {
    printf("skipped: KILN_TEST_DEVICE=%s: %s\n", e, kiln_last_error_message());
    return 77;
  }
  kv_check_all(dev);
  if (dev.type == KILN_DEVICE_CPU) {
    kiln_scope_begin();
    kiln_tensor *dst = kiln_zeros(KILN_SHAPE(2, 6), KILN_F32, dev);
    kiln_tensor *src = kiln_ones(KILN_SHAPE(2, 2), KILN_F32, dev);
    CHECK(kiln_index_copy_(dst, 1, kiln_from_data((const int64_t[]){1, 6}, KILN_SHAPE(2), KILN_I64, dev), src) ==
          KILN_ERR_INDEX);
    CHECK(strstr(kiln_last_error_message(), "index 6") != NULL);
    CHECK(kiln_item(kiln_sum(dst, 0, NULL, false)) == 0); /* checked before anything is written */
    CHECK(kiln_index_copy_(dst, 1, kiln_full(KILN_SHAPE(2), -1, KILN_I64, dev), src) == KILN_ERR_INDEX);
    kiln_tensor *q = kiln_zeros(KILN_SHAPE(1, 1, 1, 4), KILN_F32, dev), *k = kiln_zeros(KILN_SHAPE(1, 1, 5, 4), KILN_F32, dev);
    CHECK(!kiln_kv_attention(q, k, k, kiln_full(KILN_SHAPE(1), 6, KILN_I64, dev), 0) && kiln_last_error() == KILN_ERR_INDEX);
    /* append with no room for the new position: nothing written */
    kiln_tensor *cache = kiln_zeros(KILN_SHAPE(2, 1, 1, 5, 4), KILN_F32, dev);
    CHECK(!kiln_kv_attention_append(q, cache, kiln_ones(KILN_SHAPE(2, 1, 1, 1, 4), KILN_F32, dev),
                                    kiln_full(KILN_SHAPE(1), 0, KILN_I64, dev), 0) &&
          kiln_last_error() == KILN_ERR_INDEX);
    CHECK(kiln_item(kiln_sum(cache, 0, NULL, false)) == 0);
    kiln_tensor *nan_row = kiln_full(KILN_SHAPE(1, 4), NAN, KILN_F32, dev);
    CHECK(!kiln_sample_tokens(nan_row, kv_rng(dev, 1, 0), 1, 0, 1) && kiln_last_error() == KILN_ERR_INDEX);
    kiln_clear_error();
    kiln_scope_end();
  }
  printf("%d failures\n", failures);
  return failures ? 1 : 0;
}
