/*
** The CUDA backend against the CPU backend, kernel by kernel (ggml's test-backend-ops
** idea, at the seam of backend.h): for each op and dtype, random inputs are built on the
** host, the CPU kernel (kiln__cpu_backend.kernels[op]) runs on them and the CUDA kernel on
** device copies, and the outputs are compared within the dtype's tolerance. Layouts:
** contiguous, transposed, broadcast (stride 0), non-contiguous output, size 0 and size 1.
** Then the CUDA-only machinery: allocator statistics, the memory limit and OOM followed by
** recovery, empty_cache, graph capture replayed 10 times, and the device-side index
** error flag. One line per case, a summary at the end. Exits 77 without a CUDA device.
*/
#include <kiln.h>

#include "backend/backend.h"
#ifdef KILN_HAVE_CUDA
#include "backend/cuda/cuda_api.h"
#endif

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef KILN_HAVE_CUDA
int main(void) {
  printf("skip: kiln was built without CUDA\n");
  return 77;
}
#else

static int n_ok, n_fail, n_skip;
static const kiln__backend *CPU = &kiln__cpu_backend, *GPU = &kiln__cuda_backend;

/* ---- host data ---- */
static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static double urand(void) { /* [0, 1) */
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return (double)(rng_state >> 11) * (1.0 / 9007199254740992.0);
}
static double nrand(void) {
  double u1 = urand() + 1e-12, u2 = urand();
  return sqrt(-2 * log(u1)) * cos(6.283185307179586 * u2);
}

static void put(void *p, kiln_dtype dt, int64_t i, double v) {
  switch (dt) {
  case KILN_F32: ((float *)p)[i] = (float)v; break;
  case KILN_F64: ((double *)p)[i] = v; break;
  case KILN_F16: ((uint16_t *)p)[i] = kiln_f32_to_f16((float)v); break;
  case KILN_BF16: ((uint16_t *)p)[i] = kiln_f32_to_bf16((float)v); break;
  case KILN_I64: ((int64_t *)p)[i] = (int64_t)v; break;
  case KILN_I32: ((int32_t *)p)[i] = (int32_t)v; break;
  case KILN_U8: ((uint8_t *)p)[i] = (uint8_t)v; break;
  case KILN_BOOL: ((uint8_t *)p)[i] = v != 0; break;
  default: break;
  }
}
static double get(const void *p, kiln_dtype dt, int64_t i) {
  switch (dt) {
  case KILN_F32: return ((const float *)p)[i];
  case KILN_F64: return ((const double *)p)[i];
  case KILN_F16: return kiln_f16_to_f32(((const uint16_t *)p)[i]);
  case KILN_BF16: return kiln_bf16_to_f32(((const uint16_t *)p)[i]);
  case KILN_I64: return (double)((const int64_t *)p)[i];
  case KILN_I32: return ((const int32_t *)p)[i];
  case KILN_U8: return ((const uint8_t *)p)[i];
  case KILN_BOOL: return ((const uint8_t *)p)[i] != 0;
  default: return NAN;
  }
}
static bool is_float(kiln_dtype dt) { return kiln_dtype_is_float(dt); }

/* ---- tensor specs ---- */
enum { F_NORMAL, F_UNIFORM, F_INT, F_BOOL };
typedef struct tspec {
  kiln_dtype dt;
  int ndim;
  int64_t shape[KILN_MAX_DIMS], strides[KILN_MAX_DIMS];
  int64_t base_n; /* elements in the buffer behind the view */
  int fill;
  double lo, hi;
} tspec;

static tspec contig(kiln_dtype dt, int ndim, const int64_t *shape) {
  tspec t;
  memset(&t, 0, sizeof t);
  t.dt = dt;
  t.ndim = ndim;
  int64_t s = 1;
  for (int d = ndim - 1; d >= 0; d--) {
    t.shape[d] = shape[d];
    t.strides[d] = s;
    s *= shape[d];
  }
  t.base_n = s;
  t.fill = F_NORMAL;
  t.lo = -2;
  t.hi = 2;
  return t;
}
static tspec c2(kiln_dtype dt, int64_t r, int64_t c) { return contig(dt, 2, (int64_t[]){r, c}); }
static tspec c1(kiln_dtype dt, int64_t n) { return contig(dt, 1, (int64_t[]){n}); }
/* (r, c) viewed from a (c, r) buffer: strides (1, r). */
static tspec trans2(kiln_dtype dt, int64_t r, int64_t c) {
  tspec t = c2(dt, r, c);
  t.strides[0] = 1;
  t.strides[1] = r;
  return t;
}
/* stride 0 on dim 0: every row is the same buffer row. */
static tspec bcast0(tspec t) {
  t.strides[0] = 0;
  int64_t n = 1;
  for (int d = 1; d < t.ndim; d++) n *= t.shape[d];
  t.base_n = n;
  return t;
}
/* every other column: (r, c) in a (r, 2c) buffer. */
static tspec step2(kiln_dtype dt, int64_t r, int64_t c) {
  tspec t = c2(dt, r, c);
  t.strides[0] = 2 * c;
  t.strides[1] = 2;
  t.base_n = 2 * r * c;
  return t;
}
static tspec filled(tspec t, int fill, double lo, double hi) {
  t.fill = fill;
  t.lo = lo;
  t.hi = hi;
  return t;
}

typedef struct tcase {
  const char *label;
  kiln__kop op;
  int n_in, n_out;
  tspec in[KILN__MAX_KIN], out[KILN__MAX_KOUT];
  double s[4];
  int64_t i[4];
  uint64_t seed, offset;
  double tol_scale; /* 0 means 1 */
  bool skip_out1;   /* do not compare out[1] */
} tcase;

static size_t bytes_of(const tspec *t) {
  return (size_t)(t->base_n > 0 ? t->base_n : 1) * kiln_dtype_size(t->dt);
}
static void fill_host(void *p, const tspec *t) {
  for (int64_t k = 0; k < t->base_n; k++) {
    double v;
    switch (t->fill) {
    case F_UNIFORM: v = t->lo + (t->hi - t->lo) * urand(); break;
    case F_INT: v = floor(t->lo + (t->hi - t->lo + 1) * urand()); if (v > t->hi) v = t->hi; break;
    case F_BOOL: v = urand() < 0.5; break;
    default: v = nrand() * (t->hi - t->lo) / 4; break;
    }
    if (!is_float(t->dt) && t->fill == F_NORMAL) v = floor(v * 4);
    if (t->dt == KILN_U8 && v < 0) v = -v;
    put(p, t->dt, k, v);
  }
}
static kiln__view view_at(const tspec *t, void *base) {
  kiln__view v;
  memset(&v, 0, sizeof v);
  v.data = base;
  v.dtype = t->dt;
  v.ndim = t->ndim;
  for (int d = 0; d < t->ndim; d++) {
    v.shape[d] = t->shape[d];
    v.strides[d] = t->strides[d];
  }
  return v;
}
static int64_t numel(const tspec *t) {
  int64_t n = 1;
  for (int d = 0; d < t->ndim; d++) n *= t->shape[d];
  return n;
}
static double tol_of(kiln_dtype dt) {
  switch (dt) {
  case KILN_F32: return 1e-5;
  case KILN_F64: return 1e-12;
  case KILN_F16: return 1e-2;
  case KILN_BF16: return 2e-2;
  default: return 0;
  }
}

