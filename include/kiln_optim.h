/*
** kiln_optim — optimizers (SGD, Adam, AdamW), learning-rate schedulers and gradient
** clipping, built only on kiln.h, kiln_io.h and kiln_nn.h.
**
**   kiln_optim_config cfg = kiln_adamw_config(3e-4);
**   cfg.weight_decay = 0.1;
**   kiln_optimizer *opt = kiln_optimizer_new_module(&cfg, net);
**   kiln_scheduler *sched = kiln_cosine_lr_new(opt, total_steps, 0.0, warmup_steps, 0.0);
**   ... per step: zero_grad, backward, kiln_clip_grad_norm(...), kiln_optimizer_step(opt),
**       kiln_scheduler_step(sched)
**
** Semantics follow PyTorch's single-tensor ("foreach=False") implementations exactly:
**   SGD:   g += wd p; b = g (first step) else b = mu b + (1 - dampening) g;
**          g = nesterov ? g + mu b : b; p -= lr g
**   Adam:  g += wd p; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2; (amsgrad: vmax =
**          max(vmax, v), used for v below); p -= lr / (1 - b1^t) * m /
**          (sqrt(v) / sqrt(1 - b2^t) + eps)
**   AdamW: p *= 1 - lr wd, then Adam without the g += wd p term.
** t counts the steps of each parameter (a parameter without a gradient is skipped and its
** step count does not advance). maximize negates the gradient.
**
** Updates run with grad mode off, inside their own scope, with kiln's in-place ops; state
** tensors (momentum_buffer, exp_avg, exp_avg_sq, max_exp_avg_sq) live on their
** parameter's device and dtype, owned by the optimizer.
**
** Parameters and kiln_module_to(): kiln_optimizer_new() holds references to the tensors it
** is given; kiln_module_to() replaces a module's parameter tensors, so an optimizer built
** from a parameter list before the move would go on updating the old tensors. Build it
** after moving, or use kiln_optimizer_new_module(), which reads the parameters through the
** module at each step and moves its state to follow them.
*/
#ifndef KILN_OPTIM_H
#define KILN_OPTIM_H

#include "kiln.h"
#include "kiln_io.h"
#include "kiln_nn.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum kiln_optim_kind {
  KILN_OPTIM_SGD = 0,
  KILN_OPTIM_ADAM,
  KILN_OPTIM_ADAMW,
  KILN_OPTIM__COUNT
} kiln_optim_kind;

typedef struct kiln_optim_config {
  kiln_optim_kind kind;
  double lr;
  double weight_decay;
  bool maximize;
  /* SGD */
  double momentum;
  double dampening;
  bool nesterov; /* needs momentum > 0 and dampening 0 (PyTorch's rule) */
  /* Adam, AdamW */
  double beta1, beta2;
  double eps;
  bool amsgrad;
  /* Adam/AdamW: keep each parameter's step count on its device and read it there, so a
  ** captured training step (kiln_graph_capture) advances the bias correction on every
  ** replay (PyTorch's capturable=True). The lr is fixed into a captured graph: re-capture
  ** after changing it. kiln_optimizer_steps() counts eager steps only. */
  bool capturable;
} kiln_optim_config;

/* PyTorch's defaults: SGD momentum 0, dampening 0, wd 0; Adam betas (0.9, 0.999),
** eps 1e-8, wd 0; AdamW the same with wd 0.01. */
KILN_API kiln_optim_config kiln_sgd_config(double lr);
KILN_API kiln_optim_config kiln_adam_config(double lr);
KILN_API kiln_optim_config kiln_adamw_config(double lr);

typedef struct kiln_optimizer kiln_optimizer;

/* An optimizer over n parameter tensors (the optimizer takes its own reference to each;
** the same tensor twice is an error). The config is checked like PyTorch does (lr >= 0,
** momentum >= 0, 0 <= beta < 1, eps >= 0, weight_decay >= 0, nesterov needs momentum
** > 0 and dampening 0): KILN_ERR_INVALID_ARGUMENT naming the value. */
KILN_API kiln_optimizer *kiln_optimizer_new(const kiln_optim_config *cfg,
                                            kiln_tensor *const *params, int n);
