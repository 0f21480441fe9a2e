/*
** Gradient checkpointing (kiln_checkpoint): on the CPU the gradients are the bits of the
** run without it, with dropout inside (the generator is restored for the recompute),
** under kiln_backward and kiln_autograd_grad, nested, under autocast, with an explicit
** generator; the forward keeps no activations; grad mode off just runs; the bad inputs.
** The recompute's skip of a last linear or add (its output is not needed by the backward):
** the same bits, the skip counted, none where the output is read, and a recompute that
** takes another path run again in full.
*/
#define _POSIX_C_SOURCE 200809L /* setenv */
#include "check.h"
#include "tensor_cmp.h"

#include <kiln_nn.h>

#include <stdlib.h>
#include <string.h>

#include "core/kiln_int.h" /* checkpoint.c's counters */

static const kiln_device CPU = {KILN_DEVICE_CPU, 0};

/* How the second layer ends: tanh (no skip), a linear or a residual-like add (skipped), a
** linear whose output fn also reads (not skipped), or a linear in the forward and a
** product of it in the recomputes (the skip does not hold: run again in full). */
enum tail { TAIL_TANH, TAIL_LINEAR, TAIL_ADD, TAIL_READ, TAIL_SWITCH };

typedef struct net {
  kiln_tensor *w1, *b1, *w2;
  kiln_generator *gen; /* NULL: the global one */
  bool nested;         /* the second layer is a checkpoint of its own */
  enum tail tail;
  int calls;           /* of layer2 (TAIL_SWITCH) */
} net;

static kiln_tensor *param(int64_t r, int64_t c, uint64_t seed) {
  kiln_generator *g = kiln_generator_new(seed);
  kiln_tensor *w = kiln_keep(kiln_randn(KILN_SHAPE(r, c), KILN_F32, CPU, g));
  kiln_generator_free(g);
  kiln_requires_grad_(w, true);
  return w;
}

static kiln_status layer2(void *ctx, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)n_in;
  (void)n_out;
  net *m = ctx;
  kiln_tensor *t = kiln_linear(kiln_dropout(in[0], 0.3, true, m->gen), m->w2, NULL);
  switch (m->tail) {
  case TAIL_TANH: out[0] = kiln_tanh(t); break;
  case TAIL_LINEAR: out[0] = t; break;
  case TAIL_ADD: out[0] = kiln_add(t, kiln_linear(in[0], m->w2, NULL)); break;
  case TAIL_READ: out[0] = kiln_sum_all(t) ? t : NULL; break;
  case TAIL_SWITCH: out[0] = m->calls++ == 0 ? t : kiln_mul(t, t); break;
  }
  return out[0] ? KILN_OK : kiln_last_error();
}

/* (B, 6) -> (B, 4): dropout(relu(x W1^T + b1)) W2^T, then tanh */
static kiln_status block(void *ctx, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  net *m = ctx;
  kiln_tensor *h = kiln_relu(kiln_linear(in[0], m->w1, kiln_view(m->b1, KILN_SHAPE(8))));
  if (m->nested) return kiln_checkpoint_ex(layer2, m, m->gen ? 1 : 0, &m->gen, 1, &h, n_out, out);
  return layer2(ctx, n_in, &h, n_out, out);
}

static kiln_tensor *loss_of(kiln_tensor *y) { return kiln_mean_all(kiln_mul(y, y)); }

typedef struct grads {
  kiln_tensor *loss, *w1, *b1, *w2, *x;
} grads;

