/*
** Autograd: define-by-run. An op whose inputs need grad attaches a node to its output;
** backward walks the nodes reachable from the root in topological order (Kahn), calling
** each node's rule with the gradient of its output and routing the results to the nodes
** of its inputs or, for leaves, into their .grad.
**
** Nodes (src/autograd/node.c) have any number of inputs and outputs; an edge names the
** output of its node that the input was, and each output has its own pending gradient.
**
** Unit seeds: backward from a one-element output without a gradient seeds it with ones.
** A node with unit_seed_ok (cross_entropy) is told "unit seed" instead (grad_out NULL) and
** then hands out a gradient it saved in the forward, with no kernel at all. Such a
** gradient's storage is marked saved_grad: it flows freely between nodes (the engine
** only reads gradients and accumulates out of place, kiln_add), but wherever a user could
** see or write it — a leaf's .grad, a retained grad, a kiln_autograd_grad result — the
** engine stores a copy, so the node's tensor stays intact for the next backward.
*/
#include "core/kiln_int.h"
#include "ops/op.h"

#include <stdlib.h>
#include <string.h>

static _Thread_local bool grad_disabled; /* default: grad mode on */
static _Thread_local int backward_depth;

bool kiln__in_backward(void) { return backward_depth > 0; }
int kiln__backward_depth(void) { return backward_depth; }

bool kiln_set_grad_enabled(bool on) {
  bool prev = !grad_disabled;
  grad_disabled = !on;
  return prev;
}

bool kiln_grad_enabled(void) { return !grad_disabled; }

bool kiln__needs_grad(int n, kiln_tensor *const *ts) {
  if (grad_disabled) return false;
  for (int i = 0; i < n; i++)
    if (ts[i] && ts[i]->requires_grad) return true;
  return false;
}

/* ---- tensor-level autograd API ---- */
kiln_status kiln_requires_grad_(kiln_tensor *t, bool on) {
  if (!t) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_requires_grad_: NULL tensor");
  if (t->grad_fn)
    return kiln_set_error(KILN_ERR_AUTOGRAD,
                          "kiln_requires_grad_: only leaf tensors can be set; this one was made by "
                          "'%s' (use kiln_detach first)",
                          t->grad_fn->name);
  if (on && !kiln_dtype_is_float(t->dtype))
    return kiln_set_error(KILN_ERR_DTYPE,
                          "kiln_requires_grad_: only floating tensors can require grad, got %s",
                          kiln_dtype_name(t->dtype));
  t->requires_grad = on;
  return KILN_OK;
}

bool kiln_requires_grad(const kiln_tensor *t) { return t && t->requires_grad; }
bool kiln_is_leaf(const kiln_tensor *t) { return t && t->grad_fn == NULL; }
kiln_tensor *kiln_grad(const kiln_tensor *t) { return t ? t->grad : NULL; }
const char *kiln_grad_fn_name(const kiln_tensor *t) {
  return t && t->grad_fn ? t->grad_fn->name : NULL;
}

kiln_status kiln_set_grad(kiln_tensor *t, kiln_tensor *g) {
  if (!t) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_set_grad: NULL tensor");
  if (g && (g->ndim != t->ndim || memcmp(g->shape, t->shape, (size_t)t->ndim * sizeof(int64_t)) != 0))
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_set_grad: gradient of shape %s for a tensor of shape %s",
                          kiln__tshape(g), kiln__tshape(t));
  if (g && !kiln_device_equal(kiln_device_of(g), kiln_device_of(t)))
    return kiln_set_error(KILN_ERR_DEVICE, "kiln_set_grad: gradient on %s for a tensor on %s",
                          kiln__device_cstr(kiln_device_of(g)), kiln__device_cstr(kiln_device_of(t)));
  kiln_tensor *old = t->grad;
  t->grad = kiln_tensor_ref(g);
  kiln_tensor_free(old);
  return KILN_OK;
}

