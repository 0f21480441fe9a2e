/*
** Loss scaling on CUDA (issue 14): the AMP_UNSCALE list kernel and the optimizer's skip on
** the device.
**   - unscale: 70 gradients of f32/f16/bf16/f64 and sizes from 1 to past one block's chunk
**     (two launches of up to 64), with the multiplier from the host and from the device:
**     the CPU kernel's bits, and the found-inf flag set by an inf or NaN anywhere (the
**     last element of the last tensor, a NaN in an f16 tensor in the middle) and left
**     alone when every value is finite. Run with the fallback policy at error, so a
**     missing CUDA kernel fails instead of passing on the CPU.
**   - skip: Adam (fused) and SGD with momentum on the GPU, scaled: an inf step leaves
**     parameters, optimizer state and step counts bit-identical; clean steps agree with
**     the same run on the CPU.
**   - graph: a whole scaled training step (forward, scaled backward, unscale_, step,
**     update) captured once and replayed over clean and inf batches: the scale follows
**     PyTorch's sequence and an inf replay leaves the parameters as they were, which only
**     works when nothing is read on the host (a read inside a capture is an error).
**   - a captured plain step of capturable Adam on the composed (non-fused) path: the step
**     count and the bias corrections come from the device on every replay.
**   - autocast's weight gradients: the f32 product of the bf16 operands, unrounded
**     (amp_wide_check.h: the wide MATMUL on cuBLAS and cuBLASLt's BGRADB epilogue).
** Values are compared bit for bit except that any NaN equals any NaN (the payload is the
** hardware's). A failure prints the tensor or state entry, dtype, element and values.
** Exits 77 (skipped) without a CUDA device.
*/
#include "check.h"

#include <kiln_io.h>
#include <kiln_optim.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "amp_copy_check.h"
#include "amp_wide_check.h"

static kiln_device cpu, gpu;

/* a and b hold the same bits, except that any two NaNs are equal (a NaN's payload is the
** hardware's: the CPU's f16 conversion makes 0x7e00, the GPU's 0x7fff). On the first
** difference prints (unless what is NULL) what, the dtype, the element and both values with their bits. */
static bool same_data(kiln_tensor *a, kiln_tensor *b, const char *what) {
  size_t n = kiln_nbytes(a), es = kiln_dtype_size(kiln_dtype_of(a));
  if (n != kiln_nbytes(b) || kiln_dtype_of(a) != kiln_dtype_of(b) || es == 0) {
    if (what)
      fprintf(stderr, "%s: %s of %zu bytes against %s of %zu bytes\n", what, kiln_dtype_name(kiln_dtype_of(a)), n,
            kiln_dtype_name(kiln_dtype_of(b)), kiln_nbytes(b));
    return false;
  }
  int64_t ne = (int64_t)(n / es);
  unsigned char *x = malloc(n + 1), *y = malloc(n + 1);
  double *xf = malloc((size_t)ne * sizeof(double) + 1), *yf = malloc((size_t)ne * sizeof(double) + 1);
  bool ok = x && y && xf && yf && kiln_to_host(a, x, n) == KILN_OK && kiln_to_host(b, y, n) == KILN_OK;
  kiln_scope_begin();
  ok = ok && kiln_to_host(kiln_to_dtype(kiln_to_device(a, cpu), KILN_F64), xf, (size_t)ne * sizeof(double)) == KILN_OK &&
       kiln_to_host(kiln_to_dtype(kiln_to_device(b, cpu), KILN_F64), yf, (size_t)ne * sizeof(double)) == KILN_OK;
  kiln_scope_end();
  if (!ok && what) fprintf(stderr, "%s: could not read the values: %s\n", what, kiln_last_error_message());
  for (int64_t i = 0; ok && i < ne; i++) {
    if (!memcmp(x + (size_t)i * es, y + (size_t)i * es, es) || (isnan(xf[i]) && isnan(yf[i]))) continue;
    unsigned long long bx = 0, by = 0; /* little-endian: the element's bits */
    memcpy(&bx, x + (size_t)i * es, es);
    memcpy(&by, y + (size_t)i * es, es);
    if (what)
      fprintf(stderr, "%s: %s, %lld elements: first difference at %lld: %.17g (0x%llx) against %.17g (0x%llx)\n",
              what, kiln_dtype_name(kiln_dtype_of(a)), (long long)ne, (long long)i, xf[i], bx, yf[i], by);
    ok = false;
  }
  free(x), free(y), free(xf), free(yf);
  return ok;
}

