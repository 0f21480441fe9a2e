/*
** bf16 MATMUL on the CPU (oneDNN's matmul where built in, AMX on CPUs that have it; the
** f32-temporary path elsewhere) against an f64 reference of the same bf16 inputs: the
** result must be the f32-accumulated product, rounded once to the output dtype. Layouts:
** plain, transposed A and/or B (W^T of a linear layer, D^T of a weight gradient), a
** column-major output, rows with padding (leading dim > cols), a batch with B shared
** (stride 0, folded into M) and a batch with B per element; bf16 and f32 outputs
** (autocast's weight gradients), with a bias, s0 != 1, and accumulation (s1 != 0); then
** f32 products of several sizes (OpenBLAS: f32 stays off oneDNN, see the log).
**
** Tolerance, from the arithmetic: f32 accumulation of K products errs by at most
** (K + 3) u32 (|s0| sum|a b| + |s1 c| + |bias|) (u32 = 2^-24; the 3: scale, sum post-op,
** bias), and a bf16 output adds its rounding, u16 |got| (u16 = 2^-8, round to nearest).
** A product in bf16 arithmetic (no f32 accumulator) or a wrong layout misses this by
** orders of magnitude.
*/
#include "kiln.h"
#include "backend/backend.h"
#include "backend/cpu/cpu.h"
#include "core/kiln_int.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int g_checks, g_fails;
static kiln_dtype g_in = KILN_BF16; /* the operands' dtype */

static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
static double urand(void) {
  g_rng ^= g_rng << 13;
  g_rng ^= g_rng >> 7;
  g_rng ^= g_rng << 17;
  return (double)(g_rng >> 11) / 9007199254740992.0;
}

static double rd(const kiln__view *v, int64_t off) {
  const char *p = (const char *)v->data + off * (int64_t)kiln_dtype_size(v->dtype);
  if (v->dtype == KILN_BF16) return kiln_bf16_to_f32(*(const uint16_t *)p);
  return *(const float *)p;
}
static void wr(const kiln__view *v, int64_t off, double x) {
  char *p = (char *)v->data + off * (int64_t)kiln_dtype_size(v->dtype);
  if (v->dtype == KILN_BF16)
    *(uint16_t *)p = kiln_f32_to_bf16((float)x);
  else
    *(float *)p = (float)x;
}

/* A (batch, rows, cols) view (batch 0: 2-d) over a fresh buffer: trans stores it
** column-major, pad adds unused elements after each row (column), bcast gives the batch
** dim stride 0. */
static kiln__view mk(void **buf, kiln_dtype dt, int64_t batch, int64_t r, int64_t c, int trans, int64_t pad,
                     int bcast) {
  kiln__view v;
  memset(&v, 0, sizeof v);
  v.dtype = dt;
  int64_t ld = (trans ? r : c) + pad, plane = ld * (trans ? c : r);
  int64_t nb = batch > 0 && !bcast ? batch : 1;
  *buf = calloc((size_t)(plane * nb + 1), kiln_dtype_size(dt));
  v.data = *buf;
  int o = 0;
  if (batch > 0) {
    v.shape[0] = batch, v.strides[0] = bcast ? 0 : plane;
    o = 1;
  }
  v.ndim = o + 2;
  v.shape[o] = r, v.shape[o + 1] = c;
  v.strides[o] = trans ? 1 : ld, v.strides[o + 1] = trans ? ld : 1;
  for (int64_t b = 0; b < nb; b++)
    for (int64_t i = 0; i < r; i++)
      for (int64_t j = 0; j < c; j++)
        wr(&v, b * plane + i * v.strides[o] + j * v.strides[o + 1], 4 * urand() - 2);
  return v;
}

static void one(int64_t batch, int64_t M, int64_t K, int64_t N, int ta, int tb, int tc, int64_t pad, int bshared,
                kiln_dtype out_dt, int with_bias, double s0, double s1) {
  void *ba, *bb, *bc, *bz = NULL;
  kiln__view A = mk(&ba, g_in, batch, M, K, ta, pad, 0);
  kiln__view B = mk(&bb, g_in, batch, K, N, tb, pad, bshared);
  kiln__view C = mk(&bc, out_dt, batch, M, N, tc, pad, 0);
  kiln__view Z;
  if (with_bias) Z = mk(&bz, KILN_BF16, 0, 1, N, 0, 0, 0), Z.ndim = 1, Z.shape[0] = N, Z.strides[0] = 1;
  int64_t nb = batch > 0 ? batch : 1, o = batch > 0 ? 1 : 0;
  double *old = malloc(sizeof(double) * (size_t)(nb * M * N));
  for (int64_t b = 0; b < nb; b++)
    for (int64_t i = 0; i < M; i++)
      for (int64_t j = 0; j < N; j++)
        old[(b * M + i) * N + j] = rd(&C, b * (o ? C.strides[0] : 0) + i * C.strides[o] + j * C.strides[o + 1]);
  kiln__kargs a;
  memset(&a, 0, sizeof a);
  a.op = KILN__K_MATMUL;
  a.n_in = with_bias ? 3 : 2;
  a.n_out = 1;
  a.in[0] = A, a.in[1] = B, a.out[0] = C;
  if (with_bias) a.in[2] = Z;
  a.s[0] = s0, a.s[1] = s1;
  kiln_status st = kiln__cpu_backend.kernels[KILN__K_MATMUL](&a);
  g_checks++;
  if (st != KILN_OK) {
    g_fails++;
    printf("FAIL matmul batch %lld %lldx%lldx%lld ta %d tb %d tc %d pad %lld out %s bias %d: status %d (%s)\n",
           (long long)batch, (long long)M, (long long)K, (long long)N, ta, tb, tc, (long long)pad,
           kiln_dtype_name(out_dt), with_bias, (int)st, kiln_last_error_message());
  } else {
    double worst = 0;
    int64_t bad = 0;
    for (int64_t b = 0; b < nb; b++)
      for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
          double s = 0, sa = 0;
          for (int64_t k = 0; k < K; k++) {
            double x = rd(&A, b * (o ? A.strides[0] : 0) + i * A.strides[o] + k * A.strides[o + 1]);
            double y = rd(&B, b * (o ? B.strides[0] : 0) + k * B.strides[o] + j * B.strides[o + 1]);
            s += x * y, sa += fabs(x * y);
          }
          double c0 = old[(b * M + i) * N + j], z = with_bias ? rd(&Z, j) : 0;
          double want = s0 * s + s1 * c0 + z;
          double got = rd(&C, b * (o ? C.strides[0] : 0) + i * C.strides[o] + j * C.strides[o + 1]);
          double tol = (double)(K + 3) * 0x1p-24 * (fabs(s0) * sa + fabs(s1 * c0) + fabs(z));
          if (out_dt == KILN_BF16) tol += 0x1p-8 * fabs(got);
          double err = fabs(got - want);
          if (!(err <= tol)) bad++;
          if (tol > 0 && err / tol > worst) worst = err / tol;
        }
    if (bad) {
      g_fails++;
      printf("FAIL matmul batch %lld %lldx%lldx%lld ta %d tb %d tc %d pad %lld shared %d out %s bias %d s0 %g s1 %g: "
             "%lld elements out of tolerance (worst err/tol %.3g)\n",
             (long long)batch, (long long)M, (long long)K, (long long)N, ta, tb, tc, (long long)pad, bshared,
             kiln_dtype_name(out_dt), with_bias, s0, s1, (long long)bad, worst);
    }
  }
  free(old), free(ba), free(bb), free(bc), free(bz);
}

