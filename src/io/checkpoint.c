/* Training checkpoints: one safetensors file holding model, optimizer, scheduler, RNG and
** progress (layout in include/kiln_checkpoint.h). Saving builds one dict of references
** (no copies on the host beyond what the safetensors writer makes) and writes it
** atomically. Loading reads the file, splits it by prefix, validates every part against
** the live objects, and only then applies them, so a wrong checkpoint changes nothing. */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "kiln_checkpoint.h"
#include "ext/kiln_ext.h"

#define CKPT_LAYOUT "1"

/* Copies every tensor and metadata entry of src into dst under prefix. */
static kiln_status add_prefixed(kiln_dict *dst, const kiln_dict *src, const char *prefix,
                                bool tensors, bool meta) {
  char key[1024];
  kiln_status st = KILN_OK;
  for (int i = 0; tensors && i < kiln_dict_size(src) && st == KILN_OK; i++) {
    snprintf(key, sizeof key, "%s%s", prefix, kiln_dict_key(src, i));
    st = kiln_dict_set(dst, key, kiln_dict_value(src, i));
  }
  for (int i = 0; meta && i < kiln_dict_meta_size(src) && st == KILN_OK; i++) {
    snprintf(key, sizeof key, "%s%s", prefix, kiln_dict_meta_key(src, i));
    st = kiln_dict_set_meta(dst, key, kiln_dict_meta_value(src, i));
  }
  return st;
}

/* The entries of src whose names start with prefix, the prefix removed (a new dict that
** shares the tensors). */
static kiln_dict *take_prefixed(const kiln_dict *src, const char *prefix) {
  kiln_dict *d = kiln_dict_new();
  if (!d) return NULL;
  size_t n = strlen(prefix);
  kiln_status st = KILN_OK;
  for (int i = 0; i < kiln_dict_size(src) && st == KILN_OK; i++)
    if (!strncmp(kiln_dict_key(src, i), prefix, n))
      st = kiln_dict_set(d, kiln_dict_key(src, i) + n, kiln_dict_value(src, i));
  for (int i = 0; i < kiln_dict_meta_size(src) && st == KILN_OK; i++)
    if (!strncmp(kiln_dict_meta_key(src, i), prefix, n))
      st = kiln_dict_set_meta(d, kiln_dict_meta_key(src, i) + n, kiln_dict_meta_value(src, i));
  if (st != KILN_OK) {
    kiln_dict_free(d);
    return NULL;
  }
  return d;
}

kiln_status kiln_checkpoint_save(const char *path, kiln_module *model, kiln_optimizer *opt,
                                 kiln_scheduler *sched, kiln_generator *gen, int64_t epoch,
                                 int64_t step, const kiln_dict *extra) {
  return kiln_checkpoint_save_amp(path, model, opt, sched, NULL, gen, epoch, step, extra);
}

