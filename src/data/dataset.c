/*
** Datasets: user vtables and tensor datasets (one tensor per field, samples along dim 0).
*/
#include <stdlib.h>
#include <string.h>

#include "data_int.h"

size_t kiln__field_bytes(const kiln_field_spec *s) {
  size_t n = kiln_dtype_size(s->dtype);
  for (int i = 0; i < s->ndim; i++) n *= (size_t)s->shape[i];
  return n;
}

kiln_dataset *kiln_dataset_new(const kiln_dataset_vtable *vt, void *self, int n_fields,
                               const kiln_field_spec *fields) {
  if (!vt || !vt->len || !vt->get || !fields || n_fields < 1 || n_fields > KILN__MAX_FIELDS) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                   "kiln_dataset_new: need a vtable with len and get and 1..%d field specs "
                   "(got n_fields %d)",
                   KILN__MAX_FIELDS, n_fields);
    return NULL;
  }
  for (int f = 0; f < n_fields; f++) {
    const kiln_field_spec *s = &fields[f];
    int bad = s->ndim < 0 || s->ndim >= KILN_MAX_DIMS || kiln_dtype_size(s->dtype) == 0;
    for (int i = 0; !bad && i < s->ndim; i++) bad = s->shape[i] < 0 || s->shape[i] > (INT64_C(1) << 40);
    if (bad) {
      kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                     "kiln_dataset_new: field %d spec is invalid (dtype %d, ndim %d; a batch "
                     "adds a dim, so at most %d)",
                     f, (int)s->dtype, s->ndim, KILN_MAX_DIMS - 1);
      return NULL;
    }
  }
  kiln_dataset *ds = calloc(1, sizeof *ds);
  if (!ds) {
    kiln_set_error(KILN_ERR_OOM, "kiln_dataset_new: out of memory");
    return NULL;
  }
  ds->vt = *vt;
  ds->self = self;
  ds->n_fields = n_fields;
  memcpy(ds->spec, fields, sizeof(*fields) * (size_t)n_fields);
  return ds;
}

kiln_dataset *kiln_tensor_dataset_new(int n_fields, kiln_tensor *const *fields) {
  if (!fields || n_fields < 1 || n_fields > KILN__MAX_FIELDS) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                   "kiln_tensor_dataset_new: need 1..%d fields (got %d)", KILN__MAX_FIELDS,
                   n_fields);
    return NULL;
  }
  for (int f = 0; f < n_fields; f++) {
    char b0[96], b1[96];
    if (!fields[f]) {
      kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_tensor_dataset_new: field %d is NULL", f);
      return NULL;
    }
    if (kiln_ndim(fields[f]) < 1) {
      kiln_set_error(KILN_ERR_SHAPE,
                     "kiln_tensor_dataset_new: field %d is 0-dim; samples run along dim 0", f);
      return NULL;
    }
    if (kiln_size(fields[f], 0) != kiln_size(fields[0], 0)) {
      kiln_set_error(KILN_ERR_SHAPE,
                     "kiln_tensor_dataset_new: fields must share dim 0: field 0 is %s, field "
                     "%d is %s",
                     kiln_shape_str(fields[0], b0, sizeof b0), f,
                     kiln_shape_str(fields[f], b1, sizeof b1));
      return NULL;
    }
  }
  kiln_dataset *ds = calloc(1, sizeof *ds);
  if (!ds) {
    kiln_set_error(KILN_ERR_OOM, "kiln_tensor_dataset_new: out of memory");
    return NULL;
  }
  ds->is_tensor = 1;
  ds->n_fields = n_fields;
  for (int f = 0; f < n_fields; f++) {
    kiln_field_spec *s = &ds->spec[f];
    s->dtype = kiln_dtype_of(fields[f]);
    s->ndim = kiln_ndim(fields[f]) - 1;
    for (int i = 0; i < s->ndim; i++) s->shape[i] = kiln_size(fields[f], i + 1);
    ds->fields[f] = kiln_tensor_ref(fields[f]);
  }
  return ds;
}

int64_t kiln_dataset_len(const kiln_dataset *ds) {
  if (!ds) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_dataset_len: NULL dataset");
    return -1;
  }
  if (ds->is_tensor) return kiln_size(ds->fields[0], 0);
  return ds->vt.len(ds->self);
}

