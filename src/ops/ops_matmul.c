/*
** Matrix products: kiln_matmul (torch.matmul's rules) and kiln_linear (x @ W^T + bias).
**
** The MATMUL kernel takes in0 A (B..., M, K), in1 B (B..., K, N), out0 (B..., M, N), all
** with one ndim >= 2 and the batch dims already broadcast (stride 0), optional in2 bias
** (N). Everything else — promotion of 1-d operands, broadcasting of batch dims, W^T —
** is done here with views (strides), never with copies.
**
** matmul, linear, linear_relu and linear_gelu are ops on the one call path (op.h), in the
** lower precision under autocast. linear_relu is linear then relu fused into one MATMUL
** call (a ReLU epilogue); it shares linear's infer, forward and backward, and names the two
** ops it stands for (expands_to) so that a trace can show what the user wrote.
** linear_gelu (linear then the tanh GELU: GPT-2's MLP) shares linear's infer and rule; its
** forward is one LINEAR_GELU kernel where the device has one, and keeps the
** pre-activation for the backward.
*/
#include "ops/op.h"

#include <stdatomic.h>
#include <string.h>

static atomic_bool tf32_allowed; /* process-global; default off (exact f32) */

void kiln_set_matmul_tf32(bool allow) { atomic_store(&tf32_allowed, allow); }
bool kiln_matmul_tf32(void) { return atomic_load(&tf32_allowed); }

static kiln_status check_float_pair(const char *op, const kiln_tensor *a, const kiln_tensor *b) {
  if (!kiln_dtype_is_float(a->dtype) || a->dtype != b->dtype)
    return kiln_set_error(KILN_ERR_DTYPE,
                          "%s: expected two floating tensors of the same dtype, got %s %s and %s "
                          "%s",
                          op, kiln_dtype_name(a->dtype), kiln__tshape(a),
                          kiln_dtype_name(b->dtype), kiln__tshape(b));
  return KILN_OK;
}

/* A view over the memory of t with the given shape and strides. */
static kiln__view view_as(const kiln_tensor *t, int ndim, const int64_t *shape,
                          const int64_t *strides) {
  kiln__view v = kiln__view_of(t);
  v.ndim = ndim;
  for (int d = 0; d < ndim; d++) {
    v.shape[d] = shape[d];
    v.strides[d] = strides[d];
  }
  return v;
}

/* out (the whole result) = 0, or bias broadcast over rows, when the inner dim K is 0. */
static kiln_status fill_empty_product(kiln_device dev, kiln__view out, const kiln_tensor *bias) {
  kiln__kargs a = {0};
  a.n_out = 1;
  a.out[0] = out;
  if (bias) {
    a.op = KILN__K_COPY;
    a.n_in = 1;
    kiln__view bv = kiln__view_of(bias);
    kiln__view in = out;
    in.data = bv.data;
    for (int d = 0; d < in.ndim; d++) in.strides[d] = 0;
    in.strides[in.ndim - 1] = bv.strides[0];
    in.dtype = bv.dtype;
    a.in[0] = in;
  } else {
    a.op = KILN__K_FILL;
    a.s[0] = 0.0;
  }
  return kiln__dispatch(dev, &a);
}

/* C = A @ B (+ bias) (ReLU'd when relu). */
static kiln_status run_matmul(kiln_device dev, kiln__view A, kiln__view B, kiln__view C,
                              const kiln_tensor *bias, bool relu) {
  int64_t K = A.shape[A.ndim - 1];
  if (kiln__view_numel(&C) == 0) return KILN_OK;
  if (K == 0) {
    kiln_status st = fill_empty_product(dev, C, bias);
    if (st != KILN_OK || !relu) return st;
    kiln__kargs r = {0};
    r.op = KILN__K_RELU;
    r.n_in = r.n_out = 1;
    r.in[0] = r.out[0] = C;
    return kiln__dispatch(dev, &r);
  }
  kiln__kargs a = {0};
  a.op = KILN__K_MATMUL;
  a.n_in = bias ? 3 : 2;
  a.n_out = 1;
  a.in[0] = A;
  a.in[1] = B;
  if (bias) a.in[2] = kiln__view_of(bias);
  a.out[0] = C;
  a.i[1] = relu ? 1 : 0;
  a.s[0] = 1.0;
  a.s[1] = 0.0;
  a.i[0] = kiln_matmul_tf32() ? 1 : 0;
  return kiln__dispatch(dev, &a);
}

/* Whether the leading dims (all but the last) of x merge into one dim; *stride gets the
** stride of that merged dim. */
static bool leading_mergeable(const kiln_tensor *x, int64_t *stride) {
  int64_t expect = -1;
  *stride = x->shape[x->ndim - 1] ? x->shape[x->ndim - 1] : 1;
  for (int d = x->ndim - 2; d >= 0; d--) {
    if (x->shape[d] == 1) continue;
    if (expect < 0) {
      *stride = x->strides[d];
    } else if (x->strides[d] != expect) {
      return false;
    }
    expect = x->strides[d] * x->shape[d];
  }
  return true;
}