static bool same_bytes(kiln_tensor *a, kiln_tensor *b) { return same_data(a, b, "tensor"); }

/* ---- unscale ---- */
enum { NT = 70 };
static const kiln_dtype dts[4] = {KILN_F32, KILN_F16, KILN_BF16, KILN_F64};

static void make_grads(kiln_tensor **host, kiln_tensor **dev, int bad_at, double bad_value) {
  kiln_generator *g = kiln_generator_new(7);
  for (int i = 0; i < NT; i++) {
    int64_t n = i % 7 == 0 ? 3000 + i : 1 + (i * 37) % 500; /* some past a 1024-element chunk */
    kiln_tensor *r = kiln_mul_scalar(kiln_randn(KILN_SHAPE(n), KILN_F32, cpu, g), 4096.0);
    if (i == bad_at) CHECK(kiln_copy_(kiln_narrow(r, 0, n - 1, 1), kiln_scalar(bad_value, KILN_F32, cpu)) == KILN_OK);
    host[i] = kiln_keep(kiln_to_dtype(r, dts[i % 4]));
    dev[i] = kiln_keep(kiln_to_device(host[i], gpu));
  }
  kiln_generator_free(g);
}

static void test_unscale(void) {
  kiln_set_fallback_policy(KILN_FALLBACK_ERROR);
  for (int mode = 0; mode < 4; mode++) {
    /* 0: clean, host multiplier; 1: clean, device multiplier; 2: inf in the last element
    ** of the last tensor; 3: NaN in an f16 tensor in the middle */
    kiln_scope_begin();
    kiln_tensor *h[NT], *d[NT];
    int bad_at = mode == 2 ? NT - 1 : mode == 3 ? 33 : -1; /* 33 % 4 == 1: f16 */
    make_grads(h, d, bad_at, mode == 2 ? INFINITY : NAN);
    kiln_tensor *fh = kiln_zeros(KILN_SHAPE0, KILN_F32, cpu), *fd = kiln_zeros(KILN_SHAPE0, KILN_F32, gpu);
    const double inv = 1.0 / 1024.0;
    kiln_tensor *inv_h = kiln_scalar(inv, KILN_F32, cpu), *inv_d = kiln_scalar(inv, KILN_F32, gpu);
    if (mode == 0) {
      CHECK(kiln_amp_unscale_(NT, h, fh, inv) == KILN_OK);
      CHECK(kiln_amp_unscale_(NT, d, fd, inv) == KILN_OK);
    } else {
      CHECK(kiln_amp_unscale_dev_(NT, h, fh, inv_h) == KILN_OK);
      CHECK(kiln_amp_unscale_dev_(NT, d, fd, inv_d) == KILN_OK);
    }
    int differ = 0;
    for (int i = 0; i < NT; i++) {
      char what[96];
      snprintf(what, sizeof what, "unscale mode %d: tensor %d (cpu, then cuda)", mode, i);
      differ += !same_data(h[i], d[i], what);
    }
    if (differ) fprintf(stderr, "unscale mode %d: %d of %d tensors differ from the CPU kernel\n", mode, differ, NT);
    CHECK(differ == 0);
    const double want = mode >= 2 ? 1.0 : 0.0, got_h = kiln_item(fh), got_d = kiln_item(fd);
    if (got_h != want || got_d != want)
      fprintf(stderr, "unscale mode %d: found_inf %g on the cpu, %g on cuda, want %g\n", mode, got_h, got_d, want);
    CHECK(got_h == want);
    CHECK(got_d == want);
    /* the flag is never cleared: a clean pass after a bad one leaves it set */
    if (mode >= 2) {
      kiln_tensor *ok = kiln_ones(KILN_SHAPE(5), KILN_F16, gpu);
      CHECK(kiln_amp_unscale_dev_(1, &ok, fd, inv_d) == KILN_OK && kiln_item(fd) == 1.0);
    }
    for (int i = 0; i < NT; i++) kiln_tensor_free(h[i]), kiln_tensor_free(d[i]);
    kiln_scope_end();
  }
  kiln_set_fallback_policy(KILN_FALLBACK_WARN);
  kiln_clear_error();
}