kiln_status kiln_retain_grad(kiln_tensor *t) {
  if (!t) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_retain_grad: NULL tensor");
  if (!t->requires_grad)
    return kiln_set_error(KILN_ERR_AUTOGRAD, "kiln_retain_grad: tensor does not require grad");
  if (t->grad_fn) t->retains_grad = true; /* leaves keep their grad anyway */
  return KILN_OK;
}

kiln_status kiln_set_grad_ready_hook(kiln_tensor *t, kiln_grad_hook fn, void *ctx) {
  if (!t) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_set_grad_ready_hook: NULL tensor");
  if (fn && (t->grad_fn || !t->requires_grad))
    return kiln_set_error(KILN_ERR_AUTOGRAD, "kiln_set_grad_ready_hook: only leaves that require grad take a hook");
  t->hook = fn;
  t->hook_ctx = fn ? ctx : NULL;
  return KILN_OK;
}

bool kiln__grad_ready_hook_is(const kiln_tensor *t, kiln_grad_hook fn, const void *ctx) {
  return t->hook == fn && t->hook_ctx == ctx;
}

kiln_tensor *kiln_detach(kiln_tensor *t) {
  if (!t) return NULL;
  return kiln__tensor_alias(t, true);
}

kiln_status kiln__give_grad(kiln_tensor **slot, kiln_tensor *r, const kiln_tensor *g) {
  if (!r) return kiln_last_error() != KILN_OK ? kiln_last_error() : KILN_ERR_INTERNAL;
  *slot = (r != g && r->scope_refs > 0) ? kiln_keep(r) : kiln_tensor_ref(r);
  return KILN_OK;
}

/* ---- unbroadcast ---- */
kiln_tensor *kiln__unbroadcast(kiln_tensor *g, int ndim, const int64_t *shape) {
  if (!g) return NULL;
  int lead = g->ndim - ndim;
  KILN__ASSERT(lead >= 0);
  int dims[KILN_MAX_DIMS], nd = 0;
  for (int i = 0; i < g->ndim; i++) {
    int j = i - lead;
    if (j < 0 || (shape[j] == 1 && g->shape[i] != 1)) dims[nd++] = i;
  }
  if (nd == 0) return kiln_tensor_ref(g) ? kiln__scope_track(g) : NULL;
  kiln_tensor *s = kiln_sum(g, nd, dims, true);
  if (!s) return NULL;
  return kiln_view(s, ndim, shape);
}

/* ---- the engine ---- */
typedef struct nodelist {
  kiln__node **v;
  int n, cap;
} nodelist;

static bool push(nodelist *l, kiln__node *n) {
  if (l->n == l->cap) {
    int ncap = l->cap ? l->cap * 2 : 64;
    kiln__node **nv = realloc(l->v, (size_t)ncap * sizeof *nv);
    if (!nv) return false;
    l->v = nv;
    l->cap = ncap;
  }
  l->v[l->n++] = n;
  return true;
}

/* Whether a node's pending gradient t can take g in place: nothing else holds t or its
** storage (the rule that made it and its scope are done), it is dense (no stride-0 or
** overlapping view), and the sum has t's dtype and shape. */
static bool add_in_place_ok(const kiln_tensor *t, const kiln_tensor *g) {
  return atomic_load(&t->refcount) == 1 && atomic_load(&t->storage->refcount) == 1 && !t->storage->saved_grad &&
         !t->storage->borrowed && t->dtype == g->dtype && t->ndim == g->ndim &&
         memcmp(t->shape, g->shape, (size_t)t->ndim * sizeof(int64_t)) == 0 &&
         (kiln_is_contiguous(t) || kiln_is_contiguous_format(t, KILN_CHANNELS_LAST));
}

