/*
** Binary elementwise ops (ADD .. GE) and WHERE, on the machinery of cuda_ew.cuh.
** Arithmetic runs in the output's dtype (inputs of another dtype are cast first);
** comparisons run in the promoted dtype of their inputs and write bool.
*/
#include "cuda_ew.cuh"

#include <cstdlib>
#include <cstring>
#include <type_traits>

namespace {

/* a + alpha * b in one rounding for floats, as kiln's CPU add and PyTorch's (its CPU
** kernels are FMA-contracted; nvcc would contract this too, but the fma says it). */
__device__ __forceinline__ float kc_axpy(float a, float al, float b) { return fmaf(b, al, a); }
__device__ __forceinline__ double kc_axpy(double a, double al, double b) { return fma(b, al, a); }
__device__ __forceinline__ int64_t kc_axpy(int64_t a, int64_t al, int64_t b) { return a + al * b; }

#define KC_BINARY(NAME, EXPR)                                                             \
  template <class A> struct NAME {                                                        \
    A alpha;                                                                              \
    __device__ __forceinline__ A operator()(A a, A b) const { return (EXPR); }            \
  };
KC_BINARY(F_add, kc_axpy(a, alpha, b))
KC_BINARY(F_add1, a + b)
KC_BINARY(F_sub, a - b)
KC_BINARY(F_mul, a * b)
/* Integers: truncating, and x/0 gives 0 rather than undefined behaviour on the device. */
KC_BINARY(F_div, (std::is_same<A, int64_t>::value && b == (A)0) ? (A)0 : a / b)
KC_BINARY(F_pow, kc_pow(a, b))
KC_BINARY(F_maximum, a != a ? a : (b != b ? b : (a > b ? a : b))) /* NaN propagates */
KC_BINARY(F_minimum, a != a ? a : (b != b ? b : (a < b ? a : b)))
KC_BINARY(F_eq, (A)(a == b))
KC_BINARY(F_ne, (A)(a != b))
KC_BINARY(F_lt, (A)(a < b))
KC_BINARY(F_le, (A)(a <= b))
KC_BINARY(F_gt, (A)(a > b))
KC_BINARY(F_ge, (A)(a >= b))
#undef KC_BINARY

struct F_where {
  template <class C, class A> __device__ __forceinline__ A operator()(C c, A x, A y) const {
    return c != (C)0 ? x : y;
  }
};

bool is_cmp(kiln__kop op) { return op >= KILN__K_EQ && op <= KILN__K_GE; }

kiln_status bad(const kiln__kargs *a) {
  return kiln_set_error(KILN_ERR_DTYPE, "kiln_%s: dtypes %s, %s -> %s not supported on cuda",
                        kiln__kop_name(a->op), kiln_dtype_name(a->in[0].dtype),
                        a->n_in > 1 ? kiln_dtype_name(a->in[1].dtype) : "-",
                        kiln_dtype_name(a->out[0].dtype));
}

template <template <class> class F, class TO, class T>
kiln_status bin(kiln__cuda_dev *d, const kiln__kargs *a, const kiln__view *x,
                const kiln__view *y, double alpha) {
  typedef typename kc_traits<T>::acc A;
  F<A> f;
  f.alpha = (A)alpha;
  const kiln__view *ins[2] = {x, y};
  return kc_ew_launch<2, TO, T, T, T>(d, &a->out[0], ins, f, kiln__kop_name(a->op));
}

template <class T>
kiln_status arith(kiln__cuda_dev *d, const kiln__kargs *a, const kiln__view *x,
                  const kiln__view *y) {
  switch (a->op) {
  case KILN__K_ADD:
    if (a->s[0] == 1.0) return bin<F_add1, T, T>(d, a, x, y, 1.0);
    return bin<F_add, T, T>(d, a, x, y, a->s[0]);
  case KILN__K_SUB: return bin<F_sub, T, T>(d, a, x, y, 1.0);
  case KILN__K_MUL: return bin<F_mul, T, T>(d, a, x, y, 1.0);
  case KILN__K_DIV: return bin<F_div, T, T>(d, a, x, y, 1.0);
  case KILN__K_POW: return bin<F_pow, T, T>(d, a, x, y, 1.0);
  case KILN__K_MAXIMUM: return bin<F_maximum, T, T>(d, a, x, y, 1.0);
  case KILN__K_MINIMUM: return bin<F_minimum, T, T>(d, a, x, y, 1.0);
  default: return bad(a);
  }
}

template <class T>
kiln_status compare(kiln__cuda_dev *d, const kiln__kargs *a, const kiln__view *x,
                    const kiln__view *y) {
  switch (a->op) {
  case KILN__K_EQ: return bin<F_eq, bool, T>(d, a, x, y, 1.0);
  case KILN__K_NE: return bin<F_ne, bool, T>(d, a, x, y, 1.0);
  case KILN__K_LT: return bin<F_lt, bool, T>(d, a, x, y, 1.0);
  case KILN__K_LE: return bin<F_le, bool, T>(d, a, x, y, 1.0);
  case KILN__K_GT: return bin<F_gt, bool, T>(d, a, x, y, 1.0);
  case KILN__K_GE: return bin<F_ge, bool, T>(d, a, x, y, 1.0);
  default: return bad(a);
  }
}

template <class T>
kiln_status where(kiln__cuda_dev *d, const kiln__kargs *a, const kiln__view *c,
                  const kiln__view *x, const kiln__view *y) {
  const kiln__view *ins[3] = {c, x, y};
  return kc_ew_launch<3, T, bool, T, T>(d, &a->out[0], ins, F_where(), "where");
}

/* ADD, SUB, MUL of an f32 and a 16-bit float into f32, the 16-bit operand widened as it is
** read (exact) instead of cast into a temporary first: the same bits, one kernel, and
** 2 + 4 + 4 bytes moved an element instead of 2 + 4 (the cast) + 4 + 4 + 4. Autocast's
** residual stream is this: the f32 sum plus each block's bf16 output. */
template <class T0, class T1>
kiln_status mixed(kiln__cuda_dev *d, const kiln__kargs *a) {
  const kiln__view *ins[2] = {&a->in[0], &a->in[1]};
  const char *what = kiln__kop_name(a->op);
  switch (a->op) {
  case KILN__K_ADD:
    if (a->s[0] == 1.0) return kc_ew_launch<2, float, T0, T1, T1>(d, &a->out[0], ins, F_add1<float>{1.0f}, what);
    return kc_ew_launch<2, float, T0, T1, T1>(d, &a->out[0], ins, F_add<float>{(float)a->s[0]}, what);
  case KILN__K_SUB: return kc_ew_launch<2, float, T0, T1, T1>(d, &a->out[0], ins, F_sub<float>{1.0f}, what);
  case KILN__K_MUL: return kc_ew_launch<2, float, T0, T1, T1>(d, &a->out[0], ins, F_mul<float>{1.0f}, what);
  default: return bad(a);
  }
}

template <class T0> kiln_status mixed_second(kiln__cuda_dev *d, const kiln__kargs *a) {
  switch (a->in[1].dtype) {
  case KILN_F32: return mixed<T0, float>(d, a);
  case KILN_BF16: return mixed<T0, __nv_bfloat16>(d, a);
  case KILN_F16: return mixed<T0, __half>(d, a);
  default: return bad(a);
  }
}

/* KILN_CUDA_MIXED_EW=0: the cast-first path, for comparisons (read once) */
bool mixed_off() {
  static const bool off = kc_env_zero("KILN_CUDA_MIXED_EW");
  return off;
}

bool is_f32_or_half(kiln_dtype t) { return t == KILN_F32 || t == KILN_BF16 || t == KILN_F16; }

bool mixed_case(const kiln__kargs *a) {
  return (a->op == KILN__K_ADD || a->op == KILN__K_SUB || a->op == KILN__K_MUL) && a->out[0].dtype == KILN_F32 &&
         is_f32_or_half(a->in[0].dtype) && is_f32_or_half(a->in[1].dtype) &&
         (a->in[0].dtype != KILN_F32 || a->in[1].dtype != KILN_F32) && !mixed_off();
}

} // namespace