/* An optimizer over kiln_module_parameters(m), read again through m at every step (so
** kiln_module_to() may be called at any time; the state follows the parameters). m must
** outlive the optimizer, and its parameter list must keep its length. */
KILN_API kiln_optimizer *kiln_optimizer_new_module(const kiln_optim_config *cfg, kiln_module *m);
KILN_API void kiln_optimizer_free(kiln_optimizer *opt); /* NULL is a no-op */

/* Parameter groups, reduced to what differs between them in practice: a weight decay per
** parameter. wd[i] (>= 0, finite) replaces cfg.weight_decay for parameter i (the
** optimizer's order: kiln_module_parameters() for a module optimizer); n must be the
** optimizer's parameter count. wd NULL (with n 0) goes back to cfg.weight_decay for all.
** Each step updates the parameters of one decay together (one fused launch per group).
** The decays belong to the optimizer's construction, like its parameter list: its state
** dict does not carry them, and a load keeps them. KILN_ERR_INVALID_ARGUMENT naming the
** bad value or count. */
KILN_API kiln_status kiln_optimizer_set_weight_decays(kiln_optimizer *opt, const double *wd, int n);
/* Parameter i's weight decay (cfg.weight_decay unless set above); NAN out of range. */
KILN_API double kiln_optimizer_param_weight_decay(const kiln_optimizer *opt, int i);
/* nanoGPT's configure_optimizers split on a module optimizer: parameters with 2 or more
** dims (Linear and Embedding weights) decay by cfg->weight_decay, the others (biases,
** LayerNorm / RMSNorm weights) not at all. A tied weight is one parameter and decays
** once. Errors as kiln_optimizer_new_module. */
KILN_API kiln_optimizer *kiln_optimizer_new_module_decay_split(const kiln_optim_config *cfg,
                                                               kiln_module *m);

/* Clears every parameter's gradient (set_to_none=True: kiln_set_grad(p, NULL)). */
KILN_API kiln_status kiln_optimizer_zero_grad(kiln_optimizer *opt);
/* One update of every parameter that has a gradient. Errors leave the parameters already
** updated in this step updated (as PyTorch does); the message names the parameter. */
KILN_API kiln_status kiln_optimizer_step(kiln_optimizer *opt);
KILN_API kiln_status kiln_optimizer_set_lr(kiln_optimizer *opt, double lr);
KILN_API double kiln_optimizer_get_lr(const kiln_optimizer *opt); /* NAN for NULL */
KILN_API kiln_optim_config kiln_optimizer_config(const kiln_optimizer *opt);
KILN_API int kiln_optimizer_num_params(const kiln_optimizer *opt);
/* Borrowed parameter i (through the module for a module optimizer); NULL out of range. */
KILN_API kiln_tensor *kiln_optimizer_param(kiln_optimizer *opt, int i);
/* Number of kiln_optimizer_step() calls that did something. */
KILN_API int64_t kiln_optimizer_steps(const kiln_optimizer *opt);
/* Bytes held in state tensors (momentum buffers, moments). */
KILN_API int64_t kiln_optimizer_state_bytes(const kiln_optimizer *opt);

/* State for checkpoints: a new dict (caller frees). Tensors "state.<i>.<name>"
** (references to the live state, not copies; <i> is the parameter's index, <name>
** momentum_buffer / exp_avg / exp_avg_sq / max_exp_avg_sq) and metadata "kind", "lr",
** the hyperparameters, "num_params", "steps", "state.<i>.step" (decimal; doubles with
** %.17g so they round-trip exactly). */
KILN_API kiln_dict *kiln_optimizer_state_dict(const kiln_optimizer *opt);
/* Restores a state dict into an optimizer over the same parameter shapes: checks all
** (kind, parameter count, every state tensor's shape and dtype, no unknown entries) and
** changes nothing on failure; the message lists every problem. The hyperparameters
** (lr included) are restored too, as PyTorch does. State tensors are copied onto each
** parameter's device and dtype. KILN_ERR_INVALID_ARGUMENT / KILN_ERR_SHAPE /
** KILN_ERR_FORMAT (an unparsable number). */
KILN_API kiln_status kiln_optimizer_load_state_dict(kiln_optimizer *opt, const kiln_dict *d);

