/*
** The RNG: Philox4x32-10 known answers (Random123's kat_vectors), the CPU's draws element
** by element against the mapping rng.c documents (recomputed here from the raw blocks),
** same seed same numbers, state save/restore, independence from the thread count,
** distribution sanity.
*/
#include "harness.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static kiln_device cpu;

static void test_philox_kat(void) {
  /* key words (k0, k1) = lo/hi of key; counter words c0..c3 = lo/hi of counter_lo, then
  ** lo/hi of counter_hi (kiln.h) */
  struct {
    uint64_t key, chi, clo;
    uint32_t want[4];
  } kat[] = {
      {0, 0, 0, {0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}},
      {UINT64_MAX, UINT64_MAX, UINT64_MAX, {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}},
      {UINT64_C(0x299f31d0a4093822), UINT64_C(0x0370734413198a2e), UINT64_C(0x85a308d3243f6a88),
       {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}},
  };
  for (int i = 0; i < 3; i++) {
    uint32_t out[4] = {0};
    kiln_philox4x32(kat[i].key, kat[i].chi, kat[i].clo, out);
    H_CHECK(memcmp(out, kat[i].want, sizeof out) == 0,
            "philox4x32-10 KAT %d: got %08x %08x %08x %08x want %08x %08x %08x %08x", i, out[0],
            out[1], out[2], out[3], kat[i].want[0], kat[i].want[1], kat[i].want[2], kat[i].want[3]);
  }
}

static bool same(kiln_tensor *a, kiln_tensor *b) {
  int64_t na = 0, nb = 0;
  double *va = h_values(a, &na), *vb = h_values(b, &nb);
  bool eq = va && vb && na == nb && memcmp(va, vb, sizeof(double) * (size_t)na) == 0;
  free(va), free(vb);
  return eq;
}

typedef kiln_tensor *(*draw_fn)(kiln_generator *g, int64_t n, kiln_dtype dt);
static kiln_tensor *d_rand(kiln_generator *g, int64_t n, kiln_dtype dt) {
  return kiln_rand(KILN_SHAPE(n), dt, cpu, g);
}
static kiln_tensor *d_randn(kiln_generator *g, int64_t n, kiln_dtype dt) {
  return kiln_randn(KILN_SHAPE(n), dt, cpu, g);
}
static kiln_tensor *d_randint(kiln_generator *g, int64_t n, kiln_dtype dt) {
  (void)dt;
  return kiln_randint(-5, 17, KILN_SHAPE(n), KILN_I64, cpu, g);
}


/* The documented mapping, from the raw block: element k of a draw at generator offset o. */
static void blk(uint64_t seed, uint64_t c, uint32_t b[4]) { kiln_philox4x32(seed, 0, c, b); }
static float map_uniform(uint64_t seed, uint64_t o, uint64_t k) {
  uint32_t b[4];
  blk(seed, o + k / 4, b);
  return (float)(b[k % 4] >> 8) * (1.0f / 16777216.0f);
}
static double map_uniform_f64(uint64_t seed, uint64_t o, uint64_t k) {
  uint32_t b[4];
  blk(seed, o + k / 2, b);
  uint32_t a = b[2 * (k % 2)], c = b[2 * (k % 2) + 1];
  return ((double)(a >> 5) * 67108864.0 + (double)(c >> 6)) / 9007199254740992.0;
}
static float map_normal(uint64_t seed, uint64_t o, uint64_t k) {
  uint32_t b[4];
  blk(seed, o + k / 4, b);
  unsigned p = (unsigned)((k % 4) / 2);
  float u1 = (float)((b[2 * p] >> 8) + 1) * (1.0f / 16777216.0f), u2 = (float)(b[2 * p + 1] >> 8) * (1.0f / 16777216.0f);
  float r = sqrtf(-2.0f * logf(u1)), th = (float)6.283185307179586476925286766559 * u2;
  return k % 2 == 0 ? r * cosf(th) : r * sinf(th);
}
static double map_normal_f64(uint64_t seed, uint64_t o, uint64_t k) {
  uint32_t b[4];
  blk(seed, o + k / 2, b);
  double u1 = ((double)(b[0] >> 5) * 67108864.0 + (double)(b[1] >> 6) + 1.0) / 9007199254740992.0;
  double u2 = ((double)(b[2] >> 5) * 67108864.0 + (double)(b[3] >> 6)) / 9007199254740992.0;
  double r = sqrt(-2.0 * log(u1));
  return k % 2 == 0 ? r * cos(6.283185307179586476925286766559 * u2) : r * sin(6.283185307179586476925286766559 * u2);
}

