/*
** Resizing ops of convolutional networks, each a composite on the one call path (op.h):
** adaptive_avg_pool2d, upsample (nearest, bilinear) and pad (constant, reflect).
**
** Both adaptive average pooling and bilinear interpolation are linear maps along each
** spatial dim separately, so each is two products with fixed matrices, y = A_h x A_w^T
** (A_h (OH, H), A_w (OW, W), built on the host in f64 and cast to x's dtype): any
** window sizes, every backend that has MATMUL, and the backward from matmul's rule.
** Nearest upsampling and reflect padding are index_select along each dim (backward:
** INDEX_ADD), constant padding a cat with filled blocks.
*/
#include "ops/op.h"

#include <math.h>
#include <stdlib.h>

static kiln_status check_input4(const char *api, const kiln_tensor *x) {
  if (!kiln_dtype_is_float(x->dtype))
    return kiln_set_error(KILN_ERR_DTYPE, "%s: expected a floating input, got %s (shape %s)", api,
                          kiln_dtype_name(x->dtype), kiln__tshape(x));
  if (x->ndim != 4)
    return kiln_set_error(KILN_ERR_SHAPE, "%s: expected a 4-d input (N, C, H, W), got shape %s", api, kiln__tshape(x));
  return KILN_OK;
}

/* A (rows, cols) matrix of host f64 values as a tensor of dt on dev. */
static kiln_tensor *host_matrix(const double *v, int64_t rows, int64_t cols, kiln_dtype dt, kiln_device dev) {
  kiln_tensor *m = kiln_from_data(v, 2, (const int64_t[]){rows, cols}, KILN_F64, dev);
  return m && dt != KILN_F64 ? kiln_to_dtype(m, dt) : m;
}

/* A 1-d i64 index tensor on dev. */
static kiln_tensor *host_index(const int64_t *v, int64_t n, kiln_device dev) {
  return kiln_from_data(v, 1, (const int64_t[]){n}, KILN_I64, dev);
}

/* y = A_h x A_w^T for the two matrices made by fill(rows, cols, out). */
typedef void (*matrix_fill)(int64_t out_n, int64_t in_n, double *m);
static kiln_tensor *separable(kiln_tensor *x, int64_t oh, int64_t ow, matrix_fill fill) {
  int64_t H = x->shape[2], W = x->shape[3];
  double *ah = calloc((size_t)(oh * H + 1), sizeof(double)), *aw = calloc((size_t)(ow * W + 1), sizeof(double));
  kiln_tensor *y = NULL;
  if (!ah || !aw) {
    kiln_set_error(KILN_ERR_OOM, "kiln: out of host memory for a (%lld, %lld) resize matrix", (long long)oh, (long long)H);
  } else {
    fill(oh, H, ah);
    fill(ow, W, aw);
    kiln_device dev = kiln_device_of(x);
    kiln_tensor *mh = host_matrix(ah, oh, H, x->dtype, dev), *mw = host_matrix(aw, ow, W, x->dtype, dev);
    if (mh && mw) y = kiln_matmul(kiln_matmul(mh, x), kiln_transpose(mw, 0, 1));
  }
  free(ah);
  free(aw);
  return y;
}

/* ---- adaptive_avg_pool2d ---------------------------------------------------------------- */

typedef struct attrs_size {
  int64_t size[2];
  int n;
  int mode; /* upsample only */
} attrs_size;
static const char *const upsample_modes[] = {"nearest", "bilinear"};
static const kiln__attr_field f_size[] = {KILN__FIELD_INTS(attrs_size, size, n),
                                          KILN__FIELD_ENUM(attrs_size, mode, upsample_modes)};

/* Row i averages [floor(i*in/out), ceil((i+1)*in/out)) (PyTorch's windows). */
static void adaptive_fill(int64_t out_n, int64_t in_n, double *m) {
  for (int64_t i = 0; i < out_n; i++) {
    int64_t a = i * in_n / out_n, b = ((i + 1) * in_n + out_n - 1) / out_n;
    for (int64_t h = a; h < b; h++) m[i * in_n + h] = 1.0 / (double)(b - a);
  }
}

static kiln_status size_infer(kiln__op_ctx *c) {
  const attrs_size *p = c->attrs;
  kiln_tensor *x = c->in[0];
  if (check_input4(c->op->api, x) != KILN_OK) return kiln_last_error();
  if (p->size[0] < 1 || p->size[1] < 1)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: output size must be >= 1, got [%lld, %lld] (input %s)",
                          c->op->api, (long long)p->size[0], (long long)p->size[1], kiln__tshape(x));
  if (x->shape[2] == 0 || x->shape[3] == 0)
    return kiln_set_error(KILN_ERR_SHAPE, "%s: the input %s has an empty spatial dim", c->op->api, kiln__tshape(x));
  int64_t sh[4] = {x->shape[0], x->shape[1], p->size[0], p->size[1]};
  kiln__op_meta(c, 0, 4, sh, x->dtype);
  return KILN_OK;
}

