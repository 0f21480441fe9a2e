/* Generation (src/nn/generate.c) on the CPU: the cached forward gives the logits of the
** full-context forward (prompt in one pass, then a chunk, then one token at a time);
** greedy generation equals argmax over full-context forwards, with and without the static
** (graph) step; the top-k / top-p filters against a reference computed here in f64; the
** sampler draws only kept tokens, at their probabilities; same seed, same tokens; eos
** stops; Hugging Face transformers' greedy generate on the fixture GPT-2
** (scripts/make_hf_gpt2_generate_fixture.py) is reproduced token for token; bad input
** gives errors naming the problem. */
#include <kiln.h>
#include <kiln_io.h>
#include <kiln_nn.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "tensor_cmp.h"

static kiln_device cpu;

static int64_t *host_i64(kiln_tensor *t) {
  kiln_scope_begin();
  kiln_tensor *d = kiln_contiguous(kiln_to_dtype(t, KILN_I64));
  int64_t *v = malloc(kiln_nbytes(d) ? kiln_nbytes(d) : 8);
  kiln_to_host(d, v, kiln_nbytes(d));
  kiln_scope_end();
  return v;
}

static bool ids_equal(kiln_tensor *a, kiln_tensor *b) {
  if (!a || !b || kiln_ndim(a) != kiln_ndim(b) || kiln_numel(a) != kiln_numel(b)) return false;
  for (int i = 0; i < kiln_ndim(a); i++)
    if (kiln_size(a, i) != kiln_size(b, i)) return false;
  int64_t *x = host_i64(a), *y = host_i64(b);
  bool eq = memcmp(x, y, (size_t)kiln_numel(a) * 8) == 0;
  free(x);
  free(y);
  return eq;
}

static bool msg_has(const char *s) { return strstr(kiln_last_error_message(), s) != NULL; }

static kiln_gpt_config small_cfg(void) {
  kiln_gpt_config c = kiln_gpt2_config();
  c.n_layer = 2, c.n_head = 2, c.n_embd = 32, c.vocab_size = 50, c.block_size = 24;
  return c;
}

static kiln_module *small_gpt(kiln_dtype dt, uint64_t seed) {
  kiln_gpt_config c = small_cfg();
  kiln_generator *g = kiln_generator_new(seed);
  kiln_module *m = kiln_gpt_new(&c, dt, cpu, g);
  kiln_generator_free(g);
  /* GPT-2's init (std 0.02) makes logits nearly flat; larger weights give margins that
  ** make greedy comparisons meaningful */
  kiln_scope_begin();
  bool prev = kiln_set_grad_enabled(false);
  kiln_tensor *ps[64];
  int np = m ? kiln_module_parameters(m, ps, 64) : 0;
  for (int i = 0; i < np && i < 64; i++)
    if (kiln_ndim(ps[i]) == 2) kiln_mul_scalar_(ps[i], 8.0);
  kiln_set_grad_enabled(prev);
  kiln_scope_end();
  if (m) kiln_module_eval(m);
  return m;
}

static kiln_tensor *random_ids(int64_t B, int64_t T, int64_t V, uint64_t seed) {
  kiln_generator *g = kiln_generator_new(seed);
  kiln_tensor *t = kiln_randint(0, V, KILN_SHAPE(B, T), KILN_I64, cpu, g);
  kiln_generator_free(g);
  return t;
}

