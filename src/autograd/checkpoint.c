/*
** Gradient checkpointing (torch.utils.checkpoint): a segment's forward runs with grad
** mode off inside a scope of its own, so that only its inputs and outputs outlive it;
** its backward runs the segment again with grad mode on, from detached copies of the
** inputs, and backpropagates through the recomputed graph.
**
** The segment is one custom function (kiln_function_apply) whose inputs are the
** program's inputs and the parameters the segment uses: leaves that require grad, found
** while the forward runs by an op observer (every op's inputs go past it). The recompute
** asks kiln_autograd_grad for the gradients of exactly those tensors and hands them to
** the engine as the function's input gradients, so they reach .grad under kiln_backward
** and the requested results under kiln_autograd_grad alike (PyTorch's non-reentrant
** form has the same property; its reentrant form writes .grad from inside backward and
** cannot serve torch.autograd.grad).
**
** Same numbers: the recompute restores the generators' states saved at forward (the
** global one, and those the program names in kiln_checkpoint_ex), so dropout draws the
** same mask, and puts the generators back as they were after; it runs under the
** autocast state of the forward (with a weight-cast cache of its own, so it never shares
** a node with the graph being backpropagated). On the CPU the gradients are the bits of
** the run without checkpointing, as long as a parameter is used by one segment only (the
** order of the additions into its .grad is otherwise the segments').
**
** The recompute skips what the backward does not need: a segment's output made by an op
** whose rule reads only its inputs (linear, matmul, add, sub: KILN__OP_RULE_READS_INPUTS),
** read by no op after it, is there only for the graph behind it (an MLP's c_proj, a
** block's last residual add). The forward notes such outputs by the op's place among the
** calls fn made at its own depth; the recompute counts the same calls and has the path
** zero that op's output instead of running its kernels, recording its node as ever.
** Should an op read a skipped output after all, or the recompute return another tensor
** (fn took another path), the segment is recomputed again in full: the gradients never
** depend on the skip. And the forward keeps what an op flagged KILN__OP_CHECKPOINT_KEEPS
** made (attention without dropout: its output and log-sum-exp, T^2 work for T rows), which
** the recompute takes at the same place, on inputs of the same shapes, instead of running
** it again. A checkpoint that keeps products (KILN_CHECKPOINT_KEEP_PRODUCTS) keeps each
** matmul's and plain linear's output the same way (PyTorch's selective checkpointing with a
** policy that saves its mm outputs): memory for the products' work, which is most of a
** transformer block's. A kept result whose storage was written after it was made (an
** in-place op on it) is not taken: the call runs again. PyTorch's checkpoint recomputes
** everything; KILN_CHECKPOINT_ELIDE=0 does too (the A/B).
**
** Limits: a tensor with a history that fn reads other than through its inputs (from its
** ctx) gets no gradient, as with PyTorch's reentrant checkpoint: pass it as an input. fn
** should not read its outputs' values on the host (kiln_item, copies out): in the
** recompute a skipped output holds zeros.
*/
#include "ops/op.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GENS 8

/* ---- the parameter collector: an op observer with a per-thread target ---- */
typedef struct tlist {
  kiln_tensor **v;
  int n, cap;
  bool oom;
} tlist;

/* The last calls fn made at its own depth, for the skip (see the top): which op made
** which tensor (by pointer and id: an address can be reused once a tensor is freed) and
** whether any later op read it. */
#define RING 16
typedef struct made {
  const kiln__op *op;
  const kiln_tensor *t; /* NULL: not one output */
  int64_t id, index;
  bool read;
} made;

/* A call's results kept from the forward (KILN__OP_CHECKPOINT_KEEPS, or KILN__OP_PRODUCT
** when products are kept), references held, in the skip hook's layout (the outputs, then
** the temporaries from KILN__OP_MAX_OUT) with their storages' versions then, and its
** inputs' shapes to check the recompute's call against. */
#define KEEP_IN 4
typedef struct kept {
  const kiln__op *op;
  int64_t index;
  kiln_tensor *res[KILN__OBS_USE_N];
  uint64_t version[KILN__OBS_USE_N];
  int n_in;
  struct {
    int ndim;
    int64_t shape[KILN_MAX_DIMS];
    kiln_dtype dtype;
  } in[KEEP_IN];
} kept;