/* Largest violation of |g - w| <= tol * (|w| + scale) over the view; 0 when all pass. */
static double compare(const tspec *t, const void *want, const void *got, double tol,
                      int64_t *where) {
  int64_t n = numel(t);
  double scale = 0, worst = 0;
  for (int pass = 0; pass < 2; pass++) {
    for (int64_t k = 0; k < n; k++) {
      int64_t r = k, off = 0;
      for (int d = t->ndim - 1; d >= 0; d--) {
        off += (r % t->shape[d]) * t->strides[d];
        r /= t->shape[d];
      }
      double w = get(want, t->dt, off), g = get(got, t->dt, off);
      if (pass == 0) {
        if (isfinite(w) && fabs(w) > scale) scale = fabs(w);
        continue;
      }
      if (isnan(w) && isnan(g)) continue;
      if (isinf(w) && g == w) continue;
      double err = fabs(g - w), bound = tol * (fabs(w) + scale);
      if (!(err <= bound)) {
        double v = isnan(err) ? INFINITY : (bound > 0 ? err / bound : err + 1);
        if (v > worst) {
          worst = v;
          *where = k;
        }
      }
    }
  }
  return worst;
}

static void report(bool ok, const tcase *c, const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  printf("%-4s %-22s %-9s %-34s %s\n", ok ? "ok" : "FAIL", kiln__kop_name(c->op),
         kiln_dtype_name(c->out[0].dt), c->label, msg);
  if (ok) n_ok++;
  else n_fail++;
}

static void run_case(const tcase *c) {
  void *hin[KILN__MAX_KIN] = {0}, *din[KILN__MAX_KIN] = {0};
  void *hcpu[KILN__MAX_KOUT] = {0}, *hgpu[KILN__MAX_KOUT] = {0}, *dout[KILN__MAX_KOUT] = {0};
  kiln__kargs ac, ag;
  memset(&ac, 0, sizeof ac);
  ac.op = c->op;
  ac.n_in = c->n_in;
  ac.n_out = c->n_out;
  memcpy(ac.s, c->s, sizeof ac.s);
  memcpy(ac.i, c->i, sizeof ac.i);
  ac.seed = c->seed;
  ac.offset = c->offset;
  ag = ac;
  ag.device = 0;
  bool setup = true;
  for (int k = 0; k < c->n_in && setup; k++) {
    size_t nb = bytes_of(&c->in[k]);
    hin[k] = malloc(nb);
    din[k] = GPU->alloc(0, nb);
    if (!hin[k] || !din[k]) { setup = false; break; }
    fill_host(hin[k], &c->in[k]);
    if (GPU->copy_from_host(0, din[k], hin[k], nb) != KILN_OK) setup = false;
    ac.in[k] = view_at(&c->in[k], hin[k]);
    ag.in[k] = view_at(&c->in[k], din[k]);
  }
  for (int k = 0; k < c->n_out && setup; k++) {
    size_t nb = bytes_of(&c->out[k]);
    hcpu[k] = malloc(nb);
    hgpu[k] = malloc(nb);
    dout[k] = GPU->alloc(0, nb);
    if (!hcpu[k] || !hgpu[k] || !dout[k]) { setup = false; break; }
    tspec init = c->out[k];
    init.fill = is_float(init.dt) ? F_NORMAL : F_INT;
    init.lo = init.dt == KILN_BOOL ? 0 : -2;
    init.hi = init.dt == KILN_BOOL ? 1 : 2;
    fill_host(hcpu[k], &init);
    if (GPU->copy_from_host(0, dout[k], hcpu[k], nb) != KILN_OK) setup = false;
    ac.out[k] = view_at(&c->out[k], hcpu[k]);
    ag.out[k] = view_at(&c->out[k], dout[k]);
  }
  if (!setup) {
    report(false, c, "setup failed: %s", kiln_last_error_message());
    goto done;
  }
  kiln_clear_error();
  if (!CPU->kernels[c->op]) {
    printf("skip %-22s %-9s %-34s (no CPU kernel)\n", kiln__kop_name(c->op),
           kiln_dtype_name(c->out[0].dt), c->label);
    n_skip++;
    goto done;
  }
  kiln_status sc = CPU->kernels[c->op](&ac);
  if (sc != KILN_OK) {
    printf("skip %-22s %-9s %-34s (cpu: %s)\n", kiln__kop_name(c->op),
           kiln_dtype_name(c->out[0].dt), c->label, kiln_last_error_message());
    n_skip++;
    goto done;
  }
  if (GPU->supports && !GPU->supports(&ag)) {
    printf("skip %-22s %-9s %-34s (cuda: falls back to the CPU)\n", kiln__kop_name(c->op),
           kiln_dtype_name(c->out[0].dt), c->label);
    n_skip++;
    goto done;
  }
  kiln_status sg = GPU->kernels[c->op](&ag);
  if (sg == KILN_OK) sg = GPU->synchronize(0);
  if (sg != KILN_OK) {
    report(false, c, "cuda: %s", kiln_last_error_message());
    goto done;
  }
  for (int k = 0; k < c->n_out; k++) {
    if (k == 1 && c->skip_out1) continue;
    if (GPU->copy_to_host(0, hgpu[k], dout[k], bytes_of(&c->out[k])) != KILN_OK) {
      report(false, c, "copy back: %s", kiln_last_error_message());
      goto done;
    }
    double tol = tol_of(c->out[k].dt) * (c->tol_scale > 0 ? c->tol_scale : 1);
    int64_t where = -1;
    double worst = compare(&c->out[k], hcpu[k], hgpu[k], tol, &where);
    if (worst > 0) {
      int64_t r = where, off = 0;
      for (int d = c->out[k].ndim - 1; d >= 0; d--) {
        off += (r % c->out[k].shape[d]) * c->out[k].strides[d];
        r /= c->out[k].shape[d];
      }
      report(false, c, "out%d element %lld: cpu %.9g cuda %.9g (%.3g x tolerance)", k,
             (long long)where, get(hcpu[k], c->out[k].dt, off), get(hgpu[k], c->out[k].dt, off),
             worst);
      goto done;
    }
  }
  report(true, c, "");
done:
  for (int k = 0; k < KILN__MAX_KIN; k++) {
    free(hin[k]);
    if (din[k]) GPU->free(0, din[k], 0);
  }
  for (int k = 0; k < KILN__MAX_KOUT; k++) {
    free(hcpu[k]);
    free(hgpu[k]);
    if (dout[k]) GPU->free(0, dout[k], 0);
  }
}

static const kiln_dtype FLOATS[] = {KILN_F32, KILN_F64, KILN_F16, KILN_BF16};
static const kiln_dtype ALL[] = {KILN_F32, KILN_F64, KILN_F16, KILN_BF16,
                                 KILN_I64, KILN_I32, KILN_U8,  KILN_BOOL};

