/*
** The Vulkan kernels' host side: each kernel fills a parameter block (kv_params, the
** shaders' `Params` in shaders/common.glsl) and dispatches its shader; supports() says
** which dtypes and sizes each handles natively (everything else falls back to the CPU
** under the fallback policy).
**
** Sizes: shaders index elements with 32-bit ints, so a view whose element count or
** furthest element passes 2^31 - 1 is refused (falls back). f64 arithmetic is not done
** here (COPY and FILL move f64 bits; the rest falls back), so the device needs no
** shaderFloat64 (Apple GPUs have none).
*/
#include "vk_int.h"

#include <math.h>
#include <string.h>

#include "shaders/kv_ops.h"

_Static_assert(KV_F32 == KILN_F32 && KV_F64 == KILN_F64 && KV_F16 == KILN_F16 &&
                   KV_BF16 == KILN_BF16 && KV_I64 == KILN_I64 && KV_I32 == KILN_I32 &&
                   KV_U8 == KILN_U8 && KV_BOOL == KILN_BOOL,
               "shaders/kv_ops.h's dtype codes are kiln_dtype's");

/* Must match `Params` in shaders/common.glsl (std430). */
typedef struct kv_params {
  uint64_t addr[KV_MAXV];
  uint64_t flag;
  int32_t ndim, n, op, nv;
  float s[4];
  int32_t i[4];
  int32_t dtype[KV_MAXV];
  int32_t shape[KV_MAXD];
  int32_t strides[KV_MAXV * KV_MAXD];
  int32_t ex[16];
} kv_params;
_Static_assert(sizeof(kv_params) == 416, "kv_params is Params of common.glsl");

#define I32MAX 2147483647LL

/* The furthest element a view reaches fits an int (and so does its count). */
static bool fits(const kiln__view *v) {
  int64_t n = 1, far = 0;
  for (int d = 0; d < v->ndim; d++) {
    if (v->shape[d] == 0) return true;
    n *= v->shape[d];
    if (v->strides[d] < 0) return false;
    far += (v->shape[d] - 1) * v->strides[d];
    if (n > I32MAX || far > I32MAX) return false;
  }
  return v->ndim <= KV_MAXD;
}

static bool is_float(kiln_dtype t) { return t == KILN_F32 || t == KILN_F16 || t == KILN_BF16; }
static bool is_int(kiln_dtype t) { return t == KILN_I64 || t == KILN_I32 || t == KILN_U8 || t == KILN_BOOL; }

static vk_dev *dev_of(const kiln__kargs *a) {
  vk_dev *d = kiln__vk_dev(a->device);
  return d ? d : kiln__vk_dev(0);
}

static uint64_t flag_addr(int device) {
  vk_dev *d = kiln__vk_dev(device);
  return d ? d->flag.addr : 0;
}

/* Fills addr/dtype/shape/strides from views of one shape (merged where contiguous). */
static void set_views(kv_params *p, int nv, const kiln__view *const *vs) {
  kiln__view v[KV_MAXV];
  for (int i = 0; i < nv; i++) v[i] = *vs[i];
  int nd = kiln__views_coalesce(v, nv);
  p->nv = nv;
  p->ndim = nd;
  p->n = (int32_t)kiln__view_numel(&v[0]);
  for (int d = 0; d < nd; d++) p->shape[d] = (int32_t)v[0].shape[d];
  for (int i = 0; i < nv; i++) {
    p->addr[i] = (uint64_t)(uintptr_t)v[i].data;
    p->dtype[i] = (int32_t)v[i].dtype;
    for (int d = 0; d < nd; d++) p->strides[i * KV_MAXD + d] = (int32_t)v[i].strides[d];
  }
}

/* One invocation per element, 256 to a workgroup, the groups in a 2-d grid. */
static kiln_status run_1d(int device, const char *shader, const kv_params *p, int64_t n) {
  if (n <= 0) return KILN_OK;
  uint64_t groups = ((uint64_t)n + 255) / 256;
  uint32_t gx = groups < 65535 ? (uint32_t)groups : 65535;
  uint32_t gy = (uint32_t)((groups + gx - 1) / gx);
  return kiln__vk_dispatch(device, shader, p, sizeof *p, gx, gy, 1);
}

/* The row shaders (reduce, softmax, ce, ce_mean, rowsum) come in two builds of one source
** (wg.glsl): name_sg with subgroup arithmetic where the device has it in compute shaders
** (KILN_VK_SUBGROUP=0 turns it off at the probe), name with the shared-memory tree. */
static const char *sg_shader(int device, const char *plain, const char *sg) {
  vk_dev *d = kiln__vk_dev(device);
  return d && d->subgroup_arith ? sg : plain;
}

/* One workgroup per row (reductions, softmax, cross-entropy). */
static kiln_status run_rows(int device, const char *shader, const kv_params *p, int64_t rows) {
  if (rows <= 0) return KILN_OK;
  uint32_t gx = rows < 65535 ? (uint32_t)rows : 65535;
  uint32_t gy = (uint32_t)(((uint64_t)rows + gx - 1) / gx);
  return kiln__vk_dispatch(device, shader, p, sizeof *p, gx, gy, 1);
}

/* ---- COPY, FILL ---- */
static kiln_status vk_copy(const kiln__kargs *a) {
  kv_params p = {0};
  const kiln__view *vs[2] = {&a->out[0], &a->in[0]};
  set_views(&p, 2, vs);
  p.i[0] = (int32_t)kiln_dtype_size(a->out[0].dtype);
  bool f64 = a->in[0].dtype != a->out[0].dtype && (a->in[0].dtype == KILN_F64 || a->out[0].dtype == KILN_F64);
  return run_1d(a->device, f64 ? "copy_f64" : "copy", &p, p.n);
}

static int64_t sat_i64(double x) {
  if (x != x) return 0;
  if (x >= 9223372036854775807.0) return INT64_MAX;
  if (x <= -9223372036854775808.0) return INT64_MIN;
  return (int64_t)x;
}

static kiln_status vk_fill(const kiln__kargs *a) {
  kv_params p = {0};
  const kiln__view *vs[1] = {&a->out[0]};
  set_views(&p, 1, vs);
  uint64_t bits = 0;
  double x = a->s[0];
  switch (a->out[0].dtype) {
  case KILN_F32: {
    float f = (float)x;
    uint32_t u;
    memcpy(&u, &f, 4);
    bits = u;
    break;
  }
  case KILN_F64: memcpy(&bits, &x, 8); break;
  case KILN_F16: bits = kiln_f32_to_f16((float)x); break;
  case KILN_BF16: bits = kiln_f32_to_bf16((float)x); break;
  case KILN_BOOL: bits = x != 0; break;
  default: bits = (uint64_t)sat_i64(x); break;
  }
  p.i[0] = (int32_t)(uint32_t)bits;
  p.i[1] = (int32_t)(uint32_t)(bits >> 32);
  p.i[2] = (int32_t)kiln_dtype_size(a->out[0].dtype);
  return run_1d(a->device, "fill", &p, p.n);
}

/* ---- the elementwise family ---- */
static int ew_code(kiln__kop op) {
  switch (op) {
#define C(K, V) case KILN__K_##K: return KV_##V;
    C(NEG, NEG) C(EXP, EXP) C(LOG, LOG) C(SQRT, SQRT) C(RSQRT, RSQRT) C(ABS, ABS) C(SIGN, SIGN)
    C(RELU, RELU) C(LEAKY_RELU, LEAKY_RELU) C(GELU, GELU) C(GELU_TANH, GELU_TANH) C(SILU, SILU)
    C(SIGMOID, SIGMOID) C(TANH, TANH) C(SOFTPLUS, SOFTPLUS) C(CLAMP, CLAMP)
    C(POW_SCALAR, POW_SCALAR) C(AFFINE, AFFINE)
    C(RELU_BACKWARD, RELU_BW) C(LEAKY_RELU_BACKWARD, LEAKY_RELU_BW) C(GELU_BACKWARD, GELU_BW)
    C(GELU_TANH_BACKWARD, GELU_TANH_BW) C(SILU_BACKWARD, SILU_BW) C(SIGMOID_BACKWARD, SIGMOID_BW)
    C(TANH_BACKWARD, TANH_BW) C(SOFTPLUS_BACKWARD, SOFTPLUS_BW) C(CLAMP_BACKWARD, CLAMP_BW)
    C(ADD, ADD) C(SUB, SUB) C(MUL, MUL) C(DIV, DIV) C(POW, POW) C(MAXIMUM, MAXIMUM)
    C(MINIMUM, MINIMUM) C(EQ, EQ) C(NE, NE) C(LT, LT) C(LE, LE) C(GT, GT) C(GE, GE) C(WHERE, WHERE)
#undef C
  default: return 0;
  }
}

static bool ew_int_ok(int code) {
  return code == KV_NEG || code == KV_ABS || code == KV_SIGN || code == KV_RELU ||
         (code >= KV_ADD && code <= KV_WHERE && code != KV_POW);
}

static kiln_status vk_ew(const kiln__kargs *a) {
  kv_params p = {0};
  const kiln__view *vs[4] = {&a->out[0], &a->in[0], &a->in[1], &a->in[2]};
  set_views(&p, 1 + a->n_in, vs);
  p.op = ew_code(a->op);
  for (int k = 0; k < 4; k++) p.s[k] = (float)a->s[k];
  p.ex[0] = is_int(a->out[0].dtype) && (p.op < KV_EQ || p.op == KV_WHERE) ? 1 : 0;
  if (p.op >= KV_EQ && p.op <= KV_GE) p.ex[0] = is_int(a->in[0].dtype);
  if (p.ex[0] && p.op == KV_ADD) p.i[0] = (int32_t)sat_i64(a->s[0]);
  /* the fast path (ew4.comp): f32 views, contiguous after merging, 16-byte aligned */
  bool fast = p.op != KV_WHERE && p.ndim == 1 && p.n >= 4;
  for (int v = 0; v < p.nv && fast; v++)
    fast = p.dtype[v] == KV_F32 && p.strides[v * KV_MAXD] == 1 && (p.addr[v] & 15) == 0;
  if (fast) {
    uint64_t groups = ((uint64_t)p.n / 4 + 255) / 256;
    if (groups > 4096) groups = 4096; /* the rest by striding: several vec4s per invocation */
    return kiln__vk_dispatch(a->device, "ew4", &p, sizeof p, (uint32_t)groups, 1, 1);
  }
  return run_1d(a->device, "ew", &p, p.n);
}

