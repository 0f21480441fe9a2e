/*
** CONV2D on the CPU through oneDNN (built when libdnnl-dev is found: KILN_HAVE_DNNL).
**
** and its two backward kernels, CONV2D_BACKWARD_DATA and CONV2D_BACKWARD_WEIGHT (with the
** bias gradient), in f32 on NCHW tensors that are contiguous or channels-last (dense NHWC
** strides); other dtypes and layouts take the reference loops of cpu_conv.c. oneDNN is
** what PyTorch runs on the CPU. cpu_conv.c's dispatch calls in here: convolutions of one
** input channel it gives to the direct loops of cpu_conv_c1.c instead.
**
** Formats. A primitive is created with the tensors' own layouts only where oneDNN has a
** fast kernel for them: channels-last image and gradient (its brgemm/jit kernels read
** NHWC). For NCHW images, and for every weight, it is created with format "any": oneDNN
** picks its blocked layouts (nChw16c, OIhw16i16o) and kiln reorders into and out of them
** around the call. With the plain layouts oneDNN 2.6 falls back to "gemm:jit", a GEMM per
** image, which on ResNet-18 at 32x32 (8x8 .. 1x1 maps) ran at 30-60 GFLOP/s; the blocked
** kernels run several times faster and the reorders are a small copy of each tensor
** (measured: see the commit that made this). KILN_DNNL_CONV_PLAIN=1 creates every
** primitive for the plain layouts (the old path), for comparisons.
**
** A oneDNN primitive is compiled (JIT) for one geometry, which costs far more than a small
** convolution: primitives (with their reorders) are kept in a small cache keyed by the
** geometry, the layouts (strides) and the pass. The blocked copies and oneDNN's scratchpad
** live in buffers from kiln's allocator that grow to the largest call and are kept. One
** lock covers the cache, the buffers and the execution (oneDNN parallelises inside).
*/
#include "cpu.h"
#include "cpu_iter.h"

#ifdef KILN_HAVE_DNNL
#include <dnnl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#ifdef KILN_HAVE_OPENMP
#include <omp.h>
#endif

#define DNNL_CACHE 96

typedef struct dnnl_key {
  int64_t v[40];
} dnnl_key;

/* A role's memory: the user's layout, the primitive's, and the reorder between them
** (NULL when they are the same): user -> primitive for an input, back for an output. */
typedef struct dnnl_slot {
  dnnl_memory_desc_t user, prim;
  dnnl_primitive_t reorder;
  size_t bytes; /* the primitive-layout copy's size, when reordered */
} dnnl_slot;

enum { R_X, R_W, R_Y, R_B, R_N };

typedef struct dnnl_entry {
  dnnl_key key;
  dnnl_primitive_t prim;
  dnnl_slot s[R_N];
  size_t scratch;
} dnnl_entry;

static pthread_mutex_t dnnl_lock = PTHREAD_MUTEX_INITIALIZER;
static dnnl_engine_t dnnl_eng;
static dnnl_stream_t dnnl_str;
static dnnl_entry dnnl_cache[DNNL_CACHE];
static int dnnl_n, dnnl_next;
/* grow-only buffers: the blocked copies of x, w, y, and the scratchpad */
static void *dnnl_buf[R_N];
static size_t dnnl_buf_size[R_N];

static kiln_status dnnl_fail(const char *what, dnnl_status_t s) {
  return kiln_set_error(KILN_ERR_INTERNAL, "kiln: conv2d: oneDNN %s failed (status %d)", what, (int)s);
}

/* The tensors of a convolution kernel by role: the image x (N, C, H, W), the weight
** (OC, C/G, kh, kw), the output-side y (N, OC, OH, OW) and the bias (OC), each an input or
** an output depending on the kernel. */
typedef struct dnnl_roles {
  const kiln__view *v[R_N];
  bool out[R_N];
} dnnl_roles;

static dnnl_roles roles_of(const kiln__kargs *a) {
  dnnl_roles r = {{0}, {0}};
  switch (a->op) {
  case KILN__K_CONV2D_BACKWARD_DATA:
    r.v[R_X] = &a->out[0], r.v[R_W] = &a->in[1], r.v[R_Y] = &a->in[0];
    r.out[R_X] = true;
    break;
  case KILN__K_CONV2D_BACKWARD_WEIGHT:
    r.v[R_X] = &a->in[0], r.v[R_W] = &a->out[0], r.v[R_Y] = &a->in[1];
    r.v[R_B] = a->n_out > 1 ? &a->out[1] : NULL;
    r.out[R_W] = r.out[R_B] = true;
    break;
  default:
    r.v[R_X] = &a->in[0], r.v[R_W] = &a->in[1], r.v[R_Y] = &a->out[0];
    r.v[R_B] = a->n_in > 2 ? &a->in[2] : NULL;
    r.out[R_Y] = true;
  }
  return r;
}

/* Dense NHWC strides on an NCHW-shaped view (and not also contiguous: C or H*W is 1). */
static bool is_nhwc(const kiln__view *v) {
  if (v->ndim != 4 || kiln__view_is_contiguous(v)) return false;
  const int64_t *s = v->shape, *t = v->strides;
  return t[1] == 1 && t[3] == s[1] && t[2] == s[1] * s[3] && (s[0] == 1 || t[0] == s[1] * s[2] * s[3]);
}

