/*
** Reductions: SUM PROD AMAX AMIN over a set of dims, and MAX_DIM/MIN_DIM (values and
** first indices) along one dim.
**
** Floats accumulate in f64 whatever their dtype (so a sum of 1e6 f32 values is exact to
** ~1e-12 relative rather than ~1e-4), integers and bool in int64. Chunks of
** KILN__CPU_BLK elements are converted to the accumulator type, then folded with 8
** partial sums, which also gives the compiler independent adds to vectorize.
**
** Two loop orders, chosen by strides: when the reduced dims are the inner ones (row sums)
** each output folds its own contiguous run; when they are outer (a bias gradient summed
** over the batch) a block of neighbouring outputs is accumulated row by row, so every
** load is contiguous either way.
*/
/* Kernels never read the FP exception flags, so comparisons may be treated as not
** trapping: that is what lets GCC turn the selects in these loops (clamps, relu, NaN
** checks, the range limits of kiln__expf) into vector blends instead of branches. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif
#include "cpu.h"
#include "cpu_iter.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

enum { KILN__R_SUM, KILN__R_PROD, KILN__R_MAX, KILN__R_MIN };

typedef struct kiln__racc {
  double f;
  int64_t i;
} kiln__racc;

static kiln__racc kiln__r_init(int rop) {
  kiln__racc r;
  switch (rop) {
  case KILN__R_SUM:
    r.f = 0;
    r.i = 0;
    break;
  case KILN__R_PROD:
    r.f = 1;
    r.i = 1;
    break;
  case KILN__R_MAX:
    r.f = -INFINITY;
    r.i = INT64_MIN;
    break;
  default:
    r.f = INFINITY;
    r.i = INT64_MAX;
    break;
  }
  return r;
}

static double kiln__fold_f64(int rop, double acc, const double *b, int64_t n) {
  int64_t i = 0;
  switch (rop) {
  case KILN__R_SUM: {
    double s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (; i + 8 <= n; i += 8)
      for (int j = 0; j < 8; j++) s[j] += b[i + j];
    for (; i < n; i++) s[0] += b[i];
    return acc + (((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7])));
  }
  case KILN__R_PROD:
    for (; i < n; i++) acc *= b[i];
    return acc;
  case KILN__R_MAX:
    for (; i < n; i++) acc = (b[i] > acc || b[i] != b[i]) ? b[i] : acc;
    return acc;
  default:
    for (; i < n; i++) acc = (b[i] < acc || b[i] != b[i]) ? b[i] : acc;
    return acc;
  }
}

static int64_t kiln__fold_i64(int rop, int64_t acc, const int64_t *b, int64_t n) {
  uint64_t u = (uint64_t)acc; /* wrapping arithmetic, as int64 tensors overflow */
  switch (rop) {
  case KILN__R_SUM:
    for (int64_t i = 0; i < n; i++) u += (uint64_t)b[i];
    return (int64_t)u;
  case KILN__R_PROD:
    for (int64_t i = 0; i < n; i++) u *= (uint64_t)b[i];
    return (int64_t)u;
  case KILN__R_MAX:
    for (int64_t i = 0; i < n; i++) acc = b[i] > acc ? b[i] : acc;
    return acc;
  default:
    for (int64_t i = 0; i < n; i++) acc = b[i] < acc ? b[i] : acc;
    return acc;
  }
}

