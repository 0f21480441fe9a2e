/*
** The tuning switches (knobs.h): one table of every one kiln reads, with its accepted
** values and what it changes, the readers on it, and what kiln_env_check() and
** kiln_env_about() say of them (env.c holds the settings: KILN_DEVICE and the rest).
*/
#include "kiln_int.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef enum { KNOB_SWITCH, KNOB_INT, KNOB_CHOICE, KNOB_LIST, KNOB_TEXT } knob_kind;

typedef struct {
  const char *name;
  knob_kind kind;
  const char *words;  /* KNOB_CHOICE, KNOB_LIST: the accepted words, '|' between them */
  int64_t lo, hi;     /* KNOB_INT: the accepted range */
  const char *what;   /* what it changes, for kiln doctor and the errors */
} knob;

#define SWITCH(n, w) {n, KNOB_SWITCH, NULL, 0, 0, w}
#define CHOICE(n, words, w) {n, KNOB_CHOICE, words, 0, 0, w}
#define INT(n, lo, hi, w) {n, KNOB_INT, NULL, lo, hi, w}

/* In strcmp order (bsearch; tests/test_env.c checks it). */
static const knob knobs[] = {
    INT("KILN_ATTB_CHUNK_BYTES", 1, INT64_MAX,
        "CPU attention: the bytes of f32 scores a chunk of (batch, head) pairs may take"),
    INT("KILN_ATTB_ROWS", 1, INT64_MAX, "CPU attention: query rows a block, where blocks of rows are taken"),
    CHOICE("KILN_ATTENTION", "own|cudnn-fwd|cudnn-bwd|cudnn",
           "CUDA attention: cuDNN's fused kernels (cudnn, the default), kiln's own (own), or "
           "cuDNN one way only"),
    SWITCH("KILN_ATTENTION_BF16", "0: CPU bf16 attention through the f32 blocks"),
    SWITCH("KILN_ATTENTION_VNNI", "0: CPU bf16 attention on oneDNN's matmuls even without AMX"),
    SWITCH("KILN_BN_FAST", "0: the CPU batch-norm backward takes its general path"),
    SWITCH("KILN_BN_FLAT", "0: CUDA channels-last batch norm walks (n, s) even on evenly strided rows"),
    SWITCH("KILN_BN_MASK_RECOMPUTE", "0: batch_norm_relu's backward reads its mask instead of recomputing it"),
    INT("KILN_BN_P1_BPS", 0, 64, "CUDA batch norm: pass 1's blocks per SM (0: one wave by occupancy)"),
    SWITCH("KILN_BN_P3_REVERSE", "0: CUDA batch norm's pass 3 walks the rows forward"),
    INT("KILN_BN_P3_ROWS", 1, 4096, "CUDA channels-last batch norm: pass 3's rows per thread"),
    SWITCH("KILN_BN_SIMD", "0: the CPU batch-norm fast path's portable loops instead of AVX-512"),
    SWITCH("KILN_CHECKPOINT_ELIDE",
           "0: a checkpoint's recompute runs every op (no skipped last op, no kept results)"),
    SWITCH("KILN_CONV_C1", "0: single-channel CPU convolutions on oneDNN instead of kiln's loops"),
    SWITCH("KILN_CONV_C1_PORTABLE", "1: the single-channel CPU convolution's portable loops"),
    SWITCH("KILN_CONV_DIRECT", "0: CUDA convolutions kiln's direct kernels take go to cuDNN"),
    SWITCH("KILN_CONV_GEMM", "0: no one-GEMM weight gradient for small CPU convolution maps"),
    SWITCH("KILN_CONV_RELU_POOL", "0: conv2d_relu_max_pool2d runs as the three ops"),
    SWITCH("KILN_CONV_S2D", "0: CUDA stride-2 stem convolutions without the space-to-depth layout"),
    CHOICE("KILN_CONV_WINOGRAD", "0|1|auto",
           "CPU 3x3 convolutions on kiln's Winograd F(2x2,3x3): never, always where it fits, or "
           "where measured faster (auto, the default)"),
    SWITCH("KILN_CPU_AVX512BF16", "0: no AVX512-BF16 instructions (bf16 through f32 AVX-512)"),
    INT("KILN_CPU_FAIL_ALLOC_AFTER", 0, INT64_MAX,
        "a test hook: the CPU allocator fails after this many more allocations"),
    CHOICE("KILN_CPU_SGEMM", "blas|dnnl",
           "CPU f32 products on the BLAS or oneDNN's sgemm (unset: oneDNN where the BLAS runs an "
           "older core's kernels)"),
    CHOICE("KILN_CUDA_ATTENTION", "tc|simple",
           "kiln's own CUDA attention: its tensor-core kernels (tc) or the simple ones"),
    CHOICE("KILN_CUDA_BGRAD", "kiln|lt",
           "CUDA linear backward: bias gradients summed by kiln's kernel or cuBLASLt's BGRADB epilogue"),
    CHOICE("KILN_CUDA_LN", "vec|simple", "CUDA f32 layer norm: the four-wide kernels or the simple ones"),
    SWITCH("KILN_CUDA_LT_PLAIN", "0: large 16-bit CUDA products through cuBLAS instead of cuBLASLt plans"),
    CHOICE("KILN_CUDA_LT_TUNE", "0|1|2",
           "cuBLASLt plans: the heuristic's first (0), the fastest candidate with its bits (1, the default), and "
           "a line a shape on stderr (2)"),
    SWITCH("KILN_CUDA_MIXED_EW", "0: CUDA mixed-dtype elementwise ops cast first"),
    {"KILN_CUDA_RLN", KNOB_LIST, "warp|rgchunk|winter|split|f64|fast|nopf|nors|nostatpf", 0, 0,
     "CUDA residual layer norm: kernel variants to take instead of the defaults (a comma list)"},
    CHOICE("KILN_CUDNN_API", "graph|legacy", "cuDNN convolutions through its graph API or the legacy calls"),
    SWITCH("KILN_CUDNN_BENCHMARK", "1: cuDNN convolutions time their algorithms (PyTorch's cudnn.benchmark)"),
    CHOICE("KILN_CUDNN_LOG", "0|1|2", "cuDNN's algorithm and engine choices on stderr (1), and each convolution's host time at exit (2)"),
    SWITCH("KILN_CUDNN_SDPA_ATOMIC",
           "1: cuDNN attention backward may take atomic-dQ engines (faster; not bit-reproducible)"),
    SWITCH("KILN_DNNL_CONV_PLAIN", "1: oneDNN convolutions in plain layouts only (no blocked formats)"),
    SWITCH("KILN_DNNL_MATMUL", "0: CPU bf16 products on the BLAS path instead of oneDNN's matmul"),
    INT("KILN_DNNL_WGRAD_MIN_MAP", 0, INT64_MAX,
        "the smallest output map (OH*OW) whose CPU weight gradient oneDNN makes"),
    SWITCH("KILN_DNNL_WINOGRAD", "0: no oneDNN Winograd convolutions"),
    CHOICE("KILN_GPT_ONES_COLUMN", "1|0|fc",
           "CUDA GPT: bias gradients from a ones column for c_attn and c_fc (1), none (0), c_fc's only (fc)"),
    SWITCH("KILN_GPT_RESIDUAL_LN",
           "GPT residual adds fused with their layer norms: 1 everywhere, 0 nowhere (unset: CUDA only)"),
    SWITCH("KILN_GRAPH_DEPS", "0: CUDA graph captures as a chain, without the ops' data dependencies"),
    SWITCH("KILN_KV_APPEND", "0: generation appends keys and values as two ops, not fused into attention"),
    SWITCH("KILN_LAYER_NORM_F32", "0: CPU f32 layer norm without its AVX-512 kernel"),
    INT("KILN_LCE_CHUNK_ELEMS", 1, INT64_MAX, "linear_cross_entropy: the logits a row chunk may hold"),
    CHOICE("KILN_LINEAR_DECODE", "1|0|warp|mma",
           "generation's decode products: the fused kernel chosen by size (1), composed (0), or one "
           "CUDA kernel always"),
    SWITCH("KILN_LINEAR_GELU", "0: linear_gelu as a linear then a gelu"),
    SWITCH("KILN_PDL", "0: no programmatic dependent launch for CUDA decode kernels"),
    SWITCH("KILN_RELU_MAX_POOL", "0: relu_max_pool2d runs as the two ops"),
    SWITCH("KILN_RESNET_STEM_FUSED", "0: ResNet's stem without the fused batch_norm_relu_max_pool"),
    SWITCH("KILN_RESNET_STEM_RECOMPUTE", "0: ResNet's stem runs plainly (no fused or recomputed tail)"),
    {"KILN_VK_CM", KNOB_TEXT, NULL, 0, 0, "Vulkan: the tensor-core product kernel, for measuring (128, w64, 256, a..i; checked where read)"},
    SWITCH("KILN_VK_CM_EMU", "1: Vulkan tensor-core kernels emulated on a device without them"),
    SWITCH("KILN_VK_COOPMAT", "0: Vulkan products without cooperative matrices"),
    CHOICE("KILN_VK_MMBK", "8|16", "Vulkan f32 products: K steps of 8 or 16"),
    SWITCH("KILN_VK_PIPESTATS", "1: Vulkan pipelines' compiler statistics on stderr"),
    SWITCH("KILN_VK_SUBGROUP", "0: Vulkan reductions without subgroup arithmetic"),
    CHOICE("KILN_VK_TIMING", "0|1|trace", "Vulkan: each command buffer's GPU time (1), or each dispatch (trace)"),
    SWITCH("KILN_VULKAN_DISABLE", "1: no Vulkan backend"),
    {"KILN_VULKAN_LOADER", KNOB_TEXT, NULL, 0, 0, "the Vulkan loader to open (a path)"},
};
#define N_KNOBS ((int)(sizeof knobs / sizeof knobs[0]))

