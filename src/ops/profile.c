/*
** The profiler: an observer on the op call path, plus a listener on the module scope.
**
** It keeps, for the ops the program calls (depth 0: a composite counts whole, not again
** for its parts; backward's ops apart, as "name (backward)"), and for each nn module
** (forward spans from kiln_module_forward; backward: the ops of the rules of nodes the
** module made):
**   calls, host time, device time (between marks around each op: see below), bytes moved
**   (the logical bytes of the op's inputs and outputs: an estimate; a gather reads less of
**   its source, a tiled matmul re-reads more),
**   FLOPs (flops_of below), and from them achieved TFLOP/s and GB/s, and the share of
**   the device's peak when the device is one kiln knows (peak_of below).
** and, when asked, a Chrome-trace JSON (Trace Event Format, "X" complete events):
**   pid 1 "host": one track per thread; module spans and the ops inside them, which the
**   viewers (Perfetto, chrome://tracing) nest by time; pid 2 "device": each op's device
**   time, for ops on a device other than the CPU (a CPU op runs on the host track).
**
** Turned on by:
**   KILN_PROFILE=1          host time per op, table at exit; on a GPU the host column is
**                           the cost of queueing the op;
**   KILN_PROFILE=device     also device time per op (waits for each op: slow, and the
**                           host column then includes the waits);
**   KILN_PROFILE=trace:FILE device time, and the Chrome trace written to FILE at exit
**                           (opened at load: a path that cannot be written stops the
**                           program there, before any work is lost);
**   kiln_profiler_start / kiln_profiler_stop (kiln.h) around any region.
** The environment modes leave out the first 20 calls of each op and module from the
** table (module loading, library handles, caches warming: the table is the steady
** state); the API and the trace keep every call. Off, nothing is registered: the path
** pays its one observer check and the module scope one relaxed load per module.
** Counts are kept under a lock: ops may run on several threads.
*/
#include "ops/op.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_ROWS 512
#define MAX_EVENTS (1 << 20) /* ~100 MB of trace at most; later events are counted, not kept */
#define WARMUP 20

typedef struct row {
  const char *name; /* op name or module label (both live as long as the process) */
  bool backward, module;
  bool nograd;      /* forward with grad mode off (an evaluation): a row of its own */
  kiln_device_type dev;
  kiln_dtype dtype;
  int64_t warm, count;
  double host_s, device_s;
  double bytes, flops;
  bool timed; /* device time measured for every counted call */
} row;

typedef struct event {
  const char *name;
  const char *module; /* the innermost module (ops) */
  double ts, dur, dev_dur; /* seconds from the start; dev_dur < 0: none */
  int tid;
  bool is_module, backward;
  int64_t bytes, flops;
  char shapes[80];
} event;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static row rows[MAX_ROWS];
static int n_rows;
static event *events;
static int64_t n_events, cap_events, dropped;
static atomic_bool active;
static bool device_time, env_mode, warmup;
static FILE *trace_file;
static char trace_path[1024];
static double t_start;
static atomic_int next_tid;
static _Thread_local int my_tid; /* 0: not yet given */

static int tid(void) {
  if (!my_tid) my_tid = atomic_fetch_add(&next_tid, 1) + 1;
  return my_tid;
}

/* ---- FLOPs and peaks ---- */

/* FLOPs of one op, from its name and shapes. A table keyed by name rather than a field of
** each descriptor: the count belongs to the profiler's model of cost (one flop per
** element for elementwise ops, transcendental or not), and this keeps the descriptors,
** which other work edits, unchanged. Ops not listed (views, copies, indexing) count 0. */
/* A bool attribute of the op's record by its field name (false when it has none). */
static bool attr_bool(const kiln__op_event *e, const char *field) {
  if (!e->attrs) return false;
  for (int i = 0; i < e->op->n_attrs; i++)
    if (e->op->attrs[i].type == KILN__A_BOOL && !strcmp(e->op->attrs[i].name, field))
      return *(const bool *)((const char *)e->attrs + e->op->attrs[i].offset);
  return false;
}

