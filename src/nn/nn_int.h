/* Private helpers of src/nn. Built only on the public headers and the extension header
** (ext/kiln_ext.h), which carries what nn shares with optim and io/checkpoint (message
** lists, metadata numbers, the checked state-dict load). */
#ifndef KILN_NN_INT_H
#define KILN_NN_INT_H

#include <stdarg.h>

#include "kiln.h"
#include "kiln_io.h"
#include "kiln_nn.h"
#include "ext/kiln_ext.h"

/* The module's vtable (identifies kiln's own layer types exactly, for fusions). */
const kiln_module_vtable *kiln__module_vtable(const kiln_module *m);

/* The eps of kiln_gpt_new's LayerNorms (GPT-2's layer_norm_epsilon); generate.c's fused
** decode step uses it too. */
#define KILN__GPT_LN_EPS 1e-5

/* A Linear (kiln_linear_new's checks and errors) whose weight and bias are allocated, their
** values not set: for a constructor that fills them itself (layers.c). */
kiln_module *kiln__linear_new_undrawn(int64_t in_features, int64_t out_features, bool bias, kiln_dtype dt,
                                      kiln_device dev);
/* Moves gen on past the draws kiln_linear_new(in, out, bias, ..., gen) makes (layers.c). */
void kiln__linear_skip_init(int64_t in_features, int64_t out_features, bool bias, kiln_generator *gen);

/* A GPT of kiln_gpt_new's layout whose Linear and Embedding weights are not set (the
** LayerNorms are 1 and 0, the biases too are not set), for a loader that writes every one;
** no generator is touched (transformer.c). */
kiln_module *kiln__gpt_new_undrawn(const kiln_gpt_config *cfg, kiln_dtype dt, kiln_device dev);

/* The module's label for the module scope ("layers.0 (Linear)"; the root: its type
** name), interned: it outlives the module. */
const char *kiln__module_label(kiln_module *m);

/* kiln_model_memory_summary's measurement: while set on this thread, each module forward
** adds the bytes autograd saved during it to its entry (grown as needed). */
typedef struct kiln__act_measure {
  kiln_module **mods;
  int64_t *bytes;
  int n, cap;
} kiln__act_measure;
void kiln__module_measure_set(kiln__act_measure *a); /* NULL: off */
bool kiln__module_measuring(void);
void kiln__module_measure_note(kiln_module *m, int64_t bytes);

/* relu(kiln_module_forward(bn, x)) for a BatchNorm1d/2d module as one op
** (kiln_batch_norm_relu: the same numbers, no pre-ReLU tensor kept); any other module, or a
** checkpointed one, runs the two calls. conv_layers.c. */
kiln_tensor *kiln__batch_norm_relu_forward(kiln_module *bn, kiln_tensor *x);

/* relu(kiln_module_forward(bn, x) + residual) likewise (kiln_batch_norm_add_relu);
** NULL when residual is NULL (an error already set). */
kiln_tensor *kiln__batch_norm_add_relu_forward(kiln_module *bn, kiln_tensor *x, kiln_tensor *residual);

/* max_pool2d(relu(kiln_module_forward(bn, x))) with pool's window as one op
** (kiln__batch_norm_relu_max_pool2d), in bn's module scope; _fusable says whether x's device
** runs it fused (a BatchNorm2d and a MaxPool2d of dilation 1, neither checkpointed): the
** ResNet stem then needs no checkpoint to keep the normalized map out of memory. */
bool kiln__batch_norm_relu_max_pool_fusable(kiln_module *bn, kiln_module *pool, kiln_tensor *x);
kiln_tensor *kiln__batch_norm_relu_max_pool_forward(kiln_module *bn, kiln_module *pool, kiln_tensor *x);

/* The module's configuration text (vtable extra_repr), "" when it has none; snprintf-like. */
/* pool is a MaxPool2d: kiln_relu_max_pool2d(x) with its window (a Sequential's ReLU then
** MaxPool2d); any other module: NULL, no error set (conv_layers.c). */
bool kiln__module_is_max_pool2d(const kiln_module *pool);
kiln_tensor *kiln__relu_max_pool_forward(kiln_module *pool, kiln_tensor *x);
/* conv is a Conv2d and pool a MaxPool2d: kiln_conv2d_relu_max_pool2d(x) with their
** settings (a Sequential's Conv2d, ReLU, MaxPool2d); else NULL, no error set. */
bool kiln__module_is_conv2d(const kiln_module *conv);
kiln_tensor *kiln__conv_relu_max_pool_forward(kiln_module *conv, kiln_module *pool, kiln_tensor *x);
int kiln__module_extra_repr(const kiln_module *m, char *buf, size_t n);

#endif /* KILN_NN_INT_H */
