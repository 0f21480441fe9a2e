/*
** Loss scaling: PyTorch's defaults, unscale to the true gradients, a step skipped on an
** inf/NaN gradient with the parameters and optimizer untouched, backoff and growth, the
** list unscale over mixed dtypes (the flag is never cleared by it), the state round
** trip, and the bad configurations.
** The device-side skip (issue 14): an inf step leaves parameters, optimizer state and
** step counts bit-identical for every update path (fused Adam, composed Adam, SGD with
** momentum), a skipped first step is as if it never happened, clean scaled steps give the
** unscaled optimizer's bits, unscale_/step/update read nothing on the host (counted on a
** spy copy of the CPU backend whose copy_to_host counts), and the scale follows
** PyTorch's GradScaler over a scripted sequence of inf and clean steps.
*/
#include "check.h"

#include <kiln_optim.h>
#include <kiln_io.h>

#include "backend/backend.h"
#include "backend_testdev.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

static const kiln_device CPU = {KILN_DEVICE_CPU, 0};

static kiln_tensor *leaf(double v) {
  kiln_tensor *p = kiln_keep(kiln_full(KILN_SHAPE(3), v, KILN_F32, CPU));
  kiln_requires_grad_(p, true);
  return p;
}

static void test_defaults_and_bad_config(void) {
  kiln_grad_scaler_config c = kiln_grad_scaler_default_config();
  CHECK(c.init_scale == 65536.0 && c.growth_factor == 2.0 && c.backoff_factor == 0.5 && c.growth_interval == 2000);
  kiln_grad_scaler *s = kiln_grad_scaler_new(NULL);
  CHECK(s && kiln_grad_scaler_get_scale(s) == 65536.0);
  kiln_grad_scaler_free(s);
  c.init_scale = 0;
  CHECK(kiln_grad_scaler_new(&c) == NULL && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT);
  c.init_scale = -2;
  CHECK(kiln_grad_scaler_new(&c) == NULL);
  c = kiln_grad_scaler_default_config();
  c.growth_interval = 0;
  CHECK(kiln_grad_scaler_new(&c) == NULL && strstr(kiln_last_error_message(), "growth_interval") != NULL);
  kiln_grad_scaler_free(NULL);
  kiln_clear_error();
}

/* d(scale * sum(p * x))/dp unscaled is x; a clean step moves p, a bad one does not. */
static void test_unscale_step_skip_update(void) {
  kiln_tensor *p = leaf(1.0);
  kiln_optim_config oc = kiln_adam_config(0.1);
  kiln_optimizer *opt = kiln_optimizer_new(&oc, &p, 1);
  kiln_grad_scaler_config c = kiln_grad_scaler_default_config();
  c.growth_interval = 2;
  kiln_grad_scaler *s = kiln_grad_scaler_new(&c);
  for (int it = 0; it < 4; it++) {
    kiln_scope_begin();
    kiln_optimizer_zero_grad(opt);
    double xv = it == 2 ? INFINITY : 3.0;
    kiln_tensor *x = kiln_full(KILN_SHAPE(3), xv, KILN_F32, CPU);
    kiln_tensor *loss = kiln_sum_all(kiln_mul(p, x));
    double scale = kiln_grad_scaler_get_scale(s);
    CHECK(kiln_backward(kiln_grad_scaler_scale(s, loss), NULL) == KILN_OK);
    CHECK(kiln_grad_scaler_unscale_(s, opt) == KILN_OK);
    CHECK(kiln_grad_scaler_unscale_(s, opt) == KILN_ERR_STATE);
    if (it != 2) CHECK(kiln_item(kiln_sum_all(kiln_grad(p))) == 9.0);
    double before = kiln_item(kiln_sum_all(p));
    int64_t steps = kiln_optimizer_steps(opt);
    CHECK(kiln_grad_scaler_step(s, opt) == KILN_OK);
    double after = kiln_item(kiln_sum_all(p));
    if (it == 2) {
      CHECK(kiln_grad_scaler_found_inf(s) && after == before && kiln_optimizer_steps(opt) == steps);
    } else {
      CHECK(!kiln_grad_scaler_found_inf(s) && after < before);
    }
    CHECK(kiln_grad_scaler_update(s) == KILN_OK);
    double want = it == 1 ? scale * 2 : it == 2 ? scale * 0.5 : scale;
    CHECK(kiln_grad_scaler_get_scale(s) == want);
    kiln_scope_end();
  }
  CHECK(kiln_grad_scaler_update(s) == KILN_ERR_STATE);
  kiln_clear_error();
  kiln_grad_scaler_free(s);
  kiln_optimizer_free(opt);
  kiln_tensor_free(p);
}

