/*
** Convolutional layers (NCHW): conv2d, conv1d, conv_transpose2d, max_pool2d,
** avg_pool2d, adaptive_avg_pool2d, each on the one call path (op.h).
**
** Convolution is im2col then one product: x (N, C, H, W) is unfolded by the im2col op
** (kernel IM2COL) into cols (N, G, C/G*kh*kw, OH*OW), and the weight (OC, C/G, kh, kw),
** seen as (G, OC/G, C/G*kh*kw), multiplies it with kiln_matmul (MATMUL: BLAS on the CPU,
** cuBLAS on CUDA). conv2d is a composite of those ops, so its backward comes from theirs:
** the input's gradient is col2im(W^T g) (im2col's rule), the weight's is g cols^T summed
** over the batch (matmul's rule). Composing rather than writing CONV2D_BACKWARD_* kernels
** was chosen because (1) a backend needs only the two data-moving kernels IM2COL/COL2IM
** to run every convolution, forward and backward, natively, its GEMM doing the work;
** (2) double backward and every dtype come for free; (3) the costs are the same as a
** fused im2col kernel's on the CPU (the unfolded input is what a GEMM-based CONV2D
** backward would rebuild anyway). What it costs: cols stays alive for the backward (C*kh*kw
** times the input). A 1x1 stride-1 unpadded convolution skips im2col (cols is x itself).
**
** Where the device has a library convolution (kernel CONV2D: the CPU built with oneDNN,
** f32 only), conv2d's forward runs it through the internal op conv2d_direct instead; that
** op's backward rule uses the same im2col/col2im and matmul ops (cols recomputed).
**
** conv_transpose2d is the adjoint: cols = W^T x, then col2im. avg_pool2d is im2col and a
** mean over the window (count_include_pad, PyTorch's default); adaptive_avg_pool2d and
** bilinear upsampling (ops_resize.c) are two products with fixed pooling matrices.
** max_pool2d has a kernel of its own (MAX_POOL2D) that also gives the argmax, and its
** backward scatters the gradient through those indices (SCATTER_ADD).
*/
#include "ops/op.h"

#include <stdlib.h>
#include <string.h>

/* ---- im2col / col2im: internal ops, each the other's backward ----------------------- */

/* A window: kernel, stride, padding (before), dilation. The pools' attributes (stride
** defaulting to the kernel, dilation max_pool2d's only). */
typedef struct attrs_pool {
  int64_t kernel[2];
  int nk;
  int64_t stride[2];
  int ns;
  int64_t padding[2];
  int np;
  int64_t dilation[2];
  int nd;
} attrs_pool;
static const kiln__attr_field f_pool[] = {
    KILN__FIELD_INTS(attrs_pool, kernel, nk), KILN__FIELD_INTS(attrs_pool, stride, ns),
    KILN__FIELD_INTS(attrs_pool, padding, np), KILN__FIELD_INTS(attrs_pool, dilation, nd)};

/* A window and a size: for im2col the output's (OH, OW), for col2im the image's (H, W),
** for max_pool2d's backward ops the input's (H, W). */
typedef struct attrs_window {
  attrs_pool p;
  int64_t size[2];
  int nsz;
} attrs_window;
static const kiln__attr_field f_window[] = {
    {"kernel", KILN__A_INTS, offsetof(attrs_window, p.kernel), offsetof(attrs_window, p.nk), NULL},
    {"stride", KILN__A_INTS, offsetof(attrs_window, p.stride), offsetof(attrs_window, p.ns), NULL},
    {"padding", KILN__A_INTS, offsetof(attrs_window, p.padding), offsetof(attrs_window, p.np), NULL},
    {"dilation", KILN__A_INTS, offsetof(attrs_window, p.dilation), offsetof(attrs_window, p.nd), NULL},
    KILN__FIELD_INTS(attrs_window, size, nsz)};

static attrs_window window(const int64_t k[2], const int64_t s[2], const int64_t p[2], const int64_t d[2],
                           const int64_t size[2]) {
  attrs_window w = {{{k[0], k[1]}, 2, {s[0], s[1]}, 2, {p[0], p[1]}, 2, {d[0], d[1]}, 2}, {size[0], size[1]}, 2};
  return w;
}

/* The window as the kernels take it (IM2COL, COL2IM, the pools, the convolutions). */
static kiln__conv_params conv_window(const int64_t k[2], const int64_t s[2], const int64_t p[2], const int64_t d[2]) {
  kiln__conv_params cp;
  for (int i = 0; i < 2; i++) cp.kernel[i] = k[i], cp.stride[i] = s[i], cp.padding[i] = p[i], cp.dilation[i] = d[i];
  return cp;
}

static kiln__conv_params pool_params(const attrs_pool *w) {
  return conv_window(w->kernel, w->stride, w->padding, w->dilation);
}

/* Runs window kernel op on the op's first n_in inputs into its outputs (out[1] too when
** n_out is 2), with the window(s) p and the integer i0 (a.i[0]). */
static kiln_status run_window(kiln__op_ctx *c, kiln__kop op, int n_in, int n_out, const kiln__conv_params *p,
                              int64_t i0) {
  kiln__kargs a = {0};
  a.op = op;
  a.n_in = n_in;
  for (int i = 0; i < n_in; i++) a.in[i] = kiln__view_of(c->in[i]);
  a.n_out = n_out;
  if (n_out > 1) a.out[1] = kiln__view_of(c->out[1]);
  a.i[0] = i0;
  a.params = p;
  return kiln__run_into(c->out[0], &a);
}

/* v with the shape sh and contiguous strides: an output as a kernel would get it, for
** asking kiln__dispatch_has before it is made. */
static kiln__view view_shaped(kiln__view v, const int64_t sh[4]) {
  for (int d = 0; d < 4; d++) v.shape[d] = sh[d];
  kiln__contiguous_strides(4, v.shape, v.strides);
  return v;
}

static const kiln__op op_im2col, op_col2im;

static kiln_tensor *im2col_call(kiln_tensor *x, const attrs_window *w) {
  return kiln__op_call(&op_im2col, 1, &x, w, NULL);
}
static kiln_tensor *col2im_call(kiln_tensor *cols, const attrs_window *w) {
  return kiln__op_call(&op_col2im, 1, &cols, w, NULL);
}

static kiln_status im2col_infer(kiln__op_ctx *c) {
  const attrs_window *w = c->attrs;
  kiln_tensor *x = c->in[0];
  if (x->ndim != 4)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_im2col: expected (N, C, H, W), got %s", kiln__tshape(x));
  int64_t sh[6] = {x->shape[0], x->shape[1], w->p.kernel[0], w->p.kernel[1], w->size[0], w->size[1]};
  kiln__op_meta(c, 0, 6, sh, x->dtype);
  return KILN_OK;
}

static kiln_status im2col_forward(kiln__op_ctx *c) {
  kiln__conv_params p = pool_params(&((const attrs_window *)c->attrs)->p);
  return run_window(c, KILN__K_IM2COL, 1, 1, &p, 0);
}

static kiln_status im2col_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  attrs_window w = *(const attrs_window *)n->attrs;
  w.size[0] = n->in_shape[0][2];
  w.size[1] = n->in_shape[0][3];
  return kiln__give_grad(&gi[0], col2im_call(g, &w), g);
}

static kiln_status col2im_infer(kiln__op_ctx *c) {
  const attrs_window *w = c->attrs;
  kiln_tensor *t = c->in[0];
  if (t->ndim != 6)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_col2im: expected (N, C, kh, kw, OH, OW), got %s", kiln__tshape(t));
  int64_t sh[4] = {t->shape[0], t->shape[1], w->size[0], w->size[1]};
  kiln__op_meta(c, 0, 4, sh, t->dtype);
  return KILN_OK;
}

static kiln_status col2im_forward(kiln__op_ctx *c) {
  kiln__conv_params p = pool_params(&((const attrs_window *)c->attrs)->p);
  kiln__kargs z = {0};
  z.op = KILN__K_FILL;
  kiln_status st = kiln__run_into(c->out[0], &z);
  if (st != KILN_OK || kiln_numel(c->in[0]) == 0) return st;
  return run_window(c, KILN__K_COL2IM, 1, 1, &p, 0);
}

static kiln_status col2im_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  attrs_window w = *(const attrs_window *)n->attrs;
  w.size[0] = n->in_shape[0][4];
  w.size[1] = n->in_shape[0][5];
  return kiln__give_grad(&gi[0], im2col_call(g, &w), g);
}

static const kiln__op op_im2col = {
    .name = "im2col", .api = "kiln_im2col", .n_in = 1, .n_out = 1, .flags = KILN__OP_FLOAT_ONLY,
    .n_kernels = 1, .kernels = {KILN__K_IM2COL}, .attrs = f_window, .n_attrs = 5,
    .attr_size = sizeof(attrs_window), .infer = im2col_infer, .forward = im2col_forward,
    .backward = im2col_backward};
static const kiln__op op_col2im = {
    .name = "col2im", .api = "kiln_col2im", .n_in = 1, .n_out = 1, .flags = KILN__OP_FLOAT_ONLY,
    .n_kernels = 2, .kernels = {KILN__K_FILL, KILN__K_COL2IM}, .attrs = f_window, .n_attrs = 5,
    .attr_size = sizeof(attrs_window), .infer = col2im_infer, .forward = col2im_forward,
    .backward = col2im_backward};

/* ---- geometry and argument checks ------------------------------------------------------ */

static const int64_t one2[2] = {1, 1}, zero2[2] = {0, 0};

/* The output size of one spatial dim; -1 (error set) when the kernel does not fit. */
static int64_t out_size(const char *api, const char *what, int dim, int64_t in, int64_t k, int64_t s, int64_t p,
                        int64_t d, const kiln_tensor *x, const kiln_tensor *w) {
  int64_t span = d * (k - 1) + 1;
  if (in + 2 * p < span) {
    kiln_set_error(KILN_ERR_SHAPE,
                   "%s: %s %lld (dilation %lld, so %lld wide) is larger than the padded input %lld at dim %d "
                   "(input %s%s%s, padding %lld)",
                   api, what, (long long)k, (long long)d, (long long)span, (long long)(in + 2 * p), dim + 2,
                   kiln__tshape(x), w ? ", weight " : "", w ? kiln__tshape(w) : "", (long long)p);
    return -1;
  }
  return (in + 2 * p - span) / s + 1;
}

static kiln_status check_positive(const char *api, const char *name, const int64_t *v, int64_t min) {
  for (int k = 0; k < 2; k++)
    if (v[k] < min)
      return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: %s must be >= %lld, got [%lld, %lld]", api, name,
                            (long long)min, (long long)v[0], (long long)v[1]);
  return KILN_OK;
}

