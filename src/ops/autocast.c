/*
** Autocast (torch.autocast): a per-thread, nestable region in which the ops with an
** autocast class (op.h, kiln__amp) see their floating inputs cast on the way in:
**
**   LOWER    every f32 input on the region's device type -> the region's dtype (f16/bf16);
**            f64 stays (PyTorch casts only "eligible" f32 inputs the same way);
**   F32      every f16/bf16 input -> f32 (an op flagged KILN__OP_AMP_READS_16, whose kernels
**            read bf16 inputs and compute in f32, gets them uncast and gives f32 outputs:
**            the same numbers without the cast kernels; f16 is still cast, see op.h);
**   PROMOTE  mixed floating inputs -> the widest of them (kiln_dtype_promote).
**
** The policy is the op path's step 3 (kiln__set_autocast_hook). Casts are recorded
** to_dtype ops, so gradients flow back through them in the dtype of the tensor that was
** cast: an f32 parameter gets an f32 gradient. docs/autocast.md lists the classes. The
** LOWER casts of one op are made together (lower_inputs: to_dtype_many, one kernel for a
** layer's weight and bias, and one for their gradients), since on a GPU a small model's
** step is bound by launches.
**
** Weight-cast cache: a LOWER cast of a leaf that requires grad (a parameter), made with
** grad mode on, is kept and reused until the outermost region ends (PyTorch caches the
** same casts): a weight used by several ops, or in several steps of one region, is cast
** once. Keyed by kiln_tensor_id (never reused), so a freed parameter can never alias a
** new one. The cache lives only for a region: a parameter updated in place by the
** optimizer between two regions is cast afresh.
**
** Kept copies across regions: a parameter's cast (an f32 contiguous leaf) is also kept on
** the parameter (t->amp_copy), and the fused optimizers (ADAM_MULTI, SGD_MULTI) rewrite
** it in the same kernel as the update and stamp it with the parameter's new storage
** version (ops_optim.c). A later region whose cache does not have the parameter uses that
** copy instead of casting (amp_copy: an alias, no kernel) while the storage's version and
** the process's write epoch are the stamped ones; every in-place op bumps its inputs'
** versions and every raw pointer handed out bumps its storage's (src/core), and a device
** graph's replay the epoch, so a parameter written in any other way is cast afresh. Not
** inside a graph capture (PyTorch turns its cast cache off there too): a replay could not
** check the stamp, so a captured step casts. Caveat, as in PyTorch: a graph kept for a
** second backward after an optimizer step reads the updated 16-bit weight it saved.
**
** The weights' gradients: linear's rule writes them in f32 (kiln__grad_dtype), and the
** casts' rule hands them on: no cast kernel in backward.
**
** Ops that a backward runs are not cast: a rule must give gradients in the dtypes of its
** inputs. A region applies at the backward depth where it began (kiln__backward_depth),
** so a gradient-checkpoint recompute (which runs inside a backward rule) is cast while
** the rules of the engine it then runs are not.
**
** Casts made with no scope open would belong to no one (the path does not free its
** inputs): they are kept in the region's list and released at the outermost end.
*/
#include "ops/op.h"

#include <stdlib.h>
#include <string.h>

#define AC_TYPES 4   /* device types with a state of their own (cpu, cuda, two more) */
#define AC_DEPTH 64  /* nesting limit */

typedef struct ac_entry {
  int64_t id;
  kiln_dtype dt;
  kiln_tensor *t; /* ref held */
} ac_entry;

/* A list of held tensors: the weight casts (with keys) and the scope-less casts. */
typedef struct ac_cache {
  ac_entry *v;
  int n, cap;
} ac_cache;

typedef struct ac_frame {
  kiln__autocast_state prev; /* the state before this region */
  ac_cache *cache;           /* a fresh cache this frame opened, else NULL */
} ac_frame;

static _Thread_local kiln__autocast_state cur;
static _Thread_local ac_frame stack[AC_DEPTH];
static _Thread_local int depth;
static _Thread_local ac_cache *cache; /* the innermost cache; NULL outside any region */

static void cache_free(ac_cache *c) {
  if (!c) return;
  for (int i = 0; i < c->n; i++) kiln_tensor_free(c->v[i].t);
  free(c->v);
  free(c);
}

static kiln_status cache_put(int64_t id, kiln_dtype dt, kiln_tensor *t) {
  if (cache->n == cache->cap) {
    int ncap = cache->cap ? cache->cap * 2 : 16;
    ac_entry *nv = realloc(cache->v, (size_t)ncap * sizeof *nv);
    if (!nv) return kiln_set_error(KILN_ERR_OOM, "autocast: out of host memory");
    cache->v = nv;
    cache->cap = ncap;
  }
  cache->v[cache->n++] = (ac_entry){id, dt, kiln_tensor_ref(t)};
  return KILN_OK;
}

