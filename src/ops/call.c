/*
** The one call path of every op (see op.h for its steps), the observer list and the
** helpers that op definitions share.
*/
#include "ops/op.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

/* ---- observers ---- */
#define MAX_OBSERVERS 8 /* kiln__span keeps as many tokens */
static pthread_mutex_t obs_lock = PTHREAD_MUTEX_INITIALIZER;
static const kiln__observer *_Atomic observers[MAX_OBSERVERS];
static atomic_int n_observers; /* the fast check: 0 means the path skips step 8 */

kiln_status kiln__observer_add(const kiln__observer *o) {
  pthread_mutex_lock(&obs_lock);
  kiln_status st = KILN_OK;
  int free_slot = -1;
  for (int i = 0; i < MAX_OBSERVERS; i++) {
    const kiln__observer *cur = atomic_load(&observers[i]);
    if (cur == o) free_slot = -2; /* already there */
    if (!cur && free_slot == -1) free_slot = i;
  }
  if (free_slot >= 0) {
    atomic_store(&observers[free_slot], o);
    atomic_fetch_add(&n_observers, 1);
  } else if (free_slot == -1) {
    st = kiln_set_error(KILN_ERR_STATE, "kiln: at most %d op observers can be on at once", MAX_OBSERVERS);
  }
  pthread_mutex_unlock(&obs_lock);
  return st;
}

void kiln__observer_remove(const kiln__observer *o) {
  pthread_mutex_lock(&obs_lock);
  for (int i = 0; i < MAX_OBSERVERS; i++)
    if (atomic_load(&observers[i]) == o) {
      atomic_store(&observers[i], NULL);
      atomic_fetch_sub(&n_observers, 1);
    }
  pthread_mutex_unlock(&obs_lock);
}

static _Thread_local int depth;
static _Thread_local bool in_observer; /* an observer's own ops are not observed */

int kiln__op_depth(void) { return depth; }

static kiln__autocast_fn autocast_hook;
void kiln__set_autocast_hook(kiln__autocast_fn fn) { autocast_hook = fn; }

/* ---- helpers for op definitions ---- */
void kiln__op_meta(kiln__op_ctx *c, int k, int ndim, const int64_t *shape, kiln_dtype dt) {
  c->meta[k].ndim = ndim;
  for (int d = 0; d < ndim; d++) c->meta[k].shape[d] = shape[d];
  c->meta[k].dtype = dt;
  c->meta[k].channels_last = false;
}

void kiln__op_meta_like(kiln__op_ctx *c, int k, const kiln_tensor *t, kiln_dtype dt) {
  kiln__op_meta(c, k, t->ndim, t->shape, dt);
  /* Casts keep the memory format (PyTorch's preserve_format): to_dtype, and any grouped
  ** cast named after it (autocast's), so a channels-last model stays so under autocast.
  ** By name, as the profiler's cost table: the rule is about what the op is. to_infer
  ** clears it for the copies that must give NCHW memory (contiguous, another device). */
  if (!strncmp(c->op->name, "to_dtype", 8)) kiln__op_meta_keep_format(c, k, t);
}

kiln_status kiln__broadcast_shapes(const char *op, int nd_a, const int64_t *sa, int nd_b, const int64_t *sb,
                                   int *ndim, int64_t *shape) {
  int n = nd_a > nd_b ? nd_a : nd_b;
  for (int i = 0; i < n; i++) {
    int ia = i - (n - nd_a), ib = i - (n - nd_b);
    int64_t a = ia >= 0 ? sa[ia] : 1, b = ib >= 0 ? sb[ib] : 1;
    if (a != b && a != 1 && b != 1)
      return kiln_set_error(KILN_ERR_SHAPE, "%s: shapes %s and %s cannot be broadcast (dim %d: %lld vs %lld)", op,
                            kiln__shape_cstr(nd_a, sa), kiln__shape_cstr(nd_b, sb), i, (long long)a, (long long)b);
    shape[i] = a == 1 ? b : a;
  }
  *ndim = n;
  return KILN_OK;
}

kiln_status kiln__broadcast_shape(const char *op, const kiln_tensor *a, const kiln_tensor *b, int *ndim,
                                  int64_t *shape) {
  return kiln__broadcast_shapes(op, a->ndim, a->shape, b->ndim, b->shape, ndim, shape);
}

