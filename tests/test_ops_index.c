/*
** Joining and indexing: cat, stack, split, index_select, gather, scatter_add, embedding,
** and out-of-range indices. Names are prefixed ix_ (tests/test_cuda_ops.c includes
** this file).
*/
#include "harness.h"

#include <stdio.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>

typedef struct ix_ctx {
  int dim;
  int piece; /* split: which piece to return (-1: the last) */
  int64_t size;
} ix_ctx;

static int ix_wrap(int d, int n) { return d < 0 ? d + n : d; }

/* ---- cat / stack: n inputs ---- */
static kiln_tensor *ix_b_cat(kiln_tensor **in, const void *ctx) {
  return kiln_cat(3, in, ((const ix_ctx *)ctx)->dim);
}
static kiln_tensor *ix_b_stack(kiln_tensor **in, const void *ctx) {
  return kiln_stack(3, in, ((const ix_ctx *)ctx)->dim);
}

static int ix_r_cat(const h_arr *in, int n, h_arr *out, const void *ctx) {
  int d = ix_wrap(((const ix_ctx *)ctx)->dim, in[0].ndim);
  *out = (h_arr){.ndim = in[0].ndim, .data = out->data};
  memcpy(out->shape, in[0].shape, sizeof out->shape);
  out->shape[d] = 0;
  for (int i = 0; i < n; i++) {
    if (in[i].ndim != in[0].ndim) return 1;
    for (int k = 0; k < in[0].ndim; k++)
      if (k != d && in[i].shape[k] != in[0].shape[k]) return 1;
    out->shape[d] += in[i].shape[d];
  }
  if (!out->data) return 0;
  int64_t outer = h_numel(d, in[0].shape), inner = h_numel(in[0].ndim - d - 1, in[0].shape + d + 1);
  int64_t pos = 0;
  for (int64_t o = 0; o < outer; o++)
    for (int i = 0; i < n; i++) {
      int64_t len = in[i].shape[d] * inner;
      memcpy(out->data + pos, in[i].data + o * len, sizeof(double) * (size_t)len);
      pos += len;
    }
  return 0;
}

static int ix_r_stack(const h_arr *in, int n, h_arr *out, const void *ctx) {
  int nd = in[0].ndim + 1, d = ix_wrap(((const ix_ctx *)ctx)->dim, nd);
  for (int i = 1; i < n; i++)
    if (in[i].ndim != in[0].ndim || memcmp(in[i].shape, in[0].shape, sizeof(int64_t) * (size_t)in[0].ndim))
      return 1;
  out->ndim = nd;
  for (int k = 0, j = 0; k < nd; k++) out->shape[k] = k == d ? n : in[0].shape[j++];
  if (!out->data) return 0;
  int64_t outer = h_numel(d, in[0].shape), inner = h_numel(in[0].ndim - d, in[0].shape + d);
  int64_t pos = 0;
  for (int64_t o = 0; o < outer; o++)
    for (int i = 0; i < n; i++) {
      memcpy(out->data + pos, in[i].data + o * inner, sizeof(double) * (size_t)inner);
      pos += inner;
    }
  return 0;
}

/* ---- split: one piece ---- */
static kiln_tensor *ix_b_split(kiln_tensor **in, const void *ctx) {
  const ix_ctx *c = ctx;
  kiln_tensor *p[16];
  int n = kiln_split(in[0], c->size, c->dim, p, 16);
  if (n < 0) return NULL;
  int k = c->piece < 0 ? n - 1 : c->piece;
  if (k >= n) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "test: split gave %d pieces", n);
    return NULL;
  }
  return p[k];
}
static int ix_r_split(const h_arr *in, int n_in, h_arr *out, const void *ctx) {
  (void)n_in;
  const ix_ctx *c = ctx;
  const h_arr *a = &in[0];
  int d = ix_wrap(c->dim, a->ndim);
  int64_t len = a->shape[d], np = (len + c->size - 1) / c->size;
  if (np == 0) np = 1; /* torch.split of an empty dim gives one empty piece */
  int64_t k = c->piece < 0 ? np - 1 : c->piece;
  if (k >= np) return 1;
  int64_t start = k * c->size, plen = len - start < c->size ? len - start : c->size;
  out->ndim = a->ndim;
  memcpy(out->shape, a->shape, sizeof out->shape);
  out->shape[d] = plen;
  if (!out->data) return 0;
  int64_t outer = h_numel(d, a->shape), inner = h_numel(a->ndim - d - 1, a->shape + d + 1);
  for (int64_t o = 0; o < outer; o++)
    memcpy(out->data + o * plen * inner, a->data + (o * len + start) * inner,
           sizeof(double) * (size_t)(plen * inner));
  return 0;
}

