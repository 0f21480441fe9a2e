/*
** Reductions, softmax, losses and dropout on the one op path: what the path added to
** them. A trace names each op with its typed attributes (dim, keepdim, correction,
** reduction, ...); composites (var, mse_loss, dropout) show as one op; max_dim is one op
** of two outputs whose indices never require grad; eval-mode dropout hands back its input
** and is no op.
*/
#include "check.h"

#include <math.h>
#include <string.h>

static const kiln_attr *attr(const kiln_trace_op *op, const char *name) {
  for (int a = 0; op && a < op->n_attrs; a++)
    if (strcmp(op->attrs[a].name, name) == 0) return &op->attrs[a];
  return NULL;
}

static kiln_tensor *data_2x3(void) {
  const float v[] = {1, 5, 2, 7, 3, 7};
  return kiln_from_data(v, KILN_SHAPE(2, 3), KILN_F32, kiln_device_cpu());
}

/* Each op once at depth 0, with the record's attributes by name. */
static void trace_names_attributes(void) {
  kiln_scope_begin();
  kiln_tensor *x = data_2x3();
  const int64_t tv[] = {2, 0};
  kiln_tensor *target = kiln_from_data(tv, KILN_SHAPE(2), KILN_I64, kiln_device_cpu());
  kiln_trace *tr = kiln_trace_begin();
  CHECK(tr != NULL);
  kiln_tensor *s = kiln_sum(x, 1, (const int[]){-1}, true);
  kiln_tensor *v = kiln_var(x, 1, (const int[]){0}, 0, false);
  kiln_tensor *idx = NULL;
  kiln_tensor *m = kiln_max_dim(x, 1, false, &idx);
  kiln_tensor *sm = kiln_log_softmax(x, 1);
  kiln_tensor *ce = kiln_cross_entropy(x, target, KILN_REDUCTION_SUM, -100, 0.25);
  kiln_tensor *mse = kiln_mse_loss(x, x, KILN_REDUCTION_NONE);
  kiln_tensor *d = kiln_dropout(x, 0.5, false, NULL); /* the input itself, not traced */
  kiln_tensor *dt = kiln_dropout(x, 0.5, true, NULL);
  CHECK(kiln_trace_end(tr) == KILN_OK);
  CHECK(d == x && dt && dt != x);
  CHECK(s && v && m && idx && sm && ce && mse && d);
  /* composites' parts (var's mean, sub, ...) are at depth 1: not in the trace */
  CHECK(kiln_trace_count(tr) == 7);
  const char *names[] = {"sum", "var", "max_dim", "log_softmax", "cross_entropy", "mse_loss", "dropout"};
  for (int i = 0; i < 7 && i < kiln_trace_count(tr); i++) CHECK(strcmp(kiln_trace_get(tr, i)->name, names[i]) == 0);

  const kiln_trace_op *op = kiln_trace_get(tr, 0);
  const kiln_attr *a = attr(op, "dim");
  CHECK(a && a->type == KILN_ATTR_INTS && a->n == 1 && a->ints[0] == -1);
  a = attr(op, "keepdim");
  CHECK(a && a->type == KILN_ATTR_BOOL && a->i == 1);
  CHECK(op && op->n_outputs == 1 && op->outputs[0] == kiln_tensor_id(s));

  op = kiln_trace_get(tr, 1);
  a = attr(op, "correction");
  CHECK(a && a->type == KILN_ATTR_INT && a->i == 0);
  CHECK(op && op->n_attrs == 3 && op->outputs[0] == kiln_tensor_id(v));

  op = kiln_trace_get(tr, 2); /* (values, indices) */
  CHECK(op && op->n_outputs == 2 && op->outputs[0] == kiln_tensor_id(m) && op->outputs[1] == kiln_tensor_id(idx));
  a = attr(op, "dim");
  CHECK(a && a->type == KILN_ATTR_INT && a->i == 1);

  a = attr(kiln_trace_get(tr, 3), "dim");
  CHECK(a && a->i == 1);

  op = kiln_trace_get(tr, 4);
  CHECK(op && op->n_inputs == 2 && op->inputs[1] == kiln_tensor_id(target));
  a = attr(op, "reduction");
  CHECK(a && a->type == KILN_ATTR_STRING && a->s && strcmp(a->s, "sum") == 0);
  a = attr(op, "ignore_index");
  CHECK(a && a->i == -100);
  a = attr(op, "label_smoothing");
  CHECK(a && a->f == 0.25);

  a = attr(kiln_trace_get(tr, 5), "reduction");
  CHECK(a && a->s && strcmp(a->s, "none") == 0);

  op = kiln_trace_get(tr, 6); /* the mask's product (mul) is at depth 1 */
  CHECK(op && op->n_outputs == 1 && op->outputs[0] == kiln_tensor_id(dt));
  a = attr(op, "p");
  CHECK(a && a->f == 0.5);
  a = attr(op, "train");
  CHECK(a && a->type == KILN_ATTR_BOOL && a->i == 1);
  CHECK(op && op->n_attrs == 2); /* the generator is not an attribute */
  kiln_trace_free(tr);
  kiln_scope_end();
}

