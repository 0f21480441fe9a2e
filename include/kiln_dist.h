/*
** kiln_dist — data-parallel training over processes and GPUs, on MPI and NCCL.
**
** The same program runs as one process or as N, launched by `mpirun -np N ./train`. MPI
** starts the processes and bootstraps them; GPU collectives go through NCCL (one
** communicator per process, its id broadcast over MPI); CPU collectives are MPI's.
**
**   kiln_dist *d = kiln_dist_init(NULL);            // world 1 without mpirun
**   if (!d) { fprintf(stderr, "%s\n", kiln_last_error_message()); return 1; }
**   kiln_device dev = kiln_dist_device(d);          // cuda:<local rank>, or cpu
**   kiln_module *net = ...build on dev...;
**   kiln_ddp *ddp = kiln_ddp_new(d, net, NULL);     // broadcasts rank 0's parameters
**   kiln_dataset *shard = kiln_dist_shard_dataset(ds, kiln_dist_rank(d),
**                                                 kiln_dist_world_size(d), true, seed, false);
**   kiln_loader_opts o = kiln_loader_opts_default(); // shuffle off: the shard shuffles
**   o.batch_size = global_batch / kiln_dist_world_size(d);
**   kiln_loader *l = kiln_loader_new(shard, &o);
**   for (epoch ...) {
**     kiln_dist_shard_set_epoch(shard, epoch);      // before kiln_loader_epoch
**     kiln_loader_epoch(l, epoch);
**     ... per step: zero_grad, forward, kiln_backward, kiln_ddp_sync_grads(ddp),
**         kiln_optimizer_step ...
**     double loss = ...; kiln_dist_allreduce_scalar(d, &loss, KILN_DIST_AVG);
**     kiln_dist_printf(d, "epoch %d loss %.4f\n", epoch, loss);   // rank 0 only
**   }
**   kiln_ddp_free(ddp); kiln_dataset_free(shard); ...; kiln_dist_free(d);
**
** Every rank must make the same collective calls in the same order (kiln_dist_barrier,
** kiln_dist_allreduce*, kiln_dist_broadcast, kiln_ddp_new, kiln_ddp_sync_grads); a rank
** that skips one makes the others wait forever. When a rank hits an error it cannot share
** with the others, kiln_dist_abort() ends the whole job instead of letting it hang.
**
** A NULL kiln_dist is accepted by the query and collective helpers as a world of one
** (rank 0, every collective an identity), so code written for N processes also runs with
** no kiln_dist at all.
**
** Build: MPI is found by CMake (KILN_MPI=AUTO|ON|OFF; Debian: libopenmpi-dev), NCCL with
** the CUDA toolkit. Without MPI, kiln_dist_init still gives a world of one, and refuses
** (KILN_ERR_UNAVAILABLE) a process that mpirun started as one of several.
**
** Threads: call kiln_dist functions from one thread (the one that called kiln_dist_init);
** loader workers never call them.
*/
#ifndef KILN_DIST_H
#define KILN_DIST_H

#include "kiln.h"
#include "kiln_data.h"
#include "kiln_nn.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kiln_dist kiln_dist;

/* --------------------------------------------------------------------------------------
** The process group.
*/
typedef enum kiln_dist_device_mode {
  KILN_DIST_DEVICE_AUTO = 0, /* CUDA when every rank has a working GPU (kiln_device_best()
                                says cuda; KILN_DEVICE=cpu turns it off), else CPU */
  KILN_DIST_DEVICE_CPU,      /* CPU tensors, MPI collectives */
  KILN_DIST_DEVICE_CUDA      /* cuda:<local rank>, NCCL collectives (error when absent) */
} kiln_dist_device_mode;

typedef struct kiln_dist_opts {
  kiln_dist_device_mode device;
  int expected_world_size; /* 0: any; else init fails unless launched with exactly this */
  bool skip_build_check;   /* true: do not compare kiln builds across ranks */
} kiln_dist_opts;

/* device AUTO, any world size, builds compared. A zero-filled struct is the same. */
KILN_API kiln_dist_opts kiln_dist_opts_default(void);

/* Whether this kiln was built with MPI / with NCCL (then CUDA too). */
KILN_API bool kiln_dist_mpi_built(void);
KILN_API bool kiln_dist_nccl_built(void);