typedef struct kept_list {
  kept *v;
  int n, cap;
} kept_list;

static void kept_release(kept *k) {
  for (int j = 0; j < KILN__OBS_USE_N; j++) kiln_tensor_free(k->res[j]), k->res[j] = NULL;
}

static void kept_free(kept_list *l) {
  for (int i = 0; i < l->n; i++) kept_release(&l->v[i]);
  free(l->v);
  *l = (kept_list){NULL, 0, 0};
}

/* Whether nothing wrote the kept results since their call made them. */
static bool kept_unwritten(const kept *k) {
  for (int j = 0; j < KILN__OBS_USE_N; j++)
    if (k->res[j] && kiln__storage_version(k->res[j]->storage) != k->version[j]) return false;
  return true;
}

/* Whether the inputs of e are the shapes and dtypes the kept call had. */
static bool kept_matches(const kept *k, const kiln__op_event *e) {
  if (k->op != e->op || k->n_in != (e->n_in < KEEP_IN ? e->n_in : KEEP_IN)) return false;
  for (int i = 0; i < k->n_in; i++) {
    const kiln_tensor *t = e->in[i];
    if (!t) {
      if (k->in[i].ndim != -1) return false;
      continue;
    }
    if (t->ndim != k->in[i].ndim || t->dtype != k->in[i].dtype) return false;
    for (int d = 0; d < t->ndim; d++)
      if (t->shape[d] != k->in[i].shape[d]) return false;
  }
  return true;
}

typedef struct collector {
  tlist found;
  int n_exclude;
  kiln_tensor *const *exclude; /* the segment's own inputs */
  struct collector *outer;     /* an enclosing checkpoint's forward: it sees these calls too */
  int depth;                   /* fn's own depth (kiln__op_depth) */
  int64_t calls;               /* the calls made at that depth */
  made ring[RING];             /* the last of them, ring[index % RING] */
  bool elide;                  /* KILN_CHECKPOINT_ELIDE is not 0 */
  bool keep_products;          /* KILN_CHECKPOINT_KEEP_PRODUCTS (and elide) */
  kept_list keeps;             /* what the forward's kept calls made (collect_made) */
} collector;

static _Thread_local collector *collecting;

/* The recompute's plan: skip the calls at these places, and see that nothing reads what
** they made; take the kept results at theirs. */
typedef struct skip_plan {
  int n;
  struct {
    const kiln__op *op;
    int64_t index;
    int out;               /* the segment's output it makes */
    const kiln_tensor *t;  /* set when the recompute skipped it */
    int64_t id;
  } at[KILN__OP_MAX_OUT];
  int depth;
  int64_t calls;
  bool read; /* an op read a skipped output: recompute in full */
  kept_list *keeps; /* taken ones are handed over (NULL entries after) */
} skip_plan;

static _Thread_local skip_plan *skipping;

/* For the tests: the calls the recomputes skipped, the kept results they took, and the
** recomputes run again in full. */
static _Atomic int64_t g_skipped, g_taken, g_full_again;
int64_t kiln__checkpoint_skipped(void) { return g_skipped; }
int64_t kiln__checkpoint_taken(void) { return g_taken; }
int64_t kiln__checkpoint_full_again(void) { return g_full_again; }

static void mark_read(made *ring, int64_t calls, const kiln__op_event *e) {
  int64_t lo = calls > RING ? calls - RING : 0;
  for (int i = 0; i < e->n_in; i++) {
    const kiln_tensor *t = e->in[i];
    if (!t) continue;
    for (int64_t j = lo; j < calls; j++) {
      made *m = &ring[j % RING];
      if (m->t == t && m->id == t->id) m->read = true;
    }
  }
}

static void tlist_add(tlist *l, kiln_tensor *t) {
  for (int i = 0; i < l->n; i++)
    if (l->v[i] == t) return;
  if (l->n == l->cap) {
    int ncap = l->cap ? l->cap * 2 : 16;
    kiln_tensor **nv = realloc(l->v, (size_t)ncap * sizeof *nv);
    if (!nv) {
      l->oom = true;
      return;
    }
    l->v = nv;
    l->cap = ncap;
  }
  l->v[l->n++] = t;
}

