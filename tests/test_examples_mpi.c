/*
** The examples run unchanged under mpirun: seed-mlp on 2 ranks (data-parallel, rank 0
** prints one JSON line with world_size 2) reaches the loss of one process on the global
** batch. Skipped (77) without MPI in the build or mpirun on the PATH.
*/
#define _POSIX_C_SOURCE 200809L
#include <kiln.h>
#include <kiln_dist.h>

#include "cli_run.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Leak checking is off for the MPI ranks of a sanitizer build: Open MPI's plug-ins leak
** at finalize (in libmpi, not kiln); test_dist_cpu does the same. */
#define MPIRUN                                                                            \
  "ASAN_OPTIONS=detect_leaks=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 " \
  "OMPI_MCA_btl=self,vader "                                                              \
  "OMPI_MCA_rmaps_base_oversubscribe=1 KILN_NUM_THREADS=1 mpirun -np 2 --oversubscribe"

int main(void) {
  if (!kiln_dist_mpi_built() || system("command -v mpirun >/dev/null 2>&1") != 0) {
    printf("skipped: no MPI (built with MPI: %d)\n", kiln_dist_mpi_built());
    return 77;
  }
  cr_result one = cr_run("KILN_NUM_THREADS=1", "seed-mlp", "--device cpu --epochs 2 --json --quiet");
  /* a session tree of its own (tests/dist/dist_common.h says why) */
  char dir[512], env[1024];
  const char *t = getenv("TMPDIR");
  snprintf(dir, sizeof dir, "%s/kiln-mpi-XXXXXX", t && *t ? t : "/tmp");
  if (!mkdtemp(dir)) dir[0] = 0;
  snprintf(env, sizeof env, "%s%s%s" MPIRUN, dir[0] ? "OMPI_MCA_orte_tmpdir_base='" : "", dir, dir[0] ? "' " : "");
  cr_result two = cr_run(env, "seed-mlp", "--device cpu --epochs 2 --json --quiet");
  if (dir[0]) {
    char rm[600];
    snprintf(rm, sizeof rm, "rm -rf '%s'", dir);
    if (system(rm) != 0) fprintf(stderr, "test_examples_mpi: could not remove %s\n", dir);
  }
  CR_CHECK(one.status == 0, "one process exited %d: %s", one.status, one.err);
  CR_CHECK(two.status == 0, "mpirun -np 2 exited %d: %s", two.status, two.err);
  /* rank 0 alone prints: exactly one JSON line */
  const char *nl = two.out ? strchr(two.out, '\n') : NULL;
  CR_CHECK(two.out && two.out[0] == '{' && nl && nl[1] == 0, "one line from rank 0, got: %s", two.out);
  CR_CHECK(cr_json_num(two.out, "world_size") == 2, "world_size 2: %s", two.out);
  double l1 = cr_json_num(one.out, "final_loss"), l2 = cr_json_num(two.out, "final_loss");
  /* the same global batches and averaged gradients: the same training up to rounding */
  CR_CHECK(fabs(l1 - l2) <= 1e-4 * fabs(l1) + 1e-6, "final loss %.6f (1 process) vs %.6f (2 ranks)", l1, l2);
  cr_free(&one);
  cr_free(&two);
  /* a batch the ranks cannot split is a clear error on every rank */
  cr_result bad = cr_run(MPIRUN, "seed-mlp", "--device cpu --epochs 1 --batch 127 --quiet");
  CR_CHECK(bad.status != 0 && bad.err && strstr(bad.err, "divisible"), "batch 127 on 2 ranks: %d %s", bad.status, bad.err);
  cr_free(&bad);
  return cr_finish("test_examples_mpi");
}
