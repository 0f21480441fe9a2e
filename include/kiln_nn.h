/*
** kiln_nn — modules with named parameters, PyTorch-like, built only on kiln.h and
** kiln_io.h.
**
**   kiln_module *net = kiln_sequential_new();
**   kiln_sequential_append(net, kiln_linear_new(784, 128, true, KILN_F32, dev, NULL));
**   kiln_sequential_append(net, kiln_relu_new());
**   kiln_sequential_append(net, kiln_linear_new(128, 10, true, KILN_F32, dev, NULL));
**   kiln_module_summary(stdout, net);            // layers, shapes, parameter bytes
**   kiln_optim_config cfg = kiln_adamw_config(1e-3);                 // kiln_optim.h
**   kiln_optimizer *opt = kiln_optimizer_new_module(&cfg, net);
**   for (...) {
**     kiln_scope_begin();                        // one scope per step
**     kiln_tensor *loss = kiln_cross_entropy(kiln_module_forward(net, x), y, ...);
**     kiln_optimizer_zero_grad(opt);
**     kiln_backward(loss, NULL);
**     kiln_optimizer_step(opt);
**     kiln_scope_end();
**   }
**   kiln_optimizer_free(opt);
**   kiln_module_free(net);                       // children and parameters too
**
** Ownership.
** - A module owns its parameters and buffers (one plain reference each, no scope) and its
**   children (freed with it by kiln_module_free).
** - Parameters are leaves. kiln_module_to() and kiln_module_to_dtype() replace the
**   parameter tensors by new ones on the new device / dtype (the old handles are released,
**   so pointers fetched before are stale). The rule for optimizers: build the optimizer
**   after moving the model, or build it with kiln_optimizer_new_module(), which reads the
**   parameters through the module at every step and moves its own state along with them.
**   Implementations of forward therefore look their tensors up at each call
**   (kiln_module_param(m, "weight")) instead of caching pointers.
** - Tensors returned by forward follow the usual rule (owned by the open scope).
** - Borrowed pointers (parameters, names, children) stay valid until the module changes
**   (a new parameter, child, or a move); kiln_module_free ends them.
**
** Errors: functions returning kiln_module* give NULL with the last error set; status
** functions return the code. A NULL module gives KILN_ERR_INVALID_ARGUMENT (forward with a
** NULL input returns NULL without touching the last error, like the ops).
*/
#ifndef KILN_NN_H
#define KILN_NN_H

#include "kiln.h"
#include "kiln_io.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kiln_module kiln_module;

/* --------------------------------------------------------------------------------------
** User-defined modules: a vtable and an implementation pointer the module owns.
*/
typedef struct kiln_module_vtable {
  const char *type_name; /* "Linear", "MyBlock": shown by the summary; must not be NULL */
  /* One input, one output (new tensor, owned by the open scope). May be NULL if
  ** forward_n is set. */
  kiln_tensor *(*forward)(kiln_module *m, kiln_tensor *x);
  /* Several inputs (optional). */
  kiln_tensor *(*forward_n)(kiln_module *m, int n, kiln_tensor *const *xs);
  /* Frees impl (optional; the module's parameters/children are freed by kiln). */
  void (*free_impl)(void *impl);
  /* Short description of the configuration, "in=3, out=2" (optional); snprintf-like. */
  int (*extra_repr)(const kiln_module *m, char *buf, size_t n);
} kiln_module_vtable;

/* A new module with no parameters. vt must outlive the module (usually static).
** The module owns impl from now on (free_impl, if set, frees it, also on failure here). */
KILN_API kiln_module *kiln_module_new(const kiln_module_vtable *vt, void *impl);
/* Frees m, its children (recursively), its parameter and buffer references and impl.
** NULL is a no-op. Do not free a module that is a child of another (free the root). */
KILN_API void kiln_module_free(kiln_module *m);
KILN_API void *kiln_module_impl(const kiln_module *m);
KILN_API const char *kiln_module_type_name(const kiln_module *m);

/* Registers t as parameter `name` (no dots). The module takes over the caller's
** reference: t is kiln_keep()-ed out of its scope if a scope owns it; the caller must not
** free it afterwards. t must be a floating leaf; requires_grad is turned on (pass
** requires_grad false to freeze it). On failure the reference is released.
** KILN_ERR_INVALID_ARGUMENT (NULL, a bad or duplicate name), KILN_ERR_AUTOGRAD (not a
** leaf), KILN_ERR_DTYPE (not floating). A NULL t returns the pending error code. */
KILN_API kiln_status kiln_module_register_parameter(kiln_module *m, const char *name,
                                                     kiln_tensor *t, bool requires_grad);
