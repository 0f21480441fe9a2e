/*
** Fused optimizer updates: one kernel per parameter instead of a dozen elementwise ops.
** Both entry points are in-place ops on the one call path (op.h, KILN__OP_INPLACE): their
** record names Adam's hyperparameters, infer makes every check before anything moves, and
** forward runs the kernels. The path's own same-device check is off (KILN__OP_ANY_DEVICE)
** and every input is optional to it: adam_check reports NULL tensors, devices and step_t
** with the messages it always gave.
*/
#include "ops/op.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* kiln_adam_step_ with the found-inf flag (the op's 7th input); defined with the op. */
static kiln_status adam_step_call(kiln_tensor *param, kiln_tensor *grad, kiln_tensor *exp_avg,
                                  kiln_tensor *exp_avg_sq, kiln_tensor *max_exp_avg_sq, double lr,
                                  double beta1, double beta2, double eps, double weight_decay,
                                  int64_t step, bool decoupled, bool amsgrad, kiln_tensor *step_t,
                                  kiln_tensor *found_inf);

/* The checks every Adam entry point makes of one parameter's tensors; *step is set to 1
** when step_t carries the count. who names the caller. */
static kiln_status adam_check(const char *who, kiln_tensor *param, kiln_tensor *grad,
                              kiln_tensor *exp_avg, kiln_tensor *exp_avg_sq,
                              kiln_tensor *max_exp_avg_sq, bool amsgrad, kiln_tensor *step_t,
                              kiln_tensor *found_inf, int64_t *step) {
  kiln_tensor *ts[5] = {param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq};
  int n = amsgrad ? 5 : 4;
  for (int i = 0; i < n; i++)
    if (!ts[i]) {
      if (kiln_last_error() == KILN_OK)
        kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: tensor %d is NULL", who, i);
      return kiln_last_error();
    }
  if (param->requires_grad && kiln_grad_enabled())
    return kiln_set_error(KILN_ERR_AUTOGRAD, "%s: grad mode is on (wrap the step in kiln_set_grad_enabled(false))", who);
  if (kiln__same_device(who, n, ts) != KILN_OK) return kiln_last_error();
  if (!kiln_dtype_is_float(param->dtype))
    return kiln_set_error(KILN_ERR_DTYPE, "%s: parameter is %s, not a floating dtype", who, kiln_dtype_name(param->dtype));
  for (int i = 0; i < n; i++) {
    if (ts[i]->dtype != param->dtype || ts[i]->ndim != param->ndim ||
        memcmp(ts[i]->shape, param->shape, (size_t)param->ndim * sizeof(int64_t)) != 0)
      return kiln_set_error(KILN_ERR_SHAPE, "%s: tensor %d is %s %s; the parameter is %s %s", who, i,
                            kiln_dtype_name(ts[i]->dtype), kiln__tshape(ts[i]), kiln_dtype_name(param->dtype),
                            kiln__tshape(param));
    if (!kiln_is_contiguous(ts[i]))
      return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: tensor %d is not contiguous", who, i);
  }
  if (step_t) {
    if (step_t->dtype != KILN_F64 || kiln_numel(step_t) != 1 ||
        !kiln_device_equal(kiln_device_of(step_t), kiln_device_of(param)))
      return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                            "%s: step_t must be one float64 element on %s", who,
                            kiln__device_cstr(kiln_device_of(param)));
    *step = 1; /* unused by the kernel */
  }
  if (found_inf && (found_inf->dtype != KILN_F32 || kiln_numel(found_inf) != 1 ||
                    !kiln_device_equal(kiln_device_of(found_inf), kiln_device_of(param))))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: found_inf must be one float32 element on %s", who,
                          kiln__device_cstr(kiln_device_of(param)));
  if (found_inf && !step_t)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                          "%s: found_inf needs the step on the device (step_t): a host step count cannot "
                          "tell whether the step was skipped", who);
  if (*step < 1) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: step must be >= 1, got %lld", who, (long long)*step);
  return KILN_OK;
}

/* ADAM's scalars and flags, shared by the single and the list kernel. */
static void adam_scalars(kiln__kargs *a, double lr, double beta1, double beta2, double eps,
                         double weight_decay, bool decoupled, bool amsgrad, bool on_device,
                         bool found_inf) {
  a->s[0] = lr;
  a->s[1] = beta1;
  a->s[2] = beta2;
  a->s[3] = eps;
  a->i[1] = (decoupled ? 1 : 0) | (amsgrad ? 2 : 0) | (on_device ? 4 : 0) | (found_inf ? 8 : 0);
  memcpy(&a->i[2], &weight_decay, sizeof weight_decay);
}

/* The update of one parameter, its arguments checked (adam_check). */
static kiln_status adam_step(kiln_tensor *param, kiln_tensor *grad, kiln_tensor *exp_avg,
                             kiln_tensor *exp_avg_sq, kiln_tensor *max_exp_avg_sq, double lr,
                             double beta1, double beta2, double eps, double weight_decay,
                             int64_t step, bool decoupled, bool amsgrad, kiln_tensor *step_t,
                             kiln_tensor *found_inf) {
  kiln__kargs a = {0};
  a.op = KILN__K_ADAM;
  a.n_in = 1;
  a.in[0] = kiln__view_of(grad);
  a.n_out = amsgrad ? 4 : 3;
  a.out[0] = kiln__view_of(param);
  a.out[1] = kiln__view_of(exp_avg);
  a.out[2] = kiln__view_of(exp_avg_sq);
  if (amsgrad) a.out[3] = kiln__view_of(max_exp_avg_sq);
  adam_scalars(&a, lr, beta1, beta2, eps, weight_decay, decoupled, amsgrad, step_t != NULL, found_inf != NULL);
  a.i[0] = step;
  if (step_t) {
    a.n_in = 2;
    a.in[1] = kiln__view_of(step_t);
  }
  if (found_inf) a.in[a.n_in++] = kiln__view_of(found_inf);
  kiln_status st = kiln_numel(param) ? kiln__dispatch(kiln_device_of(param), &a) : KILN_OK;
  if (st != KILN_OK || !step_t) return st;
  if (found_inf) { /* step_t += (found_inf == 0), on the device: a skipped step does not count */
    kiln_scope_begin();
    kiln_tensor *ok = kiln_to_dtype(kiln_eq_scalar(found_inf, 0.0), KILN_F64);
    st = ok ? kiln_axpy_(step_t, 1.0, kiln_view(ok, 0, NULL)) : kiln_last_error();
    kiln_scope_end();
    return st;
  }
  /* step_t += 1, on the device, after the kernel read it (stream order) */
  kiln__kargs inc = {0};
  inc.op = KILN__K_AFFINE;
  inc.n_in = inc.n_out = 1;
  inc.in[0] = inc.out[0] = kiln__view_of(step_t);
  inc.s[0] = 1.0;
  inc.s[1] = 1.0;
  return kiln__dispatch(kiln_device_of(step_t), &inc);
}

