/* Convolutional modules: Conv1d, Conv2d, ConvTranspose2d, the pools, BatchNorm1d/2d,
** GroupNorm, Dropout2d. Thin layers over the ops of ops_conv.c / ops_norm.c: each holds
** its configuration, its parameters (and BatchNorm its buffers) under PyTorch's names,
** and draws PyTorch's default initialisation. forward looks its tensors up by name at
** each call because kiln_module_to() may have replaced them. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "nn/nn_int.h"

/* ---- shared helpers -------------------------------------------------------------------- */

static void *cfg_alloc(size_t n, const char *who) {
  void *c = calloc(1, n);
  if (!c) kiln_set_error(KILN_ERR_OOM, "%s: out of host memory", who);
  return c;
}

/* A new tensor of shape drawn from U(-bound, bound) (zeros when bound is 0, as PyTorch
** does for an empty fan), registered as parameter name. Frees nothing but the tensor. */
static kiln_status add_uniform_param(kiln_module *m, const char *name, int ndim, const int64_t *shape,
                                     double bound, kiln_dtype dt, kiln_device dev, kiln_generator *gen) {
  kiln_tensor *t = kiln_empty(ndim, shape, dt, dev);
  if (!t) return kiln_last_error();
  kiln_status st = bound > 0 ? kiln_uniform_(t, -bound, bound, gen) : kiln_zero_(t);
  if (st != KILN_OK) {
    kiln_tensor_free(kiln_keep(t));
    return st;
  }
  return kiln_module_register_parameter(m, name, t, true);
}

static kiln_status add_filled(kiln_module *m, const char *name, int64_t n, double v, bool param,
                              kiln_dtype dt, kiln_device dev) {
  kiln_tensor *t = kiln_full(KILN_SHAPE(n), v, dt, dev);
  if (!t) return kiln_last_error();
  return param ? kiln_module_register_parameter(m, name, t, true)
               : kiln_module_register_buffer(m, name, t, true);
}

static kiln_module *finish(kiln_module *m, kiln_status st) {
  if (st != KILN_OK) {
    kiln_module_free(m);
    return NULL;
  }
  return m;
}

static bool check_float(kiln_dtype dt, const char *who) {
  if (kiln_dtype_is_float(dt)) return true;
  kiln_set_error(KILN_ERR_DTYPE, "%s: dtype %s is not floating", who, kiln_dtype_name(dt));
  return false;
}

/* ---- Conv1d / Conv2d / ConvTranspose2d --------------------------------------------------- */

typedef struct conv_cfg {
  int nd;              /* 1 or 2 spatial dims */
  bool transposed;
  int64_t in, out, groups;
  int64_t kernel[2], stride[2], padding[2], output_padding[2], dilation[2];
  bool bias;
} conv_cfg;

static kiln_tensor *conv_forward(kiln_module *m, kiln_tensor *x) {
  const conv_cfg *c = kiln_module_impl(m);
  kiln_tensor *w = kiln_module_param(m, "weight");
  kiln_tensor *b = c->bias ? kiln_module_param(m, "bias") : NULL;
  if (c->transposed)
    return kiln_conv_transpose2d(x, w, b, c->stride, c->padding, c->output_padding, c->dilation, c->groups);
  if (c->nd == 1) return kiln_conv1d(x, w, b, c->stride[0], c->padding[0], c->dilation[0], c->groups);
  return kiln_conv2d(x, w, b, c->stride, c->padding, c->dilation, c->groups);
}

/* "(3, 3)" or "3" for Conv1d; "same" for KILN_PADDING_SAME. */
static int pair_repr(char *buf, size_t n, int nd, const int64_t *v) {
  if (v[0] == KILN_PADDING_SAME) return snprintf(buf, n, "same");
  if (nd == 1) return snprintf(buf, n, "%lld", (long long)v[0]);
  return snprintf(buf, n, "(%lld, %lld)", (long long)v[0], (long long)v[1]);
}

