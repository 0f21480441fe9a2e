/*
** CUDA runtime behaviour seen through the public API: devices, moves, mixing devices,
** the CPU fallback and its policy, out-of-memory recovery while training, memory
** statistics, and graph capture/replay. Exits 77 (skipped) without a CUDA device.
*/
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <kiln.h>

#include "backend/backend.h" /* kiln__dispatch_disable_kernel's op ids */

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void kiln__dispatch_disable_kernel(kiln_device_type type, int op, bool off);
void kiln__graph_shape(const kiln_graph *g, int *nodes, int *depth);

static int failures, checks;
#define CHECK(cond, ...)                                                                  \
  do {                                                                                    \
    checks++;                                                                             \
    if (!(cond)) {                                                                        \
      failures++;                                                                         \
      printf("FAIL %s:%d: ", __FILE__, __LINE__);                                         \
      printf(__VA_ARGS__);                                                                \
      printf(" [last error: %s]\n", kiln_last_error_message());                           \
    }                                                                                     \
  } while (0)

static double max_abs_diff(kiln_tensor *a, kiln_tensor *b) {
  kiln_tensor *ca = kiln_to_dtype(kiln_to_device(a, kiln_device_cpu()), KILN_F64);
  kiln_tensor *cb = kiln_to_dtype(kiln_to_device(b, kiln_device_cpu()), KILN_F64);
  if (!ca || !cb) return INFINITY;
  int64_t n = kiln_numel(ca);
  double *x = malloc((size_t)n * 8), *y = malloc((size_t)n * 8), m = 0;
  kiln_to_host(ca, x, (size_t)n * 8);
  kiln_to_host(cb, y, (size_t)n * 8);
  for (int64_t i = 0; i < n; i++) {
    double d = fabs(x[i] - y[i]);
    if (!(d <= m)) m = d;
  }
  free(x);
  free(y);
  return m;
}

static void test_devices(kiln_device gpu) {
  kiln_scope_begin();
  kiln_device best = kiln_device_best();
  CHECK(best.type == KILN_DEVICE_CUDA, "kiln_device_best picks the GPU");
  kiln_device d;
  CHECK(kiln_device_parse("cuda:0", &d) == KILN_OK && d.type == KILN_DEVICE_CUDA, "parse cuda:0");
  CHECK(kiln_device_parse("cuda:999", &d) == KILN_ERR_DEVICE, "parse cuda:999 is an error");
  kiln_tensor *x = kiln_randn(KILN_SHAPE(64, 33), KILN_F32, kiln_device_cpu(), NULL);
  kiln_tensor *xg = kiln_to_device(x, gpu);
  CHECK(xg && kiln_device_of(xg).type == KILN_DEVICE_CUDA, "to_device moves to the GPU");
  CHECK(max_abs_diff(x, xg) == 0, "round trip is exact");
  /* the same seed gives the same numbers on both devices */
  kiln_generator *g1 = kiln_generator_new(7), *g2 = kiln_generator_new(7);
  kiln_tensor *rc = kiln_randn(KILN_SHAPE(1000, 7), KILN_F32, kiln_device_cpu(), g1);
  kiln_tensor *rg = kiln_randn(KILN_SHAPE(1000, 7), KILN_F32, gpu, g2);
  CHECK(max_abs_diff(rc, rg) < 1e-5, "randn: same seed, same numbers on cpu and cuda (%g)", max_abs_diff(rc, rg));
  kiln_tensor *uc = kiln_rand(KILN_SHAPE(999), KILN_F64, kiln_device_cpu(), g1);
  kiln_tensor *ug = kiln_rand(KILN_SHAPE(999), KILN_F64, gpu, g2);
  CHECK(max_abs_diff(uc, ug) == 0, "rand f64: identical on cpu and cuda");
  kiln_generator_free(g1);
  kiln_generator_free(g2);
  /* mixing devices is an error, not a silent copy */
  kiln_clear_error();
  kiln_tensor *bad = kiln_add(x, xg);
  CHECK(bad == NULL && kiln_last_error() == KILN_ERR_DEVICE, "mixing devices is KILN_ERR_DEVICE");
  CHECK(strstr(kiln_last_error_message(), "cuda:0") != NULL, "message names the device");
  kiln_scope_end();
}

