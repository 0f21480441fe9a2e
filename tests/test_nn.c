/* kiln_nn: modules, parameters, init statistics, state dicts and their errors, moves,
** counting and the summary. CPU only; every check names what it proves. */
#include <kiln.h>
#include <kiln_io.h>
#include <kiln_nn.h>
#include <kiln_optim.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "tensor_cmp.h"

static kiln_device cpu;

/* PyTorch's rule for nn.Linear: kaiming_uniform(a=sqrt(5)) gives W ~ U(-1/sqrt(in),
** 1/sqrt(in)); the bias has the same bound. Checks the bound, the mean and the variance
** (b^2/3) of a large layer, and that the draws come from the given generator. */
static void test_linear_init(void) {
  kiln_scope_begin();
  kiln_generator *g = kiln_generator_new(123);
  const int64_t in = 64, out = 512;
  kiln_module *lin = kiln_linear_new(in, out, true, KILN_F32, cpu, g);
  CHECK(lin != NULL);
  kiln_tensor *w = kiln_module_param(lin, "weight"), *b = kiln_module_param(lin, "bias");
  CHECK(w && b && kiln_ndim(w) == 2 && kiln_size(w, 0) == out && kiln_size(w, 1) == in);
  CHECK(kiln_requires_grad(w) && kiln_requires_grad(b) && kiln_is_leaf(w));
  double bound = 1.0 / sqrt((double)in);
  double *wv = host_f64(w);
  int64_t n = kiln_numel(w);
  double mean = 0, var = 0, mx = 0;
  bool inside = true;
  for (int64_t i = 0; i < n; i++) {
    mean += wv[i];
    if (fabs(wv[i]) > bound) inside = false;
    if (fabs(wv[i]) > mx) mx = fabs(wv[i]);
  }
  mean /= (double)n;
  for (int64_t i = 0; i < n; i++) var += (wv[i] - mean) * (wv[i] - mean);
  var /= (double)(n - 1);
  CHECK(inside);
  CHECK(mx > 0.99 * bound); /* the whole interval is used */
  /* std of the mean: bound / sqrt(3 n) ~ 5e-4; 5 sigma */
  CHECK(fabs(mean) < 5 * bound / sqrt(3.0 * (double)n));
  /* relative sd of a sample variance of a uniform: sqrt(0.8 / n) ~ 0.5 %; allow 3 % */
  CHECK(fabs(var / (bound * bound / 3.0) - 1.0) < 0.03);
  double *bv = host_f64(b);
  bool binside = true;
  for (int64_t i = 0; i < out; i++) binside &= fabs(bv[i]) <= bound;
  CHECK(binside);

  /* Same seed, same draws; the weight is drawn before the bias. */
  kiln_generator_seed(g, 123);
  kiln_module *lin2 = kiln_linear_new(in, out, true, KILN_F32, cpu, g);
  CHECK(bits_equal(w, kiln_module_param(lin2, "weight")));
  CHECK(bits_equal(b, kiln_module_param(lin2, "bias")));
  kiln_generator_seed(g, 123);
  kiln_tensor *ref = kiln_empty(KILN_SHAPE(out, in), KILN_F32, cpu);
  kiln_uniform_(ref, -bound, bound, g);
  CHECK(bits_equal(w, ref));
  /* The global generator when gen is NULL. */
  kiln_manual_seed(7);
  kiln_module *l3 = kiln_linear_new(4, 3, true, KILN_F32, cpu, NULL);
  kiln_manual_seed(7);
  kiln_module *l4 = kiln_linear_new(4, 3, true, KILN_F32, cpu, NULL);
  CHECK(bits_equal(kiln_module_param(l3, "weight"), kiln_module_param(l4, "weight")));
  /* No bias. */
  kiln_module *nb = kiln_linear_new(4, 3, false, KILN_F32, cpu, NULL);
  CHECK(kiln_module_param(nb, "bias") == NULL && kiln_module_num_params(nb) == 12);
  free(wv);
  free(bv);
  kiln_module_free(lin);
  kiln_module_free(lin2);
  kiln_module_free(l3);
  kiln_module_free(l4);
  kiln_module_free(nb);
  kiln_generator_free(g);
  kiln_scope_end();
}