/* ---- the skip ---- */
typedef struct model {
  kiln_tensor *w[2];
  kiln_optimizer *opt;
} model;

static model make_model(kiln_device dev, int kind) {
  model m;
  kiln_generator *g = kiln_generator_new(3);
  m.w[0] = kiln_keep(kiln_to_device(kiln_randn(KILN_SHAPE(16, 32), KILN_F32, cpu, g), dev));
  m.w[1] = kiln_keep(kiln_to_device(kiln_randn(KILN_SHAPE(32, 4), KILN_F32, cpu, g), dev));
  kiln_generator_free(g);
  for (int i = 0; i < 2; i++) kiln_requires_grad_(m.w[i], true);
  kiln_optim_config c;
  if (kind == 0) {
    c = kiln_adam_config(1e-2);
  } else {
    c = kiln_sgd_config(0.05);
    c.momentum = 0.9;
    c.dampening = 0.1;
  }
  m.opt = kiln_optimizer_new(&c, m.w, 2);
  return m;
}
static void free_model(model *m) {
  kiln_optimizer_free(m->opt);
  kiln_tensor_free(m->w[0]), kiln_tensor_free(m->w[1]);
}

static kiln_tensor *loss_of(model *m, kiln_tensor *x) {
  return kiln_mean_all(kiln_tanh(kiln_matmul(kiln_relu(kiln_matmul(x, m->w[0])), m->w[1])));
}

static kiln_tensor *batch(int it, bool bad, kiln_device dev) {
  kiln_generator *g = kiln_generator_new(100 + (uint64_t)it);
  kiln_tensor *x = kiln_randn(KILN_SHAPE(8, 16), KILN_F32, cpu, g);
  kiln_generator_free(g);
  if (bad) x = kiln_mul_scalar(x, INFINITY);
  return kiln_to_device(x, dev);
}

static void scaled_step(model *m, kiln_grad_scaler *sc, kiln_tensor *x) {
  kiln_optimizer_zero_grad(m->opt);
  CHECK(kiln_backward(kiln_grad_scaler_scale(sc, loss_of(m, x)), NULL) == KILN_OK);
  CHECK(kiln_grad_scaler_step(sc, m->opt) == KILN_OK);
  CHECK(kiln_grad_scaler_update(sc) == KILN_OK);
}