/* Adds g into *slot (which holds its own reference). Rules only read their gradients, so
** an engine slot may share g with other slots and the rule that made it; a sum goes into
** the slot's own tensor only when nothing else holds it (add_in_place_ok), else it is a
** new tensor (kiln_add). shown: the slot is one a user sees (.grad, a captured result),
** where the user (or an optimizer's zero_grad) may write in place: it takes g only if
** nobody else holds it, else a copy, and never a node's saved gradient (saved_grad
** storage); it never sums in place. */
static kiln_status accumulate(kiln_tensor **slot, kiln_tensor *g, bool shown) {
  /* A node's slot (never one a user sees) sums in place where it can, as PyTorch's input
  ** buffers do: out of place, the two addends and the sum were live at once, a third
  ** activation-sized gradient at every residual join (ResNet's block inputs). */
  if (*slot && !shown && add_in_place_ok(*slot, g)) return kiln_axpy_(*slot, 1.0, g);
  if (!*slot) {
    if (!shown || (atomic_load(&g->refcount) == 1 && !g->storage->saved_grad)) {
      *slot = kiln_tensor_ref(g);
    } else {
      kiln_tensor *c = kiln_clone(g);
      if (!c) return kiln_last_error();
      *slot = kiln_tensor_ref(c);
    }
    return KILN_OK;
  }
  kiln_tensor *s = kiln_add(*slot, g);
  if (!s) return kiln_last_error();
  kiln_tensor_free(*slot);
  *slot = kiln_tensor_ref(s);
  return KILN_OK;
}

/* A node's pending gradient: an implicit unit seed already there becomes a ones tensor
** first, since the rule then needs the sum. */
static kiln_status node_accumulate(kiln__node *n, int index, kiln_tensor *g) {
  if (index > 0) return accumulate(&n->grad_accs[index], g, false);
  if (n->unit_seed) {
    kiln_tensor *one = kiln_ones(n->out_ndim, n->out_shape, n->out_dtype, n->out_device);
    if (!one) return kiln_last_error();
    n->unit_seed = false;
    kiln_status st = accumulate(&n->grad_acc, one, false);
    if (st != KILN_OK) return st;
  }
  return accumulate(&n->grad_acc, g, false);
}

static int mark_epoch;

typedef struct capture {
  int n;
  kiln_tensor *const *inputs;
  kiln_tensor **grads; /* NULL: normal backward into .grad */
} capture;

/* The capture of the backward running on this thread (kiln__grad_mask_ok reads it). */
static _Thread_local const capture *running;

/* Whether the rule now running may hand m (the node of its input, output 0) a gradient
** still to be masked (m->grad_mask): this edge is the last into m in this backward and
** nothing reached m before, so the gradient m gets is exactly this one; and no one sees
** m's gradient (not retained, not asked for by kiln_autograd_grad). */
bool kiln__grad_mask_ok(const kiln__node *m, int index) {
  if (!m || index != 0 || m->deps != 1 || m->grad_acc || m->unit_seed || m->grad_mask || m->bias_grad) return false;
  for (int k = 1; k < m->n_out; k++)
    if (m->grad_accs[k]) return false;
  if (m->out_weak && m->out_weak->retains_grad) return false;
  for (int c = 0; running && running->grads && c < running->n; c++)
    if (running->inputs[c]->grad_fn == m) return false;
  return true;
}

bool kiln__grad_shown(const kiln__node *m, int index) {
  const kiln_tensor *out = index == 0 ? m->out_weak : m->outs_weak[index];
  if (out && out->retains_grad) return true;
  for (int c = 0; running && running->grads && c < running->n; c++)
    if (running->inputs[c]->grad_fn == m && running->inputs[c]->grad_fn_index == index) return true;
  return false;
}

/* The node whose rule the engine runs now on this thread (kiln__grad_into asks). */
static _Thread_local const kiln__node *rule_node;

/* The slot that holds the pending gradient of n's input k (the output of the node it
** came from), or NULL for a leaf or an input that needs none. */
static kiln_tensor **input_slot(const kiln__node *n, int k) {
  kiln__node *m = n->next[k].node;
  if (!m || !n->needs[k]) return NULL;
  int index = n->next[k].index;
  if (index > 0) return &m->grad_accs[index];
  return m->unit_seed ? NULL : &m->grad_acc; /* a unit seed is no tensor yet */
}