kiln_status kiln_checkpoint_save_amp(const char *path, kiln_module *model, kiln_optimizer *opt,
                                     kiln_scheduler *sched, kiln_grad_scaler *scaler, kiln_generator *gen,
                                     int64_t epoch, int64_t step, const kiln_dict *extra) {
  static const char who[] = "kiln_checkpoint_save";
  if (!path || !model)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: NULL path or model", who);
  kiln_dict *d = kiln_dict_new();
  if (!d) return kiln_last_error();
  kiln_dict *md = kiln_module_state_dict(model);
  kiln_dict *od = opt ? kiln_optimizer_state_dict(opt) : NULL;
  kiln_dict *sd = sched ? kiln_scheduler_state_dict(sched) : NULL;
  kiln_dict *gd = scaler ? kiln_grad_scaler_state_dict(scaler) : NULL; /* reads the device */
  kiln_status st = KILN_OK;
  if (!md || (opt && !od) || (sched && !sd) || (scaler && !gd)) st = kiln_last_error();
  if (st == KILN_OK) st = kiln_dict_set_meta(d, "kiln.checkpoint", CKPT_LAYOUT);
  if (st == KILN_OK) st = kiln_dict_set_meta(d, "kiln.version", kiln_version());
  if (st == KILN_OK) st = kiln__meta_set_i64(d, "epoch", epoch);
  if (st == KILN_OK) st = kiln__meta_set_i64(d, "step", step);
  if (st == KILN_OK) {
    uint64_t seed, offset;
    kiln_generator_get_state(gen ? gen : kiln_generator_global(), &seed, &offset);
    char buf[32];
    snprintf(buf, sizeof buf, "%" PRIu64, seed);
    st = kiln_dict_set_meta(d, "rng.seed", buf);
    snprintf(buf, sizeof buf, "%" PRIu64, offset);
    if (st == KILN_OK) st = kiln_dict_set_meta(d, "rng.offset", buf);
  }
  if (st == KILN_OK) st = add_prefixed(d, md, "model.", true, false);
  if (st == KILN_OK && od) st = kiln_dict_set_meta(d, "has_optim", "1");
  if (st == KILN_OK && od) st = add_prefixed(d, od, "optim.", true, true);
  if (st == KILN_OK && sd) st = kiln_dict_set_meta(d, "has_sched", "1");
  if (st == KILN_OK && sd) st = add_prefixed(d, sd, "sched.", false, true);
  if (st == KILN_OK && gd) st = kiln_dict_set_meta(d, "has_scaler", "1");
  if (st == KILN_OK && gd) st = add_prefixed(d, gd, "scaler.", true, true);
  if (st == KILN_OK && extra) st = add_prefixed(d, extra, "extra.", true, true);
  if (st == KILN_OK) st = kiln_safetensors_save(path, d);
  kiln_dict_free(md);
  kiln_dict_free(od);
  kiln_dict_free(sd);
  kiln_dict_free(gd);
  kiln_dict_free(d);
  return st;
}

static kiln_status parse_u64(const kiln_dict *d, const char *key, uint64_t *out, const char *path) {
  const char *s = kiln_dict_get_meta(d, key);
  char *end = NULL;
  if (!s || !*s || *s == '-' || (*out = strtoull(s, &end, 10), *end != '\0'))
    return kiln_set_error(KILN_ERR_FORMAT, "kiln_checkpoint_load: %s: metadata \"%s\" is %s%s%s", path,
                          key, s ? "\"" : "missing", s ? s : "", s ? "\", not an unsigned integer" : "");
  return KILN_OK;
}

kiln_status kiln_checkpoint_load(const char *path, kiln_module *model, kiln_optimizer *opt,
                                 kiln_scheduler *sched, kiln_generator *gen, int64_t *epoch,
                                 int64_t *step, kiln_dict **extra) {
  return kiln_checkpoint_load_amp(path, model, opt, sched, NULL, gen, epoch, step, extra);
}

