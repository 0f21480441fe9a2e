/*
** Custom autograd functions (kiln_function_apply): the program's forward runs inside the
** op call path (so traces and profiles see it under its own name) with grad mode off;
** the outputs then share one node whose rule calls the program's backward.
*/
#include "ops/op.h"

#include <stdlib.h>
#include <string.h>

struct kiln_function_ctx {
  const kiln_function *fn;
  void *state;
  void (*state_free)(void *);
  kiln_tensor **saved; /* forward: what kiln_function_save collected (refs held) */
  int n_saved, cap_saved;
  kiln__node *node;    /* backward: the node (saved tensors and needs live there) */
  int n_out;
  kiln_tensor **outputs;
};

kiln_status kiln_function_save(kiln_function_ctx *ctx, kiln_tensor *t) {
  if (!ctx || ctx->node)
    return kiln_set_error(KILN_ERR_STATE, "kiln_function_save: only inside a custom function's forward");
  if (!t) return kiln_last_error() != KILN_OK ? kiln_last_error()
                                             : kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_function_save: NULL tensor");
  if (ctx->n_saved == ctx->cap_saved) {
    int ncap = ctx->cap_saved ? ctx->cap_saved * 2 : 4;
    kiln_tensor **nv = realloc(ctx->saved, (size_t)ncap * sizeof *nv);
    if (!nv) return kiln_set_error(KILN_ERR_OOM, "kiln_function_save: out of host memory");
    ctx->saved = nv;
    ctx->cap_saved = ncap;
  }
  ctx->saved[ctx->n_saved++] = kiln_tensor_ref(t);
  return KILN_OK;
}

kiln_tensor *kiln_function_saved(kiln_function_ctx *ctx, int k) {
  if (!ctx || !ctx->node || k < 0 || k >= ctx->node->n_saved) return NULL;
  return ctx->node->saved[k];
}

void *kiln_function_state(kiln_function_ctx *ctx) { return ctx ? ctx->state : NULL; }

bool kiln_function_grad_needed(kiln_function_ctx *ctx, int k) {
  return ctx && ctx->node && k >= 0 && k < ctx->node->n_in && ctx->node->needs[k];
}

static void ctx_free(void *p) {
  kiln_function_ctx *ctx = p;
  if (!ctx) return;
  for (int k = 0; k < ctx->n_saved; k++) kiln_tensor_free(ctx->saved[k]);
  free(ctx->saved);
  if (ctx->state_free) ctx->state_free(ctx->state);
  free(ctx);
}

static kiln_status function_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  kiln_function_ctx *ctx = n->state;
  kiln_tensor *gouts_local[8], **gouts = gouts_local;
  kiln_tensor *user_local[8], **user = user_local;
  if (n->n_out > 8) gouts = calloc((size_t)n->n_out, sizeof *gouts);
  if (n->n_in > 8) user = calloc((size_t)n->n_in, sizeof *user);
  kiln_status st = gouts && user ? KILN_OK : kiln_set_error(KILN_ERR_OOM, "kiln_backward: out of host memory");
  if (st == KILN_OK) {
    gouts[0] = g;
    for (int k = 1; k < n->n_out; k++) gouts[k] = n->grad_outs[k];
    for (int k = 0; k < n->n_in; k++) user[k] = NULL;
    st = ctx->fn->backward(ctx, n->n_out, gouts, n->n_in, user);
    if (st != KILN_OK && kiln_last_error() == KILN_OK)
      kiln_set_error(st, "%s: the custom function's backward failed", n->name);
  }
  for (int k = 0; k < n->n_in && st == KILN_OK; k++) {
    kiln_tensor *r = user[k];
    if (!r || !n->needs[k]) continue;
    if (r->ndim != n->in_ndim[k] || memcmp(r->shape, n->in_shape[k], sizeof(int64_t) * (size_t)r->ndim) != 0) {
      st = kiln_set_error(KILN_ERR_SHAPE, "%s: backward gave a gradient of shape %s for input %d of shape %s",
                          n->name, kiln__tshape(r), k, kiln__shape_cstr(n->in_ndim[k], n->in_shape[k]));
      break;
    }
    if (r->dtype != n->in_dtype[k]) {
      bool prev = kiln_set_grad_enabled(false);
      r = kiln_to_dtype(r, n->in_dtype[k]);
      kiln_set_grad_enabled(prev);
    }
    st = kiln__give_grad(&gi[k], r, g);
  }
  if (st != KILN_OK)
    for (int k = 0; k < n->n_in; k++) {
      kiln_tensor_free(gi[k]);
      gi[k] = NULL;
    }
  if (gouts != gouts_local) free(gouts);
  if (user != user_local) free(user);
  return st;
}

