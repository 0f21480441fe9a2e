/*
** Autocast on the CPU (bf16): the per-op policy (lower, f32, promote), f32 gradients for
** f32 parameters equal to the run with explicit casts, one cast per parameter per region,
** nesting and the enabled flag, backward rules never cast, the device type filter, no
** leak without a scope, inside graph capture, the bad inputs, and docs/autocast.md
** against the descriptors' classes.
*/
#include "check.h"
#include "tensor_cmp.h"

#include "ops/op.h"

#include <stdlib.h>
#include <string.h>

static const kiln_device CPU = {KILN_DEVICE_CPU, 0};

/* ---- an observer that counts ops by name and records their classes ---- */
#define MAX_SEEN 128
typedef struct seen_op {
  const char *name;
  int amp;
  int count;
} seen_op;
static seen_op seen[MAX_SEEN];
static int n_seen;
static int n_casts; /* tensors cast: one per to_dtype, one per input of to_dtype_many */

static void *seen_begin(const kiln__op_event *e, void *ctx) {
  (void)ctx;
  if (strcmp(e->op->name, "to_dtype") == 0) n_casts++;
  if (strcmp(e->op->name, "to_dtype_many") == 0) n_casts += e->n_in;
  for (int i = 0; i < n_seen; i++)
    if (strcmp(seen[i].name, e->op->name) == 0) {
      seen[i].count++;
      return NULL;
    }
  if (n_seen < MAX_SEEN) seen[n_seen++] = (seen_op){e->op->name, (int)e->op->amp, 1};
  return NULL;
}
static const kiln__observer seen_obs = {"test_autocast", seen_begin, NULL, NULL, NULL, NULL};
static int seen_count(const char *name) {
  for (int i = 0; i < n_seen; i++)
    if (strcmp(seen[i].name, name) == 0) return seen[i].count;
  return 0;
}

static kiln_tensor *param(int64_t r, int64_t c, uint64_t seed) {
  kiln_generator *g = kiln_generator_new(seed);
  kiln_tensor *w = kiln_randn(KILN_SHAPE(r, c), KILN_F32, CPU, g);
  kiln_generator_free(g);
  kiln_requires_grad_(w, true);
  return w;
}

/* linear in bf16, the loss in f32; w's gradient is f32 and the same bits as the program
** that writes the casts itself. */
static void test_linear_lower_and_f32_grads(void) {
  kiln_scope_begin();
  kiln_tensor *w = param(3, 4, 1), *b = param(1, 3, 2), *x = kiln_randn(KILN_SHAPE(5, 4), KILN_F32, CPU, NULL);
  kiln_tensor *bias = kiln_view(b, KILN_SHAPE(3));
  CHECK(kiln_autocast_begin(KILN_DEVICE_CPU, KILN_BF16) == KILN_OK);
  CHECK(kiln_autocast_is_enabled(KILN_DEVICE_CPU) && kiln_autocast_dtype(KILN_DEVICE_CPU) == KILN_BF16);
  kiln_tensor *y = kiln_linear(x, w, bias);
  CHECK(y && kiln_dtype_of(y) == KILN_BF16);
  kiln_tensor *sm = kiln_log_softmax(y, 1); /* f32 class: back to f32 */
  CHECK(sm && kiln_dtype_of(sm) == KILN_F32);
  kiln_tensor *loss = kiln_mean_all(sm);
  CHECK(kiln_autocast_end() == KILN_OK);
  CHECK(!kiln_autocast_is_enabled(KILN_DEVICE_CPU));
  CHECK(kiln_backward(loss, NULL) == KILN_OK);
  kiln_tensor *gw = kiln_keep(kiln_clone(kiln_grad(w))), *gb = kiln_keep(kiln_clone(kiln_grad(b)));
  CHECK(gw && kiln_dtype_of(gw) == KILN_F32 && kiln_dtype_of(w) == KILN_F32);
  CHECK(gb && kiln_dtype_of(gb) == KILN_F32);
  /* the same computation with the casts written out */
  kiln_set_grad(w, NULL);
  kiln_set_grad(b, NULL);
  kiln_tensor *y2 = kiln_linear(kiln_to_dtype(x, KILN_BF16), kiln_to_dtype(w, KILN_BF16),
                                kiln_to_dtype(bias, KILN_BF16));
  kiln_tensor *loss2 = kiln_mean_all(kiln_log_softmax(kiln_to_dtype(y2, KILN_F32), 1));
  CHECK(kiln_backward(loss2, NULL) == KILN_OK);
  CHECK(bits_equal(loss, loss2));
  CHECK(bits_equal(gw, kiln_grad(w)));
  CHECK(bits_equal(gb, kiln_grad(b)));
  kiln_tensor_free(gw);
  kiln_tensor_free(gb);
  kiln_scope_end();
}

