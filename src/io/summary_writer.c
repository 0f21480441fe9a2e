/*
** TensorBoard event files: scalars written as TensorFlow's Event protobuf in TFRecord
** framing, and a reader of the same records (kiln plot, the tests).
**
** TFRecord, one record per Event:
**   uint64 length (little-endian) | uint32 masked_crc32c(length's 8 bytes) |
**   data[length] | uint32 masked_crc32c(data)
**   masked_crc32c(x) = rotate_right(crc32c(x), 15) + 0xa282ead8 (CRC-32C, Castagnoli)
** The file's first Event has file_version "brain.Event:2"; each scalar is then
**   Event{wall_time=1 (double), step=2 (int64), summary=5 {value=1 {tag=1, simple_value=2}}}
** (field numbers from tensorflow/core/util/event.proto and framework/summary.proto).
**
** Encoding: through protobuf-c (the messages of tb_event.proto, compiled at build time)
** when the build found it (KILN_HAVE_PROTOBUF_C); otherwise the same five fields by hand:
** the wire format of these fields is two tags and three scalar kinds. The reader always
** decodes by hand (it skips fields it does not know), so the tests check the writer
** against an independent decoder as well as against TensorBoard's own reader.
*/
#define _POSIX_C_SOURCE 200809L
#include "io/io_int.h"
#include "ext/kiln_ext.h"
#include "kiln_io.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#if defined(KILN_HAVE_PROTOBUF_C) && KILN_HAVE_PROTOBUF_C
#include "tb_event.pb-c.h"
#endif

/* ---- CRC-32C (Castagnoli, reflected polynomial 0x82f63b78), table-driven ---- */
static uint32_t crc_table[256];

static void crc_init(void) {
  for (uint32_t i = 0; i < 256; i++) {
    uint32_t c = i;
    for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ 0x82f63b78u : c >> 1;
    crc_table[i] = c;
  }
}

uint32_t kiln_crc32c(const void *data, size_t n) {
  static pthread_once_t once = PTHREAD_ONCE_INIT;
  pthread_once(&once, crc_init);
  const uint8_t *p = data;
  uint32_t c = 0xffffffffu;
  for (size_t i = 0; i < n; i++) c = crc_table[(c ^ p[i]) & 0xff] ^ (c >> 8);
  return c ^ 0xffffffffu;
}

