/* Shared by the examples: the environment checked, the device chosen, an MPI job joined
** when one was launched. Header-only. */
#ifndef KILN_EXAMPLES_LAUNCH_H
#define KILN_EXAMPLES_LAUNCH_H

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>

#include <kiln.h>
#include <kiln_dist.h>

/* The KILN_* environment, checked before anything runs (kiln_env_check): a bad value is
** an error naming the variable and the accepted values, exit code 2. KILN_DEVICE is not
** checked when --device was given (the flag wins). Returns 0 or 2. */
static inline int ex_check_env(const char *prog, bool device_flag) {
  static const char *const names[] = {"KILN_DEVICE", "KILN_NUM_THREADS", "KILN_FALLBACK", "KILN_PROFILE",
                                      "KILN_ANOMALY"};
  for (int i = device_flag ? 1 : 0; i < 5; i++)
    if (kiln_env_check(names[i]) != KILN_OK) {
      fprintf(stderr, "%s: %s\n", prog, kiln_last_error_message());
      return 2;
    }
  return 0;
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

#endif