static void test_fallback(kiln_device gpu) {
  kiln_scope_begin();
  kiln_tensor *x = kiln_randn(KILN_SHAPE(37, 5), KILN_F32, gpu, NULL);
  kiln_tensor *ref = kiln_gelu(x);
  int gelu = KILN__K_GELU;
  kiln__dispatch_disable_kernel(KILN_DEVICE_CUDA, gelu, true);
  kiln_fallback_reset();
  kiln_set_fallback_policy(KILN_FALLBACK_SILENT);
  kiln_tensor *y = kiln_gelu(x);
  CHECK(y && kiln_device_of(y).type == KILN_DEVICE_CUDA, "fallback result stays on the GPU");
  CHECK(y && max_abs_diff(y, ref) < 1e-6, "fallback result matches the GPU kernel");
  kiln_tensor *xt = kiln_transpose(x, 0, 1); /* non-contiguous input through the fallback */
  kiln_tensor *yt = kiln_gelu(xt);
  CHECK(yt && max_abs_diff(yt, kiln_transpose(ref, 0, 1)) < 1e-6, "fallback on a non-contiguous view");
  kiln_fallback_entry e[8];
  int n = kiln_fallback_stats(e, 8);
  CHECK(n == 1 && strcmp(e[0].op, "gelu") == 0 && e[0].count == 2, "stats count the fallback (n=%d)", n);
  kiln_fallback_report(stdout);
  kiln_set_fallback_policy(KILN_FALLBACK_ERROR);
  kiln_clear_error();
  kiln_tensor *z = kiln_gelu(x);
  CHECK(z == NULL && kiln_last_error() == KILN_ERR_UNSUPPORTED, "policy error refuses the op");
  CHECK(strstr(kiln_last_error_message(), "gelu") && strstr(kiln_last_error_message(), "cuda:0"),
        "the error names the op and the device");
  kiln_set_fallback_policy(KILN_FALLBACK_WARN);
  kiln__dispatch_disable_kernel(KILN_DEVICE_CUDA, gelu, false);
  kiln_fallback_reset();
  kiln_scope_end();
}

/* Trains a linear model with ever larger batches until the device runs out of memory,
** frees, and finishes the run at a size that fits. */
static void test_oom_recovery(kiln_device gpu) {
  kiln_memory_stats st0;
  CHECK(kiln_memory_stats_get(gpu, &st0) == KILN_OK, "memory stats");
  const int64_t limit = (int64_t)256 << 20; /* 256 MiB cap so the test is quick */
  CHECK(kiln_memory_set_limit(gpu, limit) == KILN_OK, "set a memory limit");
  kiln_tensor *w = kiln_keep(kiln_randn(KILN_SHAPE(512, 512), KILN_F32, gpu, NULL));
  kiln_requires_grad_(w, true);
  int64_t batch = 1024;
  bool hit = false;
  for (int round = 0; round < 12 && !hit; round++, batch *= 2) {
    kiln_scope_begin();
    kiln_tensor *x = kiln_randn(KILN_SHAPE(batch, 512), KILN_F32, gpu, NULL);
    kiln_tensor *loss = kiln_mean_all(kiln_relu(kiln_matmul(x, w)));
    kiln_status s = kiln_backward(loss, NULL);
    if (s == KILN_ERR_OOM || (s != KILN_OK && kiln_last_error() == KILN_ERR_OOM)) {
      hit = true;
      const char *m = kiln_last_error_message();
      CHECK(strstr(m, "tried to allocate") != NULL, "OOM message gives the requested size: %s", m);
      printf("OOM as intended at batch %lld: %s\n", (long long)batch, m);
    }
    kiln_scope_end();
    kiln_set_grad(w, NULL);
  }
  CHECK(hit, "the memory limit produced KILN_ERR_OOM");
  kiln_memory_stats st;
  kiln_memory_stats_get(gpu, &st);
  CHECK(st.num_ooms >= 1, "num_ooms counted (%lld)", (long long)st.num_ooms);
  CHECK(kiln_memory_empty_cache(gpu) == KILN_OK, "empty_cache");
  /* recover: the same step at a size that fits */
  kiln_clear_error();
  kiln_scope_begin();
  kiln_tensor *x = kiln_randn(KILN_SHAPE(1024, 512), KILN_F32, gpu, NULL);
  kiln_tensor *loss = kiln_mean_all(kiln_relu(kiln_matmul(x, w)));
  CHECK(kiln_backward(loss, NULL) == KILN_OK, "training goes on after the OOM");
  CHECK(isfinite(kiln_item(loss)), "loss is finite after recovery");
  kiln_scope_end();
  kiln_memory_set_limit(gpu, 0);
  kiln_tensor_free(w);
  kiln_memory_stats_get(gpu, &st);
  printf("memory: allocated %lld reserved %lld peak %lld allocs %lld device allocs %lld\n",
         (long long)st.allocated, (long long)st.reserved, (long long)st.peak_allocated,
         (long long)st.num_allocs, (long long)st.num_device_allocs);
  CHECK(st.num_device_allocs < st.num_allocs, "the cache serves most allocations");
}