/* ---- matmul ------------------------------------------------------------------------- */

/* dA = g @ B^T and dB = A^T @ g on the promoted (>= 2-d) operands, then summed over the
** batch dims that were broadcast, then squeezed back where an operand was 1-d. */
static kiln_status matmul_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  kiln_tensor *A = n->saved[0], *B = n->saved[1];
  bool a1 = A->ndim == 1, b1 = B->ndim == 1;
  kiln_tensor *Ap = a1 ? kiln_unsqueeze(A, 0) : A;
  kiln_tensor *Bp = b1 ? kiln_unsqueeze(B, 1) : B;
  kiln_tensor *gp = g;
  if (a1 && b1)
    gp = kiln_reshape(g, KILN_SHAPE(1, 1));
  else if (a1)
    gp = kiln_unsqueeze(g, g->ndim - 1); /* (..., N) -> (..., 1, N) */
  else if (b1)
    gp = kiln_unsqueeze(g, g->ndim); /* (..., M) -> (..., M, 1) */
  if (!Ap || !Bp || !gp) return kiln_last_error();
  if (n->needs[0]) {
    kiln_tensor *d = kiln_matmul(gp, kiln_transpose(Bp, Bp->ndim - 1, Bp->ndim - 2));
    if (d) d = kiln__unbroadcast(d, Ap->ndim, Ap->shape);
    if (d && a1) d = kiln_reshape(d, 1, A->shape);
    kiln_status st = kiln__give_grad(&gi[0], d, g);
    if (st != KILN_OK) return st;
  }
  if (n->needs[1] && B->ndim == 2 && A->ndim >= 3) {
    /* B was shared by every batch: dB = A^T @ g over all rows at once, (K, rows) @ (rows,
    ** N), instead of a per-batch product summed afterwards. */
    int64_t K = B->shape[0], N = B->shape[1];
    int64_t rows = 1;
    for (int d = 0; d < A->ndim - 1; d++) rows *= A->shape[d];
    kiln_tensor *A2 = kiln_reshape(A, KILN_SHAPE(rows, K));
    kiln_tensor *g2 = kiln_reshape(g, KILN_SHAPE(rows, N));
    kiln_tensor *d = A2 && g2 ? kiln_matmul(kiln_transpose(A2, 0, 1), g2) : NULL;
    kiln_status st = kiln__give_grad(&gi[1], d, g);
    if (st != KILN_OK) return st;
  } else if (n->needs[1]) {
    kiln_tensor *d = kiln_matmul(kiln_transpose(Ap, Ap->ndim - 1, Ap->ndim - 2), gp);
    if (d) d = kiln__unbroadcast(d, Bp->ndim, Bp->shape);
    if (d && b1) d = kiln_reshape(d, 1, B->shape);
    kiln_status st = kiln__give_grad(&gi[1], d, g);
    if (st != KILN_OK) return st;
  }
  return KILN_OK;
}

/* The geometry of a @ b: 1-d operands promoted, batch dims broadcast (aligned from the
** right), the result's shape with the promoted dims dropped again. */
typedef struct mm_geom {
  int nd; /* of the promoted product (batch..., M, N) */
  int64_t M, K, N;
  int64_t csh[KILN_MAX_DIMS], Ash[KILN_MAX_DIMS], Ast[KILN_MAX_DIMS], Bsh[KILN_MAX_DIMS], Bst[KILN_MAX_DIMS];
  int ond;
  int64_t osh[KILN_MAX_DIMS];
} mm_geom;