/* f32 class on bf16 inputs; promote on mixed inputs; nothing outside a region. */
static void test_f32_and_promote(void) {
  kiln_scope_begin();
  kiln_tensor *h = kiln_randn(KILN_SHAPE(2, 3), KILN_BF16, CPU, NULL);
  kiln_tensor *f = kiln_randn(KILN_SHAPE(2, 3), KILN_F32, CPU, NULL);
  CHECK(kiln_dtype_of(kiln_softmax(h, 1)) == KILN_BF16);
  CHECK(kiln_dtype_of(kiln_exp(h)) == KILN_BF16);
  CHECK(kiln_autocast_begin(KILN_DEVICE_CPU, KILN_BF16) == KILN_OK);
  CHECK(kiln_dtype_of(kiln_softmax(h, 1)) == KILN_F32);
  CHECK(kiln_dtype_of(kiln_exp(h)) == KILN_F32);
  CHECK(kiln_dtype_of(kiln_sum_all(h)) == KILN_F32);
  CHECK(kiln_dtype_of(kiln_add(h, f)) == KILN_F32);
  CHECK(kiln_dtype_of(kiln_mul(h, h)) == KILN_BF16); /* not mixed: left alone */
  CHECK(kiln_dtype_of(kiln_relu(h)) == KILN_BF16);   /* no class */
  kiln_tensor *parts[2] = {h, f};
  CHECK(kiln_dtype_of(kiln_cat(2, parts, 0)) == KILN_F32);
  /* f64 stays f64 under lower */
  kiln_tensor *d = kiln_randn(KILN_SHAPE(3, 3), KILN_F64, CPU, NULL);
  CHECK(kiln_dtype_of(kiln_matmul(d, d)) == KILN_F64);
  CHECK(kiln_autocast_end() == KILN_OK);
  kiln_scope_end();
}

/* One cast per parameter per region, whatever the number of uses; a new region casts again. */
static void test_weight_cast_cache(void) {
  kiln_scope_begin();
  kiln_tensor *w = param(4, 4, 3), *x = kiln_randn(KILN_SHAPE(2, 4), KILN_F32, CPU, NULL);
  n_seen = n_casts = 0;
  CHECK(kiln__observer_add(&seen_obs) == KILN_OK);
  CHECK(kiln_autocast_begin(KILN_DEVICE_CPU, KILN_BF16) == KILN_OK);
  kiln_tensor *h = kiln_linear(x, w, NULL);
  h = kiln_linear(h, w, NULL); /* h is bf16 already: only w is cast, from the cache */
  kiln_tensor *loss = kiln_mean_all(h);
  CHECK(kiln_autocast_end() == KILN_OK);
  CHECK(n_casts == 3); /* x once, w once (not twice), h for the f32 mean */
  CHECK(seen_count("to_dtype_many") == 1); /* x and w in one kernel */
  CHECK(kiln_backward(loss, NULL) == KILN_OK);
  CHECK(kiln_grad(w) && kiln_dtype_of(kiln_grad(w)) == KILN_F32);
  /* the gradient of the shared cast is the sum of both uses: compare with explicit casts */
  kiln_tensor *g1 = kiln_keep(kiln_clone(kiln_grad(w)));
  kiln_set_grad(w, NULL);
  kiln_tensor *wb = kiln_to_dtype(w, KILN_BF16);
  kiln_tensor *h2 = kiln_linear(kiln_linear(kiln_to_dtype(x, KILN_BF16), wb, NULL), wb, NULL);
  CHECK(kiln_backward(kiln_mean_all(kiln_to_dtype(h2, KILN_F32)), NULL) == KILN_OK);
  CHECK(bits_equal(g1, kiln_grad(w)));
  kiln_tensor_free(g1);
  n_seen = n_casts = 0;
  bool prev;
  CHECK(kiln_autocast_begin(KILN_DEVICE_CPU, KILN_BF16) == KILN_OK);
  kiln_linear(x, w, NULL);
  CHECK(kiln_autocast_end() == KILN_OK);
  if (n_casts != 0) fprintf(stderr, "%d tensors cast\n", n_casts);
  /* a new region: w is unchanged since, its kept copy is used, and x is cast in the same
  ** op (amp_copy) */
  CHECK(n_casts == 0);
  CHECK(seen_count("amp_copy") == 1);
  prev = kiln_set_grad_enabled(false);
  CHECK(kiln_mul_scalar_(w, 1.0) == KILN_OK); /* an in-place write, even of the same values */
  kiln_set_grad_enabled(prev);
  n_seen = n_casts = 0;
  CHECK(kiln_autocast_begin(KILN_DEVICE_CPU, KILN_BF16) == KILN_OK);
  kiln_linear(x, w, NULL);
  CHECK(kiln_autocast_end() == KILN_OK);
  CHECK(n_casts == 2); /* w was written: cast afresh */
  /* with grad mode off nothing is cached (a no-grad cast has no node to reuse) */
  n_seen = 0;
  prev = kiln_set_grad_enabled(false);
  CHECK(kiln_autocast_begin(KILN_DEVICE_CPU, KILN_BF16) == KILN_OK);
  kiln_linear(x, w, NULL);
  CHECK(kiln_autocast_end() == KILN_OK);
  kiln_set_grad_enabled(prev);
  CHECK(kiln_requires_grad(kiln_linear(x, w, NULL)));
  kiln__observer_remove(&seen_obs);
  kiln_scope_end();
}