/* Joins the job: initialises MPI (unless the program already did; then kiln leaves it to
** the program to finalise), reads rank and world size from MPI_COMM_WORLD and the local
** rank and size from MPI_Comm_split_type(MPI_COMM_TYPE_SHARED), checks on every rank that
** all ranks run the same kiln build (kiln_version() and kiln_build_info() gathered from
** all) and, on CUDA, that this host has a GPU for each of its ranks, then makes the NCCL
** communicator (ncclGetUniqueId on rank 0, MPI_Bcast, ncclCommInitRank on
** cuda:<local rank>, which also becomes the CUDA device of the thread). On success it sets
** KILN_DEVICE in the environment to this rank's device ("cuda:1", "cpu"), so that
** kiln_device_best() in code written for one process picks the same. Started without
** mpirun it is a world of one (MPI's singleton mode). opts NULL: kiln_dist_opts_default().
** Every check is agreed on by all ranks before anything that could hang, so a bad launch
** fails on every rank with the same message.
** Returns the process group (free with kiln_dist_free), or NULL with:
**   KILN_ERR_STATE        a kiln_dist is already live in this process, or MPI was already
**                         finalised (MPI cannot start twice in one process);
**   KILN_ERR_UNAVAILABLE  built without MPI but launched as one of several ranks; MPI_Init
**                         failed; device CUDA asked for in a build without CUDA or NCCL,
**                         or with no working GPU on some rank;
**   KILN_ERR_INVALID_ARGUMENT  the world size is not opts->expected_world_size; a bad mode;
**   KILN_ERR_DEVICE       more ranks on a host than it has GPUs (names host and counts);
**   KILN_ERR_STATE        ranks run different kiln builds (names the ranks and builds);
**   KILN_ERR_INTERNAL     an MPI or NCCL call failed (its message included). */
KILN_API kiln_dist *kiln_dist_init(const kiln_dist_opts *opts);
/* Destroys the NCCL communicator and, when kiln_dist_init started MPI, finalises it. A
** collective: every rank calls it. NULL is a no-op. */
KILN_API void kiln_dist_free(kiln_dist *d);
/* Ends every process of the job now (MPI_Abort with code), after printing the last error
** on stderr with this rank's number. For an error one rank cannot recover from while the
** others wait in a collective. Without MPI (or d NULL and MPI not started) it exits. */
KILN_API void kiln_dist_abort(kiln_dist *d, int code);

/* This process's rank in [0, world), 0 for NULL. */
KILN_API int kiln_dist_rank(const kiln_dist *d);
/* Number of processes, 1 for NULL. */
KILN_API int kiln_dist_world_size(const kiln_dist *d);
/* Rank among the processes on this host, and their number (0 and 1 for NULL). */
KILN_API int kiln_dist_local_rank(const kiln_dist *d);
KILN_API int kiln_dist_local_size(const kiln_dist *d);
/* true on rank 0 (and for NULL): the rank that prints, saves checkpoints, evaluates. */
KILN_API bool kiln_dist_is_main(const kiln_dist *d);
/* The device this rank trains on: cuda:<local rank> in CUDA mode, else cpu (cpu for
** NULL). */
KILN_API kiln_device kiln_dist_device(const kiln_dist *d);
/* true when GPU collectives go through NCCL (CUDA mode). */
KILN_API bool kiln_dist_uses_nccl(const kiln_dist *d);