/* Checks a and b and fills g (infer); forward calls it again for the views (no error can
** happen then), which costs a few dozen integer operations and no record to carry. */
static kiln_status matmul_geom(const kiln_tensor *a, const kiln_tensor *b, mm_geom *g) {
  if (check_float_pair("kiln_matmul", a, b) != KILN_OK) return kiln_last_error();
  if (a->ndim == 0 || b->ndim == 0)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_matmul: both operands need at least 1 dim, got shapes %s and %s",
                          kiln__tshape(a), kiln__tshape(b));
  /* Promote 1-d operands: a (K) -> (1, K), b (K) -> (K, 1). */
  int64_t ash[KILN_MAX_DIMS] = {0}, ast[KILN_MAX_DIMS] = {0}, bsh[KILN_MAX_DIMS] = {0}, bst[KILN_MAX_DIMS] = {0};
  int and_ = a->ndim, bnd = b->ndim;
  if (and_ == 1) {
    and_ = 2;
    ash[0] = 1, ast[0] = 0, ash[1] = a->shape[0], ast[1] = a->strides[0];
  } else {
    for (int d = 0; d < and_; d++) ash[d] = a->shape[d], ast[d] = a->strides[d];
  }
  if (bnd == 1) {
    bnd = 2;
    bsh[0] = b->shape[0], bst[0] = b->strides[0], bsh[1] = 1, bst[1] = 0;
  } else {
    for (int d = 0; d < bnd; d++) bsh[d] = b->shape[d], bst[d] = b->strides[d];
  }
  int64_t M = ash[and_ - 2], K = ash[and_ - 1], N = bsh[bnd - 1];
  if (K != bsh[bnd - 2])
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_matmul: shapes %s and %s cannot be multiplied (%lld != %lld)",
                          kiln__tshape(a), kiln__tshape(b), (long long)K, (long long)bsh[bnd - 2]);
  /* Broadcast the batch dims (aligned from the right). */
  int na = and_ - 2, nb = bnd - 2, nbat = na > nb ? na : nb;
  for (int i = 0; i < nbat; i++) {
    int ia = i - (nbat - na), ib = i - (nbat - nb);
    int64_t sa = ia >= 0 ? ash[ia] : 1, sb = ib >= 0 ? bsh[ib] : 1;
    if (sa != sb && sa != 1 && sb != 1)
      return kiln_set_error(KILN_ERR_SHAPE, "kiln_matmul: batch dims of shapes %s and %s do not broadcast (%lld vs %lld)",
                            kiln__tshape(a), kiln__tshape(b), (long long)sa, (long long)sb);
    g->csh[i] = sa == 1 ? sb : sa;
    g->Ash[i] = g->Bsh[i] = g->csh[i];
    g->Ast[i] = (ia >= 0 && sa != 1) ? ast[ia] : 0;
    g->Bst[i] = (ib >= 0 && sb != 1) ? bst[ib] : 0;
  }
  g->Ash[nbat] = M, g->Ash[nbat + 1] = K, g->Ast[nbat] = ast[and_ - 2], g->Ast[nbat + 1] = ast[and_ - 1];
  g->Bsh[nbat] = K, g->Bsh[nbat + 1] = N, g->Bst[nbat] = bst[bnd - 2], g->Bst[nbat + 1] = bst[bnd - 1];
  g->csh[nbat] = M, g->csh[nbat + 1] = N;
  g->nd = nbat + 2;
  g->M = M, g->K = K, g->N = N;
  /* The result drops the promoted dims again. */
  g->ond = 0;
  for (int i = 0; i < nbat; i++) g->osh[g->ond++] = g->csh[i];
  if (a->ndim > 1) g->osh[g->ond++] = M;
  if (b->ndim > 1) g->osh[g->ond++] = N;
  return KILN_OK;
}

static kiln_status matmul_infer(kiln__op_ctx *c) {
  mm_geom g;
  if (matmul_geom(c->in[0], c->in[1], &g) != KILN_OK) return kiln_last_error();
  kiln__op_meta(c, 0, g.ond, g.osh, c->in[0]->dtype);
  return KILN_OK;
}

static kiln_status matmul_forward(kiln__op_ctx *c) {
  kiln_tensor *a = c->in[0], *b = c->in[1], *out = c->out[0];
  mm_geom g;
  if (matmul_geom(a, b, &g) != KILN_OK) return kiln_last_error();
  int nd = g.nd;
  int64_t K = g.K, N = g.N;
  /* Removing size-1 dims from a contiguous layout keeps the other strides, so the
  ** contiguous strides of (batch..., M, N) describe out exactly. */
  int64_t cst[KILN_MAX_DIMS];
  kiln__contiguous_strides(nd, g.csh, cst);
  kiln__view C = view_as(out, nd, g.csh, cst);
  kiln__view Av = view_as(a, nd, g.Ash, g.Ast), Bv = view_as(b, nd, g.Bsh, g.Bst);
  int64_t mst;
  if (a->ndim >= 3 && b->ndim == 2 && leading_mergeable(a, &mst)) {
    /* (B..., M, K) @ (K, N) with mergeable batch dims: one 2-D GEMM of B*M rows, not
    ** B small ones against a stride-0 B. */
    int64_t rows = 1;
    for (int d = 0; d < a->ndim - 1; d++) rows *= a->shape[d];
    int64_t xsh[2] = {rows, K}, xst[2] = {mst, a->strides[a->ndim - 1]};
    int64_t ysh[2] = {K, N}, yst[2] = {b->strides[0], b->strides[1]};
    int64_t zsh[2] = {rows, N}, zst[2] = {N, 1};
    Av = view_as(a, 2, xsh, xst);
    Bv = view_as(b, 2, ysh, yst);
    C = view_as(out, 2, zsh, zst);
  }
  return run_matmul(c->device, Av, Bv, C, NULL, false);
}

static void matmul_save(kiln__op_ctx *c, kiln__node *n) {
  kiln__node_save(n, 0, c->in[0]);
  kiln__node_save(n, 1, c->in[1]);
}