static int conv_repr(const kiln_module *m, char *buf, size_t n) {
  const conv_cfg *c = kiln_module_impl(m);
  char k[48], s[48], p[48], d[48], op[48];
  pair_repr(k, sizeof k, c->nd, c->kernel);
  pair_repr(s, sizeof s, c->nd, c->stride);
  pair_repr(p, sizeof p, c->nd, c->padding);
  pair_repr(d, sizeof d, c->nd, c->dilation);
  pair_repr(op, sizeof op, c->nd, c->output_padding);
  return snprintf(buf, n, "%lld, %lld, kernel_size=%s, stride=%s, padding=%s%s%s, dilation=%s, groups=%lld, bias=%s",
                  (long long)c->in, (long long)c->out, k, s, p, c->transposed ? ", output_padding=" : "",
                  c->transposed ? op : "", d, (long long)c->groups, c->bias ? "true" : "false");
}

static const kiln_module_vtable conv1d_vt = {"Conv1d", conv_forward, NULL, free, conv_repr};
static const kiln_module_vtable conv2d_vt = {"Conv2d", conv_forward, NULL, free, conv_repr};
static const kiln_module_vtable convt2d_vt = {"ConvTranspose2d", conv_forward, NULL, free, conv_repr};

/* Checks the configuration, then builds the module with PyTorch's reset_parameters:
** kaiming_uniform(a = sqrt(5)) on the weight, i.e. U(-1/sqrt(fan_in), 1/sqrt(fan_in)), and
** the bias from the same bound. fan_in is the weight's dim 1 times the kernel area: C/groups
** for a convolution, OC/groups for a transposed one (PyTorch computes it from the weight's
** shape in both cases). */
static kiln_module *conv_new(const char *who, conv_cfg cfg, kiln_dtype dt, kiln_device dev, kiln_generator *gen) {
  if (cfg.in < 1 || cfg.out < 1 || cfg.groups < 1) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: in_channels %lld, out_channels %lld, groups %lld (each must be >= 1)",
                   who, (long long)cfg.in, (long long)cfg.out, (long long)cfg.groups);
    return NULL;
  }
  if (cfg.in % cfg.groups || cfg.out % cfg.groups) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: groups %lld do not divide in_channels %lld and out_channels %lld",
                   who, (long long)cfg.groups, (long long)cfg.in, (long long)cfg.out);
    return NULL;
  }
  bool same = false;
  for (int i = 0; i < cfg.nd; i++) {
    if (cfg.kernel[i] < 1 || cfg.stride[i] < 1 || cfg.dilation[i] < 1) {
      kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: kernel %lld, stride %lld, dilation %lld in dim %d (each must be >= 1)",
                     who, (long long)cfg.kernel[i], (long long)cfg.stride[i], (long long)cfg.dilation[i], i);
      return NULL;
    }
    if (cfg.padding[i] == KILN_PADDING_SAME) {
      same = true;
    } else if (cfg.padding[i] < 0) {
      kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: padding %lld in dim %d is negative", who,
                     (long long)cfg.padding[i], i);
      return NULL;
    }
    if (cfg.output_padding[i] < 0 || (cfg.transposed && cfg.output_padding[i] >= cfg.stride[i] &&
                                      cfg.output_padding[i] >= cfg.dilation[i])) {
      kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                     "%s: output_padding %lld in dim %d must be >= 0 and smaller than stride %lld or dilation %lld",
                     who, (long long)cfg.output_padding[i], i, (long long)cfg.stride[i], (long long)cfg.dilation[i]);
      return NULL;
    }
  }
  if (same) {
    for (int i = 0; i < cfg.nd; i++) {
      if (cfg.padding[i] != KILN_PADDING_SAME || cfg.stride[i] != 1 || cfg.transposed) {
        kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                       "%s: padding \"same\" needs stride 1 and \"same\" in every dim (dim %d: stride %lld, padding %lld)",
                       who, i, (long long)cfg.stride[i], (long long)cfg.padding[i]);
        return NULL;
      }
    }
  }
  if (!check_float(dt, who)) return NULL;
  conv_cfg *c = cfg_alloc(sizeof *c, who);
  if (!c) return NULL;
  *c = cfg;
  kiln_module *m = kiln_module_new(cfg.transposed ? &convt2d_vt : cfg.nd == 1 ? &conv1d_vt : &conv2d_vt, c);
  if (!m) return NULL;
  int64_t area = cfg.nd == 1 ? cfg.kernel[0] : cfg.kernel[0] * cfg.kernel[1];
  int64_t fan_in = (cfg.transposed ? cfg.out : cfg.in) / cfg.groups * area;
  double bound = 1.0 / sqrt((double)fan_in);
  int64_t shape[4] = {cfg.transposed ? cfg.in : cfg.out, cfg.transposed ? cfg.out / cfg.groups : cfg.in / cfg.groups,
                      cfg.kernel[0], cfg.kernel[1]};
  kiln_status st = add_uniform_param(m, "weight", 2 + cfg.nd, shape, bound, dt, dev, gen);
  if (st == KILN_OK && cfg.bias) st = add_uniform_param(m, "bias", 1, &cfg.out, bound, dt, dev, gen);
  return finish(m, st);
}

