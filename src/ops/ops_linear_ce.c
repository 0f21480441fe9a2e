/*
** linear_cross_entropy: cross_entropy(x W^T, target) without the logits (a language
** model's head and its loss; GPT-2: x (16384, 768), W (50257, 768)).
**
** The unfused pair holds the logits (M, V) and their gradient (M, V) at once when
** cross_entropy runs (1.5 GiB each in bf16 for GPT-2 at B=16, T=1024), and the head's
** products have an odd dim (V = 50257). Here the rows go in chunks of Mc (about 2^27
** elements of logits a chunk) and the classes are padded to a multiple of 64 (a zero-row
** copy of W): per chunk, the logits L = x_c W^T into a buffer of padded rows, CROSS_ENTROPY on it (row
** losses, logsumexp, row weights, and dlogits D in the same pass for the sum; for the
** mean in one chunk CROSS_ENTROPY_MEAN, whose D carries the count of kept rows; a mean
** over several chunks: CROSS_ENTROPY_BACKWARD after it, D with the mean's divisor
** counted on the device from the targets first), then
** the two gradient products dx_c = D W and dW += D^T x_c. The forward thus makes the
** gradients, as cross_entropy's fused dlogits does; the node saves dx (M, K) and dW
** (V, K) and hands them out for a unit seed (a scalar seed g multiplies them). Peak: two
** chunk buffers instead of two (M, V) tensors. Kernels: MATMUL, CROSS_ENTROPY,
** CROSS_ENTROPY_BACKWARD, so every backend that runs the unfused pair runs this.
**
** Numbers: the loss and dx are those of the unfused pair (dx_c's rows are independent);
** dW accumulates over the chunks inside the product (out = D^T x_c + out), rounded to
** the weight's dtype once per chunk instead of once: for 16-bit weights a few roundings
** more (7 chunks for GPT-2 at B=16, T=1024) until MATMUL can write f32 from 16-bit
** inputs. The zero pad adds zeros only: the sums are the same. Reductions: mean and sum (none would need the per-row seed inside dW: use
** kiln_linear then kiln_cross_entropy). Autocast class LOWER (x and W as linear's); the
** loss in f32 under autocast (as autocast's cross_entropy gives it), else in the inputs'
** dtype (computed in f32, f64 for f64, and rounded once).
*/
#include "ops/op.h"

#include <stdlib.h>
#include <string.h>

/* logits elements a chunk buffer holds (two buffers: L and D; 256 MiB each in bf16) */
#define LCE_CHUNK_ELEMS ((int64_t)1 << 27)
/* the class dim is padded to a multiple of this (zero weight rows, zero D columns) */
#define LCE_PAD 64

typedef struct attrs_lce {
  kiln_reduction reduction;
  int64_t ignore_index;
  double label_smoothing;
} attrs_lce;
static const char *const lce_reduction_names[] = {"mean", "sum", "none"};
static const kiln__attr_field f_lce[] = {KILN__FIELD_ENUM(attrs_lce, reduction, lce_reduction_names),
                                         KILN__FIELD(attrs_lce, ignore_index, KILN__A_INT),
                                         KILN__FIELD(attrs_lce, label_smoothing, KILN__A_FLOAT)};

static kiln_status lce_infer(kiln__op_ctx *c) {
  const attrs_lce *p = c->attrs;
  kiln_tensor *x = c->in[0], *w = c->in[1], *t = c->in[2];
  const char *who = "kiln_linear_cross_entropy";
  if (!kiln_dtype_is_float(x->dtype) || x->dtype != w->dtype)
    return kiln_set_error(KILN_ERR_DTYPE, "%s: expected input and weight of one floating dtype, got %s %s and %s %s",
                          who, kiln_dtype_name(x->dtype), kiln__tshape(x), kiln_dtype_name(w->dtype), kiln__tshape(w));
  if (t->dtype != KILN_I64 && t->dtype != KILN_I32)
    return kiln_set_error(KILN_ERR_DTYPE, "%s: target must hold class indices (int64 or int32), got %s (shape %s)",
                          who, kiln_dtype_name(t->dtype), kiln__tshape(t));
  if (w->ndim != 2 || x->ndim < 1 || x->shape[x->ndim - 1] != w->shape[1])
    return kiln_set_error(KILN_ERR_SHAPE, "%s: expected input (..., in) and weight (classes, in), got %s and %s", who,
                          kiln__tshape(x), kiln__tshape(w));
  bool same = t->ndim == x->ndim - 1;
  for (int d = 0; same && d < t->ndim; d++) same = t->shape[d] == x->shape[d];
  if (!same)
    return kiln_set_error(KILN_ERR_SHAPE, "%s: target %s does not match the input's leading dims (input %s)", who,
                          kiln__tshape(t), kiln__tshape(x));
  if (p->reduction != KILN_REDUCTION_MEAN && p->reduction != KILN_REDUCTION_SUM)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                          "%s: reduction must be mean or sum, got %d (for per-row losses use kiln_linear then "
                          "kiln_cross_entropy)", who, (int)p->reduction);
  if (!(p->label_smoothing >= 0.0 && p->label_smoothing <= 1.0))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: label_smoothing must be in [0, 1], got %g", who,
                          p->label_smoothing);
  return KILN_OK;
}

