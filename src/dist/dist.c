/*
** The process group: MPI start-up, rank and host topology, launch checks, the NCCL
** communicator, rank-0 printing. Built with or without MPI: without it a process is a
** world of one and a launch of several is refused with a message saying why.
*/
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dist_int.h"
#include "ext/kiln_ext.h"

#if KILN__DIST_MPI
#include <mpi.h>
#endif

/* One kiln_dist per process: MPI_COMM_WORLD is one, and MPI starts once. */
static bool g_live;
/* kiln_dist_init called MPI_Init (so kiln_dist_free finalises it). */
#if KILN__DIST_MPI
static bool g_mpi_owned;
#endif

kiln_dist_opts kiln_dist_opts_default(void) {
  kiln_dist_opts o;
  memset(&o, 0, sizeof o);
  o.device = KILN_DIST_DEVICE_AUTO;
  return o;
}

bool kiln_dist_mpi_built(void) { return KILN__DIST_MPI; }
bool kiln_dist_nccl_built(void) { return KILN__DIST_NCCL; }

int kiln_dist_rank(const kiln_dist *d) { return d ? d->rank : 0; }
int kiln_dist_world_size(const kiln_dist *d) { return d ? d->world : 1; }
int kiln_dist_local_rank(const kiln_dist *d) { return d ? d->local_rank : 0; }
int kiln_dist_local_size(const kiln_dist *d) { return d ? d->local_size : 1; }
bool kiln_dist_is_main(const kiln_dist *d) { return !d || d->rank == 0; }
kiln_device kiln_dist_device(const kiln_dist *d) { return d ? d->device : kiln_device_cpu(); }
bool kiln_dist_uses_nccl(const kiln_dist *d) { return d && d->nccl; }

int kiln_dist_printf(const kiln_dist *d, const char *fmt, ...) {
  if (!kiln_dist_is_main(d) || !fmt) return 0;
  va_list ap;
  va_start(ap, fmt);
  int n = vprintf(fmt, ap);
  va_end(ap);
  fflush(stdout);
  return n;
}

#if !KILN__DIST_MPI
/* The world size a launcher announced in the environment (0: none). Used by a build
** without MPI to refuse being one of several, and by nothing else. */
static int launcher_world_size(const char **var) {
  static const char *const vars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE",
                                     "SLURM_NTASKS"};
  for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) {
    const char *v = kiln__getenv(vars[i]);
    if (v && atoi(v) > 0) {
      *var = vars[i];
      return atoi(v);
    }
  }
  return 0;
}
#endif

/* Whether this rank can train on a GPU of its own: CUDA works and the host has a device
** for each of its ranks. why gets the reason when not. */
static bool local_cuda_ok(const kiln_dist *d, char *why, size_t n) {
  const char *reason = NULL;
  if (!kiln_backend_built(KILN_DEVICE_CUDA)) {
    snprintf(why, n, "kiln was built without CUDA");
    return false;
  }
  if (!KILN__DIST_NCCL) {
    snprintf(why, n, "kiln was built without NCCL (install NCCL beside the CUDA toolkit)");
    return false;
  }
  if (!kiln_backend_available(KILN_DEVICE_CUDA, &reason)) {
    snprintf(why, n, "CUDA is not available: %s", reason ? reason : "no device");
    return false;
  }
  int count = kiln_device_count(KILN_DEVICE_CUDA);
  if (count < d->local_size) {
    snprintf(why, n, "%d ranks run on this host but it has %d GPU%s: launch at most %d per host",
             d->local_size, count, count == 1 ? "" : "s", count);
    return false;
  }
  return true;
}

#if KILN__DIST_MPI
#define KILN__MSG 512