/* Gradients summed where they are made: a rule whose kernel can add into its output (cuDNN's
** backward data with beta 1) writes its input's gradient into the sum pending for it,
** instead of a new tensor that accumulate() then adds (axpy_: one more read of both and a
** write, 3 ms of a ResNet-50 step at its 16 residual joins). Offered only where
** accumulate() would add in place anyway (add_in_place_ok), so the numbers are those of an
** in-place add of the rule's result, rounded once instead of twice.
** A leaf's .grad is offered too when it already holds this backward's or an earlier one's
** sum and nothing but the leaf holds it (a tied weight's second gradient: GPT-2's embedding
** scattered its rows into zeros, then 154 MB of them were added to the head's), never
** inside kiln_autograd_grad's capture. A rule that adds its terms one by one into the sum
** (the CPU's embedding) may differ from the out-of-place sum in the last place. */
kiln_tensor *kiln__grad_into(const kiln__node *n, int k) {
  if (!n || n != rule_node || k < 0 || k >= n->n_in) return NULL;
  kiln_tensor *leaf = n->next[k].leaf;
  if (leaf) {
    if (!n->needs[k] || !running || running->grads || !leaf->grad || !add_in_place_ok(leaf->grad, leaf->grad))
      return NULL;
    return leaf->grad;
  }
  kiln_tensor **slot = input_slot(n, k);
  kiln_tensor *t = slot ? *slot : NULL;
  if (!t || n->next[k].node->grad_mask || !add_in_place_ok(t, t)) return NULL;
  return t;
}

static int capture_index_leaf(const capture *c, const kiln_tensor *leaf) {
  for (int i = 0; i < c->n; i++)
    if (c->inputs[i] == leaf) return i;
  return -1;
}

