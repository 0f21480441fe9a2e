/* Built-in modules: Linear, Sequential, the activations, Dropout, Flatten, Identity. Each
** is a vtable plus a small configuration struct; forward looks its parameters up by name
** at each call because kiln_module_to() may have replaced them. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "nn/nn_int.h"

/* ---- Linear -------------------------------------------------------------------------- */

typedef struct linear_cfg {
  int64_t in, out;
  bool bias;
} linear_cfg;

static kiln_tensor *linear_forward(kiln_module *m, kiln_tensor *x) {
  const linear_cfg *c = kiln_module_impl(m);
  return kiln_linear(x, kiln_module_param(m, "weight"), c->bias ? kiln_module_param(m, "bias") : NULL);
}

static int linear_repr(const kiln_module *m, char *buf, size_t n) {
  const linear_cfg *c = kiln_module_impl(m);
  return snprintf(buf, n, "in_features=%lld, out_features=%lld, bias=%s", (long long)c->in,
                  (long long)c->out, c->bias ? "true" : "false");
}

static const kiln_module_vtable linear_vt = {"Linear", linear_forward, NULL, free, linear_repr};

/* A Linear whose weight and bias are allocated and registered, their values not set. */
kiln_module *kiln__linear_new_undrawn(int64_t in_features, int64_t out_features, bool bias, kiln_dtype dt,
                                      kiln_device dev) {
  if (in_features < 0 || out_features < 0) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_linear_new: in_features %lld, out_features %lld",
                   (long long)in_features, (long long)out_features);
    return NULL;
  }
  if (!kiln_dtype_is_float(dt)) {
    kiln_set_error(KILN_ERR_DTYPE, "kiln_linear_new: dtype %s is not floating", kiln_dtype_name(dt));
    return NULL;
  }
  linear_cfg *c = malloc(sizeof *c);
  if (!c) {
    kiln_set_error(KILN_ERR_OOM, "kiln_linear_new: out of host memory");
    return NULL;
  }
  *c = (linear_cfg){in_features, out_features, bias};
  kiln_module *m = kiln_module_new(&linear_vt, c);
  if (!m) return NULL;
  kiln_tensor *w = kiln_empty(KILN_SHAPE(out_features, in_features), dt, dev);
  kiln_status st = w ? kiln_module_register_parameter(m, "weight", w, true) : kiln_last_error();
  if (st == KILN_OK && bias) {
    kiln_tensor *b = kiln_empty(KILN_SHAPE(out_features), dt, dev);
    st = b ? kiln_module_register_parameter(m, "bias", b, true) : kiln_last_error();
  }
  if (st != KILN_OK) {
    kiln_module_free(m);
    return NULL;
  }
  return m;
}

/* kaiming_uniform_(a=sqrt(5)): gain sqrt(2 / (1 + 5)), bound sqrt(3) * gain / sqrt(fan_in)
** = 1 / sqrt(fan_in); the bias uses the same bound (PyTorch's reset_parameters). A zero
** fan_in gives a zero-element weight and PyTorch's bound 0 for the bias. */
static double linear_bound(int64_t in_features) { return in_features > 0 ? 1.0 / sqrt((double)in_features) : 0.0; }

void kiln__linear_skip_init(int64_t in_features, int64_t out_features, bool bias, kiln_generator *gen) {
  kiln__generator_skip(gen, out_features * in_features);
  if (bias && linear_bound(in_features) > 0) kiln__generator_skip(gen, out_features);
}

kiln_module *kiln_linear_new(int64_t in_features, int64_t out_features, bool bias, kiln_dtype dt,
                             kiln_device dev, kiln_generator *gen) {
  kiln_module *m = kiln__linear_new_undrawn(in_features, out_features, bias, dt, dev);
  if (!m) return NULL;
  const double bound = linear_bound(in_features);
  /* in place on fresh parameters: no graph records it */
  bool prev = kiln_set_grad_enabled(false);
  kiln_status st = kiln_uniform_(kiln_module_param(m, "weight"), -bound, bound, gen);
  if (st == KILN_OK && bias) {
    kiln_tensor *b = kiln_module_param(m, "bias");
    st = bound > 0 ? kiln_uniform_(b, -bound, bound, gen) : kiln_zero_(b);
  }
  kiln_set_grad_enabled(prev);
  if (st != KILN_OK) {
    kiln_module_free(m);
    return NULL;
  }
  return m;
}

