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
#include "dist/dist_common.h"

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
  kiln_module *net = dc_make_mlp(1, rank == 1 ? DC_HIDDEN + 1 : DC_HIDDEN, KILN_F64, kiln_device_cpu());
  kiln_ddp *bad = kiln_ddp_new(d, net, NULL);
  H_CHECK(!bad && kiln_last_error() == KILN_ERR_STATE, "different models refused (%s)",
          kiln_last_error_message());
  kiln_ddp_free(bad);
  kiln_module_free(net);
}

/* ---- the processes --------------------------------------------------------------- */

static int run_rank(void) {
  if (!kiln_dist_mpi_built()) {
    kiln_dist *d = kiln_dist_init(NULL);
    H_CHECK(!d && kiln_last_error() == KILN_ERR_UNAVAILABLE &&
                strstr(kiln_last_error_message(), "built without MPI"),
            "one of several ranks in a build without MPI is refused: %s", kiln_last_error_message());
    return h_finish();
  }
  kiln_dist_opts o = kiln_dist_opts_default();
  o.device = KILN_DIST_DEVICE_CPU;
  o.expected_world_size = 3;
  kiln_dist *d = kiln_dist_init(&o);
  H_CHECK(!d && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT &&
              strstr(kiln_last_error_message(), "expects 3 ranks"),
          "a launch with the wrong world size is refused: %s", kiln_last_error_message());
  o.expected_world_size = 0;
  if (kiln_device_count(KILN_DEVICE_CUDA) == 0) {
    /* every rank refuses, with the same reason, and nobody waits in NCCL */
    o.device = KILN_DIST_DEVICE_CUDA;
    d = kiln_dist_init(&o);
    H_CHECK(!d && kiln_last_error() == KILN_ERR_UNAVAILABLE &&
                strstr(kiln_last_error_message(), "device CUDA"),
            "device CUDA without a GPU is refused: %s", kiln_last_error_message());
    o.device = KILN_DIST_DEVICE_CPU;
  }
  d = kiln_dist_init(&o);
  H_CHECK(d != NULL, "kiln_dist_init: %s", kiln_last_error_message());
  if (!d) return h_finish();
  H_CHECK(!kiln_dist_init(&o) && kiln_last_error() == KILN_ERR_STATE, "a second init is refused");
  int world = kiln_dist_world_size(d);
  H_CHECK(world == 2, "world of 2 (%d)", world);
  H_CHECK(kiln_dist_local_size(d) == world && kiln_dist_local_rank(d) == kiln_dist_rank(d),
          "one host: local rank = rank");
  H_CHECK(kiln_dist_device(d).type == KILN_DEVICE_CPU && !kiln_dist_uses_nccl(d), "cpu, MPI");
  H_CHECK(kiln_device_best().type == KILN_DEVICE_CPU, "kiln_device_best() agrees");
  test_collectives(d);
  kiln_optim_config sgd = kiln_sgd_config(0.1);
  sgd.momentum = 0.9;
  dc_ddp_matches_single(d, sgd, "sgd+momentum", kiln_device_cpu(), KILN_F64, 1e-6, true);
  kiln_optim_config adam = kiln_adam_config(0.01);
  dc_ddp_matches_single(d, adam, "adam", kiln_device_cpu(), KILN_F64, 1e-6, false);
  dc_ddp_accumulation(d, kiln_device_cpu(), KILN_F64);
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
  kiln_module *net = dc_make_mlp(3, DC_HIDDEN, KILN_F64, kiln_device_cpu());
  kiln_ddp *ddp = kiln_ddp_new(d, net, NULL);
  kiln_scope_begin();
  kiln_tensor *x = kiln_ones(KILN_SHAPE(4, DC_IN), KILN_F64, kiln_device_cpu());
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

int main(int argc, char **argv) {
  h_init(argc, argv, "test_dist_cpu");
  if (getenv("KILN_TEST_DIST_SINGLETON")) return run_singleton();
  if (dc_under_launcher()) return run_rank();

  test_shard_rules();
  test_shard_dataset();
  test_null_group();
  char self[4096];
  dc_self(self, sizeof self, argv[0]);

  /* alone: MPI's singleton mode (or, without MPI, a world of one all the same) */
  setenv("KILN_TEST_DIST_SINGLETON", "1", 1);
  char dir[512];
  dc_mpi_session_begin(dir, sizeof dir);
  int rc = dc_run_child((char *[]){self, NULL});
  dc_mpi_session_end(dir);
  unsetenv("KILN_TEST_DIST_SINGLETON");
  H_CHECK(rc == 0, "the singleton run exited with %d", rc);

  if (!kiln_dist_mpi_built()) {
    /* what a launcher would say to a build without MPI: refused with the reason */
    setenv("OMPI_COMM_WORLD_SIZE", "2", 1);
    rc = dc_run_child((char *[]){self, NULL});
    unsetenv("OMPI_COMM_WORLD_SIZE");
    H_CHECK(rc == 0, "the refused launch exited with %d", rc);
    printf("test_dist_cpu: kiln was built without MPI: the multi-process part is skipped\n");
    int code = h_finish();
    return code != 0 ? code : 77;
  }

  rc = dc_mpirun_self(self, 2);
  if (rc == -1) {
    printf("test_dist_cpu: no mpirun on PATH: the multi-process part is skipped\n");
    h_finish();
    return 77;
  }
  H_CHECK(rc == 0, "mpirun -np 2 exited with %d", rc);
  return h_finish();
}