/* Layouts for ops on 2-d operands of one shape (r, c). */
enum { L_CONTIG, L_TRANS, L_BCAST, L_OUTT, L_COUNT };
static const char *layout_name[] = {"contiguous", "transposed in", "broadcast in0", "transposed out"};
static tspec in_layout(int L, kiln_dtype dt, int64_t r, int64_t c, int k) {
  if (L == L_TRANS) return trans2(dt, r, c);
  if (L == L_BCAST && k == 0) return bcast0(c2(dt, r, c));
  return c2(dt, r, c);
}
static tspec out_layout(int L, kiln_dtype dt, int64_t r, int64_t c) {
  return L == L_OUTT ? trans2(dt, r, c) : c2(dt, r, c);
}
static const int64_t SHAPES[][2] = {{37, 129}, {1, 1}, {0, 5}, {1, 7}, {512, 1031}};

/* ---- elementwise ---- */
static void unary_cases(void) {
  for (int op = KILN__K_NEG; op <= KILN__K_AFFINE; op++) {
    for (size_t di = 0; di < sizeof ALL / sizeof ALL[0]; di++) {
      kiln_dtype dt = ALL[di];
      bool int_ok = op == KILN__K_NEG || op == KILN__K_ABS || op == KILN__K_SIGN ||
                    op == KILN__K_RELU || op == KILN__K_CLAMP || op == KILN__K_AFFINE;
      if (!is_float(dt) && (!int_ok || dt == KILN_BOOL || dt == KILN_U8)) continue;
      for (int L = 0; L < L_COUNT; L++) {
        for (size_t si = 0; si < sizeof SHAPES / sizeof SHAPES[0]; si++) {
          if (si == 4 && L != L_CONTIG) continue;
          int64_t r = SHAPES[si][0], c = SHAPES[si][1];
          tcase t;
          memset(&t, 0, sizeof t);
          char label[64];
          snprintf(label, sizeof label, "[%lld, %lld] %s", (long long)r, (long long)c, layout_name[L]);
          t.label = label;
          t.op = (kiln__kop)op;
          t.n_in = 1;
          t.n_out = 1;
          t.in[0] = in_layout(L, dt, r, c, 0);
          if (op == KILN__K_LOG || op == KILN__K_SQRT || op == KILN__K_RSQRT || op == KILN__K_POW_SCALAR)
            t.in[0] = filled(t.in[0], F_UNIFORM, 0.5, 2.0);
          t.out[0] = out_layout(L, dt, r, c);
          t.s[0] = op == KILN__K_LEAKY_RELU ? 0.1 : op == KILN__K_SOFTPLUS ? 1.0
                   : op == KILN__K_CLAMP ? (is_float(dt) ? -0.5 : -1.0) : op == KILN__K_POW_SCALAR ? 1.7 : 1.5;
          t.s[1] = op == KILN__K_SOFTPLUS ? 20.0 : op == KILN__K_CLAMP ? (is_float(dt) ? 0.7 : 2.0) : -0.25;
          if (op == KILN__K_AFFINE && !is_float(dt)) t.s[0] = 3, t.s[1] = 1;
          run_case(&t);
        }
      }
    }
  }
}

static void unary_backward_cases(void) {
  for (int op = KILN__K_RELU_BACKWARD; op <= KILN__K_CLAMP_BACKWARD; op++) {
    for (size_t di = 0; di < 4; di++) {
      for (int L = 0; L < L_COUNT; L++) {
        kiln_dtype dt = FLOATS[di];
        tcase t;
        memset(&t, 0, sizeof t);
        t.label = layout_name[L];
        t.op = (kiln__kop)op;
        t.n_in = 2;
        t.n_out = 1;
        t.in[0] = in_layout(L, dt, 37, 129, 0);
        if (op == KILN__K_SIGMOID_BACKWARD) t.in[0] = filled(t.in[0], F_UNIFORM, 0.01, 0.99);
        if (op == KILN__K_TANH_BACKWARD) t.in[0] = filled(t.in[0], F_UNIFORM, -0.99, 0.99);
        t.in[1] = in_layout(L, dt, 37, 129, 1);
        t.out[0] = out_layout(L, dt, 37, 129);
        t.s[0] = op == KILN__K_LEAKY_RELU_BACKWARD ? 0.1 : op == KILN__K_SOFTPLUS_BACKWARD ? 1.0 : -0.5;
        t.s[1] = op == KILN__K_SOFTPLUS_BACKWARD ? 20.0 : 0.7;
        run_case(&t);
      }
    }
  }
}

static void binary_cases(void) {
  for (int op = KILN__K_ADD; op <= KILN__K_GE; op++) {
    bool cmp = op >= KILN__K_EQ;
    for (size_t di = 0; di < sizeof ALL / sizeof ALL[0]; di++) {
      kiln_dtype dt = ALL[di];
      if (dt == KILN_BOOL || (dt == KILN_U8 && op != KILN__K_ADD && op != KILN__K_MUL && !cmp)) continue;
      for (int L = 0; L < L_COUNT; L++) {
        for (size_t si = 0; si < sizeof SHAPES / sizeof SHAPES[0]; si++) {
          if (si == 4 && L != L_CONTIG) continue;
          int64_t r = SHAPES[si][0], c = SHAPES[si][1];
          tcase t;
          memset(&t, 0, sizeof t);
          char label[64];
          snprintf(label, sizeof label, "[%lld, %lld] %s", (long long)r, (long long)c, layout_name[L]);
          t.label = label;
          t.op = (kiln__kop)op;
          t.n_in = 2;
          t.n_out = 1;
          t.in[0] = in_layout(L, dt, r, c, 0);
          t.in[1] = in_layout(L, dt, r, c, 1);
          if (cmp) { /* small integers, so that equality happens */
            t.in[0] = filled(t.in[0], F_INT, 0, 3);
            t.in[1] = filled(t.in[1], F_INT, 0, 3);
          }
          if (op == KILN__K_DIV && !is_float(dt)) t.in[1] = filled(t.in[1], F_INT, 1, 7);
          if (op == KILN__K_POW) {
            t.in[0] = filled(t.in[0], is_float(dt) ? F_UNIFORM : F_INT, is_float(dt) ? 0.5 : -3, is_float(dt) ? 2 : 3);
            t.in[1] = filled(t.in[1], is_float(dt) ? F_UNIFORM : F_INT, is_float(dt) ? -2 : 0, is_float(dt) ? 2 : 5);
          }
          t.out[0] = out_layout(L, cmp ? KILN_BOOL : dt, r, c);
          t.s[0] = (op == KILN__K_ADD && L == L_TRANS) ? (is_float(dt) ? 0.5 : 3) : 1.0;
          run_case(&t);
        }
      }
    }
  }
  for (size_t di = 0; di < sizeof ALL / sizeof ALL[0]; di++) {
    for (int L = 0; L < L_COUNT; L++) {
      kiln_dtype dt = ALL[di];
      tcase t;
      memset(&t, 0, sizeof t);
      t.label = layout_name[L];
      t.op = KILN__K_WHERE;
      t.n_in = 3;
      t.n_out = 1;
      t.in[0] = filled(in_layout(L, KILN_BOOL, 37, 129, 0), F_BOOL, 0, 1);
      t.in[1] = in_layout(L, dt, 37, 129, 1);
      t.in[2] = in_layout(L, dt, 37, 129, 2);
      t.out[0] = out_layout(L, dt, 37, 129);
      run_case(&t);
    }
  }
}