/* A 2-d view of t's memory at element offset off (of t's dtype). */
static kiln__view view2_at(const kiln_tensor *t, int64_t off, int64_t r, int64_t cc, int64_t s0, int64_t s1) {
  kiln__view v = kiln__view_of(t);
  v.data = (char *)v.data + off * (int64_t)kiln_dtype_size(v.dtype);
  v.ndim = 2;
  v.shape[0] = r, v.shape[1] = cc;
  v.strides[0] = s0, v.strides[1] = s1;
  return v;
}

/* zeros into a view of a buffer (the padding's rows or columns only) */
static kiln_status fill0(kiln_device dev, kiln__view v) {
  kiln__kargs f = {0};
  f.op = KILN__K_FILL;
  f.n_out = 1;
  f.out[0] = v;
  return kiln__dispatch(dev, &f);
}

/* out (= or +=) A @ B */
static kiln_status mm(kiln_device dev, kiln__view A, kiln__view B, kiln__view C, bool accumulate) {
  kiln__kargs a = {0};
  a.op = KILN__K_MATMUL;
  a.n_in = 2;
  a.n_out = 1;
  a.in[0] = A;
  a.in[1] = B;
  a.out[0] = C;
  a.s[0] = 1.0;
  a.s[1] = accumulate ? 1.0 : 0.0;
  a.i[0] = kiln_matmul_tf32() ? 1 : 0;
  return kiln__dispatch(dev, &a);
}