int kiln_dataset_num_fields(const kiln_dataset *ds) { return ds ? ds->n_fields : 0; }

const kiln_field_spec *kiln_dataset_field(const kiln_dataset *ds, int i) {
  return ds && i >= 0 && i < ds->n_fields ? &ds->spec[i] : NULL;
}

void *kiln__dataset_self(const kiln_dataset *ds, kiln_status (*get)(void *self, int64_t index, void *const *bufs)) {
  return ds && !ds->is_tensor && ds->vt.get == get ? ds->self : NULL;
}

kiln_status kiln__dataset_get_into(kiln_dataset *ds, int64_t index, void *const *bufs) {
  if (!ds->is_tensor) {
    kiln_status st = ds->vt.get(ds->self, index, bufs);
    if (st != KILN_OK && kiln_last_error() == KILN_OK)
      kiln_set_error(st, "dataset get(%lld) failed with %s", (long long)index,
                     kiln_error_name(st));
    return st;
  }
  for (int f = 0; f < ds->n_fields; f++) {
    kiln_tensor *row = kiln__own(kiln_select(ds->fields[f], 0, index));
    if (!row) return kiln_last_error();
    kiln_status st = kiln_to_host(row, bufs[f], kiln__field_bytes(&ds->spec[f]));
    kiln_tensor_free(row);
    if (st != KILN_OK) return st;
  }
  return KILN_OK;
}

kiln_status kiln_dataset_read(kiln_dataset *ds, int64_t index, void *const *field_bufs) {
  if (!ds || !field_bufs)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_dataset_read: NULL %s",
                          ds ? "field_bufs" : "dataset");
  int64_t n = kiln_dataset_len(ds);
  if (index < 0 || index >= n)
    return kiln_set_error(KILN_ERR_INDEX, "kiln_dataset_read: index %lld out of range [0, %lld)",
                          (long long)index, (long long)n);
  return kiln__dataset_get_into(ds, index, field_bufs);
}

kiln_status kiln_dataset_get(kiln_dataset *ds, int64_t index, kiln_tensor **out) {
  if (!ds || !out)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_dataset_get: NULL %s",
                          ds ? "out" : "dataset");
  int64_t n = kiln_dataset_len(ds);
  if (index < 0 || index >= n)
    return kiln_set_error(KILN_ERR_INDEX, "kiln_dataset_get: index %lld out of range [0, %lld)",
                          (long long)index, (long long)n);
  kiln_tensor *t[KILN__MAX_FIELDS] = {0};
  void *bufs[KILN__MAX_FIELDS];
  kiln_status st = KILN_OK;
  for (int f = 0; f < ds->n_fields && st == KILN_OK; f++) {
    const kiln_field_spec *s = &ds->spec[f];
    t[f] = kiln__own(kiln_empty(s->ndim, s->ndim ? s->shape : NULL, s->dtype, kiln_device_cpu()));
    if (!t[f]) st = kiln_last_error();
    else if (kiln_numel(t[f]) == 0) bufs[f] = NULL;
    else if (!(bufs[f] = kiln_data_ptr(t[f]))) st = kiln_last_error();
  }
  if (st == KILN_OK) st = kiln__dataset_get_into(ds, index, bufs);
  int made = 0;
  for (; st == KILN_OK && made < ds->n_fields; made++) {
    /* hand over under the usual rule: +1 reference owned by the scope if one is open */
    out[made] = kiln_to_device(t[made], kiln_device_cpu());
    if (!out[made]) st = kiln_last_error();
  }
  if (st != KILN_OK) {
    for (int f = 0; f < made; f++) kiln_tensor_free(kiln__own(out[f]));
    for (int f = 0; f < ds->n_fields; f++) out[f] = NULL;
  }
  for (int f = 0; f < ds->n_fields; f++) kiln_tensor_free(t[f]);
  return st;
}

void kiln_dataset_free(kiln_dataset *ds) {
  if (!ds) return;
  if (ds->vt.destroy) ds->vt.destroy(ds->self);
  for (int f = 0; f < ds->n_fields; f++) kiln_tensor_free(ds->fields[f]);
  free(ds);
}