/* NULL: every entry dflt. */
static void pair_or(int64_t dst[2], const int64_t *src, int64_t dflt) {
  dst[0] = src ? src[0] : dflt;
  dst[1] = src ? src[1] : dflt;
}

kiln_module *kiln_conv2d_new(int64_t in_channels, int64_t out_channels, const int64_t *kernel_size,
                             const int64_t *stride, const int64_t *padding, const int64_t *dilation,
                             int64_t groups, bool bias, kiln_dtype dt, kiln_device dev, kiln_generator *gen) {
  if (!kernel_size) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_conv2d_new: kernel_size is NULL");
    return NULL;
  }
  conv_cfg c = {.nd = 2, .in = in_channels, .out = out_channels, .groups = groups, .bias = bias};
  pair_or(c.kernel, kernel_size, 1);
  pair_or(c.stride, stride, 1);
  pair_or(c.padding, padding, 0);
  pair_or(c.dilation, dilation, 1);
  return conv_new("kiln_conv2d_new", c, dt, dev, gen);
}

kiln_module *kiln_conv1d_new(int64_t in_channels, int64_t out_channels, int64_t kernel_size, int64_t stride,
                             int64_t padding, int64_t dilation, int64_t groups, bool bias, kiln_dtype dt,
                             kiln_device dev, kiln_generator *gen) {
  conv_cfg c = {.nd = 1, .in = in_channels, .out = out_channels, .groups = groups, .bias = bias,
                .kernel = {kernel_size, 1}, .stride = {stride, 1}, .padding = {padding, 0},
                .dilation = {dilation, 1}};
  return conv_new("kiln_conv1d_new", c, dt, dev, gen);
}

kiln_module *kiln_conv_transpose2d_new(int64_t in_channels, int64_t out_channels, const int64_t *kernel_size,
                                       const int64_t *stride, const int64_t *padding,
                                       const int64_t *output_padding, const int64_t *dilation, int64_t groups,
                                       bool bias, kiln_dtype dt, kiln_device dev, kiln_generator *gen) {
  if (!kernel_size) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_conv_transpose2d_new: kernel_size is NULL");
    return NULL;
  }
  conv_cfg c = {.nd = 2, .transposed = true, .in = in_channels, .out = out_channels, .groups = groups, .bias = bias};
  pair_or(c.kernel, kernel_size, 1);
  pair_or(c.stride, stride, 1);
  pair_or(c.padding, padding, 0);
  pair_or(c.output_padding, output_padding, 0);
  pair_or(c.dilation, dilation, 1);
  return conv_new("kiln_conv_transpose2d_new", c, dt, dev, gen);
}

/* ---- pools ------------------------------------------------------------------------------- */

typedef struct pool_cfg {
  int64_t kernel[2], stride[2], padding[2], dilation[2];
} pool_cfg;

static kiln_tensor *maxpool_forward(kiln_module *m, kiln_tensor *x) {
  const pool_cfg *c = kiln_module_impl(m);
  return kiln_max_pool2d(x, c->kernel, c->stride, c->padding, c->dilation, NULL);
}
static kiln_tensor *avgpool_forward(kiln_module *m, kiln_tensor *x) {
  const pool_cfg *c = kiln_module_impl(m);
  return kiln_avg_pool2d(x, c->kernel, c->stride, c->padding);
}
static kiln_tensor *adaptive_forward(kiln_module *m, kiln_tensor *x) {
  const pool_cfg *c = kiln_module_impl(m);
  return kiln_adaptive_avg_pool2d(x, c->kernel);
}

