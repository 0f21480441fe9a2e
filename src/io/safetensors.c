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
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "io_int.h"
#include "kiln_io.h"
#include "st_json.h"

#define ST_MAX_HEADER 100000000ull /* the reference's limit */
#define WHO "kiln_safetensors_load"

static const struct {
  const char *name;
  int dtype; /* kiln_dtype, or -1: valid in safetensors but not held by kiln */
} st_dtypes[] = {
    {"F32", KILN_F32}, {"F64", KILN_F64},  {"F16", KILN_F16},      {"BF16", KILN_BF16},
    {"I64", KILN_I64}, {"I32", KILN_I32},  {"U8", KILN_U8},        {"BOOL", KILN_BOOL},
    {"I8", -1},        {"I16", -1},        {"U16", -1},            {"U32", -1},
    {"U64", -1},       {"F8_E4M3", -1},    {"F8_E5M2", -1},        {"F8_E8M0", -1},
    {"F4", -1},        {"F6_E2M3", -1},    {"F6_E3M2", -1},        {"C64", -1},
};

static const char *st_dtype_name(kiln_dtype dt) {
  for (size_t i = 0; i < sizeof st_dtypes / sizeof st_dtypes[0]; i++)
    if (st_dtypes[i].dtype == (int)dt) return st_dtypes[i].name;
  return NULL;
}

typedef struct st_info {
  const char *name; /* points into the parsed JSON */
  kiln_dtype dtype;
  int ndim;
  int64_t shape[KILN_MAX_DIMS];
  uint64_t begin, end;
} st_info;

static int cmp_offsets(const void *a, const void *b) {
  const st_info *x = a, *y = b;
  if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
  if (x->end != y->end) return x->end < y->end ? -1 : 1;
  return 0;
}

static int cmp_names(const void *a, const void *b) {
  return strcmp((*(const st_info *const *)a)->name, (*(const st_info *const *)b)->name);
}

/* JSON numbers arrive as doubles: an offset or a dim must be a non-negative integer
** that a double holds exactly (below 2^53). */
static int json_uint(const cJSON *v, uint64_t *out) {
  if (!cJSON_IsNumber(v)) return 0;
  double d = v->valuedouble;
  if (!(d >= 0) || d > 9007199254740992.0 || floor(d) != d) return 0;
  *out = (uint64_t)d;
  return 1;
}