static bool ew_supports(const kiln__kargs *a) {
  int code = ew_code(a->op);
  if (code == 0) return false;
  if (code == KV_WHERE) {
    kiln_dtype t = a->out[0].dtype;
    if (t != a->in[1].dtype || t != a->in[2].dtype || t == KILN_F64 || a->in[0].dtype == KILN_F64) return false;
    return true;
  }
  kiln_dtype t = a->in[0].dtype;
  for (int i = 0; i < a->n_in; i++)
    if (a->in[i].dtype != t) return false;
  bool cmp = code >= KV_EQ && code <= KV_GE;
  if (cmp ? a->out[0].dtype != KILN_BOOL : a->out[0].dtype != t) return false;
  if (is_float(t)) return true;
  if (!is_int(t) || !ew_int_ok(code)) return false;
  if (code == KV_ADD && (a->s[0] != floor(a->s[0]) || fabs(a->s[0]) > 2147483647.0)) return false;
  return true;
}


/* A view of a few dims (the caller's), to put in a parameter block as is. */
static void put_view(kv_params *p, int slot, const kiln__view *v) {
  p->addr[slot] = (uint64_t)(uintptr_t)v->data;
  p->dtype[slot] = (int32_t)v->dtype;
}

static bool all_float(const kiln__kargs *a) {
  for (int i = 0; i < a->n_in; i++)
    if (!is_float(a->in[i].dtype)) return false;
  for (int i = 0; i < a->n_out; i++)
    if (!is_float(a->out[i].dtype)) return false;
  return true;
}

/* ---- reductions ---- */
static kiln_status vk_reduce(const kiln__kargs *a) {
  const kiln__view *in = &a->in[0], *out = &a->out[0];
  kv_params p = {0};
  p.op = a->op == KILN__K_SUM ? KV_R_SUM : a->op == KILN__K_PROD ? KV_R_PROD
       : a->op == KILN__K_AMAX ? KV_R_MAX : KV_R_MIN;
  kiln__view kept[2] = {*out, *in};
  int nk = 0, nr = 0;
  int64_t nred = 1;
  for (int d = 0; d < in->ndim; d++) {
    bool red = (out->shape[d] == 1 && in->shape[d] != 1) || ((a->i[0] >> d) & 1);
    if (red) {
      if (in->shape[d] == 1) continue;
      p.ex[1 + nr] = (int32_t)in->shape[d];
      p.strides[2 * KV_MAXD + nr] = (int32_t)in->strides[d];
      nred *= in->shape[d];
      nr++;
    } else {
      kept[0].shape[nk] = kept[1].shape[nk] = out->shape[d];
      kept[0].strides[nk] = out->strides[d];
      kept[1].strides[nk] = in->strides[d];
      nk++;
    }
  }
  if (nk == 0) {
    kept[0].shape[0] = kept[1].shape[0] = 1;
    kept[0].strides[0] = kept[1].strides[0] = 0;
    nk = 1;
  }
  kept[0].ndim = kept[1].ndim = nk;
  const kiln__view *vs[2] = {&kept[0], &kept[1]};
  set_views(&p, 2, vs);
  p.ex[0] = nr;
  p.i[0] = (int32_t)nred;
  p.ex[15] = is_int(in->dtype) ? 1 : 0;
  return run_rows(a->device, sg_shader(a->device, "reduce", "reduce_sg"), &p, p.n);
}

static bool reduce_supports(const kiln__kargs *a) {
  if (a->in[0].ndim > KV_MAXD) return false;
  kiln_dtype t = a->in[0].dtype, o = a->out[0].dtype;
  if (is_int(t)) return o == t || o == KILN_I64; /* exact in int64 */
  return t == o && is_float(t);
}

/* The views as lines along dim: each view without that dim (a 0-d remainder becomes one
** line), its stride along dim in p->ex[1 + v], then set_views. The kernels walk p->n lines
** of p->ex[0] elements (the caller sets ex[0]). */
static void lines_along(kv_params *p, int n, const kiln__view *const *src, int dim) {
  kiln__view lines[3];
  const kiln__view *vs[3];
  for (int v = 0; v < n; v++) {
    lines[v] = *src[v];
    int k = 0;
    for (int d = 0; d < src[v]->ndim; d++) {
      if (d == dim) continue;
      lines[v].shape[k] = src[v]->shape[d];
      lines[v].strides[k++] = src[v]->strides[d];
    }
    if (k == 0) lines[v].shape[0] = 1, lines[v].strides[0] = 0, k = 1;
    lines[v].ndim = k;
    p->ex[1 + v] = (int32_t)src[v]->strides[dim];
    vs[v] = &lines[v];
  }
  set_views(p, n, vs);
}

/* ---- softmax family: rows along dim i0 ---- */
static kiln_status vk_softmax(const kiln__kargs *a) {
  int dim = (int)a->i[0];
  const kiln__view *src[3] = {&a->out[0], &a->in[0], a->n_in > 1 ? &a->in[1] : &a->in[0]};
  kv_params p = {0};
  lines_along(&p, 3, src, dim);
  p.ex[0] = (int32_t)a->out[0].shape[dim];
  p.op = a->op == KILN__K_SOFTMAX ? KV_SOFTMAX : a->op == KILN__K_LOG_SOFTMAX ? KV_LOG_SOFTMAX
       : a->op == KILN__K_SOFTMAX_BACKWARD ? KV_SOFTMAX_BW : KV_LOG_SOFTMAX_BW;
  if (p.ex[0] == 0) return KILN_OK;
  return run_rows(a->device, sg_shader(a->device, "softmax", "softmax_sg"), &p, p.n);
}

/* MAX_DIM / MIN_DIM: dim i1, the rows walked as the softmax's */
static kiln_status vk_minmax_dim(const kiln__kargs *a) {
  int dim = (int)a->i[1];
  const kiln__view *src[3] = {&a->out[0], &a->in[0], &a->out[1]};
  kv_params p = {0};
  lines_along(&p, 3, src, dim);
  p.ex[0] = (int32_t)a->in[0].shape[dim];
  p.op = a->op == KILN__K_MAX_DIM ? 1 : 2;
  if (p.ex[0] == 0) return KILN_OK;
  return run_rows(a->device, "argmax", &p, p.n);
}

static bool minmax_dim_supports(const kiln__kargs *a) {
  int nd = a->in[0].ndim, dim = (int)a->i[1];
  return dim >= 0 && dim < nd && nd <= KV_MAXD + 1 && is_float(a->in[0].dtype) &&
         a->out[0].dtype == a->in[0].dtype && a->out[1].dtype == KILN_I64 &&
         a->out[0].ndim == nd && a->out[1].ndim == nd;
}

/* ---- matmul ---- */
/* The kernels a product can take, fastest first: matmul_cmv_* / matmul_cm* (f16 and bf16
** on tensor cores), matmul_big_<dtype> (register-blocked 128x128 tiles), matmul /
** matmul128 (the general 64x64 kernel, any strides and the mask; matmul128 is its 128x128
** form, kept for CPU devices, where it is tested). */
enum { MM_SMALL, MM_BIG, MM_CM };

/* The tensor-core kernels (KILN_VK_CM=key picks one; vk_dev.cm_variant). matmul_cmv_*
** (matmul_cmv.glsl) take their layout as a specialisation constant and run bf16 as f16
** converted beforehand (mm_cvt_f16); matmul_cm* (matmul_cm.glsl, the first kernels) read
** the layout at run time and convert bf16 inside the loop. */
typedef struct cm_variant {
  const char *key, *f16, *bf16; /* bf16 NULL: converted to f16 first, then the f16 shader */
  int bm, bn;
  const char *what;
} cm_variant;
static const cm_variant cm_variants[] = {
    {"a", "matmul_cmv_a", NULL, 128, 128, "128x128 tiles of 8 subgroups of 64x32, K steps of 32, 2 buffers"},
    {"b", "matmul_cmv_b", NULL, 128, 128, "128x128 tiles of 8 subgroups of 64x32, K steps of 64, 1 buffer"},
    {"c", "matmul_cmv_c", NULL, 128, 128, "128x128 tiles of 4 subgroups of 64x64, K steps of 32, 2 buffers"},
    {"d", "matmul_cmv_d", NULL, 128, 256, "128x256 tiles of 8 subgroups of 64x64, K steps of 32, 1 buffer"},
    {"e", "matmul_cmv_e", NULL, 256, 128, "256x128 tiles of 8 subgroups of 64x64, K steps of 32, 1 buffer"},
    {"f", "matmul_cmv_f", NULL, 128, 256, "128x256 tiles of 8 subgroups of 64x64, K steps of 16, 2 buffers"},
    {"g", "matmul_cmv_g", NULL, 128, 128, "128x128 tiles of 8 subgroups of 32x64, K steps of 32, 2 buffers"},
    {"h", "matmul_cmv_h", NULL, 256, 128, "256x128 tiles of 8 subgroups of 64x64, K steps of 16, 2 buffers"},
    {"i", "matmul_cmv_i", NULL, 128, 128, "128x128 tiles of 4 subgroups of 64x64, K steps of 64, 1 buffer"},
    {"128", "matmul_cm", "matmul_cm_bf16", 128, 128, "128x128 tiles of 8 subgroups of 64x32 (first kernel)"},
    {"w64", "matmul_cm_w64", "matmul_cm_w64_bf16", 128, 128, "128x128 tiles of 4 subgroups of 64x64 (first kernel)"},
    {"256", "matmul_cm_256", "matmul_cm_256_bf16", 128, 256, "128x256 tiles of 8 subgroups of 64x64 (first kernel)"},
};
#define CM_NVARIANTS ((int)(sizeof cm_variants / sizeof cm_variants[0]))
#define CM_DEFAULT 9 /* "128": the kernel measured on the H200 (91 TFLOP/s f16); the matmul_cmv variants are unmeasured */

int kiln__vk_cm_variant(const char *key) {
  for (int i = 0; key && i < CM_NVARIANTS; i++)
    if (strcmp(cm_variants[i].key, key) == 0) return i;
  if (key && key[0]) fprintf(stderr, "kiln: vulkan: KILN_VK_CM=%s is no tensor-core kernel; taking '%s'\n", key,
                             cm_variants[CM_DEFAULT].key);
  return CM_DEFAULT;
}

/* Whether view v's batch strides keep whole vectors aligned. A dim of size 1 never moves,
** whatever its stride says: a plain 2-D product's one-element batch has stride 1, and
** counting it sent every 2-D product to the general 64x64 kernel. */
static bool mm_batch_strides(const kv_params *p, int v, int mult) {
  for (int b = 0; b < p->ndim; b++)
    if (p->shape[b] > 1 && p->strides[v * KV_MAXD + b] % mult != 0) return false;
  return true;
}

/* The shaders a tensor-core product of dtype t needs: the product's, and for bf16 the
** scales' (and the conversion's) */
static bool cm_pipelines_ok(int device, const vk_dev *d, const cm_variant *v, kiln_dtype t, int spec) {
  char sh[64];
  if (d->cm_emu && v->bf16) return false; /* the first kernels have no emulated build */
  snprintf(sh, sizeof sh, "%s%s", t == KILN_BF16 && v->bf16 ? v->bf16 : v->f16, d->cm_emu ? "_emu" : "");
  if (t == KILN_BF16 && !(kiln__vk_pipeline_ok(device, "mm_absmax") &&
                          (v->bf16 || kiln__vk_pipeline_ok(device, "mm_cvt_f16"))))
    return false;
  return kiln__vk_pipeline_ok_spec(device, sh, spec);
}

