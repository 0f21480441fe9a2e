/*
** Random fills: RAND_UNIFORM, RAND_NORMAL, RAND_INT, RAND_BERNOULLI. One thread per
** Philox block (4 elements for the f32 mappings, 2 for the f64 ones), so that element k
** of out0 in C order gets exactly the value src/core/rng.c gives it (philox.cuh).
**
** Under graph capture the seed and offset are baked into the graph: a replay draws the
** same numbers again (advance the generator outside the graph if that matters).
*/
#include "cuda_int.cuh"
#include "philox.cuh"

#include <math.h>

namespace {

enum { M_UNIFORM, M_NORMAL, M_INT, M_BERNOULLI };

struct RParams {
  double s0, s1;
  int64_t i0, i1;
  uint64_t seed, offset;
  int64_t n;
};

template <class T, int MODE, bool F64MAP, bool CONTIG, class I>
__global__ void rand_kernel(T *out, kc_geom<1, I> g, RParams p) {
  const int L = F64MAP ? 2 : 4;
  const int64_t nblocks = (p.n + L - 1) / L;
  for (int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; j < nblocks;
       j += (int64_t)gridDim.x * blockDim.x) {
    kc_u32x4 w = kc_philox(p.seed, p.offset + (uint64_t)j);
#pragma unroll
    for (int l = 0; l < L; l++) {
      int64_t k = j * L + l;
      if (k >= p.n) break;
      T v;
      if (MODE == M_UNIFORM) {
        if (F64MAP) {
          double u = kc_u01_f64(w.x[2 * l], w.x[2 * l + 1]);
          v = kc_st<T>(__dadd_rn(p.s0, __dmul_rn(p.s1 - p.s0, u)));
        } else {
          float u = kc_u01_f32(w.x[l]);
          v = kc_st<T>(__fadd_rn((float)p.s0, __fmul_rn((float)(p.s1 - p.s0), u)));
        }
      } else if (MODE == M_NORMAL) {
        if (F64MAP) {
          v = kc_st<T>(__dadd_rn(p.s0, __dmul_rn(p.s1, kc_normal_f64(w, l & 1))));
        } else {
          int q = l >> 1;
          float nv = kc_normal_f32(w.x[2 * q], w.x[2 * q + 1], l & 1);
          v = kc_st<T>(__fadd_rn((float)p.s0, __fmul_rn((float)p.s1, nv)));
        }
      } else if (MODE == M_INT) {
        double u = kc_u01_f64(w.x[2 * l], w.x[2 * l + 1]);
        int64_t r = p.i0 + (int64_t)floor(u * ((double)p.i1 - (double)p.i0));
        if (r > p.i1 - 1) r = p.i1 - 1; /* u * span can round up to span */
        if (r < p.i0) r = p.i0;
        v = kc_st<T>(r);
      } else {
        bool hit;
        if (F64MAP) hit = kc_u01_f64(w.x[2 * l], w.x[2 * l + 1]) < p.s0;
        else hit = (double)kc_u01_f32(w.x[l]) < p.s0;
        v = kc_st<T>(hit ? p.s1 : 0.0);
      }
      if (CONTIG) {
        out[k] = v;
      } else {
        I off[1];
        kc_offsets<1, I>(g, (I)k, off);
        out[off[0]] = v;
      }
    }
  }
}

template <class T, int MODE, bool F64MAP>
kiln_status launch(const kiln__kargs *a, kiln__cuda_dev *d, const kc_shape *sh) {
  RParams p = {a->s[0], a->s[1], a->i[0], a->i[1], a->seed, a->offset, sh->numel};
  const int L = F64MAP ? 2 : 4;
  int blocks = kc_blocks((sh->numel + L - 1) / L, KC_THREADS, d->sm_count);
  T *out = (T *)a->out[0].data;
  bool contig = sh->ndim == 1 && sh->st[0][0] == 1;
  if (contig) {
    kc_geom<1, int64_t> g = kc_make_geom<1, int64_t>(sh);
    rand_kernel<T, MODE, F64MAP, true, int64_t><<<blocks, KC_THREADS, 0, d->stream>>>(out, g, p);
  } else if (kc_fits32(sh)) {
    kc_geom<1, int32_t> g = kc_make_geom<1, int32_t>(sh);
    rand_kernel<T, MODE, F64MAP, false, int32_t><<<blocks, KC_THREADS, 0, d->stream>>>(out, g, p);
  } else {
    kc_geom<1, int64_t> g = kc_make_geom<1, int64_t>(sh);
    rand_kernel<T, MODE, F64MAP, false, int64_t><<<blocks, KC_THREADS, 0, d->stream>>>(out, g, p);
  }
  return kiln__cuda_launched(kiln__kop_name(a->op));
}

kiln_status bad_dtype(const kiln__kargs *a) {
  return kiln_set_error(KILN_ERR_DTYPE, "kiln_%s: dtype %s not supported on cuda",
                        kiln__kop_name(a->op), kiln_dtype_name(a->out[0].dtype));
}

} // namespace

extern "C" bool kiln__cuda_random_supports(const kiln__kargs *a) {
  kiln_dtype dt = a->out[0].dtype;
  switch (a->op) {
  case KILN__K_RAND_UNIFORM: case KILN__K_RAND_NORMAL: return kc_is_float(dt);
  case KILN__K_RAND_INT: return dt != KILN_BOOL && kc_size(dt) != 0;
  case KILN__K_RAND_BERNOULLI: return kc_size(dt) != 0;
  default: return false;
  }
}

extern "C" kiln_status kiln__cuda_random(const kiln__kargs *a) {
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(a->device, &d));
  if (!kiln__cuda_random_supports(a)) return bad_dtype(a);
  const kiln__view *v[1] = {&a->out[0]};
  kc_shape sh;
  kc_coalesce(&sh, v, 1);
  if (sh.numel == 0) return KILN_OK;
  kiln_dtype dt = a->out[0].dtype;
  bool f64 = dt == KILN_F64;
  if (a->op == KILN__K_RAND_INT && a->i[1] <= a->i[0])
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_randint: low %lld must be below high %lld",
                          (long long)a->i[0], (long long)a->i[1]);
  switch (a->op) {
  case KILN__K_RAND_UNIFORM:
    if (f64) return launch<double, M_UNIFORM, true>(a, d, &sh);
    KC_SWITCH_FLOAT(dt, T, return bad_dtype(a), return launch<T, M_UNIFORM, false>(a, d, &sh))
    break;
  case KILN__K_RAND_NORMAL:
    if (f64) return launch<double, M_NORMAL, true>(a, d, &sh);
    KC_SWITCH_FLOAT(dt, T, return bad_dtype(a), return launch<T, M_NORMAL, false>(a, d, &sh))
    break;
  case KILN__K_RAND_INT:
    KC_SWITCH_ALL(dt, T, return bad_dtype(a), return launch<T, M_INT, true>(a, d, &sh))
    break;
  case KILN__K_RAND_BERNOULLI:
    if (f64) return launch<double, M_BERNOULLI, true>(a, d, &sh);
    KC_SWITCH_ALL(dt, T, return bad_dtype(a), return launch<T, M_BERNOULLI, false>(a, d, &sh))
    break;
  default: break;
  }
  return bad_dtype(a);
}