static void test_list_unscale_mixed_dtypes(void) {
  kiln_scope_begin();
  kiln_tensor *a = kiln_full(KILN_SHAPE(4), 8.0, KILN_F32, CPU);
  kiln_tensor *b = kiln_full(KILN_SHAPE(2, 2), 8.0, KILN_BF16, CPU);
  kiln_tensor *c = kiln_full(KILN_SHAPE(3), 8.0, KILN_F64, CPU);
  kiln_tensor *fi = kiln_zeros(KILN_SHAPE0, KILN_F32, CPU);
  kiln_tensor *gs[4] = {a, NULL, b, c};
  CHECK(kiln_amp_unscale_(4, gs, fi, 0.25) == KILN_OK);
  CHECK(kiln_item(kiln_sum_all(a)) == 8.0 && kiln_item(kiln_sum_all(b)) == 8.0 && kiln_item(kiln_sum_all(c)) == 6.0);
  CHECK(kiln_item(fi) == 0.0);
  kiln_fill_(c, NAN);
  CHECK(kiln_amp_unscale_(4, gs, fi, 1.0) == KILN_OK && kiln_item(fi) == 1.0);
  kiln_fill_(c, 1.0);
  CHECK(kiln_amp_unscale_(4, gs, fi, 1.0) == KILN_OK && kiln_item(fi) == 1.0); /* never cleared */
  kiln_tensor *bad = kiln_zeros(KILN_SHAPE(2), KILN_F64, CPU);
  CHECK(kiln_amp_unscale_(1, gs, bad, 1.0) == KILN_ERR_INVALID_ARGUMENT);
  kiln_tensor *ints = kiln_zeros(KILN_SHAPE(2), KILN_I32, CPU);
  CHECK(kiln_amp_unscale_(1, &ints, fi, 1.0) == KILN_ERR_DTYPE);
  kiln_clear_error();
  kiln_scope_end();
}

static void test_state_round_trip(void) {
  kiln_grad_scaler *s = kiln_grad_scaler_new(NULL), *t = kiln_grad_scaler_new(NULL);
  kiln_tensor *p = leaf(1.0);
  kiln_optim_config oc = kiln_sgd_config(0.1);
  kiln_optimizer *opt = kiln_optimizer_new(&oc, &p, 1);
  kiln_scope_begin();
  CHECK(kiln_backward(kiln_grad_scaler_scale(s, kiln_sum_all(kiln_mul_scalar(p, INFINITY))), NULL) == KILN_OK);
  CHECK(kiln_grad_scaler_step(s, opt) == KILN_OK && kiln_grad_scaler_update(s) == KILN_OK);
  kiln_scope_end();
  CHECK(kiln_grad_scaler_get_scale(s) == 32768.0);
  kiln_dict *d = kiln_grad_scaler_state_dict(s);
  CHECK(d && kiln_grad_scaler_load_state_dict(t, d) == KILN_OK);
  CHECK(kiln_grad_scaler_get_scale(t) == 32768.0);
  kiln_dict_free(d);
  kiln_dict *e = kiln_dict_new();
  CHECK(kiln_grad_scaler_load_state_dict(t, e) == KILN_ERR_FORMAT);
  kiln_dict_free(e);
  kiln_clear_error();
  kiln_optimizer_free(opt);
  kiln_tensor_free(p);
  kiln_grad_scaler_free(s);
  kiln_grad_scaler_free(t);
}


/* ---- the device-side skip ---- */