/* tmp: 0 dx (M, K) or NULL, 1 dW (V, K) or NULL. Makes its own output (the loss). */
static kiln_status lce_forward(kiln__op_ctx *c) {
  const attrs_lce *p = c->attrs;
  kiln_tensor *x = c->in[0], *W = c->in[1], *t = c->in[2];
  kiln_device dev = kiln_device_of(x);
  const int64_t V = W->shape[0], K = W->shape[1], M = kiln_numel(t);
  const kiln_dtype dt = x->dtype, ld = dt == KILN_F64 ? KILN_F64 : KILN_F32;
  bool gx = kiln_grad_enabled() && kiln_requires_grad(x), gw = kiln_grad_enabled() && kiln_requires_grad(W);
  bool ng = gx || gw;
  bool prev = kiln_set_grad_enabled(false);
  kiln_status st = KILN_OK;
  kiln_tensor *x2 = kiln_reshape(x, KILN_SHAPE(M, K)); /* a view, or a copy where rows do not merge */
  kiln_tensor *t1 = kiln_reshape(t, KILN_SHAPE(M));
  kiln_tensor *rows = kiln__tensor_new(1, &M, ld, dev), *lse = kiln__tensor_new(1, &M, ld, dev);
  kiln_tensor *wts = kiln__tensor_new(1, &M, ld, dev);
  kiln_tensor *dx = gx ? kiln__tensor_new(2, (const int64_t[]){M, K}, dt, dev) : NULL;
  kiln_tensor *dW = gw ? kiln__tensor_new(2, (const int64_t[]){V, K}, dt, dev) : NULL;
  /* The chunk size first: one chunk of rows lets the mean's gradient come with the loss. */
  const int64_t Vp = (V + LCE_PAD - 1) / LCE_PAD * LCE_PAD;
  /* KILN_LCE_CHUNK_ELEMS: another chunk size (the tests make several chunks of small
  ** problems with it) */
  int64_t budget = LCE_CHUNK_ELEMS;
  budget = kiln__knob_int("KILN_LCE_CHUNK_ELEMS", budget);
  int64_t Mc = budget / (Vp > 0 ? Vp : 1);
  if (Mc < 1) Mc = 1;
  if (Mc > M) Mc = M;
  /* the same rows in each chunk, within the budget (GPT-2: 7 of 2341 rows, not 6 of 2668
  ** and one of 376, whose products ran well under the others' rate) */
  if (M > Mc) {
    const int64_t nch = (M + Mc - 1) / Mc;
    Mc = (M + nch - 1) / nch;
  }
  /* D in the pass that computes the loss (CROSS_ENTROPY's fused dlogits, the kernels
  ** kiln_cross_entropy runs), not a second pass over the logits (CROSS_ENTROPY_BACKWARD:
  ** it read L again and recomputed every exp; 2048 x 4096 bf16 logits, the small GPT on 2
  ** CPU cores: about 8 of the op's 25 ms). The sum's D is the fused one (grad 1 a row);
  ** the mean's needs the count of kept rows over all M rows, which CROSS_ENTROPY_MEAN
  ** counts itself when one chunk holds them all; several chunks under the mean fuse where
  ** the device's CROSS_ENTROPY takes the count (computed first) as its gradient's divisor
  ** (in2: the CPU and CUDA), else keep the two passes. The D made either way is the same:
  ** g (exp(x - lse) - eps/V) - g (1 - eps) at the target, g = 1 or 1 / count in f32, from
  ** the same f32 lse. */
  const bool fuse_sum = ng && p->reduction == KILN_REDUCTION_SUM;
  const bool fuse_mean = ng && p->reduction == KILN_REDUCTION_MEAN && Mc >= M && M > 0;
  kiln_tensor *fmean = NULL, *fcnt = NULL;
  if (fuse_mean) {
    fmean = kiln__tensor_new(0, NULL, ld, dev);
    fcnt = kiln__tensor_new(0, NULL, ld, dev);
    if (!fmean || !fcnt) st = kiln_last_error();
  }
  /* the mean's divisor, the count of kept rows, before any chunk: D carries it */
  kiln_tensor *cnt = NULL, *one = NULL;
  if (x2 && t1 && ng && !fuse_sum && !fuse_mean) {
    if (p->reduction == KILN_REDUCTION_MEAN)
      cnt = kiln_add_scalar(kiln_mul_scalar(kiln_sum_all(kiln_to_dtype(kiln_eq_scalar(t1, (double)p->ignore_index), ld)),
                                            -1.0), (double)M);
    one = kiln_full(0, NULL, 1.0, ld, dev);
  }
  if (st == KILN_OK && (!x2 || !t1 || !rows || !lse || !wts || (gx && !dx) || (gw && !dW) ||
                        (ng && !fuse_sum && !fuse_mean && (!one || (p->reduction == KILN_REDUCTION_MEAN && !cnt)))))
    st = kiln_last_error();
  /* The class dim padded to a multiple of 64 (GPT-2: 50257 -> 50304, nanoGPT's padded
  ** vocab): W gets zero rows (Wp, a copy per call: 77 MB for GPT-2 in bf16), L and D
  ** padded columns (D's stay 0: CROSS_ENTROPY_BACKWARD writes the first V), so the three
  ** products have no odd dim. With V = 50257 as it is, cuBLAS ran the head's products at
  ** about 130 TFLOP/s on the H200 (29 ms of a 74 ms step, 18:40 run), the rest of the
  ** step's at 300-500. */
  kiln_tensor *Lb = NULL, *Db = NULL, *Wp = W, *dWp = dW;
  if (st == KILN_OK && M > 0 && V > 0) {
    int64_t n = Mc * Vp;
    Lb = kiln__tensor_new(1, &n, dt, dev);
    Db = ng ? kiln__tensor_new(1, &n, dt, dev) : NULL;
    /* D's pad columns must be 0 (the kernels write the first V): those columns only are
    ** filled, not all of D; without pad, none */
    if (!Lb || (ng && !Db)) st = kiln_last_error();
    if (st == KILN_OK && Db && Vp != V) st = fill0(dev, view2_at(Db, V, Mc, Vp - V, Vp, 1));
    if (st == KILN_OK && Vp != V) { /* Wp = [W; 0] (Vp, K); dW is the first V rows of dWp */
      Wp = kiln__tensor_new(2, (const int64_t[]){Vp, K}, dt, dev);
      st = Wp ? fill0(dev, view2_at(Wp, V * K, Vp - V, K, K, 1)) : kiln_last_error();
      if (st == KILN_OK) st = kiln_copy_(kiln_narrow(Wp, 0, 0, V), W);
      if (st == KILN_OK && dW) {
        dWp = kiln__tensor_new(2, (const int64_t[]){Vp, K}, dt, dev);
        dW = dWp ? kiln_narrow(dWp, 0, 0, V) : NULL;
        if (!dW) st = kiln_last_error();
      }
    }
  }
  const int64_t xs0 = x2 ? x2->strides[0] : 0, xs1 = x2 ? x2->strides[1] : 0;
  for (int64_t r0 = 0; st == KILN_OK && r0 < M && V > 0; r0 += Mc) {
    const int64_t mc = M - r0 < Mc ? M - r0 : Mc;
    kiln__view L = view2_at(Lb, 0, mc, V, Vp, 1); /* the logits; L full: (mc, Vp) */
    kiln__view xc = view2_at(x2, r0 * xs0, mc, K, xs0, xs1);
    kiln__view Wt = view2_at(Wp, 0, K, Vp, Wp->strides[1], Wp->strides[0]); /* Wp^T (K, Vp) */
    if (K > 0) st = mm(dev, xc, Wt, view2_at(Lb, 0, mc, Vp, Vp, 1), false); /* L full = x_c Wp^T */
    else st = fill0(dev, L);
    kiln__view tc = kiln__view_of(t1), rc = kiln__view_of(rows), lc = kiln__view_of(lse), wc = kiln__view_of(wts);
    tc.data = (char *)tc.data + r0 * t1->strides[0] * (int64_t)kiln_dtype_size(t1->dtype), tc.shape[0] = mc;
    rc.data = (char *)rc.data + r0 * (int64_t)kiln_dtype_size(ld), rc.shape[0] = mc;
    lc.data = (char *)lc.data + r0 * (int64_t)kiln_dtype_size(ld), lc.shape[0] = mc;
    wc.data = (char *)wc.data + r0 * (int64_t)kiln_dtype_size(ld), wc.shape[0] = mc;
    kiln__view D = ng ? view2_at(Db, 0, mc, V, Vp, 1) : L;
    bool fused = fuse_sum || fuse_mean;
    if (st == KILN_OK) { /* row losses, logsumexp, row weights (the mean, lse, count), D if fused */
      kiln__kargs a = {0};
      a.op = fuse_mean ? KILN__K_CROSS_ENTROPY_MEAN : KILN__K_CROSS_ENTROPY;
      a.n_in = 2;
      a.in[0] = L;
      a.in[1] = tc;
      a.n_out = 3;
      a.out[0] = fuse_mean ? kiln__view_of(fmean) : rc;
      a.out[1] = lc;
      a.out[2] = fuse_mean ? kiln__view_of(fcnt) : wc;
      a.i[0] = p->ignore_index;
      a.s[0] = p->label_smoothing;
      if (fused) a.out[a.n_out++] = D, a.i[1] = 1;
      if (!fused && cnt) { /* the mean over several chunks: D divided by the count in the same pass, where the
                           ** device's kernel takes the divisor (else CROSS_ENTROPY_BACKWARD after it) */
        kiln__kargs b = a;
        b.out[b.n_out++] = D, b.i[1] = 1;
        b.n_in = 3;
        b.in[2] = kiln__view_of(cnt);
        b.in[2].ndim = 1, b.in[2].shape[0] = mc, b.in[2].strides[0] = 0;
        if (kiln__dispatch_has(dev, &b, KILN__K_CROSS_ENTROPY)) a = b, fused = true;
      }
      st = kiln__dispatch(dev, &a);
    }
    if (st != KILN_OK || !ng) continue;
    if (!fused) { /* D = dlogits of the reduction: grad 1 a row, divided by the count for the mean */
      kiln__kargs a = {0};
      a.op = KILN__K_CROSS_ENTROPY_BACKWARD;
      a.n_in = cnt ? 5 : 4;
      a.in[0] = L;
      a.in[1] = tc;
      a.in[2] = lc;
      a.in[3] = kiln__view_of(one);
      a.in[3].ndim = 1, a.in[3].shape[0] = mc, a.in[3].strides[0] = 0;
      if (cnt) {
        a.in[4] = kiln__view_of(cnt);
        a.in[4].ndim = 1, a.in[4].shape[0] = mc, a.in[4].strides[0] = 0;
      }
      a.n_out = 1;
      a.out[0] = D;
      a.i[0] = p->ignore_index;
      a.s[0] = p->label_smoothing;
      st = kiln__dispatch(dev, &a);
    }
    if (st == KILN_OK && dx && K > 0) /* dx_c = D Wp: (mc, Vp) @ (Vp, K), D's pad columns 0 */
      st = mm(dev, view2_at(Db, 0, mc, Vp, Vp, 1), view2_at(Wp, 0, Vp, K, Wp->strides[0], Wp->strides[1]),
              view2_at(dx, r0 * K, mc, K, K, 1), false);
    if (st == KILN_OK && dW && K > 0) { /* dWp (+)= D^T x_c: (Vp, mc) @ (mc, K) */
      kiln__view Dt = view2_at(Db, 0, Vp, mc, 1, Vp);
      st = mm(dev, Dt, xc, kiln__view_of(dWp), r0 > 0);
    }
  }
  if (st == KILN_OK && dW && (M == 0 || V == 0)) st = kiln_fill_(dW, 0.0);
  if (st == KILN_OK && dx && V == 0) st = kiln_fill_(dx, 0.0);
  kiln_tensor *loss = NULL;
  if (st == KILN_OK) {
    if (fuse_mean) {
      loss = fmean;
    } else {
      loss = kiln_sum_all(rows);
      if (p->reduction == KILN_REDUCTION_MEAN) loss = kiln_div(loss, kiln_sum_all(wts));
    }
    /* the loss's dtype as kiln_cross_entropy gives it: f32 under autocast, else the input's */
    if (loss && dt != ld && !kiln_autocast_is_enabled(dev.type)) loss = kiln_to_dtype(loss, dt);
    if (!loss) st = kiln_last_error();
  }
  kiln_set_grad_enabled(prev);
  c->tmp[0] = dx;
  c->tmp[1] = dW;
  c->out[0] = loss;
  return st;
}