typedef struct step_ctx {
  kiln_tensor *x, *w, *out;
} step_ctx;

static kiln_status graph_step(void *p) {
  step_ctx *c = p;
  kiln_scope_begin();
  kiln_tensor *y = kiln_tanh(kiln_matmul(c->x, c->w));
  kiln_status st = y ? kiln_copy_(c->out, y) : kiln_last_error();
  kiln_scope_end();
  return st;
}

static kiln_status bad_step(void *p) {
  step_ctx *c = p;
  double v = kiln_item(kiln_sum_all(c->x)); /* a host read inside a capture */
  return isnan(v) ? kiln_last_error() : KILN_OK;
}

static void test_graphs(kiln_device gpu) {
  step_ctx c;
  c.x = kiln_keep(kiln_randn(KILN_SHAPE(64, 32), KILN_F32, gpu, NULL));
  c.w = kiln_keep(kiln_randn(KILN_SHAPE(32, 16), KILN_F32, gpu, NULL));
  c.out = kiln_keep(kiln_zeros(KILN_SHAPE(64, 16), KILN_F32, gpu));
  CHECK(graph_step(&c) == KILN_OK, "eager warm-up step");
  kiln_graph *g = kiln_graph_capture(gpu, graph_step, &c);
  CHECK(g && kiln_graph_is_device_graph(g), "captured a CUDA graph");
  for (int i = 0; i < 10 && g; i++) {
    kiln_scope_begin();
    kiln_tensor *nx = kiln_randn(KILN_SHAPE(64, 32), KILN_F32, gpu, NULL);
    kiln_copy_(c.x, nx);
    CHECK(kiln_graph_replay(g) == KILN_OK, "replay %d", i);
    kiln_tensor *want = kiln_tanh(kiln_matmul(c.x, c.w));
    CHECK(max_abs_diff(want, c.out) < 1e-5, "replay %d computes the step on new input", i);
    kiln_scope_end();
  }
  kiln_graph_free(g);
  kiln_clear_error();
  kiln_graph *b = kiln_graph_capture(gpu, bad_step, &c);
  CHECK(b == NULL && kiln_last_error() == KILN_ERR_STATE, "a host read inside a capture is KILN_ERR_STATE");
  kiln_graph_free(b);
  /* the device still works after a failed capture */
  kiln_clear_error();
  kiln_scope_begin();
  CHECK(isfinite(kiln_item(kiln_sum_all(c.x))), "device usable after a failed capture");
  kiln_scope_end();
  /* on the CPU the same calls run eagerly */
  step_ctx cc;
  cc.x = kiln_keep(kiln_randn(KILN_SHAPE(8, 4), KILN_F32, kiln_device_cpu(), NULL));
  cc.w = kiln_keep(kiln_randn(KILN_SHAPE(4, 3), KILN_F32, kiln_device_cpu(), NULL));
  cc.out = kiln_keep(kiln_zeros(KILN_SHAPE(8, 3), KILN_F32, kiln_device_cpu()));
  kiln_graph *gc = kiln_graph_capture(kiln_device_cpu(), graph_step, &cc);
  CHECK(gc && !kiln_graph_is_device_graph(gc) && kiln_graph_replay(gc) == KILN_OK, "cpu graph runs eagerly");
  kiln_scope_begin();
  CHECK(max_abs_diff(kiln_tanh(kiln_matmul(cc.x, cc.w)), cc.out) < 1e-6, "cpu replay result");
  kiln_scope_end();
  kiln_graph_free(gc);
  kiln_tensor_free(c.x), kiln_tensor_free(c.w), kiln_tensor_free(c.out);
  kiln_tensor_free(cc.x), kiln_tensor_free(cc.w), kiln_tensor_free(cc.out);
}

