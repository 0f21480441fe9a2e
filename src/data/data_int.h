/*
** Internals of the data layer (not API): the dataset object, shared by dataset.c and
** loader.c.
*/
#ifndef KILN_DATA_INT_H
#define KILN_DATA_INT_H

#include "kiln_data.h"

#define KILN__MAX_FIELDS 64

struct kiln_dataset {
  kiln_dataset_vtable vt; /* user datasets */
  void *self;
  int n_fields;
  kiln_field_spec spec[KILN__MAX_FIELDS];
  kiln_tensor *fields[KILN__MAX_FIELDS]; /* tensor datasets: one reference each; else NULL */
  int is_tensor;
};

/* Bytes of one sample's field f. */
size_t kiln__field_bytes(const kiln_field_spec *s);
/* Writes sample index into per-field host buffers (both kinds of dataset). */
kiln_status kiln__dataset_get_into(kiln_dataset *ds, int64_t index, void *const *bufs);

#endif /* KILN_DATA_INT_H */