/* ---- autocast's 16-bit copies, rewritten with the update ----
** A parameter autocast casts (an f32 leaf) keeps its 16-bit copy (t->amp_copy, autocast.c).
** The list kernels write the copy from the updated value in the same pass (one more store
** per element, no kernel), as the cast would convert it, and the copy is then stamped
** valid at the parameter's new version: autocast's next region uses it instead of casting.
** A parameter updated any other way (one tensor at a time, a backend without the list
** kernel, a skipped step still counts: nothing moved) keeps its old stamp, which the
** version bump of the in-place op has made stale. */
/* Not inside a graph capture: the graph would write the copy's memory on every replay,
** also after autocast had dropped that copy (its bytes reused by another tensor); the
** optimizer's in-place op has made the copy stale, so the next eager region casts. */
static bool has_copy(const kiln_tensor *p) {
  const kiln_tensor *c = p->amp_copy;
  return c && p->dtype == KILN_F32 && (c->dtype == KILN_BF16 || c->dtype == KILN_F16) &&
         kiln_numel(c) == kiln_numel(p) && kiln_is_contiguous(c) && kiln_is_contiguous(p) &&
         kiln_device_equal(kiln_device_of(c), kiln_device_of(p)) && !kiln__capturing(kiln_device_of(p));
}

/* The copy column of group j: the copy's view, or one with no data (nothing to write). */
static kiln__view copy_view(const kiln_tensor *p) {
  kiln__view v = kiln__view_of(p);
  if (!has_copy(p)) {
    v.data = NULL;
    return v;
  }
  return kiln__view_of(p->amp_copy);
}

/* After a list kernel wrote the copies: each is what a cast of the parameter gives now. */
static void stamp_copies(kiln_tensor *const *params, const int *idx, int m) {
  uint64_t epoch = kiln__write_epoch();
  for (int k = 0; k < m; k++) {
    kiln_tensor *p = params[idx[k]];
    if (!has_copy(p)) continue;
    p->amp_copy_version = kiln__storage_version(p->storage);
    p->amp_copy_epoch = epoch;
  }
}

/* Whether any of the n parameters has a copy to write; the list then carries the copy
** column. */
static bool any_copy(int n, kiln_tensor *const *params) {
  for (int j = 0; j < n; j++)
    if (params[j] && has_copy(params[j])) return true;
  return false;
}

/* A list kernel's call (ADAM_MULTI, SGD_MULTI; a->op and its scalars set): the found-inf
** flag as its one input, m groups of w views and their per-group integers. Dispatched,
** with the result in *st, when the device has the kernel for these arguments; false
** otherwise, and the caller runs the same tensors one at a time. */
static bool multi_dispatch(kiln_device dev, kiln__kargs *a, kiln_tensor *found_inf, int m, int w,
                           const kiln__view *list, const int64_t *li, kiln_status *st) {
  if (found_inf) {
    a->n_in = 1;
    a->in[0] = kiln__view_of(found_inf);
  }
  a->list_n = m;
  a->list_w = w;
  a->list = list;
  a->list_i = li;
  if (!kiln__dispatch_has(dev, a, a->op)) return false;
  *st = kiln__dispatch(dev, a);
  return true;
}

/* multi_dispatch with autocast's copy column (copy_flag set in a->i[1]; the last view of
** each group). A backend whose list kernel does not take the column (Vulkan) gets the
** list without it, rather than one call per tensor: its copies stay unstamped (stale), and
** autocast casts. *copied says whether the copies were written. list is compacted in place
** then. */
static bool multi_dispatch_copies(kiln_device dev, kiln__kargs *a, kiln_tensor *found_inf, int m, int w,
                                  kiln__view *list, const int64_t *li, int64_t copy_flag, bool *copied,
                                  kiln_status *st) {
  *copied = false;
  if (!(a->i[1] & copy_flag)) return multi_dispatch(dev, a, found_inf, m, w, list, li, st);
  if (multi_dispatch(dev, a, found_inf, m, w, list, li, st)) {
    *copied = true;
    return true;
  }
  for (int g = 0; g < m; g++) /* drop each group's last view (dest <= src: in order) */
    memmove(&list[(size_t)g * (size_t)(w - 1)], &list[(size_t)g * (size_t)w], (size_t)(w - 1) * sizeof *list);
  a->i[1] &= ~copy_flag;
  return multi_dispatch(dev, a, found_inf, m, w - 1, list, li, st);
}

/* A list step's host buffers for n tensors: up to n groups of w views (list) and an
** integer per group (li), each group's tensor (idx), and which tensors are listed (done). */
typedef struct multi_lists {
  kiln__view *list;
  int64_t *li;
  int *idx; /* list group -> tensor */
  unsigned char *done;
} multi_lists;

static kiln_status multi_lists_new(multi_lists *L, int n, int w, const char *who) {
  size_t cap = (size_t)(n > 0 ? n : 1);
  L->list = malloc(cap * (size_t)w * sizeof *L->list);
  L->li = malloc(cap * sizeof *L->li);
  L->idx = malloc(cap * sizeof *L->idx);
  L->done = calloc(cap, 1);
  return L->list && L->li && L->idx && L->done ? KILN_OK
                                               : kiln_set_error(KILN_ERR_OOM, "%s: out of host memory", who);
}

static void multi_lists_free(multi_lists *L) {
  free(L->list);
  free(L->li);
  free(L->idx);
  free(L->done);
}

/* The tensors not yet listed that share params[i]'s device and dtype, in order, into
** L->idx (marked done); their count. Empty tensors stay in: their step_t advances too. */
static int multi_group(multi_lists *L, int n, kiln_tensor *const *params, int i) {
  kiln_device dev = kiln_device_of(params[i]);
  kiln_dtype dt = params[i]->dtype;
  int m = 0;
  for (int j = i; j < n; j++) {
    if (L->done[j] || params[j]->dtype != dt || !kiln_device_equal(kiln_device_of(params[j]), dev)) continue;
    L->done[j] = 1;
    L->idx[m++] = j;
  }
  return m;
}