/* Which kernel runs the product described by p (ex: sizes, matrix strides and flags; s:
** alpha and beta; addr and the batch strides of views 0 C, 1 A, 2 B); *lay gets the
** layout bits the fast kernels read (ex[13], and the tensor-core kernels' specialisation
** constant). d->coop_on needs the pipelines too: a driver that refuses one gets the next
** kernel instead of an error. allow_cm false: not the tensor cores (no room for bf16's
** scratch). */
static int mm_choose(vk_dev *d, int device, const kv_params *p, kiln_dtype ta, kiln_dtype tb, kiln_dtype tc,
                     bool mask, bool allow_cm, int *lay) {
  int64_t M = p->ex[0], N = p->ex[1], K = p->ex[2];
  int ars = p->ex[3], acs = p->ex[4], brs = p->ex[5], bcs = p->ex[6], crs = p->ex[7], ccs = p->ex[8];
  bool a_kc = acs == 1, a_mc = !a_kc && ars == 1, b_nc = bcs == 1, b_kc = !b_nc && brs == 1;
  *lay = (a_kc ? 1 : 0) | (b_nc ? 2 : 0);
  if (!d || mask || ta != tb || !(a_kc || a_mc) || !(b_nc || b_kc)) return MM_SMALL;
  int lda = a_kc ? ars : acs, ldb = b_nc ? brs : bcs;
  if (allow_cm && (d->coop_on || d->cm_emu) && (ta == KILN_F16 || ta == KILN_BF16)) {
    /* whole 16-byte vectors along the contiguous dim of A and B */
    int64_t ca = a_kc ? K : M, cb = b_nc ? N : K;
    bool ok = lda % 8 == 0 && ldb % 8 == 0 && ca % 8 == 0 && cb % 8 == 0 && p->addr[1] % 16 == 0 &&
              p->addr[2] % 16 == 0 && mm_batch_strides(p, 1, 8) && mm_batch_strides(p, 2, 8);
    /* bit 2: C's fragments stored straight from the registers (matmul_cmv.glsl): an f16 C
    ** with n contiguous, rows of whole vectors, and no beta, bias or ReLU to apply */
    bool direct = ta == KILN_F16 && tc == KILN_F16 && ccs == 1 && crs % 8 == 0 && p->addr[0] % 16 == 0 &&
                  mm_batch_strides(p, 0, 8) && (p->ex[12] & 15) == 0;
    const cm_variant *v = &cm_variants[d->cm_variant];
    int spec = *lay | (direct && !v->bf16 ? 4 : 0);
    if (ok && cm_pipelines_ok(device, d, v, ta, spec)) {
      *lay = spec;
      return MM_CM;
    }
    if (ok) /* kiln doctor says so; the products go on without tensor cores */
      snprintf(d->coop_why, sizeof d->coop_why, "the driver refused the pipeline of %s (layout %d)",
               ta == KILN_F16 || !v->bf16 ? v->f16 : v->bf16, spec);
  }
  /* A GPU wants about one 128x128 tile per multiprocessor at least (128: the largest GPUs
  ** have ~130); below that the 64x64 kernel keeps 4x the workgroups in flight. A CPU
  ** device (lavapipe) takes the big tiles whenever they fit, which keeps them tested. */
  int64_t batch = 1;
  for (int b = 0; b < p->ndim; b++) batch *= p->shape[b];
  int64_t tiles = ((M + 127) / 128) * ((N + 127) / 128) * batch;
  bool cpu_dev = d->props.deviceType == VK_PHYSICAL_DEVICE_TYPE_CPU;
  int al = ta == KILN_F32 ? 16 : 8;
  if (M >= 128 && N >= 128 && (cpu_dev || tiles >= 128) && lda % 4 == 0 && ldb % 4 == 0 && p->addr[1] % al == 0 &&
      p->addr[2] % al == 0 && mm_batch_strides(p, 1, 4) && mm_batch_strides(p, 2, 4)) {
    if (tc == KILN_F32 && ccs == 1 && crs % 4 == 0 && p->addr[0] % 16 == 0 && mm_batch_strides(p, 0, 4)) *lay |= 4;
    return MM_BIG;
  }
  return MM_SMALL;
}

static const char *mm_big_shader(const vk_dev *d, kiln_dtype t) {
  if (t == KILN_F16) return "matmul_big_f16";
  if (t == KILN_BF16) return "matmul_big_bf16";
  return d->mm_k16 ? "matmul_big_f32_k16" : "matmul_big_f32";
}

/* bf16 on tensor cores: the largest |x| of A's rows (at sc + z * M + m) and of B's columns
** (at sc + batch * M + z * N + n), f32 bits, into sc (batch * (M + N) floats) */
static kiln_status mm_absmax(int device, const kv_params *p, void *sc, size_t nsc) {
  int64_t batch = p->n, M = p->ex[0], N = p->ex[1], K = p->ex[2];
  kiln_status st = kiln__vk_memset_zero(device, sc, nsc);
  kv_params q = *p;
  uint32_t gk = (uint32_t)((K + 63) / 64);
  q.addr[0] = (uint64_t)(uintptr_t)sc;
  q.ex[0] = (int32_t)M, q.ex[1] = (int32_t)K, q.ex[2] = p->ex[3], q.ex[3] = p->ex[4];
  if (st == KILN_OK)
    st = kiln__vk_dispatch(device, "mm_absmax", &q, sizeof q, (uint32_t)((M + 255) / 256), gk, (uint32_t)batch);
  q.addr[0] += (uint64_t)batch * (uint64_t)M * sizeof(float);
  q.addr[1] = p->addr[2], q.dtype[1] = p->dtype[2];
  memcpy(&q.strides[1 * KV_MAXD], &p->strides[2 * KV_MAXD], sizeof(int32_t) * KV_MAXD);
  q.ex[0] = (int32_t)N, q.ex[1] = (int32_t)K, q.ex[2] = p->ex[6], q.ex[3] = p->ex[5];
  if (st == KILN_OK)
    st = kiln__vk_dispatch(device, "mm_absmax", &q, sizeof q, (uint32_t)((N + 255) / 256), gk, (uint32_t)batch);
  return st;
}

/* bf16 operand v (1 A, 2 B) of p, rows R of C contiguous elements (row stride ld), as
** scaled f16 into the packed [batch, R, C] copy h (mm_cvt_f16.comp); its lines' largest
** |x| at sc + base + z * T + line, a line being a row or (per_col) a column. Then p takes
** the copy in its place: f16, leading stride C, batch strides of the packed copy. */
static kiln_status mm_cvt(int device, kv_params *p, int v, void *h, void *sc, int64_t R, int64_t C, int ld,
                          bool per_col, int64_t base, int64_t T) {
  kv_params q = *p;
  q.nv = 2;
  q.addr[0] = (uint64_t)(uintptr_t)h, q.dtype[0] = KILN_F16;
  q.addr[1] = p->addr[v], q.dtype[1] = p->dtype[v];
  memcpy(&q.strides[1 * KV_MAXD], &p->strides[v * KV_MAXD], sizeof(int32_t) * KV_MAXD);
  q.addr[2] = (uint64_t)(uintptr_t)sc;
  q.ex[0] = (int32_t)R, q.ex[1] = (int32_t)C, q.ex[2] = ld, q.ex[3] = per_col ? 1 : 0;
  q.ex[4] = (int32_t)base, q.ex[5] = (int32_t)T;
  uint64_t groups = ((uint64_t)R * (uint64_t)C / 8 + 255) / 256;
  uint32_t gx = groups < 65535 ? (uint32_t)groups : 65535;
  uint32_t gy = (uint32_t)((groups + gx - 1) / gx);
  kiln_status st = kiln__vk_dispatch(device, "mm_cvt_f16", &q, sizeof q, gx, gy, (uint32_t)p->n);
  p->addr[v] = (uint64_t)(uintptr_t)h, p->dtype[v] = KILN_F16;
  int64_t bs = R * C;
  for (int d = p->ndim - 1; d >= 0; d--) {
    p->strides[v * KV_MAXD + d] = (int32_t)bs;
    bs *= p->shape[d];
  }
  return st;
}