static kiln_status adaptive_forward(kiln__op_ctx *c) {
  const attrs_size *p = c->attrs;
  kiln_tensor *x = c->in[0];
  kiln_scope_begin();
  kiln_tensor *y;
  if (p->size[0] == 1 && p->size[1] == 1 && x->shape[2] == 1 && x->shape[3] == 1) {
    /* a 1x1 map already (ResNet-18 at 32x32): the average of one value is that value, so
    ** a copy; the reduction below spent 0.43 ms on (64, 512, 1, 1), a fold per output */
    y = kiln_clone(x);
  } else if (p->size[0] == 1 && p->size[1] == 1) {
    /* the global average (ResNet's head): one reduction over (H, W), and its backward one
    ** broadcast, instead of two batched products of 1-row matrices and their backward
    ** (0.5 ms forward and 1 ms backward for ResNet-50's (256, 2048, 7, 7) bf16 on the H200) */
    const int dims[2] = {2, 3};
    y = kiln_mean(x, 2, dims, true);
    if (y && y->dtype != x->dtype) y = kiln_to_dtype(y, x->dtype);
  } else {
    y = separable(x, p->size[0], p->size[1], adaptive_fill);
  }
  c->out[0] = kiln__scope_return(y);
  return c->out[0] ? KILN_OK : kiln_last_error();
}

static const kiln__op op_adaptive_avg_pool2d = {
    .name = "adaptive_avg_pool2d", .api = "kiln_adaptive_avg_pool2d", .n_in = 1, .n_out = 1,
    .flags = KILN__OP_COMPOSITE, .n_kernels = 2, .kernels = {KILN__K_MATMUL, KILN__K_SUM}, .attrs = f_size,
    .n_attrs = 1, .attr_size = sizeof(attrs_size), .infer = size_infer, .forward = adaptive_forward};

kiln_tensor *kiln_adaptive_avg_pool2d(kiln_tensor *x, const int64_t *output_size) {
  attrs_size a = {{output_size ? output_size[0] : 1, output_size ? output_size[1] : 1}, 2, 0};
  return kiln__op_call(&op_adaptive_avg_pool2d, 1, &x, &a, NULL);
}

/* ---- upsample ------------------------------------------------------------------------------ */

/* align_corners=False (PyTorch's default): source = (o + 0.5) * in/out - 0.5, clamped at 0. */
static void bilinear_fill(int64_t out_n, int64_t in_n, double *m) {
  double scale = (double)in_n / (double)out_n;
  for (int64_t o = 0; o < out_n; o++) {
    double src = ((double)o + 0.5) * scale - 0.5;
    if (src < 0) src = 0;
    int64_t i0 = (int64_t)floor(src);
    if (i0 > in_n - 1) i0 = in_n - 1;
    int64_t i1 = i0 + 1 < in_n ? i0 + 1 : in_n - 1;
    double l = src - (double)i0;
    m[o * in_n + i0] += 1.0 - l;
    m[o * in_n + i1] += l;
  }
}

static kiln_status upsample_forward(kiln__op_ctx *c) {
  const attrs_size *p = c->attrs;
  kiln_tensor *x = c->in[0];
  kiln_scope_begin();
  kiln_tensor *y = NULL;
  if (p->mode == KILN_UPSAMPLE_BILINEAR) {
    y = separable(x, p->size[0], p->size[1], bilinear_fill);
  } else {
    /* nearest: source floor(o * in / out), PyTorch's "nearest" */
    y = x;
    for (int d = 0; d < 2 && y; d++) {
      int64_t in_n = x->shape[2 + d], out_n = p->size[d];
      int64_t *ix = malloc((size_t)out_n * sizeof(int64_t));
      if (!ix) {
        kiln_set_error(KILN_ERR_OOM, "kiln_upsample: out of host memory");
        y = NULL;
        break;
      }
      for (int64_t o = 0; o < out_n; o++) ix[o] = o * in_n / out_n;
      y = kiln_index_select(y, 2 + d, host_index(ix, out_n, kiln_device_of(x)));
      free(ix);
    }
  }
  c->out[0] = kiln__scope_return(y);
  return c->out[0] ? KILN_OK : kiln_last_error();
}

static const kiln__op op_upsample = {
    .name = "upsample", .api = "kiln_upsample", .n_in = 1, .n_out = 1, .flags = KILN__OP_COMPOSITE,
    .n_kernels = 2, .kernels = {KILN__K_INDEX_SELECT, KILN__K_MATMUL}, .attrs = f_size, .n_attrs = 2,
    .attr_size = sizeof(attrs_size), .infer = size_infer, .forward = upsample_forward};

kiln_tensor *kiln_upsample(kiln_tensor *x, const int64_t *size, kiln_upsample_mode mode) {
  attrs_size a = {{size ? size[0] : 0, size ? size[1] : 0}, 2, (int)mode};
  if (mode != KILN_UPSAMPLE_NEAREST && mode != KILN_UPSAMPLE_BILINEAR) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_upsample: unknown mode %d", (int)mode);
    return NULL;
  }
  return kiln__op_call(&op_upsample, 1, &x, &a, NULL);
}