static double flops_of(const kiln__op_event *e) {
  const char *n = e->op->name;
  /* the optimizer steps (in place: their count comes from the parameters, the first list
  ** of their inputs): Adam ~14 per element (decay, two moments, sqrt, two divides, the
  ** update), SGD ~9 (decay, the momentum buffer, Nesterov, the update) */
  if (!strcmp(n, "adam_step_") || !strcmp(n, "adam_multi_step_") || !strcmp(n, "sgd_multi_step_")) {
    bool sgd = n[0] == 's';
    int np = !strcmp(n, "adam_step_") ? 1 : (e->n_in - 1) / (sgd ? 4 : 6);
    double v = 0;
    for (int i = 0; i < np && i < e->n_in; i++)
      if (e->in[i]) v += (double)kiln_numel(e->in[i]);
    return (sgd ? 9.0 : 14.0) * v;
  }
  if (e->n_out < 1 || !e->out[0]) return 0;
  if (!strcmp(n, "linear_cross_entropy") && e->n_in >= 2 && e->in[0] && e->in[1] && e->in[1]->ndim == 2) {
    /* x (..., K), W (V, K): the logits, 2 M K V, and the gradient products its forward
    ** makes for an input that wants one (dx = D W, dW = D^T x), 2 M K V each; the softmax
    ** is not counted (a product's figure, as linear's) */
    const kiln_tensor *x = e->in[0], *w = e->in[1];
    const double f = 2.0 * (double)kiln_numel(x) * (double)w->shape[0];
    const bool on = kiln_grad_enabled();
    return f * (1 + (on && kiln_requires_grad(x)) + (on && kiln_requires_grad(w)));
  }
  if (!strncmp(n, "scaled_dot_product_attention", 28) && e->n_in >= 3 && e->in[0] && e->in[1] && e->in[2]) {
    /* FlashAttention's count: q k^T and p v, 2 B H Tq Tk (D + Dv), halved when causal (the
    ** kernels skip the masked half); the backward's five products 2.5 times that */
    const kiln_tensor *q = e->in[0], *k = e->in[1], *v = e->in[2];
    if (q->ndim != 4 || k->ndim != 4 || v->ndim != 4) return 0;
    double f = 2.0 * (double)(q->shape[0] * q->shape[1]) * (double)q->shape[2] * (double)k->shape[2] *
               (double)(q->shape[3] + v->shape[3]);
    if (attr_bool(e, "is_causal")) f *= 0.5;
    if (!strcmp(n, "scaled_dot_product_attention_backward")) return 2.5 * f;
    return !strcmp(n, "scaled_dot_product_attention") ? f : 0;
  }
  if (!strcmp(n, "linear_backward") && e->n_in == 3 && e->in[0] && e->in[2] && e->in[2]->ndim == 2) {
    /* g (M, N), x (M, K), W (N, K) -> the gradients made: dx = g W and dW = g^T x, 2 M N K
    ** each (told apart by shape), db M N */
    double mn = (double)kiln_numel(e->in[0]), k = (double)e->in[2]->shape[1], f = 0;
    for (int i = 0; i < e->n_out; i++) {
      const kiln_tensor *o = e->out[i];
      if (!o) continue;
      f += o->ndim == 1 ? mn : 2.0 * mn * k;
    }
    return f;
  }
  double out = (double)kiln_numel(e->out[0]);
  kiln_tensor *a = e->n_in > 0 ? e->in[0] : NULL;
  double in0 = a ? (double)kiln_numel(a) : 0;
  if (!strcmp(n, "matmul") || !strcmp(n, "linear") || !strcmp(n, "linear_relu") || !strcmp(n, "linear_gelu")) {
    /* (..., M, K) x (K, N): 2*M*N*K multiply-adds per batch; a bias adds M*N, a relu M*N
    ** (a GELU counted the same: the figure is the product's) */
    if (!a || a->ndim < 1) return 0;
    double k = (double)a->shape[a->ndim - 1];
    double f = 2.0 * out * k;
    if (strcmp(n, "matmul") != 0 && e->n_in > 2 && e->in[2]) f += out;
    if (!strcmp(n, "linear_relu") || !strcmp(n, "linear_gelu")) f += out;
    return f;
  }
  /* Convolutions, 2*N*K*(C/G)*R*S*P*Q, from the operands' shapes whatever the layout (the
  ** 4-d shapes are NCHW-ordered; the internal ops of the channels-last path make
  ** (N, H, W, C)-shaped outputs, so the counts read the inputs where they can). */
  if (!strcmp(n, "conv2d") || !strcmp(n, "conv2d_direct") || !strcmp(n, "conv2d_bias_relu") ||
      !strcmp(n, "conv1d")) {
    /* out (N, K, P, Q) (or (N, K, L)), w (K, C/G, R, S) */
    kiln_tensor *w = e->n_in > 1 ? e->in[1] : NULL;
    if (!w || w->ndim < 3) return 0;
    double per = 1;
    for (int d = 1; d < w->ndim; d++) per *= (double)w->shape[d];
    return 2.0 * out * per;
  }
  if (!strcmp(n, "conv2d_backward_data")) {
    /* g (N, K, P, Q), w (K, C/G, R, S): the forward's count */
    kiln_tensor *g = a, *w = e->n_in > 1 ? e->in[1] : NULL;
    if (!g || !w || w->ndim != 4) return 0;
    return 2.0 * (double)kiln_numel(g) * (double)w->shape[1] * (double)w->shape[2] * (double)w->shape[3];
  }
  if (!strcmp(n, "conv2d_backward_weight")) {
    /* x (N, C, H, W), g (N, K, P, Q), dW of K*C/G*R*S elements */
    kiln_tensor *g = e->n_in > 1 ? e->in[1] : NULL;
    if (!g || g->ndim != 4 || g->shape[1] == 0) return 0;
    return 2.0 * (double)kiln_numel(g) * out / (double)g->shape[1];
  }
  if (!strcmp(n, "conv_transpose2d")) {
    /* x (N, C, H, W), w (C, OC/G, R, S): the adjoint of a conv2d from the output to x */
    kiln_tensor *w = e->n_in > 1 ? e->in[1] : NULL;
    if (!w || w->ndim != 4) return 0;
    return 2.0 * in0 * (double)w->shape[1] * (double)w->shape[2] * (double)w->shape[3];
  }
  static const char *const per_out[] = {
      "add", "axpy", "sub", "mul", "div", "pow", "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge",
      "neg", "sign", "exp", "log", "sqrt", "rsqrt", "abs", "clamp", "pow_scalar", "add_scalar", "mul_scalar",
      "relu", "leaky_relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh", "softplus", "where", "dropout", NULL};
  for (int i = 0; per_out[i]; i++)
    if (!strcmp(n, per_out[i])) return out;
  static const char *const per_in[] = {"sum", "mean", "var", "std", "max", "min", "argmax", "mse_loss", NULL};
  for (int i = 0; per_in[i]; i++)
    if (!strcmp(n, per_in[i])) return in0;
  /* max, subtract, exp, sum, divide (or log): five passes over the input */
  if (!strcmp(n, "softmax") || !strcmp(n, "log_softmax") || !strcmp(n, "cross_entropy")) return 5.0 * in0;
  /* norms: the mean (1), the variance (3: subtract, square, add), normalising (2) and the
  ** scale and shift (2) per input element; RMS has no mean and no shift */
  if (!strcmp(n, "layer_norm") || !strcmp(n, "batch_norm") || !strcmp(n, "group_norm")) return 8.0 * in0;
  if (!strcmp(n, "rms_norm")) return 5.0 * in0;
  /* pools and scans: an add or a compare per input element (a window's elements, for the
  ** non-overlapping windows networks use); bilinear upsampling ~4 per output */
  if (!strcmp(n, "avg_pool2d") || !strcmp(n, "adaptive_avg_pool2d") || !strcmp(n, "max_pool2d") ||
      !strcmp(n, "cumsum"))
    return in0;
  if (!strcmp(n, "upsample")) return 4.0 * out;
  return 0;
}