static kiln_status vk_matmul(const kiln__kargs *a) {
  const kiln__view *C = &a->out[0], *A = &a->in[0], *B = &a->in[1];
  const kiln__view *bias = kiln__mm_bias(a), *mask = kiln__mm_mask(a);
  int nd = C->ndim, nb = nd - 2;
  kv_params p = {0};
  int64_t M = C->shape[nd - 2], N = C->shape[nd - 1], K = A->shape[nd - 1];
  /* the batch walk: C, A, B, bias (stride 0), mask */
  kiln__view bv[5] = {*C, *A, *B, *C, mask ? *mask : *A};
  for (int v = 0; v < 5; v++) {
    bv[v].ndim = nb > 0 ? nb : 1;
    if (nb == 0) bv[v].shape[0] = 1, bv[v].strides[0] = 0;
    for (int d = 0; d < nb; d++) {
      bv[v].shape[d] = C->shape[d];
      if (v == 3) bv[v].strides[d] = 0;
    }
  }
  if (bias) bv[3].data = bias->data, bv[3].dtype = bias->dtype;
  const kiln__view *vs[5] = {&bv[0], &bv[1], &bv[2], &bv[3], &bv[4]};
  set_views(&p, 5, vs);
  int64_t batch = p.n;
  p.ex[0] = (int32_t)M, p.ex[1] = (int32_t)N, p.ex[2] = (int32_t)K;
  p.ex[3] = (int32_t)A->strides[nd - 2], p.ex[4] = (int32_t)A->strides[nd - 1];
  p.ex[5] = (int32_t)B->strides[nd - 2], p.ex[6] = (int32_t)B->strides[nd - 1];
  p.ex[7] = (int32_t)C->strides[nd - 2], p.ex[8] = (int32_t)C->strides[nd - 1];
  p.ex[9] = bias ? (int32_t)bias->strides[bias->ndim - 1] : 0;
  p.ex[10] = mask ? (int32_t)mask->strides[nd - 2] : 0;
  p.ex[11] = mask ? (int32_t)mask->strides[nd - 1] : 0;
  p.ex[12] = ((a->i[1] & 1) ? 1 : 0) | (mask ? 2 : 0) | (bias ? 4 : 0) | (a->s[1] != 0 ? 8 : 0);
  p.s[0] = (float)a->s[0];
  p.s[1] = (float)a->s[1];
  kiln_status st = KILN_OK;
  if (M > 0 && N > 0 && batch > 0) {
    vk_dev *d = dev_of(a);
    int lay = 0;
    int path = mm_choose(d, a->device, &p, A->dtype, B->dtype, C->dtype, mask != NULL, true, &lay);
    uint32_t g128x = (uint32_t)((N + 127) / 128), g128y = (uint32_t)((M + 127) / 128);
    const cm_variant *cv = d ? &cm_variants[d->cm_variant] : NULL;
    /* bf16 on tensor cores: the largest |x| of A's rows and B's columns first, into a
    ** scratch of batch * (M + N) floats, then (matmul_cmv) A and B as scaled f16 copies;
    ** all freed at once (later work is ordered after this product) */
    void *sc = NULL, *ha = NULL, *hb = NULL;
    size_t nsc = (size_t)batch * (size_t)(M + N) * sizeof(float);
    size_t nha = (size_t)batch * (size_t)M * (size_t)K * 2, nhb = (size_t)batch * (size_t)K * (size_t)N * 2;
    bool cvt = path == MM_CM && A->dtype == KILN_BF16 && !cv->bf16;
    if (path == MM_CM && A->dtype == KILN_BF16) {
      sc = kiln__vk_alloc(a->device, nsc);
      if (sc && cvt) ha = kiln__vk_alloc(a->device, nha);
      if (ha) hb = kiln__vk_alloc(a->device, nhb);
      if (!sc || (cvt && !hb)) { /* no room for the scratch: a kernel that needs none */
        kiln_clear_error();
        kiln__vk_free(a->device, sc, nsc), kiln__vk_free(a->device, ha, nha);
        sc = ha = NULL;
        path = mm_choose(d, a->device, &p, A->dtype, B->dtype, C->dtype, false, false, &lay);
      }
    }
    p.ex[13] = lay;
    if (sc) {
      st = mm_absmax(a->device, &p, sc, nsc);
      p.addr[4] = (uint64_t)(uintptr_t)sc;
      p.ex[14] = (int32_t)batch;
    }
    if (st == KILN_OK && hb) {
      bool a_kc = (lay & 1) != 0, b_nc = (lay & 2) != 0;
      st = a_kc ? mm_cvt(a->device, &p, 1, ha, sc, M, K, p.ex[3], false, 0, M)
                : mm_cvt(a->device, &p, 1, ha, sc, K, M, p.ex[4], true, 0, M);
      if (st == KILN_OK)
        st = b_nc ? mm_cvt(a->device, &p, 2, hb, sc, K, N, p.ex[5], true, batch * M, N)
                  : mm_cvt(a->device, &p, 2, hb, sc, N, K, p.ex[6], false, batch * M, N);
      if (a_kc) p.ex[3] = (int32_t)K, p.ex[4] = 1;
      else p.ex[3] = 1, p.ex[4] = (int32_t)M;
      if (b_nc) p.ex[5] = (int32_t)N, p.ex[6] = 1;
      else p.ex[5] = 1, p.ex[6] = (int32_t)K;
      p.ex[12] |= 16; /* the epilogue divides the scales out */
    }
    if (path == MM_CM) {
      char sh[64];
      snprintf(sh, sizeof sh, "%s%s", A->dtype == KILN_F16 || !cv->bf16 ? cv->f16 : cv->bf16, d->cm_emu ? "_emu" : "");
      if (st == KILN_OK)
        st = kiln__vk_dispatch_spec(a->device, sh, lay, &p, sizeof p, (uint32_t)((N + cv->bn - 1) / cv->bn),
                                    (uint32_t)((M + cv->bm - 1) / cv->bm), (uint32_t)batch);
      kiln__vk_free(a->device, sc, nsc), kiln__vk_free(a->device, ha, nha), kiln__vk_free(a->device, hb, nhb);
    } else if (path == MM_BIG) {
      st = kiln__vk_dispatch(a->device, mm_big_shader(d, A->dtype), &p, sizeof p, g128x, g128y, (uint32_t)batch);
    } else {
      /* matmul128 (the general kernel's 128x128 form) ran 8x slower than the 64x64 one on
      ** the H200's driver (2.1 against 16.3 TFLOP/s at 8192^3), so only CPU devices
      ** (lavapipe) take it, for the masked and odd-stride products it alone covers. */
      bool cpu_dev = d && d->props.deviceType == VK_PHYSICAL_DEVICE_TYPE_CPU;
      bool big = M >= 128 && N >= 128 && K >= 8 && cpu_dev;
      int tile = big ? 128 : 64;
      st = kiln__vk_dispatch(a->device, big ? "matmul128" : "matmul", &p, sizeof p, (uint32_t)((N + tile - 1) / tile),
                             (uint32_t)((M + tile - 1) / tile), (uint32_t)batch);
    }
  }
  if (st == KILN_OK && a->n_out == 2 && M > 0) { /* out1 (M): A's row sums */
    put_view(&p, 0, &a->out[1]);
    p.ex[13] = (int32_t)a->out[1].strides[0];
    st = run_rows(a->device, sg_shader(a->device, "rowsum", "rowsum_sg"), &p, M);
  }
  return st;
}

kiln_status kiln_vulkan_matmul_path(int index, kiln_dtype dtype, int64_t m, int64_t n, int64_t k, char *out,
                                    size_t out_n) {
  if (!out || out_n == 0)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_vulkan_matmul_path: out is NULL or empty");
  out[0] = 0;
  vk_dev *d = kiln_device_count(KILN_DEVICE_VULKAN) > index ? kiln__vk_dev(index) : NULL;
  if (!d) return kiln_set_error(KILN_ERR_DEVICE, "kiln_vulkan_matmul_path: no device vulkan:%d", index);
  if (!is_float(dtype) || m <= 0 || n <= 0 || k <= 0 || m > I32MAX || n > I32MAX || k > I32MAX)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                          "kiln_vulkan_matmul_path: a product of %s [%lld, %lld] @ [%lld, %lld] is not one "
                          "vulkan:%d runs (f32, f16 or bf16, sizes from 1 to 2^31 - 1)",
                          kiln_dtype_name(dtype), (long long)m, (long long)k, (long long)k, (long long)n, index);
  /* a plain row-major product of contiguous, aligned operands */
  kv_params p = {0};
  p.ndim = 1, p.shape[0] = 1, p.n = 1;
  p.ex[0] = (int32_t)m, p.ex[1] = (int32_t)n, p.ex[2] = (int32_t)k;
  p.ex[3] = (int32_t)k, p.ex[4] = 1, p.ex[5] = (int32_t)n, p.ex[6] = 1, p.ex[7] = (int32_t)n, p.ex[8] = 1;
  p.s[0] = 1;
  int lay = 0;
  int path = mm_choose(d, index, &p, dtype, dtype, dtype, false, true, &lay);
  const cm_variant *cv = &cm_variants[d->cm_variant];
  char cmw[256];
  snprintf(cmw, sizeof cmw, "tensor cores%s: VK_NV_cooperative_matrix 16x16x16 f16 -> f32%s, %s '%s': %s",
           d->cm_emu ? " (emulated: KILN_VK_CM_EMU=1)" : "",
           dtype != KILN_BF16 ? ""
           : cv->bf16        ? " (bf16 as f16 with a power-of-two scale per row of A and column of B)"
                             : " (bf16 converted first to f16 with a power-of-two scale per row of A and column of B)",
           dtype == KILN_BF16 && cv->bf16 ? cv->bf16 : cv->f16, cv->key, cv->what);
  const char *big = dtype == KILN_F32 && d->mm_k16
                        ? "register-blocked 128x128 tiles, 8x8 fma per invocation, K steps of 16"
                        : "register-blocked 128x128 tiles, 8x8 fma per invocation";
  const char *what = path == MM_CM ? cmw : path == MM_BIG ? big : "64x64 tiles, 4x4 fma per invocation";
  const char *tc = "";
  char why[224] = "";
  if (path != MM_CM && dtype != KILN_F32)
    snprintf(why, sizeof why, "; no tensor cores: %s", d->coop_why[0] ? d->coop_why : "the operands do not qualify");
  else if (dtype == KILN_F32)
    tc = "; f32 stays exact (no TF32 path)";
  snprintf(out, out_n, "%s%s%s", what, tc, why);
  return KILN_OK;
}

kiln_status kiln_vulkan_coop_shapes(int index, char *out, size_t out_n) {
  if (!out || out_n == 0)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_vulkan_coop_shapes: out is NULL or empty");
  out[0] = 0;
  vk_dev *d = kiln_device_count(KILN_DEVICE_VULKAN) > index ? kiln__vk_dev(index) : NULL;
  if (!d) return kiln_set_error(KILN_ERR_DEVICE, "kiln_vulkan_coop_shapes: no device vulkan:%d", index);
  snprintf(out, out_n, "%s", d->coop_shapes);
  return KILN_OK;
}

static bool matmul_supports(const kiln__kargs *a) {
  const kiln__view *C = &a->out[0];
  int nd = C->ndim;
  if (nd < 2 || !all_float(a)) return false;
  if (a->in[0].dtype != C->dtype) return false; /* no wide (16-bit in, f32 out) products here */
  int64_t batch = 1;
  for (int d = 0; d < nd - 2; d++) batch *= C->shape[d];
  if (batch > 65535 || (C->shape[nd - 2] + 63) / 64 > 65535 || (C->shape[nd - 1] + 63) / 64 > 65535) return false;
  if (a->n_out == 2 && (nd != 2 || a->out[1].ndim != 1)) return false;
  return true;
}

/* ---- cross-entropy ---- */
static void ce_views(kv_params *p, const kiln__view *lg, const kiln__view *tg) {
  put_view(p, 0, lg);
  put_view(p, 1, tg);
  for (int v = 2; v < KV_MAXV; v++) put_view(p, v, lg); /* absent views: never touched */
  p->ex[0] = (int32_t)lg->shape[1];
  p->ex[1] = (int32_t)lg->strides[0], p->ex[2] = (int32_t)lg->strides[1];
  p->ex[3] = (int32_t)tg->strides[0];
}

