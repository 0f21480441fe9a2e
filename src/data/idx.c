/*
** IDX reader (the MNIST / Fashion-MNIST format, http://yann.lecun.com/exdb/mnist/).
**
** File layout (all integers big-endian), usually gzip-compressed as a whole:
**
**   offset 0   u8 0, u8 0        magic: two zero bytes
**   offset 2   u8 type           0x08 u8, 0x09 i8, 0x0B i16, 0x0C i32, 0x0D f32, 0x0E f64
**   offset 3   u8 ndim           number of dims, >= 1
**   offset 4   ndim x u32        the dims, outermost first
**   then       prod(dims) elements of type, C order, big-endian
**
** Train images are (60000, 28, 28) u8, labels (60000) u8; test sets have 10000.
*/
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ext/kiln_ext.h"
#include "kiln_data.h"

#ifdef KILN_HAVE_ZLIB
#include <zlib.h>
#endif

#define WHO "kiln_idx_load"

/* A byte stream: gzip through zlib (which also reads raw files as they are), or stdio. */
typedef struct rd {
#ifdef KILN_HAVE_ZLIB
  gzFile g;
#else
  FILE *f;
#endif
  uint64_t pos; /* bytes consumed from the (uncompressed) stream */
  int err;      /* a read error, not an end of file */
} rd;

/* 0 with the error set on failure (a FIFO or other special file is refused unopened). */
static int rd_open(rd *r, const char *path) {
  memset(r, 0, sizeof *r);
#ifdef KILN_HAVE_ZLIB
  int fd = kiln__open_regular(WHO, path);
  if (fd < 0) return 0;
  r->g = gzdopen(fd, "rb");
  if (!r->g) {
    close(fd);
    kiln_set_error(KILN_ERR_OOM, WHO ": %s: out of memory for the gzip reader", path);
  }
  return r->g != NULL;
#else
  r->f = kiln__fopen_regular(WHO, path);
  return r->f != NULL;
#endif
}

static void rd_close(rd *r) {
#ifdef KILN_HAVE_ZLIB
  if (r->g) gzclose(r->g);
#else
  if (r->f) fclose(r->f);
#endif
}

/* Reads up to n bytes; returns how many (short only at the end or on an error). */
static size_t rd_read(rd *r, void *buf, size_t n) {
  size_t got = 0;
  while (got < n) {
    size_t want = n - got > (1u << 30) ? (1u << 30) : n - got;
#ifdef KILN_HAVE_ZLIB
    int k = gzread(r->g, (char *)buf + got, (unsigned)want);
    if (k < 0) {
      r->err = 1;
      break;
    }
    if (k == 0) break;
    got += (size_t)k;
#else
    size_t k = fread((char *)buf + got, 1, want, r->f);
    got += k;
    if (k < want) {
      if (ferror(r->f)) r->err = 1;
      break;
    }
#endif
  }
  r->pos += got;
  return got;
}

static const char *rd_errmsg(rd *r) {
#ifdef KILN_HAVE_ZLIB
  int code;
  const char *m = gzerror(r->g, &code);
  return m && *m ? m : "read error";
#else
  (void)r;
  return strerror(errno);
#endif
}

/* Sets the error for a short read at the stream's position. */
static void short_read(rd *r, const char *path, const char *what) {
  if (r->err)
    kiln_set_error(KILN_ERR_IO, WHO ": %s: read error in %s at offset %llu: %s", path, what,
                   (unsigned long long)r->pos, rd_errmsg(r));
  else
    kiln_set_error(KILN_ERR_FORMAT, WHO ": %s: truncated: %s ends at offset %llu", path, what,
                   (unsigned long long)r->pos);
}

kiln_tensor *kiln_idx_load(const char *path) {
  if (!path) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, WHO ": NULL path");
    return NULL;
  }
  rd r;
  if (!rd_open(&r, path)) return NULL;
  unsigned char *buf = NULL;
  kiln_tensor *t = NULL;
  unsigned char h[4 + 4 * KILN_MAX_DIMS];
  if (rd_read(&r, h, 4) != 4) {
    short_read(&r, path, "the 4-byte magic");
    goto fail;
  }
