/*
** Internals shared by the core, ops and autograd layers. Not API: nothing here is
** exported; names are kiln__ (STYLE.md rule 1).
*/
#ifndef KILN_INT_H
#define KILN_INT_H

#include "kiln.h"
#include "../backend/backend.h"
#include "knobs.h"

#include <stdatomic.h>

#define KILN__UNUSED(x) ((void)(x))

/* Broken invariant: a bug in kiln, never bad input. Goes through the abort hook. */
void kiln__abort(const char *file, int line, const char *msg);
#define KILN__ASSERT(cond)                                                                \
  do {                                                                                    \
    if (!(cond)) kiln__abort(__FILE__, __LINE__, "assertion failed: " #cond);             \
  } while (0)

/* Error helper that returns NULL, for tensor-returning functions. */
#define KILN__FAIL_NULL(code, ...)                                                        \
  do {                                                                                    \
    kiln_set_error((code), __VA_ARGS__);                                                  \
    return NULL;                                                                          \
  } while (0)

/* ---- storage: a refcounted block of memory on one device ---- */
typedef struct kiln__storage {
  atomic_int refcount;
  kiln_device device;
  const kiln__backend *backend;
  void *data;
  size_t nbytes;
  bool borrowed; /* memory not ours (kiln_from_blob-style); never freed */
  bool packed;   /* made by kiln_to_device_many: its views, and between them only padding */
  /* A gradient an autograd node keeps and hands to the engine as its input's gradient
  ** (cross_entropy's fused dlogits): it must outlive every backward, so the engine never
  ** lets a user see or write these bytes; it copies them first (engine.c, accumulate). */
  bool saved_grad;
  /* Write version: bumped (kiln__storage_bump) by every write the host can know of before
  ** it happens: an in-place op on the call path (call.c bumps every input of a
  ** KILN__OP_INPLACE op before its forward), and any raw pointer handed out
  ** (kiln_data_ptr, kiln__tensor_data, kiln__storage_data). A graph replay writes without
  ** the host seeing which storages: it bumps the process's write epoch instead
  ** (kiln__write_epoch). A copy derived from the bytes (autocast's 16-bit copy of a
  ** parameter) is valid while both still read as when it was made. */
  _Atomic uint64_t version;
} kiln__storage;

kiln__storage *kiln__storage_new(kiln_device dev, size_t nbytes); /* NULL + error on OOM */
void kiln__storage_retain(kiln__storage *s);
void kiln__storage_release(kiln__storage *s);
/* For the layers above (ext/kiln_ext.h declares them too, with their contracts): the
** block's first byte; whether another reference than the caller's holds s. */
void *kiln__storage_data(const kiln__storage *s);
bool kiln__storage_in_use(const kiln__storage *s);
void kiln__storage_bump(const kiln__storage *s); /* s's version += 1 (a write is coming) */
uint64_t kiln__storage_version(const kiln__storage *s);
/* The process's write epoch: bumped by every graph replay (kiln_graph_replay). */
uint64_t kiln__write_epoch(void);
void kiln__write_epoch_bump(void);
void kiln__storage_mark_packed(kiln__storage *s);

/* ---- autograd node ---- */
struct kiln__node;
struct kiln__op;
/* Computes the gradients of the node's inputs from the gradient of its output.
** grad_in[i] must be set to a new reference or NULL (no gradient / input does not need
** it); the engine owns what it receives. Returns KILN_OK or an error code. grad_out is
** NULL only for a node with unit_seed_ok, when its gradient is the implicit all-ones seed
** of a backward from its one-element output (no ones tensor is made). A node of several
** outputs gets output 0's gradient as grad_out and the others in n->grad_outs[k] (NULL
** where no gradient reached that output). */
typedef kiln_status (*kiln__backward_fn)(struct kiln__node *n, kiln_tensor *grad_out,
                                         kiln_tensor **grad_in);

typedef struct kiln__edge {
  struct kiln__node *node; /* the input's grad_fn (ref held), or NULL */
  kiln_tensor *leaf;       /* the input itself when it is a leaf needing grad (ref held) */
  int index;               /* which output of node the input is */
} kiln__edge;

/* A node of any arity: the arrays below point into the node's own allocation (one
** malloc per node), sized when it is made. */
typedef struct kiln__node {
  atomic_int refcount;
  const char *name;
  const struct kiln__op *op; /* the op that made it; NULL for custom functions */
  const char *module;        /* the module whose forward made it (interned label) or NULL */
  kiln__backward_fn backward;
  int n_in, n_out, n_saved;
  kiln__edge *next; /* [n_in] */
  bool *needs;      /* [n_in] which inputs need a gradient */
  /* input metadata the rules often need (shape for un-broadcasting, dtype) */
  int *in_ndim;                      /* [n_in] */
  int64_t (*in_shape)[KILN_MAX_DIMS]; /* [n_in] */
  kiln_dtype *in_dtype;              /* [n_in] */
  /* output 0's metadata (the unit seed and retained gradients use it) */
  int out_ndim;
  int64_t out_shape[KILN_MAX_DIMS];
  kiln_dtype out_dtype;
  kiln_device out_device;
  kiln_tensor **saved; /* [n_saved] refs held; released with the node */
  uint32_t saved_counted; /* bit k: slot k's bytes are in the saved-bytes count (memory.c) */
  void *attrs;         /* a copy of the op's attribute record (NULL when it has none) */
  void *state;         /* custom functions: the caller's state, freed by state_free */
  void (*state_free)(void *state);
  bool unit_seed_ok; /* the rule takes grad_out NULL for an implicit unit seed (see above) */
  double s[4];
  int64_t i[KILN_MAX_DIMS + 4];
  /* the output tensors (weak: cleared when a handle dies); used for retain_grad and
  ** kiln__node_save_output. out_weak is output 0's. */
  kiln_tensor *out_weak;
  kiln_tensor **outs_weak; /* [n_out], outs_weak[0] unused (out_weak) */
  /* engine scratch */
  int deps;
  kiln_tensor *grad_acc;    /* output 0's pending gradient */
  kiln_tensor **grad_accs;  /* [n_out] the other outputs' ([0] unused) */
  kiln_tensor **grad_outs;  /* [n_out] during the rule: the gradients of outputs 1.. */
  /* Set by the rule of the one node this node's output feeds (relu), which then hands
  ** on its gradient unmasked: this node's rule reads its gradient as where(mask > 0, g,
  ** 0) (folded into its products). Only for ops with KILN__OP_GRAD_MASK; see
  ** kiln__grad_mask_ok. Freed by the engine after the rule. */
  kiln_tensor *grad_mask;
  /* Set by the rule of the one node a linear's output feeds (residual_layer_norm, whose
  ** kernel sums the columns of the gradient it hands on, kiln__linear_bias_handover): the
  ** linear's bias gradient, which its rule then takes instead of summing g's rows again.
  ** On kiln__grad_mask_ok's terms; freed by the engine after the rule. */
  kiln_tensor *bias_grad;
  bool unit_seed; /* the pending gradient is the implicit unit seed (grad_acc NULL) */
  int visit_mark;
  /* A backward that did not retain the graph ran this node's rule and let go of its saved
  ** tensors (kiln__node_free_saved): a later backward through it fails. */
  bool saved_freed;
} kiln__node;

void kiln__node_release(kiln__node *n);

/* ---- tensor ---- */
struct kiln_tensor {
  atomic_int refcount;
  kiln__storage *storage;
  int64_t offset; /* elements */
  int ndim;
  int64_t shape[KILN_MAX_DIMS];
  int64_t strides[KILN_MAX_DIMS];
  kiln_dtype dtype;
  bool requires_grad;
  bool retains_grad;
  kiln_tensor *grad; /* ref held */
  kiln__node *grad_fn; /* ref held */
  int grad_fn_index;   /* which output of grad_fn this tensor is */
  int64_t id;          /* unique in the process (traces name tensors by it) */
  int scope_refs; /* how many references scopes hold on this handle */
  /* grad-ready hook (kiln_set_grad_ready_hook): edges still to come in this backward */
  kiln_grad_hook hook;
  void *hook_ctx;
  int hook_pending, hook_epoch;
  /* Autocast's 16-bit copy of this parameter (src/ops/autocast.c), kept across regions and
  ** rewritten by the fused optimizers in the same kernel as the update: valid only while
  ** the storage's version and the write epoch are those stamped here (ref held; released
  ** with the handle). */
  kiln_tensor *amp_copy;
  uint64_t amp_copy_version, amp_copy_epoch;
  /* Each row of the last dim (K elements, row stride K + 8, 16-bit) is followed in the
  ** storage by a 1 and seven 0s, written by the op that made it (residual_layer_norm asked
  ** for a padded output): a linear reading this tensor takes its bias gradient as one more
  ** column of its weight-gradient product (ops_matmul.c). Kept by aliases (saved tensors),
  ** not by other views. */
  bool ones_col;
};

/* Makes a handle over s (takes a new reference on s). ndim/shape/strides copied;
** strides NULL means contiguous. Registers with the current scope. */
kiln_tensor *kiln__tensor_make(kiln__storage *s, int64_t offset, int ndim, const int64_t *shape,
                               const int64_t *strides, kiln_dtype dt);
/* A fresh contiguous tensor on dev (registered with the scope). */
kiln_tensor *kiln__tensor_new(int ndim, const int64_t *shape, kiln_dtype dt, kiln_device dev);
/* Releases t now whether or not a scope owns it (error paths after creating an output:
** kiln_tensor_free(kiln_keep(t))). NULL is a no-op. */
void kiln__discard(kiln_tensor *t);
/* A new handle on t's storage with t's shape and strides, no autograd history; tracked by
** the current scope when track is true. */
kiln_tensor *kiln__tensor_alias(const kiln_tensor *t, bool track);
/* Ends the scope a composed op opened for its intermediates and hands r (which may be
** NULL) to the caller's scope: r survives, everything else made in the scope goes. */
kiln_tensor *kiln__scope_return(kiln_tensor *r);
/* Registers a new reference with the innermost scope, if any. Returns t. */
kiln_tensor *kiln__scope_track(kiln_tensor *t);
void kiln__contiguous_strides(int ndim, const int64_t *shape, int64_t *strides);
int64_t kiln__shape_numel(int ndim, const int64_t *shape);
/* Bounds-checked shape validation: each dim >= 0, ndim <= 8, numel*elsize fits. */
kiln_status kiln__check_shape(const char *op, int ndim, const int64_t *shape, kiln_dtype dt);
/* Normalises a possibly-negative dim; sets KILN_ERR_INVALID_ARGUMENT and returns -1 when
** out of range. */
int kiln__wrap_dim(const char *op, int dim, int ndim);
/* The address of t's element 0 (ext/kiln_ext.h). */
void *kiln__tensor_data(const kiln_tensor *t);
/* The kernel view of a tensor. */
kiln__view kiln__view_of(const kiln_tensor *t);
/* The same, a 0-dim tensor seen as one element along a dim of size 1 (for kernels that
** walk a dim: softmax, cumsum, gather and the like). */
kiln__view kiln__view_of_1d(const kiln_tensor *t);
/* t's view broadcast to (ndim, shape) with stride 0 on broadcast dims (caller checked). */
kiln__view kiln__view_broadcast(const kiln_tensor *t, int ndim, const int64_t *shape);
/* Shape text for messages: "[2, 3]". Uses one of 8 rotating thread-local buffers. */
const char *kiln__shape_cstr(int ndim, const int64_t *shape);
const char *kiln__tshape(const kiln_tensor *t);
const char *kiln__device_cstr(kiln_device dev);

/* ---- dispatch (src/ops/dispatch.c) ----
** For the op layer and tests; the core never calls it (tests/test_layering.sh checks the
** core's objects for calls up into ops). */
/* Runs kernel a->op on the device dev, falling back to the CPU under the policy when the
** backend lacks it. The views in a must point into memory of dev. */
kiln_status kiln__dispatch(kiln_device dev, kiln__kargs *a);
/* Whether dev's backend runs kernel op itself (no fallback) for arguments like a (a may be
** NULL: then only the table is asked). List ops use it to choose their path. */
bool kiln__dispatch_has(kiln_device dev, const kiln__kargs *a, kiln__kop op);
/* Test hook: make dispatch treat kernel op of backend type as missing (fallback tests). */
void kiln__dispatch_disable_kernel(kiln_device_type type, int op, bool off);
/* Test hook: fn(ctx, dev, a, native) is called on this thread for every kernel call before
** it runs (native false: it will fall back, or fail); NULL stops it. */
typedef void (*kiln__dispatch_observer)(void *ctx, kiln_device dev, const kiln__kargs *a, bool native);
void kiln__dispatch_observe(kiln__dispatch_observer fn, void *ctx);
/* Test hook: how many kernels this thread has asked kiln__dispatch for (every call,
** whether it ran on the device, fell back or failed). Tests diff it around a call. */
int64_t kiln__dispatch_count(void);
/* Test hook: a device graph's node count and its longest chain of dependent nodes (-1
** for a CPU graph or when unknown). */
void kiln__graph_shape(const kiln_graph *g, int *nodes, int *depth);
/* One element at p as double. */
double kiln__load_double(const void *p, kiln_dtype dt);
/* Checks that all non-NULL tensors are on one device; sets KILN_ERR_DEVICE naming op. */
kiln_status kiln__same_device(const char *op, int n, kiln_tensor *const *ts);

/* ---- rng (src/core/rng.c) ---- */
/* Reserves the counters n values need and returns the (seed, offset) to hand a kernel. */
void kiln__generator_reserve(kiln_generator *g, int64_t n, uint64_t *seed, uint64_t *offset);
void kiln__generator_shuffle_draws(kiln_generator *g, int64_t n, int64_t *j, bool parallel);
/* p = a random permutation of 0..n-1, the one kiln_randperm(n, g) gives; parallel: the
** draws may use the OpenMP team (not from a thread of kiln's own: it would make a team). */
kiln_status kiln__randperm_fill(int64_t n, kiln_generator *g, int64_t *p, bool parallel);
void kiln__generator_skip(kiln_generator *g, int64_t n); /* (ext/kiln_ext.h) */
/* Philox4x32-10's multipliers and key increments (rng.c's block; the CPU's 16-block
** kernel uses them too). */
#define KILN__PHILOX_M0 0xD2511F53u
#define KILN__PHILOX_M1 0xCD9E8D57u
#define KILN__PHILOX_W0 0x9E3779B9u
#define KILN__PHILOX_W1 0xBB67AE85u
/* The exact per-element mapping every backend implements. */
float kiln__philox_uniform(uint64_t seed, uint64_t offset, uint64_t k);  /* [0,1) */
double kiln__philox_uniform_f64(uint64_t seed, uint64_t offset, uint64_t k);
float kiln__philox_normal(uint64_t seed, uint64_t offset, uint64_t k);
double kiln__philox_normal_f64(uint64_t seed, uint64_t offset, uint64_t k);
/* Block c's values at once (elements 4c .. 4c + 3 of an f32 draw at offset 0, 2c .. 2c + 1
** of an f64 one): the same bits as the per-element functions, a quarter (a half) of the
** Philox work for a run of elements. */
void kiln__philox_uniform_block(uint64_t seed, uint64_t c, float out[4]);
void kiln__philox_normal_block(uint64_t seed, uint64_t c, float out[4]);
void kiln__philox_uniform_f64_block(uint64_t seed, uint64_t c, double out[2]);
void kiln__philox_normal_f64_block(uint64_t seed, uint64_t c, double out[2]);

/* ---- autograd (src/autograd/) ---- */
/* In a rule: whether it may set m->grad_mask for its input's node m (engine.c). */
bool kiln__grad_mask_ok(const kiln__node *m, int index);
/* Whether the program sees the gradient of output index of node m in the backward now
** running: the output retains its gradient, or kiln_autograd_grad asked for it. */
bool kiln__grad_shown(const kiln__node *m, int index);
/* In n's rule, while the engine runs it: the gradient already pending for n's input k (the
** sum the engine would add this rule's gradient into, or a leaf's .grad already holding a
** sum), when the rule may add into it in place instead (nothing else holds it, dense, not
** in kiln_autograd_grad's capture); NULL otherwise. A rule
** that adds its gradient into it hands that same tensor back as gi[k] (kiln__give_grad),
** and the engine then adds nothing (engine.c). The rule must check the dtype, shape and
** layout are its gradient's. */
kiln_tensor *kiln__grad_into(const kiln__node *n, int k);
/* Whether the calling thread is running a backward (engine.c). */
bool kiln__in_backward(void);
/* How many backward engines run on this thread now (0 outside any; 2 inside a backward
** that a rule started: a checkpoint's recompute). */
int kiln__backward_depth(void);
/* For the tests (checkpoint.c): the calls checkpoints' recomputes made without their
** kernels, and the recomputes run again in full because a skip did not hold. */
int64_t kiln__checkpoint_skipped(void);
int64_t kiln__checkpoint_taken(void); /* kept results (KILN__OP_CHECKPOINT_KEEPS, products) taken */
int64_t kiln__checkpoint_full_again(void);
/* Whether t's grad-ready hook is fn with ctx (ext/kiln_ext.h). */
bool kiln__grad_ready_hook_is(const kiln_tensor *t, kiln_grad_hook fn, const void *ctx);
/* True when grad mode is on and any of the tensors requires grad. */
bool kiln__needs_grad(int n, kiln_tensor *const *ts);
/* Makes a node for out with inputs ins (NULL entries allowed) and room for 4 saved
** tensors, sets out->grad_fn and out->requires_grad. Saved tensors / scalars are filled by
** the caller after. Returns the node (owned by out) or NULL on OOM. */
kiln__node *kiln__node_attach(kiln_tensor *out, const char *name, kiln__backward_fn fn, int n_in,
                              kiln_tensor *const *ins);
/* The general form: n_out outputs (each gets grad_fn = the node, grad_fn_index = k),
** n_saved slots, and attr_size bytes of attrs copied into the node. */
kiln__node *kiln__node_make(int n_out, kiln_tensor *const *outs, const char *name, kiln__backward_fn fn,
                            int n_in, kiln_tensor *const *ins, int n_saved, const void *attrs,
                            size_t attr_size);
/* Saves t in slot k of n (takes a reference; t may be NULL). */
void kiln__node_save(kiln__node *n, int k, kiln_tensor *t);
/* Saves the node's own output in slot k without a reference cycle: stores a detached
** alias sharing the output's storage. Call right after kiln__node_attach. */
void kiln__node_save_output(kiln__node *n, int k);
/* Releases every saved slot now (the engine, once the node's rule ran in a backward that
** does not retain the graph); marks the node saved_freed when a slot held a tensor. */
void kiln__node_free_saved(kiln__node *n);
/* Hands a backward rule's result r to the engine as *slot (a new reference it owns): a
** result made in the rule is taken out of the engine's scope (no copy); the incoming
** gradient g passed straight through gets a reference of its own. NULL r returns the
** pending error. */
kiln_status kiln__give_grad(kiln_tensor **slot, kiln_tensor *r, const kiln_tensor *g);
/* Reduces a broadcast gradient g back to the input shape (sum over broadcast dims). */
kiln_tensor *kiln__unbroadcast(kiln_tensor *g, int ndim, const int64_t *shape);

/* ---- devices (src/core/device.c) ---- */
/* KILN_OK when dev exists and its backend works; else sets an error naming `what`. */
kiln_status kiln__check_device(kiln_device dev, const char *what);

/* ---- misc ---- */
double kiln__now(void); /* monotonic seconds */

/* ---- memory accounting (core/memory.c) ---- */
/* Bytes of tensors autograd nodes hold in saved slots: add on save, subtract on release. */
void kiln__saved_bytes_add(int64_t delta);
int64_t kiln__saved_bytes_live(void);
/* A module (its interned label) left bytes saved for backward in its last forward. */
void kiln__memory_note_saver(const char *label, int64_t bytes);
/* The modules that saved the most, largest first; returns how many (at most max). */
int kiln__memory_top_savers(const char **labels, int64_t *bytes, int max);
/* Appends the memory breakdown and advice to the OOM error just set for dev. */
void kiln__oom_annotate(kiln_device dev);
const char *kiln__getenv(const char *name); /* NULL when unset or empty */
/* KILN_NUM_THREADS as a thread count, 0 when unset; an invalid value warns once on stderr
** and gives 0 (the default). src/core/env.c. */
int kiln__env_num_threads(void);
/* KILN_FALLBACK as a kiln_fallback_policy; unset or invalid (warned once): WARN. */
int kiln__env_fallback_policy(void);
/* The tuning switches' table, for env.c (src/core/knobs.c): how many, the i-th's name, what
** name changes (NULL: not a switch), and whether its value is accepted (the error names
** what is). */
int kiln__knob_count(void);
const char *kiln__knob_name(int i);
const char *kiln__knob_about(const char *name);
kiln_status kiln__knob_check(const char *name);

#endif /* KILN_INT_H */