/* Everything an optimizer holds, as bytes: the parameters, then its state dict's tensors
** and metadata (steps, per-parameter step counts). Two equal blobs: bit-identical. */
typedef struct blob {
  unsigned char *b;
  size_t n;
} blob;
static void blob_add(blob *o, const void *p, size_t n) {
  o->b = realloc(o->b, o->n + n + 1);
  memcpy(o->b + o->n, p, n);
  o->n += n;
}
static void blob_tensor(blob *o, kiln_tensor *t) {
  size_t n = kiln_nbytes(t);
  unsigned char *tmp = malloc(n + 1);
  CHECK(kiln_to_host(t, tmp, n) == KILN_OK);
  blob_add(o, tmp, n);
  free(tmp);
}
static blob snapshot(kiln_optimizer *opt) {
  blob o = {NULL, 0};
  for (int i = 0; i < kiln_optimizer_num_params(opt); i++) blob_tensor(&o, kiln_optimizer_param(opt, i));
  kiln_dict *d = kiln_optimizer_state_dict(opt);
  CHECK(d != NULL);
  if (!d) return o;
  for (int i = 0; i < kiln_dict_size(d); i++) {
    const char *k = kiln_dict_key(d, i);
    blob_add(&o, k, strlen(k) + 1);
    blob_tensor(&o, kiln_dict_value(d, i));
  }
  for (int i = 0; i < kiln_dict_meta_size(d); i++) {
    const char *k = kiln_dict_meta_key(d, i), *v = kiln_dict_meta_value(d, i);
    blob_add(&o, k, strlen(k) + 1);
    blob_add(&o, v, strlen(v) + 1);
  }
  kiln_dict_free(d);
  return o;
}
static bool blob_eq(blob a, blob b) { return a.n == b.n && memcmp(a.b, b.b, a.n) == 0; }

/* Two parameters (5 and 3x4 elements) on dev with fixed values. */
static void make_params(kiln_tensor **ps, kiln_device dev) {
  kiln_scope_begin();
  ps[0] = kiln_keep(kiln_to_device(kiln_arange(0, 5, 1, KILN_F32, CPU), dev));
  kiln_tensor *w = kiln_mul_scalar(kiln_arange(-6, 6, 1, KILN_F32, CPU), 0.25);
  ps[1] = kiln_keep(kiln_contiguous(kiln_to_device(kiln_view(w, 2, (const int64_t[]){3, 4}), dev)));
  kiln_scope_end();
  kiln_requires_grad_(ps[0], true);
  kiln_requires_grad_(ps[1], true);
}

/* One scaled iteration: loss = sum(p0 * x0) + sum(p1 * p1 * x1), x0 inf when bad. With
** scaler NULL, the plain optimizer step on the same gradients (no scaling). */
static void iteration(kiln_grad_scaler *sc, kiln_optimizer *opt, kiln_tensor **ps, int it, bool bad) {
  kiln_scope_begin();
  kiln_device dev = kiln_device_of(ps[0]);
  kiln_optimizer_zero_grad(opt);
  kiln_tensor *x0 = kiln_full(KILN_SHAPE(5), bad ? INFINITY : 0.5 + 0.125 * it, KILN_F32, dev);
  kiln_tensor *x1 = kiln_full(KILN_SHAPE(3, 4), 0.75 - 0.0625 * it, KILN_F32, dev);
  kiln_tensor *loss = kiln_add(kiln_sum_all(kiln_mul(ps[0], x0)), kiln_sum_all(kiln_mul(kiln_mul(ps[1], ps[1]), x1)));
  if (sc) {
    CHECK(kiln_backward(kiln_grad_scaler_scale(sc, loss), NULL) == KILN_OK);
    CHECK(kiln_grad_scaler_step(sc, opt) == KILN_OK);
    CHECK(kiln_grad_scaler_update(sc) == KILN_OK);
  } else {
    CHECK(kiln_backward(loss, NULL) == KILN_OK);
    CHECK(kiln_optimizer_step(opt) == KILN_OK);
  }
  kiln_scope_end();
}

static kiln_optim_config path_config(int path) {
  kiln_optim_config c;
  switch (path) {
  case 0: c = kiln_adam_config(0.01); break; /* fused (ADAM_MULTI) */
  case 1: c = kiln_adamw_config(0.01); c.amsgrad = true; break;
  case 2: c = kiln_adam_config(0.01); c.maximize = true; break; /* composed */
  case 3: c = kiln_sgd_config(0.05); c.momentum = 0.9; c.dampening = 0.25; c.weight_decay = 0.01; break;
  default: c = kiln_sgd_config(0.05); c.momentum = 0.9; c.nesterov = true; break;
  }
  return c;
}
static const char *const path_name[5] = {"adam", "adamw-amsgrad", "adam-maximize", "sgd-dampening", "sgd-nesterov"};

/* One update path twice, for a run through a scaler against a reference run: the same
** parameters (make_params) in ps and qs, opt over ps with a fresh scaler sc, ref over qs. */
typedef struct twin {
  kiln_tensor *ps[2], *qs[2];
  kiln_optimizer *opt, *ref;
  kiln_grad_scaler *sc;
} twin;