/* One step, checkpointed or not: the loss and the gradients (kept), from seed 11. */
static grads run(net *m, bool ckpt, bool autocast) {
  grads r;
  kiln_scope_begin();
  kiln_manual_seed(11);
  if (m->gen) kiln_generator_seed(m->gen, 11);
  kiln_tensor *x = kiln_randn(KILN_SHAPE(5, 6), KILN_F32, CPU, NULL);
  kiln_requires_grad_(x, true);
  kiln_tensor *y = NULL;
  if (autocast) kiln_autocast_begin(KILN_DEVICE_CPU, KILN_BF16);
  if (ckpt) {
    CHECK(kiln_checkpoint_ex(block, m, m->gen ? 1 : 0, &m->gen, 1, &x, 1, &y) == KILN_OK);
    CHECK(kiln_grad_fn_name(y) && strcmp(kiln_grad_fn_name(y), "checkpoint") == 0);
  } else CHECK(block(m, 1, &x, 1, &y) == KILN_OK);
  kiln_tensor *loss = loss_of(y);
  if (autocast) kiln_autocast_end();
  kiln_set_grad(m->w1, NULL);
  kiln_set_grad(m->b1, NULL);
  kiln_set_grad(m->w2, NULL);
  CHECK(kiln_backward(loss, NULL) == KILN_OK);
  r.loss = kiln_keep(kiln_clone(loss));
  r.w1 = kiln_keep(kiln_clone(kiln_grad(m->w1)));
  r.b1 = kiln_keep(kiln_clone(kiln_grad(m->b1)));
  r.w2 = kiln_keep(kiln_clone(kiln_grad(m->w2)));
  r.x = kiln_keep(kiln_clone(kiln_grad(x)));
  kiln_scope_end();
  return r;
}

static void grads_free(grads *g) {
  kiln_tensor_free(g->loss);
  kiln_tensor_free(g->w1);
  kiln_tensor_free(g->b1);
  kiln_tensor_free(g->w2);
  kiln_tensor_free(g->x);
}

static void expect_same(net *m, bool autocast) {
  grads a = run(m, false, autocast), b = run(m, true, autocast);
  CHECK(bits_equal(a.loss, b.loss));
  CHECK(bits_equal(a.w1, b.w1));
  CHECK(bits_equal(a.b1, b.b1));
  CHECK(bits_equal(a.w2, b.w2));
  CHECK(bits_equal(a.x, b.x));
  grads_free(&a);
  grads_free(&b);
}

static net make_net(void) {
  net m = {param(8, 6, 1), param(1, 8, 2), param(4, 8, 3), NULL, false, TAIL_TANH, 0};
  return m;
}
static void free_net(net *m) {
  kiln_tensor_free(m->w1);
  kiln_tensor_free(m->b1);
  kiln_tensor_free(m->w2);
}

static void test_bit_identical_with_dropout(void) {
  net m = make_net();
  expect_same(&m, false);
  free_net(&m);
}

static void test_nested(void) {
  net m = make_net();
  m.nested = true;
  expect_same(&m, false);
  free_net(&m);
}

static void test_under_autocast(void) {
  net m = make_net();
  expect_same(&m, true);
  m.nested = true;
  expect_same(&m, true);
  free_net(&m);
}

/* An explicit generator is restored for the recompute and left as it was after. */
static void test_explicit_generator(void) {
  net m = make_net();
  m.gen = kiln_generator_new(5);
  expect_same(&m, false);
  kiln_scope_begin();
  kiln_tensor *x = kiln_randn(KILN_SHAPE(5, 6), KILN_F32, CPU, NULL), *y = NULL;
  CHECK(kiln_checkpoint_ex(block, &m, 1, &m.gen, 1, &x, 1, &y) == KILN_OK);
  uint64_t s0, o0, s1, o1, gs0, go0, gs1, go1;
  kiln_generator_get_state(m.gen, &s0, &o0);
  kiln_generator_get_state(kiln_generator_global(), &gs0, &go0);
  CHECK(kiln_backward(loss_of(y), NULL) == KILN_OK);
  kiln_generator_get_state(m.gen, &s1, &o1);
  kiln_generator_get_state(kiln_generator_global(), &gs1, &go1);
  CHECK(s0 == s1 && o0 == o1 && gs0 == gs1 && go0 == go1);
  kiln_scope_end();
  kiln_generator_free(m.gen);
  free_net(&m);
}