#ifndef KILN_HAVE_ZLIB
  if (h[0] == 0x1f && h[1] == 0x8b) {
    kiln_set_error(KILN_ERR_UNSUPPORTED, WHO ": %s is gzip-compressed and kiln was built "
                                         "without zlib (gunzip it first)", path);
    goto fail;
  }
#endif
  if (h[0] != 0 || h[1] != 0) {
    kiln_set_error(KILN_ERR_FORMAT, WHO ": %s: bad magic %02x %02x at offset 0 (want 00 00)",
                   path, h[0], h[1]);
    goto fail;
  }
  int type = h[2], nd = h[3];
  size_t fsize; /* element size in the file */
  kiln_dtype dt;
  switch (type) {
  case 0x08: fsize = 1; dt = KILN_U8; break;
  case 0x09: fsize = 1; dt = KILN_I32; break;
  case 0x0B: fsize = 2; dt = KILN_I32; break;
  case 0x0C: fsize = 4; dt = KILN_I32; break;
  case 0x0D: fsize = 4; dt = KILN_F32; break;
  case 0x0E: fsize = 8; dt = KILN_F64; break;
  default:
    kiln_set_error(KILN_ERR_FORMAT, WHO ": %s: unknown type byte 0x%02x at offset 2", path, type);
    goto fail;
  }
  if (nd < 1 || nd > KILN_MAX_DIMS) {
    kiln_set_error(KILN_ERR_FORMAT, WHO ": %s: %d dims at offset 3 (want 1..%d)", path, nd,
                   KILN_MAX_DIMS);
    goto fail;
  }
  if (rd_read(&r, h + 4, 4 * (size_t)nd) != 4 * (size_t)nd) {
    short_read(&r, path, "the dims");
    goto fail;
  }
  int64_t shape[KILN_MAX_DIMS];
  /* span: the product with zero dims counted as 1 (strides are made of it), so that
  ** (0, 2^31, 2^31, 2^31) is refused like its non-empty cousin. */
  uint64_t numel = 1, span = 1;
  for (int i = 0; i < nd; i++) {
    const unsigned char *p = h + 4 + 4 * i;
    shape[i] = (int64_t)(((uint64_t)p[0] << 24) | ((uint64_t)p[1] << 16) | ((uint64_t)p[2] << 8) | p[3]);
    uint64_t d = shape[i] ? (uint64_t)shape[i] : 1;
    if (span > (UINT64_C(1) << 40) / d) {
      kiln_set_error(KILN_ERR_SHAPE, WHO ": %s: dims at offset 4 give over 2^40 elements", path);
      goto fail;
    }
    span *= d;
    numel *= (uint64_t)shape[i];
  }
  /* Read into a buffer that grows with the data, so a corrupt dim costs no more memory
  ** than the file really holds. */
  uint64_t need = numel * fsize, have = 0, cap = 0;
  while (have < need) {
    uint64_t want = need - have > (UINT64_C(1) << 24) ? (UINT64_C(1) << 24) : need - have;
    if (have + want > cap) {
      uint64_t nc = cap ? cap * 2 : (UINT64_C(1) << 16);
      if (nc < have + want) nc = have + want;
      if (nc > need) nc = need;
      unsigned char *nb = realloc(buf, (size_t)nc);
      if (!nb) {
        kiln_set_error(KILN_ERR_OOM, WHO ": %s: out of memory (%llu bytes)", path,
                       (unsigned long long)nc);
        goto fail;
      }
      buf = nb;
      cap = nc;
    }
    size_t got = rd_read(&r, buf + have, (size_t)want);
    have += got;
    if (got < want) {
      short_read(&r, path, "the data");
      goto fail;
    }
  }
  unsigned char extra;
  if (rd_read(&r, &extra, 1) != 0) {
    kiln_set_error(KILN_ERR_FORMAT, WHO ": %s: trailing bytes after the data at offset %llu", path,
                   (unsigned long long)(r.pos - 1));
    goto fail;
  }
  if (r.err) {
    short_read(&r, path, "the end of the stream");
    goto fail;
  }