/* Prompt in one pass, then a chunk of 3 (queries that start past 0: the explicit mask),
** then one token at a time: the logits of the full forward, at f32 rounding (f64: 1e-12).
** The ids come in transposed (non-contiguous). */
static void test_cached_equals_full(kiln_dtype dt, double tol) {
  kiln_scope_begin();
  kiln_module *m = small_gpt(dt, 1);
  const int64_t B = 2, T = 14;
  kiln_tensor *ids = kiln_transpose(random_ids(T, B, 50, 7), 0, 1); /* (B, T), strided */
  kiln_tensor *full = kiln_module_forward(m, ids);                   /* (B, T, V) */
  kiln_kv_cache *c = kiln_kv_cache_new(m, B, 20);
  CHECK(c && kiln_kv_cache_length(c) == 0);
  kiln_tensor *parts[16];
  int np = 0;
  parts[np++] = kiln_gpt_forward_cached(m, kiln_narrow(ids, 1, 0, 5), c);
  CHECK(kiln_kv_cache_length(c) == 5);
  parts[np++] = kiln_gpt_forward_cached(m, kiln_narrow(ids, 1, 5, 3), c);
  for (int64_t t = 8; t < T; t++) parts[np++] = kiln_gpt_forward_cached(m, kiln_narrow(ids, 1, t, 1), c);
  CHECK(kiln_kv_cache_length(c) == T);
  kiln_tensor *cached = kiln_cat(np, parts, 1);
  double d = max_abs_diff(full, cached);
  if (!(d <= tol)) fprintf(stderr, "cached vs full (%s): max diff %g (tol %g)\n", kiln_dtype_name(dt), d, tol);
  CHECK(d <= tol);
  /* reset: the same prompt again gives the same logits */
  kiln_kv_cache_reset(c);
  kiln_tensor *again = kiln_gpt_forward_cached(m, kiln_narrow(ids, 1, 0, 5), c);
  CHECK(max_abs_diff(again, parts[0]) == 0);
  /* past max_len: an error naming the numbers, nothing appended */
  kiln_tensor *over = kiln_gpt_forward_cached(m, random_ids(B, 16, 50, 3), c);
  CHECK(!over && kiln_last_error() == KILN_ERR_SHAPE && msg_has("max_len 20"));
  CHECK(kiln_kv_cache_length(c) == 5);
  kiln_kv_cache_free(c);
  kiln_module_free(m);
  kiln_scope_end();
}

/* Greedy tokens from the full-context forward, the slow way. */
static kiln_tensor *greedy_reference(kiln_module *m, kiln_tensor *ids, int64_t n_new) {
  kiln_tensor *cur = ids;
  for (int64_t i = 0; i < n_new; i++) {
    kiln_tensor *logits = kiln_module_forward(m, cur);
    kiln_tensor *last = kiln_select(logits, 1, kiln_size(cur, 1) - 1);     /* (B, V) */
    cur = kiln_cat(2, (kiln_tensor *[]){cur, kiln_unsqueeze(kiln_argmax(last, 1, false), 1)}, 1);
  }
  return cur;
}

static void test_greedy_equals_uncached(void) {
  kiln_scope_begin();
  kiln_module *m = small_gpt(KILN_F32, 2);
  kiln_tensor *ids = random_ids(3, 4, 50, 11);
  kiln_tensor *want = greedy_reference(m, ids, 20); /* to the full context, 24 */
  kiln_sample_opts o = kiln_sample_opts_default();
  o.greedy = true;
  o.graph = KILN_GEN_GRAPH_OFF;
  kiln_tensor *eager = kiln_gpt_generate(m, ids, 20, &o, NULL);
  o.graph = KILN_GEN_GRAPH_ON;
  kiln_tensor *graph = kiln_gpt_generate(m, ids, 20, &o, NULL);
  CHECK(eager && kiln_size(eager, 1) == 24 && kiln_dtype_of(eager) == KILN_I64);
  CHECK(ids_equal(eager, want));
  CHECK(ids_equal(graph, want));
  o.greedy = false;
  o.temperature = 0; /* temperature 0 is greedy too */
  CHECK(ids_equal(kiln_gpt_generate(m, ids, 20, &o, NULL), want));
  /* n_new 0: the prompt back */
  CHECK(ids_equal(kiln_gpt_generate(m, ids, 0, &o, NULL), ids));
  /* i32 prompt */
  CHECK(ids_equal(kiln_gpt_generate(m, kiln_to_dtype(ids, KILN_I32), 20, &o, NULL), want));
  kiln_module_free(m);
  kiln_scope_end();
}

/* The filters against f64 references on small rows (ties avoided: the reference and the
** filter may treat a tie at the cut differently, documented). */
static void reference_filter(const double *l, int V, double temp, int64_t top_k, double top_p, double *out) {
  double x[64];
  int order[64];
  for (int i = 0; i < V; i++) x[i] = l[i] / temp, order[i] = i;
  for (int i = 0; i < V; i++) /* decreasing order, selection sort */
    for (int j = i + 1; j < V; j++)
      if (x[order[j]] > x[order[i]]) {
        int t = order[i];
        order[i] = order[j], order[j] = t;
      }
  bool keep[64];
  for (int r = 0; r < V; r++) keep[order[r]] = top_k <= 0 || r < top_k;
  if (top_p < 1) {
    double mx = -INFINITY, z = 0, before = 0;
    for (int r = 0; r < V; r++)
      if (keep[order[r]]) mx = fmax(mx, x[order[r]]);
    for (int r = 0; r < V; r++)
      if (keep[order[r]]) z += exp(x[order[r]] - mx);
    for (int r = 0; r < V; r++) {
      if (!keep[order[r]]) continue;
      double p = exp(x[order[r]] - mx) / z;
      if (!(before < top_p)) keep[order[r]] = false;
      before += p;
    }
  }
  for (int i = 0; i < V; i++) out[i] = keep[i] ? x[i] : -INFINITY;
}