/* Registers a buffer (state that is not trained: running stats, masks), the same
** ownership rule. persistent buffers go into the state dict. Any dtype. */
KILN_API kiln_status kiln_module_register_buffer(kiln_module *m, const char *name,
                                                  kiln_tensor *t, bool persistent);
/* Adds child under name (no dots). The parent owns child from now on, also on failure
** (then child is freed). A NULL child returns the pending error code. Returns KILN_OK. */
KILN_API kiln_status kiln_module_add_child(kiln_module *m, const char *name, kiln_module *child);

/* Lookup by name; dotted names reach into children ("fc1.weight", "0"). Borrowed; NULL if
** absent (no error set). */
KILN_API kiln_tensor *kiln_module_param(const kiln_module *m, const char *name);
KILN_API kiln_tensor *kiln_module_buffer(const kiln_module *m, const char *name);
KILN_API kiln_module *kiln_module_child(const kiln_module *m, const char *name);
/* Replaces the tensor of an existing buffer (e.g. a running statistic updated in
** forward): same ownership rule as register. KILN_ERR_INVALID_ARGUMENT when absent. */
KILN_API kiln_status kiln_module_set_buffer(kiln_module *m, const char *name, kiln_tensor *t);
/* Direct children, in insertion order. */
KILN_API int kiln_module_num_children(const kiln_module *m);
KILN_API kiln_module *kiln_module_child_at(const kiln_module *m, int i);
KILN_API const char *kiln_module_child_name(const kiln_module *m, int i);

/* Forward. NULL x (or any NULL input) returns NULL without touching the last error. */
KILN_API kiln_tensor *kiln_module_forward(kiln_module *m, kiln_tensor *x);
KILN_API kiln_tensor *kiln_module_forward_n(kiln_module *m, int n, kiln_tensor *const *xs);

/* Gradient checkpointing (kiln_checkpoint): a marked module's forward keeps only its
** inputs and output and runs again during backward (when grad mode is on). Marking a
** Sequential marks each of its children (one segment per block); to make a whole
** Sequential one segment, put it in a Sequential of its own and mark that. */
KILN_API kiln_status kiln_module_set_checkpoint(kiln_module *m, bool on);
KILN_API bool kiln_module_is_checkpointed(const kiln_module *m);
/* What a checkpointed module's segment keeps besides its inputs and output
** (kiln_checkpoint_keep; the default keeps attention's results; products also keeps
** each matmul's and plain linear's output). A Sequential's goes to each child, as above. */
KILN_API kiln_status kiln_module_set_checkpoint_keep(kiln_module *m, kiln_checkpoint_keep keep);
KILN_API kiln_checkpoint_keep kiln_module_checkpoint_keep(const kiln_module *m);
/* Train / eval mode, recursive (new modules are in train mode). */
KILN_API void kiln_module_train(kiln_module *m, bool on);
KILN_API void kiln_module_eval(kiln_module *m);
KILN_API bool kiln_module_is_training(const kiln_module *m);

/* Moves all parameters, buffers and gradients to dev (recursively). Parameter handles
** are replaced (see Ownership above). All or nothing: on failure (OOM) nothing changes. */
KILN_API kiln_status kiln_module_to(kiln_module *m, kiln_device dev);
/* Casts floating parameters and floating buffers to dt (a floating dtype). */
KILN_API kiln_status kiln_module_to_dtype(kiln_module *m, kiln_dtype dt);
/* Lays out every 4-d floating parameter and buffer (and its gradient) in format, as
** PyTorch's model.to(memory_format=torch.channels_last): KILN_CHANNELS_LAST keeps the
** convolution weights (OC, C, kh, kw) in NHWC memory, so a channels-last network hands
** cuDNN its weights without a copy per call. Handles are replaced as kiln_module_to does;
** all or nothing. KILN_ERR_INVALID_ARGUMENT for a NULL module or an unknown format. */
KILN_API kiln_status kiln_module_to_format(kiln_module *m, kiln_memory_format format);

/* Parameters in a stable order: a module's own (registration order), then its children's
** (insertion order, depth first); a tensor registered twice appears once. Writes at most
** max borrowed pointers into out (out may be NULL with max 0) and returns the total
** number, -1 on error. names (may be NULL) gets the dotted names, borrowed. */
KILN_API int kiln_module_parameters(kiln_module *m, kiln_tensor **out, int max);
KILN_API int kiln_module_named_parameters(kiln_module *m, const char **names,
                                          kiln_tensor **out, int max);
KILN_API int kiln_module_named_buffers(kiln_module *m, const char **names, kiln_tensor **out,
                                       int max);