/* Regions nest: an inner disabled region runs in f32; the outer resumes after it. */
static void test_nesting_and_enabled_flag(void) {
  kiln_scope_begin();
  kiln_tensor *a = kiln_randn(KILN_SHAPE(2, 2), KILN_F32, CPU, NULL);
  CHECK(kiln_autocast_begin(KILN_DEVICE_CPU, KILN_BF16) == KILN_OK);
  CHECK(kiln_dtype_of(kiln_matmul(a, a)) == KILN_BF16);
  CHECK(kiln_autocast_begin_enabled(KILN_DEVICE_CPU, KILN_BF16, false) == KILN_OK);
  CHECK(!kiln_autocast_is_enabled(KILN_DEVICE_CPU));
  CHECK(kiln_dtype_of(kiln_matmul(a, a)) == KILN_F32);
  CHECK(kiln_autocast_begin(KILN_DEVICE_CPU, KILN_F16) == KILN_OK);
  CHECK(kiln_dtype_of(kiln_matmul(a, a)) == KILN_F16);
  CHECK(kiln_autocast_end() == KILN_OK);
  CHECK(kiln_autocast_end() == KILN_OK);
  CHECK(kiln_dtype_of(kiln_matmul(a, a)) == KILN_BF16);
  CHECK(kiln_autocast_end() == KILN_OK);
  CHECK(kiln_dtype_of(kiln_matmul(a, a)) == KILN_F32);
  /* a CUDA region does not touch CPU tensors */
  if (kiln_backend_built(KILN_DEVICE_CUDA)) {
    CHECK(kiln_autocast_begin(KILN_DEVICE_CUDA, KILN_F16) == KILN_OK);
    CHECK(kiln_dtype_of(kiln_matmul(a, a)) == KILN_F32);
    CHECK(kiln_autocast_end() == KILN_OK);
  }
  kiln_scope_end();
}

/* A backward called inside a region runs its rules uncast: gradients keep their dtypes. */
static void test_backward_inside_region(void) {
  kiln_scope_begin();
  kiln_tensor *w = param(3, 3, 4), *x = kiln_randn(KILN_SHAPE(2, 3), KILN_F32, CPU, NULL);
  CHECK(kiln_autocast_begin(KILN_DEVICE_CPU, KILN_BF16) == KILN_OK);
  kiln_tensor *loss = kiln_mean_all(kiln_exp(kiln_matmul(x, w)));
  CHECK(kiln_backward(loss, NULL) == KILN_OK);
  CHECK(kiln_autocast_end() == KILN_OK);
  CHECK(kiln_grad(w) && kiln_dtype_of(kiln_grad(w)) == KILN_F32);
  kiln_scope_end();
}

/* Without a scope the casts belong to the region and are freed at its end. */
static void test_no_scope_no_leak(void) {
  int64_t live = kiln_live_tensors();
  kiln_tensor *a = kiln_randn(KILN_SHAPE(2, 2), KILN_F32, CPU, NULL);
  kiln_tensor *w = param(2, 2, 5);
  CHECK(kiln_autocast_begin(KILN_DEVICE_CPU, KILN_BF16) == KILN_OK);
  kiln_tensor *y = kiln_matmul(a, w);
  kiln_tensor *z = kiln_softmax(y, 1);
  CHECK(kiln_autocast_end() == KILN_OK);
  CHECK(kiln_dtype_of(z) == KILN_F32);
  kiln_tensor_free(z);
  kiln_tensor_free(y);
  kiln_tensor_free(w);
  kiln_tensor_free(a);
  CHECK(kiln_live_tensors() == live);
}