/* ---- index_select / gather / scatter_add / embedding ---- */
static kiln_tensor *ix_b_isel(kiln_tensor **in, const void *ctx) {
  return kiln_index_select(in[0], ((const ix_ctx *)ctx)->dim, in[1]);
}
static int ix_r_isel(const h_arr *in, int n_in, h_arr *out, const void *ctx) {
  (void)n_in;
  const h_arr *a = &in[0], *ix = &in[1];
  int d = ix_wrap(((const ix_ctx *)ctx)->dim, a->ndim);
  out->ndim = a->ndim;
  memcpy(out->shape, a->shape, sizeof out->shape);
  out->shape[d] = ix->shape[0];
  if (!out->data) return 0;
  int64_t idx[KILN_MAX_DIMS] = {0}, n = h_numel(out->ndim, out->shape);
  for (int64_t k = 0; k < n; k++) {
    int64_t src[KILN_MAX_DIMS];
    memcpy(src, idx, sizeof src);
    src[d] = (int64_t)ix->data[idx[d]];
    out->data[k] = a->data[h_bcast_offset(a->ndim, a->shape, a->ndim, src)];
    h_next_index(out->ndim, out->shape, idx);
  }
  return 0;
}

static kiln_tensor *ix_b_gather(kiln_tensor **in, const void *ctx) {
  return kiln_gather(in[0], ((const ix_ctx *)ctx)->dim, in[1]);
}
/* flat offset of a multi-index in a C-order array (no broadcasting) */
static int64_t ix_off(int nd, const int64_t *shape, const int64_t *idx) {
  int64_t o = 0;
  for (int i = 0; i < nd; i++) o = o * shape[i] + idx[i];
  return o;
}
static int ix_r_gather(const h_arr *in, int n_in, h_arr *out, const void *ctx) {
  (void)n_in;
  const h_arr *a = &in[0], *ix = &in[1];
  int d = ix_wrap(((const ix_ctx *)ctx)->dim, a->ndim);
  out->ndim = ix->ndim;
  memcpy(out->shape, ix->shape, sizeof out->shape);
  if (!out->data) return 0;
  int64_t idx[KILN_MAX_DIMS] = {0}, n = h_numel(ix->ndim, ix->shape);
  for (int64_t k = 0; k < n; k++) {
    int64_t src[KILN_MAX_DIMS];
    memcpy(src, idx, sizeof src);
    src[d] = (int64_t)ix->data[k];
    out->data[k] = a->data[ix_off(a->ndim, a->shape, src)];
    h_next_index(ix->ndim, ix->shape, idx);
  }
  return 0;
}

static kiln_tensor *ix_b_scatter(kiln_tensor **in, const void *ctx) {
  return kiln_scatter_add(in[0], ((const ix_ctx *)ctx)->dim, in[1], in[2]);
}
static int ix_r_scatter(const h_arr *in, int n_in, h_arr *out, const void *ctx) {
  (void)n_in;
  const h_arr *a = &in[0], *ix = &in[1], *src = &in[2];
  int d = ix_wrap(((const ix_ctx *)ctx)->dim, a->ndim);
  out->ndim = a->ndim;
  memcpy(out->shape, a->shape, sizeof out->shape);
  if (!out->data) return 0;
  memcpy(out->data, a->data, sizeof(double) * (size_t)h_numel(a->ndim, a->shape));
  int64_t idx[KILN_MAX_DIMS] = {0}, n = h_numel(ix->ndim, ix->shape);
  for (int64_t k = 0; k < n; k++) {
    int64_t dst[KILN_MAX_DIMS];
    memcpy(dst, idx, sizeof dst);
    dst[d] = (int64_t)ix->data[k];
    out->data[ix_off(a->ndim, a->shape, dst)] += src->data[ix_off(src->ndim, src->shape, idx)];
    h_next_index(ix->ndim, ix->shape, idx);
  }
  return 0;
}