/* --------------------------------------------------------------------------------------
** Gradient clipping (torch.nn.utils.clip_grad_norm_ / clip_grad_value_). Parameters
** without a gradient are skipped.
*/
/* Scales all gradients by max_norm / (total + 1e-6) when that is below 1, where total is
** the norm_type norm (2.0 or INFINITY; any p >= 1 works) of all gradients together.
** Returns total (before clipping); NAN with the last error set on failure. Waits for the
** device (the norm is read back). */
KILN_API double kiln_clip_grad_norm(kiln_tensor *const *params, int n, double max_norm,
                                    double norm_type);
/* Clamps every gradient element into [-clip, clip]. */
KILN_API kiln_status kiln_clip_grad_value(kiln_tensor *const *params, int n, double clip);

/* --------------------------------------------------------------------------------------
** Learning-rate schedulers. A scheduler sets the optimizer's lr: at creation to the
** value for step 0 (PyTorch's constructor does the same), then at every
** kiln_scheduler_step() to the value for the next step t (t = 1, 2, ...). base_lr is the
** optimizer's lr when the scheduler is made. Closed forms, t >= 0:
**   StepLR         base * gamma^floor(t / step_size)
**   MultiStepLR    base * gamma^(number of milestones <= t)
**   ExponentialLR  base * gamma^t
**   LinearLR       base * (start + (end - start) * min(t, total) / total)
**   Cosine         with warmup W: t < W: base * (s + (1 - s) * t / W) (s the warmup start
**                  factor); after: eta_min + (base - eta_min) (1 + cos(pi u / T)) / 2,
**                  u = min(t - W, T), T = t_max - W. With W = 0 this is PyTorch's
**                  CosineAnnealingLR on [0, t_max]; past t_max it holds eta_min (PyTorch
**                  would rise again, which is rarely what anyone wants).
** The optimizer must outlive its scheduler. One scheduler per optimizer.
*/
typedef struct kiln_scheduler kiln_scheduler;

KILN_API kiln_scheduler *kiln_step_lr_new(kiln_optimizer *opt, int64_t step_size, double gamma);
/* milestones: n strictly increasing positive step numbers. */
KILN_API kiln_scheduler *kiln_multistep_lr_new(kiln_optimizer *opt, int n,
                                               const int64_t *milestones, double gamma);
KILN_API kiln_scheduler *kiln_exponential_lr_new(kiln_optimizer *opt, double gamma);
/* PyTorch's LinearLR; 0 < start_factor <= 1, 0 <= end_factor <= 1, total_iters >= 1
** (PyTorch: 1/3, 1, 5). */
KILN_API kiln_scheduler *kiln_linear_lr_new(kiln_optimizer *opt, double start_factor,
                                            double end_factor, int64_t total_iters);
/* Linear warmup from start_factor * base to base over warmup_steps, then constant. */
KILN_API kiln_scheduler *kiln_linear_warmup_new(kiln_optimizer *opt, int64_t warmup_steps,
                                                double start_factor);
/* Cosine annealing to eta_min at t_max, after warmup_steps (0: none) of linear warmup
** from warmup_start_factor * base. 0 <= warmup_steps < t_max. */
KILN_API kiln_scheduler *kiln_cosine_lr_new(kiln_optimizer *opt, int64_t t_max, double eta_min,
                                            int64_t warmup_steps, double warmup_start_factor);
KILN_API void kiln_scheduler_free(kiln_scheduler *s); /* NULL is a no-op */

/* Advances t by one and sets the optimizer's lr. */
KILN_API kiln_status kiln_scheduler_step(kiln_scheduler *s);
/* The lr for the current t (what the optimizer has). NAN for NULL. */
KILN_API double kiln_scheduler_get_lr(const kiln_scheduler *s);
/* The lr the schedule gives at step t (no state change). */
KILN_API double kiln_scheduler_lr_at(const kiln_scheduler *s, int64_t t);
KILN_API int64_t kiln_scheduler_last_epoch(const kiln_scheduler *s); /* t */
/* "StepLR", "MultiStepLR", "ExponentialLR", "LinearLR", "CosineLR". */
KILN_API const char *kiln_scheduler_name(const kiln_scheduler *s);