/* kiln_autograd_grad through a checkpoint: the same gradients, and no .grad written. */
static void test_autograd_grad(void) {
  net m = make_net();
  kiln_tensor *res[2][4];
  for (int c = 0; c < 2; c++) {
    kiln_scope_begin();
    kiln_manual_seed(3);
    kiln_tensor *x = kiln_randn(KILN_SHAPE(5, 6), KILN_F32, CPU, NULL), *y = NULL;
    kiln_requires_grad_(x, true);
    if (c) CHECK(kiln_checkpoint(block, &m, 1, &x, 1, &y) == KILN_OK);
    else CHECK(block(&m, 1, &x, 1, &y) == KILN_OK);
    kiln_tensor *loss = loss_of(y);
    kiln_tensor *wrt[4] = {m.w1, m.b1, m.w2, x}, *g[4] = {NULL};
    CHECK(kiln_autograd_grad(1, &loss, NULL, 4, wrt, g) == KILN_OK);
    for (int k = 0; k < 4; k++) res[c][k] = kiln_keep(g[k]);
    CHECK(!kiln_grad(m.w1) && !kiln_grad(m.w2) && !kiln_grad(x));
    kiln_scope_end();
  }
  for (int k = 0; k < 4; k++) {
    CHECK(bits_equal(res[0][k], res[1][k]));
    kiln_tensor_free(res[0][k]);
    kiln_tensor_free(res[1][k]);
  }
  free_net(&m);
}

/* The forward keeps only the outputs: fewer live tensors than the plain forward. */
static void test_keeps_no_activations(void) {
  net m = make_net();
  kiln_scope_begin();
  kiln_tensor *x = kiln_randn(KILN_SHAPE(5, 6), KILN_F32, CPU, NULL), *y = NULL;
  int64_t before = kiln_live_tensors();
  CHECK(kiln_checkpoint(block, &m, 1, &x, 1, &y) == KILN_OK);
  int64_t with = kiln_live_tensors() - before;
  before = kiln_live_tensors();
  CHECK(block(&m, 1, &x, 1, &y) == KILN_OK);
  int64_t without = kiln_live_tensors() - before;
  CHECK(with < without);
  CHECK(with <= 2); /* the output and its alias on the node */
  kiln_scope_end();
  free_net(&m);
}

/* Grad mode off: fn just runs, nothing is recorded. */
static void test_no_grad_just_runs(void) {
  net m = make_net();
  kiln_scope_begin();
  kiln_tensor *x = kiln_randn(KILN_SHAPE(5, 6), KILN_F32, CPU, NULL), *y = NULL;
  bool prev = kiln_set_grad_enabled(false);
  CHECK(kiln_checkpoint(block, &m, 1, &x, 1, &y) == KILN_OK);
  kiln_set_grad_enabled(prev);
  CHECK(y && !kiln_requires_grad(y) && kiln_grad_fn_name(y) == NULL);
  kiln_scope_end();
  free_net(&m);
}

static kiln_status returns_nothing(void *ctx, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)ctx;
  (void)n_in;
  (void)in;
  (void)n_out;
  (void)out;
  return KILN_OK;
}
static kiln_status fails(void *ctx, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)ctx;
  (void)n_in;
  (void)n_out;
  out[0] = kiln_relu(in[0]);
  return kiln_set_error(KILN_ERR_SHAPE, "fails: on purpose");
}

static void test_bad_inputs(void) {
  kiln_scope_begin();
  int64_t live0 = kiln_live_tensors();
  kiln_tensor *x = kiln_ones(KILN_SHAPE(2), KILN_F32, CPU), *y = (kiln_tensor *)&y;
  kiln_requires_grad_(x, true);
  CHECK(kiln_checkpoint(returns_nothing, NULL, 1, &x, 1, &y) == KILN_ERR_INVALID_ARGUMENT);
  CHECK(y == NULL && strstr(kiln_last_error_message(), "no tensor") != NULL);
  CHECK(kiln_checkpoint(fails, NULL, 1, &x, 1, &y) == KILN_ERR_SHAPE && y == NULL);
  CHECK(strstr(kiln_last_error_message(), "on purpose") != NULL);
  CHECK(kiln_checkpoint(NULL, NULL, 1, &x, 1, &y) == KILN_ERR_INVALID_ARGUMENT);
  CHECK(kiln_checkpoint(block, NULL, 1, &x, 0, &y) == KILN_ERR_INVALID_ARGUMENT);
  kiln_tensor *none = NULL;
  kiln_clear_error();
  CHECK(kiln_checkpoint(block, NULL, 1, &none, 1, &y) == KILN_ERR_INVALID_ARGUMENT);
  CHECK(kiln_live_tensors() == live0 + 1);
  kiln_clear_error();
  kiln_scope_end();
}