static kiln_tensor *ix_b_emb(kiln_tensor **in, const void *ctx) {
  (void)ctx;
  return kiln_embedding(in[0], in[1]);
}
static int ix_r_emb(const h_arr *in, int n_in, h_arr *out, const void *ctx) {
  (void)n_in, (void)ctx;
  const h_arr *w = &in[0], *ids = &in[1];
  int64_t D = w->shape[1];
  out->ndim = ids->ndim + 1;
  memcpy(out->shape, ids->shape, sizeof(int64_t) * (size_t)ids->ndim);
  out->shape[ids->ndim] = D;
  if (!out->data) return 0;
  int64_t n = h_numel(ids->ndim, ids->shape);
  for (int64_t k = 0; k < n; k++)
    for (int64_t j = 0; j < D; j++) out->data[k * D + j] = w->data[(int64_t)ids->data[k] * D + j];
  return 0;
}

#define IXF(nd, ...) {.ndim = nd, .shape = {__VA_ARGS__}, .fill = H_RANDN, .diff = true}
#define IXI(nd, hs, dt, ...)                                                              \
  {.ndim = nd, .shape = {__VA_ARGS__}, .fill = H_INDEX, .hi_sym = hs, .dtype = dt}
#define IXC(...) (&(const ix_ctx){__VA_ARGS__})
#define S0 H_SYM(0)
#define S1 H_SYM(1)

