/*
** Collectives: raw host buffers through MPI, scalars for logging, and tensors in place
** (NCCL for CUDA tensors on the rank's GPU, MPI for everything else, through a staging
** copy when the tensor is strided, on another device, or 16-bit on the CPU path).
*/
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "dist_int.h"
#include "ext/kiln_ext.h"

#if KILN__DIST_MPI
#include <mpi.h>
#endif

kiln_status kiln__mpi_fail(const char *op, int rc) {
#if KILN__DIST_MPI
  char buf[MPI_MAX_ERROR_STRING] = "";
  int len = 0;
  MPI_Error_string(rc, buf, &len);
  return kiln_set_error(KILN_ERR_INTERNAL, "%s failed: %s (MPI error %d)", op, buf, rc);
#else
  return kiln_set_error(KILN_ERR_INTERNAL, "%s failed (error %d)", op, rc);
#endif
}

static bool op_valid(kiln_dist_op op) { return (int)op >= KILN_DIST_SUM && (int)op <= KILN_DIST_MIN; }

kiln_status kiln__dist_check_op(const char *what, kiln_dtype dt, kiln_dist_op op) {
  if (!op_valid(op))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: unknown reduction %d", what, (int)op);
  switch (dt) {
  case KILN_F32: case KILN_F64: case KILN_F16: case KILN_BF16: return KILN_OK;
  case KILN_I32: case KILN_I64: case KILN_U8:
    if (op == KILN_DIST_AVG)
      return kiln_set_error(KILN_ERR_DTYPE, "%s: KILN_DIST_AVG needs a floating dtype, not %s",
                            what, kiln_dtype_name(dt));
    return KILN_OK;
  default:
    return kiln_set_error(KILN_ERR_DTYPE, "%s: dtype %s cannot be reduced", what,
                          kiln_dtype_name(dt));
  }
}

void *kiln__dist_ptr(const kiln_tensor *t) { return kiln__tensor_data(t); }

#if KILN__DIST_MPI
static MPI_Datatype mpi_type(kiln_dtype dt) {
  switch (dt) {
  case KILN_F32: return MPI_FLOAT;
  case KILN_F64: return MPI_DOUBLE;
  case KILN_I32: return MPI_INT32_T;
  case KILN_I64: return MPI_INT64_T;
  case KILN_U8: return MPI_UINT8_T;
  default: return MPI_DATATYPE_NULL;
  }
}
static MPI_Op mpi_op(kiln_dist_op op) {
  switch (op) {
  case KILN_DIST_MAX: return MPI_MAX;
  case KILN_DIST_MIN: return MPI_MIN;
  default: return MPI_SUM;
  }
}
/* MPI counts are int: big buffers go in pieces of 2^30 elements. */
#define KILN__MPI_CHUNK (INT64_C(1) << 30)

static void scale_host(void *buf, int64_t count, kiln_dtype dt, double s) {
  if (dt == KILN_F32) {
    float *p = buf, f = (float)s;
    for (int64_t i = 0; i < count; i++) p[i] *= f;
  } else if (dt == KILN_F64) {
    double *p = buf;
    for (int64_t i = 0; i < count; i++) p[i] *= s;
  }
}
#endif

kiln_status kiln__mpi_allreduce(const kiln_dist *d, void *buf, int64_t count, kiln_dtype dt,
                                kiln_dist_op op) {
  if (!d || d->world == 1 || count == 0) return KILN_OK;
#if KILN__DIST_MPI
  MPI_Datatype ty = mpi_type(dt);
  if (ty == MPI_DATATYPE_NULL)
    return kiln_set_error(KILN_ERR_INTERNAL, "kiln__mpi_allreduce: no MPI type for %s",
                          kiln_dtype_name(dt));
  size_t es = kiln_dtype_size(dt);
  for (int64_t at = 0; at < count; at += KILN__MPI_CHUNK) {
    int64_t n = count - at < KILN__MPI_CHUNK ? count - at : KILN__MPI_CHUNK;
    int rc = MPI_Allreduce(MPI_IN_PLACE, (char *)buf + (size_t)at * es, (int)n, ty, mpi_op(op),
                           MPI_COMM_WORLD);
    if (rc != MPI_SUCCESS) return kiln__mpi_fail("kiln_dist_allreduce: MPI_Allreduce", rc);
  }
  if (op == KILN_DIST_AVG) scale_host(buf, count, dt, 1.0 / d->world);
  return KILN_OK;
#else
  KILN__UNUSED(buf);
  KILN__UNUSED(dt);
  KILN__UNUSED(op);
  return kiln_set_error(KILN_ERR_UNAVAILABLE, "kiln was built without MPI");
#endif
}

