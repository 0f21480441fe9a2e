/*
** safetensors reader and writer (https://github.com/huggingface/safetensors).
**
** File layout (all integers little-endian):
**
**   offset 0        u64 N            length of the JSON header in bytes
**   offset 8        N bytes          UTF-8 JSON object, may be padded with trailing spaces
**                                    (the reference pads so that 8 + N is a multiple of 8)
**   offset 8 + N    data area        the tensors' bytes, back to back, C order, LE
**
** The header maps each tensor name to
**   {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}
** with [begin, end) relative to the start of the data area, and may hold one entry
** "__metadata__": {"key": "value", ...} (string values only). A valid file's tensors
** cover the data area exactly: sorted by begin, each starts where the previous ended,
** the first at 0 and the last ending at the end of the file; end - begin equals
** numel(shape) * dtype size. Dtypes: BOOL U8 I8 I16 U16 F16 BF16 I32 U32 F32 F64 I64
** U64 F8_E4M3 F8_E5M2 ...; kiln holds F32 F64 F16 BF16 I64 I32 U8 BOOL.
**
** The reader checks every one of these rules before it allocates a tensor, so a
** corrupt file costs at most the header's memory (capped at 100 MB as the reference).
*/
#define _POSIX_C_SOURCE 200809L
#define _FILE_OFFSET_BITS 64
#include <errno.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "io_int.h"
#include "kiln_io.h"
#include "ext/kiln_ext.h"

#define ST_MAX_HEADER 100000000ull /* the reference's limit */
#define WHO "kiln_safetensors_load"

static const struct {
  const char *name;
  int dtype; /* kiln_dtype, or -1: valid in safetensors but not held by kiln */
  int bits;  /* per element; F4 and F6 pack elements across bytes */
} st_dtypes[] = {
    {"F32", KILN_F32, 32}, {"F64", KILN_F64, 64}, {"F16", KILN_F16, 16},   {"BF16", KILN_BF16, 16},
    {"I64", KILN_I64, 64}, {"I32", KILN_I32, 32}, {"U8", KILN_U8, 8},      {"BOOL", KILN_BOOL, 8},
    {"I8", -1, 8},         {"I16", -1, 16},       {"U16", -1, 16},         {"U32", -1, 32},
    {"U64", -1, 64},       {"F8_E4M3", -1, 8},    {"F8_E5M2", -1, 8},      {"F8_E8M0", -1, 8},
    {"F4", -1, 4},         {"F6_E2M3", -1, 6},    {"F6_E3M2", -1, 6},      {"C64", -1, 64},
};
#define ST_HELD "F32 F64 F16 BF16 I64 I32 U8 BOOL"

static const char *st_dtype_name(kiln_dtype dt) {
  for (size_t i = 0; i < sizeof st_dtypes / sizeof st_dtypes[0]; i++)
    if (st_dtypes[i].dtype == (int)dt) return st_dtypes[i].name;
  return NULL;
}

typedef struct st_info {
  const char *name; /* in the names arena */
  size_t name_at;   /* the name's offset in the header, for errors */
  kiln_dtype dtype; /* KILN_DTYPE__COUNT: one kiln does not hold (listed, not read) */
  int st_dtype;     /* the file's, an index into st_dtypes */
  int ndim;
  int64_t shape[KILN_MAX_DIMS];
  uint64_t begin, end;
  int pos; /* in the header's order: ties of data order (empty tensors) keep it */
} st_info;

/* The header's entries as the cursor reads them: tensors in JSON order, their names
** decoded into one arena (a decoded name and its NUL never outgrow the quoted text). */
typedef struct st_header {
  st_info *infos;
  int n, cap;
  char *names;
  size_t names_used;
} st_header;

static int cmp_offsets(const void *a, const void *b) {
  const st_info *x = a, *y = b;
  if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
  if (x->end != y->end) return x->end < y->end ? -1 : 1;
  return (x->pos > y->pos) - (x->pos < y->pos);
}

static int cmp_names(const void *a, const void *b) {
  const st_info *x = *(const st_info *const *)a, *y = *(const st_info *const *)b;
  int c = strcmp(x->name, y->name);
  return c ? c : (x->name_at > y->name_at) - (x->name_at < y->name_at);
}

/* A member of an entry seen twice: the reference refuses it, and the second copy would
** otherwise silently win. */
static int once(kiln__jreader *jr, int *seen, const char *name) {
  if (!*seen) return *seen = 1;
  kiln__jr_fail_at(jr, jr->key_pos, "tensor '%s' has \"%s\" twice", name, jr->buf);
  return 0;
}

