/*
** The op layer's one path: op descriptors and the call that every public op makes.
**
** An op is one kiln__op: its name, arity, a typed attribute record (a plain C struct per
** op, described field by field so that observers can name each attribute), shape and
** dtype inference, the forward that dispatches its kernels, its backward rule (written
** with other ops), and its autocast class. A public op builds its attribute record and
** calls kiln__op_call(); the call does, in order:
**
**   1. NULL inputs pass through (the error that made them stays the last error);
**   2. the inputs must share one device (KILN_ERR_DEVICE naming the op otherwise);
**   3. the autocast hook, when one is set and the op has a class, may cast the inputs;
**   4. infer checks the arguments and gives each output's shape and dtype;
**   5. the outputs are allocated (unless the op makes its own: views, composites);
**   6. forward dispatches the kernels (kiln__dispatch: the fallback policy lives there);
**   7. when grad mode is on, an input requires grad and the op has a backward rule, a
**      node of the op's arity is recorded on the outputs, with a copy of the attributes,
**      and save() stores what the rule needs;
**   8. the observers (trace, profiler, anomaly check) see the op, its attributes, its
**      inputs and its outputs. With no observer on, this is one relaxed atomic load.
**
** Ops that are composed of other public ops (mse_loss, var) set KILN__OP_COMPOSITE: their
** forward calls those ops, which record their own nodes; the path records none. The
** depth of nested calls is kept per thread, so a trace can keep only the ops the user
** called (depth 0) and a profile can keep composites whole.
*/
#ifndef KILN_OP_H
#define KILN_OP_H

#include "core/kiln_int.h"

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KILN__OP_MAX_OUT 8
#define KILN__OP_MAX_TMP 6
#define KILN__OP_VARIADIC (-1)

/* Autocast classes (PyTorch's autocast op lists): run in the lower precision (matmul,
** linear, conv, attention); run in f32 (softmax, norms, losses, reductions, exp/log/pow);
** promote mixed inputs to the widest; or leave alone. The policy that applies them is a
** hook (kiln__autocast_hook) so the op layer does not depend on it. */
typedef enum kiln__amp {
  KILN__AMP_NONE = 0,
  KILN__AMP_LOWER,
  KILN__AMP_F32,
  KILN__AMP_PROMOTE
} kiln__amp;

/* One attribute of an op's record. INTS is an int64_t array with an int count beside it. */
typedef enum kiln__attr_type {
  KILN__A_INT,    /* int64_t */
  KILN__A_INT32,  /* int */
  KILN__A_FLOAT,  /* double */
  KILN__A_BOOL,   /* bool */
  KILN__A_INTS,   /* int64_t[], count at count_offset (int) */
  KILN__A_DTYPE,  /* kiln_dtype */
  KILN__A_DEVICE, /* kiln_device */
  KILN__A_ENUM    /* int-sized enum, printed by its names (names[]) */
} kiln__attr_type;

typedef struct kiln__attr_field {
  const char *name;
  kiln__attr_type type;
  size_t offset;
  size_t count_offset;       /* INTS only */
  const char *const *names;  /* ENUM only: names[value] */
} kiln__attr_field;

#define KILN__FIELD(rec, f, t) {#f, t, offsetof(rec, f), 0, NULL}
#define KILN__FIELD_INTS(rec, f, cnt) {#f, KILN__A_INTS, offsetof(rec, f), offsetof(rec, cnt), NULL}
#define KILN__FIELD_ENUM(rec, f, nm) {#f, KILN__A_ENUM, offsetof(rec, f), 0, nm}

struct kiln__op;

/* What one call of an op carries from step to step. infer fills meta and n_out; forward
** reads in and attrs and writes out; forward may park intermediates (converted inputs)
** in tmp for save(): the path releases each after save() (save takes its own reference),
** unless it is one of the inputs or outputs, with or without an open scope. */
typedef struct kiln__op_ctx {
  const struct kiln__op *op;
  const void *attrs;
  int n_in;
  kiln_tensor **in; /* the inputs after autocast */
  int n_out;
  kiln_tensor *out[KILN__OP_MAX_OUT];
  struct {
    int ndim;
    int64_t shape[KILN_MAX_DIMS];
    kiln_dtype dtype;
    bool channels_last; /* allocate NHWC memory (kiln__op_meta clears it) */
  } meta[KILN__OP_MAX_OUT];
  kiln_device device;         /* the inputs' device (infer may set it for creation ops) */
  kiln_tensor *tmp[KILN__OP_MAX_TMP];
  bool differentiable;        /* infer may clear it (comparisons, integer dtypes) */
  bool records;               /* set before forward: the call records a node if forward succeeds
                              ** (and its first output is floating), so forward may skip what
                              ** only the backward needs (linear_gelu's z) */
  uint64_t scratch[8];        /* small op-private values from infer to forward */
  bool amp_f32;               /* autocast left 16-bit inputs to a KILN__OP_AMP_READS_16 op:
                              ** its floating outputs are f32 */
  int n_node_out;             /* infer may set it: only the first n_node_out outputs go into
                              ** the node (the rest never require grad); 0: all */
} kiln__op_ctx;