/* nn: a Sequential marked to checkpoint each block gives the same gradients. */
static void test_nn_sequential(void) {
  kiln_tensor *g[2][4] = {{NULL}};
  for (int c = 0; c < 2; c++) {
    kiln_generator *gen = kiln_generator_new(9);
    kiln_module *seq = kiln_sequential_new();
    kiln_sequential_append(seq, kiln_linear_new(6, 8, true, KILN_F32, CPU, gen));
    kiln_sequential_append(seq, kiln_relu_new());
    kiln_sequential_append(seq, kiln_dropout_new(0.25, NULL));
    kiln_sequential_append(seq, kiln_linear_new(8, 3, true, KILN_F32, CPU, gen));
    kiln_generator_free(gen);
    if (c) CHECK(kiln_module_set_checkpoint(seq, true) == KILN_OK);
    kiln_scope_begin();
    kiln_manual_seed(4);
    kiln_tensor *x = kiln_randn(KILN_SHAPE(5, 6), KILN_F32, CPU, NULL);
    kiln_tensor *loss = loss_of(kiln_module_forward(seq, x));
    int64_t s0 = kiln__checkpoint_skipped();
    CHECK(kiln_backward(loss, NULL) == KILN_OK);
    CHECK(kiln__checkpoint_skipped() - s0 == 2 * c); /* each Linear's product (a segment each) */
    kiln_tensor *ps[4];
    CHECK(kiln_module_parameters(seq, ps, 4) == 4);
    for (int k = 0; k < 4; k++) g[c][k] = kiln_keep(kiln_clone(kiln_grad(ps[k])));
    kiln_scope_end();
    kiln_module_free(seq);
  }
  for (int k = 0; k < 4; k++) {
    CHECK(bits_equal(g[0][k], g[1][k]));
    kiln_tensor_free(g[0][k]);
    kiln_tensor_free(g[1][k]);
  }
}

/* A max pool inside a checkpoint (ResNet's stem): the recompute, which runs inside the
** backward, keeps the pool's indices instead of recomputing them in the pool's rule; the
** gradient is the bits of the run without the checkpoint, overlapping windows and ties
** included (the indices name the same pixels). */
static kiln_status pool_seg(void *ctx, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)ctx, (void)n_in, (void)n_out;
  static const int64_t k3[2] = {3, 3}, s2[2] = {2, 2}, p1[2] = {1, 1};
  out[0] = kiln_max_pool2d(kiln_relu(in[0]), k3, s2, p1, NULL, NULL);
  return out[0] ? KILN_OK : kiln_last_error();
}

static void test_max_pool_inside(void) {
  kiln_tensor *g[2] = {NULL, NULL};
  for (int c = 0; c < 2; c++) {
    kiln_scope_begin();
    kiln_generator *gen = kiln_generator_new(5);
    /* rounded to quarters: ties inside windows */
    kiln_tensor *x = kiln_mul_scalar(kiln_to_dtype(kiln_randint(-8, 8, KILN_SHAPE(2, 3, 9, 10), KILN_I64, CPU, gen),
                                                   KILN_F32), 0.25);
    kiln_generator_free(gen);
    kiln_requires_grad_(x, true);
    kiln_tensor *y = NULL;
    if (c) CHECK(kiln_checkpoint(pool_seg, NULL, 1, &x, 1, &y) == KILN_OK);
    else CHECK(pool_seg(NULL, 1, &x, 1, &y) == KILN_OK);
    CHECK(kiln_backward(kiln_sum_all(kiln_mul(y, y)), NULL) == KILN_OK);
    g[c] = kiln_keep(kiln_clone(kiln_grad(x)));
    kiln_scope_end();
  }
  CHECK(g[0] && g[1] && bits_equal(g[0], g[1]));
  kiln_tensor_free(g[0]);
  kiln_tensor_free(g[1]);
}