/* Reads one tensor entry's value at the cursor into info. 1, or 0 with the error set. */
static int parse_entry(kiln__jreader *jr, st_info *info) {
  const char *name = info->name;
  int c = kiln__jr_peek(jr);
  size_t at = jr->pos;
  if (c != '{') {
    kiln__jr_fail_at(jr, at, "tensor '%s' entry is not a JSON object", name);
    return 0;
  }
  kiln__jr_object_begin(jr);
  int first = 1, r, seen_dt = 0, seen_shape = 0, seen_off = 0;
  size_t dt_at = 0, shape_at = 0, off_at = 0;
  uint64_t dims[KILN_MAX_DIMS];
  while ((r = kiln__jr_member(jr, &first)) == 1) {
    if (!strcmp(jr->buf, "dtype")) {
      if (!once(jr, &seen_dt, name)) return 0;
      dt_at = jr->pos;
      if (kiln__jr_peek(jr) != '"') {
        kiln__jr_fail_at(jr, dt_at, "tensor '%s' \"dtype\" is not a string", name);
        return 0;
      }
      if (!kiln__jr_string(jr)) return 0;
      int found = 0;
      for (size_t i = 0; i < sizeof st_dtypes / sizeof st_dtypes[0] && !found; i++) {
        if (strcmp(st_dtypes[i].name, jr->buf) != 0) continue;
        info->dtype = st_dtypes[i].dtype < 0 ? KILN_DTYPE__COUNT : (kiln_dtype)st_dtypes[i].dtype;
        info->st_dtype = (int)i;
        found = 1;
      }
      if (!found) {
        kiln__jr_fail_at(jr, dt_at, "tensor '%s' has unknown dtype \"%.32s\"", name, jr->buf);
        return 0;
      }
    } else if (!strcmp(jr->buf, "shape")) {
      if (!once(jr, &seen_shape, name)) return 0;
      shape_at = jr->pos;
      if (kiln__jr_peek(jr) != '[') {
        kiln__jr_fail_at(jr, shape_at, "tensor '%s' \"shape\" is not an array", name);
        return 0;
      }
      kiln__jr_array_begin(jr);
      int f2 = 1, e;
      info->ndim = 0;
      while ((e = kiln__jr_element(jr, &f2)) == 1) {
        if (info->ndim == KILN_MAX_DIMS) {
          jr->code = KILN_ERR_SHAPE;
          kiln__jr_fail_at(jr, shape_at, "tensor '%s' has more than %d dims (kiln holds %d)",
                           name, KILN_MAX_DIMS, KILN_MAX_DIMS);
          return 0;
        }
        if (!kiln__jr_try_uint(jr, &dims[info->ndim])) {
          kiln__jr_fail_at(jr, jr->pos, "tensor '%s' shape[%d] is not a non-negative integer",
                           name, info->ndim);
          return 0;
        }
        info->ndim++;
      }
      if (e < 0) return 0;
    } else if (!strcmp(jr->buf, "data_offsets")) {
      if (!once(jr, &seen_off, name)) return 0;
      off_at = jr->pos;
      int ok = kiln__jr_accept(jr, '[') && kiln__jr_try_uint(jr, &info->begin) &&
               kiln__jr_accept(jr, ',') && kiln__jr_try_uint(jr, &info->end) && kiln__jr_accept(jr, ']');
      if (!ok) {
        kiln__jr_fail_at(jr, off_at,
                         "tensor '%s' \"data_offsets\" is not [begin, end] with non-negative "
                         "integers",
                         name);
        return 0;
      }
    } else if (!kiln__jr_skip(jr)) { /* other members: ignored, as the reference does */
      return 0;
    }
  }
  if (r < 0) return 0;
  if (!seen_dt || !seen_shape || !seen_off) {
    kiln__jr_fail_at(jr, at, "tensor '%s' has no %s", name,
                     !seen_dt ? "\"dtype\" string" : !seen_shape ? "\"shape\" array"
                                                                 : "\"data_offsets\" array");
    return 0;
  }
  /* numel * size stays below 2^62: each factor is checked before multiplying. span is the
  ** product with zero dims counted as 1 (what strides are made of): it must fit too, or a
  ** shape like [0, 2^40, 2^40] would pass as 0 bytes. Sub-byte dtypes count bits. */
  const int bits = st_dtypes[info->st_dtype].bits;
  uint64_t bytes = bits % 8 ? (uint64_t)bits : (uint64_t)bits / 8, span = bytes;
  for (int i = 0; i < info->ndim; i++) {
    uint64_t v = dims[i];
    if (span > (UINT64_C(1) << 62) / (v ? v : 1)) {
      jr->code = KILN_ERR_SHAPE;
      kiln__jr_fail_at(jr, shape_at,
                       "tensor '%s' shape is too large (a product of its dims passes 2^62 "
                       "bytes)",
                       name);
      return 0;
    }
    span *= v ? v : 1;
    bytes *= v;
    info->shape[i] = (int64_t)v;
  }
  if (bits % 8) {
    if (bytes % 8) {
      kiln__jr_fail_at(jr, shape_at, "tensor '%s' has %llu elements of %s (%d bits each): not a whole number "
                       "of bytes", name, (unsigned long long)(bytes / (uint64_t)bits), st_dtypes[info->st_dtype].name,
                       bits);
      return 0;
    }
    bytes /= 8;
  }
  if (info->end < info->begin) {
    kiln__jr_fail_at(jr, off_at, "tensor '%s' data_offsets [%llu, %llu) end before begin", name,
                     (unsigned long long)info->begin, (unsigned long long)info->end);
    return 0;
  }
  if (info->end - info->begin != bytes) {
    kiln__jr_fail_at(jr, off_at,
                     "tensor '%s' data_offsets [%llu, %llu) hold %llu bytes but shape and "
                     "dtype %s need %llu",
                     name, (unsigned long long)info->begin, (unsigned long long)info->end,
                     (unsigned long long)(info->end - info->begin),
                     st_dtypes[info->st_dtype].name, (unsigned long long)bytes);
    return 0;
  }
  return 1;
}