static void *collect_begin(const kiln__op_event *e, void *ctx) {
  KILN__UNUSED(ctx);
  if (e->span) return NULL; /* a rule's kernels: no op a segment's forward or recompute called */
  skip_plan *p = skipping;
  if (p) {
    for (int i = 0; i < e->n_in && !p->read; i++)
      for (int k = 0; k < p->n; k++)
        if (p->at[k].t && e->in[i] == p->at[k].t && e->in[i]->id == p->at[k].id) p->read = true;
    if (e->depth == p->depth) p->calls++;
  }
  collector *c = collecting;
  if (!c) return NULL;
  for (int i = 0; i < e->n_in; i++) {
    kiln_tensor *t = e->in[i];
    if (!t || !t->requires_grad || t->grad_fn) continue;
    bool own = false;
    for (int k = 0; k < c->n_exclude && !own; k++) own = c->exclude[k] == t;
    if (!own) tlist_add(&c->found, t);
  }
  for (collector *o = c; o; o = o->outer) mark_read(o->ring, o->calls, e);
  return NULL;
}

static kiln_status collect_end(const kiln__op_event *e, void *token, void *ctx) {
  KILN__UNUSED(token), KILN__UNUSED(ctx);
  if (e->span) return KILN_OK;
  for (collector *o = collecting; o; o = o->outer) {
    if (e->depth != o->depth) continue;
    made *m = &o->ring[o->calls % RING];
    bool one = e->status == KILN_OK && e->n_out == 1 && e->out[0];
    *m = (made){e->op, one ? e->out[0] : NULL, one ? e->out[0]->id : 0, o->calls, false};
    o->calls++;
  }
  return KILN_OK;
}

/* In the forward: a KILN__OP_CHECKPOINT_KEEPS call's results, or a product's when products
** are kept, kept for the recompute. */
static void collect_made(const kiln__op_event *e, kiln_tensor *const *tmp, void *ctx) {
  KILN__UNUSED(ctx);
  collector *c = collecting;
  if (!c || !c->elide || e->depth != c->depth || e->n_out < 1 || !e->out[0]) return;
  if (!(e->op->flags & KILN__OP_CHECKPOINT_KEEPS) && !c->keep_products) return;
  kept_list *l = &c->keeps;
  if (l->n == l->cap) {
    int ncap = l->cap ? l->cap * 2 : 4;
    kept *nv = realloc(l->v, (size_t)ncap * sizeof *nv);
    if (!nv) return; /* recomputed instead */
    l->v = nv;
    l->cap = ncap;
  }
  kept *k = &l->v[l->n++];
  memset(k, 0, sizeof *k);
  k->op = e->op;
  k->index = c->calls; /* collect_end counts this call after */
  for (int i = 0; i < e->n_out && i < KILN__OP_MAX_OUT; i++) k->res[i] = kiln_tensor_ref(e->out[i]);
  for (int i = 0; i < KILN__OP_MAX_TMP; i++) k->res[KILN__OP_MAX_OUT + i] = kiln_tensor_ref(tmp[i]); /* NULL-safe */
  for (int j = 0; j < KILN__OBS_USE_N; j++)
    if (k->res[j]) k->version[j] = kiln__storage_version(k->res[j]->storage);
  k->n_in = e->n_in < KEEP_IN ? e->n_in : KEEP_IN;
  for (int i = 0; i < k->n_in; i++) {
    const kiln_tensor *t = e->in[i];
    k->in[i].ndim = t ? t->ndim : -1;
    if (!t) continue;
    k->in[i].dtype = t->dtype;
    memcpy(k->in[i].shape, t->shape, sizeof(int64_t) * (size_t)t->ndim);
  }
}