/* The skip: a last linear or add is made without kernels in the recompute, the gradients
** the bits of the run without the checkpoint (under autocast and nested too), and of the
** run with KILN_CHECKPOINT_ELIDE=0. */
static void test_skips_the_last_op(void) {
  for (int tail = TAIL_LINEAR; tail <= TAIL_READ; tail++)
    for (int variant = 0; variant < 3; variant++) {
      net m = make_net();
      m.tail = (enum tail)tail;
      m.nested = variant == 2;
      int64_t s0 = kiln__checkpoint_skipped(), f0 = kiln__checkpoint_full_again();
      expect_same(&m, variant == 1);
      int64_t skipped = kiln__checkpoint_skipped() - s0;
      /* nested: the inner segment's in the plain run (block checkpoints its second layer
      ** either way); in the checkpointed one the outer's recompute skips the same call
      ** (the inner output is the outer's), then the inner's recompute does */
      CHECK(skipped == (tail == TAIL_READ ? 0 : variant == 2 ? 3 : 1));
      CHECK(kiln__checkpoint_full_again() == f0);
      setenv("KILN_CHECKPOINT_ELIDE", "0", 1);
      s0 = kiln__checkpoint_skipped();
      expect_same(&m, variant == 1);
      CHECK(kiln__checkpoint_skipped() == s0);
      unsetenv("KILN_CHECKPOINT_ELIDE");
      free_net(&m);
    }
}

/* A recompute that reads what it skipped (fn took another path than the forward's) is run
** again in full: the gradients those of a full recompute. */
static void test_skip_not_held(void) {
  grads g[2];
  for (int c = 0; c < 2; c++) {
    net m = make_net();
    m.tail = TAIL_SWITCH;
    if (c) setenv("KILN_CHECKPOINT_ELIDE", "0", 1);
    int64_t f0 = kiln__checkpoint_full_again(), s0 = kiln__checkpoint_skipped();
    g[c] = run(&m, true, false);
    CHECK(kiln__checkpoint_full_again() - f0 == (c ? 0 : 1));
    CHECK(kiln__checkpoint_skipped() - s0 == (c ? 0 : 1));
    unsetenv("KILN_CHECKPOINT_ELIDE");
    free_net(&m);
  }
  CHECK(bits_equal(g[0].w1, g[1].w1) && bits_equal(g[0].b1, g[1].b1));
  CHECK(bits_equal(g[0].w2, g[1].w2) && bits_equal(g[0].x, g[1].x));
  grads_free(&g[0]);
  grads_free(&g[1]);
}

/* Attention in a segment: without dropout the recompute takes the forward's output and
** log-sum-exp instead of running the attention again; with dropout it runs it, drawing the
** forward's mask. The gradients are the bits of the run without the checkpoint either way,
** and of the run with KILN_CHECKPOINT_ELIDE=0. */
typedef struct att_ctx {
  kiln_tensor *w;
  double p;
  bool direct; /* the segment's output is the attention's own */
} att_ctx;

static kiln_status att_seg(void *ctx, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)n_in, (void)n_out;
  att_ctx *a = ctx;
  kiln_tensor *x = in[0];
  kiln_tensor *y = kiln_scaled_dot_product_attention(kiln_mul(x, a->w), x, kiln_tanh(x), NULL, true, a->p, 0.0, NULL);
  out[0] = a->direct ? y : kiln_tanh(y);
  return out[0] ? KILN_OK : kiln_last_error();
}