int main(void) {

#ifdef KILN_HAVE_DNNL
  /* which cases oneDNN takes (the rest run the f32-temporary path): both must be right */
  {
    void *ba, *bb, *bc;
    kiln__kargs a;
    memset(&a, 0, sizeof a);
    a.op = KILN__K_MATMUL, a.n_in = 2, a.n_out = 1, a.s[0] = 1;
    a.in[0] = mk(&ba, KILN_BF16, 0, 64, 64, 0, 0, 0);
    a.in[1] = mk(&bb, KILN_BF16, 0, 64, 64, 1, 0, 0);
    a.out[0] = mk(&bc, KILN_BF16, 0, 64, 64, 0, 0, 0);
    kiln_status st;
    int taken = kiln__cpu_dnnl_matmul(&a, &st) ? 1 : 0;
    printf("oneDNN bf16 matmul: %s\n", taken ? "taken" : "refused (f32-temporary path)");
    free(ba), free(bb), free(bc);
  }
#endif
  const int64_t shapes[][3] = {{64, 96, 80}, {37, 130, 51}, {1, 64, 17}, {128, 256, 768}, {5, 1, 9}};
  for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
    for (int l = 0; l < 8; l++) {
      int ta = l & 1, tb = (l >> 1) & 1, tc = (l >> 2) & 1;
      for (int od = 0; od < 2; od++) {
        kiln_dtype out = od ? KILN_F32 : KILN_BF16;
        one(0, shapes[s][0], shapes[s][1], shapes[s][2], ta, tb, tc, 0, 0, out, 0, 1.0, 0.0);
        /* a bias with f32 output is not in MATMUL's contract for 16-bit operands */
        one(0, shapes[s][0], shapes[s][1], shapes[s][2], ta, tb, tc, 3, 0, out, !od, 1.0, 0.0);
        one(0, shapes[s][0], shapes[s][1], shapes[s][2], ta, tb, tc, 0, 0, out, 0, 2.0, 0.5);
        one(0, shapes[s][0], shapes[s][1], shapes[s][2], ta, tb, tc, 0, 0, out, !od, 1.0, 1.0);
      }
    }
  /* batches: B shared (a linear layer on (B, T, C)) and B per element (attention-like) */
  for (int l = 0; l < 4; l++)
    for (int shared = 0; shared < 2; shared++) {
      one(3, 40, 70, 33, l & 1, l >> 1, 0, 0, shared, KILN_BF16, 1, 1.0, 0.0);
      one(3, 40, 70, 33, l & 1, l >> 1, 0, 2, shared, KILN_F32, 0, 1.0, 1.0);
    }
  /* f32 products (OpenBLAS; tried on oneDNN, see the log): f32 accumulation, no output
  ** rounding beyond f32's */
  g_in = KILN_F32;
  for (int l = 0; l < 8; l++) {
    one(0, 512, 256, 512, l & 1, (l >> 1) & 1, (l >> 2) & 1, 0, 0, KILN_F32, 0, 1.0, 0.0);
    one(0, 512, 256, 520, l & 1, (l >> 1) & 1, 0, 3, 0, KILN_F32, 0, 2.0, 0.5);
  }
  one(4, 256, 256, 256, 0, 1, 0, 0, 1, KILN_F32, 0, 1.0, 0.0);
  one(4, 256, 256, 256, 0, 0, 0, 0, 0, KILN_F32, 0, 1.0, 1.0);
  one(0, 64, 96, 80, 0, 1, 0, 0, 0, KILN_F32, 0, 1.0, 0.0);
  printf("test_cpu_dnnl_matmul: %d checks, %d failed\n", g_checks, g_fails);

  return g_fails ? 1 : 0;
}