/* max_dim records one node for the values; the indices stay plain integers. */
static void max_dim_indices_need_no_grad(void) {
  kiln_scope_begin();
  kiln_tensor *x = data_2x3();
  CHECK(kiln_requires_grad_(x, true) == KILN_OK);
  kiln_tensor *idx = NULL;
  kiln_tensor *m = kiln_max_dim(x, 1, false, &idx);
  CHECK(m && idx);
  CHECK(kiln_grad_fn_name(m) && strcmp(kiln_grad_fn_name(m), "max_dim") == 0);
  CHECK(!kiln_requires_grad(idx) && kiln_grad_fn_name(idx) == NULL);
  CHECK(kiln_backward(kiln_sum_all(m), NULL) == KILN_OK);
  float g[6] = {0};
  CHECK(kiln_grad(x) && kiln_to_host(kiln_grad(x), g, sizeof g) == KILN_OK);
  const float want[6] = {0, 1, 0, 1, 0, 0}; /* first index on ties */
  CHECK(memcmp(g, want, sizeof g) == 0);
  int64_t iv[2] = {0};
  CHECK(kiln_to_host(idx, iv, sizeof iv) == KILN_OK && iv[0] == 1 && iv[1] == 0);
  /* the argmax family gives the indices alone, never recorded */
  kiln_tensor *am = kiln_argmax(x, 1, false);
  CHECK(am && !kiln_requires_grad(am) && kiln_grad_fn_name(am) == NULL);
  kiln_scope_end();
}

/* The rules read typed attributes: a keepdim=false mean over two dims of three and a
** softmax along dim 0 differentiate as before. */
static void rules_read_attributes(void) {
  kiln_scope_begin();
  kiln_tensor *x = kiln_arange(0, 24, 1, KILN_F32, kiln_device_cpu());
  x = kiln_reshape(x, KILN_SHAPE(2, 3, 4));
  x = kiln_clone(x);
  CHECK(kiln_requires_grad_(x, true) == KILN_OK);
  kiln_tensor *mn = kiln_mean(x, 2, (const int[]){-1, 0}, false); /* (3) */
  CHECK(mn && kiln_ndim(mn) == 1 && kiln_grad_fn_name(mn) && strcmp(kiln_grad_fn_name(mn), "mean") == 0);
  CHECK(kiln_backward(kiln_sum_all(mn), NULL) == KILN_OK);
  float g[24];
  CHECK(kiln_to_host(kiln_grad(x), g, sizeof g) == KILN_OK);
  bool ok = true;
  for (int i = 0; i < 24; i++) ok = ok && g[i] == 1.0f / 8.0f;
  CHECK(ok);
  kiln_scope_end();
}

/* Eval mode skips the path only for arguments it would accept: the others get infer's
** error, as in training. */
static void dropout_eval_checks_arguments(void) {
  kiln_scope_begin();
  kiln_tensor *x = data_2x3();
  kiln_tensor *i = kiln_to_dtype(x, KILN_I32);
  CHECK(kiln_dropout(x, 1.5, false, NULL) == NULL && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT);
  CHECK(kiln_dropout(i, 0.5, false, NULL) == NULL && kiln_last_error() == KILN_ERR_DTYPE);
  CHECK(kiln_dropout(i, 0.0, true, NULL) == NULL && kiln_last_error() == KILN_ERR_DTYPE);
  kiln_clear_error();
  kiln_scope_end();
}

int main(void) {
  trace_names_attributes();
  dropout_eval_checks_arguments();
  max_dim_indices_need_no_grad();
  rules_read_attributes();
  if (failures) fprintf(stderr, "test_ops_reduce_path: %d failed checks\n", failures);
  return failures ? 1 : 0;
}