static kiln_status check_float4(const char *api, const kiln_tensor *x) {
  if (!kiln_dtype_is_float(x->dtype))
    return kiln_set_error(KILN_ERR_DTYPE, "%s: expected a floating input, got %s (shape %s)", api,
                          kiln_dtype_name(x->dtype), kiln__tshape(x));
  if (x->ndim != 4)
    return kiln_set_error(KILN_ERR_SHAPE, "%s: expected a 4-d input (N, C, H, W), got shape %s", api,
                          kiln__tshape(x));
  return KILN_OK;
}

/* ---- conv2d ------------------------------------------------------------------------------ */

typedef struct attrs_conv {
  int64_t stride[2];
  int ns;
  int64_t padding[2]; /* KILN_PADDING_SAME: "same" */
  int np;
  int64_t dilation[2];
  int nd;
  int64_t output_padding[2]; /* conv_transpose2d only */
  int nop;
  int64_t groups;
} attrs_conv;
static const kiln__attr_field f_conv[] = {
    KILN__FIELD_INTS(attrs_conv, stride, ns), KILN__FIELD_INTS(attrs_conv, padding, np),
    KILN__FIELD_INTS(attrs_conv, dilation, nd), KILN__FIELD(attrs_conv, groups, KILN__A_INT),
    KILN__FIELD_INTS(attrs_conv, output_padding, nop)};

/* conv2d's geometry: padding before (same: half the total, the odd one after, as
** PyTorch), the output's spatial size, and whether the 1x1 shortcut applies. */
typedef struct conv_geom {
  int64_t N, C, H, W, OC, KH, KW, G, OH, OW;
  int64_t pad[2];
} conv_geom;

static kiln_status conv_check_common(const char *api, const kiln_tensor *x, const kiln_tensor *w,
                                     const kiln_tensor *b, const attrs_conv *p, int64_t out_ch) {
  if (check_float4(api, x) != KILN_OK) return kiln_last_error();
  if (w->ndim != 4)
    return kiln_set_error(KILN_ERR_SHAPE, "%s: weight must be 4-d, got shape %s (input %s)", api, kiln__tshape(w),
                          kiln__tshape(x));
  if (w->dtype != x->dtype || (b && b->dtype != x->dtype))
    return kiln_set_error(KILN_ERR_DTYPE, "%s: input %s %s, weight %s %s%s%s must share one dtype", api,
                          kiln_dtype_name(x->dtype), kiln__tshape(x), kiln_dtype_name(w->dtype), kiln__tshape(w),
                          b ? " and bias " : "", b ? kiln_dtype_name(b->dtype) : "");
  if (check_positive(api, "stride", p->stride, 1) != KILN_OK) return kiln_last_error();
  if (check_positive(api, "dilation", p->dilation, 1) != KILN_OK) return kiln_last_error();
  if (p->groups < 1)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: groups must be >= 1, got %lld", api, (long long)p->groups);
  if (x->shape[1] % p->groups != 0 || out_ch % p->groups != 0)
    return kiln_set_error(KILN_ERR_SHAPE,
                          "%s: groups %lld must divide the input channels %lld and the output channels %lld "
                          "(input %s, weight %s)",
                          api, (long long)p->groups, (long long)x->shape[1], (long long)out_ch, kiln__tshape(x),
                          kiln__tshape(w));
  if (b && (b->ndim != 1 || b->shape[0] != out_ch))
    return kiln_set_error(KILN_ERR_SHAPE, "%s: bias must have shape [%lld] (the output channels), got %s", api,
                          (long long)out_ch, kiln__tshape(b));
  return KILN_OK;
}

static kiln_status conv_geometry(const kiln_tensor *x, const kiln_tensor *w, const kiln_tensor *b,
                                 const attrs_conv *p, conv_geom *g) {
  const char *api = "kiln_conv2d";
  if (conv_check_common(api, x, w, b, p, w->ndim == 4 ? w->shape[0] : 0) != KILN_OK) return kiln_last_error();
  g->N = x->shape[0], g->C = x->shape[1], g->H = x->shape[2], g->W = x->shape[3];
  g->OC = w->shape[0], g->KH = w->shape[2], g->KW = w->shape[3], g->G = p->groups;
  if (w->shape[1] * g->G != g->C)
    return kiln_set_error(KILN_ERR_SHAPE,
                          "kiln_conv2d: weight %s expects %lld input channels (groups %lld), input %s has %lld", kiln__tshape(w),
                          (long long)(w->shape[1] * g->G), (long long)g->G, kiln__tshape(x), (long long)g->C);
  int64_t in[2] = {g->H, g->W}, k[2] = {g->KH, g->KW}, o[2];
  for (int d = 0; d < 2; d++) {
    if (p->padding[d] == KILN_PADDING_SAME) {
      if (p->stride[d] != 1)
        return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                              "kiln_conv2d: padding \"same\" needs stride 1, got stride [%lld, %lld] (input %s)",
                              (long long)p->stride[0], (long long)p->stride[1], kiln__tshape(x));
      int64_t total = p->dilation[d] * (k[d] - 1);
      g->pad[d] = total / 2;
      o[d] = in[d];
    } else {
      if (p->padding[d] < 0)
        return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_conv2d: padding must be >= 0 or KILN_PADDING_SAME, got [%lld, %lld]",
                              (long long)p->padding[0], (long long)p->padding[1]);
      g->pad[d] = p->padding[d];
      o[d] = out_size(api, "kernel", d, in[d], k[d], p->stride[d], p->padding[d], p->dilation[d], x, w);
      if (o[d] < 0) return kiln_last_error();
    }
  }
  g->OH = o[0], g->OW = o[1];
  return KILN_OK;
}

/* A 1x1 stride-1 unpadded kernel: cols is x itself (and x's gradient dcols). */
static bool conv_pointwise(const conv_geom *g, const attrs_conv *p) {
  return g->KH == 1 && g->KW == 1 && p->stride[0] == 1 && p->stride[1] == 1 && g->pad[0] == 0 && g->pad[1] == 0;
}

/* cols (N, G, C/G*kh*kw, OH*OW): a view of x for a 1x1 stride-1 unpadded kernel, else
** the im2col op's output. */
static kiln_tensor *conv_cols(kiln_tensor *x, const conv_geom *g, const attrs_conv *p) {
  int64_t K = g->C / g->G * g->KH * g->KW, L = g->OH * g->OW;
  kiln_tensor *cols;
  if (conv_pointwise(g, p)) {
    cols = x;
  } else {
    int64_t k[2] = {g->KH, g->KW}, o[2] = {g->OH, g->OW};
    attrs_window w = window(k, p->stride, g->pad, p->dilation, o);
    cols = im2col_call(x, &w);
  }
  return g->G == 1 ? kiln_reshape(cols, KILN_SHAPE(g->N, K, L)) : kiln_reshape(cols, KILN_SHAPE(g->N, g->G, K, L));
}

/* ---- channels-last through the library kernels ----------------------------------------- */
/* An op of the library path (conv2d_direct and the two backward ops) runs channels-last
** when its image input (x, or the gradient for the data gradient) is channels-last (and
** not also contiguous): cuDNN, and oneDNN on the CPU, read NHWC natively. Its inputs
** are then all made channels-last and it makes its output in NHWC memory: the op's own
** output has the shape (N, H, W, C) (its infer permutes it), its kernel sees that memory
** as an NCHW-shaped view with channels-last strides, and the caller permutes it back, so
** the user gets an NCHW-shaped channels-last tensor. */
static bool conv_cl(const kiln_tensor *x) {
  return x && !kiln_is_contiguous(x) && kiln_is_contiguous_format(x, KILN_CHANNELS_LAST);
}
static const int to_nchw[4] = {0, 3, 1, 2};

/* t as the library op reads it: channels-last in cl mode, else contiguous (a copy only
** when t is not already so; the copies are ops of their own). */
static kiln_tensor *conv_prep(kiln_tensor *t, bool cl) {
  if (!t || t->ndim != 4) return t ? kiln_contiguous(t) : NULL;
  return cl ? kiln_contiguous_format(t, KILN_CHANNELS_LAST) : kiln_contiguous(t);
}

/* The strides conv_prep gives a view (for asking kiln__dispatch_has before the copies). */
static void prep_strides(kiln__view *v, bool cl) {
  kiln__contiguous_strides(v->ndim, v->shape, v->strides);
  if (cl && v->ndim == 4) {
    v->strides[1] = 1, v->strides[3] = v->shape[1], v->strides[2] = v->shape[3] * v->shape[1];
    v->strides[0] = v->shape[2] * v->strides[2];
  }
}

/* An op's NCHW output shape as it allocates it (NHWC in cl mode). */
static void out_shape(int64_t sh[4], bool cl) {
  if (!cl) return;
  int64_t t[4] = {sh[0], sh[2], sh[3], sh[1]};
  for (int k = 0; k < 4; k++) sh[k] = t[k];
}

/* Runs a library kernel into out (NHWC memory seen as NCHW in cl mode). */
static kiln_status run_lib(kiln_tensor *out, kiln__kargs *a, bool cl) {
  a->n_out = a->n_out ? a->n_out : 1;
  a->out[0] = kiln__view_of(out);
  if (cl) {
    kiln__view v = a->out[0], o = v;
    o.shape[1] = v.shape[3], o.shape[2] = v.shape[1], o.shape[3] = v.shape[2];
    o.strides[1] = v.strides[3], o.strides[2] = v.strides[1], o.strides[3] = v.strides[2];
    a->out[0] = o;
  }
  if (kiln_numel(out) == 0) return KILN_OK;
  return kiln__dispatch(kiln_device_of(out), a);
}

/* An op's output as the NCHW-shaped tensor the caller wants. */
static kiln_tensor *from_lib(kiln_tensor *y, bool cl) { return cl && y ? kiln_permute(y, 4, to_nchw) : y; }

/* ---- conv2d's backward kernels (CONV2D_BACKWARD_DATA/_WEIGHT: cuDNN on CUDA) ------------- */

/* attrs_conv with the padding resolved (no "same") and the size of the tensor the op
** makes: the input's (H, W) for the data gradient, the kernel's (kh, kw) for the weight's. */
typedef struct attrs_convb {
  attrs_conv c;
  int64_t size[2];
  int64_t bias; /* the weight gradient's op: 1 makes the bias gradient too (a second output) */
  int nsz;
} attrs_convb;
static const kiln__attr_field f_convb[] = {
    {"stride", KILN__A_INTS, offsetof(attrs_convb, c.stride), offsetof(attrs_convb, c.ns), NULL},
    {"padding", KILN__A_INTS, offsetof(attrs_convb, c.padding), offsetof(attrs_convb, c.np), NULL},
    {"dilation", KILN__A_INTS, offsetof(attrs_convb, c.dilation), offsetof(attrs_convb, c.nd), NULL},
    {"groups", KILN__A_INT, offsetof(attrs_convb, c.groups), 0, NULL},
    KILN__FIELD_INTS(attrs_convb, size, nsz), KILN__FIELD(attrs_convb, bias, KILN__A_INT)};

static const kiln__op op_conv2d_bwd_data, op_conv2d_bwd_weight;