/* Inside a captured step (on the CPU: the step runs at each replay). */
typedef struct cap_ctx {
  kiln_tensor *x, *w, *out;
} cap_ctx;
static kiln_status cap_step(void *p) {
  cap_ctx *c = p;
  kiln_status st = kiln_autocast_begin(KILN_DEVICE_CPU, KILN_BF16);
  if (st != KILN_OK) return st;
  kiln_scope_begin();
  kiln_tensor *y = kiln_matmul(c->x, c->w);
  st = y ? kiln_copy_(c->out, y) : kiln_last_error();
  kiln_scope_end();
  kiln_status e = kiln_autocast_end();
  return st != KILN_OK ? st : e;
}
static void test_graph_capture(void) {
  kiln_scope_begin();
  cap_ctx c = {kiln_randn(KILN_SHAPE(2, 2), KILN_F32, CPU, NULL), param(2, 2, 6),
               kiln_zeros(KILN_SHAPE(2, 2), KILN_BF16, CPU)};
  CHECK(cap_step(&c) == KILN_OK);
  kiln_graph *g = kiln_graph_capture(CPU, cap_step, &c);
  CHECK(g != NULL);
  CHECK(kiln_graph_replay(g) == KILN_OK);
  kiln_tensor *ref = kiln_matmul(kiln_to_dtype(c.x, KILN_BF16), kiln_to_dtype(c.w, KILN_BF16));
  CHECK(bits_equal(ref, c.out));
  kiln_graph_free(g);
  kiln_scope_end();
}

static void test_bad_inputs(void) {
  CHECK(kiln_autocast_begin(KILN_DEVICE_CPU, KILN_I32) == KILN_ERR_DTYPE);
  CHECK(strstr(kiln_last_error_message(), "int32") != NULL);
  CHECK(!kiln_autocast_is_enabled(KILN_DEVICE_CPU));
  CHECK(kiln_autocast_begin(KILN_DEVICE_CPU, KILN_F32) == KILN_ERR_DTYPE);
  CHECK(kiln_autocast_begin((kiln_device_type)97, KILN_BF16) == KILN_ERR_DEVICE);
  CHECK(kiln_autocast_end() == KILN_ERR_STATE);
  int ok = 0;
  while (kiln_autocast_begin(KILN_DEVICE_CPU, KILN_BF16) == KILN_OK && ok < 1000) ok++;
  CHECK(ok == 64 && kiln_last_error() == KILN_ERR_STATE);
  for (int i = 0; i < ok; i++) CHECK(kiln_autocast_end() == KILN_OK);
  CHECK(!kiln_autocast_is_enabled(KILN_DEVICE_CPU));
  kiln_clear_error();
}

