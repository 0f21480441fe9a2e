/*
** Data-parallel wrapper of a module: rank 0's parameters broadcast at the start, then
** after every backward the gradients averaged over the ranks in buckets (flat buffers
** of ~25 MiB: one collective per bucket instead of one per parameter, PyTorch DDP's
** layout).
**
** Bucket b holds consecutive trainable parameters in reverse registration order (the
** order backward finishes them), all of one device and dtype:
**   flat (numel_0 + ... + numel_{k-1} + k) on the comm device, in the comm dtype
**   [ grad_0 | grad_1 | ... | grad_{k-1} | has_0 ... has_{k-1} ]
** has_i is 1 where this rank has a gradient for parameter i, else 0 (and its slice is
** zeros); after the reduction has_i > 0 tells a rank without a gradient whether any rank
** had one, so that every rank ends with the same set of gradients.
**
** Each bucket goes through launch (copy in, start the collective) and finish (copy
** back); sync runs them one after the other after backward. A per-leaf "gradient ready"
** hook in autograd could later call launch as each bucket fills (overlap with backward).
*/
#include <stdlib.h>
#include <string.h>

#include "dist_int.h"
#include "kiln_int.h"

typedef struct ddp_slot {
  int param;      /* index in the module's parameter list */
  int64_t offset; /* first element in the bucket's flat buffer */
  int64_t numel;
} ddp_slot;

typedef struct ddp_bucket {
  int first, n;       /* slots [first, first + n) */
  int64_t numel;      /* gradient elements (the flags follow them) */
  int64_t bytes;      /* of the flat buffer */
  kiln_tensor *flat;  /* owned; NULL in a world of one (nothing to reduce) */
  kiln_device dev;    /* the parameters' device */
} ddp_bucket;

struct kiln_ddp {
  kiln_dist *d;
  kiln_module *m;
  kiln_ddp_opts o;
  int n_params;         /* as last seen */
  kiln_tensor **params; /* borrowed, refreshed at every sync */
  uint64_t sig;         /* the parameters' layout the buckets were built for */
  ddp_slot *slots;
  int n_slots;
  ddp_bucket *buckets;
  int n_buckets;
};

bool kiln__ddp_always_reduce = false;

/* Whether there is anything to reduce. */
static bool reduces(const kiln_ddp *ddp) {
  return kiln_dist_world_size(ddp->d) > 1 || (ddp->d && kiln__ddp_always_reduce);
}

kiln_ddp_opts kiln_ddp_opts_default(void) {
  kiln_ddp_opts o;
  memset(&o, 0, sizeof o);
  o.bucket_mb = 25;
  return o;
}

static uint64_t fnv(uint64_t h, const void *p, size_t n) {
  const unsigned char *b = p;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * UINT64_C(0x100000001b3);
  return h;
}

/* What the buckets depend on: per parameter, trainable or not, dtype, device, shape. */
static uint64_t layout_sig(kiln_tensor *const *ps, int n) {
  uint64_t h = fnv(UINT64_C(0xcbf29ce484222325), &n, sizeof n);
  for (int i = 0; i < n; i++) {
    const kiln_tensor *t = ps[i];
    int v[4] = {t->requires_grad, (int)t->dtype, (int)t->storage->device.type, t->storage->device.index};
    h = fnv(h, v, sizeof v);
    h = fnv(h, &t->ndim, sizeof t->ndim);
    h = fnv(h, t->shape, sizeof(int64_t) * (size_t)t->ndim);
  }
  return h;
}

/* Reads the module's parameters into ddp->params. */
static kiln_status fetch_params(kiln_ddp *ddp) {
  int n = kiln_module_parameters(ddp->m, NULL, 0);
  if (n < 0) return kiln_last_error();
  if (n != ddp->n_params || !ddp->params) {
    kiln_tensor **p = realloc(ddp->params, sizeof *p * (size_t)(n > 0 ? n : 1));
    if (!p) return kiln_set_error(KILN_ERR_OOM, "kiln_ddp: out of memory");
    ddp->params = p;
    ddp->n_params = n;
  }
  if (kiln_module_parameters(ddp->m, ddp->params, n) != n)
    return kiln_set_error(KILN_ERR_INTERNAL, "kiln_ddp: the module's parameters changed while read");
  return KILN_OK;
}