/* Data dependencies in a capture (cuda_capture.cu): two branches that share only what
** one op before them wrote run side by side in the graph (its longest chain is shorter than its node count),
** and with KILN_GRAPH_DEPS=0 the graph is one chain; replays give the eager numbers. */
typedef struct branch_ctx {
  kiln_tensor *x, *w1, *w2, *out;
} branch_ctx;

static kiln_status branch_step(void *p) {
  branch_ctx *c = p;
  kiln_scope_begin();
  kiln_tensor *h = kiln_mul_scalar(c->x, 0.5); /* what both branches read */
  kiln_tensor *a = kiln_relu(kiln_matmul(h, c->w1));
  kiln_tensor *b = kiln_tanh(kiln_matmul(h, c->w2));
  kiln_tensor *y = kiln_add(a, b);
  kiln_status st = y ? kiln_copy_(c->out, y) : kiln_last_error();
  kiln_scope_end();
  return st;
}

/* Ops on overlapping views of one buffer in every order of reads and writes (read after
** write, write after read, write after write), beside independent ones, with reductions
** whose scratch the allocator hands out again inside the capture. A view is 2^20 floats,
** so kernels the capture wrongly let run side by side would overlap in time. */
enum { HZ_SEG = 1 << 20, HZ_VIEWS = 7, HZ_OPS = 48 };
typedef struct hazard_ctx {
  kiln_tensor *buf; /* HZ_VIEWS + 1 half-segments; view i starts at half-segment i */
} hazard_ctx;

static kiln_status hazard_step(void *p) {
  hazard_ctx *c = p;
  kiln_scope_begin();
  kiln_tensor *v[HZ_VIEWS];
  for (int i = 0; i < HZ_VIEWS; i++) v[i] = kiln_narrow(c->buf, 0, (int64_t)i * HZ_SEG / 2, HZ_SEG);
  kiln_status st = KILN_OK;
  uint32_t r = 12345;
  for (int k = 0; k < HZ_OPS && st == KILN_OK; k++) {
    r = r * 1664525u + 1013904223u;
    const int i = (int)((r >> 8) % HZ_VIEWS), kind = (int)((r >> 20) % 4);
    int j = (int)((r >> 12) % HZ_VIEWS);
    if (abs(i - j) < 2) j = (i + 3) % HZ_VIEWS; /* views i and j do not overlap */
    switch (kind) {
    case 0: st = kiln_mul_scalar_(v[i], 0.5 + 0.01 * (double)(k % 7)); break;
    case 1: st = kiln_axpy_(v[i], 0.25, v[j]); break;
    case 2: st = kiln_copy_(v[i], kiln_tanh(v[j])); break;
    default: /* a reduction with split partials, written into one element of view i */
      st = kiln_copy_(kiln_narrow(v[i], 0, 0, 1), kiln_mul_scalar(kiln_sum_all(v[j]), 1e-6));
    }
  }
  kiln_scope_end();
  return st;
}