/* Parses one tensor entry into info. Returns KILN_OK or sets the error. */
static kiln_status parse_entry(const char *path, const cJSON *e, st_info *info) {
  const char *name = e->string;
  info->name = name;
  if (!cJSON_IsObject(e))
    return kiln_set_error(KILN_ERR_FORMAT, WHO ": %s: tensor '%s' entry is not a JSON object",
                          path, name);
  const cJSON *dt = cJSON_GetObjectItemCaseSensitive(e, "dtype");
  const cJSON *sh = cJSON_GetObjectItemCaseSensitive(e, "shape");
  const cJSON *off = cJSON_GetObjectItemCaseSensitive(e, "data_offsets");
  if (!cJSON_IsString(dt) || !dt->valuestring)
    return kiln_set_error(KILN_ERR_FORMAT, WHO ": %s: tensor '%s' has no \"dtype\" string",
                          path, name);
  int found = 0;
  for (size_t i = 0; i < sizeof st_dtypes / sizeof st_dtypes[0]; i++)
    if (strcmp(st_dtypes[i].name, dt->valuestring) == 0) {
      if (st_dtypes[i].dtype < 0)
        return kiln_set_error(KILN_ERR_DTYPE,
                              WHO ": %s: tensor '%s' has dtype %s, which kiln does not hold "
                                  "(F32 F64 F16 BF16 I64 I32 U8 BOOL)",
                              path, name, dt->valuestring);
      info->dtype = (kiln_dtype)st_dtypes[i].dtype;
      found = 1;
      break;
    }
  if (!found)
    return kiln_set_error(KILN_ERR_FORMAT, WHO ": %s: tensor '%s' has unknown dtype \"%.32s\"",
                          path, name, dt->valuestring);
  if (!cJSON_IsArray(sh))
    return kiln_set_error(KILN_ERR_FORMAT, WHO ": %s: tensor '%s' has no \"shape\" array",
                          path, name);
  int nd = cJSON_GetArraySize(sh);
  if (nd > KILN_MAX_DIMS)
    return kiln_set_error(KILN_ERR_SHAPE, WHO ": %s: tensor '%s' has %d dims (kiln holds %d)",
                          path, name, nd, KILN_MAX_DIMS);
  info->ndim = nd;
  /* numel * size stays below 2^62: each factor is checked before multiplying. span is the
  ** product with zero dims counted as 1 (what strides are made of): it must fit too, or a
  ** shape like [0, 2^40, 2^40] would pass as 0 bytes. */
  uint64_t bytes = kiln_dtype_size(info->dtype), span = bytes;
  int i = 0;
  for (const cJSON *d = sh->child; d; d = d->next, i++) {
    uint64_t v;
    if (!json_uint(d, &v))
      return kiln_set_error(KILN_ERR_FORMAT,
                            WHO ": %s: tensor '%s' shape[%d] is not a non-negative integer",
                            path, name, i);
    info->shape[i] = (int64_t)v;
    if (span > (UINT64_C(1) << 62) / (v ? v : 1))
      return kiln_set_error(KILN_ERR_SHAPE,
                            WHO ": %s: tensor '%s' shape is too large (a product of its "
                                "dims passes 2^62 bytes)",
                            path, name);
    span *= v ? v : 1;
    bytes *= v;
  }
  if (!cJSON_IsArray(off) || cJSON_GetArraySize(off) != 2 || !json_uint(off->child, &info->begin) ||
      !json_uint(off->child->next, &info->end))
    return kiln_set_error(KILN_ERR_FORMAT,
                          WHO ": %s: tensor '%s' \"data_offsets\" is not [begin, end] with "
                              "non-negative integers",
                          path, name);
  if (info->end < info->begin)
    return kiln_set_error(KILN_ERR_FORMAT,
                          WHO ": %s: tensor '%s' data_offsets [%llu, %llu) end before begin",
                          path, name, (unsigned long long)info->begin,
                          (unsigned long long)info->end);
  if (info->end - info->begin != bytes)
    return kiln_set_error(KILN_ERR_FORMAT,
                          WHO ": %s: tensor '%s' data_offsets [%llu, %llu) hold %llu bytes "
                              "but shape and dtype %s need %llu",
                          path, name, (unsigned long long)info->begin,
                          (unsigned long long)info->end,
                          (unsigned long long)(info->end - info->begin), dt->valuestring,
                          (unsigned long long)bytes);
  return KILN_OK;
}

static kiln_status parse_meta(const char *path, const cJSON *m, kiln_dict *d) {
  if (cJSON_IsNull(m)) return KILN_OK;
  if (!cJSON_IsObject(m))
    return kiln_set_error(KILN_ERR_FORMAT, WHO ": %s: \"__metadata__\" is not a JSON object",
                          path);
  for (const cJSON *e = m->child; e; e = e->next) {
    if (!cJSON_IsString(e) || !e->valuestring)
      return kiln_set_error(KILN_ERR_FORMAT,
                            WHO ": %s: \"__metadata__\" value for '%s' is not a string", path,
                            e->string);
    if (kiln_dict_get_meta(d, e->string))
      return kiln_set_error(KILN_ERR_FORMAT, WHO ": %s: duplicate \"__metadata__\" key '%s'",
                            path, e->string);
    kiln_status st = kiln_dict_set_meta(d, e->string, e->valuestring);
    if (st != KILN_OK) return st;
  }
  return KILN_OK;
}

