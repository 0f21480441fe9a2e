/*
** kiln_dict: ordered name -> tensor map plus string metadata (state dicts, safetensors).
** Entries are only appended or replaced in place, never removed, so each list keeps a
** hash index of positions beside it: a file of a million names loads in linear time
** (a linear scan per insert made a crafted safetensors header take hours).
*/
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kiln_io.h"

typedef struct dict_entry {
  char *key;
  kiln_tensor *t;
} dict_entry;

typedef struct meta_entry {
  char *key;
  char *value;
} meta_entry;

/* Open addressing over positions: slot[h] is an entry's index, or -1. Capacity is a power
** of two at least twice the entries. The hash starts from a value of the dict's own (its
** address, which ASLR moves), so a file cannot be made of names that collide in every run. */
typedef struct dict_index {
  int *slot;
  size_t cap;
} dict_index;

struct kiln_dict {
  dict_entry *e;
  int n, cap;
  meta_entry *m;
  int nm, capm;
  dict_index ie, im;
  uint64_t seed;
};

static size_t hash_str(const kiln_dict *d, const char *s) { /* FNV-1a from the dict's seed */
  uint64_t h = 1469598103934665603ull ^ d->seed;
  for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
  return (size_t)(h ^ (h >> 29));
}

static char *dup_str(const char *s) {
  size_t n = strlen(s) + 1;
  char *p = malloc(n);
  if (p) memcpy(p, s, n);
  return p;
}

kiln_dict *kiln_dict_new(void) {
  kiln_dict *d = calloc(1, sizeof *d);
  if (!d) kiln_set_error(KILN_ERR_OOM, "kiln_dict_new: out of memory");
  else d->seed = (uint64_t)(uintptr_t)d * 0x9E3779B97F4A7C15ull;
  return d;
}

void kiln_dict_free(kiln_dict *d) {
  if (!d) return;
  for (int i = 0; i < d->n; i++) {
    free(d->e[i].key);
    kiln_tensor_free(d->e[i].t);
  }
  for (int i = 0; i < d->nm; i++) {
    free(d->m[i].key);
    free(d->m[i].value);
  }
  free(d->e);
  free(d->m);
  free(d->ie.slot);
  free(d->im.slot);
  free(d);
}

static const char *entry_key(const kiln_dict *d, int i) { return d->e[i].key; }
static const char *meta_key(const kiln_dict *d, int i) { return d->m[i].key; }
typedef const char *(*key_fn)(const kiln_dict *d, int i);

/* The position of key in the list that ix indexes, or -1. */
static int index_find(const kiln_dict *d, const dict_index *ix, key_fn key_at, const char *key) {
  if (!ix->cap) return -1;
  for (size_t h = hash_str(d, key) & (ix->cap - 1);; h = (h + 1) & (ix->cap - 1)) {
    int i = ix->slot[h];
    if (i < 0 || strcmp(key_at(d, i), key) == 0) return i;
  }
}

static void index_put(const kiln_dict *d, dict_index *ix, const char *key, int i) {
  size_t h = hash_str(d, key) & (ix->cap - 1);
  while (ix->slot[h] >= 0) h = (h + 1) & (ix->cap - 1);
  ix->slot[h] = i;
}

/* Room in ix for entry n (entries 0..n-1 indexed already): 0 on OOM, nothing changed. */
static int index_reserve(const kiln_dict *d, dict_index *ix, key_fn key_at, int n) {
  if ((size_t)n + 1 <= ix->cap / 2) return 1;
  size_t cap = ix->cap ? ix->cap * 2 : 32;
  int *slot = malloc(cap * sizeof *slot);
  if (!slot) return 0;
  for (size_t h = 0; h < cap; h++) slot[h] = -1;
  free(ix->slot);
  ix->slot = slot;
  ix->cap = cap;
  for (int i = 0; i < n; i++) index_put(d, ix, key_at(d, i), i);
  return 1;
}

static int find(const kiln_dict *d, const char *name) { return index_find(d, &d->ie, entry_key, name); }
static int find_meta(const kiln_dict *d, const char *key) { return index_find(d, &d->im, meta_key, key); }