static const kiln__op op_matmul = {
    .name = "matmul", .api = "kiln_matmul", .n_in = 2, .n_out = 1, .amp = KILN__AMP_LOWER,
    .flags = KILN__OP_RULE_READS_INPUTS | KILN__OP_PRODUCT,
    .n_kernels = 2, .kernels = {KILN__K_MATMUL, KILN__K_FILL}, .infer = matmul_infer,
    .forward = matmul_forward, .backward = matmul_backward, .n_saved = 2, .save = matmul_save};

kiln_tensor *kiln_matmul(kiln_tensor *a, kiln_tensor *b) {
  kiln_tensor *in[2] = {a, b};
  return kiln__op_call(&op_matmul, 2, in, NULL, NULL);
}

/* ---- linear ------------------------------------------------------------------------- */

/* The product A (M, K) @ B (K, N) into a new (M, N) tensor of dtype odt (B's, or f32 for
** 16-bit operands where the device has that "wide" product; B's where it has not), A read
** through mask (where(mask > 0, A, 0): ReLU's backward) when given; rowsum, when given,
** gets A's (masked) row sums in the same dtype. For backward rules (grad mode is off
** there: nothing is recorded). */
static kiln_tensor *product(kiln__view A, const kiln__view *mask, kiln_tensor *B, kiln_tensor **rowsum,
                            kiln_dtype odt) {
  int64_t M = A.shape[0], N = B->shape[1];
  kiln_device dev = kiln_device_of(B);
  if (odt != B->dtype) { /* asked before anything is allocated: the views' pointers do not matter */
    kiln__kargs w = {0};
    w.op = KILN__K_MATMUL;
    w.n_in = 2;
    w.n_out = rowsum ? 2 : 1;
    w.in[0] = A;
    w.in[1] = kiln__view_of(B);
    if (mask) {
      w.in[w.n_in++] = *mask;
      w.i[1] = 2;
    }
    w.out[0] = w.in[1];
    w.out[0].dtype = odt;
    w.out[0].ndim = 2;
    w.out[0].shape[0] = M;
    w.out[0].shape[1] = N;
    w.out[0].strides[0] = N;
    w.out[0].strides[1] = 1;
    if (rowsum) {
      w.out[1] = w.out[0];
      w.out[1].ndim = 1;
      w.out[1].shape[0] = M;
      w.out[1].strides[0] = 1;
    }
    if (!kiln__dispatch_has(dev, &w, KILN__K_MATMUL)) odt = B->dtype;
  }
  kiln_tensor *C = kiln__tensor_new(2, (int64_t[]){M, N}, odt, dev);
  kiln_tensor *R = C && rowsum ? kiln__tensor_new(1, &M, odt, dev) : NULL;
  if (!C || (rowsum && !R)) return NULL;
  kiln__kargs a = {0};
  a.op = KILN__K_MATMUL;
  a.n_in = 2;
  a.n_out = R ? 2 : 1;
  a.in[0] = A;
  a.in[1] = kiln__view_of(B);
  if (mask) {
    a.in[a.n_in++] = *mask;
    a.i[1] = 2;
  }
  a.out[0] = kiln__view_of(C);
  if (R) a.out[1] = kiln__view_of(R);
  a.s[0] = 1.0;
  a.i[0] = kiln_matmul_tf32() ? 1 : 0;
  if (kiln__dispatch(dev, &a) != KILN_OK) return NULL;
  if (rowsum) *rowsum = R;
  return C;
}

/* A 2-d view of t (M, N) or of its transpose. */
static kiln__view view2(const kiln_tensor *t, bool transpose) {
  kiln__view v = kiln__view_of(t);
  if (transpose) {
    int64_t s0 = v.strides[0], n0 = v.shape[0];
    v.shape[0] = v.shape[1], v.strides[0] = v.strides[1];
    v.shape[1] = n0, v.strides[1] = s0;
  }
  return v;
}

static const kiln__op op_linear;
static const kiln__op op_linear_relu;
static const kiln__op op_linear_gelu;

