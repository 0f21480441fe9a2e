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
** back). With overlap on, every trainable parameter carries a grad-ready hook
** (kiln_set_grad_ready_hook): when the last gradient of a bucket is complete, the hook
** launches it while backward goes on (NCCL: queued on its own stream, so the GPU
** communicates during the rest of backward; MPI: an MPI_Iallreduce on the process
** group's duplicate communicator, waited for in the sync).
** Buckets are always launched in index order, by the hook or at sync, so every rank
** issues the same collectives in the same order even when some parameter gets no gradient
** on some rank. A gradient that changes after its bucket was launched (a second backward
** before the sync: gradient accumulation) marks the round dirty, and sync reduces every
** bucket again from the final gradients: correct, only slower (kiln_ddp_no_sync avoids
** it). kiln_ddp_sync_grads launches what the hooks did not and finishes all.
*/
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dist_int.h"
#include "ext/kiln_ext.h"

typedef struct ddp_slot {
  int param;      /* index in the module's parameter list */
  int64_t offset; /* first element in the bucket's flat buffer */
  int64_t numel;
  int bucket;
  bool ready;     /* its gradient is complete in this round (hook) */
} ddp_slot;

typedef struct ddp_bucket {
  int first, n;       /* slots [first, first + n) */
  int64_t numel;      /* gradient elements (the flags follow them) */
  int64_t bytes;      /* of the flat buffer */
  kiln_tensor *flat;  /* owned; NULL in a world of one (nothing to reduce) */
  kiln_device dev;    /* the parameters' device */
  int ready;          /* slots ready in this round */
  bool launched;      /* in this round */
  kiln__mpi_pending pending; /* a CPU bucket's reduction in flight */
} ddp_bucket;

/* A parameter carrying this wrapper's hook (a reference held, so that a parameter the
** module replaced cannot call the hook after it is gone). Sorted by address. */
typedef struct ddp_hooked {
  kiln_tensor *t;
  int slot;
} ddp_hooked;

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
  ddp_hooked *hooked;
  int n_hooked;
  /* the round: from one sync to the next */
  int next_launch;    /* buckets [0, next_launch) are launched */
  int early;          /* of those, launched by hooks during backward */
  int last_early;     /* early of the last finished round */
  bool dirty;         /* a gradient changed after its bucket was launched */
  bool no_sync;       /* hooks launch nothing (kiln_ddp_no_sync) */
  kiln_status err;    /* the first failure inside a hook, reported by sync */
  char err_msg[512];
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
    int v[4] = {kiln_requires_grad(t), (int)kiln_dtype_of(t), (int)kiln_device_of(t).type, kiln_device_of(t).index};
    h = fnv(h, v, sizeof v);
    int nd = kiln_ndim(t);
    h = fnv(h, &nd, sizeof nd);
    h = fnv(h, kiln_shape(t), sizeof(int64_t) * (size_t)nd);
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

static void ddp_hook(kiln_tensor *t, void *ctx);

static void unhook_all(kiln_ddp *ddp) {
  for (int i = 0; i < ddp->n_hooked; i++) {
    kiln_tensor *t = ddp->hooked[i].t;
    if (kiln__grad_ready_hook_is(t, ddp_hook, ddp)) kiln_set_grad_ready_hook(t, NULL, NULL);
    kiln_tensor_free(t);
  }
  free(ddp->hooked);
  ddp->hooked = NULL;
  ddp->n_hooked = 0;
}

static void reset_round(kiln_ddp *ddp) {
  for (int k = 0; k < ddp->n_slots; k++) ddp->slots[k].ready = false;
  for (int b = 0; b < ddp->n_buckets; b++) {
    kiln__mpi_wait(&ddp->buckets[b].pending); /* after an error: nothing left in flight */
    ddp->buckets[b].ready = 0;
    ddp->buckets[b].launched = false;
  }
  ddp->next_launch = 0;
  ddp->early = 0;
  ddp->dirty = false;
  ddp->err = KILN_OK;
}

static void free_buckets(kiln_ddp *ddp) {
  unhook_all(ddp);
  for (int b = 0; b < ddp->n_buckets; b++) {
    kiln__mpi_wait(&ddp->buckets[b].pending); /* MPI still writes into it */
    kiln_tensor_free(ddp->buckets[b].flat);
  }
  free(ddp->buckets);
  free(ddp->slots);
  ddp->buckets = NULL;
  ddp->slots = NULL;
  ddp->n_buckets = ddp->n_slots = 0;
  ddp->next_launch = ddp->early = 0;
  ddp->dirty = false;
  ddp->err = KILN_OK;
}

static int cmp_hooked(const void *a, const void *b) {
  uintptr_t x = (uintptr_t)((const ddp_hooked *)a)->t, y = (uintptr_t)((const ddp_hooked *)b)->t;
  return x < y ? -1 : x > y;
}

static int find_slot(const kiln_ddp *ddp, const kiln_tensor *t) {
  int lo = 0, hi = ddp->n_hooked - 1;
  while (lo <= hi) {
    int mid = (lo + hi) / 2;
    uintptr_t m = (uintptr_t)ddp->hooked[mid].t, want = (uintptr_t)t;
    if (m == want) return ddp->hooked[mid].slot;
    if (m < want) lo = mid + 1;
    else hi = mid - 1;
  }
  return -1;
}

/* Hooks on every trainable parameter (overlap on, and something to reduce). */
static kiln_status hook_all(kiln_ddp *ddp) {
  ddp->hooked = calloc((size_t)(ddp->n_slots > 0 ? ddp->n_slots : 1), sizeof *ddp->hooked);
  if (!ddp->hooked) return kiln_set_error(KILN_ERR_OOM, "kiln_ddp: out of memory");
  for (int k = 0; k < ddp->n_slots; k++) {
    kiln_tensor *t = ddp->params[ddp->slots[k].param];
    kiln_status st = kiln_set_grad_ready_hook(t, ddp_hook, ddp);
    if (st != KILN_OK) return st;
    ddp->hooked[ddp->n_hooked].t = kiln_tensor_ref(t);
    ddp->hooked[ddp->n_hooked].slot = k;
    ddp->n_hooked++;
  }
  qsort(ddp->hooked, (size_t)ddp->n_hooked, sizeof *ddp->hooked, cmp_hooked);
  return KILN_OK;
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
    if (!kiln_requires_grad(p)) continue;
    int64_t bytes = kiln_numel(p) * (int64_t)kiln_dtype_size(kiln_dtype_of(p));
    bool fits = cur && kiln_device_equal(cur->dev, kiln_device_of(p)) &&
                kiln_dtype_of(ddp->params[ddp->slots[cur->first].param]) == kiln_dtype_of(p) &&
                cur_bytes + bytes <= cap;
    if (!fits) {
      cur = &ddp->buckets[ddp->n_buckets++];
      cur->first = ddp->n_slots;
      cur->dev = kiln_device_of(p);
      cur_bytes = 0;
    }
    ddp_slot *s = &ddp->slots[ddp->n_slots++];
    s->param = i;
    s->bucket = (int)(cur - ddp->buckets);
    s->offset = cur->numel;
    s->numel = kiln_numel(p);
    cur->numel += s->numel;
    cur->n++;
    cur_bytes += bytes;
  }
  for (int b = 0; b < ddp->n_buckets; b++) {
    ddp_bucket *bk = &ddp->buckets[b];
    kiln_dtype pdt = kiln_dtype_of(ddp->params[ddp->slots[bk->first].param]);
    kiln_device cdev = kiln__dist_comm_device(ddp->d, bk->dev);
    kiln_dtype cdt = kiln__dist_comm_dtype(cdev, pdt);
    int64_t len = bk->numel + bk->n;
    bk->bytes = len * (int64_t)kiln_dtype_size(cdt);
    if (!reduces(ddp)) continue; /* no memory for an identity */
    bk->flat = kiln_keep(kiln_zeros(1, &len, cdt, cdev));
    if (!bk->flat) return kiln_last_error();
  }
  if (reduces(ddp) && !ddp->o.no_overlap) return hook_all(ddp);
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
  return kiln_view(kiln_narrow(bk->flat, 0, s->offset, s->numel), kiln_ndim(p), kiln_shape(p));
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
  if (bk->dev.type != KILN_DEVICE_CPU && kiln_device_of(bk->flat).type == KILN_DEVICE_CPU)
    st = kiln_device_synchronize(bk->dev);
  if (st != KILN_OK) return st;
  kiln_dist_op op = ddp->o.sum ? KILN_DIST_SUM : KILN_DIST_AVG;
  if (kiln_device_of(bk->flat).type == KILN_DEVICE_CPU)
    /* nonblocking, on the wrapper's own communicator: a bucket started by a hook in
    ** backward never meets another collective the program makes before the sync */
    return kiln__mpi_iallreduce(ddp->d, kiln__dist_ptr(bk->flat), kiln_numel(bk->flat),
                                kiln_dtype_of(bk->flat), op, &bk->pending);
  return kiln__dist_allreduce_buffer(ddp->d, bk->flat, op);
}

