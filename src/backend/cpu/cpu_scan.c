/*
** Kernels along one dim or over the last two: cumsum (forward and reversed, its
** backward), tril/triu, topk, and multinomial sampling from the Philox generator.
**
** multinomial's mapping (every backend implements it to draw the same samples):
**   sample s of row r (S samples a row) uses u = the f64 Philox uniform of element
**   k = r*S + s at the kernel's (seed, offset) (src/core/rng.c: block offset + k/2, words
**   2(k%2) and 2(k%2)+1); the weights w_j of the row (with the classes drawn so far in
**   this row set to 0 when sampling without replacement) give total = sum_j w_j and the
**   prefix sums cdf_j, both in f64 in class order; the sample is the first j with
**   cdf_j > u * total (a zero weight is never drawn), or the last class of nonzero
**   weight when rounding leaves none.
*/
#include "cpu.h"
#include "cpu_iter.h"
#include "../../core/kiln_int.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Lines along dim d of views vs (all of vs[0]'s shape): line L's first element pointer
** for each view. */
static void kiln__line_ptrs(const kiln__view *vs, int nv, int d, int64_t L, char **p) {
  const kiln__view *v0 = &vs[0];
  int64_t idx[KILN_MAX_DIMS] = {0};
  for (int k = v0->ndim - 1; k >= 0; k--) {
    if (k == d) continue;
    idx[k] = L % v0->shape[k];
    L /= v0->shape[k];
  }
  for (int i = 0; i < nv; i++) {
    int64_t off = 0;
    for (int k = 0; k < vs[i].ndim; k++) off += idx[k] * vs[i].strides[k];
    p[i] = (char *)vs[i].data + off * (int64_t)kiln__cpu_esize(vs[i].dtype);
  }
}

static int64_t kiln__n_lines(const kiln__view *v, int d) {
  int64_t n = 1;
  for (int k = 0; k < v->ndim; k++)
    if (k != d) n *= v->shape[k];
  return n;
}

/* ---- cumsum ---- */
typedef struct kiln__scan {
  const kiln__kargs *a;
  int d;
  bool failed;
} kiln__scan;

static void kiln__cumsum_range(void *vctx, int64_t lo, int64_t hi) {
  kiln__scan *c = vctx;
  const kiln__kargs *a = c->a;
  kiln__view vs[2] = {a->in[0], a->out[0]};
  int d = c->d;
  int64_t len = vs[0].shape[d];
  int64_t bi = vs[0].strides[d] * (int64_t)kiln__cpu_esize(vs[0].dtype);
  int64_t bo = vs[1].strides[d] * (int64_t)kiln__cpu_esize(vs[1].dtype);
  bool rev = a->i[1] == 1, fl = kiln__cpu_is_float(vs[1].dtype);
  for (int64_t L = lo; L < hi; L++) {
    char *p[2];
    kiln__line_ptrs(vs, 2, d, L, p);
    double sf = 0;
    int64_t si = 0;
    for (int64_t t = 0; t < len; t++) {
      int64_t j = rev ? len - 1 - t : t;
      if (fl) {
        sf += kiln__cpu_get_f64(p[0] + j * bi, vs[0].dtype);
        kiln__cpu_set_f64(p[1] + j * bo, vs[1].dtype, sf);
      } else {
        si += kiln__cpu_get_i64(p[0] + j * bi, vs[0].dtype);
        kiln__cpu_set_i64(p[1] + j * bo, vs[1].dtype, si);
      }
    }
  }
}

kiln_status kiln__cpu_cumsum(const kiln__kargs *a) {
  int d = (int)a->i[0];
  if (d < 0 || d >= a->in[0].ndim)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_cumsum: dim %d invalid for %d dims", d, a->in[0].ndim);
  kiln__scan c = {.a = a, .d = d};
  int64_t n = kiln__n_lines(&a->in[0], d), len = a->in[0].shape[d];
  if (n == 0 || len == 0) return KILN_OK;
  int64_t cost = len + KILN__CPU_ROW_COST;
  kiln__cpu_parallel_for(n, n * cost < KILN__CPU_PAR_MIN ? INT64_MAX : KILN__CPU_PAR_MIN / cost + 1,
                         kiln__cumsum_range, &c);
  return KILN_OK;
}