/* Every rank proposes a status and a message; all get the first failure (lowest rank),
** so that a bad launch fails everywhere with the same words instead of leaving ranks
** waiting in a collective. Returns that status (KILN_OK when all succeeded), with the
** last error set to "rank R: message". */
static kiln_status agree(const kiln_dist *d, kiln_status st, const char *msg) {
  char mine[KILN__MSG];
  int code = (int)st;
  snprintf(mine, sizeof mine, "%s", st == KILN_OK ? "" : (msg ? msg : ""));
  int worst = 0;
  int rc = MPI_Allreduce(&code, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rc != MPI_SUCCESS) return kiln__mpi_fail("kiln_dist_init: MPI_Allreduce", rc);
  if (worst == KILN_OK) return KILN_OK;
  int *codes = malloc(sizeof(int) * (size_t)d->world);
  char *msgs = malloc((size_t)KILN__MSG * (size_t)d->world);
  if (!codes || !msgs) {
    free(codes);
    free(msgs);
    return kiln_set_error(KILN_ERR_OOM, "kiln_dist_init: out of memory");
  }
  rc = MPI_Allgather(&code, 1, MPI_INT, codes, 1, MPI_INT, MPI_COMM_WORLD);
  if (rc == MPI_SUCCESS)
    rc = MPI_Allgather(mine, KILN__MSG, MPI_CHAR, msgs, KILN__MSG, MPI_CHAR, MPI_COMM_WORLD);
  kiln_status out = KILN_ERR_INTERNAL;
  if (rc != MPI_SUCCESS) {
    out = kiln__mpi_fail("kiln_dist_init: MPI_Allgather", rc);
  } else {
    for (int r = 0; r < d->world; r++) {
      if (codes[r] == KILN_OK) continue;
      msgs[(size_t)r * KILN__MSG + KILN__MSG - 1] = 0;
      out = (kiln_status)codes[r];
      if (r == d->rank)
        kiln_set_error(out, "%s", msgs + (size_t)r * KILN__MSG);
      else
        kiln_set_error(out, "rank %d of %d: %s", r, d->world, msgs + (size_t)r * KILN__MSG);
      break;
    }
  }
  free(codes);
  free(msgs);
  return out;
}

/* Every rank must run the same kiln: the layouts of what the collectives exchange, and
** which backends exist, depend on the build. */
static kiln_status check_builds(const kiln_dist *d) {
  char mine[KILN__MSG];
  snprintf(mine, sizeof mine, "kiln %s (%s)", kiln_version(), kiln_build_info());
  char *all = malloc((size_t)KILN__MSG * (size_t)d->world);
  if (!all) return kiln_set_error(KILN_ERR_OOM, "kiln_dist_init: out of memory");
  int rc = MPI_Allgather(mine, KILN__MSG, MPI_CHAR, all, KILN__MSG, MPI_CHAR, MPI_COMM_WORLD);
  if (rc != MPI_SUCCESS) {
    free(all);
    return kiln__mpi_fail("kiln_dist_init: MPI_Allgather", rc);
  }
  kiln_status st = KILN_OK;
  for (int r = 1; r < d->world && st == KILN_OK; r++) {
    const char *other = all + (size_t)r * KILN__MSG;
    if (strncmp(other, all, KILN__MSG) != 0)
      st = kiln_set_error(KILN_ERR_STATE,
                          "kiln_dist_init: ranks run different kiln builds: rank 0 runs %.*s, "
                          "rank %d runs %.*s; run the same build on every rank",
                          KILN__MSG, all, r, KILN__MSG, other);
  }
  free(all);
  return st; /* every rank compared the same table: they agree already */
}

/* MPI that kiln started and nobody finalised (a failed kiln_dist_init leaves it up, so
** that a later init may succeed) is finalised at exit: otherwise mpirun reports the rank
** as having exited "improperly" and fails the whole job. */
static void finalize_at_exit(void) {
  int fin = 0, inited = 0;
  MPI_Initialized(&inited);
  MPI_Finalized(&fin);
  if (g_mpi_owned && inited && !fin) MPI_Finalize();
}

static kiln_status mpi_start(void) {
  int fin = 0, inited = 0;
  MPI_Finalized(&fin);
  if (fin)
    return kiln_set_error(KILN_ERR_STATE, "kiln_dist_init: MPI was already finalised in this "
                                          "process (MPI starts only once per process)");
  MPI_Initialized(&inited);
  if (!inited) {
    int provided = 0;
    /* FUNNELED: loader worker threads exist, but only the main thread calls MPI. */
    int rc = MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided);
    if (rc != MPI_SUCCESS) {
      char buf[MPI_MAX_ERROR_STRING] = "";
      int len = 0;
      MPI_Error_string(rc, buf, &len);
      return kiln_set_error(KILN_ERR_UNAVAILABLE,
                            "kiln_dist_init: MPI_Init failed (%s); launch with mpirun -np N",
                            buf);
    }
    g_mpi_owned = true;
    atexit(finalize_at_exit);
  }
  /* Errors come back as codes (kiln's rule), not as MPI's default abort. */
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  return KILN_OK;
}

