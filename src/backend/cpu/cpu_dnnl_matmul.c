/*
** MATMUL of bf16 operands on the CPU through oneDNN's matmul primitive (built when
** libdnnl-dev is found: KILN_HAVE_DNNL): bf16 x bf16 products accumulated in f32, written
** as bf16 (rounded once from the f32 accumulator) or as f32 (autocast's weight gradients).
** This is what PyTorch's CPU autocast runs (aten::mm -> oneDNN), and on a CPU with AMX
** (Sapphire Rapids) oneDNN's brgemm kernels run it on the tile unit ("brg:avx512_core_
** amx_bf16"): 2.5-2.7 TFLOP/s on 2 cores against ~0.3 for sgemm, and no widening of the
** operands into f32 temporaries (which cost more than the sgemm itself in a GPT step).
**
** Operands are described to oneDNN by their strides: a transposed operand (W^T of a linear
** layer, D^T of a weight gradient) is a plain "ba" layout, not a copy. A batch that B
** shares (stride 0) and whose rows merge with M's is folded into one 2-d product, as the
** BLAS path does. s0 becomes oneDNN's output scale, s1 a sum post-op (dst = acc + s1 dst,
** in f32, rounded once), the bias oneDNN's bias (added to the f32 accumulator).
**
** A layout the fast kernels do not take (oneDNN then picks a reference implementation,
** named "ref" in its implementation string) is refused, and the caller takes the f32
** path. A primitive is compiled (JIT) per geometry: primitives, and refusals, are kept in a
** small cache keyed by dtypes, shapes, strides and scalars. One lock covers the cache and
** the execution (oneDNN parallelises inside, on its OpenMP threads).
** KILN_DNNL_MATMUL=0 turns this path off (the f32-temporary path then runs: A/B timing).
*/
#include "cpu.h"
#include "cpu_iter.h"
#include "../../core/kiln_int.h"

#ifdef KILN_HAVE_DNNL
#include <dnnl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#ifdef KILN_HAVE_OPENMP
#include <omp.h>
#endif

#define MM_CACHE 96
#define MM_KEY (9 + 7 * KILN_MAX_DIMS)

typedef struct mm_entry {
  int64_t key[MM_KEY];
  dnnl_primitive_t prim; /* NULL: refused (oneDNN had only a reference implementation) */
  dnnl_memory_desc_t a, b, c, bias;
} mm_entry;

static pthread_mutex_t mm_lock = PTHREAD_MUTEX_INITIALIZER;
static dnnl_engine_t mm_eng;
static dnnl_stream_t mm_str;
static mm_entry mm_cache[MM_CACHE];
static int mm_n, mm_next;
static int mm_enabled = -1; /* -1: KILN_DNNL_MATMUL not read yet */

static dnnl_data_type_t mm_dt(kiln_dtype dt) { return dt == KILN_BF16 ? dnnl_bf16 : dnnl_f32; }

/* The geometry handed to oneDNN: nd dims (batch dims, then M, K / K, N / M, N). */
typedef struct mm_geom {
  int nd;
  int64_t ad[KILN_MAX_DIMS], as[KILN_MAX_DIMS], bd[KILN_MAX_DIMS], bs[KILN_MAX_DIMS];
  int64_t cd[KILN_MAX_DIMS], cs[KILN_MAX_DIMS];
  int64_t bias_stride;
} mm_geom;

/* A stride for a dim of size 1 (any is valid; oneDNN's layout checks want a plain one). */
static void mm_fix_unit(int nd, const int64_t *d, int64_t *s) {
  for (int i = nd - 1; i >= 0; i--)
    if (d[i] == 1) {
      int64_t run = 1;
      for (int k = i + 1; k < nd; k++)
        if (s[k] * d[k] > run) run = s[k] * d[k];
      s[i] = run;
    }
}