static kiln_status vk_ce(const kiln__kargs *a) {
  const kiln__view *lg = &a->in[0], *tg = &a->in[1], *dl = kiln__ce_dlogits(a);
  int nout = a->n_out - (dl ? 1 : 0);
  int64_t N = lg->shape[0];
  if (lg->shape[1] == 0) return kiln_set_error(KILN_ERR_SHAPE, "kiln_cross_entropy: logits have 0 classes");
  kv_params p = {0};
  ce_views(&p, lg, tg);
  p.n = (int32_t)N;
  p.flag = flag_addr(a->device);
  p.i[0] = (int32_t)a->i[0];
  p.s[0] = (float)a->s[0];
  p.s[1] = 1.0f;
  if (dl) {
    put_view(&p, 5, dl);
    p.ex[7] = (int32_t)dl->strides[0], p.ex[8] = (int32_t)dl->strides[1];
    p.ex[9] |= 4;
  }
  if (a->op == KILN__K_CROSS_ENTROPY) {
    put_view(&p, 2, &a->out[0]);
    p.ex[4] = (int32_t)a->out[0].strides[0];
    if (nout > 1) put_view(&p, 3, &a->out[1]), p.ex[5] = (int32_t)a->out[1].strides[0], p.ex[9] |= 1;
    if (nout > 2) put_view(&p, 4, &a->out[2]), p.ex[6] = (int32_t)a->out[2].strides[0], p.ex[9] |= 2;
    return run_rows(a->device, sg_shader(a->device, "ce", "ce_sg"), &p, N);
  }
  /* the mean: count the kept rows (their gradient divides by it), the rows' losses into a
  ** scratch row, then their sum over the count */
  kv_params c = p;
  c.op = 1;
  c.ex[0] = (int32_t)N;
  c.ex[1] = (int32_t)tg->strides[0];
  put_view(&c, 1, tg);
  put_view(&c, 2, &a->out[2]);
  kiln_status st = kiln__vk_dispatch(a->device, sg_shader(a->device, "ce_mean", "ce_mean_sg"), &c, sizeof c, 1, 1, 1);
  if (st != KILN_OK) return st;
  void *scratch = kiln__vk_alloc(a->device, (size_t)(N > 0 ? N : 1) * 4);
  if (!scratch) return kiln_last_error();
  kiln__view sv = {.data = scratch, .dtype = KILN_F32, .ndim = 1, .shape = {N}, .strides = {1}};
  put_view(&p, 2, &sv);
  p.ex[4] = 1;
  put_view(&p, 3, &a->out[1]);
  p.ex[5] = (int32_t)a->out[1].strides[0];
  p.ex[9] |= 1;
  if (dl) put_view(&p, 4, &a->out[2]), p.ex[9] |= 8; /* the count: the gradient's 1 / count */
  st = run_rows(a->device, sg_shader(a->device, "ce", "ce_sg"), &p, N);
  if (st == KILN_OK) {
    c.op = 2;
    put_view(&c, 0, &a->out[0]);
    put_view(&c, 3, &sv);
    st = kiln__vk_dispatch(a->device, sg_shader(a->device, "ce_mean", "ce_mean_sg"), &c, sizeof c, 1, 1, 1);
  }
  /* the queue runs in order behind barriers: freeing now is safe (vk_memory.c) */
  kiln__vk_free(a->device, scratch, (size_t)(N > 0 ? N : 1) * 4);
  return st;
}

static kiln_status vk_ce_bw(const kiln__kargs *a) {
  const kiln__view *lg = &a->in[0], *tg = &a->in[1], *out = &a->out[0];
  kv_params p = {0};
  put_view(&p, 0, out);
  put_view(&p, 1, lg);
  put_view(&p, 2, tg);
  put_view(&p, 3, &a->in[2]);
  put_view(&p, 4, &a->in[3]);
  put_view(&p, 5, a->n_in > 4 ? &a->in[4] : &a->in[3]);
  p.ex[0] = (int32_t)lg->shape[1];
  p.ex[1] = (int32_t)lg->strides[0], p.ex[2] = (int32_t)lg->strides[1];
  p.ex[3] = (int32_t)tg->strides[0];
  p.flag = flag_addr(a->device);
  p.ex[4] = (int32_t)a->in[2].strides[0];
  p.ex[5] = (int32_t)a->in[3].strides[0];
  p.ex[6] = a->n_in > 4 ? (int32_t)a->in[4].strides[0] : 0;
  p.ex[7] = (int32_t)out->strides[0], p.ex[8] = (int32_t)out->strides[1];
  p.ex[9] = a->n_in > 4 ? 1 : 0;
  p.i[0] = (int32_t)a->i[0];
  p.s[0] = (float)a->s[0];
  p.n = (int32_t)(lg->shape[0] * lg->shape[1]);
  return run_1d(a->device, "ce_bw", &p, p.n);
}

static bool ce_supports(const kiln__kargs *a) {
  const kiln__view *lg = &a->in[0], *tg = &a->in[1];
  if (lg->ndim != 2 || tg->ndim != 1 || (tg->dtype != KILN_I64 && tg->dtype != KILN_I32)) return false;
  if (a->i[0] < INT32_MIN || a->i[0] > INT32_MAX || !is_float(lg->dtype)) return false;
  if (a->op == KILN__K_CROSS_ENTROPY && a->n_in > 2) return false; /* the fused gradient's divisor: not here */
  for (int i = 2; i < a->n_in; i++)
    if (!is_float(a->in[i].dtype) || a->in[i].ndim != 1) return false;
  for (int i = 0; i < a->n_out; i++)
    if (!is_float(a->out[i].dtype)) return false;
  return true;
}

/* ---- Adam (one tensor) ---- */
static int32_t fbits(double x) {
  float f = (float)x;
  int32_t b;
  memcpy(&b, &f, 4);
  return b;
}

static kiln_status vk_adam(const kiln__kargs *a) {
  kv_params p = {0};
  for (int k = 0; k < a->n_out; k++) put_view(&p, k, &a->out[k]);
  if (a->n_out < 4) put_view(&p, 3, &a->out[0]);
  put_view(&p, 4, &a->in[0]);
  p.n = (int32_t)kiln__view_numel(&a->out[0]);
  double lr = a->s[0], b1 = a->s[1], b2 = a->s[2], wd;
  memcpy(&wd, &a->i[2], sizeof wd);
  int64_t step = a->i[0] > 0 ? a->i[0] : 1;
  bool decoupled = (a->i[1] & 1) != 0, ams = (a->i[1] & 2) != 0 && a->n_out > 3;
  /* Python's arithmetic on Python floats, in adam.py's order (as cpu_optim.c) */
  p.ex[0] = fbits(1.0 - lr * wd);
  p.ex[1] = fbits(b1), p.ex[2] = fbits(1.0 - b1);
  p.ex[3] = fbits(b2), p.ex[4] = fbits(1.0 - b2);
  p.ex[5] = fbits(wd);
  p.ex[6] = fbits(sqrt(1.0 - pow(b2, (double)step)));
  p.ex[7] = fbits(a->s[3]);
  p.ex[8] = fbits(-(lr / (1.0 - pow(b1, (double)step))));
  p.i[0] = (decoupled ? 1 : (wd != 0 ? 2 : 0)) | (ams ? 4 : 0);
  return run_1d(a->device, "adam", &p, p.n);
}

static bool adam_supports(const kiln__kargs *a) {
  if ((a->i[1] & 4) || a->n_out < 3) return false; /* the step on the device: an f64 read */
  if (a->i[1] & 8) return false; /* the found-inf flag (loss scaling): not read here, fall back */
  kiln_dtype t = a->out[0].dtype;
  if (!is_float(t) || a->in[0].dtype != t || !kiln__view_is_contiguous(&a->in[0])) return false;
  for (int k = 0; k < a->n_out; k++)
    if (a->out[k].dtype != t || !kiln__view_is_contiguous(&a->out[k])) return false;
  return true;
}

/* ---- indexing ---- */
static kiln_status vk_index(const kiln__kargs *a) {
  int dim = (int)a->i[0];
  bool add = a->op == KILN__K_INDEX_ADD || a->op == KILN__K_SCATTER_ADD;
  bool one_d = a->op == KILN__K_INDEX_SELECT || a->op == KILN__K_INDEX_ADD;
  const kiln__view *walk = add ? &a->in[0] : &a->out[0];     /* the tensor walked */
  const kiln__view *other = add ? &a->out[0] : &a->in[0];    /* the one indexed */
  kiln__view v[3] = {a->out[0], a->in[0], a->in[1]};
  for (int k = 0; k < 3; k++) {
    v[k].ndim = walk->ndim;
    for (int d = 0; d < walk->ndim; d++) v[k].shape[d] = walk->shape[d];
  }
  int oi = add ? 0 : 1; /* the indexed view's slot: its own stride along dim comes from the index */
  v[oi].strides[dim] = 0;
  if (one_d) {
    for (int d = 0; d < walk->ndim; d++) v[2].strides[d] = 0;
    v[2].strides[dim] = a->in[1].strides[0];
  }
  kv_params p = {0};
  const kiln__view *vs[3] = {&v[0], &v[1], &v[2]};
  set_views(&p, 3, vs);
  p.op = a->op == KILN__K_INDEX_SELECT ? KV_INDEX_SELECT : a->op == KILN__K_INDEX_ADD ? KV_INDEX_ADD
       : a->op == KILN__K_GATHER ? KV_GATHER : KV_SCATTER_ADD;
  p.ex[0] = (int32_t)other->strides[dim];
  p.ex[1] = (int32_t)other->shape[dim];
  p.i[0] = (int32_t)kiln_dtype_size(a->out[0].dtype);
  p.flag = flag_addr(a->device);
  return run_1d(a->device, "index", &p, p.n);
}

static bool index_supports(const kiln__kargs *a) {
  kiln_dtype it = a->in[1].dtype;
  if (it != KILN_I64 && it != KILN_I32) return false;
  if (a->in[0].dtype != a->out[0].dtype) return false;
  bool add = a->op == KILN__K_INDEX_ADD || a->op == KILN__K_SCATTER_ADD;
  if (add && !is_float(a->out[0].dtype)) return false; /* CAS adds: f32, f16, bf16 */
  int dim = (int)a->i[0];
  const kiln__view *walk = add ? &a->in[0] : &a->out[0];
  return dim >= 0 && dim < walk->ndim;
}

/* ---- random (f32) ---- */
static kiln_status vk_random(const kiln__kargs *a) {
  kv_params p = {0};
  const kiln__view *vs[1] = {&a->out[0]};
  set_views(&p, 1, vs);
  p.i[0] = (int32_t)(uint32_t)a->seed, p.i[1] = (int32_t)(uint32_t)(a->seed >> 32);
  p.ex[0] = (int32_t)(uint32_t)a->offset, p.ex[1] = (int32_t)(uint32_t)(a->offset >> 32);
  switch (a->op) {
  case KILN__K_RAND_UNIFORM: {
    float lo = (float)a->s[0], hi = (float)a->s[1];
    p.op = KV_RAND_UNIFORM;
    p.s[0] = lo;
    p.s[1] = (float)(a->s[1] - a->s[0]);
    p.ex[2] = fbits(hi > lo ? nextafterf(hi, -INFINITY) : hi);
    break;
  }
  case KILN__K_RAND_NORMAL:
    p.op = KV_RAND_NORMAL;
    p.s[0] = (float)a->s[0], p.s[1] = (float)a->s[1];
    break;
  default: { /* bernoulli: u < p exactly, u = j * 2^-24: j < ceil(p * 2^24) */
    double t = ceil(a->s[0] * 16777216.0);
    p.op = KV_RAND_BERNOULLI;
    p.ex[3] = !(t > 0) ? 0 : t > 16777217.0 ? 16777217 : (int32_t)t;
    p.s[1] = (float)a->s[1];
    break;
  }
  }
  return run_1d(a->device, "random", &p, p.n);
}