static kiln_status topology(kiln_dist *d) {
  int rc = MPI_Comm_rank(MPI_COMM_WORLD, &d->rank);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_size(MPI_COMM_WORLD, &d->world);
  if (rc != MPI_SUCCESS) return kiln__mpi_fail("kiln_dist_init: MPI_Comm_rank/size", rc);
  MPI_Comm *node = malloc(sizeof *node);
  if (!node) return kiln_set_error(KILN_ERR_OOM, "kiln_dist_init: out of memory");
  rc = MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, d->rank, MPI_INFO_NULL, node);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_rank(*node, &d->local_rank);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_size(*node, &d->local_size);
  if (rc != MPI_SUCCESS) {
    free(node);
    return kiln__mpi_fail("kiln_dist_init: MPI_Comm_split_type", rc);
  }
  d->node_comm = node;
  MPI_Comm *bc = malloc(sizeof *bc);
  if (!bc) return kiln_set_error(KILN_ERR_OOM, "kiln_dist_init: out of memory");
  rc = MPI_Comm_dup(MPI_COMM_WORLD, bc);
  if (rc != MPI_SUCCESS) {
    free(bc);
    return kiln__mpi_fail("kiln_dist_init: MPI_Comm_dup", rc);
  }
  MPI_Comm_set_errhandler(*bc, MPI_ERRORS_RETURN);
  d->bucket_comm = bc;
  return KILN_OK;
}

static void mpi_release(kiln_dist *d) {
  if (d->bucket_comm) {
    MPI_Comm_free((MPI_Comm *)d->bucket_comm);
    free(d->bucket_comm);
    d->bucket_comm = NULL;
  }
  if (d->node_comm) {
    MPI_Comm_free((MPI_Comm *)d->node_comm);
    free(d->node_comm);
    d->node_comm = NULL;
  }
}
#endif /* KILN__DIST_MPI */

/* Picks the device: CUDA when asked, or (AUTO) when every rank can. */
static kiln_status choose_device(kiln_dist *d, kiln_dist_device_mode mode) {
  char why[400] = "";
  bool ok = mode != KILN_DIST_DEVICE_CPU && local_cuda_ok(d, why, sizeof why);
  if (mode == KILN_DIST_DEVICE_AUTO && ok) ok = kiln_device_best().type == KILN_DEVICE_CUDA;
  kiln_status st = KILN_OK;
  char msg[1024] = "";
  if (mode == KILN_DIST_DEVICE_CUDA && !ok) {
    bool topo = strstr(why, "ranks run on this host") != NULL;
    char host[256] = "this host";
#if KILN__DIST_MPI
    int len = 0;
    char name[MPI_MAX_PROCESSOR_NAME];
    if (MPI_Get_processor_name(name, &len) == MPI_SUCCESS) snprintf(host, sizeof host, "%s", name);
#endif
    st = topo ? KILN_ERR_DEVICE : KILN_ERR_UNAVAILABLE;
    snprintf(msg, sizeof msg, "kiln_dist_init: device CUDA on %s: %s", host, why);
  }
#if KILN__DIST_MPI
  if (d->mpi) {
    st = agree(d, st, msg);
    if (st != KILN_OK) return st;
    /* AUTO takes the GPU only when every rank can: one job, one kind of collective */
    int mine = ok, all = 0;
    int rc = MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (rc != MPI_SUCCESS) return kiln__mpi_fail("kiln_dist_init: MPI_Allreduce", rc);
    ok = all != 0;
  }
#endif
  if (st != KILN_OK) return kiln_set_error(st, "%s", msg);
  d->device = ok ? kiln_device_cuda(d->local_rank) : kiln_device_cpu();
  return KILN_OK;
}

/* NCCL: rank 0 makes the id, MPI carries it, every rank joins on its own GPU. */
static kiln_status start_nccl(kiln_dist *d) {
  if (d->device.type != KILN_DEVICE_CUDA) return KILN_OK;
#if KILN__DIST_NCCL
  unsigned char id[256];
  size_t n = kiln__nccl_id_size();
  KILN__ASSERT(n <= sizeof id);
  kiln_status st = KILN_OK;
  char msg[512] = "";
  if (d->rank == 0) {
    st = kiln__nccl_unique_id(id);
    if (st != KILN_OK) snprintf(msg, sizeof msg, "%s", kiln_last_error_message());
  }
#if KILN__DIST_MPI
  if (d->mpi) {
    st = agree(d, st, msg);
    if (st != KILN_OK) return st;
    int rc = MPI_Bcast(id, (int)n, MPI_BYTE, 0, MPI_COMM_WORLD);
    if (rc != MPI_SUCCESS) return kiln__mpi_fail("kiln_dist_init: MPI_Bcast of the NCCL id", rc);
  }
#endif
  if (st != KILN_OK) return st;
  d->nccl = kiln__nccl_new(d, id, n);
  st = d->nccl ? KILN_OK : kiln_last_error();
  if (st != KILN_OK) snprintf(msg, sizeof msg, "%s", kiln_last_error_message());
#if KILN__DIST_MPI
  if (d->mpi) st = agree(d, st, msg);
#endif
  return st;
#else
  return kiln_set_error(KILN_ERR_UNAVAILABLE, "kiln_dist_init: kiln was built without NCCL");
#endif
}

