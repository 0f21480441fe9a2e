/*
** Losses: cross_entropy (one fused kernel, and no backward kernel) and mse_loss (a
** composite), descriptors on the one call path (op.h). Their attributes are PyTorch's:
** reduction (mean, sum, none), and for cross_entropy ignore_index and label_smoothing.
**
** cross_entropy moves the class dim last and flattens logits to (M, C), targets to (M).
** The CROSS_ENTROPY kernel gives per-row losses and the row logsumexp in f32 (f64 for f64
** logits), whatever the logits' dtype, so 16-bit logits lose nothing inside; the result
** is cast back to the logits' dtype as PyTorch returns it, except under autocast: there
** bf16 logits come in uncast (KILN__OP_AMP_READS_16, op.h) and the loss stays f32, the
** numbers of cast-then-op without the cast kernel, nor its gradient's: dlogits (bf16,
** rounded once from f32) is what the cast's backward would have made from the f32 one. The reduction runs on the
** device — mean divides by the number of targets that are not ignore_index, counted on
** the device too, so no op here waits for the device (all ignored gives 0/0 = NaN, as
** in PyTorch). The mean is one kernel (CROSS_ENTROPY_MEAN).
**
** A small model's step is bounded by the number of launches, so the backward has no
** kernel of its own. When the logits need a gradient, the forward kernel also writes
** dlogits (its flag i1 & 1): the gradient for a unit upstream gradient, softmax minus the
** smoothed one-hot, 0 for ignored rows, divided by the count of kept rows for the mean
** (per row for 'none' and 'sum', whose row weights are all 1). The node saves only that
** tensor, in the logits' shape and dtype, and takes a unit seed (unit_seed_ok): backward
** from kiln_backward(loss) without a gradient hands it on as the logits' gradient, no
** kernel; an explicit gradient g costs one mul (g (N, 1, d...) over the classes for
** 'none', a scalar otherwise). Its storage is marked saved_grad, so the engine copies it
** before a user can see or write it (a leaf's .grad, retain_grad, kiln_autograd_grad),
** and a second backward finds it intact. The price is memory: dlogits (M, C) is made in
** the forward and lives with the graph (before, the backward made it from the saved
** logits). CROSS_ENTROPY_BACKWARD stays for the backends and their tests: every path
** here that needs the gradient has dlogits.
*/
#include "ops/op.h"

#include <math.h>
#include <string.h>

static bool valid_reduction(kiln_reduction r) {
  return r == KILN_REDUCTION_MEAN || r == KILN_REDUCTION_SUM || r == KILN_REDUCTION_NONE;
}

/* names[value] of kiln_reduction, for traces */
static const char *const reduction_names[] = {"mean", "sum", "none"};
_Static_assert(sizeof(kiln_reduction) == sizeof(int), "KILN__A_ENUM reads an int");

/* ---- cross_entropy ------------------------------------------------------------------ */

typedef struct attrs_ce {
  kiln_reduction reduction;
  int64_t ignore_index;
  double label_smoothing;
} attrs_ce;
static const kiln__attr_field f_ce[] = {KILN__FIELD_ENUM(attrs_ce, reduction, reduction_names),
                                        KILN__FIELD(attrs_ce, ignore_index, KILN__A_INT),
                                        KILN__FIELD(attrs_ce, label_smoothing, KILN__A_FLOAT)};

/* saved: 0 dlogits, the logits' gradient for a unit upstream gradient (the logits' shape
** and dtype). g NULL: the implicit unit seed. */
static kiln_status ce_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  kiln_tensor *dl = n->saved[0];
  if (!g) /* the saved tensor is the answer: a handle of the engine's own, no kernel */
    return kiln__give_grad(&gi[0], kiln__tensor_alias(dl, true), NULL);
  /* A wider g (an f32 loss's gradient reaching bf16 logits under autocast) multiplies in
  ** its own dtype, the product rounded once to the logits' dtype: as the cast-then-op path
  ** computes it but for dlogits' own rounding (none for a power-of-two g). */
  bool wide = (dl->dtype == KILN_BF16 || dl->dtype == KILN_F16) && g->dtype == KILN_F32;
  kiln_tensor *gd = g->dtype == dl->dtype || wide ? g : kiln_to_dtype(g, dl->dtype);
  int nd = n->in_ndim[0];
  if (gd && ((const attrs_ce *)n->attrs)->reduction == KILN_REDUCTION_NONE && nd >= 2) { /* (N, d...) -> (N, 1, d...) */
    int64_t sh[KILN_MAX_DIMS];
    memcpy(sh, n->in_shape[0], (size_t)nd * sizeof sh[0]);
    sh[1] = 1;
    gd = kiln_reshape(gd, nd, sh);
  }
  kiln_tensor *r = gd ? kiln_mul(dl, gd) : NULL;
  if (r && r->dtype != dl->dtype) r = kiln_to_dtype(r, dl->dtype);
  return kiln__give_grad(&gi[0], r, g);
}