/* Linear forward equals x W^T + b computed by hand in double. */
static void test_linear_forward(void) {
  kiln_scope_begin();
  kiln_generator *g = kiln_generator_new(5);
  kiln_module *lin = kiln_linear_new(3, 4, true, KILN_F32, cpu, g);
  kiln_tensor *x = kiln_randn(KILN_SHAPE(5, 3), KILN_F32, cpu, g);
  kiln_tensor *y = kiln_module_forward(lin, x);
  CHECK(y && kiln_ndim(y) == 2 && kiln_size(y, 0) == 5 && kiln_size(y, 1) == 4);
  double *xv = host_f64(x), *wv = host_f64(kiln_module_param(lin, "weight")),
         *bv = host_f64(kiln_module_param(lin, "bias")), *yv = host_f64(y);
  double maxerr = 0;
  for (int i = 0; i < 5; i++)
    for (int o = 0; o < 4; o++) {
      double s = bv[o];
      for (int k = 0; k < 3; k++) s += xv[i * 3 + k] * wv[o * 3 + k];
      maxerr = fmax(maxerr, fabs(s - yv[i * 4 + o]));
    }
  CHECK(maxerr < 1e-5);
  /* Gradients reach the parameters. */
  CHECK(kiln_backward(kiln_sum_all(y), NULL) == KILN_OK);
  CHECK(kiln_grad(kiln_module_param(lin, "weight")) != NULL);
  CHECK(kiln_module_grad_bytes(lin) == (12 + 4) * 4);
  /* NULL input: NULL out, last error untouched. */
  kiln_set_error(KILN_ERR_SHAPE, "earlier failure");
  CHECK(kiln_module_forward(lin, NULL) == NULL && kiln_last_error() == KILN_ERR_SHAPE);
  kiln_clear_error();
  free(xv);
  free(wv);
  free(bv);
  free(yv);
  kiln_module_free(lin);
  kiln_generator_free(g);
  kiln_scope_end();
}

static kiln_module *mlp(uint64_t seed) {
  kiln_generator *g = kiln_generator_new(seed);
  kiln_module *seq = kiln_sequential_new();
  kiln_sequential_append(seq, kiln_linear_new(3, 4, true, KILN_F32, cpu, g));
  kiln_sequential_append(seq, kiln_relu_new());
  kiln_sequential_append(seq, kiln_linear_new(4, 2, true, KILN_F32, cpu, g));
  kiln_generator_free(g);
  return seq;
}

/* A Sequential runs Linear then ReLU as kiln_linear_relu: the same output and the same
** gradients as the two ops written out, bit for bit on the CPU. */
static void test_sequential_fuses_linear_relu(void) {
  kiln_scope_begin();
  kiln_module *seq = mlp(17);
  kiln_generator *g = kiln_generator_new(3);
  kiln_tensor *x = kiln_randn(KILN_SHAPE(6, 3), KILN_F32, cpu, g);
  kiln_tensor *y = kiln_module_forward(seq, x);
  kiln_tensor *w0 = kiln_module_param(seq, "0.weight"), *b0 = kiln_module_param(seq, "0.bias");
  kiln_tensor *w2 = kiln_module_param(seq, "2.weight"), *b2 = kiln_module_param(seq, "2.bias");
  kiln_tensor *h = kiln_linear(x, w0, b0);
  kiln_tensor *y2 = kiln_linear(kiln_relu(h), w2, b2);
  CHECK(y && y2 && bits_equal(y, y2));
  kiln_tensor *grads[4];
  CHECK(kiln_backward(kiln_sum_all(kiln_mul(y, y)), NULL) == KILN_OK);
  kiln_tensor *ps[4] = {w0, b0, w2, b2};
  for (int i = 0; i < 4; i++) grads[i] = kiln_tensor_ref(kiln_grad(ps[i]));
  for (int i = 0; i < 4; i++) kiln_set_grad(ps[i], NULL);
  CHECK(kiln_backward(kiln_sum_all(kiln_mul(y2, y2)), NULL) == KILN_OK);
  for (int i = 0; i < 4; i++) {
    CHECK(grads[i] && kiln_grad(ps[i]) && bits_equal(grads[i], kiln_grad(ps[i])));
    kiln_tensor_free(grads[i]);
  }
  kiln_generator_free(g);
  kiln_module_free(seq);
  kiln_scope_end();
}