static kiln_tensor *cache_get(int64_t id, kiln_dtype dt) {
  for (int i = 0; i < cache->n; i++)
    if (cache->v[i].id == id && cache->v[i].dt == dt) return cache->v[i].t;
  return NULL;
}

/* t cast to dt for the op (a recorded to_dtype when grad mode is on), or NULL. */
static kiln_tensor *cast(kiln_tensor *t, kiln_dtype dt, bool lower) {
  bool cacheable = lower && t->requires_grad && !t->grad_fn && kiln_grad_enabled();
  if (cacheable) {
    kiln_tensor *c = cache_get(kiln_tensor_id(t), dt);
    if (c) return c;
  }
  kiln_tensor *c = kiln_to_dtype(t, dt);
  if (!c) return NULL;
  /* The cache holds a reference to a weight cast; a cast no scope owns is held by the
  ** region too (id 0 never matches a lookup), and only by it. */
  bool scopeless = kiln_scope_depth() == 0;
  if (cacheable || scopeless) {
    kiln_status st = cache_put(cacheable ? kiln_tensor_id(t) : 0, dt, c);
    if (scopeless) kiln_tensor_free(c);
    if (st != KILN_OK) return NULL;
  }
  return c;
}

/* Keeps c, the cast of t made for the region, as cast() does: in the weight cache when
** cacheable, in the region's list when no scope owns it. */
static kiln_status keep_cast(kiln_tensor *t, kiln_dtype dt, kiln_tensor *c, bool cacheable) {
  bool scopeless = kiln_scope_depth() == 0;
  if (!cacheable && !scopeless) return KILN_OK;
  kiln_status st = cache_put(cacheable ? kiln_tensor_id(t) : 0, dt, c);
  if (scopeless) kiln_tensor_free(c);
  return st;
}

/* Casts in[idx[0..m)] to dt in one kiln__to_dtype_many (one kernel; a node for the first
** n_grad), each kept as cast() keeps its own; a single one goes through cast() as before. */
static kiln_status cast_group(kiln_tensor **in, const int *idx, const bool *cacheable, int m, int n_grad, kiln_dtype dt) {
  if (m == 0) return KILN_OK;
  if (m == 1) {
    kiln_tensor *c = cast(in[idx[0]], dt, true);
    if (!c) return kiln_last_error();
    in[idx[0]] = c;
    return KILN_OK;
  }
  kiln_tensor *src[KILN__OP_MAX_OUT] = {NULL}, *dst[KILN__OP_MAX_OUT] = {NULL};
  for (int j = 0; j < m; j++) src[j] = in[idx[j]];
  kiln_status st = kiln__to_dtype_many(m, src, dt, n_grad, dst);
  for (int j = 0; j < m && st == KILN_OK; j++) {
    st = keep_cast(src[j], dt, dst[j], cacheable[j]);
    in[idx[j]] = dst[j];
  }
  return st;
}

/* Whether dev is capturing a graph now. */
bool kiln__capturing(kiln_device dev) {
  const kiln__backend *b = kiln__backend_get(dev.type);
  return b && b->graph && b->graph->capturing && b->graph->capturing(dev.index);
}

/* t's kept copy in dt when it still reads as t does (see the top), else NULL. */
static kiln_tensor *valid_copy(const kiln_tensor *t, kiln_dtype dt) {
  const kiln_tensor *c = t->amp_copy;
  if (!c || c->dtype != dt || t->amp_copy_version != kiln__storage_version(t->storage) ||
      t->amp_copy_epoch != kiln__write_epoch())
    return NULL;
  return t->amp_copy;
}

/* Keeps c, the cast of parameter t just made, as t's copy, stamped valid now. */
static void adopt_copy(kiln_tensor *t, kiln_tensor *c) {
  if (t->dtype != KILN_F32 || !kiln_is_contiguous(t) || !kiln_is_contiguous(c) || t->amp_copy == c) return;
  kiln_tensor *a = kiln__tensor_alias(c, false); /* the bytes, without c's history */
  if (!a) {
    kiln_clear_error(); /* no copy kept: the next region casts again */
    return;
  }
  kiln_tensor_free(t->amp_copy);
  t->amp_copy = a;
  t->amp_copy_version = kiln__storage_version(t->storage);
  t->amp_copy_epoch = kiln__write_epoch();
}

