/*
** The op test harness; harness.h says what it checks and the tolerance rule.
*/
#include "harness.h"

#include "backend_testdev.h"
#include "core/kiln_int.h"

#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#define H_MAX_DEVS 16
#define H_MAX_ROWS 256
#define H_NDT 4 /* the support table's dtypes: f32 f64 f16 bf16 */

/* A row of the support table: one case, each backend slot and dtype a cell. */
typedef struct support_row {
  char name[48];
  char cell[KILN__MAX_BACKENDS][H_NDT]; /* 'Y' native, 'F' fell back, 'X' failed, '-' no dtype, 0 not run */
  char fell[KILN__MAX_BACKENDS][192];   /* kernel ops that fell back, comma separated */
  bool from_tables[KILN__MAX_BACKENDS]; /* judged from the kernel table, not run */
} support_row;

static struct {
  const char *name;
  int passed, failed;
  bool cross_only;
  const char *only_backend; /* KILN_TEST_DEVICE=<name>: part (d) on that backend only */
  int n_devs;               /* part (d)'s devices: every registered non-CPU backend's */
  kiln_device devs[H_MAX_DEVS];
  bool devs_test[H_MAX_DEVS]; /* a test-only backend: fallback allowed (see part (d)) */
  bool support;               /* KILN_HARNESS_SUPPORT=1 / --support: the table, no checks */
  bool has_native;            /* h_set_native_type: H_CPU_ONLY is strict on native_type */
  kiln_device_type native_type;
  int n_rows;
  support_row rows[H_MAX_ROWS];
  uint64_t rng;
} H = {.name = "test", .rng = 0x9e3779b97f4a7c15ull};

/* ---------------------------------------------------------------- host RNG, shapes */