static attrs_convb convb_attrs(const attrs_conv *p, const conv_geom *g) {
  attrs_convb a;
  a.c = *p;
  for (int k = 0; k < 2; k++) a.c.padding[k] = g->pad[k];
  a.size[0] = g->H, a.size[1] = g->W;
  a.nsz = 2;
  a.bias = 0;
  return a;
}

static kiln__conv_params convb_params(const attrs_convb *a, int64_t kh, int64_t kw) {
  const int64_t k[2] = {kh, kw};
  return conv_window(k, a->c.stride, a->c.padding, a->c.dilation);
}

/* The arguments of a backward kernel: in0, in1, and the output (shape out_shape,
** contiguous strides when it is only asked about). */
static kiln__kargs convb_args(kiln__kop op, kiln_tensor *in0, kiln_tensor *in1, const int64_t *oshape,
                              const attrs_convb *ab, const kiln__conv_params *cp) {
  kiln__kargs q = {0};
  q.op = op;
  q.n_in = 2;
  q.in[0] = kiln__view_of(in0);
  q.in[1] = kiln__view_of(in1);
  q.n_out = 1;
  q.out[0] = view_shaped(q.in[0], oshape);
  if (op == KILN__K_CONV2D_BACKWARD_WEIGHT && ab->bias) { /* the bias gradient (OC) */
    q.n_out = 2;
    q.out[1] = q.out[0];
    q.out[1].ndim = 1;
    q.out[1].shape[0] = oshape[0];
    q.out[1].strides[0] = 1;
  }
  q.i[0] = ab->c.groups;
  q.i[1] = kiln_matmul_tf32() ? 1 : 0;
  q.params = cp;
  return q;
}

/* Whether conv2d's backward should use kernel op for these tensors: when the device has it
** for these arguments (cuDNN: padding symmetric, packed layouts). On the CPU only in f32
** with a library convolution (kernel CONV2D: oneDNN), which then runs the backward too;
** else the CPU's kernels are reference loops and im2col + BLAS is much faster. `like` is
** the tensor whose gradient it makes. */
/* The smallest output map (OH*OW) whose weight gradient oneDNN makes on the CPU
** (KILN_DNNL_WGRAD_MIN_MAP overrides, for measuring). */
static int64_t dnnl_wgrad_min_map(void) {
  static int64_t v = -1;
  if (v < 0) {
    v = kiln__knob_int("KILN_DNNL_WGRAD_MIN_MAP", 16);
  }
  return v;
}

/* Whether the CPU's CONV2D kernels make this small-map weight gradient with one GEMM
** (cpu_dnnl.c: gemm_case, one output pixel whose cut window is the whole image, ResNet-18
** 32x32's layer4; small_case, the columns written in the GEMM's layout, layer3), which beat
** the composite there: ungrouped, NCHW. KILN_CONV_GEMM=0 turns it off there and here.
** x (N, C, H, W). */
static bool conv_gemm_map(const kiln_tensor *x, const attrs_convb *ab) {
  static int off = -1;
  if (off < 0) off = !kiln__knob_on("KILN_CONV_GEMM", true);
  return !off && ab->c.groups == 1 && !conv_cl(x);
}

static bool convb_has(kiln__kop op, kiln_tensor *in0, kiln_tensor *in1, const kiln_tensor *like,
                      const attrs_convb *ab) {
  kiln_device dev = kiln_device_of(in0);
  bool cl = conv_cl(in0);
  const kiln_tensor *k = op == KILN__K_CONV2D_BACKWARD_DATA ? in1 : like; /* the weight */
  if (dev.type == KILN_DEVICE_CPU) {
    if (in0->dtype != KILN_F32 || in1->dtype != KILN_F32 || !kiln__dispatch_has(dev, NULL, KILN__K_CONV2D))
      return false;
    /* oneDNN runs every pass (cpu_dnnl.c, in the layouts it picks) but one: the weight
    ** gradient of a spatial kernel on maps under 4x4, where its jit kernel (a reduction
    ** over the batch, mostly padding taps) ran at 38-75 GFLOP/s on ResNet-18 32x32's
    ** 2x2 and 1x1 maps and the composite's one GEMM over the batch at ~180-200; at 4x4
    ** and above, and for 1x1 kernels, oneDNN won (ResNet-18 32x32, batch 64) */
    int64_t L = in1->shape[2] * in1->shape[3];
    if (op == KILN__K_CONV2D_BACKWARD_WEIGHT && L < dnnl_wgrad_min_map() && k->shape[2] * k->shape[3] > 1 &&
        !conv_gemm_map(in0, ab))
      return false;
  }
  kiln__conv_params cp = convb_params(ab, k->shape[2], k->shape[3]);
  /* the operands as the calls below prepare them */
  kiln__kargs q = convb_args(op, in0, in1, like->shape, ab, &cp);
  prep_strides(&q.in[0], cl), prep_strides(&q.in[1], cl), prep_strides(&q.out[0], cl);
  return kiln__dispatch_has(dev, &q, op);
}

/* dx added by the kernel into the gradient already pending for x (kiln__grad_into), where
** the device's kernel can add (CONV2D_BACKWARD_DATA_ACC: cuDNN's beta 1): *into is that
** tensor, or NULL when nothing was done (no pending sum, another dtype or layout, no such
** kernel); an error only when the kernel failed. */
static kiln_status convb_data_into(const kiln__node *n, kiln_tensor *g, kiln_tensor *w, const attrs_convb *ab,
                                   kiln_tensor **into) {
  *into = NULL;
  kiln_tensor *acc = kiln__grad_into(n, 0);
  bool cl = conv_cl(g);
  if (!acc || acc->dtype != g->dtype || acc->ndim != 4 || acc->shape[0] != g->shape[0] ||
      acc->shape[1] != w->shape[1] * ab->c.groups || acc->shape[2] != ab->size[0] || acc->shape[3] != ab->size[1] ||
      !kiln_device_equal(kiln_device_of(acc), kiln_device_of(g)) ||
      !(cl ? kiln_is_contiguous_format(acc, KILN_CHANNELS_LAST) : kiln_is_contiguous(acc)))
    return KILN_OK;
  kiln__conv_params cp = convb_params(ab, w->shape[2], w->shape[3]);
  kiln__kargs q = convb_args(KILN__K_CONV2D_BACKWARD_DATA_ACC, g, w, acc->shape, ab, &cp);
  q.out[0] = kiln__view_of(acc); /* NCHW-shaped; channels-last strides in cl mode */
  prep_strides(&q.in[0], cl), prep_strides(&q.in[1], cl);
  if (!kiln__dispatch_has(kiln_device_of(g), &q, KILN__K_CONV2D_BACKWARD_DATA_ACC)) return KILN_OK;
  kiln_tensor *in[2] = {conv_prep(g, cl), conv_prep(w, cl)};
  if (!in[0] || !in[1]) return kiln_last_error();
  q.in[0] = kiln__view_of(in[0]), q.in[1] = kiln__view_of(in[1]);
  kiln_status st = kiln__run_into(acc, &q);
  if (st == KILN_OK) *into = acc;
  return st;
}

static kiln_tensor *convb_data_call(kiln_tensor *g, kiln_tensor *w, const attrs_convb *ab) {
  bool cl = conv_cl(g);
  kiln_tensor *in[2] = {conv_prep(g, cl), conv_prep(w, cl)};
  return in[0] && in[1] ? from_lib(kiln__op_call(&op_conv2d_bwd_data, 2, in, ab, NULL), cl) : NULL;
}
/* ab->size is the weight's (kh, kw) here; with ab->bias, *db gets the bias gradient */
static kiln_tensor *convb_weight_call(kiln_tensor *x, kiln_tensor *g, const attrs_convb *ab, kiln_tensor **db) {
  bool cl = conv_cl(x);
  kiln_tensor *in[2] = {conv_prep(x, cl), conv_prep(g, cl)}, *out[2] = {NULL, NULL};
  kiln_tensor *dw = in[0] && in[1] ? from_lib(kiln__op_call(&op_conv2d_bwd_weight, 2, in, ab, out), cl) : NULL;
  if (db) *db = out[1];
  return dw;
}

/* dx (N, C, H, W) from g (N, OC, OH, OW) and w (OC, C/G, kh, kw) */
static kiln_status convb_data_infer(kiln__op_ctx *c) {
  const attrs_convb *ab = c->attrs;
  kiln_tensor *g = c->in[0], *w = c->in[1];
  if (g->ndim != 4 || w->ndim != 4 || g->shape[1] != w->shape[0])
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_conv2d_backward_data: grad %s and weight %s do not match",
                          kiln__tshape(g), kiln__tshape(w));
  int64_t sh[4] = {g->shape[0], w->shape[1] * ab->c.groups, ab->size[0], ab->size[1]};
  out_shape(sh, conv_cl(g));
  kiln__op_meta(c, 0, 4, sh, g->dtype);
  return KILN_OK;
}

static kiln_status convb_data_forward(kiln__op_ctx *c) {
  const attrs_convb *ab = c->attrs;
  kiln__conv_params cp = convb_params(ab, c->in[1]->shape[2], c->in[1]->shape[3]);
  kiln__kargs a = convb_args(KILN__K_CONV2D_BACKWARD_DATA, c->in[0], c->in[1], c->out[0]->shape, ab, &cp);
  a.n_out = 0; /* run_lib sets out0 */
  return run_lib(c->out[0], &a, conv_cl(c->in[0]));
}

/* saved: inputs 0 and 1 (the two backward ops, and conv2d_direct: x and w) */
static void save_in01(kiln__op_ctx *c, kiln__node *n) {
  kiln__node_save(n, 0, c->in[0]);
  kiln__node_save(n, 1, c->in[1]);
}

/* conv2d with the resolved padding (every argument checked already) */
static kiln_tensor *convb_conv(kiln_tensor *x, kiln_tensor *w, const attrs_convb *ab) {
  return kiln_conv2d(x, w, NULL, ab->c.stride, ab->c.padding, ab->c.dilation, ab->c.groups);
}

/* dx = T(g, w) is linear in each: <gg, T(g, w)> = <conv(gg, w), g>, whose gradient in w is
** the weight gradient of conv(gg, .) against g. */
static kiln_status convb_data_backward(kiln__node *n, kiln_tensor *gg, kiln_tensor **gi) {
  const attrs_convb *ab = n->attrs;
  kiln_tensor *g = n->saved[0], *w = n->saved[1];
  gg = from_lib(gg, conv_cl(g)); /* the op's output was NHWC-shaped in cl mode */
  if (n->needs[0]) {
    kiln_status st = kiln__give_grad(&gi[0], convb_conv(gg, w, ab), gg);
    if (st != KILN_OK) return st;
  }
  if (n->needs[1]) {
    attrs_convb wb = *ab;
    wb.size[0] = w->shape[2], wb.size[1] = w->shape[3];
    wb.bias = 0;
    kiln_status st = kiln__give_grad(&gi[1], convb_weight_call(gg, g, &wb, NULL), gg);
    if (st != KILN_OK) return st;
  }
  return KILN_OK;
}