/* A Sequential runs ReLU then MaxPool2d as kiln_relu_max_pool2d, and Conv2d of one input
** channel, ReLU, MaxPool2d as kiln_conv2d_relu_max_pool2d: the same output and gradients as
** the ops written out, bit for bit, in f32 and bf16 (fmnist-cnn's pools: 2x2 on 26x26 and,
** odd, on 11x11), and in f32 less kept for backward (the pooled output and a byte per
** output instead of the ReLU's input and the pool's), which shows a fused op ran. */
static void test_sequential_fuses_relu_max_pool(void) {
  const int64_t k3[2] = {3, 3}, k2[2] = {2, 2};
  const int64_t hw[2] = {28, 13};
  const kiln_dtype dts[3] = {KILN_F32, KILN_BF16, KILN_F32};
  /* t 4, 5: one input channel in f32, where Conv2d, ReLU, MaxPool2d run as one op */
  for (int t = 0; t < 6; t++) {
    kiln_scope_begin();
    kiln_dtype dt = dts[t / 2];
    int64_t cin = t >= 4 ? 1 : 2;
    kiln_manual_seed(5 + (uint64_t)t);
    kiln_module *conv = kiln_conv2d_new(cin, 4, k3, NULL, NULL, NULL, 1, true, dt, cpu, NULL);
    kiln_module *seq = kiln_sequential_of(3, (kiln_module *[]){conv, kiln_relu_new(), kiln_max_pool2d_new(k2, NULL, NULL, NULL)});
    kiln_generator *g = kiln_generator_new(7);
    kiln_tensor *x = kiln_to_dtype(kiln_randn(KILN_SHAPE(3, cin, hw[t % 2], hw[t % 2]), KILN_F32, cpu, g), dt);
    int64_t s0 = 0, s1 = 0, s2 = 0;
    kiln_autograd_saved_bytes(&s0, NULL);
    kiln_tensor *y = kiln_module_forward(seq, x);
    kiln_autograd_saved_bytes(&s1, NULL);
    kiln_tensor *w = kiln_module_param(seq, "0.weight"), *b = kiln_module_param(seq, "0.bias");
    kiln_tensor *y2 = kiln_max_pool2d(kiln_relu(kiln_module_forward(conv, x)), k2, NULL, NULL, NULL, NULL);
    kiln_autograd_saved_bytes(&s2, NULL);
    CHECK(y && y2 && bits_equal(y, y2));
    if (dt == KILN_F32) CHECK(s1 - s0 < s2 - s1); /* bf16 takes the ops apart (kiln_relu_max_pool2d) */
    kiln_tensor *gw = NULL, *gb = NULL;
    CHECK(kiln_backward(kiln_sum_all(kiln_mul(y, y)), NULL) == KILN_OK);
    gw = kiln_tensor_ref(kiln_grad(w)), gb = kiln_tensor_ref(kiln_grad(b));
    kiln_set_grad(w, NULL), kiln_set_grad(b, NULL);
    CHECK(kiln_backward(kiln_sum_all(kiln_mul(y2, y2)), NULL) == KILN_OK);
    CHECK(gw && kiln_grad(w) && bits_equal(gw, kiln_grad(w)));
    CHECK(gb && kiln_grad(b) && bits_equal(gb, kiln_grad(b)));
    kiln_tensor_free(gw), kiln_tensor_free(gb);
    kiln_generator_free(g);
    kiln_module_free(seq);
    kiln_scope_end();
  }
}