/* elementwise combine of a block: acc[j] = acc[j] (op) b[j] */
static void kiln__comb_f64(int rop, double *acc, const double *b, int64_t n) {
  switch (rop) {
  case KILN__R_SUM:
    for (int64_t j = 0; j < n; j++) acc[j] += b[j];
    break;
  case KILN__R_PROD:
    for (int64_t j = 0; j < n; j++) acc[j] *= b[j];
    break;
  case KILN__R_MAX:
    for (int64_t j = 0; j < n; j++) acc[j] = (b[j] > acc[j] || b[j] != b[j]) ? b[j] : acc[j];
    break;
  default:
    for (int64_t j = 0; j < n; j++) acc[j] = (b[j] < acc[j] || b[j] != b[j]) ? b[j] : acc[j];
    break;
  }
}
static void kiln__comb_i64(int rop, int64_t *acc, const int64_t *b, int64_t n) {
  switch (rop) {
  case KILN__R_SUM:
    for (int64_t j = 0; j < n; j++) acc[j] = (int64_t)((uint64_t)acc[j] + (uint64_t)b[j]);
    break;
  case KILN__R_PROD:
    for (int64_t j = 0; j < n; j++) acc[j] = (int64_t)((uint64_t)acc[j] * (uint64_t)b[j]);
    break;
  case KILN__R_MAX:
    for (int64_t j = 0; j < n; j++) acc[j] = b[j] > acc[j] ? b[j] : acc[j];
    break;
  default:
    for (int64_t j = 0; j < n; j++) acc[j] = b[j] < acc[j] ? b[j] : acc[j];
    break;
  }
}

typedef struct kiln__red {
  int rop;
  bool isf;           /* accumulate in f64 (else int64) */
  kiln_dtype idt;     /* input dtype */
  kiln__view kv[2];   /* kept dims: [0] in, [1] out (coalesced together) */
  kiln__view rv;      /* reduced dims of in (coalesced), data set per use */
  bool outer;         /* reduced dims are outer: block over outputs */
  int nchunks;        /* full reduction: partials */
  kiln__racc part[64];
} kiln__red;

/* Folds the run (p, bst, n) into the accumulator passed as ctx. */
typedef struct kiln__fold_ctx {
  const kiln__red *r;
  kiln__racc acc;
} kiln__fold_ctx;

