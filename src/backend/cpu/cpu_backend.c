/*
** The CPU backend's vtable. Memory is host memory (host_visible), kernels run to
** completion on the calling thread (plus OpenMP workers), so synchronize is a no-op.
*/
#define _POSIX_C_SOURCE 200809L
#include "cpu.h"

#include <stdio.h>
#include <string.h>
#include <unistd.h>

static kiln_status kiln__cpu_probe(const char **why) {
  if (why) *why = NULL;
  return KILN_OK;
}

static int kiln__cpu_device_count(void) { return 1; }

/* The CPU's model from /proc/cpuinfo: x86's "model name"; arm64 kernels give none, only
** "Hardware", "Processor", "cpu model" or "CPU part" (the earliest of these keys wins). */
static void cpu_model(char *buf, size_t n) {
  snprintf(buf, n, "unknown CPU");
  FILE *f = fopen("/proc/cpuinfo", "r");
  if (!f) return;
  char line[512];
  const char *keys[] = {"model name", "Hardware", "Processor", "cpu model", "CPU part"};
  int best = (int)(sizeof keys / sizeof keys[0]);
  while (best > 0 && fgets(line, sizeof line, f)) {
    for (int k = 0; k < best; k++) {
      if (strncmp(line, keys[k], strlen(keys[k])) != 0) continue;
      char *c = strchr(line, ':');
      if (!c) continue;
      c++;
      while (*c == ' ' || *c == '\t') c++;
      c[strcspn(c, "\n")] = 0;
      if (*c) {
        snprintf(buf, n, "%s", c);
        best = k;
      }
      break;
    }
  }
  fclose(f);
}