/* saved: 0 dx (x's shape), 1 dW: the gradients for a unit seed */
static void lce_save(kiln__op_ctx *c, kiln__node *n) {
  kiln_tensor *x = c->in[0];
  kiln_tensor *dx = c->tmp[0] ? kiln_reshape(c->tmp[0], x->ndim, x->shape) : NULL;
  kiln__node_save(n, 0, dx);
  kiln__node_save(n, 1, c->tmp[1]);
  for (int k = 0; k < 2; k++)
    if (n->saved[k]) n->saved[k]->storage->saved_grad = true; /* the engine copies before anyone writes */
  n->unit_seed_ok = true;
}

static kiln_status lce_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  for (int k = 0; k < 2; k++) {
    kiln_tensor *d = n->saved[k];
    if (!n->needs[k]) continue;
    if (!d) return kiln_set_error(KILN_ERR_STATE, "kiln_linear_cross_entropy: no gradient was made for input %d", k);
    kiln_tensor *r;
    if (!g) { /* the unit seed: the saved gradient is the answer */
      r = kiln__tensor_alias(d, true);
    } else { /* g (0-d, the loss's dtype) times the saved gradient, rounded once to its dtype */
      r = kiln_mul(d, g);
      if (r && r->dtype != d->dtype) r = kiln_to_dtype(r, d->dtype);
    }
    kiln_status st = kiln__give_grad(&gi[k], r, g);
    if (st != KILN_OK) return st;
  }
  return KILN_OK;
}

