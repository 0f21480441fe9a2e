/*
** Autograd nodes: one per recorded op output set, of any arity. A node is one allocation:
** the struct, then its per-input arrays (edges, needs, input shapes and dtypes), its saved
** tensor slots, its per-output slots and a copy of the op's attribute record, so that
** making a node costs one malloc whatever the op.
**
** Saved tensors are detached aliases (same storage, no grad_fn), so a node never owns a
** graph through what it saved: no reference cycles, and freeing a long chain needs no
** recursion through saved tensors.
*/
#include "core/kiln_int.h"
#include "ops/op.h"

#include <stdalign.h>
#include <stdlib.h>
#include <string.h>

static size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

kiln__node *kiln__node_make(int n_out, kiln_tensor *const *outs, const char *name, kiln__backward_fn fn,
                            int n_in, kiln_tensor *const *ins, int n_saved, const void *attrs,
                            size_t attr_size) {
  KILN__ASSERT(n_in >= 0 && n_out >= 1 && n_saved >= 0 && outs && outs[0]);
  /* layout: struct | in_shape[n_in] | next[n_in] | saved | outs_weak | grad_accs |
  ** grad_outs | attrs | in_ndim | in_dtype | needs (largest alignment first) */
  size_t off = align_up(sizeof(kiln__node), alignof(max_align_t));
  size_t o_shape = off;
  off += (size_t)n_in * sizeof(int64_t[KILN_MAX_DIMS]);
  size_t o_next = off;
  off += (size_t)n_in * sizeof(kiln__edge);
  size_t o_saved = off;
  off += (size_t)n_saved * sizeof(kiln_tensor *);
  size_t o_outs = off;
  off += (size_t)n_out * 3 * sizeof(kiln_tensor *);
  off = align_up(off, alignof(max_align_t));
  size_t o_attrs = off;
  off += align_up(attr_size, alignof(max_align_t));
  size_t o_ndim = off;
  off += (size_t)n_in * sizeof(int);
  size_t o_dtype = off;
  off += (size_t)n_in * sizeof(kiln_dtype);
  size_t o_needs = off;
  off += (size_t)n_in * sizeof(bool);
  char *mem = calloc(1, off);
  if (!mem) {
    kiln_set_error(KILN_ERR_OOM, "kiln: out of host memory for an autograd node (%s)", name);
    return NULL;
  }
  kiln__node *n = (kiln__node *)mem;
  atomic_init(&n->refcount, 1);
  n->name = name;
  n->module = kiln__module_scope_current();
  n->backward = fn;
  n->n_in = n_in;
  n->n_out = n_out;
  n->n_saved = n_saved;
  n->in_shape = (int64_t(*)[KILN_MAX_DIMS])(mem + o_shape);
  n->next = (kiln__edge *)(mem + o_next);
  n->saved = (kiln_tensor **)(mem + o_saved);
  n->outs_weak = (kiln_tensor **)(mem + o_outs);
  n->grad_accs = n->outs_weak + n_out;
  n->grad_outs = n->grad_accs + n_out;
  n->attrs = attr_size ? mem + o_attrs : NULL;
  if (attr_size) memcpy(n->attrs, attrs, attr_size);
  n->in_ndim = (int *)(mem + o_ndim);
  n->in_dtype = (kiln_dtype *)(mem + o_dtype);
  n->needs = (bool *)(mem + o_needs);
  for (int i = 0; i < n_in; i++) {
    kiln_tensor *t = ins[i];
    if (!t) continue;
    n->in_ndim[i] = t->ndim;
    memcpy(n->in_shape[i], t->shape, sizeof n->in_shape[i]);
    n->in_dtype[i] = t->dtype;
    n->needs[i] = t->requires_grad;
    if (!t->requires_grad) continue;
    if (t->grad_fn) {
      atomic_fetch_add_explicit(&t->grad_fn->refcount, 1, memory_order_relaxed);
      n->next[i].node = t->grad_fn;
      n->next[i].index = t->grad_fn_index;
    } else {
      n->next[i].leaf = kiln_tensor_ref(t);
    }
  }
  kiln_tensor *out = outs[0];
  n->out_ndim = out->ndim;
  memcpy(n->out_shape, out->shape, sizeof n->out_shape);
  n->out_dtype = out->dtype;
  n->out_device = kiln_device_of(out);
  /* Each output holds one reference; the node lives while any output (or a later node
  ** that took it as an input) does. */
  for (int k = 0; k < n_out; k++) {
    kiln_tensor *o = outs[k];
    if (!o) continue;
    if (k > 0) atomic_fetch_add_explicit(&n->refcount, 1, memory_order_relaxed);
    if (k == 0) n->out_weak = o;
    else n->outs_weak[k] = o;
    if (o->grad_fn) kiln__node_release(o->grad_fn);
    o->grad_fn = n;
    o->grad_fn_index = k;
    o->requires_grad = true;
  }
  return n;
}

