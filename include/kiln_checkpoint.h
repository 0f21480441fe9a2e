/*
** kiln_checkpoint — one-file training checkpoints (model, optimizer, scheduler, RNG,
** epoch/step, user metadata) in the safetensors format, built on kiln_io, kiln_nn and
** kiln_optim.
**
** File layout (a plain safetensors file any reader can open):
**   tensors   "model.<name>"   the model's state dict (kiln_module_state_dict)
**             "optim.<name>"   the optimizer's state tensors ("optim.state.3.exp_avg")
**             "extra.<name>"   the caller's extra tensors
**             "scaler.scale", "scaler.growth_tracker"  the loss scaler's state (_amp forms)
**   metadata  "kiln.checkpoint" = "1" (the layout version), "kiln.version",
**             "epoch", "step", "rng.seed", "rng.offset",
**             "optim.<key>"    the optimizer's metadata (lr, hyperparameters, step counts)
**             "sched.<key>"    the scheduler's (kind, last_epoch, base_lr, ...)
**             "extra.<key>"    the caller's extra metadata
**             "has_optim", "has_sched", "has_scaler" = "1" for the parts saved
**             "scaler.<key>"   the scaler's factors and interval (informational)
** The file is written atomically (kiln_safetensors_save: a temporary file, fsync, rename),
** so a crash while saving leaves the previous checkpoint intact.
**
**   kiln_checkpoint_save("run.ckpt", net, opt, sched, NULL, epoch, step, NULL);
**   ...
**   int64_t epoch, step;
**   if (kiln_checkpoint_load("run.ckpt", net, opt, sched, NULL, &epoch, &step, NULL) != KILN_OK)
**     fprintf(stderr, "%s\n", kiln_last_error_message());
*/
#ifndef KILN_CHECKPOINT_H
#define KILN_CHECKPOINT_H

#include "kiln.h"
#include "kiln_io.h"
#include "kiln_nn.h"
#include "kiln_optim.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Writes a checkpoint. model is required; opt and sched may be NULL (not saved); gen NULL
** saves the global generator's state. extra (may be NULL) adds the caller's tensors and
** metadata under "extra.". KILN_ERR_INVALID_ARGUMENT, KILN_ERR_IO, KILN_ERR_OOM. */
KILN_API kiln_status kiln_checkpoint_save(const char *path, kiln_module *model,
                                          kiln_optimizer *opt, kiln_scheduler *sched,
                                          kiln_generator *gen, int64_t epoch, int64_t step,
                                          const kiln_dict *extra);
/* Restores a checkpoint into existing objects built the same way as the saved ones:
** model (required, strict: every key must match), opt and sched (NULL: not restored, even
** if the file has them; non-NULL: the file must have them), the RNG state into gen (NULL:
** the global generator). epoch, step (may be NULL) get the saved values; *extra (may be
** NULL) gets a new dict with the extra entries (prefix removed), which the caller frees.
** Everything is checked before anything changes: a checkpoint of another model fails with
** a message naming the missing, unexpected and mismatched keys and leaves all objects as
** they were. KILN_ERR_IO / KILN_ERR_FORMAT (the file), KILN_ERR_INVALID_ARGUMENT /
** KILN_ERR_SHAPE / KILN_ERR_DTYPE (the objects do not match it). */
KILN_API kiln_status kiln_checkpoint_load(const char *path, kiln_module *model,
                                          kiln_optimizer *opt, kiln_scheduler *sched,
                                          kiln_generator *gen, int64_t *epoch, int64_t *step,
                                          kiln_dict **extra);

/* kiln_checkpoint_save with the loss scaler's state (kiln_grad_scaler_state_dict: scale and
** growth tracker) as well; scaler NULL: not saved (kiln_checkpoint_save is this with NULL).
** Reads the scaler's device tensors (a wait). Errors as kiln_checkpoint_save. */
KILN_API kiln_status kiln_checkpoint_save_amp(const char *path, kiln_module *model,
                                              kiln_optimizer *opt, kiln_scheduler *sched,
                                              kiln_grad_scaler *scaler, kiln_generator *gen,
                                              int64_t epoch, int64_t step, const kiln_dict *extra);
/* kiln_checkpoint_load restoring the scaler too: scaler NULL: not restored; non-NULL: the
** file must have it (KILN_ERR_INVALID_ARGUMENT otherwise) and a damaged entry (missing,
** a scale that is not positive and finite, a negative or fractional tracker) is
** KILN_ERR_FORMAT; like every part it is checked before anything changes. */
KILN_API kiln_status kiln_checkpoint_load_amp(const char *path, kiln_module *model,
                                              kiln_optimizer *opt, kiln_scheduler *sched,
                                              kiln_grad_scaler *scaler, kiln_generator *gen,
                                              int64_t *epoch, int64_t *step, kiln_dict **extra);

#ifdef __cplusplus
}
#endif
#endif /* KILN_CHECKPOINT_H */