/* Every rank must hold the same layout, or the collectives would mix unrelated bytes. */
static kiln_status check_same_layout(kiln_ddp *ddp, uint64_t sig) {
  if (kiln_dist_world_size(ddp->d) == 1) return KILN_OK;
  int64_t lo = (int64_t)sig, hi = (int64_t)sig;
  kiln_status st = kiln__mpi_allreduce(ddp->d, &lo, 1, KILN_I64, KILN_DIST_MIN);
  if (st == KILN_OK) st = kiln__mpi_allreduce(ddp->d, &hi, 1, KILN_I64, KILN_DIST_MAX);
  if (st != KILN_OK) return st;
  if (lo != hi)
    return kiln_set_error(KILN_ERR_STATE,
                          "kiln_ddp: ranks hold different parameters (this rank, %d, has %d "
                          "parameters, %lld trainable elements): build the same model on every "
                          "rank and move it the same way",
                          kiln_dist_rank(ddp->d), ddp->n_params,
                          (long long)kiln_module_num_trainable_params(ddp->m));
  return KILN_OK;
}

static void free_buckets(kiln_ddp *ddp) {
  for (int b = 0; b < ddp->n_buckets; b++) kiln_tensor_free(ddp->buckets[b].flat);
  free(ddp->buckets);
  free(ddp->slots);
  ddp->buckets = NULL;
  ddp->slots = NULL;
  ddp->n_buckets = ddp->n_slots = 0;
}

static kiln_status build_buckets(kiln_ddp *ddp) {
  free_buckets(ddp);
  int n = ddp->n_params;
  ddp->slots = calloc((size_t)(n > 0 ? n : 1), sizeof *ddp->slots);
  ddp->buckets = calloc((size_t)(n > 0 ? n : 1), sizeof *ddp->buckets);
  if (!ddp->slots || !ddp->buckets) return kiln_set_error(KILN_ERR_OOM, "kiln_ddp: out of memory");
  double mb = ddp->o.bucket_mb > 0 ? ddp->o.bucket_mb : 25;
  int64_t cap = (int64_t)(mb * 1048576.0);
  if (cap < 1) cap = 1;
  ddp_bucket *cur = NULL;
  int64_t cur_bytes = 0;
  for (int i = n - 1; i >= 0; i--) {
    kiln_tensor *p = ddp->params[i];
    if (!p->requires_grad) continue;
    int64_t bytes = kiln_numel(p) * (int64_t)kiln_dtype_size(p->dtype);
    bool fits = cur && kiln_device_equal(cur->dev, p->storage->device) &&
                ddp->params[ddp->slots[cur->first].param]->dtype == p->dtype &&
                cur_bytes + bytes <= cap;
    if (!fits) {
      cur = &ddp->buckets[ddp->n_buckets++];
      cur->first = ddp->n_slots;
      cur->dev = p->storage->device;
      cur_bytes = 0;
    }
    ddp_slot *s = &ddp->slots[ddp->n_slots++];
    s->param = i;
    s->offset = cur->numel;
    s->numel = kiln_numel(p);
    cur->numel += s->numel;
    cur->n++;
    cur_bytes += bytes;
  }
  for (int b = 0; b < ddp->n_buckets; b++) {
    ddp_bucket *bk = &ddp->buckets[b];
    kiln_dtype pdt = ddp->params[ddp->slots[bk->first].param]->dtype;
    kiln_device cdev = kiln__dist_comm_device(ddp->d, bk->dev);
    kiln_dtype cdt = kiln__dist_comm_dtype(cdev, pdt);
    int64_t len = bk->numel + bk->n;
    bk->bytes = len * (int64_t)kiln_dtype_size(cdt);
    if (!reduces(ddp)) continue; /* no memory for an identity */
    bk->flat = kiln_keep(kiln_zeros(1, &len, cdt, cdev));
    if (!bk->flat) return kiln_last_error();
  }
  return KILN_OK;
}