/* The user's memory: its shape and strides (a grouped weight as (G, OC/G, C/G, kh, kw)). */
static dnnl_status_t user_md(dnnl_memory_desc_t *md, const kiln__view *v, int64_t G, bool weight) {
  if (weight && G > 1) {
    dnnl_dims_t d = {G, v->shape[0] / G, v->shape[1], v->shape[2], v->shape[3]};
    dnnl_dims_t s = {v->shape[0] / G * v->strides[0], v->strides[0], v->strides[1], v->strides[2], v->strides[3]};
    return dnnl_memory_desc_init_by_strides(md, 5, d, dnnl_f32, s);
  }
  dnnl_dims_t d, s;
  for (int k = 0; k < v->ndim; k++) d[k] = v->shape[k], s[k] = v->strides[k];
  /* a size-1 dimension's stride is free in kiln; give oneDNN the dense one (a cropped
  ** weight, not dense, keeps its own) */
  if (v->ndim == 4 && (kiln__view_is_contiguous(v) || is_nhwc(v))) {
    bool nhwc = is_nhwc(v);
    int order[4] = {0, 1, 2, 3}, onhwc[4] = {0, 2, 3, 1};
    const int *o = nhwc ? onhwc : order;
    int64_t e = 1;
    for (int k = 3; k >= 0; k--) s[o[k]] = e, e *= d[o[k]];
  }
  return dnnl_memory_desc_init_by_strides(md, v->ndim, d, dnnl_f32, s);
}

static bool plain_only(void) {
  static int v = -1;
  if (v < 0) {
    v = kiln__knob_on("KILN_DNNL_CONV_PLAIN", false);
  }
  return v;
}

/* The slot's reorder between the user's layout and the primitive's (the lock held). */
static dnnl_status_t slot_finish(dnnl_slot *sl, bool out) {
  sl->reorder = NULL;
  sl->bytes = 0;
  if (dnnl_memory_desc_equal(&sl->user, &sl->prim)) return dnnl_success;
  dnnl_primitive_desc_t rpd;
  const dnnl_memory_desc_t *from = out ? &sl->prim : &sl->user, *to = out ? &sl->user : &sl->prim;
  dnnl_status_t s = dnnl_reorder_primitive_desc_create(&rpd, from, dnnl_eng, to, dnnl_eng, NULL);
  if (s != dnnl_success) return s;
  s = dnnl_primitive_create(&sl->reorder, rpd);
  dnnl_primitive_desc_destroy(rpd);
  sl->bytes = dnnl_memory_desc_get_size(&sl->prim);
  return s;
}

static void entry_free(dnnl_entry *e) {
  dnnl_primitive_destroy(e->prim);
  for (int k = 0; k < R_N; k++) dnnl_primitive_destroy(e->s[k].reorder);
  memset(e, 0, sizeof *e);
}

/* Whether a convolution takes oneDNN's Winograd kernel (jit_wino_4x3, F(4x4, 3x3)) in
** every pass: 3x3, stride 1, padding 1, ungrouped, channels in 16s, output maps 4x4 to
** 8x8, where it beat the direct kernel (2 threads, batch 64, blocked layouts, ms a call,
** direct -> Winograd: 64 channels 8x8 forward 0.70 -> 0.43, data gradient 0.73 -> 0.44,
** weight gradient 0.76 -> 0.56; 128 channels 4x4 0.67 -> 0.59, 0.59 -> 0.57, 0.84 -> 0.50;
** on 2x2 it was 3x slower). Its rounding differs from the direct sum's: on those shapes
** it stayed within 1.5e-6 of the output's largest value (direct against Winograd, f32),
** inside kiln's f32 tolerance (cv_f32_vs_f64 checks these shapes against f64).
** KILN_DNNL_WINOGRAD=0 turns it off. */
static bool winograd_case(const kiln__kargs *a, const kiln__view *x, const kiln__view *w, const kiln__view *y,
                          int64_t G) {
  static int off = -1;
  if (off < 0) {
    off = !kiln__knob_on("KILN_DNNL_WINOGRAD", true);
  }
  const kiln__conv_params *p = a->params;
  int64_t L = y->shape[2] * y->shape[3];
  return !off && G == 1 && w->shape[2] == 3 && w->shape[3] == 3 && p->stride[0] == 1 && p->stride[1] == 1 &&
         p->dilation[0] == 1 && p->dilation[1] == 1 && p->padding[0] == 1 && p->padding[1] == 1 &&
         x->shape[1] % 16 == 0 && w->shape[0] % 16 == 0 && y->shape[2] >= 4 && y->shape[3] >= 4 && L <= 64;
}