/* Elements in all parameters (each shared tensor once); only those requiring grad. */
KILN_API int64_t kiln_module_num_params(kiln_module *m);
KILN_API int64_t kiln_module_num_trainable_params(kiln_module *m);
/* Bytes of the parameters, of their current gradients, of the buffers. */
KILN_API int64_t kiln_module_param_bytes(kiln_module *m);
KILN_API int64_t kiln_module_grad_bytes(kiln_module *m);
KILN_API int64_t kiln_module_buffer_bytes(kiln_module *m);

/* State dict: a new dict (caller frees) holding references to the parameters and
** persistent buffers under their dotted names (shared, not copied, like PyTorch). */
KILN_API kiln_dict *kiln_module_state_dict(kiln_module *m);
/* Copies the entries of d into the module's tensors (values, not handles). Checks
** everything first and changes nothing when a check fails; the error lists every
** problem: missing keys and unexpected keys (only when strict), shape and dtype
** mismatches (always). Tensors may be on any device. KILN_ERR_INVALID_ARGUMENT (missing /
** unexpected), KILN_ERR_SHAPE, KILN_ERR_DTYPE (the first kind found decides the code). */
KILN_API kiln_status kiln_module_load_state_dict(kiln_module *m, const kiln_dict *d, bool strict);

/* Prints a table: each module (dotted name, type, configuration), its own parameters
** with shapes, counts and bytes, then totals: parameters (trainable), bytes of weights,
** gradients and buffers. */
KILN_API kiln_status kiln_module_summary(FILE *f, kiln_module *m);
/* The memory a model costs, printed to f: parameters, gradients, buffers, optimizer state
** (opt may be NULL), and, when x is given, one forward on x (grad on, in its own scope,
** then dropped) measuring the activations saved for backward: in all and at the peak,
** and per module (each module's bytes include its children's; "-" for a module that ran
** fused into its parent's op). x does not need to require grad. Returns the forward's
** error if it failed. Allocator numbers: kiln_memory_summary (kiln.h). */
struct kiln_optimizer;
KILN_API kiln_status kiln_model_memory_summary(FILE *f, kiln_module *m, const struct kiln_optimizer *opt,
                                               kiln_tensor *x);
/* The bytes a forward of m on x leaves saved for backward in module which (m itself when
** NULL; its children included); -1 with the error set when the forward failed, or which
** did not run as its own module. */
KILN_API int64_t kiln_module_activation_bytes(kiln_module *m, kiln_tensor *x, kiln_module *which);
/* Human-readable byte count "1.50 MiB" into buf; returns buf. */
KILN_API const char *kiln_format_bytes(int64_t bytes, char *buf, size_t n);

/* --------------------------------------------------------------------------------------
** Built-in modules. Constructors return NULL with the last error set on bad arguments.
*/
/* y = x W^T + b with W (out, in), b (out). PyTorch's default init: kaiming_uniform with
** a = sqrt(5), i.e. W ~ U(-1/sqrt(in), 1/sqrt(in)), and b ~ U(-1/sqrt(in), 1/sqrt(in)),
** drawn weight first from gen (NULL: the global generator). dt must be floating. */
KILN_API kiln_module *kiln_linear_new(int64_t in_features, int64_t out_features, bool bias,
                                      kiln_dtype dt, kiln_device dev, kiln_generator *gen);
/* Children run in order; appended children are named "0", "1", ... */
KILN_API kiln_module *kiln_sequential_new(void);
/* Takes ownership of child (also on failure). A NULL child returns the pending error. */
KILN_API kiln_status kiln_sequential_append(kiln_module *seq, kiln_module *child);
/* A Sequential of n modules (ownership of all taken; NULL entries make it fail). */
KILN_API kiln_module *kiln_sequential_of(int n, kiln_module *const *children);

KILN_API kiln_module *kiln_relu_new(void);
KILN_API kiln_module *kiln_leaky_relu_new(double negative_slope); /* PyTorch: 0.01 */
typedef enum kiln_gelu_approx { KILN_GELU_EXACT = 0, KILN_GELU_TANH } kiln_gelu_approx;
KILN_API kiln_module *kiln_gelu_new(kiln_gelu_approx approx);
KILN_API kiln_module *kiln_silu_new(void);
KILN_API kiln_module *kiln_sigmoid_new(void);
KILN_API kiln_module *kiln_tanh_new(void);
KILN_API kiln_module *kiln_softplus_new(double beta, double threshold); /* PyTorch: 1, 20 */
/* Zeroes elements with probability p in train mode (scaled by 1/(1-p)); identity in eval.
** gen NULL: the global generator (not owned). 0 <= p <= 1. */
KILN_API kiln_module *kiln_dropout_new(double p, kiln_generator *gen);
KILN_API kiln_module *kiln_flatten_new(int start_dim, int end_dim); /* PyTorch: 1, -1 */
KILN_API kiln_module *kiln_identity_new(void);

