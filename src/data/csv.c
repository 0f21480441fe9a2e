/*
** CSV reader for numeric tables: features f32 (N, F), integer labels i64 (N).
** Lines and columns in messages count from 1, as editors show them.
*/
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ext/kiln_ext.h"
#include "kiln_data.h"

#define WHO "kiln_csv_load"
#define MAX_COLS 1000000

typedef struct field {
  const char *s; /* not NUL-terminated */
  size_t n;
} field;

/* Splits one line (without its newline) into fields: trims spaces, strips one pair of
** quotes (inside which the delimiter is literal and "" is a quote). Returns the count,
** or -1 for an unterminated quote. Fields point into line. */
static int split(char *line, size_t len, char delim, field **fs, int *cap) {
  int n = 0;
  size_t i = 0;
  for (;;) {
    while (i < len && (line[i] == ' ' || line[i] == '\t') && line[i] != delim) i++;
    size_t start = i, end;
    if (i < len && line[i] == '"') {
      size_t w = ++i;
      start = w;
      for (;;) {
        if (i >= len) return -1;
        if (line[i] == '"') {
          if (i + 1 < len && line[i + 1] == '"') {
            line[w++] = '"';
            i += 2;
            continue;
          }
          i++;
          break;
        }
        line[w++] = line[i++];
      }
      end = w;
      while (i < len && line[i] != delim) i++; /* spaces after the quote */
    } else {
      while (i < len && line[i] != delim) i++;
      end = i;
      while (end > start && (line[end - 1] == ' ' || line[end - 1] == '\t')) end--;
    }
    if (n == *cap) {
      int nc = *cap ? *cap * 2 : 16;
      field *nf = realloc(*fs, sizeof(field) * (size_t)nc);
      if (!nf) return -2;
      *fs = nf;
      *cap = nc;
    }
    (*fs)[n].s = line + start;
    (*fs)[n].n = end - start;
    n++;
    if (n > MAX_COLS) return -2;
    if (i >= len) break;
    i++; /* the delimiter */
  }
  return n;
}

/* A whole field as a number. */
static int parse_num(const field *f, double *out) {
  char tmp[128];
  if (f->n == 0 || f->n >= sizeof tmp) return 0;
  memcpy(tmp, f->s, f->n);
  tmp[f->n] = 0;
  char *end;
  errno = 0;
  double v = strtod(tmp, &end);
  if (end != tmp + f->n) return 0;
  *out = v;
  return 1;
}