static kiln_status engine(int n_roots, kiln_tensor *const *roots, kiln_tensor *const *grads,
                          capture *cap, bool retain) {
  kiln_status st = KILN_OK;
  bool prev_mode = kiln_set_grad_enabled(false);
  backward_depth++;
  const capture *prev_running = running;
  running = cap;
  kiln_scope_begin();
  nodelist all = {0}, ready = {0};
  int epoch = ++mark_epoch;
  /* Root gradients. */
  for (int r = 0; r < n_roots && st == KILN_OK; r++) {
    kiln_tensor *root = roots[r];
    kiln_tensor *g = grads ? grads[r] : NULL;
    if (!root->requires_grad) {
      st = kiln_set_error(KILN_ERR_AUTOGRAD,
                          "kiln_backward: output %d does not require grad (no input requires grad, "
                          "or it was computed in no-grad mode)", r);
      break;
    }
    if (!g) {
      if (kiln_numel(root) != 1) {
        st = kiln_set_error(KILN_ERR_AUTOGRAD,
                            "kiln_backward: a gradient can be created implicitly only for "
                            "one-element outputs; output %d has shape %s",
                            r, kiln__tshape(root));
        break;
      }
      kiln__node *rn = root->grad_fn;
      if (rn && rn->unit_seed_ok && root->grad_fn_index == 0 && rn->visit_mark != epoch) { /* its first gradient: no ones */
        if (!push(&all, rn)) {
          st = kiln_set_error(KILN_ERR_OOM, "kiln_backward: out of host memory");
          break;
        }
        rn->unit_seed = true;
        rn->visit_mark = epoch;
        rn->deps = 0;
        continue;
      }
      g = kiln_ones_like(root);
      if (!g) { st = kiln_last_error(); break; }
    } else if (g->ndim != root->ndim ||
               memcmp(g->shape, root->shape, (size_t)root->ndim * sizeof(int64_t)) != 0) {
      st = kiln_set_error(KILN_ERR_SHAPE, "kiln_backward: gradient of shape %s for output of shape %s",
                          kiln__tshape(g), kiln__tshape(root));
      break;
    } else if (!kiln_device_equal(kiln_device_of(g), kiln_device_of(root))) {
      st = kiln_set_error(KILN_ERR_DEVICE, "kiln_backward: gradient on %s for output on %s",
                          kiln__device_cstr(kiln_device_of(g)), kiln__device_cstr(kiln_device_of(root)));
      break;
    }
    if (!root->grad_fn) { /* the root is a leaf */
      if (cap->grads) {
        int ci = capture_index_leaf(cap, root);
        if (ci >= 0) st = accumulate(&cap->grads[ci], g, true);
      } else {
        st = accumulate(&root->grad, g, true);
      }
      continue;
    }
    kiln__node *n = root->grad_fn;
    st = node_accumulate(n, root->grad_fn_index, g);
    if (st == KILN_OK && n->visit_mark != epoch) {
      n->visit_mark = epoch;
      n->deps = 0;
      if (!push(&all, n)) st = kiln_set_error(KILN_ERR_OOM, "kiln_backward: out of host memory");
    }
  }
  /* Discover the graph and count dependencies. all grows while we scan it. */
  for (int i = 0; i < all.n && st == KILN_OK; i++) {
    kiln__node *n = all.v[i];
    if (n->saved_freed) { /* before any rule runs: no .grad is half updated */
      st = kiln_set_error(KILN_ERR_AUTOGRAD,
                          "%s: the tensors that '%s'%s%s saved for backward were freed by an earlier "
                          "backward; to backward through a graph twice, keep it the first time "
                          "(kiln_backward_ex(root, grad, true))",
                          cap->grads ? "kiln_autograd_grad" : "kiln_backward", n->name,
                          n->module ? " in " : "", n->module ? n->module : "");
      break;
    }
    for (int k = 0; k < n->n_in; k++) {
      kiln_tensor *leaf = n->next[k].leaf;
      if (leaf && leaf->hook && !cap->grads) { /* count the paths into a hooked leaf (kiln_backward's only: a
                                               ** nested kiln_autograd_grad, as a checkpoint runs, must not reset it) */
        if (leaf->hook_epoch != epoch) {
          leaf->hook_epoch = epoch;
          leaf->hook_pending = 0;
        }
        leaf->hook_pending++;
      }
      kiln__node *m = n->next[k].node;
      if (!m) continue;
      if (m->visit_mark != epoch) {
        m->visit_mark = epoch;
        m->deps = 0;
        if (!push(&all, m)) { st = kiln_set_error(KILN_ERR_OOM, "kiln_backward: out of host memory"); break; }
      }
      m->deps++;
    }
  }
  for (int i = 0; i < all.n && st == KILN_OK; i++)
    if (all.v[i]->deps == 0 && !push(&ready, all.v[i]))
      st = kiln_set_error(KILN_ERR_OOM, "kiln_backward: out of host memory");
  /* Run. */
  kiln_tensor *gi_local[8], **gi_buf = gi_local;
  int gi_cap = 8;
  while (ready.n > 0 && st == KILN_OK) {
    kiln__node *n = ready.v[--ready.n];
    kiln_tensor *g = n->grad_acc; /* NULL: reached, but no gradient flowed into it */
    bool unit = n->unit_seed;     /* or the implicit unit seed, with no tensor */
    bool any_other = false;       /* a gradient reached an output other than 0 */
    n->grad_acc = NULL;
    n->unit_seed = false;
    for (int k = 1; k < n->n_out; k++) {
      n->grad_outs[k] = n->grad_accs[k];
      n->grad_accs[k] = NULL;
      any_other = any_other || n->grad_outs[k];
    }
    kiln_scope_begin();
    /* Does a user see this node's gradient (captured, or retained)? A unit seed is made
    ** into a ones tensor only then. No gradient at all: nothing to compute; the edges
    ** below still release their dependencies. */
    bool show = !cap->grads && n->out_weak && n->out_weak->retains_grad;
    for (int c = 0; cap->grads && c < cap->n; c++)
      show = show || (cap->inputs[c]->grad_fn == n && cap->inputs[c]->grad_fn_index == 0);
    kiln_tensor *shown = g;
    if (show && unit && !(shown = kiln_ones(n->out_ndim, n->out_shape, n->out_dtype, n->out_device)))
      st = kiln_last_error();
    if (show && shown && st == KILN_OK) {
      if (!cap->grads) st = accumulate(&n->out_weak->grad, shown, true);
      for (int c = 0; cap->grads && c < cap->n && st == KILN_OK; c++)
        if (cap->inputs[c]->grad_fn == n && cap->inputs[c]->grad_fn_index == 0)
          st = accumulate(&cap->grads[c], shown, true);
    }
    for (int k = 1; k < n->n_out && st == KILN_OK; k++) { /* the other outputs' gradients */
      kiln_tensor *gk = n->grad_outs[k], *ok = n->outs_weak[k];
      if (!gk) continue;
      if (!cap->grads && ok && ok->retains_grad) st = accumulate(&ok->grad, gk, true);
      for (int c = 0; cap->grads && c < cap->n && st == KILN_OK; c++)
        if (cap->inputs[c]->grad_fn == n && cap->inputs[c]->grad_fn_index == k)
          st = accumulate(&cap->grads[c], gk, true);
    }
    if (n->n_in > gi_cap && st == KILN_OK) {
      kiln_tensor **nb = realloc(gi_buf == gi_local ? NULL : gi_buf, (size_t)n->n_in * sizeof *nb);
      if (!nb) {
        st = kiln_set_error(KILN_ERR_OOM, "kiln_backward: out of host memory");
      } else {
        gi_buf = nb;
        gi_cap = n->n_in;
      }
    }
    kiln_tensor **gi = gi_buf;
    for (int k = 0; k < n->n_in && k < gi_cap; k++) gi[k] = NULL;
    if (st == KILN_OK && (g || unit || any_other)) {
      const kiln__node *outer = kiln__backward_node_swap(n); /* observers name the node */
      const kiln__node *outer_rule = rule_node;
      rule_node = n;
      st = n->backward(n, g, gi);
      rule_node = outer_rule;
      kiln__backward_node_swap(outer);
      if (st != KILN_OK && kiln_last_error() == KILN_OK)
        kiln_set_error(st, "kiln_backward: the rule of '%s' failed", n->name);
      /* What the rule read is not needed again unless the graph is kept: let it go now,
      ** as PyTorch does, not when the step's scope ends. The activations of the layers
      ** already done are then free while the ones before them run (a ResNet-50's
      ** backward peak was every activation plus the gradients in flight). */
      if (st == KILN_OK && !retain) kiln__node_free_saved(n);
    }
    /* A rule that hands a gradient on unchanged (a cast whose gradient already came in its
    ** input's dtype, kiln__grad_dtype) holds it twice with the engine: the engine's
    ** reference goes first, so that a leaf takes the tensor as its .grad instead of a copy. */
    for (int k = 0; st == KILN_OK && k < n->n_in && k < gi_cap; k++) {
      if (!gi[k]) continue;
      if (gi[k] == g) {
        kiln_tensor_free(g);
        g = NULL;
      }
      for (int j = 1; j < n->n_out; j++)
        if (gi[k] == n->grad_outs[j]) {
          kiln_tensor_free(n->grad_outs[j]);
          n->grad_outs[j] = NULL;
        }
    }
    for (int k = 0; k < n->n_in; k++) {
      kiln_tensor *gk = k < gi_cap ? gi[k] : NULL;
      if (st == KILN_OK && gk && n->needs[k]) {
        if (n->next[k].leaf) {
          kiln_tensor *leaf = n->next[k].leaf;
          if (cap->grads) {
            int ci = capture_index_leaf(cap, leaf);
            if (ci >= 0) st = accumulate(&cap->grads[ci], gk, true);
          } else if (gk != leaf->grad) { /* else the rule added into .grad (kiln__grad_into) */
            st = accumulate(&leaf->grad, gk, true);
          }
        } else if (n->next[k].node) {
          kiln_tensor **slot = input_slot(n, k);
          if (!slot || *slot != gk) /* else the rule added into the pending sum (kiln__grad_into) */
            st = node_accumulate(n->next[k].node, n->next[k].index, gk);
        }
      }
      kiln_tensor_free(gk);
      kiln_tensor *hl = n->next[k].leaf;
      if (st == KILN_OK && hl && hl->hook && hl->hook_epoch == epoch && --hl->hook_pending == 0 && !cap->grads)
        hl->hook(hl, hl->hook_ctx);
      kiln__node *m = n->next[k].node;
      if (m && --m->deps == 0 && !push(&ready, m))
        st = kiln_set_error(KILN_ERR_OOM, "kiln_backward: out of host memory");
    }
    kiln_tensor_free(g);
    kiln_tensor_free(n->grad_mask);
    n->grad_mask = NULL;
    kiln_tensor_free(n->bias_grad);
    n->bias_grad = NULL;
    for (int k = 1; k < n->n_out; k++) {
      kiln_tensor_free(n->grad_outs[k]);
      n->grad_outs[k] = NULL;
    }
    kiln_scope_end();
  }
  if (gi_buf != gi_local) free(gi_buf);
  /* On error, drop partial accumulations so a later backward starts clean. */
  for (int i = 0; i < all.n; i++) {
    kiln__node *n = all.v[i];
    kiln_tensor_free(n->grad_acc);
    n->grad_acc = NULL;
    n->unit_seed = false;
    kiln_tensor_free(n->grad_mask);
    n->grad_mask = NULL;
    kiln_tensor_free(n->bias_grad);
    n->bias_grad = NULL;
    for (int k = 1; k < n->n_out; k++) {
      kiln_tensor_free(n->grad_accs[k]);
      n->grad_accs[k] = NULL;
    }
  }
  free(all.v);
  free(ready.v);
  kiln_scope_end();
  running = prev_running;
  backward_depth--;
  kiln_set_grad_enabled(prev_mode);
  return st;
}