static void kiln__fold_run(void *vctx, char *const *p, const int64_t *bst, int64_t n, int64_t k0) {
  kiln__fold_ctx *c = (kiln__fold_ctx *)vctx;
  const kiln__red *r = c->r;
  _Alignas(64) double buf[KILN__CPU_BLK];
  (void)k0;
  if (r->rop == KILN__R_SUM && r->idt == KILN_F32 && bst[0] == 4) {
    /* the common case, without the staging buffer: f32 widened to f64 as it is added */
    const float *x = (const float *)p[0];
    double s8[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
      for (int j = 0; j < 8; j++) s8[j] += (double)x[i + j];
    for (; i < n; i++) s8[0] += (double)x[i];
    c->acc.f += ((s8[0] + s8[1]) + (s8[2] + s8[3])) + ((s8[4] + s8[5]) + (s8[6] + s8[7]));
    return;
  }
  for (int64_t off = 0; off < n; off += KILN__CPU_BLK) {
    int64_t len = n - off < KILN__CPU_BLK ? n - off : KILN__CPU_BLK;
    if (r->isf) {
      kiln__cpu_load(buf, KILN_F64, p[0] + off * bst[0], bst[0], r->idt, len);
      c->acc.f = kiln__fold_f64(r->rop, c->acc.f, buf, len);
    } else {
      kiln__cpu_load(buf, KILN_I64, p[0] + off * bst[0], bst[0], r->idt, len);
      c->acc.i = kiln__fold_i64(r->rop, c->acc.i, (const int64_t *)buf, len);
    }
  }
}

static void kiln__store_acc(char *p, kiln_dtype dt, bool isf, kiln__racc acc) {
  if (isf)
    kiln__cpu_set_f64(p, dt, acc.f);
  else
    kiln__cpu_set_i64(p, dt, acc.i);
}

/* Block accumulator for the outer order: a block of outputs along the kept run. */
typedef struct kiln__blk_ctx {
  const kiln__red *r;
  int64_t kbst;     /* input byte stride between neighbouring outputs */
  int64_t len;
  double *accf;
  int64_t *acci;
} kiln__blk_ctx;

static void kiln__blk_run(void *vctx, char *const *p, const int64_t *bst, int64_t n, int64_t k0) {
  kiln__blk_ctx *c = (kiln__blk_ctx *)vctx;
  const kiln__red *r = c->r;
  _Alignas(64) double buf[KILN__CPU_BLK];
  (void)k0;
  /* p[0] walks the reduced dims from the block's first output */
  if (r->rop == KILN__R_SUM && r->idt == KILN_F32 && c->kbst == 4) {
    /* bias gradients: contiguous f32 rows added straight into the f64 block */
    for (int64_t i = 0; i < n; i++) {
      const float *x = (const float *)(p[0] + i * bst[0]);
      for (int64_t j = 0; j < c->len; j++) c->accf[j] += (double)x[j];
    }
    return;
  }
  for (int64_t i = 0; i < n; i++) {
    const char *q = p[0] + i * bst[0];
    if (r->isf) {
      kiln__cpu_load(buf, KILN_F64, q, c->kbst, r->idt, c->len);
      kiln__comb_f64(r->rop, c->accf, buf, c->len);
    } else {
      kiln__cpu_load(buf, KILN_I64, q, c->kbst, r->idt, c->len);
      kiln__comb_i64(r->rop, c->acci, (const int64_t *)buf, c->len);
    }
  }
}

static void kiln__kept_run(void *vctx, char *const *p, const int64_t *bst, int64_t n, int64_t k0) {
  const kiln__red *r = (const kiln__red *)vctx;
  kiln_dtype odt = r->kv[1].dtype;
  int64_t rn = kiln__view_numel(&r->rv);
  (void)k0;
  if (!r->outer) {
    for (int64_t i = 0; i < n; i++) {
      kiln__fold_ctx fc = {r, kiln__r_init(r->rop)};
      kiln__view v = r->rv;
      v.data = p[0] + i * bst[0];
      kiln__cpu_walk(&v, 1, 0, rn, kiln__fold_run, &fc);
      kiln__store_acc(p[1] + i * bst[1], odt, r->isf, fc.acc);
    }
    return;
  }
  _Alignas(64) double accf[KILN__CPU_BLK];
  _Alignas(64) int64_t acci[KILN__CPU_BLK];
  for (int64_t off = 0; off < n; off += KILN__CPU_BLK) {
    int64_t len = n - off < KILN__CPU_BLK ? n - off : KILN__CPU_BLK;
    kiln__racc init = kiln__r_init(r->rop);
    for (int64_t j = 0; j < len; j++) {
      accf[j] = init.f;
      acci[j] = init.i;
    }
    kiln__blk_ctx bc = {r, bst[0], len, accf, acci};
    kiln__view v = r->rv;
    v.data = p[0] + off * bst[0];
    kiln__cpu_walk(&v, 1, 0, rn, kiln__blk_run, &bc);
    if (r->isf)
      kiln__cpu_store(p[1] + off * bst[1], bst[1], odt, accf, KILN_F64, len);
    else
      kiln__cpu_store(p[1] + off * bst[1], bst[1], odt, acci, KILN_I64, len);
  }
}

static void kiln__kept_range(void *vctx, int64_t lo, int64_t hi) {
  kiln__red *r = (kiln__red *)vctx;
  kiln__cpu_walk(r->kv, 2, lo, hi, kiln__kept_run, r);
}

static void kiln__full_range(void *vctx, int64_t lo, int64_t hi) {
  kiln__red *r = (kiln__red *)vctx;
  int64_t rn = kiln__view_numel(&r->rv);
  for (int64_t c = lo; c < hi; c++) {
    kiln__fold_ctx fc = {r, kiln__r_init(r->rop)};
    kiln__cpu_walk(&r->rv, 1, rn * c / r->nchunks, rn * (c + 1) / r->nchunks, kiln__fold_run, &fc);
    r->part[c] = fc.acc;
  }
}

static int64_t kiln__iabs(int64_t v) { return v < 0 ? -v : v; }

kiln_status kiln__cpu_reduce(const kiln__kargs *a) {
  const kiln__view *in = &a->in[0], *out = &a->out[0];
  int nd = in->ndim;
  if (out->ndim != nd)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_%s: out has %d dims, input %d", kiln__kop_name(a->op),
                          out->ndim, nd);
  kiln__red rs; /* ~1.5 KB on the caller's stack: no allocation per call */
  kiln__red *r = &rs;
  r->rop = a->op == KILN__K_SUM ? KILN__R_SUM
           : a->op == KILN__K_PROD ? KILN__R_PROD
           : a->op == KILN__K_AMAX ? KILN__R_MAX
                                   : KILN__R_MIN;
  r->isf = kiln__cpu_is_float(in->dtype);
  r->idt = in->dtype;
  int nk = 0, nr = 0;
  r->kv[0] = *in;
  r->kv[1] = *out;
  r->rv = *in;
  for (int d = 0; d < nd; d++) {
    bool red = (out->shape[d] == 1 && in->shape[d] != 1) || ((a->i[0] >> d) & 1);
    if (red) {
      if (out->shape[d] != 1) {
        return kiln_set_error(KILN_ERR_SHAPE, "kiln_%s: reduced dim %d of out has size %lld, not 1",
                              kiln__kop_name(a->op), d, (long long)out->shape[d]);
      }
      r->rv.shape[nr] = in->shape[d];
      r->rv.strides[nr] = in->strides[d];
      nr++;
    } else {
      if (out->shape[d] != in->shape[d]) {
        return kiln_set_error(KILN_ERR_SHAPE, "kiln_%s: dim %d is %lld in out but %lld in the input",
                              kiln__kop_name(a->op), d, (long long)out->shape[d],
                              (long long)in->shape[d]);
      }
      for (int i = 0; i < 2; i++) {
        r->kv[i].shape[nk] = in->shape[d];
        r->kv[i].strides[nk] = i == 0 ? in->strides[d] : out->strides[d];
      }
      nk++;
    }
  }
  r->kv[0].ndim = r->kv[1].ndim = nk;
  r->rv.ndim = nr;
  int64_t nout = kiln__view_numel(&r->kv[1]);
  int64_t nred = kiln__view_numel(&r->rv);
  if (nout == 0) return KILN_OK;
  kiln__views_coalesce(r->kv, 2);
  kiln__views_coalesce(&r->rv, 1);
  if (nout == 1) {
    int nt = kiln__cpu_threads_for(nred, KILN__CPU_PAR_MIN_CHEAP);
    r->nchunks = nt > 64 ? 64 : nt;
    kiln__cpu_parallel_for(r->nchunks, 1, kiln__full_range, r);
    kiln__racc acc = kiln__r_init(r->rop);
    for (int c = 0; c < r->nchunks; c++) {
      if (r->isf)
        acc.f = kiln__fold_f64(r->rop, acc.f, &r->part[c].f, 1);
      else
        acc.i = kiln__fold_i64(r->rop, acc.i, &r->part[c].i, 1);
    }
    kiln__store_acc((char *)out->data, out->dtype, r->isf, acc);
    return KILN_OK;
  }
  int kn = r->kv[0].ndim, rnd = r->rv.ndim;
  r->outer = kiln__iabs(r->rv.strides[rnd - 1]) > kiln__iabs(r->kv[0].strides[kn - 1]);
  int64_t work = nout * (nred > 0 ? nred : 1);
  int64_t min_par =
      work < KILN__CPU_PAR_MIN_CHEAP ? INT64_MAX : (KILN__CPU_PAR_MIN_CHEAP / (nred > 0 ? nred : 1)) + 1;
  kiln__cpu_parallel_for(nout, min_par, kiln__kept_range, r);
  return KILN_OK;
}

