/*
** View helpers every backend may use: element counts, contiguity, and dim coalescing so
** that kernels iterate over the fewest dims (a contiguous tensor becomes one flat run);
** and the reading of ADAM_MULTI's list layout, which every backend's list kernel needs.
*/
#include "backend.h"

int64_t kiln__view_numel(const kiln__view *v) {
  int64_t n = 1;
  for (int d = 0; d < v->ndim; d++) n *= v->shape[d];
  return n;
}

int64_t kiln__view_extent(const kiln__view *v) {
  int64_t last = 0;
  for (int d = 0; d < v->ndim; d++) {
    if (v->shape[d] == 0) return 0;
    if (v->strides[d] > 0) last += (v->shape[d] - 1) * v->strides[d];
  }
  return last + 1;
}

/* C-contiguous, ignoring the strides of size-1 dims (they are never stepped over). */
bool kiln__view_is_contiguous(const kiln__view *v) {
  int64_t expect = 1;
  for (int d = v->ndim - 1; d >= 0; d--) {
    if (v->shape[d] == 0) return true;
    if (v->shape[d] == 1) continue;
    if (v->strides[d] != expect) return false;
    expect *= v->shape[d];
  }
  return true;
}

/* Keeps the dims in their order (so a linear index over the result is still the C-order
** index of the original shape, which the RNG kernels rely on). */
int kiln__views_coalesce(kiln__view *views, int n) {
  if (n <= 0) return 0;
  int nd = views[0].ndim;
  int64_t numel = kiln__view_numel(&views[0]);
  if (numel == 0) {
    for (int i = 0; i < n; i++) {
      views[i].ndim = 1;
      views[i].shape[0] = 0;
      views[i].strides[0] = 1;
    }
    return 1;
  }
  int out = 0; /* dims kept so far, written in place */
  for (int d = 0; d < nd; d++) {
    int64_t size = views[0].shape[d];
    if (size == 1) continue;
    bool merge = out > 0;
    for (int i = 0; merge && i < n; i++) {
      /* dim out-1 (outer) merges with d (inner) when one step of the outer equals a full
      ** sweep of the inner, in every view */
      if (views[i].strides[out - 1] != views[i].strides[d] * size) merge = false;
    }
    if (merge) {
      for (int i = 0; i < n; i++) {
        views[i].shape[out - 1] *= size;
        views[i].strides[out - 1] = views[i].strides[d];
      }
    } else {
      for (int i = 0; i < n; i++) {
        views[i].shape[out] = size;
        views[i].strides[out] = views[i].strides[d];
      }
      out++;
    }
  }
  if (out == 0) { /* a single element */
    for (int i = 0; i < n; i++) {
      views[i].shape[0] = 1;
      views[i].strides[0] = 1;
    }
    out = 1;
  }
  for (int i = 0; i < n; i++) views[i].ndim = out;
  return out;
}

int kiln__sgd_list_width(const kiln__kargs *a) {
  const int w = 2 + ((a->i[1] & 16) ? 1 : 0) + ((a->i[1] & 4) ? 1 : 0) + ((a->i[1] & 32) ? 1 : 0);
  if (a->list_w != w || (a->list_n > 0 && !a->list)) {
    kiln_set_error(KILN_ERR_INTERNAL, "kiln sgd_multi kernel: expected groups of %d views, got %d", w, a->list_w);
    return -1;
  }
  return w;
}

int kiln__adam_list_width(const kiln__kargs *a) {
  const int w = 4 + ((a->i[1] & 2) ? 1 : 0) + ((a->i[1] & 4) ? 1 : 0) + ((a->i[1] & 16) ? 1 : 0);
  if (a->list_w != w || (a->list_n > 0 && !a->list)) {
    kiln_set_error(KILN_ERR_INTERNAL, "kiln adam_multi kernel: expected groups of %d views, got %d", w, a->list_w);
    return -1;
  }
  return w;
}