uint64_t h_rand_u64(void) {
  uint64_t z = (H.rng += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

double h_rand_uniform(void) { return (double)(h_rand_u64() >> 11) * (1.0 / 9007199254740992.0); }

double h_rand_normal(void) {
  double u1 = h_rand_uniform(), u2 = h_rand_uniform();
  if (u1 < 1e-300) u1 = 1e-300;
  return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

double h_round_to(double x, kiln_dtype dt) {
  switch (dt) {
  case KILN_F32: return (double)(float)x;
  case KILN_F16: return (double)kiln_f16_to_f32(kiln_f32_to_f16((float)x));
  case KILN_BF16: return (double)kiln_bf16_to_f32(kiln_f32_to_bf16((float)x));
  case KILN_I32:
  case KILN_I64: return nearbyint(x);
  default: return x;
  }
}

int64_t h_numel(int ndim, const int64_t *shape) {
  int64_t n = 1;
  for (int i = 0; i < ndim; i++) n *= shape[i];
  return n;
}

bool h_broadcast_shape(int na, const int64_t *sa, int nb, const int64_t *sb, int *nout,
                       int64_t *out) {
  int n = na > nb ? na : nb;
  for (int i = 0; i < n; i++) {
    int64_t a = i < n - na ? 1 : sa[i - (n - na)];
    int64_t b = i < n - nb ? 1 : sb[i - (n - nb)];
    if (a != b && a != 1 && b != 1) return false;
    out[i] = a == 1 ? b : a;
  }
  *nout = n;
  return true;
}

int64_t h_bcast_offset(int n, const int64_t *s, int nout, const int64_t *idx) {
  int64_t off = 0;
  for (int i = 0; i < n; i++) {
    int64_t k = idx[nout - n + i];
    off = off * s[i] + (s[i] == 1 ? 0 : k);
  }
  return off;
}

bool h_next_index(int ndim, const int64_t *shape, int64_t *idx) {
  for (int i = ndim - 1; i >= 0; i--) {
    if (++idx[i] < shape[i]) return true;
    idx[i] = 0;
  }
  return false;
}

const char *h_shape_text(int ndim, const int64_t *shape, char *buf, size_t n) {
  size_t k = 0;
  k += (size_t)snprintf(buf + k, n - k, "[");
  for (int i = 0; i < ndim && k < n; i++)
    k += (size_t)snprintf(buf + k, n - k, "%s%lld", i ? ", " : "", (long long)shape[i]);
  if (k < n) snprintf(buf + k, n - k, "]");
  return buf;
}

/* ---------------------------------------------------------------- checks */

bool h_check_(bool ok, const char *file, int line, const char *fmt, ...) {
  if (ok) {
    H.passed++;
    return true;
  }
  H.failed++;
  fprintf(stdout, "FAIL %s:%d: ", file, line);
  va_list ap;
  va_start(ap, fmt);
  vfprintf(stdout, fmt, ap);
  va_end(ap);
  const char *m = kiln_last_error_message();
  if (m && *m) fprintf(stdout, "  [last error %s: %s]", kiln_error_name(kiln_last_error()), m);
  fprintf(stdout, "\n");
  return false;
}

bool h_expect_err_(bool returned_failure, kiln_status code, const char *file, int line,
                   const char *what) {
  kiln_status got = kiln_last_error();
  const char *msg = kiln_last_error_message();
  bool ok = returned_failure && got == code && msg && *msg;
  h_check_(ok, file, line, "%s: expected failure with %s, got %s (%s) message \"%s\"", what,
           kiln_error_name(code), returned_failure ? "failure" : "success", kiln_error_name(got),
           msg ? msg : "(null)");
  kiln_clear_error();
  return ok;
}

void h_dtype_tol(kiln_dtype dt, double *rtol, double *atol) {
  switch (dt) {
  case KILN_F64: *rtol = 1e-10, *atol = 1e-10; break;
  case KILN_F32: *rtol = 1e-5, *atol = 1e-5; break;
  case KILN_F16: *rtol = 1e-2, *atol = 5e-3; break;
  case KILN_BF16: *rtol = 3e-2, *atol = 3e-2; break;
  default: *rtol = 0, *atol = 0; break;
  }
}

/* Worst element under the rule of harness.h; returns true when all pass. */
static bool close_worst(const double *got, const double *want, int64_t n, double rtol,
                        double atol, double scale_floor, int64_t *worst, double *worst_err,
                        double *worst_tol) {
  double scale = scale_floor;
  for (int64_t i = 0; i < n; i++)
    if (isfinite(want[i]) && fabs(want[i]) > scale) scale = fabs(want[i]);
  bool ok = true;
  double worst_ratio = -1;
  *worst = -1, *worst_err = 0, *worst_tol = 0;
  for (int64_t i = 0; i < n; i++) {
    double g = got[i], w = want[i], err, tol = rtol * fabs(w) + atol * scale;
    if (isnan(w) || isnan(g)) err = (isnan(w) && isnan(g)) ? 0 : INFINITY;
    else if (isinf(w) || isinf(g)) err = (g == w) ? 0 : INFINITY;
    else err = fabs(g - w);
    double ratio = err == 0 ? 0 : (tol > 0 ? err / tol : INFINITY);
    if (err > tol) ok = false;
    if (ratio > worst_ratio) worst_ratio = ratio, *worst = i, *worst_err = err, *worst_tol = tol;
  }
  return ok;
}

bool h_close(const char *what, const double *got, const double *want, int64_t n, double rtol,
             double atol) {
  int64_t wi;
  double we, wt;
  bool ok = close_worst(got, want, n, rtol, atol, 0, &wi, &we, &wt);
  if (ok) {
    H.passed++;
  } else {
    H.failed++;
    printf("FAIL %s: max error %.3g (tol %.3g) at index %lld: got %.10g want %.10g\n", what, we,
           wt, (long long)wi, got[wi], want[wi]);
  }
  return ok;
}

bool h_tensor_close(const char *what, kiln_tensor *t, const double *want, int64_t n, double rtol,
                    double atol) {
  int64_t m = 0;
  double *v = t ? h_values(t, &m) : NULL;
  if (!v || m != n) {
    H_CHECK(false, "%s: %s (numel %lld, want %lld)", what, t ? "could not read values" : "NULL",
            (long long)m, (long long)n);
    free(v);
    return false;
  }
  bool ok = h_close(what, v, want, n, rtol, atol);
  free(v);
  return ok;
}

/* ---------------------------------------------------------------- tensors <-> host */

double *h_values(kiln_tensor *t, int64_t *n) {
  if (!t) return NULL;
  int64_t m = kiln_numel(t);
  double *out = malloc(sizeof(double) * (size_t)(m ? m : 1));
  if (!out) return NULL;
  kiln_scope_begin();
  kiln_tensor *f = kiln_dtype_of(t) == KILN_F64 ? t : kiln_to_dtype(t, KILN_F64);
  kiln_status st = f ? kiln_to_host(f, out, sizeof(double) * (size_t)m) : KILN_ERR_INTERNAL;
  kiln_scope_end();
  if (st != KILN_OK) {
    free(out);
    return NULL;
  }
  if (n) *n = m;
  return out;
}

kiln_tensor *h_tensor(const double *v, int ndim, const int64_t *shape, kiln_dtype dt) {
  kiln_tensor *f = kiln_from_data(v, ndim, shape, KILN_F64, kiln_device_cpu());
  if (!f || dt == KILN_F64) return f;
  kiln_tensor *r = kiln_to_dtype(f, dt);
  kiln_tensor_free(kiln_keep(f));
  return r;
}

/* ---------------------------------------------------------------- variants */

enum vkind { V_CONTIG, V_NONCONTIG, V_EXPAND, V_BCAST0, V_BCAST_RANK, V_SIZE1, V_SIZE0 };

typedef struct variant {
  char name[48];
  enum vkind kind;
  int which; /* input (broadcast variants) or symbol (size variants) */
  int64_t sym[H_MAX_SYM];
} variant;

/* One input as built for a variant: the base buffer and how the view reads it. */
typedef struct vinput {
  int ndim; /* logical */
  int64_t shape[KILN_MAX_DIMS];
  int bndim; /* base */
  int64_t bshape[KILN_MAX_DIMS];
  int64_t lstride[KILN_MAX_DIMS]; /* logical index -> base offset */
  enum vkind view;                /* V_CONTIG, V_NONCONTIG or V_EXPAND */
  kiln_dtype dtype;               /* fixed dtype for index/bool inputs, else F64 */
  bool is_float;
} vinput;

static bool is_float_fill(h_fill f) { return f != H_INDEX && f != H_BOOLS; }

static bool resolve(const h_case *c, const variant *v, int i, vinput *vi) {
  const h_input *in = &c->in[i];
  vi->ndim = in->ndim;
  for (int d = 0; d < in->ndim; d++) {
    int64_t s = in->shape[d];
    if (s < 0) s = v->sym[-1 - s];
    vi->shape[d] = s;
  }
  if (v->kind == V_BCAST0 && v->which == i && vi->ndim > 0) vi->shape[0] = 1;
  if (v->kind == V_BCAST_RANK && v->which == i && vi->ndim > 0) {
    memmove(vi->shape, vi->shape + 1, sizeof(int64_t) * (size_t)(vi->ndim - 1));
    vi->ndim--;
  }
  vi->is_float = is_float_fill(in->fill);
  vi->dtype = in->fill == H_BOOLS ? KILN_BOOL
              : in->fill == H_INDEX ? (in->dtype == KILN_I32 ? KILN_I32 : KILN_I64)
                                    : KILN_F64;
  int n = vi->ndim;
  vi->view = V_CONTIG;
  if (v->kind == V_NONCONTIG && n >= 1 && h_numel(n, vi->shape) > 1) vi->view = V_NONCONTIG;
  if (v->kind == V_EXPAND && n >= 1 && vi->shape[0] > 1) vi->view = V_EXPAND;
  vi->bndim = n;
  memcpy(vi->bshape, vi->shape, sizeof(int64_t) * (size_t)n);
  if (vi->view == V_NONCONTIG && n >= 2) {
    vi->bshape[n - 1] = vi->shape[n - 2], vi->bshape[n - 2] = vi->shape[n - 1];
  } else if (vi->view == V_NONCONTIG) {
    vi->bshape[0] = 2 * vi->shape[0];
  } else if (vi->view == V_EXPAND) {
    vi->bshape[0] = 1;
  }
  int64_t bs[KILN_MAX_DIMS], acc = 1;
  for (int d = n - 1; d >= 0; d--) bs[d] = acc, acc *= vi->bshape[d];
  for (int d = 0; d < n; d++) vi->lstride[d] = bs[d];
  if (vi->view == V_NONCONTIG && n >= 2) {
    vi->lstride[n - 1] = bs[n - 2], vi->lstride[n - 2] = bs[n - 1];
  } else if (vi->view == V_NONCONTIG) {
    vi->lstride[0] = 2;
  } else if (vi->view == V_EXPAND) {
    vi->lstride[0] = 0;
  }
  return true;
}

/* The view a variant feeds to the op, built with public view ops from the base. */
static kiln_tensor *make_view(kiln_tensor *base, const vinput *vi) {
  if (vi->view == V_NONCONTIG && vi->ndim >= 2) return kiln_transpose(base, -1, -2);
  if (vi->view == V_NONCONTIG) return kiln_slice(base, 0, 0, vi->bshape[0], 2);
  if (vi->view == V_EXPAND) return kiln_expand(base, vi->ndim, vi->shape);
  return base;
}

/* Logical C-order values of the view, gathered on the host from the base values. */
static double *logical_values(const vinput *vi, const double *base) {
  int64_t n = h_numel(vi->ndim, vi->shape);
  double *out = malloc(sizeof(double) * (size_t)(n ? n : 1));
  int64_t idx[KILN_MAX_DIMS] = {0};
  for (int64_t k = 0; k < n; k++) {
    int64_t off = 0;
    for (int d = 0; d < vi->ndim; d++) off += idx[d] * vi->lstride[d];
    out[k] = base[off];
    h_next_index(vi->ndim, vi->shape, idx);
  }
  return out;
}

static void fill_base(const h_case *c, const variant *v, int i, const vinput *vi, double *b) {
  const h_input *in = &c->in[i];
  int64_t n = h_numel(vi->bndim, vi->bshape);
  double hi = in->hi_sym ? (double)v->sym[in->hi_sym - 1] : in->hi;
  for (int64_t k = 0; k < n; k++) {
    switch (in->fill) {
    case H_RANDN: b[k] = h_rand_normal() * (in->hi != 0 ? in->hi : 1.0); break;
    case H_UNIFORM: b[k] = in->lo + (in->hi - in->lo) * h_rand_uniform(); break;
    case H_POSITIVE: b[k] = 0.5 + 1.5 * h_rand_uniform(); break;
    case H_INTVAL: b[k] = in->lo + floor((in->hi - in->lo + 1) * h_rand_uniform()); break;
    case H_INDEX: b[k] = in->lo + floor((hi - in->lo) * h_rand_uniform()); break;
    case H_BOOLS: b[k] = h_rand_uniform() < 0.5 ? 1 : 0; break;
    }
  }
}

/* ---------------------------------------------------------------- one run */

typedef struct run_result {
  bool ok;      /* the op returned a tensor */
  bool bwd_ok;  /* backward (when asked) returned KILN_OK */
  kiln_status code;
  char err[256];
  int ndim;
  int64_t shape[KILN_MAX_DIMS];
  kiln_dtype dtype;
  double *out;
  int64_t n_out;
  double *grad[H_MAX_IN]; /* base-shaped; NULL when no gradient came back */
  int64_t n_grad[H_MAX_IN];
} run_result;

static void result_free(run_result *r) {
  free(r->out);
  for (int i = 0; i < H_MAX_IN; i++) free(r->grad[i]);
  memset(r, 0, sizeof *r);
}

/* Builds the inputs from base values on dev in dtype dt (float inputs), runs the builder,
** reads the output; with g, runs backward with upstream g and reads the leaves' grads. */
static void run_once(const h_case *c, const vinput *vis, double *const *bases, kiln_dtype dt,
                     kiln_device dev, const double *g, run_result *r) {
  memset(r, 0, sizeof *r);
  kiln_clear_error();
  kiln_scope_begin();
  kiln_tensor *leaf[H_MAX_IN] = {0}, *view[H_MAX_IN] = {0};
  for (int i = 0; i < c->n_in; i++) {
    const vinput *vi = &vis[i];
    kiln_dtype idt = vi->is_float ? dt : vi->dtype;
    kiln_tensor *b = h_tensor(bases[i], vi->bndim, vi->bshape, idt);
    if (b && dev.type != KILN_DEVICE_CPU) b = kiln_to_device(b, dev);
    if (b && g && c->in[i].diff && kiln_dtype_is_float(idt)) kiln_requires_grad_(b, true);
    leaf[i] = b;
    view[i] = b ? make_view(b, vi) : NULL;
    if (!view[i]) {
      snprintf(r->err, sizeof r->err, "building input %d failed: %s %s", i,
               kiln_error_name(kiln_last_error()), kiln_last_error_message());
      r->code = kiln_last_error();
      kiln_scope_end();
      return;
    }
  }
  kiln_tensor *out = c->fn(view, c->ctx);
  if (!out) {
    r->code = kiln_last_error();
    snprintf(r->err, sizeof r->err, "%s: %s", kiln_error_name(r->code),
             kiln_last_error_message());
    kiln_scope_end();
    return;
  }
  r->ok = true;
  r->ndim = kiln_ndim(out);
  memcpy(r->shape, kiln_shape(out), sizeof(int64_t) * (size_t)r->ndim);
  r->dtype = kiln_dtype_of(out);
  r->out = h_values(out, &r->n_out);
  if (!r->out) {
    r->ok = false;
    snprintf(r->err, sizeof r->err, "reading the output failed: %s", kiln_last_error_message());
  }
  r->bwd_ok = true;
  if (g && r->ok && kiln_dtype_is_float(r->dtype) && kiln_requires_grad(out)) {
    kiln_tensor *gt = h_tensor(g, r->ndim, r->shape, r->dtype);
    if (gt && dev.type != KILN_DEVICE_CPU) gt = kiln_to_device(gt, dev);
    kiln_status st = gt ? kiln_backward(out, gt) : kiln_last_error();
    if (st != KILN_OK) {
      r->bwd_ok = false;
      snprintf(r->err, sizeof r->err, "backward: %s: %s", kiln_error_name(st),
               kiln_last_error_message());
    } else {
      for (int i = 0; i < c->n_in; i++) {
        kiln_tensor *gr = leaf[i] ? kiln_grad(leaf[i]) : NULL;
        if (gr) r->grad[i] = h_values(gr, &r->n_grad[i]);
      }
    }
  } else if (g && r->ok && kiln_dtype_is_float(r->dtype)) {
    /* An output that does not require grad although a float input does is a bug. */
    for (int i = 0; i < c->n_in; i++)
      if (c->in[i].diff && vis[i].is_float) {
        r->bwd_ok = false;
        snprintf(r->err, sizeof r->err, "output does not require grad");
      }
  }
  kiln_scope_end();
}

/* sum(out * g) for the finite differences. */
static double dot_out(const h_case *c, const vinput *vis, double *const *bases, const double *g,
                      int64_t n, bool *ok) {
  run_result r;
  run_once(c, vis, bases, KILN_F64, kiln_device_cpu(), NULL, &r);
  double s = 0;
  if (!r.ok || r.n_out != n) *ok = false;
  else
    for (int64_t k = 0; k < n; k++) s += r.out[k] * g[k];
  result_free(&r);
  return s;
}

/* ---------------------------------------------------------------- reporting */

static void fail_line(const h_case *c, const variant *v, const char *part, kiln_dtype dt,
                      const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 5, 6)))
#endif
    ;
static void fail_line(const h_case *c, const variant *v, const char *part, kiln_dtype dt,
                      const char *fmt, ...) {
  H.failed++;
  printf("FAIL %s [%s] %s %s: ", c->name, v->name, part, kiln_dtype_name(dt));
  va_list ap;
  va_start(ap, fmt);
  vprintf(fmt, ap);
  va_end(ap);
  printf("\n");
}

/* Gradients, and results compared across devices, are judged with an absolute floor
** (scale at least 1): a value that is 0 in exact arithmetic (a gradient, or a loss that
** cancels exactly on one device) comes back from the other as roundoff of O(1) terms. */
static void compare(const h_case *c, const variant *v, const char *part, kiln_dtype dt,
                    const double *got, const double *want, int64_t n, double rtol, double atol) {
  int64_t wi;
  double we, wt;
  /* cross-device parts are named "<device> ..." ("cuda:0 forward"): the only ones with a ':' */
  double floor_ = (strstr(part, "grad") || strchr(part, ':')) ? 1.0 : 0.0;
  if (close_worst(got, want, n, rtol, atol, floor_, &wi, &we, &wt)) {
    H.passed++;
    return;
  }
  fail_line(c, v, part, dt, "max error %.3g (tol %.3g) at index %lld: got %.10g want %.10g", we,
            wt, (long long)wi, got[wi], want[wi]);
}

static bool same_shape(int na, const int64_t *a, int nb, const int64_t *b) {
  if (na != nb) return false;
  for (int i = 0; i < na; i++)
    if (a[i] != b[i]) return false;
  return true;
}

/* ---------------------------------------------------------------- the parts */

static double tol_scale(const h_case *c) { return c->tol_scale > 0 ? c->tol_scale : 1.0; }

/* Rounds the float inputs' base values to dt (copies). */
static void round_bases(const h_case *c, const vinput *vis, double *const *src, double **dst,
                        kiln_dtype dt) {
  for (int i = 0; i < c->n_in; i++) {
    int64_t n = h_numel(vis[i].bndim, vis[i].bshape);
    dst[i] = malloc(sizeof(double) * (size_t)(n ? n : 1));
    for (int64_t k = 0; k < n; k++) {
      double x = src[i][k];
      if (vis[i].is_float && (dt == KILN_I32 || dt == KILN_I64)) x = nearbyint(3 * x);
      dst[i][k] = vis[i].is_float ? h_round_to(x, dt) : x;
    }
  }
}

static void free_bases(int n, double **b) {
  for (int i = 0; i < n; i++) free(b[i]), b[i] = NULL;
}

/* Calls the reference on the logical values of bases. Returns -1 without a reference,
** else the reference's answer; out gets shape and (malloc'd) data. */
static int call_ref(const h_case *c, const vinput *vis, double *const *bases, h_arr *out) {
  if (!c->ref) return -1;
  h_arr in[H_MAX_IN];
  for (int i = 0; i < c->n_in; i++) {
    in[i].ndim = vis[i].ndim;
    memcpy(in[i].shape, vis[i].shape, sizeof in[i].shape);
    in[i].data = logical_values(&vis[i], bases[i]);
  }
  memset(out, 0, sizeof *out);
  int rc = c->ref(in, c->n_in, out, c->ctx);
  if (rc == 0) {
    int64_t n = h_numel(out->ndim, out->shape);
    out->data = calloc((size_t)(n ? n : 1), sizeof(double));
    c->ref(in, c->n_in, out, c->ctx);
  }
  for (int i = 0; i < c->n_in; i++) free(in[i].data);
  return rc;
}

/* ---------------------------------------------------------------- support table */

/* What the observer saw of one run: the kernel calls on the watched device, and for a
** backend that cannot run here (built, no device), what its tables say of the CPU's. */
typedef struct watch {
  kiln_device dev;
  const kiln__backend *judge; /* non-NULL: judge the CPU's calls by this backend's table */
  int n_native, n_fell;
  char fell[160];
} watch;

static void watch_call(void *ctx, kiln_device dev, const kiln__kargs *a, bool native) {
  watch *w = ctx;
  if (!kiln_device_equal(dev, w->dev)) return;
  if (w->judge)
    native = w->judge->kernels[a->op] && (!w->judge->supports || w->judge->supports(a));
  if (native) {
    w->n_native++;
    return;
  }
  w->n_fell++;
  const char *name = kiln__kop_name(a->op);
  char pat[40];
  snprintf(pat, sizeof pat, ",%s,", name);
  char have[170];
  snprintf(have, sizeof have, ",%s,", w->fell);
  if (strstr(have, pat)) return;
  size_t k = strlen(w->fell);
  snprintf(w->fell + k, sizeof w->fell - k, "%s%s", k ? "," : "", name);
}

static support_row *support_row_of(const char *name) {
  for (int i = 0; i < H.n_rows; i++)
    if (strcmp(H.rows[i].name, name) == 0) return &H.rows[i];
  if (H.n_rows == H_MAX_ROWS) return NULL;
  support_row *r = &H.rows[H.n_rows++];
  memset(r, 0, sizeof *r);
  snprintf(r->name, sizeof r->name, "%s", name);
  return r;
}

static void run_once(const h_case *c, const vinput *vis, double *const *bases, kiln_dtype dt,
                     kiln_device dev, const double *g, run_result *r);

/* The contiguous variant, forward and backward, on every backend in each float dtype,
** with the fallback policy silent and the dispatch observer counting what ran where. */
static void support_variant(const h_case *c, const vinput *vis, double *const *bases,
                            const double *g, bool float_out) {
  support_row *row = support_row_of(c->name);
  if (!row) return;
  static const kiln_dtype dts[H_NDT] = {KILN_F32, KILN_F64, KILN_F16, KILN_BF16};
  kiln_fallback_policy saved = kiln_fallback_policy_get();
  kiln_set_fallback_policy(KILN_FALLBACK_SILENT);
  for (int di = 0; di < H_NDT; di++) {
    kiln_dtype dt = dts[di];
    bool skip = (c->flags & H_NO_LOWP) && (dt == KILN_F16 || dt == KILN_BF16);
    double *rb[H_MAX_IN] = {0};
    round_bases(c, vis, bases, rb, dt);
    bool grad = float_out && !(c->flags & H_NO_GRAD);
    run_result rc;
    run_once(c, vis, rb, dt, kiln_device_cpu(), grad ? g : NULL, &rc);
    bool cpu_ok = rc.ok && rc.bwd_ok;
    result_free(&rc);
    for (int bi = 0; bi < kiln__backend_count() && bi < KILN__MAX_BACKENDS; bi++) {
      kiln_device_type t;
      const kiln__backend *b = kiln__backend_at(bi, &t);
      if (skip || !cpu_ok) {
        row->cell[bi][di] = '-';
        continue;
      }
      watch w = {.dev = {t, 0}};
      kiln_device run_on = w.dev;
      if (t != KILN_DEVICE_CPU && kiln_device_count(t) == 0) { /* built, no device here */
        w.dev = run_on = kiln_device_cpu();
        w.judge = b;
        row->from_tables[bi] = true;
      }
      run_result r;
      kiln__dispatch_observe(watch_call, &w);
      run_once(c, vis, rb, dt, run_on, grad ? g : NULL, &r);
      kiln__dispatch_observe(NULL, NULL);
      row->cell[bi][di] = !(r.ok && r.bwd_ok) ? 'X' : w.n_fell ? 'F' : 'Y';
      if (w.n_fell) {
        char *tok = strtok(w.fell, ",");
        for (; tok; tok = strtok(NULL, ",")) {
          char have[200], pat[40];
          snprintf(have, sizeof have, ",%s,", row->fell[bi]);
          for (char *p = have; *p; p++)
            if (*p == ' ') memmove(p, p + 1, strlen(p)); /* ", " separators -> "," */
          snprintf(pat, sizeof pat, ",%s,", tok);
          if (strstr(have, pat)) continue;
          size_t k = strlen(row->fell[bi]);
          snprintf(row->fell[bi] + k, sizeof row->fell[bi] - k, "%s%s", k ? ", " : "", tok);
        }
      }
      result_free(&r);
    }
    free_bases(c->n_in, rb);
  }
  kiln_set_fallback_policy(saved);
  kiln_clear_error();
}

/* The table as Markdown rows (scripts/ops_doc.sh adds the page around them). */
static void support_print(void) {
  int nb = kiln__backend_count();
  if (nb > KILN__MAX_BACKENDS) nb = KILN__MAX_BACKENDS;
  printf("| case |");
  for (int bi = 0; bi < nb; bi++) {
    const kiln__backend *b = kiln__backend_at(bi, NULL);
    bool tables = false;
    for (int r = 0; r < H.n_rows; r++) tables |= H.rows[r].from_tables[bi];
    printf(" %s%s |", b->name, tables ? " (tables)" : "");
  }
  printf(" kernels that fall back |\n|---|");
  for (int bi = 0; bi < nb; bi++) printf("---|");
  printf("---|\n");
  for (int r = 0; r < H.n_rows; r++) {
    support_row *row = &H.rows[r];
    printf("| %s |", row->name);
    for (int bi = 0; bi < nb; bi++) {
      printf(" ");
      for (int di = 0; di < H_NDT; di++) {
        char ch = row->cell[bi][di];
        printf("%s", ch == 'Y' ? "✓" : ch == 'F' ? "F" : ch == 'X' ? "✗" : "·");
      }
      printf(" |");
    }
    printf(" ");
    bool any = false;
    for (int bi = 0; bi < nb; bi++)
      if (row->fell[bi][0]) {
        printf("%s%s: %s", any ? "; " : "", kiln__backend_at(bi, NULL)->name, row->fell[bi]);
        any = true;
      }
    printf(" |\n");
  }
}

static void run_variant(const h_case *c, const variant *v) {
  vinput vis[H_MAX_IN];
  double *bases[H_MAX_IN] = {0};
  for (int i = 0; i < c->n_in; i++) {
    resolve(c, v, i, &vis[i]);
    /* an index range made empty by a size-0 symbol cannot fill a non-empty input */
    const h_input *in = &c->in[i];
    if (in->fill == H_INDEX && h_numel(vis[i].bndim, vis[i].bshape) > 0) {
      double hi = in->hi_sym ? (double)v->sym[in->hi_sym - 1] : in->hi;
      if (hi <= in->lo) {
        free_bases(i, bases);
        return;
      }
    }
    int64_t n = h_numel(vis[i].bndim, vis[i].bshape);
    bases[i] = malloc(sizeof(double) * (size_t)(n ? n : 1));
    fill_base(c, v, i, &vis[i], bases[i]);
  }
  kiln_device cpu = kiln_device_cpu();
  run_result r64;
  h_arr ref = {0};
  int ref_rc = call_ref(c, vis, bases, &ref);

  /* (a) forward f64 against the reference; gives the output shape for the rest */
  run_once(c, vis, bases, KILN_F64, cpu, NULL, &r64);
  if (ref_rc == 1 && H.support) goto done;
  if (ref_rc == 1) {
    if (!H.cross_only) {
      if (r64.ok) fail_line(c, v, "forward", KILN_F64, "expected an error, got a result");
      else if (r64.code == KILN_OK)
        fail_line(c, v, "forward", KILN_F64, "returned NULL without setting an error");
      else H.passed++;
    }
    goto done;
  }
  if (!r64.ok) {
    if (!H.support) fail_line(c, v, "forward", KILN_F64, "failed: %s", r64.err);
    goto done;
  }
  if (!H.cross_only && !H.support && ref_rc == 0) {
    char b1[96], b2[96];
    if (!same_shape(r64.ndim, r64.shape, ref.ndim, ref.shape))
      fail_line(c, v, "shape", KILN_F64, "got %s want %s", h_shape_text(r64.ndim, r64.shape, b1, 96),
                h_shape_text(ref.ndim, ref.shape, b2, 96));
    else
      compare(c, v, "forward", KILN_F64, r64.out, ref.data, r64.n_out, 1e-10, 1e-10);
  }
  bool int_out = !kiln_dtype_is_float(r64.dtype);
  bool size0 = v->kind == V_SIZE0;

  double *g = malloc(sizeof(double) * (size_t)(r64.n_out ? r64.n_out : 1));
  for (int64_t k = 0; k < r64.n_out; k++) g[k] = h_rand_normal();
  if (H.support) {
    support_variant(c, vis, bases, g, !int_out);
    free(g);
    goto done;
  }

  /* (b) lower precision against kiln's f64 on the same rounded inputs */
  static const kiln_dtype lowp[] = {KILN_F32, KILN_F16, KILN_BF16, KILN_I32, KILN_I64};
  for (int li = 0; li < 5 && !H.cross_only && !size0; li++) {
    kiln_dtype dt = lowp[li];
    bool is_int = dt == KILN_I32 || dt == KILN_I64;
    if ((c->flags & H_NO_LOWP) && (dt == KILN_F16 || dt == KILN_BF16)) continue;
    if (is_int && !(c->flags & H_INT_DTYPES)) continue;
    double *rb[H_MAX_IN] = {0};
    round_bases(c, vis, bases, rb, dt);
    run_result want, got;
    h_arr iref = {0};
    int irc = is_int ? call_ref(c, vis, rb, &iref) : -1;
    run_once(c, vis, rb, KILN_F64, cpu, NULL, &want);
    run_once(c, vis, rb, dt, cpu, NULL, &got);
    const double *wv = irc == 0 ? iref.data : want.out;
    double rtol, atol;
    h_dtype_tol(int_out || is_int ? KILN_I64 : dt, &rtol, &atol);
    rtol *= tol_scale(c), atol *= tol_scale(c);
    if (!got.ok) fail_line(c, v, "forward", dt, "failed: %s", got.err);
    else if (!want.ok) fail_line(c, v, "forward", KILN_F64, "failed on rounded inputs: %s", want.err);
    else if (!same_shape(got.ndim, got.shape, want.ndim, want.shape))
      fail_line(c, v, "shape", dt, "differs from the f64 run");
    else if (!int_out && !is_int && got.dtype != dt)
      fail_line(c, v, "dtype", dt, "result dtype %s", kiln_dtype_name(got.dtype));
    else compare(c, v, "forward", dt, got.out, wv, got.n_out, rtol, atol);
    result_free(&want), result_free(&got);
    free(iref.data);
    free_bases(c->n_in, rb);
  }

  /* (c) gradcheck in f64 */
  bool any_diff = false;
  for (int i = 0; i < c->n_in; i++) any_diff |= c->in[i].diff && vis[i].is_float;
  if (!H.cross_only && any_diff && !int_out && !(c->flags & H_NO_GRAD)) {
    run_result ra;
    run_once(c, vis, bases, KILN_F64, cpu, g, &ra);
    if (!ra.ok || !ra.bwd_ok) {
      fail_line(c, v, "backward", KILN_F64, "%s", ra.err);
    } else {
      for (int i = 0; i < c->n_in; i++) {
        if (!c->in[i].diff || !vis[i].is_float) continue;
        int64_t n = h_numel(vis[i].bndim, vis[i].bshape);
        char part[32];
        snprintf(part, sizeof part, "grad[%d]", i);
        if (!ra.grad[i] && n > 0) {
          fail_line(c, v, part, KILN_F64, "no gradient reached the input");
          continue;
        }
        if (ra.grad[i] && ra.n_grad[i] != n) {
          fail_line(c, v, part, KILN_F64, "gradient has %lld elements, input %lld",
                    (long long)ra.n_grad[i], (long long)n);
          continue;
        }
        if (size0 || n == 0) {
          H.passed++;
          continue;
        }
        double *num = malloc(sizeof(double) * (size_t)n);
        bool ok = true;
        const double eps = 1e-6;
        for (int64_t k = 0; k < n; k++) {
          double x = bases[i][k];
          bases[i][k] = x + eps;
          double fp = dot_out(c, vis, bases, g, r64.n_out, &ok);
          bases[i][k] = x - eps;
          double fm = dot_out(c, vis, bases, g, r64.n_out, &ok);
          bases[i][k] = x;
          num[k] = (fp - fm) / (2 * eps);
        }
        double tol = c->grad_tol > 0 ? c->grad_tol : 1e-6;
        if (!ok) fail_line(c, v, part, KILN_F64, "forward failed during finite differences");
        else compare(c, v, part, KILN_F64, ra.grad[i], num, n, tol, tol);
        free(num);
      }
    }
    result_free(&ra);
  } else if (!H.cross_only && size0 && !int_out && any_diff) {
    run_result ra;
    run_once(c, vis, bases, KILN_F64, cpu, g, &ra);
    if (!ra.bwd_ok) fail_line(c, v, "backward", KILN_F64, "%s", ra.err);
    else H.passed++;
    result_free(&ra);
  }

  /* (d) every other device against the CPU in the same dtype. A real backend runs with
  ** the fallback policy at error, so a kernel it lacks fails the case (naming op, device
  ** and dtype) instead of comparing the CPU with itself. A test-only backend (testdev,
  ** which has six kernels) runs with fallback allowed: everything it lacks goes through
  ** the CPU fallback, and the results must still match, which tests the fallback path
  ** (staging, strided copies back) on every op and variant. */
  kiln_fallback_policy saved_policy = kiln_fallback_policy_get();
  for (int d = 0; d < H.n_devs; d++) {
    kiln_device dev = H.devs[d];
    char dname[24];
    kiln_device_str(dev, dname, sizeof dname);
    bool cpu_only = (c->flags & H_CPU_ONLY) && !(H.has_native && dev.type == H.native_type) &&
                    !((c->flags & H_CUDA_NATIVE) && dev.type == KILN_DEVICE_CUDA) &&
                    !((c->flags & H_VK_NATIVE) && dev.type == KILN_DEVICE_VULKAN);
    kiln_set_fallback_policy(H.devs_test[d] || cpu_only ? KILN_FALLBACK_SILENT : KILN_FALLBACK_ERROR);
    static const kiln_dtype xdt[] = {KILN_F64, KILN_F32, KILN_F16, KILN_BF16};
    for (int xi = 0; xi < 4; xi++) {
      kiln_dtype dt = xdt[xi];
      if ((c->flags & H_NO_LOWP) && (dt == KILN_F16 || dt == KILN_BF16)) continue;
      double *rb[H_MAX_IN] = {0};
      round_bases(c, vis, bases, rb, dt);
      bool grad = any_diff && !int_out && !(c->flags & H_NO_GRAD);
      run_result rc, rg;
      run_once(c, vis, rb, dt, cpu, grad ? g : NULL, &rc);
      run_once(c, vis, rb, dt, dev, grad ? g : NULL, &rg);
      char part[48];
      snprintf(part, sizeof part, "%s forward", dname);
      double rtol, atol;
      h_dtype_tol(int_out ? KILN_I64 : dt, &rtol, &atol);
      rtol *= tol_scale(c), atol *= tol_scale(c);
      if (c->xtol_scale > 0) rtol *= c->xtol_scale, atol *= c->xtol_scale;
      if (!rg.ok) fail_line(c, v, part, dt, "failed: %s", rg.err);
      else if (!rc.ok) fail_line(c, v, part, dt, "the CPU run failed: %s", rc.err);
      else if (!same_shape(rg.ndim, rg.shape, rc.ndim, rc.shape) || rg.dtype != rc.dtype)
        fail_line(c, v, part, dt, "shape or dtype differs from the CPU");
      else {
        compare(c, v, part, dt, rg.out, rc.out, rc.n_out, rtol, atol);
        if (grad && !rg.bwd_ok) {
          snprintf(part, sizeof part, "%s backward", dname);
          fail_line(c, v, part, dt, "%s", rg.err);
        } else if (grad) {
          for (int i = 0; i < c->n_in; i++) {
            if (!rc.grad[i]) continue;
            snprintf(part, sizeof part, "%s grad[%d]", dname, i);
            if (!rg.grad[i] || rg.n_grad[i] != rc.n_grad[i])
              fail_line(c, v, part, dt, "missing or wrongly shaped gradient");
            else compare(c, v, part, dt, rg.grad[i], rc.grad[i], rc.n_grad[i], rtol, atol);
          }
        }
      }
      result_free(&rc), result_free(&rg);
      free_bases(c->n_in, rb);
    }
  }
  kiln_set_fallback_policy(saved_policy);
  free(g);
done:
  free(ref.data);
  result_free(&r64);
  free_bases(c->n_in, bases);
}

void h_run_case(const h_case *c) {
  if (H.support) {
    variant v = {.kind = V_CONTIG};
    snprintf(v.name, sizeof v.name, "contiguous");
    memcpy(v.sym, c->sym, sizeof c->sym);
    run_variant(c, &v);
    kiln_clear_error();
    return;
  }
  if (H.cross_only && H.n_devs == 0) return;
  int64_t live0 = kiln_live_tensors();
  int used[H_MAX_SYM] = {0};
  for (int i = 0; i < c->n_in; i++) {
    for (int d = 0; d < c->in[i].ndim; d++)
      if (c->in[i].shape[d] < 0) used[-1 - c->in[i].shape[d]] = 1;
    if (c->in[i].hi_sym) used[c->in[i].hi_sym - 1] = 1;
  }
  variant vs[64];
  int nv = 0;
#define H_ADDV(k, w, ...)                                                                 \
  do {                                                                                    \
    vs[nv].kind = (k), vs[nv].which = (w);                                                \
    memcpy(vs[nv].sym, c->sym, sizeof c->sym);                                            \
    snprintf(vs[nv].name, sizeof vs[nv].name, __VA_ARGS__);                               \
    nv++;                                                                                 \
  } while (0)
  H_ADDV(V_CONTIG, 0, "contiguous");
  if (!(c->flags & H_NO_NONCONTIG)) H_ADDV(V_NONCONTIG, 0, "noncontiguous");
  if (!(c->flags & H_NO_EXPAND)) H_ADDV(V_EXPAND, 0, "expanded");
  if (c->flags & H_BROADCAST) {
    for (int i = 0; i < c->n_in; i++) {
      if (c->in[i].ndim == 0) continue;
      H_ADDV(V_BCAST0, i, "broadcast in%d dim0=1", i);
      H_ADDV(V_BCAST_RANK, i, "broadcast in%d rank-1", i);
    }
  }
  for (int k = 0; k < H_MAX_SYM; k++) {
    if (!used[k]) continue;
    if (!(c->flags & H_NO_SIZE1) && c->sym[k] != 1) {
      H_ADDV(V_SIZE1, k, "sym%d=1", k);
      vs[nv - 1].sym[k] = 1;
    }
    if (!(c->flags & H_NO_SIZE0)) {
      H_ADDV(V_SIZE0, k, "sym%d=0", k);
      vs[nv - 1].sym[k] = 0;
    }
  }
#undef H_ADDV
  for (int i = 0; i < nv; i++) run_variant(c, &vs[i]);
  kiln_clear_error();
  int64_t live1 = kiln_live_tensors();
  if (!H.cross_only) {
    if (live1 != live0) {
      H.failed++;
      printf("FAIL %s: leak: %lld live tensors before, %lld after\n", c->name, (long long)live0,
             (long long)live1);
    } else {
      H.passed++;
    }
  }
}

void h_run_cases(const h_case *cs, int n) {
  for (int i = 0; i < n; i++) h_run_case(&cs[i]);
}

/* ---------------------------------------------------------------- init / finish */

/* Part (d)'s devices: every device of every registered backend but the CPU. The test
** backend is registered here (KILN_HARNESS_TESTDEV=0 leaves it out); a cross-only run
** (--cross-only, KILN_TEST_DEVICE=<backend>) uses the real backends only, or the one
** named. */
static void find_devices(void) {
  const char *td = getenv("KILN_HARNESS_TESTDEV");
  kiln_device_type test_type = KILN__DEVICE_TYPE_ANY;
  if (!td || strcmp(td, "0") != 0) test_type = h_testdev_register();
  H.n_devs = 0;
  for (int i = 0; i < kiln_backend_count(); i++) {
    kiln_device_type t = kiln_backend_type(i);
    const char *name = kiln_backend_name(t);
    bool is_test = t == test_type;
    if (t == KILN_DEVICE_CPU) continue;
    if (H.only_backend ? strcmp(H.only_backend, name) != 0 : (H.cross_only && is_test)) continue;
    /* Vulkan claims part of the ops (its supports() turns the rest away): it runs with
    ** the fallback allowed, so what it claims runs natively and is compared, and what it
    ** lacks checks the fallback path, as for testdev. KILN_HARNESS_STRICT=1 makes it
    ** strict (every kernel native), as CUDA is. */
    const char *strict = getenv("KILN_HARNESS_STRICT");
    bool partial = is_test || (strcmp(name, "vulkan") == 0 && !(strict && strcmp(strict, "1") == 0));
    int n = kiln_device_count(t);
    for (int d = 0; d < n && H.n_devs < H_MAX_DEVS; d++) {
      H.devs[H.n_devs] = (kiln_device){t, d};
      H.devs_test[H.n_devs++] = partial;
    }
  }
  kiln_clear_error();
}

void h_init(int argc, char **argv, const char *test_name) {
  H.name = test_name;
  const char *e = getenv("KILN_TEST_DEVICE");
  if (e && *e && strcmp(e, "cpu") != 0) {
    H.cross_only = true;
    static char only[24];
    snprintf(only, sizeof only, "%.*s", (int)strcspn(e, ":"), e); /* "cuda:0" -> "cuda" */
    H.only_backend = only;
  }
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--cross-only") == 0) H.cross_only = true;
    if (strcmp(argv[i], "--support") == 0) H.support = true;
  }
  const char *sup = getenv("KILN_HARNESS_SUPPORT");
  if (sup && *sup && strcmp(sup, "0") != 0) H.support = true;
  find_devices();
  setvbuf(stdout, NULL, _IOLBF, 0);
}

