/*
** NumPy .npy reader and writer (numpy/lib/format.py, NEP 1).
**
** File layout:
**
**   offset 0   6 bytes   magic "\x93NUMPY"
**   offset 6   u8 major, u8 minor      version 1.0, 2.0 or 3.0
**   offset 8   header length H          u16 LE for 1.0; u32 LE for 2.0 and 3.0
**   offset 10 (1.0) or 12 (2.0, 3.0)    H bytes of header: a Python dict literal, ASCII
**                                       (1.0, 2.0) or UTF-8 (3.0), padded with spaces and
**                                       ending in '\n' so the data starts 64-aligned:
**                                       {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
**   then       the array's bytes: numel * itemsize, C order (or Fortran order when
**              fortran_order is True), in the byte order descr names
**
** descr is a byte-order char ('<' little, '>' big, '|' not applicable, '=' native) then a
** kind and an item size: f4 f8 f2 i8 i4 u1 b1 are what kiln holds.
*/
#define _POSIX_C_SOURCE 200809L
#define _FILE_OFFSET_BITS 64
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "io_int.h"
#include "kiln_io.h"

#define WHO "kiln_npy_load"

typedef struct npy_header {
  kiln_dtype dtype;
  int fortran;
  int ndim;
  int64_t shape[KILN_MAX_DIMS];
  int have_descr, have_fortran, have_shape;
} npy_header;

typedef struct lit {
  const char *p, *end, *start;
  uint64_t base; /* file offset of start */
} lit;

static void lit_ws(lit *l) {
  while (l->p < l->end && (*l->p == ' ' || *l->p == '\t' || *l->p == '\n' || *l->p == '\r'))
    l->p++;
}

static unsigned long long lit_off(const lit *l) {
  return (unsigned long long)(l->base + (uint64_t)(l->p - l->start));
}

/* A Python string literal with ' or " quotes, no escapes (numpy writes none). */
static int lit_string(lit *l, char *out, size_t cap) {
  lit_ws(l);
  if (l->p >= l->end || (*l->p != '\'' && *l->p != '"')) return 0;
  char q = *l->p++;
  size_t n = 0;
  while (l->p < l->end && *l->p != q) {
    if (*l->p == '\\' || n + 1 >= cap) return 0;
    out[n++] = *l->p++;
  }
  if (l->p >= l->end) return 0;
  l->p++;
  out[n] = 0;
  return 1;
}

static int lit_word(lit *l, const char *w) {
  lit_ws(l);
  size_t n = strlen(w);
  if ((size_t)(l->end - l->p) < n || memcmp(l->p, w, n) != 0) return 0;
  l->p += n;
  return 1;
}

static kiln_status parse_descr(const char *path, const char *d, npy_header *h,
                               unsigned long long off) {
  char order = 0;
  if (*d == '<' || *d == '>' || *d == '|' || *d == '=') order = *d++;
  static const struct {
    const char *code;
    kiln_dtype dt;
  } map[] = {{"f4", KILN_F32}, {"f8", KILN_F64}, {"f2", KILN_F16}, {"i8", KILN_I64},
             {"i4", KILN_I32}, {"u1", KILN_U8},  {"b1", KILN_BOOL}};
  for (size_t i = 0; i < sizeof map / sizeof map[0]; i++)
    if (strcmp(d, map[i].code) == 0) {
      if (order == '>' && kiln_dtype_size(map[i].dt) > 1)
        return kiln_set_error(KILN_ERR_FORMAT,
                              WHO ": %s: big-endian dtype '>%s' is not supported (header at "
                                  "file offset %llu); save it little-endian "
                                  "(arr.astype(arr.dtype.newbyteorder('<')))",
                              path, d, off);
      h->dtype = map[i].dt;
      return KILN_OK;
    }
  return kiln_set_error(KILN_ERR_DTYPE,
                        WHO ": %s: dtype '%s' is not one kiln holds (<f4 <f8 <f2 <i8 <i4 |u1 "
                            "|b1)",
                        path, d);
}