static void memory_op_cases(void) {
  /* casts between every pair, values every dtype can hold */
  for (size_t a = 0; a < 8; a++) {
    for (size_t b = 0; b < 8; b++) {
      for (int L = 0; L < 2; L++) {
        tcase t;
        memset(&t, 0, sizeof t);
        t.label = L ? "transposed in" : "contiguous";
        t.op = KILN__K_COPY;
        t.n_in = 1;
        t.n_out = 1;
        t.in[0] = filled(in_layout(L == 0 ? L_CONTIG : L_TRANS, ALL[a], 37, 129, 0), F_INT, 0, 50);
        if (is_float(ALL[a]) && is_float(ALL[b])) t.in[0].fill = F_NORMAL;
        t.out[0] = c2(ALL[b], 37, 129);
        run_case(&t);
      }
    }
  }
  for (size_t a = 0; a < 8; a++) {
    tcase t;
    memset(&t, 0, sizeof t);
    t.label = "[37, 129] transposed";
    t.op = KILN__K_FILL;
    t.n_out = 1;
    t.out[0] = trans2(ALL[a], 37, 129);
    t.s[0] = is_float(ALL[a]) ? 1.5 : 3;
    run_case(&t);
    t.label = "[1000]";
    t.op = KILN__K_ARANGE;
    t.out[0] = c1(ALL[a], ALL[a] == KILN_U8 || ALL[a] == KILN_BOOL ? 100 : 1000);
    t.s[0] = is_float(ALL[a]) ? -3.0 : 0;
    t.s[1] = is_float(ALL[a]) ? 0.25 : 1;
    if (ALL[a] == KILN_F16 || ALL[a] == KILN_BF16) t.s[1] = 1;
    if (ALL[a] != KILN_BOOL) run_case(&t);
    t.label = "[5, 7]";
    t.op = KILN__K_EYE;
    t.out[0] = c2(ALL[a], 5, 7);
    run_case(&t);
  }
}

static void random_cases(void) {
  const kiln__kop ops[] = {KILN__K_RAND_UNIFORM, KILN__K_RAND_NORMAL, KILN__K_RAND_INT,
                           KILN__K_RAND_BERNOULLI};
  for (int o = 0; o < 4; o++) {
    for (size_t di = 0; di < 8; di++) {
      kiln_dtype dt = ALL[di];
      if (dt == KILN_BOOL || (o < 2 && !is_float(dt))) continue;
      for (int L = 0; L < 2; L++) {
        tcase t;
        memset(&t, 0, sizeof t);
        t.label = L ? "[33, 17] transposed out" : "[1001]";
        t.op = ops[o];
        t.n_out = 1;
        t.out[0] = L ? trans2(dt, 33, 17) : c1(dt, 1001);
        t.s[0] = o == 3 ? 0.3 : (o == 1 ? 0.5 : -1.0);
        t.s[1] = o == 3 ? 2.0 : 2.0;
        t.i[0] = -5;
        t.i[1] = dt == KILN_U8 ? 250 : 1000003;
        if (dt == KILN_U8) t.i[0] = 0;
        t.seed = 1234567890123ull;
        t.offset = 77;
        run_case(&t);
      }
    }
  }
}

/* ---- reductions ---- */
static void reduce_cases(void) {
  const kiln__kop ops[] = {KILN__K_SUM, KILN__K_PROD, KILN__K_AMAX, KILN__K_AMIN};
  struct { int64_t shape[3]; unsigned mask; const char *label; bool trans; } rs[] = {
      {{7, 33, 65}, 4, "[7,33,65] dim 2", false},
      {{7, 33, 65}, 1, "[7,33,65] dim 0", false},
      {{7, 33, 65}, 2, "[7,33,65] dim 1", false},
      {{7, 33, 65}, 5, "[7,33,65] dims 0,2", false},
      {{7, 33, 65}, 7, "[7,33,65] all", false},
      {{1, 33, 65}, 4, "[33,65]^T dim 2", true},
      {{3, 200000, 1}, 2, "[3,200000,1] dim 1 (split)", false},
      {{1, 100000, 3}, 2, "[100000,3] dim 0 (cols split)", false},
      {{2, 0, 5}, 2, "[2,0,5] dim 1 (empty)", false},
      {{1, 1, 1}, 7, "[1,1,1] all", false},
  };
  for (int o = 0; o < 4; o++) {
    for (size_t di = 0; di < 6; di++) {
      kiln_dtype dt = ALL[di];
      for (size_t k = 0; k < sizeof rs / sizeof rs[0]; k++) {
        if ((o >= 2) && rs[k].shape[1] == 0) continue; /* amax of nothing is an error */
        tcase t;
        memset(&t, 0, sizeof t);
        t.label = rs[k].label;
        t.op = ops[o];
        t.n_in = 1;
        t.n_out = 1;
        t.in[0] = contig(dt, 3, rs[k].shape);
        if (rs[k].trans) {
          t.in[0].strides[1] = 1;
          t.in[0].strides[2] = rs[k].shape[1];
        }
        if (o == 1) t.in[0] = filled(t.in[0], is_float(dt) ? F_UNIFORM : F_INT, is_float(dt) ? 0.95 : -1, is_float(dt) ? 1.05 : 1);
        int64_t os[3];
        for (int d = 0; d < 3; d++) os[d] = (rs[k].mask >> d) & 1 ? 1 : rs[k].shape[d];
        t.out[0] = contig(dt, 3, os);
        t.i[0] = rs[k].mask;
        /* f32 sums/products of 1e5 terms in another order: allow the accumulated rounding */
        t.tol_scale = (o <= 1 && rs[k].shape[1] >= 100000) ? 10 : 1;
        if (o == 1 && rs[k].mask == 7) t.tol_scale = 10; /* a product of 15015 terms */
        run_case(&t);
      }
    }
  }
  for (int mx = 0; mx < 2; mx++) {
    for (size_t di = 0; di < 6; di++) {
      for (int dim = 0; dim < 3; dim++) {
        kiln_dtype dt = ALL[di];
        tcase t;
        memset(&t, 0, sizeof t);
        const char *labels[] = {"[7,33,65] dim 0 (ties)", "[7,33,65] dim 1 (ties)", "[7,33,65] dim 2 (ties)"};
        t.label = labels[dim];
        t.op = mx ? KILN__K_MAX_DIM : KILN__K_MIN_DIM;
        t.n_in = 1;
        t.n_out = 2;
        int64_t sh[3] = {7, 33, 65}, os[3] = {7, 33, 65};
        os[dim] = 1;
        t.in[0] = filled(contig(dt, 3, sh), F_INT, -3, 3);
        t.out[0] = contig(dt, 3, os);
        t.out[1] = contig(KILN_I64, 3, os);
        t.i[1] = dim;
        run_case(&t);
      }
    }
  }
}