/* Sequential names children "0", "1", ...; parameters come in a stable order with
** dotted names; lookups reach into children. */
static void test_sequential_naming(void) {
  kiln_module *seq = mlp(1);
  CHECK(kiln_module_num_children(seq) == 3);
  CHECK(!strcmp(kiln_module_child_name(seq, 1), "1"));
  CHECK(!strcmp(kiln_module_type_name(kiln_module_child(seq, "1")), "ReLU"));
  const char *names[8];
  kiln_tensor *ps[8];
  int n = kiln_module_named_parameters(seq, names, ps, 8);
  CHECK(n == 4);
  const char *want[] = {"0.weight", "0.bias", "2.weight", "2.bias"};
  for (int i = 0; i < 4 && i < n; i++) {
    CHECK(!strcmp(names[i], want[i]));
    CHECK(kiln_module_param(seq, want[i]) == ps[i]);
  }
  CHECK(kiln_module_param(seq, "1.weight") == NULL && kiln_module_param(seq, "9.bias") == NULL);
  CHECK(kiln_module_parameters(seq, NULL, 0) == 4);
  kiln_tensor *two[2];
  CHECK(kiln_module_parameters(seq, two, 2) == 4 && two[1] == ps[1]);
  /* Forward chains the children. */
  kiln_scope_begin();
  kiln_tensor *x = kiln_ones(KILN_SHAPE(2, 3), KILN_F32, cpu);
  kiln_tensor *y = kiln_module_forward(seq, x);
  kiln_tensor *ref = kiln_linear(kiln_relu(kiln_linear(x, ps[0], ps[1])), ps[2], ps[3]);
  CHECK(y && bits_equal(y, ref));
  kiln_scope_end();
  /* An empty Sequential is the identity; sequential_of builds the same tree. */
  kiln_module *e = kiln_sequential_new();
  kiln_scope_begin();
  kiln_tensor *z = kiln_module_forward(e, kiln_ones(KILN_SHAPE(2), KILN_F32, cpu));
  CHECK(z && kiln_numel(z) == 2);
  kiln_scope_end();
  kiln_module *kids[2] = {kiln_identity_new(), kiln_tanh_new()};
  kiln_module *of = kiln_sequential_of(2, kids);
  CHECK(of && kiln_module_num_children(of) == 2 &&
        !strcmp(kiln_module_type_name(kiln_module_child(of, "1")), "Tanh"));
  /* Appending a failed constructor's NULL keeps that error. */
  CHECK(kiln_sequential_append(of, kiln_dropout_new(2.0, NULL)) == KILN_ERR_INVALID_ARGUMENT);
  CHECK(kiln_module_num_children(of) == 2);
  kiln_module_free(of);
  kiln_module_free(e);
  kiln_module_free(seq);
}

/* train/eval is recursive, and Dropout follows it. */
static void test_train_eval(void) {
  kiln_module *seq = kiln_sequential_new();
  kiln_sequential_append(seq, kiln_dropout_new(0.5, NULL));
  kiln_module *inner = kiln_sequential_new();
  kiln_sequential_append(inner, kiln_dropout_new(0.5, NULL));
  kiln_sequential_append(seq, inner);
  CHECK(kiln_module_is_training(seq) && kiln_module_is_training(kiln_module_child(seq, "1.0")));
  kiln_module_eval(seq);
  CHECK(!kiln_module_is_training(seq) && !kiln_module_is_training(kiln_module_child(seq, "1.0")));
  kiln_scope_begin();
  kiln_tensor *x = kiln_ones(KILN_SHAPE(1000), KILN_F32, cpu);
  CHECK(bits_equal(kiln_module_forward(seq, x), x));
  kiln_module_train(seq, true);
  CHECK(kiln_module_is_training(kiln_module_child(seq, "1.0")));
  kiln_tensor *y = kiln_module_forward(kiln_module_child(seq, "0"), x);
  double *v = host_f64(y);
  int zeros = 0, twos = 0;
  for (int i = 0; i < 1000; i++) {
    zeros += v[i] == 0.0;
    twos += v[i] == 2.0;
  }
  CHECK(zeros + twos == 1000 && zeros > 400 && zeros < 600);
  free(v);
  kiln_scope_end();
  kiln_module_free(seq);
}

/* state_dict then load_state_dict copies values into another model (handles unchanged). */
static void test_state_dict_round_trip(void) {
  kiln_module *a = mlp(1), *b = mlp(2);
  kiln_tensor *bw = kiln_module_param(b, "0.weight");
  CHECK(!bits_equal(kiln_module_param(a, "0.weight"), bw));
  kiln_dict *sd = kiln_module_state_dict(a);
  CHECK(sd && kiln_dict_size(sd) == 4 && !strcmp(kiln_dict_key(sd, 2), "2.weight"));
  CHECK(kiln_dict_get(sd, "0.bias") == kiln_module_param(a, "0.bias")); /* shared, not copied */
  CHECK(kiln_module_load_state_dict(b, sd, true) == KILN_OK);
  CHECK(kiln_module_param(b, "0.weight") == bw);
  const char *names[4];
  kiln_tensor *pa[4], *pb[4];
  kiln_module_named_parameters(a, names, pa, 4);
  kiln_module_parameters(b, pb, 4);
  for (int i = 0; i < 4; i++) CHECK(bits_equal(pa[i], pb[i]));
  /* Through a file. */
  const char *path = "test_nn_sd.safetensors";
  CHECK(kiln_safetensors_save(path, sd) == KILN_OK);
  kiln_module *c = mlp(3);
  kiln_dict *back = kiln_safetensors_load(path, cpu);
  CHECK(back && kiln_module_load_state_dict(c, back, true) == KILN_OK);
  CHECK(bits_equal(kiln_module_param(c, "2.weight"), pa[2]));
  remove(path);
  kiln_dict_free(back);
  kiln_dict_free(sd);
  kiln_module_free(a);
  kiln_module_free(b);
  kiln_module_free(c);
}