static kiln_status function_forward(kiln__op_ctx *c) {
  kiln_function_ctx *ctx = (kiln_function_ctx *)c->attrs;
  bool prev = kiln_set_grad_enabled(false);
  for (int k = 0; k < ctx->n_out; k++) ctx->outputs[k] = NULL;
  kiln_status st = ctx->fn->forward(ctx, c->n_in, c->in, ctx->n_out, ctx->outputs);
  kiln_set_grad_enabled(prev);
  if (st != KILN_OK) {
    if (kiln_last_error() == KILN_OK) kiln_set_error(st, "%s: the custom function's forward failed", ctx->fn->name);
    return kiln_last_error();
  }
  for (int k = 0; k < ctx->n_out; k++) {
    kiln_tensor *o = ctx->outputs[k];
    if (!o)
      return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: forward left output %d NULL", ctx->fn->name, k);
    /* An input handed back, or anything with a history, gets a handle of its own, so
    ** the node goes on the output and not on what the program passed in. */
    if (o->requires_grad || o->grad_fn) {
      if (!(o = kiln__tensor_alias(o, true))) return kiln_last_error();
    }
    ctx->outputs[k] = c->out[k] = o;
  }
  c->n_out = ctx->n_out;
  if (!kiln__needs_grad(c->n_in, c->in)) return KILN_OK;
  bool any_float = false;
  for (int k = 0; k < ctx->n_out; k++) any_float = any_float || kiln_dtype_is_float(c->out[k]->dtype);
  if (!any_float) return KILN_OK;
  kiln__node *n = kiln__node_make(ctx->n_out, c->out, ctx->fn->name, function_backward, c->n_in, c->in,
                                  ctx->n_saved, NULL, 0);
  if (!n) return kiln_last_error();
  for (int k = 0; k < ctx->n_saved; k++) kiln__node_save(n, k, ctx->saved[k]);
  for (int k = 0; k < ctx->n_saved; k++) kiln_tensor_free(ctx->saved[k]);
  ctx->n_saved = 0;
  ctx->node = n;
  n->state = ctx;
  n->state_free = ctx_free;
  return KILN_OK;
}

kiln_status kiln_function_apply(const kiln_function *fn, void *state, void (*state_free)(void *), int n_in,
                                kiln_tensor *const *inputs, int n_out, kiln_tensor **outputs) {
  if (!fn || !fn->forward || !fn->backward || !fn->name || n_in < 0 || (n_in > 0 && !inputs) ||
      n_out < 1 || n_out > KILN__OP_MAX_OUT || !outputs) {
    if (state_free) state_free(state);
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                          "kiln_function_apply: needs a function with a name, forward and backward, "
                          "inputs, and 1 to %d outputs",
                          KILN__OP_MAX_OUT);
  }
  for (int k = 0; k < n_out; k++) outputs[k] = NULL;
  kiln_function_ctx *ctx = calloc(1, sizeof *ctx);
  if (!ctx) {
    if (state_free) state_free(state);
    return kiln_set_error(KILN_ERR_OOM, "kiln_function_apply: out of host memory");
  }
  ctx->fn = fn;
  ctx->state = state;
  ctx->state_free = state_free;
  ctx->n_out = n_out;
  ctx->outputs = outputs;
  /* The descriptor lives for this call only: the node keeps the name (fn's) and the rule
  ** (static), never the descriptor. */
  kiln__op op;
  memset(&op, 0, sizeof op);
  op.name = fn->name;
  op.api = fn->name;
  op.n_in = n_in;
  op.n_out = n_out;
  op.flags = KILN__OP_SELF_ALLOC | KILN__OP_NO_GRAD;
  op.forward = function_forward;
  kiln_status st = kiln__op_call_status(&op, n_in, inputs, ctx);
  if (!ctx->node) ctx_free(ctx); /* no node took it */
  if (st != KILN_OK)
    for (int k = 0; k < n_out; k++) outputs[k] = NULL;
  return st;
}