/* LOWER: the f32 inputs go to the region's dtype. A weight cast already made in the region
** is reused; the others are cast together in one kernel (a layer's batch, weight and bias;
** and the weight's and bias's gradients in one on the way back), those that need a gradient
** first: the node covers only them, so the batch is never made to need one. */
static kiln_status lower_inputs(int n_in, kiln_tensor **in, const kiln__autocast_type *(*state)(const kiln_tensor *)) {
  int idx[KILN__OP_MAX_OUT], oi[KILN__OP_MAX_OUT], ki[KILN__OP_MAX_OUT], ng = 0, no = 0, nk = 0;
  kiln_tensor *kept[KILN__OP_MAX_OUT], *kept_src[KILN__OP_MAX_OUT];
  bool cacheable[KILN__OP_MAX_OUT];
  kiln_dtype dt = KILN_F32;
  bool grad_on = kiln_grad_enabled();
  int cap = -1; /* whether the inputs' device is capturing: asked once, when needed */
  for (int i = 0; i < n_in; i++) {
    kiln_tensor *t = in[i];
    if (!t || t->dtype != KILN_F32) continue;
    const kiln__autocast_type *s = state(t);
    if (!s) continue;
    if (n_in > KILN__OP_MAX_OUT || (ng + no > 0 && s->dtype != dt)) { /* one by one, as before */
      kiln_tensor *c = cast(t, s->dtype, true);
      if (!c) return kiln_last_error();
      in[i] = c;
      continue;
    }
    dt = s->dtype;
    bool weight = t->requires_grad && !t->grad_fn && grad_on;
    if (weight) {
      kiln_tensor *c = cache_get(kiln_tensor_id(t), dt);
      if (c) {
        in[i] = c;
        continue;
      }
      if (t->amp_copy && cap < 0) cap = kiln__capturing(kiln_device_of(t));
      kiln_tensor *k = cap == 0 ? valid_copy(t, dt) : NULL;
      if (k) { /* the optimizer's copy: no cast */
        kept_src[nk] = t;
        kept[nk] = k;
        ki[nk++] = i;
        continue;
      }
    }
    if (t->requires_grad && grad_on) {
      cacheable[ng] = weight;
      idx[ng++] = i;
    } else {
      oi[no++] = i;
    }
  }
  for (int j = 0; j < no; j++) { /* the rest after those that need a gradient */
    cacheable[ng + j] = false;
    idx[ng + j] = oi[j];
  }
  if (nk > 0) { /* the kept copies: one node for them all, no kernel */
    /* with no weight to cast, the rest (the batch) is cast in the same op call */
    int nr = ng == 0 && nk + no <= KILN__OP_MAX_OUT ? no : 0;
    for (int j = 0; j < nr; j++) {
      kept_src[nk + j] = in[oi[j]];
      kept[nk + j] = NULL;
    }
    kiln_tensor *outs[KILN__OP_MAX_OUT];
    kiln_status st = kiln__amp_copy_many(nk + nr, kept_src, kept, dt, outs);
    for (int j = 0; j < nk + nr && st == KILN_OK; j++) {
      st = j < nk ? keep_cast(kept_src[j], dt, outs[j], true) : keep_cast(kept_src[j], dt, outs[j], false);
      in[j < nk ? ki[j] : oi[j - nk]] = outs[j];
    }
    if (st != KILN_OK) return st;
    if (nr == no) no = 0; /* all cast */
  }
  kiln_tensor *src[KILN__OP_MAX_OUT];
  for (int j = 0; j < ng; j++) src[j] = in[idx[j]];
  kiln_status st = cast_group(in, idx, cacheable, ng + no, ng, dt);
  if (st != KILN_OK) return st;
  /* the parameters just cast keep their casts for the optimizer to rewrite (not when
  ** capturing: a replay could not tell whether the copy is still valid) */
  for (int j = 0; j < ng; j++) {
    if (!cacheable[j] || (dt != KILN_BF16 && dt != KILN_F16)) continue;
    if (cap < 0) cap = kiln__capturing(kiln_device_of(src[j]));
    if (cap == 0) adopt_copy(src[j], in[idx[j]]);
  }
  return KILN_OK;
}

static const kiln__autocast_type *state_of(const kiln_tensor *t) {
  kiln_device_type ty = t->storage->device.type;
  if ((int)ty < 0 || (int)ty >= AC_TYPES || !cur.type[ty].enabled) return NULL;
  return &cur.type[ty];
}