/* dW (OC, C/G, kh, kw) from x (N, C, H, W) and g (N, OC, OH, OW) */
static kiln_status convb_weight_infer(kiln__op_ctx *c) {
  const attrs_convb *ab = c->attrs;
  kiln_tensor *x = c->in[0], *g = c->in[1];
  if (x->ndim != 4 || g->ndim != 4 || x->shape[0] != g->shape[0] || x->shape[1] % ab->c.groups)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_conv2d_backward_weight: input %s and grad %s do not match",
                          kiln__tshape(x), kiln__tshape(g));
  int64_t sh[4] = {g->shape[1], x->shape[1] / ab->c.groups, ab->size[0], ab->size[1]};
  out_shape(sh, conv_cl(x));
  kiln__op_meta(c, 0, 4, sh, x->dtype);
  c->n_out = 1; /* the op's n_out counts the optional bias gradient: no second output without it */
  if (ab->bias) {
    int64_t bs[1] = {g->shape[1]};
    kiln__op_meta(c, 1, 1, bs, x->dtype);
    c->n_out = 2;
    c->n_node_out = 1; /* the rule below differentiates dW only */
  }
  return KILN_OK;
}

static kiln_status convb_weight_forward(kiln__op_ctx *c) {
  const attrs_convb *ab = c->attrs;
  kiln__conv_params cp = convb_params(ab, ab->size[0], ab->size[1]);
  kiln__kargs a = convb_args(KILN__K_CONV2D_BACKWARD_WEIGHT, c->in[0], c->in[1], c->out[0]->shape, ab, &cp);
  a.n_out = 0;
  if (ab->bias) {
    a.n_out = 2;
    a.out[1] = kiln__view_of(c->out[1]);
  }
  return run_lib(c->out[0], &a, conv_cl(c->in[0]));
}

/* dW = V(x, g): <gW, V(x, g)> = <conv(x, gW), g>: in x the data gradient of conv(., gW)
** against g, in g conv(x, gW). */
static kiln_status convb_weight_backward(kiln__node *n, kiln_tensor *gw, kiln_tensor **gi) {
  const attrs_convb *ab = n->attrs;
  kiln_tensor *x = n->saved[0], *g = n->saved[1];
  gw = from_lib(gw, conv_cl(x));
  if (n->needs[0]) {
    attrs_convb db = *ab;
    db.size[0] = x->shape[2], db.size[1] = x->shape[3];
    kiln_status st = kiln__give_grad(&gi[0], convb_data_call(g, gw, &db), gw);
    if (st != KILN_OK) return st;
  }
  if (n->needs[1]) {
    kiln_status st = kiln__give_grad(&gi[1], convb_conv(x, gw, ab), gw);
    if (st != KILN_OK) return st;
  }
  return KILN_OK;
}

static const kiln__op op_conv2d_bwd_data = {
    .name = "conv2d_backward_data", .api = "kiln_conv2d_backward_data", .n_in = 2, .n_out = 1,
    .flags = KILN__OP_FLOAT_ONLY, .n_kernels = 1, .kernels = {KILN__K_CONV2D_BACKWARD_DATA}, .attrs = f_convb,
    .n_attrs = 6, .attr_size = sizeof(attrs_convb), .infer = convb_data_infer, .forward = convb_data_forward,
    .backward = convb_data_backward, .n_saved = 2, .save = save_in01};
static const kiln__op op_conv2d_bwd_weight = {
    .name = "conv2d_backward_weight", .api = "kiln_conv2d_backward_weight", .n_in = 2, .n_out = 2,
    .flags = KILN__OP_FLOAT_ONLY, .n_kernels = 1, .kernels = {KILN__K_CONV2D_BACKWARD_WEIGHT}, .attrs = f_convb,
    .n_attrs = 6, .attr_size = sizeof(attrs_convb), .infer = convb_weight_infer, .forward = convb_weight_forward,
    .backward = convb_weight_backward, .n_saved = 2, .save = save_in01};

/* ---- conv2d through a library's kernel (CONV2D: oneDNN on the CPU) ---------------------- */

static const kiln__op op_conv2d_direct;

static kiln__conv_params conv_params(const conv_geom *g, const attrs_conv *p) {
  const int64_t k[2] = {g->KH, g->KW};
  return conv_window(k, p->stride, g->pad, p->dilation);
}

/* conv2d's output (N, OC, OH, OW), allocated as (N, OH, OW, OC) when cl (out_shape) */
static kiln_status conv_infer_as(kiln__op_ctx *c, bool cl) {
  conv_geom g = {0};
  if (conv_geometry(c->in[0], c->in[1], c->in[2], c->attrs, &g) != KILN_OK) return kiln_last_error();
  int64_t sh[4] = {g.N, g.OC, g.OH, g.OW};
  out_shape(sh, cl);
  kiln__op_meta(c, 0, 4, sh, c->in[0]->dtype);
  return KILN_OK;
}

static kiln_status conv2d_infer(kiln__op_ctx *c) { return conv_infer_as(c, false); }
static kiln_status conv_direct_infer(kiln__op_ctx *c) { return conv_infer_as(c, conv_cl(c->in[0])); }

static kiln_status conv_direct_forward(kiln__op_ctx *c) {
  const attrs_conv *p = c->attrs;
  conv_geom g = {0};
  if (conv_geometry(c->in[0], c->in[1], c->in[2], p, &g) != KILN_OK) return kiln_last_error();
  kiln__conv_params cp = conv_params(&g, p);
  kiln__kargs a = {0};
  a.op = KILN__K_CONV2D;
  a.n_in = c->in[2] ? 3 : 2;
  for (int i = 0; i < a.n_in; i++) a.in[i] = kiln__view_of(c->in[i]);
  a.i[0] = g.G;
  a.i[1] = kiln_matmul_tf32() ? 1 : 0; /* TF32 as the products allow it */
  a.params = &cp;
  return run_lib(c->out[0], &a, conv_cl(c->in[0]));
}

/* The backward of the kernel's convolution, with the ops the composite uses, so that it
** runs on every backend and twice differentiates: dx = col2im(W^T g), dW = sum_n g cols^T
** (cols recomputed: the forward kept none; one product over the batch), db = g summed
** over (N, OH, OW). */
static kiln_status conv_direct_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  const attrs_conv *p = n->attrs;
  kiln_tensor *x = n->saved[0], *w = n->saved[1];
  conv_geom ge = {0};
  if (conv_geometry(x, w, NULL, p, &ge) != KILN_OK) return kiln_last_error();
  g = from_lib(g, conv_cl(x)); /* NHWC-shaped in cl mode, as the forward's output */
  /* The device's own backward kernels (cuDNN), where it has them for these arguments. */
  attrs_convb ab = convb_attrs(p, &ge), wb = ab;
  wb.size[0] = ge.KH, wb.size[1] = ge.KW;
  bool need_x = n->needs[0], need_w = n->needs[1];
  if (need_x && convb_has(KILN__K_CONV2D_BACKWARD_DATA, g, w, x, &ab)) {
    kiln_tensor *dx;
    kiln_status st = convb_data_into(n, g, w, &ab, &dx);
    if (st != KILN_OK) return st;
    st = kiln__give_grad(&gi[0], dx ? dx : convb_data_call(g, w, &ab), g);
    if (st != KILN_OK) return st;
    need_x = false;
  }
  /* the bias gradient in the weight gradient's pass (oneDNN's diff_bias and the direct
  ** loops' sums on the CPU: PyTorch's arrangement; on CUDA the direct TF32 kernel's row sums,
  ** or cuDNN's path's own two-stage sum), instead of a sum over the gradient after:
  ** fmnist-cnn's two bias sums were 0.9 ms of a 12.6 ms CPU step */
  bool need_b = n->needs[2];
  wb.bias = need_w && need_b;
  if (wb.bias && !convb_has(KILN__K_CONV2D_BACKWARD_WEIGHT, x, g, w, &wb)) wb.bias = 0;
  if (need_w && convb_has(KILN__K_CONV2D_BACKWARD_WEIGHT, x, g, w, &wb)) {
    kiln_tensor *db = NULL;
    kiln_status st = kiln__give_grad(&gi[1], convb_weight_call(x, g, &wb, wb.bias ? &db : NULL), g);
    if (st == KILN_OK && wb.bias) st = kiln__give_grad(&gi[2], db, g);
    if (st != KILN_OK) return st;
    need_w = false;
    need_b = need_b && !wb.bias;
  }
  /* the composite for what the kernels did not make (reshaping a channels-last weight or
  ** gradient copies it: not when the kernels made both) */
  if (!need_x && !need_w && !need_b) return KILN_OK;
  int64_t OCg = ge.OC / ge.G, K = ge.C / ge.G * ge.KH * ge.KW, L = ge.OH * ge.OW;
  kiln_tensor *gm = need_x || need_w ? kiln_reshape(g, KILN_SHAPE(ge.N, ge.G, OCg, L)) : NULL;
  kiln_tensor *wm = need_x ? kiln_reshape(w, KILN_SHAPE(ge.G, OCg, K)) : NULL;
  if (need_x) {
    kiln_tensor *dcols = kiln_matmul(kiln_transpose(wm, 1, 2), gm); /* (N, G, K, L) */
    kiln_tensor *dx;
    if (conv_pointwise(&ge, p)) {
      dx = kiln_reshape(dcols, 4, x->shape);
    } else {
      int64_t k[2] = {ge.KH, ge.KW}, sz[2] = {ge.H, ge.W};
      attrs_window win = window(k, p->stride, ge.pad, p->dilation, sz);
      dx = col2im_call(kiln_reshape(dcols, KILN_SHAPE(ge.N, ge.C, ge.KH, ge.KW, ge.OH, ge.OW)), &win);
    }
    kiln_status st = kiln__give_grad(&gi[0], dx, g);
    if (st != KILN_OK) return st;
  }
  if (need_w) {
    kiln_tensor *cols = conv_cols(x, &ge, p);
    if (cols && ge.G == 1) cols = kiln_unsqueeze(cols, 1); /* (N, 1, K, L) */
    /* One product over all the images: (G, OCg, N*L) x (G, N*L, K). A product per image
    ** summed afterwards made an (N, G, OCg, K) intermediate, N times the weight: 600 MB per
    ** call in ResNet-18's layer4 at batch 64, and most of a CPU training step. */
    const int to_gcnl[4] = {1, 2, 0, 3}; /* (N, G, ., L) -> (G, ., N, L) */
    kiln_tensor *gt = kiln_reshape(kiln_contiguous(kiln_permute(gm, 4, to_gcnl)), KILN_SHAPE(ge.G, OCg, ge.N * L));
    kiln_tensor *ct = cols ? kiln_reshape(kiln_contiguous(kiln_permute(cols, 4, to_gcnl)), KILN_SHAPE(ge.G, K, ge.N * L)) : NULL;
    kiln_tensor *dw = kiln_matmul(gt, ct ? kiln_transpose(ct, 1, 2) : NULL); /* (G, OCg, K) */
    kiln_status st = kiln__give_grad(&gi[1], kiln_reshape(dw, 4, w->shape), g);
    if (st != KILN_OK) return st;
  }
  if (need_b) {
    int dims[3] = {0, 2, 3};
    kiln_status st = kiln__give_grad(&gi[2], kiln_sum(g, 3, dims, false), g);
    if (st != KILN_OK) return st;
  }
  return KILN_OK;
}