/* A new primitive for the geometry and kernel (the lock held). A backward primitive is
** made from the forward's description (oneDNN's hint), which is then dropped. */
static kiln_status dnnl_build(const kiln__kargs *a, const dnnl_key *k, dnnl_entry *e) {
  memset(e, 0, sizeof *e);
  dnnl_roles r = roles_of(a);
  const kiln__view *x = r.v[R_X], *w = r.v[R_W], *y = r.v[R_Y];
  const kiln__conv_params *p = a->params;
  int64_t G = a->i[0];
  bool bias = r.v[R_B] != NULL;
  dnnl_status_t s;
  if ((s = user_md(&e->s[R_X].user, x, G, false)) != dnnl_success) return dnnl_fail("src", s);
  if ((s = user_md(&e->s[R_Y].user, y, G, false)) != dnnl_success) return dnnl_fail("dst", s);
  if ((s = user_md(&e->s[R_W].user, w, G, true)) != dnnl_success) return dnnl_fail("weights", s);
  dnnl_dims_t bd = {w->shape[0]};
  if ((s = dnnl_memory_desc_init_by_tag(&e->s[R_B].user, 1, bd, dnnl_f32, dnnl_x)) != dnnl_success)
    return dnnl_fail("bias", s);
  /* what the primitive is asked for: channels-last stays so (oneDNN's brgemm kernels read
  ** NHWC); NCHW images and every weight as oneDNN likes them */
  dnnl_memory_desc_t qx = e->s[R_X].user, qy = e->s[R_Y].user, qw = e->s[R_W].user;
  /* The plain layouts where they won (bench-conv, same locked command): a 1x1 stride-1
  ** unpadded convolution is one GEMM on NCHW (gemm:jit 2.6 ms vs 5.5 with the blocked
  ** reorders, 256->64 at 56x56, batch 8; not a cropped one, dnnl_crop: gemm:jit's weight
  ** gradient of ResNet-18's 512-channel 3x3s cropped to 1x1 took 5.2 ms), and an
  ** ungrouped data gradient of fewer than 16 channels would be padded to a 16-channel
  ** block (an image's one or three: the 112x112 stem's fwd + bwd 13.8 -> 8.0 ms; depthwise
  ** ones stay blocked, faster) */
  bool pointwise = w->shape[2] == 1 && w->shape[3] == 1 && p->stride[0] == 1 && p->stride[1] == 1 &&
                   p->padding[0] == 0 && p->padding[1] == 0 && G == 1 && kiln__view_is_contiguous(w);
  bool plain = plain_only() || pointwise || (a->op == KILN__K_CONV2D_BACKWARD_DATA && G == 1 && x->shape[1] < 16);
  if (!plain && (!is_nhwc(x) || !is_nhwc(y))) {
    dnnl_memory_desc_init_by_tag(&qx, 4, e->s[R_X].user.dims, dnnl_f32, dnnl_format_tag_any);
    dnnl_memory_desc_init_by_tag(&qy, 4, e->s[R_Y].user.dims, dnnl_f32, dnnl_format_tag_any);
  }
  /* a weight not dense (channels-last, or cropped: dnnl_crop) is reordered in any case */
  if (!plain || !kiln__view_is_contiguous(w))
    dnnl_memory_desc_init_by_tag(&qw, e->s[R_W].user.ndims, e->s[R_W].user.dims, dnnl_f32, dnnl_format_tag_any);
  dnnl_dims_t st, dl, pl, pr;
  for (int d = 0; d < 2; d++) {
    st[d] = p->stride[d];
    dl[d] = p->dilation[d] - 1; /* oneDNN counts the gaps */
    pl[d] = p->padding[d];
    /* the padding after: what the last window reaches past the input */
    pr[d] = (y->shape[2 + d] - 1) * p->stride[d] + p->dilation[d] * (w->shape[2 + d] - 1) + 1 - x->shape[2 + d] - pl[d];
    if (pr[d] < 0) pr[d] = 0;
  }
  dnnl_primitive_attr_t attr;
  if ((s = dnnl_primitive_attr_create(&attr)) != dnnl_success) return dnnl_fail("attributes", s);
  dnnl_primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user);
  bool fwd = a->op == KILN__K_CONV2D;
  dnnl_convolution_desc_t fd, bd_;
  const dnnl_memory_desc_t *b = bias ? &e->s[R_B].user : NULL;
  /* forward_training for every forward, as PyTorch asks (the result is the same: a
  ** convolution keeps no workspace). With forward_inference and format "any" oneDNN 2.6
  ** picks its brgemm kernel on channels-last, which on small maps with many channels ran
  ** at half the speed of the blocked jit kernel that forward_training gets: ResNet-18 at
  ** 32x32's 256-channel 3x3s on 2x2 maps 1.88 vs 0.86 ms a call; the other layers within
  ** a few percent either way (ONEDNN_VERBOSE, same run). */
  dnnl_primitive_desc_t pd = NULL;
  /* Winograd where it won (winograd_case), else direct; Winograd again direct when oneDNN
  ** has no Winograd kernel for the call (a bias, a layout) */
  for (int tryw = winograd_case(a, x, w, y, G) && !plain && !is_nhwc(x) ? 1 : 0; tryw >= 0; tryw--) {
    dnnl_alg_kind_t alg = tryw ? dnnl_convolution_winograd : dnnl_convolution_direct;
    s = dnnl_dilated_convolution_forward_desc_init(&fd, dnnl_forward_training, alg, &qx, &qw, b, &qy, st, dl, pl, pr);
    if (s != dnnl_success) {
      if (tryw) continue;
      dnnl_primitive_attr_destroy(attr);
      return dnnl_fail("convolution descriptor", s);
    }
    dnnl_primitive_desc_t fpd;
    if ((s = dnnl_primitive_desc_create(&fpd, &fd, fwd ? attr : NULL, dnnl_eng, NULL)) != dnnl_success) {
      if (tryw) continue;
      dnnl_primitive_attr_destroy(attr);
      return dnnl_fail("primitive descriptor", s);
    }
    if (fwd) {
      pd = fpd;
      break;
    }
    s = a->op == KILN__K_CONV2D_BACKWARD_DATA
            ? dnnl_dilated_convolution_backward_data_desc_init(&bd_, alg, &qx, &qw, &qy, st, dl, pl, pr)
            : dnnl_dilated_convolution_backward_weights_desc_init(&bd_, alg, &qx, &qw, b, &qy, st, dl, pl, pr);
    if (s == dnnl_success) s = dnnl_primitive_desc_create(&pd, &bd_, attr, dnnl_eng, fpd);
    dnnl_primitive_desc_destroy(fpd);
    if (s == dnnl_success) break;
    pd = NULL;
    if (tryw) continue;
    dnnl_primitive_attr_destroy(attr);
    return dnnl_fail("backward primitive descriptor", s);
  }
  dnnl_primitive_attr_destroy(attr);
  /* the layouts it chose */
  dnnl_query_t qsrc = a->op == KILN__K_CONV2D_BACKWARD_DATA ? dnnl_query_diff_src_md : dnnl_query_src_md;
  dnnl_query_t qwei = a->op == KILN__K_CONV2D_BACKWARD_WEIGHT ? dnnl_query_diff_weights_md : dnnl_query_weights_md;
  dnnl_query_t qdst = a->op == KILN__K_CONV2D ? dnnl_query_dst_md : dnnl_query_diff_dst_md;
  e->s[R_X].prim = *dnnl_primitive_desc_query_md(pd, qsrc, 0);
  e->s[R_W].prim = *dnnl_primitive_desc_query_md(pd, qwei, 0);
  e->s[R_Y].prim = *dnnl_primitive_desc_query_md(pd, qdst, 0);
  e->s[R_B].prim = e->s[R_B].user;
  e->scratch = dnnl_memory_desc_get_size(dnnl_primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0));
  s = dnnl_primitive_create(&e->prim, pd);
  dnnl_primitive_desc_destroy(pd);
  if (s != dnnl_success) return dnnl_fail("primitive", s);
  for (int q = 0; q < R_B; q++)
    if ((s = slot_finish(&e->s[q], r.out[q])) != dnnl_success) {
      entry_free(e);
      return dnnl_fail("reorder", s);
    }
  e->key = *k;
  return KILN_OK;
}