static uint32_t masked_crc(const void *data, size_t n) {
  uint32_t c = kiln_crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

static void put_le(uint8_t *p, uint64_t v, int n) {
  for (int i = 0; i < n; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint64_t get_le(const uint8_t *p, int n) {
  uint64_t v = 0;
  for (int i = 0; i < n; i++) v |= (uint64_t)p[i] << (8 * i);
  return v;
}

/* ---- encoding ---- */
#if !(defined(KILN_HAVE_PROTOBUF_C) && KILN_HAVE_PROTOBUF_C)
static size_t put_varint(uint8_t *p, uint64_t v) {
  size_t n = 0;
  do {
    p[n++] = (uint8_t)((v & 0x7f) | (v > 0x7f ? 0x80 : 0));
    v >>= 7;
  } while (v);
  return n;
}
#endif

/* One Event into buf (cap bytes; a tag of at most 1 KiB fits in 1200): the encoded
** length, or 0 when it does not fit. tag NULL: the file_version event. */
static size_t encode_event(uint8_t *buf, size_t cap, double wall, int64_t step, const char *tag, float value) {
#if defined(KILN_HAVE_PROTOBUF_C) && KILN_HAVE_PROTOBUF_C
  KilnTb__Event ev = KILN__TB__EVENT__INIT;
  KilnTb__Summary sum = KILN__TB__SUMMARY__INIT;
  KilnTb__SummaryValue val = KILN__TB__SUMMARY_VALUE__INIT;
  KilnTb__SummaryValue *vals[1] = {&val};
  ev.wall_time = wall;
  ev.step = step;
  if (!tag) {
    ev.what_case = KILN__TB__EVENT__WHAT_FILE_VERSION;
    ev.file_version = (char *)"brain.Event:2";
  } else {
    val.tag = (char *)tag;
    val.simple_value = value;
    sum.n_value = 1;
    sum.value = vals;
    ev.what_case = KILN__TB__EVENT__WHAT_SUMMARY;
    ev.summary = &sum;
  }
  size_t n = kiln__tb__event__get_packed_size(&ev);
  if (n > cap) return 0;
  return kiln__tb__event__pack(&ev, buf);
#else
  const char *s = tag ? tag : "brain.Event:2";
  size_t sl = strlen(s);
  if (sl + 64 > cap) return 0;
  size_t n = 0;
  uint64_t bits;
  buf[n++] = (1 << 3) | 1; /* wall_time: fixed64 */
  memcpy(&bits, &wall, 8);
  put_le(buf + n, bits, 8);
  n += 8;
  if (step != 0) { /* proto3 leaves zero scalars out, as protobuf-c does */
    buf[n++] = (2 << 3) | 0; /* step: varint (two's complement) */
    n += put_varint(buf + n, (uint64_t)step);
  }
  if (!tag) {
    buf[n++] = (3 << 3) | 2; /* file_version: bytes */
    n += put_varint(buf + n, sl);
    memcpy(buf + n, s, sl);
    return n + sl;
  }
  /* Value{tag=1 (bytes), simple_value=2 (fixed32)} inside Summary{value=1} inside field 5 */
  uint8_t v[1100];
  size_t vn = 0;
  v[vn++] = (1 << 3) | 2;
  vn += put_varint(v + vn, sl);
  memcpy(v + vn, s, sl);
  vn += sl;
  if (value != 0.0f || signbit(value)) {
    uint32_t fb;
    memcpy(&fb, &value, 4);
    v[vn++] = (2 << 3) | 5;
    put_le(v + vn, fb, 4);
    vn += 4;
  }
  uint8_t hdr[12];
  size_t hn = 0;
  hdr[hn++] = (1 << 3) | 2;
  hn += put_varint(hdr + hn, vn);
  buf[n++] = (5 << 3) | 2; /* summary */
  n += put_varint(buf + n, hn + vn);
  memcpy(buf + n, hdr, hn);
  n += hn;
  memcpy(buf + n, v, vn);
  return n + vn;
#endif
}

/* ---- the writer ---- */
struct kiln_summary_writer {
  FILE *f;
  char *path;
};

/* mkdir -p: each missing component, 0777 less the umask. */
static kiln_status make_dirs(const char *dir) {
  size_t n = strlen(dir);
  char *p = malloc(n + 1);
  if (!p) return kiln_set_error(KILN_ERR_OOM, "kiln_summary_writer_open: out of host memory");
  memcpy(p, dir, n + 1);
  kiln_status st = KILN_OK;
  for (size_t i = 1; i <= n && st == KILN_OK; i++) {
    if (p[i] != '/' && p[i] != 0) continue;
    char c = p[i];
    p[i] = 0;
    struct stat sb;
    if (stat(p, &sb) != 0) {
      if (mkdir(p, 0777) != 0 && errno != EEXIST)
        st = kiln_set_error(KILN_ERR_IO, "kiln_summary_writer_open: cannot create the log directory '%s': %s", p,
                            strerror(errno));
    } else if (!S_ISDIR(sb.st_mode)) {
      st = kiln_set_error(KILN_ERR_IO, "kiln_summary_writer_open: cannot create the log directory '%s': '%s' is not a directory",
                          dir, p);
    }
    p[i] = c;
  }
  free(p);
  return st;
}

static kiln_status write_record(kiln_summary_writer *w, const uint8_t *data, size_t n) {
  uint8_t head[12], tail[4];
  put_le(head, n, 8);
  put_le(head + 8, masked_crc(head, 8), 4);
  put_le(tail, masked_crc(data, n), 4);
  if (fwrite(head, 1, 12, w->f) != 12 || fwrite(data, 1, n, w->f) != n || fwrite(tail, 1, 4, w->f) != 4)
    return kiln_set_error(KILN_ERR_IO, "kiln_summary_writer: writing '%s' failed: %s", w->path, strerror(errno));
  return KILN_OK;
}

static double wall_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

kiln_summary_writer *kiln_summary_writer_open(const char *logdir) {
  if (!logdir || !*logdir) KILN__FAIL_NULL(KILN_ERR_INVALID_ARGUMENT, "kiln_summary_writer_open: no log directory");
  if (make_dirs(logdir) != KILN_OK) return NULL;
  static atomic_int seq;
  char host[128] = "localhost";
  if (gethostname(host, sizeof host) != 0) snprintf(host, sizeof host, "localhost");
  host[sizeof host - 1] = 0;
  size_t n = strlen(logdir) + strlen(host) + 96;
  kiln_summary_writer *w = calloc(1, sizeof *w);
  char *path = malloc(n);
  if (!w || !path) {
    free(w);
    free(path);
    KILN__FAIL_NULL(KILN_ERR_OOM, "kiln_summary_writer_open: out of host memory");
  }
  /* TensorBoard loads files whose name contains "tfevents", in name order */
  snprintf(path, n, "%s/events.out.tfevents.%lld.%s.%d.%d", logdir, (long long)time(NULL), host, (int)getpid(),
           atomic_fetch_add(&seq, 1));
  w->path = path;
  w->f = fopen(path, "wb");
  if (!w->f) {
    kiln_set_error(KILN_ERR_IO, "kiln_summary_writer_open: cannot write '%s': %s", path, strerror(errno));
    free(path);
    free(w);
    return NULL;
  }
  uint8_t buf[128];
  size_t len = encode_event(buf, sizeof buf, wall_now(), 0, NULL, 0);
  if (write_record(w, buf, len) != KILN_OK || fflush(w->f) != 0) {
    kiln_status st = kiln_last_error();
    fclose(w->f);
    free(path);
    free(w);
    if (st == KILN_OK) kiln_set_error(KILN_ERR_IO, "kiln_summary_writer_open: writing failed");
    return NULL;
  }
  return w;
}

kiln_status kiln_summary_writer_add_scalar(kiln_summary_writer *w, const char *tag, int64_t step, double value) {
  if (!w || !tag || !*tag)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_summary_writer_add_scalar: NULL writer or empty tag");
  if (strlen(tag) > 1024)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_summary_writer_add_scalar: tag longer than 1024 bytes");
  uint8_t buf[1200];
  size_t len = encode_event(buf, sizeof buf, wall_now(), step, tag, (float)value);
  if (!len) return kiln_set_error(KILN_ERR_INTERNAL, "kiln_summary_writer_add_scalar: event does not fit");
  return write_record(w, buf, len);
}

kiln_status kiln_summary_writer_flush(kiln_summary_writer *w) {
  if (!w) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_summary_writer_flush: NULL writer");
  if (fflush(w->f) != 0)
    return kiln_set_error(KILN_ERR_IO, "kiln_summary_writer_flush: '%s': %s", w->path, strerror(errno));
  return KILN_OK;
}

const char *kiln_summary_writer_path(const kiln_summary_writer *w) { return w ? w->path : NULL; }

kiln_status kiln_summary_writer_close(kiln_summary_writer *w) {
  if (!w) return KILN_OK;
  kiln_status st = KILN_OK;
  if (fclose(w->f) != 0) st = kiln_set_error(KILN_ERR_IO, "kiln_summary_writer_close: '%s': %s", w->path, strerror(errno));
  free(w->path);
  free(w);
  return st;
}

/* ---- the reader ---- */

typedef struct cursor {
  const uint8_t *p, *end;
  bool bad;
} cursor;

static uint64_t get_varint(cursor *c) {
  uint64_t v = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    if (c->p >= c->end) break;
    uint8_t b = *c->p++;
    v |= (uint64_t)(b & 0x7f) << shift;
    if (!(b & 0x80)) return v;
  }
  c->bad = true;
  return 0;
}

/* Skips a field of wire type wt; false on a malformed one. */
static bool skip(cursor *c, int wt) {
  size_t n;
  switch (wt) {
  case 0: get_varint(c); return !c->bad;
  case 1: n = 8; break;
  case 5: n = 4; break;
  case 2: n = (size_t)get_varint(c); break;
  default: return false;
  }
  if (c->bad || n > (size_t)(c->end - c->p)) return false;
  c->p += n;
  return true;
}

/* Summary.Value: tag and simple_value (other kinds of value are skipped: tag NULL). */
static bool read_value(cursor c, kiln_scalar_event *ev, char *tag, size_t tag_cap) {
  ev->tag = NULL;
  bool simple = false;
  while (c.p < c.end) {
    uint64_t key = get_varint(&c);
    if (c.bad) return false;
    int field = (int)(key >> 3), wt = (int)(key & 7);
    if (field == 1 && wt == 2) {
      size_t n = (size_t)get_varint(&c);
      if (c.bad || n > (size_t)(c.end - c.p)) return false;
      size_t k = n < tag_cap - 1 ? n : tag_cap - 1;
      memcpy(tag, c.p, k);
      tag[k] = 0;
      ev->tag = tag;
      c.p += n;
    } else if (field == 2 && wt == 5) {
      if (c.end - c.p < 4) return false;
      uint32_t b = (uint32_t)get_le(c.p, 4);
      float f;
      memcpy(&f, &b, 4);
      ev->value = f;
      simple = true;
      c.p += 4;
    } else if (!skip(&c, wt)) {
      return false;
    }
  }
  if (!simple && ev->tag) ev->value = 0; /* proto3: an absent simple_value is 0 */
  return true;
}

kiln_status kiln_summary_read(const char *path, kiln_scalar_fn fn, void *ctx) {
  if (!path || !fn) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_summary_read: NULL argument");
  FILE *f = kiln__fopen_regular("kiln_summary_read", path); /* a FIFO is refused, not waited on */
  if (!f) return kiln_last_error();
  kiln_status st = KILN_OK;
  uint8_t *data = NULL;
  size_t cap = 0;
  long offset = 0;
  for (;;) {
    uint8_t head[12], tail[4];
    size_t got = fread(head, 1, 12, f);
    if (got == 0) break;
    if (got != 12) {
      st = kiln_set_error(KILN_ERR_FORMAT, "kiln_summary_read: '%s': truncated record at offset %ld", path, offset);
      break;
    }
    uint64_t n = get_le(head, 8);
    if ((uint32_t)get_le(head + 8, 4) != masked_crc(head, 8) || n > (1u << 26)) {
      st = kiln_set_error(KILN_ERR_FORMAT, "kiln_summary_read: '%s': bad record length at offset %ld", path, offset);
      break;
    }
    if (n > cap || !data) { /* an empty record too: the cursor below needs a buffer */
      uint8_t *nd = realloc(data, n ? (size_t)n : 1);
      if (!nd) {
        st = kiln_set_error(KILN_ERR_OOM, "kiln_summary_read: out of host memory");
        break;
      }
      data = nd;
      cap = n ? (size_t)n : 1;
    }
    if (fread(data, 1, (size_t)n, f) != n || fread(tail, 1, 4, f) != 4) {
      st = kiln_set_error(KILN_ERR_FORMAT, "kiln_summary_read: '%s': truncated record at offset %ld", path, offset);
      break;
    }
    if ((uint32_t)get_le(tail, 4) != masked_crc(data, (size_t)n)) {
      st = kiln_set_error(KILN_ERR_FORMAT, "kiln_summary_read: '%s': record at offset %ld fails its CRC", path, offset);
      break;
    }
    offset += 16 + (long)n;
    /* Event */
    cursor c = {data, data + n, false};
    kiln_scalar_event ev = {0, 0, NULL, 0};
    const uint8_t *sum = NULL, *sum_end = NULL;
    while (c.p < c.end && !c.bad) {
      uint64_t key = get_varint(&c);
      int field = (int)(key >> 3), wt = (int)(key & 7);
      if (field == 1 && wt == 1 && c.end - c.p >= 8) {
        uint64_t b = get_le(c.p, 8);
        memcpy(&ev.wall_time, &b, 8);
        c.p += 8;
      } else if (field == 2 && wt == 0) {
        ev.step = (int64_t)get_varint(&c);
      } else if (field == 5 && wt == 2) {
        size_t m = (size_t)get_varint(&c);
        if (c.bad || m > (size_t)(c.end - c.p)) c.bad = true;
        else sum = c.p, sum_end = c.p + m, c.p += m;
      } else if (!skip(&c, wt)) {
        c.bad = true;
      }
    }
    if (c.bad) {
      st = kiln_set_error(KILN_ERR_FORMAT, "kiln_summary_read: '%s': malformed event before offset %ld", path, offset);
      break;
    }
    /* Summary: each value */
    cursor s = {sum, sum_end, false};
    while (sum && s.p < s.end && st == KILN_OK) {
      uint64_t key = get_varint(&s);
      int field = (int)(key >> 3), wt = (int)(key & 7);
      if (field == 1 && wt == 2) {
        size_t m = (size_t)get_varint(&s);
        if (s.bad || m > (size_t)(s.end - s.p)) {
          s.bad = true;
          break;
        }
        char tag[1025];
        cursor v = {s.p, s.p + m, false};
        if (!read_value(v, &ev, tag, sizeof tag)) s.bad = true;
        else if (ev.tag && !fn(&ev, ctx)) goto done;
        s.p += m;
      } else if (!skip(&s, wt)) {
        s.bad = true;
      }
      if (s.bad) break;
    }
    if (s.bad) {
      st = kiln_set_error(KILN_ERR_FORMAT, "kiln_summary_read: '%s': malformed summary before offset %ld", path, offset);
      break;
    }
  }
done:
  free(data);
  fclose(f);
  return st;
}