static void test_attention_kept(void) {
  for (int drop = 0; drop < 3; drop++) {
    att_ctx a = {param(1, 4, 7), drop == 1 ? 0.25 : 0.0, drop == 2};
    kiln_tensor *g[3][2] = {{NULL}};
    for (int c = 0; c < 3; c++) { /* plain, checkpointed, checkpointed with ELIDE=0 */
      if (c == 2) setenv("KILN_CHECKPOINT_ELIDE", "0", 1);
      kiln_scope_begin();
      kiln_manual_seed(21);
      kiln_tensor *x = kiln_randn(KILN_SHAPE(2, 2, 8, 4), KILN_F32, CPU, NULL), *y = NULL;
      kiln_requires_grad_(x, true);
      int64_t t0 = kiln__checkpoint_taken();
      if (c) CHECK(kiln_checkpoint(att_seg, &a, 1, &x, 1, &y) == KILN_OK);
      else CHECK(att_seg(&a, 1, &x, 1, &y) == KILN_OK);
      kiln_set_grad(a.w, NULL);
      CHECK(kiln_backward(loss_of(y), NULL) == KILN_OK);
      CHECK(kiln__checkpoint_taken() - t0 == (c == 1 && a.p == 0 ? 1 : 0));
      /* the program's output keeps its node: the recompute took the kept result on a
      ** handle of its own (direct: that result is the output) */
      if (c) CHECK(kiln_grad_fn_name(y) && !strcmp(kiln_grad_fn_name(y), "checkpoint"));
      g[c][0] = kiln_keep(kiln_clone(kiln_grad(x)));
      g[c][1] = kiln_keep(kiln_clone(kiln_grad(a.w)));
      kiln_scope_end();
      unsetenv("KILN_CHECKPOINT_ELIDE");
    }
    for (int c = 1; c < 3; c++)
      for (int k = 0; k < 2; k++) CHECK(g[0][k] && g[c][k] && bits_equal(g[0][k], g[c][k]));
    for (int c = 0; c < 3; c++)
      for (int k = 0; k < 2; k++) kiln_tensor_free(g[c][k]);
    kiln_tensor_free(a.w);
  }
}

/* The kept results are handed to the recompute, not shared: a chain of checkpointed
** attentions peaks no higher with them than without them by more than what they are (an
** output and a log-sum-exp each). A reference the segment kept on a result the recompute's
** node took as its own output held that recompute's graph to the end of the backward. */
static void test_attention_kept_memory(void) {
  enum { N = 6 };
  att_ctx a = {param(1, 64, 7), 0.0, false};
  int64_t peak[2];
  for (int c = 0; c < 2; c++) {
    if (c) setenv("KILN_CHECKPOINT_ELIDE", "0", 1);
    kiln_scope_begin();
    kiln_manual_seed(5);
    kiln_tensor *x = kiln_randn(KILN_SHAPE(2, 4, 64, 64), KILN_F32, CPU, NULL);
    kiln_requires_grad_(x, true);
    kiln_tensor *y = x;
    for (int i = 0; i < N; i++) {
      kiln_tensor *in = y;
      CHECK(kiln_checkpoint(att_seg, &a, 1, &in, 1, &y) == KILN_OK);
    }
    kiln_tensor *loss = loss_of(y);
    kiln_memory_reset_peak(CPU);
    CHECK(kiln_backward(loss, NULL) == KILN_OK);
    kiln_memory_stats ms;
    CHECK(kiln_memory_stats_get(CPU, &ms) == KILN_OK);
    peak[c] = ms.peak_allocated;
    kiln_scope_end();
    unsetenv("KILN_CHECKPOINT_ELIDE");
  }
  const int64_t kept = N * (2 * 4 * 64 * 64 + 2 * 4 * 64) * 4; /* outputs and lse, f32 */
  if (peak[0] > peak[1] + kept)
    fprintf(stderr, "attention kept: backward peak %lld bytes against %lld recomputing\n", (long long)peak[0],
            (long long)peak[1]);
  CHECK(peak[0] <= peak[1] + kept);
  kiln_tensor_free(a.w);
}

