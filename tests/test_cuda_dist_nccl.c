/*
** The GPU path of kiln_dist: NCCL communicators bootstrapped through MPI, collectives on
** CUDA tensors on NCCL's own stream, and DDP's buckets on the GPU (label gpu).
**
** Run directly, it runs itself as a child process without mpirun (a world of one: MPI's
** singleton mode, or no MPI at all) that makes the NCCL communicator of one rank on
** cuda:0 and checks every collective and DDP's bucket path through it (the buckets are
** forced on with a test hook, since a world of one otherwise skips them). With two GPUs
** or more and mpirun on PATH it also runs itself under `mpirun -np 2`: each rank on
** cuda:<local rank> checks the collectives' results and trains data-parallel against one
** process on the global batches (f64: 1e-6 relative; f32: 1e-5).
** Exits 77 without CUDA, NCCL or a GPU.
*/
#define _POSIX_C_SOURCE 200809L
#include "dist/dist_common.h"
#include "dist/dist_int.h" /* kiln__ddp_always_reduce */

static kiln_device g_dev;

static void check_collectives(kiln_dist *d) {
  int rank = kiln_dist_rank(d), world = kiln_dist_world_size(d);
  double want_sum = world * (world + 1) / 2.0;
  kiln_scope_begin();
  const kiln_dtype dts[] = {KILN_F32, KILN_F64, KILN_F16, KILN_BF16};
  for (int i = 0; i < 4; i++) {
    kiln_tensor *t = kiln_full(KILN_SHAPE(3, 5), rank + 1, dts[i], g_dev);
    H_CHECK(kiln_dist_allreduce(d, t, KILN_DIST_AVG) == KILN_OK, "allreduce %s: %s",
            kiln_dtype_name(dts[i]), kiln_last_error_message());
    double got = kiln_get(t, (int64_t[]){2, 4});
    H_CHECK(got == want_sum / world, "avg %s on the GPU: %g", kiln_dtype_name(dts[i]), got);
    kiln_tensor *m = kiln_full(KILN_SHAPE(7), rank + 1, dts[i], g_dev);
    H_CHECK(kiln_dist_allreduce(d, m, KILN_DIST_MAX) == KILN_OK &&
                kiln_get(m, (int64_t[]){6}) == world, "max %s", kiln_dtype_name(dts[i]));
  }
  /* ordering: a large tensor written by a kernel just before, read by one just after */
  int64_t n = 1 << 22;
  kiln_tensor *big = kiln_full(1, &n, rank + 1, KILN_F32, g_dev);
  H_CHECK(kiln_dist_allreduce(d, big, KILN_DIST_SUM) == KILN_OK, "big allreduce");
  kiln_mul_scalar_(big, 2.0);
  double s = kiln_item(kiln_sum_all(big));
  H_CHECK(s == 2.0 * want_sum * (double)n, "kernel, NCCL, kernel stay in order (%.17g)", s);
  /* strided: through a contiguous copy, only the view's elements change */
  kiln_tensor *base = kiln_full(KILN_SHAPE(4, 6), rank + 1, KILN_F64, g_dev);
  kiln_tensor *view = kiln_transpose(kiln_narrow(base, 1, 0, 3), 0, 1);
  H_CHECK(kiln_dist_allreduce(d, view, KILN_DIST_SUM) == KILN_OK, "strided allreduce");
  H_CHECK(kiln_get(base, (int64_t[]){3, 2}) == want_sum && kiln_get(base, (int64_t[]){3, 3}) == rank + 1,
          "strided allreduce touches only the view");
  kiln_tensor *it = kiln_full(KILN_SHAPE(4), rank + 1, KILN_I64, g_dev);
  H_CHECK(kiln_dist_allreduce(d, it, KILN_DIST_SUM) == KILN_OK && kiln_get(it, (int64_t[]){3}) == want_sum,
          "i64 sum");
  EXPECT_ST(kiln_dist_allreduce(d, it, KILN_DIST_AVG), KILN_ERR_DTYPE, "avg of integers");
  kiln_tensor *bt = kiln_full(KILN_SHAPE(2, 3), rank + 1, KILN_BF16, g_dev);
  H_CHECK(kiln_dist_broadcast(d, bt, world - 1) == KILN_OK && kiln_get(bt, (int64_t[]){1, 2}) == world,
          "broadcast from the last rank");
  /* a CPU tensor in a CUDA group goes through MPI */
  kiln_tensor *ct = kiln_full(KILN_SHAPE(3), rank + 1, KILN_F32, kiln_device_cpu());
  H_CHECK(kiln_dist_allreduce(d, ct, KILN_DIST_SUM) == KILN_OK && kiln_get(ct, (int64_t[]){0}) == want_sum,
          "a CPU tensor: %s", kiln_last_error_message());
  kiln_scope_end();
}