static const h_case ix_cases[] = {
    {.name = "cat dim1", .fn = ix_b_cat, .ref = ix_r_cat, .ctx = IXC(.dim = 1), .n_in = 3,
     .in = {IXF(3, S0, 2, S1), IXF(3, S0, 3, S1), IXF(3, S0, 1, S1)}, .sym = {2, 4}},
    {.name = "cat dim0", .fn = ix_b_cat, .ref = ix_r_cat, .ctx = IXC(.dim = 0), .n_in = 3,
     .in = {IXF(2, S0, S1), IXF(2, 1, S1), IXF(2, S0, S1)}, .sym = {3, 4}},
    {.name = "cat dim-1", .fn = ix_b_cat, .ref = ix_r_cat, .ctx = IXC(.dim = -1), .n_in = 3,
     .in = {IXF(2, S0, S1), IXF(2, S0, 2), IXF(2, S0, 1)}, .sym = {3, 4}},
    {.name = "stack dim0", .fn = ix_b_stack, .ref = ix_r_stack, .ctx = IXC(.dim = 0), .n_in = 3,
     .in = {IXF(2, S0, S1), IXF(2, S0, S1), IXF(2, S0, S1)}, .sym = {3, 4}},
    {.name = "stack dim1", .fn = ix_b_stack, .ref = ix_r_stack, .ctx = IXC(.dim = 1), .n_in = 3,
     .in = {IXF(2, S0, S1), IXF(2, S0, S1), IXF(2, S0, S1)}, .sym = {3, 4}},
    {.name = "stack dim-1 (new last)", .fn = ix_b_stack, .ref = ix_r_stack, .ctx = IXC(.dim = -1),
     .n_in = 3, .in = {IXF(2, S0, S1), IXF(2, S0, S1), IXF(2, S0, S1)}, .sym = {3, 4}},
    {.name = "split 2 dim1 piece 1", .fn = ix_b_split, .ref = ix_r_split,
     .ctx = IXC(.dim = 1, .piece = 1, .size = 2), .n_in = 1, .in = {IXF(2, S0, 5)}, .sym = {3}},
    {.name = "split 2 dim1 last piece", .fn = ix_b_split, .ref = ix_r_split,
     .ctx = IXC(.dim = 1, .piece = -1, .size = 2), .n_in = 1, .in = {IXF(2, S0, 5)}, .sym = {3}},
    {.name = "split 3 dim0 piece 0", .fn = ix_b_split, .ref = ix_r_split,
     .ctx = IXC(.dim = 0, .piece = 0, .size = 3), .n_in = 1, .in = {IXF(2, S0, S1)},
     .sym = {7, 2}},
    {.name = "index_select dim0 i64", .fn = ix_b_isel, .ref = ix_r_isel, .ctx = IXC(.dim = 0),
     .n_in = 2, .in = {IXF(2, S0, S1), IXI(1, 1, KILN_I64, 6)}, .sym = {4, 3}},
    {.name = "index_select dim1 i32", .fn = ix_b_isel, .ref = ix_r_isel, .ctx = IXC(.dim = 1),
     .n_in = 2, .in = {IXF(3, 2, S0, S1), IXI(1, 1, KILN_I32, 5)}, .sym = {3, 4}},
    {.name = "gather dim1", .fn = ix_b_gather, .ref = ix_r_gather, .ctx = IXC(.dim = 1),
     .n_in = 2, .in = {IXF(2, S0, S1), IXI(2, 2, KILN_I64, S0, 5)}, .sym = {3, 4}},
    {.name = "gather dim0 i32", .fn = ix_b_gather, .ref = ix_r_gather, .ctx = IXC(.dim = 0),
     .n_in = 2, .in = {IXF(2, S0, S1), IXI(2, 1, KILN_I32, 5, S1)}, .sym = {3, 4}},
    {.name = "scatter_add dim1", .fn = ix_b_scatter, .ref = ix_r_scatter, .ctx = IXC(.dim = 1),
     .n_in = 3, .in = {IXF(2, S0, S1), IXI(2, 2, KILN_I64, S0, 6), IXF(2, S0, 6)},
     .sym = {3, 4}},
    {.name = "scatter_add dim0", .fn = ix_b_scatter, .ref = ix_r_scatter, .ctx = IXC(.dim = 0),
     .n_in = 3, .in = {IXF(2, S0, S1), IXI(2, 1, KILN_I64, 5, S1), IXF(2, 5, S1)},
     .sym = {3, 4}},
    {.name = "embedding ids (2,3)", .fn = ix_b_emb, .ref = ix_r_emb, .n_in = 2,
     .in = {IXF(2, S0, S1), IXI(2, 1, KILN_I64, 2, 3)}, .sym = {7, 4}},
    {.name = "embedding ids 1-d i32", .fn = ix_b_emb, .ref = ix_r_emb, .n_in = 2,
     .in = {IXF(2, S0, S1), IXI(1, 1, KILN_I32, 9)}, .sym = {5, 3}},
};