typedef struct kiln__op {
  const char *name; /* "add": traces, profiles and node names */
  const char *api;  /* "kiln_add": the prefix of error messages */
  int n_in;         /* or KILN__OP_VARIADIC */
  int n_out;        /* the most outputs; infer sets c->n_out */
  uint32_t optional; /* bit i: input i may be NULL (a bias); all bits set: every input,
                      ** however many (list ops check their own) */
  kiln__amp amp;
  unsigned flags;
  int n_kernels;            /* the kernels its forward dispatches (docs/ops.md) */
  kiln__kop kernels[4];
  const kiln__attr_field *attrs; /* the record's fields, for observers */
  int n_attrs;
  size_t attr_size;
  kiln_status (*infer)(kiln__op_ctx *c);
  kiln_status (*forward)(kiln__op_ctx *c);
  kiln__backward_fn backward; /* NULL: not differentiable */
  int n_saved;                /* slots save() fills */
  void (*save)(kiln__op_ctx *c, kiln__node *n);
  /* Fused ops: the standard ops the fused one stands for, in order, so that a trace
  ** shows what the user wrote (NULL-terminated; NULL for ordinary ops). */
  const char *const *expands_to;
} kiln__op;

/* flags */
#define KILN__OP_COMPOSITE (1u << 0) /* forward calls public ops; no node of its own */
#define KILN__OP_SELF_ALLOC (1u << 1) /* forward makes c->out (views, aliases) */
#define KILN__OP_INPLACE (1u << 2)    /* writes input 0; returns it (never recorded) */
#define KILN__OP_CREATION (1u << 3)   /* no tensor inputs: c->device comes from attrs */
#define KILN__OP_NO_GRAD (1u << 4)    /* never recorded (random fills, comparisons) */
#define KILN__OP_FLOAT_ONLY (1u << 5) /* input 0 must be a floating tensor */
#define KILN__OP_ANY_DEVICE (1u << 6) /* inputs may be on different devices (copies) */
/* Its rule reads n->grad_mask (a ReLU after it folded its backward into this op's
** products): the peephole of ops_elementwise.c's relu rule. */
#define KILN__OP_GRAD_MASK (1u << 7)
/* An f32-class op whose kernels read bf16 inputs and compute in f32 themselves (the cast
** to f32 is exact, so reading the 16-bit values in the kernel gives the same numbers as
** cast-then-op). Under autocast its bf16 inputs are left as they are and c->amp_f32 tells
** it to give its floating outputs in f32, as the cast inputs would have: one cast kernel
** (and its gradient's, in backward) fewer per call, and for a language model's logits a
** 3.3 GB f32 copy and its f32 gradient less. f16 inputs are still cast: a gradient the op
** saves in f16 before the loss scale reaches it (softmax / count ~1e-9) would underflow.
** A high bit, out of the way of the flags other work adds after bit 7. */
#define KILN__OP_AMP_READS_16 (1u << 16)
/* Its backward rule reads nothing the forward made, only the inputs and the attributes
** (linear, add, sub): where no op reads its output either, the output's values are not
** needed to backpropagate through it, and a checkpoint's recompute, which runs the
** segment only to rebuild its graph, may skip its kernels (kiln__observer.skip). */
#define KILN__OP_RULE_READS_INPUTS (1u << 17)
/* A checkpoint keeps this call's outputs and temporaries from the segment's forward, and
** its recompute takes them instead of running the kernels: work that grows faster than
** what it makes (attention: T^2 products for T rows out). Only on calls that draw no
** random numbers (the recompute must move the generators as the forward did). */
#define KILN__OP_CHECKPOINT_KEEPS (1u << 18)
/* A product (matmul, linear without an activation): a checkpoint that keeps products
** (KILN_CHECKPOINT_KEEP_PRODUCTS) keeps its output from the segment's forward as it does a
** KILN__OP_CHECKPOINT_KEEPS call's, and the recompute takes it. A fused activation's
** product is not one: it keeps its input for the rule too, twice the memory. */
#define KILN__OP_PRODUCT (1u << 19)