/* Parses the header dict literal. */
static kiln_status parse_header(const char *path, const char *s, size_t n, uint64_t base,
                                npy_header *h) {
  lit l = {s, s + n, s, base};
  memset(h, 0, sizeof *h);
  lit_ws(&l);
  if (l.p >= l.end || *l.p != '{') goto syntax;
  l.p++;
  for (;;) {
    lit_ws(&l);
    if (l.p < l.end && *l.p == '}') {
      l.p++;
      break;
    }
    char key[32];
    if (!lit_string(&l, key, sizeof key)) goto syntax;
    lit_ws(&l);
    if (l.p >= l.end || *l.p != ':') goto syntax;
    l.p++;
    lit_ws(&l);
    if (strcmp(key, "descr") == 0) {
      char d[32];
      if (l.p < l.end && *l.p == '[')
        return kiln_set_error(KILN_ERR_DTYPE,
                              WHO ": %s: structured dtypes are not supported (file offset %llu)",
                              path, lit_off(&l));
      unsigned long long at = lit_off(&l);
      if (!lit_string(&l, d, sizeof d)) goto syntax;
      kiln_status st = parse_descr(path, d, h, at);
      if (st != KILN_OK) return st;
      h->have_descr++;
    } else if (strcmp(key, "fortran_order") == 0) {
      if (lit_word(&l, "True")) h->fortran = 1;
      else if (lit_word(&l, "False")) h->fortran = 0;
      else goto syntax;
      h->have_fortran++;
    } else if (strcmp(key, "shape") == 0) {
      if (l.p >= l.end || *l.p != '(') goto syntax;
      l.p++;
      h->ndim = 0;
      for (;;) {
        lit_ws(&l);
        if (l.p < l.end && *l.p == ')') {
          l.p++;
          break;
        }
        if (l.p >= l.end || *l.p < '0' || *l.p > '9') goto syntax;
        uint64_t v = 0;
        while (l.p < l.end && *l.p >= '0' && *l.p <= '9') {
          v = v * 10 + (uint64_t)(*l.p++ - '0');
          if (v > (UINT64_C(1) << 48)) goto syntax;
        }
        if (l.p < l.end && *l.p == 'L') l.p++; /* Python 2 longs */
        if (h->ndim == KILN_MAX_DIMS)
          return kiln_set_error(KILN_ERR_SHAPE, WHO ": %s: more than %d dims", path,
                                KILN_MAX_DIMS);
        h->shape[h->ndim++] = (int64_t)v;
        lit_ws(&l);
        if (l.p < l.end && *l.p == ',') l.p++;
        else if (l.p < l.end && *l.p == ')') continue;
        else goto syntax;
      }
      h->have_shape++;
    } else {
      return kiln_set_error(KILN_ERR_FORMAT, WHO ": %s: unknown header key '%s' (file offset %llu)",
                            path, key, lit_off(&l));
    }
    lit_ws(&l);
    if (l.p < l.end && *l.p == ',') {
      l.p++;
      continue;
    }
    if (l.p < l.end && *l.p == '}') {
      l.p++;
      break;
    }
    goto syntax;
  }
  lit_ws(&l);
  while (l.p < l.end && *l.p == '\0') l.p++; /* some writers pad with NULs */
  if (l.p != l.end) goto syntax;
  if (h->have_descr != 1 || h->have_fortran != 1 || h->have_shape != 1)
    return kiln_set_error(KILN_ERR_FORMAT,
                          WHO ": %s: header needs 'descr', 'fortran_order' and 'shape' once each",
                          path);
  return KILN_OK;
syntax:
  return kiln_set_error(KILN_ERR_FORMAT, WHO ": %s: bad header syntax at file offset %llu", path,
                        lit_off(&l));
}

/* Fortran order to C order: element (i0, ..., ik) sits at sum i_j * prod_{m<j} shape_m
** in src. Walks dst in C order with an odometer, keeping the source offset in step. */
static void fortran_to_c(unsigned char *dst, const unsigned char *src, int nd,
                         const int64_t *shape, size_t es, int64_t numel) {
  int64_t fstride[KILN_MAX_DIMS], idx[KILN_MAX_DIMS] = {0};
  int64_t s = 1;
  for (int j = 0; j < nd; j++) {
    fstride[j] = s;
    s *= shape[j];
  }
  int64_t off = 0;
  for (int64_t i = 0; i < numel; i++) {
    memcpy(dst + (size_t)i * es, src + (size_t)off * es, es);
    for (int j = nd - 1; j >= 0; j--) {
      idx[j]++;
      off += fstride[j];
      if (idx[j] < shape[j]) break;
      off -= fstride[j] * shape[j];
      idx[j] = 0;
    }
  }
}