static void twin_new(twin *t, int path) {
  kiln_optim_config oc = path_config(path);
  make_params(t->ps, CPU);
  make_params(t->qs, CPU);
  t->opt = kiln_optimizer_new(&oc, t->ps, 2);
  t->ref = kiln_optimizer_new(&oc, t->qs, 2);
  t->sc = kiln_grad_scaler_new(NULL);
}

static void twin_free(twin *t) {
  kiln_grad_scaler_free(t->sc);
  kiln_optimizer_free(t->opt);
  kiln_optimizer_free(t->ref);
  for (int i = 0; i < 2; i++) kiln_tensor_free(t->ps[i]), kiln_tensor_free(t->qs[i]);
}

/* For every update path: (a) an inf step after two clean ones leaves everything the
** optimizer holds bit-identical; (b) a run whose first step is skipped ends bit-identical
** to one that never had that step; (c) the step count does not count skipped steps. */
static void test_skip_is_bit_identical(void) {
  for (int path = 0; path < 5; path++) {
    twin t;
    twin_new(&t, path);
    kiln_tensor **ps = t.ps, **qs = t.qs;
    kiln_optimizer *opt = t.opt, *ref = t.ref;
    kiln_grad_scaler *sc = t.sc;
    /* (b) a skipped first step, then clean steps; ref never sees the bad step */
    iteration(sc, opt, ps, 0, true);
    CHECK(kiln_grad_scaler_found_inf(sc));
    CHECK(kiln_optimizer_steps(opt) == 0);
    for (int it = 1; it <= 2; it++) {
      iteration(sc, opt, ps, it, false);
      iteration(NULL, ref, qs, it, false);
    }
    blob a = snapshot(opt), r = snapshot(ref);
    if (!blob_eq(a, r) && path != 2) { /* composed Adam's device corrections: checked below */
      fprintf(stderr, "path %s: skipped first step differs from never taking it\n", path_name[path]);
      CHECK(false);
    }
    CHECK(kiln_optimizer_steps(opt) == 2);
    /* (a) an inf step now: nothing moves */
    blob before = snapshot(opt);
    iteration(sc, opt, ps, 3, true);
    blob after = snapshot(opt);
    if (!blob_eq(before, after)) {
      fprintf(stderr, "path %s: the skipped step changed the optimizer\n", path_name[path]);
      CHECK(false);
    }
    CHECK(kiln_optimizer_steps(opt) == 2);
    /* one more clean step on both: still together, the step counts 3 */
    iteration(sc, opt, ps, 4, false);
    iteration(NULL, ref, qs, 4, false);
    CHECK(kiln_optimizer_steps(opt) == 3);
    if (path == 2) { /* f64 pow on the device vs the host's: equal to f32 rounding */
      kiln_scope_begin();
      for (int i = 0; i < 2; i++)
        CHECK(kiln_item(kiln_amax(kiln_abs(kiln_sub(ps[i], qs[i])), 0, NULL, false)) < 1e-6);
      kiln_scope_end();
    } else {
      blob x = snapshot(opt), y = snapshot(ref);
      CHECK(blob_eq(x, y));
      free(x.b), free(y.b);
    }
    free(a.b), free(r.b), free(before.b), free(after.b);
    twin_free(&t);
  }
  kiln_clear_error();
}

/* A skipped scaled first step, then plain (unscaled) steps: as if the skipped step never
** happened. The skipped step made a zero momentum buffer; SGD's first-step rule (the
** buffer is the gradient) must come from the device step count, not from whether the
** buffer exists (dampening 0.25 would scale the first buffer by 0.75). */
static void test_plain_after_skipped_first(void) {
  for (int path = 0; path < 5; path++) {
    twin t;
    twin_new(&t, path);
    iteration(t.sc, t.opt, t.ps, 0, true);
    for (int it = 1; it <= 3; it++) {
      iteration(NULL, t.opt, t.ps, it, false);
      iteration(NULL, t.ref, t.qs, it, false);
    }
    CHECK(kiln_optimizer_steps(t.opt) == 3);
    kiln_scope_begin();
    for (int i = 0; i < 2; i++) {
      /* composed Adam: f64 pow on the device against the host's, equal to f32 rounding */
      double d = kiln_item(kiln_amax(kiln_abs(kiln_sub(t.ps[i], t.qs[i])), 0, NULL, false));
      if (!(path == 2 ? d < 1e-6 : d == 0))
        fprintf(stderr, "path %s: plain steps after a skipped first step: param %d off by %g\n", path_name[path], i, d);
      CHECK(path == 2 ? d < 1e-6 : d == 0);
    }
    kiln_scope_end();
    twin_free(&t);
  }
  kiln_clear_error();
}