kiln_status kiln_csv_load(const char *path, const kiln_csv_opts *opts, kiln_tensor **features,
                          kiln_tensor **labels) {
  kiln_csv_opts o;
  if (opts) o = *opts;
  else memset(&o, 0, sizeof o);
  if (features) *features = NULL;
  if (labels) *labels = NULL;
  if (!path || !features || (!labels && !o.no_label))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, WHO ": NULL %s",
                          !path ? "path" : !features ? "features" : "labels");
  char delim = o.delimiter ? o.delimiter : ',';
  FILE *fp = kiln__fopen_regular(WHO, path); /* a FIFO is refused, not waited on */
  if (!fp) return kiln_last_error();
  char *text = NULL;
  size_t len = 0, cap = 0;
  for (;;) {
    if (len + 65536 + 1 > cap) {
      size_t nc = cap ? cap * 2 : 65536 * 2;
      char *nt = realloc(text, nc);
      if (!nt) {
        free(text);
        fclose(fp);
        return kiln_set_error(KILN_ERR_OOM, WHO ": %s: out of memory", path);
      }
      text = nt;
      cap = nc;
    }
    size_t k = fread(text + len, 1, 65536, fp);
    len += k;
    if (k < 65536) break;
  }
  int rerr = ferror(fp);
  fclose(fp);
  if (rerr) {
    free(text);
    return kiln_set_error(KILN_ERR_IO, WHO ": read error on %s", path);
  }
  text[len] = 0;

  kiln_status st = KILN_OK;
  field *fs = NULL;
  int fcap = 0, ncols = -1, label = -1;
  float *feat = NULL;
  int64_t *lab = NULL;
  size_t nrows = 0, rcap = 0;
  int seen_first = 0;
  size_t pos = 0;
  long line_no = 0;
  while (pos < len && st == KILN_OK) {
    size_t eol = pos;
    while (eol < len && text[eol] != '\n') eol++;
    size_t lend = eol;
    if (lend > pos && text[lend - 1] == '\r') lend--;
    char *line = text + pos;
    size_t ll = lend - pos;
    pos = eol + 1;
    line_no++;
    size_t b = 0;
    while (b < ll && (line[b] == ' ' || line[b] == '\t')) b++;
    if (b == ll) continue; /* blank line */
    int n = split(line, ll, delim, &fs, &fcap);
    if (n == -1) {
      st = kiln_set_error(KILN_ERR_FORMAT, WHO ": %s: line %ld: unterminated quote", path, line_no);
      break;
    }
    if (n < 0) {
      st = kiln_set_error(KILN_ERR_OOM, WHO ": %s: line %ld: out of memory or too many columns",
                          path, line_no);
      break;
    }
    if (!seen_first) {
      seen_first = 1;
      ncols = n;
      int is_header = o.header == KILN_CSV_HEADER_YES;
      if (o.header == KILN_CSV_HEADER_AUTO) {
        double v;
        for (int c = 0; c < n && !is_header; c++) is_header = !parse_num(&fs[c], &v);
      }
      if (!o.no_label) {
        if (o.label_name) {
          if (!is_header) {
            st = kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                                WHO ": %s: label column '%s' named but the file has no header",
                                path, o.label_name);
            break;
          }
          for (int c = 0; c < n && label < 0; c++)
            if (fs[c].n == strlen(o.label_name) && memcmp(fs[c].s, o.label_name, fs[c].n) == 0)
              label = c;
          if (label < 0) {
            st = kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                                WHO ": %s: no column named '%s' in the header (line %ld)", path,
                                o.label_name, line_no);
            break;
          }
        } else {
          label = o.label_col < 0 ? n + o.label_col : o.label_col;
          if (label < 0 || label >= n) {
            st = kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                                WHO ": %s: label column %d out of range for %d columns", path,
                                o.label_col, n);
            break;
          }
        }
      }
      if (is_header) continue;
    }
    if (n != ncols) {
      st = kiln_set_error(KILN_ERR_FORMAT, WHO ": %s: line %ld has %d fields, expected %d", path,
                          line_no, n, ncols);
      break;
    }
    int nf = ncols - (label >= 0);
    if (nrows == rcap) {
      size_t nc = rcap ? rcap * 2 : 1024;
      float *nfeat = realloc(feat, sizeof(float) * nc * (size_t)(nf ? nf : 1));
      if (nfeat) feat = nfeat;
      int64_t *nlab = realloc(lab, sizeof(int64_t) * nc);
      if (nlab) lab = nlab;
      if (!nfeat || !nlab) {
        st = kiln_set_error(KILN_ERR_OOM, WHO ": %s: out of memory at line %ld", path, line_no);
        break;
      }
      rcap = nc;
    }
    float *row = feat + nrows * (size_t)nf;
    int k = 0;
    for (int c = 0; c < ncols; c++) {
      double v;
      if (!parse_num(&fs[c], &v)) {
        st = kiln_set_error(KILN_ERR_FORMAT, WHO ": %s: line %ld, column %d: %s '%.*s'", path,
                            line_no, c + 1, fs[c].n ? "not a number:" : "empty field", (int)(fs[c].n > 40 ? 40 : fs[c].n),
                            fs[c].s);
        break;
      }
      if (c == label) {
        if (!(v == floor(v)) || fabs(v) > 9.0e18) {
          st = kiln_set_error(KILN_ERR_FORMAT,
                              WHO ": %s: line %ld, column %d: label %.*s is not an integer", path,
                              line_no, c + 1, (int)(fs[c].n > 40 ? 40 : fs[c].n), fs[c].s);
          break;
        }
        lab[nrows] = (int64_t)v;
      } else {
        row[k++] = (float)v;
      }
    }
    nrows++;
  }
  if (st == KILN_OK && nrows == 0)
    st = kiln_set_error(KILN_ERR_FORMAT, WHO ": %s: no data rows", path);
  kiln_tensor *tf = NULL, *tl = NULL;
  if (st == KILN_OK) {
    int nf = ncols - (label >= 0);
    tf = kiln_from_data(feat, 2, (const int64_t[]){(int64_t)nrows, nf}, KILN_F32, kiln_device_cpu());
    if (!tf) st = kiln_last_error();
    if (st == KILN_OK && label >= 0) {
      tl = kiln_from_data(lab, 1, (const int64_t[]){(int64_t)nrows}, KILN_I64, kiln_device_cpu());
      if (!tl) {
        st = kiln_last_error();
        kiln_tensor_free(kiln__own(tf));
        tf = NULL;
      }
    }
  }
  free(fs);
  free(feat);
  free(lab);
  free(text);
  if (st != KILN_OK) return st;
  *features = tf;
  if (labels) *labels = tl;
  return KILN_OK;
}