static atomic_uchar warned[N_KNOBS];

static int by_name(const void *key, const void *elem) {
  return strcmp((const char *)key, ((const knob *)elem)->name);
}

static const knob *find(const char *name) {
  return name ? bsearch(name, knobs, (size_t)N_KNOBS, sizeof knobs[0], by_name) : NULL;
}

/* The place of word (n bytes) in words ("a|b|c"), or -1. */
static int word_index(const char *words, const char *word, size_t n) {
  int i = 0;
  for (const char *p = words;; i++) {
    const char *bar = strchr(p, '|');
    size_t len = bar ? (size_t)(bar - p) : strlen(p);
    if (len == n && !strncmp(p, word, n)) return i;
    if (!bar) return -1;
    p = bar + 1;
  }
}

/* Whether v is an accepted value of k; *out gets the switch's 0/1, the integer or the
** choice's place. */
static bool parse(const knob *k, const char *v, int64_t *out) {
  switch (k->kind) {
  case KNOB_SWITCH:
    if (strcmp(v, "0") && strcmp(v, "1")) return false;
    *out = v[0] == '1';
    return true;
  case KNOB_INT: {
    char *end = NULL;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (errno || end == v || *end || x < k->lo || x > k->hi) return false;
    *out = x;
    return true;
  }
  case KNOB_CHOICE: *out = word_index(k->words, v, strlen(v)); return *out >= 0;
  case KNOB_LIST:
    for (const char *p = v;;) {
      const char *comma = strchr(p, ',');
      size_t n = comma ? (size_t)(comma - p) : strlen(p);
      if (word_index(k->words, p, n) < 0) return false;
      if (!comma) return true;
      p = comma + 1;
    }
  case KNOB_TEXT: return true;
  }
  return false;
}