static int maxpool_repr(const kiln_module *m, char *buf, size_t n) {
  const pool_cfg *c = kiln_module_impl(m);
  return snprintf(buf, n, "kernel_size=(%lld, %lld), stride=(%lld, %lld), padding=(%lld, %lld), dilation=(%lld, %lld)",
                  (long long)c->kernel[0], (long long)c->kernel[1], (long long)c->stride[0], (long long)c->stride[1],
                  (long long)c->padding[0], (long long)c->padding[1], (long long)c->dilation[0],
                  (long long)c->dilation[1]);
}
static int avgpool_repr(const kiln_module *m, char *buf, size_t n) {
  const pool_cfg *c = kiln_module_impl(m);
  return snprintf(buf, n, "kernel_size=(%lld, %lld), stride=(%lld, %lld), padding=(%lld, %lld)",
                  (long long)c->kernel[0], (long long)c->kernel[1], (long long)c->stride[0], (long long)c->stride[1],
                  (long long)c->padding[0], (long long)c->padding[1]);
}
static int adaptive_repr(const kiln_module *m, char *buf, size_t n) {
  const pool_cfg *c = kiln_module_impl(m);
  return snprintf(buf, n, "output_size=(%lld, %lld)", (long long)c->kernel[0], (long long)c->kernel[1]);
}

static const kiln_module_vtable maxpool_vt = {"MaxPool2d", maxpool_forward, NULL, free, maxpool_repr};
static const kiln_module_vtable avgpool_vt = {"AvgPool2d", avgpool_forward, NULL, free, avgpool_repr};
static const kiln_module_vtable adaptive_vt = {"AdaptiveAvgPool2d", adaptive_forward, NULL, free, adaptive_repr};

bool kiln__module_is_max_pool2d(const kiln_module *pool) { return pool && kiln__module_vtable(pool) == &maxpool_vt; }

bool kiln__module_is_conv2d(const kiln_module *conv) { return conv && kiln__module_vtable(conv) == &conv2d_vt; }

kiln_tensor *kiln__conv_relu_max_pool_forward(kiln_module *conv, kiln_module *pool, kiln_tensor *x) {
  if (!kiln__module_is_conv2d(conv) || !kiln__module_is_max_pool2d(pool)) return NULL;
  const conv_cfg *c = kiln_module_impl(conv);
  const pool_cfg *p = kiln_module_impl(pool);
  kiln_tensor *w = kiln_module_param(conv, "weight"), *b = c->bias ? kiln_module_param(conv, "bias") : NULL;
  return kiln_conv2d_relu_max_pool2d(x, w, b, c->stride, c->padding, c->dilation, c->groups, p->kernel, p->stride,
                                     p->padding, p->dilation);
}

kiln_tensor *kiln__relu_max_pool_forward(kiln_module *pool, kiln_tensor *x) {
  if (!kiln__module_is_max_pool2d(pool)) return NULL;
  const pool_cfg *c = kiln_module_impl(pool);
  return kiln_relu_max_pool2d(x, c->kernel, c->stride, c->padding, c->dilation);
}

/* Shared checks of the window pools; the padding bound (at most half the kernel) is
** PyTorch's and the op's. */
static kiln_module *pool_new(const char *who, const kiln_module_vtable *vt, const int64_t *kernel,
                             const int64_t *stride, const int64_t *padding, const int64_t *dilation) {
  if (!kernel) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: kernel_size is NULL", who);
    return NULL;
  }
  pool_cfg c;
  pair_or(c.kernel, kernel, 1);
  pair_or(c.stride, stride ? stride : kernel, 1);
  pair_or(c.padding, padding, 0);
  pair_or(c.dilation, dilation, 1);
  for (int i = 0; i < 2; i++) {
    if (c.kernel[i] < 1 || c.stride[i] < 1 || c.dilation[i] < 1 || c.padding[i] < 0 ||
        c.padding[i] > c.kernel[i] / 2) {
      kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                     "%s: kernel %lld, stride %lld, padding %lld, dilation %lld in dim %d (kernel, stride, dilation "
                     ">= 1; 0 <= padding <= kernel / 2)",
                     who, (long long)c.kernel[i], (long long)c.stride[i], (long long)c.padding[i],
                     (long long)c.dilation[i], i);
      return NULL;
    }
  }
  pool_cfg *p = cfg_alloc(sizeof *p, who);
  if (!p) return NULL;
  *p = c;
  return kiln_module_new(vt, p);
}

