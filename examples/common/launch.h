/* Shared by the examples: was this process started by an MPI launcher? Plain runs then
** never touch MPI (no singleton start-up cost, no MPI messages). Header-only. */
#ifndef KILN_EXAMPLES_LAUNCH_H
#define KILN_EXAMPLES_LAUNCH_H

#include <stdbool.h>
#include <stdlib.h>

/* Open MPI, MPICH/Hydra (PMI) and PMIx-based launchers each set one of these. */
static inline bool ex_launched_by_mpi(void) {
  return getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMI_SIZE") || getenv("PMIX_RANK");
}

#endif