/* The CPU kernels compute each Philox block once for a run of elements: every element
** must still be the mapping's, bit for bit, whatever the offset, length, thread count and
** output strides (a run that starts or ends inside a block). */
static void test_mapping(void) {
  kiln_scope_begin();
  const int nt = kiln_num_threads();
  const int64_t lens[] = {1, 3, 6, 1001, 100003};
  int bad[6] = {0};
  for (int th = 1; th <= 2; th++) {
    kiln_set_num_threads(th);
    for (size_t li = 0; li < sizeof lens / sizeof *lens; li++) {
      const int64_t n = lens[li];
      kiln_generator *g = kiln_generator_new(31337);
      kiln_tensor *pre = kiln_rand(KILN_SHAPE(3), KILN_F32, cpu, g); /* the offset is not 0 */
      uint64_t seed, o[6];
      kiln_generator_get_state(g, &seed, &o[0]);
      double *u = h_values(kiln_rand(KILN_SHAPE(n), KILN_F32, cpu, g), NULL);
      kiln_generator_get_state(g, &seed, &o[1]);
      double *z = h_values(kiln_randn(KILN_SHAPE(n), KILN_F32, cpu, g), NULL);
      kiln_generator_get_state(g, &seed, &o[2]);
      double *u64 = h_values(kiln_rand(KILN_SHAPE(n), KILN_F64, cpu, g), NULL);
      kiln_generator_get_state(g, &seed, &o[3]);
      double *z64 = h_values(kiln_randn(KILN_SHAPE(n), KILN_F64, cpu, g), NULL);
      kiln_generator_get_state(g, &seed, &o[4]);
      double *ri = h_values(kiln_randint(-7, 1000003, KILN_SHAPE(n), KILN_I64, cpu, g), NULL);
      /* a strided output: column 1 of (n, 3); elements in the view's C order */
      kiln_tensor *t = kiln_zeros(KILN_SHAPE(n, 3), KILN_F32, cpu);
      kiln_generator_get_state(g, &seed, &o[5]);
      kiln_normal_(kiln_select(t, 1, 1), 0.0, 1.0, g);
      double *col = h_values(kiln_contiguous(kiln_select(t, 1, 1)), NULL);
      for (int64_t k = 0; pre && u && z && u64 && z64 && ri && col && k < n; k++) {
        bad[0] += u[k] != map_uniform(seed, o[0], (uint64_t)k);
        bad[1] += z[k] != map_normal(seed, o[1], (uint64_t)k);
        bad[2] += u64[k] != map_uniform_f64(seed, o[2], (uint64_t)k);
        bad[3] += z64[k] != map_normal_f64(seed, o[3], (uint64_t)k);
        double want = -7 + floor(map_uniform_f64(seed, o[4], (uint64_t)k) * (1000003.0 + 7.0));
        bad[4] += ri[k] != (want > 1000002 ? 1000002 : want);
        bad[5] += col[k] != map_normal(seed, o[5], (uint64_t)k);
      }
      H_CHECK(pre && u && z && u64 && z64 && ri && col, "draws of %lld", (long long)n);
      free(u), free(z), free(u64), free(z64), free(ri), free(col);
      kiln_generator_free(g);
    }
  }
  kiln_set_num_threads(nt);
  /* counters across 2^32 (the low word wraps, the high one takes the carry: the vector
  ** kernel adds the lane to the low word alone) */
  kiln_generator *gw = kiln_generator_new(5);
  const uint64_t ow = (UINT64_C(1) << 32) - 7;
  kiln_generator_set_state(gw, 5, ow);
  double *uw = h_values(kiln_rand(KILN_SHAPE(4099), KILN_F32, cpu, gw), NULL);
  int bad_wrap = uw ? 0 : -1;
  for (int64_t k = 0; uw && k < 4099; k++) bad_wrap += uw[k] != map_uniform(5, ow, (uint64_t)k);
  H_CHECK(bad_wrap == 0, "rand f32 across counter 2^32: %d elements differ from the mapping", bad_wrap);
  free(uw);
  kiln_generator_free(gw);
  const char *what[6] = {"rand f32", "randn f32", "rand f64", "randn f64", "randint", "normal_ on a strided view"};
  for (int i = 0; i < 6; i++) H_CHECK(bad[i] == 0, "%s: %d elements differ from the documented mapping", what[i], bad[i]);
  kiln_scope_end();
}