#ifdef KILN_HAVE_ZLIB
  {
    /* gzread treats a missing or cut gzip trailer (CRC and length) as a soft
    ** Z_BUF_ERROR and returns the data: check for it, or a truncated .gz would pass. */
    int code = Z_OK;
    const char *m = gzerror(r.g, &code);
    if (code != Z_OK) {
      kiln_set_error(code == Z_BUF_ERROR ? KILN_ERR_FORMAT : KILN_ERR_IO,
                     WHO ": %s: gzip stream %s after offset %llu: %s", path,
                     code == Z_BUF_ERROR ? "truncated" : "broken", (unsigned long long)r.pos,
                     m ? m : "?");
      goto fail;
    }
  }
#endif
  t = kiln__own(kiln_empty(nd, shape, dt, kiln_device_cpu()));
  if (!t) goto fail;
  if (numel) {
    unsigned char *dst = kiln_data_ptr(t);
    if (!dst) goto fail;
    for (uint64_t i = 0; i < numel; i++) {
      const unsigned char *p = buf + i * fsize;
      switch (type) {
      case 0x08: dst[i] = p[0]; break;
      case 0x09: ((int32_t *)dst)[i] = (int8_t)p[0]; break;
      case 0x0B: ((int32_t *)dst)[i] = (int16_t)(((unsigned)p[0] << 8) | p[1]); break;
      default: { /* 4 or 8 bytes big-endian -> host */
        uint64_t v = 0;
        for (size_t k = 0; k < fsize; k++) v = (v << 8) | p[k];
        if (fsize == 4) {
          uint32_t v32 = (uint32_t)v;
          memcpy(dst + i * 4, &v32, 4);
        } else {
          memcpy(dst + i * 8, &v, 8);
        }
      }
      }
    }
  }
  free(buf);
  rd_close(&r);
  {
    /* the usual rule: a new reference owned by the current scope if one is open */
    kiln_tensor *out = kiln_to_device(t, kiln_device_cpu());
    kiln_tensor_free(t);
    return out;
  }
fail:
  kiln_tensor_free(t);
  free(buf);
  rd_close(&r);
  return NULL;
}

/* ------------------------------------------------------------------------------------ */
/* Fashion-MNIST. */

#undef WHO
#define WHO "kiln_fashion_mnist_load"
#define DEFAULT_DIR "/usr/share/datasets/fashion-mnist"

/* stat, not open: opening a FIFO to see whether it is there would block; kiln_idx_load
** then refuses anything that is not a regular file. */
static int file_exists(const char *p) {
  struct stat sb;
  return stat(p, &sb) == 0;
}

/* Finds base[.gz] in one of the candidate dirs; writes the path. */
static int find_file(char dirs[][1024], int nd, const char *base, char *out, size_t n) {
  for (int i = 0; i < nd; i++) {
    snprintf(out, n, "%s/%s.gz", dirs[i], base);
    if (file_exists(out)) return 1;
    snprintf(out, n, "%s/%s", dirs[i], base);
    if (file_exists(out)) return 1;
  }
  return 0;
}