/* In the recompute: a kept call (counted by collect_begin) takes its results from the
** forward; a planned skip makes its output without its kernels. */
static bool collect_skip(const kiln__op_event *e, kiln_tensor **use, void *ctx) {
  KILN__UNUSED(ctx);
  skip_plan *p = skipping;
  if (!p || e->depth != p->depth) return false;
  for (int i = 0; p->keeps && i < p->keeps->n; i++) {
    kept *k = &p->keeps->v[i];
    if (k->index != p->calls - 1 || !k->res[0] || !kept_matches(k, e)) continue;
    if (!kept_unwritten(k)) { /* fn wrote it in place after the call: run the call again */
      kept_release(k);
      return false;
    }
    /* New handles on the kept storage, and the kept handles let go: the recompute's node
    ** takes these as its outputs (their grad_fn set), so a handle the segment still held
    ** would keep that graph alive until the segment is freed (a block's recomputed
    ** activations, ~175 MB each for GPT-2), and one the forward also returned (a segment
    ** whose output is the attention's) would leave the program's tensor with the
    ** recompute's node for its grad_fn. */
    bool ok = true;
    for (int j = 0; j < KILN__OBS_USE_N; j++)
      if (k->res[j] && !(use[j] = kiln__tensor_alias(k->res[j], false))) ok = false;
    if (!ok) { /* out of host memory for a handle: recompute the call instead */
      for (int j = 0; j < KILN__OBS_USE_N; j++) kiln_tensor_free(use[j]), use[j] = NULL;
      kiln_clear_error();
      return false;
    }
    kept_release(k);
    g_taken++;
    return true;
  }
  if (e->n_out != 1 || !e->out[0]) return false;
  for (int k = 0; k < p->n; k++)
    if (!p->at[k].t && p->at[k].index == p->calls - 1 && p->at[k].op == e->op) {
      p->at[k].t = e->out[0];
      p->at[k].id = e->out[0]->id;
      g_skipped++;
      return true;
    }
  return false;
}

static const kiln__observer collect_obs = {"checkpoint", collect_begin, collect_end, NULL, collect_skip, collect_made};
static pthread_mutex_t obs_lock = PTHREAD_MUTEX_INITIALIZER;
static int obs_users; /* threads collecting now: the observer is on while any is */

static kiln_status collect_on(void) {
  pthread_mutex_lock(&obs_lock);
  kiln_status st = obs_users == 0 ? kiln__observer_add(&collect_obs) : KILN_OK;
  if (st == KILN_OK) obs_users++;
  pthread_mutex_unlock(&obs_lock);
  return st;
}

static void collect_off(void) {
  pthread_mutex_lock(&obs_lock);
  if (--obs_users == 0) kiln__observer_remove(&collect_obs);
  pthread_mutex_unlock(&obs_lock);
}

/* ---- the segment ---- */
typedef struct rng_state {
  kiln_generator *g;
  uint64_t seed, offset;
} rng_state;

typedef struct segment {
  kiln_checkpoint_fn fn;
  void *ctx;
  int n_in;     /* the program's inputs; the function's inputs after them are parameters */
  int n_params;
  int n_out;
  kiln_tensor **outs; /* forward: the outputs computed before kiln_function_apply */
  int n_gens;
  rng_state gens[MAX_GENS + 1]; /* [0]: the global generator */
  kiln__autocast_state ac;
  skip_plan plan;  /* the calls the recompute may make without kernels (plan.n of them);
                   ** each recompute starts from a copy */
  kept_list keeps; /* results the recompute takes instead of running their calls */
} segment;

/* After the forward: which outputs a call at fn's own depth made, read by no later op, with
** a rule that reads only its inputs (see the top); a product kept at such a call is let go
** (its output is not needed at all). */
static void plan_skips(segment *s, collector *c, int n_out, kiln_tensor *const *outs) {
  if (!c->elide) return;
  int64_t lo = c->calls > RING ? c->calls - RING : 0;
  for (int k = 0; k < n_out; k++)
    for (int64_t j = c->calls - 1; j >= lo; j--) {
      const made *m = &c->ring[j % RING];
      if (m->t != outs[k] || m->id != outs[k]->id) continue;
      skip_plan *p = &s->plan;
      bool dup = false;
      for (int i = 0; i < p->n; i++) dup = dup || p->at[i].index == m->index;
      if (!m->read && !dup && (m->op->flags & KILN__OP_RULE_READS_INPUTS)) {
        p->at[p->n].op = m->op;
        p->at[p->n].index = m->index;
        p->at[p->n++].out = k;
      }
      break;
    }
  for (int i = 0; i < c->keeps.n; i++)
    for (int k = 0; k < s->plan.n; k++)
      if (c->keeps.v[i].index == s->plan.at[k].index) kept_release(&c->keeps.v[i]);
}