/* Parameters read again; buckets rebuilt when their layout changed (kiln_module_to). */
static kiln_status refresh(kiln_ddp *ddp) {
  kiln_status st = fetch_params(ddp);
  if (st != KILN_OK) return st;
  uint64_t sig = layout_sig(ddp->params, ddp->n_params);
  st = check_same_layout(ddp, sig);
  if (st != KILN_OK) return st;
  bool unbuffered = reduces(ddp) && ddp->n_buckets > 0 && !ddp->buckets[0].flat;
  if (sig != ddp->sig || !ddp->slots || unbuffered) {
    st = build_buckets(ddp);
    if (st != KILN_OK) {
      free_buckets(ddp);
      return st;
    }
    ddp->sig = sig;
  }
  return KILN_OK;
}

/* Slot s's slice of the bucket, shaped like its parameter (a view: scope-owned). */
static kiln_tensor *slice_of(kiln_ddp *ddp, const ddp_bucket *bk, const ddp_slot *s) {
  kiln_tensor *p = ddp->params[s->param];
  return kiln_view(kiln_narrow(bk->flat, 0, s->offset, s->numel), p->ndim, p->shape);
}

/* Copies the bucket's gradients in and starts its collective (NCCL: queued; MPI: done). */
static kiln_status bucket_launch(kiln_ddp *ddp, int b) {
  ddp_bucket *bk = &ddp->buckets[b];
  kiln_status st = kiln_fill_(kiln_narrow(bk->flat, 0, bk->numel, bk->n), 1.0);
  for (int k = 0; k < bk->n && st == KILN_OK; k++) {
    const ddp_slot *s = &ddp->slots[bk->first + k];
    kiln_tensor *g = kiln_grad(ddp->params[s->param]);
    kiln_tensor *dst = slice_of(ddp, bk, s);
    if (!dst) return kiln_last_error();
    if (g) {
      st = kiln_copy_(dst, g);
    } else {
      st = kiln_zero_(dst);
      if (st == KILN_OK) st = kiln_zero_(kiln_narrow(bk->flat, 0, bk->numel + k, 1));
    }
  }
  if (st != KILN_OK) return st;
  /* the host transport reads what the device wrote */
  if (bk->dev.type != KILN_DEVICE_CPU && bk->flat->storage->device.type == KILN_DEVICE_CPU)
    st = kiln_device_synchronize(bk->dev);
  if (st != KILN_OK) return st;
  return kiln__dist_allreduce_buffer(ddp->d, bk->flat, ddp->o.sum ? KILN_DIST_SUM : KILN_DIST_AVG);
}

/* Copies the reduced gradients back (queued after the collective on the device). */
static kiln_status bucket_finish(kiln_ddp *ddp, int b) {
  ddp_bucket *bk = &ddp->buckets[b];
  kiln_status st = KILN_OK;
  for (int k = 0; k < bk->n && st == KILN_OK; k++) {
    const ddp_slot *s = &ddp->slots[bk->first + k];
    kiln_tensor *p = ddp->params[s->param];
    kiln_tensor *src = slice_of(ddp, bk, s);
    if (!src) return kiln_last_error();
    kiln_tensor *g = kiln_grad(p);
    if (g) {
      st = kiln_copy_(g, src);
      continue;
    }
    /* no gradient here: take the average only if some rank had one (reading the flag
    ** waits for the device, but only on this rare path) */
    double had = kiln_item(kiln_narrow(bk->flat, 0, bk->numel + k, 1));
    if (had != had) return kiln_last_error();
    if (had > 0) {
      kiln_tensor *ng = kiln_zeros_like(p);
      st = ng ? kiln_copy_(ng, src) : kiln_last_error();
      if (st == KILN_OK) st = kiln_set_grad(p, ng);
    }
  }
  return st;
}

kiln_status kiln_ddp_sync_grads(kiln_ddp *ddp) {
  if (!ddp) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_ddp_sync_grads: NULL wrapper");
  kiln_status st = refresh(ddp);
  if (st != KILN_OK || !reduces(ddp)) return st;
  bool prev = kiln_set_grad_enabled(false);
  for (int b = 0; b < ddp->n_buckets && st == KILN_OK; b++) {
    kiln_scope_begin();
    st = bucket_launch(ddp, b);
    kiln_scope_end();
  }
  for (int b = 0; b < ddp->n_buckets && st == KILN_OK; b++) {
    kiln_scope_begin();
    st = bucket_finish(ddp, b);
    kiln_scope_end();
  }
  kiln_set_grad_enabled(prev);
  return st;
}