/* The optimizer's state after a skipped step against a copy from before it: every state
** tensor that existed holds the same bits and the step counts are the same. A tensor the
** step made (a first step's moments or momentum buffer: made before the device knows the
** step is skipped, as PyTorch's fused Adam makes its state) must be all zeros, which is
** the state of a step never taken. Prints which entry differs. */
static bool same_state(kiln_optimizer *a, kiln_dict *before, const char *what) {
  kiln_dict *now = kiln_optimizer_state_dict(a);
  if (!now) {
    fprintf(stderr, "%s: no state dict: %s\n", what, kiln_last_error_message());
    return false;
  }
  bool ok = true;
  char buf[160];
  for (int i = 0; i < kiln_dict_size(before); i++)
    if (!kiln_dict_get(now, kiln_dict_key(before, i))) {
      fprintf(stderr, "%s: state entry %s is gone\n", what, kiln_dict_key(before, i));
      ok = false;
    }
  for (int i = 0; i < kiln_dict_size(now); i++) {
    const char *key = kiln_dict_key(now, i);
    kiln_tensor *was = kiln_dict_get(before, key), *t = kiln_dict_value(now, i);
    snprintf(buf, sizeof buf, "%s: state entry %s", what, key);
    if (was) {
      ok = same_data(was, t, buf) && ok;
      continue;
    }
    kiln_scope_begin();
    double mag = kiln_item(kiln_mean_all(kiln_abs(kiln_to_dtype(t, KILN_F64))));
    kiln_scope_end();
    if (mag != 0.0) {
      fprintf(stderr, "%s (made by the skipped step) is not zero: mean |x| %g\n", buf, mag);
      ok = false;
    }
  }
  for (int i = 0; i < kiln_dict_meta_size(before); i++) {
    const char *k = kiln_dict_meta_key(before, i), *v = kiln_dict_get_meta(now, k);
    if (!v || strcmp(v, kiln_dict_meta_value(before, i))) {
      fprintf(stderr, "%s: metadata %s was %s, now %s\n", what, k, kiln_dict_meta_value(before, i), v ? v : "(none)");
      ok = false;
    }
  }
  for (int i = 0; i < kiln_dict_meta_size(now); i++)
    if (!kiln_dict_get_meta(before, kiln_dict_meta_key(now, i))) {
      fprintf(stderr, "%s: metadata %s = %s is new\n", what, kiln_dict_meta_key(now, i), kiln_dict_meta_value(now, i));
      ok = false;
    }
  kiln_dict_free(now);
  return ok;
}

static kiln_dict *state_copy(kiln_optimizer *o) {
  kiln_dict *d = kiln_optimizer_state_dict(o), *c = kiln_dict_new();
  for (int i = 0; d && i < kiln_dict_size(d); i++) {
    kiln_tensor *t = kiln_keep(kiln_clone(kiln_dict_value(d, i)));
    kiln_dict_set(c, kiln_dict_key(d, i), t);
    kiln_tensor_free(t);
  }
  for (int i = 0; d && i < kiln_dict_meta_size(d); i++) kiln_dict_set_meta(c, kiln_dict_meta_key(d, i), kiln_dict_meta_value(d, i));
  kiln_dict_free(d);
  return c;
}

static void test_device_skip(void) {
  for (int kind = 0; kind < 2; kind++) {
    model g = make_model(gpu, kind), c = make_model(cpu, kind);
    kiln_grad_scaler *sg = kiln_grad_scaler_new(NULL), *scpu = kiln_grad_scaler_new(NULL);
    for (int it = 0; it < 6; it++) {
      kiln_scope_begin();
      bool bad = it == 0 || it == 3; /* a skipped first step, and one later */
      kiln_tensor *wg[2] = {kiln_clone(g.w[0]), kiln_clone(g.w[1])};
      kiln_dict *before = state_copy(g.opt);
      scaled_step(&g, sg, batch(it, bad, gpu));
      scaled_step(&c, scpu, batch(it, bad, cpu));
      if (bad) {
        CHECK(kiln_grad_scaler_found_inf(sg));
        char what[64];
        snprintf(what, sizeof what, "skip kind %d step %d", kind, it);
        CHECK(same_data(wg[0], g.w[0], what) && same_data(wg[1], g.w[1], what));
        CHECK(same_state(g.opt, before, what));
      }
      kiln_dict_free(before);
      kiln_scope_end();
    }
    CHECK(kiln_optimizer_steps(g.opt) == 4 && kiln_optimizer_steps(c.opt) == 4);
    CHECK(kiln_grad_scaler_get_scale(sg) == 16384.0 && kiln_grad_scaler_get_scale(scpu) == 16384.0);
    kiln_scope_begin();
    /* SGD: the largest difference; Adam: the mean one, since an element whose gradient is
    ** ~0 may take its lr-sized step the other way on the GPU (matmul rounding), while a
    ** step applied on one device and skipped on the other moves every element by ~lr. */
    for (int i = 0; i < 2; i++) {
      kiln_tensor *diff = kiln_abs(kiln_sub(kiln_to_device(g.w[i], cpu), c.w[i]));
      double d = kiln_item(kind == 0 ? kiln_mean_all(diff) : kiln_amax(diff, 0, NULL, false));
      double tol = kind == 0 ? 1e-3 : 1e-4;
      if (!(d < tol)) fprintf(stderr, "kind %d: weight %d differs from the CPU run by %g\n", kind, i, d);
      CHECK(d < tol);
    }
    kiln_scope_end();
    kiln_grad_scaler_free(sg), kiln_grad_scaler_free(scpu);
    free_model(&g), free_model(&c);
  }
  kiln_clear_error();
}

