/* ResNet-18/34/50 as torchvision builds them (torchvision/models/resnet.py: ResNet,
** BasicBlock, Bottleneck, _make_layer), so that torchvision's state dicts load by name.
** The tree and its names:
**   conv1 bn1 relu maxpool layer1..layer4 avgpool flatten fc
**   layerK.i: conv1 bn1 conv2 bn2 [conv3 bn3] [downsample.0 (1x1 conv) downsample.1 (BN)]
** The stride of a layer's first block sits on its 3x3 convolution (conv2 of a Bottleneck:
** torchvision's "ResNet v1.5"). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "nn/nn_int.h"

typedef struct resnet_cfg {
  int layers[4];
  kiln_resnet_block block;
  int64_t width, num_classes;
  bool cifar_stem;
} resnet_cfg;

typedef struct block_cfg {
  bool bottleneck, downsample;
  int64_t in, planes, stride;
} block_cfg;

/* ---- blocks ----------------------------------------------------------------------------- */

/* Blocks and the network run in a scope of their own and return only their output
** (kiln__scope_return, as the GPT modules do): what a node saved survives (nodes hold
** their own aliases), every other intermediate goes when the block returns. Without it
** the step's scope kept every batch-norm output (read by nothing once ReLU saves its
** output), and the residual sum before its ReLU, to the end of the step. */
static kiln_tensor *block_body(kiln_module *m, kiln_tensor *x);
static kiln_tensor *block_forward(kiln_module *m, kiln_tensor *x) {
  kiln_scope_begin();
  return kiln__scope_return(block_body(m, x));
}

static kiln_tensor *block_body(kiln_module *m, kiln_tensor *x) {
  const block_cfg *c = kiln_module_impl(m);
  /* bn1 (and a Bottleneck's bn2) with its ReLU as one op (kiln__batch_norm_relu_forward) */
  kiln_tensor *out = kiln__batch_norm_relu_forward(kiln_module_child(m, "bn1"),
                                                   kiln_module_forward(kiln_module_child(m, "conv1"), x));
  kiln_tensor *c2 = kiln_module_forward(kiln_module_child(m, "conv2"), out);
  kiln_tensor *last = c2; /* the block's last convolution's output, before its BatchNorm */
  if (c->bottleneck)
    last = kiln_module_forward(kiln_module_child(m, "conv3"),
                               kiln__batch_norm_relu_forward(kiln_module_child(m, "bn2"), c2));
  kiln_tensor *identity = c->downsample ? kiln_module_forward(kiln_module_child(m, "downsample"), x) : x;
  if (!last || !identity) return NULL;
  /* relu(bn(last) + identity) as one op (kiln_batch_norm_add_relu) */
  return kiln__batch_norm_add_relu_forward(kiln_module_child(m, c->bottleneck ? "bn3" : "bn2"), last, identity);
}

static int block_repr(const kiln_module *m, char *buf, size_t n) {
  const block_cfg *c = kiln_module_impl(m);
  return snprintf(buf, n, "in=%lld, planes=%lld, stride=%lld", (long long)c->in, (long long)c->planes,
                  (long long)c->stride);
}

static const kiln_module_vtable basic_vt = {"BasicBlock", block_forward, NULL, free, block_repr};
static const kiln_module_vtable bottleneck_vt = {"Bottleneck", block_forward, NULL, free, block_repr};

/* A bias-free convolution with torchvision's init: kaiming_normal_(mode="fan_out",
** nonlinearity="relu"), std = sqrt(2 / fan_out), fan_out = out * kh * kw. kiln_conv2d_new
** draws PyTorch's default first and this draws again, as torchvision's constructor
** does (build, then re-initialise every Conv2d). */
static kiln_module *conv(int64_t in, int64_t out, int64_t k, int64_t stride, kiln_dtype dt, kiln_device dev,
                         kiln_generator *gen) {
  int64_t ks[2] = {k, k}, st[2] = {stride, stride}, pad[2] = {k / 2, k / 2};
  kiln_module *m = kiln_conv2d_new(in, out, ks, st, pad, NULL, 1, false, dt, dev, gen);
  if (!m) return NULL;
  bool was = kiln_set_grad_enabled(false); /* an initialiser, not a recorded op */
  kiln_status ok = kiln_normal_(kiln_module_param(m, "weight"), 0.0, sqrt(2.0 / (double)(out * k * k)), gen);
  kiln_set_grad_enabled(was);
  if (ok != KILN_OK) {
    kiln_module_free(m);
    return NULL;
  }
  return m;
}