/* --------------------------------------------------------------------------------------
** Convolutional modules (src/nn/conv_layers.c) over the ops of kiln.h (kiln_conv2d ...),
** PyTorch's names, shapes and defaults. dt must be floating (KILN_ERR_DTYPE); a bad
** configuration gives NULL and KILN_ERR_INVALID_ARGUMENT naming the values. Pairs
** (kernel_size, stride, ...) are two values (height, width); a NULL pair takes PyTorch's
** default (stride 1, padding 0, dilation 1, output_padding 0). Forward takes (N, C, H, W)
** ((N, C, L) for Conv1d) and reports shape problems as the op does (KILN_ERR_SHAPE).
**
** Convolutions draw PyTorch's default init from gen (NULL: the global generator), weight
** first: kaiming_uniform(a = sqrt(5)), i.e. W ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)) and the
** bias from the same bound, fan_in = in_channels/groups * kernel area (ConvTranspose2d:
** out_channels/groups * kernel area, as PyTorch). Parameters: weight, bias (when bias). */
/* weight (out, in/groups, kh, kw). padding may be KILN_PADDING_SAME in both dims (then
** stride must be 1). groups must divide both channel counts. */
KILN_API kiln_module *kiln_conv2d_new(int64_t in_channels, int64_t out_channels, const int64_t *kernel_size,
                                      const int64_t *stride, const int64_t *padding, const int64_t *dilation,
                                      int64_t groups, bool bias, kiln_dtype dt, kiln_device dev,
                                      kiln_generator *gen);
/* weight (out, in/groups, k); padding may be KILN_PADDING_SAME (stride 1). */
KILN_API kiln_module *kiln_conv1d_new(int64_t in_channels, int64_t out_channels, int64_t kernel_size,
                                      int64_t stride, int64_t padding, int64_t dilation, int64_t groups, bool bias,
                                      kiln_dtype dt, kiln_device dev, kiln_generator *gen);
/* weight (in, out/groups, kh, kw); output_padding < stride or < dilation (PyTorch's rule). */
KILN_API kiln_module *kiln_conv_transpose2d_new(int64_t in_channels, int64_t out_channels,
                                                const int64_t *kernel_size, const int64_t *stride,
                                                const int64_t *padding, const int64_t *output_padding,
                                                const int64_t *dilation, int64_t groups, bool bias, kiln_dtype dt,
                                                kiln_device dev, kiln_generator *gen);
/* stride NULL: the kernel size (PyTorch). padding at most half the kernel. */
KILN_API kiln_module *kiln_max_pool2d_new(const int64_t *kernel_size, const int64_t *stride,
                                          const int64_t *padding, const int64_t *dilation);
/* The padding's zeros count in the mean (count_include_pad, PyTorch's default). */
KILN_API kiln_module *kiln_avg_pool2d_new(const int64_t *kernel_size, const int64_t *stride,
                                          const int64_t *padding);
KILN_API kiln_module *kiln_adaptive_avg_pool2d_new(const int64_t *output_size);
/* Batch normalization over C of (N, C) or (N, C, L) (1d) / (N, C, H, W) (2d). PyTorch's
** defaults: eps 1e-5, momentum 0.1 (NAN: PyTorch's momentum=None, a cumulative average,
** which reads the count on the host at each training step), affine and
** track_running_stats true. Parameters weight (1) and bias (0) when affine; persistent
** buffers running_mean (0), running_var (1) (dt) and num_batches_tracked (0-dim i64) when
** track_running_stats: they are in the state dict and moved by kiln_module_to, not seen
** by optimizers. Train mode: batch statistics, num_batches_tracked += 1 and the running
** statistics updated in place (r = (1-momentum) r + momentum stat, unbiased variance).
** Eval mode: the running statistics; without track_running_stats always the batch's.
** Forward: KILN_ERR_SHAPE for another rank or channel count, and (train) one value per
** channel. */
KILN_API kiln_module *kiln_batch_norm1d_new(int64_t num_features, double eps, double momentum, bool affine,
                                            bool track_running_stats, kiln_dtype dt, kiln_device dev);
KILN_API kiln_module *kiln_batch_norm2d_new(int64_t num_features, double eps, double momentum, bool affine,
                                            bool track_running_stats, kiln_dtype dt, kiln_device dev);
/* GroupNorm: num_groups must divide num_channels; weight 1, bias 0 when affine. */
KILN_API kiln_module *kiln_group_norm_new(int64_t num_groups, int64_t num_channels, double eps, bool affine,
                                          kiln_dtype dt, kiln_device dev);