extern "C" bool kiln__cuda_binary_supports(const kiln__kargs *a) {
  if (a->op < KILN__K_ADD || a->op > KILN__K_WHERE) return false;
  for (int i = 0; i < a->n_in; i++)
    if (kc_size(a->in[i].dtype) == 0) return false;
  if (is_cmp(a->op)) return a->out[0].dtype == KILN_BOOL;
  return kc_size(a->out[0].dtype) != 0;
}

extern "C" kiln_status kiln__cuda_binary(const kiln__kargs *a) {
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(a->device, &d));
  if (!kiln__cuda_binary_supports(a)) return bad(a);
  const kiln__view *out = &a->out[0];
  if (mixed_case(a)) {
    switch (a->in[0].dtype) {
    case KILN_F32: return mixed_second<float>(d, a);
    case KILN_BF16: return mixed_second<__nv_bfloat16>(d, a);
    default: return mixed_second<__half>(d, a);
    }
  }
  kc_temps tmp(a->device);
  if (a->op == KILN__K_WHERE) {
    const kiln__view *c = tmp.cast(&a->in[0], out, KILN_BOOL);
    const kiln__view *x = c ? tmp.cast(&a->in[1], out, out->dtype) : NULL;
    const kiln__view *y = x ? tmp.cast(&a->in[2], out, out->dtype) : NULL;
    if (!y) return kiln_last_error();
    KC_SWITCH_ALL(out->dtype, T, return bad(a), return where<T>(d, a, c, x, y))
    return KILN_OK;
  }
  kiln_dtype ct = out->dtype;
  if (is_cmp(a->op))
    ct = a->in[0].dtype == a->in[1].dtype ? a->in[0].dtype
                                         : kiln_dtype_promote(a->in[0].dtype, a->in[1].dtype);
  const kiln__view *x = tmp.cast(&a->in[0], out, ct);
  const kiln__view *y = x ? tmp.cast(&a->in[1], out, ct) : NULL;
  if (!y) return kiln_last_error();
  if (is_cmp(a->op)) {
    KC_SWITCH_ALL(ct, T, return bad(a), return compare<T>(d, a, x, y))
  } else {
    KC_SWITCH_ALL(ct, T, return bad(a), return arith<T>(d, a, x, y))
  }
  return KILN_OK;
}