kiln_status kiln_dict_set(kiln_dict *d, const char *name, kiln_tensor *t) {
  if (!d || !name || !t)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_dict_set: NULL %s",
                          !d ? "dict" : !name ? "name" : "tensor");
  if (!*name) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_dict_set: empty name");
  int i = find(d, name);
  if (i >= 0) {
    kiln_tensor *old = d->e[i].t;
    d->e[i].t = kiln_tensor_ref(t); /* ref before free: t may be the same tensor */
    kiln_tensor_free(old);
    return KILN_OK;
  }
  if (d->n == d->cap) {
    int cap = d->cap ? d->cap * 2 : 16;
    dict_entry *e = realloc(d->e, (size_t)cap * sizeof *e);
    if (!e) return kiln_set_error(KILN_ERR_OOM, "kiln_dict_set: out of memory");
    d->e = e;
    d->cap = cap;
  }
  char *k = dup_str(name);
  if (!k || !index_reserve(d, &d->ie, entry_key, d->n)) {
    free(k);
    return kiln_set_error(KILN_ERR_OOM, "kiln_dict_set: out of memory");
  }
  d->e[d->n].key = k;
  d->e[d->n].t = kiln_tensor_ref(t);
  index_put(d, &d->ie, k, d->n);
  d->n++;
  return KILN_OK;
}

kiln_tensor *kiln_dict_get(const kiln_dict *d, const char *name) {
  if (!d || !name) return NULL;
  int i = find(d, name);
  return i >= 0 ? d->e[i].t : NULL;
}

int kiln_dict_size(const kiln_dict *d) { return d ? d->n : 0; }

const char *kiln_dict_key(const kiln_dict *d, int i) {
  return d && i >= 0 && i < d->n ? d->e[i].key : NULL;
}

kiln_tensor *kiln_dict_value(const kiln_dict *d, int i) {
  return d && i >= 0 && i < d->n ? d->e[i].t : NULL;
}

kiln_status kiln_dict_set_meta(kiln_dict *d, const char *key, const char *value) {
  if (!d || !key || !value)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_dict_set_meta: NULL %s",
                          !d ? "dict" : !key ? "key" : "value");
  char *v = dup_str(value);
  if (!v) return kiln_set_error(KILN_ERR_OOM, "kiln_dict_set_meta: out of memory");
  int i = find_meta(d, key);
  if (i >= 0) {
    free(d->m[i].value);
    d->m[i].value = v;
    return KILN_OK;
  }
  if (d->nm == d->capm) {
    int cap = d->capm ? d->capm * 2 : 8;
    meta_entry *m = realloc(d->m, (size_t)cap * sizeof *m);
    if (!m) {
      free(v);
      return kiln_set_error(KILN_ERR_OOM, "kiln_dict_set_meta: out of memory");
    }
    d->m = m;
    d->capm = cap;
  }
  char *k = dup_str(key);
  if (!k || !index_reserve(d, &d->im, meta_key, d->nm)) {
    free(k);
    free(v);
    return kiln_set_error(KILN_ERR_OOM, "kiln_dict_set_meta: out of memory");
  }
  d->m[d->nm].key = k;
  d->m[d->nm].value = v;
  index_put(d, &d->im, k, d->nm);
  d->nm++;
  return KILN_OK;
}

const char *kiln_dict_get_meta(const kiln_dict *d, const char *key) {
  if (!d || !key) return NULL;
  int i = find_meta(d, key);
  return i >= 0 ? d->m[i].value : NULL;
}

int kiln_dict_meta_size(const kiln_dict *d) { return d ? d->nm : 0; }

const char *kiln_dict_meta_key(const kiln_dict *d, int i) {
  return d && i >= 0 && i < d->nm ? d->m[i].key : NULL;
}

const char *kiln_dict_meta_value(const kiln_dict *d, int i) {
  return d && i >= 0 && i < d->nm ? d->m[i].value : NULL;
}