static void ix_extra(void) {
  kiln_device cpu = kiln_device_cpu();
  kiln_scope_begin();
  kiln_tensor *t = kiln_ones(KILN_SHAPE(3, 4), KILN_F32, cpu);
  kiln_tensor *bad = H_T(KILN_SHAPE(2), KILN_I64, 1, 3);
  kiln_tensor *neg = H_T(KILN_SHAPE(2), KILN_I64, 0, -1);
  H_EXPECT_ERR(kiln_index_select(t, 0, bad), KILN_ERR_INDEX, "index_select index 3 of size 3");
  H_EXPECT_ERR(kiln_index_select(t, 0, neg), KILN_ERR_INDEX, "index_select index -1");
  H_EXPECT_ERR(kiln_index_select(t, 0, kiln_ones(KILN_SHAPE(2), KILN_F32, cpu)), KILN_ERR_DTYPE,
               "index_select with a float index");
  kiln_tensor *gi = H_T(KILN_SHAPE(3, 1), KILN_I64, 0, 4, 1);
  H_EXPECT_ERR(kiln_gather(t, 1, gi), KILN_ERR_INDEX, "gather index 4 of size 4");
  H_EXPECT_ERR(kiln_scatter_add(t, 1, gi, kiln_ones(KILN_SHAPE(3, 1), KILN_F32, cpu)),
               KILN_ERR_INDEX, "scatter_add index 4 of size 4");
  kiln_tensor *w = kiln_ones(KILN_SHAPE(5, 2), KILN_F32, cpu);
  H_EXPECT_ERR(kiln_embedding(w, H_T(KILN_SHAPE(3), KILN_I64, 0, 5, 1)), KILN_ERR_INDEX,
               "embedding id 5 of 5");
  H_EXPECT_ERR(kiln_embedding(w, H_T(KILN_SHAPE(1), KILN_I32, -2)), KILN_ERR_INDEX,
               "embedding id -2");
  /* the message names the op */
  kiln_index_select(t, 0, bad);
  H_CHECK(strstr(kiln_last_error_message(), "index_select") != NULL,
          "index error message names index_select: \"%s\"", kiln_last_error_message());
  kiln_clear_error();
  kiln_tensor *ts[2] = {t, kiln_ones(KILN_SHAPE(3, 5), KILN_F32, cpu)};
  H_EXPECT_ERR(kiln_cat(2, ts, 0), KILN_ERR_SHAPE, "cat [3,4] and [3,5] along 0");
  H_EXPECT_ERR(kiln_stack(2, ts, 0), KILN_ERR_SHAPE, "stack [3,4] and [3,5]");
  H_EXPECT_ERR(kiln_cat(2, ts, 2), KILN_ERR_INVALID_ARGUMENT, "cat along dim 2 of 2-d");
  kiln_tensor *ok = kiln_cat(2, ts, 1);
  H_CHECK(ok && kiln_size(ok, 1) == 9, "cat [3,4] and [3,5] along 1 is [3,9]");
  /* split views share storage and max_out limits what is written */
  kiln_tensor *p[2] = {NULL, NULL};
  int np = kiln_split(kiln_ones(KILN_SHAPE(7), KILN_F32, cpu), 2, 0, p, 2);
  H_CHECK(np == 4 || np == 2 || np == -1, "split 7 by 2 with max_out 2: 4 (pieces), 2 (written) or -1: %d", np);
  kiln_clear_error();
  H_CHECK(kiln_split(t, 0, 0, p, 2) == -1 && kiln_last_error() != KILN_OK, "split size 0 is an error");
  kiln_clear_error();
  /* index_select backward accumulates duplicate indices */
  kiln_tensor *x = H_T(KILN_SHAPE(3), KILN_F64, 1, 2, 3);
  kiln_requires_grad_(x, true);
  kiln_tensor *dup = H_T(KILN_SHAPE(4), KILN_I64, 2, 0, 2, 2);
  if (H_CHECK(kiln_backward(kiln_sum_all(kiln_index_select(x, 0, dup)), NULL) == KILN_OK,
              "index_select backward"))
    h_tensor_close("index_select duplicate grads add up", kiln_grad(x), (double[]){1, 0, 3}, 3, 0, 0);
  kiln_scope_end();
}