/* The call. Returns the first output (a new reference owned by the current scope), NULL
** with the last error set on failure. out (may be NULL) receives every output. */
kiln_tensor *kiln__op_call(const kiln__op *op, int n_in, kiln_tensor *const *in, const void *attrs,
                           kiln_tensor **out);
/* The same for in-place ops: returns the status. */
kiln_status kiln__op_call_status(const kiln__op *op, int n_in, kiln_tensor *const *in, const void *attrs);

/* Infer helpers */
/* Output k has input i's shape and the given dtype. */
void kiln__op_meta_like(kiln__op_ctx *c, int k, const kiln_tensor *t, kiln_dtype dt);
void kiln__op_meta(kiln__op_ctx *c, int k, int ndim, const int64_t *shape, kiln_dtype dt);
/* Output k (set by kiln__op_meta first) takes the memory format of `like` when both are
** 4-d of one shape and `like` is channels-last and not also contiguous: the ops that keep
** formats (elementwise, casts, pools) call it, as PyTorch's outputs follow their input's
** layout. Nothing changes otherwise, so calling it with a second input after a first is
** "the first channels-last one wins". (ops_format.c) */
void kiln__op_meta_keep_format(kiln__op_ctx *c, int k, const kiln_tensor *like);
/* Whether t is channels-last and not also contiguous (4-d; size-1 dims aside, the two
** layouts differ): the case in which an op keeping formats makes a channels-last output. */
bool kiln__is_channels_last(const kiln_tensor *t);
/* A new tensor (owned by the scope): channels-last memory when cl and ndim == 4, else
** contiguous. */
kiln_tensor *kiln__tensor_new_format(int ndim, const int64_t *shape, kiln_dtype dt, kiln_device dev, bool cl);
/* A new tensor of t's shape and dt in t's memory format (kiln__is_channels_last). */
kiln_tensor *kiln__tensor_new_like_format(const kiln_tensor *t, kiln_dtype dt);
/* The broadcast shape of a and b; KILN_ERR_SHAPE naming the op otherwise. */
kiln_status kiln__broadcast_shape(const char *op, const kiln_tensor *a, const kiln_tensor *b, int *ndim,
                                  int64_t *shape);
kiln_status kiln__broadcast_shapes(const char *op, int nd_a, const int64_t *sa, int nd_b, const int64_t *sb,
                                   int *ndim, int64_t *shape);
/* outs[k] = ins[k] cast to dt (floating) for k < n <= KILN__OP_MAX_OUT, one kernel call
** where the device has CAST_MULTI (a recorded op, "to_dtype_many"); the node, when one is
** made, has the first n_grad outputs (0: all), so inputs that need no gradient go last.
** Outputs owned by the current scope. */
kiln_status kiln__to_dtype_many(int n, kiln_tensor *const *ins, kiln_dtype dt, int n_grad, kiln_tensor **outs);
/* outs[k] = an alias of copies[k] (autocast's kept 16-bit copy of parameter ins[k], of
** ins[k]'s shape and dtype dt) as a recorded op: no kernel; the node gives the parameters
** their gradients as to_dtype_many's does. Inputs with a NULL copy (after all those with
** one; they get no gradient) are cast to dt (COPY). Outputs owned by the current scope. */
kiln_status kiln__amp_copy_many(int n, kiln_tensor *const *ins, kiln_tensor *const *copies, kiln_dtype dt,
                                kiln_tensor **outs);
/* The dtype in which n's rule may give input i's gradient: f32 for an f16/bf16 input made
** by a cast of an f32 tensor (autocast's parameter casts), whose rule then has nothing to
** convert; else the input's dtype. (ops_elementwise.c) */
kiln_dtype kiln__grad_dtype(const kiln__node *n, int i);
/* Whether the rule now running, whose input's node is m (output `index`), may give m its
** bias gradient (m->bias_grad) with the gradient it hands m: m a linear (no activation)
** whose bias needs a gradient, that gradient reaching m only through this edge
** (kiln__grad_mask_ok). *dt: the dtype m's rule gives it in. (ops_matmul.c) */
bool kiln__linear_bias_handover(const kiln__node *m, int index, kiln_dtype *dt);
/* t itself when it already has dtype dt, else a converted copy without autograd. */
kiln_tensor *kiln__as_dtype_nograd(kiln_tensor *t, kiln_dtype dt);
/* Dispatches kernel a on out's device with a->out[0] = out's view (n_out 1 unless set);
** nothing for an empty out. */
kiln_status kiln__run_into(kiln_tensor *out, kiln__kargs *a);