static kiln_module *bn(int64_t c, kiln_dtype dt, kiln_device dev) {
  return kiln_batch_norm2d_new(c, 1e-5, 0.1, true, true, dt, dev);
}

/* Adds child (taking it; a NULL child keeps the pending error). */
static kiln_status add(kiln_module *m, const char *name, kiln_module *child, kiln_status st) {
  if (st != KILN_OK) {
    kiln_module_free(child);
    return st;
  }
  return kiln_module_add_child(m, name, child);
}

static kiln_module *block_new(bool bottleneck, int64_t in, int64_t planes, int64_t stride, kiln_dtype dt,
                              kiln_device dev, kiln_generator *gen) {
  int64_t expansion = bottleneck ? 4 : 1;
  block_cfg *c = malloc(sizeof *c);
  if (!c) {
    kiln_set_error(KILN_ERR_OOM, "kiln_resnet_new: out of host memory");
    return NULL;
  }
  *c = (block_cfg){bottleneck, stride != 1 || in != planes * expansion, in, planes, stride};
  kiln_module *m = kiln_module_new(bottleneck ? &bottleneck_vt : &basic_vt, c);
  if (!m) return NULL;
  kiln_status st = KILN_OK;
  if (bottleneck) {
    /* torchvision's width = planes * (base_width / 64) * groups, with 64 and 1 */
    st = add(m, "conv1", conv(in, planes, 1, 1, dt, dev, gen), st);
    st = add(m, "bn1", bn(planes, dt, dev), st);
    st = add(m, "conv2", conv(planes, planes, 3, stride, dt, dev, gen), st);
    st = add(m, "bn2", bn(planes, dt, dev), st);
    st = add(m, "conv3", conv(planes, planes * 4, 1, 1, dt, dev, gen), st);
    st = add(m, "bn3", bn(planes * 4, dt, dev), st);
  } else {
    st = add(m, "conv1", conv(in, planes, 3, stride, dt, dev, gen), st);
    st = add(m, "bn1", bn(planes, dt, dev), st);
    st = add(m, "conv2", conv(planes, planes, 3, 1, dt, dev, gen), st);
    st = add(m, "bn2", bn(planes, dt, dev), st);
  }
  if (st == KILN_OK && c->downsample) {
    kiln_module *ds = kiln_sequential_new();
    st = ds ? KILN_OK : kiln_last_error();
    if (st == KILN_OK) st = kiln_sequential_append(ds, conv(in, planes * expansion, 1, stride, dt, dev, gen));
    if (st == KILN_OK) st = kiln_sequential_append(ds, bn(planes * expansion, dt, dev));
    st = add(m, "downsample", ds, st);
  }
  if (st != KILN_OK) {
    kiln_module_free(m);
    return NULL;
  }
  return m;
}

/* ---- the network ------------------------------------------------------------------------ */