static void test_filters(void) {
  kiln_scope_begin();
  enum { N = 3, V = 7 };
  const double rows[N][V] = {{1.0, 3.0, -2.0, 0.5, 2.2, -0.3, 1.7},
                             {0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7},
                             {5.0, -1.0, -1.5, -3.0, 4.1, -2.5, 0.25}};
  kiln_tensor *logits = kiln_from_data(rows, KILN_SHAPE(N, V), KILN_F64, cpu);
  const struct { double temp; int64_t k; double p; } cases[] = {
      {1.0, 0, 1.0}, {1.0, 2, 1.0}, {0.7, 3, 1.0}, {1.0, 0, 0.5}, {1.0, 0, 0.9}, {1.0, 0, 0.05},
      {2.0, 0, 0.8}, {0.5, 4, 0.6}, {1.0, 7, 0.999}, {1.0, 100, 1.0}};
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    kiln_sample_opts o = kiln_sample_opts_default();
    o.temperature = cases[c].temp, o.top_k = cases[c].k, o.top_p = cases[c].p;
    kiln_tensor *f = kiln_sample_filter(logits, &o);
    CHECK(f && kiln_dtype_of(f) == KILN_F32 && kiln_size(f, 0) == N && kiln_size(f, 1) == V);
    if (!f) continue;
    double *got = host_f64(f);
    for (int r = 0; r < N; r++) {
      double want[V];
      reference_filter(rows[r], V, o.temperature, o.top_k, o.top_p, want);
      for (int i = 0; i < V; i++) {
        bool ok = isinf(want[i]) ? isinf(got[r * V + i]) && got[r * V + i] < 0 : fabs(got[r * V + i] - want[i]) < 1e-6;
        if (!ok)
          fprintf(stderr, "filter case %zu row %d token %d: got %g want %g\n", c, r, i, got[r * V + i], want[i]);
        CHECK(ok);
      }
    }
    free(got);
  }
  kiln_scope_end();
}

/* 4000 draws from one row under top-k 3: only the 3 kept tokens, at their renormalised
** probabilities (4 sigma of a binomial: a wrong sampler fails, a right one almost never). */
static void test_sampler_distribution(void) {
  kiln_scope_begin();
  enum { S = 4000, V = 6 };
  const float row[V] = {0.2f, 1.5f, -1.0f, 1.0f, 0.9f, -3.0f};
  kiln_tensor *one = kiln_from_data(row, KILN_SHAPE(1, V), KILN_F32, cpu);
  kiln_tensor *logits = kiln_contiguous(kiln_expand(one, KILN_SHAPE(S, V)));
  kiln_sample_opts o = kiln_sample_opts_default();
  o.top_k = 3;
  kiln_generator *g = kiln_generator_new(5);
  kiln_tensor *tok = kiln_sample_next(logits, &o, g);
  CHECK(tok && kiln_ndim(tok) == 1 && kiln_size(tok, 0) == S && kiln_dtype_of(tok) == KILN_I64);
  if (tok) {
    int64_t *t = host_i64(tok), count[V] = {0};
    for (int i = 0; i < S; i++) count[t[i] >= 0 && t[i] < V ? t[i] : 0] += t[i] >= 0 && t[i] < V;
    free(t);
    double z = exp(1.5) + exp(1.0) + exp(0.9);
    const double p[V] = {0, exp(1.5) / z, 0, exp(1.0) / z, exp(0.9) / z, 0};
    for (int i = 0; i < V; i++) {
      double sd = sqrt(S * p[i] * (1 - p[i]));
      if (p[i] == 0) CHECK(count[i] == 0);
      else CHECK(fabs(count[i] - S * p[i]) <= 4 * sd);
    }
  }
  kiln_generator_free(g);
  kiln_scope_end();
}