/* ---- Sequential ------------------------------------------------------------------------ */

/* A new scope-owned reference to x: what Identity and an empty Sequential return, so the
** result follows the usual lifetime rule (a reshape to the same shape is a view). */
static kiln_tensor *same(kiln_tensor *x) { return kiln_reshape(x, kiln_ndim(x), kiln_shape(x)); }

static const kiln_module_vtable relu_vt;

/* A Linear followed by a ReLU runs as kiln_linear_relu, a ReLU followed by a MaxPool2d as
** kiln_relu_max_pool2d, a Conv2d, ReLU, MaxPool2d as kiln_conv2d_relu_max_pool2d (fused ops,
** the same numbers). */
static kiln_tensor *sequential_forward(kiln_module *m, kiln_tensor *x) {
  int n = kiln_module_num_children(m);
  if (n == 0) return same(x);
  for (int i = 0; i < n && x; i++) {
    kiln_module *c = kiln_module_child_at(m, i);
    kiln_module *next = i + 1 < n ? kiln_module_child_at(m, i + 1) : NULL;
    if (kiln__module_vtable(c) == &linear_vt && next && kiln__module_vtable(next) == &relu_vt &&
        !kiln_module_is_checkpointed(c) && !kiln_module_is_checkpointed(next)) {
      const linear_cfg *lc = kiln_module_impl(c);
      /* the fused op runs in the Linear's module scope (the ReLU gets no span of its own) */
      kiln__module_scope_push(kiln__module_label(c));
      int64_t s0 = 0, s1 = 0;
      if (kiln__module_measuring()) kiln_autograd_saved_bytes(&s0, NULL);
      x = kiln_linear_relu(x, kiln_module_param(c, "weight"), lc->bias ? kiln_module_param(c, "bias") : NULL);
      if (kiln__module_measuring()) {
        kiln_autograd_saved_bytes(&s1, NULL);
        kiln__module_measure_note(c, s1 - s0);
      }
      kiln__module_scope_pop();
      i++;
      continue;
    }
    /* Conv2d, ReLU, MaxPool2d: kiln_conv2d_relu_max_pool2d, in the conv's module scope */
    kiln_module *next2 = i + 2 < n ? kiln_module_child_at(m, i + 2) : NULL;
    if (kiln__module_is_conv2d(c) && next && kiln__module_vtable(next) == &relu_vt && kiln__module_is_max_pool2d(next2) &&
        !kiln_module_is_checkpointed(c) && !kiln_module_is_checkpointed(next) && !kiln_module_is_checkpointed(next2)) {
      kiln__module_scope_push(kiln__module_label(c));
      int64_t s0 = 0, s1 = 0;
      if (kiln__module_measuring()) kiln_autograd_saved_bytes(&s0, NULL);
      x = kiln__conv_relu_max_pool_forward(c, next2, x);
      if (kiln__module_measuring()) {
        kiln_autograd_saved_bytes(&s1, NULL);
        kiln__module_measure_note(c, s1 - s0);
      }
      kiln__module_scope_pop();
      i += 2;
      continue;
    }
    /* ReLU then MaxPool2d: kiln_relu_max_pool2d, in the pool's module scope */
    if (kiln__module_vtable(c) == &relu_vt && kiln__module_is_max_pool2d(next) && !kiln_module_is_checkpointed(c) &&
        !kiln_module_is_checkpointed(next)) {
      kiln__module_scope_push(kiln__module_label(next));
      int64_t s0 = 0, s1 = 0;
      if (kiln__module_measuring()) kiln_autograd_saved_bytes(&s0, NULL);
      x = kiln__relu_max_pool_forward(next, x);
      if (kiln__module_measuring()) {
        kiln_autograd_saved_bytes(&s1, NULL);
        kiln__module_measure_note(next, s1 - s0);
      }
      kiln__module_scope_pop();
      i++;
      continue;
    }
    x = kiln_module_forward(c, x);
  }
  return x;
}