/* Zeroes whole channels with probability p in train mode (scaled by 1/(1-p)); identity in
** eval. gen NULL: the global generator (not owned). */
KILN_API kiln_module *kiln_dropout2d_new(double p, kiln_generator *gen);

/* ResNets (src/nn/resnet.c), torchvision's structure and parameter names: conv1, bn1,
** (relu, maxpool), layer1..layer4 of blocks ("layer1.0.conv1.weight",
** "layer2.0.downsample.0.weight", "layer2.0.downsample.1.running_mean"), avgpool
** (adaptive to 1x1), flatten, fc. Input (N, 3, H, W) -> logits (N, num_classes).
** torchvision's initialisation: convolutions kaiming_normal (fan_out, relu):
** N(0, sqrt(2 / (out_channels * kh * kw))), BatchNorm weight 1 and bias 0, fc as Linear's
** default (kiln_linear_new), drawn from gen (NULL: the global generator). cifar_stem:
** conv1 is 3x3 stride 1 padding 1 and there is no maxpool (the usual variant for 32x32
** images; the names stay the same). A state dict of another depth does not load:
** kiln_module_load_state_dict lists the missing / unexpected keys and shapes.
** depth 18, 34 (BasicBlock, layers [2,2,2,2] / [3,4,6,3]) or 50 (Bottleneck, [3,4,6,3]).
** NULL + KILN_ERR_INVALID_ARGUMENT for another depth or num_classes < 1, KILN_ERR_DTYPE. */
KILN_API kiln_module *kiln_resnet_new(int depth, int64_t num_classes, bool cifar_stem, kiln_dtype dt,
                                      kiln_device dev, kiln_generator *gen);
typedef enum kiln_resnet_block {
  KILN_RESNET_BASIC = 0, /* two 3x3 convolutions, expansion 1 */
  KILN_RESNET_BOTTLENECK /* 1x1, 3x3 (the stride), 1x1; expansion 4 (torchvision's v1.5) */
} kiln_resnet_block;
/* Any ResNet of torchvision's code: layers[i] blocks in layer i+1 (each >= 1), width the
** channels of conv1 and layer1 (torchvision: 64; layer k has width * 2^(k-1) planes).
** kiln_resnet_new(18, ...) is kiln_resnet_custom_new({2,2,2,2}, BASIC, 64, ...). */
KILN_API kiln_module *kiln_resnet_custom_new(const int *layers, kiln_resnet_block block, int64_t width,
                                             int64_t num_classes, bool cifar_stem, kiln_dtype dt,
                                             kiln_device dev, kiln_generator *gen);

/* --------------------------------------------------------------------------------------
** Transformer modules (GPT-2 / nanoGPT layout and parameter names). dt must be floating;
** gen (NULL: the global generator) gives the initial draws; dropout draws from the global
** generator.
*/
/* Rows of weight (num_embeddings, embedding_dim) picked by integer ids of any shape:
** (..., embedding_dim). PyTorch's init: weight ~ N(0, 1). Parameter: weight. */
KILN_API kiln_module *kiln_embedding_new(int64_t num_embeddings, int64_t embedding_dim,
                                         kiln_dtype dt, kiln_device dev, kiln_generator *gen);
/* LayerNorm over the last dim (dim): weight 1, bias 0 (bias false: no bias parameter).
** PyTorch's eps: 1e-5. Parameters: weight, bias. */
KILN_API kiln_module *kiln_layer_norm_new(int64_t dim, double eps, bool bias, kiln_dtype dt,
                                          kiln_device dev);
/* RMSNorm over the last dim: weight 1. Parameter: weight. */
KILN_API kiln_module *kiln_rms_norm_new(int64_t dim, double eps, kiln_dtype dt, kiln_device dev);

/* A GPT-2 shape. The struct may grow at its end: start from kiln_gpt2_config(). */
typedef struct kiln_gpt_config {
  int64_t n_layer, n_head, n_embd; /* n_embd must be a multiple of n_head */
  int64_t vocab_size;
  int64_t block_size;              /* the context: the longest sequence forward takes */
  double dropout;                  /* embeddings, attention weights, residual branches */
  bool bias;                       /* biases in the Linears and LayerNorms */
} kiln_gpt_config;
/* GPT-2 small: 12 layers, 12 heads, 768 wide, vocab 50257, context 1024, dropout 0,
** biases on (124M parameters). */
KILN_API kiln_gpt_config kiln_gpt2_config(void);

