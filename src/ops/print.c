/* Printing tensors the way PyTorch does: tensor([[1.0000, 2.0000], ...], dtype=...). In the
** op layer, not the core: it reads values with kiln_to_host, which runs a copy kernel for a
** strided tensor. */
#include "core/kiln_int.h"

#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

typedef struct sbuf {
  char *p;
  size_t n, cap;
  bool oom;
} sbuf;

static void sb_printf(sbuf *b, const char *fmt, ...) {
  if (b->oom) return;
  for (;;) {
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(b->p ? b->p + b->n : NULL, b->p ? b->cap - b->n : 0, fmt, ap);
    va_end(ap);
    if (k < 0) { b->oom = true; return; }
    if (b->p && b->n + (size_t)k < b->cap) {
      b->n += (size_t)k;
      return;
    }
    size_t ncap = (b->cap ? b->cap * 2 : 256) + (size_t)k;
    char *np = realloc(b->p, ncap);
    if (!np) { b->oom = true; return; }
    b->p = np;
    b->cap = ncap;
  }
}

enum { SUMMARY_THRESHOLD = 1000, EDGE = 3 };

typedef struct fmt {
  kiln_dtype dt;
  int mode; /* 0 int, 1 integral floats "1.", 2 fixed 4, 3 scientific, 4 bool */
  int width;
} fmt;

static int format_value(char *s, size_t n, const fmt *f, double v) {
  if (f->mode == 4) return snprintf(s, n, "%s", v != 0 ? "True" : "False");
  if (f->mode == 0) return snprintf(s, n, "%lld", (long long)v);
  if (isnan(v)) return snprintf(s, n, "nan");
  if (isinf(v)) return snprintf(s, n, v > 0 ? "inf" : "-inf");
  if (f->mode == 1) return snprintf(s, n, "%.0f.", v);
  if (f->mode == 2) return snprintf(s, n, "%.4f", v);
  return snprintf(s, n, "%.4e", v);
}

static bool shown(int64_t i, int64_t size, bool summarize) {
  return !summarize || size <= 2 * EDGE || i < EDGE || i >= size - EDGE;
}

static void emit(sbuf *b, const double *v, const int64_t *shape, const int64_t *strides, int ndim,
                 int dim, int64_t off, const fmt *f, bool summarize, int indent) {
  if (dim == ndim) {
    char s[64];
    format_value(s, sizeof s, f, v[off]);
    sb_printf(b, "%*s", f->width, s);
    return;
  }
  sb_printf(b, "[");
  int64_t size = shape[dim];
  bool skipped = false;
  for (int64_t i = 0; i < size; i++) {
    if (!shown(i, size, summarize)) {
      if (!skipped) {
        skipped = true;
        if (dim == ndim - 1)
          sb_printf(b, " ..., "); /* PyTorch pads the ellipsis with a space */
        else
          sb_printf(b, "...,\n%*s", indent + dim + 1, "");
      }
      continue;
    }
    emit(b, v, shape, strides, ndim, dim + 1, off + i * strides[dim], f, summarize, indent);
    if (i + 1 < size) {
      if (dim == ndim - 1) {
        sb_printf(b, ", ");
      } else {
        sb_printf(b, ",");
        for (int k = 0; k < ndim - dim - 1; k++) sb_printf(b, "\n");
        sb_printf(b, "%*s", indent + dim + 1, "");
      }
    }
  }
  sb_printf(b, "]");
}