static void test_reproducible(void) {
  kiln_scope_begin();
  draw_fn fns[3] = {d_rand, d_randn, d_randint};
  const char *names[3] = {"rand", "randn", "randint"};
  kiln_dtype dts[4] = {KILN_F32, KILN_F64, KILN_F16, KILN_BF16};
  for (int f = 0; f < 3; f++)
    for (int d = 0; d < (f == 2 ? 1 : 4); d++) {
      kiln_generator *g1 = kiln_generator_new(2024), *g2 = kiln_generator_new(2024);
      kiln_generator *g3 = kiln_generator_new(2025);
      kiln_tensor *a = fns[f](g1, 1001, dts[d]), *b = fns[f](g2, 1001, dts[d]);
      kiln_tensor *c = fns[f](g3, 1001, dts[d]), *a2 = fns[f](g1, 1001, dts[d]);
      H_CHECK(a && b && same(a, b), "%s %s: same seed, same numbers", names[f], kiln_dtype_name(dts[d]));
      H_CHECK(c && !same(a, c), "%s %s: another seed, other numbers", names[f], kiln_dtype_name(dts[d]));
      H_CHECK(a2 && !same(a, a2), "%s %s: the generator advances", names[f], kiln_dtype_name(dts[d]));
      /* state save / restore */
      uint64_t seed, off;
      kiln_generator_get_state(g2, &seed, &off);
      H_CHECK(seed == 2024 && off > 0, "state after a draw: seed 2024, offset %llu > 0",
              (unsigned long long)off);
      kiln_tensor *x1 = fns[f](g2, 77, dts[d]);
      kiln_generator *g4 = kiln_generator_new(1);
      kiln_generator_set_state(g4, seed, off);
      kiln_tensor *x2 = fns[f](g4, 77, dts[d]);
      H_CHECK(same(x1, x2), "%s %s: a restored state repeats the numbers", names[f],
              kiln_dtype_name(dts[d]));
      kiln_generator_seed(g4, 2024);
      uint64_t s2, o2;
      kiln_generator_get_state(g4, &s2, &o2);
      H_CHECK(s2 == 2024 && o2 == 0, "generator_seed resets the offset");
      kiln_generator_free(g1), kiln_generator_free(g2), kiln_generator_free(g3), kiln_generator_free(g4);
    }
  /* element k in C order does not depend on the shape */
  kiln_generator *g = kiln_generator_new(9);
  kiln_tensor *flat = kiln_rand(KILN_SHAPE(24), KILN_F32, cpu, g);
  kiln_generator_seed(g, 9);
  kiln_tensor *shaped = kiln_rand(KILN_SHAPE(2, 3, 4), KILN_F32, cpu, g);
  H_CHECK(same(flat, kiln_reshape(shaped, KILN_SHAPE(24))), "rand [24] and [2,3,4] agree element-wise");
  /* global generator */
  kiln_manual_seed(5);
  kiln_tensor *m1 = kiln_randn(KILN_SHAPE(50), KILN_F32, cpu, NULL);
  kiln_manual_seed(5);
  kiln_tensor *m2 = kiln_randn(KILN_SHAPE(50), KILN_F32, cpu, NULL);
  H_CHECK(same(m1, m2), "manual_seed repeats the global generator");
  kiln_manual_seed(5);
  kiln_tensor *m3 = kiln_randn(KILN_SHAPE(50), KILN_F32, cpu, kiln_generator_global());
  H_CHECK(same(m1, m3), "NULL generator is kiln_generator_global()");
  kiln_generator_free(g);
  kiln_scope_end();
}