kiln_status kiln_backward_ex(kiln_tensor *root, kiln_tensor *grad, bool retain_graph) {
  if (!root) {
    if (kiln_last_error() == KILN_OK)
      kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_backward: NULL tensor");
    return kiln_last_error();
  }
  capture cap = {0, NULL, NULL};
  kiln_tensor *gs[1] = {grad};
  return engine(1, &root, grad ? gs : NULL, &cap, retain_graph);
}

kiln_status kiln_backward(kiln_tensor *root, kiln_tensor *grad) { return kiln_backward_ex(root, grad, false); }

kiln_status kiln_autograd_grad(int n_outputs, kiln_tensor *const *outputs,
                               kiln_tensor *const *grad_outputs, int n_inputs,
                               kiln_tensor *const *inputs, kiln_tensor **grads_out) {
  if (n_outputs <= 0 || !outputs || n_inputs <= 0 || !inputs || !grads_out)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_autograd_grad: empty or NULL arguments");
  for (int i = 0; i < n_outputs; i++)
    if (!outputs[i]) {
      if (kiln_last_error() == KILN_OK)
        kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_autograd_grad: output %d is NULL", i);
      return kiln_last_error();
    }
  for (int i = 0; i < n_inputs; i++) {
    if (!inputs[i]) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_autograd_grad: input %d is NULL", i);
    if (!inputs[i]->requires_grad)
      return kiln_set_error(KILN_ERR_AUTOGRAD, "kiln_autograd_grad: input %d does not require grad", i);
    grads_out[i] = NULL;
  }
  capture cap = {n_inputs, inputs, grads_out};
  kiln_status st = engine(n_outputs, outputs, grad_outputs, &cap, true);
  for (int i = 0; i < n_inputs; i++) {
    if (st != KILN_OK) {
      kiln_tensor_free(grads_out[i]);
      grads_out[i] = NULL;
    } else if (grads_out[i]) {
      kiln__scope_track(grads_out[i]); /* the caller's scope owns the results */
    }
  }
  return st;
}