/* Same seed, same tokens (eager and static step alike); another seed, other tokens. */
static void test_seeded(void) {
  kiln_scope_begin();
  kiln_module *m = small_gpt(KILN_F32, 3);
  kiln_tensor *ids = random_ids(2, 3, 50, 13);
  kiln_sample_opts o = kiln_sample_opts_default();
  o.temperature = 1.3, o.top_k = 20, o.top_p = 0.95, o.graph = KILN_GEN_GRAPH_OFF;
  kiln_tensor *r[4];
  for (int i = 0; i < 4; i++) {
    o.graph = i == 2 ? KILN_GEN_GRAPH_ON : KILN_GEN_GRAPH_OFF;
    kiln_generator *g = kiln_generator_new(i == 3 ? 43 : 42);
    r[i] = kiln_gpt_generate(m, ids, 20, &o, g);
    uint64_t seed, off;
    kiln_generator_get_state(g, &seed, &off);
    CHECK(off == 20); /* 20 draws of 2 rows: one Philox block each, as kiln_multinomial reserves */
    kiln_generator_free(g);
  }
  CHECK(r[0] && ids_equal(r[0], r[1]));
  CHECK(ids_equal(r[0], r[2]));
  CHECK(r[3] && !ids_equal(r[0], r[3]));
  /* the prompt is kept as given */
  CHECK(ids_equal(kiln_narrow(r[0], 1, 0, 3), ids));
  kiln_module_free(m);
  kiln_scope_end();
}

/* Under bf16 autocast (weights f32, the products in bf16, the fused add + norm in f32) the
** decode step runs, captured or not, with the same tokens. */
static void test_autocast(void) {
  kiln_scope_begin();
  kiln_module *m = small_gpt(KILN_F32, 5);
  kiln_tensor *ids = random_ids(2, 4, 50, 19);
  kiln_sample_opts o = kiln_sample_opts_default();
  o.greedy = true;
  kiln_autocast_begin(KILN_DEVICE_CPU, KILN_BF16);
  o.graph = KILN_GEN_GRAPH_OFF;
  kiln_tensor *a = kiln_gpt_generate(m, ids, 12, &o, NULL);
  o.graph = KILN_GEN_GRAPH_ON;
  kiln_tensor *b = kiln_gpt_generate(m, ids, 12, &o, NULL);
  kiln_autocast_end();
  CHECK(a && kiln_size(a, 1) == 16);
  CHECK(b && ids_equal(a, b));
  kiln_module_free(m);
  kiln_scope_end();
}

/* eos: a row that makes it repeats it; all rows done ends early. */
static void test_eos(void) {
  kiln_scope_begin();
  kiln_module *m = small_gpt(KILN_F32, 4);
  kiln_tensor *ids = random_ids(1, 3, 50, 17);
  kiln_sample_opts o = kiln_sample_opts_default();
  o.greedy = true;
  kiln_tensor *full = kiln_gpt_generate(m, ids, 10, &o, NULL);
  int64_t *f = full ? host_i64(full) : NULL;
  if (f) {
    o.eos_id = f[5]; /* the third new token (or an earlier equal one) ends it */
    int64_t stop = 3;
    while (f[stop] != f[5]) stop++;
    kiln_tensor *cut = kiln_gpt_generate(m, ids, 10, &o, NULL);
    CHECK(cut && kiln_size(cut, 1) == stop + 1);
    CHECK(ids_equal(cut, kiln_narrow(full, 1, 0, stop + 1)));
    free(f);
  }
  CHECK(f);
  kiln_module_free(m);
  kiln_scope_end();
}

/* transformers' greedy generate on the fixture model, token for token. */
static void test_hf_parity(void) {
  const char *src = getenv("KILN_SOURCE_DIR");
  char dir[4096], path[4200];
  snprintf(dir, sizeof dir, "%s/tests/fixtures/hf_gpt2", src ? src : ".");
  snprintf(path, sizeof path, "%s/generate.safetensors", dir);
  kiln_dict *ref = kiln_safetensors_load(path, cpu);
  CHECK(ref);
  kiln_module *m = ref ? kiln_gpt_from_hf(dir, NULL, KILN_F32, cpu) : NULL;
  CHECK(m);
  if (m) {
    kiln_scope_begin();
    kiln_module_eval(m);
    kiln_sample_opts o = kiln_sample_opts_default();
    o.greedy = true;
    kiln_tensor *out = kiln_gpt_generate(m, kiln_dict_get(ref, "prompt"), 20, &o, NULL);
    CHECK(ids_equal(out, kiln_dict_get(ref, "out")));
    o.graph = KILN_GEN_GRAPH_ON;
    kiln_tensor *lp = kiln_narrow(kiln_dict_get(ref, "out_long"), 1, 0, 4);
    kiln_tensor *lng = kiln_gpt_generate(m, lp, 28, &o, NULL); /* to the full context, 32 */
    CHECK(ids_equal(lng, kiln_dict_get(ref, "out_long")));
    kiln_scope_end();
  }
  kiln_module_free(m);
  kiln_dict_free(ref);
}