/* A world of one with the buckets forced on: gradients come back bit for bit. */
static void check_ddp_identity(kiln_dist *d, kiln_dtype dt) {
  kiln_module *net = dc_make_mlp(3, DC_HIDDEN, dt, g_dev);
  kiln_ddp_opts o = kiln_ddp_opts_default();
  /* 75 elements a bucket whatever the dtype, so 16-bit models get several buckets too */
  o.bucket_mb = 75.0 * (double)kiln_dtype_size(dt) / 1048576.0;
  kiln_ddp *ddp = kiln_ddp_new(d, net, &o);
  H_CHECK(ddp && kiln_ddp_num_buckets(ddp) >= 2, "%s: buckets (%s)", kiln_dtype_name(dt),
          kiln_last_error_message());
  kiln_scope_begin();
  kiln_tensor *x = kiln_randn(KILN_SHAPE(8, DC_IN), dt, g_dev, NULL);
  kiln_backward(kiln_mean_all(kiln_module_forward(net, x)), NULL);
  kiln_tensor *ps[4];
  kiln_module_parameters(net, ps, 4);
  double *before[4];
  int64_t k[4];
  for (int i = 0; i < 4; i++) before[i] = h_values(kiln_grad(ps[i]), &k[i]);
  H_CHECK(kiln_ddp_sync_grads(ddp) == KILN_OK, "%s: sync: %s", kiln_dtype_name(dt),
          kiln_last_error_message());
  bool same = true;
  for (int i = 0; i < 4; i++) {
    int64_t kk = 0;
    double *after = h_values(kiln_grad(ps[i]), &kk);
    same = same && after && before[i] && kk == k[i] &&
           memcmp(after, before[i], sizeof(double) * (size_t)kk) == 0;
    free(after);
    free(before[i]);
  }
  H_CHECK(same, "%s: gradients through NCCL buckets unchanged in a world of one", kiln_dtype_name(dt));
  kiln_scope_end();
  kiln_ddp_free(ddp);
  kiln_module_free(net);
}

static kiln_tensor *ident_forward(kiln_module *m, kiln_tensor *x) {
  (void)m;
  return kiln_tensor_ref(x);
}
static const kiln_module_vtable two_params_vt = {"TwoParams", ident_forward, NULL, NULL, NULL};

/* Only rank 0 has a gradient for a, nobody for b (the flags read back from the GPU). */
static void check_partial_grads(kiln_dist *d) {
  int rank = kiln_dist_rank(d), world = kiln_dist_world_size(d);
  kiln_module *m = kiln_module_new(&two_params_vt, NULL);
  kiln_module_register_parameter(m, "a", kiln_zeros(KILN_SHAPE(3), KILN_F32, g_dev), true);
  kiln_module_register_parameter(m, "b", kiln_zeros(KILN_SHAPE(2), KILN_F32, g_dev), true);
  kiln_ddp *ddp = kiln_ddp_new(d, m, NULL);
  kiln_tensor *a = kiln_module_param(m, "a"), *b = kiln_module_param(m, "b");
  kiln_scope_begin();
  if (rank == 0) kiln_set_grad(a, kiln_to_device(H_T(KILN_SHAPE(3), KILN_F32, 2, 4, 6), g_dev));
  H_CHECK(kiln_ddp_sync_grads(ddp) == KILN_OK, "partial sync: %s", kiln_last_error_message());
  kiln_tensor *ga = kiln_grad(a);
  H_CHECK(ga && kiln_get(ga, (int64_t[]){2}) == 6.0 / world, "a missing gradient counts as zeros");
  H_CHECK(!kiln_grad(b), "no rank had one: none anywhere");
  kiln_scope_end();
  kiln_ddp_free(ddp);
  kiln_module_free(m);
}