static double bytes_of(const kiln__op_event *e) {
  double b = 0;
  for (int i = 0; i < e->n_in; i++)
    if (e->in[i]) b += (double)kiln_nbytes(e->in[i]);
  for (int k = 0; k < e->n_out; k++)
    if (e->out[k]) b += (double)kiln_nbytes(e->out[k]);
  return b;
}

/* Dense peaks from the vendors' data sheets (SXM parts; no sparsity): f32 on the CUDA
** cores, bf16/f16 on the tensor cores, and HBM bandwidth. Not measured here: a device
** kiln does not know (the CPU, another GPU) shows no share of peak. */
static const struct {
  const char *match;
  double f32_tflops, half_tflops, gbs;
} peaks[] = {
    {"H200", 67.0, 989.0, 4800.0},
    {"H100", 67.0, 989.0, 3350.0},
    {"A100", 19.5, 312.0, 2039.0},
    {"L40S", 91.6, 362.0, 864.0},
    {"V100", 15.7, 125.0, 900.0},
};

typedef struct peak {
  char device[256];
  double f32, half, gbs; /* 0: unknown */
} peak;
#define MAX_TYPES 8
static peak dev_peak[MAX_TYPES]; /* by device type, found at start */

static void find_peak(kiln_device_type t) {
  if ((int)t < 0 || (int)t >= MAX_TYPES) return;
  peak *p = &dev_peak[t];
  memset(p, 0, sizeof *p);
  if (t == KILN_DEVICE_CPU) return;
  kiln_device_info info;
  kiln_device d = {t, 0};
  if (kiln_device_info_get(d, &info) != KILN_OK) {
    kiln_clear_error();
    return;
  }
  snprintf(p->device, sizeof p->device, "%s", info.name);
  for (size_t i = 0; i < sizeof peaks / sizeof peaks[0]; i++)
    if (strstr(info.name, peaks[i].match)) {
      p->f32 = peaks[i].f32_tflops;
      p->half = peaks[i].half_tflops;
      p->gbs = peaks[i].gbs;
      return;
    }
}