/* A spy of the CPU backend: the same kernels and memory, its own device type, and a
** copy_to_host that counts. Every host read of a tensor on it (kiln_item, kiln_to_host)
** goes through copy_to_host; kernels run natively (host-visible memory, no staging). */
static long spy_reads;
static kiln_status (*cpu_copy_to_host)(int, void *, const void *, size_t);
static kiln_status spy_copy_to_host(int device, void *dst, const void *src, size_t n) {
  spy_reads++;
  return cpu_copy_to_host(device, dst, src, n);
}
static kiln__backend spy_backend;
static kiln_device spy_device(void) {
  static kiln_device d = {KILN_DEVICE_CPU, 0};
  static bool done;
  if (!done) {
    spy_backend = *kiln__backend_get(KILN_DEVICE_CPU);
    cpu_copy_to_host = spy_backend.copy_to_host;
    spy_backend.name = "cpuspy";
    spy_backend.type = KILN__DEVICE_TYPE_ANY;
    spy_backend.copy_to_host = spy_copy_to_host;
    spy_backend.graph = NULL;
    spy_backend.async = NULL;
    spy_backend.best_rank = 0;
    d.type = kiln__backend_register(&spy_backend);
    done = true;
  }
  return d;
}

/* unscale_, step and update read nothing on the host, clean or not, for Adam and SGD:
** the spy counts no copy_to_host between the backward and the end of update; a query
** (get_scale) does count, so the counter is live. */
static void test_no_host_read(void) {
  kiln_device spy = spy_device();
  CHECK((int)spy.type >= 0);
  if ((int)spy.type < 0) return;
  for (int path = 0; path < 5; path++) {
    kiln_optim_config oc = path_config(path);
    kiln_tensor *ps[2];
    make_params(ps, spy);
    kiln_optimizer *opt = kiln_optimizer_new(&oc, ps, 2);
    kiln_grad_scaler_config c = kiln_grad_scaler_default_config();
    c.growth_interval = 2;
    kiln_grad_scaler *sc = kiln_grad_scaler_new(&c);
    for (int it = 0; it < 4; it++) {
      kiln_scope_begin();
      kiln_optimizer_zero_grad(opt);
      kiln_tensor *x0 = kiln_full(KILN_SHAPE(5), it == 2 ? INFINITY : 0.5, KILN_F32, spy);
      kiln_tensor *loss = kiln_sum_all(kiln_mul(kiln_mul(ps[0], ps[0]), x0));
      CHECK(kiln_backward(kiln_grad_scaler_scale(sc, loss), NULL) == KILN_OK);
      long r0 = spy_reads;
      CHECK(kiln_grad_scaler_unscale_(sc, opt) == KILN_OK);
      CHECK(kiln_grad_scaler_step(sc, opt) == KILN_OK);
      CHECK(kiln_grad_scaler_update(sc) == KILN_OK);
      if (spy_reads != r0) {
        fprintf(stderr, "path %s, iteration %d: %ld host reads in unscale_/step/update\n", path_name[path], it,
                spy_reads - r0);
        CHECK(false);
      }
      kiln_scope_end();
    }
    long r1 = spy_reads;
    /* clean, clean (x2), inf (x0.5), clean: 65536 */
    CHECK(kiln_grad_scaler_get_scale(sc) == 65536.0);
    CHECK(spy_reads > r1);
    CHECK(kiln_optimizer_steps(opt) == 3);
    kiln_grad_scaler_free(sc);
    kiln_optimizer_free(opt);
    kiln_tensor_free(ps[0]), kiln_tensor_free(ps[1]);
  }
  kiln_clear_error();
}

