/*
** Transfers that may run a copy kernel: reading a tensor into host memory (a strided one is
** made contiguous on its device first), moving several tensors to a device in one transfer,
** and copying pairs in one transfer. They moved here from src/core/tensor.c because they
** call ops (kiln_contiguous, kiln_to_device, kiln_copy_): the core does not call up into
** the op layer. They are not ops of their own: each is a data movement between memory
** spaces (or a batch of ops), and the ops it calls show in traces.
*/
#include "ops/op.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- reading values ---- */
kiln_status kiln_to_host(const kiln_tensor *t, void *dst, size_t nbytes) {
  if (!t) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_to_host: NULL tensor");
  size_t need = kiln_nbytes(t);
  if (!dst && need > 0) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_to_host: NULL destination");
  if (nbytes < need)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                          "kiln_to_host: destination holds %zu bytes; tensor %s of %s needs %zu",
                          nbytes, kiln__tshape(t), kiln_dtype_name(t->dtype), need);
  if (need == 0) return KILN_OK;
  kiln_device dev = kiln_device_of(t);
  const kiln__backend *b = t->storage->backend;
  size_t es = kiln_dtype_size(t->dtype);
  if (kiln_is_contiguous(t))
    return b->copy_to_host(dev.index, dst, (char *)t->storage->data + t->offset * (int64_t)es, need);
  /* Non-contiguous: make it contiguous on its device first (one kernel, one transfer). */
  bool prev = kiln_set_grad_enabled(false);
  kiln_scope_begin();
  kiln_tensor *c = kiln_contiguous((kiln_tensor *)t);
  kiln_status st = c ? b->copy_to_host(dev.index, dst, (char *)c->storage->data + c->offset * (int64_t)es, need)
                     : kiln_last_error();
  kiln_scope_end();
  kiln_set_grad_enabled(prev);
  return st;
}

/* ---- movement of several tensors ---- */
/* n tensors in one transfer: packed (each at a 256-byte offset) into one host buffer, one
** copy into one device block, and each result a view of its part. A transfer costs the
** host several microseconds whatever its size, and a batch has several fields. */
kiln_status kiln_to_device_many(int n, kiln_tensor *const *ts, kiln_device dev, kiln_tensor **out) {
  if (n < 0 || (n > 0 && (!ts || !out)))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_to_device_many: n must be >= 0 and the arrays given");
  for (int i = 0; i < n; i++) out[i] = NULL;
  for (int i = 0; i < n; i++)
    if (!ts[i]) return kiln_last_error() != KILN_OK ? kiln_last_error()
                                                   : kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_to_device_many: tensor %d is NULL", i);
  if (kiln__check_device(dev, "kiln_to_device_many") != KILN_OK) return kiln_last_error();
  /* one block only when every tensor is a compact host tensor (the loader's case) and they
  ** are small together: past that, per-transfer costs no longer matter and packing would
  ** add a copy (and fresh pages for the packing buffer: 2x slower at batch 8192) */
  bool pack = dev.type != KILN_DEVICE_CPU && n > 1;
  size_t total = 0;
  for (int i = 0; i < n && pack; i++) {
    if (ts[i]->storage->device.type != KILN_DEVICE_CPU || !kiln_is_contiguous(ts[i]) || ts[i]->requires_grad)
      pack = false;
    total += (kiln_nbytes(ts[i]) + 255) / 256 * 256;
  }
  if (total > ((size_t)128 << 10)) pack = false;
  if (!pack) {
    for (int i = 0; i < n; i++)
      if (!(out[i] = kiln_to_device(ts[i], dev))) {
        kiln_status st = kiln_last_error();
        for (int k = 0; k < i; k++) kiln__discard(out[k]), out[k] = NULL;
        return st;
      }
    return KILN_OK;
  }
  char *host = malloc(total ? total : 1);
  if (!host) return kiln_set_error(KILN_ERR_OOM, "kiln_to_device_many: out of host memory (%zu bytes)", total);
  size_t off = 0;
  for (int i = 0; i < n; i++) {
    memcpy(host + off, kiln__view_of(ts[i]).data, kiln_nbytes(ts[i]));
    off += (kiln_nbytes(ts[i]) + 255) / 256 * 256;
  }
  kiln__storage *s = kiln__storage_new(dev, total);
  if (s) s->packed = true;
  kiln_status st = s ? s->backend->copy_from_host(dev.index, s->data, host, total) : kiln_last_error();
  free(host);
  off = 0;
  for (int i = 0; i < n && st == KILN_OK; i++) {
    size_t es = kiln_dtype_size(ts[i]->dtype);
    out[i] = kiln__tensor_make(s, (int64_t)(off / es), ts[i]->ndim, ts[i]->shape, NULL, ts[i]->dtype);
    if (!out[i]) st = kiln_last_error();
    off += (kiln_nbytes(ts[i]) + 255) / 256 * 256;
  }
  kiln__storage_release(s); /* the views hold it */
  if (st != KILN_OK)
    for (int i = 0; i < n; i++) kiln__discard(out[i]), out[i] = NULL;
  return st;
}