/* ---- memory: where the live set is largest ----
** Per device type (device 0), read from the allocator's statistics at the end of every op
** the program calls: the most bytes live after an op (and how many of them autograd holds
** saved), and where the allocator's peak rose while profiling, if it did. An op's own
** scratch (a cuDNN workspace) shows only in the peak. */
typedef struct memwatch {
  bool on;
  int64_t peak0, peak, peak_after, peak_saved; /* peak0: the allocator's peak at start */
  const char *peak_op, *peak_module;
  bool peak_bw;
  int64_t live[2], live_saved[2]; /* [0] after a forward op, [1] after an op in a backward */
  const char *live_op[2], *live_module[2];
} memwatch;
static memwatch mem[MAX_TYPES];

static void mem_start(kiln_device_type t) {
  if ((int)t < 0 || (int)t >= MAX_TYPES) return;
  memwatch *w = &mem[t];
  memset(w, 0, sizeof *w);
  kiln_memory_stats ms;
  kiln_device d = {t, 0};
  if (kiln_memory_stats_get(d, &ms) != KILN_OK) {
    kiln_clear_error();
    return;
  }
  w->on = true;
  w->peak0 = w->peak = ms.peak_allocated;
}

/* Caller holds lock; ms read after the op ended. */
static void mem_note(kiln_device dev, const kiln_memory_stats *ms, int64_t saved, const char *op, const char *module,
                     bool backward) {
  if ((int)dev.type < 0 || (int)dev.type >= MAX_TYPES || dev.index != 0 || !mem[dev.type].on) return;
  memwatch *w = &mem[dev.type];
  if (ms->peak_allocated > w->peak) {
    w->peak = ms->peak_allocated, w->peak_after = ms->allocated, w->peak_saved = saved;
    w->peak_op = op, w->peak_module = module, w->peak_bw = backward;
  }
  int b = backward ? 1 : 0;
  if (ms->allocated > w->live[b]) {
    w->live[b] = ms->allocated, w->live_saved[b] = saved;
    w->live_op[b] = op, w->live_module[b] = module;
  }
}

/* b in GiB with 3 decimals, or in MiB under 1 GiB (rotating buffers: up to 4 per line) */
static const char *mem_fmt(int64_t b) {
  static char buf[4][32];
  static int k;
  char *o = buf[k++ & 3];
  if (b >= (int64_t)1 << 30) snprintf(o, 32, "%.3f GiB", b / 1073741824.0);
  else snprintf(o, 32, "%.2f MiB", b / 1048576.0);
  return o;
}

static void mem_print(FILE *f) {
  for (int t = 0; t < MAX_TYPES; t++) {
    const memwatch *w = &mem[t];
    if (!w->on || (!w->live_op[0] && !w->live_op[1])) continue;
    kiln_device d = {(kiln_device_type)t, 0};
    for (int b = 0; b < 2; b++)
      if (w->live_op[b])
        fprintf(f, "  memory on %s: most live after an op %s: %s (%s saved for backward), after %s%s%s\n",
                kiln__device_cstr(d), b ? "in a backward" : "outside backward", mem_fmt(w->live[b]),
                mem_fmt(w->live_saved[b]), w->live_op[b], w->live_module[b] ? " in " : "",
                w->live_module[b] ? w->live_module[b] : "");
    if (w->peak > w->peak0)
      fprintf(f, "  memory on %s: the allocator's peak rose to %s in %s (%s%s%s); %s live after it, "
                 "%s saved\n",
              kiln__device_cstr(d), mem_fmt(w->peak), w->peak_op, w->peak_bw ? "in a backward" : "outside backward",
              w->peak_module ? ", " : "", w->peak_module ? w->peak_module : "", mem_fmt(w->peak_after),
              mem_fmt(w->peak_saved));
    else
      fprintf(f, "  memory on %s: the allocator's peak, %s, was reached before the profiler started\n",
              kiln__device_cstr(d), mem_fmt(w->peak0));
  }
}

/* ---- recording ---- */