kiln_module *kiln_max_pool2d_new(const int64_t *kernel_size, const int64_t *stride, const int64_t *padding,
                                 const int64_t *dilation) {
  return pool_new("kiln_max_pool2d_new", &maxpool_vt, kernel_size, stride, padding, dilation);
}

kiln_module *kiln_avg_pool2d_new(const int64_t *kernel_size, const int64_t *stride, const int64_t *padding) {
  return pool_new("kiln_avg_pool2d_new", &avgpool_vt, kernel_size, stride, padding, NULL);
}

kiln_module *kiln_adaptive_avg_pool2d_new(const int64_t *output_size) {
  if (!output_size || output_size[0] < 1 || output_size[1] < 1) {
    if (output_size)
      kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_adaptive_avg_pool2d_new: output_size (%lld, %lld) (each >= 1)",
                     (long long)output_size[0], (long long)output_size[1]);
    else
      kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_adaptive_avg_pool2d_new: output_size is NULL");
    return NULL;
  }
  pool_cfg *p = cfg_alloc(sizeof *p, "kiln_adaptive_avg_pool2d_new");
  if (!p) return NULL;
  p->kernel[0] = output_size[0];
  p->kernel[1] = output_size[1];
  return kiln_module_new(&adaptive_vt, p);
}

/* ---- BatchNorm1d / BatchNorm2d ------------------------------------------------------------ */

typedef struct bn_cfg {
  int nd;                 /* 1: BatchNorm1d (N, C) or (N, C, L); 2: BatchNorm2d (N, C, H, W) */
  int64_t features;
  double eps, momentum;   /* momentum NAN: cumulative average */
  bool affine, track;
} bn_cfg;

/* The normalization of bn_apply: kiln_batch_norm (residual NULL, relu false),
** kiln_batch_norm_relu (relu), kiln_batch_norm_add_relu (a residual) or, with a pool,
** kiln__batch_norm_relu_max_pool2d. */
static kiln_tensor *bn_call(kiln_tensor *x, kiln_tensor *res, bool relu, const pool_cfg *pool, kiln_tensor *rm,
                            kiln_tensor *rv, kiln_tensor *w, kiln_tensor *b, bool training, double momentum, double eps) {
  if (pool && (pool->dilation[0] != 1 || pool->dilation[1] != 1)) /* the fused op's pools have none */
    return kiln_max_pool2d(kiln_batch_norm_relu(x, rm, rv, w, b, training, momentum, eps), pool->kernel, pool->stride,
                           pool->padding, pool->dilation, NULL);
  if (pool)
    return kiln__batch_norm_relu_max_pool2d(x, rm, rv, w, b, training, momentum, eps, pool->kernel, pool->stride,
                                            pool->padding);
  if (res) return kiln_batch_norm_add_relu(x, res, rm, rv, w, b, training, momentum, eps);
  if (relu) return kiln_batch_norm_relu(x, rm, rv, w, b, training, momentum, eps);
  return kiln_batch_norm(x, rm, rv, w, b, training, momentum, eps);
}