static void test_graph_dependencies(kiln_device gpu) {
  kiln_generator *gen = kiln_generator_new(3);
  branch_ctx c;
  c.x = kiln_keep(kiln_randn(KILN_SHAPE(96, 64), KILN_F32, gpu, gen));
  c.w1 = kiln_keep(kiln_randn(KILN_SHAPE(64, 48), KILN_F32, gpu, gen));
  c.w2 = kiln_keep(kiln_randn(KILN_SHAPE(64, 48), KILN_F32, gpu, gen));
  c.out = kiln_keep(kiln_zeros(KILN_SHAPE(96, 48), KILN_F32, gpu));
  CHECK(branch_step(&c) == KILN_OK, "eager warm-up step");
  int nodes[2], depth[2];
  for (int off = 0; off < 2; off++) {
    if (off) setenv("KILN_GRAPH_DEPS", "0", 1);
    kiln_graph *g = kiln_graph_capture(gpu, branch_step, &c);
    unsetenv("KILN_GRAPH_DEPS");
    CHECK(g != NULL, "captured the two-branch step (KILN_GRAPH_DEPS %s)", off ? "0" : "unset");
    kiln__graph_shape(g, &nodes[off], &depth[off]);
    for (int i = 0; i < 5 && g; i++) {
      kiln_scope_begin();
      kiln_copy_(c.x, kiln_randn(KILN_SHAPE(96, 64), KILN_F32, gpu, gen));
      CHECK(kiln_graph_replay(g) == KILN_OK, "replay %d", i);
      kiln_tensor *h = kiln_mul_scalar(c.x, 0.5);
      kiln_tensor *want = kiln_add(kiln_relu(kiln_matmul(h, c.w1)), kiln_tanh(kiln_matmul(h, c.w2)));
      CHECK(max_abs_diff(want, c.out) == 0, "replay %d gives the eager numbers (deps %s)", i, off ? "off" : "on");
      kiln_scope_end();
    }
    kiln_graph_free(g);
  }
  /* 7 ops: the scaling, two products and their activations, the add, the copy out */
  CHECK(nodes[1] >= 7 && depth[1] == nodes[1],
        "KILN_GRAPH_DEPS=0 captures one chain: %d nodes, longest chain %d", nodes[1], depth[1]);
  CHECK(nodes[0] == nodes[1] && depth[0] >= 5 && depth[0] <= nodes[1] - 2,
        "the branches run side by side: %d nodes, longest chain %d (a chain: %d)", nodes[0], depth[0], depth[1]);
  kiln_tensor_free(c.x), kiln_tensor_free(c.w1), kiln_tensor_free(c.w2), kiln_tensor_free(c.out);

  /* the hazards: the eager run from a start, then replays from the same start */
  kiln_tensor *start = kiln_keep(kiln_randn(KILN_SHAPE((HZ_VIEWS + 1) * HZ_SEG / 2), KILN_F32, gpu, gen));
  hazard_ctx e = {kiln_keep(kiln_clone(start))}, h = {kiln_keep(kiln_clone(start))};
  CHECK(hazard_step(&e) == KILN_OK, "eager hazard step");
  kiln_graph *g = kiln_graph_capture(gpu, hazard_step, &h);
  CHECK(g != NULL, "captured the hazard step");
  int hn, hd;
  kiln__graph_shape(g, &hn, &hd);
  CHECK(hn >= HZ_OPS && hd < hn, "the hazard step has independent ops: %d nodes, longest chain %d", hn, hd);
  for (int rep = 0; rep < 3 && g; rep++) {
    CHECK(kiln_graph_replay(g) == KILN_OK, "hazard replay %d", rep);
    CHECK(max_abs_diff(e.buf, h.buf) == 0, "hazard replay %d gives the eager numbers", rep);
    CHECK(hazard_step(&e) == KILN_OK, "eager hazard step %d", rep + 2);
  }
  kiln_graph_free(g);
  kiln_tensor_free(start), kiln_tensor_free(e.buf), kiln_tensor_free(h.buf);
  kiln_generator_free(gen);
}