/* The GPT-2 initialisation (nanoGPT's _init_weights) all of these use: Linear and
** Embedding weights ~ N(0, 0.02), biases 0, LayerNorm weight 1 and bias 0, and the
** residual projections (c_proj of attention and MLP) ~ N(0, 0.02 / sqrt(2 n_layer)).
**
** Causal self-attention on x (B, T, C): children c_attn (Linear C -> 3C; q, k, v in that
** order along the output) and c_proj (Linear C -> C); heads of n_embd / n_head. */
KILN_API kiln_module *kiln_causal_self_attention_new(const kiln_gpt_config *cfg, kiln_dtype dt,
                                                     kiln_device dev, kiln_generator *gen);
/* MLP: c_fc (Linear C -> 4C), GELU (tanh approximation), c_proj (Linear 4C -> C). */
KILN_API kiln_module *kiln_gpt_mlp_new(const kiln_gpt_config *cfg, kiln_dtype dt, kiln_device dev,
                                       kiln_generator *gen);
/* Pre-norm block: x + attn(ln_1(x)), then x + mlp(ln_2(x)). Children ln_1, attn, ln_2, mlp. */
KILN_API kiln_module *kiln_gpt_block_new(const kiln_gpt_config *cfg, kiln_dtype dt, kiln_device dev,
                                         kiln_generator *gen);
/* GPT-2: forward takes token ids idx (B, T) (i64 or i32) and returns logits
** (B, T, vocab_size). Children wte (Embedding vocab x C), wpe (Embedding block_size x C),
** drop, h (a Sequential of n_layer Blocks: "h.0.attn.c_attn.weight"), ln_f. The output
** head is tied to the token embedding: logits = x @ wte.weight^T, and the weight is
** registered once (wte.weight), so state dicts, parameter counts, optimizers and the
** summary see it once (nanoGPT's state dict would also list lm_head.weight).
** Errors: constructors give KILN_ERR_INVALID_ARGUMENT for sizes < 1, dropout outside
** [0, 1) or n_embd not a multiple of n_head (naming both); forward gives KILN_ERR_SHAPE
** for idx that is not (B, T) or T over block_size (naming both), KILN_ERR_DTYPE for ids
** that are not integers. */
KILN_API kiln_module *kiln_gpt_new(const kiln_gpt_config *cfg, kiln_dtype dt, kiln_device dev,
                                   kiln_generator *gen);
/* The configuration a GPT module (or one of its attention, MLP or block modules) was
** built with; NULL for any other module. Borrowed. */
KILN_API const kiln_gpt_config *kiln_gpt_config_of(const kiln_module *m);
/* The training loss of a kiln_gpt_new module: the mean cross-entropy of its logits for idx
** (B, T) against targets ((B, T) or (B*T), class ids; ignore_index as kiln_cross_entropy),
** the same value and gradients as kiln_cross_entropy of kiln_module_forward's logits, but
** through kiln_linear_cross_entropy: the (B, T, vocab) logits and their gradient are never
** whole in memory (for GPT-2 at B=16, T=1024, bf16: 3 GiB less at the peak). Errors of
** the forward, KILN_ERR_INVALID_ARGUMENT for another module, KILN_ERR_SHAPE for targets
** of another size. The loss (0-dim, as kiln_cross_entropy's) is owned by the current scope. */
KILN_API kiln_tensor *kiln_gpt_forward_loss(kiln_module *gpt, kiln_tensor *idx, kiln_tensor *targets,
                                            int64_t ignore_index);

/* --------------------------------------------------------------------------------------
** Generation (src/nn/generate.c): a key/value cache, sampling, kiln_gpt_generate.
**
**   kiln_sample_opts o = kiln_sample_opts_default();    // temperature 1, no filters
**   o.top_k = 40; o.temperature = 0.8;
**   kiln_tensor *out = kiln_gpt_generate(gpt, prompt, 100, &o, gen);  // (B, T0 + 100)
*/
/* The keys and values of every layer of one GPT for a batch: per layer two tensors
** (batch, n_head, max_len, head_dim), made at the first forward with the dtype and device
** of the keys (under autocast, the autocast dtype). NULL + KILN_ERR_INVALID_ARGUMENT
** (gpt not a kiln_gpt_new module; batch < 1; max_len outside [1, block_size]) or
** KILN_ERR_OOM. Owned by the caller: kiln_kv_cache_free (NULL is a no-op). */
typedef struct kiln_kv_cache kiln_kv_cache;
KILN_API kiln_kv_cache *kiln_kv_cache_new(const kiln_module *gpt, int64_t batch, int64_t max_len);
KILN_API void kiln_kv_cache_free(kiln_kv_cache *cache);
/* Positions filled so far (0 for NULL). */
KILN_API int64_t kiln_kv_cache_length(const kiln_kv_cache *cache);
/* Forgets the cached positions (the memory stays). */
KILN_API void kiln_kv_cache_reset(kiln_kv_cache *cache);
/* The GPT's forward on the next T positions: idx (batch, T) i64/i32 are tokens at
** positions len .. len + T - 1 (len = kiln_kv_cache_length), attending the cached prefix
** and themselves (causally); returns logits (batch, T, vocab_size) and appends their keys
** and values. Runs with grad mode off and without dropout (inference). Equal, within f32
** rounding, to the last T positions of kiln_module_forward on the whole sequence.
** Errors: KILN_ERR_INVALID_ARGUMENT (not a GPT, NULL cache, a cache of another shape),
** KILN_ERR_SHAPE (idx not (batch, T>=1), len + T over max_len), KILN_ERR_DTYPE. */
KILN_API kiln_tensor *kiln_gpt_forward_cached(kiln_module *gpt, kiln_tensor *idx, kiln_kv_cache *cache);