/* Keeping products (KILN_CHECKPOINT_KEEP_PRODUCTS): the recompute takes each linear's and
** matmul's output from the forward, except the last op's (skipped, so not kept) and one fn
** wrote in place after making it (made again); the gradients are the bits of the run
** without the checkpoint, and the forward holds exactly the kept outputs beyond the
** default's. */
typedef struct prod_ctx {
  kiln_tensor *w1, *w2, *w3;
  bool in_place; /* scale the first product in place after it is made (grad mode off) */
} prod_ctx;

static kiln_status prod_seg(void *ctx, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)n_in, (void)n_out;
  prod_ctx *p = ctx;
  kiln_tensor *a = kiln_linear(in[0], p->w1, NULL); /* (B, 16) */
  if (a && p->in_place) { /* outside autograd, as kiln asks of an in-place write */
    bool prev = kiln_set_grad_enabled(false);
    kiln_status st = kiln_mul_scalar_(a, 0.5);
    kiln_set_grad_enabled(prev);
    if (st != KILN_OK) return st;
  }
  kiln_tensor *m = kiln_matmul(kiln_tanh(a), p->w2); /* (B, 16) x (16, 12) */
  out[0] = kiln_linear(kiln_tanh(m), p->w3, NULL);   /* the last op: skipped */
  return out[0] ? KILN_OK : kiln_last_error();
}