/* kiln_to_device_many: compact host tensors in one transfer, as views of one device block
** at aligned offsets, with their values; one that requires grad goes alone and keeps its
** history; a device tensor among them is moved as usual. */
static void test_to_device_many(kiln_device gpu) {
  kiln_scope_begin();
  kiln_device cpu = kiln_device_cpu();
  kiln_tensor *ts[4] = {kiln_randn(KILN_SHAPE(5, 3), KILN_F32, cpu, NULL), kiln_arange(0, 7, 1, KILN_I64, cpu),
                        kiln_zeros(KILN_SHAPE(0), KILN_U8, cpu), kiln_randn(KILN_SHAPE(33), KILN_BF16, cpu, NULL)};
  kiln_tensor *out[4];
  CHECK(kiln_to_device_many(4, ts, gpu, out) == KILN_OK, "to_device_many to the GPU");
  for (int i = 0; i < 4; i++) {
    CHECK(out[i] && kiln_device_of(out[i]).type == KILN_DEVICE_CUDA && kiln_dtype_of(out[i]) == kiln_dtype_of(ts[i]) &&
              kiln_numel(out[i]) == kiln_numel(ts[i]),
          "to_device_many: tensor %d on the GPU with its dtype and shape", i);
    if (out[i] && kiln_numel(ts[i]) > 0) CHECK(max_abs_diff(ts[i], out[i]) == 0, "to_device_many: tensor %d's values", i);
  }
  /* refilled in one transfer by kiln_copy_many_ from new host tensors of the same shapes */
  kiln_tensor *fresh[4] = {kiln_randn(KILN_SHAPE(5, 3), KILN_F32, cpu, NULL), kiln_arange(7, 14, 1, KILN_I64, cpu),
                           kiln_zeros(KILN_SHAPE(0), KILN_U8, cpu), kiln_randn(KILN_SHAPE(33), KILN_BF16, cpu, NULL)};
  CHECK(kiln_copy_many_(4, out, fresh) == KILN_OK, "copy_many_ into the packed block");
  for (int i = 0; i < 4; i++)
    if (kiln_numel(fresh[i]) > 0) CHECK(max_abs_diff(fresh[i], out[i]) == 0, "copy_many_: tensor %d's new values", i);
  /* on the device: from another block of the same layout (one copy), then pair by pair
  ** from separate device tensors */
  kiln_tensor *other[4], *sep[4];
  CHECK(kiln_to_device_many(4, ts, gpu, other) == KILN_OK && kiln_copy_many_(4, out, other) == KILN_OK,
        "copy_many_ from a packed device block");
  for (int i = 0; i < 4; i++)
    if (kiln_numel(ts[i]) > 0) CHECK(max_abs_diff(ts[i], out[i]) == 0, "copy_many_ on the device: tensor %d", i);
  for (int i = 0; i < 4; i++) sep[i] = kiln_to_device(fresh[i], gpu);
  CHECK(kiln_copy_many_(4, out, sep) == KILN_OK, "copy_many_ from separate device tensors");
  for (int i = 0; i < 4; i++)
    if (kiln_numel(fresh[i]) > 0) CHECK(max_abs_diff(fresh[i], out[i]) == 0, "copy_many_ pair by pair: tensor %d", i);
  kiln_tensor *w = kiln_randn(KILN_SHAPE(4), KILN_F32, cpu, NULL);
  kiln_requires_grad_(w, true);
  kiln_tensor *two[2] = {ts[0], w}, *o2[2];
  CHECK(kiln_to_device_many(2, two, gpu, o2) == KILN_OK && kiln_requires_grad(o2[1]),
        "a tensor that requires grad keeps its history");
  CHECK(kiln_backward(kiln_sum_all(o2[1]), NULL) == KILN_OK && kiln_grad(w) &&
            kiln_device_of(kiln_grad(w)).type == KILN_DEVICE_CPU,
        "the gradient comes back to the CPU leaf");
  kiln_scope_end();
}

/* kiln_adam_multi_step_ on the GPU (the list kernel: 40 tensors, so more than one launch,
** sizes from empty to 100k) against the same calls on the CPU, per dtype; with the step
** on the device too, which the kernel must read and then advance. */
static void test_adam_multi(kiln_device gpu) {
  enum { NT = 40 };
  const kiln_dtype dts[4] = {KILN_F32, KILN_F64, KILN_F16, KILN_BF16};
  const kiln_device cpu = kiln_device_cpu();
  for (int di = 0; di < 4; di++) {
    for (int dev_step = 0; dev_step < 2; dev_step++) {
      kiln_dtype dt = dts[di];
      kiln_scope_begin();
      kiln_generator *gen = kiln_generator_new(99 + (uint64_t)di);
      kiln_tensor *p[2][NT], *g[2][NT], *m[2][NT], *v[2][NT], *x[2][NT], *t[2][NT];
      int64_t steps[NT];
      for (int i = 0; i < NT; i++) {
        int64_t n = i == 3 ? 0 : i == 7 ? 100003 : 1 + (i * 977) % 3001;
        kiln_tensor *p0 = kiln_randn(KILN_SHAPE(n), KILN_F32, cpu, gen);
        kiln_tensor *g0 = kiln_randn(KILN_SHAPE(n), KILN_F32, cpu, gen);
        for (int side = 0; side < 2; side++) {
          kiln_device d = side ? gpu : cpu;
          p[side][i] = kiln_to_device(kiln_to_dtype(p0, dt), d);
          g[side][i] = kiln_to_device(kiln_to_dtype(g0, dt), d);
          m[side][i] = kiln_zeros(KILN_SHAPE(n), dt, d);
          v[side][i] = kiln_zeros(KILN_SHAPE(n), dt, d);
          x[side][i] = kiln_zeros(KILN_SHAPE(n), dt, d);
          t[side][i] = kiln_scalar(0, KILN_F64, d);
        }
      }
      bool prev = kiln_set_grad_enabled(false);
      kiln_status st = KILN_OK;
      for (int s = 1; s <= 3 && st == KILN_OK; s++) {
        for (int i = 0; i < NT; i++) steps[i] = s;
        for (int side = 0; side < 2 && st == KILN_OK; side++)
          st = kiln_adam_multi_step_(NT, p[side], g[side], m[side], v[side], x[side], steps,
                                     dev_step ? t[side] : NULL, 1e-2, 0.9, 0.99, 1e-8, 0.01,
                                     s == 2, true);
      }
      kiln_set_grad_enabled(prev);
      CHECK(st == KILN_OK, "adam_multi %s: %s", kiln_dtype_name(dt), kiln_last_error_message());
      double tol = dt == KILN_F64 ? 1e-12 : dt == KILN_F32 ? 1e-5 : 2e-2, worst = 0;
      for (int i = 0; i < NT && st == KILN_OK; i++) {
        double d = max_abs_diff(p[0][i], p[1][i]);
        d = fmax(d, max_abs_diff(m[0][i], m[1][i]));
        d = fmax(d, max_abs_diff(v[0][i], v[1][i]));
        d = fmax(d, max_abs_diff(x[0][i], x[1][i]));
        if (!(d <= worst)) worst = d;
        if (dev_step) CHECK(kiln_item(t[1][i]) == 3, "adam_multi: step_t %d advanced to 3 (got %g)", i, kiln_item(t[1][i]));
      }
      CHECK(worst <= tol, "adam_multi %s%s: cpu and cuda differ by %g", kiln_dtype_name(dt),
            dev_step ? " (device step)" : "", worst);
      kiln_generator_free(gen);
      kiln_scope_end();
    }
  }
}