/* The list form: the tensors of one device and dtype go to one ADAM_MULTI call (the
** backend splits it into launches as it needs); a backend without the list kernel gets
** kiln_adam_step_ per tensor, which gives the same numbers. Its arguments are checked
** (adam_multi_infer). */
static kiln_status adam_multi_step(int n, kiln_tensor *const *params, kiln_tensor *const *grads,
                                   kiln_tensor *const *exp_avg, kiln_tensor *const *exp_avg_sq,
                                   kiln_tensor *const *max_exp_avg_sq, const int64_t *steps,
                                   kiln_tensor *const *step_t, double lr, double beta1,
                                   double beta2, double eps, double weight_decay, bool decoupled,
                                   bool amsgrad, kiln_tensor *found_inf) {
  static const char who[] = "kiln_adam_multi_step_";
  const bool copies = any_copy(n, params);
  const int w = 4 + (amsgrad ? 1 : 0) + (step_t ? 1 : 0) + (copies ? 1 : 0);
  const int wc = w - (copies ? 1 : 0); /* the copy is the last column, after step_t */
  multi_lists L;
  kiln_status st = multi_lists_new(&L, n, w, who);
  kiln__view *list = L.list;
  int64_t *li = L.li;
  const int *idx = L.idx;
  for (int i = 0; i < n && st == KILN_OK; i++) {
    if (L.done[i]) continue;
    kiln_device dev = kiln_device_of(params[i]);
    int m = multi_group(&L, n, params, i);
    for (int k = 0; k < m; k++) {
      int j = idx[k];
      kiln__view *g = &list[(size_t)k * (size_t)w];
      g[0] = kiln__view_of(grads[j]);
      g[1] = kiln__view_of(params[j]);
      g[2] = kiln__view_of(exp_avg[j]);
      g[3] = kiln__view_of(exp_avg_sq[j]);
      if (amsgrad) g[4] = kiln__view_of(max_exp_avg_sq[j]);
      if (step_t) g[wc - 1] = kiln__view_of(step_t[j]);
      if (copies) g[w - 1] = copy_view(params[j]);
      li[k] = step_t ? 1 : steps[j];
    }
    kiln__kargs a = {0};
    a.op = KILN__K_ADAM_MULTI;
    adam_scalars(&a, lr, beta1, beta2, eps, weight_decay, decoupled, amsgrad, step_t != NULL, found_inf != NULL);
    if (copies) a.i[1] |= 16;
    bool copied;
    if (multi_dispatch_copies(dev, &a, found_inf, m, w, list, li, 16, &copied, &st)) {
      if (st == KILN_OK && copied) stamp_copies(params, idx, m);
      continue;
    }
    for (int k = 0; k < m && st == KILN_OK; k++) { /* the same tensors, one at a time */
      int j = idx[k];
      st = adam_step_call(params[j], grads[j], exp_avg[j], exp_avg_sq[j],
                          amsgrad ? max_exp_avg_sq[j] : NULL, lr, beta1, beta2, eps, weight_decay,
                          li[k], decoupled, amsgrad, step_t ? step_t[j] : NULL, found_inf);
    }
  }
  multi_lists_free(&L);
  return st;
}

/* ---- the ops ---- */
/* Adam's hyperparameters (torch.optim.Adam's names). step is the single form's count
** (unused with step_t); steps, n and has_step_t are not attributes: the list form's
** per-tensor counts (NULL when it has step_t), its tensor count (its inputs are the six
** lists, n each) and whether its step_t list was given (it wins over steps, as before). */
typedef struct attrs_adam {
  double lr, beta1, beta2, eps, weight_decay;
  bool amsgrad, decoupled;
  int64_t step;
  const int64_t *steps;
  int n;
  bool has_step_t;
} attrs_adam;
static const kiln__attr_field f_adam[] = {
    KILN__FIELD(attrs_adam, lr, KILN__A_FLOAT),           KILN__FIELD(attrs_adam, beta1, KILN__A_FLOAT),
    KILN__FIELD(attrs_adam, beta2, KILN__A_FLOAT),        KILN__FIELD(attrs_adam, eps, KILN__A_FLOAT),
    KILN__FIELD(attrs_adam, weight_decay, KILN__A_FLOAT), KILN__FIELD(attrs_adam, amsgrad, KILN__A_BOOL),
    KILN__FIELD(attrs_adam, decoupled, KILN__A_BOOL),     KILN__FIELD(attrs_adam, step, KILN__A_INT)};

/* inputs: param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq (amsgrad), step_t (capturable),
** found_inf (loss scaling: skip on the device when set) */
static kiln_status adam_infer(kiln__op_ctx *c) {
  const attrs_adam *p = c->attrs;
  kiln_tensor *const *in = c->in;
  int64_t step = p->step;
  kiln_status cs = adam_check(c->op->api, in[0], in[1], in[2], in[3], in[4], p->amsgrad, in[5], in[6], &step);
  c->scratch[0] = (uint64_t)step; /* the count the kernel gets (1 with step_t) */
  return cs;
}
static kiln_status adam_forward(kiln__op_ctx *c) {
  const attrs_adam *p = c->attrs;
  kiln_tensor *const *in = c->in;
  return adam_step(in[0], in[1], in[2], in[3], in[4], p->lr, p->beta1, p->beta2, p->eps, p->weight_decay,
                   (int64_t)c->scratch[0], p->decoupled, p->amsgrad, in[5], in[6]);
}

