/*
** Data-parallel training on the CPU over MPI (kiln_dist.h).
**
** Run directly (as ctest does), it checks the sampler rules and the NULL-group helpers in
** this process, then runs itself twice more: alone (MPI's singleton mode: a world of one)
** and under `mpirun -np 2`, and passes when both children pass. Under mpirun each rank:
**   - checks launch errors (wrong expected world size, a second kiln_dist_init),
**   - checks the collectives (scalars, tensors of several dtypes and layouts, broadcast),
**   - trains a small MLP data-parallel (its shard of a fixed data set through the shard
**     view and the loader, gradients averaged in several buckets, SGD with momentum and
**     Adam), while rank 0 trains the same model on the global batches in one process:
**     the final parameters agree within 1e-6 relative, and every rank's parameters are
**     bit-identical (checksums gathered),
**   - checks gradients that only some ranks have, and a model that differs across ranks.
** Skips (77) when kiln was built without MPI or mpirun is not on PATH.
*/
#define _POSIX_C_SOURCE 200809L
#include <kiln.h>
#include <kiln_data.h>
#include <kiln_dist.h>
#include <kiln_nn.h>
#include <kiln_optim.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"

#define N_SAMPLES 64
#define N_IN 5
#define N_HIDDEN 16
#define N_CLASSES 3
#define GLOBAL_BATCH 16
#define EPOCHS 2
#define DATA_SEED 5

/* A status call that must fail with code and say why. */
#define EXPECT_ST(expr, code, what)                                                       \
  do {                                                                                    \
    kiln_status st_ = (expr);                                                             \
    H_CHECK(st_ == (code) && kiln_last_error_message()[0], "%s: got %s (%s)", (what),     \
            kiln_error_name(st_), kiln_last_error_message());                            \
  } while (0)

static bool under_launcher(void) {
  return getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMIX_RANK") || getenv("PMI_RANK");
}

/* ---- checks that need no process group ------------------------------------------- */

static void test_shard_rules(void) {
  /* PyTorch's DistributedSampler: n 10, world 3 -> 4 each, padded from the start */
  H_CHECK(kiln_dist_shard_num_samples(10, 3, false) == 4, "ceil(10/3)");
  H_CHECK(kiln_dist_shard_num_samples(10, 3, true) == 3, "floor(10/3)");
  H_CHECK(kiln_dist_shard_num_samples(0, 3, false) == 0, "empty");
  H_CHECK(kiln_dist_shard_num_samples(-1, 3, false) == -1 &&
              kiln_last_error() == KILN_ERR_INVALID_ARGUMENT, "n < 0 refused");
  int64_t got[3][4];
  int seen[10] = {0};
  for (int r = 0; r < 3; r++) {
    H_CHECK(kiln_dist_shard_indices(10, r, 3, false, 0, 0, false, got[r]) == KILN_OK, "indices");
    for (int i = 0; i < 4; i++) seen[got[r][i]]++;
  }
  /* order 0..9 padded with 0, 1: rank r takes r, r+3, r+6, r+9 of 0..9,0,1 */
  H_CHECK(got[0][3] == 9 && got[1][3] == 0 && got[2][3] == 1, "padding repeats the start "
          "(got %lld %lld %lld)", (long long)got[0][3], (long long)got[1][3], (long long)got[2][3]);
  H_CHECK(seen[0] == 2 && seen[1] == 2 && seen[5] == 1, "each sample once but the padding");
  /* drop_last: disjoint, the tail of a shuffled order dropped */
  int64_t a[3][3];
  int hits[10] = {0};
  for (int r = 0; r < 3; r++) {
    kiln_dist_shard_indices(10, r, 3, true, 42, 3, true, a[r]);
    for (int i = 0; i < 3; i++) hits[a[r][i]]++;
  }
  int total = 0, dup = 0;
  for (int i = 0; i < 10; i++) total += hits[i], dup += hits[i] > 1;
  H_CHECK(total == 9 && dup == 0, "drop_last shards are disjoint (%d samples, %d repeated)", total, dup);
  /* the order changes with the epoch, and is the loader's own (a world of one) */
  int64_t e0[10], e1[10];
  kiln_dist_shard_indices(10, 0, 1, true, 42, 0, false, e0);
  kiln_dist_shard_indices(10, 0, 1, true, 42, 1, false, e1);
  H_CHECK(memcmp(e0, e1, sizeof e0) != 0, "a new order each epoch");
  kiln_generator *g = kiln_generator_new(42 + 1);
  kiln_scope_begin();
  kiln_tensor *perm = kiln_randperm(10, g);
  int64_t p[10];
  kiln_to_host(perm, p, sizeof p);
  kiln_scope_end();
  kiln_generator_free(g);
  H_CHECK(memcmp(p, e1, sizeof p) == 0, "order = kiln_randperm(seed + epoch)");
  EXPECT_ST(kiln_dist_shard_indices(10, 3, 3, false, 0, 0, false, got[0]),
               KILN_ERR_INVALID_ARGUMENT, "rank outside the world");
}