/* Reads the tensor described by info from f into a new CPU tensor the caller owns. */
static kiln_tensor *read_tensor(const char *path, FILE *f, uint64_t data_start,
                                const st_info *info) {
  kiln_tensor *t =
      kiln__own(kiln_empty(info->ndim, info->ndim ? info->shape : NULL, info->dtype,
                           kiln_device_cpu()));
  if (!t) return NULL;
  size_t n = (size_t)(info->end - info->begin);
  if (n == 0) return t;
  unsigned char *p = kiln_data_ptr(t);
  if (!p) {
    kiln_tensor_free(t);
    return NULL;
  }
  if (fseeko(f, (off_t)(data_start + info->begin), SEEK_SET) != 0 || fread(p, 1, n, f) != n) {
    int e = errno;
    kiln_set_error(KILN_ERR_IO, WHO ": %s: tensor '%s': read of %zu bytes at file offset %llu "
                                "failed: %s",
                   path, info->name, n, (unsigned long long)(data_start + info->begin),
                   ferror(f) ? strerror(e) : "unexpected end of file");
    kiln_tensor_free(t);
    return NULL;
  }
  size_t es = kiln_dtype_size(info->dtype);
  if (!kiln__host_is_le()) kiln__swap_bytes(p, n / es, es);
  if (info->dtype == KILN_BOOL) /* kernels assume 0/1 bytes */
    for (size_t i = 0; i < n; i++) p[i] = p[i] != 0;
  return t;
}