/* ---- softmax and cross entropy ---- */
static void softmax_cases(void) {
  struct { int64_t r, c; int dim; bool trans; const char *label; } ss[] = {
      {13, 77, 1, false, "[13,77] dim 1"},   {13, 77, 0, false, "[13,77] dim 0"},
      {4, 3000, 1, false, "[4,3000] dim 1"}, {13, 77, 1, true, "[13,77]^T dim 1"},
      {2000, 5, 0, false, "[2000,5] dim 0"}, {1, 1, 1, false, "[1,1]"},
      {0, 4, 1, false, "[0,4]"},
  };
  for (int op = KILN__K_SOFTMAX; op <= KILN__K_LOG_SOFTMAX_BACKWARD; op++) {
    for (size_t di = 0; di < 4; di++) {
      for (size_t k = 0; k < sizeof ss / sizeof ss[0]; k++) {
        kiln_dtype dt = FLOATS[di];
        tcase t;
        memset(&t, 0, sizeof t);
        t.label = ss[k].label;
        t.op = (kiln__kop)op;
        bool bw = op >= KILN__K_SOFTMAX_BACKWARD;
        t.n_in = bw ? 2 : 1;
        t.n_out = 1;
        t.in[0] = ss[k].trans ? trans2(dt, ss[k].r, ss[k].c) : c2(dt, ss[k].r, ss[k].c);
        t.in[0] = filled(t.in[0], F_NORMAL, -4, 4);
        if (op == KILN__K_SOFTMAX_BACKWARD) t.in[0] = filled(t.in[0], F_UNIFORM, 0, 0.2);
        if (op == KILN__K_LOG_SOFTMAX_BACKWARD) t.in[0] = filled(t.in[0], F_UNIFORM, -6, -0.5);
        if (bw) t.in[1] = c2(dt, ss[k].r, ss[k].c);
        t.out[0] = c2(dt, ss[k].r, ss[k].c);
        t.i[0] = ss[k].dim;
        /* long rows: the sum for the backward rules is accumulated in another order */
        t.tol_scale = ss[k].c >= 3000 ? 4 : 1;
        run_case(&t);
      }
    }
  }
  struct { int64_t n, c; double eps; bool ignore; const char *label; } cs[] = {
      {37, 11, 0.0, false, "[37,11]"},
      {37, 11, 0.1, true, "[37,11] smoothing, ignore"},
      {8, 5000, 0.0, false, "[8,5000]"},
      {0, 7, 0.0, false, "[0,7]"},
      {3000, 5, 0.0, true, "[3000,5] ignore (several blocks)"},
      {1500, 40, 0.0, false, "[1500,40] (several blocks)"},
  };
  for (size_t di = 0; di < 4; di++) {
    for (size_t k = 0; k < sizeof cs / sizeof cs[0]; k++) {
      for (int it = 0; it < 2; it++) {
        /* CE, its backward, the mean, backward / count; then the forwards with dlogits (flag
        ** i1 & 1, the last output): CE with the weight and a transposed dlogits, CE without
        ** the weight, the mean (one block counts the kept rows itself; several: ce_count) */
        for (int bw = 0; bw < 7; bw++) {
          kiln_dtype dt = FLOATS[di], lt = dt == KILN_F64 ? KILN_F64 : KILN_F32;
          kiln_dtype tdt = it ? KILN_I32 : KILN_I64;
          tcase t;
          memset(&t, 0, sizeof t);
          char label[64];
          snprintf(label, sizeof label, "%s%s", cs[k].label, bw >= 4 ? " +dlogits" : "");
          t.label = label;
          t.i[0] = -100;
          t.s[0] = cs[k].eps;
          tspec logits = filled(c2(dt, cs[k].n, cs[k].c), F_NORMAL, -6, 6);
          tspec target = filled(c1(tdt, cs[k].n), F_INT, cs[k].ignore ? -1 : 0, (double)cs[k].c - 1);
          if (bw == 0 || bw == 4 || bw == 5) {
            t.op = KILN__K_CROSS_ENTROPY;
            t.n_in = 2;
            t.n_out = 2;
            t.in[0] = logits;
            t.in[1] = target;
            t.out[0] = c1(lt, cs[k].n);
            t.out[1] = c1(lt, cs[k].n);
            if (bw == 4) t.out[t.n_out++] = c1(lt, cs[k].n); /* the weight */
            if (bw >= 4) {
              t.out[t.n_out++] = bw == 4 ? trans2(dt, cs[k].n, cs[k].c) : c2(dt, cs[k].n, cs[k].c);
              t.i[1] = 1;
            }
          } else if (bw == 2 || bw == 6) {
            t.op = KILN__K_CROSS_ENTROPY_MEAN;
            t.n_in = 2;
            t.n_out = 3;
            t.in[0] = logits;
            t.in[1] = target;
            t.out[0] = c1(lt, 1);
            t.out[1] = c1(lt, cs[k].n);
            t.out[2] = c1(lt, 1);
            t.tol_scale = 4; /* a sum over rows in another order */
            if (bw == 6) {
              t.n_out = 4;
              t.out[3] = c2(dt, cs[k].n, cs[k].c);
              t.i[1] = 1;
            }
          } else {
            t.op = KILN__K_CROSS_ENTROPY_BACKWARD;
            t.n_in = bw == 3 ? 5 : 4;
            t.n_out = 1;
            t.in[0] = logits;
            t.in[1] = target;
            t.in[2] = filled(c1(lt, cs[k].n), F_UNIFORM, 3, 9);
            t.in[3] = c1(lt, cs[k].n);
            if (bw == 3) { /* the mean's count, one value broadcast over the rows */
              t.in[4] = filled(c1(lt, cs[k].n), F_UNIFORM, 2, 40);
              t.in[4].strides[0] = 0;
              t.in[4].base_n = 1;
            }
            t.out[0] = c2(dt, cs[k].n, cs[k].c);
          }
          /* ignore_index -1 (the fill makes some targets -1) */
          if (cs[k].ignore) t.i[0] = -1;
          run_case(&t);
        }
      }
    }
  }
}

