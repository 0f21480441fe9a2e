/*
** Elementwise kernels without a second operand: COPY between dtypes (casts), ARANGE, EYE,
** the unary ops and their backward rules (machinery in cuda_ew.cuh). Binary ops and
** WHERE live in cuda_binary.cu; same-dtype COPY and FILL in cuda_copy.cu (a small module,
** loaded fast on first use). 16-bit floats are computed in f32, f64 in f64, integers
** in int64, as backend.h asks.
*/
#include "cuda_ew.cuh"

#include <math.h>
#include <type_traits>

namespace {

/* ---- fills (FILL itself is in cuda_copy.cu) ---- */
struct F_arange {
  double s0, s1;
  __device__ __forceinline__ double operator()(int64_t k) const { return s0 + (double)k * s1; }
};
struct F_arange_int {
  int64_t s0, s1;
  __device__ __forceinline__ int64_t operator()(int64_t k) const { return s0 + k * s1; }
};
struct F_eye {
  int64_t cols;
  __device__ __forceinline__ int64_t operator()(int64_t k) const {
    return (k / cols) == (k % cols) ? 1 : 0;
  }
};
struct F_ident {
  template <class X> __device__ __forceinline__ X operator()(X x) const { return x; }
};

/* ---- unary (A = float or double; the int-capable ones also int64) ---- */
#define KC_UNARY(NAME, EXPR)                                                              \
  template <class A> struct NAME {                                                        \
    A s0, s1;                                                                             \
    __device__ __forceinline__ A operator()(A x) const { return (EXPR); }                 \
  };
KC_UNARY(F_neg, -x)
KC_UNARY(F_exp, kc_exp(x))
KC_UNARY(F_log, kc_log(x))
KC_UNARY(F_sqrt, kc_sqrt(x))
KC_UNARY(F_rsqrt, kc_rsqrt(x))
KC_UNARY(F_abs, x < (A)0 ? -x : x)
KC_UNARY(F_sign, x > (A)0 ? (A)1 : (x < (A)0 ? (A)-1 : x)) /* keeps NaN, +-0 */
KC_UNARY(F_relu, x < (A)0 ? (A)0 : x) /* NaN passes through, as in PyTorch */
KC_UNARY(F_leaky, x > (A)0 ? x : x * s0)
KC_UNARY(F_gelu, (A)0.5 * x * ((A)1 + kc_erf(x * (A)0.70710678118654752440)))
KC_UNARY(F_gelu_tanh,
         (A)0.5 * x *
             ((A)1 + kc_tanh((A)0.79788456080286535588 * (x + (A)0.044715 * x * x * x))))
KC_UNARY(F_silu, x / ((A)1 + kc_exp(-x)))
KC_UNARY(F_sigmoid, (A)1 / ((A)1 + kc_exp(-x)))
KC_UNARY(F_tanh, kc_tanh(x))
/* log(1 + exp(beta x)) / beta, linear above the threshold (PyTorch's rule). */
KC_UNARY(F_softplus, x * s0 > s1 ? x : kc_log1p(kc_exp(x * s0)) / s0)
KC_UNARY(F_pow_scalar, kc_pow(x, s0))
KC_UNARY(F_affine, x * s0 + s1)
#undef KC_UNARY

/* Clamp bounds stay double so that +-inf works for integer dtypes too; NaN stays NaN. */
template <class A> struct F_clamp {
  double lo, hi;
  __device__ __forceinline__ A operator()(A x) const {
    double xd = (double)x;
    if (xd < lo) return (A)lo;
    if (xd > hi) return (A)hi;
    return x;
  }
};
/* Integer affine: computed in double, truncated toward zero. */
struct F_affine_int {
  double s0, s1;
  __device__ __forceinline__ int64_t operator()(int64_t x) const {
    return (int64_t)((double)x * s0 + s1);
  }
};

/* ---- unary backward: (x or y, g) ---- */
#define KC_UNARY_BW(NAME, EXPR)                                                           \
  template <class A> struct NAME {                                                        \
    A s0, s1;                                                                             \
    __device__ __forceinline__ A operator()(A x, A g) const { return (EXPR); }            \
  };
KC_UNARY_BW(F_relu_bw, x > (A)0 ? g : (A)0)
KC_UNARY_BW(F_leaky_bw, x > (A)0 ? g : g * s0)
/* d/dx x*Phi(x) = Phi(x) + x*phi(x) */
KC_UNARY_BW(F_gelu_bw, g * ((A)0.5 * ((A)1 + kc_erf(x * (A)0.70710678118654752440)) +
                            x * (A)0.39894228040143267794 * kc_exp((A)-0.5 * x * x)))
KC_UNARY_BW(F_sigmoid_bw, g * x * ((A)1 - x)) /* x is y here */
KC_UNARY_BW(F_tanh_bw, g * ((A)1 - x * x))    /* x is y here */
#undef KC_UNARY_BW

template <class A> struct F_gelu_tanh_bw {
  A s0, s1;
  __device__ __forceinline__ A operator()(A x, A g) const {
    const A k = (A)0.79788456080286535588, c = (A)0.044715;
    A t = kc_tanh(k * (x + c * x * x * x));
    return g * ((A)0.5 * ((A)1 + t) + (A)0.5 * x * ((A)1 - t * t) * k * ((A)1 + (A)3 * c * x * x));
  }
};
template <class A> struct F_silu_bw {
  A s0, s1;
  __device__ __forceinline__ A operator()(A x, A g) const {
    A s = (A)1 / ((A)1 + kc_exp(-x));
    return g * s * ((A)1 + x * ((A)1 - s));
  }
};
template <class A> struct F_softplus_bw {
  A s0, s1;
  __device__ __forceinline__ A operator()(A x, A g) const {
    A bx = x * s0;
    return bx > s1 ? g : g / ((A)1 + kc_exp(-bx));
  }
};
template <class A> struct F_clamp_bw {
  double lo, hi;
  __device__ __forceinline__ A operator()(A x, A g) const {
    double xd = (double)x;
    return (xd >= lo && xd <= hi) ? g : (A)0;
  }
};

kiln_status bad(const kiln__kargs *a, const char *what) {
  return kiln_set_error(KILN_ERR_DTYPE, "kiln_%s: %s not supported on cuda (out %s, in %s)",
                        kiln__kop_name(a->op), what, kiln_dtype_name(a->out[0].dtype),
                        a->n_in > 0 ? kiln_dtype_name(a->in[0].dtype) : "-");
}

/* ---- COPY between dtypes (a cast; same-dtype copies are in cuda_copy.cu) ---- */
template <class TO>
kiln_status copy_to(kiln__cuda_dev *d, const kiln__view *out, const kiln__view *in) {
  const kiln__view *ins[1] = {in};
  KC_SWITCH_ALL(in->dtype, TI, return kiln_set_error(KILN_ERR_DTYPE, "kiln_copy: bad dtype"),
                return kc_ew_launch<1, TO, TI, TO, TO>(d, out, ins, F_ident(), "copy"))
  return KILN_OK;
}

template <class T> kiln_status arange(kiln__cuda_dev *d, const kiln__kargs *a) {
  if constexpr (std::is_same<typename kc_traits<T>::acc, int64_t>::value) { /* integers */
    F_arange_int f = {(int64_t)a->s[0], (int64_t)a->s[1]};
    return kc_ew_launch<0, T, T, T, T>(d, &a->out[0], NULL, f, "arange");
  } else {
    F_arange f = {a->s[0], a->s[1]};
    return kc_ew_launch<0, T, T, T, T>(d, &a->out[0], NULL, f, "arange");
  }
}

template <class T> kiln_status eye(kiln__cuda_dev *d, const kiln__kargs *a) {
  F_eye f = {a->out[0].shape[1] > 0 ? a->out[0].shape[1] : 1};
  return kc_ew_launch<0, T, T, T, T>(d, &a->out[0], NULL, f, "eye");
}

/* ---- unary ---- */
template <template <class> class F, class T>
kiln_status unary(kiln__cuda_dev *d, const kiln__kargs *a, const kiln__view *in) {
  typedef typename kc_traits<T>::acc A;
  F<A> f;
  f.s0 = (A)a->s[0];
  f.s1 = (A)a->s[1];
  const kiln__view *ins[1] = {in};
  return kc_ew_launch<1, T, T, T, T>(d, &a->out[0], ins, f, kiln__kop_name(a->op));
}
template <template <class> class F, class T>
kiln_status unary_bw(kiln__cuda_dev *d, const kiln__kargs *a, const kiln__view *x,
                     const kiln__view *g) {
  typedef typename kc_traits<T>::acc A;
  F<A> f;
  f.s0 = (A)a->s[0];
  f.s1 = (A)a->s[1];
  const kiln__view *ins[2] = {x, g};
  return kc_ew_launch<2, T, T, T, T>(d, &a->out[0], ins, f, kiln__kop_name(a->op));
}

template <class T>
kiln_status unary_float(kiln__cuda_dev *d, const kiln__kargs *a, const kiln__view *x,
                        const kiln__view *g) {
  typedef typename kc_traits<T>::acc A;
  switch (a->op) {
  case KILN__K_NEG: return unary<F_neg, T>(d, a, x);
  case KILN__K_EXP: return unary<F_exp, T>(d, a, x);
  case KILN__K_LOG: return unary<F_log, T>(d, a, x);
  case KILN__K_SQRT: return unary<F_sqrt, T>(d, a, x);
  case KILN__K_RSQRT: return unary<F_rsqrt, T>(d, a, x);
  case KILN__K_ABS: return unary<F_abs, T>(d, a, x);
  case KILN__K_SIGN: return unary<F_sign, T>(d, a, x);
  case KILN__K_RELU: return unary<F_relu, T>(d, a, x);
  case KILN__K_LEAKY_RELU: return unary<F_leaky, T>(d, a, x);
  case KILN__K_GELU: return unary<F_gelu, T>(d, a, x);
  case KILN__K_GELU_TANH: return unary<F_gelu_tanh, T>(d, a, x);
  case KILN__K_SILU: return unary<F_silu, T>(d, a, x);
  case KILN__K_SIGMOID: return unary<F_sigmoid, T>(d, a, x);
  case KILN__K_TANH: return unary<F_tanh, T>(d, a, x);
  case KILN__K_SOFTPLUS: return unary<F_softplus, T>(d, a, x);
  case KILN__K_POW_SCALAR: return unary<F_pow_scalar, T>(d, a, x);
  case KILN__K_AFFINE: return unary<F_affine, T>(d, a, x);
  case KILN__K_CLAMP: {
    F_clamp<A> f = {a->s[0], a->s[1]};
    const kiln__view *ins[1] = {x};
    return kc_ew_launch<1, T, T, T, T>(d, &a->out[0], ins, f, "clamp");
  }
  case KILN__K_RELU_BACKWARD: return unary_bw<F_relu_bw, T>(d, a, x, g);
  case KILN__K_LEAKY_RELU_BACKWARD: return unary_bw<F_leaky_bw, T>(d, a, x, g);
  case KILN__K_GELU_BACKWARD: return unary_bw<F_gelu_bw, T>(d, a, x, g);
  case KILN__K_GELU_TANH_BACKWARD: return unary_bw<F_gelu_tanh_bw, T>(d, a, x, g);
  case KILN__K_SILU_BACKWARD: return unary_bw<F_silu_bw, T>(d, a, x, g);
  case KILN__K_SIGMOID_BACKWARD: return unary_bw<F_sigmoid_bw, T>(d, a, x, g);
  case KILN__K_TANH_BACKWARD: return unary_bw<F_tanh_bw, T>(d, a, x, g);
  case KILN__K_SOFTPLUS_BACKWARD: return unary_bw<F_softplus_bw, T>(d, a, x, g);
  case KILN__K_CLAMP_BACKWARD: {
    F_clamp_bw<A> f = {a->s[0], a->s[1]};
    const kiln__view *ins[2] = {x, g};
    return kc_ew_launch<2, T, T, T, T>(d, &a->out[0], ins, f, "clamp_backward");
  }
  default: return bad(a, "op");
  }
}

template <class T>
kiln_status unary_int(kiln__cuda_dev *d, const kiln__kargs *a, const kiln__view *x) {
  const kiln__view *ins[1] = {x};
  switch (a->op) {
  case KILN__K_NEG: return unary<F_neg, T>(d, a, x);
  case KILN__K_ABS: return unary<F_abs, T>(d, a, x);
  case KILN__K_SIGN: return unary<F_sign, T>(d, a, x);
  case KILN__K_RELU: return unary<F_relu, T>(d, a, x);
  case KILN__K_CLAMP: {
    F_clamp<int64_t> f = {a->s[0], a->s[1]};
    return kc_ew_launch<1, T, T, T, T>(d, &a->out[0], ins, f, "clamp");
  }
  case KILN__K_AFFINE: {
    F_affine_int f = {a->s[0], a->s[1]};
    return kc_ew_launch<1, T, T, T, T>(d, &a->out[0], ins, f, "affine");
  }
  default: return bad(a, "integer dtype");
  }
}

bool is_unary(kiln__kop op) { return op >= KILN__K_NEG && op <= KILN__K_AFFINE; }
bool is_unary_bw(kiln__kop op) {
  return op >= KILN__K_RELU_BACKWARD && op <= KILN__K_CLAMP_BACKWARD;
}
bool int_unary_ok(kiln__kop op) {
  return op == KILN__K_NEG || op == KILN__K_ABS || op == KILN__K_SIGN || op == KILN__K_RELU ||
         op == KILN__K_CLAMP || op == KILN__K_AFFINE;
}

} // namespace