/* Buffer q at least n bytes (the lock held); NULL with the error set when out of memory. */
static void *buf(int q, size_t n) {
  if (n <= dnnl_buf_size[q]) return dnnl_buf[q];
  kiln__cpu_free(0, dnnl_buf[q], dnnl_buf_size[q]);
  dnnl_buf[q] = kiln__cpu_alloc(0, n);
  dnnl_buf_size[q] = dnnl_buf[q] ? n : 0;
  return dnnl_buf[q];
}

static kiln_status dnnl_exec(dnnl_primitive_t prim, int n, const dnnl_exec_arg_t *args) {
  dnnl_status_t s = dnnl_primitive_execute(prim, dnnl_str, n, args);
  if (s == dnnl_success) s = dnnl_stream_wait(dnnl_str);
  return s == dnnl_success ? KILN_OK : dnnl_fail("execution", s);
}

/* Kernel taps that never meet the image (every window puts them on padding) multiply
** zeros: ResNet-18 at 32x32 ends with 3x3 convolutions on 1x1 maps, where only the centre
** tap does anything. The convolution is the same with the weight cropped to the taps that
** do (a strided view of it) and the padding before reduced by the taps cut: a 3x3 on a
** 1x1 map becomes a 1x1 (one GEMM), a 3x3 stride 2 from 2x2 to 1x1 a 2x2. The weight
** gradient is zeros outside the crop. Whether the crop applies, into *c and *cp. */
static bool dnnl_crop(const kiln__kargs *a, kiln__kargs *c, kiln__conv_params *cp) {
  dnnl_roles r = roles_of(a);
  const kiln__view *x = r.v[R_X], *w = r.v[R_W], *y = r.v[R_Y];
  const kiln__conv_params *p = a->params;
  int64_t lo[2], hi[2];
  bool crop = false;
  for (int d = 0; d < 2; d++) {
    int64_t K = w->shape[2 + d], O = y->shape[2 + d], I = x->shape[2 + d], s = p->stride[d], dl = p->dilation[d];
    lo[d] = K, hi[d] = 0;
    for (int64_t i = 0; i < K; i++) /* tap i meets the image iff some o has 0 <= o*s - pad + i*dl < I */
      for (int64_t o = 0; o < O; o++) {
        int64_t at = o * s - p->padding[d] + i * dl;
        if (at >= 0 && at < I) {
          if (i < lo[d]) lo[d] = i;
          if (i + 1 > hi[d]) hi[d] = i + 1;
          break;
        }
      }
    if (lo[d] >= hi[d]) return false; /* no tap meets it: left to oneDNN as it is */
    if (hi[d] - lo[d] < K) crop = true;
    /* the cropped window's padding after must not go negative (oneDNN's geometry) */
    if ((O - 1) * s + dl * (hi[d] - lo[d] - 1) + 1 - I - (p->padding[d] - lo[d] * dl) < 0) return false;
  }
  if (!crop) return false;
  *c = *a;
  *cp = *p;
  kiln__view *cw = a->op == KILN__K_CONV2D_BACKWARD_WEIGHT ? &c->out[0] : &c->in[1];
  cw->data = (char *)cw->data + (lo[0] * cw->strides[2] + lo[1] * cw->strides[3]) * (int64_t)sizeof(float);
  for (int d = 0; d < 2; d++) {
    cw->shape[2 + d] = hi[d] - lo[d];
    cp->kernel[d] = hi[d] - lo[d];
    cp->padding[d] = p->padding[d] - lo[d] * p->dilation[d];
  }
  c->params = cp;
  return true;
}

/* Weight gradients whose one output pixel's window, cut to the taps that meet the image,
** covers the whole image and nothing else: ResNet-18 at 32x32's layer4 (3x3 pad 1 on 1x1
** maps, and 3x3 stride 2 from 2x2 to 1x1). Each is one GEMM over the batch, dWc = G^T X,
** with the image (N, C*H*W) and the gradient (N, OC) as they lie, into the weight cut to
** those taps (OC, C*H*W), then spread into the full weight with zeros around it in one
** pass. On these layers oneDNN (cropped) and im2col + GEMM (9x the padding zeros) took
** 2-3 ms a call, this ~0.6 ms (measured: see the commit). The forward and the data
** gradient stay with oneDNN (cropped): the same GEMM there needs the cut weight gathered
** out of the full one, which oneDNN's reorder does faster than a gather loop did.
** dnnl_sgemm: f32 products accumulated in f32 (what PyTorch's GEMM does). KILN_CONV_GEMM=0
** turns this off (here and in ops_conv.c), for comparisons. Whether it applies, and the
** first tap kept, into lo. */
static bool conv_gemm_off(void) {
  static int v = -1;
  if (v < 0) {
    v = !kiln__knob_on("KILN_CONV_GEMM", true);
  }
  return v;
}