static const kiln__op op_conv2d_direct = {
    .name = "conv2d_direct", .api = "kiln_conv2d", .n_in = 3, .n_out = 1, .optional = 1u << 2, .n_kernels = 1,
    .kernels = {KILN__K_CONV2D}, .attrs = f_conv, .n_attrs = 4, .attr_size = sizeof(attrs_conv),
    .infer = conv_direct_infer, .forward = conv_direct_forward, .backward = conv_direct_backward, .n_saved = 2,
    .save = save_in01};

static kiln_status conv2d_forward(kiln__op_ctx *c) {
  const attrs_conv *p = c->attrs;
  kiln_tensor *x = c->in[0], *w = c->in[1], *b = c->in[2];
  conv_geom g = {0};
  if (conv_geometry(x, w, b, p, &g) != KILN_OK) return kiln_last_error();
  int64_t K = g.C / g.G * g.KH * g.KW;
  kiln_scope_begin();
  /* whether the device runs CONV2D for these arguments (its supports() asked too) */
  kiln__kargs q = {0};
  q.op = KILN__K_CONV2D;
  q.n_in = b ? 3 : 2;
  for (int i = 0; i < q.n_in; i++) q.in[i] = kiln__view_of(c->in[i]);
  q.n_out = 1;
  const int64_t osh[4] = {g.N, g.OC, g.OH, g.OW};
  q.out[0] = view_shaped(q.in[0], osh);
  q.i[0] = g.G;
  q.i[1] = kiln_matmul_tf32() ? 1 : 0;
  kiln__conv_params qp = conv_params(&g, p);
  q.params = &qp;
  /* the operands as the call below prepares them (channels-last on CUDA stays so) */
  bool cl = conv_cl(x);
  for (int i = 0; i < q.n_in; i++) prep_strides(&q.in[i], cl);
  prep_strides(&q.out[0], cl);
  /* The CPU's kernel (oneDNN) is f32 only; other devices' supports() say which dtypes. */
  bool lib_dtype = x->dtype == KILN_F32 || c->device.type != KILN_DEVICE_CPU;
  if (lib_dtype && kiln__dispatch_has(c->device, &q, KILN__K_CONV2D)) {
    kiln_tensor *in[3] = {conv_prep(x, cl), conv_prep(w, cl), b ? kiln_contiguous(b) : NULL};
    kiln_tensor *y = in[0] && in[1] && (!b || in[2]) ? kiln__op_call(&op_conv2d_direct, 3, in, p, NULL) : NULL;
    y = from_lib(y, cl);
    /* a channels-last input the kernel read as NCHW (oneDNN on the CPU): the output is made
    ** channels-last as the input (PyTorch's rule) */
    if (y && !cl && kiln__is_channels_last(x)) y = kiln_contiguous_format(y, KILN_CHANNELS_LAST);
    c->out[0] = kiln__scope_return(y);
    return c->out[0] ? KILN_OK : kiln_last_error();
  }
  kiln_tensor *cols = conv_cols(x, &g, p);
  /* (OC, K) @ (N, K, L), or per group (G, OC/G, K) @ (N, G, K, L) */
  kiln_tensor *wm = g.G == 1 ? kiln_reshape(w, KILN_SHAPE(g.OC, K)) : kiln_reshape(w, KILN_SHAPE(g.G, g.OC / g.G, K));
  kiln_tensor *y = kiln_reshape(kiln_matmul(wm, cols), KILN_SHAPE(g.N, g.OC, g.OH, g.OW));
  if (y && b) y = kiln_add(y, kiln_reshape(b, KILN_SHAPE(g.OC, 1, 1)));
  /* the memory format of the input, as the library path gives it (PyTorch's rule) */
  if (y && kiln__is_channels_last(x)) y = kiln_contiguous_format(y, KILN_CHANNELS_LAST);
  c->out[0] = kiln__scope_return(y);
  return c->out[0] ? KILN_OK : kiln_last_error();
}

static const kiln__op op_conv2d = {
    .name = "conv2d", .api = "kiln_conv2d", .n_in = 3, .n_out = 1, .optional = 1u << 2,
    .amp = KILN__AMP_LOWER, .flags = KILN__OP_COMPOSITE, .n_kernels = 2,
    .kernels = {KILN__K_IM2COL, KILN__K_MATMUL}, .attrs = f_conv, .n_attrs = 4,
    .attr_size = sizeof(attrs_conv), .infer = conv2d_infer, .forward = conv2d_forward};

static attrs_conv conv_attrs(const int64_t *stride, const int64_t *padding, const int64_t *dilation,
                             const int64_t *output_padding, int64_t groups) {
  attrs_conv a;
  const int64_t *s = stride ? stride : one2, *p = padding ? padding : zero2, *d = dilation ? dilation : one2;
  const int64_t *op = output_padding ? output_padding : zero2;
  for (int k = 0; k < 2; k++) a.stride[k] = s[k], a.padding[k] = p[k], a.dilation[k] = d[k], a.output_padding[k] = op[k];
  a.ns = a.np = a.nd = a.nop = 2;
  a.groups = groups;
  return a;
}

kiln_tensor *kiln_conv2d(kiln_tensor *x, kiln_tensor *weight, kiln_tensor *bias, const int64_t *stride,
                         const int64_t *padding, const int64_t *dilation, int64_t groups) {
  attrs_conv a = conv_attrs(stride, padding, dilation, NULL, groups);
  kiln_tensor *in[3] = {x, weight, bias};
  return kiln__op_call(&op_conv2d, 3, in, &a, NULL);
}

/* ---- conv1d: conv2d with a unit height ------------------------------------------------ */

static kiln_status conv1d_infer(kiln__op_ctx *c) {
  kiln_tensor *x = c->in[0], *w = c->in[1];
  if (x->ndim != 3 || w->ndim != 3)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_conv1d: expected input (N, C, L) and weight (OC, C/groups, k), got %s and %s",
                          kiln__tshape(x), kiln__tshape(w));
  return KILN_OK;
}

static kiln_status conv1d_forward(kiln__op_ctx *c) {
  const attrs_conv *p = c->attrs;
  kiln_scope_begin();
  int64_t s[2] = {1, p->stride[1]}, pd[2] = {0, p->padding[1]}, d[2] = {1, p->dilation[1]};
  kiln_tensor *y = kiln_conv2d(kiln_unsqueeze(c->in[0], 2), kiln_unsqueeze(c->in[1], 2), c->in[2], s, pd, d, p->groups);
  if (y) y = kiln_squeeze(y, 2);
  c->out[0] = kiln__scope_return(y);
  return c->out[0] ? KILN_OK : kiln_last_error();
}

static const kiln__op op_conv1d = {
    .name = "conv1d", .api = "kiln_conv1d", .n_in = 3, .n_out = 1, .optional = 1u << 2,
    .amp = KILN__AMP_LOWER, .flags = KILN__OP_COMPOSITE, .n_kernels = 2,
    .kernels = {KILN__K_IM2COL, KILN__K_MATMUL}, .attrs = f_conv, .n_attrs = 4,
    .attr_size = sizeof(attrs_conv), .infer = conv1d_infer, .forward = conv1d_forward};

kiln_tensor *kiln_conv1d(kiln_tensor *x, kiln_tensor *weight, kiln_tensor *bias, int64_t stride, int64_t padding,
                         int64_t dilation, int64_t groups) {
  int64_t s[2] = {1, stride}, p[2] = {0, padding}, d[2] = {1, dilation};
  attrs_conv a = conv_attrs(s, p, d, NULL, groups);
  kiln_tensor *in[3] = {x, weight, bias};
  return kiln__op_call(&op_conv1d, 3, in, &a, NULL);
}

/* ---- conv_transpose2d: the adjoint of conv2d in x ------------------------------------- */

static kiln_status convt_geometry(const kiln_tensor *x, const kiln_tensor *w, const kiln_tensor *b,
                                  const attrs_conv *p, conv_geom *g) {
  const char *api = "kiln_conv_transpose2d";
  int64_t oc = w->ndim == 4 ? w->shape[1] * p->groups : 0;
  if (conv_check_common(api, x, w, b, p, oc) != KILN_OK) return kiln_last_error();
  if (w->shape[0] != x->shape[1])
    return kiln_set_error(KILN_ERR_SHAPE, "%s: weight %s expects %lld input channels, input %s has %lld", api,
                          kiln__tshape(w), (long long)w->shape[0], kiln__tshape(x), (long long)x->shape[1]);
  g->N = x->shape[0], g->C = x->shape[1], g->H = x->shape[2], g->W = x->shape[3];
  g->OC = oc, g->KH = w->shape[2], g->KW = w->shape[3], g->G = p->groups;
  int64_t in[2] = {g->H, g->W}, k[2] = {g->KH, g->KW}, o[2];
  for (int d = 0; d < 2; d++) {
    if (p->padding[d] < 0 || p->output_padding[d] < 0 ||
        (p->output_padding[d] >= p->stride[d] && p->output_padding[d] >= p->dilation[d]))
      return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                            "%s: padding [%lld, %lld] must be >= 0 and output_padding [%lld, %lld] >= 0 and smaller "
                            "than the stride or the dilation",
                            api, (long long)p->padding[0], (long long)p->padding[1], (long long)p->output_padding[0],
                            (long long)p->output_padding[1]);
    g->pad[d] = p->padding[d];
    o[d] = (in[d] - 1) * p->stride[d] - 2 * p->padding[d] + p->dilation[d] * (k[d] - 1) + p->output_padding[d] + 1;
    if (o[d] < 0 || (in[d] > 0 && o[d] == 0))
      return kiln_set_error(KILN_ERR_SHAPE, "%s: the output size at dim %d would be %lld (input %s, weight %s, padding %lld)",
                            api, d + 2, (long long)o[d], kiln__tshape(x), kiln__tshape(w), (long long)p->padding[d]);
  }
  g->OH = o[0], g->OW = o[1];
  return KILN_OK;
}

static kiln_status convt_infer(kiln__op_ctx *c) {
  conv_geom g = {0};
  if (convt_geometry(c->in[0], c->in[1], c->in[2], c->attrs, &g) != KILN_OK) return kiln_last_error();
  int64_t sh[4] = {g.N, g.OC, g.OH, g.OW};
  kiln__op_meta(c, 0, 4, sh, c->in[0]->dtype);
  return KILN_OK;
}

