/*
** View and copy ops through the harness: gradients through permute, transpose, narrow,
** slice, select, expand, squeeze/unsqueeze, reshape (view and copy paths), flatten,
** contiguous and clone, and the same on every device (strided copies on the GPU).
** Names are prefixed vw_ (tests/test_cuda_ops.c includes this file).
*/
#include "harness.h"

#include <string.h>

enum { VW_PERMUTE, VW_TRANSPOSE, VW_NARROW, VW_SLICE, VW_SELECT, VW_EXPAND, VW_UNSQUEEZE,
       VW_SQUEEZE, VW_RESHAPE, VW_RESHAPE_T, VW_FLATTEN, VW_CONTIG_T, VW_CLONE };

typedef struct vw_ctx {
  int kind;
  int dim;
  int64_t start, len, step;
} vw_ctx;

static kiln_tensor *vw_b(kiln_tensor **in, const void *ctx) {
  const vw_ctx *c = ctx;
  kiln_tensor *t = in[0];
  switch (c->kind) {
  case VW_PERMUTE: return kiln_permute(t, KILN_DIMS(2, 0, 1));
  case VW_TRANSPOSE: return kiln_transpose(t, 0, 2);
  case VW_NARROW: return kiln_narrow(t, c->dim, c->start, c->len);
  case VW_SLICE: return kiln_slice(t, c->dim, c->start, c->start + c->len, c->step);
  case VW_SELECT: return kiln_select(t, c->dim, c->start);
  case VW_EXPAND: return kiln_expand(t, KILN_SHAPE(2, -1, 3, -1));
  case VW_UNSQUEEZE: return kiln_unsqueeze(t, c->dim);
  case VW_SQUEEZE: return kiln_squeeze(kiln_unsqueeze(t, 1), 1);
  case VW_RESHAPE: return kiln_reshape(t, KILN_SHAPE(-1, kiln_size(t, 2)));
  case VW_RESHAPE_T: return kiln_reshape(kiln_transpose(t, 1, 2), KILN_SHAPE(-1));
  case VW_FLATTEN: return kiln_flatten(t, 1, 2);
  case VW_CONTIG_T: return kiln_contiguous(kiln_transpose(t, 0, 1));
  case VW_CLONE: return kiln_clone(t);
  }
  return NULL;
}

/* out[idx] = in[src(idx)] for the index maps of each view */
static int vw_r(const h_arr *in, int n_in, h_arr *out, const void *ctx) {
  (void)n_in;
  const vw_ctx *c = ctx;
  const h_arr *a = &in[0];
  const int64_t *s = a->shape;
  int64_t perm[KILN_MAX_DIMS] = {0, 1, 2, 3}; /* out dim i reads in dim perm[i] */
  int64_t start[KILN_MAX_DIMS] = {0}, step[KILN_MAX_DIMS] = {1, 1, 1, 1};
  out->ndim = a->ndim;
  memcpy(out->shape, s, sizeof out->shape);
  bool flat = false; /* output is the input's C order, reshaped */
  switch (c->kind) {
  case VW_PERMUTE:
    perm[0] = 2, perm[1] = 0, perm[2] = 1;
    out->shape[0] = s[2], out->shape[1] = s[0], out->shape[2] = s[1];
    break;
  case VW_TRANSPOSE:
  case VW_CONTIG_T:
    if (c->kind == VW_TRANSPOSE) perm[0] = 2, perm[2] = 0;
    else perm[0] = 1, perm[1] = 0;
    for (int i = 0; i < 3; i++) out->shape[i] = s[perm[i]];
    break;
  case VW_NARROW:
  case VW_SLICE: {
    int64_t st = c->kind == VW_SLICE ? c->step : 1, len = c->len;
    if (c->kind == VW_NARROW && c->start + len > s[c->dim]) return 1;
    if (c->kind == VW_SLICE) { /* Python slicing clamps */
      int64_t b = c->start < s[c->dim] ? c->start : s[c->dim];
      int64_t e = c->start + len < s[c->dim] ? c->start + len : s[c->dim];
      len = e - b;
    }
    start[c->dim] = c->start, step[c->dim] = st;
    out->shape[c->dim] = (len + st - 1) / st;
    break;
  }
  case VW_SELECT:
    if (c->start >= s[c->dim]) return 1;
    break;
  case VW_EXPAND:
    out->ndim = 4;
    out->shape[0] = 2, out->shape[1] = s[0], out->shape[2] = 3, out->shape[3] = s[2];
    if (s[1] != 1 && s[1] != 3) return 1;
    break;
  case VW_UNSQUEEZE:
    out->ndim = a->ndim + 1;
    for (int i = 0, j = 0; i < out->ndim; i++) out->shape[i] = i == c->dim ? 1 : s[j++];
    flat = true;
    break;
  case VW_RESHAPE:
    if (s[2] == 0) return 1; /* -1 next to a 0 is ambiguous (PyTorch refuses) */
    out->ndim = 2, out->shape[0] = s[0] * s[1], out->shape[1] = s[2];
    flat = true;
    break;
  case VW_RESHAPE_T:
    out->ndim = 1, out->shape[0] = h_numel(a->ndim, s);
    break;
  case VW_FLATTEN:
    out->ndim = 2, out->shape[0] = s[0], out->shape[1] = s[1] * s[2];
    flat = true;
    break;
  default: flat = true; break;
  }
  if (c->kind == VW_SELECT) {
    out->ndim = a->ndim - 1;
    for (int i = 0, j = 0; i < a->ndim; i++)
      if (i != c->dim) out->shape[j++] = s[i];
  }
  if (!out->data) return 0;
  int64_t n = h_numel(out->ndim, out->shape);
  if (flat) {
    memcpy(out->data, a->data, sizeof(double) * (size_t)n);
    return 0;
  }
  int64_t idx[KILN_MAX_DIMS] = {0};
  for (int64_t k = 0; k < n; k++) {
    int64_t src[KILN_MAX_DIMS] = {0};
    if (c->kind == VW_EXPAND) {
      src[0] = idx[1], src[1] = s[1] == 1 ? 0 : idx[2], src[2] = idx[3];
    } else if (c->kind == VW_SELECT) {
      for (int i = 0, j = 0; i < a->ndim; i++) src[i] = i == c->dim ? c->start : idx[j++];
    } else if (c->kind == VW_RESHAPE_T) {
      /* C order of transpose(1, 2): (s0, s2, s1) */
      int64_t r = k, i2 = r % s[1], i1 = (r / s[1]) % s[2], i0 = r / (s[1] * s[2]);
      src[0] = i0, src[1] = i2, src[2] = i1;
    } else {
      for (int i = 0; i < out->ndim; i++) src[perm[i]] = start[perm[i]] + idx[i] * step[perm[i]];
    }
    int64_t off = 0;
    for (int i = 0; i < a->ndim; i++) off = off * s[i] + src[i];
    out->data[k] = a->data[off];
    h_next_index(out->ndim, out->shape, idx);
  }
  return 0;
}