/* Rows are kept apart by grad mode (an evaluation's calls, another batch size and the
** first use of other kernels, would otherwise mix with the training steps' and their
** warm-up count) and, for ops, by the output's dtype (f32 evaluation calls inside a bf16
** autocast run: once averaged in, they made bf16 linear_relu look 283 us a call on the
** H200, against 26 us measured alone). Names are printed with what tells such rows apart. */
static row *row_for(const char *name, bool backward, bool module, bool nograd, kiln_dtype dt) {
  for (int r = 0; r < n_rows; r++)
    if (rows[r].name == name && rows[r].backward == backward && rows[r].module == module &&
        rows[r].nograd == nograd && (module || rows[r].dtype == dt))
      return &rows[r];
  if (n_rows == MAX_ROWS) return NULL;
  row *r = &rows[n_rows++];
  memset(r, 0, sizeof *r);
  r->name = name;
  r->backward = backward;
  r->module = module;
  r->nograd = nograd;
  r->timed = true;
  r->dev = KILN_DEVICE_CPU;
  r->dtype = module ? KILN_F32 : dt;
  return r;
}

static event *event_new(void) {
  if (!trace_file) return NULL;
  if (n_events == cap_events) {
    if (cap_events == MAX_EVENTS) {
      dropped++;
      return NULL;
    }
    int64_t nc = cap_events ? cap_events * 2 : 4096;
    event *ne = realloc(events, (size_t)nc * sizeof *ne);
    if (!ne) {
      dropped++;
      return NULL;
    }
    events = ne;
    cap_events = nc;
  }
  return &events[n_events++];
}

/* Adds one call's numbers to r (after the warm-up in the environment modes). */
static void add(row *r, double host, double dev_s, double bytes, double flops) {
  if (!r) return;
  if (warmup && ++r->warm <= WARMUP) return;
  r->count++;
  r->host_s += host;
  if (dev_s >= 0) r->device_s += dev_s;
  else r->timed = false;
  r->bytes += bytes;
  r->flops += flops;
}

typedef struct token {
  double t0;
  kiln_mark *m0;
} token;

static void *prof_begin(const kiln__op_event *e, void *ctx) {
  KILN__UNUSED(ctx);
  if (e->depth != 0) return NULL;
  token *t = malloc(sizeof *t);
  if (!t) return NULL;
  t->m0 = NULL;
  if (device_time && e->n_in > 0 && e->in[0]) t->m0 = kiln_mark_record(kiln_device_of(e->in[0]));
  t->t0 = kiln__now();
  return t;
}