static kiln_status convt_forward(kiln__op_ctx *c) {
  const attrs_conv *p = c->attrs;
  kiln_tensor *x = c->in[0], *w = c->in[1], *b = c->in[2];
  conv_geom g = {0};
  if (convt_geometry(x, w, b, p, &g) != KILN_OK) return kiln_last_error();
  int64_t Cg = g.C / g.G, OCg = g.OC / g.G, K = OCg * g.KH * g.KW, L = g.H * g.W;
  kiln_scope_begin();
  /* cols (N, G, OC/G*kh*kw, H*W) = W^T (G, OC/G*kh*kw, C/G) @ x (N, G, C/G, H*W) */
  kiln_tensor *wt = kiln_transpose(kiln_reshape(w, KILN_SHAPE(g.G, Cg, K)), 1, 2);
  kiln_tensor *cols = kiln_matmul(wt, kiln_reshape(x, KILN_SHAPE(g.N, g.G, Cg, L)));
  int64_t k[2] = {g.KH, g.KW}, o[2] = {g.OH, g.OW};
  attrs_window win = window(k, p->stride, g.pad, p->dilation, o);
  kiln_tensor *y = col2im_call(kiln_reshape(cols, KILN_SHAPE(g.N, g.OC, g.KH, g.KW, g.H, g.W)), &win);
  if (y && b) y = kiln_add(y, kiln_reshape(b, KILN_SHAPE(g.OC, 1, 1)));
  c->out[0] = kiln__scope_return(y);
  return c->out[0] ? KILN_OK : kiln_last_error();
}

static const kiln__op op_conv_transpose2d = {
    .name = "conv_transpose2d", .api = "kiln_conv_transpose2d", .n_in = 3, .n_out = 1, .optional = 1u << 2,
    .amp = KILN__AMP_LOWER, .flags = KILN__OP_COMPOSITE, .n_kernels = 2,
    .kernels = {KILN__K_MATMUL, KILN__K_COL2IM}, .attrs = f_conv, .n_attrs = 5,
    .attr_size = sizeof(attrs_conv), .infer = convt_infer, .forward = convt_forward};

kiln_tensor *kiln_conv_transpose2d(kiln_tensor *x, kiln_tensor *weight, kiln_tensor *bias, const int64_t *stride,
                                   const int64_t *padding, const int64_t *output_padding, const int64_t *dilation,
                                   int64_t groups) {
  attrs_conv a = conv_attrs(stride, padding, dilation, output_padding, groups);
  kiln_tensor *in[3] = {x, weight, bias};
  return kiln__op_call(&op_conv_transpose2d, 3, in, &a, NULL);
}

/* ---- pooling -------------------------------------------------------------------------------- */

static attrs_pool pool_attrs(const int64_t *kernel, const int64_t *stride, const int64_t *padding,
                             const int64_t *dilation) {
  attrs_pool a;
  const int64_t *k = kernel ? kernel : one2;
  const int64_t *s = stride ? stride : k, *p = padding ? padding : zero2, *d = dilation ? dilation : one2;
  for (int i = 0; i < 2; i++) a.kernel[i] = k[i], a.stride[i] = s[i], a.padding[i] = p[i], a.dilation[i] = d[i];
  a.nk = a.ns = a.np = a.nd = 2;
  return a;
}

/* The output's spatial size (o), after the checks every pool makes. PyTorch's rule: the
** padding is at most half the (dilated) kernel, so that no window lies in padding only. */
static kiln_status pool_geometry(const char *api, const kiln_tensor *x, const attrs_pool *p, int64_t o[2]) {
  if (check_float4(api, x) != KILN_OK) return kiln_last_error();
  if (check_positive(api, "kernel size", p->kernel, 1) != KILN_OK) return kiln_last_error();
  if (check_positive(api, "stride", p->stride, 1) != KILN_OK) return kiln_last_error();
  if (check_positive(api, "dilation", p->dilation, 1) != KILN_OK) return kiln_last_error();
  for (int d = 0; d < 2; d++) {
    if (p->padding[d] < 0 || 2 * p->padding[d] > p->dilation[d] * (p->kernel[d] - 1) + 1)
      return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                            "%s: padding [%lld, %lld] must be >= 0 and at most half the kernel [%lld, %lld] (input %s)",
                            api, (long long)p->padding[0], (long long)p->padding[1], (long long)p->kernel[0],
                            (long long)p->kernel[1], kiln__tshape(x));
    o[d] = out_size(api, "kernel", d, x->shape[2 + d], p->kernel[d], p->stride[d], p->padding[d], p->dilation[d], x,
                    NULL);
    if (o[d] < 0) return kiln_last_error();
  }
  return KILN_OK;
}

/* A pool's output 0, (N, C, OH, OW) in x's dtype, after pool_geometry's checks; sh its shape. */
static kiln_status pool_infer(kiln__op_ctx *c, const char *api, int64_t sh[4]) {
  kiln_tensor *x = c->in[0];
  int64_t o[2];
  if (pool_geometry(api, x, c->attrs, o) != KILN_OK) return kiln_last_error();
  sh[0] = x->shape[0], sh[1] = x->shape[1], sh[2] = o[0], sh[3] = o[1];
  kiln__op_meta(c, 0, 4, sh, x->dtype);
  return KILN_OK;
}

static kiln_status max_pool_infer(kiln__op_ctx *c) {
  kiln_tensor *x = c->in[0];
  int64_t sh[4];
  if (pool_infer(c, "kiln_max_pool2d", sh) != KILN_OK) return kiln_last_error();
  kiln__op_meta(c, 1, 4, sh, KILN_I64);
  /* a channels-last input gives channels-last outputs (the indices too, as PyTorch's) */
  c->meta[0].channels_last = c->meta[1].channels_last = kiln__is_channels_last(x);
  return KILN_OK;
}

static kiln_status max_pool_forward(kiln__op_ctx *c) {
  if (kiln_numel(c->out[0]) == 0) return KILN_OK;
  kiln__conv_params p = pool_params(c->attrs);
  return run_window(c, KILN__K_MAX_POOL2D, 1, 2, &p, 0);
}

/* saved: 0 the input x, not the indices: the backward runs the forward kernel again for
** them (the same argmax, ties included, from the same x). In a CNN x is a ReLU's output,
** which that ReLU (and PyTorch, which keeps both) saves anyway, so the pool keeps no bytes
** of its own; the int64 indices were 2 bytes per input element (ResNet-50's stem at batch
** 256: 392 MiB held from the forward to the end of the backward), the recompute is one
** pooling pass over x. A forward that runs inside a backward (a checkpoint's recompute:
** ResNet's stem) keeps the indices as well (saved 1): its graph is used up at once, so they
** cost no memory that lasts, and the recompute would be a third pass over x (the stem's
** max pool: 0.37 ms a step on the H100). */
static void max_pool_save(kiln__op_ctx *c, kiln__node *n) {
  kiln__node_save(n, 0, c->in[0]);
  if (kiln__in_backward()) kiln__node_save(n, 1, c->out[1]);
}

/* max_pool2d's backward through its kernel (MAX_POOL2D_BACKWARD: a gather per pixel, the
** same sums every run), an internal op: inputs the gradient and the indices, attributes
** the forward's window and the input's (H, W) (an attrs_window). Its own backward gathers
** the gradient of dx at the indices. */

/* the backward ops' attributes: the forward's window, and x's (H, W) from its shape xs */
static attrs_window pool_bwd_attrs(const attrs_pool *p, const int64_t *xs) {
  attrs_window ab;
  ab.p = *p;
  ab.size[0] = xs[2], ab.size[1] = xs[3], ab.nsz = 2;
  return ab;
}

static kiln_status max_pool_bwd_infer(kiln__op_ctx *c) {
  const attrs_window *ab = c->attrs;
  kiln_tensor *g = c->in[0], *ix = c->in[1];
  if (g->ndim != 4 || ix->ndim != 4 || ix->dtype != KILN_I64)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_max_pool2d_backward: grad %s and i64 indices %s expected", kiln__tshape(g),
                          kiln__tshape(ix));
  int64_t sh[4] = {g->shape[0], g->shape[1], ab->size[0], ab->size[1]};
  kiln__op_meta(c, 0, 4, sh, g->dtype);
  c->meta[0].channels_last = kiln__is_channels_last(g); /* dx in the gradient's layout */
  return KILN_OK;
}

static kiln_status max_pool_bwd_forward(kiln__op_ctx *c) {
  kiln__conv_params p = pool_params(&((const attrs_window *)c->attrs)->p);
  return run_window(c, KILN__K_MAX_POOL2D_BACKWARD, 2, 1, &p, 0);
}

static void max_pool_bwd_save(kiln__op_ctx *c, kiln__node *n) { kiln__node_save(n, 0, c->in[1]); }

/* dx = scatter of g at the indices: its gradient in g is gg gathered at them */
static kiln_status max_pool_bwd_backward(kiln__node *n, kiln_tensor *gg, kiln_tensor **gi) {
  kiln_tensor *ix = n->saved[0];
  const int64_t *gs = n->in_shape[0];
  int64_t N = gs[0], C = gs[1], L = gs[2] * gs[3];
  kiln_tensor *r = kiln_gather(kiln_reshape(gg, KILN_SHAPE(N, C, gg->shape[2] * gg->shape[3])), 2,
                               kiln_reshape(ix, KILN_SHAPE(N, C, L)));
  return kiln__give_grad(&gi[0], kiln_reshape(r, 4, gs), gg);
}

static const kiln__op op_max_pool2d_bwd = {
    .name = "max_pool2d_backward", .api = "kiln_max_pool2d_backward", .n_in = 2, .n_out = 1, .n_kernels = 1,
    .kernels = {KILN__K_MAX_POOL2D_BACKWARD}, .attrs = f_window, .n_attrs = 5, .attr_size = sizeof(attrs_window),
    .infer = max_pool_bwd_infer, .forward = max_pool_bwd_forward, .backward = max_pool_bwd_backward, .n_saved = 1,
    .save = max_pool_bwd_save};

/* The gradient goes to the pixel each window took its maximum from; windows that share
** it add up: the device's MAX_POOL2D_BACKWARD where it has it, else SCATTER_ADD (whose
** atomics on a GPU add in no fixed order). */
static const kiln__op op_max_pool2d;