/* The ImageNet stem's bn1 -> relu -> maxpool as a checkpointed segment: only its input
** (conv1's output, which bn1 would keep anyway) and its output (layer1's input) stay for
** the backward, which runs the three again. Kept, the ReLU's output (the pool's input)
** was the largest activation but one: (N, 64, H/2, W/2), 392 MiB for ResNet-50 at 224
** and batch 256; the recompute is one batch norm, ReLU and pooling pass over it. The
** segment runs with grad mode off in the forward and on in the recompute
** (kiln_checkpoint), which must not move bn1's running statistics a second time: they
** are put back as they were. KILN_RESNET_STEM_RECOMPUTE=0 keeps the four as plain
** children (read at each forward, so a test can compare both ways). With
** Where the device runs bn1, the ReLU and the pool as one op that never makes the
** normalized map (kiln__batch_norm_relu_max_pool2d: CUDA, channels-last), that op instead,
** with nothing to recompute; KILN_RESNET_STEM_FUSED=0 keeps the checkpointed three (the A/B). */
static kiln_status stem_tail(void *ctx, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)n_in, (void)n_out;
  kiln_module *m = ctx, *bn = kiln_module_child(m, "bn1");
  static const char *const stats[3] = {"running_mean", "running_var", "num_batches_tracked"};
  kiln_tensor *keep[3] = {NULL, NULL, NULL};
  bool recompute = kiln_grad_enabled();
  for (int k = 0; k < 3 && recompute; k++) {
    kiln_tensor *b = kiln_module_buffer(bn, stats[k]);
    if (b && !(keep[k] = kiln_clone(b))) return kiln_last_error();
  }
  kiln_tensor *h = kiln__batch_norm_relu_forward(bn, in[0]); /* bn1 with the ReLU module after it */
  out[0] = kiln_module_forward(kiln_module_child(m, "maxpool"), h);
  for (int k = 0; k < 3 && out[0]; k++)
    if (keep[k] && kiln_copy_(kiln_module_buffer(bn, stats[k]), keep[k]) != KILN_OK) return kiln_last_error();
  return out[0] ? KILN_OK : kiln_last_error();
}

/* Children run in order: conv1 bn1 relu [maxpool] layer1..4 avgpool flatten fc; bn1 and
** the ReLU module after it as one op (kiln__batch_norm_relu_forward). */
static kiln_tensor *resnet_forward(kiln_module *m, kiln_tensor *x) {
  const resnet_cfg *c = kiln_module_impl(m);
  int n = kiln_module_num_children(m), i = 0;
  kiln_scope_begin(); /* the stem's batch-norm output goes at the end (block_forward) */
  if (!c->cifar_stem && x && kiln__knob_on("KILN_RESNET_STEM_RECOMPUTE", true)) { /* conv1, then bn1 relu maxpool (children 1..3) */
    kiln_tensor *y = NULL, *h = kiln_module_forward(kiln_module_child_at(m, 0), x);
    kiln_module *bn1 = kiln_module_child_at(m, 1), *pool = kiln_module_child_at(m, 3);
    if (h && kiln__knob_on("KILN_RESNET_STEM_FUSED", true) && kiln__batch_norm_relu_max_pool_fusable(bn1, pool, h))
      x = kiln__batch_norm_relu_max_pool_forward(bn1, pool, h); /* nothing to recompute: the map is never made */
    else
      x = h && kiln_checkpoint(stem_tail, m, 1, &h, 1, &y) == KILN_OK ? y : NULL;
    i = 4;
  }
  for (; i < n && x; i++) {
    kiln_module *ch = kiln_module_child_at(m, i), *next = i + 1 < n ? kiln_module_child_at(m, i + 1) : NULL;
    if (next && !strcmp(kiln__module_vtable(next)->type_name, "ReLU") && !kiln_module_is_checkpointed(next) &&
        !strcmp(kiln__module_vtable(ch)->type_name, "BatchNorm2d")) {
      x = kiln__batch_norm_relu_forward(ch, x);
      i++;
      continue;
    }
    x = kiln_module_forward(ch, x);
  }
  return kiln__scope_return(x);
}

static int resnet_repr(const kiln_module *m, char *buf, size_t n) {
  const resnet_cfg *c = kiln_module_impl(m);
  return snprintf(buf, n, "block=%s, layers=[%d, %d, %d, %d], width=%lld, num_classes=%lld%s",
                  c->block == KILN_RESNET_BOTTLENECK ? "Bottleneck" : "BasicBlock", c->layers[0], c->layers[1],
                  c->layers[2], c->layers[3], (long long)c->width, (long long)c->num_classes,
                  c->cifar_stem ? ", cifar_stem" : "");
}

static const kiln_module_vtable resnet_vt = {"ResNet", resnet_forward, NULL, free, resnet_repr};