/* The recompute: fn from the detached inputs x, under the forward's generators and
** autocast state, with grad mode on; the planned calls skipped when plan is given. */
static kiln_status recompute(segment *s, kiln_tensor **x, int n_out, kiln_tensor **y, skip_plan *plan) {
  rng_state now[MAX_GENS + 1];
  for (int k = 0; k < s->n_gens; k++) {
    now[k].g = s->gens[k].g;
    kiln_generator_get_state(now[k].g, &now[k].seed, &now[k].offset);
    kiln_generator_set_state(s->gens[k].g, s->gens[k].seed, s->gens[k].offset);
  }
  kiln_status st = kiln__autocast_push_state(&s->ac);
  /* With every observer slot taken the skip cannot be watched: recompute in full. A
  ** recompute inside fn (a backward fn runs itself) keeps the outer plan for after. */
  if (st == KILN_OK && plan && collect_on() != KILN_OK) {
    kiln_clear_error();
    plan = NULL;
  }
  skip_plan *outer = skipping;
  if (st == KILN_OK) {
    if (plan) plan->depth = kiln__op_depth();
    skipping = plan; /* NULL too: an outer recompute's plan does not count these calls */
    bool prev = kiln_set_grad_enabled(true);
    for (int k = 0; k < n_out; k++) y[k] = NULL;
    st = s->fn(s->ctx, s->n_in, x, n_out, y);
    kiln_set_grad_enabled(prev);
    skipping = outer;
    if (plan) collect_off();
    kiln__autocast_pop_state();
  }
  for (int k = 0; k < s->n_gens; k++) kiln_generator_set_state(now[k].g, now[k].seed, now[k].offset);
  if (st != KILN_OK && kiln_last_error() == KILN_OK) kiln_set_error(st, "kiln_checkpoint: the recompute failed");
  return st;
}

/* Whether a recompute with skips gave what the plan said: each skipped call's output is
** the segment's output it was planned for, and no op read one. */
static bool skips_held(const skip_plan *p, int n_out, kiln_tensor *const *y) {
  if (p->read) return false;
  for (int k = 0; k < p->n; k++)
    if (p->at[k].t && (p->at[k].out >= n_out || y[p->at[k].out] != p->at[k].t)) return false;
  return true;
}

static void rng_save(segment *s) {
  for (int k = 0; k < s->n_gens; k++) kiln_generator_get_state(s->gens[k].g, &s->gens[k].seed, &s->gens[k].offset);
}

static kiln_status seg_forward(kiln_function_ctx *fc, int n_in, kiln_tensor *const *in, int n_out,
                               kiln_tensor **out) {
  segment *s = kiln_function_state(fc);
  for (int i = 0; i < s->n_in && i < n_in; i++) {
    kiln_status st = kiln_function_save(fc, in[i]);
    if (st != KILN_OK) return st;
  }
  for (int k = 0; k < n_out; k++) out[k] = s->outs[k];
  return KILN_OK;
}