kiln_status kiln__mpi_iallreduce(const kiln_dist *d, void *buf, int64_t count, kiln_dtype dt,
                                 kiln_dist_op op, kiln__mpi_pending *p) {
  memset(p, 0, sizeof *p);
  if (!d || d->world == 1 || count == 0) return KILN_OK;
#if KILN__DIST_MPI
  MPI_Datatype ty = mpi_type(dt);
  if (ty == MPI_DATATYPE_NULL || !d->bucket_comm)
    return kiln_set_error(KILN_ERR_INTERNAL, "kiln__mpi_iallreduce: no MPI type for %s",
                          kiln_dtype_name(dt));
  int n = (int)((count + KILN__MPI_CHUNK - 1) / KILN__MPI_CHUNK);
  MPI_Request *reqs = malloc(sizeof *reqs * (size_t)n);
  if (!reqs) return kiln_set_error(KILN_ERR_OOM, "kiln_ddp: out of memory");
  size_t es = kiln_dtype_size(dt);
  for (int i = 0; i < n; i++) {
    int64_t at = (int64_t)i * KILN__MPI_CHUNK;
    int64_t k = count - at < KILN__MPI_CHUNK ? count - at : KILN__MPI_CHUNK;
    int rc = MPI_Iallreduce(MPI_IN_PLACE, (char *)buf + (size_t)at * es, (int)k, ty, mpi_op(op),
                            *(MPI_Comm *)d->bucket_comm, &reqs[i]);
    if (rc != MPI_SUCCESS) {
      /* the ones started must still complete before buf is reused */
      MPI_Waitall(i, reqs, MPI_STATUSES_IGNORE);
      free(reqs);
      return kiln__mpi_fail("kiln_ddp: MPI_Iallreduce", rc);
    }
  }
  p->reqs = reqs;
  p->n = n;
  p->buf = buf;
  p->count = count;
  p->dt = dt;
  p->scale = op == KILN_DIST_AVG ? 1.0 / d->world : 1.0;
  return KILN_OK;
#else
  KILN__UNUSED(buf);
  KILN__UNUSED(dt);
  KILN__UNUSED(op);
  return kiln_set_error(KILN_ERR_UNAVAILABLE, "kiln was built without MPI");
#endif
}

kiln_status kiln__mpi_wait(kiln__mpi_pending *p) {
  if (!p->reqs) return KILN_OK;
#if KILN__DIST_MPI
  int rc = MPI_Waitall(p->n, (MPI_Request *)p->reqs, MPI_STATUSES_IGNORE);
  free(p->reqs);
  p->reqs = NULL;
  if (rc != MPI_SUCCESS) return kiln__mpi_fail("kiln_ddp: MPI_Waitall", rc);
  if (p->scale != 1.0) scale_host(p->buf, p->count, p->dt, p->scale);
  return KILN_OK;
#else
  return KILN_OK;
#endif
}

kiln_status kiln__mpi_broadcast(const kiln_dist *d, void *buf, int64_t count, kiln_dtype dt,
                                int root) {
  if (!d || d->world == 1 || count == 0) return KILN_OK;
#if KILN__DIST_MPI
  /* bytes: a broadcast does no arithmetic, so any dtype (f16 too) goes as it is */
  size_t bytes = (size_t)count * kiln_dtype_size(dt);
  for (size_t at = 0; at < bytes; at += (size_t)KILN__MPI_CHUNK) {
    size_t n = bytes - at < (size_t)KILN__MPI_CHUNK ? bytes - at : (size_t)KILN__MPI_CHUNK;
    int rc = MPI_Bcast((char *)buf + at, (int)n, MPI_BYTE, root, MPI_COMM_WORLD);
    if (rc != MPI_SUCCESS) return kiln__mpi_fail("kiln_dist_broadcast: MPI_Bcast", rc);
  }
  return KILN_OK;
#else
  KILN__UNUSED(buf);
  KILN__UNUSED(dt);
  KILN__UNUSED(root);
  return kiln_set_error(KILN_ERR_UNAVAILABLE, "kiln was built without MPI");
#endif
}

kiln_device kiln__dist_comm_device(const kiln_dist *d, kiln_device dev) {
  if (dev.type == KILN_DEVICE_CUDA && d && d->nccl && kiln_device_equal(dev, d->device)) return dev;
  return kiln_device_cpu();
}

kiln_dtype kiln__dist_comm_dtype(kiln_device comm_dev, kiln_dtype dt) {
  /* MPI has no 16-bit floats: reduce them in f32 (also more exact). NCCL has both. */
  if (comm_dev.type == KILN_DEVICE_CPU && (dt == KILN_F16 || dt == KILN_BF16)) return KILN_F32;
  return dt;
}

kiln_status kiln__dist_allreduce_buffer(kiln_dist *d, kiln_tensor *buf, kiln_dist_op op) {
  int64_t n = kiln_numel(buf);
  if (!d || n == 0) return KILN_OK;
  if (kiln_device_of(buf).type == KILN_DEVICE_CUDA) {
#if KILN__DIST_NCCL
    return kiln__nccl_allreduce(d->nccl, kiln__dist_ptr(buf), n, kiln_dtype_of(buf), op);
#else
    return kiln_set_error(KILN_ERR_INTERNAL, "kiln_dist: a CUDA buffer without NCCL");
#endif
  }
  return kiln__mpi_allreduce(d, kiln__dist_ptr(buf), n, kiln_dtype_of(buf), op);
}

