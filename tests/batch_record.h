/* Shared by the loader tests (test_data_loader_async, test_data_loader_cuda): an epoch
** recorded as bytes, for each batch each field's rank, shape and contents, so that two
** loaders' epochs compare with one memcmp. Header-only; CHECK comes from check.h. */
#ifndef KILN_TEST_BATCH_RECORD_H
#define KILN_TEST_BATCH_RECORD_H

#include <kiln.h>

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

typedef struct record {
  unsigned char *p; /* malloc'd; the caller frees */
  size_t n, cap;
  int batches, staged; /* batches put, and those the test counted as staged */
} record;

static inline void put(record *r, const void *p, size_t n) {
  if (r->n + n > r->cap) {
    r->cap = (r->n + n) * 2;
    r->p = realloc(r->p, r->cap);
  }
  memcpy(r->p + r->n, p, n);
  r->n += n;
}

/* One field of a batch: its rank, shape and bytes (copied to the host). */
static inline void put_tensor(record *r, kiln_tensor *t) {
  int nd = kiln_ndim(t);
  put(r, &nd, sizeof nd);
  put(r, kiln_shape(t), sizeof(int64_t) * (size_t)nd);
  size_t nb = kiln_nbytes(t);
  unsigned char *tmp = malloc(nb + 1);
  CHECK(kiln_to_host(t, tmp, nb) == KILN_OK);
  put(r, tmp, nb);
  free(tmp);
}

/* Whether two epochs recorded the same bytes. */
static inline bool record_same(const record *a, const record *b) {
  return a->n == b->n && memcmp(a->p, b->p, a->n) == 0;
}

#endif