/* ---- matmul ---- */
static void matmul_cases(void) {
  struct { int64_t m, k, n; const char *label; } ms[] = {
      {33, 47, 29, "33x47 @ 47x29"}, {1, 64, 1, "1x64 @ 64x1"}, {128, 256, 64, "128x256 @ 256x64"},
      {5, 0, 7, "5x0 @ 0x7"}, {0, 4, 3, "0x4 @ 4x3"},
      /* the small kernels' shapes: tiny K, thin (N <= 8), thin transposed (M <= 8) */
      {128, 2, 128, "128x2 @ 2x128 (tiny K)"}, {7, 16, 40, "7x16 @ 16x40 (tiny K=16)"},
      {128, 128, 2, "128x128 @ 128x2 (thin)"}, {37, 300, 3, "37x300 @ 300x3 (thin)"},
      {2, 128, 128, "2x128 @ 128x128 (thin^T)"}, {3, 512, 200, "3x512 @ 512x200 (thin^T, K=512)"},
      {40, 17, 9, "40x17 @ 17x9 (tiles)"},
      /* past the one-launch kernel's limits: cuBLAS(Lt) */
      {300, 100, 200, "300x100 @ 100x200 (cublas)"}, {8, 1024, 8, "8x1024 @ 1024x8 (cublas)"},
  };
  for (size_t di = 0; di < 4; di++) {
    kiln_dtype dt = FLOATS[di];
    double tol = dt == KILN_F32 ? 10 : (dt == KILN_F64 ? 100 : 1);
    for (size_t k = 0; k < sizeof ms / sizeof ms[0]; k++) {
      for (int variant = 0; variant < 7; variant++) {
        int64_t M = ms[k].m, K = ms[k].k, N = ms[k].n;
        tcase t;
        memset(&t, 0, sizeof t);
        char label[96];
        const char *vn[] = {"", " A^T", " B^T", " A step 2", " out^T", " bias a=2 b=.5", " tf32"};
        snprintf(label, sizeof label, "%s%s", ms[k].label, vn[variant]);
        t.label = label;
        t.op = KILN__K_MATMUL;
        t.n_in = 2;
        t.n_out = 1;
        t.in[0] = variant == 1 ? trans2(dt, M, K) : variant == 3 ? step2(dt, M, K) : c2(dt, M, K);
        t.in[1] = variant == 2 ? trans2(dt, K, N) : c2(dt, K, N);
        t.out[0] = variant == 4 ? trans2(dt, M, N) : c2(dt, M, N);
        t.s[0] = 1;
        t.s[1] = 0;
        t.tol_scale = tol;
        if (variant == 5) {
          t.n_in = 3;
          t.in[2] = c1(dt, N);
          t.s[0] = 2;
          t.s[1] = 0.5;
        }
        if (variant == 6) {
          if (dt != KILN_F32) continue;
          t.i[0] = 1;
          t.tol_scale = 2000; /* TF32 keeps 10 mantissa bits */
        }
        run_case(&t);
      }
    }
    /* the row-sum output (a linear layer's dW = g^T x with db): A transposed, as g^T is,
    ** and contiguous; the epilogue path and the plain one must agree with the CPU */
    struct { int64_t m, k, n; bool trans; const char *label; } rs[] = {
        {128, 128, 64, true, "rowsum g^T[128,128]@x[128,64]"}, {2, 128, 128, true, "rowsum g^T[2,128]@h"},
        {33, 47, 29, false, "rowsum 33x47 @ 47x29"}, {6, 0, 5, true, "rowsum K=0"},
        {64, 1024, 32, true, "rowsum K=1024 (cuBLASLt BGRADB)"},
        {128, 2, 128, true, "rowsum K=2 (tiny K)"}, {128, 128, 2, true, "rowsum thin N=2"},
        {37, 300, 5, false, "rowsum thin 37x300 @ 300x5"}, {5, 40, 100, false, "rowsum thin^T 5x40"},
        /* col_sums: several strips of 256 or 128 rows, each in many chunks */
        {3072, 2048, 16, true, "rowsum g^T[3072,2048] (strips x chunks)"}};
    for (size_t k = 0; k < sizeof rs / sizeof rs[0]; k++) {
      tcase t;
      memset(&t, 0, sizeof t);
      t.label = rs[k].label;
      t.op = KILN__K_MATMUL;
      t.n_in = 2;
      t.n_out = 2;
      t.in[0] = rs[k].trans ? trans2(dt, rs[k].m, rs[k].k) : c2(dt, rs[k].m, rs[k].k);
      t.in[1] = c2(dt, rs[k].k, rs[k].n);
      t.out[0] = c2(dt, rs[k].m, rs[k].n);
      t.out[1] = c1(dt, rs[k].m);
      t.s[0] = 1;
      t.tol_scale = tol;
      run_case(&t);
    }
    /* the linear+ReLU flags: ReLU on the output (1), A read through a mask (2), both;
    ** in the one-launch kernel and, past its limits, composed around cuBLAS */
    struct { int64_t m, k, n; const char *label; } fl[] = {{33, 47, 29, "flags 33x47 @ 47x29"},
                                                           {300, 100, 200, "flags 300x100 @ 100x200 (cublas)"},
                                                           {128, 2, 128, "flags 128x2 @ 2x128 (tiny K)"},
                                                           {128, 128, 2, "flags 128x128 @ 128x2 (thin)"},
                                                           {2, 128, 128, "flags 2x128 @ 128x128 (thin^T)"}};
    for (size_t k = 0; k < sizeof fl / sizeof fl[0]; k++)
      for (int flags = 1; flags <= 3; flags++) {
        tcase t;
        memset(&t, 0, sizeof t);
        char label[96];
        snprintf(label, sizeof label, "%s relu %d mask %d", fl[k].label, flags & 1, (flags >> 1) & 1);
        t.label = label;
        t.op = KILN__K_MATMUL;
        t.n_in = 3;
        t.n_out = 1;
        /* A (and its mask) transposed as a gradient g^T is, or contiguous, by turns */
        t.in[0] = k % 2 ? c2(dt, fl[k].m, fl[k].k) : trans2(dt, fl[k].m, fl[k].k);
        t.in[1] = c2(dt, fl[k].k, fl[k].n);
        t.in[2] = c1(dt, fl[k].n); /* bias */
        if (flags & 2) { /* the mask, last: where(mask > 0, A, 0) */
          t.n_in = 4;
          t.in[3] = k % 2 ? c2(dt, fl[k].m, fl[k].k) : trans2(dt, fl[k].m, fl[k].k);
        }
        t.out[0] = c2(dt, fl[k].m, fl[k].n);
        t.s[0] = 1;
        t.i[1] = flags;
        t.tol_scale = tol;
        run_case(&t);
      }
    /* batched: uniform strides, a broadcast operand, a batch that is not collapsible */
    for (int variant = 0; variant < 5; variant++) {
      tcase t;
      memset(&t, 0, sizeof t);
      const char *vn[] = {"[3,17,19]@[3,19,23]", "[3,17,19]@bcast[19,23]", "[2,3,..] permuted batch",
                          "[3,17,19]@[3,19,23]+bias", "[4,128,96]@[4,96,128] (cublas)"};
      t.label = vn[variant];
      t.op = KILN__K_MATMUL;
      t.n_in = variant == 3 ? 3 : 2;
      t.n_out = 1;
      t.s[0] = 1;
      t.tol_scale = tol;
      if (variant == 2) {
        t.in[0] = contig(dt, 4, (int64_t[]){2, 3, 17, 19});
        t.in[1] = contig(dt, 4, (int64_t[]){2, 3, 19, 23});
        /* batch dims swapped in memory: (3, 2) buffer read as (2, 3) */
        t.in[0].strides[0] = 17 * 19;
        t.in[0].strides[1] = 2 * 17 * 19;
        t.out[0] = contig(dt, 4, (int64_t[]){2, 3, 17, 23});
      } else if (variant == 4) {
        t.in[0] = contig(dt, 3, (int64_t[]){4, 128, 96});
        t.in[1] = contig(dt, 3, (int64_t[]){4, 96, 128});
        t.out[0] = contig(dt, 3, (int64_t[]){4, 128, 128});
      } else {
        t.in[0] = contig(dt, 3, (int64_t[]){3, 17, 19});
        t.in[1] = contig(dt, 3, (int64_t[]){3, 19, 23});
        if (variant == 1) t.in[1] = bcast0(t.in[1]);
        t.out[0] = contig(dt, 3, (int64_t[]){3, 17, 23});
        if (variant == 3) t.in[2] = c1(dt, 23);
      }
      run_case(&t);
    }
  }
}