static kiln_dict *copy_without(const kiln_dict *d, const char *skip) {
  kiln_dict *o = kiln_dict_new();
  for (int i = 0; i < kiln_dict_size(d); i++)
    if (!skip || strcmp(kiln_dict_key(d, i), skip)) kiln_dict_set(o, kiln_dict_key(d, i), kiln_dict_value(d, i));
  return o;
}

/* Each kind of state-dict problem gives a clear error listing the keys, and a failed
** load changes nothing. */
static void test_state_dict_errors(void) {
  kiln_module *a = mlp(1), *b = mlp(2);
  kiln_dict *sd = kiln_module_state_dict(a);
  kiln_tensor *before = kiln_keep(kiln_clone(kiln_module_param(b, "0.weight")));

  kiln_dict *miss = copy_without(sd, "2.bias");
  CHECK(kiln_module_load_state_dict(b, miss, true) == KILN_ERR_INVALID_ARGUMENT);
  CHECK(strstr(kiln_last_error_message(), "1 missing key: 2.bias") != NULL);
  CHECK(bits_equal(kiln_module_param(b, "0.weight"), before)); /* nothing copied */
  CHECK(kiln_module_load_state_dict(b, miss, false) == KILN_OK); /* not strict: fine */
  CHECK(bits_equal(kiln_module_param(b, "0.weight"), kiln_module_param(a, "0.weight")));

  kiln_dict *unexp = copy_without(sd, NULL);
  kiln_tensor *extra = kiln_keep(kiln_zeros(KILN_SHAPE(3), KILN_F32, cpu));
  kiln_dict_set(unexp, "3.weight", extra);
  kiln_dict_set(unexp, "head.bias", extra);
  CHECK(kiln_module_load_state_dict(b, unexp, true) == KILN_ERR_INVALID_ARGUMENT);
  CHECK(strstr(kiln_last_error_message(), "2 unexpected keys: 3.weight, head.bias") != NULL);
  CHECK(kiln_module_load_state_dict(b, unexp, false) == KILN_OK);

  kiln_dict *shape = copy_without(sd, NULL);
  kiln_tensor *wrong = kiln_keep(kiln_zeros(KILN_SHAPE(4, 2), KILN_F32, cpu));
  kiln_dict_set(shape, "0.weight", wrong);
  kiln_tensor *keep_b = kiln_keep(kiln_clone(kiln_module_param(b, "2.weight")));
  CHECK(kiln_module_load_state_dict(b, shape, true) == KILN_ERR_SHAPE);
  CHECK(strstr(kiln_last_error_message(), "0.weight: shape [4, 2] in the state dict, [4, 3] in the model"));
  CHECK(kiln_module_load_state_dict(b, shape, false) == KILN_ERR_SHAPE); /* always checked */
  CHECK(bits_equal(kiln_module_param(b, "2.weight"), keep_b));

  kiln_dict *dt = copy_without(sd, NULL);
  kiln_tensor *f64 = kiln_keep(kiln_zeros(KILN_SHAPE(2), KILN_F64, cpu));
  kiln_dict_set(dt, "2.bias", f64);
  CHECK(kiln_module_load_state_dict(b, dt, true) == KILN_ERR_DTYPE);
  CHECK(strstr(kiln_last_error_message(), "2.bias: dtype float64") != NULL);

  /* All problems at once, all named. */
  kiln_dict *all = copy_without(sd, "0.bias");
  kiln_dict_set(all, "0.weight", wrong);
  kiln_dict_set(all, "bogus", extra);
  CHECK(kiln_module_load_state_dict(b, all, true) != KILN_OK);
  const char *msg = kiln_last_error_message();
  CHECK(strstr(msg, "0.bias") && strstr(msg, "bogus") && strstr(msg, "0.weight"));

  kiln_dict_free(miss);
  kiln_dict_free(unexp);
  kiln_dict_free(shape);
  kiln_dict_free(dt);
  kiln_dict_free(all);
  kiln_dict_free(sd);
  kiln_tensor_free(extra);
  kiln_tensor_free(wrong);
  kiln_tensor_free(f64);
  kiln_tensor_free(before);
  kiln_tensor_free(keep_b);
  kiln_module_free(a);
  kiln_module_free(b);
}