kiln__node *kiln__node_attach(kiln_tensor *out, const char *name, kiln__backward_fn fn, int n_in,
                              kiln_tensor *const *ins) {
  return kiln__node_make(1, &out, name, fn, n_in, ins, 4, NULL, 0);
}

void kiln__node_save(kiln__node *n, int k, kiln_tensor *t) {
  KILN__ASSERT(k >= 0 && k < n->n_saved);
  uint32_t bit = k < 32 ? 1u << k : 0;
  if (n->saved[k] && (n->saved_counted & bit)) kiln__saved_bytes_add(-(int64_t)kiln_nbytes(n->saved[k]));
  kiln_tensor_free(n->saved[k]);
  n->saved[k] = t ? kiln__tensor_alias(t, false) : NULL;
  n->saved_counted &= ~bit;
  /* Activations are what autograd keeps alive: a leaf that requires grad (a parameter)
  ** is held by its owner anyway and is not counted. Slots past 32 are not counted. */
  if (n->saved[k] && bit && !(t->requires_grad && !t->grad_fn)) {
    n->saved_counted |= bit;
    kiln__saved_bytes_add((int64_t)kiln_nbytes(n->saved[k]));
  }
}

void kiln__node_save_output(kiln__node *n, int k) {
  KILN__ASSERT(n->out_weak != NULL);
  kiln__node_save(n, k, n->out_weak);
}

void kiln__node_free_saved(kiln__node *n) {
  for (int k = 0; k < n->n_saved; k++) {
    if (!n->saved[k]) continue;
    if (k < 32 && (n->saved_counted & (1u << k))) kiln__saved_bytes_add(-(int64_t)kiln_nbytes(n->saved[k]));
    kiln_tensor_free(n->saved[k]);
    n->saved[k] = NULL;
    n->saved_freed = true;
  }
  n->saved_counted = 0;
}

void kiln__node_release(kiln__node *root) {
  /* Iterative: a chain of a million nodes must not overflow the C stack. */
  kiln__node *local[64];
  kiln__node **stack = local;
  int top = 0, cap = 64;
  stack[top++] = root;
  while (top > 0) {
    kiln__node *n = stack[--top];
    if (!n) continue;
    if (atomic_fetch_sub_explicit(&n->refcount, 1, memory_order_acq_rel) != 1) continue;
    for (int i = 0; i < n->n_in; i++) {
      kiln_tensor_free(n->next[i].leaf);
      if (!n->next[i].node) continue;
      if (top == cap) {
        int ncap = cap * 2;
        kiln__node **ns = malloc((size_t)ncap * sizeof *ns);
        if (!ns) kiln__abort(__FILE__, __LINE__, "out of host memory while freeing a graph");
        memcpy(ns, stack, (size_t)top * sizeof *ns);
        if (stack != local) free(stack);
        stack = ns;
        cap = ncap;
      }
      stack[top++] = n->next[i].node;
    }
    kiln__node_free_saved(n);
    kiln_tensor_free(n->grad_acc);
    kiln_tensor_free(n->grad_mask);
    kiln_tensor_free(n->bias_grad);
    for (int k = 1; k < n->n_out; k++) kiln_tensor_free(n->grad_accs[k]);
    if (n->out_weak && n->out_weak->grad_fn == n) n->out_weak->grad_fn = NULL;
    for (int k = 1; k < n->n_out; k++)
      if (n->outs_weak[k] && n->outs_weak[k]->grad_fn == n) n->outs_weak[k]->grad_fn = NULL;
    if (n->state_free) n->state_free(n->state);
    free(n);
  }
  if (stack != local) free(stack);
}