/* The layer's forward, the ReLU (relu), residual-then-ReLU (res) or ReLU-then-pool (pool)
** fused where asked (kiln__batch_norm_relu_forward, kiln__batch_norm_add_relu_forward,
** kiln__batch_norm_relu_max_pool_forward). */
static kiln_tensor *bn_apply(kiln_module *m, kiln_tensor *x, kiln_tensor *res, bool relu, const pool_cfg *pool) {
  const bn_cfg *c = kiln_module_impl(m);
  int nd = kiln_ndim(x);
  bool ok = c->nd == 2 ? nd == 4 : (nd == 2 || nd == 3);
  if (!ok) {
    char s[96];
    kiln_shape_str(x, s, sizeof s);
    kiln_set_error(KILN_ERR_SHAPE, "BatchNorm%dd: input %s is not %s", c->nd, s,
                   c->nd == 2 ? "(N, C, H, W)" : "(N, C) or (N, C, L)");
    return NULL;
  }
  if (kiln_shape(x)[1] != c->features) {
    char s[96];
    kiln_shape_str(x, s, sizeof s);
    kiln_set_error(KILN_ERR_SHAPE, "BatchNorm%dd: input %s has %lld channels, the layer %lld", c->nd, s,
                   (long long)kiln_shape(x)[1], (long long)c->features);
    return NULL;
  }
  kiln_tensor *w = c->affine ? kiln_module_param(m, "weight") : NULL;
  kiln_tensor *b = c->affine ? kiln_module_param(m, "bias") : NULL;
  bool training = kiln_module_is_training(m);
  if (!c->track) /* no running statistics: batch statistics in both modes (PyTorch) */
    return bn_call(x, res, relu, pool, NULL, NULL, w, b, true, 0.0, c->eps);
  kiln_tensor *rm = kiln_module_buffer(m, "running_mean");
  kiln_tensor *rv = kiln_module_buffer(m, "running_var");
  if (!training) return bn_call(x, res, relu, pool, rm, rv, w, b, false, 0.0, c->eps);
  /* num_batches_tracked += 1 first: the cumulative average (momentum NAN) uses the new
  ** count, as PyTorch's _BatchNorm.forward does. The count stays on the tensor's device;
  ** only the cumulative mode reads it on the host. */
  kiln_tensor *nbt = kiln_module_buffer(m, "num_batches_tracked");
  if (kiln_add_scalar_(nbt, 1.0) != KILN_OK) return NULL;
  double momentum = c->momentum;
  if (isnan(momentum)) {
    double count = kiln_item(nbt);
    if (isnan(count)) return NULL;
    momentum = 1.0 / count;
  }
  return bn_call(x, res, relu, pool, rm, rv, w, b, true, momentum, c->eps);
}

static kiln_tensor *bn_forward(kiln_module *m, kiln_tensor *x) { return bn_apply(m, x, NULL, false, NULL); }

static const kiln_module_vtable bn1d_vt, bn2d_vt;

/* relu(bn(x)) (res NULL), relu(bn(x) + res), or max_pool(relu(bn(x))) (pool) through the
** fused ops in bn's module scope */
static kiln_tensor *bn_fused(kiln_module *m, kiln_tensor *x, kiln_tensor *res, const pool_cfg *pool) {
  const kiln_module_vtable *vt = m ? kiln__module_vtable(m) : NULL;
  if (!x || (vt != &bn1d_vt && vt != &bn2d_vt) || kiln_module_is_checkpointed(m)) {
    kiln_tensor *y = kiln_module_forward(m, x);
    y = kiln_relu(res ? kiln_add(y, res) : y);
    return pool ? kiln_max_pool2d(y, pool->kernel, pool->stride, pool->padding, pool->dilation, NULL) : y;
  }
  /* the fused op runs in the BatchNorm's module scope, as kiln_module_forward runs it */
  kiln__module_scope_push(kiln__module_label(m));
  int64_t s0 = 0, s1 = 0;
  if (kiln__module_measuring()) kiln_autograd_saved_bytes(&s0, NULL);
  kiln_tensor *y = bn_apply(m, x, res, true, pool);
  if (kiln__module_measuring()) {
    kiln_autograd_saved_bytes(&s1, NULL);
    kiln__module_measure_note(m, s1 - s0);
  }
  kiln__module_scope_pop();
  return y;
}

kiln_tensor *kiln__batch_norm_relu_forward(kiln_module *m, kiln_tensor *x) { return bn_fused(m, x, NULL, NULL); }