static bool gemm_case(const kiln__kargs *a, int64_t lo[2]) {
  if (a->op != KILN__K_CONV2D_BACKWARD_WEIGHT || conv_gemm_off()) return false;
  dnnl_roles r = roles_of(a);
  const kiln__view *x = r.v[R_X], *w = r.v[R_W], *y = r.v[R_Y];
  const kiln__conv_params *p = a->params;
  if (a->i[0] != 1 || !kiln__view_is_contiguous(x) || !kiln__view_is_contiguous(w) || !kiln__view_is_contiguous(y))
    return false;
  for (int d = 0; d < 2; d++) {
    int64_t K = w->shape[2 + d], I = x->shape[2 + d], pad = p->padding[d];
    /* one output; tap i reads x at i - pad: taps pad .. pad+I-1 are the whole image */
    if (y->shape[2 + d] != 1 || p->dilation[d] != 1 || pad < 0 || pad + I > K) return false;
    lo[d] = pad;
  }
  return true;
}

typedef struct gemm_spread {
  float *w;         /* the full weight gradient (OC*C, KH, KW) */
  const float *wc;  /* the cut one (OC*C, H, W) */
  int64_t KH, KW, H, W, lo[2];
} gemm_spread;

static void gemm_spread_range(void *ctx, int64_t lo, int64_t hi) {
  const gemm_spread *g = ctx;
  int64_t KK = g->KH * g->KW, HW = g->H * g->W;
  for (int64_t q = lo; q < hi; q++) {
    float *d = g->w + q * KK;
    const float *s = g->wc + q * HW;
    for (int64_t k = 0; k < KK; k++) d[k] = 0.0f;
    for (int64_t i = 0; i < g->H; i++)
      for (int64_t j = 0; j < g->W; j++) d[(g->lo[0] + i) * g->KW + g->lo[1] + j] = s[i * g->W + j];
  }
}

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__) && !defined(KILN_NO_TARGET_CLONES)
#include <immintrin.h>
#define SPREAD_HAVE_AVX512 1
/* The spread of a one-tap cut (a 1x1 image: each q gets one value, at tap t of its KK):
** 16 q's are 16*KK consecutive floats, written as KK vectors, vector j lane i the value of
** q 16j+i / KK where (16j+i) % KK == t, else +0 (one masked permute each). The scalar
** loop spent 0.8-1.3 ms on each of ResNet-18 32x32's 512x512x3x3 gradients (9.4 MB), a
** handful of stores per value; this writes them at the memory's pace. Same values. */
typedef struct spread1 {
  float *w;
  const float *wc;
  int64_t KK, t;
} spread1;

__attribute__((target("avx512f"))) static void spread1_range(void *ctx, int64_t lo, int64_t hi) {
  const spread1 *g = ctx;
  int64_t KK = g->KK;
  __m512i idx[16];
  __mmask16 mk[16];
  for (int64_t j = 0; j < KK; j++) {
    int32_t ix[16];
    unsigned m = 0;
    for (int i = 0; i < 16; i++) {
      int64_t e = 16 * j + i;
      ix[i] = (int32_t)(e / KK);
      if (e % KK == g->t) m |= 1u << i;
    }
    idx[j] = _mm512_loadu_si512(ix);
    mk[j] = (__mmask16)m;
  }
  for (int64_t b = lo; b < hi; b++) { /* block b: q = 16b .. 16b+15 */
    __m512 v = _mm512_loadu_ps(g->wc + 16 * b);
    float *d = g->w + 16 * b * KK;
    for (int64_t j = 0; j < KK; j++) _mm512_storeu_ps(d + 16 * j, _mm512_maskz_permutexvar_ps(mk[j], idx[j], v));
  }
}

static bool spread_avx512_ok(void) {
  static int ok = -1;
  if (ok < 0) ok = __builtin_cpu_supports("avx512f");
  return ok;
}
#endif

/* The lock held (the cut weight's buffer is dnnl_buf[R_W]). */
static kiln_status gemm_wgrad(const kiln__kargs *a, const int64_t lo[2]) {
  dnnl_roles r = roles_of(a);
  const kiln__view *x = r.v[R_X], *w = r.v[R_W], *y = r.v[R_Y], *b = r.v[R_B];
  int64_t N = x->shape[0], C = x->shape[1], H = x->shape[2], W = x->shape[3];
  int64_t OC = w->shape[0], KH = w->shape[2], KW = w->shape[3], Kc = C * H * W;
  bool full = H == KH && W == KW; /* the cut is the whole weight: the GEMM writes it */
  const float *xp = x->data, *yp = y->data;
  float *wc = w->data;
  if (!full && !(wc = buf(R_W, (size_t)(OC * Kc) * sizeof(float)))) return kiln_last_error();
  dnnl_status_t s = dnnl_sgemm('T', 'N', OC, Kc, N, 1.0f, yp, OC, xp, Kc, 0.0f, wc, Kc);
  if (s != dnnl_success) return dnnl_fail("sgemm", s);
  if (!full) {
    gemm_spread g = {w->data, wc, KH, KW, H, W, {lo[0], lo[1]}};
    int64_t Q = OC * C, done = 0;
#ifdef SPREAD_HAVE_AVX512
    if (H == 1 && W == 1 && KH * KW <= 16 && spread_avx512_ok()) {
      spread1 g1 = {w->data, wc, KH * KW, lo[0] * KW + lo[1]};
      done = Q / 16 * 16;
      kiln__cpu_parallel_for(Q / 16, 1 + KILN__CPU_PAR_MIN_CHEAP / (16 * KH * KW), spread1_range, &g1);
    }
#endif
    if (done < Q) { /* the rest (all of it without AVX-512, or a cut of more than one tap) */
      g.w += done * KH * KW, g.wc += done * H * W;
      kiln__cpu_parallel_for(Q - done, 1 + KILN__CPU_PAR_MIN_CHEAP / (KH * KW), gemm_spread_range, &g);
    }
  }
  if (b) { /* the bias gradient: the gradient's sum over the batch, in f32 in batch order */
    float *bp = b->data;
    for (int64_t o = 0; o < OC; o++) bp[o] = 0.0f;
    for (int64_t n = 0; n < N; n++)
      for (int64_t o = 0; o < OC; o++) bp[o] += yp[n * OC + o];
  }
  return KILN_OK;
}