/* "__metadata__": null, or an object of strings. 1, or 0 with the error set. */
static int parse_meta(kiln__jreader *jr, kiln_dict *d) {
  int c = kiln__jr_peek(jr);
  size_t at = jr->pos;
  if (c == 'n') return kiln__jr_skip(jr); /* null, or a JSON error */
  if (c != '{') {
    kiln__jr_fail_at(jr, at, "\"__metadata__\" is not a JSON object");
    return 0;
  }
  kiln__jr_object_begin(jr);
  int first = 1, r;
  while ((r = kiln__jr_member(jr, &first)) == 1) {
    char *key = malloc(jr->len + 1); /* jr->buf is reused for the value */
    if (!key) {
      jr->code = KILN_ERR_OOM;
      kiln__jr_fail_at(jr, jr->key_pos, "out of memory for a metadata key");
      return 0;
    }
    memcpy(key, jr->buf, jr->len + 1);
    size_t key_at = jr->key_pos, val_at = jr->pos;
    int ok = 0;
    if (kiln__jr_peek(jr) != '"')
      kiln__jr_fail_at(jr, val_at, "\"__metadata__\" value for '%s' is not a string", key);
    else if (kiln_dict_get_meta(d, key))
      kiln__jr_fail_at(jr, key_at, "duplicate \"__metadata__\" key '%s'", key);
    else if (kiln__jr_string(jr)) {
      kiln_status st = kiln_dict_set_meta(d, key, jr->buf);
      if (st != KILN_OK) jr->failed = 1; /* the dict set the error */
      ok = st == KILN_OK;
    }
    free(key);
    if (!ok) return 0;
  }
  return r == 0;
}

/* Reads the header object: tensor entries into h, "__metadata__" into d. */
static kiln_status parse_header(kiln__jreader *jr, st_header *h, kiln_dict *d) {
  int first = 1, r, seen_meta = 0;
  if (!kiln__jr_object_begin(jr)) return kiln_last_error();
  while ((r = kiln__jr_member(jr, &first)) == 1) {
    if (!strcmp(jr->buf, "__metadata__")) {
      if (seen_meta) return kiln__jr_fail_at(jr, jr->key_pos, "duplicate \"__metadata__\"");
      seen_meta = 1;
      if (!parse_meta(jr, d)) return kiln_last_error();
      continue;
    }
    if (h->n == h->cap) {
      int cap = h->cap ? 2 * h->cap : 64;
      st_info *p = realloc(h->infos, (size_t)cap * sizeof *p);
      if (!p) {
        jr->code = KILN_ERR_OOM;
        return kiln__jr_fail_at(jr, jr->key_pos, "out of memory for %d tensor entries", cap);
      }
      h->infos = p;
      h->cap = cap;
    }
    st_info *info = memset(&h->infos[h->n++], 0, sizeof *info);
    info->name = memcpy(h->names + h->names_used, jr->buf, jr->len + 1);
    info->name_at = jr->key_pos;
    info->pos = h->n - 1;
    h->names_used += jr->len + 1;
    if (!parse_entry(jr, info)) return kiln_last_error();
  }
  if (r < 0) return kiln_last_error();
  return kiln__jr_end(jr);
}