/* Fills g from the views; false when the shapes do not multiply (the f32 path reports). */
static bool mm_geometry(const kiln__kargs *a, mm_geom *g) {
  const kiln__view *A = &a->in[0], *B = &a->in[1], *C = &a->out[0], *bias = kiln__mm_bias(a);
  int nd = C->ndim;
  if (nd < 2 || A->ndim != nd || B->ndim != nd) return false;
  int64_t M = C->shape[nd - 2], N = C->shape[nd - 1], K = A->shape[nd - 1];
  if (A->shape[nd - 2] != M || B->shape[nd - 2] != K || B->shape[nd - 1] != N) return false;
  if (M <= 0 || N <= 0 || K <= 0) return false; /* nothing to compute, or zeros: the f32 path */
  bool shared = true; /* B the same for the whole batch */
  for (int d = 0; d < nd - 2; d++) {
    if (A->shape[d] != C->shape[d] || B->shape[d] != C->shape[d] || C->shape[d] <= 0) return false;
    if (B->strides[d] != 0 && B->shape[d] != 1) shared = false;
  }
  if (bias && (bias->ndim < 1 || bias->shape[bias->ndim - 1] != N)) return false;
  /* oneDNN 2.6's brgemm reads the bias as dense whatever its descriptor's stride says
  ** (measured: a strided bias gave wrong sums): only a unit-stride bias is handed over */
  if (bias && N > 1 && bias->strides[bias->ndim - 1] != 1) return false;
  g->bias_stride = bias ? bias->strides[bias->ndim - 1] : 0;
  if (nd > 2 && shared) { /* fold (batch..., M) into one M when A's and C's rows merge */
    kiln__view fv[2] = {*A, *C};
    for (int i = 0; i < 2; i++) fv[i].ndim = nd - 1;
    if (kiln__views_coalesce(fv, 2) == 1) {
      g->nd = 2;
      g->ad[0] = g->cd[0] = fv[0].shape[0];
      g->ad[1] = K, g->as[0] = fv[0].strides[0], g->as[1] = A->strides[nd - 1];
      g->bd[0] = K, g->bd[1] = N, g->bs[0] = B->strides[nd - 2], g->bs[1] = B->strides[nd - 1];
      g->cd[1] = N, g->cs[0] = fv[1].strides[0], g->cs[1] = C->strides[nd - 1];
      goto fix;
    }
  }
  g->nd = nd;
  for (int d = 0; d < nd; d++) {
    /* a broadcast batch dim (stride 0) is a dim of size 1 to oneDNN, which broadcasts it */
    bool last2 = d >= nd - 2;
    g->ad[d] = !last2 && A->strides[d] == 0 ? 1 : A->shape[d], g->as[d] = A->strides[d];
    g->bd[d] = !last2 && B->strides[d] == 0 ? 1 : B->shape[d], g->bs[d] = B->strides[d];
    g->cd[d] = C->shape[d], g->cs[d] = C->strides[d];
    if (C->strides[d] == 0 && C->shape[d] > 1) return false; /* an output cannot alias itself */
  }
fix:
  mm_fix_unit(g->nd, g->ad, g->as);
  mm_fix_unit(g->nd, g->bd, g->bs);
  mm_fix_unit(g->nd, g->cd, g->cs);
  for (int d = 0; d < g->nd; d++)
    if (g->as[d] < 0 || g->bs[d] < 0 || g->cs[d] <= 0) return false;
  return true;
}

static kiln_status mm_fail(const char *what, dnnl_status_t s) {
  return kiln_set_error(KILN_ERR_INTERNAL, "kiln_matmul: oneDNN %s failed (status %d)", what, (int)s);
}