/* ---- observers ---- */
typedef struct kiln__op_event {
  const kiln__op *op;
  const void *attrs;
  int n_in;
  kiln_tensor *const *in;
  int n_out;
  kiln_tensor *const *out;
  int depth;      /* 0 for an op the program called itself */
  bool backward;  /* called from a backward rule */
  bool span;      /* a rule's own kernels as one event (kiln__span_begin), not an op call */
  kiln_status status;
} kiln__op_event;

#define KILN__OBS_USE_N (KILN__OP_MAX_OUT + KILN__OP_MAX_TMP) /* kiln__observer.skip's use entries */
typedef struct kiln__observer {
  const char *name;
  /* Before infer; returns a token handed to end (may be NULL). */
  void *(*begin)(const kiln__op_event *e, void *ctx);
  /* After the node is recorded (status says how the op ended). A non-OK return fails
  ** the op with that status (the anomaly check). */
  kiln_status (*end)(const kiln__op_event *e, void *token, void *ctx);
  void *ctx;
  /* Before the kernels of an op with KILN__OP_RULE_READS_INPUTS and one allocated output
  ** (e->out[0], e->n_out 1) or with KILN__OP_CHECKPOINT_KEEPS or KILN__OP_PRODUCT: true
  ** has the path skip them, the node recorded as ever (checkpoint.c's recompute; may be
  ** NULL). use (NULL entries on entry) may receive new references, the outputs first and
  ** the forward's temporaries from use[KILN__OP_MAX_OUT]: the path takes them as the op's
  ** own; with use[0] NULL the output is zeros. */
  bool (*skip)(const kiln__op_event *e, kiln_tensor **use, void *ctx); /* use: KILN__OBS_USE_N */
  /* After the kernels of an op with KILN__OP_CHECKPOINT_KEEPS or KILN__OP_PRODUCT: its
  ** temporaries (tmp, KILN__OP_MAX_TMP entries, NULL where none) beside its outputs (may
  ** be NULL). */
  void (*made)(const kiln__op_event *e, kiln_tensor *const *tmp, void *ctx);
} kiln__observer;

/* Adds o (kept by pointer) to the process's observers; at most 8. */
kiln_status kiln__observer_add(const kiln__observer *o);
void kiln__observer_remove(const kiln__observer *o);
/* The current op depth of this thread (0 outside any op); kept only while an observer is on. */
int kiln__op_depth(void);
/* A backward rule that runs its kernels itself (linear's products) shows them to the
** observers as one event named by op (the profiler's row, the anomaly check of its
** gradients): begin with the rule's inputs, end with the gradients it made (NULLs
** skipped) and its status; the ops the rule calls in between are inside it (depth + 1).
** Nothing is done while no observer is on. */
typedef struct kiln__obs_token { /* an observer and what its begin returned */
  const kiln__observer *o;
  void *token;
} kiln__obs_token;
typedef struct kiln__span {
  kiln__op_event ev;
  kiln_tensor *out[KILN__OP_MAX_OUT];
  kiln__obs_token toks[8];
  int n_tok;
  bool on;
} kiln__span;
void kiln__span_begin(kiln__span *s, const kiln__op *op, int n_in, kiln_tensor *const *in);
kiln_status kiln__span_end(kiln__span *s, int n_out, kiln_tensor *const *out, kiln_status st);

/* ---- autocast hook (the mixed-precision issue installs the policy) ---- */
/* Called for ops with an amp class when set: may replace in[i] with cast tensors (owned by
** the current scope); sets *f32_out when it left 16-bit inputs of a KILN__OP_AMP_READS_16
** op uncast (the op then gives f32 outputs). Returns KILN_OK or an error that fails the op. */
typedef kiln_status (*kiln__autocast_fn)(const kiln__op *op, int n_in, kiln_tensor **in, bool *f32_out);
void kiln__set_autocast_hook(kiln__autocast_fn fn);