/* The header's text, before the JSON parser sees it: strictly valid UTF-8 (the format
** requires it; no overlong forms, surrogates or code points past U+10FFFF), no NUL byte,
** and no escaped NUL (\u0000) in a string: names and metadata are C strings, so a NUL would
** cut one short silently (two such names then look like duplicates of the cut name).
** Errors name the file offset of the offending byte. */
static kiln_status check_header_text(const char *who, const char *path, const char *hdr, uint64_t hlen) {
  const unsigned char *p = (const unsigned char *)hdr;
  bool in_string = false;
  for (uint64_t i = 0; i < hlen;) {
    unsigned c = p[i];
    if (c == 0)
      return kiln_set_error(KILN_ERR_FORMAT, "%s: %s: NUL byte in the header at file offset %llu",
                            who, path, (unsigned long long)(8 + i));
    if (c < 0x80) {
      if (c == '"') in_string = !in_string;
      else if (c == '\\' && in_string && i + 1 < hlen) {
        if (p[i + 1] == 'u' && i + 5 < hlen && !memcmp(p + i + 2, "0000", 4))
          return kiln_set_error(KILN_ERR_FORMAT,
                                "%s: %s: escaped NUL (\\u0000) in a string at file offset %llu "
                                    "(names and metadata may not hold NUL)",
                                who, path, (unsigned long long)(8 + i));
        if (p[i + 1] < 0x80) i++; /* the escaped character (a quote does not end the string) */
      }
      i++;
      continue;
    }
    /* lead byte: length and the smallest code point that needs that length */
    int len;
    uint32_t cp, min;
    if (c >= 0xC2 && c <= 0xDF) len = 2, cp = c & 0x1F, min = 0x80;
    else if (c >= 0xE0 && c <= 0xEF) len = 3, cp = c & 0x0F, min = 0x800;
    else if (c >= 0xF0 && c <= 0xF4) len = 4, cp = c & 0x07, min = 0x10000;
    else len = 0, cp = 0, min = 0;
    bool ok = len > 0 && i + (uint64_t)len <= hlen;
    for (int k = 1; ok && k < len; k++) {
      if ((p[i + k] & 0xC0) != 0x80) ok = false;
      else cp = (cp << 6) | (p[i + k] & 0x3F);
    }
    if (ok && (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))) ok = false;
    if (!ok)
      return kiln_set_error(KILN_ERR_FORMAT,
                            "%s: %s: invalid UTF-8 in the header at file offset %llu (byte 0x%02x)",
                            who, path, (unsigned long long)(8 + i), c);
    i += (uint64_t)len;
  }
  return KILN_OK;
}

/* An open file: its validated header, tensors in data order, found by name through
** by_name (the same entries sorted by name). */
struct kiln_safetensors {
  FILE *f;
  char *path;
  uint64_t data_start;
  st_header h;    /* h.infos sorted by data offset */
  st_info **by_name;
  kiln_dict *meta; /* "__metadata__"; no tensors */
};

static void st_free(kiln_safetensors *s) {
  if (!s) return;
  if (s->f) fclose(s->f);
  free(s->path);
  free(s->h.infos);
  free(s->h.names);
  free(s->by_name);
  kiln_dict_free(s->meta);
  free(s);
}

/* The header's rules past its syntax: names unique, the tensors covering the data area
** exactly. s->h is sorted by data offset here (ties in JSON order) and s->by_name made. */
static kiln_status check_layout(kiln__jreader *jr, kiln_safetensors *s, uint64_t fsize) {
  const char *who = jr->what, *path = s->path;
  const uint64_t data_start = s->data_start, data_size = fsize - data_start;
  const int n = s->h.n;
  st_info *infos = s->h.infos;
  if (n > 1) qsort(infos, (size_t)n, sizeof *infos, cmp_offsets);
  st_info **by_name = s->by_name = malloc(((size_t)n + 1) * sizeof *by_name);
  if (!by_name) return kiln_set_error(KILN_ERR_OOM, "%s: %s: out of memory for %d tensor entries", who, path, n);
  for (int i = 0; i < n; i++) by_name[i] = &infos[i];
  if (n > 1) qsort(by_name, (size_t)n, sizeof *by_name, cmp_names);
  for (int i = 1; i < n; i++)
    if (strcmp(by_name[i - 1]->name, by_name[i]->name) == 0)
      return kiln__jr_fail_at(jr, by_name[i]->name_at, "duplicate tensor name '%s'", by_name[i]->name);
  /* Coverage: sorted by begin, each tensor starts where the previous one ended. */
  uint64_t expect = 0;
  for (int i = 0; i < n; i++) {
    const st_info *t = &infos[i];
    if (t->end > data_size)
      return kiln_set_error(KILN_ERR_FORMAT,
                            "%s: %s: tensor '%s' data_offsets [%llu, %llu) end past the data "
                            "area of %llu bytes (file offset %llu)",
                            who, path, t->name, (unsigned long long)t->begin, (unsigned long long)t->end,
                            (unsigned long long)data_size, (unsigned long long)fsize);
    if (t->begin != expect)
      return kiln_set_error(KILN_ERR_FORMAT,
                            "%s: %s: tensor '%s' data_offsets [%llu, %llu) %s: the previous "
                            "tensor ends at %llu (file offset %llu)",
                            who, path, t->name, (unsigned long long)t->begin, (unsigned long long)t->end,
                            t->begin > expect ? "leave a gap" : "overlap another tensor",
                            (unsigned long long)expect, (unsigned long long)(data_start + t->begin));
    expect = t->end;
  }
  if (expect != data_size)
    return kiln_set_error(KILN_ERR_FORMAT,
                          "%s: %s: tensors cover %llu bytes of a data area of %llu bytes "
                          "(%llu stray bytes from file offset %llu)",
                          who, path, (unsigned long long)expect, (unsigned long long)data_size,
                          (unsigned long long)(data_size - expect), (unsigned long long)(data_start + expect));
  return KILN_OK;
}