/* cat of many inputs that need grad records one node (no tree of cats): the trace shows
** one cat of all its inputs, and each input gets its own slice of the gradient. A legacy
** 1-d empty input joins the node but takes no part in the result, so it gets no gradient;
** a cat where only such an input needs grad records nothing. */
static void ix_cat_one_node(void) {
  kiln_device cpu = kiln_device_cpu();
  kiln_scope_begin();
  enum { N = 9 };
  kiln_tensor *in[N + 1];
  int64_t total = 0;
  for (int k = 0; k < N; k++) {
    in[k] = kiln_ones(KILN_SHAPE(2, k % 3 + 1), KILN_F64, cpu);
    kiln_requires_grad_(in[k], true);
    total += k % 3 + 1;
  }
  in[N] = kiln_zeros(KILN_SHAPE(0), KILN_F64, cpu); /* legacy empty, needs grad */
  kiln_requires_grad_(in[N], true);
  kiln_trace *tr = kiln_trace_begin();
  kiln_tensor *y = kiln_cat(N + 1, in, -1);
  kiln_trace_end(tr);
  const kiln_trace_op *op = kiln_trace_count(tr) == 1 ? kiln_trace_get(tr, 0) : NULL;
  H_CHECK(op && strcmp(op->name, "cat") == 0 && op->n_inputs == N + 1 && op->n_attrs == 1 &&
              strcmp(op->attrs[0].name, "dim") == 0 && op->attrs[0].i == -1,
          "cat of %d inputs traces as one cat(dim=-1) of all of them", N + 1);
  kiln_trace_free(tr);
  H_CHECK(y && kiln_size(y, 1) == total && kiln_grad_fn_name(y) && strcmp(kiln_grad_fn_name(y), "cat") == 0,
          "cat of %d inputs that need grad: one node named cat (%s)", N,
          y && kiln_grad_fn_name(y) ? kiln_grad_fn_name(y) : "NULL");
  /* weights 0, 1, 2, ... along the joined dim: input k's gradient is its slice of them */
  kiln_tensor *w = kiln_arange(0, (double)total, 1, KILN_F64, cpu);
  if (H_CHECK(y && kiln_backward(kiln_sum_all(kiln_mul(y, w)), NULL) == KILN_OK, "cat backward")) {
    int64_t start = 0;
    for (int k = 0; k < N; k++) {
      int64_t len = k % 3 + 1;
      double want[6];
      for (int r = 0; r < 2; r++)
        for (int j = 0; j < len; j++) want[r * len + j] = (double)(start + j);
      char what[64];
      snprintf(what, sizeof what, "cat input %d gets its slice of the gradient", k);
      h_tensor_close(what, kiln_grad(in[k]), want, 2 * len, 0, 0);
      start += len;
    }
    H_CHECK(kiln_grad(in[N]) == NULL, "the skipped legacy empty gets no gradient");
  }
  kiln_tensor *plain[2] = {kiln_ones(KILN_SHAPE(2, 2), KILN_F64, cpu), in[N]};
  kiln_tensor *z = kiln_cat(2, plain, 1);
  H_CHECK(z && !kiln_requires_grad(z), "cat where only a skipped legacy empty needs grad records no node");
  kiln_scope_end();
}

/* A tied weight (GPT-2's wte: the head's product and the embedding): the embedding's rows
** go straight into the .grad the other use made (kiln__grad_into on a leaf), and summing
** over two backward calls and a .grad the caller still holds keep their meaning. f32 on
** every device there is; dyadic values, so every order of the sums gives the same bits. */
static void ix_tied_embedding(kiln_device dev) {
  char dn[32];
  kiln_device_str(dev, dn, sizeof dn);
  kiln_scope_begin();
  /* W (4, 4); head: sum(linear(x, W)) with x (1, 4) = (1, 2, 1, 2): dW row r = x. Rows of
  ** 16 bytes: CUDA's row kernels (four-wide atomics) take the embedding's both ways. */
  kiln_tensor *W = kiln_to_device(kiln_to_dtype(kiln_arange(0, 16, 1, KILN_F64, kiln_device_cpu()), KILN_F32), dev);
  W = kiln_reshape(W, KILN_SHAPE(4, 4));
  kiln_requires_grad_(W, true);
  kiln_tensor *x = kiln_to_device(kiln_to_dtype(H_T(KILN_SHAPE(1, 4), KILN_F64, 1, 2, 1, 2), KILN_F32), dev);
  kiln_tensor *ids = kiln_to_device(H_T(KILN_SHAPE(5), KILN_I64, 2, 0, 2, 2, 3), dev);
  /* the embedding's rows weighted by 0.5: row 2 thrice, rows 0 and 3 once, row 1 never */
  const double one[16] = {1.5, 2.5, 1.5, 2.5, 1, 2, 1, 2, 2.5, 3.5, 2.5, 3.5, 1.5, 2.5, 1.5, 2.5};
  kiln_tensor *held = NULL;
  /* 1: into no .grad; 2: into the .grad of 1 (in place); 3: into a .grad the caller holds */
  for (int pass = 1; pass <= 3; pass++) {
    kiln_tensor *head = kiln_sum_all(kiln_linear(x, W, NULL));
    kiln_tensor *emb = kiln_mul_scalar(kiln_sum_all(kiln_embedding(W, ids)), 0.5);
    char what[96];
    snprintf(what, sizeof what, "tied embedding + product on %s: backward %d", dn, pass);
    if (pass == 3) held = kiln_tensor_ref(kiln_grad(W));
    if (!H_CHECK(head && emb && kiln_backward(kiln_add(head, emb), NULL) == KILN_OK, "%s", what)) break;
    double want[16];
    for (int i = 0; i < 16; i++) want[i] = pass * one[i];
    kiln_scope_begin(); /* the copy read here holds no reference past the check */
    h_tensor_close(what, kiln_to_device(kiln_grad(W), kiln_device_cpu()), want, 16, 0, 0);
    kiln_scope_end();
  }
  if (held) {
    double want[16];
    for (int i = 0; i < 16; i++) want[i] = 2 * one[i];
    char what[96];
    snprintf(what, sizeof what, "a .grad the caller holds on %s is left as it was", dn);
    h_tensor_close(what, kiln_to_device(held, kiln_device_cpu()), want, 16, 0, 0);
  }
  kiln_tensor_free(held);
  kiln_scope_end();
}