/* A user-defined module: children, an own parameter, a buffer, a frozen parameter. */
typedef struct block {
  double scale;
} block;

static kiln_tensor *block_forward(kiln_module *m, kiln_tensor *x) {
  block *b = kiln_module_impl(m);
  kiln_tensor *h = kiln_module_forward(kiln_module_child(m, "fc1"), x);
  h = kiln_gelu(h);
  h = kiln_module_forward(kiln_module_child(m, "fc2"), h);
  h = kiln_mul(h, kiln_module_param(m, "gain"));
  return kiln_mul_scalar(h, b->scale);
}

static int block_repr(const kiln_module *m, char *buf, size_t n) {
  return snprintf(buf, n, "scale=%g", ((block *)kiln_module_impl(m))->scale);
}

static const kiln_module_vtable block_vt = {"Block", block_forward, NULL, free, block_repr};

static kiln_module *block_new(void) {
  block *b = malloc(sizeof *b);
  b->scale = 0.5;
  kiln_module *m = kiln_module_new(&block_vt, b);
  kiln_module_add_child(m, "fc1", kiln_linear_new(3, 8, true, KILN_F32, cpu, NULL));
  kiln_module_add_child(m, "fc2", kiln_linear_new(8, 2, false, KILN_F32, cpu, NULL));
  kiln_module_register_parameter(m, "gain", kiln_ones(KILN_SHAPE(2), KILN_F32, cpu), true);
  kiln_module_register_parameter(m, "frozen", kiln_ones(KILN_SHAPE(5), KILN_F32, cpu), false);
  kiln_module_register_buffer(m, "running", kiln_zeros(KILN_SHAPE(2), KILN_F32, cpu), true);
  kiln_module_register_buffer(m, "scratch", kiln_zeros(KILN_SHAPE(7), KILN_F32, cpu), false);
  return m;
}

static void test_user_module_and_counting(void) {
  int64_t live = kiln_live_tensors();
  kiln_scope_begin(); /* register_parameter takes tensors out of this scope */
  kiln_module *m = block_new();
  kiln_scope_end();
  CHECK(m != NULL);
  const char *names[16];
  int n = kiln_module_named_parameters(m, names, NULL, 16);
  CHECK(n == 5);
  CHECK(n == 5 && !strcmp(names[0], "gain") && !strcmp(names[1], "frozen") && !strcmp(names[2], "fc1.weight") &&
        !strcmp(names[4], "fc2.weight"));
  /* 2 + 5 + 24 + 8 + 16 */
  CHECK(kiln_module_num_params(m) == 55);
  CHECK(kiln_module_num_trainable_params(m) == 50);
  CHECK(kiln_module_param_bytes(m) == 55 * 4);
  CHECK(kiln_module_buffer_bytes(m) == 9 * 4);
  CHECK(kiln_module_grad_bytes(m) == 0);
  kiln_dict *sd = kiln_module_state_dict(m);
  CHECK(kiln_dict_size(sd) == 6 && kiln_dict_get(sd, "running") && !kiln_dict_get(sd, "scratch"));
  kiln_dict_free(sd);
  const char *bn[4];
  CHECK(kiln_module_named_buffers(m, bn, NULL, 4) == 2 && !strcmp(bn[1], "scratch"));

  kiln_scope_begin();
  kiln_tensor *y = kiln_module_forward(m, kiln_ones(KILN_SHAPE(4, 3), KILN_F32, cpu));
  CHECK(y && kiln_size(y, 1) == 2);
  CHECK(kiln_backward(kiln_sum_all(y), NULL) == KILN_OK);
  CHECK(kiln_module_grad_bytes(m) == 50 * 4); /* the frozen one has none */
  kiln_scope_end();

  /* Registration errors. */
  kiln_scope_begin();
  CHECK(kiln_module_register_parameter(m, "a.b", kiln_ones(KILN_SHAPE(1), KILN_F32, cpu), true) ==
        KILN_ERR_INVALID_ARGUMENT);
  CHECK(kiln_module_register_parameter(m, "gain", kiln_ones(KILN_SHAPE(1), KILN_F32, cpu), true) ==
        KILN_ERR_INVALID_ARGUMENT);
  CHECK(strstr(kiln_last_error_message(), "already") != NULL);
  CHECK(kiln_module_register_parameter(m, "ints", kiln_zeros(KILN_SHAPE(1), KILN_I64, cpu), true) ==
        KILN_ERR_DTYPE);
  kiln_tensor *leaf = kiln_ones(KILN_SHAPE(2), KILN_F32, cpu);
  kiln_requires_grad_(leaf, true);
  CHECK(kiln_module_register_parameter(m, "nonleaf", kiln_mul_scalar(leaf, 2.0), true) == KILN_ERR_AUTOGRAD);
  CHECK(kiln_module_add_child(m, "fc1", kiln_relu_new()) == KILN_ERR_INVALID_ARGUMENT);
  kiln_scope_end();
  CHECK(kiln_module_num_params(m) == 55);

  /* Tied weights: the same tensor in two places counts once. */
  kiln_module *tied = kiln_sequential_new();
  kiln_sequential_append(tied, kiln_linear_new(2, 2, false, KILN_F32, cpu, NULL));
  kiln_module *id = kiln_identity_new();
  kiln_module_register_parameter(id, "w", kiln_tensor_ref(kiln_module_param(tied, "0.weight")), true);
  kiln_sequential_append(tied, id);
  CHECK(kiln_module_parameters(tied, NULL, 0) == 1 && kiln_module_num_params(tied) == 4);
  kiln_dict *tsd = kiln_module_state_dict(tied);
  CHECK(kiln_dict_size(tsd) == 2); /* like PyTorch, both names are in the state dict */
  kiln_dict_free(tsd);
  kiln_module_free(tied);
  kiln_module_free(m);
  CHECK(kiln_live_tensors() == live); /* everything released */
}