/* Whether src can be copied into dst as bytes: compact, one dtype and shape (no cast, no
** broadcast), dst not refused by kiln_copy_ (which then reports why). */
static bool copy_as_bytes(const kiln_tensor *dst, const kiln_tensor *src) {
  return dst && src && kiln_is_contiguous(dst) && kiln_is_contiguous(src) && src->dtype == dst->dtype &&
         src->ndim == dst->ndim && memcmp(src->shape, dst->shape, sizeof(int64_t) * (size_t)dst->ndim) == 0 &&
         !(dst->requires_grad && kiln_grad_enabled());
}

static size_t byte_offset(const kiln_tensor *t) { return (size_t)t->offset * kiln_dtype_size(t->dtype); }

/* kiln_copy_ for n pairs. When the destinations are the views of one block made by
** kiln_to_device_many (so the bytes between them are padding nobody reads), the whole span
** goes in one transfer: from compact host tensors of their shapes and dtypes, or on the
** device from views of one other block laid out the same way (a staged loader batch). A
** captured step's static inputs are refilled so every step. Other pairs on one device
** with one dtype and shape take one device copy each instead of a copy kernel. */
kiln_status kiln_copy_many_(int n, kiln_tensor *const *dsts, kiln_tensor *const *srcs) {
  if (n < 0 || (n > 0 && (!dsts || !srcs)))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_copy_many_: n must be >= 0 and the arrays given");
  bool one = n > 1, from_host = n > 0 && srcs[0] && srcs[0]->storage->device.type == KILN_DEVICE_CPU;
  size_t lo = SIZE_MAX, hi = 0;
  int64_t delta = 0; /* device to device: a source's byte offset minus its destination's */
  for (int i = 0; i < n && one; i++) {
    kiln_tensor *d = dsts[i], *s = srcs[i];
    if (!copy_as_bytes(d, s) || !d->storage->packed || d->storage != dsts[0]->storage) {
      one = false;
      break;
    }
    if (from_host) {
      one = s->storage->device.type == KILN_DEVICE_CPU;
    } else {
      if (i == 0) delta = (int64_t)byte_offset(s) - (int64_t)byte_offset(d);
      one = s->storage == srcs[0]->storage && s->storage != d->storage &&
            kiln_device_equal(s->storage->device, d->storage->device) &&
            (int64_t)byte_offset(s) - (int64_t)byte_offset(d) == delta;
    }
    size_t off = byte_offset(d);
    if (off < lo) lo = off;
    if (off + kiln_nbytes(d) > hi) hi = off + kiln_nbytes(d);
  }
  if (one && hi > lo) {
    kiln__storage *st = dsts[0]->storage;
    if (!from_host) /* both spans lie inside their blocks: each view does */
      return st->backend->copy_device(st->device.index, (char *)st->data + lo,
                                      (char *)srcs[0]->storage->data + (int64_t)lo + delta, hi - lo);
    char *host = calloc(hi - lo, 1);
    if (!host) return kiln_set_error(KILN_ERR_OOM, "kiln_copy_many_: out of host memory (%zu bytes)", hi - lo);
    for (int i = 0; i < n; i++)
      memcpy(host + byte_offset(dsts[i]) - lo, kiln__view_of(srcs[i]).data, kiln_nbytes(srcs[i]));
    kiln_status rc = st->backend->copy_from_host(st->device.index, (char *)st->data + lo, host, hi - lo);
    free(host);
    return rc;
  }
  for (int i = 0; i < n; i++) {
    kiln_tensor *d = dsts ? dsts[i] : NULL, *s = srcs ? srcs[i] : NULL;
    kiln_status st;
    if (copy_as_bytes(d, s) && d->storage != s->storage &&
        kiln_device_equal(d->storage->device, s->storage->device))
      st = kiln_nbytes(d) ? d->storage->backend->copy_device(d->storage->device.index, kiln__view_of(d).data,
                                                             kiln__view_of(s).data, kiln_nbytes(d))
                          : KILN_OK;
    else
      st = kiln_copy_(d, s);
    if (st != KILN_OK) {
      char msg[512];
      snprintf(msg, sizeof msg, "%s", kiln_last_error_message());
      return kiln_set_error(st, "%s (pair %d)", msg, i);
    }
  }
  return KILN_OK;
}