/* Opens path and checks everything but the tensors' bytes; who names the caller in errors. */
static kiln_safetensors *st_open(const char *who, const char *path) {
  uint64_t fsize;
  FILE *f = kiln__fopen_regular_size(who, path, &fsize); /* NULL path refused; a FIFO too, not waited on */
  if (!f) return NULL;
  kiln_safetensors *s = calloc(1, sizeof *s);
  char *hdr = NULL;
  kiln__jreader jr;
  bool jr_live = false;
  if (s) s->f = f, s->path = strdup(path);
  if (!s || !s->path) {
    kiln_set_error(KILN_ERR_OOM, "%s: %s: out of memory", who, path);
    if (!s) fclose(f);
    st_free(s);
    return NULL;
  }
  unsigned char b8[8];
  if (fsize < 8 || fread(b8, 1, 8, f) != 8) {
    kiln_set_error(KILN_ERR_FORMAT, "%s: %s: file of %llu bytes is shorter than the 8-byte header length",
                   who, path, (unsigned long long)fsize);
    goto fail;
  }
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | b8[i];
  if (hlen > fsize - 8) {
    kiln_set_error(KILN_ERR_FORMAT,
                   "%s: %s: header length %llu (file offset 0) runs past the end of the "
                   "file of %llu bytes",
                   who, path, (unsigned long long)hlen, (unsigned long long)fsize);
    goto fail;
  }
  if (hlen > ST_MAX_HEADER || hlen < 2) {
    kiln_set_error(KILN_ERR_FORMAT, "%s: %s: header length %llu (file offset 0) is %s", who, path,
                   (unsigned long long)hlen, hlen < 2 ? "too small" : "over the 100 MB limit");
    goto fail;
  }
  s->data_start = 8 + hlen;
  hdr = malloc((size_t)hlen + 1);
  s->h.names = malloc((size_t)hlen + 1);
  s->meta = kiln_dict_new();
  if (!hdr || !s->h.names || !s->meta) {
    kiln_set_error(KILN_ERR_OOM, "%s: %s: out of memory for a header of %llu bytes", who, path,
                   (unsigned long long)hlen);
    goto fail;
  }
  if (fread(hdr, 1, (size_t)hlen, f) != (size_t)hlen) {
    kiln_set_error(KILN_ERR_IO, "%s: %s: cannot read the header at file offset 8", who, path);
    goto fail;
  }
  hdr[hlen] = 0;
  if (hdr[0] != '{') {
    kiln_set_error(KILN_ERR_FORMAT, "%s: %s: header does not start with '{' (file offset 8)", who, path);
    goto fail;
  }
  if (check_header_text(who, path, hdr, hlen) != KILN_OK) goto fail;
  kiln__jr_init(&jr, who, path, hdr, (size_t)hlen);
  jr_live = true;
  jr.base = 8; /* offsets in errors are the file's */
  if (parse_header(&jr, &s->h, s->meta) != KILN_OK) goto fail;
  if (check_layout(&jr, s, fsize) != KILN_OK) goto fail;
  kiln__jr_release(&jr);
  free(hdr);
  return s;
fail:
  if (jr_live) kiln__jr_release(&jr);
  free(hdr);
  st_free(s);
  return NULL;
}