kiln_tensor *kiln_npy_load(const char *path, kiln_device dev) {
  uint64_t fsize;
  FILE *f = kiln__fopen_regular_size(WHO, path, &fsize); /* NULL path refused; a FIFO too, not waited on */
  if (!f) return NULL;
  char *hdr = NULL;
  unsigned char *tmp = NULL;
  kiln_tensor *t = NULL;
  unsigned char pre[12];
  if (fread(pre, 1, 10, f) != 10 || memcmp(pre, "\x93NUMPY", 6) != 0) {
    kiln_set_error(KILN_ERR_FORMAT, WHO ": %s: not a .npy file (no \\x93NUMPY magic at file offset 0)",
                   path);
    goto fail;
  }
  int major = pre[6], minor = pre[7];
  uint64_t hlen, hstart;
  if (major == 1 && minor == 0) {
    hlen = (uint64_t)pre[8] | ((uint64_t)pre[9] << 8);
    hstart = 10;
  } else if ((major == 2 || major == 3) && minor == 0) {
    if (fread(pre + 10, 1, 2, f) != 2) {
      kiln_set_error(KILN_ERR_FORMAT, WHO ": %s: truncated at file offset 10", path);
      goto fail;
    }
    hlen = (uint64_t)pre[8] | ((uint64_t)pre[9] << 8) | ((uint64_t)pre[10] << 16) |
           ((uint64_t)pre[11] << 24);
    hstart = 12;
  } else {
    kiln_set_error(KILN_ERR_FORMAT, WHO ": %s: unsupported format version %d.%d (file offset 6)",
                   path, major, minor);
    goto fail;
  }
  if (hlen > fsize - hstart) {
    kiln_set_error(KILN_ERR_FORMAT,
                   WHO ": %s: header length %llu at file offset 8 runs past the end of the "
                       "file of %llu bytes",
                   path, (unsigned long long)hlen, (unsigned long long)fsize);
    goto fail;
  }
  hdr = malloc((size_t)hlen + 1);
  if (!hdr) {
    kiln_set_error(KILN_ERR_OOM, WHO ": %s: out of memory", path);
    goto fail;
  }
  if (fread(hdr, 1, (size_t)hlen, f) != (size_t)hlen) {
    kiln_set_error(KILN_ERR_IO, WHO ": %s: cannot read the header", path);
    goto fail;
  }
  hdr[hlen] = 0;
  npy_header h;
  if (parse_header(path, hdr, (size_t)hlen, hstart, &h) != KILN_OK) goto fail;
  size_t es = kiln_dtype_size(h.dtype);
  /* span: the product with zero dims counted as 1 (strides are made of it), checked
  ** like the element count, so [0, 2^40, 2^40] is refused too. */
  uint64_t numel = 1, span = 1;
  for (int i = 0; i < h.ndim; i++) {
    uint64_t d = h.shape[i] ? (uint64_t)h.shape[i] : 1;
    if (span > (UINT64_C(1) << 56) / d) {
      kiln_set_error(KILN_ERR_SHAPE, WHO ": %s: shape too large (a product of its dims passes 2^56)",
                     path);
      goto fail;
    }
    span *= d;
    numel *= (uint64_t)h.shape[i];
  }
  uint64_t nbytes = numel * es, dstart = hstart + hlen;
  if (fsize - dstart != nbytes) {
    kiln_set_error(KILN_ERR_FORMAT,
                   WHO ": %s: data at file offset %llu is %llu bytes but the shape needs %llu "
                       "(%s)",
                   path, (unsigned long long)dstart, (unsigned long long)(fsize - dstart),
                   (unsigned long long)nbytes,
                   fsize - dstart < nbytes ? "truncated" : "trailing bytes");
    goto fail;
  }
  t = kiln__own(kiln_empty(h.ndim, h.ndim ? h.shape : NULL, h.dtype, kiln_device_cpu()));
  if (!t) goto fail;
  if (nbytes) {
    unsigned char *p = kiln_data_ptr(t);
    if (!p) goto fail;
    int transpose = h.fortran && h.ndim > 1;
    unsigned char *into = p;
    if (transpose) {
      into = tmp = malloc((size_t)nbytes);
      if (!tmp) {
        kiln_set_error(KILN_ERR_OOM, WHO ": %s: out of memory (%llu bytes)", path,
                       (unsigned long long)nbytes);
        goto fail;
      }
    }
    if (fread(into, 1, (size_t)nbytes, f) != (size_t)nbytes) {
      kiln_set_error(KILN_ERR_IO, WHO ": %s: read of %llu bytes at file offset %llu failed",
                     path, (unsigned long long)nbytes, (unsigned long long)dstart);
      goto fail;
    }
    if (!kiln__host_is_le()) kiln__swap_bytes(into, (size_t)numel, es);
    if (transpose) fortran_to_c(p, tmp, h.ndim, h.shape, es, (int64_t)numel);
    if (h.dtype == KILN_BOOL)
      for (uint64_t i = 0; i < nbytes; i++) p[i] = p[i] != 0;
  }
  free(tmp);
  free(hdr);
  fclose(f);
  /* Hand the result back under the usual rule: owned by the caller's scope if one is
  ** open. kiln_to_device returns a new reference (the same tensor when dev is the CPU). */
  kiln_tensor *out = kiln_to_device(t, dev);
  kiln_tensor_free(t);
  return out;
fail:
  kiln_tensor_free(t);
  free(tmp);
  free(hdr);
  fclose(f);
  return NULL;
}