/* The header's text, before the JSON parser sees it: strictly valid UTF-8 (the format
** requires it; no overlong forms, surrogates or code points past U+10FFFF), no NUL byte,
** and no escaped NUL (\u0000) in a string: names and metadata are C strings, so a NUL would
** cut one short silently (two such names then look like duplicates of the cut name).
** Errors name the file offset of the offending byte. */
static kiln_status check_header_text(const char *path, const char *hdr, uint64_t hlen) {
  const unsigned char *p = (const unsigned char *)hdr;
  bool in_string = false;
  for (uint64_t i = 0; i < hlen;) {
    unsigned c = p[i];
    if (c == 0)
      return kiln_set_error(KILN_ERR_FORMAT, WHO ": %s: NUL byte in the header at file offset %llu",
                            path, (unsigned long long)(8 + i));
    if (c < 0x80) {
      if (c == '"') in_string = !in_string;
      else if (c == '\\' && in_string && i + 1 < hlen) {
        if (p[i + 1] == 'u' && i + 5 < hlen && !memcmp(p + i + 2, "0000", 4))
          return kiln_set_error(KILN_ERR_FORMAT,
                                WHO ": %s: escaped NUL (\\u0000) in a string at file offset %llu "
                                    "(names and metadata may not hold NUL)",
                                path, (unsigned long long)(8 + i));
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
                            WHO ": %s: invalid UTF-8 in the header at file offset %llu (byte 0x%02x)",
                            path, (unsigned long long)(8 + i), c);
    i += (uint64_t)len;
  }
  return KILN_OK;
}

static kiln_status validate_and_read(const char *path, FILE *f, uint64_t fsize, char *hdr,
                                     uint64_t hlen, kiln_dict *d, kiln_device dev) {
  const uint64_t data_start = 8 + hlen, data_size = fsize - data_start;
  if (check_header_text(path, hdr, hlen) != KILN_OK) return kiln_last_error();
  const char *end = NULL;
  cJSON *root = cJSON_ParseWithLengthOpts(hdr, (size_t)hlen, &end, 0);
  if (!root) {
    uint64_t at = end && end >= hdr ? (uint64_t)(end - hdr) : 0;
    return kiln_set_error(KILN_ERR_FORMAT, WHO ": %s: invalid JSON header near file offset %llu",
                          path, (unsigned long long)(8 + at));
  }
  kiln_status st = KILN_OK;
  st_info *infos = NULL;
  st_info **by_name = NULL;
  for (const char *p = end; p < hdr + hlen; p++) /* padding: whitespace only */
    if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r') {
      st = kiln_set_error(KILN_ERR_FORMAT,
                          WHO ": %s: bytes after the JSON header at file offset %llu", path,
                          (unsigned long long)(8 + (uint64_t)(p - hdr)));
      goto done;
    }
  if (!cJSON_IsObject(root)) {
    st = kiln_set_error(KILN_ERR_FORMAT, WHO ": %s: JSON header is not an object", path);
    goto done;
  }
  int n = 0, nmeta = 0;
  for (const cJSON *e = root->child; e; e = e->next) {
    if (strcmp(e->string, "__metadata__") == 0) nmeta++;
    else n++;
  }
  if (nmeta > 1) {
    st = kiln_set_error(KILN_ERR_FORMAT, WHO ": %s: duplicate \"__metadata__\"", path);
    goto done;
  }
  infos = calloc((size_t)n + 1, sizeof *infos);
  by_name = calloc((size_t)n + 1, sizeof *by_name);
  if (!infos || !by_name) {
    st = kiln_set_error(KILN_ERR_OOM, WHO ": %s: out of memory for %d tensor entries", path, n);
    goto done;
  }
  int k = 0;
  for (const cJSON *e = root->child; e; e = e->next) {
    if (strcmp(e->string, "__metadata__") == 0) {
      st = parse_meta(path, e, d);
    } else {
      st = parse_entry(path, e, &infos[k]);
      by_name[k] = &infos[k];
      k++;
    }
    if (st != KILN_OK) goto done;
  }
  qsort(by_name, (size_t)n, sizeof *by_name, cmp_names);
  for (int i = 1; i < n; i++)
    if (strcmp(by_name[i - 1]->name, by_name[i]->name) == 0) {
      st = kiln_set_error(KILN_ERR_FORMAT, WHO ": %s: duplicate tensor name '%s'", path,
                          by_name[i]->name);
      goto done;
    }
  /* Coverage: sorted by begin, each tensor starts where the previous one ended. */
  qsort(infos, (size_t)n, sizeof *infos, cmp_offsets);
  uint64_t expect = 0;
  for (int i = 0; i < n; i++) {
    const st_info *t = &infos[i];
    if (t->end > data_size) {
      st = kiln_set_error(KILN_ERR_FORMAT,
                          WHO ": %s: tensor '%s' data_offsets [%llu, %llu) end past the data "
                              "area of %llu bytes (file offset %llu)",
                          path, t->name, (unsigned long long)t->begin,
                          (unsigned long long)t->end, (unsigned long long)data_size,
                          (unsigned long long)fsize);
      goto done;
    }
    if (t->begin != expect) {
      st = kiln_set_error(KILN_ERR_FORMAT,
                          WHO ": %s: tensor '%s' data_offsets [%llu, %llu) %s: the previous "
                              "tensor ends at %llu (file offset %llu)",
                          path, t->name, (unsigned long long)t->begin,
                          (unsigned long long)t->end,
                          t->begin > expect ? "leave a gap" : "overlap another tensor",
                          (unsigned long long)expect,
                          (unsigned long long)(data_start + t->begin));
      goto done;
    }
    expect = t->end;
  }
  if (expect != data_size) {
    st = kiln_set_error(KILN_ERR_FORMAT,
                        WHO ": %s: tensors cover %llu bytes of a data area of %llu bytes "
                            "(%llu stray bytes from file offset %llu)",
                        path, (unsigned long long)expect, (unsigned long long)data_size,
                        (unsigned long long)(data_size - expect),
                        (unsigned long long)(data_start + expect));
    goto done;
  }
  /* Valid: read, in data order (which is the writer's order for kiln and the reference). */
  for (int i = 0; i < n; i++) {
    kiln_tensor *t = read_tensor(path, f, data_start, &infos[i]);
    if (t && dev.type != KILN_DEVICE_CPU) {
      kiln_tensor *moved = kiln__own(kiln_to_device(t, dev));
      kiln_tensor_free(t);
      t = moved;
    }
    if (!t) {
      st = kiln_last_error() != KILN_OK ? kiln_last_error() : KILN_ERR_INTERNAL;
      goto done;
    }
    st = kiln_dict_set(d, infos[i].name, t);
    kiln_tensor_free(t); /* the dict holds its own reference */
    if (st != KILN_OK) goto done;
  }
done:
  free(infos);
  free(by_name);
  cJSON_Delete(root);
  return st;
}