/* KILN_ERR_DTYPE for a tensor of a dtype kiln does not hold; tail ends the message. */
static kiln_status refuse_unheld(const char *who, const char *path, const st_info *info, const char *tail) {
  return kiln_set_error(KILN_ERR_DTYPE, "%s: %s: tensor '%s' has dtype %s, which kiln does not hold (" ST_HELD "%s)",
                        who, path, info->name, st_dtypes[info->st_dtype].name, tail);
}

/* Tensor i onto the CPU (caller-owned), read with pread: at its own offset, whatever was
** read before through the handle. */
static kiln_tensor *st_read(const char *who, kiln_safetensors *s, int i) {
  const st_info *info = &s->h.infos[i];
  if (info->dtype == KILN_DTYPE__COUNT) {
    refuse_unheld(who, s->path, info, "");
    return NULL;
  }
  kiln_tensor *t = kiln__own(kiln_empty(info->ndim, info->ndim ? info->shape : NULL, info->dtype, kiln_device_cpu()));
  if (!t) return NULL;
  size_t n = (size_t)(info->end - info->begin);
  if (n == 0) return t;
  unsigned char *p = kiln_data_ptr(t);
  if (!p) {
    kiln_tensor_free(t);
    return NULL;
  }
  const uint64_t at = s->data_start + info->begin;
  size_t got = 0;
  int e = 0;
  while (got < n) {
    ssize_t r = pread(fileno(s->f), p + got, n - got, (off_t)(at + got));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      e = r < 0 ? errno : 0;
      break;
    }
    got += (size_t)r;
  }
  if (got < n) {
    kiln_set_error(KILN_ERR_IO, "%s: %s: tensor '%s': read of %zu bytes at file offset %llu failed: %s", who,
                   s->path, info->name, n, (unsigned long long)at, e ? strerror(e) : "unexpected end of file");
    kiln_tensor_free(t);
    return NULL;
  }
  size_t es = kiln_dtype_size(info->dtype);
  if (!kiln__host_is_le()) kiln__swap_bytes(p, n / es, es);
  if (info->dtype == KILN_BOOL) /* kernels assume 0/1 bytes */
    for (size_t k = 0; k < n; k++) p[k] = p[k] != 0;
  return t;
}

/* st_read, then onto dev: a tensor the caller owns. */
static kiln_tensor *st_read_to(const char *who, kiln_safetensors *s, int i, kiln_device dev) {
  kiln_tensor *t = st_read(who, s, i);
  if (t && dev.type != KILN_DEVICE_CPU) {
    kiln_tensor *moved = kiln__own(kiln_to_device(t, dev));
    kiln_tensor_free(t);
    t = moved;
  }
  return t;
}

kiln_safetensors *kiln_safetensors_open(const char *path) { return st_open("kiln_safetensors_open", path); }

void kiln_safetensors_close(kiln_safetensors *s) { st_free(s); }

int kiln_safetensors_count(const kiln_safetensors *s) { return s ? s->h.n : 0; }

static bool st_index_ok(const char *who, const kiln_safetensors *s, int i) {
  if (!s) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: NULL file", who), false;
  if (i < 0 || i >= s->h.n)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: %s: tensor index %d out of range (the file holds %d)", who,
                          s->path, i, s->h.n),
           false;
  return true;
}

const char *kiln_safetensors_name(const kiln_safetensors *s, int i) {
  return st_index_ok("kiln_safetensors_name", s, i) ? s->h.infos[i].name : NULL;
}

int kiln_safetensors_info(const kiln_safetensors *s, int i, kiln_dtype *dtype, int64_t *shape) {
  if (!st_index_ok("kiln_safetensors_info", s, i)) return -1;
  const st_info *info = &s->h.infos[i];
  if (dtype) *dtype = info->dtype;
  if (shape) memcpy(shape, info->shape, sizeof(int64_t) * (size_t)info->ndim);
  return info->ndim;
}

const char *kiln_safetensors_dtype(const kiln_safetensors *s, int i) {
  return st_index_ok("kiln_safetensors_dtype", s, i) ? st_dtypes[s->h.infos[i].st_dtype].name : NULL;
}

int64_t kiln_safetensors_nbytes(const kiln_safetensors *s, int i) {
  if (!st_index_ok("kiln_safetensors_nbytes", s, i)) return -1;
  return (int64_t)(s->h.infos[i].end - s->h.infos[i].begin);
}

int kiln_safetensors_find(const kiln_safetensors *s, const char *name) {
  if (!s || !name) return -1;
  int lo = 0, hi = s->h.n; /* the first of by_name[lo..hi) whose name is >= name */
  while (lo < hi) {
    int mid = lo + (hi - lo) / 2;
    if (strcmp(s->by_name[mid]->name, name) < 0) lo = mid + 1;
    else hi = mid;
  }
  return lo < s->h.n && !strcmp(s->by_name[lo]->name, name) ? (int)(s->by_name[lo] - s->h.infos) : -1;
}