/* linear and linear_relu (for linear_relu, y = relu(z) is saved[2], and the gradient that
** reaches z is g where y > 0: the products below read g through that mask, so ReLU's
** backward costs no kernel of its own). */
/* The peephole of GPT-2's MLP backward: a linear whose input is a linear_gelu's output,
** and the only way gradient reaches it (kiln__grad_mask_ok), gives that node the gradient
** of its pre-activation z directly: dz = (g W) * gelu_tanh'(z), one MATMUL_DGELU (CUDA:
** cuBLASLt's DGELU epilogue) instead of the product then linear_gelu's GELU kernel. The
** linear_gelu node is told by its grad_mask (set to z; the engine frees it after the
** rule). *d gets dz in x's shape; false (nothing done) where the pattern does not hold. */
static bool dgelu_handover(kiln__node *n, kiln_tensor *g2, kiln_tensor *W, kiln_tensor *x, kiln_tensor **d) {
  kiln__node *m = n->next[0].node;
  if (!m || m->op != &op_linear_gelu || !kiln__grad_mask_ok(m, n->next[0].index)) return false;
  kiln_tensor *z = m->saved[2];
  int64_t N = W->shape[0], K = W->shape[1], M = g2->shape[0];
  if (!z || z->dtype != g2->dtype || kiln_numel(z) != M * K || !kiln_is_contiguous(z)) return false;
  kiln_device dev = kiln_device_of(g2);
  kiln_tensor *dz = kiln__tensor_new(2, (int64_t[]){M, K}, g2->dtype, dev);
  if (!dz) return false;
  kiln__kargs a = {0};
  a.op = KILN__K_MATMUL_DGELU;
  a.n_in = 3;
  a.in[0] = kiln__view_of(g2);                                  /* (M, N) */
  a.in[1] = view_as(W, 2, (int64_t[]){N, K}, W->strides);        /* (N, K) */
  a.in[2] = view_as(z, 2, (int64_t[]){M, K}, (int64_t[]){K, 1}); /* (M, K) */
  a.n_out = 1;
  a.out[0] = kiln__view_of(dz);
  a.i[0] = kiln_matmul_tf32() ? 1 : 0;
  kiln_status st;
  if (K > 0 && N > 0 && kiln__dispatch_has(dev, &a, KILN__K_MATMUL_DGELU)) {
    st = kiln__dispatch(dev, &a);
  } else { /* the product, then the GELU's backward on it */
    kiln_tensor *dh = product(view2(g2, false), NULL, W, NULL, W->dtype);
    kiln__kargs k = {0};
    k.op = KILN__K_GELU_TANH_BACKWARD;
    k.n_in = 2;
    k.in[0] = a.in[2];
    k.in[1] = dh ? kiln__view_of(dh) : a.in[2];
    st = dh ? kiln__run_into(dz, &k) : kiln_last_error();
  }
  if (st != KILN_OK) return false;
  *d = kiln_reshape(dz, x->ndim, x->shape);
  if (!*d) return false;
  m->grad_mask = kiln_tensor_ref(z);
  return true;
}

bool kiln__linear_bias_handover(const kiln__node *m, int index, kiln_dtype *dt) {
  if (!m || m->op != &op_linear || m->n_in < 3 || !m->needs[2] || !kiln__grad_mask_ok(m, index)) return false;
  *dt = kiln__grad_dtype(m, 2);
  return true;
}

/* x (saved) as (M, K + 8) over its buffer with the ones column (ones_col: each row of K
** 16-bit elements followed by a 1 and seven 0s, rows K + 8 apart; residual_layer_norm
** makes GPT-2's ln outputs so), or NULL: its product with g^T is [dW | db | 0]. x2 is x as
** (M, K). */
static kiln_tensor *ones_augmented(const kiln_tensor *x, const kiln_tensor *x2) {
  const int64_t K = x2->shape[1];
  if (!x->ones_col || kiln_dtype_size(x->dtype) != 2 || x2->strides[1] != 1 || x2->strides[0] != K + 8) return NULL;
  return kiln__tensor_make(x2->storage, x2->offset, 2, (const int64_t[]){x2->shape[0], K + 8},
                           (const int64_t[]){K + 8, 1}, x2->dtype);
}

