/*
** kiln_dict: ordered name -> tensor map plus string metadata (state dicts, safetensors).
** Lookups are linear: state dicts hold hundreds of entries, and a scan of that many
** short strings costs less than keeping a hash table in step with in-place replacement.
*/
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

struct kiln_dict {
  dict_entry *e;
  int n, cap;
  meta_entry *m;
  int nm, capm;
};

static char *dup_str(const char *s) {
  size_t n = strlen(s) + 1;
  char *p = malloc(n);
  if (p) memcpy(p, s, n);
  return p;
}

kiln_dict *kiln_dict_new(void) {
  kiln_dict *d = calloc(1, sizeof *d);
  if (!d) kiln_set_error(KILN_ERR_OOM, "kiln_dict_new: out of memory");
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
  free(d);
}

static int find(const kiln_dict *d, const char *name) {
  for (int i = 0; i < d->n; i++)
    if (strcmp(d->e[i].key, name) == 0) return i;
  return -1;
}

static int find_meta(const kiln_dict *d, const char *key) {
  for (int i = 0; i < d->nm; i++)
    if (strcmp(d->m[i].key, key) == 0) return i;
  return -1;
}

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
  if (!k) return kiln_set_error(KILN_ERR_OOM, "kiln_dict_set: out of memory");
  d->e[d->n].key = k;
  d->e[d->n].t = kiln_tensor_ref(t);
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
  if (!k) {
    free(v);
    return kiln_set_error(KILN_ERR_OOM, "kiln_dict_set_meta: out of memory");
  }
  d->m[d->nm].key = k;
  d->m[d->nm].value = v;
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