static void test_threads(void) {
  kiln_scope_begin();
  int nt = kiln_num_threads();
  H_CHECK(nt >= 1, "num_threads %d", nt);
  const int64_t n = 200003;
  kiln_tensor *r[2][4];
  for (int t = 0; t < 2; t++) {
    kiln_set_num_threads(t + 1);
    H_CHECK(kiln_num_threads() == t + 1, "set_num_threads(%d)", t + 1);
    kiln_generator *g = kiln_generator_new(77);
    r[t][0] = kiln_rand(KILN_SHAPE(n), KILN_F32, cpu, g);
    r[t][1] = kiln_randn(KILN_SHAPE(n), KILN_F64, cpu, g);
    r[t][2] = kiln_randint(0, 1000, KILN_SHAPE(n), KILN_I32, cpu, g);
    kiln_tensor *u = kiln_empty(KILN_SHAPE(n), KILN_F32, cpu);
    kiln_normal_(u, 2, 3, g);
    r[t][3] = u;
    kiln_generator_free(g);
  }
  kiln_set_num_threads(nt);
  const char *names[4] = {"rand", "randn", "randint", "normal_"};
  for (int k = 0; k < 4; k++)
    H_CHECK(r[0][k] && r[1][k] && same(r[0][k], r[1][k]), "%s: 1 and 2 threads give identical values",
            names[k]);
  kiln_scope_end();
}

static void stats(kiln_tensor *t, double *mean, double *sd, double *mn, double *mx) {
  int64_t n = 0;
  double *v = h_values(t, &n), s = 0, s2 = 0;
  *mn = INFINITY, *mx = -INFINITY;
  for (int64_t k = 0; v && k < n; k++) {
    s += v[k], s2 += v[k] * v[k];
    *mn = fmin(*mn, v[k]), *mx = fmax(*mx, v[k]);
  }
  *mean = s / (double)n;
  *sd = sqrt(s2 / (double)n - *mean * *mean);
  free(v);
}