static kiln_status linear_backward_run(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  if (n->op == &op_linear_gelu && !n->grad_mask) { /* grad_mask: g is already z's (dgelu_handover) */
    /* the gradient of the pre-activation z (saved[2]): g gelu_tanh'(z), one kernel; then
    ** linear's products below on it, unmasked */
    kiln_tensor *z = n->saved[2];
    kiln_tensor *dz = kiln__tensor_new(z->ndim, z->shape, z->dtype, kiln_device_of(z));
    kiln_tensor *gc = g ? kiln_contiguous(g) : NULL;
    if (!dz || !gc) return kiln_last_error();
    kiln__kargs k = {0};
    k.op = KILN__K_GELU_TANH_BACKWARD;
    k.n_in = 2;
    k.in[0] = kiln__view_of(z);
    k.in[1] = kiln__view_of(gc);
    if (kiln__run_into(dz, &k) != KILN_OK) return kiln_last_error();
    g = dz;
  }
  /* the mask of the gradient: linear_relu's output, or a following ReLU's input handed
  ** over by that ReLU's rule (KILN__OP_GRAD_MASK); either is > 0 where ReLU passed it */
  kiln_tensor *x = n->saved[0], *W = n->saved[1];
  kiln_tensor *y = n->op == &op_linear_relu ? n->saved[2] : n->op == &op_linear_gelu ? NULL : n->grad_mask;
  int64_t N = W->shape[0], K = W->shape[1];
  int64_t M = 1; /* rows of the flattened problem: prod(leading dims of x) */
  for (int d = 0; d < x->ndim - 1; d++) M *= x->shape[d];
  kiln_tensor *g2 = kiln_reshape(g, KILN_SHAPE(M, N));
  kiln_tensor *y2 = y ? kiln_reshape(y, KILN_SHAPE(M, N)) : NULL;
  kiln_tensor *x2 = kiln_reshape(x, KILN_SHAPE(M, K));
  if (!g2 || !x2 || (y && !y2)) return kiln_last_error();
  kiln__view mT, m;
  if (y2) mT = view2(y2, true), m = view2(y2, false);
  if (n->needs[0]) {
    kiln_tensor *d = NULL;
    if (y2 || n->op != &op_linear || !dgelu_handover(n, g2, W, x, &d)) {
      d = product(view2(g2, false), y2 ? &m : NULL, W, NULL, W->dtype); /* (M, N) @ (N, K) */
      if (d) d = kiln_reshape(d, x->ndim, x->shape);
    }
    kiln_status st = kiln__give_grad(&gi[0], d, g);
    if (st != KILN_OK) return st;
  }
  kiln_tensor *given = n->needs[2] ? n->bias_grad : NULL; /* db, summed by the rule after us */
  if (given) {
    kiln_status st = kiln__give_grad(&gi[2], given, g);
    if (st != KILN_OK) return st;
  }
  if (n->needs[2] && !given && !n->needs[1] && !y2) { /* a frozen weight: db alone, no product */
    kiln_status st = kiln__give_grad(&gi[2], kiln_sum(g2, KILN_DIMS(0), false), g);
    if (st != KILN_OK) return st;
  } else if (n->needs[1] || (n->needs[2] && !given)) {
    /* dW = g^T x (N, K) and, in the same call, db = g^T's row sums (N); in f32 when both
    ** go to casts from f32 parameters (autocast): no cast kernel after them */
    const bool sum_b = n->needs[2] && !given;
    kiln_dtype odt = x2->dtype;
    if ((!n->needs[1] || kiln__grad_dtype(n, 1) == KILN_F32) && (!sum_b || kiln__grad_dtype(n, 2) == KILN_F32))
      odt = KILN_F32;
    kiln_tensor *db = NULL, *dW = NULL;
    kiln_tensor *xa = sum_b && n->needs[1] && !y2 && odt == KILN_F32 ? ones_augmented(x, x2) : NULL;
    if (xa) { /* x's rows carry a ones column: [dW | db] = g^T [x | 1], one product */
      kiln_tensor *dWa = product(view2(g2, true), NULL, xa, NULL, KILN_F32); /* (N, K + 8) */
      if (dWa && dWa->dtype == KILN_F32) {
        dW = kiln_contiguous(kiln_narrow(dWa, 1, 0, K));
        db = kiln_contiguous(kiln_select(dWa, 1, K));
      }
    }
    if (!dW || !db) dW = product(view2(g2, true), y2 ? &mT : NULL, x2, sum_b ? &db : NULL, odt);
    kiln_status st = dW ? KILN_OK : kiln_last_error();
    if (st == KILN_OK && n->needs[1]) st = kiln__give_grad(&gi[1], dW, g);
    if (st == KILN_OK && sum_b) st = kiln__give_grad(&gi[2], db, g);
    if (st != KILN_OK) return st;
  }
  return KILN_OK;
}

/* The rule's products run as kernels, not ops: the observers see them as one event,
** "linear_backward" with inputs (g, x, W) and the gradients it made (dx, dW, db): a row of
** the profiler (KILN_PROFILE) and the anomaly check of the gradients. */
static const kiln__op op_linear_backward_span = {.name = "linear_backward", .api = "kiln_linear (backward)"};

static kiln_status linear_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  kiln__span sp;
  kiln_tensor *in[3] = {g, n->saved[0], n->saved[1]};
  kiln__span_begin(&sp, &op_linear_backward_span, 3, in);
  kiln_status st = linear_backward_run(n, g, gi);
  return kiln__span_end(&sp, 3, gi, st);
}

/* Inputs (x, weight, bias): bias may be NULL. */
static kiln_status linear_infer(kiln__op_ctx *c) {
  const char *who = c->op->api;
  kiln_tensor *x = c->in[0], *weight = c->in[1], *bias = c->in[2];
  if (check_float_pair(who, x, weight) != KILN_OK) return kiln_last_error();
  if (bias && bias->dtype != x->dtype)
    return kiln_set_error(KILN_ERR_DTYPE, "%s: bias is %s but input and weight are %s", who,
                          kiln_dtype_name(bias->dtype), kiln_dtype_name(x->dtype));
  if (weight->ndim != 2 || x->ndim == 0)
    return kiln_set_error(KILN_ERR_SHAPE, "%s: expected input (..., in) and weight (out, in), got %s and %s", who,
                          kiln__tshape(x), kiln__tshape(weight));
  int64_t N = weight->shape[0], K = weight->shape[1];
  if (x->shape[x->ndim - 1] != K)
    return kiln_set_error(KILN_ERR_SHAPE, "%s: input %s and weight %s cannot be multiplied (%lld != %lld)", who,
                          kiln__tshape(x), kiln__tshape(weight), (long long)x->shape[x->ndim - 1], (long long)K);
  if (bias && (bias->ndim != 1 || bias->shape[0] != N))
    return kiln_set_error(KILN_ERR_SHAPE, "%s: bias %s does not match weight %s (expected [%lld])", who,
                          kiln__tshape(bias), kiln__tshape(weight), (long long)N);
  kiln__op_meta_like(c, 0, x, x->dtype);
  c->meta[0].shape[x->ndim - 1] = N;
  return KILN_OK;
}