static kiln_status max_pool_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  const int64_t *xs = n->in_shape[0];
  int64_t N = xs[0], C = xs[1], L = g->shape[2] * g->shape[3];
  /* the indices, kept (max_pool_save) or from the saved input; the pooled values go at once */
  kiln_tensor *ix = n->saved[1];
  if (!ix) {
    kiln_tensor *ixo[2] = {NULL, NULL}, *x = n->saved[0];
    if (!kiln__op_call(&op_max_pool2d, 1, &x, n->attrs, ixo)) return kiln_last_error();
    ix = ixo[1];
    kiln__discard(ixo[0]);
  }
  kiln__kargs q = {0};
  attrs_window ab = pool_bwd_attrs(n->attrs, xs);
  kiln__conv_params p = pool_params(&ab.p);
  q.op = KILN__K_MAX_POOL2D_BACKWARD;
  q.n_in = 2, q.n_out = 1;
  q.in[0] = kiln__view_of(g);
  q.in[1] = kiln__view_of(ix);
  q.out[0] = view_shaped(q.in[0], xs);
  q.params = &p;
  if (kiln_dtype_is_float(g->dtype) && kiln__dispatch_has(kiln_device_of(g), &q, KILN__K_MAX_POOL2D_BACKWARD)) {
    kiln_tensor *in[2] = {g, ix};
    return kiln__give_grad(&gi[0], kiln__op_call(&op_max_pool2d_bwd, 2, in, &ab, NULL), g);
  }
  kiln_tensor *z = kiln_zeros(KILN_SHAPE(N, C, xs[2] * xs[3]), g->dtype, kiln_device_of(g));
  kiln_tensor *idx = kiln_reshape(ix, KILN_SHAPE(N, C, L));
  kiln_tensor *r = kiln_scatter_add(z, 2, idx, kiln_reshape(g, KILN_SHAPE(N, C, L)));
  return kiln__give_grad(&gi[0], kiln_reshape(r, 4, xs), g);
}

static const kiln__op op_max_pool2d = {
    .name = "max_pool2d", .api = "kiln_max_pool2d", .n_in = 1, .n_out = 2, .n_kernels = 1,
    .kernels = {KILN__K_MAX_POOL2D}, .attrs = f_pool, .n_attrs = 4, .attr_size = sizeof(attrs_pool),
    .infer = max_pool_infer, .forward = max_pool_forward, .backward = max_pool_backward, .n_saved = 2,
    .save = max_pool_save};

kiln_tensor *kiln_max_pool2d(kiln_tensor *x, const int64_t *kernel, const int64_t *stride, const int64_t *padding,
                             const int64_t *dilation, kiln_tensor **indices) {
  if (indices) *indices = NULL;
  attrs_pool a = pool_attrs(kernel, stride, padding, dilation);
  kiln_tensor *out[2] = {NULL, NULL};
  kiln_tensor *y = kiln__op_call(&op_max_pool2d, 1, &x, &a, out);
  if (y && indices) *indices = out[1];
  else if (y) kiln__discard(out[1]); /* not asked for, not saved: gone now, not at scope end */
  return y;
}

/* ---- relu_max_pool2d: ReLU then max_pool2d, one op ------------------------------------ */
/* max_pool2d(relu(x)) as one kernel each way where the device has RELU_MAX_POOL2D and the
** windows tile x (a CNN's MaxPool2d(k): stride = kernel, no padding or dilation): relu is
** monotone, so pooling first and then ReLU gives the same values, and the backward sends
** g to each window's max where the output is > 0, which is where the pair sends it. Saved:
** the output and a byte per output (the max's offset in its window), instead of the
** pair's two full-size maps; max_pool2d's backward ran its forward again for the indices.
** Elsewhere (other windows, dtypes, channels-last, devices) it is the two ops. */

static const kiln__op op_relu_max_pool2d, op_relu_max_pool2d_bwd;

static kiln_status relu_max_pool_infer(kiln__op_ctx *c) {
  int64_t sh[4];
  if (pool_infer(c, "kiln_relu_max_pool2d", sh) != KILN_OK) return kiln_last_error();
  kiln__op_meta(c, 1, 4, sh, KILN_U8);
  c->n_node_out = 1; /* the offsets never need a gradient */
  return KILN_OK;
}

static kiln_status relu_max_pool_forward(kiln__op_ctx *c) {
  kiln__conv_params p = pool_params(c->attrs);
  return run_window(c, KILN__K_RELU_MAX_POOL2D, 1, 2, &p, 0);
}

static void relu_max_pool_save(kiln__op_ctx *c, kiln__node *n) {
  kiln__node_save_output(n, 0);
  kiln__node_save(n, 1, c->out[1]);
}

static kiln_status relu_max_pool_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  attrs_window ab = pool_bwd_attrs(n->attrs, n->in_shape[0]);
  kiln_tensor *in[3] = {g, n->saved[0], n->saved[1]};
  return kiln__give_grad(&gi[0], kiln__op_call(&op_relu_max_pool2d_bwd, 3, in, &ab, NULL), g);
}

static kiln_status relu_max_pool_bwd_infer(kiln__op_ctx *c) {
  const attrs_window *ab = c->attrs;
  kiln_tensor *g = c->in[0];
  int64_t sh[4] = {g->shape[0], g->shape[1], ab->size[0], ab->size[1]};
  kiln__op_meta(c, 0, 4, sh, g->dtype);
  return KILN_OK;
}

static kiln_status relu_max_pool_bwd_forward(kiln__op_ctx *c) {
  kiln__conv_params p = pool_params(&((const attrs_window *)c->attrs)->p);
  return run_window(c, KILN__K_RELU_MAX_POOL2D_BACKWARD, 3, 1, &p, 0);
}

/* No rule of its own: kiln's engine runs backward rules with grad off (kiln_autograd_grad
** has no create_graph), so nothing could record this op for a second derivative. */
static const kiln__op op_relu_max_pool2d_bwd = {
    .name = "relu_max_pool2d_backward", .api = "kiln_relu_max_pool2d_backward", .n_in = 3, .n_out = 1,
    .n_kernels = 1, .kernels = {KILN__K_RELU_MAX_POOL2D_BACKWARD}, .attrs = f_window, .n_attrs = 5,
    .attr_size = sizeof(attrs_window), .infer = relu_max_pool_bwd_infer, .forward = relu_max_pool_bwd_forward};

static const kiln__op op_relu_max_pool2d = {
    .name = "relu_max_pool2d", .api = "kiln_relu_max_pool2d", .n_in = 1, .n_out = 2, .flags = KILN__OP_FLOAT_ONLY,
    .n_kernels = 1, .kernels = {KILN__K_RELU_MAX_POOL2D}, .attrs = f_pool, .n_attrs = 4,
    .attr_size = sizeof(attrs_pool), .infer = relu_max_pool_infer, .forward = relu_max_pool_forward,
    .backward = relu_max_pool_backward, .n_saved = 2, .save = relu_max_pool_save,
    .expands_to = (const char *const[]){"relu", "max_pool2d", NULL}};

/* Whether the fused kernel takes x with these windows (the op's outputs contiguous). */
static bool relu_max_pool_fused(kiln_tensor *x, const attrs_pool *a) {
  static int off = -1; /* KILN_RELU_MAX_POOL=0: always the two ops (A/B comparisons) */
  if (off < 0) off = !kiln__knob_on("KILN_RELU_MAX_POOL", true);
  if (off || !x || x->ndim != 4 || kiln__is_channels_last(x)) return false;
  /* f32 only: the CPU kernel's bf16 (and f64) loops are portable scalar ones, and bf16 under
  ** autocast ran slower fused than through the pair's vector kernels (fashion-mnist cnn, 40
  ** steps: 0.96 -> 1.21 s) */
  if (x->dtype != KILN_F32) return false;
  for (int d = 0; d < 2; d++)
    if (a->stride[d] != a->kernel[d] || a->padding[d] != 0 || a->dilation[d] != 1 || a->kernel[d] > x->shape[2 + d])
      return false;
  if (a->kernel[0] * a->kernel[1] > 256) return false;
  kiln__kargs q = {0};
  kiln__conv_params p = pool_params(a);
  q.op = KILN__K_RELU_MAX_POOL2D;
  q.n_in = 1, q.n_out = 2;
  q.in[0] = kiln__view_of(x);
  const int64_t osh[4] = {x->shape[0], x->shape[1], x->shape[2] / a->kernel[0], x->shape[3] / a->kernel[1]};
  q.out[0] = view_shaped(q.in[0], osh);
  q.out[1] = q.out[0];
  q.out[1].dtype = KILN_U8;
  q.params = &p;
  return kiln__dispatch_has(kiln_device_of(x), &q, KILN__K_RELU_MAX_POOL2D);
}

kiln_tensor *kiln_relu_max_pool2d(kiln_tensor *x, const int64_t *kernel, const int64_t *stride,
                                  const int64_t *padding, const int64_t *dilation) {
  attrs_pool a = pool_attrs(kernel, stride, padding, dilation);
  int64_t o[2];
  if (x && pool_geometry("kiln_relu_max_pool2d", x, &a, o) != KILN_OK) return NULL; /* errors name this op */
  if (!relu_max_pool_fused(x, &a)) return kiln_max_pool2d(kiln_relu(x), kernel, stride, padding, dilation, NULL);
  kiln_tensor *out[2] = {NULL, NULL};
  kiln_tensor *y = kiln__op_call(&op_relu_max_pool2d, 1, &x, &a, out);
  if (y) kiln__discard(out[1]); /* saved by the node when one is made; not the caller's */
  return y;
}

/* ---- conv2d_relu_max_pool2d: conv2d, ReLU, max_pool2d, one op -------------------------- */
/* relu_max_pool2d(conv2d(x, w, b)) as one kernel each way where the device has
** CONV1_RELU_MAX_POOL2D for it: one input channel (an image CNN's first layer), stride and
** dilation 1, f32, tiling pool windows, an input that needs no gradient (the kernel makes
** the weight's and the bias's). The conv's full-size output and its gradient are never
** made. Saved: x (the caller's anyway), the pooled output and its offsets. Elsewhere, the
** ops it stands for. */

typedef struct attrs_cpool {
  attrs_conv c;
  attrs_pool p;
  int64_t ksize[2]; /* the weight's (kh, kw): the backward op's output */
  int nks;
} attrs_cpool;
static const kiln__attr_field f_cpool[] = {
    {"stride", KILN__A_INTS, offsetof(attrs_cpool, c.stride), offsetof(attrs_cpool, c.ns), NULL},
    {"padding", KILN__A_INTS, offsetof(attrs_cpool, c.padding), offsetof(attrs_cpool, c.np), NULL},
    {"dilation", KILN__A_INTS, offsetof(attrs_cpool, c.dilation), offsetof(attrs_cpool, c.nd), NULL},
    {"groups", KILN__A_INT, offsetof(attrs_cpool, c.groups), 0, NULL},
    {"pool_kernel", KILN__A_INTS, offsetof(attrs_cpool, p.kernel), offsetof(attrs_cpool, p.nk), NULL},
    {"pool_stride", KILN__A_INTS, offsetof(attrs_cpool, p.stride), offsetof(attrs_cpool, p.ns), NULL},
    {"pool_padding", KILN__A_INTS, offsetof(attrs_cpool, p.padding), offsetof(attrs_cpool, p.np), NULL},
    {"pool_dilation", KILN__A_INTS, offsetof(attrs_cpool, p.dilation), offsetof(attrs_cpool, p.nd), NULL},
    KILN__FIELD_INTS(attrs_cpool, ksize, nks)};