static kiln_module *resnet_build(const char *who, const int *layers, kiln_resnet_block block, int64_t width,
                                 int64_t num_classes, bool cifar_stem, kiln_dtype dt, kiln_device dev,
                                 kiln_generator *gen) {
  if (!layers || (block != KILN_RESNET_BASIC && block != KILN_RESNET_BOTTLENECK) || width < 1 ||
      num_classes < 1) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: layers %s, block %d, width %lld (>= 1), num_classes %lld (>= 1)",
                   who, layers ? "given" : "NULL", (int)block, (long long)width, (long long)num_classes);
    return NULL;
  }
  for (int i = 0; i < 4; i++) {
    if (layers[i] < 1) {
      kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: layer%d has %d blocks (must be >= 1)", who, i + 1, layers[i]);
      return NULL;
    }
  }
  if (!kiln_dtype_is_float(dt)) {
    kiln_set_error(KILN_ERR_DTYPE, "%s: dtype %s is not floating", who, kiln_dtype_name(dt));
    return NULL;
  }
  resnet_cfg *c = malloc(sizeof *c);
  if (!c) {
    kiln_set_error(KILN_ERR_OOM, "%s: out of host memory", who);
    return NULL;
  }
  *c = (resnet_cfg){{layers[0], layers[1], layers[2], layers[3]}, block, width, num_classes, cifar_stem};
  kiln_module *m = kiln_module_new(&resnet_vt, c);
  if (!m) return NULL;
  bool bottleneck = block == KILN_RESNET_BOTTLENECK;
  int64_t expansion = bottleneck ? 4 : 1;
  kiln_status st = KILN_OK;
  /* torchvision draws in construction order (every conv's default, the fc's default),
  ** then re-draws the convolutions; kiln draws each conv's two at once. Both are
  ** torchvision's distributions; the numbers differ from torch's generator anyway. */
  st = add(m, "conv1", conv(3, width, cifar_stem ? 3 : 7, cifar_stem ? 1 : 2, dt, dev, gen), st);
  st = add(m, "bn1", bn(width, dt, dev), st);
  st = add(m, "relu", kiln_relu_new(), st);
  if (!cifar_stem) st = add(m, "maxpool", kiln_max_pool2d_new((const int64_t[]){3, 3}, (const int64_t[]){2, 2},
                                                             (const int64_t[]){1, 1}, NULL), st);
  int64_t in = width;
  for (int l = 0; l < 4 && st == KILN_OK; l++) {
    int64_t planes = width << l, stride = l == 0 ? 1 : 2;
    kiln_module *layer = kiln_sequential_new();
    st = layer ? KILN_OK : kiln_last_error();
    for (int b = 0; b < layers[l] && st == KILN_OK; b++) {
      st = kiln_sequential_append(layer, block_new(bottleneck, in, planes, b == 0 ? stride : 1, dt, dev, gen));
      in = planes * expansion;
    }
    char name[16];
    snprintf(name, sizeof name, "layer%d", l + 1);
    st = add(m, name, layer, st);
  }
  st = add(m, "avgpool", kiln_adaptive_avg_pool2d_new((const int64_t[]){1, 1}), st);
  st = add(m, "flatten", kiln_flatten_new(1, -1), st);
  st = add(m, "fc", kiln_linear_new(in, num_classes, true, dt, dev, gen), st);
  if (st != KILN_OK) {
    kiln_module_free(m);
    return NULL;
  }
  return m;
}

kiln_module *kiln_resnet_custom_new(const int *layers, kiln_resnet_block block, int64_t width, int64_t num_classes,
                                    bool cifar_stem, kiln_dtype dt, kiln_device dev, kiln_generator *gen) {
  return resnet_build("kiln_resnet_custom_new", layers, block, width, num_classes, cifar_stem, dt, dev, gen);
}

kiln_module *kiln_resnet_new(int depth, int64_t num_classes, bool cifar_stem, kiln_dtype dt, kiln_device dev,
                             kiln_generator *gen) {
  static const int l18[4] = {2, 2, 2, 2}, l34[4] = {3, 4, 6, 3};
  if (depth != 18 && depth != 34 && depth != 50) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_resnet_new: depth %d is not 18, 34 or 50", depth);
    return NULL;
  }
  return resnet_build("kiln_resnet_new", depth == 18 ? l18 : l34,
                      depth == 50 ? KILN_RESNET_BOTTLENECK : KILN_RESNET_BASIC, 64, num_classes, cifar_stem, dt,
                      dev, gen);
}