void h_set_cross_only(bool on) {
  H.cross_only = on;
  find_devices(); /* a cross-only run leaves the test backend out */
}

bool h_support_mode(void) { return H.support; }

void h_set_native_type(kiln_device_type t) {
  H.has_native = true;
  H.native_type = t;
}

bool h_cross_only(void) { return H.cross_only; }

bool h_backend_checks(const char *name) {
  return !H.support && (!H.cross_only || !H.only_backend || strcmp(H.only_backend, name) == 0);
}

int h_finish(void) {
  if (H.support) {
    support_print();
    return 0;
  }
  if (H.cross_only && H.n_devs == 0) {
    printf("%s: skipped (no %s device)\n", H.name, H.only_backend ? H.only_backend : "non-CPU");
    return 77;
  }
  printf("%s: %d passed, %d failed\n", H.name, H.passed, H.failed);
  return H.failed ? 1 : 0;
}

/* ---------------------------------------------------------------- reference blocks */

int h_ref_map1(const h_arr *a, h_arr *out, double (*f)(double)) {
  out->ndim = a->ndim;
  memcpy(out->shape, a->shape, sizeof out->shape);
  if (out->data) {
    int64_t n = h_numel(a->ndim, a->shape);
    for (int64_t k = 0; k < n; k++) out->data[k] = f(a->data[k]);
  }
  return 0;
}