static char *render(const kiln_tensor *t) {
  sbuf b = {0};
  int64_t n = kiln_numel(t);
  double *v = malloc((size_t)(n ? n : 1) * sizeof(double));
  void *raw = malloc(kiln_nbytes(t) ? kiln_nbytes(t) : 1);
  if (!v || !raw) {
    free(v);
    free(raw);
    kiln_set_error(KILN_ERR_OOM, "kiln_print: out of host memory");
    return NULL;
  }
  if (kiln_to_host(t, raw, kiln_nbytes(t)) != KILN_OK) {
    free(v);
    free(raw);
    return NULL;
  }
  size_t es = kiln_dtype_size(t->dtype);
  for (int64_t i = 0; i < n; i++) v[i] = kiln__load_double((char *)raw + i * (int64_t)es, t->dtype);
  free(raw);

  fmt f = {t->dtype, 0, 1};
  bool summarize = n > SUMMARY_THRESHOLD;
  if (t->dtype == KILN_BOOL) {
    f.mode = 4;
  } else if (kiln_dtype_is_float(t->dtype)) {
    double amax = 0, amin = INFINITY;
    bool integral = true;
    for (int64_t i = 0; i < n; i++) {
      if (!isfinite(v[i])) continue;
      double a = fabs(v[i]);
      if (a > amax) amax = a;
      if (a != 0 && a < amin) amin = a;
      if (v[i] != floor(v[i])) integral = false;
    }
    if (integral && amax < 1e8)
      f.mode = 1;
    else if (amax >= 1e8 || (amin < 1e-4) || (amin != INFINITY && amax / amin > 1000))
      f.mode = 3;
    else
      f.mode = 2;
  }
  /* width of the widest element shown */
  int64_t cstrides[KILN_MAX_DIMS];
  kiln__contiguous_strides(t->ndim, t->shape, cstrides);
  for (int64_t i = 0; i < n; i++) {
    char s[64];
    int w = format_value(s, sizeof s, &f, v[i]);
    if (w > f.width) f.width = w;
  }
  sb_printf(&b, "tensor(");
  if (n == 0) {
    sb_printf(&b, "[]");
    if (t->ndim != 1) {
      sb_printf(&b, ", size=(");
      for (int i = 0; i < t->ndim; i++) sb_printf(&b, i ? ", %lld" : "%lld", (long long)t->shape[i]);
      sb_printf(&b, t->ndim == 1 ? ",)" : ")");
    }
  } else {
    emit(&b, v, t->shape, cstrides, t->ndim, 0, 0, &f, summarize, 7);
  }
  free(v);
  bool default_dtype = t->dtype == KILN_F32 || t->dtype == KILN_I64 || t->dtype == KILN_BOOL;
  kiln_device dev = kiln_device_of(t);
  if (dev.type != KILN_DEVICE_CPU) sb_printf(&b, ", device='%s'", kiln__device_cstr(dev));
  if (!default_dtype) sb_printf(&b, ", dtype=%s", kiln_dtype_name(t->dtype));
  if (t->grad_fn)
    sb_printf(&b, ", grad_fn=<%s>", t->grad_fn->name);
  else if (t->requires_grad)
    sb_printf(&b, ", requires_grad=True");
  sb_printf(&b, ")");
  if (b.oom) {
    free(b.p);
    kiln_set_error(KILN_ERR_OOM, "kiln_print: out of host memory");
    return NULL;
  }
  return b.p;
}

int kiln_snprint(char *buf, size_t n, const kiln_tensor *t) {
  if (!t) {
    if (kiln_last_error() == KILN_OK) kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_snprint: NULL tensor");
    return -1;
  }
  char *s = render(t);
  if (!s) return -1;
  int len = (int)strlen(s);
  if (buf && n > 0) snprintf(buf, n, "%s", s);
  free(s);
  return len;
}

kiln_status kiln_fprint(FILE *f, const kiln_tensor *t) {
  if (!t) {
    if (kiln_last_error() == KILN_OK) kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_print: NULL tensor");
    return kiln_last_error();
  }
  char *s = render(t);
  if (!s) return kiln_last_error();
  fprintf(f ? f : stdout, "%s\n", s);
  free(s);
  return KILN_OK;
}

kiln_status kiln_print(const kiln_tensor *t) { return kiln_fprint(stdout, t); }