bool kiln__batch_norm_relu_max_pool_fusable(kiln_module *bn, kiln_module *pool, kiln_tensor *x) {
  const kiln_module_vtable *vt = bn ? kiln__module_vtable(bn) : NULL;
  if (!x || vt != &bn2d_vt || kiln_module_is_checkpointed(bn) || !kiln__module_is_max_pool2d(pool) ||
      kiln_module_is_checkpointed(pool))
    return false;
  const bn_cfg *c = kiln_module_impl(bn);
  const pool_cfg *p = kiln_module_impl(pool);
  if (p->dilation[0] != 1 || p->dilation[1] != 1 || kiln_ndim(x) != 4 || kiln_shape(x)[1] != c->features) return false;
  kiln_tensor *w = c->affine ? kiln_module_param(bn, "weight") : NULL, *b = c->affine ? kiln_module_param(bn, "bias") : NULL;
  bool training = kiln_module_is_training(bn);
  kiln_tensor *rm = c->track ? kiln_module_buffer(bn, "running_mean") : NULL;
  kiln_tensor *rv = c->track ? kiln_module_buffer(bn, "running_var") : NULL;
  return kiln__batch_norm_relu_max_pool2d_native(x, rm, rv, w, b, training || !c->track, p->kernel, p->stride,
                                                 p->padding);
}

kiln_tensor *kiln__batch_norm_relu_max_pool_forward(kiln_module *bn, kiln_module *pool, kiln_tensor *x) {
  if (!kiln__module_is_max_pool2d(pool)) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln__batch_norm_relu_max_pool_forward: the pool is not a MaxPool2d");
    return NULL;
  }
  return bn_fused(bn, x, NULL, kiln_module_impl(pool));
}

kiln_tensor *kiln__batch_norm_add_relu_forward(kiln_module *m, kiln_tensor *x, kiln_tensor *residual) {
  if (!residual) return NULL;
  return bn_fused(m, x, residual, NULL);
}

static int bn_repr(const kiln_module *m, char *buf, size_t n) {
  const bn_cfg *c = kiln_module_impl(m);
  char mom[32];
  if (isnan(c->momentum))
    snprintf(mom, sizeof mom, "None");
  else
    snprintf(mom, sizeof mom, "%g", c->momentum);
  return snprintf(buf, n, "%lld, eps=%g, momentum=%s, affine=%s, track_running_stats=%s", (long long)c->features,
                  c->eps, mom, c->affine ? "true" : "false", c->track ? "true" : "false");
}

static const kiln_module_vtable bn1d_vt = {"BatchNorm1d", bn_forward, NULL, free, bn_repr};
static const kiln_module_vtable bn2d_vt = {"BatchNorm2d", bn_forward, NULL, free, bn_repr};

static kiln_module *bn_new(int nd, int64_t num_features, double eps, double momentum, bool affine,
                           bool track_running_stats, kiln_dtype dt, kiln_device dev) {
  const char *who = nd == 1 ? "kiln_batch_norm1d_new" : "kiln_batch_norm2d_new";
  if (num_features < 1 || !(eps > 0) || (!isnan(momentum) && !(momentum >= 0 && momentum <= 1))) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                   "%s: num_features %lld (>= 1), eps %g (> 0), momentum %g (in [0, 1], or NAN for a cumulative average)",
                   who, (long long)num_features, eps, momentum);
    return NULL;
  }
  if (!check_float(dt, who)) return NULL;
  bn_cfg *c = cfg_alloc(sizeof *c, who);
  if (!c) return NULL;
  *c = (bn_cfg){nd, num_features, eps, momentum, affine, track_running_stats};
  kiln_module *m = kiln_module_new(nd == 1 ? &bn1d_vt : &bn2d_vt, c);
  if (!m) return NULL;
  kiln_status st = KILN_OK;
  if (affine) {
    st = add_filled(m, "weight", num_features, 1.0, true, dt, dev);
    if (st == KILN_OK) st = add_filled(m, "bias", num_features, 0.0, true, dt, dev);
  }
  if (st == KILN_OK && track_running_stats) {
    st = add_filled(m, "running_mean", num_features, 0.0, false, dt, dev);
    if (st == KILN_OK) st = add_filled(m, "running_var", num_features, 1.0, false, dt, dev);
    if (st == KILN_OK) {
      /* PyTorch's num_batches_tracked: a 0-dim i64 */
      kiln_tensor *t = kiln_zeros(0, NULL, KILN_I64, dev);
      st = t ? kiln_module_register_buffer(m, "num_batches_tracked", t, true) : kiln_last_error();
    }
  }
  return finish(m, st);
}