const kiln_dict *kiln_safetensors_metadata(const kiln_safetensors *s) { return s ? s->meta : NULL; }

const char *kiln_safetensors_path(const kiln_safetensors *s) { return s ? s->path : NULL; }

kiln_tensor *kiln_safetensors_read(kiln_safetensors *s, int i, kiln_device dev) {
  if (!st_index_ok("kiln_safetensors_read", s, i)) return NULL;
  kiln_tensor *t = st_read("kiln_safetensors_read", s, i);
  if (!t) return NULL;
  /* the usual rule: owned by the caller's scope if one is open (kiln_to_device returns a
  ** new reference, the same tensor when dev is the CPU) */
  kiln_tensor *out = kiln_to_device(t, dev);
  kiln_tensor_free(t);
  return out;
}

kiln_dict *kiln_safetensors_load(const char *path, kiln_device dev) {
  kiln_safetensors *s = st_open(WHO, path);
  if (!s) return NULL;
  /* a dtype kiln does not hold refuses the file before any read (the first in the header) */
  const st_info *unheld = NULL;
  for (int i = 0; i < s->h.n; i++)
    if (s->h.infos[i].dtype == KILN_DTYPE__COUNT && (!unheld || s->h.infos[i].pos < unheld->pos))
      unheld = &s->h.infos[i];
  if (unheld) {
    refuse_unheld(WHO, path, unheld, "; kiln_safetensors_open lists such a file");
    st_free(s);
    return NULL;
  }
  kiln_dict *d = s->meta; /* the metadata's dict becomes the result */
  s->meta = NULL;
  for (int i = 0; i < s->h.n; i++) { /* in data order: the writer's order for kiln and the reference */
    kiln_tensor *t = st_read_to(WHO, s, i, dev);
    kiln_status st = t ? kiln_dict_set(d, s->h.infos[i].name, t) : kiln_last_error();
    kiln_tensor_free(t); /* the dict holds its own reference */
    if (st != KILN_OK) {
      kiln_dict_free(d);
      st_free(s);
      return NULL;
    }
  }
  st_free(s);
  return d;
}

/* ------------------------------------------------------------------------------------ */
/* Writer. */

typedef struct sbuf {
  char *p;
  size_t n, cap;
  int oom;
} sbuf;

static void sb_put(sbuf *b, const char *s, size_t n) {
  if (b->oom) return;
  if (b->n + n + 1 > b->cap) {
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->n + n + 1) cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) {
      b->oom = 1;
      return;
    }
    b->p = p;
    b->cap = cap;
  }
  memcpy(b->p + b->n, s, n);
  b->n += n;
  b->p[b->n] = 0;
}

static void sb_str(sbuf *b, const char *s) { sb_put(b, s, strlen(s)); }

static void sb_u64(sbuf *b, uint64_t v) {
  char t[32];
  int n = snprintf(t, sizeof t, "%llu", (unsigned long long)v);
  sb_put(b, t, (size_t)n);
}

/* A JSON string literal: quotes, backslashes and control bytes escaped; other bytes
** (UTF-8) pass through. */
static void sb_json_string(sbuf *b, const char *s) {
  sb_put(b, "\"", 1);
  for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
    if (*p == '"') sb_put(b, "\\\"", 2);
    else if (*p == '\\') sb_put(b, "\\\\", 2);
    else if (*p == '\n') sb_put(b, "\\n", 2);
    else if (*p == '\t') sb_put(b, "\\t", 2);
    else if (*p == '\r') sb_put(b, "\\r", 2);
    else if (*p < 0x20) {
      char t[8];
      snprintf(t, sizeof t, "\\u%04x", *p);
      sb_put(b, t, 6);
    } else sb_put(b, (const char *)p, 1);
  }
  sb_put(b, "\"", 1);
}

typedef struct save_rec {
  size_t size; /* the dtype's */
  const char *name;
  int index; /* in the dict */
} save_rec;

/* The reference's order: larger dtypes first (keeps every tensor aligned to its size
** when the data area starts aligned), then by name (names are unique). */
static int cmp_save(const void *a, const void *b) {
  const save_rec *x = a, *y = b;
  if (x->size != y->size) return x->size > y->size ? -1 : 1;
  return strcmp(x->name, y->name);
}