/* ---- MAX_DIM / MIN_DIM ---- */
typedef struct kiln__mm {
  bool is_max, isf;
  kiln_dtype idt, odt;
  int64_t size, bstride; /* along the dim: elements, input byte stride */
} kiln__mm;

static void kiln__mm_run(void *vctx, char *const *p, const int64_t *bst, int64_t n, int64_t k0) {
  const kiln__mm *m = (const kiln__mm *)vctx;
  _Alignas(64) double buf[KILN__CPU_BLK];
  (void)k0;
  for (int64_t i = 0; i < n; i++) {
    const char *q = p[0] + i * bst[0];
    int64_t best_i = 0;
    double bf = 0;
    int64_t bi = 0;
    bool nan = false;
    for (int64_t off = 0; off < m->size && !nan; off += KILN__CPU_BLK) {
      int64_t len = m->size - off < KILN__CPU_BLK ? m->size - off : KILN__CPU_BLK;
      if (m->isf) {
        kiln__cpu_load(buf, KILN_F64, q + off * m->bstride, m->bstride, m->idt, len);
        if (off == 0) bf = buf[0];
        for (int64_t j = 0; j < len; j++) {
          double v = buf[j];
          if (v != v) { /* the first NaN wins, as in PyTorch */
            bf = v;
            best_i = off + j;
            nan = true;
            break;
          }
          if (m->is_max ? v > bf : v < bf) {
            bf = v;
            best_i = off + j;
          }
        }
      } else {
        const int64_t *b = (const int64_t *)buf;
        kiln__cpu_load(buf, KILN_I64, q + off * m->bstride, m->bstride, m->idt, len);
        if (off == 0) bi = b[0];
        for (int64_t j = 0; j < len; j++) {
          if (m->is_max ? b[j] > bi : b[j] < bi) {
            bi = b[j];
            best_i = off + j;
          }
        }
      }
    }
    if (m->isf)
      kiln__cpu_set_f64(p[1] + i * bst[1], m->odt, bf);
    else
      kiln__cpu_set_i64(p[1] + i * bst[1], m->odt, bi);
    *(int64_t *)(p[2] + i * bst[2]) = best_i;
  }
}