/* printf on rank 0 only (stdout, flushed); other ranks print nothing. Returns what printf
** returns on rank 0, 0 elsewhere. */
KILN_API int kiln_dist_printf(const kiln_dist *d, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* --------------------------------------------------------------------------------------
** Collectives. All ranks call them in the same order with the same shapes and dtypes.
*/
typedef enum kiln_dist_op {
  KILN_DIST_SUM = 0,
  KILN_DIST_AVG, /* sum / world size (floating dtypes only) */
  KILN_DIST_MAX,
  KILN_DIST_MIN
} kiln_dist_op;

/* Waits until every rank has called it (host-side: queued device work is not waited
** for; call kiln_device_synchronize first for that). KILN_ERR_INTERNAL on MPI failure. */
KILN_API kiln_status kiln_dist_barrier(kiln_dist *d);
/* Reduces one double over all ranks in place (MPI, host): for averaging a loss or an
** accuracy across ranks. KILN_ERR_INVALID_ARGUMENT (NULL v, bad op). */
KILN_API kiln_status kiln_dist_allreduce_scalar(kiln_dist *d, double *v, kiln_dist_op op);
/* Gathers one double from every rank: out[r] gets rank r's v (out has world size
** entries). */
KILN_API kiln_status kiln_dist_allgather_scalar(kiln_dist *d, double v, double *out);
/* Reduces t in place over all ranks (element-wise). CUDA tensors go through NCCL on its
** own stream, ordered after the work queued on t and before the work queued after the
** call, without waiting on the host; CPU tensors (and CUDA ones when NCCL is off) through
** MPI_Allreduce. f16/bf16 are reduced in f32 on the CPU path. Any strides (a strided
** tensor goes through a contiguous copy). Dtypes: f32 f64 f16 bf16 i32 i64 u8 (AVG:
** floating only). KILN_ERR_DTYPE, KILN_ERR_INVALID_ARGUMENT, KILN_ERR_INTERNAL. */
KILN_API kiln_status kiln_dist_allreduce(kiln_dist *d, kiln_tensor *t, kiln_dist_op op);
/* Copies root's t into t on every rank (in place; same rules as kiln_dist_allreduce). */
KILN_API kiln_status kiln_dist_broadcast(kiln_dist *d, kiln_tensor *t, int root);

/* --------------------------------------------------------------------------------------
** Data parallelism for a module (PyTorch's DistributedDataParallel, without its backward
** hooks): every rank holds the whole model, trains on its shard of each global batch, and
** averages gradients before the optimizer step, so all ranks take the same step.
**
** Gradients are all-reduced in buckets: the gradients of consecutive parameters (in
** reverse registration order, the order backward produces them; grouped by device and
** dtype) are copied into one flat buffer of about bucket_mb, reduced with one collective
** and copied back.
**
** Overlap (on by default): the wrapper puts a grad-ready hook (kiln_set_grad_ready_hook)
** on every trainable parameter, and a bucket whose gradients are all complete is launched
** from inside kiln_backward, while the rest of backward runs. On CUDA the collective is
** queued on NCCL's stream and runs beside the remaining backward kernels; on the CPU it is
** an MPI_Iallreduce on the wrapper's own duplicate of MPI_COMM_WORLD (so it never meets
** another collective), completed in the sync. kiln_ddp_sync_grads then launches the
** buckets the hooks did not and copies all results back. Buckets always start in one
** order on every rank, so a parameter that gets no gradient on some rank is fine. One
** caveat on CUDA: a GPU collective of the program's own (kiln_dist_allreduce of a CUDA
** tensor) between backward and the sync shares NCCL's communicator with the buckets; it
** is safe when every rank's backward reaches the same parameters, else make it after the
** sync. The hooks replace any other grad-ready hook on those parameters.
**
** Gradient accumulation (several backward passes per optimizer step): call
** kiln_ddp_no_sync(ddp, true) before the backward passes of all micro-batches but the
** last, and kiln_ddp_no_sync(ddp, false) before the last one. Without it the result is
** still right (a gradient that grows after its bucket was sent makes sync reduce every
** bucket again), only the early communication is wasted.
**
** A parameter without a gradient on some rank (not used in that rank's forward) counts as
** zeros there; if no rank has a gradient for it, it keeps none on every rank (the
** optimizer skips it everywhere). Frozen parameters (requires_grad off) are left alone.
*/
typedef struct kiln_ddp kiln_ddp;

typedef struct kiln_ddp_opts {
  double bucket_mb;       /* bucket capacity in MiB; 0 means 25 */
  bool no_broadcast;      /* true: skip broadcasting rank 0's parameters and buffers at
                             kiln_ddp_new (the program made them equal itself) */
  bool sum;               /* true: sum gradients instead of averaging them */
  bool no_overlap;        /* true: no hooks; every bucket is reduced in kiln_ddp_sync_grads */
} kiln_ddp_opts;

/* 25 MiB buckets, broadcast at start, average, overlap. A zero-filled struct is the same. */
KILN_API kiln_ddp_opts kiln_ddp_opts_default(void);

/* Wraps m (borrowed: m and d must outlive the wrapper). Checks that every rank has the
** same parameters (count, shapes, dtypes: a hash compared across ranks), then copies rank
** 0's parameters and persistent buffers to all ranks. The module is read through at every
** sync, so kiln_module_to()/kiln_module_to_dtype() afterwards are fine (the buckets are
** rebuilt when the parameters change). A collective. NULL with KILN_ERR_INVALID_ARGUMENT
** (NULL m, bucket_mb < 0), KILN_ERR_STATE (ranks hold different models: names the first
** mismatch on this rank), KILN_ERR_OOM, or a collective's error. d NULL: a world of one. */
KILN_API kiln_ddp *kiln_ddp_new(kiln_dist *d, kiln_module *m, const kiln_ddp_opts *opts);
/* Averages (or sums) every gradient over all ranks, in place: call after kiln_backward,
** before kiln_optimizer_step (and before gradient clipping, so every rank clips the same
** gradients). A collective. Grad mode may be on. Errors: a collective's, KILN_ERR_OOM,
** KILN_ERR_STATE (ranks' parameters changed differently). */
KILN_API kiln_status kiln_ddp_sync_grads(kiln_ddp *ddp);
/* While on, backward passes start no communication (the micro-batches of gradient
** accumulation before the last); kiln_ddp_sync_grads still reduces everything when called.
** Not a collective; set it the same way on every rank. KILN_ERR_INVALID_ARGUMENT for NULL. */
KILN_API kiln_status kiln_ddp_no_sync(kiln_ddp *ddp, bool on);
/* How many buckets the last kiln_ddp_sync_grads found already launched during backward
** (overlap at work; 0 with no_overlap, in a world of one, or after a dirty round). -1 for
** NULL. */
KILN_API int kiln_ddp_num_overlapped(const kiln_ddp *ddp);
/* Copies rank 0's parameters and persistent buffers to all ranks again (after loading a
** checkpoint on rank 0 only, say). A collective. */
KILN_API kiln_status kiln_ddp_broadcast_params(kiln_ddp *ddp);
/* The wrapped module (borrowed). */
KILN_API kiln_module *kiln_ddp_module(const kiln_ddp *ddp);
/* Number of gradient buckets as last built (-1 for NULL), and bucket b's number of
** parameters and bytes (for logs and tests; 0 when out of range). */
KILN_API int kiln_ddp_num_buckets(const kiln_ddp *ddp);
KILN_API int kiln_ddp_bucket_params(const kiln_ddp *ddp, int b);
KILN_API int64_t kiln_ddp_bucket_bytes(const kiln_ddp *ddp, int b);
/* Frees the wrapper (not the module; no collective) and removes its hooks. NULL is a
** no-op. */
KILN_API void kiln_ddp_free(kiln_ddp *ddp);

/* --------------------------------------------------------------------------------------
** Distributed sampling (PyTorch's DistributedSampler rules). For n samples and world
** ranks:
**   - each epoch's order is kiln_randperm(n) from a generator seeded seed + epoch when
**     shuffle is on (the same on every rank, and the same order the loader itself would
**     use), else 0, 1, ..., n-1;
**   - drop_last false: num_samples = ceil(n / world); the order is padded to
**     num_samples * world by repeating it from its start (as often as needed), so every
**     rank gets the same count and a few samples are seen twice per epoch;
**   - drop_last true: num_samples = floor(n / world); the tail of the order is dropped;
**   - rank r takes positions r, r + world, r + 2 world, ... of that order.
** So the shards of one epoch are disjoint (but for the padding), and with a loader of
** batch size B on each rank, step s of all ranks together covers positions
** [s B world, (s+1) B world) of the order: a global batch of B * world.
*/
/* Samples per rank per epoch (rules above); -1 with KILN_ERR_INVALID_ARGUMENT for n < 0 or
** world < 1. */
KILN_API int64_t kiln_dist_shard_num_samples(int64_t n, int world, bool drop_last);
/* Writes rank's dataset indices for the epoch (kiln_dist_shard_num_samples of them) into
** out. KILN_ERR_INVALID_ARGUMENT (rank outside [0, world), NULL out with a non-empty
** shard), KILN_ERR_OOM. */
KILN_API kiln_status kiln_dist_shard_indices(int64_t n, int rank, int world, bool shuffle,
                                             uint64_t seed, uint64_t epoch, bool drop_last,
                                             int64_t *out);
/* A view of base whose item i is base's item indices[i] of the current epoch's shard
** (epoch 0 until kiln_dist_shard_set_epoch). Give it to a loader with shuffle off (the
** shard does the shuffling). Samples are read through base's get (for a tensor dataset:
** one row copy per sample). base is borrowed and must outlive the view; free the view
** with kiln_dataset_free. base's length is read once, here. NULL with
** KILN_ERR_INVALID_ARGUMENT (NULL base, bad rank/world) or KILN_ERR_OOM. */
KILN_API kiln_dataset *kiln_dist_shard_dataset(kiln_dataset *base, int rank, int world,
                                               bool shuffle, uint64_t seed, bool drop_last);
/* Reshuffles the shard for epoch (the same epoch on every rank). Call it before
** kiln_loader_epoch; it is safe while loader workers still read the view. KILN_ERR_
** INVALID_ARGUMENT when ds is not a shard view, KILN_ERR_OOM. */
KILN_API kiln_status kiln_dist_shard_set_epoch(kiln_dataset *ds, uint64_t epoch);

#ifdef __cplusplus
}
#endif
#endif /* KILN_DIST_H */