static void test_products_kept(void) {
  for (int variant = 0; variant < 3; variant++) { /* plain; under autocast; in place */
    prod_ctx p = {param(16, 10, 31), param(16, 12, 32), param(4, 12, 33), variant == 2};
    bool ac = variant == 1;
    kiln_tensor *g[4][4] = {{NULL}};
    int64_t live[4] = {0};
    for (int c = 0; c < 4; c++) { /* plain; default keep; products; products with ELIDE=0 */
      if (c == 3) setenv("KILN_CHECKPOINT_ELIDE", "0", 1);
      kiln_scope_begin();
      kiln_manual_seed(41);
      kiln_tensor *x = kiln_randn(KILN_SHAPE(64, 10), KILN_F32, CPU, NULL), *y = NULL;
      kiln_requires_grad_(x, true);
      if (ac) kiln_autocast_begin(KILN_DEVICE_CPU, KILN_BF16);
      int64_t t0 = kiln__checkpoint_taken(), s0 = kiln__checkpoint_skipped();
      kiln_memory_stats m0, m1;
      CHECK(kiln_memory_stats_get(CPU, &m0) == KILN_OK);
      const kiln_checkpoint_keep keep = c >= 2 ? KILN_CHECKPOINT_KEEP_PRODUCTS : KILN_CHECKPOINT_KEEP_DEFAULT;
      const kiln_checkpoint_options o = {0, NULL, keep};
      if (c) CHECK(kiln_checkpoint_with(prod_seg, &p, &o, 1, &x, 1, &y) == KILN_OK);
      else CHECK(prod_seg(&p, 1, &x, 1, &y) == KILN_OK);
      CHECK(kiln_memory_stats_get(CPU, &m1) == KILN_OK);
      live[c] = m1.allocated - m0.allocated;
      kiln_tensor *loss = loss_of(y);
      if (ac) kiln_autocast_end();
      kiln_set_grad(p.w1, NULL), kiln_set_grad(p.w2, NULL), kiln_set_grad(p.w3, NULL);
      CHECK(kiln_backward(loss, NULL) == KILN_OK);
      int64_t taken = kiln__checkpoint_taken() - t0, skipped = kiln__checkpoint_skipped() - s0;
      CHECK(taken == (c == 2 ? (p.in_place ? 1 : 2) : 0));
      CHECK(skipped == (c == 1 || c == 2 ? 1 : 0));
      if (c) CHECK(kiln_grad_fn_name(y) && !strcmp(kiln_grad_fn_name(y), "checkpoint"));
      g[c][0] = kiln_keep(kiln_clone(kiln_grad(x)));
      g[c][1] = kiln_keep(kiln_clone(kiln_grad(p.w1)));
      g[c][2] = kiln_keep(kiln_clone(kiln_grad(p.w2)));
      g[c][3] = kiln_keep(kiln_clone(kiln_grad(p.w3)));
      kiln_scope_end();
      unsetenv("KILN_CHECKPOINT_ELIDE");
    }
    for (int c = 1; c < 4; c++)
      for (int k = 0; k < 4; k++) CHECK(g[c][k] && bits_equal(g[0][k], g[c][k]));
    /* what the products' forward holds beyond the default's: the two kept outputs (64x16 and
    ** 64x12, bf16 under autocast); the last product's is let go */
    int64_t esz = ac ? 2 : 4, kept = (64 * 16 + 64 * 12) * esz;
    if (live[2] - live[1] != kept)
      fprintf(stderr, "products kept: %lld bytes held against %lld expected\n", (long long)(live[2] - live[1]),
              (long long)kept);
    CHECK(live[2] - live[1] == kept);
    for (int c = 0; c < 4; c++)
      for (int k = 0; k < 4; k++) kiln_tensor_free(g[c][k]);
    kiln_tensor_free(p.w1), kiln_tensor_free(p.w2), kiln_tensor_free(p.w3);
  }
  /* a keep policy that does not exist, for a segment or a module */
  kiln_tensor *x = kiln_keep(kiln_zeros(KILN_SHAPE(2, 10), KILN_F32, CPU)), *y = x; /* set NULL by the refusal */
  prod_ctx p = {NULL, NULL, NULL, false};
  const kiln_checkpoint_options bad = {0, NULL, (kiln_checkpoint_keep)7};
  CHECK(kiln_checkpoint_with(prod_seg, &p, &bad, 1, &x, 1, &y) == KILN_ERR_INVALID_ARGUMENT && !y);
  CHECK(strstr(kiln_last_error_message(), "keep"));
  kiln_module *lin = kiln_linear_new(10, 4, true, KILN_F32, CPU, NULL);
  CHECK(kiln_module_set_checkpoint_keep(lin, (kiln_checkpoint_keep)-1) == KILN_ERR_INVALID_ARGUMENT);
  CHECK(kiln_module_set_checkpoint_keep(NULL, KILN_CHECKPOINT_KEEP_PRODUCTS) == KILN_ERR_INVALID_ARGUMENT);
  CHECK(kiln_module_checkpoint_keep(lin) == KILN_CHECKPOINT_KEEP_DEFAULT);
  CHECK(kiln_module_set_checkpoint_keep(lin, KILN_CHECKPOINT_KEEP_PRODUCTS) == KILN_OK);
  CHECK(kiln_module_checkpoint_keep(lin) == KILN_CHECKPOINT_KEEP_PRODUCTS);
  kiln_module_free(lin);
  kiln_tensor_free(x);
  /* a Sequential's policy is its children's, as its checkpointing is */
  kiln_module *seq = kiln_sequential_new();
  kiln_sequential_append(seq, kiln_linear_new(6, 8, true, KILN_F32, CPU, NULL));
  kiln_sequential_append(seq, kiln_relu_new());
  CHECK(kiln_module_set_checkpoint_keep(seq, KILN_CHECKPOINT_KEEP_PRODUCTS) == KILN_OK);
  CHECK(kiln_module_checkpoint_keep(kiln_module_child_at(seq, 0)) == KILN_CHECKPOINT_KEEP_PRODUCTS);
  CHECK(kiln_module_checkpoint_keep(kiln_module_child_at(seq, 1)) == KILN_CHECKPOINT_KEEP_PRODUCTS);
  kiln_module_free(seq);
}

int main(void) {
  test_bit_identical_with_dropout();
  test_nested();
  test_under_autocast();
  test_explicit_generator();
  test_autograd_grad();
  test_keeps_no_activations();
  test_no_grad_just_runs();
  test_bad_inputs();
  test_nn_sequential();
  test_max_pool_inside();
  test_skips_the_last_op();
  test_skip_not_held();
  test_attention_kept();
  test_attention_kept_memory();
  test_products_kept();
  printf("test_checkpointing: %d failures\n", failures);
  return failures ? 1 : 0;
}
