/*
** The GPU transport: one NCCL communicator per process on its own CUDA stream. Each
** collective is ordered with the rest of kiln's work by two events: the NCCL stream
** waits for everything kiln queued on its stream so far (the gradients being written),
** and kiln's stream waits for the collective before what comes after it (copying the
** results back, the optimizer step). The host never waits.
*/
#include "dist_int.h"

#if KILN__DIST_NCCL
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>
/* nccl.h declares a few functions with () (not prototypes in C before C23) */
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstrict-prototypes"
#endif
#include <nccl.h>
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

#include "backend/cuda/cuda_api.h"
#include "kiln_int.h"

typedef struct kiln__nccl {
  ncclComm_t comm;
  cudaStream_t stream;
  cudaEvent_t before, after;
  int device;
} kiln__nccl;

static kiln_status nccl_fail(const char *what, ncclResult_t r) {
  return kiln_set_error(KILN_ERR_INTERNAL, "%s failed: %s (NCCL %d.%d.%d)", what,
                        ncclGetErrorString(r), NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH);
}
static kiln_status cuda_fail(const char *what, cudaError_t e) {
  return kiln_set_error(KILN_ERR_INTERNAL, "%s failed: %s", what, cudaGetErrorString(e));
}

size_t kiln__nccl_id_size(void) { return sizeof(ncclUniqueId); }

kiln_status kiln__nccl_unique_id(void *id) {
  ncclUniqueId u;
  ncclResult_t r = ncclGetUniqueId(&u);
  if (r != ncclSuccess) return nccl_fail("kiln_dist_init: ncclGetUniqueId", r);
  memcpy(id, &u, sizeof u);
  return KILN_OK;
}

void *kiln__nccl_new(const kiln_dist *d, const void *id, size_t id_size) {
  if (id_size != sizeof(ncclUniqueId))
    KILN__FAIL_NULL(KILN_ERR_INTERNAL, "kiln_dist_init: NCCL id of %zu bytes", id_size);
  kiln__nccl *nc = calloc(1, sizeof *nc);
  if (!nc) KILN__FAIL_NULL(KILN_ERR_OOM, "kiln_dist_init: out of memory");
  nc->device = d->device.index;
  /* kiln's stream first: it sets up the device's context as the backend wants it */
  if (!kiln__cuda_stream(nc->device)) {
    free(nc);
    return NULL;
  }
  cudaError_t e = cudaSetDevice(nc->device);
  if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&nc->stream, cudaStreamNonBlocking);
  if (e == cudaSuccess) e = cudaEventCreateWithFlags(&nc->before, cudaEventDisableTiming);
  if (e == cudaSuccess) e = cudaEventCreateWithFlags(&nc->after, cudaEventDisableTiming);
  if (e != cudaSuccess) {
    cuda_fail("kiln_dist_init: NCCL stream setup", e);
    kiln__nccl_free(nc);
    return NULL;
  }
  ncclUniqueId u;
  memcpy(&u, id, sizeof u);
  ncclResult_t r = ncclCommInitRank(&nc->comm, d->world, u, d->rank);
  if (r != ncclSuccess) {
    nccl_fail("kiln_dist_init: ncclCommInitRank", r);
    nc->comm = NULL;
    kiln__nccl_free(nc);
    return NULL;
  }
  return nc;
}

void kiln__nccl_free(void *p) {
  kiln__nccl *nc = p;
  if (!nc) return;
  if (nc->stream) cudaStreamSynchronize(nc->stream);
  if (nc->comm) ncclCommDestroy(nc->comm);
  if (nc->before) cudaEventDestroy(nc->before);
  if (nc->after) cudaEventDestroy(nc->after);
  if (nc->stream) cudaStreamDestroy(nc->stream);
  free(nc);
}

static bool nccl_type(kiln_dtype dt, ncclDataType_t *out) {
  switch (dt) {
  case KILN_F32: *out = ncclFloat32; return true;
  case KILN_F64: *out = ncclFloat64; return true;
  case KILN_F16: *out = ncclFloat16; return true;
  case KILN_BF16: *out = ncclBfloat16; return true;
  case KILN_I32: *out = ncclInt32; return true;
  case KILN_I64: *out = ncclInt64; return true;
  case KILN_U8: *out = ncclUint8; return true;
  default: return false;
  }
}

/* The NCCL stream waits for kiln's; returns kiln's stream. */
static kiln_status enter(kiln__nccl *nc, cudaStream_t *kst) {
  *kst = (cudaStream_t)kiln__cuda_stream(nc->device);
  if (!*kst) return kiln_last_error();
  cudaError_t e = cudaSetDevice(nc->device);
  if (e == cudaSuccess) e = cudaEventRecord(nc->before, *kst);
  if (e == cudaSuccess) e = cudaStreamWaitEvent(nc->stream, nc->before, 0);
  return e == cudaSuccess ? KILN_OK : cuda_fail("kiln_dist: ordering the NCCL stream", e);
}
/* kiln's stream waits for the collective. */
static kiln_status leave(kiln__nccl *nc, cudaStream_t kst) {
  cudaError_t e = cudaEventRecord(nc->after, nc->stream);
  if (e == cudaSuccess) e = cudaStreamWaitEvent(kst, nc->after, 0);
  return e == cudaSuccess ? KILN_OK : cuda_fail("kiln_dist: ordering kiln's stream", e);
}

kiln_status kiln__nccl_allreduce(void *p, void *buf, int64_t count, kiln_dtype dt,
                                 kiln_dist_op op) {
  kiln__nccl *nc = p;
  ncclDataType_t ty;
  if (!nccl_type(dt, &ty))
    return kiln_set_error(KILN_ERR_DTYPE, "kiln_dist_allreduce: NCCL has no %s", kiln_dtype_name(dt));
  ncclRedOp_t rop = op == KILN_DIST_AVG ? ncclAvg : op == KILN_DIST_MAX ? ncclMax
                    : op == KILN_DIST_MIN ? ncclMin : ncclSum;
  cudaStream_t kst;
  kiln_status st = enter(nc, &kst);
  if (st != KILN_OK) return st;
  ncclResult_t r = ncclAllReduce(buf, buf, (size_t)count, ty, rop, nc->comm, nc->stream);
  if (r != ncclSuccess) return nccl_fail("kiln_dist_allreduce: ncclAllReduce", r);
  return leave(nc, kst);
}

kiln_status kiln__nccl_broadcast(void *p, void *buf, int64_t count, kiln_dtype dt, int root) {
  kiln__nccl *nc = p;
  cudaStream_t kst;
  kiln_status st = enter(nc, &kst);
  if (st != KILN_OK) return st;
  /* bytes: no arithmetic, so every dtype goes */
  size_t bytes = (size_t)count * kiln_dtype_size(dt);
  ncclResult_t r = ncclBroadcast(buf, buf, bytes, ncclUint8, root, nc->comm, nc->stream);
  if (r != ncclSuccess) return nccl_fail("kiln_dist_broadcast: ncclBroadcast", r);
  return leave(nc, kst);
}

#else
/* Built without NCCL: this unit is empty (ISO C wants a declaration). */
typedef int kiln__dist_no_nccl;
#endif
