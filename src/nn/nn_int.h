/* Private helpers shared by src/nn, src/optim and src/io/checkpoint.c. Built only on the
** public headers (these layers never reach into kiln's core internals). */
#ifndef KILN_NN_INT_H
#define KILN_NN_INT_H

#include <stdarg.h>

#include "kiln.h"
#include "kiln_io.h"
#include "kiln_nn.h"

/* A growable string for error messages that list many problems. On OOM it silently
** stops growing (the message is then shorter, never wrong). */
typedef struct kiln__sb {
  char *buf;
  size_t len, cap;
} kiln__sb;
void kiln__sb_printf(kiln__sb *sb, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
const char *kiln__sb_str(const kiln__sb *sb); /* "" when empty */
void kiln__sb_free(kiln__sb *sb);

/* A list of problems of three kinds, printed as "N missing keys: a, b; ..." with at most
** a handful of names per kind (the message buffer of the last error is 1 KiB). */
typedef struct kiln__problems {
  kiln__sb missing, unexpected, mismatch;
  int n_missing, n_unexpected, n_mismatch;
  kiln_status mismatch_code; /* first mismatch's code (SHAPE or DTYPE) */
} kiln__problems;
void kiln__problems_missing(kiln__problems *p, const char *name);
void kiln__problems_unexpected(kiln__problems *p, const char *name);
void kiln__problems_mismatch(kiln__problems *p, kiln_status code, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
int kiln__problems_count(const kiln__problems *p);
/* Sets the last error "<who>: <the list>" and returns its code (KILN_OK when empty). */
kiln_status kiln__problems_report(kiln__problems *p, const char *who);
void kiln__problems_free(kiln__problems *p);

/* Validates d against m (apply false) or validates and then copies (apply true). The
** public kiln_module_load_state_dict is this with apply true; checkpoints validate every
** part before applying any. who names the caller in the message. */
kiln_status kiln__module_load_state_dict(kiln_module *m, const kiln_dict *d, bool strict,
                                         bool apply, const char *who);

/* The module's vtable (identifies kiln's own layer types exactly, for fusions). */
const kiln_module_vtable *kiln__module_vtable(const kiln_module *m);

/* The module's configuration text (vtable extra_repr), "" when it has none; snprintf-like. */
int kiln__module_extra_repr(const kiln_module *m, char *buf, size_t n);

/* Number parsing for metadata: KILN_ERR_FORMAT naming key and text on failure. */
kiln_status kiln__meta_i64(const kiln_dict *d, const char *key, int64_t *out, const char *who);
kiln_status kiln__meta_f64(const kiln_dict *d, const char *key, double *out, const char *who);
kiln_status kiln__meta_set_i64(kiln_dict *d, const char *key, int64_t v);
kiln_status kiln__meta_set_f64(kiln_dict *d, const char *key, double v);

#endif /* KILN_NN_INT_H */