kiln_status kiln_ddp_broadcast_params(kiln_ddp *ddp) {
  if (!ddp) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_ddp_broadcast_params: NULL wrapper");
  kiln_status st = refresh(ddp);
  if (st != KILN_OK || kiln_dist_world_size(ddp->d) == 1) return st;
  for (int i = 0; i < ddp->n_params && st == KILN_OK; i++)
    st = kiln_dist_broadcast(ddp->d, ddp->params[i], 0);
  if (st != KILN_OK) return st;
  int nb = kiln_module_named_buffers(ddp->m, NULL, NULL, 0);
  if (nb < 0) return kiln_last_error();
  if (nb == 0) return KILN_OK;
  kiln_tensor **bufs = malloc(sizeof *bufs * (size_t)nb);
  if (!bufs) return kiln_set_error(KILN_ERR_OOM, "kiln_ddp_broadcast_params: out of memory");
  /* buffer counts may differ only by a bug in the program: the same check as parameters */
  int64_t lo = nb, hi = nb;
  st = kiln__mpi_allreduce(ddp->d, &lo, 1, KILN_I64, KILN_DIST_MIN);
  if (st == KILN_OK) st = kiln__mpi_allreduce(ddp->d, &hi, 1, KILN_I64, KILN_DIST_MAX);
  if (st == KILN_OK && lo != hi)
    st = kiln_set_error(KILN_ERR_STATE, "kiln_ddp: ranks hold different numbers of buffers "
                                        "(%lld to %lld)", (long long)lo, (long long)hi);
  if (st == KILN_OK && kiln_module_named_buffers(ddp->m, NULL, bufs, nb) != nb)
    st = kiln_set_error(KILN_ERR_INTERNAL, "kiln_ddp: the module's buffers changed while read");
  for (int i = 0; i < nb && st == KILN_OK; i++)
    if (bufs[i]) st = kiln_dist_broadcast(ddp->d, bufs[i], 0);
  free(bufs);
  return st;
}

kiln_ddp *kiln_ddp_new(kiln_dist *d, kiln_module *m, const kiln_ddp_opts *opts) {
  kiln_ddp_opts o = opts ? *opts : kiln_ddp_opts_default();
  if (!m) KILN__FAIL_NULL(KILN_ERR_INVALID_ARGUMENT, "kiln_ddp_new: NULL module");
  if (!(o.bucket_mb >= 0))
    KILN__FAIL_NULL(KILN_ERR_INVALID_ARGUMENT, "kiln_ddp_new: bucket_mb %g is negative", o.bucket_mb);
  kiln_ddp *ddp = calloc(1, sizeof *ddp);
  if (!ddp) KILN__FAIL_NULL(KILN_ERR_OOM, "kiln_ddp_new: out of memory");
  ddp->d = d;
  ddp->m = m;
  ddp->o = o;
  kiln_status st = refresh(ddp);
  if (st == KILN_OK && !o.no_broadcast) st = kiln_ddp_broadcast_params(ddp);
  if (st != KILN_OK) {
    kiln_ddp_free(ddp);
    return NULL;
  }
  return ddp;
}

kiln_module *kiln_ddp_module(const kiln_ddp *ddp) { return ddp ? ddp->m : NULL; }
int kiln_ddp_num_buckets(const kiln_ddp *ddp) { return ddp ? ddp->n_buckets : -1; }
int kiln_ddp_bucket_params(const kiln_ddp *ddp, int b) {
  return ddp && b >= 0 && b < ddp->n_buckets ? ddp->buckets[b].n : 0;
}
int64_t kiln_ddp_bucket_bytes(const kiln_ddp *ddp, int b) {
  return ddp && b >= 0 && b < ddp->n_buckets ? ddp->buckets[b].bytes : 0;
}

void kiln_ddp_free(kiln_ddp *ddp) {
  if (!ddp) return;
  free_buckets(ddp);
  free(ddp->params);
  free(ddp);
}