static void test_shard_dataset(void) {
  kiln_scope_begin();
  kiln_tensor *x = kiln_arange(0, 10, 1, KILN_F32, kiln_device_cpu());
  kiln_dataset *base = kiln_tensor_dataset_new(1, &x);
  kiln_dataset *sh = kiln_dist_shard_dataset(base, 1, 3, true, 9, false);
  H_CHECK(sh && kiln_dataset_len(sh) == 4, "shard length 4");
  int64_t want[4];
  for (uint64_t epoch = 0; epoch < 2; epoch++) {
    if (epoch) H_CHECK(kiln_dist_shard_set_epoch(sh, epoch) == KILN_OK, "set_epoch");
    kiln_dist_shard_indices(10, 1, 3, true, 9, epoch, false, want);
    kiln_loader_opts o = kiln_loader_opts_default();
    o.batch_size = 4;
    o.num_workers = 1;
    kiln_loader *l = kiln_loader_new(sh, &o);
    kiln_loader_epoch(l, epoch);
    kiln_tensor *b[1];
    H_CHECK(kiln_loader_next(l, b) == 1, "a batch");
    float v[4] = {0};
    kiln_to_host(b[0], v, sizeof v);
    bool ok = true;
    for (int i = 0; i < 4; i++) ok = ok && v[i] == (float)want[i];
    H_CHECK(ok, "epoch %d: the loader delivers the shard's samples in order", (int)epoch);
    kiln_loader_free(l);
  }
  EXPECT_ST(kiln_dist_shard_set_epoch(base, 1), KILN_ERR_INVALID_ARGUMENT, "not a shard");
  H_CHECK(!kiln_dist_shard_dataset(base, 3, 3, false, 0, false), "bad rank refused");
  kiln_dataset_free(sh);
  kiln_dataset_free(base);
  kiln_scope_end();
}

static void test_null_group(void) {
  H_CHECK(kiln_dist_rank(NULL) == 0 && kiln_dist_world_size(NULL) == 1 && kiln_dist_is_main(NULL),
          "NULL is a world of one");
  double v = 2.5;
  H_CHECK(kiln_dist_allreduce_scalar(NULL, &v, KILN_DIST_AVG) == KILN_OK && v == 2.5, "identity");
  H_CHECK(kiln_dist_barrier(NULL) == KILN_OK, "barrier");
  EXPECT_ST(kiln_dist_allreduce_scalar(NULL, NULL, KILN_DIST_SUM), KILN_ERR_INVALID_ARGUMENT,
               "NULL value");
}

/* ---- the model and the data ------------------------------------------------------ */