/* ---- tril / triu ---- */
kiln_status kiln__cpu_tril(const kiln__kargs *a) {
  const kiln__view *x = &a->in[0], *y = &a->out[0];
  if (x->ndim < 2 || x->dtype != y->dtype)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_tril: the kernel wants 2 or more dims and one dtype");
  int nd = x->ndim;
  int64_t n = kiln__view_numel(x), diag = a->i[0];
  bool upper = a->i[1] == 1;
  size_t es = kiln__cpu_esize(x->dtype);
  int64_t idx[KILN_MAX_DIMS] = {0};
  for (int64_t e = 0; e < n; e++) {
    int64_t ox = 0, oy = 0;
    for (int k = 0; k < nd; k++) ox += idx[k] * x->strides[k], oy += idx[k] * y->strides[k];
    int64_t off = idx[nd - 1] - idx[nd - 2];
    bool keep = upper ? off >= diag : off <= diag;
    char *dst = (char *)y->data + oy * (int64_t)es;
    if (keep) memmove(dst, (const char *)x->data + ox * (int64_t)es, es);
    else memset(dst, 0, es); /* 0 in every dtype (bf16/f16 +0 too) */
    for (int k = nd - 1; k >= 0; k--) {
      if (++idx[k] < x->shape[k]) break;
      idx[k] = 0;
    }
  }
  return KILN_OK;
}

/* ---- topk ---- */
typedef struct kiln__kv {
  double v;
  int64_t i;
} kiln__kv;

/* NaN counts as the largest value (PyTorch); ties keep the lower index first. */
static int kiln__kv_desc(const void *pa, const void *pb) {
  const kiln__kv *x = pa, *y = pb;
  bool nx = isnan(x->v), ny = isnan(y->v);
  if (nx != ny) return nx ? -1 : 1;
  if (!nx && x->v != y->v) return x->v > y->v ? -1 : 1;
  return x->i < y->i ? -1 : (x->i > y->i);
}
static int kiln__kv_asc(const void *pa, const void *pb) {
  const kiln__kv *x = pa, *y = pb;
  bool nx = isnan(x->v), ny = isnan(y->v);
  if (nx != ny) return nx ? 1 : -1;
  if (!nx && x->v != y->v) return x->v < y->v ? -1 : 1;
  return x->i < y->i ? -1 : (x->i > y->i);
}

static void kiln__topk_range(void *vctx, int64_t lo, int64_t hi) {
  kiln__scan *c = vctx;
  const kiln__kargs *a = c->a;
  kiln__view vs[3] = {a->in[0], a->out[0], a->out[1]};
  int d = c->d;
  int64_t len = vs[0].shape[d], k = a->i[1];
  kiln__kv *row = malloc(sizeof(kiln__kv) * (size_t)len);
  if (!row) {
    c->failed = true;
    return;
  }
  size_t es = kiln__cpu_esize(vs[0].dtype);
  int64_t bi = vs[0].strides[d] * (int64_t)es, bo = vs[1].strides[d] * (int64_t)es;
  int64_t bx = vs[2].strides[d] * (int64_t)kiln__cpu_esize(vs[2].dtype);
  for (int64_t L = lo; L < hi; L++) {
    char *p[3];
    kiln__line_ptrs(vs, 3, d, L, p);
    for (int64_t j = 0; j < len; j++) row[j].v = kiln__cpu_get_f64(p[0] + j * bi, vs[0].dtype), row[j].i = j;
    qsort(row, (size_t)len, sizeof *row, (a->i[2] & 1) ? kiln__kv_desc : kiln__kv_asc);
    for (int64_t t = 0; t < k; t++) {
      memcpy(p[1] + t * bo, p[0] + row[t].i * bi, es); /* the element itself: exact in any dtype */
      kiln__cpu_set_i64(p[2] + t * bx, vs[2].dtype, row[t].i);
    }
  }
  free(row);
}

kiln_status kiln__cpu_topk(const kiln__kargs *a) {
  int d = (int)a->i[0];
  const kiln__view *x = &a->in[0];
  if (d < 0 || d >= x->ndim || a->i[1] < 0 || a->i[1] > x->shape[d] || a->out[0].shape[d] != a->i[1] ||
      a->out[0].dtype != x->dtype)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_topk: dim %d and k %lld do not fit the views", d,
                          (long long)a->i[1]);
  kiln__scan c = {.a = a, .d = d};
  int64_t n = kiln__n_lines(x, d), len = x->shape[d];
  if (n == 0 || a->i[1] == 0) return KILN_OK;
  int64_t cost = len * 8 + KILN__CPU_ROW_COST;
  kiln__cpu_parallel_for(n, n * cost < KILN__CPU_PAR_MIN ? INT64_MAX : KILN__CPU_PAR_MIN / cost + 1,
                         kiln__topk_range, &c);
  if (c.failed) return kiln_set_error(KILN_ERR_OOM, "kiln_topk: out of host memory for a row of %lld", (long long)len);
  return KILN_OK;
}