/* ---- helpers for the other families ---- */

extern "C" kiln_status kiln__cuda_cast_view(int device, const kiln__view *out,
                                            const kiln__view *in) {
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(device, &d));
  KC_SWITCH_ALL(out->dtype, TO, return kiln_set_error(KILN_ERR_DTYPE, "kiln_copy: bad dtype"),
                return copy_to<TO>(d, out, in))
  return KILN_OK;
}

extern "C" kiln_status kiln__cuda_scale_view(int device, const kiln__view *out, double s) {
  kiln__kargs a = {};
  a.op = KILN__K_AFFINE;
  a.device = device;
  a.n_in = 1;
  a.n_out = 1;
  a.in[0] = *out;
  a.out[0] = *out;
  a.s[0] = s;
  a.s[1] = 0.0;
  return kiln__cuda_elementwise(&a);
}

extern "C" kiln_status kiln__cuda_add_view(int device, const kiln__view *out,
                                           const kiln__view *in) {
  kiln__kargs a = {};
  a.op = KILN__K_ADD;
  a.device = device;
  a.n_in = 2;
  a.n_out = 1;
  a.in[0] = *out;
  a.in[1] = *in;
  a.out[0] = *out;
  a.s[0] = 1.0;
  return kiln__cuda_binary(&a);
}