/* This thread's autocast state (src/ops/autocast.c): per device type (the first 4),
** whether a region casts and to what; level is the backward depth it applies at. Gradient
** checkpointing saves it at forward and reinstates it (with a cache of its own) for the
** recompute. */
typedef struct kiln__autocast_type {
  bool enabled;
  kiln_dtype dtype;
} kiln__autocast_type;
typedef struct kiln__autocast_state {
  kiln__autocast_type type[4];
  int n_enabled;
  int level;
} kiln__autocast_state;
void kiln__autocast_get_state(kiln__autocast_state *s);
/* Whether dev's backend is capturing a graph now (autocast.c): autocast's kept copies are
** neither used nor written inside a capture. */
bool kiln__capturing(kiln_device dev);
kiln_status kiln__autocast_push_state(const kiln__autocast_state *s);
kiln_status kiln__autocast_pop_state(void);

/* ---- attention (ops_attention.c): qkv's gradient as attention's backward packed it
** (see kiln_ext.h) */
kiln_tensor *kiln__attention_qkv_grad(kiln_tensor *const dqkv[3]);
/* max_pool2d(relu(batch_norm(x))) as one op where x's device has it (CUDA, channels-last:
** the normalized map never made); elsewhere the ops it stands for. _native says which. The
** pool's dilation is 1 (ops_norm.c). */
bool kiln__batch_norm_relu_max_pool2d_native(kiln_tensor *x, kiln_tensor *running_mean, kiln_tensor *running_var,
                                             kiln_tensor *weight, kiln_tensor *bias, bool training,
                                             const int64_t kernel[2], const int64_t stride[2], const int64_t padding[2]);
kiln_tensor *kiln__batch_norm_relu_max_pool2d(kiln_tensor *x, kiln_tensor *running_mean, kiln_tensor *running_var,
                                              kiln_tensor *weight, kiln_tensor *bias, bool training, double momentum,
                                              double eps, const int64_t kernel[2], const int64_t stride[2],
                                              const int64_t padding[2]);
/* kiln_residual_layer_norm with y padded for a ones column (kiln_ext.h). */
kiln_tensor *kiln__residual_layer_norm_ones(kiln_tensor *x, kiln_tensor *r, kiln_tensor *weight, kiln_tensor *bias,
                                            double eps, kiln_dtype y_dtype, kiln_tensor **sum);
/* attention's and kv_attention's checks of q, k, v (op names the op in errors): each 4-d
** (B, H, T, D) of one floating dtype, k and v of q's batch and heads, k of q's head dim, v
** of k's length; scale finite and >= 0 (0: 1/sqrt(D)). KILN_OK or the error set. */
kiln_status kiln__attention_check(const char *op, kiln_tensor *const qkv[3], double scale);
/* The scale the kernels use: scale, or 1/sqrt(d) when it is 0 (1 when d is 0). */
double kiln__attention_scale(double scale, int64_t d);

/* ---- module scope (module_scope.c) ----
** The nn module the thread is inside (labels interned: "layers.0 (Linear)"), pushed and
** popped by kiln_module_forward through the extension header; and the node whose
** backward rule the thread is running (set by the engine around each rule). */
void kiln__module_scope_push(const char *label);
void kiln__module_scope_pop(void);
const char *kiln__module_scope_current(void); /* innermost label or NULL */
int kiln__module_scope_depth(void);
const char *kiln__module_scope_at(int i); /* 0: outermost */
/* Told of every push (begin true, t1 0) and pop (t0 the push's time, t1 now) while set:
** the profiler's module spans. One listener; NULL removes it. */
typedef void (*kiln__module_listener_fn)(const char *label, bool begin, double t0, double t1);
void kiln__module_scope_set_listener(kiln__module_listener_fn fn);
/* Sets the thread's backward node, returns the previous one. */
const kiln__node *kiln__backward_node_swap(const kiln__node *n);
const kiln__node *kiln__backward_node(void); /* NULL outside a backward rule */
/* A copy of s that lives as long as the process (one per distinct string). */
const char *kiln__intern(const char *s);

/* Fills the public attribute view of a record (observers, traces): at most max entries,
** returns the count. ints point into rec. */
int kiln__attrs_describe(const kiln__op *op, const void *rec, kiln_attr *out, int max);

#ifdef __cplusplus
}
#endif
/* The environment's observers (KILN_PROFILE, KILN_ANOMALY), read by constructors in
** profile.c and anomaly.c; call.c names them so that static links keep those files. */
void kiln__profile_env_init(void);
void kiln__anomaly_env_init(void);

#endif /* KILN_OP_H */