/* ---- index ops ---- */
static void index_cases(void) {
  for (size_t di = 0; di < 8; di++) {
    kiln_dtype dt = ALL[di];
    for (int it = 0; it < 2; it++) {
      kiln_dtype idt = it ? KILN_I32 : KILN_I64;
      for (int dim = 0; dim < 2; dim++) {
        tcase t;
        memset(&t, 0, sizeof t);
        const char *l1[] = {"src [20,9] dim 0", "src [20,9] dim 1"};
        t.label = l1[dim];
        t.op = KILN__K_INDEX_SELECT;
        t.n_in = 2;
        t.n_out = 1;
        t.in[0] = c2(dt, 20, 9);
        int64_t len = 13;
        t.in[1] = filled(c1(idt, len), F_INT, 0, dim ? 8 : 19);
        t.out[0] = dim ? c2(dt, 20, len) : c2(dt, len, 9);
        t.i[0] = dim;
        run_case(&t);
        t.op = KILN__K_INDEX_ADD; /* repeated indices accumulate */
        t.in[0] = dim ? c2(dt, 20, len) : trans2(dt, len, 9);
        t.out[0] = c2(dt, 20, 9);
        run_case(&t);
        t.label = dim ? "[6,10] <- index [6,4] dim 1" : "[10,6] <- index [4,6] dim 0";
        t.op = KILN__K_GATHER;
        t.in[0] = dim ? c2(dt, 6, 10) : c2(dt, 10, 6);
        t.in[1] = filled(dim ? c2(idt, 6, 4) : trans2(idt, 4, 6), F_INT, 0, 9);
        t.out[0] = dim ? c2(dt, 6, 4) : c2(dt, 4, 6);
        run_case(&t);
        t.op = KILN__K_SCATTER_ADD;
        t.in[0] = dim ? c2(dt, 6, 4) : c2(dt, 4, 6);
        t.out[0] = dim ? c2(dt, 6, 10) : c2(dt, 10, 6);
        run_case(&t);
      }
    }
  }
}

/* ---- machinery ---- */
#define CHECK(cond, name, ...)                                                            \
  do {                                                                                    \
    bool ok_ = (cond);                                                                    \
    printf("%-4s %-22s ", ok_ ? "ok" : "FAIL", name);                                     \
    printf(__VA_ARGS__);                                                                  \
    if (!ok_) printf(" [last error: %s]", kiln_last_error_message());                     \
    printf("\n");                                                                         \
    if (ok_) n_ok++;                                                                      \
    else n_fail++;                                                                        \
  } while (0)

static void allocator_tests(void) {
  kiln_memory_stats s0, s1, s2;
  GPU->empty_cache(0);
  GPU->memory_stats(0, &s0);
  void *a = GPU->alloc(0, 1000);
  void *b = GPU->alloc(0, 4 << 20); /* a multiple of 2 MiB: no unsplit remainder */
  GPU->memory_stats(0, &s1);
  CHECK(a && b && s1.allocated == s0.allocated + 1024 + (4 << 20), "alloc stats",
        "allocated %lld -> %lld (1000 B rounds to 1024, 4 MiB stays)", (long long)s0.allocated,
        (long long)s1.allocated);
  CHECK(s1.num_allocs == s0.num_allocs + 2 && s1.reserved >= s1.allocated && s1.peak_allocated >= s1.allocated,
        "alloc stats", "num_allocs +2, reserved %lld >= allocated, peak %lld", (long long)s1.reserved,
        (long long)s1.peak_allocated);
  GPU->free(0, b, 4 << 20);
  void *c = GPU->alloc(0, 4 << 20);
  GPU->memory_stats(0, &s2);
  CHECK(c == b && s2.num_device_allocs == s1.num_device_allocs, "cache reuse",
        "a freed 4 MiB block is served again without cudaMalloc");
  void *d1 = GPU->alloc(0, 512), *d2 = GPU->alloc(0, 512);
  CHECK(d1 && d2 && (char *)d2 - (char *)d1 != 0, "small split", "two 512 B blocks from one segment");
  GPU->free(0, a, 0);
  GPU->free(0, c, 0);
  GPU->free(0, d1, 0);
  GPU->free(0, d2, 0);
  GPU->memory_stats(0, &s1);
  GPU->empty_cache(0);
  GPU->memory_stats(0, &s2);
  CHECK(s2.reserved < s1.reserved && s2.allocated == s0.allocated, "empty_cache",
        "reserved %lld -> %lld once everything is freed", (long long)s1.reserved, (long long)s2.reserved);

  /* the limit, an OOM, then recovery */
  GPU->set_memory_limit(0, s2.reserved + (64 << 20));
  void *big = GPU->alloc(0, (size_t)100 << 20);
  kiln_status e = kiln_last_error();
  GPU->memory_stats(0, &s1);
  CHECK(!big && e == KILN_ERR_OOM && s1.num_ooms == s2.num_ooms + 1 &&
            strstr(kiln_last_error_message(), "out of memory on cuda:0"),
        "limit -> OOM", "100 MiB over a 64 MiB limit fails: %.120s", kiln_last_error_message());
  void *fits = GPU->alloc(0, (size_t)48 << 20);
  CHECK(fits != NULL, "OOM recovery", "48 MiB under the limit works after the OOM");
  void *more = GPU->alloc(0, (size_t)48 << 20);
  CHECK(more == NULL, "limit holds", "a second 48 MiB passes the limit");
  GPU->free(0, fits, 0);
  more = GPU->alloc(0, (size_t)48 << 20);
  CHECK(more != NULL, "free then retry", "after freeing, the same request succeeds");
  GPU->free(0, more, 0);
  GPU->set_memory_limit(0, 0);
  void *huge = GPU->alloc(0, (size_t)1 << 46); /* 64 TiB: cudaMalloc refuses */
  e = kiln_last_error();
  void *after = GPU->alloc(0, 1 << 20);
  CHECK(!huge && e == KILN_ERR_OOM && after, "device OOM", "64 TiB fails cleanly, 1 MiB then works");
  GPU->free(0, after, 0);
  kiln_memory_stats s3;
  GPU->memory_stats(0, &s3);
  GPU->reset_peak(0);
  GPU->memory_stats(0, &s1);
  CHECK(s1.peak_allocated == s1.allocated, "reset_peak", "peak %lld == allocated", (long long)s1.peak_allocated);
}