static kiln_module *make_mlp(uint64_t seed, int64_t hidden) {
  kiln_generator *g = kiln_generator_new(seed);
  kiln_module *net = kiln_sequential_new();
  kiln_sequential_append(net, kiln_linear_new(N_IN, hidden, true, KILN_F64, kiln_device_cpu(), g));
  kiln_sequential_append(net, kiln_relu_new());
  kiln_sequential_append(net, kiln_linear_new(hidden, N_CLASSES, true, KILN_F64, kiln_device_cpu(), g));
  kiln_generator_free(g);
  return net;
}

/* Sum and sum of squares of all parameters, weighted by position (order-sensitive). */
static double checksum(kiln_module *m) {
  kiln_tensor *ps[16];
  int n = kiln_module_parameters(m, ps, 16);
  double s = 0;
  for (int i = 0; i < n; i++) {
    int64_t k = 0;
    double *v = h_values(ps[i], &k);
    for (int64_t j = 0; j < k; j++) s += v[j] * (1.0 + 1e-3 * (double)(j + 31 * i));
    free(v);
  }
  return s;
}

/* Largest |a - b| over all parameters, relative to the largest |b|. */
static double max_rel_diff(kiln_module *a, kiln_module *b) {
  kiln_tensor *pa[16], *pb[16];
  int n = kiln_module_parameters(a, pa, 16);
  kiln_module_parameters(b, pb, 16);
  double worst = 0, scale = 0;
  for (int i = 0; i < n; i++) {
    int64_t k = 0;
    double *va = h_values(pa[i], &k), *vb = h_values(pb[i], &k);
    for (int64_t j = 0; j < k; j++) {
      worst = fmax(worst, fabs(va[j] - vb[j]));
      scale = fmax(scale, fabs(vb[j]));
    }
    free(va);
    free(vb);
  }
  return worst / (scale > 0 ? scale : 1);
}

static kiln_tensor *step_loss(kiln_module *net, kiln_tensor *x, kiln_tensor *y) {
  return kiln_cross_entropy(kiln_module_forward(net, x), y, KILN_REDUCTION_MEAN, -100, 0);
}