#undef WHO
#define WHO "kiln_npy_save"

kiln_status kiln_npy_save(const char *path, const kiln_tensor *t) {
  if (!path || !t)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, WHO ": NULL %s", path ? "tensor" : "path");
  const char *descr;
  switch (kiln_dtype_of(t)) {
  case KILN_F32: descr = "<f4"; break;
  case KILN_F64: descr = "<f8"; break;
  case KILN_F16: descr = "<f2"; break;
  case KILN_I64: descr = "<i8"; break;
  case KILN_I32: descr = "<i4"; break;
  case KILN_U8: descr = "|u1"; break;
  case KILN_BOOL: descr = "|b1"; break;
  default:
    return kiln_set_error(KILN_ERR_DTYPE,
                          WHO ": %s: dtype %s has no numpy equivalent (convert to float32)", path,
                          kiln_dtype_name(kiln_dtype_of(t)));
  }
  char shape[KILN_MAX_DIMS * 24 + 8];
  size_t sn = 0;
  int nd = kiln_ndim(t);
  shape[sn++] = '(';
  for (int i = 0; i < nd; i++)
    sn += (size_t)snprintf(shape + sn, sizeof shape - sn, i ? ", %lld" : "%lld",
                           (long long)kiln_size(t, i));
  if (nd == 1) shape[sn++] = ',';
  shape[sn++] = ')';
  shape[sn] = 0;
  char dict[sizeof shape + 96];
  int dn = snprintf(dict, sizeof dict, "{'descr': '%s', 'fortran_order': False, 'shape': %s, }",
                    descr, shape);
  /* Pad with spaces and a final '\n' so that the data starts 64-aligned (numpy >= 1.22). */
  size_t pre = 10, total = pre + (size_t)dn + 1;
  size_t padded = (total + 63) / 64 * 64;
  char hdr[sizeof dict + 64 + 12];
  memcpy(hdr, "\x93NUMPY\x01\x00", 8);
  size_t hl = padded - pre;
  hdr[8] = (char)(hl & 0xff);
  hdr[9] = (char)(hl >> 8);
  memcpy(hdr + pre, dict, (size_t)dn);
  memset(hdr + pre + dn, ' ', hl - (size_t)dn - 1);
  hdr[padded - 1] = '\n';

  size_t nb = kiln_nbytes(t);
  void *buf = malloc(nb ? nb : 1);
  if (!buf) return kiln_set_error(KILN_ERR_OOM, WHO ": %s: out of memory (%zu bytes)", path, nb);
  kiln_status st = nb ? kiln_to_host(t, buf, nb) : KILN_OK;
  if (st == KILN_OK) {
    size_t es = kiln_dtype_size(kiln_dtype_of(t));
    if (!kiln__host_is_le()) kiln__swap_bytes(buf, nb / es, es);
    kiln__atomic_file af;
    st = kiln__atomic_open(&af, WHO, path);
    if (st == KILN_OK) {
      st = kiln__atomic_write(&af, hdr, padded);
      if (st == KILN_OK) st = kiln__atomic_write(&af, buf, nb);
      if (st == KILN_OK) st = kiln__atomic_commit(&af);
      else kiln__atomic_abort(&af);
    }
  }
  free(buf);
  return st;
}