/* Copies the reduced gradients back (queued after the collective on the device). */
static kiln_status bucket_finish(kiln_ddp *ddp, int b) {
  ddp_bucket *bk = &ddp->buckets[b];
  kiln_status st = kiln__mpi_wait(&bk->pending);
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

/* Launches bucket next_launch (in its own scope, grad mode off). */
static kiln_status launch_next(kiln_ddp *ddp) {
  int b = ddp->next_launch;
  bool prev = kiln_set_grad_enabled(false);
  kiln_scope_begin();
  kiln_status st = bucket_launch(ddp, b);
  kiln_scope_end();
  kiln_set_grad_enabled(prev);
  if (st == KILN_OK) {
    ddp->buckets[b].launched = true;
    ddp->next_launch++;
  }
  return st;
}

/* The grad-ready hook: t's gradient is complete for this backward. */
static void ddp_hook(kiln_tensor *t, void *ctx) {
  kiln_ddp *ddp = ctx;
  if (ddp->no_sync || ddp->err != KILN_OK) return;
  int k = find_slot(ddp, t);
  if (k < 0) return;
  ddp_slot *s = &ddp->slots[k];
  ddp_bucket *bk = &ddp->buckets[s->bucket];
  if (bk->launched) {
    ddp->dirty = true; /* this gradient grew after it was sent */
    return;
  }
  if (!s->ready) {
    s->ready = true;
    bk->ready++;
  }
  /* in index order only: every rank issues the same collectives in the same order */
  while (ddp->next_launch < ddp->n_buckets && !ddp->dirty) {
    ddp_bucket *nb = &ddp->buckets[ddp->next_launch];
    if (nb->ready < nb->n) break;
    kiln_status st = launch_next(ddp);
    if (st != KILN_OK) {
      ddp->err = st;
      snprintf(ddp->err_msg, sizeof ddp->err_msg, "%s", kiln_last_error_message());
      return;
    }
    ddp->early++;
  }
}

kiln_status kiln_ddp_sync_grads(kiln_ddp *ddp) {
  if (!ddp) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_ddp_sync_grads: NULL wrapper");
  kiln_status st = refresh(ddp);
  if (st != KILN_OK || !reduces(ddp)) {
    if (ddp->slots) reset_round(ddp);
    return st;
  }
  if (ddp->err != KILN_OK) {
    st = kiln_set_error(ddp->err, "kiln_ddp_sync_grads: during backward: %s", ddp->err_msg);
    reset_round(ddp);
    return st;
  }
  int early = ddp->early;
  if (ddp->dirty) {
    /* reduce everything again from the final gradients (what was sent is stale); on the
    ** device the new copies are queued after the collectives already in flight */
    for (int b = 0; b < ddp->n_buckets; b++) {
      ddp->buckets[b].launched = false;
      if (st == KILN_OK) st = kiln__mpi_wait(&ddp->buckets[b].pending); /* before reuse */
    }
    ddp->next_launch = 0;
    early = 0;
  }
  while (st == KILN_OK && ddp->next_launch < ddp->n_buckets) st = launch_next(ddp);
  bool prev = kiln_set_grad_enabled(false);
  for (int b = 0; b < ddp->n_buckets && st == KILN_OK; b++) {
    kiln_scope_begin();
    st = bucket_finish(ddp, b);
    kiln_scope_end();
  }
  kiln_set_grad_enabled(prev);
  ddp->last_early = st == KILN_OK ? early : 0;
  reset_round(ddp);
  return st;
}

kiln_status kiln_ddp_no_sync(kiln_ddp *ddp, bool on) {
  if (!ddp) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_ddp_no_sync: NULL wrapper");
  ddp->no_sync = on;
  return KILN_OK;
}

int kiln_ddp_num_overlapped(const kiln_ddp *ddp) { return ddp ? ddp->last_early : -1; }

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