/* An embedding's gradient with many repeated ids (4096 ids among 8 rows) is the same to
** the bit twice over, and matches the CPU's within f32 rounding: CUDA sorts the ids and sums
** each one's rows in index order (atomics in any order would move the last bits). */
static void ix_embedding_grad_repeatable(kiln_device dev) {
  char dn[32];
  kiln_device_str(dev, dn, sizeof dn);
  kiln_scope_begin();
  kiln_manual_seed(7);
  kiln_tensor *ids = kiln_randint(0, 8, 1, (const int64_t[]){4096}, KILN_I64, kiln_device_cpu(), NULL);
  kiln_tensor *g = kiln_randn(2, (const int64_t[]){4096, 64}, KILN_F32, kiln_device_cpu(), NULL);
  float got[2][8 * 64], ref[8 * 64];
  for (int run = 0; run < 3; run++) {
    kiln_device on = run < 2 ? dev : kiln_device_cpu();
    kiln_scope_begin();
    kiln_tensor *W = kiln_zeros(2, (const int64_t[]){8, 64}, KILN_F32, on);
    kiln_requires_grad_(W, true);
    kiln_tensor *y = kiln_embedding(W, kiln_to_device(ids, on));
    kiln_status st = y ? kiln_backward(y, kiln_to_device(g, on)) : kiln_last_error();
    st = st == KILN_OK ? kiln_to_host(kiln_grad(W), run < 2 ? got[run] : ref, sizeof ref) : st;
    H_CHECK(st == KILN_OK, "embedding backward of 4096 repeated ids on %s (run %d)", dn, run);
    kiln_scope_end();
  }
  H_CHECK(memcmp(got[0], got[1], sizeof ref) == 0, "embedding gradient on %s: the same bits twice", dn);
  double worst = 0;
  for (int i = 0; i < 8 * 64; i++) {
    double e = fabs((double)got[0][i] - ref[i]) / (1 + fabs((double)ref[i]));
    worst = e > worst ? e : worst;
  }
  H_CHECK(worst < 1e-4, "embedding gradient on %s against the CPU's: relative error %.3g", dn, worst);
  kiln_scope_end();
}

static void ix_family(void) {
  h_run_cases(ix_cases, (int)(sizeof ix_cases / sizeof ix_cases[0]));
  if (!h_cross_only()) {
    ix_extra();
    ix_cat_one_node();
    ix_tied_embedding(kiln_device_cpu());
    ix_embedding_grad_repeatable(kiln_device_cpu());
  }
  if (h_backend_checks("cuda") && kiln_device_count(KILN_DEVICE_CUDA) > 0) { /* test_cuda_ops runs these too */
    ix_tied_embedding(kiln_device_cuda(0));
    ix_embedding_grad_repeatable(kiln_device_cuda(0));
  }
}

#ifndef H_NO_MAIN
int main(int argc, char **argv) {
  h_init(argc, argv, "test_ops_index");
  ix_family();
  return h_finish();
}
#endif
#undef S0
#undef S1