/* inputs: the lists params, grads, exp_avg, exp_avg_sq, max_exp_avg_sq, step_t, n each
** (the last two all NULL when not used), then found_inf (NULL when not used) */
#define ADAM_LIST(c, k) ((c)->in + (size_t)(k) * (size_t)((const attrs_adam *)(c)->attrs)->n)
static kiln_status adam_multi_infer(kiln__op_ctx *c) {
  const attrs_adam *p = c->attrs;
  kiln_tensor *const *params = ADAM_LIST(c, 0), *const *grads = ADAM_LIST(c, 1);
  kiln_tensor *const *exp_avg = ADAM_LIST(c, 2), *const *exp_avg_sq = ADAM_LIST(c, 3);
  kiln_tensor *const *max_exp_avg_sq = ADAM_LIST(c, 4), *const *step_t = ADAM_LIST(c, 5);
  for (int i = 0; i < p->n; i++) { /* everything checked before anything moves */
    int64_t st = p->steps ? p->steps[i] : 1;
    kiln_status cs = adam_check(c->op->api, params[i], grads[i], exp_avg[i], exp_avg_sq[i],
                                p->amsgrad ? max_exp_avg_sq[i] : NULL, p->amsgrad, p->has_step_t ? step_t[i] : NULL,
                                c->in[6 * (size_t)p->n], &st);
    if (cs != KILN_OK) {
      char msg[512];
      snprintf(msg, sizeof msg, "%s", kiln_last_error_message());
      return kiln_set_error(cs, "%s (tensor %d)", msg, i);
    }
  }
  return KILN_OK;
}
static kiln_status adam_multi_forward(kiln__op_ctx *c) {
  const attrs_adam *p = c->attrs;
  return adam_multi_step(p->n, ADAM_LIST(c, 0), ADAM_LIST(c, 1), ADAM_LIST(c, 2), ADAM_LIST(c, 3),
                         p->amsgrad ? ADAM_LIST(c, 4) : NULL, p->steps, p->has_step_t ? ADAM_LIST(c, 5) : NULL, p->lr,
                         p->beta1, p->beta2, p->eps, p->weight_decay, p->decoupled, p->amsgrad,
                         c->in[6 * (size_t)p->n]);
}

static const kiln__op op_adam_step_ = {
    .name = "adam_step_", .api = "kiln_adam_step_", .n_in = 7, .n_out = 1, .optional = 0x7f,
    .flags = KILN__OP_INPLACE | KILN__OP_ANY_DEVICE, .n_kernels = 2, .kernels = {KILN__K_ADAM, KILN__K_AFFINE},
    .attrs = f_adam, .n_attrs = 8, .attr_size = sizeof(attrs_adam), .infer = adam_infer, .forward = adam_forward};
static const kiln__op op_adam_multi_step_ = {
    .name = "adam_multi_step_", .api = "kiln_adam_multi_step_", .n_in = KILN__OP_VARIADIC, .n_out = 1,
    .optional = 0xffffffffu, .flags = KILN__OP_INPLACE | KILN__OP_ANY_DEVICE, .n_kernels = 3,
    .kernels = {KILN__K_ADAM_MULTI, KILN__K_ADAM, KILN__K_AFFINE}, .attrs = f_adam, .n_attrs = 7,
    .attr_size = sizeof(attrs_adam), .infer = adam_multi_infer, .forward = adam_multi_forward};

kiln_status kiln_adam_step_(kiln_tensor *param, kiln_tensor *grad, kiln_tensor *exp_avg,
                            kiln_tensor *exp_avg_sq, kiln_tensor *max_exp_avg_sq, double lr,
                            double beta1, double beta2, double eps, double weight_decay,
                            int64_t step, bool decoupled, bool amsgrad, kiln_tensor *step_t) {
  return adam_step_call(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, lr, beta1, beta2, eps, weight_decay,
                        step, decoupled, amsgrad, step_t, NULL);
}

static kiln_status adam_step_call(kiln_tensor *param, kiln_tensor *grad, kiln_tensor *exp_avg,
                                  kiln_tensor *exp_avg_sq, kiln_tensor *max_exp_avg_sq, double lr,
                                  double beta1, double beta2, double eps, double weight_decay,
                                  int64_t step, bool decoupled, bool amsgrad, kiln_tensor *step_t,
                                  kiln_tensor *found_inf) {
  kiln_tensor *in[7] = {param, grad, exp_avg, exp_avg_sq, amsgrad ? max_exp_avg_sq : NULL, step_t, found_inf};
  attrs_adam p = {lr, beta1, beta2, eps, weight_decay, amsgrad, decoupled, step, NULL, 1, step_t != NULL};
  return kiln__op_call_status(&op_adam_step_, 7, in, &p);
}

/* The lists are laid end to end as the op's inputs (one host array for the call; the
** kernels' list is built in forward as before). */
kiln_status kiln_adam_multi_step_(int n, kiln_tensor *const *params, kiln_tensor *const *grads,
                                  kiln_tensor *const *exp_avg, kiln_tensor *const *exp_avg_sq,
                                  kiln_tensor *const *max_exp_avg_sq, const int64_t *steps,
                                  kiln_tensor *const *step_t, double lr, double beta1,
                                  double beta2, double eps, double weight_decay, bool decoupled,
                                  bool amsgrad) {
  return kiln_adam_multi_step_amp_(n, params, grads, exp_avg, exp_avg_sq, max_exp_avg_sq, steps, step_t, lr, beta1,
                                   beta2, eps, weight_decay, decoupled, amsgrad, NULL);
}

kiln_status kiln_adam_multi_step_amp_(int n, kiln_tensor *const *params, kiln_tensor *const *grads,
                                      kiln_tensor *const *exp_avg, kiln_tensor *const *exp_avg_sq,
                                      kiln_tensor *const *max_exp_avg_sq, const int64_t *steps,
                                      kiln_tensor *const *step_t, double lr, double beta1, double beta2,
                                      double eps, double weight_decay, bool decoupled, bool amsgrad,
                                      kiln_tensor *found_inf) {
  static const char who[] = "kiln_adam_multi_step_";
  if (n < 0 || (n > 0 && (!params || !grads || !exp_avg || !exp_avg_sq || (amsgrad && !max_exp_avg_sq) ||
                          (!steps && !step_t))))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                          "%s: n must be >= 0 and the arrays given (max_exp_avg_sq with amsgrad; "
                          "steps or step_t)", who);
  kiln_tensor **in = malloc(((size_t)n * 6 + 1) * sizeof *in);
  if (!in) return kiln_set_error(KILN_ERR_OOM, "%s: out of host memory", who);
  in[6 * (size_t)n] = found_inf;
  for (int i = 0; i < n; i++) {
    in[i] = params[i];
    in[n + i] = grads[i];
    in[2 * n + i] = exp_avg[i];
    in[3 * n + i] = exp_avg_sq[i];
    in[4 * n + i] = amsgrad ? max_exp_avg_sq[i] : NULL;
    in[5 * n + i] = step_t ? step_t[i] : NULL;
  }
  attrs_adam p = {lr, beta1, beta2, eps, weight_decay, amsgrad, decoupled, 0, steps, n, step_t != NULL};
  kiln_status st = kiln__op_call_status(&op_adam_multi_step_, 6 * n + 1, in, &p);
  free(in);
  return st;
}