/* kiln_device_info_get on the CPU: the model, the cores and the machine's memory. */
static kiln_status kiln__cpu_device_info(int device, kiln_device_info *out) {
  (void)device;
  cpu_model(out->name, sizeof out->name);
  long c = sysconf(_SC_NPROCESSORS_ONLN);
  out->multiprocessors = c > 0 ? (int)c : 1;
  long pages = sysconf(_SC_PHYS_PAGES), avail = sysconf(_SC_AVPHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
  if (pages > 0 && psz > 0) out->total_memory = (int64_t)pages * psz;
  if (avail > 0 && psz > 0) out->free_memory = (int64_t)avail * psz;
  return KILN_OK;
}

/* The calls the CPU's kernels refuse by their arguments, so that kiln__dispatch_has
** answers for them (the op layer asks before choosing a fused path) without naming the
** device type: BATCH_NORM's pooled output (flag 32) and BATCH_NORM_BACKWARD's mask
** recomputed from x (flag 8) are CUDA's fusions; the op layer composes them here. */
static bool cpu_supports(const kiln__kargs *a) {
  switch (a->op) {
  case KILN__K_BATCH_NORM: return !(a->i[0] & 32);
  case KILN__K_BATCH_NORM_BACKWARD: return !(a->i[0] & 8);
  default: return true;
  }
}

const kiln__backend kiln__cpu_backend = {
    .name = "cpu",
    .type = KILN_DEVICE_CPU,
    .host_visible = true,
    .probe = kiln__cpu_probe,
    .device_count = kiln__cpu_device_count,
    .alloc = kiln__cpu_alloc,
    .free = kiln__cpu_free,
    .copy_to_host = kiln__cpu_memcpy,
    .copy_from_host = kiln__cpu_memcpy,
    .copy_device = kiln__cpu_memcpy,
    .memset_zero = kiln__cpu_memset_zero,
    .synchronize = kiln__cpu_synchronize,
    .memory_stats = kiln__cpu_memory_stats,
    .empty_cache = kiln__cpu_empty_cache,
    .set_memory_limit = kiln__cpu_set_memory_limit,
    .reset_peak = kiln__cpu_reset_peak,
    .kernels =
        {
            [KILN__K_COPY] = kiln__cpu_copy,
            [KILN__K_FILL] = kiln__cpu_fill,
            [KILN__K_ARANGE] = kiln__cpu_arange,
            [KILN__K_EYE] = kiln__cpu_eye,
            [KILN__K_RAND_UNIFORM] = kiln__cpu_random,
            [KILN__K_RAND_NORMAL] = kiln__cpu_random,
            [KILN__K_RAND_INT] = kiln__cpu_random,
            [KILN__K_RAND_BERNOULLI] = kiln__cpu_random,
            [KILN__K_NEG] = kiln__cpu_unary,
            [KILN__K_EXP] = kiln__cpu_unary,
            [KILN__K_LOG] = kiln__cpu_unary,
            [KILN__K_SQRT] = kiln__cpu_unary,
            [KILN__K_RSQRT] = kiln__cpu_unary,
            [KILN__K_ABS] = kiln__cpu_unary,
            [KILN__K_SIGN] = kiln__cpu_unary,
            [KILN__K_RELU] = kiln__cpu_unary,
            [KILN__K_LEAKY_RELU] = kiln__cpu_unary,
            [KILN__K_GELU] = kiln__cpu_unary,
            [KILN__K_GELU_TANH] = kiln__cpu_unary,
            [KILN__K_SILU] = kiln__cpu_unary,
            [KILN__K_SIGMOID] = kiln__cpu_unary,
            [KILN__K_TANH] = kiln__cpu_unary,
            [KILN__K_SOFTPLUS] = kiln__cpu_unary,
            [KILN__K_CLAMP] = kiln__cpu_unary,
            [KILN__K_POW_SCALAR] = kiln__cpu_unary,
            [KILN__K_AFFINE] = kiln__cpu_unary,
            [KILN__K_RELU_BACKWARD] = kiln__cpu_unary,
            [KILN__K_LEAKY_RELU_BACKWARD] = kiln__cpu_unary,
            [KILN__K_GELU_BACKWARD] = kiln__cpu_unary,
            [KILN__K_GELU_TANH_BACKWARD] = kiln__cpu_unary,
            [KILN__K_SILU_BACKWARD] = kiln__cpu_unary,
            [KILN__K_SIGMOID_BACKWARD] = kiln__cpu_unary,
            [KILN__K_TANH_BACKWARD] = kiln__cpu_unary,
            [KILN__K_SOFTPLUS_BACKWARD] = kiln__cpu_unary,
            [KILN__K_CLAMP_BACKWARD] = kiln__cpu_unary,
            [KILN__K_ADD] = kiln__cpu_binary,
            [KILN__K_SUB] = kiln__cpu_binary,
            [KILN__K_MUL] = kiln__cpu_binary,
            [KILN__K_DIV] = kiln__cpu_binary,
            [KILN__K_POW] = kiln__cpu_binary,
            [KILN__K_MAXIMUM] = kiln__cpu_binary,
            [KILN__K_MINIMUM] = kiln__cpu_binary,
            [KILN__K_EQ] = kiln__cpu_binary,
            [KILN__K_NE] = kiln__cpu_binary,
            [KILN__K_LT] = kiln__cpu_binary,
            [KILN__K_LE] = kiln__cpu_binary,
            [KILN__K_GT] = kiln__cpu_binary,
            [KILN__K_GE] = kiln__cpu_binary,
            [KILN__K_WHERE] = kiln__cpu_where,
            [KILN__K_SUM] = kiln__cpu_reduce,
            [KILN__K_PROD] = kiln__cpu_reduce,
            [KILN__K_AMAX] = kiln__cpu_reduce,
            [KILN__K_AMIN] = kiln__cpu_reduce,
            [KILN__K_MAX_DIM] = kiln__cpu_minmax_dim,
            [KILN__K_MIN_DIM] = kiln__cpu_minmax_dim,
            [KILN__K_SOFTMAX] = kiln__cpu_softmax,
            [KILN__K_LOG_SOFTMAX] = kiln__cpu_softmax,
            [KILN__K_SOFTMAX_BACKWARD] = kiln__cpu_softmax,
            [KILN__K_LOG_SOFTMAX_BACKWARD] = kiln__cpu_softmax,
            [KILN__K_MATMUL] = kiln__cpu_matmul,
            [KILN__K_INDEX_SELECT] = kiln__cpu_index_select,
            [KILN__K_INDEX_ADD] = kiln__cpu_index_add,
            [KILN__K_GATHER] = kiln__cpu_gather,
            [KILN__K_SCATTER_ADD] = kiln__cpu_scatter_add,
            [KILN__K_CROSS_ENTROPY] = kiln__cpu_cross_entropy,
            [KILN__K_CROSS_ENTROPY_BACKWARD] = kiln__cpu_cross_entropy_backward,
            [KILN__K_CROSS_ENTROPY_MEAN] = kiln__cpu_cross_entropy_mean,
            [KILN__K_ADAM] = kiln__cpu_adam,
            [KILN__K_ADAM_MULTI] = kiln__cpu_adam_multi,
            [KILN__K_SGD_MULTI] = kiln__cpu_sgd_multi,
            [KILN__K_CAST_MULTI] = kiln__cpu_cast_multi,
            [KILN__K_AMP_UNSCALE] = kiln__cpu_amp_unscale,
            [KILN__K_AMP_UPDATE_SCALE] = kiln__cpu_amp_update_scale,
            [KILN__K_LAYER_NORM] = kiln__cpu_layer_norm,
            [KILN__K_LAYER_NORM_BACKWARD] = kiln__cpu_layer_norm,
            [KILN__K_ATTENTION] = kiln__cpu_attention,
            [KILN__K_ATTENTION_BACKWARD] = kiln__cpu_attention,
            [KILN__K_CUMSUM] = kiln__cpu_cumsum,
            [KILN__K_TRIL] = kiln__cpu_tril,
            [KILN__K_TOPK] = kiln__cpu_topk,
            [KILN__K_MULTINOMIAL] = kiln__cpu_multinomial,
            [KILN__K_INDEX_COPY] = kiln__cpu_index_copy,
            [KILN__K_KV_ATTENTION] = kiln__cpu_kv_attention,
            [KILN__K_SAMPLE_TOKENS] = kiln__cpu_sample_tokens,
            [KILN__K_ADD_LAYER_NORM] = kiln__cpu_add_layer_norm,
            [KILN__K_IM2COL] = kiln__cpu_conv_window,
            [KILN__K_COL2IM] = kiln__cpu_conv_window,
            [KILN__K_MAX_POOL2D] = kiln__cpu_max_pool2d,
            [KILN__K_CONV2D_BACKWARD_DATA] = kiln__cpu_conv2d_backward,
            [KILN__K_CONV2D_BACKWARD_WEIGHT] = kiln__cpu_conv2d_backward,
            [KILN__K_MAX_POOL2D_BACKWARD] = kiln__cpu_max_pool2d,
            [KILN__K_RELU_MAX_POOL2D] = kiln__cpu_relu_max_pool2d,
            [KILN__K_RELU_MAX_POOL2D_BACKWARD] = kiln__cpu_relu_max_pool2d,
            [KILN__K_BATCH_NORM] = kiln__cpu_batch_norm,
            [KILN__K_BATCH_NORM_BACKWARD] = kiln__cpu_batch_norm,
#ifdef KILN_HAVE_DNNL
            [KILN__K_CONV2D] = kiln__cpu_conv2d,
            [KILN__K_CONV1_RELU_MAX_POOL2D] = kiln__cpu_conv1_relu_max_pool2d,
            [KILN__K_CONV1_RELU_MAX_POOL2D_BACKWARD] = kiln__cpu_conv1_relu_max_pool2d,
#endif
        },
    .supports = cpu_supports,
    .device_info = kiln__cpu_device_info,
    /* no mark/elapsed_ms, graph, async, bandwidth: the CPU does the plain thing */
};