/* y = x @ W^T + bias, then ReLU for linear_relu: one MATMUL call either way. */
static kiln_status linear_forward(kiln__op_ctx *c) {
  kiln_tensor *x = c->in[0], *weight = c->in[1], *bias = c->in[2], *out = c->out[0];
  int64_t N = weight->shape[0], K = weight->shape[1];
  int64_t M = 1;
  for (int d = 0; d < x->ndim - 1; d++) M *= x->shape[d];
  kiln__view A, B, C;
  int64_t mst = 0;
  /* W^T is W with its strides swapped. */
  int64_t wsh[2] = {K, N}, wst[2] = {weight->strides[1], weight->strides[0]};
  if (x->ndim == 1 || leading_mergeable(x, &mst)) {
    /* One plain 2-D GEMM: M = prod(leading dims). */
    if (x->ndim == 1) mst = 0;
    int64_t xsh[2] = {M, K}, xst[2] = {mst, x->strides[x->ndim - 1]};
    int64_t csh[2] = {M, N}, cst[2] = {N, 1};
    A = view_as(x, 2, xsh, xst);
    B = view_as(weight, 2, wsh, wst);
    C = view_as(out, 2, csh, cst);
  } else {
    /* Leading dims that do not merge: a batched product with W^T broadcast (stride 0). */
    int nd = x->ndim;
    int64_t bsh[KILN_MAX_DIMS], bst[KILN_MAX_DIMS];
    for (int d = 0; d < nd - 2; d++) bsh[d] = x->shape[d], bst[d] = 0;
    bsh[nd - 2] = K, bst[nd - 2] = wst[0], bsh[nd - 1] = N, bst[nd - 1] = wst[1];
    A = kiln__view_of(x);
    B = view_as(weight, nd, bsh, bst);
    C = kiln__view_of(out);
  }
  return run_matmul(c->device, A, B, C, bias, c->op == &op_linear_relu);
}

static void linear_save(kiln__op_ctx *c, kiln__node *n) {
  kiln__node_save(n, 0, c->in[0]);
  kiln__node_save(n, 1, c->in[1]);
  if (c->op == &op_linear_relu) kiln__node_save_output(n, 2);
  if (c->op == &op_linear_gelu) kiln__node_save(n, 2, c->tmp[0]); /* z, the pre-activation */
}