/* ---- loss scaling: unscale and check for inf/NaN ---- */
typedef struct attrs_unscale {
  double inv_scale;
  int n;
} attrs_unscale;
/* The multiplier: the device tensor inv_t (f32, one element) when given, else inv_scale. */
static const kiln__attr_field f_unscale[] = {KILN__FIELD(attrs_unscale, inv_scale, KILN__A_FLOAT)};

/* inputs: the n gradients (NULL entries skipped), then found_inf, then inv_scale as a
** tensor (NULL: the attribute) */
static kiln_status unscale_infer(kiln__op_ctx *c) {
  const attrs_unscale *p = c->attrs;
  kiln_tensor *fi = c->in[p->n], *inv = c->in[p->n + 1];
  if (!fi || fi->dtype != KILN_F32 || kiln_numel(fi) != 1)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: found_inf must be one float32 element", c->op->api);
  if (inv && (inv->dtype != KILN_F32 || kiln_numel(inv) != 1 ||
              !kiln_device_equal(kiln_device_of(inv), kiln_device_of(fi))))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: inv_scale must be one float32 element on %s", c->op->api,
                          kiln__device_cstr(kiln_device_of(fi)));
  for (int i = 0; i < p->n; i++) {
    kiln_tensor *g = c->in[i];
    if (!g) continue;
    if (!kiln_dtype_is_float(g->dtype))
      return kiln_set_error(KILN_ERR_DTYPE, "%s: gradient %d is %s, not floating", c->op->api, i, kiln_dtype_name(g->dtype));
    if (!kiln_is_contiguous(g))
      return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: gradient %d is not contiguous", c->op->api, i);
    if (!kiln_device_equal(kiln_device_of(g), kiln_device_of(fi)))
      return kiln_set_error(KILN_ERR_DEVICE, "%s: gradient %d is on %s, found_inf on %s", c->op->api, i,
                            kiln__device_cstr(kiln_device_of(g)), kiln__device_cstr(kiln_device_of(fi)));
  }
  return KILN_OK;
}

/* One list kernel for all the gradients (CUDA: one launch); a backend without it gets the
** same numbers from public ops per tensor, still without reading anything on the host:
** g *= inv_scale; found_inf = max(found_inf, any(g * 0 != 0)) (inf * 0 and NaN * 0 are NaN). */
static kiln_status unscale_forward(kiln__op_ctx *c) {
  const attrs_unscale *p = c->attrs;
  kiln_tensor *fi = c->in[p->n], *inv = c->in[p->n + 1];
  kiln_device dev = kiln_device_of(fi);
  kiln__view *list = malloc((size_t)(p->n > 0 ? p->n : 1) * sizeof *list);
  if (!list) return kiln_set_error(KILN_ERR_OOM, "%s: out of host memory", c->op->api);
  int m = 0;
  for (int i = 0; i < p->n; i++)
    if (c->in[i] && kiln_numel(c->in[i]) > 0) list[m++] = kiln__view_of(c->in[i]);
  kiln__kargs a = {0};
  a.op = KILN__K_AMP_UNSCALE;
  a.n_out = 1;
  a.out[0] = kiln__view_of(fi);
  a.s[0] = p->inv_scale;
  if (inv) {
    a.n_in = 1;
    a.in[0] = kiln__view_of(inv);
  }
  a.list_n = m;
  a.list_w = 1;
  a.list = list;
  kiln_status st = KILN_OK;
  if (m == 0) {
    /* nothing to do */
  } else if (kiln__dispatch_has(dev, &a, KILN__K_AMP_UNSCALE)) {
    st = kiln__dispatch(dev, &a);
  } else {
    for (int i = 0; i < p->n && st == KILN_OK; i++) {
      kiln_tensor *g = c->in[i];
      if (!g || kiln_numel(g) == 0) continue;
      kiln_scope_begin();
      st = inv ? kiln_copy_(g, kiln_mul(g, kiln_view(inv, 0, NULL))) : kiln_mul_scalar_(g, p->inv_scale);
      kiln_tensor *bad = st == KILN_OK ? kiln_amax(kiln_to_dtype(kiln_ne(kiln_mul_scalar(g, 0.0), kiln_zeros_like(g)),
                                                                 KILN_F32), g->ndim, (const int[]){0, 1, 2, 3, 4, 5, 6, 7}, false)
                                       : NULL;
      kiln_tensor *both = bad ? kiln_maximum(kiln_view(fi, 0, NULL), bad) : NULL;
      if (st == KILN_OK) st = both ? kiln_copy_(fi, both) : kiln_last_error();
      kiln_scope_end();
    }
  }
  free(list);
  return st;
}

static const kiln__op op_amp_unscale_ = {
    .name = "amp_unscale_", .api = "kiln_amp_unscale_", .n_in = KILN__OP_VARIADIC, .n_out = 1,
    .optional = 0xffffffffu, .flags = KILN__OP_INPLACE | KILN__OP_ANY_DEVICE, .n_kernels = 1,
    .kernels = {KILN__K_AMP_UNSCALE}, .attrs = f_unscale, .n_attrs = 1, .attr_size = sizeof(attrs_unscale),
    .infer = unscale_infer, .forward = unscale_forward};

static kiln_status amp_unscale_call(int n, kiln_tensor *const *grads, kiln_tensor *found_inf, double inv_scale,
                                    kiln_tensor *inv_t) {
  static const char who[] = "kiln_amp_unscale_";
  if (n < 0 || (n > 0 && !grads) || !found_inf)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: n must be >= 0, the gradients and found_inf given", who);
  kiln_tensor **in = malloc((size_t)(n + 2) * sizeof *in);
  if (!in) return kiln_set_error(KILN_ERR_OOM, "%s: out of host memory", who);
  for (int i = 0; i < n; i++) in[i] = grads[i];
  in[n] = found_inf;
  in[n + 1] = inv_t;
  attrs_unscale p = {inv_scale, n};
  kiln_status st = kiln__op_call_status(&op_amp_unscale_, n + 2, in, &p);
  free(in);
  return st;
}

kiln_status kiln_amp_unscale_(int n, kiln_tensor *const *grads, kiln_tensor *found_inf, double inv_scale) {
  return amp_unscale_call(n, grads, found_inf, inv_scale, NULL);
}

kiln_status kiln_amp_unscale_dev_(int n, kiln_tensor *const *grads, kiln_tensor *found_inf, kiln_tensor *inv_scale) {
  if (!inv_scale)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_amp_unscale_dev_: NULL inv_scale");
  return amp_unscale_call(n, grads, found_inf, 0.0, inv_scale);
}