/* Weight gradients on small maps (under 4x4 outputs: ResNet-18 32x32's layer3, 2x2), other
** than those above: oneDNN's jit kernel there (a reduction over the batch, mostly padding
** taps) ran at 38-75 GFLOP/s. On such maps most (tap, output pixel) pairs put the tap on
** padding: a 3x3 pad 1 on 2x2 has 16 pairs that meet the image of 36. So the gradient is a
** sum over the pairs that do: for tap t and output pixel l reading image pixel p,
** dW[:, :, t] += G_l X_p^T, G_l (OC, N) the gradient at l and X_p (C, N) the image at p,
** each a dnnl_sgemm (f32 accumulation) over the batch, into acc (OC, taps, C), then
** transposed into dW (OC, C, taps) with zeros for taps that meet nothing. The operands are
** laid out once for this: gt (OC, L, N) and xt (H*W, C, N). (The one im2col GEMM over
** all 36 pairs before spent 0.45 ms laying out its columns and 1.1 ms multiplying,
** padding zeros included, on each 256-channel 2x2 layer.) The bias gradient is gt's row
** sums (f32, in (pixel, n) order). */
#define SMALL_MAP 16
#define SMALL_TAPS 64 /* kernels of more taps take oneDNN */

static bool small_case(const kiln__kargs *a) {
  if (a->op != KILN__K_CONV2D_BACKWARD_WEIGHT || conv_gemm_off() || a->i[0] != 1) return false;
  const kiln__view *x = &a->in[0], *g = &a->in[1], *w = &a->out[0];
  return g->shape[2] * g->shape[3] < SMALL_MAP && w->shape[2] * w->shape[3] <= SMALL_TAPS &&
         kiln__view_is_contiguous(x) && kiln__view_is_contiguous(g) && kiln__view_is_contiguous(w);
}

typedef struct small_job {
  const float *x, *g;
  float *xt, *gt, *acc, *w;
  int64_t N, C, H, W, OC, KH, KW, OH, OW;
  const bool *hit; /* per tap: some pair meets the image */
} small_job;

/* xt rows q = p*C + c in [lo, hi): xt[p][c][n] = x[n][c][p] */
static void small_xt_range(void *ctx, int64_t lo, int64_t hi) {
  const small_job *j = ctx;
  int64_t HW = j->H * j->W;
  for (int64_t q = lo; q < hi; q++) {
    int64_t p = q / j->C, c = q % j->C;
    float *o = j->xt + q * j->N;
    const float *xp = j->x + c * HW + p;
    for (int64_t n = 0; n < j->N; n++) o[n] = xp[n * j->C * HW];
  }
}

/* gt's rows [lo, hi): gt[oc][l][n] = g[n][oc][l] */
static void small_gt_range(void *ctx, int64_t lo, int64_t hi) {
  const small_job *j = ctx;
  int64_t L = j->OH * j->OW;
  for (int64_t oc = lo; oc < hi; oc++)
    for (int64_t l = 0; l < L; l++) {
      float *o = j->gt + (oc * L + l) * j->N;
      const float *gp = j->g + oc * L + l;
      for (int64_t n = 0; n < j->N; n++) o[n] = gp[n * j->OC * L];
    }
}

/* dW's rows oc in [lo, hi): dW[oc][c][t] = acc[oc][t][c], or 0 for a tap that meets nothing */
static void small_dw_range(void *ctx, int64_t lo, int64_t hi) {
  const small_job *j = ctx;
  int64_t T = j->KH * j->KW;
  for (int64_t oc = lo; oc < hi; oc++) {
    float *d = j->w + oc * j->C * T;
    const float *a = j->acc + oc * T * j->C;
    for (int64_t c = 0; c < j->C; c++)
      for (int64_t t = 0; t < T; t++) d[c * T + t] = j->hit[t] ? a[t * j->C + c] : 0.0f;
  }
}

/* The lock held (buffers dnnl_buf[R_X], [R_Y] and [R_W]). */
static kiln_status small_wgrad(const kiln__kargs *a) {
  const kiln__view *x = &a->in[0], *g = &a->in[1], *w = &a->out[0], *b = a->n_out > 1 ? &a->out[1] : NULL;
  const kiln__conv_params *p = a->params;
  bool hit[SMALL_TAPS] = {0};
  small_job j = {x->data, g->data, NULL, NULL, NULL, w->data, x->shape[0], x->shape[1], x->shape[2], x->shape[3],
                 w->shape[0], w->shape[2], w->shape[3], g->shape[2], g->shape[3], hit};
  int64_t L = j.OH * j.OW, HW = j.H * j.W, T = j.KH * j.KW;
  if (T > SMALL_TAPS) return kiln_set_error(KILN_ERR_INTERNAL, "kiln: conv2d small-map weight gradient of %lld taps", (long long)T);
  if (!(j.xt = buf(R_X, (size_t)(HW * j.C * j.N) * sizeof(float))) ||
      !(j.gt = buf(R_Y, (size_t)(j.OC * L * j.N) * sizeof(float))) ||
      !(j.acc = buf(R_W, (size_t)(j.OC * T * j.C) * sizeof(float))))
    return kiln_last_error();
  kiln__cpu_parallel_for(HW * j.C, 1 + KILN__CPU_PAR_MIN_CHEAP / (j.N + 1), small_xt_range, &j);
  kiln__cpu_parallel_for(j.OC, 1 + KILN__CPU_PAR_MIN_CHEAP / (L * j.N + 1), small_gt_range, &j);
  for (int64_t t = 0; t < T; t++) {
    int64_t i = t / j.KW, jj = t % j.KW;
    for (int64_t l = 0; l < L; l++) {
      int64_t h = (l / j.OW) * p->stride[0] - p->padding[0] + i * p->dilation[0];
      int64_t ww = (l % j.OW) * p->stride[1] - p->padding[1] + jj * p->dilation[1];
      if (h < 0 || h >= j.H || ww < 0 || ww >= j.W) continue;
      /* acc[:, t, :] (OC, C) (+)= gt[:, l, :] (OC, N) xt[h*W + w] (C, N)^T */
      dnnl_status_t s = dnnl_sgemm('N', 'T', j.OC, j.C, j.N, 1.0f, j.gt + l * j.N, L * j.N,
                                   j.xt + (h * j.W + ww) * j.C * j.N, j.N, hit[t] ? 1.0f : 0.0f, j.acc + t * j.C,
                                   T * j.C);
      if (s != dnnl_success) return dnnl_fail("sgemm", s);
      hit[t] = true;
    }
  }
  kiln__cpu_parallel_for(j.OC, 1 + KILN__CPU_PAR_MIN_CHEAP / (j.C * T + 1), small_dw_range, &j);
  if (b) {
    float *bp = b->data;
    int64_t LN = L * j.N;
    for (int64_t o = 0; o < j.OC; o++) {
      float acc = 0.0f;
      for (int64_t q = 0; q < LN; q++) acc += j.gt[o * LN + q];
      bp[o] = acc;
    }
  }
  return KILN_OK;
}

