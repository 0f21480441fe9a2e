/* The KV-cache ops on CUDA device 0 (label gpu; skipped, 77, without a device): the
** kernels of cuda_kv.cu against the f64 references of kv_checks.h in f32, bf16, f16, f64,
** with the fallback policy at error (so a missing kernel fails instead of running on the
** CPU); a bad position or length sets the device's index flag, reported as KILN_ERR_INDEX
** at the next synchronize, without touching memory outside the cache; and both ops inside a
** captured graph read their position on each replay. */
#include "kv_checks.h"

typedef struct cap {
  kiln_tensor *cache, *pos, *val;
} cap;

/* cache[0, pos] = val; val += 1; pos += 1 */
static kiln_status cap_step(void *p) {
  cap *c = p;
  kiln_scope_begin();
  kiln_status st = kiln_index_copy_(c->cache, 1, c->pos, c->val);
  if (st == KILN_OK) st = kiln_copy_(c->val, kiln_add_scalar(c->val, 1));
  if (st == KILN_OK) st = kiln_copy_(c->pos, kiln_add_scalar(c->pos, 1));
  kiln_scope_end();
  return st;
}

int main(void) {
  const char *why = NULL;
  if (!kiln_backend_available(KILN_DEVICE_CUDA, &why) || kiln_device_count(KILN_DEVICE_CUDA) < 1) {
    printf("skipped: no CUDA device (%s)\n", why ? why : "none");
    return 77;
  }
  kiln_device dev = kiln_device_cuda(0);
  kiln_set_fallback_policy(KILN_FALLBACK_ERROR);
  kv_check_all(dev);

  kiln_scope_begin();
  /* out-of-range positions: the flag, then the error at the synchronize */
  kiln_tensor *dst = kiln_zeros(KILN_SHAPE(2, 6), KILN_F32, dev);
  CHECK(kiln_index_copy_(dst, 1, kiln_full(KILN_SHAPE(1), 6, KILN_I64, dev), kiln_ones(KILN_SHAPE(2, 1), KILN_F32, dev)) ==
        KILN_OK);
  CHECK(kiln_device_synchronize(dev) == KILN_ERR_INDEX);
  kiln_clear_error();
  CHECK(kiln_item(kiln_sum(dst, 0, NULL, false)) == 0);
  kiln_tensor *q = kiln_ones(KILN_SHAPE(1, 1, 1, 4), KILN_F32, dev), *k = kiln_ones(KILN_SHAPE(1, 1, 5, 4), KILN_F32, dev);
  kiln_tensor *y = kiln_kv_attention(q, k, k, kiln_full(KILN_SHAPE(1), 9, KILN_I64, dev), 0);
  CHECK(y != NULL);
  CHECK(kiln_device_synchronize(dev) == KILN_ERR_INDEX);
  kiln_clear_error();
  /* the fused append (bf16, one query) with no room: the flag, and nothing written */
  kiln_tensor *cache = kiln_zeros(KILN_SHAPE(2, 1, 1, 5, 64), KILN_BF16, dev);
  kiln_tensor *qa = kiln_ones(KILN_SHAPE(1, 1, 1, 64), KILN_BF16, dev);
  y = kiln_kv_attention_append(qa, cache, kiln_ones(KILN_SHAPE(2, 1, 1, 1, 64), KILN_BF16, dev),
                               kiln_full(KILN_SHAPE(1), 0, KILN_I64, dev), 0);
  CHECK(y != NULL);
  CHECK(kiln_device_synchronize(dev) == KILN_ERR_INDEX);
  kiln_clear_error();
  CHECK(kiln_item(kiln_sum(kiln_to_dtype(cache, KILN_F32), 0, NULL, false)) == 0);

  /* captured: the position advances inside the graph, and each replay reads it anew */
  cap c = {kiln_zeros(KILN_SHAPE(1, 8), KILN_F32, dev), kiln_zeros(KILN_SHAPE(1), KILN_I64, dev),
           kiln_ones(KILN_SHAPE(1, 1), KILN_F32, dev)};
  CHECK(cap_step(&c) == KILN_OK); /* eager: slot 0 = 1 */
  kiln_graph *g = kiln_graph_capture(dev, cap_step, &c);
  CHECK(g && kiln_graph_is_device_graph(g));
  for (int r = 0; g && r < 4; r++) CHECK(kiln_graph_replay(g) == KILN_OK);
  float got[8] = {0}, want[8] = {1, 2, 3, 4, 5, 0, 0, 0};
  CHECK(kiln_to_host(c.cache, got, sizeof got) == KILN_OK);
  CHECK(memcmp(got, want, sizeof got) == 0);
  kiln_graph_free(g);

  /* the CPU's rule: the same tokens but where exp differs in the last bit at a cut (rare) */
  kiln_tensor *tg = kv_check_sample_vocab(dev, KILN_BF16), *tc = kv_check_sample_vocab(kiln_device_cpu(), KILN_BF16);
  int64_t *a = tg ? kv_host_i64(tg) : NULL, *b = tc ? kv_host_i64(tc) : NULL;
  int diff = 0;
  for (int i = 0; a && b && i < 64; i++) diff += a[i] != b[i];
  printf("sample_tokens: cuda vs cpu, %d of 64 rows differ\n", diff);
  CHECK(a && b && diff <= 1);
  free(a);
  free(b);
  kiln_scope_end();
  printf("%d failures\n", failures);
  return failures ? 1 : 0;
}