/* DDP training on this rank's shard vs one process on the global batches (rank 0). */
static void test_ddp_matches_single(kiln_dist *d, kiln_optim_config cfg, const char *name) {
  int rank = kiln_dist_rank(d), world = kiln_dist_world_size(d);
  kiln_generator *dg = kiln_generator_new(123); /* the same data on every rank */
  kiln_tensor *x = kiln_keep(kiln_randn(KILN_SHAPE(N_SAMPLES, N_IN), KILN_F64, kiln_device_cpu(), dg));
  kiln_tensor *y = kiln_keep(kiln_randint(0, N_CLASSES, KILN_SHAPE(N_SAMPLES), KILN_I64,
                                          kiln_device_cpu(), dg));
  kiln_generator_free(dg);
  kiln_dataset *ds = kiln_tensor_dataset_new(2, (kiln_tensor *[]){x, y});
  kiln_dataset *shard = kiln_dist_shard_dataset(ds, rank, world, true, DATA_SEED, false);

  /* each rank starts from other weights: the wrapper must broadcast rank 0's */
  kiln_module *net = make_mlp(7 + 100 * (uint64_t)rank, N_HIDDEN);
  kiln_ddp_opts dopt = kiln_ddp_opts_default();
  dopt.bucket_mb = 300.0 / 1048576.0; /* ~300 bytes: several buckets */
  kiln_ddp *ddp = kiln_ddp_new(d, net, &dopt);
  H_CHECK(ddp != NULL, "%s: kiln_ddp_new: %s", name, kiln_last_error_message());
  if (!ddp) return;
  H_CHECK(kiln_ddp_num_buckets(ddp) >= 3, "%s: %d buckets", name, kiln_ddp_num_buckets(ddp));
  int in_buckets = 0;
  for (int b = 0; b < kiln_ddp_num_buckets(ddp); b++) in_buckets += kiln_ddp_bucket_params(ddp, b);
  H_CHECK(in_buckets == 4, "%s: every parameter in one bucket (%d)", name, in_buckets);
  kiln_optimizer *opt = kiln_optimizer_new_module(&cfg, net);

  kiln_module *ref = rank == 0 ? make_mlp(7, N_HIDDEN) : NULL;
  kiln_optimizer *ref_opt = ref ? kiln_optimizer_new_module(&cfg, ref) : NULL;

  kiln_loader_opts lo = kiln_loader_opts_default();
  lo.batch_size = GLOBAL_BATCH / world;
  lo.num_workers = 1;
  kiln_loader *l = kiln_loader_new(shard, &lo);
  double worst_loss = 0;
  int steps = 0;
  for (uint64_t epoch = 0; epoch < EPOCHS; epoch++) {
    kiln_dist_shard_set_epoch(shard, epoch);
    kiln_loader_epoch(l, epoch);
    int64_t order[N_SAMPLES];
    kiln_dist_shard_indices(N_SAMPLES, 0, 1, true, DATA_SEED, epoch, false, order);
    for (int s = 0;; s++) {
      kiln_scope_begin();
      kiln_tensor *b[2];
      int r = kiln_loader_next(l, b);
      if (r != 1) {
        H_CHECK(r == 0, "%s: loader: %s", name, kiln_last_error_message());
        kiln_scope_end();
        break;
      }
      kiln_optimizer_zero_grad(opt);
      kiln_tensor *loss = step_loss(net, b[0], b[1]);
      kiln_status st = kiln_backward(loss, NULL);
      if (st == KILN_OK) st = kiln_ddp_sync_grads(ddp);
      if (st == KILN_OK) st = kiln_optimizer_step(opt);
      H_CHECK(st == KILN_OK, "%s: step: %s", name, kiln_last_error_message());
      double lv = kiln_item(loss);
      kiln_dist_allreduce_scalar(d, &lv, KILN_DIST_AVG);
      if (ref) {
        kiln_tensor *idx = kiln_from_data(order + s * GLOBAL_BATCH, KILN_SHAPE(GLOBAL_BATCH),
                                          KILN_I64, kiln_device_cpu());
        kiln_optimizer_zero_grad(ref_opt);
        kiln_tensor *rl = step_loss(ref, kiln_index_select(x, 0, idx), kiln_index_select(y, 0, idx));
        kiln_backward(rl, NULL);
        kiln_optimizer_step(ref_opt);
        worst_loss = fmax(worst_loss, fabs(kiln_item(rl) - lv) / fabs(kiln_item(rl)));
      }
      steps++;
      kiln_scope_end();
    }
  }
  H_CHECK(steps == EPOCHS * N_SAMPLES / GLOBAL_BATCH, "%s: %d steps", name, steps);
  if (ref) {
    double rel = max_rel_diff(net, ref);
    H_CHECK(rel <= 1e-6, "%s: parameters vs one process on the global batch: rel diff %.3g", name, rel);
    H_CHECK(worst_loss <= 1e-9, "%s: averaged loss vs one process: rel diff %.3g", name, worst_loss);
  }
  double sums[8];
  kiln_dist_allgather_scalar(d, checksum(net), sums);
  bool same = true;
  for (int r = 1; r < world; r++) same = same && sums[r] == sums[0];
  H_CHECK(same, "%s: parameters bit-identical on every rank (%.17g vs %.17g)", name, sums[0],
          sums[world - 1]);

  kiln_loader_free(l);
  kiln_optimizer_free(ref_opt);
  kiln_module_free(ref);
  kiln_optimizer_free(opt);
  kiln_ddp_free(ddp);
  kiln_module_free(net);
  kiln_dataset_free(shard);
  kiln_dataset_free(ds);
  kiln_tensor_free(x);
  kiln_tensor_free(y);
}

/* ---- collectives ----------------------------------------------------------------- */