/* ---- inside a captured graph ---- */
typedef struct cap {
  model m;
  kiln_grad_scaler *sc;
  kiln_tensor *x; /* the static input */
} cap;

static kiln_status cap_step(void *p) {
  cap *c = p;
  kiln_scope_begin();
  kiln_status st = kiln_optimizer_zero_grad(c->m.opt);
  if (st == KILN_OK) st = kiln_backward(kiln_grad_scaler_scale(c->sc, loss_of(&c->m, c->x)), NULL);
  if (st == KILN_OK) st = kiln_grad_scaler_step(c->sc, c->m.opt);
  if (st == KILN_OK) st = kiln_grad_scaler_update(c->sc);
  kiln_scope_end();
  return st;
}

static void test_graph(void) {
  kiln_grad_scaler_config cfg = kiln_grad_scaler_default_config();
  cfg.growth_interval = 2;
  for (int kind = 0; kind < 2; kind++) {
    cap c;
    c.m = make_model(gpu, kind);
    if (kind == 0) { /* the captured Adam keeps its step on the device */
      kiln_optim_config oc = kiln_optimizer_config(c.m.opt);
      oc.capturable = true;
      kiln_optimizer_free(c.m.opt);
      c.m.opt = kiln_optimizer_new(&oc, c.m.w, 2);
    }
    c.sc = kiln_grad_scaler_new(&cfg);
    c.x = kiln_keep(batch(0, false, gpu));
    CHECK(cap_step(&c) == KILN_OK); /* eager warm-up: state, memory cache; scale 65536, tracker 1 */
    kiln_graph *g = kiln_graph_capture(gpu, cap_step, &c);
    CHECK(g != NULL);
    if (!g) {
      fprintf(stderr, "capture failed: %s\n", kiln_last_error_message());
    } else {
      CHECK(kiln_graph_is_device_graph(g));
      /* replays: clean (grow: 131072), inf (65536), inf (32768), clean, clean (65536) */
      const bool bad[5] = {false, true, true, false, false};
      const double want[5] = {131072, 65536, 32768, 32768, 65536};
      for (int r = 0; r < 5; r++) {
        kiln_scope_begin();
        CHECK(kiln_copy_(c.x, batch(r + 1, bad[r], gpu)) == KILN_OK);
        kiln_tensor *w0 = kiln_clone(c.m.w[0]);
        CHECK(kiln_graph_replay(g) == KILN_OK);
        double s = kiln_grad_scaler_get_scale(c.sc);
        if (s != want[r]) fprintf(stderr, "kind %d replay %d: scale %g, want %g\n", kind, r, s, want[r]);
        CHECK(s == want[r]);
        CHECK(bad[r] ? same_bytes(w0, c.m.w[0]) : !same_data(w0, c.m.w[0], NULL));
        CHECK(kiln_grad_scaler_found_inf(c.sc) == bad[r]);
        kiln_scope_end();
      }
      /* the warm-up and three clean replays were applied */
      kiln_dict *d = kiln_optimizer_state_dict(c.m.opt);
      const char *s0 = d ? kiln_dict_get_meta(d, "state.0.step") : NULL;
      CHECK(s0 && !strcmp(s0, "4"));
      kiln_dict_free(d);
    }
    kiln_graph_free(g);
    kiln_tensor_free(c.x);
    kiln_grad_scaler_free(c.sc);
    free_model(&c.m);
  }
  kiln_clear_error();
}

