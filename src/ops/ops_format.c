/*
** Memory formats (PyTorch's torch.channels_last): kiln_contiguous_format and
** kiln_is_contiguous_format.
**
** A channels-last tensor keeps its logical NCHW shape; only its strides change, to
** (H*W*C, 1, W*C, C): the channels of one pixel are adjacent in memory, the layout
** tensor-core convolutions read best (cuDNN takes it as it is). contiguous_format is a
** composite (permute to NHWC, contiguous, permute back), so its backward is those ops'.
** Which ops keep the format: conv2d on a device with a library convolution (CUDA with
** cuDNN) takes a channels-last input without a copy and returns a channels-last output;
** every other op takes it as any strided tensor and returns a contiguous result.
*/
#include "ops/op.h"

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