/* dlogits (M, C) in the logits' layout: (M, C) -> (C) for 1-d logits (a view), or
** (M, C) -> (N, d..., C) -> (N, C, d...) (a copy) for more than 2 dims. */
static kiln_tensor *ce_logits_layout(kiln_tensor *dl, int nd, const int64_t *ls) {
  if (nd == 1) return kiln_reshape(dl, 1, ls);
  if (nd == 2) return dl;
  int64_t sh[KILN_MAX_DIMS];
  int perm[KILN_MAX_DIMS];
  sh[0] = ls[0];
  for (int k = 2; k < nd; k++) sh[k - 1] = ls[k];
  sh[nd - 1] = ls[1];
  perm[0] = 0;
  perm[1] = nd - 1;
  for (int k = 2; k < nd; k++) perm[k] = k - 1;
  return kiln_contiguous(kiln_permute(kiln_reshape(dl, nd, sh), nd, perm));
}

/* The forward kernel (CROSS_ENTROPY: per-row loss; CROSS_ENTROPY_MEAN: the mean, and the
** count of kept rows in cnt) on logits L2 (M, C) and targets T1 (M); dl (M, C), when not
** NULL, gets the fused gradient. */
static kiln_status ce_forward(kiln__kop op, kiln_tensor *L2, kiln_tensor *T1, kiln_tensor *loss,
                              kiln_tensor *lse, kiln_tensor *cnt, kiln_tensor *dl,
                              int64_t ignore_index, double label_smoothing) {
  kiln__kargs a = {0};
  a.op = op;
  a.n_in = 2;
  a.n_out = cnt ? 3 : 2;
  a.in[0] = kiln__view_of(L2);
  a.in[1] = kiln__view_of(T1);
  a.out[0] = kiln__view_of(loss);
  a.out[1] = kiln__view_of(lse);
  if (cnt) a.out[2] = kiln__view_of(cnt);
  if (dl) a.out[a.n_out++] = kiln__view_of(dl);
  a.i[0] = ignore_index;
  a.i[1] = dl ? 1 : 0;
  a.s[0] = label_smoothing;
  return kiln__dispatch(kiln_device_of(L2), &a);
}

static kiln_status ce_infer(kiln__op_ctx *c) {
  const attrs_ce *p = c->attrs;
  kiln_tensor *logits = c->in[0], *target = c->in[1];
  if (!kiln_dtype_is_float(logits->dtype))
    return kiln_set_error(KILN_ERR_DTYPE, "kiln_cross_entropy: logits must be floating, got %s (shape %s)",
                          kiln_dtype_name(logits->dtype), kiln__tshape(logits));
  if (target->dtype != KILN_I64 && target->dtype != KILN_I32)
    return kiln_set_error(KILN_ERR_DTYPE,
                          "kiln_cross_entropy: target must hold class indices (int64 or int32), got %s "
                          "(shape %s)",
                          kiln_dtype_name(target->dtype), kiln__tshape(target));
  if (!valid_reduction(p->reduction))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_cross_entropy: invalid reduction %d",
                          (int)p->reduction);
  if (!(p->label_smoothing >= 0.0 && p->label_smoothing <= 1.0))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                          "kiln_cross_entropy: label_smoothing must be in [0, 1], got %g", p->label_smoothing);
  int nd = logits->ndim;
  bool shape_ok = nd >= 1 && target->ndim == nd - 1;
  if (shape_ok && nd >= 2) {
    shape_ok = target->shape[0] == logits->shape[0];
    for (int k = 2; k < nd && shape_ok; k++) shape_ok = target->shape[k - 1] == logits->shape[k];
  }
  if (!shape_ok)
    return kiln_set_error(KILN_ERR_SHAPE,
                          "kiln_cross_entropy: logits %s and target %s do not match (expected logits "
                          "(N, C, d...) with target (N, d...), or logits (C) with a 0-dim target)",
                          kiln__tshape(logits), kiln__tshape(target));
  return KILN_OK;
}