kiln_tensor *kiln__as_dtype_nograd(kiln_tensor *t, kiln_dtype dt) {
  if (t->dtype == dt) return t;
  bool prev = kiln_set_grad_enabled(false);
  kiln_tensor *c = kiln_to_dtype(t, dt);
  kiln_set_grad_enabled(prev);
  return c;
}

kiln_status kiln__run_into(kiln_tensor *out, kiln__kargs *a) {
  a->n_out = a->n_out ? a->n_out : 1;
  a->out[0] = kiln__view_of(out);
  if (kiln_numel(out) == 0) return KILN_OK;
  return kiln__dispatch(kiln_device_of(out), a);
}

int kiln__attrs_describe(const kiln__op *op, const void *rec, kiln_attr *out, int max) {
  int n = 0;
  const char *base = rec;
  for (int k = 0; rec && k < op->n_attrs && n < max; k++) {
    const kiln__attr_field *f = &op->attrs[k];
    kiln_attr a;
    memset(&a, 0, sizeof a);
    a.name = f->name;
    const void *p = base + f->offset;
    switch (f->type) {
    case KILN__A_INT: a.type = KILN_ATTR_INT; memcpy(&a.i, p, sizeof(int64_t)); break;
    case KILN__A_INT32: {
      int v;
      memcpy(&v, p, sizeof v);
      a.type = KILN_ATTR_INT;
      a.i = v;
      break;
    }
    case KILN__A_FLOAT: a.type = KILN_ATTR_FLOAT; memcpy(&a.f, p, sizeof(double)); break;
    case KILN__A_BOOL: {
      bool v;
      memcpy(&v, p, sizeof v);
      a.type = KILN_ATTR_BOOL;
      a.i = v;
      break;
    }
    case KILN__A_INTS: {
      int cnt;
      memcpy(&cnt, base + f->count_offset, sizeof cnt);
      a.type = KILN_ATTR_INTS;
      a.n = cnt;
      a.ints = (const int64_t *)p;
      break;
    }
    case KILN__A_DTYPE: {
      kiln_dtype v;
      memcpy(&v, p, sizeof v);
      a.type = KILN_ATTR_DTYPE;
      a.i = v;
      a.s = kiln_dtype_name(v);
      break;
    }
    case KILN__A_DEVICE: {
      kiln_device v;
      memcpy(&v, p, sizeof v);
      a.type = KILN_ATTR_STRING;
      a.i = v.index;
      a.s = kiln__device_cstr(v);
      break;
    }
    case KILN__A_ENUM: {
      int v;
      memcpy(&v, p, sizeof v);
      a.type = KILN_ATTR_STRING;
      a.i = v;
      a.s = f->names ? f->names[v] : "?";
      break;
    }
    }
    out[n++] = a;
  }
  return n;
}

/* ---- the path ---- */
static kiln_tensor *fail(kiln__op_ctx *c, int n_alloc) {
  for (int k = 0; k < n_alloc; k++) {
    kiln__discard(c->out[k]);
    c->out[k] = NULL;
  }
  return NULL;
}

/* The intermediates forward parked for save(): each was a new reference (owned by the
** scope when one is open), now released either way. */
static void release_tmps(kiln__op_ctx *c) {
  for (int k = 0; k < KILN__OP_MAX_TMP; k++) {
    kiln_tensor *t = c->tmp[k];
    if (!t) continue;
    bool shared = false;
    for (int i = 0; i < c->n_in && !shared; i++) shared = c->in[i] == t;
    for (int i = 0; i < c->n_out && !shared; i++) shared = c->out[i] == t;
    for (int j = 0; j < k && !shared; j++) shared = c->tmp[j] == t;
    if (!shared) kiln__discard(t);
    c->tmp[k] = NULL;
  }
}

static int observe_begin(const kiln__op_event *e, kiln__obs_token *toks) {
  int n = 0;
  for (int i = 0; i < MAX_OBSERVERS; i++) {
    const kiln__observer *o = atomic_load_explicit(&observers[i], memory_order_acquire);
    if (!o) continue;
    toks[n].o = o;
    toks[n].token = o->begin ? o->begin(e, o->ctx) : NULL;
    n++;
  }
  return n;
}