/* kiln_module_to_dtype replaces the handles, keeps values and requires_grad, moves
** gradients; a module optimizer follows, a list optimizer built afterwards works. */
static void test_moves(void) {
  kiln_module *m = mlp(4);
  kiln_tensor *w0 = kiln_module_param(m, "0.weight");
  CHECK(kiln_module_to(m, cpu) == KILN_OK);
  CHECK(kiln_module_param(m, "0.weight") == w0); /* nothing to move: same handle */
  double *before = host_f64(w0);
  kiln_optim_config cfg = kiln_sgd_config(0.1);
  cfg.momentum = 0.9;
  kiln_optimizer *opt = kiln_optimizer_new_module(&cfg, m);
  kiln_scope_begin();
  kiln_tensor *x = kiln_ones(KILN_SHAPE(2, 3), KILN_F32, cpu);
  kiln_backward(kiln_sum_all(kiln_module_forward(m, x)), NULL);
  CHECK(kiln_optimizer_step(opt) == KILN_OK);
  kiln_scope_end();
  CHECK(kiln_module_to_dtype(m, KILN_F64) == KILN_OK);
  kiln_tensor *w1 = kiln_module_param(m, "0.weight");
  CHECK(w1 != w0 && kiln_dtype_of(w1) == KILN_F64 && kiln_requires_grad(w1) && kiln_is_leaf(w1));
  CHECK(kiln_grad(w1) && kiln_dtype_of(kiln_grad(w1)) == KILN_F64);
  CHECK(kiln_optimizer_param(opt, 0) == w1);
  kiln_scope_begin();
  kiln_optimizer_zero_grad(opt);
  kiln_tensor *x64 = kiln_ones(KILN_SHAPE(2, 3), KILN_F64, cpu);
  CHECK(kiln_backward(kiln_sum_all(kiln_module_forward(m, x64)), NULL) == KILN_OK);
  CHECK(kiln_optimizer_step(opt) == KILN_OK);
  kiln_scope_end();
  double *after = host_f64(w1);
  CHECK(after[0] != before[0]);
  CHECK(kiln_optimizer_state_bytes(opt) == 26 * 8); /* momentum buffers now f64 */
  CHECK(kiln_module_to_dtype(m, KILN_I32) == KILN_ERR_DTYPE);
  free(before);
  free(after);
  kiln_optimizer_free(opt);
  kiln_module_free(m);
}