/* A new primitive for the geometry (the lock held); e->prim stays NULL when oneDNN offers
** only its reference implementation. */
static kiln_status mm_build(const kiln__kargs *a, const mm_geom *g, mm_entry *e) {
  const kiln__view *bias = kiln__mm_bias(a);
  dnnl_status_t s;
  dnnl_dims_t ad, as, bd, bs, cd, cs, zd, zs;
  for (int d = 0; d < g->nd; d++) {
    ad[d] = g->ad[d], as[d] = g->as[d], bd[d] = g->bd[d], bs[d] = g->bs[d];
    cd[d] = g->cd[d], cs[d] = g->cs[d];
    zd[d] = 1, zs[d] = 1;
  }
  zd[g->nd - 1] = g->cd[g->nd - 1];
  zs[g->nd - 1] = g->bias_stride > 0 ? g->bias_stride : 1;
  for (int d = g->nd - 2; d >= 0; d--) zs[d] = zs[d + 1] * zd[d + 1];
  e->prim = NULL;
  if ((s = dnnl_memory_desc_init_by_strides(&e->a, g->nd, ad, mm_dt(a->in[0].dtype), as)) != dnnl_success ||
      (s = dnnl_memory_desc_init_by_strides(&e->b, g->nd, bd, mm_dt(a->in[1].dtype), bs)) != dnnl_success ||
      (s = dnnl_memory_desc_init_by_strides(&e->c, g->nd, cd, mm_dt(a->out[0].dtype), cs)) != dnnl_success ||
      (bias && (s = dnnl_memory_desc_init_by_strides(&e->bias, g->nd, zd, mm_dt(bias->dtype), zs)) != dnnl_success))
    return KILN_OK; /* a layout oneDNN cannot describe: refused */
  dnnl_matmul_desc_t md;
  if ((s = dnnl_matmul_desc_init(&md, &e->a, &e->b, bias ? &e->bias : NULL, &e->c)) != dnnl_success) return KILN_OK;
  dnnl_primitive_attr_t attr = NULL;
  if ((s = dnnl_primitive_attr_create(&attr)) != dnnl_success) return mm_fail("attribute", s);
  float scale = (float)a->s[0];
  if (a->s[0] != 1.0) s = dnnl_primitive_attr_set_output_scales(attr, 1, 0, &scale);
  if (s == dnnl_success && a->s[1] != 0) {
    dnnl_post_ops_t po = NULL;
    if ((s = dnnl_post_ops_create(&po)) == dnnl_success) {
      s = dnnl_post_ops_append_sum(po, (float)a->s[1]);
      if (s == dnnl_success) s = dnnl_primitive_attr_set_post_ops(attr, po);
      dnnl_post_ops_destroy(po);
    }
  }
  if (s != dnnl_success) {
    dnnl_primitive_attr_destroy(attr);
    return mm_fail("attribute", s);
  }
  dnnl_primitive_desc_t pd = NULL;
  s = dnnl_primitive_desc_create(&pd, &md, attr, mm_eng, NULL);
  dnnl_primitive_attr_destroy(attr);
  if (s != dnnl_success) return KILN_OK; /* unsupported combination: refused */
  const char *impl = NULL;
  if (dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl) != dnnl_success || !impl ||
      strstr(impl, "ref")) {
    dnnl_primitive_desc_destroy(pd);
    return KILN_OK;
  }
  s = dnnl_primitive_create(&e->prim, pd);
  dnnl_primitive_desc_destroy(pd);
  if (s != dnnl_success) {
    e->prim = NULL;
    return mm_fail("primitive", s);
  }
  return KILN_OK;
}

static void mm_key(const kiln__kargs *a, const mm_geom *g, int nthreads, int64_t *k) {
  const kiln__view *bias = kiln__mm_bias(a);
  memset(k, 0, sizeof(int64_t) * MM_KEY);
  k[0] = g->nd;
  k[1] = a->in[0].dtype, k[2] = a->in[1].dtype, k[3] = a->out[0].dtype;
  k[4] = bias ? (int64_t)bias->dtype + 1 : 0;
  k[5] = g->bias_stride;
  memcpy(&k[6], &a->s[0], sizeof(double));
  memcpy(&k[7], &a->s[1], sizeof(double));
  k[MM_KEY - 1] = nthreads; /* a primitive splits its work for the count it was made under */
  for (int d = 0; d < g->nd; d++) {
    int64_t *r = k + 8 + 7 * d;
    r[0] = g->ad[d], r[1] = g->as[d], r[2] = g->bd[d], r[3] = g->bs[d], r[4] = g->cd[d], r[5] = g->cs[d];
  }
}

/* The lock held. Returns the entry, or NULL with the error set. */
static mm_entry *mm_lookup(const kiln__kargs *a, const mm_geom *g, int nthreads) {
  int64_t key[MM_KEY];
  mm_key(a, g, nthreads, key);
  for (int i = 0; i < mm_n; i++)
    if (memcmp(mm_cache[i].key, key, sizeof key) == 0) return &mm_cache[i];
  mm_entry fresh;
  memcpy(fresh.key, key, sizeof key);
  if (mm_build(a, g, &fresh) != KILN_OK) return NULL;
  mm_entry *e;
  if (mm_n < MM_CACHE) {
    e = &mm_cache[mm_n++];
  } else { /* round robin: a network has few distinct product shapes */
    e = &mm_cache[mm_next];
    mm_next = (mm_next + 1) % MM_CACHE;
    if (e->prim) dnnl_primitive_destroy(e->prim);
  }
  *e = fresh;
  return e;
}