static kiln_status prof_end(const kiln__op_event *e, void *tok, void *ctx) {
  KILN__UNUSED(ctx);
  token *t = tok;
  if (!t) return KILN_OK;
  double dev_s = -1;
  kiln_device dev = e->n_in > 0 && e->in[0] ? kiln_device_of(e->in[0])
                    : e->n_out > 0 && e->out[0] ? kiln_device_of(e->out[0])
                                                : kiln_device_cpu();
  if (t->m0) {
    double ms = kiln_mark_elapsed_ms(t->m0, kiln_mark_record(dev));
    dev_s = ms < 0 ? -1 : ms * 1e-3;
  }
  double t1 = kiln__now();
  double host = t1 - t->t0, t0 = t->t0;
  free(t);
  if (dev.type == KILN_DEVICE_CPU && dev_s < 0) dev_s = host; /* the CPU's ops run on the host */
  double bytes = e->status == KILN_OK ? bytes_of(e) : 0, flops = e->status == KILN_OK ? flops_of(e) : 0;
  /* backward: the module of the node whose rule runs; forward: the module stack */
  const kiln__node *bn = e->backward ? kiln__backward_node() : NULL;
  const char *bmod = bn ? bn->module : NULL;
  int depth = kiln__module_scope_depth();
  kiln_memory_stats ms;
  int64_t saved = 0;
  bool have_ms = false;
  if (e->status == KILN_OK && dev.index == 0 && (int)dev.type < MAX_TYPES && mem[dev.type].on) {
    have_ms = kiln_memory_stats_get(dev, &ms) == KILN_OK;
    if (!have_ms) kiln_clear_error(); /* the op succeeded: leave no error behind */
    else kiln_autograd_saved_bytes(&saved, NULL);
  }
  pthread_mutex_lock(&lock);
  if (have_ms) mem_note(dev, &ms, saved, e->op->name, e->backward ? bmod : kiln__module_scope_current(), e->backward);
  bool nograd = !e->backward && !kiln_grad_enabled();
  kiln_dtype dt = e->n_out > 0 && e->out[0] ? kiln_dtype_of(e->out[0])
                  : e->n_in > 0 && e->in[0] ? kiln_dtype_of(e->in[0])
                                            : KILN_F32;
  row *r = row_for(e->op->name, e->backward, false, nograd, dt);
  if (r && r->count == 0 && r->warm == 0) r->dev = dev.type;
  add(r, host, dev_s, bytes, flops);
  /* modules: every module on the stack has this op inside it (forward); the backward
  ** row of the node's module has the op (host time summed from its ops) */
  if (e->backward) {
    if (bmod) {
      row *m = row_for(bmod, true, true, false, KILN_F32);
      if (m && m->count == 0 && m->warm == 0) m->dev = dev.type;
      add(m, host, dev_s, bytes, flops);
    }
  } else {
    for (int i = 0; i < depth; i++) {
      const char *label = kiln__module_scope_at(i);
      row *m = label ? row_for(label, false, true, nograd, KILN_F32) : NULL;
      if (!m) continue;
      if (m->count == 0 && m->warm == 0) m->dev = dev.type;
      /* calls and host time come from the module's span (listener); the rest from ops */
      if (dev_s >= 0) m->device_s += dev_s;
      m->bytes += bytes;
      m->flops += flops;
    }
  }
  event *ev = event_new();
  if (ev) {
    ev->name = e->op->name;
    ev->module = e->backward ? bmod : kiln__module_scope_current();
    ev->ts = t0 - t_start;
    ev->dur = host;
    ev->dev_dur = dev.type != KILN_DEVICE_CPU ? dev_s : -1;
    ev->tid = tid();
    ev->is_module = false;
    ev->backward = e->backward;
    ev->bytes = (int64_t)bytes;
    ev->flops = (int64_t)flops;
    int k = 0;
    ev->shapes[0] = 0;
    for (int i = 0; i < e->n_in && k < (int)sizeof ev->shapes - 1; i++)
      if (e->in[i])
        k += snprintf(ev->shapes + k, sizeof ev->shapes - (size_t)k, "%s%s", k ? " " : "", kiln__tshape(e->in[i]));
  }
  pthread_mutex_unlock(&lock);
  return KILN_OK;
}

static void module_span(const char *label, bool begin, double t0, double t1) {
  if (begin || !label) return;
  pthread_mutex_lock(&lock);
  row *m = row_for(label, false, true, !kiln_grad_enabled(), KILN_F32);
  if (m) {
    if (warmup && ++m->warm <= WARMUP) {
      /* the ops' share added meanwhile belongs to the warm-up too */
      m->device_s = m->bytes = m->flops = 0;
    } else {
      m->count++;
      m->host_s += t1 - t0;
    }
  }
  event *ev = event_new();
  if (ev) {
    memset(ev, 0, sizeof *ev);
    ev->name = label;
    ev->ts = t0 - t_start;
    ev->dur = t1 - t0;
    ev->dev_dur = -1;
    ev->tid = tid();
    ev->is_module = true;
  }
  pthread_mutex_unlock(&lock);
}

static const kiln__observer profiler = {"profile", prof_begin, prof_end, NULL, NULL, NULL};

/* ---- the table ---- */

