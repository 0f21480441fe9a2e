/*
** Memory formats (PyTorch's torch.channels_last): kiln_contiguous_format and
** kiln_is_contiguous_format.
**
** A channels-last tensor keeps its logical NCHW shape; only its strides change, to
** (H*W*C, 1, W*C, C): the channels of one pixel are adjacent in memory, the layout
** tensor-core convolutions read best (cuDNN takes it as it is). contiguous_format is a
** composite (permute to NHWC, contiguous, permute back), so its backward is those ops'.
** Which ops keep the format (PyTorch's rule: an output follows the layout of its input):
** conv2d (on CUDA cuDNN reads and writes NHWC as it is; elsewhere the result is made
** channels-last), the elementwise ops (unary, binary: the first channels-last input of
** the output's shape wins, casts and clone; their backward kernels), max_pool2d and its
** backward, batch_norm (ops_norm.c). An op of the path lists calls
** kiln__op_meta_keep_format in its infer, and the call path (call.c) then allocates NHWC
** memory. Every other op takes a channels-last tensor as any strided one and returns a
** contiguous result; kiln_contiguous always gives NCHW memory.
*/
#include "ops/op.h"

bool kiln__is_channels_last(const kiln_tensor *t) {
  return t && t->ndim == 4 && kiln_is_contiguous_format(t, KILN_CHANNELS_LAST) && !kiln_is_contiguous(t);
}

void kiln__op_meta_keep_format(kiln__op_ctx *c, int k, const kiln_tensor *like) {
  if (c->meta[k].channels_last || c->meta[k].ndim != 4 || !kiln__is_channels_last(like)) return;
  for (int d = 0; d < 4; d++)
    if (c->meta[k].shape[d] != like->shape[d]) return;
  c->meta[k].channels_last = true;
}

kiln_tensor *kiln__tensor_new_format(int ndim, const int64_t *shape, kiln_dtype dt, kiln_device dev, bool cl) {
  if (!cl || ndim != 4) return kiln__tensor_new(ndim, shape, dt, dev);
  if (kiln__check_shape("kiln_empty", ndim, shape, dt) != KILN_OK) return NULL;
  /* memory order (N, H, W, C); a 0 extent counts as 1 in the strides (as contiguous ones) */
  int64_t e[4], st[4];
  for (int d = 0; d < 4; d++) e[d] = shape[d] > 0 ? shape[d] : 1;
  st[1] = 1, st[3] = e[1], st[2] = e[3] * e[1], st[0] = e[2] * e[3] * e[1];
  kiln__storage *s = kiln__storage_new(dev, (size_t)kiln__shape_numel(ndim, shape) * kiln_dtype_size(dt));
  if (!s) return NULL;
  kiln_tensor *t = kiln__tensor_make(s, 0, ndim, shape, st, dt);
  kiln__storage_release(s); /* the handle holds its own reference */
  return t;
}

kiln_tensor *kiln__tensor_new_like_format(const kiln_tensor *t, kiln_dtype dt) {
  return kiln__tensor_new_format(t->ndim, t->shape, dt, kiln_device_of(t), kiln__is_channels_last(t));
}

bool kiln_is_contiguous_format(const kiln_tensor *t, kiln_memory_format format) {
  if (!t) return false;
  if (format == KILN_CONTIGUOUS_FORMAT) return kiln_is_contiguous(t);
  if (format != KILN_CHANNELS_LAST || t->ndim != 4) return false;
  static const int order[4] = {1, 3, 2, 0}; /* fastest first */
  int64_t want = 1;
  for (int k = 0; k < 4; k++) {
    int d = order[k];
    if (t->shape[d] != 1 && t->strides[d] != want) return false; /* size-1 dims: any stride */
    want *= t->shape[d];
  }
  return true;
}

typedef struct attrs_format {
  int format; /* kiln_memory_format (KILN__A_ENUM reads an int) */
} attrs_format;
static const char *const format_names[] = {"contiguous", "channels_last"};
static const kiln__attr_field f_format[] = {KILN__FIELD_ENUM(attrs_format, format, format_names)};

static kiln_status format_infer(kiln__op_ctx *c) {
  kiln_tensor *t = c->in[0];
  if (t->ndim != 4)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_contiguous_format: channels_last needs a 4-d (N, C, H, W) tensor, got %s",
                          kiln__tshape(t));
  kiln__op_meta(c, 0, t->ndim, t->shape, t->dtype);
  return KILN_OK;
}

static kiln_status format_forward(kiln__op_ctx *c) {
  static const int to_nhwc[4] = {0, 2, 3, 1}, to_nchw[4] = {0, 3, 1, 2};
  kiln_scope_begin();
  kiln_tensor *y = kiln_permute(kiln_contiguous(kiln_permute(c->in[0], 4, to_nhwc)), 4, to_nchw);
  c->out[0] = kiln__scope_return(y);
  return c->out[0] ? KILN_OK : kiln_last_error();
}

static const kiln__op op_contiguous_format = {
    .name = "contiguous_format", .api = "kiln_contiguous_format", .n_in = 1, .n_out = 1,
    .flags = KILN__OP_COMPOSITE, .n_kernels = 1, .kernels = {KILN__K_COPY}, .attrs = f_format, .n_attrs = 1,
    .attr_size = sizeof(attrs_format), .infer = format_infer, .forward = format_forward};

kiln_tensor *kiln_contiguous_format(kiln_tensor *t, kiln_memory_format format) {
  if (!t) return NULL;
  if (format != KILN_CONTIGUOUS_FORMAT && format != KILN_CHANNELS_LAST) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_contiguous_format: unknown memory format %d", (int)format);
    return NULL;
  }
  if (format == KILN_CONTIGUOUS_FORMAT) return kiln_contiguous(t);
  /* already in the format: the same tensor, as kiln_contiguous does */
  if (kiln_is_contiguous_format(t, format)) return kiln__scope_track(kiln_tensor_ref(t));
  attrs_format a = {format};
  return kiln__op_call(&op_contiguous_format, 1, &t, &a, NULL);
}