kiln_module *kiln_batch_norm1d_new(int64_t num_features, double eps, double momentum, bool affine,
                                   bool track_running_stats, kiln_dtype dt, kiln_device dev) {
  return bn_new(1, num_features, eps, momentum, affine, track_running_stats, dt, dev);
}

kiln_module *kiln_batch_norm2d_new(int64_t num_features, double eps, double momentum, bool affine,
                                   bool track_running_stats, kiln_dtype dt, kiln_device dev) {
  return bn_new(2, num_features, eps, momentum, affine, track_running_stats, dt, dev);
}

/* ---- GroupNorm ---------------------------------------------------------------------------- */

typedef struct gn_cfg {
  int64_t groups, channels;
  double eps;
  bool affine;
} gn_cfg;

static kiln_tensor *gn_forward(kiln_module *m, kiln_tensor *x) {
  const gn_cfg *c = kiln_module_impl(m);
  return kiln_group_norm(x, c->groups, c->affine ? kiln_module_param(m, "weight") : NULL,
                         c->affine ? kiln_module_param(m, "bias") : NULL, c->eps);
}

static int gn_repr(const kiln_module *m, char *buf, size_t n) {
  const gn_cfg *c = kiln_module_impl(m);
  return snprintf(buf, n, "%lld, %lld, eps=%g, affine=%s", (long long)c->groups, (long long)c->channels, c->eps,
                  c->affine ? "true" : "false");
}

static const kiln_module_vtable gn_vt = {"GroupNorm", gn_forward, NULL, free, gn_repr};

kiln_module *kiln_group_norm_new(int64_t num_groups, int64_t num_channels, double eps, bool affine, kiln_dtype dt,
                                 kiln_device dev) {
  static const char who[] = "kiln_group_norm_new";
  if (num_groups < 1 || num_channels < 1 || num_channels % num_groups || !(eps > 0)) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                   "%s: num_groups %lld must divide num_channels %lld (both >= 1), eps %g (> 0)", who,
                   (long long)num_groups, (long long)num_channels, eps);
    return NULL;
  }
  if (!check_float(dt, who)) return NULL;
  gn_cfg *c = cfg_alloc(sizeof *c, who);
  if (!c) return NULL;
  *c = (gn_cfg){num_groups, num_channels, eps, affine};
  kiln_module *m = kiln_module_new(&gn_vt, c);
  if (!m) return NULL;
  kiln_status st = KILN_OK;
  if (affine) {
    st = add_filled(m, "weight", num_channels, 1.0, true, dt, dev);
    if (st == KILN_OK) st = add_filled(m, "bias", num_channels, 0.0, true, dt, dev);
  }
  return finish(m, st);
}

/* ---- Dropout2d ---------------------------------------------------------------------------- */

typedef struct drop2d_cfg {
  double p;
  kiln_generator *gen;
} drop2d_cfg;

static kiln_tensor *drop2d_forward(kiln_module *m, kiln_tensor *x) {
  const drop2d_cfg *c = kiln_module_impl(m);
  return kiln_dropout2d(x, c->p, kiln_module_is_training(m), c->gen);
}

static int drop2d_repr(const kiln_module *m, char *buf, size_t n) {
  return snprintf(buf, n, "p=%g", ((const drop2d_cfg *)kiln_module_impl(m))->p);
}

static const kiln_module_vtable drop2d_vt = {"Dropout2d", drop2d_forward, NULL, free, drop2d_repr};

kiln_module *kiln_dropout2d_new(double p, kiln_generator *gen) {
  if (!(p >= 0 && p <= 1)) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_dropout2d_new: p %g is not in [0, 1]", p);
    return NULL;
  }
  drop2d_cfg *c = cfg_alloc(sizeof *c, "kiln_dropout2d_new");
  if (!c) return NULL;
  *c = (drop2d_cfg){p, gen};
  return kiln_module_new(&drop2d_vt, c);
}