static void dist_release(kiln_dist *d) {
#if KILN__DIST_NCCL
  kiln__nccl_free(d->nccl);
#endif
  d->nccl = NULL;
#if KILN__DIST_MPI
  mpi_release(d);
#endif
}

kiln_dist *kiln_dist_init(const kiln_dist_opts *opts) {
  kiln_dist_opts o = opts ? *opts : kiln_dist_opts_default();
  if (g_live)
    KILN__FAIL_NULL(KILN_ERR_STATE, "kiln_dist_init: already initialised in this process "
                                    "(call kiln_dist_free first)");
  if ((int)o.device < KILN_DIST_DEVICE_AUTO || (int)o.device > KILN_DIST_DEVICE_CUDA ||
      o.expected_world_size < 0)
    KILN__FAIL_NULL(KILN_ERR_INVALID_ARGUMENT,
                    "kiln_dist_init: bad options (device mode %d, expected_world_size %d)",
                    (int)o.device, o.expected_world_size);
  kiln_dist *d = calloc(1, sizeof *d);
  if (!d) KILN__FAIL_NULL(KILN_ERR_OOM, "kiln_dist_init: out of memory");
  d->world = 1;
  d->local_size = 1;
  d->device = kiln_device_cpu();
  kiln_status st = KILN_OK;
#if KILN__DIST_MPI
  st = mpi_start();
  if (st == KILN_OK) {
    d->mpi = true;
    st = topology(d);
  }
#else
  const char *var = NULL;
  int announced = launcher_world_size(&var);
  if (announced > 1)
    st = kiln_set_error(KILN_ERR_UNAVAILABLE,
                        "kiln_dist_init: launched as one of %d ranks (%s=%d), but kiln was "
                        "built without MPI: install an MPI (libopenmpi-dev) and rebuild with "
                        "KILN_MPI=ON",
                        announced, var, announced);
#endif
  if (st == KILN_OK && o.expected_world_size > 0 && d->world != o.expected_world_size)
    st = kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                        "kiln_dist_init: the program expects %d ranks but was launched with %d "
                        "(mpirun -np %d)",
                        o.expected_world_size, d->world, o.expected_world_size);
#if KILN__DIST_MPI
  if (st == KILN_OK && !o.skip_build_check && d->world > 1) st = check_builds(d);
#endif
  if (st == KILN_OK) st = choose_device(d, o.device);
  if (st == KILN_OK) st = start_nccl(d);
  if (st != KILN_OK) {
    /* MPI stays up (it cannot start again): a later kiln_dist_init may still succeed. */
    dist_release(d);
    free(d);
    return NULL;
  }
  /* programs written for one process pick their device with kiln_device_best(): make it
  ** answer this rank's device (cuda:<local rank>, not cuda:0 on every rank) */
  char dev_name[32];
  setenv("KILN_DEVICE", kiln_device_str(d->device, dev_name, sizeof dev_name), 1);
  g_live = true;
  return d;
}

void kiln_dist_free(kiln_dist *d) {
  if (!d) return;
  dist_release(d);
#if KILN__DIST_MPI
  if (d->mpi && g_mpi_owned) {
    int fin = 0;
    MPI_Finalized(&fin);
    if (!fin) MPI_Finalize();
    g_mpi_owned = false;
  }
#endif
  free(d);
  g_live = false;
}

void kiln_dist_abort(kiln_dist *d, int code) {
  const char *msg = kiln_last_error_message();
  fprintf(stderr, "kiln: rank %d of %d aborts the job (code %d)%s%s\n", kiln_dist_rank(d),
          kiln_dist_world_size(d), code, msg && *msg ? ": " : "", msg ? msg : "");
  fflush(stderr);
#if KILN__DIST_MPI
  int inited = 0, fin = 0;
  MPI_Initialized(&inited);
  MPI_Finalized(&fin);
  if (inited && !fin) MPI_Abort(MPI_COMM_WORLD, code);
#endif
  exit(code);
}