/* kiln_mark on the GPU: device time between marks, in stream order; none inside a capture */
static kiln_status mark_step(void *p) {
  kiln_mark **out = p;
  *out = kiln_mark_record(kiln_device_cuda(0));
  return *out ? KILN_OK : kiln_last_error();
}

static void test_marks(kiln_device gpu) {
  kiln_scope_begin();
  kiln_tensor *a = kiln_randn(KILN_SHAPE(2048, 2048), KILN_F32, gpu, NULL);
  kiln_device_synchronize(gpu);
  kiln_mark *m0 = kiln_mark_record(gpu);
  kiln_tensor *p = a;
  for (int i = 0; i < 8; i++) p = kiln_matmul(p, a); /* about 140 GFLOP of exact f32 */
  kiln_mark *m1 = kiln_mark_record(gpu);
  CHECK(m0 && m1 && p, "marks around queued products");
  double ms = kiln_mark_elapsed_ms(m0, m1);
  CHECK(ms > 0.05 && ms < 10000, "device time of 8 products of 2048^2: %.3f ms", ms);
  kiln_mark *inside = NULL;
  kiln_clear_error();
  kiln_graph *g = kiln_graph_capture(gpu, mark_step, &inside);
  CHECK(g == NULL && inside == NULL && kiln_last_error() == KILN_ERR_STATE,
        "a mark inside a capture is KILN_ERR_STATE");
  kiln_graph_free(g);
  kiln_clear_error();
  kiln_mark *c = kiln_mark_record(gpu), *d = kiln_mark_record(kiln_device_cpu());
  CHECK(kiln_mark_elapsed_ms(c, d) == -1 && kiln_last_error() == KILN_ERR_DEVICE,
        "marks on two devices: -1 and KILN_ERR_DEVICE");
  kiln_scope_end();
}

int main(void) {
  const char *why = NULL;
  if (kiln_device_count(KILN_DEVICE_CUDA) == 0) {
    kiln_backend_available(KILN_DEVICE_CUDA, &why);
    printf("skipped: no CUDA device (%s)\n", why ? why : "?");
    return 77;
  }
  kiln_device gpu = kiln_device_cuda(0);
  kiln_device_info info;
  if (kiln_device_info_get(gpu, &info) == KILN_OK)
    printf("device: %s, sm_%d%d, %d SMs, %.1f GiB\n", info.name, info.compute_major,
           info.compute_minor, info.multiprocessors, (double)info.total_memory / (1 << 30));
  test_devices(gpu);
  test_fallback(gpu);
  test_oom_recovery(gpu);
  test_graphs(gpu);
  test_graph_dependencies(gpu);
  test_adam_multi(gpu);
  test_to_device_many(gpu);
  test_marks(gpu);
  printf("%d passed, %d failed\n", checks - failures, failures);
  return failures ? 1 : 0;
}