/* Whether an observer has the op's kernels skipped (kiln__observer.skip). */
static bool observe_skip(const kiln__op_event *e, kiln_tensor **use, kiln__obs_token *toks, int n) {
  bool skip = false;
  for (int i = 0; i < n && !skip; i++)
    if (toks[i].o->skip) skip = toks[i].o->skip(e, use, toks[i].o->ctx);
  return skip;
}

static void observe_made(const kiln__op_event *e, kiln_tensor *const *tmp, kiln__obs_token *toks, int n) {
  for (int i = 0; i < n; i++)
    if (toks[i].o->made) toks[i].o->made(e, tmp, toks[i].o->ctx);
}

/* A skipped call's outputs and temporaries handed over by an observer (new references,
** owned by the scope from here on) in place of those the path allocated. */
static void take_kept(kiln__op_ctx *c, kiln_tensor **use, int *n_alloc) {
  for (int k = 0; k < c->n_out; k++) {
    if (k < *n_alloc) kiln__discard(c->out[k]);
    c->out[k] = use[k] ? kiln__scope_track(use[k]) : NULL;
  }
  *n_alloc = 0;
  for (int k = 0; k < KILN__OP_MAX_TMP; k++)
    if (use[KILN__OP_MAX_OUT + k]) c->tmp[k] = kiln__scope_track(use[KILN__OP_MAX_OUT + k]);
}

static kiln_status observe_end(const kiln__op_event *e, kiln__obs_token *toks, int n) {
  kiln_status st = KILN_OK;
  for (int i = 0; i < n; i++)
    if (toks[i].o->end) {
      kiln_status s = toks[i].o->end(e, toks[i].token, toks[i].o->ctx);
      if (st == KILN_OK) st = s;
    }
  return st;
}

_Static_assert(sizeof(((kiln__span *)0)->toks) / sizeof(((kiln__span *)0)->toks[0]) >= MAX_OBSERVERS,
               "a span keeps a token for every observer");

void kiln__span_begin(kiln__span *s, const kiln__op *op, int n_in, kiln_tensor *const *in) {
  s->on = atomic_load_explicit(&n_observers, memory_order_relaxed) > 0 && !in_observer;
  if (!s->on) return;
  s->ev = (kiln__op_event){.op = op, .n_in = n_in, .in = in, .out = s->out, .depth = depth,
                           .backward = kiln__in_backward(), .span = true, .status = KILN_OK};
  in_observer = true;
  s->n_tok = observe_begin(&s->ev, s->toks);
  in_observer = false;
  depth++;
}

kiln_status kiln__span_end(kiln__span *s, int n_out, kiln_tensor *const *out, kiln_status st) {
  if (!s->on) return st;
  depth--;
  int k = 0;
  for (int i = 0; i < n_out && k < KILN__OP_MAX_OUT; i++)
    if (out[i]) s->out[k++] = out[i];
  s->ev.n_out = st == KILN_OK ? k : 0;
  s->ev.status = st;
  in_observer = true;
  kiln_status ost = observe_end(&s->ev, s->toks, s->n_tok);
  in_observer = false;
  return st == KILN_OK ? ost : st;
}