/* ---- ARANGE, EYE, RAND_INT, TRIL ---- */
static void put_f64_bits(kv_params *p, int at, double x) {
  uint64_t u;
  memcpy(&u, &x, 8);
  p->ex[at] = (int32_t)(uint32_t)u, p->ex[at + 1] = (int32_t)(uint32_t)(u >> 32);
}

static void put_u64(kv_params *p, int at, uint64_t u) {
  p->ex[at] = (int32_t)(uint32_t)u, p->ex[at + 1] = (int32_t)(uint32_t)(u >> 32);
}

/* ARANGE and RAND_INT compute in f64 as the CPU does (arange.comp): devices with
** shaderFloat64 only; the rest fall back. */
static kiln_status vk_arange(const kiln__kargs *a) {
  kv_params p = {0};
  const kiln__view *vs[1] = {&a->out[0]};
  set_views(&p, 1, vs);
  put_f64_bits(&p, 0, a->s[0]);
  put_f64_bits(&p, 2, a->s[1]);
  return run_1d(a->device, "arange", &p, p.n);
}

static kiln_status vk_rand_int(const kiln__kargs *a) {
  if (a->i[1] <= a->i[0])
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_randint: low %lld must be below high %lld",
                          (long long)a->i[0], (long long)a->i[1]);
  kv_params p = {0};
  const kiln__view *vs[1] = {&a->out[0]};
  set_views(&p, 1, vs);
  p.op = 1;
  p.i[0] = (int32_t)(uint32_t)a->seed, p.i[1] = (int32_t)(uint32_t)(a->seed >> 32);
  put_u64(&p, 4, a->offset);
  put_u64(&p, 6, (uint64_t)a->i[0]);
  put_u64(&p, 8, (uint64_t)a->i[1]);
  return run_1d(a->device, "arange", &p, p.n);
}

/* A view as it is (no coalescing): the walk needs its row and column indices. */
static void set_views_as_is(kv_params *p, int nv, const kiln__view *const *vs) {
  p->nv = nv;
  p->ndim = vs[0]->ndim;
  p->n = (int32_t)kiln__view_numel(vs[0]);
  for (int d = 0; d < vs[0]->ndim; d++) p->shape[d] = (int32_t)vs[0]->shape[d];
  for (int i = 0; i < nv; i++) {
    p->addr[i] = (uint64_t)(uintptr_t)vs[i]->data;
    p->dtype[i] = (int32_t)vs[i]->dtype;
    for (int d = 0; d < vs[i]->ndim; d++) p->strides[i * KV_MAXD + d] = (int32_t)vs[i]->strides[d];
  }
}

static kiln_status vk_eye(const kiln__kargs *a) {
  if (a->out[0].ndim != 2)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_eye: out must be 2-d, got %d dims", a->out[0].ndim);
  kv_params p = {0};
  const kiln__view *vs[1] = {&a->out[0]};
  set_views_as_is(&p, 1, vs);
  p.op = KV_M_EYE;
  p.ex[0] = (int32_t)a->out[0].shape[1];
  return run_1d(a->device, "misc", &p, p.n);
}

static kiln_status vk_tril(const kiln__kargs *a) {
  const kiln__view *x = &a->in[0], *y = &a->out[0];
  if (x->ndim < 2 || x->dtype != y->dtype)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_tril: the kernel wants 2 or more dims and one dtype");
  kv_params p = {0};
  const kiln__view *vs[2] = {y, x};
  set_views_as_is(&p, 2, vs);
  p.op = KV_M_TRIL;
  p.i[0] = (int32_t)a->i[0];
  p.i[1] = a->i[1] == 1;
  p.i[2] = (int32_t)kiln_dtype_size(x->dtype);
  return run_1d(a->device, "misc", &p, p.n);
}

/* ---- CUMSUM: one invocation per line along dim i0 ---- */
static kiln_status vk_cumsum(const kiln__kargs *a) {
  int dim = (int)a->i[0];
  if (dim < 0 || dim >= a->in[0].ndim)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_cumsum: dim %d invalid for %d dims", dim, a->in[0].ndim);
  const kiln__view *src[2] = {&a->out[0], &a->in[0]};
  kv_params p = {0};
  lines_along(&p, 2, src, dim);
  p.ex[0] = (int32_t)a->in[0].shape[dim];
  p.i[0] = a->i[1] == 1;
  if (p.ex[0] == 0 || p.n == 0) return KILN_OK;
  uint64_t groups = ((uint64_t)p.n + 63) / 64;
  uint32_t gx = groups < 65535 ? (uint32_t)groups : 65535;
  return kiln__vk_dispatch(a->device, "cumsum", &p, sizeof p, gx, (uint32_t)((groups + gx - 1) / gx), 1);
}

static bool cumsum_supports(const kiln__kargs *a) {
  kiln_dtype t = a->in[0].dtype, o = a->out[0].dtype;
  int dim = (int)a->i[0];
  if (dim < 0 || dim >= a->in[0].ndim || a->in[0].ndim > KV_MAXD + 1) return false;
  if (is_float(t)) return o == t;
  return is_int(t) && o == KILN_I64;
}

/* ---- LAYER_NORM (+ RMS), LAYER_NORM_BACKWARD ---- */
static kiln_status vk_layer_norm(const kiln__kargs *a) {
  bool bw = a->op == KILN__K_LAYER_NORM_BACKWARD, rms = a->i[1] == 1;
  const kiln__view *x = &a->in[0];
  if (x->ndim != 2 || a->out[0].ndim != 2)
    return kiln_set_error(KILN_ERR_SHAPE, "%s: the kernel wants x as (rows, n)",
                          bw ? "kiln_layer_norm_backward" : "kiln_layer_norm");
  int64_t R = x->shape[0], N = x->shape[1];
  kv_params p = {0};
  p.ex[0] = (int32_t)R, p.ex[1] = (int32_t)N;
  p.ex[2] = (int32_t)x->strides[0], p.ex[3] = (int32_t)x->strides[1];
  p.ex[6] = (int32_t)a->out[0].strides[0], p.ex[7] = (int32_t)a->out[0].strides[1];
  p.ex[12] = ((a->i[0] & 1) ? 1 : 0) | (rms ? 4 : 0);
  p.s[0] = (float)a->s[0];
  for (int v = 0; v < KV_MAXV; v++) put_view(&p, v, x); /* absent views: never touched */
  put_view(&p, 0, &a->out[0]);
  if (!bw) {
    int wi = 1;
    if (a->i[0] & 1) put_view(&p, 2, &a->in[wi]), p.ex[10] = (int32_t)a->in[wi].strides[0], wi++;
    if (a->i[0] & 2) put_view(&p, 3, &a->in[wi]), p.ex[11] = (int32_t)a->in[wi].strides[0], p.ex[12] |= 2;
    if (rms) {
      put_view(&p, 5, &a->out[1]), p.ex[9] = (int32_t)a->out[1].strides[0];
    } else {
      put_view(&p, 4, &a->out[1]), p.ex[8] = (int32_t)a->out[1].strides[0];
      put_view(&p, 5, &a->out[2]), p.ex[9] = (int32_t)a->out[2].strides[0];
    }
    p.op = KV_LN_FWD;
    if (R == 0 || N == 0) return KILN_OK;
    return run_rows(a->device, "layernorm", &p, R);
  }
  put_view(&p, 1, x);
  put_view(&p, 2, &a->in[1]);
  p.ex[4] = (int32_t)a->in[1].strides[0], p.ex[5] = (int32_t)a->in[1].strides[1];
  put_view(&p, 3, &a->in[2]), p.ex[8] = (int32_t)a->in[2].strides[0];
  put_view(&p, 4, &a->in[3]), p.ex[9] = (int32_t)a->in[3].strides[0];
  if (a->i[0] & 1) put_view(&p, 5, &a->in[4]), p.ex[10] = (int32_t)a->in[4].strides[0];
  kiln_status st = KILN_OK;
  p.op = KV_LN_BWD;
  if (R > 0 && N > 0) st = run_rows(a->device, "layernorm", &p, R);
  if (st != KILN_OK || a->n_out < 2) return st;
  /* the weight's (and bias's) gradients: one invocation per column, over every row */
  kv_params w = p;
  w.op = KV_LN_WGRAD;
  w.ex[12] = rms ? 4 : 0;
  put_view(&w, 0, &a->out[1]), w.ex[10] = (int32_t)a->out[1].strides[0];
  if (a->n_out > 2) put_view(&w, 5, &a->out[2]), w.ex[11] = (int32_t)a->out[2].strides[0], w.ex[12] |= 2;
  if (N == 0) return KILN_OK;
  return run_1d(a->device, "layernorm", &w, N);
}

static bool layer_norm_supports(const kiln__kargs *a) {
  if (a->in[0].ndim != 2 || a->out[0].ndim != 2) return false;
  for (int i = 0; i < a->n_in; i++)
    if (!is_float(a->in[i].dtype)) return false;
  for (int i = 0; i < a->n_out; i++)
    if (!is_float(a->out[i].dtype)) return false;
  return true;
}

/* ---- IM2COL, COL2IM, MAX_POOL2D ---- */
static kiln_status vk_window(const kiln__kargs *a) {
  const kiln__conv_params *cp = a->params;
  if (!cp) return kiln_set_error(KILN_ERR_INTERNAL, "kiln: %s without its window parameters", kiln__kop_name(a->op));
  const kiln__view *x = a->op == KILN__K_COL2IM ? &a->out[0] : &a->in[0];
  kv_params p = {0};
  const kiln__view *vs[3] = {&a->out[0], &a->in[0], a->n_out > 1 ? &a->out[1] : &a->out[0]};
  set_views_as_is(&p, 3, vs);
  p.op = a->op == KILN__K_IM2COL ? KV_W_IM2COL : a->op == KILN__K_COL2IM ? KV_W_COL2IM : KV_W_MAXPOOL;
  for (int k = 0; k < 2; k++) {
    p.ex[0 + k] = (int32_t)cp->kernel[k], p.ex[2 + k] = (int32_t)cp->stride[k];
    p.ex[4 + k] = (int32_t)cp->padding[k], p.ex[6 + k] = (int32_t)cp->dilation[k];
  }
  p.ex[8] = (int32_t)x->shape[2], p.ex[9] = (int32_t)x->shape[3];
  const kiln__view *o = a->op == KILN__K_IM2COL ? &a->out[0] : a->op == KILN__K_COL2IM ? &a->in[0] : &a->out[0];
  p.ex[10] = (int32_t)o->shape[o->ndim - 2], p.ex[11] = (int32_t)o->shape[o->ndim - 1];
  p.i[2] = (int32_t)kiln_dtype_size(a->in[0].dtype);
  return run_1d(a->device, "window", &p, p.n);
}