static kiln_status autocast_hook(const kiln__op *op, int n_in, kiln_tensor **in, bool *f32_out) {
  if (cur.n_enabled == 0 || kiln__backward_depth() != cur.level) return KILN_OK;
  if (op->amp == KILN__AMP_LOWER) return lower_inputs(n_in, in, state_of);
  kiln_dtype widest = KILN_DTYPE__COUNT;
  if (op->amp == KILN__AMP_PROMOTE) {
    int n_float = 0;
    bool mixed = false;
    for (int i = 0; i < n_in; i++) {
      kiln_tensor *t = in[i];
      if (!t || !kiln_dtype_is_float(t->dtype) || !state_of(t)) continue;
      if (n_float++ == 0) {
        widest = t->dtype;
      } else if (t->dtype != widest) {
        mixed = true;
        widest = kiln_dtype_promote(widest, t->dtype);
      }
    }
    if (!mixed) return KILN_OK;
  }
  for (int i = 0; i < n_in; i++) {
    kiln_tensor *t = in[i];
    if (!t || !kiln_dtype_is_float(t->dtype)) continue;
    const kiln__autocast_type *s = state_of(t);
    if (!s) continue;
    kiln_dtype to;
    switch (op->amp) {
    case KILN__AMP_LOWER:
      if (t->dtype != KILN_F32) continue;
      to = s->dtype;
      break;
    case KILN__AMP_F32:
      if (t->dtype != KILN_F16 && t->dtype != KILN_BF16) continue;
      if (t->dtype == KILN_BF16 && (op->flags & KILN__OP_AMP_READS_16)) { /* the kernel reads it, computes in f32 */
        *f32_out = true;
        continue;
      }
      to = KILN_F32;
      break;
    case KILN__AMP_PROMOTE:
      if (t->dtype == widest) continue;
      to = widest;
      break;
    default: continue;
    }
    kiln_tensor *c = cast(t, to, op->amp == KILN__AMP_LOWER);
    if (!c) return kiln_last_error();
    in[i] = c;
  }
  return KILN_OK;
}

static void install(void) {
  /* Once, for good: with no region on this thread the hook returns at its first test. */
  static atomic_bool installed;
  if (!atomic_exchange(&installed, true)) kiln__set_autocast_hook(autocast_hook);
}

static kiln_status push(const kiln__autocast_state *next, bool fresh_cache, const char *who) {
  if (depth == AC_DEPTH)
    return kiln_set_error(KILN_ERR_STATE, "%s: autocast regions nest at most %d deep", who, AC_DEPTH);
  ac_cache *c = NULL;
  if (fresh_cache || !cache) {
    if (!(c = calloc(1, sizeof *c))) return kiln_set_error(KILN_ERR_OOM, "%s: out of host memory", who);
  }
  install();
  stack[depth].prev = cur;
  stack[depth].cache = c;
  depth++;
  if (c) cache = c;
  cur = *next;
  cur.n_enabled = 0;
  for (int k = 0; k < AC_TYPES; k++) cur.n_enabled += cur.type[k].enabled;
  return KILN_OK;
}

static kiln_status pop(const char *who) {
  if (depth == 0) return kiln_set_error(KILN_ERR_STATE, "%s: no autocast region is open", who);
  depth--;
  cur = stack[depth].prev;
  if (stack[depth].cache) {
    cache_free(stack[depth].cache);
    cache = NULL;
    for (int k = depth - 1; k >= 0 && !cache; k--) cache = stack[k].cache;
  }
  return KILN_OK;
}

kiln_status kiln_autocast_begin_enabled(kiln_device_type device_type, kiln_dtype dtype, bool enabled) {
  static const char who[] = "kiln_autocast_begin";
  if (!kiln_backend_name(device_type) || (int)device_type >= AC_TYPES)
    return kiln_set_error(KILN_ERR_DEVICE, "%s: unknown device type %d", who, (int)device_type);
  if (dtype != KILN_F16 && dtype != KILN_BF16)
    return kiln_set_error(KILN_ERR_DTYPE, "%s: autocast runs ops in float16 or bfloat16, not %s", who,
                          kiln_dtype_name(dtype));
  kiln__autocast_state next = cur;
  next.type[device_type].enabled = enabled;
  next.type[device_type].dtype = dtype;
  next.level = depth > 0 ? cur.level : kiln__backward_depth();
  return push(&next, false, who);
}

kiln_status kiln_autocast_begin(kiln_device_type device_type, kiln_dtype dtype) {
  return kiln_autocast_begin_enabled(device_type, dtype, true);
}

kiln_status kiln_autocast_end(void) { return pop("kiln_autocast_end"); }

bool kiln_autocast_is_enabled(kiln_device_type device_type) {
  return (int)device_type >= 0 && (int)device_type < AC_TYPES && cur.type[device_type].enabled;
}

kiln_dtype kiln_autocast_dtype(kiln_device_type device_type) {
  if ((int)device_type >= 0 && (int)device_type < AC_TYPES && cur.type[device_type].enabled)
    return cur.type[device_type].dtype;
  return KILN_F32;
}

/* ---- for gradient checkpointing ---- */
void kiln__autocast_get_state(kiln__autocast_state *s) { *s = cur; }

kiln_status kiln__autocast_push_state(const kiln__autocast_state *s) {
  kiln__autocast_state next = *s;
  next.level = kiln__backward_depth();
  return push(&next, true, "kiln_checkpoint");
}

kiln_status kiln__autocast_pop_state(void) { return pop("kiln_checkpoint"); }