static kiln_status dnnl_run(const kiln__kargs *a, int nthreads) {
  int64_t glo[2];
  if (gemm_case(a, glo)) return gemm_wgrad(a, glo);
  if (small_case(a)) return small_wgrad(a);
  kiln__kargs ca;
  kiln__conv_params ccp;
  if (dnnl_crop(a, &ca, &ccp)) {
    if (a->op == KILN__K_CONV2D_BACKWARD_WEIGHT) /* dense: its bytes are its elements */
      memset(a->out[0].data, 0, (size_t)kiln__view_numel(&a->out[0]) * sizeof(float));
    a = &ca;
  }
  dnnl_roles r = roles_of(a);
  const kiln__conv_params *p = a->params;
  dnnl_status_t s;
  if (!dnnl_eng) {
    if ((s = dnnl_engine_create(&dnnl_eng, dnnl_cpu, 0)) != dnnl_success) return dnnl_fail("engine", s);
    if ((s = dnnl_stream_create(&dnnl_str, dnnl_eng, dnnl_stream_default_flags)) != dnnl_success) {
      dnnl_engine_destroy(dnnl_eng);
      dnnl_eng = NULL;
      return dnnl_fail("stream", s);
    }
  }
  dnnl_key k;
  memset(&k, 0, sizeof k);
  for (int q = 0; q < 3; q++)
    for (int d = 0; d < 4; d++) k.v[8 * q + d] = r.v[q]->shape[d], k.v[8 * q + 4 + d] = r.v[q]->strides[d];
  for (int d = 0; d < 2; d++)
    k.v[24 + d] = p->stride[d], k.v[26 + d] = p->padding[d], k.v[28 + d] = p->dilation[d];
  k.v[30] = a->i[0];
  k.v[31] = r.v[R_B] != NULL;
  k.v[32] = a->op;
  k.v[33] = plain_only();
  k.v[34] = nthreads; /* a primitive splits its work for the count it was made under */
  dnnl_entry *e = NULL;
  for (int i = 0; i < dnnl_n && !e; i++)
    if (memcmp(&dnnl_cache[i].key, &k, sizeof k) == 0) e = &dnnl_cache[i];
  if (!e) {
    dnnl_entry fresh;
    kiln_status st = dnnl_build(a, &k, &fresh);
    if (st != KILN_OK) return st;
    if (dnnl_n < DNNL_CACHE) {
      e = &dnnl_cache[dnnl_n++];
    } else { /* round robin: a network has few distinct layer shapes */
      e = &dnnl_cache[dnnl_next];
      dnnl_next = (dnnl_next + 1) % DNNL_CACHE;
      entry_free(e);
    }
    *e = fresh;
  }
  /* user memories, the primitive-layout copies, the scratchpad */
  dnnl_memory_t mu[R_N] = {0}, mp[R_N] = {0}, msc = NULL;
  kiln_status st = KILN_OK;
  for (int q = 0; q < R_N && st == KILN_OK; q++) {
    if (!r.v[q]) continue;
    if ((s = dnnl_memory_create(&mu[q], &e->s[q].user, dnnl_eng, r.v[q]->data)) != dnnl_success) {
      st = dnnl_fail("memory", s);
      break;
    }
    if (!e->s[q].reorder) continue;
    void *b = buf(q, e->s[q].bytes);
    if (!b) st = kiln_last_error();
    else if ((s = dnnl_memory_create(&mp[q], &e->s[q].prim, dnnl_eng, b)) != dnnl_success) st = dnnl_fail("memory", s);
  }
  if (st == KILN_OK && e->scratch) {
    dnnl_memory_desc_t smd;
    dnnl_dims_t sd = {(dnnl_dim_t)e->scratch};
    void *b = buf(R_B, e->scratch); /* the bias is never reordered: its buffer is the scratchpad */
    if (!b) st = kiln_last_error();
    else if ((s = dnnl_memory_desc_init_by_tag(&smd, 1, sd, dnnl_u8, dnnl_x)) != dnnl_success ||
             (s = dnnl_memory_create(&msc, &smd, dnnl_eng, b)) != dnnl_success)
      st = dnnl_fail("scratchpad", s);
  }
  /* inputs into the primitive's layouts */
  for (int q = 0; q < R_N && st == KILN_OK; q++)
    if (mp[q] && !r.out[q]) {
      dnnl_exec_arg_t ra[2] = {{DNNL_ARG_FROM, mu[q]}, {DNNL_ARG_TO, mp[q]}};
      st = dnnl_exec(e->s[q].reorder, 2, ra);
    }
  if (st == KILN_OK) {
    dnnl_memory_t m[R_N];
    for (int q = 0; q < R_N; q++) m[q] = mp[q] ? mp[q] : mu[q];
    dnnl_exec_arg_t args[6];
    int n = 0;
    switch (a->op) {
    case KILN__K_CONV2D_BACKWARD_DATA:
      args[n++] = (dnnl_exec_arg_t){DNNL_ARG_DIFF_DST, m[R_Y]};
      args[n++] = (dnnl_exec_arg_t){DNNL_ARG_WEIGHTS, m[R_W]};
      args[n++] = (dnnl_exec_arg_t){DNNL_ARG_DIFF_SRC, m[R_X]};
      break;
    case KILN__K_CONV2D_BACKWARD_WEIGHT:
      args[n++] = (dnnl_exec_arg_t){DNNL_ARG_SRC, m[R_X]};
      args[n++] = (dnnl_exec_arg_t){DNNL_ARG_DIFF_DST, m[R_Y]};
      args[n++] = (dnnl_exec_arg_t){DNNL_ARG_DIFF_WEIGHTS, m[R_W]};
      if (m[R_B]) args[n++] = (dnnl_exec_arg_t){DNNL_ARG_DIFF_BIAS, m[R_B]};
      break;
    default:
      args[n++] = (dnnl_exec_arg_t){DNNL_ARG_SRC, m[R_X]};
      args[n++] = (dnnl_exec_arg_t){DNNL_ARG_WEIGHTS, m[R_W]};
      args[n++] = (dnnl_exec_arg_t){DNNL_ARG_DST, m[R_Y]};
      if (m[R_B]) args[n++] = (dnnl_exec_arg_t){DNNL_ARG_BIAS, m[R_B]};
    }
    if (msc) args[n++] = (dnnl_exec_arg_t){DNNL_ARG_SCRATCHPAD, msc};
    st = dnnl_exec(e->prim, n, args);
  }
  /* outputs back to the user's layouts */
  for (int q = 0; q < R_N && st == KILN_OK; q++)
    if (mp[q] && r.out[q]) {
      dnnl_exec_arg_t ra[2] = {{DNNL_ARG_FROM, mp[q]}, {DNNL_ARG_TO, mu[q]}};
      st = dnnl_exec(e->s[q].reorder, 2, ra);
    }
  for (int q = 0; q < R_N; q++) dnnl_memory_destroy(mu[q]), dnnl_memory_destroy(mp[q]);
  dnnl_memory_destroy(msc);
  return st;
}