static void test_bad_input(void) {
  kiln_scope_begin();
  kiln_module *m = small_gpt(KILN_F32, 5);
  kiln_sample_opts o = kiln_sample_opts_default();
  kiln_tensor *ids = random_ids(2, 4, 50, 19);
  /* a prompt of 0 tokens */
  kiln_tensor *empty = kiln_zeros(KILN_SHAPE(2, 0), KILN_I64, cpu);
  CHECK(!kiln_gpt_generate(m, empty, 5, &o, NULL) && kiln_last_error() == KILN_ERR_SHAPE && msg_has("T0 >= 1"));
  /* past the context: no sliding window */
  CHECK(!kiln_gpt_generate(m, ids, 21, &o, NULL) && kiln_last_error() == KILN_ERR_SHAPE &&
        msg_has("block_size 24") && msg_has("n_new 21"));
  CHECK(!kiln_gpt_generate(m, ids, -1, &o, NULL) && kiln_last_error() == KILN_ERR_SHAPE);
  /* options */
  o.temperature = -0.5;
  CHECK(!kiln_gpt_generate(m, ids, 5, &o, NULL) && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT &&
        msg_has("temperature -0.5"));
  o = kiln_sample_opts_default();
  o.top_p = 0;
  CHECK(!kiln_gpt_generate(m, ids, 5, &o, NULL) && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT && msg_has("top_p 0"));
  o.top_p = 1.5;
  CHECK(!kiln_sample_next(kiln_zeros(KILN_SHAPE(1, 4), KILN_F32, cpu), &o, NULL) && msg_has("top_p 1.5"));
  o = kiln_sample_opts_default();
  o.top_k = -1;
  CHECK(!kiln_sample_filter(kiln_zeros(KILN_SHAPE(1, 4), KILN_F32, cpu), &o) &&
        kiln_last_error() == KILN_ERR_INVALID_ARGUMENT && msg_has("top_k -1"));
  o = kiln_sample_opts_default();
  o.eos_id = 50;
  CHECK(!kiln_gpt_generate(m, ids, 5, &o, NULL) && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT);
  CHECK(!kiln_gpt_generate(m, ids, 5, NULL, NULL) && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT);
  o = kiln_sample_opts_default();
  /* float ids, 1-d ids, logits of the wrong rank */
  CHECK(!kiln_gpt_generate(m, kiln_zeros(KILN_SHAPE(2, 3), KILN_F32, cpu), 5, &o, NULL) &&
        kiln_last_error() == KILN_ERR_SHAPE);
  CHECK(!kiln_gpt_generate(m, kiln_zeros(KILN_SHAPE(3), KILN_I64, cpu), 5, &o, NULL));
  CHECK(!kiln_sample_next(kiln_zeros(KILN_SHAPE(2, 3, 4), KILN_F32, cpu), &o, NULL) &&
        kiln_last_error() == KILN_ERR_SHAPE);
  /* not a GPT */
  kiln_module *lin = kiln_linear_new(4, 4, true, KILN_F32, cpu, NULL);
  CHECK(!kiln_gpt_generate(lin, ids, 5, &o, NULL) && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT &&
        msg_has("not a GPT"));
  CHECK(!kiln_kv_cache_new(lin, 1, 4) && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT);
  CHECK(!kiln_kv_cache_new(m, 1, 25) && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT);
  kiln_kv_cache *c = kiln_kv_cache_new(m, 2, 8);
  CHECK(!kiln_gpt_forward_cached(m, random_ids(3, 2, 50, 1), c) && kiln_last_error() == KILN_ERR_SHAPE);
  CHECK(!kiln_gpt_forward_cached(m, ids, NULL) && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT);
  CHECK(kiln_gpt_generate(m, NULL, 5, &o, NULL) == NULL); /* NULL passes through */
  kiln_kv_cache_free(c);
  kiln_kv_cache_free(NULL);
  kiln_module_free(lin);
  kiln_module_free(m);
  kiln_scope_end();
}

int main(void) {
  cpu = kiln_device_cpu();
  test_cached_equals_full(KILN_F32, 2e-5);
  test_cached_equals_full(KILN_F64, 1e-11);
  test_greedy_equals_uncached();
  test_filters();
  test_sampler_distribution();
  test_seeded();
  test_autocast();
  test_eos();
  test_hf_parity();
  test_bad_input();
  printf("%d failures\n", failures);
  return failures ? 1 : 0;
}