/* What k accepts, as the errors and warnings say it. */
static void accepted(const knob *k, char *buf, size_t n) {
  switch (k->kind) {
  case KNOB_SWITCH: snprintf(buf, n, "0 or 1"); break;
  case KNOB_INT:
    if (k->hi == INT64_MAX) snprintf(buf, n, "an integer from %lld", (long long)k->lo);
    else snprintf(buf, n, "an integer from %lld to %lld", (long long)k->lo, (long long)k->hi);
    break;
  case KNOB_CHOICE: snprintf(buf, n, "one of %s", k->words); break;
  case KNOB_LIST: snprintf(buf, n, "a comma list of %s", k->words); break;
  case KNOB_TEXT: snprintf(buf, n, "any text"); break;
  }
}

/* name's value when the table accepts it (true, *out set); false when unset or empty, and
** when not accepted (said once on stderr; the caller keeps its default). */
static bool read_knob(const char *name, knob_kind kind, int64_t *out) {
  const knob *k = find(name);
  KILN__ASSERT(k && k->kind == kind); /* a switch kiln reads must be in the table */
  const char *v = kiln__getenv(name);
  if (!v) return false;
  if (parse(k, v, out)) return true;
  if (atomic_exchange(&warned[k - knobs], 1) == 0) {
    char acc[160];
    accepted(k, acc, sizeof acc);
    fprintf(stderr, "kiln: %s='%s' is not understood (accepted: %s); using the default\n", name, v, acc);
  }
  return false;
}

bool kiln__knob_on(const char *name, bool dflt) {
  int64_t v;
  return read_knob(name, KNOB_SWITCH, &v) ? v != 0 : dflt;
}

int64_t kiln__knob_int(const char *name, int64_t dflt) {
  int64_t v;
  return read_knob(name, KNOB_INT, &v) ? v : dflt;
}

int kiln__knob_choice(const char *name, int dflt) {
  int64_t v;
  return read_knob(name, KNOB_CHOICE, &v) ? (int)v : dflt;
}

bool kiln__knob_lists(const char *name, const char *word) {
  int64_t v;
  if (!read_knob(name, KNOB_LIST, &v)) return false;
  const char *list = kiln__getenv(name);
  const size_t n = strlen(word);
  for (const char *p = list; p; p = strchr(p, ',') ? strchr(p, ',') + 1 : NULL)
    if (!strncmp(p, word, n) && (p[n] == ',' || p[n] == '\0')) return true;
  return false;
}

const char *kiln__knob_text(const char *name) {
  int64_t v;
  return read_knob(name, KNOB_TEXT, &v) ? kiln__getenv(name) : NULL;
}

/* ---- for env.c: kiln_env_check and kiln_env_about ---- */

int kiln__knob_count(void) { return N_KNOBS; }

const char *kiln__knob_name(int i) { return i >= 0 && i < N_KNOBS ? knobs[i].name : NULL; }

const char *kiln__knob_about(const char *name) {
  const knob *k = find(name);
  return k ? k->what : NULL;
}

kiln_status kiln__knob_check(const char *name) {
  const knob *k = find(name);
  KILN__ASSERT(k);
  const char *v = kiln__getenv(name);
  int64_t x;
  if (!v || parse(k, v, &x)) return KILN_OK;
  char acc[160];
  accepted(k, acc, sizeof acc);
  return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s='%s' is not understood: use %s, or unset it (%s)", name, v,
                        acc, k->what);
}