/* State: a dict with metadata only: "kind", "last_epoch", "base_lr" and the parameters.
** Loading checks the kind, restores all and sets the optimizer's lr for that t. */
KILN_API kiln_dict *kiln_scheduler_state_dict(const kiln_scheduler *s);
KILN_API kiln_status kiln_scheduler_load_state_dict(kiln_scheduler *s, const kiln_dict *d);

/* --------------------------------------------------------------------------------------
** Loss scaling for f16 training (torch.amp.GradScaler), with PyTorch's defaults:
**
**   kiln_grad_scaler *sc = kiln_grad_scaler_new(NULL);        // 2^16, x2 / 2000, x0.5
**   for (...) {
**     kiln_backward(kiln_grad_scaler_scale(sc, loss), NULL);
**     kiln_grad_scaler_unscale_(sc, opt);                     // optional: before clipping
**     kiln_clip_grad_norm(params, n, 1.0, ...);
**     kiln_grad_scaler_step(sc, opt);                         // skipped on inf/NaN
**     kiln_grad_scaler_update(sc);
**   }
**
** unscale_ divides every gradient of the optimizer by the scale and checks them for inf
** and NaN in one pass (kiln_amp_unscale_: one kernel launch for all); step unscales if
** that was not done, then steps unless a gradient was not finite (parameters and
** optimizer state are then left as they were); update halves the scale after such a
** step and multiplies it by growth_factor after growth_interval clean ones. Nothing of
** this reads the device on the host: the scale, the growth tracker and the found-inf flag
** are one-element tensors on the gradients' device, the optimizer's kernels skip the step
** there (its step count does not advance), and update runs on the device, so the loop
** never waits and a CUDA graph can capture it. get_scale, found_inf and the state dict
** read the device (a wait). */
typedef struct kiln_grad_scaler kiln_grad_scaler;
typedef struct kiln_grad_scaler_config {
  double init_scale;       /* 65536 */
  double growth_factor;    /* 2 */
  double backoff_factor;   /* 0.5 */
  int64_t growth_interval; /* 2000 */
  bool enabled;            /* false: scale 1, step is the optimizer's step */
} kiln_grad_scaler_config;
KILN_API kiln_grad_scaler_config kiln_grad_scaler_default_config(void);
/* cfg NULL: the defaults. NULL with KILN_ERR_INVALID_ARGUMENT for a scale that is not
** positive and finite, a growth interval <= 0, a growth factor <= 1 or a backoff factor
** outside (0, 1). */
KILN_API kiln_grad_scaler *kiln_grad_scaler_new(const kiln_grad_scaler_config *cfg);
KILN_API void kiln_grad_scaler_free(kiln_grad_scaler *s); /* NULL is a no-op */
/* loss * scale (a new tensor, recorded; f32 for an f16/bf16 loss, whose range 2^16 passes).
** NULL loss gives NULL without a new error; KILN_ERR_DTYPE for an integer loss. */
KILN_API kiln_tensor *kiln_grad_scaler_scale(kiln_grad_scaler *s, kiln_tensor *loss);
/* KILN_ERR_STATE when called twice for one optimizer before update. */
KILN_API kiln_status kiln_grad_scaler_unscale_(kiln_grad_scaler *s, kiln_optimizer *opt);
KILN_API kiln_status kiln_grad_scaler_step(kiln_grad_scaler *s, kiln_optimizer *opt);
KILN_API kiln_status kiln_grad_scaler_update(kiln_grad_scaler *s);
KILN_API double kiln_grad_scaler_get_scale(const kiln_grad_scaler *s);
/* Whether the last step was skipped (a gradient was inf or NaN). */
KILN_API bool kiln_grad_scaler_found_inf(const kiln_grad_scaler *s);
/* State for checkpoints: "scale" (f64) and "growth_tracker" (i64), the factors as
** metadata. load: KILN_ERR_FORMAT for missing or out-of-range entries. */
KILN_API kiln_dict *kiln_grad_scaler_state_dict(const kiln_grad_scaler *s);
KILN_API kiln_status kiln_grad_scaler_load_state_dict(kiln_grad_scaler *s, const kiln_dict *d);

#ifdef __cplusplus
}
#endif
#endif /* KILN_OPTIM_H */