static const kiln__op op_conv_relu_pool, op_conv_relu_pool_bwd;

/* the two windows as the kernels take them: the conv's, then the pool's */
static void cpool_params(const attrs_cpool *a, kiln__conv_params cp[2]) {
  cp[0] = conv_window(a->ksize, a->c.stride, a->c.padding, a->c.dilation);
  cp[1] = pool_params(&a->p);
}

/* (N, OC, POH, POW): the conv's output size pooled by tiling windows */
static void cpool_out(const attrs_cpool *a, const kiln_tensor *x, const kiln_tensor *w, int64_t sh[4]) {
  sh[0] = x->shape[0], sh[1] = w->shape[0];
  for (int d = 0; d < 2; d++) sh[2 + d] = (x->shape[2 + d] + 2 * a->c.padding[d] - a->ksize[d] + 1) / a->p.kernel[d];
}

static kiln_status conv_relu_pool_infer(kiln__op_ctx *c) {
  int64_t sh[4];
  cpool_out(c->attrs, c->in[0], c->in[1], sh);
  kiln__op_meta(c, 0, 4, sh, c->in[0]->dtype);
  kiln__op_meta(c, 1, 4, sh, KILN_U8);
  c->n_node_out = 1; /* the offsets never need a gradient */
  return KILN_OK;
}

static kiln_status conv_relu_pool_forward(kiln__op_ctx *c) {
  kiln__conv_params cp[2];
  cpool_params(c->attrs, cp);
  return run_window(c, KILN__K_CONV1_RELU_MAX_POOL2D, c->in[2] ? 3 : 2, 2, cp, 1);
}

static void conv_relu_pool_save(kiln__op_ctx *c, kiln__node *n) {
  kiln__node_save(n, 0, c->in[0]);
  kiln__node_save_output(n, 1);
  kiln__node_save(n, 2, c->out[1]);
}

static kiln_status conv_relu_pool_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  if (n->needs[0]) /* the op is used only for inputs that need none (kiln_conv2d_relu_max_pool2d) */
    return kiln_set_error(KILN_ERR_INTERNAL, "kiln_conv2d_relu_max_pool2d: no input gradient");
  if (!n->needs[1] && !n->needs[2]) return KILN_OK;
  kiln_tensor *in[4] = {n->saved[0], kiln_contiguous(g), n->saved[1], n->saved[2]}, *out[2] = {NULL, NULL};
  attrs_cpool a = *(const attrs_cpool *)n->attrs;
  a.c.output_padding[0] = n->needs[2]; /* the backward op's flag: make db too */
  if (!in[1] || !kiln__op_call(&op_conv_relu_pool_bwd, 4, in, &a, out)) return kiln_last_error();
  kiln_status st = n->needs[1] ? kiln__give_grad(&gi[1], out[0], g) : KILN_OK;
  if (st == KILN_OK && n->needs[2]) st = kiln__give_grad(&gi[2], out[1], g);
  return st;
}

static kiln_status conv_relu_pool_bwd_infer(kiln__op_ctx *c) {
  const attrs_cpool *a = c->attrs;
  int64_t sh[4] = {c->in[1]->shape[1], 1, a->ksize[0], a->ksize[1]}, bs[1] = {c->in[1]->shape[1]};
  kiln__op_meta(c, 0, 4, sh, c->in[1]->dtype);
  if (a->c.output_padding[0]) kiln__op_meta(c, 1, 1, bs, c->in[1]->dtype);
  c->n_out = a->c.output_padding[0] ? 2 : 1;
  return KILN_OK;
}

static kiln_status conv_relu_pool_bwd_forward(kiln__op_ctx *c) {
  kiln__conv_params cp[2];
  cpool_params(c->attrs, cp);
  return run_window(c, KILN__K_CONV1_RELU_MAX_POOL2D_BACKWARD, 4, c->n_out, cp, 1);
}

/* No rule: kiln's engine runs backward rules with grad off. output_padding[0] (unused by
** the forward) carries "make the bias gradient too". */
static const kiln__op op_conv_relu_pool_bwd = {
    .name = "conv2d_relu_max_pool2d_backward", .api = "kiln_conv2d_relu_max_pool2d_backward", .n_in = 4,
    .n_out = 2, .n_kernels = 1, .kernels = {KILN__K_CONV1_RELU_MAX_POOL2D_BACKWARD}, .attrs = f_cpool, .n_attrs = 9,
    .attr_size = sizeof(attrs_cpool), .infer = conv_relu_pool_bwd_infer, .forward = conv_relu_pool_bwd_forward};

static const kiln__op op_conv_relu_pool = {
    .name = "conv2d_relu_max_pool2d", .api = "kiln_conv2d_relu_max_pool2d", .n_in = 3, .n_out = 2,
    .optional = 1u << 2, .flags = KILN__OP_FLOAT_ONLY, .n_kernels = 1, .kernels = {KILN__K_CONV1_RELU_MAX_POOL2D},
    .attrs = f_cpool, .n_attrs = 9, .attr_size = sizeof(attrs_cpool), .infer = conv_relu_pool_infer,
    .forward = conv_relu_pool_forward, .backward = conv_relu_pool_backward, .n_saved = 3,
    .save = conv_relu_pool_save, .expands_to = (const char *const[]){"conv2d", "relu", "max_pool2d", NULL}};

/* Whether the fused kernel takes these arguments (as cpu_conv_c1.c's kernel checks them). */
static bool conv_relu_pool_fused(kiln_tensor *x, kiln_tensor *w, kiln_tensor *b, const attrs_cpool *a) {
  static int off = -1; /* KILN_CONV_RELU_POOL=0: always the ops it stands for (A/B comparisons) */
  if (off < 0) off = !kiln__knob_on("KILN_CONV_RELU_POOL", true);
  if (off || !x || !w || x->ndim != 4 || w->ndim != 4 || x->dtype != KILN_F32 || w->dtype != KILN_F32 ||
      !kiln_is_contiguous(x) || !kiln_is_contiguous(w) || x->shape[1] != 1 || w->shape[1] != 1 || a->c.groups != 1 ||
      kiln_requires_grad(x) || kiln_autocast_is_enabled(kiln_device_of(x).type) ||
      w->shape[2] * w->shape[3] > 49 || a->p.kernel[0] * a->p.kernel[1] > 256)
    return false;
  if (b && (b->dtype != KILN_F32 || b->ndim != 1 || b->shape[0] != w->shape[0] || !kiln_is_contiguous(b)))
    return false;
  for (int d = 0; d < 2; d++) {
    int64_t o = x->shape[2 + d] + 2 * a->c.padding[d] - w->shape[2 + d] + 1;
    if (a->c.stride[d] != 1 || a->c.dilation[d] != 1 || a->c.padding[d] < 0 || o < a->p.kernel[d] ||
        a->p.stride[d] != a->p.kernel[d] || a->p.padding[d] != 0 || a->p.dilation[d] != 1)
      return false;
  }
  if ((x->shape[2] + 2 * a->c.padding[0]) * (x->shape[3] + 2 * a->c.padding[1]) + w->shape[3] > 4096) return false;
  return kiln__dispatch_has(kiln_device_of(x), NULL, KILN__K_CONV1_RELU_MAX_POOL2D) &&
         kiln_device_of(w).type == kiln_device_of(x).type && kiln_device_of(w).index == kiln_device_of(x).index &&
         (!b || (kiln_device_of(b).type == kiln_device_of(x).type && kiln_device_of(b).index == kiln_device_of(x).index));
}

kiln_tensor *kiln_conv2d_relu_max_pool2d(kiln_tensor *x, kiln_tensor *weight, kiln_tensor *bias, const int64_t *stride,
                                         const int64_t *padding, const int64_t *dilation, int64_t groups,
                                         const int64_t *pool_kernel, const int64_t *pool_stride,
                                         const int64_t *pool_padding, const int64_t *pool_dilation) {
  attrs_cpool a;
  memset(&a, 0, sizeof a);
  a.c = conv_attrs(stride, padding, dilation, NULL, groups);
  a.c.output_padding[0] = a.c.output_padding[1] = 0;
  a.p = pool_attrs(pool_kernel, pool_stride, pool_padding, pool_dilation);
  if (weight && weight->ndim == 4) a.ksize[0] = weight->shape[2], a.ksize[1] = weight->shape[3];
  a.nks = 2;
  if (!conv_relu_pool_fused(x, weight, bias, &a))
    return kiln_relu_max_pool2d(kiln_conv2d(x, weight, bias, stride, padding, dilation, groups), pool_kernel,
                                pool_stride, pool_padding, pool_dilation);
  kiln_tensor *in[3] = {x, weight, bias}, *out[2] = {NULL, NULL};
  kiln_tensor *y = kiln__op_call(&op_conv_relu_pool, 3, in, &a, out);
  if (y) kiln__discard(out[1]); /* saved by the node when one is made; not the caller's */
  return y;
}

/* avg_pool2d: the mean of each window, padding counted (PyTorch's count_include_pad). */
static kiln_status avg_pool_infer(kiln__op_ctx *c) {
  int64_t sh[4];
  return pool_infer(c, "kiln_avg_pool2d", sh);
}

static kiln_status avg_pool_forward(kiln__op_ctx *c) {
  const attrs_pool *p = c->attrs;
  kiln_tensor *x = c->in[0];
  int64_t o[2];
  if (pool_geometry("kiln_avg_pool2d", x, p, o) != KILN_OK) return kiln_last_error();
  int64_t N = x->shape[0], C = x->shape[1];
  kiln_scope_begin();
  attrs_window w = window(p->kernel, p->stride, p->padding, p->dilation, o);
  kiln_tensor *cols = kiln_reshape(im2col_call(x, &w), KILN_SHAPE(N, C, p->kernel[0] * p->kernel[1], o[0], o[1]));
  int dim = 2;
  kiln_tensor *y = kiln_mean(cols, 1, &dim, false);
  c->out[0] = kiln__scope_return(y);
  return c->out[0] ? KILN_OK : kiln_last_error();
}

static const kiln__op op_avg_pool2d = {
    .name = "avg_pool2d", .api = "kiln_avg_pool2d", .n_in = 1, .n_out = 1, .flags = KILN__OP_COMPOSITE,
    .n_kernels = 2, .kernels = {KILN__K_IM2COL, KILN__K_SUM}, .attrs = f_pool, .n_attrs = 3,
    .attr_size = sizeof(attrs_pool), .infer = avg_pool_infer, .forward = avg_pool_forward};

kiln_tensor *kiln_avg_pool2d(kiln_tensor *x, const int64_t *kernel, const int64_t *stride, const int64_t *padding) {
  attrs_pool a = pool_attrs(kernel, stride, padding, NULL);
  return kiln__op_call(&op_avg_pool2d, 1, &x, &a, NULL);
}