static void test_collectives(kiln_dist *d) {
  int rank = kiln_dist_rank(d), world = kiln_dist_world_size(d);
  double v = rank + 1, want_sum = world * (world + 1) / 2.0;
  kiln_dist_allreduce_scalar(d, &v, KILN_DIST_SUM);
  H_CHECK(v == want_sum, "scalar sum %g", v);
  v = rank + 1;
  kiln_dist_allreduce_scalar(d, &v, KILN_DIST_AVG);
  H_CHECK(v == want_sum / world, "scalar avg %g", v);
  v = rank + 1;
  kiln_dist_allreduce_scalar(d, &v, KILN_DIST_MAX);
  H_CHECK(v == world, "scalar max %g", v);
  double all[8];
  kiln_dist_allgather_scalar(d, 10.0 * rank, all);
  H_CHECK(all[world - 1] == 10.0 * (world - 1), "allgather");

  kiln_scope_begin();
  const kiln_dtype dts[] = {KILN_F32, KILN_F64, KILN_F16, KILN_BF16};
  for (int i = 0; i < 4; i++) {
    kiln_tensor *t = kiln_full(KILN_SHAPE(3, 5), rank + 1, dts[i], kiln_device_cpu());
    H_CHECK(kiln_dist_allreduce(d, t, KILN_DIST_AVG) == KILN_OK, "allreduce %s: %s",
            kiln_dtype_name(dts[i]), kiln_last_error_message());
    double got = kiln_get(t, (int64_t[]){2, 4});
    H_CHECK(got == want_sum / world, "allreduce avg %s: %g", kiln_dtype_name(dts[i]), got);
  }
  /* a strided view: only its elements change */
  kiln_tensor *base = kiln_full(KILN_SHAPE(4, 6), rank + 1, KILN_F64, kiln_device_cpu());
  kiln_tensor *view = kiln_transpose(kiln_narrow(base, 1, 0, 3), 0, 1); /* (3, 4) strided */
  H_CHECK(kiln_dist_allreduce(d, view, KILN_DIST_SUM) == KILN_OK, "strided allreduce");
  H_CHECK(kiln_get(base, (int64_t[]){3, 2}) == want_sum && kiln_get(base, (int64_t[]){3, 3}) == rank + 1,
          "strided allreduce touches only the view");
  kiln_tensor *it = kiln_full(KILN_SHAPE(4), rank + 1, KILN_I64, kiln_device_cpu());
  H_CHECK(kiln_dist_allreduce(d, it, KILN_DIST_SUM) == KILN_OK && kiln_get(it, (int64_t[]){0}) == want_sum,
          "i64 sum");
  EXPECT_ST(kiln_dist_allreduce(d, it, KILN_DIST_AVG), KILN_ERR_DTYPE, "avg of integers");
  kiln_tensor *bt = kiln_full(KILN_SHAPE(2, 2), rank + 1, KILN_F16, kiln_device_cpu());
  H_CHECK(kiln_dist_broadcast(d, bt, world - 1) == KILN_OK && kiln_get(bt, (int64_t[]){1, 1}) == world,
          "broadcast from the last rank");
  EXPECT_ST(kiln_dist_broadcast(d, bt, world), KILN_ERR_INVALID_ARGUMENT, "root out of range");
  kiln_scope_end();
  H_CHECK(kiln_dist_barrier(d) == KILN_OK, "barrier");
  int printed = kiln_dist_printf(d, "test_dist_cpu: rank-0 line from a world of %d\n", world);
  H_CHECK(rank == 0 ? printed > 0 : printed == 0, "printf on rank 0 only");
}

/* ---- gradients only some ranks have; models that differ -------------------------- */

static kiln_tensor *ident_forward(kiln_module *m, kiln_tensor *x) {
  (void)m;
  return kiln_tensor_ref(x);
}
static const kiln_module_vtable two_params_vt = {"TwoParams", ident_forward, NULL, NULL, NULL};