#define VW_IN {{.ndim = 3, .shape = {H_SYM(0), H_SYM(1), H_SYM(2)}, .fill = H_RANDN, .diff = true}}
#define VW(nm, ...)                                                                       \
  {.name = nm, .fn = vw_b, .ref = vw_r, .ctx = &(const vw_ctx){__VA_ARGS__}, .n_in = 1,    \
   .in = VW_IN, .sym = {2, 3, 4}}

static const h_case vw_cases[] = {
    VW("permute (2,0,1)", .kind = VW_PERMUTE),
    VW("transpose (0,2)", .kind = VW_TRANSPOSE),
    VW("narrow dim2 [1,3)", .kind = VW_NARROW, .dim = 2, .start = 1, .len = 2),
    VW("narrow dim0 [0,1)", .kind = VW_NARROW, .dim = 0, .start = 0, .len = 1),
    VW("slice dim2 0:4:2", .kind = VW_SLICE, .dim = 2, .start = 0, .len = 4, .step = 2),
    VW("slice dim1 1:3:1", .kind = VW_SLICE, .dim = 1, .start = 1, .len = 2, .step = 1),
    VW("select dim1 index 2", .kind = VW_SELECT, .dim = 1, .start = 2),
    VW("select dim0 index 0", .kind = VW_SELECT, .dim = 0, .start = 0),
    {.name = "expand (S0,1,S2) -> (2,S0,3,S2)", .fn = vw_b, .ref = vw_r,
     .ctx = &(const vw_ctx){.kind = VW_EXPAND}, .n_in = 1,
     .in = {{.ndim = 3, .shape = {H_SYM(0), 1, H_SYM(2)}, .fill = H_RANDN, .diff = true}},
     .sym = {2, 3, 4}},
    VW("unsqueeze 1", .kind = VW_UNSQUEEZE, .dim = 1),
    VW("unsqueeze 3", .kind = VW_UNSQUEEZE, .dim = 3),
    VW("squeeze(unsqueeze)", .kind = VW_SQUEEZE),
    VW("reshape (-1, S2)", .kind = VW_RESHAPE),
    VW("reshape of a transpose (copy)", .kind = VW_RESHAPE_T),
    VW("flatten 1..2", .kind = VW_FLATTEN),
    VW("contiguous of a transpose", .kind = VW_CONTIG_T),
    VW("clone", .kind = VW_CLONE),
};

static void vw_family(void) { h_run_cases(vw_cases, (int)(sizeof vw_cases / sizeof vw_cases[0])); }

#ifndef H_NO_MAIN
int main(int argc, char **argv) {
  h_init(argc, argv, "test_ops_view");
  vw_family();
  return h_finish();
}
#endif