kiln_status kiln_checkpoint_load_amp(const char *path, kiln_module *model, kiln_optimizer *opt,
                                     kiln_scheduler *sched, kiln_grad_scaler *scaler, kiln_generator *gen,
                                     int64_t *epoch, int64_t *step, kiln_dict **extra) {
  static const char who[] = "kiln_checkpoint_load";
  if (extra) *extra = NULL;
  if (!path || !model)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: NULL path or model", who);
  kiln_dict *d = kiln_safetensors_load(path, kiln_device_cpu());
  if (!d) return kiln_last_error();
  kiln_dict *md = NULL, *od = NULL, *sd = NULL, *xd = NULL, *gd = NULL;
  kiln_status st = KILN_OK;
  int64_t ep = 0, sp = 0;
  uint64_t seed = 0, offset = 0;
  const char *layout = kiln_dict_get_meta(d, "kiln.checkpoint");
  if (!layout) {
    st = kiln_set_error(KILN_ERR_FORMAT,
                        "%s: %s: not a kiln checkpoint (no \"kiln.checkpoint\" metadata; a plain "
                        "safetensors file loads with kiln_safetensors_load)", who, path);
    goto done;
  }
  if (strcmp(layout, CKPT_LAYOUT)) {
    st = kiln_set_error(KILN_ERR_FORMAT, "%s: %s: checkpoint layout \"%s\", this kiln reads \"%s\"",
                        who, path, layout, CKPT_LAYOUT);
    goto done;
  }
  char whobuf[1100];
  snprintf(whobuf, sizeof whobuf, "%s: %s", who, path);
  if ((st = kiln__meta_i64(d, "epoch", &ep, whobuf)) != KILN_OK ||
      (st = kiln__meta_i64(d, "step", &sp, whobuf)) != KILN_OK)
    goto done;
  if (ep < 0 || sp < 0) {
    st = kiln_set_error(KILN_ERR_FORMAT, "%s: %s: metadata \"%s\" is %lld; it must be 0 or more",
                        who, path, ep < 0 ? "epoch" : "step", (long long)(ep < 0 ? ep : sp));
    goto done;
  }
  if ((st = parse_u64(d, "rng.seed", &seed, path)) != KILN_OK ||
      (st = parse_u64(d, "rng.offset", &offset, path)) != KILN_OK)
    goto done;
  /* The writer sets these to "1" or leaves them out; anything else is a damaged file. */
  static const char *const flags[] = {"has_optim", "has_sched", "has_scaler"};
  for (int i = 0; i < 3; i++) {
    const char *v = kiln_dict_get_meta(d, flags[i]);
    if (v && strcmp(v, "1")) {
      st = kiln_set_error(KILN_ERR_FORMAT, "%s: %s: metadata \"%s\" is \"%s\" (a kiln checkpoint has "
                          "\"1\" or no such entry)", who, path, flags[i], v);
      goto done;
    }
  }
  if (opt && !kiln_dict_get_meta(d, "has_optim")) {
    st = kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: %s has no optimizer state (saved without one)",
                        who, path);
    goto done;
  }
  if (sched && !kiln_dict_get_meta(d, "has_sched")) {
    st = kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: %s has no scheduler state (saved without one)",
                        who, path);
    goto done;
  }
  if (scaler && !kiln_dict_get_meta(d, "has_scaler")) {
    st = kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: %s has no grad scaler state (saved without one)",
                        who, path);
    goto done;
  }
  md = take_prefixed(d, "model.");
  od = opt ? take_prefixed(d, "optim.") : NULL;
  sd = sched ? take_prefixed(d, "sched.") : NULL;
  xd = extra ? take_prefixed(d, "extra.") : NULL;
  gd = scaler ? take_prefixed(d, "scaler.") : NULL;
  if (!md || (opt && !od) || (sched && !sd) || (extra && !xd) || (scaler && !gd)) {
    st = kiln_last_error();
    goto done;
  }
  /* Check all parts, then apply all. */
  snprintf(whobuf, sizeof whobuf, "%s: %s: model", who, path);
  st = kiln__module_load_state_dict(model, md, true, false, whobuf);
  if (st == KILN_OK && opt) {
    snprintf(whobuf, sizeof whobuf, "%s: %s: optimizer", who, path);
    st = kiln__optimizer_load_state_dict(opt, od, false, whobuf);
  }
  if (st == KILN_OK && sched) {
    snprintf(whobuf, sizeof whobuf, "%s: %s: scheduler", who, path);
    st = kiln__scheduler_load_state_dict(sched, sd, false, whobuf);
  }
  if (st == KILN_OK && scaler) {
    snprintf(whobuf, sizeof whobuf, "%s: %s: grad scaler", who, path);
    st = kiln__grad_scaler_load_state_dict(scaler, gd, false, whobuf);
  }
  if (st != KILN_OK) goto done;
  snprintf(whobuf, sizeof whobuf, "%s: %s: model", who, path);
  st = kiln__module_load_state_dict(model, md, true, true, whobuf);
  if (st == KILN_OK && opt) st = kiln__optimizer_load_state_dict(opt, od, true, whobuf);
  /* The scheduler last: it sets the optimizer's lr for its step. */
  if (st == KILN_OK && sched) st = kiln__scheduler_load_state_dict(sched, sd, true, whobuf);
  if (st == KILN_OK && scaler) st = kiln__grad_scaler_load_state_dict(scaler, gd, true, whobuf);
  if (st != KILN_OK) goto done; /* only OOM can get here after the checks */
  kiln_generator_set_state(gen ? gen : kiln_generator_global(), seed, offset);
  if (epoch) *epoch = ep;
  if (step) *step = sp;
  if (extra) {
    *extra = xd;
    xd = NULL;
  }
done:
  kiln_dict_free(md);
  kiln_dict_free(od);
  kiln_dict_free(sd);
  kiln_dict_free(xd);
  kiln_dict_free(gd);
  kiln_dict_free(d);
  return st;
}