/* PyTorch's GradScaler (torch/amp/grad_scaler.py, _amp_update_scale_) over a script of
** clean (.) and inf (x) steps, growth_interval 3: the scale after each update, written
** out by hand from its rule (x: scale * 0.5, tracker 0; .: tracker + 1, at 3: scale * 2,
** tracker 0). */
static void test_scale_sequence_matches_pytorch(void) {
  const char *script = "...x..xx......x...";
  const double want[] = {65536, 65536, 131072, 65536, 65536, 65536, 32768, 16384, 16384,
                         16384, 32768, 32768,  32768, 65536, 32768, 32768, 32768, 65536};
  const double want_tracker[] = {1, 2, 0, 0, 1, 2, 0, 0, 1, 2, 0, 1, 2, 0, 0, 1, 2, 0};
  kiln_grad_scaler_config c = kiln_grad_scaler_default_config();
  c.growth_interval = 3;
  kiln_grad_scaler *sc = kiln_grad_scaler_new(&c);
  kiln_tensor *p = leaf(1.0);
  kiln_optim_config oc = kiln_sgd_config(0.01);
  kiln_optimizer *opt = kiln_optimizer_new(&oc, &p, 1);
  int clean = 0;
  for (int i = 0; script[i]; i++) {
    kiln_scope_begin();
    kiln_optimizer_zero_grad(opt);
    kiln_tensor *x = kiln_full(KILN_SHAPE(3), script[i] == 'x' ? NAN : 1.0, KILN_F32, CPU);
    CHECK(kiln_backward(kiln_grad_scaler_scale(sc, kiln_sum_all(kiln_mul(p, x))), NULL) == KILN_OK);
    CHECK(kiln_grad_scaler_step(sc, opt) == KILN_OK);
    CHECK(kiln_grad_scaler_update(sc) == KILN_OK);
    clean += script[i] == '.';
    double got = kiln_grad_scaler_get_scale(sc);
    if (got != want[i]) {
      fprintf(stderr, "step %d (%c): scale %g, PyTorch %g\n", i, script[i], got, want[i]);
      CHECK(false);
    }
    kiln_dict *d = kiln_grad_scaler_state_dict(sc);
    CHECK(d && kiln_item(kiln_dict_get(d, "growth_tracker")) == want_tracker[i]);
    kiln_dict_free(d);
    CHECK(kiln_grad_scaler_found_inf(sc) == (script[i] == 'x'));
    kiln_scope_end();
  }
  CHECK(kiln_optimizer_steps(opt) == clean);
  kiln_grad_scaler_free(sc);
  kiln_optimizer_free(opt);
  kiln_tensor_free(p);

  /* growth that would overflow f32 keeps the scale (PyTorch: only a finite scale grows) */
  c = kiln_grad_scaler_default_config();
  c.init_scale = 3e38;
  c.growth_interval = 1;
  sc = kiln_grad_scaler_new(&c);
  p = leaf(1.0);
  opt = kiln_optimizer_new(&oc, &p, 1);
  kiln_scope_begin();
  CHECK(kiln_backward(kiln_grad_scaler_scale(sc, kiln_sum_all(kiln_mul_scalar(p, 1e-30))), NULL) == KILN_OK);
  CHECK(kiln_grad_scaler_step(sc, opt) == KILN_OK && kiln_grad_scaler_update(sc) == KILN_OK);
  kiln_scope_end();
  CHECK(kiln_grad_scaler_get_scale(sc) == (double)3e38f);
  kiln_grad_scaler_free(sc);
  kiln_optimizer_free(opt);
  kiln_tensor_free(p);
}