static kiln__kargs add_args(void *out, void *x, void *y, int64_t n) {
  kiln__kargs a;
  memset(&a, 0, sizeof a);
  a.op = KILN__K_ADD;
  a.n_in = 2;
  a.n_out = 1;
  kiln__view v;
  memset(&v, 0, sizeof v);
  v.dtype = KILN_F32;
  v.ndim = 1;
  v.shape[0] = n;
  v.strides[0] = 1;
  a.in[0] = v;
  a.in[1] = v;
  a.out[0] = v;
  a.in[0].data = x;
  a.in[1].data = y;
  a.out[0].data = out;
  a.s[0] = 1;
  return a;
}

static void graph_tests(void) {
  const int64_t n = 100003;
  float *h = malloc((size_t)n * 4), *r = malloc((size_t)n * 4);
  for (int64_t i = 0; i < n; i++) h[i] = (float)(i % 97) * 0.5f;
  float *z = GPU->alloc(0, (size_t)n * 4), *x = GPU->alloc(0, (size_t)n * 4);
  float *tmp = GPU->alloc(0, (size_t)n * 4);
  GPU->copy_from_host(0, x, h, (size_t)n * 4);
  GPU->memset_zero(0, z, (size_t)n * 4);
  /* the step: tmp = x + x; z = z + tmp   (so z grows by 2x per replay) */
  kiln__kargs a1 = add_args(tmp, x, x, n), a2 = add_args(z, z, tmp, n);
  GPU->free(0, tmp, 0); /* freed before capture: the cache serves it again inside */
  GPU->synchronize(0);
  kiln_status st = kiln__cuda_graph_begin(0);
  void *t2 = GPU->alloc(0, (size_t)n * 4); /* cached: allowed */
  a1.out[0].data = t2;
  a2.in[1].data = t2;
  if (st == KILN_OK) st = GPU->kernels[KILN__K_ADD](&a1);
  if (st == KILN_OK) st = GPU->kernels[KILN__K_ADD](&a2);
  /* not in the cache: a new segment, taken with the capture mode relaxed for the call */
  void *uncached = GPU->alloc(0, (size_t)3 << 30);
  kiln_status e1 = uncached ? KILN_OK : kiln_last_error();
  float probe;
  kiln_status e2 = GPU->copy_to_host(0, &probe, z, 4);
  GPU->free(0, t2, 0);
  if (uncached) GPU->free(0, uncached, 0); /* freed inside: the graph keeps it */
  void *exec = NULL;
  kiln_status se = kiln__cuda_graph_end(0, &exec);
  CHECK(st == KILN_OK && se == KILN_OK && exec, "graph capture", "two adds captured");
  CHECK(uncached && e1 == KILN_OK, "graph capture", "an uncached allocation inside takes a new segment");
  CHECK(e2 == KILN_ERR_STATE, "graph capture", "a copy to the host inside is refused");
  /* a block the graph uses must not be handed out while the graph lives */
  void *other = GPU->alloc(0, (size_t)n * 4);
  CHECK(other != t2, "graph memory", "the graph's temporary is not reused by others");
  for (int k = 0; k < 10 && se == KILN_OK; k++) st = kiln__cuda_graph_launch(0, exec);
  GPU->copy_to_host(0, r, z, (size_t)n * 4);
  bool good = st == KILN_OK;
  for (int64_t i = 0; i < n && good; i++) good = r[i] == 20.0f * h[i];
  CHECK(good, "graph replay", "10 replays give z = 20 x");
  kiln__cuda_graph_free(exec);
  GPU->free(0, other, 0);
  GPU->free(0, z, 0);
  GPU->free(0, x, 0);
  free(h);
  free(r);
}

static void index_flag_tests(void) {
  int64_t idx[3] = {0, 25, 1};
  float *src = GPU->alloc(0, 20 * 9 * 4), *out = GPU->alloc(0, 3 * 9 * 4);
  int64_t *di = GPU->alloc(0, sizeof idx);
  GPU->memset_zero(0, src, 20 * 9 * 4);
  GPU->copy_from_host(0, di, idx, sizeof idx);
  kiln__kargs a;
  memset(&a, 0, sizeof a);
  a.op = KILN__K_INDEX_SELECT;
  a.n_in = 2;
  a.n_out = 1;
  a.in[0] = (kiln__view){src, KILN_F32, 2, {20, 9}, {9, 1}};
  a.in[1] = (kiln__view){di, KILN_I64, 1, {3}, {1}};
  a.out[0] = (kiln__view){out, KILN_F32, 2, {3, 9}, {9, 1}};
  kiln_status q = GPU->kernels[KILN__K_INDEX_SELECT](&a);
  kiln_status s = GPU->synchronize(0);
  CHECK(q == KILN_OK && s == KILN_ERR_INDEX && strstr(kiln_last_error_message(), "index_select"),
        "index error flag", "index 25 of 20: %s", kiln_last_error_message());
  CHECK(GPU->synchronize(0) == KILN_OK, "index error flag", "the flag is cleared once reported");
  GPU->free(0, src, 0);
  GPU->free(0, out, 0);
  GPU->free(0, di, 0);
}

static void info_tests(void) {
  kiln__cuda_info info;
  kiln_status s = kiln__cuda_device_info(0, &info);
  CHECK(s == KILN_OK && info.name[0] && info.major >= 1 && info.total_mem > 0, "device info",
        "%s, sm_%d%d, %d SMs, %.1f GiB, driver %d, runtime %d, cuBLAS %d", info.name, info.major,
        info.minor, info.multiprocessors, info.total_mem / 1073741824.0, info.driver_version,
        info.runtime_version, info.cublas_version);
  double h2d = 0, d2h = 0;
  s = kiln__cuda_bandwidth(0, &h2d, &d2h);
  CHECK(s == KILN_OK && h2d > 0.5 && d2h > 0.5, "bandwidth", "host->device %.1f GB/s, device->host %.1f GB/s", h2d, d2h);
}

int main(void) {
  const char *why = NULL;
  if (GPU->probe(&why) != KILN_OK) {
    printf("skip: CUDA backend not available: %s\n", why ? why : "?");
    return 77;
  }
  printf("cuda devices: %d\n", GPU->device_count());
  info_tests();
  allocator_tests();
  graph_tests();
  index_flag_tests();
  memory_op_cases();
  random_cases();
  unary_cases();
  unary_backward_cases();
  binary_cases();
  reduce_cases();
  softmax_cases();
  matmul_cases();
  index_cases();
  printf("\n%d passed, %d failed, %d skipped\n", n_ok, n_fail, n_skip);
  return n_fail ? 1 : 0;
}
#endif /* KILN_HAVE_CUDA */
