// The elementwise family's arithmetic, shared by ew.comp (strided, every dtype) and
// ew4.comp (the contiguous f32 fast path), so both give the same numbers.
const float SQRT1_2 = 0.70710678118654752;
const float INV_SQRT_2PI = 0.39894228040143268;
const float SQRT_2_PI = 0.79788456080286536;

// erfc, Numerical Recipes' Chebyshev fit: relative error < 1.2e-7 everywhere, so GELU's
// tail (x << 0) keeps its relative accuracy (GLSL has no erf).
float kv_erfc(float x) {
  float z = abs(x);
  float t = 1.0 / (1.0 + 0.5 * z);
  float r = t * exp(-z * z - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 +
            t * (-0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 +
            t * (-0.82215223 + t * 0.17087277)))))))));
  return x >= 0.0 ? r : 2.0 - r;
}

float kv_log1p(float y) {
  float u = 1.0 + y;
  return u == 1.0 ? y : log(u) * (y / (u - 1.0));
}

float kv_sigmoid(float x) { return 1.0 / (1.0 + exp(-x)); }

// C's pow for f32 (GLSL's is undefined for x < 0 and x == 0)
float kv_pow(float x, float y) {
  if (y == 0.0) return 1.0;
  if (isnan(x) || isnan(y)) return x + y;
  if (x == 0.0) {
    bool odd = fract(y * 0.5) == 0.5;
    if (y > 0.0) return odd ? x : 0.0;
    return odd ? 1.0 / x : 1.0 / 0.0;
  }
  if (x < 0.0) {
    if (floor(y) != y) return 0.0 / 0.0;
    float r = exp2(y * log2(-x));
    return fract(y * 0.5) == 0.5 ? -r : r;
  }
  return exp2(y * log2(x));
}

float kv_tanh(float x) { // tanh overflows in some drivers' exp-based versions
  if (abs(x) > 15.0) return sign(x);
  return tanh(x);
}

float unary(int op, float x) {
  Params P = pc.P;
  float s0 = P.s[0], s1 = P.s[1];
  switch (op) {
  case KV_NEG: return -x;
  case KV_EXP: return exp(x);
  case KV_LOG: return log(x);
  case KV_SQRT: return sqrt(x);
  case KV_RSQRT: return inversesqrt(x);
  case KV_ABS: return abs(x);
  case KV_SIGN: return isnan(x) ? x : sign(x);
  case KV_RELU: return x > 0.0 ? x : (isnan(x) ? x : 0.0);
  case KV_LEAKY_RELU: return x > 0.0 ? x : x * s0;
  case KV_GELU: return 0.5 * x * kv_erfc(-x * SQRT1_2);
  case KV_GELU_TANH: return 0.5 * x * (1.0 + kv_tanh(SQRT_2_PI * (x + 0.044715 * x * x * x)));
  case KV_SILU: return x * kv_sigmoid(x);
  case KV_SIGMOID: return kv_sigmoid(x);
  case KV_TANH: return kv_tanh(x);
  case KV_SOFTPLUS: return x * s0 > s1 ? x : kv_log1p(exp(s0 * x)) / s0;
  case KV_CLAMP: return isnan(x) ? x : min(max(x, s0), s1);
  case KV_POW_SCALAR: return kv_pow(x, s0);
  case KV_AFFINE: return x * s0 + s1;
  }
  return 0.0;
}

float backward(int op, float v, float g) {
  Params P = pc.P;
  float s0 = P.s[0], s1 = P.s[1];
  switch (op) {
  case KV_RELU_BW: return v > 0.0 ? g : 0.0;
  case KV_LEAKY_RELU_BW: return v > 0.0 ? g : g * s0;
  case KV_GELU_BW: return g * (0.5 * kv_erfc(-v * SQRT1_2) + v * INV_SQRT_2PI * exp(-0.5 * v * v));
  case KV_GELU_TANH_BW: {
    float u = SQRT_2_PI * (v + 0.044715 * v * v * v);
    float t = kv_tanh(u);
    return g * (0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * SQRT_2_PI * (1.0 + 3.0 * 0.044715 * v * v));
  }
  case KV_SILU_BW: {
    float s = kv_sigmoid(v);
    return g * s * (1.0 + v * (1.0 - s));
  }
  case KV_SIGMOID_BW: return g * v * (1.0 - v);
  case KV_TANH_BW: return g * (1.0 - v * v);
  case KV_SOFTPLUS_BW: return v * s0 > s1 ? g : g * kv_sigmoid(s0 * v);
  case KV_CLAMP_BW: return (v >= s0 && v <= s1) ? g : 0.0;
  }
  return 0.0;
}

float binary(int op, float x, float y) {
  Params P = pc.P;
  switch (op) {
  case KV_ADD: return P.s[0] == 1.0 ? x + y : fma(y, P.s[0], x);
  case KV_SUB: return x - y;
  case KV_MUL: return x * y;
  case KV_DIV: return x / y;
  case KV_POW: return kv_pow(x, y);
  case KV_MAXIMUM: return isnan(x) || x > y ? x : y;
  case KV_MINIMUM: return isnan(x) || x < y ? x : y;
  case KV_EQ: return x == y ? 1.0 : 0.0;
  case KV_NE: return x != y ? 1.0 : 0.0;
  case KV_LT: return x < y ? 1.0 : 0.0;
  case KV_LE: return x <= y ? 1.0 : 0.0;
  case KV_GT: return x > y ? 1.0 : 0.0;
  case KV_GE: return x >= y ? 1.0 : 0.0;
  }
  return 0.0;
}

int64_t binary_int(int op, int64_t x, int64_t y) {
  switch (op) {
  case KV_ADD: return x + int64_t(pc.P.i[0]) * y;
  case KV_SUB: return x - y;
  case KV_MUL: return x * y;
  case KV_DIV: return y == 0l ? 0l : x / y;
  case KV_MAXIMUM: return max(x, y);
  case KV_MINIMUM: return min(x, y);
  case KV_EQ: return x == y ? 1l : 0l;
  case KV_NE: return x != y ? 1l : 0l;
  case KV_LT: return x < y ? 1l : 0l;
  case KV_LE: return x <= y ? 1l : 0l;
  case KV_GT: return x > y ? 1l : 0l;
  case KV_GE: return x >= y ? 1l : 0l;
  }
  return 0l;
}