static int run_one_gpu(void) {
  kiln_dist_opts o = kiln_dist_opts_default();
  o.device = KILN_DIST_DEVICE_CUDA;
  kiln_dist *d = kiln_dist_init(&o);
  H_CHECK(d != NULL, "kiln_dist_init(CUDA): %s", kiln_last_error_message());
  if (!d) return h_finish();
  g_dev = kiln_dist_device(d);
  H_CHECK(kiln_dist_world_size(d) == 1 && kiln_dist_uses_nccl(d) &&
              g_dev.type == KILN_DEVICE_CUDA && g_dev.index == 0,
          "a world of one on cuda:0 through NCCL");
  check_collectives(d);
  kiln__ddp_always_reduce = true;
  check_ddp_identity(d, KILN_F32);
  check_ddp_identity(d, KILN_F16);
  check_ddp_identity(d, KILN_BF16);
  check_partial_grads(d);
  kiln__ddp_always_reduce = false;
  kiln_dist_free(d);
  return h_finish();
}

static int run_rank(void) {
  kiln_dist_opts o = kiln_dist_opts_default();
  o.device = KILN_DIST_DEVICE_CUDA;
  kiln_dist *d = kiln_dist_init(&o);
  if (getenv("KILN_TEST_DIST_TOO_MANY")) {
    /* two ranks, one GPU: refused on both ranks, naming the counts */
    H_CHECK(!d && kiln_last_error() == KILN_ERR_DEVICE &&
                strstr(kiln_last_error_message(), "2 ranks run on this host but it has 1 GPU"),
            "more ranks than GPUs is refused: %s", kiln_last_error_message());
    kiln_dist_free(d);
    return h_finish();
  }
  H_CHECK(d != NULL, "kiln_dist_init(CUDA): %s", kiln_last_error_message());
  if (!d) return h_finish();
  g_dev = kiln_dist_device(d);
  H_CHECK(g_dev.type == KILN_DEVICE_CUDA && g_dev.index == kiln_dist_local_rank(d) &&
              kiln_dist_uses_nccl(d), "rank %d on cuda:%d", kiln_dist_rank(d), g_dev.index);
  H_CHECK(kiln_device_equal(kiln_device_best(), g_dev), "kiln_device_best() is this rank's GPU");
  check_collectives(d);
  kiln_optim_config sgd = kiln_sgd_config(0.1);
  sgd.momentum = 0.9;
  dc_ddp_matches_single(d, sgd, "cuda f64 sgd+momentum", g_dev, KILN_F64, 1e-6, true);
  dc_ddp_matches_single(d, kiln_adam_config(0.01), "cuda f32 adam", g_dev, KILN_F32, 1e-5, false);
  dc_ddp_accumulation(d, g_dev, KILN_F64);
  check_partial_grads(d);
  kiln_dist_free(d);
  return h_finish();
}

int main(int argc, char **argv) {
  h_init(argc, argv, "test_cuda_dist_nccl");
  if (!kiln_dist_nccl_built()) {
    printf("test_cuda_dist_nccl: kiln was built without CUDA and NCCL: skipped\n");
    return 77;
  }
  if (getenv("KILN_TEST_DIST_SINGLETON")) return run_one_gpu();
  if (dc_under_launcher()) return run_rank();
  int gpus = kiln_device_count(KILN_DEVICE_CUDA);
  if (gpus < 1) {
    printf("test_cuda_dist_nccl: no working GPU: skipped\n");
    return 77;
  }
  char self[4096];
  dc_self(self, sizeof self, argv[0]);
  setenv("KILN_TEST_DIST_SINGLETON", "1", 1);
  int rc = dc_run_child((char *[]){self, NULL});
  unsetenv("KILN_TEST_DIST_SINGLETON");
  H_CHECK(rc == 0, "the one-GPU run exited with %d", rc);
  if (gpus >= 2 && kiln_dist_mpi_built()) {
    rc = dc_mpirun_self(self, 2);
    if (rc == -1) printf("test_cuda_dist_nccl: no mpirun on PATH: the two-GPU part is skipped\n");
    else H_CHECK(rc == 0, "mpirun -np 2 on two GPUs exited with %d", rc);
  } else if (gpus == 1 && kiln_dist_mpi_built()) {
    printf("test_cuda_dist_nccl: one GPU: the two-GPU part is skipped; two ranks on it must "
           "be refused\n");
    setenv("KILN_TEST_DIST_TOO_MANY", "1", 1);
    rc = dc_mpirun_self(self, 2);
    unsetenv("KILN_TEST_DIST_TOO_MANY");
    if (rc != -1) H_CHECK(rc == 0, "mpirun -np 2 on one GPU exited with %d", rc);
  } else {
    printf("test_cuda_dist_nccl: %d GPU(s), no MPI: the two-GPU part is skipped\n", gpus);
  }
  return h_finish();
}
