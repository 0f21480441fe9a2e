/*
** Internals of the distributed layer (not API), shared by dist.c (process group),
** collective.c (tensor collectives), nccl.c (the GPU transport) and ddp.c.
*/
#ifndef KILN_DIST_INT_H
#define KILN_DIST_INT_H

#include "kiln_dist.h"

#if defined(KILN_HAVE_NCCL) && KILN_HAVE_NCCL && defined(KILN_HAVE_CUDA) && KILN_HAVE_CUDA
#define KILN__DIST_NCCL 1
#else
#define KILN__DIST_NCCL 0
#endif
#if defined(KILN_HAVE_MPI) && KILN_HAVE_MPI
#define KILN__DIST_MPI 1
#else
#define KILN__DIST_MPI 0
#endif

struct kiln_dist {
  int rank, world;
  int local_rank, local_size;
  kiln_device device; /* what this rank trains on */
  bool mpi;           /* MPI is up (false: a world of one without MPI) */
  void *node_comm;    /* MPI_Comm of this host's ranks (heap copy), or NULL */
  void *bucket_comm;  /* MPI_Comm (heap copy), a duplicate of MPI_COMM_WORLD for DDP's
                         nonblocking bucket reductions, so that they can never match (or
                         wait for) any other collective; NULL without MPI */
  void *nccl;         /* kiln__nccl (nccl.c), or NULL */
};

/* ---- nccl.c: one communicator per process, its own stream ---- */
/* Makes the communicator of d's world on d->device (every rank calls it; id is the
** ncclUniqueId bytes rank 0 made, already broadcast). NULL + error on failure. */
void *kiln__nccl_new(const kiln_dist *d, const void *id, size_t id_size);
/* ncclGetUniqueId into id (at least kiln__nccl_id_size() bytes). */
kiln_status kiln__nccl_unique_id(void *id);
size_t kiln__nccl_id_size(void);
void kiln__nccl_free(void *nc);
/* Collectives on device memory of d->device, ordered with kiln's stream by events: the
** NCCL stream waits for what kiln queued so far; kiln's stream then waits for the
** collective. Nothing waits on the host. op: kiln_dist_op. */
kiln_status kiln__nccl_allreduce(void *nc, void *buf, int64_t count, kiln_dtype dt,
                                 kiln_dist_op op);
kiln_status kiln__nccl_broadcast(void *nc, void *buf, int64_t count, kiln_dtype dt, int root);

/* ---- collective.c: raw host buffers through MPI, and tensors ---- */
/* In place over host memory (MPI; identity for a world of one). dt: f32 f64 i32 i64 u8.
** AVG divides after the sum. */
kiln_status kiln__mpi_allreduce(const kiln_dist *d, void *buf, int64_t count, kiln_dtype dt,
                                kiln_dist_op op);
kiln_status kiln__mpi_broadcast(const kiln_dist *d, void *buf, int64_t count, kiln_dtype dt,
                                int root);
/* A nonblocking reduction in flight on d->bucket_comm (DDP's CPU buckets). */
typedef struct kiln__mpi_pending {
  void *reqs; /* MPI_Request[n] */
  int n;
  void *buf;
  int64_t count;
  kiln_dtype dt;
  double scale; /* applied after completion (AVG: 1 / world), 1 for none */
} kiln__mpi_pending;
/* Starts an in-place reduction of host memory on d->bucket_comm (done at once, with
** nothing pending, in a world of one). Calls on one kiln_dist match across ranks in
** issue order. buf must stay untouched until kiln__mpi_wait. */
kiln_status kiln__mpi_iallreduce(const kiln_dist *d, void *buf, int64_t count, kiln_dtype dt,
                                 kiln_dist_op op, kiln__mpi_pending *p);
/* Completes p (a no-op when nothing is pending) and applies its scale. */
kiln_status kiln__mpi_wait(kiln__mpi_pending *p);
/* MPI's error text for a return code, "op: text" in the last error. */
kiln_status kiln__mpi_fail(const char *op, int rc);
/* Where a collective on a tensor of (dev, dt) runs its buffer: dev itself when NCCL serves
** it, else the CPU; and in which dtype (f16/bf16 staged in f32 on the CPU). */
kiln_device kiln__dist_comm_device(const kiln_dist *d, kiln_device dev);
kiln_dtype kiln__dist_comm_dtype(kiln_device comm_dev, kiln_dtype dt);
/* Collectives on a contiguous buffer tensor already on its comm device in its comm dtype
** (what ddp.c's flat buckets are). */
kiln_status kiln__dist_allreduce_buffer(kiln_dist *d, kiln_tensor *buf, kiln_dist_op op);
/* The address of element 0 of t (device or host). */
void *kiln__dist_ptr(const kiln_tensor *t);
/* Checks op against dt ("AVG needs a floating dtype"). */
kiln_status kiln__dist_check_op(const char *what, kiln_dtype dt, kiln_dist_op op);

/* ---- ddp.c ---- */
/* Test hook: run the buckets (copy in, collective, copy back) even in a world of one,
** where kiln_ddp_sync_grads normally returns at once, so that a one-GPU machine can
** exercise the NCCL path. */
extern bool kiln__ddp_always_reduce;

#endif /* KILN_DIST_INT_H */