static kiln_status seg_backward(kiln_function_ctx *fc, int n_out, kiln_tensor *const *gout, int n_in,
                                kiln_tensor **gin) {
  segment *s = kiln_function_state(fc);
  kiln_tensor *local[16], **buf = local;
  size_t need = (size_t)s->n_in + (size_t)n_out * 3 + (size_t)n_in * 2;
  if (need > 16 && !(buf = calloc(need, sizeof *buf)))
    return kiln_set_error(KILN_ERR_OOM, "kiln_checkpoint: out of host memory");
  kiln_tensor **x = buf, **y = x + s->n_in, **ys = y + n_out, **gs = ys + n_out;
  kiln_tensor **targets = gs + n_out, **grads = targets + n_in;
  int where[64];
  kiln_status st = KILN_OK;
  /* detached inputs; those the engine wants a gradient for require grad */
  for (int i = 0; i < s->n_in && st == KILN_OK; i++) {
    x[i] = kiln_detach(kiln_function_saved(fc, i));
    if (!x[i]) st = kiln_last_error();
    else if (kiln_function_grad_needed(fc, i) && kiln_dtype_is_float(kiln_dtype_of(x[i])))
      st = kiln_requires_grad_(x[i], true);
  }
  /* the recompute; in full once more if a skip did not hold */
  if (st == KILN_OK) {
    skip_plan plan = s->plan;
    plan.keeps = &s->keeps;
    st = recompute(s, x, n_out, y, plan.n > 0 || s->keeps.n > 0 ? &plan : NULL);
    if (st == KILN_OK && plan.n > 0 && !skips_held(&plan, n_out, y)) {
      for (int k = 0; k < n_out; k++) kiln__discard(y[k]);
      g_full_again++;
      st = recompute(s, x, n_out, y, NULL);
    }
  }
  /* backward through it, to the inputs and parameters that want a gradient */
  int n_y = 0, n_t = 0;
  for (int k = 0; k < n_out && st == KILN_OK; k++) {
    if (!y[k]) st = kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_checkpoint: the recompute left output %d NULL", k);
    else if (gout[k] && kiln_requires_grad(y[k])) {
      ys[n_y] = y[k];
      gs[n_y++] = gout[k];
    }
  }
  for (int i = 0; i < n_in && st == KILN_OK; i++) {
    if (!kiln_function_grad_needed(fc, i)) continue;
    if (n_t == 64) {
      st = kiln_set_error(KILN_ERR_UNSUPPORTED, "kiln_checkpoint: at most 64 tensors take a gradient from a segment");
      break;
    }
    where[n_t] = i;
    targets[n_t++] = NULL;
  }
  if (st == KILN_OK && n_y > 0 && n_t > 0) {
    /* an input's detached copy, or a parameter itself (kept after the outputs in outs) */
    for (int j = 0; j < n_t; j++) {
      int i = where[j];
      targets[j] = i < s->n_in ? x[i] : s->outs[s->n_out + (i - s->n_in)];
    }
    st = kiln_autograd_grad(n_y, ys, gs, n_t, targets, grads);
    for (int j = 0; j < n_t && st == KILN_OK; j++) gin[where[j]] = grads[j];
  }
  if (buf != local) free(buf);
  return st;
}

static const kiln_function seg_fn = {"checkpoint", seg_forward, seg_backward};

static void segment_free(void *p) {
  segment *s = p;
  if (!s) return;
  for (int j = 0; j < s->n_params; j++) kiln_tensor_free(s->outs[s->n_out + j]);
  free(s->outs);
  kept_free(&s->keeps);
  free(s);
}