static kiln_status bcast_buffer(kiln_dist *d, kiln_tensor *buf, int root) {
  int64_t n = kiln_numel(buf);
  if (kiln_device_of(buf).type == KILN_DEVICE_CUDA) {
#if KILN__DIST_NCCL
    return kiln__nccl_broadcast(d->nccl, kiln__dist_ptr(buf), n, kiln_dtype_of(buf), root);
#else
    return kiln_set_error(KILN_ERR_INTERNAL, "kiln_dist: a CUDA buffer without NCCL");
#endif
  }
  return kiln__mpi_broadcast(d, kiln__dist_ptr(buf), n, kiln_dtype_of(buf), root);
}

/* Runs fn on t directly when it already is a buffer the transport takes, else on a
** contiguous copy on the comm device in the comm dtype, copied back after. */
static kiln_status on_tensor(kiln_dist *d, kiln_tensor *t, const char *what, bool reduce,
                             kiln_dist_op op, int root) {
  kiln_device dev = kiln_device_of(t);
  kiln_device cdev = kiln__dist_comm_device(d, dev);
  /* a world of one has nothing to exchange; NCCL still runs (it is what a one-GPU test of
  ** the GPU path can exercise) */
  if (d->world == 1 && cdev.type == KILN_DEVICE_CPU) return KILN_OK;
  kiln_dtype cdt = reduce ? kiln__dist_comm_dtype(cdev, kiln_dtype_of(t)) : kiln_dtype_of(t);
  if (kiln_is_contiguous(t) && kiln_device_equal(dev, cdev) && cdt == kiln_dtype_of(t))
    return reduce ? kiln__dist_allreduce_buffer(d, t, op) : bcast_buffer(d, t, root);
  bool prev = kiln_set_grad_enabled(false); /* t may be a parameter */
  kiln_scope_begin();
  kiln_tensor *buf = kiln_empty(kiln_ndim(t), kiln_shape(t), cdt, cdev);
  kiln_status st = buf ? kiln_copy_(buf, t) : kiln_last_error();
  /* the host transport reads memory the device may still be writing */
  if (st == KILN_OK && dev.type != KILN_DEVICE_CPU && cdev.type == KILN_DEVICE_CPU)
    st = kiln_device_synchronize(dev);
  if (st == KILN_OK)
    st = reduce ? kiln__dist_allreduce_buffer(d, buf, op) : bcast_buffer(d, buf, root);
  if (st == KILN_OK) st = kiln_copy_(t, buf);
  if (st != KILN_OK && kiln_last_error() == KILN_OK)
    kiln_set_error(st, "%s: staging copy failed", what);
  kiln_scope_end();
  kiln_set_grad_enabled(prev);
  return st;
}

kiln_status kiln_dist_allreduce(kiln_dist *d, kiln_tensor *t, kiln_dist_op op) {
  if (!t) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_dist_allreduce: NULL tensor");
  kiln_status st = kiln__dist_check_op("kiln_dist_allreduce", kiln_dtype_of(t), op);
  if (st != KILN_OK || !d || kiln_numel(t) == 0) return st;
  return on_tensor(d, t, "kiln_dist_allreduce", true, op, 0);
}

kiln_status kiln_dist_broadcast(kiln_dist *d, kiln_tensor *t, int root) {
  if (!t) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_dist_broadcast: NULL tensor");
  int world = kiln_dist_world_size(d);
  if (root < 0 || root >= world)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                          "kiln_dist_broadcast: root %d outside [0, %d)", root, world);
  if (!d || kiln_numel(t) == 0) return KILN_OK;
  return on_tensor(d, t, "kiln_dist_broadcast", false, KILN_DIST_SUM, root);
}

kiln_status kiln_dist_barrier(kiln_dist *d) {
  if (!d || d->world == 1) return KILN_OK;
#if KILN__DIST_MPI
  int rc = MPI_Barrier(MPI_COMM_WORLD);
  return rc == MPI_SUCCESS ? KILN_OK : kiln__mpi_fail("kiln_dist_barrier: MPI_Barrier", rc);
#else
  return kiln_set_error(KILN_ERR_UNAVAILABLE, "kiln was built without MPI");
#endif
}

kiln_status kiln_dist_allreduce_scalar(kiln_dist *d, double *v, kiln_dist_op op) {
  if (!v) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_dist_allreduce_scalar: NULL value");
  if (!op_valid(op))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_dist_allreduce_scalar: unknown "
                                                     "reduction %d", (int)op);
  return kiln__mpi_allreduce(d, v, 1, KILN_F64, op);
}

kiln_status kiln_dist_allgather_scalar(kiln_dist *d, double v, double *out) {
  if (!out) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_dist_allgather_scalar: NULL out");
  if (!d || d->world == 1) {
    out[0] = v;
    return KILN_OK;
  }
#if KILN__DIST_MPI
  int rc = MPI_Allgather(&v, 1, MPI_DOUBLE, out, 1, MPI_DOUBLE, MPI_COMM_WORLD);
  return rc == MPI_SUCCESS ? KILN_OK : kiln__mpi_fail("kiln_dist_allgather_scalar: MPI_Allgather", rc);
#else
  return kiln_set_error(KILN_ERR_UNAVAILABLE, "kiln was built without MPI");
#endif
}