/* order[k] = the dict index of the k-th tensor to write; 0 on OOM. */
static int save_order(const kiln_dict *d, int *order, int n) {
  save_rec *r = malloc(sizeof *r * (size_t)(n > 0 ? n : 1));
  if (!r) return 0;
  for (int i = 0; i < n; i++)
    r[i] = (save_rec){kiln_dtype_size(kiln_dtype_of(kiln_dict_value(d, i))), kiln_dict_key(d, i), i};
  if (n > 1) qsort(r, (size_t)n, sizeof *r, cmp_save);
  for (int i = 0; i < n; i++) order[i] = r[i].index;
  free(r);
  return 1;
}

#undef WHO
#define WHO "kiln_safetensors_save"

kiln_status kiln_safetensors_save(const char *path, const kiln_dict *d) {
  if (!path || !d)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, WHO ": NULL %s", path ? "dict" : "path");
  int n = kiln_dict_size(d);
  for (int i = 0; i < n; i++) {
    const char *name = kiln_dict_key(d, i);
    kiln_tensor *t = kiln_dict_value(d, i);
    if (strcmp(name, "__metadata__") == 0)
      return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                            WHO ": %s: a tensor may not be named \"__metadata__\"", path);
    if (!st_dtype_name(kiln_dtype_of(t)))
      return kiln_set_error(KILN_ERR_DTYPE, WHO ": %s: tensor '%s' has an invalid dtype", path,
                            name);
  }
  int *order = malloc(sizeof(int) * (size_t)(n > 0 ? n : 1));
  if (!order || !save_order(d, order, n)) {
    free(order);
    return kiln_set_error(KILN_ERR_OOM, WHO ": out of memory");
  }

  sbuf h = {0};
  sb_str(&h, "{");
  int first = 1;
  int nm = kiln_dict_meta_size(d);
  if (nm > 0) {
    sb_str(&h, "\"__metadata__\":{");
    for (int i = 0; i < nm; i++) {
      if (i) sb_str(&h, ",");
      sb_json_string(&h, kiln_dict_meta_key(d, i));
      sb_str(&h, ":");
      sb_json_string(&h, kiln_dict_meta_value(d, i));
    }
    sb_str(&h, "}");
    first = 0;
  }
  uint64_t off = 0;
  for (int k = 0; k < n; k++) {
    kiln_tensor *t = kiln_dict_value(d, order[k]);
    if (!first) sb_str(&h, ",");
    first = 0;
    sb_json_string(&h, kiln_dict_key(d, order[k]));
    sb_str(&h, ":{\"dtype\":\"");
    sb_str(&h, st_dtype_name(kiln_dtype_of(t)));
    sb_str(&h, "\",\"shape\":[");
    for (int i = 0; i < kiln_ndim(t); i++) {
      if (i) sb_str(&h, ",");
      sb_u64(&h, (uint64_t)kiln_size(t, i));
    }
    sb_str(&h, "],\"data_offsets\":[");
    sb_u64(&h, off);
    sb_str(&h, ",");
    off += kiln_nbytes(t);
    sb_u64(&h, off);
    sb_str(&h, "]}");
  }
  sb_str(&h, "}");
  while (!h.oom && (8 + h.n) % 8 != 0) sb_str(&h, " "); /* data area starts 8-aligned */
  if (h.oom) {
    free(h.p);
    free(order);
    return kiln_set_error(KILN_ERR_OOM, WHO ": out of memory for the header");
  }
  kiln__atomic_file af;
  kiln_status st = kiln__atomic_open(&af, WHO, path);
  if (st != KILN_OK) {
    free(h.p);
    free(order);
    return st;
  }
  unsigned char b8[8];
  for (int i = 0; i < 8; i++) b8[i] = (unsigned char)((uint64_t)h.n >> (8 * i));
  st = kiln__atomic_write(&af, b8, 8);
  if (st == KILN_OK) st = kiln__atomic_write(&af, h.p, h.n);
  for (int k = 0; k < n && st == KILN_OK; k++) {
    kiln_tensor *t = kiln_dict_value(d, order[k]);
    size_t nb = kiln_nbytes(t);
    if (nb == 0) continue;
    void *buf = malloc(nb);
    if (!buf) {
      st = kiln_set_error(KILN_ERR_OOM, WHO ": %s: out of memory for tensor '%s' (%zu bytes)",
                          path, kiln_dict_key(d, order[k]), nb);
      break;
    }
    st = kiln_to_host(t, buf, nb);
    if (st == KILN_OK) {
      size_t es = kiln_dtype_size(kiln_dtype_of(t));
      if (!kiln__host_is_le()) kiln__swap_bytes(buf, nb / es, es);
      st = kiln__atomic_write(&af, buf, nb);
    }
    free(buf);
  }
  free(h.p);
  free(order);
  if (st != KILN_OK) {
    kiln__atomic_abort(&af);
    return st;
  }
  return kiln__atomic_commit(&af);
}