/* Whether kiln_gpt_generate records the per-token step once and replays it
** (kiln_graph_capture). Every token after the prompt runs the same decode step (its
** position and the cache's valid length held on the device: kiln_index_copy_,
** kiln_kv_attention; the next token chosen inside it unless eos_id is set), so the tokens
** are the same whichever this is: AUTO captures on any device but the CPU (a CUDA graph)
** and runs the step eagerly where the capture fails (a step op on the CPU fallback) or the
** device has no graphs; ON always captures, a failed capture being an error (on the CPU a
** replay calls the step); OFF runs the step eagerly. */
typedef enum kiln_gen_graph { KILN_GEN_GRAPH_AUTO = 0, KILN_GEN_GRAPH_OFF, KILN_GEN_GRAPH_ON } kiln_gen_graph;
/* How the next token is chosen from logits. May grow at its end: start from
** kiln_sample_opts_default(). In order: logits / temperature, then top-k (keep the k
** largest; 0 keeps all), then top-p (keep the fewest largest tokens whose probability
** reaches top_p: a token stays while the tokens above it hold < top_p; tokens tied with
** the last kept one stay too), softmax, one draw from gen (kiln_sample_next: kiln_multinomial;
** kiln_gpt_generate: kiln_sample_tokens on the device, which advances gen the same; same
** seed, same tokens). greedy, or temperature 0, takes the argmax (first on ties) and
** ignores the filters. */
typedef struct kiln_sample_opts {
  double temperature;   /* >= 0; default 1 */
  int64_t top_k;        /* >= 0; default 0 (off) */
  double top_p;         /* (0, 1]; default 1 (off) */
  bool greedy;          /* default false */
  int64_t eos_id;       /* >= 0: a row that made it repeats it, generation stops when all rows
                           have (one host read per token); default -1 (none) */
  kiln_gen_graph graph; /* default AUTO */
} kiln_sample_opts;
KILN_API kiln_sample_opts kiln_sample_opts_default(void);
/* logits (N, V) floating -> (N, V) f32: divided by the temperature, with -inf where top-k
** or top-p removes a token (greedy: the logits as f32, unfiltered). Errors:
** KILN_ERR_INVALID_ARGUMENT (temperature < 0 or not finite, top_k < 0, top_p outside
** (0, 1], NULL opts), KILN_ERR_SHAPE (logits not floating (N, V)). */
KILN_API kiln_tensor *kiln_sample_filter(kiln_tensor *logits, const kiln_sample_opts *opts);
/* One token per row of logits (N, V): (N) i64, drawn as kiln_sample_opts says from gen
** (NULL: the global generator). Errors as kiln_sample_filter. */
KILN_API kiln_tensor *kiln_sample_next(kiln_tensor *logits, const kiln_sample_opts *opts,
                                       kiln_generator *gen);
/* Continues each row of ids (B, T0) i64/i32 (on the model's device) by n_new tokens and
** returns (B, T0 + n_new) i64 (prompt included), owned by the open scope. The prompt runs
** in one pass that fills a kiln_kv_cache of T0 + n_new positions, then one position per
** token (a CUDA graph replay per token where opts->graph allows). With eos_id set and
** every row finished early, the result is shorter: (B, T0 + tokens made). Grad mode off,
** no dropout. T0 + n_new may not exceed the context: there is no sliding window (the
** learned positions stop at block_size; a caller that wants more crops its prompt and
** calls again). Errors: KILN_ERR_SHAPE (ids not (B, T0) integers, T0 = 0 (an empty
** prompt), T0 + n_new > block_size, n_new < 0, naming the numbers),
** KILN_ERR_INVALID_ARGUMENT (not a GPT, bad options as kiln_sample_filter, eos_id >=
** vocab_size), and the errors of the ops. */
KILN_API kiln_tensor *kiln_gpt_generate(kiln_module *gpt, kiln_tensor *ids, int64_t n_new,
                                        const kiln_sample_opts *opts, kiln_generator *gen);