/* kiln_amp_update_scale_ through the CPU's AMP_UPDATE_SCALE kernel and through the
** composed path (the test backend has no such kernel, so the op composes it from
** elementwise ops): the same scale and tracker after every step of a script, including a
** growth that would overflow f32 (kept) and an f32 tracker. */
static void test_update_scale_kernel_and_composed(void) {
  kiln_device td = h_testdev_device();
  kiln_fallback_policy prev = kiln_fallback_policy_get();
  kiln_set_fallback_policy(KILN_FALLBACK_SILENT); /* the composed ops run on the CPU by design */
  for (int variant = 0; variant < 2; variant++) {
    kiln_scope_begin();
    const char *script = variant ? "...x..." : "..x...xx.....";
    double init = variant ? 3e38 : 1024.0;
    kiln_dtype tdt = variant ? KILN_F32 : KILN_F64;
    kiln_tensor *s0 = kiln_scalar(init, KILN_F32, CPU), *t0 = kiln_scalar(0, tdt, CPU);
    kiln_tensor *s1 = kiln_scalar(init, KILN_F32, td), *t1 = kiln_scalar(0, tdt, td);
    kiln_tensor *f0 = kiln_zeros(KILN_SHAPE0, KILN_F32, CPU), *f1 = kiln_zeros(KILN_SHAPE0, KILN_F32, td);
    h_testdev_reset_calls();
    for (int i = 0; script[i]; i++) {
      double bad = script[i] == 'x' ? 1.0 : 0.0;
      kiln_fill_(f0, bad);
      kiln_fill_(f1, bad);
      CHECK(kiln_amp_update_scale_(s0, t0, f0, 2.0, 0.5, 3) == KILN_OK);
      CHECK(kiln_amp_update_scale_(s1, t1, f1, 2.0, 0.5, 3) == KILN_OK);
      if (kiln_item(s0) != kiln_item(s1) || kiln_item(t0) != kiln_item(t1)) {
        fprintf(stderr, "update_scale step %d: kernel %g/%g, composed %g/%g\n", i, kiln_item(s0), kiln_item(t0),
                kiln_item(s1), kiln_item(t1));
        CHECK(false);
      }
      if (variant && i == 2) CHECK(kiln_item(s0) == (double)3e38f); /* 6e38 overflows: kept */
    }
    /* 1024: x0.5 at 2, x2 at 5, x0.5 at 6 and 7, x2 at 10: 512 */
    CHECK(variant || kiln_item(s0) == 512.0);
    CHECK(!variant || kiln_item(s0) == (double)3e38f); /* x0.5 at 3, x2 at 6 */
    CHECK(h_testdev_calls(KILN__K_AMP_UPDATE_SCALE) == 0); /* the test backend composed it */
    kiln_scope_end();
  }
  kiln_set_fallback_policy(prev);
  kiln_clear_error();
}

/* Two optimizers on one scaler (PyTorch: a found_inf per optimizer): an inf gradient of
** one skips that optimizer's step only; update backs off once for the iteration. */
static void test_two_optimizers(void) {
  kiln_tensor *p = leaf(1.0), *q = leaf(2.0);
  kiln_optim_config ac = kiln_adam_config(0.1), sc_ = kiln_sgd_config(0.1);
  kiln_optimizer *a = kiln_optimizer_new(&ac, &p, 1), *b = kiln_optimizer_new(&sc_, &q, 1);
  kiln_grad_scaler *s = kiln_grad_scaler_new(NULL);
  for (int it = 0; it < 2; it++) {
    bool bad = it == 0;
    kiln_scope_begin();
    kiln_optimizer_zero_grad(a);
    kiln_optimizer_zero_grad(b);
    kiln_tensor *x = kiln_full(KILN_SHAPE(3), 1.0, KILN_F32, CPU);
    kiln_tensor *y = kiln_full(KILN_SHAPE(3), bad ? INFINITY : 1.0, KILN_F32, CPU);
    kiln_tensor *loss = kiln_add(kiln_sum_all(kiln_mul(p, x)), kiln_sum_all(kiln_mul(q, y)));
    CHECK(kiln_backward(kiln_grad_scaler_scale(s, loss), NULL) == KILN_OK);
    double p0 = kiln_item(kiln_sum_all(p)), q0 = kiln_item(kiln_sum_all(q));
    CHECK(kiln_grad_scaler_unscale_(s, a) == KILN_OK && kiln_grad_scaler_unscale_(s, b) == KILN_OK);
    CHECK(kiln_grad_scaler_step(s, a) == KILN_OK && kiln_grad_scaler_step(s, b) == KILN_OK);
    CHECK(kiln_grad_scaler_found_inf(s) == bad);
    CHECK(kiln_grad_scaler_update(s) == KILN_OK);
    CHECK(kiln_item(kiln_sum_all(p)) < p0);                       /* a's gradients were finite */
    CHECK(bad ? kiln_item(kiln_sum_all(q)) == q0 : kiln_item(kiln_sum_all(q)) < q0);
    kiln_scope_end();
  }
  CHECK(kiln_optimizer_steps(a) == 2 && kiln_optimizer_steps(b) == 1);
  CHECK(kiln_grad_scaler_get_scale(s) == 32768.0);
  kiln_grad_scaler_free(s);
  kiln_optimizer_free(a), kiln_optimizer_free(b);
  kiln_tensor_free(p), kiln_tensor_free(q);
}