static void test_distributions(void) {
  kiln_scope_begin();
  kiln_generator *g = kiln_generator_new(31337);
  const int64_t n = 100000;
  double mean, sd, mn, mx, tol = 5 / sqrt((double)n);
  kiln_dtype dts[4] = {KILN_F32, KILN_F64, KILN_F16, KILN_BF16};
  for (int d = 0; d < 4; d++) {
    const char *dn = kiln_dtype_name(dts[d]);
    stats(kiln_randn(KILN_SHAPE(n), dts[d], cpu, g), &mean, &sd, &mn, &mx);
    H_CHECK(fabs(mean) < tol && fabs(sd - 1) < 2 * tol, "randn %s mean %.4f std %.4f", dn, mean, sd);
    H_CHECK(mn > -7 && mx < 7 && mn < -3 && mx > 3, "randn %s range [%.2f, %.2f]", dn, mn, mx);
    stats(kiln_rand(KILN_SHAPE(n), dts[d], cpu, g), &mean, &sd, &mn, &mx);
    H_CHECK(fabs(mean - 0.5) < tol && fabs(sd - sqrt(1 / 12.0)) < 2 * tol,
            "rand %s mean %.4f std %.4f", dn, mean, sd);
    H_CHECK(mn >= 0 && mx < 1, "rand %s in [0, 1): [%g, %g]", dn, mn, mx);
  }
  kiln_tensor *ri = kiln_randint(-3, 4, KILN_SHAPE(n), KILN_I64, cpu, g);
  int64_t m = 0, counts[7] = {0};
  double *v = h_values(ri, &m);
  bool in_range = v != NULL;
  for (int64_t k = 0; v && k < m; k++) {
    if (v[k] < -3 || v[k] > 3 || v[k] != floor(v[k])) in_range = false;
    else counts[(int)v[k] + 3]++;
  }
  free(v);
  H_CHECK(in_range, "randint in [-3, 4)");
  for (int k = 0; k < 7; k++)
    H_CHECK(fabs((double)counts[k] / (double)n - 1 / 7.0) < 0.01, "randint value %d frequency %.4f", k - 3,
            (double)counts[k] / (double)n);
  H_CHECK(kiln_randint(5, 5, KILN_SHAPE(3), KILN_I64, cpu, g) == NULL && kiln_last_error() != KILN_OK,
          "randint with an empty range is an error");
  kiln_clear_error();
  kiln_tensor *u = kiln_zeros(KILN_SHAPE(n), KILN_F64, cpu);
  H_CHECK(kiln_uniform_(u, -2, 6, g) == KILN_OK, "uniform_");
  stats(u, &mean, &sd, &mn, &mx);
  H_CHECK(fabs(mean - 2) < 8 * tol && mn >= -2 && mx < 6, "uniform_(-2, 6) mean %.3f range [%.3f, %.3f]", mean, mn, mx);
  H_CHECK(kiln_normal_(u, 10, 0.5, g) == KILN_OK, "normal_");
  stats(u, &mean, &sd, &mn, &mx);
  H_CHECK(fabs(mean - 10) < tol && fabs(sd - 0.5) < tol, "normal_(10, 0.5) mean %.4f std %.4f", mean, sd);
  /* host draws */
  bool ok = true;
  for (int k = 0; k < 10000; k++) {
    double x = kiln_generator_uniform(g);
    uint64_t b = kiln_generator_below(g, 7);
    ok &= x >= 0 && x < 1 && b < 7;
  }
  H_CHECK(ok, "generator_uniform in [0,1) and generator_below(7) < 7");
  kiln_tensor *p = kiln_randperm(1000, g);
  bool perm = p && kiln_numel(p) == 1000 && kiln_dtype_of(p) == KILN_I64;
  if (perm) {
    double *pv = h_values(p, NULL);
    bool seen[1000] = {0};
    for (int k = 0; k < 1000; k++) {
      int x = (int)pv[k];
      if (x < 0 || x >= 1000 || seen[x]) perm = false;
      else seen[x] = true;
    }
    free(pv);
  }
  H_CHECK(perm, "randperm(1000) is a permutation of 0..999");
  kiln_generator_free(g);
  kiln_generator_free(NULL);
  kiln_scope_end();
}

int main(int argc, char **argv) {
  h_init(argc, argv, "test_rng");
  cpu = kiln_device_cpu();
  if (h_cross_only()) {
    /* same seed, same numbers on every device */
    for (int d = 0; d < kiln_device_count(KILN_DEVICE_CUDA); d++) {
      kiln_scope_begin();
      kiln_generator *g1 = kiln_generator_new(3), *g2 = kiln_generator_new(3);
      kiln_tensor *a = kiln_randn(KILN_SHAPE(4097), KILN_F32, cpu, g1);
      kiln_tensor *b = kiln_randn(KILN_SHAPE(4097), KILN_F32, kiln_device_cuda(d), g2);
      kiln_tensor *c = kiln_rand(KILN_SHAPE(4097), KILN_F64, cpu, g1);
      kiln_tensor *e = kiln_rand(KILN_SHAPE(4097), KILN_F64, kiln_device_cuda(d), g2);
      int64_t n = 0;
      double *va = h_values(a, &n), *vb = h_values(b, NULL);
      H_CHECK(va && vb && h_close("randn cuda vs cpu", vb, va, n, 1e-6, 1e-6), "randn on cuda:%d", d);
      H_CHECK(same(c, e), "rand f64 on cuda:%d equals the CPU", d);
      free(va), free(vb);
      kiln_generator_free(g1), kiln_generator_free(g2);
      kiln_scope_end();
    }
    return h_finish();
  }
  test_philox_kat();
  test_mapping();
  test_reproducible();
  test_threads();
  test_distributions();
  return h_finish();
}