typedef struct kiln__mm_par {
  kiln__mm m;
  kiln__view v[3]; /* in, values, indices */
} kiln__mm_par;

static void kiln__mm_range(void *vctx, int64_t lo, int64_t hi) {
  kiln__mm_par *c = (kiln__mm_par *)vctx;
  kiln__cpu_walk(c->v, 3, lo, hi, kiln__mm_run, &c->m);
}

kiln_status kiln__cpu_minmax_dim(const kiln__kargs *a) {
  const kiln__view *in = &a->in[0];
  int nd = in->ndim;
  int64_t d = a->i[1];
  if (d < 0 || d >= nd || a->out[0].ndim != nd || a->out[1].ndim != nd)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_%s: dim %lld invalid for %d dims",
                          kiln__kop_name(a->op), (long long)d, nd);
  if (a->out[1].dtype != KILN_I64) return kiln__cpu_dtype_error(a, a->out[1].dtype);
  kiln__mm_par c;
  c.m.is_max = a->op == KILN__K_MAX_DIM;
  c.m.isf = kiln__cpu_is_float(in->dtype);
  c.m.idt = in->dtype;
  c.m.odt = a->out[0].dtype;
  c.m.size = in->shape[d];
  c.m.bstride = in->strides[d] * (int64_t)kiln__cpu_esize(in->dtype);
  c.v[0] = *in;
  c.v[1] = a->out[0];
  c.v[2] = a->out[1];
  for (int i = 0; i < 3; i++) { /* drop dim d */
    for (int k = (int)d; k < nd - 1; k++) {
      c.v[i].shape[k] = c.v[i].shape[k + 1];
      c.v[i].strides[k] = c.v[i].strides[k + 1];
    }
    c.v[i].ndim = nd - 1;
  }
  int64_t nout = kiln__view_numel(&c.v[0]);
  if (nout == 0) return KILN_OK;
  if (c.m.size == 0)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_%s: cannot reduce dim %lld of size 0",
                          kiln__kop_name(a->op), (long long)d);
  if (nd == 1) { /* the only dim is the reduced one: one output */
    for (int i = 0; i < 3; i++) {
      c.v[i].ndim = 1;
      c.v[i].shape[0] = 1;
      c.v[i].strides[0] = 0;
    }
  }
  kiln__views_coalesce(c.v, 3);
  int64_t work = nout * c.m.size;
  kiln__cpu_parallel_for(nout, work < KILN__CPU_PAR_MIN_CHEAP ? INT64_MAX : KILN__CPU_PAR_MIN_CHEAP / c.m.size + 1,
                         kiln__mm_range, &c);
  return KILN_OK;
}