/* Makes its own output (a reshape of the row losses, their sum or the mean kernel's
** result). It runs in the scope kiln_cross_entropy opened for the call: the
** intermediates, and the fused gradient that save() hands the node, go when it ends. */
static kiln_status ce_forward_op(kiln__op_ctx *c) {
  const attrs_ce *p = c->attrs;
  kiln_tensor *logits = c->in[0], *target = c->in[1];
  kiln_reduction red = p->reduction;
  int nd = logits->ndim;
  int64_t C = nd == 1 ? logits->shape[0] : logits->shape[1];
  int64_t M = kiln_numel(target);
  kiln_dtype ld = logits->dtype == KILN_F64 ? KILN_F64 : KILN_F32;
  kiln_device dev = kiln_device_of(logits);

  bool ng = c->records; /* the target, integer, never needs grad */
  bool prev = kiln_set_grad_enabled(false);
  kiln_tensor *L2 = NULL, *T1 = NULL, *rows = NULL, *lse = NULL, *cnt = NULL, *r = NULL;
  kiln_tensor *dl = NULL; /* (M, C): the fused gradient, made only when it will be used */
  if (nd <= 2) {
    L2 = kiln_reshape(logits, KILN_SHAPE(M, C));
  } else { /* (N, C, d...) -> (N, d..., C) -> (M, C) */
    int perm[KILN_MAX_DIMS];
    perm[0] = 0;
    for (int k = 1; k < nd - 1; k++) perm[k] = k + 1;
    perm[nd - 1] = 1;
    L2 = kiln_reshape(kiln_permute(logits, nd, perm), KILN_SHAPE(M, C));
  }
  T1 = kiln_reshape(target, KILN_SHAPE(M));
  kiln_status st = KILN_OK;
  if (L2 && T1 && ng) dl = kiln__tensor_new(2, (const int64_t[]){M, C}, logits->dtype, dev);
  if (ng && !dl) {
    st = kiln_last_error();
  } else if (L2 && T1 && red == KILN_REDUCTION_MEAN) {
    /* the mean over kept rows and their count in one kernel (CROSS_ENTROPY_MEAN) */
    kiln_tensor *mean = kiln__tensor_new(0, NULL, ld, dev);
    cnt = kiln__tensor_new(0, NULL, ld, dev);
    lse = kiln__tensor_new(1, &M, ld, dev);
    st = mean && cnt && lse ? KILN_OK : KILN_ERR_OOM;
    if (st == KILN_OK)
      st = ce_forward(KILN__K_CROSS_ENTROPY_MEAN, L2, T1, mean, lse, cnt, dl, p->ignore_index, p->label_smoothing);
    r = st == KILN_OK ? mean : NULL;
  } else if (L2 && T1) {
    rows = kiln__tensor_new(1, &M, ld, dev);
    lse = rows ? kiln__tensor_new(1, &M, ld, dev) : NULL;
    st = lse ? KILN_OK : KILN_ERR_OOM;
    if (lse && M > 0)
      st = ce_forward(KILN__K_CROSS_ENTROPY, L2, T1, rows, lse, NULL, dl, p->ignore_index, p->label_smoothing);
    if (st == KILN_OK)
      r = red == KILN_REDUCTION_NONE ? kiln_reshape(rows, target->ndim, target->shape) : kiln_sum_all(rows);
  } else {
    st = kiln_last_error();
  }
  /* under autocast (c->amp_f32) the loss stays f32, as it is for logits cast to f32 */
  if (st == KILN_OK && r && r->dtype != logits->dtype && !c->amp_f32) r = kiln_to_dtype(r, logits->dtype);
  kiln_tensor *grad = r && ng ? ce_logits_layout(dl, nd, logits->shape) : NULL;
  if (ng && !grad) r = NULL;
  kiln_set_grad_enabled(prev);
  c->tmp[0] = grad;
  c->out[0] = r;
  return r ? KILN_OK : kiln_last_error();
}