/* linear_gelu: z = x W^T + b, y = gelu_tanh(z) (GPT-2's c_fc and its GELU). z is made
** here (tmp[0]) and saved for the backward, which is g gelu_tanh'(z) then linear's rule:
** the unfused pair saves the same two tensors (linear its input, GELU z). Where the
** device has LINEAR_GELU for a 2-d problem, one call writes y and z (CUDA: a cuBLASLt
** epilogue, no pass over memory for the bias or the GELU); elsewhere, the CPU included,
** MATMUL into z and GELU_TANH from z to y, the reference the fused kernel is tested
** against. */
static kiln_status linear_gelu_forward(kiln__op_ctx *c) {
  kiln_tensor *x = c->in[0], *weight = c->in[1], *bias = c->in[2], *y = c->out[0];
  kiln_device dev = c->device;
  /* z is saved for the backward: a call that records no node (eval, generation, a
  ** checkpoint's forward) has the fused kernel write y alone (n_out 1) */
  const bool keep_z = c->records;
  kiln_tensor *z = NULL;
  if (keep_z && !(z = c->tmp[0] = kiln__tensor_new(y->ndim, y->shape, y->dtype, dev))) return kiln_last_error();
  int64_t N = weight->shape[0], K = weight->shape[1];
  int64_t M = 1;
  for (int d = 0; d < x->ndim - 1; d++) M *= x->shape[d];
  if (M * N == 0) return KILN_OK;
  int64_t mst = 0;
  int64_t wsh[2] = {K, N}, wst[2] = {weight->strides[1], weight->strides[0]};
  int64_t csh[2] = {M, N}, cst[2] = {N, 1};
  kiln__view A, B = view_as(weight, 2, wsh, wst), Y = view_as(y, 2, csh, cst), Z = {0};
  if (z) Z = view_as(z, 2, csh, cst);
  if (x->ndim == 1 || leading_mergeable(x, &mst)) {
    if (x->ndim == 1) mst = 0;
    int64_t xsh[2] = {M, K}, xst[2] = {mst, x->strides[x->ndim - 1]};
    A = view_as(x, 2, xsh, xst);
  } else { /* leading dims that do not merge: a contiguous copy (no node: this op's covers it) */
    bool prev = kiln_set_grad_enabled(false);
    kiln_tensor *xc = kiln_contiguous(x);
    kiln_set_grad_enabled(prev);
    if (!xc) return kiln_last_error();
    int64_t xsh[2] = {M, K}, xst[2] = {K, 1};
    A = view_as(xc, 2, xsh, xst);
  }
  kiln__kargs a = {0};
  a.op = KILN__K_LINEAR_GELU;
  a.n_in = bias ? 3 : 2;
  a.in[0] = A;
  a.in[1] = B;
  if (bias) a.in[2] = kiln__view_of(bias);
  a.n_out = z ? 2 : 1;
  a.out[0] = Y;
  if (z) a.out[1] = Z;
  a.i[0] = kiln_matmul_tf32() ? 1 : 0;
  /* KILN_LINEAR_GELU=0 always composes (an A/B switch for the benchmarks) */
  static int off = -1;
  if (off < 0) {
    off = !kiln__knob_on("KILN_LINEAR_GELU", true);
  }
  if (!off && K > 0 && kiln__dispatch_has(dev, &a, KILN__K_LINEAR_GELU)) return kiln__dispatch(dev, &a);
  if (!z) { /* composed: z a temporary here too */
    if (!(z = c->tmp[0] = kiln__tensor_new(y->ndim, y->shape, y->dtype, dev))) return kiln_last_error();
    Z = view_as(z, 2, csh, cst);
  }
  kiln_status st = run_matmul(dev, A, B, Z, bias, false);
  if (st != KILN_OK) return st;
  kiln__kargs g = {0};
  g.op = KILN__K_GELU_TANH;
  g.n_in = g.n_out = 1;
  g.in[0] = Z;
  g.out[0] = Y;
  return kiln__dispatch(dev, &g);
}

/* Kernels: MATMUL; COPY / FILL for the bias or zeros when K is 0 (and RELU then). */
static const kiln__op op_linear = {
    .name = "linear", .api = "kiln_linear", .n_in = 3, .n_out = 1, .optional = 1u << 2,
    .flags = KILN__OP_GRAD_MASK | KILN__OP_RULE_READS_INPUTS | KILN__OP_PRODUCT,
    .amp = KILN__AMP_LOWER, .n_kernels = 3, .kernels = {KILN__K_MATMUL, KILN__K_COPY, KILN__K_FILL},
    .infer = linear_infer, .forward = linear_forward, .backward = linear_backward, .n_saved = 3,
    .save = linear_save};

static const kiln__op op_linear_relu = {
    .name = "linear_relu", .api = "kiln_linear_relu", .n_in = 3, .n_out = 1, .optional = 1u << 2,
    .amp = KILN__AMP_LOWER, .n_kernels = 4,
    .kernels = {KILN__K_MATMUL, KILN__K_COPY, KILN__K_FILL, KILN__K_RELU}, .infer = linear_infer,
    .forward = linear_forward, .backward = linear_backward, .n_saved = 3, .save = linear_save,
    .expands_to = (const char *const[]){"linear", "relu", NULL}};

/* Kernels: LINEAR_GELU where the device has it; else MATMUL (COPY / FILL when K is 0)
** and GELU_TANH. */
static const kiln__op op_linear_gelu = {
    .name = "linear_gelu", .api = "kiln_linear_gelu", .n_in = 3, .n_out = 1, .optional = 1u << 2,
    .amp = KILN__AMP_LOWER, .n_kernels = 4,
    .kernels = {KILN__K_LINEAR_GELU, KILN__K_MATMUL, KILN__K_GELU_TANH, KILN__K_FILL}, .infer = linear_infer,
    .forward = linear_gelu_forward, .backward = linear_backward, .n_saved = 3, .save = linear_save,
    .expands_to = (const char *const[]){"linear", "gelu_tanh", NULL}};

kiln_tensor *kiln_linear(kiln_tensor *x, kiln_tensor *weight, kiln_tensor *bias) {
  kiln_tensor *in[3] = {x, weight, bias};
  return kiln__op_call(&op_linear, 3, in, NULL, NULL);
}

kiln_tensor *kiln_linear_relu(kiln_tensor *x, kiln_tensor *weight, kiln_tensor *bias) {
  kiln_tensor *in[3] = {x, weight, bias};
  return kiln__op_call(&op_linear_relu, 3, in, NULL, NULL);
}

kiln_tensor *kiln_linear_gelu(kiln_tensor *x, kiln_tensor *weight, kiln_tensor *bias) {
  kiln_tensor *in[3] = {x, weight, bias};
  return kiln__op_call(&op_linear_gelu, 3, in, NULL, NULL);
}