static void test_partial_grads(kiln_dist *d) {
  int rank = kiln_dist_rank(d), world = kiln_dist_world_size(d);
  kiln_module *m = kiln_module_new(&two_params_vt, NULL);
  kiln_module_register_parameter(m, "a", kiln_zeros(KILN_SHAPE(3), KILN_F32, kiln_device_cpu()), true);
  kiln_module_register_parameter(m, "b", kiln_zeros(KILN_SHAPE(2), KILN_F32, kiln_device_cpu()), true);
  kiln_module_register_parameter(m, "frozen", kiln_zeros(KILN_SHAPE(2), KILN_F32, kiln_device_cpu()), false);
  kiln_ddp *ddp = kiln_ddp_new(d, m, NULL);
  H_CHECK(ddp && kiln_ddp_num_buckets(ddp) == 1, "one bucket for two parameters");
  kiln_tensor *a = kiln_module_param(m, "a"), *b = kiln_module_param(m, "b");
  kiln_scope_begin();
  if (rank == 0) kiln_set_grad(a, H_T(KILN_SHAPE(3), KILN_F32, 2, 4, 6));
  H_CHECK(kiln_ddp_sync_grads(ddp) == KILN_OK, "sync: %s", kiln_last_error_message());
  kiln_tensor *ga = kiln_grad(a);
  H_CHECK(ga && kiln_get(ga, (int64_t[]){2}) == 6.0 / world, "a rank without a gradient counts as zeros");
  H_CHECK(!kiln_grad(b), "no rank had one: none anywhere");
  H_CHECK(!kiln_grad(kiln_module_param(m, "frozen")), "frozen parameters untouched");
  kiln_scope_end();
  kiln_ddp_free(ddp);
  kiln_module_free(m);

  /* rank 1 builds a wider model: refused on every rank, nobody hangs */
  kiln_module *net = make_mlp(1, rank == 1 ? N_HIDDEN + 1 : N_HIDDEN);
  kiln_ddp *bad = kiln_ddp_new(d, net, NULL);
  H_CHECK(!bad && kiln_last_error() == KILN_ERR_STATE, "different models refused (%s)",
          kiln_last_error_message());
  kiln_ddp_free(bad);
  kiln_module_free(net);
}

/* ---- the processes --------------------------------------------------------------- */

static int run_rank(void) {
  kiln_dist_opts o = kiln_dist_opts_default();
  o.device = KILN_DIST_DEVICE_CPU;
  o.expected_world_size = 3;
  kiln_dist *d = kiln_dist_init(&o);
  H_CHECK(!d && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT &&
              strstr(kiln_last_error_message(), "expects 3 ranks"),
          "a launch with the wrong world size is refused: %s", kiln_last_error_message());
  o.expected_world_size = 0;
  d = kiln_dist_init(&o);
  H_CHECK(d != NULL, "kiln_dist_init: %s", kiln_last_error_message());
  if (!d) return h_finish();
  H_CHECK(!kiln_dist_init(&o) && kiln_last_error() == KILN_ERR_STATE, "a second init is refused");
  int world = kiln_dist_world_size(d);
  H_CHECK(world == 2, "world of 2 (%d)", world);
  H_CHECK(kiln_dist_local_size(d) == world && kiln_dist_local_rank(d) == kiln_dist_rank(d),
          "one host: local rank = rank");
  H_CHECK(kiln_dist_device(d).type == KILN_DEVICE_CPU && !kiln_dist_uses_nccl(d), "cpu, MPI");
  test_collectives(d);
  kiln_optim_config sgd = kiln_sgd_config(0.1);
  sgd.momentum = 0.9;
  test_ddp_matches_single(d, sgd, "sgd+momentum");
  kiln_optim_config adam = kiln_adam_config(0.01);
  test_ddp_matches_single(d, adam, "adam");
  test_partial_grads(d);
  kiln_dist_free(d);
  H_CHECK(!kiln_dist_init(&o) && kiln_last_error() == KILN_ERR_STATE, "MPI cannot start twice");
  return h_finish();
}