/* docs/autocast.md's table against the descriptors of every op this runs. */
static int class_of(const char *s) {
  if (strcmp(s, "lower") == 0) return KILN__AMP_LOWER;
  if (strcmp(s, "f32") == 0) return KILN__AMP_F32;
  if (strcmp(s, "promote") == 0) return KILN__AMP_PROMOTE;
  return -1;
}
static void test_doc_table_matches_descriptors(void) {
  const char *src = getenv("KILN_SOURCE_DIR");
  char path[1024];
  snprintf(path, sizeof path, "%s/docs/autocast.md", src ? src : ".");
  FILE *f = fopen(path, "r");
  CHECK(f != NULL);
  if (!f) return;
  struct {
    char name[64];
    int amp;
  } doc[96];
  int n_doc = 0;
  char line[256];
  bool in_table = false;
  while (fgets(line, sizeof line, f)) {
    if (strstr(line, "autocast-table: begin")) in_table = true;
    if (strstr(line, "autocast-table: end")) in_table = false;
    char name[64], cls[32];
    if (in_table && sscanf(line, "| %63[a-z_0-9] | %31[a-z0-9] |", name, cls) == 2 && n_doc < 96 &&
        strcmp(name, "op") != 0) {
      snprintf(doc[n_doc].name, sizeof doc[n_doc].name, "%s", name);
      doc[n_doc].amp = class_of(cls);
      CHECK(doc[n_doc].amp >= 0);
      n_doc++;
    }
  }
  fclose(f);
  CHECK(n_doc >= 30);

  kiln_scope_begin();
  n_seen = 0;
  CHECK(kiln__observer_add(&seen_obs) == KILN_OK);
  kiln_tensor *a = kiln_randn(KILN_SHAPE(3, 4), KILN_F32, CPU, NULL);
  kiln_tensor *b = kiln_randn(KILN_SHAPE(3, 4), KILN_F32, CPU, NULL);
  kiln_tensor *w = kiln_randn(KILN_SHAPE(5, 4), KILN_F32, CPU, NULL);
  kiln_tensor *pos = kiln_add_scalar(kiln_abs(a), 0.5);
  kiln_tensor *ids = kiln_zeros(KILN_SHAPE(3), KILN_I64, CPU);
  kiln_tensor *idx2 = kiln_zeros(KILN_SHAPE(3, 4), KILN_I64, CPU);
  kiln_tensor *ab[2] = {a, b};
  kiln_matmul(a, kiln_transpose(b, 0, 1));
  kiln_linear(a, w, NULL);
  kiln_linear_relu(a, w, NULL);
  kiln_softmax(a, 1);
  kiln_log_softmax(a, 1);
  kiln_cross_entropy(a, ids, KILN_REDUCTION_MEAN, -100, 0.0);
  kiln_mse_loss(a, b, KILN_REDUCTION_MEAN);
  kiln_sum_all(a);
  kiln_mean_all(a);
  kiln_var(a, KILN_DIMS(1), 1, false);
  kiln_std(a, KILN_DIMS(1), 1, false);
  kiln_exp(a);
  kiln_log(pos);
  kiln_rsqrt(pos);
  kiln_sqrt(pos);
  kiln_pow(pos, b);
  kiln_pow_scalar(pos, 2.0);
  kiln_softplus(a, 1.0, 20.0);
  kiln_add(a, b);
  kiln_axpy(a, 2.0, b);
  kiln_sub(a, b);
  kiln_mul(a, b);
  kiln_div(a, pos);
  kiln_maximum(a, b);
  kiln_minimum(a, b);
  kiln_eq(a, b);
  kiln_ne(a, b);
  kiln_lt(a, b);
  kiln_le(a, b);
  kiln_gt(a, b);
  kiln_ge(a, b);
  kiln_where(kiln_gt(a, b), a, b);
  kiln_cat(2, ab, 0);
  kiln_stack(2, ab, 0);
  kiln_scatter_add(a, 1, idx2, b);
  kiln_relu(a);
  kiln_tanh(a);
  kiln_neg(a);
  kiln_amax(a, KILN_DIMS(1), false);
  kiln_to_dtype(a, KILN_BF16);
  kiln__observer_remove(&seen_obs);
  for (int d = 0; d < n_doc; d++) {
    int found = -1;
    for (int i = 0; i < n_seen; i++)
      if (strcmp(seen[i].name, doc[d].name) == 0) found = i;
    if (found < 0) fprintf(stderr, "docs/autocast.md lists %s, which the test did not run\n", doc[d].name);
    CHECK(found >= 0);
    if (found >= 0 && seen[found].amp != doc[d].amp)
      fprintf(stderr, "%s: docs/autocast.md says class %d, the descriptor %d\n", doc[d].name, doc[d].amp,
              seen[found].amp);
    CHECK(found < 0 || seen[found].amp == doc[d].amp);
  }
  for (int i = 0; i < n_seen; i++) {
    bool listed = false;
    for (int d = 0; d < n_doc; d++) listed = listed || strcmp(seen[i].name, doc[d].name) == 0;
    if (!listed && seen[i].amp != KILN__AMP_NONE)
      fprintf(stderr, "%s has autocast class %d but is not in docs/autocast.md\n", seen[i].name, seen[i].amp);
    CHECK(listed || seen[i].amp == KILN__AMP_NONE);
  }
  kiln_scope_end();
}

int main(void) {
  kiln_manual_seed(7);
  test_linear_lower_and_f32_grads();
  test_f32_and_promote();
  test_weight_cast_cache();
  test_nesting_and_enabled_flag();
  test_backward_inside_region();
  test_no_scope_no_leak();
  test_graph_capture();
  test_bad_inputs();
  test_doc_table_matches_descriptors();
  printf("test_autocast: %d failures\n", failures);
  return failures ? 1 : 0;
}