static const kiln_module_vtable sequential_vt = {"Sequential", sequential_forward, NULL, NULL, NULL};

kiln_module *kiln_sequential_new(void) { return kiln_module_new(&sequential_vt, NULL); }

kiln_status kiln_sequential_append(kiln_module *seq, kiln_module *c) {
  if (!c) {
    kiln_status e = kiln_last_error();
    return e != KILN_OK ? e : kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_sequential_append: NULL child");
  }
  if (!seq || kiln_module_impl(seq) != NULL || strcmp(kiln_module_type_name(seq), "Sequential")) {
    kiln_module_free(c);
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_sequential_append: %s is not a Sequential",
                          seq ? kiln_module_type_name(seq) : "NULL");
  }
  char name[24];
  snprintf(name, sizeof name, "%d", kiln_module_num_children(seq));
  return kiln_module_add_child(seq, name, c);
}

kiln_module *kiln_sequential_of(int n, kiln_module *const *children) {
  kiln_module *seq = kiln_sequential_new();
  kiln_status st = seq ? KILN_OK : kiln_last_error();
  for (int i = 0; i < n; i++) {
    if (st == KILN_OK)
      st = kiln_sequential_append(seq, children[i]);
    else
      kiln_module_free(children[i]);
  }
  if (st != KILN_OK) {
    kiln_module_free(seq);
    return NULL;
  }
  return seq;
}

/* ---- activations and friends ------------------------------------------------------------ */

typedef struct act_cfg {
  double a, b;       /* slope / beta, threshold / p */
  int i, j;          /* approx / start_dim, end_dim */
  kiln_generator *gen;
} act_cfg;

static kiln_module *new_with(const kiln_module_vtable *vt, act_cfg cfg) {
  act_cfg *c = malloc(sizeof *c);
  if (!c) {
    kiln_set_error(KILN_ERR_OOM, "kiln_%s_new: out of host memory", vt->type_name);
    return NULL;
  }
  *c = cfg;
  return kiln_module_new(vt, c);
}

#define CFG(m) ((const act_cfg *)kiln_module_impl(m))

static kiln_tensor *relu_fwd(kiln_module *m, kiln_tensor *x) { (void)m; return kiln_relu(x); }
static kiln_tensor *silu_fwd(kiln_module *m, kiln_tensor *x) { (void)m; return kiln_silu(x); }
static kiln_tensor *sigmoid_fwd(kiln_module *m, kiln_tensor *x) { (void)m; return kiln_sigmoid(x); }
static kiln_tensor *tanh_fwd(kiln_module *m, kiln_tensor *x) { (void)m; return kiln_tanh(x); }
static kiln_tensor *identity_fwd(kiln_module *m, kiln_tensor *x) { (void)m; return same(x); }
static kiln_tensor *leaky_fwd(kiln_module *m, kiln_tensor *x) { return kiln_leaky_relu(x, CFG(m)->a); }
static kiln_tensor *gelu_fwd(kiln_module *m, kiln_tensor *x) {
  return CFG(m)->i == KILN_GELU_TANH ? kiln_gelu_tanh(x) : kiln_gelu(x);
}
static kiln_tensor *softplus_fwd(kiln_module *m, kiln_tensor *x) {
  return kiln_softplus(x, CFG(m)->a, CFG(m)->b);
}
static kiln_tensor *dropout_fwd(kiln_module *m, kiln_tensor *x) {
  return kiln_dropout(x, CFG(m)->b, kiln_module_is_training(m), CFG(m)->gen);
}
static kiln_tensor *flatten_fwd(kiln_module *m, kiln_tensor *x) {
  return kiln_flatten(x, CFG(m)->i, CFG(m)->j);
}