/* --------------------------------------------------------------------------------------
** Hugging Face interop (transformers' GPT2LMHeadModel / GPT2Model, src/nn/gpt_hf.c).
** HF's names are kiln's with "transformer." in front ("transformer.h.0.attn.c_attn.weight"),
** and its c_attn, c_proj and c_fc are Conv1D layers whose weights are stored (in, out):
** transposed from kiln's Linear (out, in). HF's lm_head.weight is the tied wte.
**
**   kiln_module *gpt = kiln_gpt_from_hf("gpt2-dir", NULL, KILN_F32, kiln_device_cpu());
**   ...
**   kiln_gpt_save_hf(gpt, "out-dir");   // config.json + model.safetensors, HF's layout
*/
/* Copies a HF GPT-2 state dict into gpt (a kiln_gpt_new module, biases on). Names with or
** without the "transformer." prefix; Conv1D weights transposed; values converted to the
** model's dtype; the buffers attn.bias / attn.masked_bias skipped; lm_head.weight, when
** present, must equal wte.weight. Checks everything first and changes nothing on failure;
** the error lists every problem and gives the sizes of the file and of the model:
** KILN_ERR_SHAPE (an entry of another shape: key, file shape, expected shape, in HF's
** (in, out) terms for Conv1D), KILN_ERR_FORMAT (missing or unexpected keys, e.g. another
** n_layer; an untied lm_head), KILN_ERR_DTYPE (a non-floating entry),
** KILN_ERR_INVALID_ARGUMENT (NULL, gpt not a GPT). */
KILN_API kiln_status kiln_gpt_load_hf(kiln_module *gpt, const kiln_dict *hf);
/* gpt's parameters under HF's GPT2LMHeadModel names ("transformer." + kiln's name), Conv1D
** weights transposed to (in, out) (copies; the others shared), metadata format "pt"; no
** lm_head.weight (transformers ties it on load). A new dict the caller frees; NULL +
** KILN_ERR_INVALID_ARGUMENT (not a GPT) or KILN_ERR_OOM. */
KILN_API kiln_dict *kiln_gpt_hf_state_dict(kiln_module *gpt);
/* Reads a HF config.json (n_layer, n_head, n_embd, vocab_size, n_positions -> block_size,
** resid_pdrop -> dropout; an absent rate is transformers' default 0.1) into *cfg, which
** is left alone on failure. KILN_ERR_IO (cannot read), KILN_ERR_FORMAT (bad JSON naming
** the byte, a size missing, a size that is not a whole number from 1 to 2^31 - 1, n_embd
** not a multiple of n_head, a dropout rate outside [0, 1), or a GPT-2 kiln's GPT is not:
** model_type other than gpt2, activation other than gelu_new, layer_norm_epsilon other
** than 1e-5, n_inner other than 4 n_embd, untied embeddings,
** scale_attn_by_inverse_layer_idx). */
KILN_API kiln_status kiln_gpt_hf_config(const char *path, kiln_gpt_config *cfg);
/* A new GPT from a HF checkpoint: path is a directory (its config.json and
** model.safetensors, or a sharded model.safetensors.index.json and the shards its
** "weight_map" names, as save_pretrained writes a large model), a .safetensors file or
** such an index (a path ending .index.json; config.json beside either). cfg non-NULL is used instead of config.json. The model is built
** with dt on dev and loaded as kiln_gpt_load_hf loads a dict, with the same checks, from
** the files opened with kiln_safetensors_open and read a tensor at a time (no file is ever
** whole in host memory; the global generator is not drawn from). NULL with the error of
** kiln_gpt_hf_config, kiln_safetensors_open or _read, or kiln_gpt_load_hf's (prefixed by
** the file); a sharded index is refused by name (KILN_ERR_FORMAT) when it puts a tensor in
** a shard that does not hold it, names a shard by a path rather than a file name of the
** directory, or when two shards hold one tensor; KILN_ERR_IO when the directory has
** neither file. */
KILN_API kiln_module *kiln_gpt_from_hf(const char *path, const kiln_gpt_config *cfg, kiln_dtype dt,
                                       kiln_device dev);
/* Writes dir/model.safetensors (kiln_gpt_hf_state_dict) and dir/config.json, as
** save_pretrained does (dir is made when missing; its parent must exist), so that
** transformers' GPT2LMHeadModel.from_pretrained(dir) and kiln_gpt_from_hf(dir) read it.
** KILN_ERR_INVALID_ARGUMENT, KILN_ERR_IO (naming the path), KILN_ERR_OOM. */
KILN_API kiln_status kiln_gpt_save_hf(kiln_module *gpt, const char *dir);

#ifdef __cplusplus
}
#endif
#endif /* KILN_NN_H */