/* ---- pad ------------------------------------------------------------------------------------ */

#define PAD_MAX (2 * KILN_MAX_DIMS)
typedef struct attrs_pad {
  int64_t pads[PAD_MAX]; /* PyTorch's order: (last dim before, after, the dim before it ...) */
  int n;
  int mode;
  double value;
} attrs_pad;
static const char *const pad_modes[] = {"constant", "reflect"};
static const kiln__attr_field f_pad[] = {KILN__FIELD_INTS(attrs_pad, pads, n), KILN__FIELD_ENUM(attrs_pad, mode, pad_modes),
                                         KILN__FIELD(attrs_pad, value, KILN__A_FLOAT)};

static kiln_status pad_infer(kiln__op_ctx *c) {
  const attrs_pad *p = c->attrs;
  kiln_tensor *x = c->in[0];
  if (p->n % 2 != 0 || p->n / 2 > x->ndim)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_pad: %d pad values for input %s (expected an even count, at most %d)",
                          p->n, kiln__tshape(x), 2 * x->ndim);
  int64_t sh[KILN_MAX_DIMS];
  for (int d = 0; d < x->ndim; d++) sh[d] = x->shape[d];
  for (int k = 0; k < p->n / 2; k++) {
    int d = x->ndim - 1 - k;
    int64_t b = p->pads[2 * k], a = p->pads[2 * k + 1];
    if (b < 0 || a < 0)
      return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_pad: pads must be >= 0, got %lld and %lld at dim %d (input %s)",
                            (long long)b, (long long)a, d, kiln__tshape(x));
    if (p->mode == KILN_PAD_REFLECT && (b >= x->shape[d] || a >= x->shape[d]))
      return kiln_set_error(KILN_ERR_SHAPE,
                            "kiln_pad: reflect padding (%lld, %lld) must be smaller than the dim %d of input %s",
                            (long long)b, (long long)a, d, kiln__tshape(x));
    sh[d] += a + b;
  }
  kiln__op_meta(c, 0, x->ndim, sh, x->dtype);
  return KILN_OK;
}

static kiln_status pad_forward(kiln__op_ctx *c) {
  const attrs_pad *p = c->attrs;
  kiln_tensor *x = c->in[0];
  kiln_device dev = kiln_device_of(x);
  kiln_scope_begin();
  kiln_tensor *y = x;
  for (int k = 0; k < p->n / 2 && y; k++) {
    int d = x->ndim - 1 - k;
    int64_t b = p->pads[2 * k], a = p->pads[2 * k + 1], in_n = y->shape[d];
    if (a == 0 && b == 0) continue;
    if (p->mode == KILN_PAD_REFLECT) {
      int64_t n = in_n + a + b;
      int64_t *ix = malloc((size_t)n * sizeof(int64_t));
      if (!ix) {
        kiln_set_error(KILN_ERR_OOM, "kiln_pad: out of host memory");
        y = NULL;
        break;
      }
      for (int64_t o = 0; o < n; o++) {
        int64_t i = o - b;
        ix[o] = i < 0 ? -i : i >= in_n ? 2 * (in_n - 1) - i : i;
      }
      y = kiln_index_select(y, d, host_index(ix, n, dev));
      free(ix);
    } else {
      kiln_tensor *parts[3];
      int np = 0;
      int64_t sh[KILN_MAX_DIMS];
      for (int e = 0; e < y->ndim; e++) sh[e] = y->shape[e];
      if (b > 0) sh[d] = b, parts[np++] = kiln_full(y->ndim, sh, p->value, y->dtype, dev);
      parts[np++] = y;
      if (a > 0) sh[d] = a, parts[np++] = kiln_full(y->ndim, sh, p->value, y->dtype, dev);
      y = kiln_cat(np, parts, d);
    }
  }
  if (y == x) y = kiln_clone(x); /* nothing to pad: a copy, as PyTorch returns */
  c->out[0] = kiln__scope_return(y);
  return c->out[0] ? KILN_OK : kiln_last_error();
}

static const kiln__op op_pad = {
    .name = "pad", .api = "kiln_pad", .n_in = 1, .n_out = 1, .flags = KILN__OP_COMPOSITE, .n_kernels = 2,
    .kernels = {KILN__K_COPY, KILN__K_INDEX_SELECT}, .attrs = f_pad, .n_attrs = 3, .attr_size = sizeof(attrs_pad),
    .infer = pad_infer, .forward = pad_forward};

kiln_tensor *kiln_pad(kiln_tensor *x, int n, const int64_t *pads, kiln_pad_mode mode, double value) {
  attrs_pad a = {{0}, n, (int)mode, value};
  if (n < 0 || n > PAD_MAX || (n > 0 && !pads) || (mode != KILN_PAD_CONSTANT && mode != KILN_PAD_REFLECT)) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_pad: %d pad values (at most %d) or mode %d is not valid", n, PAD_MAX,
                   (int)mode);
    return NULL;
  }
  for (int k = 0; k < n; k++) a.pads[k] = pads[k];
  return kiln__op_call(&op_pad, 1, &x, &a, NULL);
}
