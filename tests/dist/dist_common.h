/*
** What test_dist_cpu.c and test_cuda_dist_nccl.c share: relaunching under mpirun, and the
** data-parallel equivalence check (a small MLP trained with kiln_ddp on each rank's shard
** against one process training on the global batches). Static functions: each test
** includes this once.
*/
#ifndef KILN_TEST_DIST_COMMON_H
#define KILN_TEST_DIST_COMMON_H

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

#define DC_SAMPLES 64
#define DC_IN 5
#define DC_HIDDEN 16
#define DC_CLASSES 3
#define DC_GLOBAL_BATCH 16
#define DC_EPOCHS 2
#define DC_DATA_SEED 5

/* A status call that must fail with code and say why. */
#define EXPECT_ST(expr, code, what)                                                       \
  do {                                                                                    \
    kiln_status st_ = (expr);                                                             \
    H_CHECK(st_ == (code) && kiln_last_error_message()[0], "%s: got %s (%s)", (what),     \
            kiln_error_name(st_), kiln_last_error_message());                            \
  } while (0)

static bool dc_under_launcher(void) {
  return getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMIX_RANK") || getenv("PMI_RANK");
}

static char *dc_find_on_path(const char *name) {
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

/* Under ASan (make asan) Open MPI leaves allocations behind at exit, many in its plug-ins
** that it has already unloaded (LSan shows them as "<unknown module>", so no suppression
** can name them): the MPI processes run without leak checking. This process, which runs
** the sampler tests, keeps it; ASan's other checks stay on in the children. */
#if defined(__SANITIZE_ADDRESS__) /* gcc */
#define DC_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) /* clang */
#define DC_ASAN 1
#endif
#endif
static void dc_child_env(void) {
#if defined(DC_ASAN)
  const char *asan = getenv("ASAN_OPTIONS");
  if (asan && strstr(asan, ":detect_leaks=0")) return;
  char buf[4096];
  snprintf(buf, sizeof buf, "%s:detect_leaks=0", asan ? asan : ""); /* the last one wins */
  setenv("ASAN_OPTIONS", buf, 1);
#endif
}

/* Runs argv as a child and returns its exit status (-1 when it could not run). */
static int dc_run_child(char *const argv[]) {
  dc_child_env();
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

/* This executable's path. */
static void dc_self(char *self, size_t n, const char *argv0) {
  ssize_t k = readlink("/proc/self/exe", self, n - 1);
  if (k <= 0) snprintf(self, n, "%s", argv0);
  else self[k] = 0;
}

/* A session directory tree of its own for the next Open MPI launch (a singleton's MPI_Init
** or an mpirun): OMPI_MCA_orte_tmpdir_base set to a fresh directory under $TMPDIR or /tmp,
** its path left in dir ("" when none could be made: the default tree then). Without it,
** every launch on the machine shares /tmp/ompi.<host>.<uid>, and one whose daemon was
** still removing that tree as the next launch made it failed the next ("A call to mkdir was
** unable to create the desired directory ... File exists", a fresh-clone CI run). */
static void dc_mpi_session_begin(char *dir, size_t n) {
  const char *t = getenv("TMPDIR");
  snprintf(dir, n, "%s/kiln-mpi-XXXXXX", t && *t ? t : "/tmp");
  if (mkdtemp(dir)) setenv("OMPI_MCA_orte_tmpdir_base", dir, 1);
  else dir[0] = 0;
}

/* Removes the launch's tree (what Open MPI left in it too). */
static void dc_mpi_session_end(const char *dir) {
  unsetenv("OMPI_MCA_orte_tmpdir_base");
  if (!dir[0]) return;
  char *args[] = {"rm", "-rf", (char *)dir, NULL};
  char *rm = dc_find_on_path("rm");
  if (rm) {
    args[0] = rm;
    (void)dc_run_child(args);
    free(rm);
  }
}

/* `mpirun -np np self` with one CPU thread per rank, as root, shared memory only, in a
** session tree of its own; returns its exit status (-1: no mpirun). */
static int dc_mpirun_self(const char *self, int np) {
  char *mpirun = dc_find_on_path("mpirun");
  if (!mpirun) return -1;
  setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
  setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
  setenv("KILN_NUM_THREADS", "1", 1);
  setenv("OMP_NUM_THREADS", "1", 1);
  setenv("OPENBLAS_NUM_THREADS", "1", 1);
  char nps[16];
  snprintf(nps, sizeof nps, "%d", np);
  char *args[] = {mpirun, "-np", nps, "--oversubscribe", "--bind-to", "none", "--mca", "btl",
                  "self,vader", "--timeout", "120", (char *)self, NULL};
  char dir[512];
  dc_mpi_session_begin(dir, sizeof dir);
  int rc = dc_run_child(args);
  dc_mpi_session_end(dir);
  free(mpirun);
  return rc;
}

static kiln_module *dc_make_mlp(uint64_t seed, int64_t hidden, kiln_dtype dt, kiln_device dev) {
  kiln_generator *g = kiln_generator_new(seed);
  kiln_module *net = kiln_sequential_new();
  kiln_sequential_append(net, kiln_linear_new(DC_IN, hidden, true, dt, dev, g));
  kiln_sequential_append(net, kiln_relu_new());
  kiln_sequential_append(net, kiln_linear_new(hidden, DC_CLASSES, true, dt, dev, g));
  kiln_generator_free(g);
  return net;
}

/* An order-sensitive sum of all parameters. */
static double dc_checksum(kiln_module *m) {
  kiln_tensor *ps[16];
  int n = kiln_module_parameters(m, ps, 16);
  double s = 0;
  for (int i = 0; i < n; i++) {
    int64_t k = 0;
    double *v = h_values(ps[i], &k);
    for (int64_t j = 0; v && j < k; j++) s += v[j] * (1.0 + 1e-3 * (double)(j + 31 * i));
    free(v);
  }
  return s;
}

/* Largest |a - b| over all parameters, relative to the largest |b|. */
static double dc_max_rel_diff(kiln_module *a, kiln_module *b) {
  kiln_tensor *pa[16], *pb[16];
  int n = kiln_module_parameters(a, pa, 16);
  kiln_module_parameters(b, pb, 16);
  double worst = 0, scale = 0;
  for (int i = 0; i < n; i++) {
    int64_t k = 0;
    double *va = h_values(pa[i], &k), *vb = h_values(pb[i], &k);
    for (int64_t j = 0; va && vb && j < k; j++) {
      worst = fmax(worst, fabs(va[j] - vb[j]));
      scale = fmax(scale, fabs(vb[j]));
    }
    free(va);
    free(vb);
  }
  return worst / (scale > 0 ? scale : 1);
}

static kiln_tensor *dc_loss(kiln_module *net, kiln_tensor *x, kiln_tensor *y) {
  return kiln_cross_entropy(kiln_module_forward(net, x), y, KILN_REDUCTION_MEAN, -100, 0);
}

/* DDP training on this rank's shard (through the shard view and a loader delivering to
** dev) vs one process on the global batches (rank 0, on dev): parameters within tol
** relative, averaged losses within tol, and every rank's parameters bit-identical. Each
** rank starts from other weights, so the initial broadcast is checked too. */
static void dc_ddp_matches_single(kiln_dist *d, kiln_optim_config cfg, const char *name,
                                  kiln_device dev, kiln_dtype dt, double tol, bool overlap) {
  int rank = kiln_dist_rank(d), world = kiln_dist_world_size(d);
  kiln_generator *dg = kiln_generator_new(123); /* the same data on every rank */
  kiln_tensor *x = kiln_keep(kiln_randn(KILN_SHAPE(DC_SAMPLES, DC_IN), dt, kiln_device_cpu(), dg));
  kiln_tensor *y = kiln_keep(kiln_randint(0, DC_CLASSES, KILN_SHAPE(DC_SAMPLES), KILN_I64,
                                          kiln_device_cpu(), dg));
  kiln_generator_free(dg);
  kiln_dataset *ds = kiln_tensor_dataset_new(2, (kiln_tensor *[]){x, y});
  kiln_dataset *shard = kiln_dist_shard_dataset(ds, rank, world, true, DC_DATA_SEED, false);

  kiln_module *net = dc_make_mlp(7 + 100 * (uint64_t)rank, DC_HIDDEN, dt, dev);
  kiln_ddp_opts dopt = kiln_ddp_opts_default();
  dopt.bucket_mb = 300.0 / 1048576.0; /* ~300 bytes: several buckets */
  dopt.no_overlap = !overlap;
  kiln_ddp *ddp = kiln_ddp_new(d, net, &dopt);
  H_CHECK(ddp != NULL, "%s: kiln_ddp_new: %s", name, kiln_last_error_message());
  if (!ddp) return;
  int bad_overlap = 0;
  H_CHECK(kiln_ddp_num_buckets(ddp) >= 3, "%s: %d buckets", name, kiln_ddp_num_buckets(ddp));
  int in_buckets = 0;
  for (int b = 0; b < kiln_ddp_num_buckets(ddp); b++) in_buckets += kiln_ddp_bucket_params(ddp, b);
  H_CHECK(in_buckets == 4, "%s: every parameter in one bucket (%d)", name, in_buckets);
  kiln_optimizer *opt = kiln_optimizer_new_module(&cfg, net);

  kiln_module *ref = rank == 0 ? dc_make_mlp(7, DC_HIDDEN, dt, dev) : NULL;
  kiln_optimizer *ref_opt = ref ? kiln_optimizer_new_module(&cfg, ref) : NULL;
  kiln_tensor *xd = ref ? kiln_keep(kiln_to_device(x, dev)) : NULL;
  kiln_tensor *yd = ref ? kiln_keep(kiln_to_device(y, dev)) : NULL;

  kiln_loader_opts lo = kiln_loader_opts_default();
  lo.batch_size = DC_GLOBAL_BATCH / world;
  lo.num_workers = 1;
  lo.device = dev;
  kiln_loader *l = kiln_loader_new(shard, &lo);
  double worst_loss = 0;
  int steps = 0;
  for (uint64_t epoch = 0; epoch < DC_EPOCHS; epoch++) {
    kiln_dist_shard_set_epoch(shard, epoch);
    kiln_loader_epoch(l, epoch);
    int64_t order[DC_SAMPLES]; /* the whole epoch's order: a world of one's shard */
    kiln_dist_shard_indices(DC_SAMPLES, 0, 1, true, DC_DATA_SEED, epoch, false, order);
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
      kiln_tensor *loss = dc_loss(net, b[0], b[1]);
      kiln_status st = kiln_backward(loss, NULL);
      if (st == KILN_OK) st = kiln_ddp_sync_grads(ddp);
      /* with overlap every bucket was started inside backward */
      int want = overlap && world > 1 ? kiln_ddp_num_buckets(ddp) : 0;
      if (kiln_ddp_num_overlapped(ddp) != want) bad_overlap++;
      if (st == KILN_OK) st = kiln_optimizer_step(opt);
      H_CHECK(st == KILN_OK, "%s: step: %s", name, kiln_last_error_message());
      double lv = kiln_item(loss);
      kiln_dist_allreduce_scalar(d, &lv, KILN_DIST_AVG);
      if (ref) {
        /* step s of all ranks together = positions [s GB, (s+1) GB) of the order */
        kiln_tensor *idx = kiln_from_data(order + s * DC_GLOBAL_BATCH, KILN_SHAPE(DC_GLOBAL_BATCH),
                                          KILN_I64, dev);
        kiln_optimizer_zero_grad(ref_opt);
        kiln_tensor *rl = dc_loss(ref, kiln_index_select(xd, 0, idx), kiln_index_select(yd, 0, idx));
        kiln_backward(rl, NULL);
        kiln_optimizer_step(ref_opt);
        double rv = kiln_item(rl);
        worst_loss = fmax(worst_loss, fabs(rv - lv) / fabs(rv));
      }
      steps++;
      kiln_scope_end();
    }
  }
  H_CHECK(steps == DC_EPOCHS * DC_SAMPLES / DC_GLOBAL_BATCH, "%s: %d steps", name, steps);
  H_CHECK(bad_overlap == 0, "%s: buckets started during backward (%d steps wrong)", name, bad_overlap);
  if (ref) {
    double rel = dc_max_rel_diff(net, ref);
    H_CHECK(rel <= tol, "%s: parameters vs one process on the global batch: rel diff %.3g", name, rel);
    H_CHECK(worst_loss <= tol, "%s: averaged loss vs one process: rel diff %.3g", name, worst_loss);
  }
  double sums[64];
  kiln_dist_allgather_scalar(d, dc_checksum(net), sums);
  bool same = true;
  for (int r = 1; r < world && r < 64; r++) same = same && sums[r] == sums[0];
  H_CHECK(same, "%s: parameters bit-identical on every rank (%.17g vs %.17g)", name, sums[0],
          sums[world - 1]);

  kiln_loader_free(l);
  kiln_tensor_free(xd);
  kiln_tensor_free(yd);
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

/* Gradient accumulation: two backward passes (other data on each rank), then one sync,
** equals the average over ranks of the summed gradients: without kiln_ddp_no_sync (the
** buckets the first backward started are stale: sync reduces again) and with it. */
static void dc_ddp_accumulation(kiln_dist *d, kiln_device dev, kiln_dtype dt) {
  int rank = kiln_dist_rank(d);
  kiln_module *net = dc_make_mlp(11, DC_HIDDEN, dt, dev);
  kiln_ddp_opts o = kiln_ddp_opts_default();
  o.bucket_mb = 300.0 / 1048576.0;
  kiln_ddp *ddp = kiln_ddp_new(d, net, &o);
  kiln_generator *g = kiln_generator_new(50 + (uint64_t)rank);
  for (int use_no_sync = 0; use_no_sync < 2; use_no_sync++) {
    kiln_scope_begin();
    kiln_tensor *ps[4];
    kiln_module_parameters(net, ps, 4);
    for (int i = 0; i < 4; i++) kiln_set_grad(ps[i], NULL);
    for (int micro = 0; micro < 2; micro++) {
      if (use_no_sync) kiln_ddp_no_sync(ddp, micro == 0);
      kiln_tensor *x = kiln_randn(KILN_SHAPE(6, DC_IN), dt, dev, g);
      kiln_backward(kiln_mean_all(kiln_mul(kiln_module_forward(net, x), kiln_module_forward(net, x))), NULL);
    }
    /* the expectation, by the plain collective (a WORLD collective between backward and
    ** sync, while buckets may be in flight) */
    kiln_tensor *want[4];
    for (int i = 0; i < 4; i++) {
      want[i] = kiln_clone(kiln_grad(ps[i]));
      kiln_dist_allreduce(d, want[i], KILN_DIST_AVG);
    }
    H_CHECK(kiln_ddp_sync_grads(ddp) == KILN_OK, "accumulation sync: %s", kiln_last_error_message());
    double worst = 0;
    for (int i = 0; i < 4; i++)
      worst = fmax(worst, kiln_item(kiln_amax(kiln_abs(kiln_sub(kiln_grad(ps[i]), want[i])), 0, NULL, false)));
    H_CHECK(worst <= 1e-12, "%s: accumulated gradients averaged (%s): max diff %.3g",
            kiln_dtype_name(dt), use_no_sync ? "no_sync" : "stale buckets redone", worst);
    int nb = kiln_ddp_num_buckets(ddp);
    int want_early = use_no_sync && kiln_dist_world_size(d) > 1 ? nb : 0;
    H_CHECK(kiln_ddp_num_overlapped(ddp) == want_early, "%s: %d buckets early (want %d)",
            use_no_sync ? "no_sync" : "dirty round", kiln_ddp_num_overlapped(ddp), want_early);
    kiln_scope_end();
  }
  kiln_generator_free(g);
  kiln_ddp_free(ddp);
  kiln_module_free(net);
}

#endif /* KILN_TEST_DIST_COMMON_H */