/* ---- loss scaling: the scale's update on the device (torch._amp_update_scale_) ----
** One kernel (AMP_UPDATE_SCALE) where the backend has it; elsewhere the same rule from
** elementwise ops on one-element tensors (about a dozen, all queued, none read on the
** host). Either way a graph captures it. PyTorch's rule, in its order:
**   found_inf:  scale *= backoff; tracker = 0
**   else:       t = tracker + 1; t == interval ? (scale *= growth if that is finite; tracker = 0)
**                                              : tracker = t */
typedef struct attrs_update_scale {
  double growth_factor, backoff_factor;
  int64_t growth_interval;
} attrs_update_scale;
static const kiln__attr_field f_update_scale[] = {
    KILN__FIELD(attrs_update_scale, growth_factor, KILN__A_FLOAT),
    KILN__FIELD(attrs_update_scale, backoff_factor, KILN__A_FLOAT),
    KILN__FIELD(attrs_update_scale, growth_interval, KILN__A_INT)};

/* inputs: scale, growth_tracker, found_inf */
static kiln_status update_scale_infer(kiln__op_ctx *c) {
  const attrs_update_scale *p = c->attrs;
  const char *who = c->op->api;
  kiln_tensor *scale = c->in[0], *tracker = c->in[1], *found_inf = c->in[2];
  if (!scale || !tracker || !found_inf)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: NULL scale, growth_tracker or found_inf", who);
  if (scale->dtype != KILN_F32 || kiln_numel(scale) != 1 || found_inf->dtype != KILN_F32 || kiln_numel(found_inf) != 1 ||
      (tracker->dtype != KILN_F32 && tracker->dtype != KILN_F64) || kiln_numel(tracker) != 1)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                          "%s: scale and found_inf must be one float32 element, growth_tracker one float32 or "
                          "float64 element", who);
  kiln_device dev = kiln_device_of(scale);
  if (!kiln_device_equal(dev, kiln_device_of(tracker)) || !kiln_device_equal(dev, kiln_device_of(found_inf)))
    return kiln_set_error(KILN_ERR_DEVICE, "%s: scale, growth_tracker and found_inf must be on one device", who);
  if (p->growth_interval <= 0 || !(p->growth_factor > 0) || !(p->backoff_factor > 0))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: growth_interval %lld, growth %g, backoff %g out of range",
                          who, (long long)p->growth_interval, p->growth_factor, p->backoff_factor);
  return KILN_OK;
}

/* The rule from elementwise ops, for a backend without the kernel. */
static kiln_status update_scale_composed(kiln_tensor *scale, kiln_tensor *growth_tracker, kiln_tensor *found_inf,
                                         const attrs_update_scale *p) {
  kiln_device dev = kiln_device_of(scale);
  kiln_scope_begin();
  kiln_tensor *sc = kiln_view(scale, 0, NULL), *tr = kiln_view(growth_tracker, 0, NULL);
  kiln_tensor *bad = kiln_ne(kiln_view(found_inf, 0, NULL), kiln_scalar(0.0, KILN_F32, dev));
  kiln_tensor *zero_t = kiln_zeros_like(tr);
  kiln_tensor *t1 = kiln_add_scalar(tr, 1.0);
  kiln_tensor *clean_t1 = kiln_where(bad, zero_t, t1); /* 0 after a bad step, else tracker + 1 */
  kiln_tensor *grow = clean_t1 ? kiln_ge(clean_t1, kiln_full_like(clean_t1, (double)p->growth_interval)) : NULL;
  kiln_tensor *grown = kiln_mul_scalar(sc, p->growth_factor);
  kiln_tensor *grown_ok = grown ? kiln_where(kiln_eq(kiln_mul_scalar(grown, 0.0), kiln_zeros_like(grown)), grown, sc)
                                : NULL; /* inf * 0 is NaN: the growth would overflow, keep the scale */
  kiln_tensor *new_sc = kiln_where(bad, kiln_mul_scalar(sc, p->backoff_factor), kiln_where(grow, grown_ok, sc));
  kiln_tensor *new_tr = kiln_where(grow, zero_t, clean_t1);
  kiln_status st = new_sc && new_tr ? kiln_copy_(scale, new_sc) : kiln_last_error();
  if (st == KILN_OK) st = kiln_copy_(growth_tracker, new_tr);
  kiln_scope_end();
  return st;
}

static kiln_status update_scale_forward(kiln__op_ctx *c) {
  const attrs_update_scale *p = c->attrs;
  kiln_tensor *scale = c->in[0], *tracker = c->in[1], *found_inf = c->in[2];
  kiln__kargs a = {0};
  a.op = KILN__K_AMP_UPDATE_SCALE;
  a.n_in = 1;
  a.in[0] = kiln__view_of(found_inf);
  a.n_out = 2;
  a.out[0] = kiln__view_of(scale);
  a.out[1] = kiln__view_of(tracker);
  a.s[0] = p->growth_factor;
  a.s[1] = p->backoff_factor;
  a.i[0] = p->growth_interval;
  kiln_device dev = kiln_device_of(scale);
  if (kiln__dispatch_has(dev, &a, KILN__K_AMP_UPDATE_SCALE)) return kiln__dispatch(dev, &a);
  return update_scale_composed(scale, tracker, found_inf, p);
}

static const kiln__op op_amp_update_scale_ = {
    .name = "amp_update_scale_", .api = "kiln_amp_update_scale_", .n_in = 3, .n_out = 1, .optional = 0x7,
    .flags = KILN__OP_INPLACE | KILN__OP_ANY_DEVICE, .n_kernels = 1, .kernels = {KILN__K_AMP_UPDATE_SCALE},
    .attrs = f_update_scale, .n_attrs = 3, .attr_size = sizeof(attrs_update_scale), .infer = update_scale_infer,
    .forward = update_scale_forward};

kiln_status kiln_amp_update_scale_(kiln_tensor *scale, kiln_tensor *growth_tracker, kiln_tensor *found_inf,
                                   double growth_factor, double backoff_factor, int64_t growth_interval) {
  kiln_tensor *in[3] = {scale, growth_tracker, found_inf};
  attrs_update_scale p = {growth_factor, backoff_factor, growth_interval};
  bool prev = kiln_set_grad_enabled(false);
  kiln_status st = kiln__op_call_status(&op_amp_update_scale_, 3, in, &p);
  kiln_set_grad_enabled(prev);
  return st;
}

