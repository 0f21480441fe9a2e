/*
** Dtypes: names, sizes, promotion (PyTorch's table), and the f16/bf16 conversions —
** known bit patterns, round-to-nearest-even ties, subnormals, overflow, NaN, every 16-bit
** pattern round-tripped, tensor conversion equal to the scalar one, and 200k random floats against an independent reference that
** rounds on the f16/bf16 grid in double arithmetic.
*/
#include "harness.h"

#include <stdlib.h>
#include <string.h>

static uint32_t f2u(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
static float u2f(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* Independent reference: the nearest value on the grid of a binary format with `man`
** mantissa bits, minimum normal exponent emin and maximum finite exponent emax, ties to
** even (nearbyint in the default rounding mode). Returns the bit pattern. */
static uint32_t ref_round(float f, int man, int emin, int emax, int ebias) {
  uint32_t sign = f2u(f) >> 31;
  double a = fabs((double)f);
  uint32_t inf = ((uint32_t)(emax + ebias + 1)) << man;
  uint32_t out;
  if (a == 0) {
    out = 0;
  } else if (a < ldexp(1.0, emin)) {
    double q = nearbyint(a / ldexp(1.0, emin - man)); /* subnormal units */
    out = (uint32_t)q; /* q == 2^man is the smallest normal: bits line up */
  } else {
    int E;
    frexp(a, &E);
    int e = E - 1;
    double q = nearbyint(a / ldexp(1.0, e - man));
    if (q == ldexp(1.0, man + 1)) e++, q = ldexp(1.0, man);
    if (e > emax) out = inf;
    else out = ((uint32_t)(e + ebias) << man) | (uint32_t)(q - ldexp(1.0, man));
  }
  return (sign << (man + (man == 10 ? 5 : 8))) | out;
}
static uint16_t ref_f16(float f) { return (uint16_t)ref_round(f, 10, -14, 15, 15); }
static uint16_t ref_bf16(float f) { return (uint16_t)ref_round(f, 7, -126, 127, 127); }

static void test_basics(void) {
  struct {
    kiln_dtype dt;
    const char *name;
    size_t size;
    bool fl;
  } t[] = {{KILN_F32, "float32", 4, true}, {KILN_F64, "float64", 8, true},
           {KILN_F16, "float16", 2, true}, {KILN_BF16, "bfloat16", 2, true},
           {KILN_I64, "int64", 8, false},  {KILN_I32, "int32", 4, false},
           {KILN_U8, "uint8", 1, false},   {KILN_BOOL, "bool", 1, false}};
  for (int i = 0; i < 8; i++) {
    H_CHECK(strcmp(kiln_dtype_name(t[i].dt), t[i].name) == 0, "dtype_name(%d) = %s, want %s", i,
            kiln_dtype_name(t[i].dt), t[i].name);
    H_CHECK(kiln_dtype_size(t[i].dt) == t[i].size, "dtype_size(%s)", t[i].name);
    H_CHECK(kiln_dtype_is_float(t[i].dt) == t[i].fl, "dtype_is_float(%s)", t[i].name);
  }
  H_CHECK(strcmp(kiln_dtype_name((kiln_dtype)42), "?") == 0 && kiln_dtype_size((kiln_dtype)42) == 0 &&
              !kiln_dtype_is_float((kiln_dtype)42),
          "invalid dtype: \"?\", size 0");
  /* torch.promote_types */
  struct {
    kiln_dtype a, b, want;
  } p[] = {{KILN_F32, KILN_F64, KILN_F64}, {KILN_F16, KILN_F32, KILN_F32},
           {KILN_F16, KILN_BF16, KILN_F32}, {KILN_BF16, KILN_BF16, KILN_BF16},
           {KILN_F16, KILN_I64, KILN_F16},  {KILN_BF16, KILN_I32, KILN_BF16},
           {KILN_I32, KILN_I64, KILN_I64},  {KILN_U8, KILN_I32, KILN_I32},
           {KILN_BOOL, KILN_U8, KILN_U8},   {KILN_BOOL, KILN_BOOL, KILN_BOOL},
           {KILN_BOOL, KILN_F16, KILN_F16}, {KILN_I64, KILN_F32, KILN_F32},
           {KILN_U8, KILN_U8, KILN_U8},     {KILN_BOOL, KILN_I64, KILN_I64}};
  for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) {
    kiln_dtype g1 = kiln_dtype_promote(p[i].a, p[i].b), g2 = kiln_dtype_promote(p[i].b, p[i].a);
    H_CHECK(g1 == p[i].want && g2 == p[i].want, "promote(%s, %s) = %s / %s, want %s",
            kiln_dtype_name(p[i].a), kiln_dtype_name(p[i].b), kiln_dtype_name(g1),
            kiln_dtype_name(g2), kiln_dtype_name(p[i].want));
  }
}

static void test_half_known(void) {
  struct {
    float f;
    uint16_t h, b;
  } k[] = {
      {1.0f, 0x3c00, 0x3f80},        {-2.0f, 0xc000, 0xc000},        {0.5f, 0x3800, 0x3f00},
      {65504.0f, 0x7bff, 0x4780}, {0.1f, 0x2e66, 0x3dcd},
      {1.0f / 3, 0x3555, 0x3eab},   {-0.0f, 0x8000, 0x8000},        {0x1p-24f, 0x0001, 0x3380},
      {INFINITY, 0x7c00, 0x7f80},   {-INFINITY, 0xfc00, 0xff80},
  };
  for (size_t i = 0; i < sizeof k / sizeof k[0]; i++) {
    uint16_t h = kiln_f32_to_f16(k[i].f), b = kiln_f32_to_bf16(k[i].f);
    H_CHECK(h == k[i].h, "f32_to_f16(%a) = %04x, want %04x", (double)k[i].f, h, k[i].h);
    H_CHECK(b == k[i].b, "f32_to_bf16(%a) = %04x, want %04x", (double)k[i].f, b, k[i].b);
  }
  /* ties to even and boundaries */
  H_CHECK(kiln_f32_to_f16(1 + 0x1p-11f) == 0x3c00, "f16 half-ulp tie above 1 rounds down to even");
  H_CHECK(kiln_f32_to_f16(1 + 3 * 0x1p-11f) == 0x3c02, "f16 1.5-ulp tie rounds up to even");
  H_CHECK(kiln_f32_to_f16(65519.0f) == 0x7bff && kiln_f32_to_f16(65520.0f) == 0x7c00,
          "f16 overflow at 65520");
  H_CHECK(kiln_f32_to_f16(0x1p-25f) == 0x0000 && kiln_f32_to_f16(3 * 0x1p-25f) == 0x0002,
          "f16 subnormal ties to even");
  H_CHECK(kiln_f32_to_f16(0x1.ffcp-15f) == 0x0400 && kiln_f32_to_f16(0x1.ff8p-15f) == 0x03ff, "f16 1023.5 subnormal units tie to 0x0400");
  H_CHECK(kiln_f32_to_bf16(1 + 0x1p-8f) == 0x3f80 && kiln_f32_to_bf16(1 + 3 * 0x1p-8f) == 0x3f82,
          "bf16 ties to even");
  H_CHECK(kiln_f32_to_bf16(u2f(0x7f7fffffu)) == 0x7f80, "bf16 of FLT_MAX rounds to inf");
  uint16_t hn = kiln_f32_to_f16(NAN), bn = kiln_f32_to_bf16(NAN);
  H_CHECK((hn & 0x7c00) == 0x7c00 && (hn & 0x03ff) != 0, "f16 NaN stays NaN (%04x)", hn);
  H_CHECK((bn & 0x7f80) == 0x7f80 && (bn & 0x007f) != 0, "bf16 NaN stays NaN (%04x)", bn);
  uint16_t bsn = kiln_f32_to_bf16(u2f(0x7f800001u)); /* NaN with payload only in low bits */
  H_CHECK((bsn & 0x7f80) == 0x7f80 && (bsn & 0x007f) != 0, "bf16 of a low-payload NaN is NaN, not inf");
  H_CHECK(kiln_f16_to_f32(0x0001) == 0x1p-24f && kiln_f16_to_f32(0x7bff) == 65504.0f &&
              isinf(kiln_f16_to_f32(0x7c00)) && signbit(kiln_f16_to_f32(0x8000)) &&
              isnan(kiln_f16_to_f32(0x7e00)) && kiln_f16_to_f32(0x3555) == 0x1.554p-2f,
          "f16_to_f32 known values");
  H_CHECK(kiln_bf16_to_f32(0x3f80) == 1.0f && kiln_bf16_to_f32(0x0001) == 0x1p-133f &&
              isinf(kiln_bf16_to_f32(0xff80)) && isnan(kiln_bf16_to_f32(0x7fc0)),
          "bf16_to_f32 known values");
}

static void test_half_exhaustive(void) {
  int bad_h = 0, bad_b = 0;
  for (uint32_t u = 0; u < 65536; u++) {
    float fh = kiln_f16_to_f32((uint16_t)u), fb = kiln_bf16_to_f32((uint16_t)u);
    uint16_t h = kiln_f32_to_f16(fh), b = kiln_f32_to_bf16(fb);
    if (isnan(fh) ? !((h & 0x7c00) == 0x7c00 && (h & 0x3ff)) : h != u) bad_h++;
    if (isnan(fb) ? !((b & 0x7f80) == 0x7f80 && (b & 0x7f)) : b != u) bad_b++;
    /* the f16 value itself against its definition */
    uint32_t e = (u >> 10) & 31, m = u & 1023;
    double want = e == 0 ? ldexp((double)m, -24) : ldexp(1024.0 + m, (int)e - 25);
    if (e != 31 && (double)fabsf(fh) != want) bad_h++;
  }
  H_CHECK(bad_h == 0, "all 65536 f16 patterns round-trip and decode (%d bad)", bad_h);
  H_CHECK(bad_b == 0, "all 65536 bf16 patterns round-trip (%d bad)", bad_b);
  int mis_h = 0, mis_b = 0;
  uint32_t first_h = 0, first_b = 0;
  for (int i = 0; i < 200000; i++) {
    uint32_t u = (uint32_t)h_rand_u64();
    if (i % 2) u = (u & 0x807fffffu) | ((uint32_t)(101 + (u >> 23) % 50) << 23); /* near f16 range */
    float f = u2f(u);
    if (isnan(f)) continue;
    if (kiln_f32_to_f16(f) != ref_f16(f) && !mis_h++) first_h = u;
    if (kiln_f32_to_bf16(f) != ref_bf16(f) && !mis_b++) first_b = u;
  }
  H_CHECK(mis_h == 0, "f32_to_f16 on 200k random floats matches the reference (%d wrong, first %08x: %04x vs %04x)",
          mis_h, first_h, kiln_f32_to_f16(u2f(first_h)), ref_f16(u2f(first_h)));
  H_CHECK(mis_b == 0, "f32_to_bf16 on 200k random floats matches the reference (%d wrong, first %08x)",
          mis_b, first_b);
}

/* Tensor conversion agrees with the scalar functions, bit for bit. */
static void test_tensor_conversion(void) {
  kiln_scope_begin();
  enum { N = 4096 };
  static float src[N];
  for (int i = 0; i < N; i++) src[i] = u2f((uint32_t)h_rand_u64() & 0xc7ffffffu); /* |x| < 2^17ish */
  src[0] = NAN, src[1] = INFINITY, src[2] = 65520.0f, src[3] = 1 + 0x1p-11f;
  kiln_tensor *t = kiln_from_data(src, KILN_SHAPE(N), KILN_F32, kiln_device_cpu());
  static uint16_t h[N], b[N];
  kiln_tensor *th = kiln_to_dtype(t, KILN_F16), *tb = kiln_to_dtype(t, KILN_BF16);
  int bad_h = 0, bad_b = 0;
  if (H_CHECK(th && tb && kiln_to_host(th, h, sizeof h) == KILN_OK && kiln_to_host(tb, b, sizeof b) == KILN_OK,
              "convert a tensor to f16 and bf16")) {
    for (int i = 1; i < N; i++) {
      bad_h += h[i] != kiln_f32_to_f16(src[i]);
      bad_b += b[i] != kiln_f32_to_bf16(src[i]);
    }
    H_CHECK((h[0] & 0x7c00) == 0x7c00 && (h[0] & 0x3ff), "tensor NaN -> f16 NaN");
  }
  H_CHECK(bad_h == 0 && bad_b == 0, "tensor conversions equal the scalar ones (%d f16, %d bf16 differ)",
          bad_h, bad_b);
  kiln_scope_end();
}

int main(int argc, char **argv) {
  h_init(argc, argv, "test_dtype");
  if (h_cross_only()) return h_finish();
  test_basics();
  test_half_known();
  test_half_exhaustive();
  test_tensor_conversion();
  return h_finish();
}