/* ---- multinomial ---- */
typedef struct kiln__mn {
  const kiln__kargs *a;
  bool failed;
} kiln__mn;

static void kiln__mn_range(void *vctx, int64_t lo, int64_t hi) {
  kiln__mn *c = vctx;
  const kiln__kargs *a = c->a;
  const kiln__view *p = &a->in[0], *o = &a->out[0];
  int64_t C = p->shape[1], S = o->shape[1];
  bool repl = a->i[0] == 1;
  double *w = malloc(sizeof(double) * (size_t)(2 * C));
  if (!w) {
    c->failed = true;
    return;
  }
  double *cdf = w + C;
  size_t ep = kiln__cpu_esize(p->dtype), eo = kiln__cpu_esize(o->dtype);
  for (int64_t r = lo; r < hi; r++) {
    for (int64_t j = 0; j < C; j++)
      w[j] = kiln__cpu_get_f64((const char *)p->data + (r * p->strides[0] + j * p->strides[1]) * (int64_t)ep,
                               p->dtype);
    for (int64_t s = 0; s < S; s++) {
      double tot = 0;
      int64_t last = -1;
      for (int64_t j = 0; j < C; j++) {
        tot += w[j];
        cdf[j] = tot;
        if (w[j] > 0) last = j;
      }
      double u = kiln__philox_uniform_f64(a->seed, a->offset, (uint64_t)(r * S + s)) * tot;
      int64_t pick = last;
      for (int64_t j = 0; j < C; j++)
        if (cdf[j] > u) {
          pick = j;
          break;
        }
      kiln__cpu_set_i64((char *)o->data + (r * o->strides[0] + s * o->strides[1]) * (int64_t)eo, o->dtype, pick);
      if (!repl) w[pick] = 0;
    }
  }
  free(w);
}

kiln_status kiln__cpu_multinomial(const kiln__kargs *a) {
  const kiln__view *p = &a->in[0], *o = &a->out[0];
  if (p->ndim != 2 || o->ndim != 2 || o->shape[0] != p->shape[0])
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_multinomial: the kernel wants probabilities (N, C) and out (N, S)");
  if (!kiln__cpu_is_float(p->dtype)) return kiln__cpu_dtype_error(a, p->dtype);
  int64_t N = p->shape[0], C = p->shape[1], S = o->shape[1];
  bool repl = a->i[0] == 1;
  size_t ep = kiln__cpu_esize(p->dtype);
  /* Every row checked before anything is drawn: a bad distribution is an error, not a
  ** sample (the data is read here, as cross entropy reads its targets). */
  for (int64_t r = 0; r < N; r++) {
    double tot = 0;
    int64_t nz = 0;
    for (int64_t j = 0; j < C; j++) {
      double v = kiln__cpu_get_f64((const char *)p->data + (r * p->strides[0] + j * p->strides[1]) * (int64_t)ep,
                                   p->dtype);
      if (!(v >= 0) || isinf(v))
        return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                              "kiln_multinomial: probabilities must be finite and non-negative; row %lld "
                              "class %lld is %g",
                              (long long)r, (long long)j, v);
      tot += v;
      nz += v > 0;
    }
    if (!(tot > 0))
      return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_multinomial: row %lld of the probabilities sums to 0",
                            (long long)r);
    if (!repl && nz < S)
      return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                            "kiln_multinomial: %lld samples without replacement, but row %lld has only %lld "
                            "classes of nonzero probability",
                            (long long)S, (long long)r, (long long)nz);
  }
  if (N == 0 || S == 0) return KILN_OK;
  kiln__mn c = {.a = a};
  int64_t cost = S * C + KILN__CPU_ROW_COST;
  kiln__cpu_parallel_for(N, N * cost < KILN__CPU_PAR_MIN ? INT64_MAX : KILN__CPU_PAR_MIN / cost + 1, kiln__mn_range,
                         &c);
  if (c.failed) return kiln_set_error(KILN_ERR_OOM, "kiln_multinomial: out of host memory for %lld classes", (long long)C);
  return KILN_OK;
}