static bool window_supports(const kiln__kargs *a) {
  const kiln__conv_params *cp = a->params;
  if (!cp) return false;
  for (int k = 0; k < 2; k++)
    if (cp->kernel[k] > I32MAX || cp->stride[k] < 1 || cp->stride[k] > I32MAX || cp->padding[k] > I32MAX ||
        cp->padding[k] < 0 || cp->dilation[k] > I32MAX)
      return false;
  switch (a->op) {
  case KILN__K_IM2COL: /* bits moved: f64 too */
    return a->in[0].ndim == 4 && a->out[0].ndim == 6 && a->in[0].dtype == a->out[0].dtype &&
           (is_float(a->in[0].dtype) || a->in[0].dtype == KILN_F64);
  case KILN__K_COL2IM:
    return a->in[0].ndim == 6 && a->out[0].ndim == 4 && is_float(a->in[0].dtype) && is_float(a->out[0].dtype);
  default:
    return a->in[0].ndim == 4 && a->out[0].ndim == 4 && a->n_out == 2 && is_float(a->in[0].dtype) &&
           a->out[0].dtype == a->in[0].dtype && a->out[1].dtype == KILN_I64;
  }
}

/* ---- AMP_UNSCALE (a list of width 1), ADAM_MULTI (groups of ADAM) ---- */
static kiln_status vk_amp_unscale(const kiln__kargs *a) {
  if (a->list_w != 1 || a->n_out < 1 || a->out[0].dtype != KILN_F32)
    return kiln_set_error(KILN_ERR_INTERNAL, "kiln amp_unscale kernel: expected a list of width 1 and an f32 flag");
  for (int g = 0; g < a->list_n; g++) {
    kv_params p = {0};
    const kiln__view *vs[1] = {&a->list[g]};
    set_views(&p, 1, vs);
    p.nv = 1;
    put_view(&p, 1, &a->out[0]);
    p.op = KV_M_UNSCALE;
    p.s[0] = (float)a->s[0];
    kiln_status st = run_1d(a->device, "misc", &p, p.n);
    if (st != KILN_OK) return st;
  }
  return KILN_OK;
}

static bool amp_unscale_supports(const kiln__kargs *a) {
  if (a->list_w != 1 || a->n_out < 1 || a->out[0].dtype != KILN_F32) return false;
  for (int g = 0; g < a->list_n; g++)
    if (!is_float(a->list[g].dtype) || !fits(&a->list[g])) return false;
  return true;
}

static kiln_status vk_adam(const kiln__kargs *a);
static bool adam_supports(const kiln__kargs *a);

/* Group g of an ADAM_MULTI as one ADAM (host-side step; flag 4 is not supported here). */
static void adam_group(const kiln__kargs *a, int g, kiln__kargs *one) {
  *one = *a;
  one->op = KILN__K_ADAM;
  one->list_n = 0, one->list = NULL, one->list_i = NULL;
  const kiln__view *v = &a->list[(size_t)g * (size_t)a->list_w];
  one->n_in = 1;
  one->in[0] = v[0];
  one->n_out = a->list_w - 1;
  for (int k = 0; k < one->n_out && k < KILN__MAX_KOUT; k++) one->out[k] = v[1 + k];
  one->i[0] = a->list_i ? a->list_i[g] : 1;
}

static kiln_status vk_adam_multi(const kiln__kargs *a) {
  for (int g = 0; g < a->list_n; g++) {
    kiln__kargs one;
    adam_group(a, g, &one);
    /* the groups update disjoint tensors: no barrier between them, so the GPU may overlap
    ** them (one per parameter: four each step of a two-layer MLP) */
    if (g > 0) kiln__vk_next_independent(a->device, true);
    kiln_status st = vk_adam(&one);
    kiln__vk_next_independent(a->device, false); /* consumed, or nothing was dispatched */
    if (st != KILN_OK) return st;
  }
  return KILN_OK;
}

static bool adam_multi_supports(const kiln__kargs *a) {
  if ((a->i[1] & (4 | 16)) || a->list_w < 4 || a->list_w > 5) return false; /* 16: autocast's copies (not here) */
  for (int g = 0; g < a->list_n; g++) {
    kiln__kargs one;
    adam_group(a, g, &one);
    for (int k = 0; k < a->list_w; k++)
      if (!fits(&a->list[(size_t)g * (size_t)a->list_w + (size_t)k])) return false;
    if (!adam_supports(&one)) return false;
  }
  return true;
}

/* ---- ATTENTION, ATTENTION_BACKWARD ---- */
#define VK_ATT_MAXD 128 /* attention.comp's KV_ATT_MAXD: q and the accumulator in registers */

static void put_view_strides(kv_params *p, int slot, const kiln__view *v) {
  put_view(p, slot, v);
  for (int d = 0; d < v->ndim && d < KV_MAXD; d++) p->strides[slot * KV_MAXD + d] = (int32_t)v->strides[d];
}

static kiln_status vk_attention(const kiln__kargs *a) {
  const kiln__view *q = &a->in[0], *k = &a->in[1], *v = &a->in[2];
  if (q->ndim != 4 || k->ndim != 4 || v->ndim != 4)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_scaled_dot_product_attention: the kernel wants 4-d q, k, v");
  bool masked = (a->i[0] & 2) != 0;
  kv_params p = {0};
  put_view_strides(&p, 0, &a->out[0]);
  put_view_strides(&p, 1, q);
  put_view_strides(&p, 2, k);
  put_view_strides(&p, 3, v);
  put_view_strides(&p, 4, masked ? &a->in[3] : q);
  put_view_strides(&p, 5, &a->out[1]);
  int64_t B = q->shape[0], H = q->shape[1], Tq = q->shape[2], Tk = k->shape[2];
  p.ex[0] = (int32_t)B, p.ex[1] = (int32_t)H, p.ex[2] = (int32_t)Tq, p.ex[3] = (int32_t)Tk;
  p.ex[4] = (int32_t)q->shape[3], p.ex[5] = (int32_t)v->shape[3];
  p.ex[6] = (a->i[0] & 1) | (masked ? 2 : 0) | (masked && a->in[3].dtype == KILN_BOOL ? 4 : 0);
  float sch = (float)a->s[0], scl = (float)(a->s[0] - (double)sch); /* the scale as hi + lo */
  memcpy(&p.ex[10], &sch, 4);
  memcpy(&p.ex[11], &scl, 4);
  if (a->s[1] > 0) { /* kept when u = j 2^-24 < 1 - p: j < ceil((1 - p) 2^24), as RAND_BERNOULLI */
    double keep = 1.0 - a->s[1], t = ceil(keep * 16777216.0);
    p.ex[6] |= 8;
    p.ex[7] = !(t > 0) ? 0 : t > 16777217.0 ? 16777217 : (int32_t)t;
    p.s[1] = keep > 0 ? (float)(1.0 / keep) : 0.0f;
  }
  p.i[0] = (int32_t)(uint32_t)a->seed, p.i[1] = (int32_t)(uint32_t)(a->seed >> 32);
  put_u64(&p, 8, a->offset);
  int64_t rows = B * H * Tq;
  if (rows == 0) return KILN_OK;
  uint64_t groups = ((uint64_t)rows + 63) / 64;
  uint32_t gx = groups < 65535 ? (uint32_t)groups : 65535;
  return kiln__vk_dispatch(a->device, "attention", &p, sizeof p, gx, (uint32_t)((groups + gx - 1) / gx), 1);
}

/* Three dispatches of attention_bw (dq with each query row's delta, then dk, then dv) and a
** scratch row of deltas (B*H*Tq f32). */
static kiln_status vk_attention_bw(const kiln__kargs *a) {
  const kiln__view *q = &a->in[0], *k = &a->in[1], *v = &a->in[2], *lse = &a->out[3];
  bool masked = (a->i[0] & 2) != 0;
  kv_params p = {0};
  put_view_strides(&p, 1, q);
  put_view_strides(&p, 2, k);
  put_view_strides(&p, 3, v);
  put_view_strides(&p, 4, masked ? &a->in[4] : q);
  put_view_strides(&p, 5, &a->in[3]);
  int64_t B = q->shape[0], H = q->shape[1], Tq = q->shape[2], Tk = k->shape[2];
  p.ex[0] = (int32_t)B, p.ex[1] = (int32_t)H, p.ex[2] = (int32_t)Tq, p.ex[3] = (int32_t)Tk;
  p.ex[4] = (int32_t)q->shape[3], p.ex[5] = (int32_t)v->shape[3];
  p.ex[6] = (a->i[0] & 1) | (masked ? 2 : 0) | (masked && a->in[4].dtype == KILN_BOOL ? 4 : 0);
  float sch = (float)a->s[0], scl = (float)(a->s[0] - (double)sch);
  memcpy(&p.ex[10], &sch, 4);
  memcpy(&p.ex[11], &scl, 4);
  if (a->s[1] > 0) {
    double keep = 1.0 - a->s[1], t = ceil(keep * 16777216.0);
    p.ex[6] |= 8;
    p.ex[7] = !(t > 0) ? 0 : t > 16777217.0 ? 16777217 : (int32_t)t;
    p.s[1] = keep > 0 ? (float)(1.0 / keep) : 0.0f;
  }
  p.i[0] = (int32_t)(uint32_t)a->seed, p.i[1] = (int32_t)(uint32_t)(a->seed >> 32);
  put_u64(&p, 8, a->offset);
  put_u64(&p, 12, (uint64_t)(uintptr_t)lse->data);
  for (int d = 0; d < 3; d++) p.shape[d] = (int32_t)lse->strides[d];
  int64_t nq = B * H * Tq, nk = B * H * Tk;
  size_t sbytes = (size_t)(nq > 0 ? nq : 1) * 4;
  void *delta = kiln__vk_alloc(a->device, sbytes);
  if (!delta) return kiln_last_error();
  p.flag = (uint64_t)(uintptr_t)delta;
  kiln_status st = KILN_OK;
  for (int op = 1; op <= 3 && st == KILN_OK; op++) {
    p.op = op;
    put_view_strides(&p, 0, &a->out[op - 1]);
    int64_t rows = op == 1 ? nq : nk;
    if (rows == 0) continue;
    uint64_t groups = ((uint64_t)rows + 63) / 64;
    uint32_t gx = groups < 65535 ? (uint32_t)groups : 65535;
    st = kiln__vk_dispatch(a->device, "attention_bw", &p, sizeof p, gx, (uint32_t)((groups + gx - 1) / gx), 1);
  }
  /* the queue runs in order behind barriers: freeing now is safe (vk_memory.c) */
  kiln__vk_free(a->device, delta, sbytes);
  return st;
}

