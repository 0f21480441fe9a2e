/* Shared by the examples: the environment checked, the device chosen, an MPI job joined
** when one was launched. Header-only. */
#ifndef KILN_EXAMPLES_LAUNCH_H
#define KILN_EXAMPLES_LAUNCH_H

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>

#include <kiln.h>
#include <kiln_dist.h>

#include "logdir.h"

/* The KILN_* environment, checked before anything runs (kiln_env_check): a bad value of a
** setting or a tuning switch is an error naming the variable and the accepted values, exit
** code 2. KILN_DEVICE is not checked when --device was given (the flag wins). Returns 0 or 2. */
static inline int ex_check_env(const char *prog, bool device_flag) {
  static const char *const names[] = {"KILN_DEVICE", "KILN_NUM_THREADS", "KILN_FALLBACK", "KILN_PROFILE",
                                      "KILN_ANOMALY"};
  bool ok = true;
  for (int i = device_flag ? 1 : 0; i < 5 && ok; i++) ok = kiln_env_check(names[i]) == KILN_OK;
  for (int i = 0; ok && kiln_env_switch(i); i++) ok = kiln_env_check(kiln_env_switch(i)) == KILN_OK;
  if (ok) return 0;
  fprintf(stderr, "%s: %s\n", prog, kiln_last_error_message());
  return 2;
}

/* --device NAME into *dev when given (else *dev is left as the caller's default), with its
** printable name in name (32 bytes). Returns 0, or 2 after saying why the name is bad. */
static inline int ex_device(const char *prog, const char *devname, kiln_device *dev, char name[32]) {
  if (devname && kiln_device_parse(devname, dev) != KILN_OK) {
    fprintf(stderr, "%s: --device '%s': %s\n", prog, devname, kiln_last_error_message());
    return 2;
  }
  kiln_device_str(*dev, name, 32);
  return 0;
}

/* Open MPI, MPICH/Hydra (PMI) and PMIx-based launchers each set one of these. Plain runs
** never touch MPI (no singleton start-up cost, no MPI messages). */
static inline bool ex_launched_by_mpi(void) {
  return getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMI_SIZE") || getenv("PMIX_RANK");
}

/* Joins the job when started by a launcher (kiln_dist_init), else a world of one (*dist
** NULL). The global batch must split evenly across the ranks. Returns 0, or the exit code
** to leave with: 1 when joining failed, 2 for a batch the ranks cannot split. */
static inline int ex_join(const char *prog, long long batch, kiln_dist **dist, int *world, int *rank) {
  *dist = NULL;
  *world = 1;
  *rank = 0;
  if (!ex_launched_by_mpi()) return 0;
  if (!(*dist = kiln_dist_init(NULL))) {
    fprintf(stderr, "%s: joining the MPI job: %s (%s)\n", prog, kiln_last_error_message(),
            kiln_error_name(kiln_last_error()));
    return 1;
  }
  *world = kiln_dist_world_size(*dist);
  *rank = kiln_dist_rank(*dist);
  if (batch % *world != 0) {
    fprintf(stderr, "%s: --batch %lld is not divisible by the %d ranks\n", prog, batch, *world);
    return 2;
  }
  return 0;
}

/* Where a data-parallel example (seed-mlp, fashion-mnist) runs: filled by ex_launch. */
typedef struct ex_job {
  kiln_dist *dist; /* the MPI job joined, NULL for a world of one; the caller frees it */
  int world, rank;
  kiln_summary_writer *tb; /* --logdir's writer, on rank 0 only; the caller closes it */
  kiln_device dev;         /* the rank's device under MPI, else the best; --device wins */
  char dname[32];          /* dev's printable name */
} ex_job;

/* A data-parallel example's start, in this order: joins the job when launched by one
** (ex_join), refuses --graph across ranks (the gradient all-reduce is not captured), quiets
** every rank but 0 (*quiet set, *json cleared: rank 0 speaks for the job), opens --logdir
** on rank 0 (ex_log_open, which exits 1 on a bad directory), then takes --device. Returns
** 0, or the exit code to leave with (1 or 2) after saying why; job->dist and job->tb hold
** what was made either way. */
static inline int ex_launch(const char *prog, long long batch, bool graph, const char *logdir, const char *devname,
                            bool *quiet, bool *json, ex_job *job) {
  job->tb = NULL;
  int rc = ex_join(prog, batch, &job->dist, &job->world, &job->rank);
  if (rc) return rc;
  if (job->world > 1 && graph) {
    fprintf(stderr, "%s: --graph is for one process (the gradient all-reduce is not captured)\n", prog);
    return 2;
  }
  if (job->rank != 0) *quiet = true, *json = false;
  job->tb = job->rank == 0 ? ex_log_open(prog, logdir) : NULL;
  job->dev = job->dist ? kiln_dist_device(job->dist) : kiln_device_best();
  return ex_device(prog, devname, &job->dev, job->dname);
}

#endif