kiln_dict *kiln_safetensors_load(const char *path, kiln_device dev) {
  uint64_t fsize;
  FILE *f = kiln__fopen_regular_size(WHO, path, &fsize); /* NULL path refused; a FIFO too, not waited on */
  if (!f) return NULL;
  kiln_dict *d = NULL;
  char *hdr = NULL;
  unsigned char b8[8];
  if (fsize < 8 || fread(b8, 1, 8, f) != 8) {
    kiln_set_error(KILN_ERR_FORMAT,
                   WHO ": %s: file of %llu bytes is shorter than the 8-byte header length",
                   path, (unsigned long long)fsize);
    goto fail;
  }
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | b8[i];
  if (hlen > fsize - 8) {
    kiln_set_error(KILN_ERR_FORMAT,
                   WHO ": %s: header length %llu (file offset 0) runs past the end of the "
                       "file of %llu bytes",
                   path, (unsigned long long)hlen, (unsigned long long)fsize);
    goto fail;
  }
  if (hlen > ST_MAX_HEADER || hlen < 2) {
    kiln_set_error(KILN_ERR_FORMAT, WHO ": %s: header length %llu (file offset 0) is %s", path,
                   (unsigned long long)hlen, hlen < 2 ? "too small" : "over the 100 MB limit");
    goto fail;
  }
  hdr = malloc((size_t)hlen + 1);
  if (!hdr) {
    kiln_set_error(KILN_ERR_OOM, WHO ": %s: out of memory for a header of %llu bytes", path,
                   (unsigned long long)hlen);
    goto fail;
  }
  if (fread(hdr, 1, (size_t)hlen, f) != (size_t)hlen) {
    kiln_set_error(KILN_ERR_IO, WHO ": %s: cannot read the header at file offset 8", path);
    goto fail;
  }
  hdr[hlen] = 0;
  if (hdr[0] != '{') {
    kiln_set_error(KILN_ERR_FORMAT, WHO ": %s: header does not start with '{' (file offset 8)",
                   path);
    goto fail;
  }
  d = kiln_dict_new();
  if (!d) goto fail;
  if (validate_and_read(path, f, fsize, hdr, hlen, d, dev) != KILN_OK) goto fail;
  free(hdr);
  fclose(f);
  return d;
fail:
  kiln_dict_free(d);
  free(hdr);
  fclose(f);
  return NULL;
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

/* The reference's order: larger dtypes first (keeps every tensor aligned to its size
** when the data area starts aligned), then by name. An insertion sort on indices: qsort
** has no context argument in C11, and state dicts hold hundreds of entries. */
static void save_order(const kiln_dict *d, int *order, int n) {
  for (int i = 0; i < n; i++) order[i] = i;
  for (int i = 1; i < n; i++) {
    int v = order[i], j = i - 1;
    size_t sv = kiln_dtype_size(kiln_dtype_of(kiln_dict_value(d, v)));
    while (j >= 0) {
      int u = order[j];
      size_t su = kiln_dtype_size(kiln_dtype_of(kiln_dict_value(d, u)));
      if (!(sv > su || (sv == su && strcmp(kiln_dict_key(d, v), kiln_dict_key(d, u)) < 0)))
        break;
      order[j + 1] = u;
      j--;
    }
    order[j + 1] = v;
  }
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
  if (!order) return kiln_set_error(KILN_ERR_OOM, WHO ": out of memory");
  save_order(d, order, n);

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