/* dnnl_run under the lock, on kiln's thread count. oneDNN runs on OpenMP's count, which
** an OpenMP build of OpenBLAS sets to 1 for every small sgemm (openblas_set_num_threads ->
** omp_set_num_threads; cpu_matmul.c gives small products one thread): fashion-mnist's
** fc layers did that each step, and its conv2 primitives then ran on one core of two
** (backward data 3.3 ms where PyTorch's same jit:avx512_core kernel took 1.7). kiln's
** count for the creation and the call (cpu_dnnl_matmul.c does the same), then OpenMP's
** back; and kiln's loops move onto the OpenMP team from then on (cpu_iter.c: its workers
** spin after each region and would fight a pool of kiln's own for the cores). */
static kiln_status dnnl_locked_run(const kiln__kargs *a) {
  pthread_mutex_lock(&dnnl_lock);
  int nt = 1;
#ifdef KILN_HAVE_OPENMP
  int omp_was = omp_get_max_threads();
  nt = omp_in_parallel() ? 1 : kiln_num_threads();
  if (nt != omp_was) omp_set_num_threads(nt);
  if (nt > 1) atomic_store_explicit(&kiln__cpu_omp_loops, 1, memory_order_relaxed);
#endif
  kiln_status st = dnnl_run(a, nt);
#ifdef KILN_HAVE_OPENMP
  if (nt != omp_was) omp_set_num_threads(omp_was);
#endif
  pthread_mutex_unlock(&dnnl_lock);
  return st;
}

/* A 4-d view oneDNN reads as it is: contiguous NCHW, or channels-last. */
static bool dense4(const kiln__view *v) { return v->ndim == 4 && (kiln__view_is_contiguous(v) || is_nhwc(v)); }

/* Whether oneDNN takes these arguments: f32, NCHW or channels-last (the bias contiguous),
** something to compute. */
bool kiln__cpu_dnnl_conv_takes(const kiln__kargs *a) {
  if (!a->params || a->n_in < 2 || a->n_out < 1) return false;
  for (int i = 0; i < a->n_in; i++)
    if (a->in[i].dtype != KILN_F32 || !(i < 2 ? dense4(&a->in[i]) : kiln__view_is_contiguous(&a->in[i]))) return false;
  for (int i = 0; i < a->n_out; i++)
    if (a->out[i].dtype != KILN_F32 || !(i < 1 ? dense4(&a->out[i]) : kiln__view_is_contiguous(&a->out[i])))
      return false;
  return true;
}

/* CONV2D_BACKWARD_DATA / _WEIGHT through oneDNN; the caller (cpu_conv.c) checked
** kiln__cpu_dnnl_conv_takes and that no output is empty. */
kiln_status kiln__cpu_dnnl_conv2d_backward(const kiln__kargs *a) {
  /* an empty batch or image: nothing flows back, the gradients are zeros (dense outputs:
  ** their bytes are the elements, in whichever order) */
  if (kiln__view_numel(&a->in[0]) == 0 || kiln__view_numel(&a->in[1]) == 0) {
    for (int i = 0; i < a->n_out; i++) memset(a->out[i].data, 0, (size_t)kiln__view_numel(&a->out[i]) * sizeof(float));
    return KILN_OK;
  }
  return dnnl_locked_run(a);
}

/* CONV2D through oneDNN; the caller (cpu_conv.c) checked the same. */
kiln_status kiln__cpu_dnnl_conv2d(const kiln__kargs *a) { return dnnl_locked_run(a); }
#endif /* KILN_HAVE_DNNL */