static const kiln__op op_linear_cross_entropy = {
    .name = "linear_cross_entropy", .api = "kiln_linear_cross_entropy", .n_in = 3, .n_out = 1,
    .amp = KILN__AMP_LOWER, .flags = KILN__OP_SELF_ALLOC, .n_kernels = 4,
    .kernels = {KILN__K_MATMUL, KILN__K_CROSS_ENTROPY, KILN__K_CROSS_ENTROPY_MEAN, KILN__K_CROSS_ENTROPY_BACKWARD},
    .attrs = f_lce,
    .n_attrs = 3, .attr_size = sizeof(attrs_lce), .infer = lce_infer, .forward = lce_forward,
    .backward = lce_backward, .n_saved = 2, .save = lce_save,
    .expands_to = (const char *const[]){"linear", "cross_entropy", NULL}};

kiln_tensor *kiln_linear_cross_entropy(kiln_tensor *x, kiln_tensor *weight, kiln_tensor *target, kiln_reduction red,
                                       int64_t ignore_index, double label_smoothing) {
  attrs_lce p = {red, ignore_index, label_smoothing};
  kiln_tensor *in[3] = {x, weight, target};
  /* the call's own scope: the chunk buffers and the other intermediates go when it ends */
  kiln_scope_begin();
  return kiln__scope_return(kiln__op_call(&op_linear_cross_entropy, 3, in, &p, NULL));
}