static void print_rows(FILE *f, bool modules) {
  bool any = false;
  for (int i = 0; i < n_rows; i++) any |= rows[i].module == modules && rows[i].count > 0;
  if (!any) return;
  fprintf(f, "  %-36s %8s %10s %10s %10s %10s %10s %8s %8s %7s\n", modules ? "module" : "op", "calls",
          "host ms", "host us/c", "dev us/c", "MB moved", "GFLOP", "TFLOP/s", "GB/s", "% peak");
  for (int i = 0; i < n_rows; i++) {
    row *r = &rows[i];
    if (r->module != modules || !r->count) continue;
    char name[96], dus[16] = "-", tf[16] = "-", gb[16] = "-", pk[16] = "-";
    /* what tells this row from another of the same name: grad mode, the op's dtype */
    bool other_grad = false, other_dt = false;
    for (int j = 0; j < n_rows; j++) {
      const row *o = &rows[j];
      if (j == i || o->name != r->name || o->module != r->module || o->backward != r->backward || !o->count) continue;
      other_grad |= o->nograd != r->nograd;
      other_dt |= !r->module && o->dtype != r->dtype;
    }
    snprintf(name, sizeof name, "%s%s%s%s%s", r->name, r->backward ? " (backward)" : "",
             other_grad && r->nograd ? " (no grad)" : "", other_dt ? " " : "", other_dt ? kiln_dtype_name(r->dtype) : "");
    double n = (double)r->count;
    /* rates need device time: measured, or the host time of CPU ops (which is theirs) */
    bool have = r->timed && r->device_s > 0;
    if (have) {
      snprintf(dus, sizeof dus, "%.2f", 1e6 * r->device_s / n);
      double tflops = r->flops / r->device_s * 1e-12, gbs = r->bytes / r->device_s * 1e-9;
      if (r->flops > 0) snprintf(tf, sizeof tf, "%.3f", tflops);
      snprintf(gb, sizeof gb, "%.1f", gbs);
      const peak *p = (int)r->dev >= 0 && (int)r->dev < MAX_TYPES ? &dev_peak[r->dev] : NULL;
      if (p && p->gbs > 0) {
        double pf = r->dtype == KILN_BF16 || r->dtype == KILN_F16 ? p->half : p->f32;
        /* the bound that binds: compute for ops that do work, bandwidth for the rest */
        double share = r->flops > 0 ? 100.0 * tflops / pf : 100.0 * gbs / p->gbs;
        double bw = 100.0 * gbs / p->gbs;
        snprintf(pk, sizeof pk, "%.1f", share > bw ? share : bw);
      }
    }
    fprintf(f, "  %-36s %8" PRId64 " %10.3f %10.2f %10s %10.2f %10.3f %8s %8s %7s\n", name, r->count,
            1e3 * r->host_s, 1e6 * r->host_s / n, dus, r->bytes / 1e6, r->flops / 1e9, tf, gb, pk);
  }
}

static void print_table(FILE *f) {
  double total = 0, dtotal = 0;
  for (int r = 0; r < n_rows; r++)
    if (!rows[r].module) total += rows[r].host_s, dtotal += rows[r].device_s;
  fprintf(f, "kiln profile (%s%s): ops host %.4f s", env_mode ? "KILN_PROFILE" : "kiln_profiler",
          warmup ? "; after 20 calls of each op and module" : "", total);
  if (device_time) fprintf(f, ", device %.4f s", dtotal);
  fprintf(f, "\n");
  print_rows(f, false);
  print_rows(f, true);
  mem_print(f);
  for (int t = 1; t < MAX_TYPES; t++)
    if (dev_peak[t].gbs > 0)
      fprintf(f, "  %% peak: of %s's data-sheet peak (%.1f TFLOP/s f32, %.0f bf16/f16 dense, %.0f GB/s)\n",
              dev_peak[t].device, dev_peak[t].f32, dev_peak[t].half, dev_peak[t].gbs);
  if (!device_time) fprintf(f, "  (no device times on a GPU without device timing: KILN_PROFILE=device)\n");
}

/* ---- the Chrome trace ---- */

static void json_str(FILE *f, const char *s) {
  fputc('"', f);
  for (; s && *s; s++) {
    unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
    else if (c < 0x20) fprintf(f, "\\u%04x", c);
    else fputc(c, f);
  }
  fputc('"', f);
}

static kiln_status write_trace(void) {
  FILE *f = trace_file;
  fprintf(f, "{\"displayTimeUnit\":\"ms\",\"otherData\":{\"producer\":\"kiln %s\",\"dropped_events\":%" PRId64
             "},\n\"traceEvents\":[\n",
          kiln_version(), dropped);
  fprintf(f, "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":1,\"tid\":0,\"args\":{\"name\":\"host\"}},\n");
  fprintf(f, "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":2,\"tid\":0,\"args\":{\"name\":\"device\"}}");
  int max_tid = atomic_load(&next_tid);
  for (int t = 1; t <= max_tid; t++)
    fprintf(f, ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":1,\"tid\":%d,\"args\":{\"name\":\"thread %d\"}}", t, t);
  for (int64_t i = 0; i < n_events; i++) {
    const event *e = &events[i];
    fprintf(f, ",\n{\"name\":");
    json_str(f, e->name);
    fprintf(f, ",\"cat\":\"%s\",\"ph\":\"X\",\"pid\":1,\"tid\":%d,\"ts\":%.3f,\"dur\":%.3f",
            e->is_module ? "module" : e->backward ? "op,backward" : "op", e->tid, e->ts * 1e6, e->dur * 1e6);
    if (!e->is_module) {
      fprintf(f, ",\"args\":{\"shapes\":");
      json_str(f, e->shapes);
      fprintf(f, ",\"bytes\":%" PRId64 ",\"flops\":%" PRId64, e->bytes, e->flops);
      if (e->module) {
        fprintf(f, ",\"module\":");
        json_str(f, e->module);
      }
      fprintf(f, "}");
    }
    fprintf(f, "}");
    if (e->dev_dur >= 0) {
      fprintf(f, ",\n{\"name\":");
      json_str(f, e->name);
      fprintf(f, ",\"cat\":\"device\",\"ph\":\"X\",\"pid\":2,\"tid\":%d,\"ts\":%.3f,\"dur\":%.3f}", e->tid,
              e->ts * 1e6, e->dev_dur * 1e6);
    }
  }
  fprintf(f, "\n]}\n");
  bool bad = ferror(f) != 0;
  bad |= fclose(f) != 0;
  trace_file = NULL;
  if (bad) return kiln_set_error(KILN_ERR_IO, "kiln profiler: writing the trace '%s' failed", trace_path);
  return KILN_OK;
}