/* Each activation module equals its op; Flatten and Identity shapes. */
static void test_activations(void) {
  kiln_scope_begin();
  kiln_tensor *x = kiln_randn(KILN_SHAPE(2, 3, 4), KILN_F32, cpu, NULL);
  struct {
    kiln_module *m;
    kiln_tensor *want;
  } cases[] = {
      {kiln_relu_new(), kiln_relu(x)},
      {kiln_leaky_relu_new(0.2), kiln_leaky_relu(x, 0.2)},
      {kiln_gelu_new(KILN_GELU_EXACT), kiln_gelu(x)},
      {kiln_gelu_new(KILN_GELU_TANH), kiln_gelu_tanh(x)},
      {kiln_silu_new(), kiln_silu(x)},
      {kiln_sigmoid_new(), kiln_sigmoid(x)},
      {kiln_tanh_new(), kiln_tanh(x)},
      {kiln_softplus_new(2.0, 10.0), kiln_softplus(x, 2.0, 10.0)},
      {kiln_identity_new(), x},
      {kiln_flatten_new(1, -1), kiln_flatten(x, 1, -1)},
      {kiln_flatten_new(0, 1), kiln_flatten(x, 0, 1)},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    kiln_tensor *y = kiln_module_forward(cases[i].m, x);
    CHECK(y && kiln_ndim(y) == kiln_ndim(cases[i].want) && bits_equal(y, cases[i].want));
    kiln_module_free(cases[i].m);
  }
  kiln_module *f = kiln_flatten_new(1, -1);
  kiln_tensor *y = kiln_module_forward(f, x);
  CHECK(kiln_ndim(y) == 2 && kiln_size(y, 1) == 12);
  kiln_module_free(f);
  CHECK(kiln_gelu_new((kiln_gelu_approx)7) == NULL && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT);
  CHECK(kiln_dropout_new(-0.1, NULL) == NULL);
  CHECK(kiln_linear_new(-1, 2, true, KILN_F32, cpu, NULL) == NULL);
  CHECK(kiln_linear_new(1, 2, true, KILN_I32, cpu, NULL) == NULL && kiln_last_error() == KILN_ERR_DTYPE);
  kiln_scope_end();
}

/* The summary names layers, shapes, counts and byte totals. */
static void test_summary(void) {
  kiln_module *m = kiln_sequential_new();
  kiln_sequential_append(m, kiln_linear_new(3, 4, true, KILN_F32, cpu, NULL));
  kiln_sequential_append(m, kiln_relu_new());
  kiln_sequential_append(m, block_new());
  FILE *f = tmpfile();
  CHECK(kiln_module_summary(f, m) == KILN_OK);
  long len = ftell(f);
  rewind(f);
  char *buf = calloc(1, (size_t)len + 1);
  CHECK(fread(buf, 1, (size_t)len, f) == (size_t)len);
  fclose(f);
  CHECK(strstr(buf, "Linear(in_features=3, out_features=4, bias=true)") != NULL);
  CHECK(strstr(buf, "0.weight") && strstr(buf, "[4, 3]") && strstr(buf, "float32"));
  CHECK(strstr(buf, "2.fc1.weight") && strstr(buf, "Block(scale=0.5)"));
  CHECK(strstr(buf, "(frozen)") != NULL);
  CHECK(strstr(buf, "parameters: 71 (trainable 66, frozen 5)") != NULL);
  CHECK(strstr(buf, "weights: 284 B") != NULL);
  CHECK(strstr(buf, "device: cpu") != NULL);
  if (getenv("KILN_TEST_VERBOSE")) fputs(buf, stdout);
  free(buf);
  char b[32];
  CHECK(!strcmp(kiln_format_bytes(1536, b, sizeof b), "1.50 KiB"));
  CHECK(!strcmp(kiln_format_bytes(3 * 1024 * 1024, b, sizeof b), "3.00 MiB"));
  kiln_module_free(m);
}

int main(void) {
  cpu = kiln_device_cpu();
  test_linear_init();
  test_linear_forward();
  test_sequential_naming();
  test_sequential_fuses_linear_relu();
  test_sequential_fuses_relu_max_pool();
  test_train_eval();
  test_state_dict_round_trip();
  test_state_dict_errors();
  test_user_module_and_counting();
  test_moves();
  test_activations();
  test_summary();
  kiln_module_free(NULL);
  return check_finish("test_nn");
}