/* saved: 0 the fused gradient, which the node hands on for a unit seed */
static void ce_save(kiln__op_ctx *c, kiln__node *n) {
  kiln_tensor *grad = c->tmp[0];
  kiln__node_save(n, 0, grad);
  grad->storage->saved_grad = true; /* the engine copies it before anyone sees it */
  n->unit_seed_ok = true;
}

static const kiln__op op_cross_entropy = {
    .name = "cross_entropy", .api = "kiln_cross_entropy", .n_in = 2, .n_out = 1, .amp = KILN__AMP_F32,
    .flags = KILN__OP_SELF_ALLOC | KILN__OP_AMP_READS_16, .n_kernels = 2,
    .kernels = {KILN__K_CROSS_ENTROPY, KILN__K_CROSS_ENTROPY_MEAN}, .attrs = f_ce, .n_attrs = 3,
    .attr_size = sizeof(attrs_ce), .infer = ce_infer, .forward = ce_forward_op, .backward = ce_backward,
    .n_saved = 1, .save = ce_save};

kiln_tensor *kiln_cross_entropy(kiln_tensor *logits, kiln_tensor *target, kiln_reduction red,
                                int64_t ignore_index, double label_smoothing) {
  attrs_ce p = {red, ignore_index, label_smoothing};
  kiln_tensor *in[2] = {logits, target};
  /* The call's own scope (the one this function opened before the op path): see
  ** ce_forward_op. */
  kiln_scope_begin();
  return kiln__scope_return(kiln__op_call(&op_cross_entropy, 2, in, &p, NULL));
}

/* ---- mse_loss ----------------------------------------------------------------------- */

typedef struct attrs_reduction {
  kiln_reduction reduction;
} attrs_reduction;
static const kiln__attr_field f_reduction[] = {KILN__FIELD_ENUM(attrs_reduction, reduction, reduction_names)};

static kiln_status mse_infer(kiln__op_ctx *c) {
  const attrs_reduction *p = c->attrs;
  kiln_tensor *input = c->in[0], *target = c->in[1];
  if (!kiln_dtype_is_float(input->dtype) || !kiln_dtype_is_float(target->dtype))
    return kiln_set_error(KILN_ERR_DTYPE, "kiln_mse_loss: expected floating tensors, got %s and %s",
                          kiln_dtype_name(input->dtype), kiln_dtype_name(target->dtype));
  if (!valid_reduction(p->reduction))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_mse_loss: invalid reduction %d", (int)p->reduction);
  /* Unlike PyTorch (a warning, then broadcasting), different shapes are an error: they
  ** are nearly always a bug ((N, 1) against (N)). */
  bool same = input->ndim == target->ndim;
  for (int k = 0; same && k < input->ndim; k++) same = input->shape[k] == target->shape[k];
  if (!same)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_mse_loss: input %s and target %s must have the same shape",
                          kiln__tshape(input), kiln__tshape(target));
  return KILN_OK;
}

static kiln_status mse_forward(kiln__op_ctx *c) {
  kiln_reduction red = ((const attrs_reduction *)c->attrs)->reduction;
  kiln_scope_begin();
  kiln_tensor *d = kiln_sub(c->in[0], c->in[1]);
  kiln_tensor *sq = kiln_mul(d, d);
  kiln_tensor *r = red == KILN_REDUCTION_MEAN ? kiln_mean_all(sq)
                   : red == KILN_REDUCTION_SUM ? kiln_sum_all(sq)
                                               : sq;
  c->out[0] = kiln__scope_return(r);
  return c->out[0] ? KILN_OK : kiln_last_error();
}

/* A composite: sub, mul and mean/sum record their own nodes and name their own kernels. */
static const kiln__op op_mse_loss = {
    .name = "mse_loss", .api = "kiln_mse_loss", .n_in = 2, .n_out = 1, .amp = KILN__AMP_F32,
    .flags = KILN__OP_COMPOSITE, .attrs = f_reduction, .n_attrs = 1, .attr_size = sizeof(attrs_reduction),
    .infer = mse_infer, .forward = mse_forward};

kiln_tensor *kiln_mse_loss(kiln_tensor *input, kiln_tensor *target, kiln_reduction red) {
  attrs_reduction p = {red};
  kiln_tensor *in[2] = {input, target};
  return kiln__op_call(&op_mse_loss, 2, in, &p, NULL);
}