/* ---- on and off ---- */

static kiln_status start(bool dev_time, const char *path, bool from_env) {
  if (atomic_load(&active))
    return kiln_set_error(KILN_ERR_STATE, "kiln_profiler_start: the profiler is already on%s",
                          env_mode ? " (KILN_PROFILE)" : "");
  if (path) {
    if (strlen(path) >= sizeof trace_path)
      return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_profiler_start: trace path too long");
    FILE *f = fopen(path, "w");
    if (!f)
      return kiln_set_error(KILN_ERR_IO, "kiln_profiler_start: cannot write the trace '%s': %s", path, strerror(errno));
    snprintf(trace_path, sizeof trace_path, "%s", path);
    trace_file = f;
  }
  pthread_mutex_lock(&lock);
  n_rows = 0;
  n_events = 0;
  dropped = 0;
  device_time = dev_time;
  env_mode = from_env;
  warmup = from_env;
  for (int t = 0; t < kiln_backend_count(); t++) find_peak(kiln_backend_type(t)), mem_start(kiln_backend_type(t));
  t_start = kiln__now();
  pthread_mutex_unlock(&lock);
  kiln_status st = kiln__observer_add(&profiler);
  if (st != KILN_OK) {
    if (trace_file) fclose(trace_file), trace_file = NULL;
    return st;
  }
  kiln__module_scope_set_listener(module_span);
  atomic_store(&active, true);
  return KILN_OK;
}

static kiln_status stop(FILE *table) {
  if (!atomic_load(&active)) return kiln_set_error(KILN_ERR_STATE, "kiln_profiler_stop: the profiler is not on");
  kiln__observer_remove(&profiler);
  kiln__module_scope_set_listener(NULL);
  atomic_store(&active, false);
  pthread_mutex_lock(&lock);
  if (table) print_table(table);
  kiln_status st = trace_file ? write_trace() : KILN_OK;
  free(events);
  events = NULL;
  n_events = cap_events = 0;
  pthread_mutex_unlock(&lock);
  return st;
}

kiln_status kiln_profiler_start(const kiln_profiler_options *opt) {
  return start(opt && opt->device_time, opt ? opt->trace_path : NULL, false);
}

kiln_status kiln_profiler_stop(FILE *table) { return stop(table); }

bool kiln_profiler_enabled(void) { return atomic_load(&active); }

static void report(void) {
  if (!atomic_load(&active) || !env_mode) return;
  if (stop(stderr) != KILN_OK) fprintf(stderr, "%s\n", kiln_last_error_message());
  else if (trace_path[0]) fprintf(stderr, "kiln profile: trace written to %s\n", trace_path);
}

/* Read once, when the library is loaded: the path itself never looks at the variable.
** Not static: call.c refers to it, so that a static link (nothing else names this file)
** still pulls it in and its constructor runs. */
__attribute__((constructor)) void kiln__profile_env_init(void) {
  const char *e = getenv("KILN_PROFILE");
  if (!e || !*e || strcmp(e, "0") == 0) return;
  kiln_status st;
  if (strcmp(e, "1") == 0) {
    st = start(false, NULL, true);
  } else if (strcmp(e, "device") == 0) {
    st = start(true, NULL, true);
  } else if (strncmp(e, "trace:", 6) == 0 && e[6]) {
    st = start(true, e + 6, true);
    if (st != KILN_OK) {
      /* The trace is what was asked for: better to stop now than after the run. */
      fprintf(stderr, "kiln: KILN_PROFILE=%s: %s; stopping before any work (fix the path or unset KILN_PROFILE)\n",
              e, kiln_last_error_message());
      exit(2);
    }
  } else {
    fprintf(stderr, "kiln: KILN_PROFILE=%s is not understood (accepted: 0, 1, device, trace:FILE); not profiling\n", e);
    return;
  }
  if (st == KILN_OK) atexit(report);
}