/* The new entry points refuse bad arguments with a message. */
static void test_amp_bad_input(void) {
  kiln_scope_begin();
  kiln_tensor *sc = kiln_scalar(4.0, KILN_F32, CPU), *tr = kiln_scalar(0.0, KILN_F64, CPU);
  kiln_tensor *fi = kiln_zeros(KILN_SHAPE0, KILN_F32, CPU), *fi64 = kiln_zeros(KILN_SHAPE0, KILN_F64, CPU);
  CHECK(kiln_amp_update_scale_(sc, tr, fi64, 2, 0.5, 10) == KILN_ERR_INVALID_ARGUMENT);
  CHECK(strstr(kiln_last_error_message(), "found_inf") != NULL);
  CHECK(kiln_amp_update_scale_(sc, tr, fi, 2, 0.5, 0) == KILN_ERR_INVALID_ARGUMENT);
  CHECK(kiln_amp_update_scale_(NULL, tr, fi, 2, 0.5, 1) == KILN_ERR_INVALID_ARGUMENT);
  kiln_tensor *g = kiln_ones(KILN_SHAPE(3), KILN_F32, CPU);
  CHECK(kiln_amp_unscale_dev_(1, &g, fi, NULL) == KILN_ERR_INVALID_ARGUMENT);
  CHECK(kiln_amp_unscale_dev_(1, &g, fi, fi64) == KILN_ERR_INVALID_ARGUMENT);
  CHECK(strstr(kiln_last_error_message(), "inv_scale") != NULL);
  kiln_tensor *inv = kiln_scalar(0.5, KILN_F32, CPU);
  CHECK(kiln_amp_unscale_dev_(1, &g, fi, inv) == KILN_OK && kiln_item(kiln_sum_all(g)) == 1.5);
  /* found_inf needs the step on the device */
  kiln_tensor *p = kiln_ones(KILN_SHAPE(3), KILN_F32, CPU), *m = kiln_zeros_like(p), *v = kiln_zeros_like(p);
  int64_t step = 1;
  CHECK(kiln_adam_multi_step_amp_(1, &p, &g, &m, &v, NULL, &step, NULL, 0.1, 0.9, 0.999, 1e-8, 0, false, false, fi) ==
        KILN_ERR_INVALID_ARGUMENT);
  CHECK(strstr(kiln_last_error_message(), "step_t") != NULL);
  kiln_tensor *st = kiln_scalar(0.0, KILN_F64, CPU);
  kiln_fill_(fi, 1.0);
  CHECK(kiln_adam_multi_step_amp_(1, &p, &g, &m, &v, NULL, NULL, &st, 0.1, 0.9, 0.999, 1e-8, 0, false, false, fi) ==
        KILN_OK);
  CHECK(kiln_item(st) == 0.0 && kiln_item(kiln_sum_all(p)) == 3.0 && kiln_item(kiln_sum_all(m)) == 0.0);
  kiln_fill_(fi, 0.0);
  CHECK(kiln_adam_multi_step_amp_(1, &p, &g, &m, &v, NULL, NULL, &st, 0.1, 0.9, 0.999, 1e-8, 0, false, false, fi) ==
        KILN_OK);
  CHECK(kiln_item(st) == 1.0 && kiln_item(kiln_sum_all(p)) < 3.0);
  /* skipped again after a clean step: p and step_t stay */
  kiln_fill_(fi, 1.0);
  kiln_tensor *p2 = kiln_clone(p);
  CHECK(kiln_adam_multi_step_amp_(1, &p, &g, &m, &v, NULL, NULL, &st, 0.1, 0.9, 0.999, 1e-8, 0, false, false, fi) ==
        KILN_OK);
  CHECK(kiln_item(st) == 1.0 && kiln_item(kiln_sum_all(kiln_ne(p, p2))) == 0.0);
  kiln_grad_scaler *s = kiln_grad_scaler_new(NULL);
  CHECK(kiln_grad_scaler_scale(s, kiln_ones(KILN_SHAPE0, KILN_I32, CPU)) == NULL && kiln_last_error() == KILN_ERR_DTYPE);
  kiln_grad_scaler_free(s);
  kiln_clear_error();
  kiln_scope_end();
}

int main(void) {
  test_defaults_and_bad_config();
  test_unscale_step_skip_update();
  test_list_unscale_mixed_dtypes();
  test_state_round_trip();
  test_skip_is_bit_identical();
  test_plain_after_skipped_first();
  test_no_host_read();
  test_scale_sequence_matches_pytorch();
  test_amp_bad_input();
  test_update_scale_kernel_and_composed();
  test_two_optimizers();
  printf("test_grad_scaler: %d failures\n", failures);
  return failures ? 1 : 0;
}
