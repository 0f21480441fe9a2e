/*
** TensorBoard event files (kiln_summary_writer): CRC-32C against its check value; a log
** directory made with its parents; scalars read back by kiln's own decoder (every record's
** CRCs checked), by protobuf-c's when the build has it, and, with --tensorboard, by
** TensorBoard's own reader from PyPI (exit 77 without python3 or the package); a damaged
** byte found by the CRC; a log directory that cannot be made fails at open, naming it.
*/
#define _POSIX_C_SOURCE 200809L
#include <kiln.h>
#include <kiln_io.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "scratch.h"

#if defined(KILN_HAVE_PROTOBUF_C) && KILN_HAVE_PROTOBUF_C
#include "tb_event.pb-c.h"
#endif

enum { N = 10 };

typedef struct seen {
  int n_loss, n_lr, n_other;
  bool ok;
} seen;

static double loss_at(int i) { return 2.5 / (1 + i); }

static bool on_scalar(const kiln_scalar_event *e, void *ctx) {
  seen *s = ctx;
  if (!strcmp(e->tag, "train/loss")) {
    if (e->step != s->n_loss * 100 || e->value != (double)(float)loss_at(s->n_loss) || e->wall_time < 1e9) s->ok = false;
    s->n_loss++;
  } else if (!strcmp(e->tag, "lr")) {
    if (e->value != (double)(float)1e-3 || e->step != (int64_t)1 << 40) s->ok = false;
    s->n_lr++;
  } else if (!strcmp(e->tag, "zero")) {
    if (e->value != 0 || e->step != 0) s->ok = false;
    s->n_other++;
  } else {
    s->ok = false;
  }
  return true;
}

static void write_log(const char *logdir, char *path, size_t n) {
  kiln_summary_writer *w = kiln_summary_writer_open(logdir);
  CHECK(w != NULL);
  if (!w) return;
  snprintf(path, n, "%s", kiln_summary_writer_path(w));
  for (int i = 0; i < N; i++) CHECK(kiln_summary_writer_add_scalar(w, "train/loss", 100 * i, loss_at(i)) == KILN_OK);
  CHECK(kiln_summary_writer_add_scalar(w, "lr", (int64_t)1 << 40, 1e-3) == KILN_OK);
  CHECK(kiln_summary_writer_add_scalar(w, "zero", 0, 0.0) == KILN_OK);
  CHECK(kiln_summary_writer_flush(w) == KILN_OK);
  CHECK(kiln_summary_writer_add_scalar(w, "", 0, 1.0) == KILN_ERR_INVALID_ARGUMENT);
  CHECK(kiln_summary_writer_close(w) == KILN_OK);
}

#if defined(KILN_HAVE_PROTOBUF_C) && KILN_HAVE_PROTOBUF_C
/* protobuf-c's decoder over each record's payload */
static void check_protobuf_c(const char *path) {
  FILE *f = fopen(path, "rb");
  CHECK(f != NULL);
  if (!f) return;
  int events = 0, scalars = 0;
  bool version = false;
  unsigned char head[12], buf[4096], tail[4];
  while (fread(head, 1, 12, f) == 12) {
    uint64_t n = 0;
    for (int i = 0; i < 8; i++) n |= (uint64_t)head[i] << (8 * i);
    if (n > sizeof buf || fread(buf, 1, n, f) != n || fread(tail, 1, 4, f) != 4) break;
    KilnTb__Event *ev = kiln__tb__event__unpack(NULL, n, buf);
    CHECK(ev != NULL);
    if (!ev) break;
    events++;
    if (ev->what_case == KILN__TB__EVENT__WHAT_FILE_VERSION) version = !strcmp(ev->file_version, "brain.Event:2");
    if (ev->what_case == KILN__TB__EVENT__WHAT_SUMMARY) scalars += (int)ev->summary->n_value;
    kiln__tb__event__free_unpacked(ev, NULL);
  }
  fclose(f);
  CHECK(version && events == N + 3 && scalars == N + 2);
}
#endif