kiln_status kiln_checkpoint_with(kiln_checkpoint_fn fn, void *ctx, const kiln_checkpoint_options *opts, int n_in,
                                 kiln_tensor *const *inputs, int n_out, kiln_tensor **outputs) {
  static const char who[] = "kiln_checkpoint";
  const kiln_checkpoint_options none = {0, NULL, KILN_CHECKPOINT_KEEP_DEFAULT};
  if (!opts) opts = &none;
  int n_gens = opts->n_gens;
  kiln_generator *const *gens = opts->gens;
  if (!fn || n_in < 0 || (n_in > 0 && !inputs) || n_out < 1 || n_out > KILN__OP_MAX_OUT || !outputs ||
      n_gens < 0 || n_gens > MAX_GENS || (n_gens > 0 && !gens))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                          "%s: needs a function, inputs, 1 to %d outputs and at most %d generators", who,
                          KILN__OP_MAX_OUT, MAX_GENS);
  for (int k = 0; k < n_out; k++) outputs[k] = NULL;
  if (opts->keep != KILN_CHECKPOINT_KEEP_DEFAULT && opts->keep != KILN_CHECKPOINT_KEEP_PRODUCTS)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: unknown keep policy %d", who, (int)opts->keep);
  for (int i = 0; i < n_in; i++)
    if (!inputs[i]) {
      if (kiln_last_error() == KILN_OK) kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: input %d is NULL", who, i);
      return kiln_last_error();
    }
  for (int k = 0; k < n_gens; k++)
    if (!gens[k]) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: generator %d is NULL", who, k);
  segment *s = calloc(1, sizeof *s);
  if (!s) return kiln_set_error(KILN_ERR_OOM, "%s: out of host memory", who);
  s->fn = fn;
  s->ctx = ctx;
  s->n_in = n_in;
  s->n_out = n_out;
  s->n_gens = n_gens + 1;
  s->gens[0].g = kiln_generator_global();
  for (int k = 0; k < n_gens; k++) s->gens[k + 1].g = gens[k];
  rng_save(s);
  kiln__autocast_get_state(&s->ac);
  bool record = kiln_grad_enabled();

  /* the forward: grad mode off, in a scope of its own; the parameters collected */
  collector col = {.n_exclude = n_in, .exclude = inputs, .outer = collecting,
                   .elide = kiln__knob_on("KILN_CHECKPOINT_ELIDE", true)},
            *prev_col = collecting;
  col.keep_products = col.elide && opts->keep == KILN_CHECKPOINT_KEEP_PRODUCTS;
  kiln_tensor *outs[KILN__OP_MAX_OUT] = {NULL};
  kiln_status st = record ? collect_on() : KILN_OK;
  if (st == KILN_OK) {
    col.depth = kiln__op_depth();
    if (record) collecting = &col;
    bool prev = kiln_set_grad_enabled(false);
    kiln_scope_begin();
    st = fn(ctx, n_in, inputs, n_out, outs);
    if (st == KILN_OK)
      for (int k = 0; k < n_out && st == KILN_OK; k++) {
        if (!outs[k])
          st = kiln_last_error() != KILN_OK
                   ? kiln_last_error()
                   : kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: the function returned no tensor for output %d",
                                    who, k);
      }
    else if (kiln_last_error() == KILN_OK)
      kiln_set_error(st, "%s: the function failed", who);
    for (int k = 0; k < n_out; k++) kiln_tensor_ref(outs[k]); /* NULL-safe: outlives the scope */
    kiln_scope_end();
    kiln_set_grad_enabled(prev);
    if (record) {
      collecting = prev_col;
      collect_off();
    }
  }
  for (int k = 0; k < n_out; k++) kiln__scope_track(outs[k]); /* the caller's scope owns them now */
  if (st == KILN_OK && col.found.oom) st = kiln_set_error(KILN_ERR_OOM, "%s: out of host memory", who);
  /* An enclosing checkpoint's forward must see this segment's parameters too. */
  for (int j = 0; prev_col && j < col.found.n; j++) tlist_add(&prev_col->found, col.found.v[j]);
  bool any = false;
  for (int i = 0; i < n_in && record; i++) any = any || inputs[i]->requires_grad;
  any = any || col.found.n > 0;
  if (st != KILN_OK || !record || !any) {
    if (st == KILN_OK)
      for (int k = 0; k < n_out; k++) outputs[k] = outs[k];
    else
      for (int k = 0; k < n_out; k++) kiln__discard(outs[k]);
    free(col.found.v);
    kept_free(&col.keeps);
    free(s);
    return st;
  }
  /* One node for the segment: inputs, then the parameters (kept in outs after the outputs). */
  int n_all = n_in + col.found.n;
  kiln_tensor **all = malloc((size_t)(n_all > 0 ? n_all : 1) * sizeof *all);
  s->outs = malloc((size_t)(n_out + col.found.n) * sizeof *s->outs);
  if (!all || !s->outs) {
    free(all);
    free(s->outs);
    free(s);
    free(col.found.v);
    kept_free(&col.keeps);
    return kiln_set_error(KILN_ERR_OOM, "%s: out of host memory", who);
  }
  for (int i = 0; i < n_in; i++) all[i] = inputs[i];
  for (int k = 0; k < n_out; k++) s->outs[k] = outs[k];
  for (int j = 0; j < col.found.n; j++) {
    all[n_in + j] = col.found.v[j];
    s->outs[n_out + j] = kiln_tensor_ref(col.found.v[j]);
  }
  s->n_params = col.found.n;
  free(col.found.v);
  plan_skips(s, &col, n_out, outs);
  s->keeps = col.keeps;
  st = kiln_function_apply(&seg_fn, s, segment_free, n_all, all, n_out, outputs);
  free(all);
  return st;
}

kiln_status kiln_checkpoint_ex(kiln_checkpoint_fn fn, void *ctx, int n_gens, kiln_generator *const *gens,
                               int n_in, kiln_tensor *const *inputs, int n_out, kiln_tensor **outputs) {
  const kiln_checkpoint_options o = {n_gens, gens, KILN_CHECKPOINT_KEEP_DEFAULT};
  return kiln_checkpoint_with(fn, ctx, &o, n_in, inputs, n_out, outputs);
}

kiln_status kiln_checkpoint(kiln_checkpoint_fn fn, void *ctx, int n_in, kiln_tensor *const *inputs, int n_out,
                            kiln_tensor **outputs) {
  return kiln_checkpoint_with(fn, ctx, NULL, n_in, inputs, n_out, outputs);
}