static bool attention_supports(const kiln__kargs *a) {
  if (a->op == KILN__K_ATTENTION_BACKWARD) {
    if (a->n_out < 4 || a->out[3].dtype != KILN_F32 || a->out[3].ndim != 3 || a->n_in < 4) return false;
    for (int i = 0; i < 3; i++)
      if (!is_float(a->out[i].dtype) || a->out[i].ndim != 4) return false;
    if (!is_float(a->in[3].dtype) || a->in[3].ndim != 4) return false;
    if ((a->i[0] & 2) && (a->n_in < 5 || (a->in[4].dtype != KILN_BOOL && !is_float(a->in[4].dtype)))) return false;
    const kiln__view *q = &a->in[0], *k = &a->in[1], *v = &a->in[2];
    if (q->ndim != 4 || k->ndim != 4 || v->ndim != 4) return false;
    if (q->shape[3] > VK_ATT_MAXD || v->shape[3] > VK_ATT_MAXD) return false;
    for (int i = 0; i < 3; i++)
      if (!is_float(a->in[i].dtype)) return false;
    return true;
  }
  const kiln__view *q = &a->in[0], *k = &a->in[1], *v = &a->in[2];
  if (q->ndim != 4 || k->ndim != 4 || v->ndim != 4 || a->n_out < 2) return false;
  if (q->shape[3] > VK_ATT_MAXD || v->shape[3] > VK_ATT_MAXD) return false;
  if (q->shape[0] * q->shape[1] * q->shape[2] * (k->shape[2] > 0 ? k->shape[2] : 1) > I32MAX * 4LL) return false;
  for (int i = 0; i < 3; i++)
    if (!is_float(a->in[i].dtype)) return false;
  if ((a->i[0] & 2) && a->in[3].dtype != KILN_BOOL && !is_float(a->in[3].dtype)) return false;
  return is_float(a->out[0].dtype) && is_float(a->out[1].dtype);
}

/* ---- TOPK: one invocation per line, k selection rounds (topk.comp) ---- */
static kiln_status vk_topk(const kiln__kargs *a) {
  int dim = (int)a->i[0];
  const kiln__view *x = &a->in[0];
  if (dim < 0 || dim >= x->ndim || a->i[1] < 0 || a->i[1] > x->shape[dim] || a->out[0].shape[dim] != a->i[1] ||
      a->out[0].dtype != x->dtype)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_topk: dim %d and k %lld do not fit the views", dim,
                          (long long)a->i[1]);
  const kiln__view *src[3] = {&a->out[0], x, &a->out[1]};
  kv_params p = {0};
  lines_along(&p, 3, src, dim);
  p.ex[0] = (int32_t)x->shape[dim];
  p.i[0] = (int32_t)a->i[1];
  p.i[1] = (a->i[2] & 1) ? 1 : 0;
  if (p.n == 0 || a->i[1] == 0) return KILN_OK;
  uint64_t groups = ((uint64_t)p.n + 63) / 64;
  uint32_t gx = groups < 65535 ? (uint32_t)groups : 65535;
  return kiln__vk_dispatch(a->device, "topk", &p, sizeof p, gx, (uint32_t)((groups + gx - 1) / gx), 1);
}

static bool topk_supports(const kiln__kargs *a) {
  int dim = (int)a->i[0];
  const kiln__view *x = &a->in[0];
  return dim >= 0 && dim < x->ndim && x->ndim <= KV_MAXD + 1 && is_float(x->dtype) && a->out[0].dtype == x->dtype &&
         a->n_out == 2 && a->out[1].dtype == KILN_I64 && a->i[1] >= 0 && a->i[1] <= x->shape[dim];
}

bool kiln__vk_supports(const kiln__kargs *a) {
  for (int i = 0; i < a->n_in; i++)
    if (!fits(&a->in[i])) return false;
  for (int i = 0; i < a->n_out; i++)
    if (!fits(&a->out[i])) return false;
  vk_dev *d = dev_of(a);
  switch (a->op) {
  case KILN__K_COPY: /* casts to or from f64 need shaderFloat64 */
    return a->in[0].dtype == a->out[0].dtype ||
           (d && d->f64) || (a->in[0].dtype != KILN_F64 && a->out[0].dtype != KILN_F64);
  case KILN__K_FILL: return true;
  case KILN__K_SUM: case KILN__K_PROD: case KILN__K_AMAX: case KILN__K_AMIN: return reduce_supports(a);
  case KILN__K_SOFTMAX: case KILN__K_LOG_SOFTMAX: case KILN__K_SOFTMAX_BACKWARD:
  case KILN__K_LOG_SOFTMAX_BACKWARD: return all_float(a) && a->out[0].ndim <= KV_MAXD + 1;
  case KILN__K_MATMUL: return matmul_supports(a);
  case KILN__K_MAX_DIM: case KILN__K_MIN_DIM: return minmax_dim_supports(a);
  case KILN__K_CROSS_ENTROPY: case KILN__K_CROSS_ENTROPY_MEAN: case KILN__K_CROSS_ENTROPY_BACKWARD:
    return ce_supports(a);
  case KILN__K_ADAM: return adam_supports(a);
  case KILN__K_INDEX_SELECT: case KILN__K_INDEX_ADD: case KILN__K_GATHER: case KILN__K_SCATTER_ADD:
    return index_supports(a);
  case KILN__K_RAND_UNIFORM: case KILN__K_RAND_NORMAL: case KILN__K_RAND_BERNOULLI:
    return a->out[0].dtype == KILN_F32;
  case KILN__K_ARANGE: case KILN__K_RAND_INT: /* f64 arithmetic, as the CPU */
    return d && d->f64 && (a->op == KILN__K_ARANGE || a->out[0].dtype == KILN_I64);
  case KILN__K_EYE: return a->out[0].ndim == 2 && a->out[0].dtype != KILN_F64;
  case KILN__K_TRIL: return a->in[0].ndim >= 2 && a->in[0].dtype == a->out[0].dtype;
  case KILN__K_CUMSUM: return cumsum_supports(a);
  case KILN__K_LAYER_NORM: case KILN__K_LAYER_NORM_BACKWARD: return layer_norm_supports(a);
  case KILN__K_IM2COL: case KILN__K_COL2IM: case KILN__K_MAX_POOL2D: return window_supports(a);
  case KILN__K_AMP_UNSCALE: return amp_unscale_supports(a);
  case KILN__K_ADAM_MULTI: return adam_multi_supports(a);
  case KILN__K_ATTENTION: case KILN__K_ATTENTION_BACKWARD: return attention_supports(a);
  case KILN__K_TOPK: return topk_supports(a);
  default: return ew_supports(a);
  }
}

/* Not const: the probe sets best_rank (a discrete GPU ranks above an integrated one;
** lavapipe, a CPU, never beats the CPU itself). */
kiln__backend kiln__vulkan_backend = {
    .name = "vulkan",
    .type = KILN_DEVICE_VULKAN,
    .host_visible = false, /* pointers are device addresses, even on unified memory */
    .probe = kiln__vk_probe,
    .device_count = kiln__vk_device_count,
    .alloc = kiln__vk_alloc,
    .free = kiln__vk_free,
    .copy_to_host = kiln__vk_copy_to_host,
    .copy_from_host = kiln__vk_copy_from_host,
    .copy_device = kiln__vk_copy_device,
    .memset_zero = kiln__vk_memset_zero,
    .synchronize = kiln__vk_synchronize,
    .memory_stats = kiln__vk_memory_stats,
    .empty_cache = kiln__vk_empty_cache,
    .set_memory_limit = kiln__vk_set_limit,
    .reset_peak = kiln__vk_reset_peak,
    .kernels = {
    [KILN__K_COPY] = vk_copy,
    [KILN__K_FILL] = vk_fill,
#define EW(K) [KILN__K_##K] = vk_ew,
    EW(NEG) EW(EXP) EW(LOG) EW(SQRT) EW(RSQRT) EW(ABS) EW(SIGN) EW(RELU) EW(LEAKY_RELU)
    EW(GELU) EW(GELU_TANH) EW(SILU) EW(SIGMOID) EW(TANH) EW(SOFTPLUS) EW(CLAMP) EW(POW_SCALAR)
    EW(AFFINE) EW(RELU_BACKWARD) EW(LEAKY_RELU_BACKWARD) EW(GELU_BACKWARD) EW(GELU_TANH_BACKWARD)
    EW(SILU_BACKWARD) EW(SIGMOID_BACKWARD) EW(TANH_BACKWARD) EW(SOFTPLUS_BACKWARD) EW(CLAMP_BACKWARD)
    EW(ADD) EW(SUB) EW(MUL) EW(DIV) EW(POW) EW(MAXIMUM) EW(MINIMUM) EW(EQ) EW(NE) EW(LT) EW(LE)
    EW(GT) EW(GE) EW(WHERE)
#undef EW
            [KILN__K_SUM] = vk_reduce, [KILN__K_PROD] = vk_reduce, [KILN__K_AMAX] = vk_reduce,
            [KILN__K_AMIN] = vk_reduce, [KILN__K_SOFTMAX] = vk_softmax,
            [KILN__K_LOG_SOFTMAX] = vk_softmax, [KILN__K_SOFTMAX_BACKWARD] = vk_softmax,
            [KILN__K_LOG_SOFTMAX_BACKWARD] = vk_softmax, [KILN__K_MATMUL] = vk_matmul,
            [KILN__K_MAX_DIM] = vk_minmax_dim, [KILN__K_MIN_DIM] = vk_minmax_dim,
            [KILN__K_CROSS_ENTROPY] = vk_ce, [KILN__K_CROSS_ENTROPY_MEAN] = vk_ce,
            [KILN__K_CROSS_ENTROPY_BACKWARD] = vk_ce_bw, [KILN__K_ADAM] = vk_adam,
            [KILN__K_INDEX_SELECT] = vk_index, [KILN__K_INDEX_ADD] = vk_index,
            [KILN__K_GATHER] = vk_index, [KILN__K_SCATTER_ADD] = vk_index,
            [KILN__K_RAND_UNIFORM] = vk_random, [KILN__K_RAND_NORMAL] = vk_random,
            [KILN__K_RAND_BERNOULLI] = vk_random, [KILN__K_RAND_INT] = vk_rand_int,
            [KILN__K_ARANGE] = vk_arange, [KILN__K_EYE] = vk_eye, [KILN__K_TRIL] = vk_tril,
            [KILN__K_CUMSUM] = vk_cumsum, [KILN__K_LAYER_NORM] = vk_layer_norm,
            [KILN__K_LAYER_NORM_BACKWARD] = vk_layer_norm, [KILN__K_IM2COL] = vk_window,
            [KILN__K_COL2IM] = vk_window, [KILN__K_MAX_POOL2D] = vk_window,
            [KILN__K_AMP_UNSCALE] = vk_amp_unscale, [KILN__K_ADAM_MULTI] = vk_adam_multi,
            [KILN__K_ATTENTION] = vk_attention, [KILN__K_ATTENTION_BACKWARD] = vk_attention_bw,
            [KILN__K_TOPK] = vk_topk,
        },
    .supports = kiln__vk_supports,
    .device_info = kiln__vk_device_info,
    .best_rank = 60, /* lowered by the probe; must start > 0 for kiln_device_best to ask */
};