/* Loads one images/labels pair into owned tensors (f32 (N, H, W) in [0, 1], i64 (N)). */
static kiln_status load_pair(char dirs[][1024], int nd, const char *img_base, const char *lbl_base,
                             kiln_tensor **x, kiln_tensor **y) {
  char p[1100];
  const char *bases[2] = {img_base, lbl_base};
  kiln_tensor *raw[2] = {NULL, NULL};
  kiln_status st = KILN_OK;
  for (int k = 0; k < 2; k++) {
    if (!(k == 0 ? x : y)) continue;
    if (!find_file(dirs, nd, bases[k], p, sizeof p)) {
      st = kiln_set_error(KILN_ERR_IO, WHO ": %s[.gz] not found in %s%s%s%s%s", bases[k], dirs[0],
                          nd > 1 ? ", " : "", nd > 1 ? dirs[1] : "", nd > 2 ? ", " : "",
                          nd > 2 ? dirs[2] : "");
      goto done;
    }
    raw[k] = kiln__own(kiln_idx_load(p));
    if (!raw[k]) {
      st = kiln_last_error();
      goto done;
    }
    if (kiln_dtype_of(raw[k]) != KILN_U8 || kiln_ndim(raw[k]) != (k == 0 ? 3 : 1)) {
      char b[96];
      st = kiln_set_error(KILN_ERR_FORMAT, WHO ": %s: want %s u8, got %s %s", p,
                          k == 0 ? "(N, H, W)" : "(N)", kiln_shape_str(raw[k], b, sizeof b),
                          kiln_dtype_name(kiln_dtype_of(raw[k])));
      goto done;
    }
  }
  if (raw[0] && raw[1] && kiln_size(raw[0], 0) != kiln_size(raw[1], 0)) {
    st = kiln_set_error(KILN_ERR_FORMAT, WHO ": %s has %lld images but %s has %lld labels", img_base,
                        (long long)kiln_size(raw[0], 0), lbl_base, (long long)kiln_size(raw[1], 0));
    goto done;
  }
  if (raw[0]) {
    kiln_tensor *f = kiln__own(kiln_empty(3, kiln_shape(raw[0]), KILN_F32, kiln_device_cpu()));
    if (!f) {
      st = kiln_last_error();
      goto done;
    }
    const uint8_t *s = kiln_data_ptr(raw[0]);
    float *d = kiln_data_ptr(f);
    int64_t n = kiln_numel(f);
    for (int64_t i = 0; i < n; i++) d[i] = (float)s[i] / 255.0f;
    *x = f;
  }
  if (raw[1]) {
    kiln_tensor *l = kiln__own(kiln_empty(1, kiln_shape(raw[1]), KILN_I64, kiln_device_cpu()));
    if (!l) {
      st = kiln_last_error();
      goto done;
    }
    const uint8_t *s = kiln_data_ptr(raw[1]);
    int64_t *d = kiln_data_ptr(l);
    int64_t n = kiln_numel(l);
    for (int64_t i = 0; i < n; i++) d[i] = s[i];
    *y = l;
  }
done:
  kiln_tensor_free(raw[0]);
  kiln_tensor_free(raw[1]);
  return st;
}

kiln_status kiln_fashion_mnist_load(const char *dir, kiln_tensor **train_x, kiln_tensor **train_y,
                                    kiln_tensor **test_x, kiln_tensor **test_y) {
  kiln_tensor **outs[4] = {train_x, train_y, test_x, test_y};
  for (int i = 0; i < 4; i++)
    if (outs[i]) *outs[i] = NULL;
  char dirs[3][1024];
  int nd = 0;
  const char *env = getenv("KILN_DATA_DIR");
  if (dir) {
    snprintf(dirs[nd++], sizeof dirs[0], "%s", dir);
  } else if (env && *env) {
    snprintf(dirs[nd++], sizeof dirs[0], "%s/fashion-mnist", env);
    snprintf(dirs[nd++], sizeof dirs[0], "%s", env);
  } else {
    snprintf(dirs[nd++], sizeof dirs[0], "%s", DEFAULT_DIR);
  }
  kiln_tensor *t[4] = {NULL, NULL, NULL, NULL};
  kiln_status st = load_pair(dirs, nd, "train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                             train_x ? &t[0] : NULL, train_y ? &t[1] : NULL);
  if (st == KILN_OK)
    st = load_pair(dirs, nd, "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte",
                   test_x ? &t[2] : NULL, test_y ? &t[3] : NULL);
  for (int i = 0; i < 4; i++) {
    if (!t[i]) continue;
    if (st == KILN_OK) {
      /* hand over under the usual rule (scope-owned if a scope is open) */
      *outs[i] = kiln_to_device(t[i], kiln_device_cpu());
      if (!*outs[i]) st = kiln_last_error();
    }
    kiln_tensor_free(t[i]);
  }
  if (st != KILN_OK)
    for (int i = 0; i < 4; i++)
      if (outs[i] && *outs[i]) {
        kiln_tensor_free(kiln__own(*outs[i]));
        *outs[i] = NULL;
      }
  return st;
}