bool kiln__cpu_dnnl_matmul(const kiln__kargs *a, kiln_status *st) {
  if (a->n_out != 1 || (a->i[1] & 3)) return false;
  const kiln__view *bias = kiln__mm_bias(a);
  kiln_dtype ct = a->out[0].dtype;
  if (a->in[0].dtype != KILN_BF16 || a->in[1].dtype != KILN_BF16 || (ct != KILN_BF16 && ct != KILN_F32)) return false;
  if (bias && bias->dtype != KILN_BF16 && bias->dtype != KILN_F32) return false;
  /* oneDNN adds the bias before the output scale: that order only agrees when s0 == 1 */
  if (bias && a->s[0] != 1.0) return false;
  mm_geom g;
  if (!mm_geometry(a, &g)) return false;
  pthread_mutex_lock(&mm_lock);
  if (mm_enabled < 0) {
    mm_enabled = kiln__knob_on("KILN_DNNL_MATMUL", true);
  }
  bool taken = false;
  *st = KILN_OK;
#ifdef KILN_HAVE_OPENMP
  int omp_was = 0, nt = 0;
#endif
  dnnl_status_t s;
  if (!mm_enabled) goto out;
#ifdef KILN_HAVE_OPENMP
  /* oneDNN runs on OpenMP's thread count, which an OpenMP build of OpenBLAS sets to 1 for
  ** every small sgemm (openblas_set_num_threads -> omp_set_num_threads), and a primitive
  ** keeps the count it was created under: created after a small sgemm, the GPT's products
  ** ran on one core (0.65-0.86 ms for 2048x256x768 where 0.37 was possible). kiln's
  ** count for the creation and the call, then OpenMP's back. */
  omp_was = omp_get_max_threads();
  nt = omp_in_parallel() ? 1 : kiln_num_threads();
  if (nt != omp_was) omp_set_num_threads(nt);
#endif
  if (!mm_eng) {
    if ((s = dnnl_engine_create(&mm_eng, dnnl_cpu, 0)) != dnnl_success) {
      mm_eng = NULL;
      goto out; /* no engine: the f32 path */
    }
    if ((s = dnnl_stream_create(&mm_str, mm_eng, dnnl_stream_default_flags)) != dnnl_success) {
      dnnl_engine_destroy(mm_eng);
      mm_eng = NULL;
      goto out;
    }
  }
#ifdef KILN_HAVE_OPENMP
  mm_entry *e = mm_lookup(a, &g, nt);
#else
  mm_entry *e = mm_lookup(a, &g, 1);
#endif
  if (!e) {
    taken = true;
    *st = kiln_last_error();
    goto out;
  }
  if (!e->prim) goto out;
  taken = true;
#ifdef KILN_HAVE_OPENMP
  atomic_store_explicit(&kiln__cpu_omp_loops, 1, memory_order_relaxed);
#endif
  dnnl_memory_t ma = NULL, mb = NULL, mc = NULL, mz = NULL;
  if ((s = dnnl_memory_create(&ma, &e->a, mm_eng, a->in[0].data)) != dnnl_success ||
      (s = dnnl_memory_create(&mb, &e->b, mm_eng, a->in[1].data)) != dnnl_success ||
      (s = dnnl_memory_create(&mc, &e->c, mm_eng, a->out[0].data)) != dnnl_success ||
      (bias && (s = dnnl_memory_create(&mz, &e->bias, mm_eng, bias->data)) != dnnl_success)) {
    *st = mm_fail("memory", s);
  } else {
    dnnl_exec_arg_t args[4] = {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc}, {DNNL_ARG_BIAS, mz}};
    if ((s = dnnl_primitive_execute(e->prim, mm_str, bias ? 4 : 3, args)) != dnnl_success ||
        (s = dnnl_stream_wait(mm_str)) != dnnl_success)
      *st = mm_fail("execution", s);
  }
  dnnl_memory_destroy(ma), dnnl_memory_destroy(mb), dnnl_memory_destroy(mc), dnnl_memory_destroy(mz);
out:
#ifdef KILN_HAVE_OPENMP
  if (nt != omp_was) omp_set_num_threads(omp_was);
#endif
  pthread_mutex_unlock(&mm_lock);
  return taken;
}
#endif /* KILN_HAVE_DNNL */