int h_ref_map2(const h_arr *a, const h_arr *b, h_arr *out, double (*f)(double, double)) {
  if (!h_broadcast_shape(a->ndim, a->shape, b->ndim, b->shape, &out->ndim, out->shape)) return 1;
  if (out->data) {
    int64_t idx[KILN_MAX_DIMS] = {0}, n = h_numel(out->ndim, out->shape);
    for (int64_t k = 0; k < n; k++) {
      out->data[k] = f(a->data[h_bcast_offset(a->ndim, a->shape, out->ndim, idx)],
                       b->data[h_bcast_offset(b->ndim, b->shape, out->ndim, idx)]);
      h_next_index(out->ndim, out->shape, idx);
    }
  }
  return 0;
}

int h_ref_map3(const h_arr *a, const h_arr *b, const h_arr *c, h_arr *out,
               double (*f)(double, double, double)) {
  int n1;
  int64_t s1[KILN_MAX_DIMS];
  if (!h_broadcast_shape(a->ndim, a->shape, b->ndim, b->shape, &n1, s1)) return 1;
  if (!h_broadcast_shape(n1, s1, c->ndim, c->shape, &out->ndim, out->shape)) return 1;
  if (out->data) {
    int64_t idx[KILN_MAX_DIMS] = {0}, n = h_numel(out->ndim, out->shape);
    for (int64_t k = 0; k < n; k++) {
      out->data[k] = f(a->data[h_bcast_offset(a->ndim, a->shape, out->ndim, idx)],
                       b->data[h_bcast_offset(b->ndim, b->shape, out->ndim, idx)],
                       c->data[h_bcast_offset(c->ndim, c->shape, out->ndim, idx)]);
      h_next_index(out->ndim, out->shape, idx);
    }
  }
  return 0;
}

kiln_tensor *h_lit_(int ndim, const int64_t *shape, kiln_dtype dt, int n, const double *v) {
  if (h_numel(ndim, shape) != n) {
    printf("h_lit: %d values for %lld elements\n", n, (long long)h_numel(ndim, shape));
    return NULL;
  }
  return h_tensor(v, ndim, shape, dt);
}