static int tensorboard_check(const char *path, const char *logdir) {
  if (system("python3 -c 'import tensorboard' >/dev/null 2>&1") != 0) {
    printf("test_summary_writer: python3 or the tensorboard package is missing: skipped\n");
    return 77;
  }
  const char *src = getenv("KILN_SOURCE_DIR");
  char cmd[2048];
  snprintf(cmd, sizeof cmd, "python3 '%s/tests/tb_read.py' '%s' '%s' 2>/dev/null", src ? src : ".", path, logdir);
  FILE *p = popen(cmd, "r");
  CHECK(p != NULL);
  if (!p) return 1;
  char line[512];
  int n_loss = 0, rows = 0;
  bool version = false, acc_loss = false, acc_lr = false, bad = false;
  while (fgets(line, sizeof line, p)) {
    char tag[256];
    long long step;
    double v;
    int count;
    if (!strncmp(line, "version brain.Event:2", 21)) {
      version = true;
    } else if (sscanf(line, "acc %255s %d", tag, &count) == 2) {
      if (!strcmp(tag, "train/loss")) acc_loss = count == N;
      if (!strcmp(tag, "lr")) acc_lr = count == 1;
    } else if (sscanf(line, "%255s %lld %lf", tag, &step, &v) == 3) {
      rows++;
      if (!strcmp(tag, "train/loss")) {
        if (step != 100 * n_loss || v != (double)(float)loss_at(n_loss)) bad = true;
        n_loss++;
      } else if (!strcmp(tag, "lr")) {
        if (step != (long long)1 << 40 || v != (double)(float)1e-3) bad = true;
      }
    }
  }
  int rc = pclose(p);
  CHECK(rc == 0);
  CHECK(version && n_loss == N && rows == N + 2 && !bad && acc_loss && acc_lr);
  return failures ? 1 : 0;
}

int main(int argc, char **argv) {
  bool tb = argc > 1 && !strcmp(argv[1], "--tensorboard");
  /* CRC-32C's check value (RFC 3720, B.4) */
  CHECK(kiln_crc32c("123456789", 9) == 0xe3069283u);
  char dir[512], logdir[640], path[1024];
  if (scratch_begin(dir, sizeof dir, "tb") != 0) return 1;
  snprintf(logdir, sizeof logdir, "%s/runs/a/b", dir);
  path[0] = 0;
  write_log(logdir, path, sizeof path);
  if (tb) {
    int rc = path[0] ? tensorboard_check(path, logdir) : 1;
    scratch_end(dir);
    return rc;
  }
  seen s = {0, 0, 0, true};
  CHECK(kiln_summary_read(path, on_scalar, &s) == KILN_OK);
  CHECK(s.ok && s.n_loss == N && s.n_lr == 1 && s.n_other == 1);
#if defined(KILN_HAVE_PROTOBUF_C) && KILN_HAVE_PROTOBUF_C
  check_protobuf_c(path);
#endif
  /* a flipped byte in the last record's payload: the CRC finds it */
  FILE *f = fopen(path, "r+b");
  CHECK(f != NULL);
  if (f) {
    fseek(f, -6, SEEK_END);
    int c = fgetc(f);
    fseek(f, -6, SEEK_END);
    fputc(c ^ 0x40, f);
    fclose(f);
    seen s2 = {0, 0, 0, true};
    CHECK(kiln_summary_read(path, on_scalar, &s2) == KILN_ERR_FORMAT);
    CHECK(strstr(kiln_last_error_message(), "CRC") != NULL);
    CHECK(s2.n_loss == N); /* what came before is read */
  }
  CHECK(kiln_summary_read("/nonexistent-kiln/x", on_scalar, &s) == KILN_ERR_IO);
  /* an empty record (an Event with no fields) first: read, no scalar in it (the reader
  ** made a cursor from a NULL buffer; found by the fuzz target tfevents under UBSan) */
  f = fopen(path, "wb");
  CHECK(f != NULL);
  if (f) {
    unsigned char rec[16] = {0};
    uint32_t c = kiln_crc32c(rec, 8), e = kiln_crc32c(rec, 0);
    c = ((c >> 15) | (c << 17)) + 0xa282ead8u;
    e = ((e >> 15) | (e << 17)) + 0xa282ead8u;
    for (int i = 0; i < 4; i++) rec[8 + i] = (unsigned char)(c >> (8 * i)), rec[12 + i] = (unsigned char)(e >> (8 * i));
    fwrite(rec, 1, 16, f);
    fclose(f);
    seen s3 = {0, 0, 0, true};
    CHECK(kiln_summary_read(path, on_scalar, &s3) == KILN_OK && s3.n_loss + s3.n_lr + s3.n_other == 0);
  }
  /* a log directory under a regular file cannot be made */
  char bad[1200];
  snprintf(bad, sizeof bad, "%s/sub", path);
  CHECK(kiln_summary_writer_open(bad) == NULL && kiln_last_error() == KILN_ERR_IO);
  CHECK(strstr(kiln_last_error_message(), "log directory") != NULL);
  CHECK(kiln_summary_writer_open("") == NULL && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT);
  CHECK(kiln_summary_writer_close(NULL) == KILN_OK);
  scratch_end(dir);
  if (failures) fprintf(stderr, "test_summary_writer: %d failed\n", failures);
  else printf("test_summary_writer: ok\n");
  return failures ? 1 : 0;
}