static int run_singleton(void) {
  kiln_dist *d = kiln_dist_init(NULL);
  H_CHECK(d != NULL, "singleton kiln_dist_init: %s", kiln_last_error_message());
  if (!d) return h_finish();
  H_CHECK(kiln_dist_world_size(d) == 1 && kiln_dist_is_main(d), "without mpirun: a world of one");
  kiln_module *net = make_mlp(3, N_HIDDEN);
  kiln_ddp *ddp = kiln_ddp_new(d, net, NULL);
  kiln_scope_begin();
  kiln_tensor *x = kiln_ones(KILN_SHAPE(4, N_IN), KILN_F64, kiln_device_cpu());
  kiln_backward(kiln_sum_all(kiln_module_forward(net, x)), NULL);
  double before = kiln_item(kiln_sum_all(kiln_grad(kiln_module_param(net, "0.weight"))));
  H_CHECK(kiln_ddp_sync_grads(ddp) == KILN_OK, "sync in a world of one");
  double after = kiln_item(kiln_sum_all(kiln_grad(kiln_module_param(net, "0.weight"))));
  H_CHECK(before == after, "a world of one leaves gradients alone");
  kiln_scope_end();
  kiln_ddp_free(ddp);
  kiln_module_free(net);
  kiln_dist_free(d);
  return h_finish();
}

static char *find_on_path(const char *name) {
  const char *path = getenv("PATH");
  if (!path) return NULL;
  char *copy = strdup(path), *save = NULL;
  char *found = NULL;
  for (char *dir = strtok_r(copy, ":", &save); dir && !found; dir = strtok_r(NULL, ":", &save)) {
    char buf[4096];
    snprintf(buf, sizeof buf, "%s/%s", dir, name);
    if (access(buf, X_OK) == 0) found = strdup(buf);
  }
  free(copy);
  return found;
}

/* Runs argv as a child and returns its exit status (-1 when it could not run). */
static int run_child(char *const argv[]) {
  fflush(stdout);
  pid_t pid = fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    execv(argv[0], argv);
    _exit(127);
  }
  int status = 0;
  if (waitpid(pid, &status, 0) < 0) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
}

int main(int argc, char **argv) {
  h_init(argc, argv, "test_dist_cpu");
  if (getenv("KILN_TEST_DIST_SINGLETON")) return run_singleton();
  if (under_launcher()) return run_rank();

  test_shard_rules();
  test_shard_dataset();
  test_null_group();
  if (!kiln_dist_mpi_built()) {
    printf("test_dist_cpu: kiln was built without MPI: the multi-process part is skipped\n");
    h_finish();
    return 77;
  }
  char *mpirun = find_on_path("mpirun");
  if (!mpirun) {
    printf("test_dist_cpu: no mpirun on PATH: the multi-process part is skipped\n");
    h_finish();
    return 77;
  }
  char self[4096];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) snprintf(self, sizeof self, "%s", argv[0]);
  else self[n] = 0;

  /* alone: MPI's singleton mode */
  setenv("KILN_TEST_DIST_SINGLETON", "1", 1);
  int rc = run_child((char *[]){self, NULL});
  unsetenv("KILN_TEST_DIST_SINGLETON");
  H_CHECK(rc == 0, "the singleton run exited with %d", rc);

  /* two ranks; one thread each (2 cores), run as root in a sandbox, shared memory only */
  setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
  setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
  setenv("KILN_NUM_THREADS", "1", 1);
  setenv("OMP_NUM_THREADS", "1", 1);
  setenv("OPENBLAS_NUM_THREADS", "1", 1);
  char *args[] = {mpirun, "-np", "2", "--oversubscribe", "--bind-to", "none",
                  "--mca", "btl", "self,vader", "--timeout", "120", self, NULL};
  rc = run_child(args);
  H_CHECK(rc == 0, "mpirun -np 2 exited with %d", rc);
  free(mpirun);
  return h_finish();
}