static int leaky_repr(const kiln_module *m, char *buf, size_t n) {
  return snprintf(buf, n, "negative_slope=%g", CFG(m)->a);
}
static int gelu_repr(const kiln_module *m, char *buf, size_t n) {
  return snprintf(buf, n, "approximate=%s", CFG(m)->i == KILN_GELU_TANH ? "tanh" : "none");
}
static int softplus_repr(const kiln_module *m, char *buf, size_t n) {
  return snprintf(buf, n, "beta=%g, threshold=%g", CFG(m)->a, CFG(m)->b);
}
static int dropout_repr(const kiln_module *m, char *buf, size_t n) {
  return snprintf(buf, n, "p=%g", CFG(m)->b);
}
static int flatten_repr(const kiln_module *m, char *buf, size_t n) {
  return snprintf(buf, n, "start_dim=%d, end_dim=%d", CFG(m)->i, CFG(m)->j);
}

static const kiln_module_vtable relu_vt = {"ReLU", relu_fwd, NULL, NULL, NULL};
static const kiln_module_vtable silu_vt = {"SiLU", silu_fwd, NULL, NULL, NULL};
static const kiln_module_vtable sigmoid_vt = {"Sigmoid", sigmoid_fwd, NULL, NULL, NULL};
static const kiln_module_vtable tanh_vt = {"Tanh", tanh_fwd, NULL, NULL, NULL};
static const kiln_module_vtable identity_vt = {"Identity", identity_fwd, NULL, NULL, NULL};
static const kiln_module_vtable leaky_vt = {"LeakyReLU", leaky_fwd, NULL, free, leaky_repr};
static const kiln_module_vtable gelu_vt = {"GELU", gelu_fwd, NULL, free, gelu_repr};
static const kiln_module_vtable softplus_vt = {"Softplus", softplus_fwd, NULL, free, softplus_repr};
static const kiln_module_vtable dropout_vt = {"Dropout", dropout_fwd, NULL, free, dropout_repr};
static const kiln_module_vtable flatten_vt = {"Flatten", flatten_fwd, NULL, free, flatten_repr};

kiln_module *kiln_relu_new(void) { return kiln_module_new(&relu_vt, NULL); }
kiln_module *kiln_silu_new(void) { return kiln_module_new(&silu_vt, NULL); }
kiln_module *kiln_sigmoid_new(void) { return kiln_module_new(&sigmoid_vt, NULL); }
kiln_module *kiln_tanh_new(void) { return kiln_module_new(&tanh_vt, NULL); }
kiln_module *kiln_identity_new(void) { return kiln_module_new(&identity_vt, NULL); }

kiln_module *kiln_leaky_relu_new(double negative_slope) {
  return new_with(&leaky_vt, (act_cfg){negative_slope, 0, 0, 0, NULL});
}

kiln_module *kiln_gelu_new(kiln_gelu_approx approx) {
  if (approx != KILN_GELU_EXACT && approx != KILN_GELU_TANH) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_gelu_new: approx %d is not EXACT or TANH", (int)approx);
    return NULL;
  }
  return new_with(&gelu_vt, (act_cfg){0, 0, (int)approx, 0, NULL});
}

kiln_module *kiln_softplus_new(double beta, double threshold) {
  if (!(beta != 0) || isnan(threshold)) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_softplus_new: beta %g, threshold %g", beta, threshold);
    return NULL;
  }
  return new_with(&softplus_vt, (act_cfg){beta, threshold, 0, 0, NULL});
}

kiln_module *kiln_dropout_new(double p, kiln_generator *gen) {
  if (!(p >= 0 && p <= 1)) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_dropout_new: p %g is not in [0, 1]", p);
    return NULL;
  }
  return new_with(&dropout_vt, (act_cfg){0, p, 0, 0, gen});
}

kiln_module *kiln_flatten_new(int start_dim, int end_dim) {
  return new_with(&flatten_vt, (act_cfg){0, 0, start_dim, end_dim, NULL});
}