/* ---- SGD over a list of tensors (SGD_MULTI) ---- */
/* torch.optim.SGD's hyperparameters; first, n and the two presence flags are not
** attributes: the per-tensor first-step marks (host steps), the tensor count (the inputs
** are four lists of n, then found_inf) and whether the buffer and step_t lists hold
** tensors. */
typedef struct attrs_sgd {
  double lr, momentum, dampening, weight_decay;
  bool nesterov, maximize;
  const bool *first;
  int n;
  bool has_step_t;
} attrs_sgd;
static const kiln__attr_field f_sgd[] = {
    KILN__FIELD(attrs_sgd, lr, KILN__A_FLOAT),           KILN__FIELD(attrs_sgd, momentum, KILN__A_FLOAT),
    KILN__FIELD(attrs_sgd, dampening, KILN__A_FLOAT),    KILN__FIELD(attrs_sgd, weight_decay, KILN__A_FLOAT),
    KILN__FIELD(attrs_sgd, nesterov, KILN__A_BOOL),      KILN__FIELD(attrs_sgd, maximize, KILN__A_BOOL)};

#define SGD_LIST(c, k) ((c)->in + (size_t)(k) * (size_t)((const attrs_sgd *)(c)->attrs)->n)

/* inputs: the lists params, grads, momentum_buffers, step_t (n each; the last two all
** NULL when not used), then found_inf (NULL when not used) */
static kiln_status sgd_multi_infer(kiln__op_ctx *c) {
  const attrs_sgd *p = c->attrs;
  const char *who = c->op->api;
  kiln_tensor *const *params = SGD_LIST(c, 0), *const *grads = SGD_LIST(c, 1);
  kiln_tensor *const *bufs = SGD_LIST(c, 2), *const *step_t = SGD_LIST(c, 3);
  kiln_tensor *found_inf = c->in[4 * (size_t)p->n];
  const bool mom = p->momentum != 0;
  if (found_inf && !p->has_step_t)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                          "%s: found_inf needs the steps on the device (step_t): a host step count cannot "
                          "tell whether the step was skipped", who);
  if (found_inf && (found_inf->dtype != KILN_F32 || kiln_numel(found_inf) != 1))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: found_inf must be one float32 element", who);
  for (int i = 0; i < p->n; i++) { /* everything checked before anything moves */
    kiln_tensor *ts[4] = {params[i], grads[i], mom ? bufs[i] : NULL, p->has_step_t ? step_t[i] : NULL};
    const int nt = mom ? 3 : 2;
    for (int k = 0; k < nt; k++)
      if (!ts[k]) {
        if (kiln_last_error() == KILN_OK)
          kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: %s %d is NULL", who,
                         k == 0 ? "parameter" : k == 1 ? "gradient" : "momentum buffer", i);
        return kiln_last_error();
      }
    kiln_tensor *pa = params[i];
    if (pa->requires_grad && kiln_grad_enabled())
      return kiln_set_error(KILN_ERR_AUTOGRAD, "%s: grad mode is on (wrap the step in kiln_set_grad_enabled(false))", who);
    if (!kiln_dtype_is_float(pa->dtype))
      return kiln_set_error(KILN_ERR_DTYPE, "%s: parameter %d is %s, not a floating dtype", who, i,
                            kiln_dtype_name(pa->dtype));
    kiln_device dev = kiln_device_of(pa);
    for (int k = 0; k < nt; k++) {
      kiln_tensor *t = ts[k];
      if (!kiln_device_equal(kiln_device_of(t), dev))
        return kiln_set_error(KILN_ERR_DEVICE, "%s: tensor %d of parameter %d is on %s, the parameter on %s", who, k, i,
                              kiln__device_cstr(kiln_device_of(t)), kiln__device_cstr(dev));
      if (t->dtype != pa->dtype || t->ndim != pa->ndim ||
          memcmp(t->shape, pa->shape, (size_t)pa->ndim * sizeof(int64_t)) != 0)
        return kiln_set_error(KILN_ERR_SHAPE, "%s: tensor %d of parameter %d is %s %s; the parameter is %s %s", who, k,
                              i, kiln_dtype_name(t->dtype), kiln__tshape(t), kiln_dtype_name(pa->dtype),
                              kiln__tshape(pa));
      if (!kiln_is_contiguous(t))
        return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: tensor %d of parameter %d is not contiguous", who, k, i);
    }
    if (ts[3] && (ts[3]->dtype != KILN_F64 || kiln_numel(ts[3]) != 1 || !kiln_device_equal(kiln_device_of(ts[3]), dev)))
      return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: step_t %d must be one float64 element on %s", who, i,
                            kiln__device_cstr(dev));
    if (p->has_step_t && !ts[3])
      return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: step_t %d is NULL", who, i);
    if (found_inf && !kiln_device_equal(kiln_device_of(found_inf), dev))
      return kiln_set_error(KILN_ERR_DEVICE, "%s: found_inf is on %s, parameter %d on %s", who,
                            kiln__device_cstr(kiln_device_of(found_inf)), i, kiln__device_cstr(dev));
  }
  return KILN_OK;
}

/* The same update with elementwise ops, for a backend without SGD_MULTI: the composed
** rule's ops in its order (so its roundings), the new values selected on the device
** against found_inf, nothing read on the host. */
static kiln_status sgd_composed(const attrs_sgd *p, kiln_tensor *pa, kiln_tensor *g, kiln_tensor *b, bool first,
                                kiln_tensor *step_t, kiln_tensor *found_inf) {
  kiln_scope_begin();
  kiln_status st = KILN_OK;
  if (p->maximize) g = kiln_neg(g);
  if (g && p->weight_decay != 0) g = kiln_axpy(g, p->weight_decay, pa);
  kiln_tensor *bn = NULL;
  if (g && b) {
    if (step_t) {
      kiln_tensor *later = kiln_axpy(kiln_mul_scalar(b, p->momentum), 1.0 - p->dampening, g);
      kiln_tensor *is_first = kiln_eq_scalar(kiln_view(step_t, 0, NULL), 0.0);
      bn = later && is_first ? kiln_where(is_first, g, later) : NULL;
    } else {
      bn = first ? g : kiln_axpy(kiln_mul_scalar(b, p->momentum), 1.0 - p->dampening, g);
    }
    g = !bn ? NULL : p->nesterov ? kiln_axpy(g, p->momentum, bn) : bn;
  }
  kiln_tensor *pn = g ? kiln_axpy(pa, -p->lr, g) : NULL;
  if (!pn) st = kiln_last_error();
  kiln_tensor *bad = NULL;
  if (st == KILN_OK && found_inf &&
      !(bad = kiln_ne(kiln_view(found_inf, 0, NULL), kiln_scalar(0.0, KILN_F32, kiln_device_of(found_inf)))))
    st = kiln_last_error();
  kiln_tensor *now[2] = {pa, b}, *fresh[2] = {pn, bn};
  for (int k = 0; k < 2 && st == KILN_OK; k++)
    if (now[k]) st = kiln_copy_(now[k], bad ? kiln_where(bad, now[k], fresh[k]) : fresh[k]);
  if (st == KILN_OK && step_t) {
    kiln_tensor *inc = found_inf ? kiln_to_dtype(kiln_eq_scalar(kiln_view(found_inf, 0, NULL), 0.0), KILN_F64)
                                 : kiln_scalar(1.0, KILN_F64, kiln_device_of(step_t));
    st = inc ? kiln_axpy_(step_t, 1.0, inc) : kiln_last_error();
  }
  kiln_scope_end();
  return st;
}