/* ---- the family's entry points ---- */

extern "C" bool kiln__cuda_elementwise_supports(const kiln__kargs *a) {
  kiln_dtype dt = a->out[0].dtype;
  if (kc_size(dt) == 0) return false;
  kiln__kop op = a->op;
  if (op == KILN__K_COPY || op == KILN__K_FILL || op == KILN__K_ARANGE || op == KILN__K_EYE)
    return true;
  if (is_unary(op) || is_unary_bw(op)) {
    if (kc_is_float(dt)) return true;
    return is_unary(op) && int_unary_ok(op) && dt != KILN_BOOL;
  }
  return kiln__cuda_binary_supports(a);
}

extern "C" kiln_status kiln__cuda_elementwise(const kiln__kargs *a) {
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(a->device, &d));
  const kiln__view *out = &a->out[0];
  kiln_dtype dt = out->dtype;
  switch (a->op) {
  case KILN__K_COPY: return kiln__cuda_copy_view(a->device, out, &a->in[0]);
  case KILN__K_FILL: return kiln__cuda_fill_view(a->device, out, a->s[0]);
  case KILN__K_ARANGE:
    KC_SWITCH_ALL(dt, T, return bad(a, "dtype"), return arange<T>(d, a))
    return KILN_OK;
  case KILN__K_EYE:
    if (out->ndim != 2)
      return kiln_set_error(KILN_ERR_SHAPE, "kiln_eye: out must be 2-d (got %d dims)", out->ndim);
    KC_SWITCH_ALL(dt, T, return bad(a, "dtype"), return eye<T>(d, a))
    return KILN_OK;
  default: break;
  }
  if (!is_unary(a->op) && !is_unary_bw(a->op)) return kiln__cuda_binary(a);
  if (!kiln__cuda_elementwise_supports(a)) return bad(a, "dtype");
  kc_temps tmp(a->device);
  const kiln__view *x = tmp.cast(&a->in[0], out, dt);
  if (!x) return kiln_last_error();
  const kiln__view *g = NULL;
  if (is_unary_bw(a->op)) {
    g = tmp.cast(&a->in[1], out, dt);
    if (!g) return kiln_last_error();
  }
  if (kc_is_float(dt)) {
    KC_SWITCH_FLOAT(dt, T, return bad(a, "dtype"), return unary_float<T>(d, a, x, g))
  } else {
    switch (dt) {
    case KILN_I64: return unary_int<int64_t>(d, a, x);
    case KILN_I32: return unary_int<int32_t>(d, a, x);
    case KILN_U8: return unary_int<uint8_t>(d, a, x);
    default: return bad(a, "dtype");
    }
  }
  return KILN_OK;
}