static kiln_tensor *call(const kiln__op *op, int n_in, kiln_tensor *const *in, const void *attrs,
                         kiln_tensor **out, kiln_status *status) {
  kiln__op_ctx c;
  /* Only the fields the path reads before infer are set here: the struct is ~1 KB and
  ** this runs for every op. */
  c.op = op;
  c.attrs = attrs;
  c.n_in = n_in;
  c.n_out = op->n_out;
  c.differentiable = op->backward != NULL;
  c.amp_f32 = false;
  c.n_node_out = 0;
  for (int k = 0; k < KILN__OP_MAX_OUT; k++) c.out[k] = NULL, c.meta[k].ndim = -1; /* -1: infer gave no shape */
  for (int k = 0; k < KILN__OP_MAX_TMP; k++) c.tmp[k] = NULL;
  *status = KILN_OK;

  /* 1. NULL inputs pass through; 2. one device (the first input's; the others match).
  ** One loop, with the device read inline: this runs for every op. */
  c.device = kiln_device_cpu();
  bool any_device = (op->flags & (KILN__OP_CREATION | KILN__OP_ANY_DEVICE)) != 0;
  int first = -1;
  for (int i = 0; i < n_in; i++) {
    const kiln_tensor *t = in[i];
    if (!t) {
      if (op->optional == UINT32_MAX || (i < 32 && (op->optional >> i) & 1u)) continue;
      if (kiln_last_error() == KILN_OK) kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: input %d is NULL", op->api, i);
      *status = kiln_last_error();
      return NULL;
    }
    kiln_device di = t->storage->device;
    if (first < 0) {
      if (!(op->flags & KILN__OP_CREATION)) c.device = di;
      first = i;
    } else if (!any_device && (di.type != c.device.type || di.index != c.device.index)) {
      *status = kiln_set_error(KILN_ERR_DEVICE,
                               "%s: expected all tensors on one device, but input %d is on %s and "
                               "input %d on %s (move them with kiln_to_device)",
                               op->api, first, kiln__device_cstr(c.device), i, kiln__device_cstr(di));
      return NULL;
    }
  }
  /* the inputs as the op sees them: a copy only when autocast may replace entries */
  bool amp = op->amp != KILN__AMP_NONE && autocast_hook;
  kiln_tensor *local[8], **args = (kiln_tensor **)in;
  if (amp) {
    if (n_in > 8 && !(args = malloc((size_t)n_in * sizeof *args))) {
      *status = kiln_set_error(KILN_ERR_OOM, "%s: out of host memory", op->api);
      return NULL;
    }
    if (n_in <= 8) args = local;
    for (int i = 0; i < n_in; i++) args[i] = in[i];
  }
  c.in = args;

  /* The depth is kept only while observers are on (no one else reads it), so the path
  ** touches no thread-local when none is. */
  bool observe = atomic_load_explicit(&n_observers, memory_order_relaxed) > 0 && !in_observer;
  kiln__obs_token toks[MAX_OBSERVERS];
  int n_tok = 0;
  kiln__op_event ev;
  if (observe) {
    ev.op = op;
    ev.attrs = attrs;
    ev.n_in = n_in;
    ev.in = in;
    ev.n_out = 0;
    ev.out = c.out;
    ev.depth = depth;
    ev.backward = kiln__in_backward();
    ev.span = false;
    ev.status = KILN_OK;
    in_observer = true;
    n_tok = observe_begin(&ev, toks);
    in_observer = false;
    depth++;
  }
  kiln_status st = KILN_OK;
  int n_alloc = 0;
  /* 3. autocast */
  if (amp) st = autocast_hook(op, n_in, args, &c.amp_f32);
  /* 4. infer */
  if (st == KILN_OK && op->infer) st = op->infer(&c);
  /* 5. outputs */
  if (st == KILN_OK && !(op->flags & (KILN__OP_SELF_ALLOC | KILN__OP_COMPOSITE | KILN__OP_INPLACE))) {
    for (int k = 0; k < c.n_out && st == KILN_OK; k++) {
      if (c.meta[k].ndim < 0) { /* an op's infer left an output it counts undescribed: a bug, reported */
        st = kiln_set_error(KILN_ERR_INTERNAL, "%s: output %d has no shape (the op's infer set none)", op->api, k);
        break;
      }
      c.out[k] = c.meta[k].channels_last
                     ? kiln__tensor_new_format(c.meta[k].ndim, c.meta[k].shape, c.meta[k].dtype, c.device, true)
                     : kiln__tensor_new(c.meta[k].ndim, c.meta[k].shape, c.meta[k].dtype, c.device);
      if (!c.out[k]) st = kiln_last_error();
      else n_alloc = k + 1;
    }
  }
  /* 6. forward (an in-place op's inputs are written: their versions move first, so that a
  ** copy derived from them is stale from now on, and one the op itself rewrites can be
  ** stamped with the new version) */
  if (st == KILN_OK && (op->flags & KILN__OP_INPLACE))
    for (int i = 0; i < n_in; i++)
      if (args[i]) kiln__storage_bump(args[i]->storage);
  c.records = st == KILN_OK && c.differentiable &&
              !(op->flags & (KILN__OP_COMPOSITE | KILN__OP_INPLACE | KILN__OP_NO_GRAD)) && kiln__needs_grad(n_in, args);
  bool skip = false;
  if (st == KILN_OK && observe && !(op->flags & (KILN__OP_COMPOSITE | KILN__OP_INPLACE)) &&
      ((op->flags & (KILN__OP_CHECKPOINT_KEEPS | KILN__OP_PRODUCT)) ||
       ((op->flags & KILN__OP_RULE_READS_INPUTS) && c.n_out == 1 && n_alloc == 1))) {
    kiln_tensor *use[KILN__OBS_USE_N] = {NULL};
    ev.n_out = n_alloc;
    in_observer = true;
    skip = observe_skip(&ev, use, toks, n_tok);
    ev.n_out = 0;
    if (skip && use[0]) /* a result kept from the forward */
      take_kept(&c, use, &n_alloc);
    else if (skip) /* a recompute that needs the node, not the values: zeros, unobserved
                   ** (the fill is this op's, not a reader of its output) */
      st = n_alloc == 1 ? kiln_zero_(c.out[0]) : kiln_set_error(KILN_ERR_INTERNAL, "%s: skipped without outputs", op->api);
    in_observer = false;
  }
  if (!skip && st == KILN_OK) {
    st = op->forward(&c);
    if (st == KILN_OK && observe && (op->flags & (KILN__OP_CHECKPOINT_KEEPS | KILN__OP_PRODUCT))) {
      ev.n_out = c.n_out;
      in_observer = true;
      observe_made(&ev, c.tmp, toks, n_tok);
      in_observer = false;
      ev.n_out = 0;
    }
  }
  if (st == KILN_OK && (op->flags & (KILN__OP_SELF_ALLOC | KILN__OP_COMPOSITE))) {
    n_alloc = 0; /* the op's own outputs: not ours to discard */
    if (!c.out[0]) st = kiln_last_error() != KILN_OK ? kiln_last_error() : KILN_ERR_INTERNAL;
  }
  /* 7. autograd */
  if (st == KILN_OK && c.records && kiln_dtype_is_float(c.out[0]->dtype)) {
    int n_node_out = c.n_out;
    /* Trailing integer outputs (max_dim's indices) are not differentiable, as in PyTorch:
    ** they stay out of the node and never require grad. */
    while (n_node_out > 1 && !kiln_dtype_is_float(c.out[n_node_out - 1]->dtype)) n_node_out--;
    if (c.n_node_out > 0 && c.n_node_out < n_node_out) n_node_out = c.n_node_out; /* infer said so */
    kiln__node *node = kiln__node_make(n_node_out, c.out, op->name, op->backward, n_in, args,
                                       op->n_saved, attrs, op->attr_size);
    if (!node) {
      st = kiln_last_error();
    } else {
      node->op = op;
      if (op->save) op->save(&c, node);
    }
  }
  if (observe) depth--;
  release_tmps(&c);
  if (st != KILN_OK && kiln_last_error() == KILN_OK)
    kiln_set_error(st, "%s failed", op->api);
  /* 8. observers */
  if (observe) {
    ev.n_out = st == KILN_OK ? c.n_out : 0;
    ev.status = st;
    in_observer = true;
    kiln_status ost = observe_end(&ev, toks, n_tok);
    in_observer = false;
    if (st == KILN_OK && ost != KILN_OK) st = ost;
  }
  if (amp && args != local) free(args);
  *status = st;
  if (st != KILN_OK) return fail(&c, n_alloc);
  if (out)
    for (int k = 0; k < c.n_out; k++) out[k] = c.out[k];
  return (op->flags & KILN__OP_INPLACE) ? in[0] : c.out[0];
}

kiln_tensor *kiln__op_call(const kiln__op *op, int n_in, kiln_tensor *const *in, const void *attrs,
                           kiln_tensor **out) {
  kiln_status st;
  return call(op, n_in, in, attrs, out, &st);
}

kiln_status kiln__op_call_status(const kiln__op *op, int n_in, kiln_tensor *const *in, const void *attrs) {
  kiln_status st;
  call(op, n_in, in, attrs, NULL, &st);
  return st;
}

/* Keeps profile.c and anomaly.c in a static link: a program linking libkiln.a names
** neither, and the linker only takes an archive's object files that something refers to,
** so KILN_PROFILE and KILN_ANOMALY would do nothing there (their constructors read them). */
__attribute__((used)) static void (*const env_observers[])(void) = {kiln__profile_env_init,
                                                                   kiln__anomaly_env_init};