/* The tensors of one device and dtype go to one SGD_MULTI call (the backend splits it
** into launches as it needs); a backend without it gets sgd_composed per tensor. */
static kiln_status sgd_multi_forward(kiln__op_ctx *c) {
  const attrs_sgd *p = c->attrs;
  const char *who = c->op->api;
  const int n = p->n;
  kiln_tensor *const *params = SGD_LIST(c, 0), *const *grads = SGD_LIST(c, 1);
  kiln_tensor *const *bufs = SGD_LIST(c, 2), *const *step_t = SGD_LIST(c, 3);
  kiln_tensor *found_inf = c->in[4 * (size_t)n];
  const bool mom = p->momentum != 0, on_dev = p->has_step_t;
  const bool copies = any_copy(n, params);
  const int w = 2 + (mom ? 1 : 0) + (on_dev ? 1 : 0) + (copies ? 1 : 0);
  const int wc = w - (copies ? 1 : 0); /* the copy is the last column, after step_t */
  multi_lists L;
  kiln_status st = multi_lists_new(&L, n, w, who);
  kiln__view *list = L.list;
  int64_t *li = L.li;
  const int *idx = L.idx;
  for (int i = 0; i < n && st == KILN_OK; i++) {
    if (L.done[i]) continue;
    kiln_device dev = kiln_device_of(params[i]);
    int m = multi_group(&L, n, params, i);
    for (int k = 0; k < m; k++) {
      int j = idx[k];
      kiln__view *g = &list[(size_t)k * (size_t)w];
      g[0] = kiln__view_of(grads[j]);
      g[1] = kiln__view_of(params[j]);
      if (mom) g[2] = kiln__view_of(bufs[j]);
      if (on_dev) g[wc - 1] = kiln__view_of(step_t[j]);
      if (copies) g[w - 1] = copy_view(params[j]);
      li[k] = p->first && p->first[j] ? 1 : 0;
    }
    kiln__kargs a = {0};
    a.op = KILN__K_SGD_MULTI;
    a.s[0] = p->lr;
    a.s[1] = p->momentum;
    a.s[2] = p->dampening;
    a.s[3] = p->weight_decay;
    a.i[1] = (p->nesterov ? 1 : 0) | (p->maximize ? 2 : 0) | (on_dev ? 4 : 0) | (found_inf ? 8 : 0) | (mom ? 16 : 0) |
             (copies ? 32 : 0);
    bool copied;
    if (multi_dispatch_copies(dev, &a, found_inf, m, w, list, li, 32, &copied, &st)) {
      if (st == KILN_OK && copied) stamp_copies(params, idx, m);
      continue;
    }
    for (int k = 0; k < m && st == KILN_OK; k++) { /* the same tensors, one at a time */
      int j = idx[k];
      st = sgd_composed(p, params[j], grads[j], mom ? bufs[j] : NULL, li[k] != 0, on_dev ? step_t[j] : NULL,
                        found_inf);
    }
  }
  multi_lists_free(&L);
  return st;
}

static const kiln__op op_sgd_multi_step_ = {
    .name = "sgd_multi_step_", .api = "kiln_sgd_multi_step_", .n_in = KILN__OP_VARIADIC, .n_out = 1,
    .optional = 0xffffffffu, .flags = KILN__OP_INPLACE | KILN__OP_ANY_DEVICE, .n_kernels = 1,
    .kernels = {KILN__K_SGD_MULTI}, .attrs = f_sgd, .n_attrs = 6, .attr_size = sizeof(attrs_sgd),
    .infer = sgd_multi_infer, .forward = sgd_multi_forward};

kiln_status kiln_sgd_multi_step_(int n, kiln_tensor *const *params, kiln_tensor *const *grads,
                                 kiln_tensor *const *momentum_buffers, const bool *first, kiln_tensor *const *step_t,
                                 double lr, double momentum, double dampening, double weight_decay, bool nesterov,
                                 bool maximize, kiln_tensor *found_inf) {
  static const char who[] = "kiln_sgd_multi_step_";
  if (n < 0 || (n > 0 && (!params || !grads || (momentum != 0 && !momentum_buffers))))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                          "%s: n must be >= 0 and the arrays given (momentum_buffers with a momentum)", who);
  if (!(lr >= 0) || !(momentum >= 0) || !(weight_decay >= 0) || dampening != dampening ||
      (nesterov && (momentum <= 0 || dampening != 0)))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                          "%s: lr %g, momentum %g and weight_decay %g must be >= 0, dampening a number (%g), and "
                          "nesterov needs a momentum and zero dampening", who, lr, momentum, weight_decay, dampening);
  kiln_tensor **in = malloc(((size_t)n * 4 + 1) * sizeof *in);
  if (!in) return kiln_set_error(KILN_ERR_OOM, "%s: out of host memory", who);
  in[4 * (size_t)n] = found_inf;
  for (int i = 0; i < n; i++) {
    in[i] = params[i];
    in[n + i] = grads[i];
    in[2 * n + i] = momentum != 0 ? momentum_buffers[i] : NULL;
    in[3 * n + i] = step_t ? step_t[i] : NULL;
  }
  attrs_sgd p = {lr, momentum, dampening, weight_decay, nesterov, maximize, first, n, step_t != NULL};
  kiln_status st = kiln__op_call_status(&op_sgd_multi_step_, 4 * n + 1, in, &p);
  free(in);
  return st;
}