/* A captured plain step of capturable Adam on the composed path (maximize: no fused
** kernel takes it): each replay must read the device step count for its bias corrections
** and advance it, as the fused kernel does. (It once read the host's count: every replay
** repeated the capture's corrections and the count stood at the capture's.) */
static kiln_status plain_step(void *p) {
  cap *c = p;
  kiln_scope_begin();
  kiln_status st = kiln_optimizer_zero_grad(c->m.opt);
  if (st == KILN_OK) st = kiln_backward(loss_of(&c->m, c->x), NULL);
  if (st == KILN_OK) st = kiln_optimizer_step(c->m.opt);
  kiln_scope_end();
  return st;
}

static void test_graph_composed_adam(void) {
  cap c;
  model r = make_model(cpu, 0);
  c.m = make_model(gpu, 0);
  kiln_optim_config oc = kiln_optimizer_config(c.m.opt);
  oc.maximize = true;
  kiln_optimizer_free(r.opt);
  r.opt = kiln_optimizer_new(&oc, r.w, 2);
  oc.capturable = true;
  kiln_optimizer_free(c.m.opt);
  c.m.opt = kiln_optimizer_new(&oc, c.m.w, 2);
  c.sc = NULL;
  c.x = kiln_keep(batch(0, false, gpu));
  cap rc = {r, NULL, kiln_keep(batch(0, false, cpu))};
  CHECK(plain_step(&c) == KILN_OK && plain_step(&rc) == KILN_OK); /* eager warm-up */
  kiln_graph *g = kiln_graph_capture(gpu, plain_step, &c);
  CHECK(g != NULL);
  if (!g) {
    fprintf(stderr, "composed adam: capture failed: %s\n", kiln_last_error_message());
  } else {
    for (int k = 0; k < 3; k++) {
      kiln_scope_begin();
      CHECK(kiln_copy_(c.x, batch(k + 1, false, gpu)) == KILN_OK);
      CHECK(kiln_copy_(rc.x, batch(k + 1, false, cpu)) == KILN_OK);
      CHECK(kiln_graph_replay(g) == KILN_OK);
      CHECK(plain_step(&rc) == KILN_OK);
      kiln_scope_end();
    }
    kiln_dict *d = kiln_optimizer_state_dict(c.m.opt);
    const char *s0 = d ? kiln_dict_get_meta(d, "state.0.step") : NULL;
    if (!s0 || strcmp(s0, "4")) fprintf(stderr, "composed adam: state.0.step %s after 4 steps\n", s0 ? s0 : "(none)");
    CHECK(s0 && !strcmp(s0, "4"));
    kiln_dict_free(d);
    kiln_scope_begin();
    for (int i = 0; i < 2; i++) { /* the mean difference, as test_device_skip's Adam */
      double diff = kiln_item(kiln_mean_all(kiln_abs(kiln_sub(kiln_to_device(c.m.w[i], cpu), rc.m.w[i]))));
      if (!(diff < 1e-3)) fprintf(stderr, "composed adam: weight %d differs from the CPU run by %g\n", i, diff);
      CHECK(diff < 1e-3);
    }
    kiln_scope_end();
  }
  kiln_graph_free(g);
  kiln_tensor_free(c.x), kiln_tensor_free(rc.x);
  free_model(&c.m), free_model(&rc.m);
  kiln_clear_error();
}

int main(void) {
  cpu = kiln_device_cpu();
  if (kiln_device_count(KILN_DEVICE_CUDA) < 1) {
    printf("test_cuda_amp: no CUDA device, skipped\n");
    return 77;
  }
  gpu = kiln_device_cuda(0);
  test_unscale();
  test_device_skip();
  test_graph();
  test_graph_composed_adam();
  amp_wide_check(gpu);
  amp_copy_check(gpu);
  printf("test_cuda_amp: %d failures\n", failures);
  return failures ? 1 : 0;
}
