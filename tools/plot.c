/*
** kiln plot LOGDIR [--out FILE.png|FILE.svg] [--smooth X]: the scalar curves of the
** TensorBoard event files in LOGDIR (and in its subdirectories, one run each) drawn with
** cairo, for people without TensorBoard. One panel per tag (a grid), step on the x axis,
** one line per run with a legend; PNG or SVG by the file's extension. Built only when
** cairo was found (KILN_HAVE_CAIRO); otherwise the command says how to get it.
*/
#define _POSIX_C_SOURCE 200809L
#include <kiln.h>
#include <kiln_io.h>

#include <dirent.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli.h"

#if defined(KILN_HAVE_CAIRO) && KILN_HAVE_CAIRO
#include <cairo-svg.h>
#include <cairo.h>

#define MAX_SERIES 64
#define MAX_RUNS 16

typedef struct series {
  char tag[128];
  int run;
  double *x, *y;
  int n, cap;
} series;

typedef struct plot_data {
  series s[MAX_SERIES];
  int n;
  char runs[MAX_RUNS][128];
  int n_runs, cur_run;
  char tags[MAX_SERIES][128];
  int n_tags;
  int64_t dropped;
} plot_data;

static bool on_scalar(const kiln_scalar_event *e, void *ctx) {
  plot_data *d = ctx;
  series *s = NULL;
  for (int i = 0; i < d->n && !s; i++)
    if (d->s[i].run == d->cur_run && !strcmp(d->s[i].tag, e->tag)) s = &d->s[i];
  if (!s) {
    if (d->n == MAX_SERIES) {
      d->dropped++;
      return true;
    }
    s = &d->s[d->n++];
    snprintf(s->tag, sizeof s->tag, "%s", e->tag);
    s->run = d->cur_run;
    int t = 0;
    while (t < d->n_tags && strcmp(d->tags[t], e->tag)) t++;
    if (t == d->n_tags && d->n_tags < MAX_SERIES) snprintf(d->tags[d->n_tags++], 128, "%s", e->tag);
  }
  if (s->n == s->cap) {
    int nc = s->cap ? 2 * s->cap : 256;
    double *nx = realloc(s->x, (size_t)nc * sizeof *nx);
    if (!nx) return false;
    s->x = nx;
    double *ny = realloc(s->y, (size_t)nc * sizeof *ny);
    if (!ny) return false;
    s->y = ny;
    s->cap = nc;
  }
  s->x[s->n] = (double)e->step;
  s->y[s->n] = e->value;
  s->n++;
  return true;
}

/* Reads the event files directly in dir as run `run`; returns how many it read. */
static int read_dir(plot_data *d, const char *dir, const char *run) {
  DIR *dp = opendir(dir);
  if (!dp) return 0;
  int files = 0;
  struct dirent *de;
  while ((de = readdir(dp)) != NULL) {
    if (!strstr(de->d_name, "tfevents")) continue;
    if (files == 0) {
      if (d->n_runs == MAX_RUNS) break;
      snprintf(d->runs[d->n_runs], 128, "%s", run);
      d->cur_run = d->n_runs++;
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
    if (kiln_summary_read(path, on_scalar, d) != KILN_OK)
      fprintf(stderr, "kiln plot: warning: %s (the events before it are drawn)\n", kiln_last_error_message());
    files++;
  }
  closedir(dp);
  return files;
}

/* "Nice" tick step for a span: 1, 2 or 5 times a power of ten, about 5 ticks. */
static double nice_step(double span) {
  if (!(span > 0)) return 1;
  double raw = span / 5, p = pow(10, floor(log10(raw))), m = raw / p;
  return (m < 1.5 ? 1 : m < 3.5 ? 2 : m < 7.5 ? 5 : 10) * p;
}

static void fmt_num(char *buf, size_t n, double v, double step) {
  if (v == 0) snprintf(buf, n, "0");
  else if (fabs(v) >= 1e5 || fabs(v) < 1e-3) snprintf(buf, n, "%.2g", v);
  else if (step >= 1) snprintf(buf, n, "%.0f", v);
  else snprintf(buf, n, "%.*f", (int)ceil(-log10(step)), v);
}

static const double palette[][3] = {{0.12, 0.47, 0.71}, {1.00, 0.50, 0.05}, {0.17, 0.63, 0.17}, {0.84, 0.15, 0.16},
                                    {0.58, 0.40, 0.74}, {0.55, 0.34, 0.29}, {0.89, 0.47, 0.76}, {0.50, 0.50, 0.50}};

static void draw_panel(cairo_t *cr, const plot_data *d, const char *tag, double px, double py, double pw, double ph,
                       double smooth) {
  /* frame of the plot area inside the panel */
  double l = px + 62, r = px + pw - 14, t = py + 30, b = py + ph - 42;
  double x0 = INFINITY, x1 = -INFINITY, y0 = INFINITY, y1 = -INFINITY;
  for (int i = 0; i < d->n; i++) {
    if (strcmp(d->s[i].tag, tag)) continue;
    for (int k = 0; k < d->s[i].n; k++) {
      if (!isfinite(d->s[i].y[k])) continue;
      x0 = fmin(x0, d->s[i].x[k]), x1 = fmax(x1, d->s[i].x[k]);
      y0 = fmin(y0, d->s[i].y[k]), y1 = fmax(y1, d->s[i].y[k]);
    }
  }
  if (!(x1 >= x0)) x0 = 0, x1 = 1;
  if (!(y1 >= y0)) y0 = 0, y1 = 1;
  if (x1 == x0) x1 = x0 + 1;
  if (y1 == y0) y0 -= fabs(y0) * 0.1 + 0.5, y1 += fabs(y1) * 0.1 + 0.5;
  double ypad = (y1 - y0) * 0.05;
  y0 -= ypad, y1 += ypad;
  /* title */
  cairo_set_source_rgb(cr, 0, 0, 0);
  cairo_select_font_face(cr, "sans-serif", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_BOLD);
  cairo_set_font_size(cr, 14);
  cairo_move_to(cr, l, py + 20);
  cairo_show_text(cr, tag);
  cairo_select_font_face(cr, "sans-serif", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_NORMAL);
  cairo_set_font_size(cr, 11);
  /* grid and ticks */
  cairo_set_line_width(cr, 1);
  double xs = nice_step(x1 - x0), ys = nice_step(y1 - y0);
  char lab[32];
  cairo_text_extents_t te;
  for (double v = ceil(y0 / ys) * ys; v <= y1 + 1e-9 * ys; v += ys) {
    double yy = b - (v - y0) / (y1 - y0) * (b - t);
    cairo_set_source_rgb(cr, 0.88, 0.88, 0.88);
    cairo_move_to(cr, l, yy), cairo_line_to(cr, r, yy), cairo_stroke(cr);
    cairo_set_source_rgb(cr, 0.2, 0.2, 0.2);
    fmt_num(lab, sizeof lab, fabs(v) < ys * 1e-6 ? 0 : v, ys);
    cairo_text_extents(cr, lab, &te);
    cairo_move_to(cr, l - 6 - te.width, yy + te.height / 2), cairo_show_text(cr, lab);
  }
  for (double v = ceil(x0 / xs) * xs; v <= x1 + 1e-9 * xs; v += xs) {
    double xx = l + (v - x0) / (x1 - x0) * (r - l);
    cairo_set_source_rgb(cr, 0.88, 0.88, 0.88);
    cairo_move_to(cr, xx, t), cairo_line_to(cr, xx, b), cairo_stroke(cr);
    cairo_set_source_rgb(cr, 0.2, 0.2, 0.2);
    fmt_num(lab, sizeof lab, v, xs);
    cairo_text_extents(cr, lab, &te);
    cairo_move_to(cr, xx - te.width / 2, b + 16), cairo_show_text(cr, lab);
  }
  cairo_text_extents(cr, "step", &te);
  cairo_move_to(cr, (l + r) / 2 - te.width / 2, b + 32), cairo_show_text(cr, "step");
  cairo_set_source_rgb(cr, 0.3, 0.3, 0.3);
  cairo_rectangle(cr, l, t, r - l, b - t), cairo_stroke(cr);
  /* the curves (exponential moving average when --smooth, as TensorBoard's slider) */
  cairo_save(cr);
  cairo_rectangle(cr, l, t, r - l, b - t);
  cairo_clip(cr);
  cairo_set_line_width(cr, 1.8);
  for (int i = 0; i < d->n; i++) {
    const series *s = &d->s[i];
    if (strcmp(s->tag, tag)) continue;
    const double *c = palette[s->run % 8];
    cairo_set_source_rgb(cr, c[0], c[1], c[2]);
    double ema = NAN;
    bool pen = false;
    for (int k = 0; k < s->n; k++) {
      if (!isfinite(s->y[k])) {
        pen = false;
        continue;
      }
      ema = isnan(ema) ? s->y[k] : smooth * ema + (1 - smooth) * s->y[k];
      double xx = l + (s->x[k] - x0) / (x1 - x0) * (r - l), yy = b - (ema - y0) / (y1 - y0) * (b - t);
      if (pen) cairo_line_to(cr, xx, yy);
      else cairo_move_to(cr, xx, yy);
      pen = true;
      if (s->n == 1) cairo_arc(cr, xx, yy, 2.5, 0, 6.283185307179586);
    }
    cairo_stroke(cr);
  }
  cairo_restore(cr);
}

static int plot(const char *logdir, const char *out, double smooth) {
  struct stat sb;
  if (stat(logdir, &sb) != 0 || !S_ISDIR(sb.st_mode)) {
    fprintf(stderr, "kiln plot: '%s' is not a directory\n", logdir);
    return 1;
  }
  const char *ext = strrchr(out, '.');
  bool svg = ext && !strcmp(ext, ".svg");
  if (!ext || (!svg && strcmp(ext, ".png") != 0)) {
    fprintf(stderr, "kiln plot: --out '%s': give a .png or .svg file\n", out);
    return 2;
  }
  plot_data *d = calloc(1, sizeof *d);
  if (!d) return 1;
  const char *base = strrchr(logdir, '/');
  read_dir(d, logdir, base && base[1] ? base + 1 : logdir);
  DIR *dp = opendir(logdir);
  struct dirent *de;
  while (dp && (de = readdir(dp)) != NULL) {
    if (de->d_name[0] == '.') continue;
    char sub[4096];
    snprintf(sub, sizeof sub, "%s/%s", logdir, de->d_name);
    if (stat(sub, &sb) == 0 && S_ISDIR(sb.st_mode)) read_dir(d, sub, de->d_name);
  }
  if (dp) closedir(dp);
  int rc = 0;
  if (d->n_tags == 0) {
    fprintf(stderr, "kiln plot: no scalars in event files (events.out.tfevents.*) under '%s'\n", logdir);
    rc = 1;
    goto done;
  }
  int cols = d->n_tags < 3 ? d->n_tags : 3, rows = (d->n_tags + cols - 1) / cols;
  double pw = 420, ph = 280, legend = 26;
  double W = cols * pw, H = rows * ph + legend;
  cairo_surface_t *surf = svg ? cairo_svg_surface_create(out, W, H)
                              : cairo_image_surface_create(CAIRO_FORMAT_RGB24, (int)W, (int)H);
  if (cairo_surface_status(surf) != CAIRO_STATUS_SUCCESS) {
    fprintf(stderr, "kiln plot: cannot write '%s': %s\n", out, cairo_status_to_string(cairo_surface_status(surf)));
    cairo_surface_destroy(surf);
    rc = 1;
    goto done;
  }
  cairo_t *cr = cairo_create(surf);
  cairo_set_source_rgb(cr, 1, 1, 1);
  cairo_paint(cr);
  for (int i = 0; i < d->n_tags; i++)
    draw_panel(cr, d, d->tags[i], (i % cols) * pw, (i / cols) * ph, pw, ph, smooth);
  /* legend: one swatch per run */
  cairo_select_font_face(cr, "sans-serif", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_NORMAL);
  cairo_set_font_size(cr, 12);
  double lx = 62;
  for (int r = 0; r < d->n_runs; r++) {
    const double *c = palette[r % 8];
    cairo_set_source_rgb(cr, c[0], c[1], c[2]);
    cairo_rectangle(cr, lx, rows * ph + 8, 18, 10), cairo_fill(cr);
    cairo_set_source_rgb(cr, 0, 0, 0);
    cairo_move_to(cr, lx + 24, rows * ph + 18);
    cairo_show_text(cr, d->runs[r]);
    cairo_text_extents_t te;
    cairo_text_extents(cr, d->runs[r], &te);
    lx += 24 + te.x_advance + 24;
  }
  cairo_destroy(cr);
  cairo_status_t cs = CAIRO_STATUS_SUCCESS;
  if (svg) {
    cairo_surface_finish(surf);
    cs = cairo_surface_status(surf);
  } else {
    cs = cairo_surface_write_to_png(surf, out);
  }
  cairo_surface_destroy(surf);
  if (cs != CAIRO_STATUS_SUCCESS) {
    fprintf(stderr, "kiln plot: cannot write '%s': %s\n", out, cairo_status_to_string(cs));
    rc = 1;
  } else {
    printf("kiln plot: %d curve(s) of %d tag(s) from %d run(s) -> %s\n", d->n, d->n_tags, d->n_runs, out);
  }
done:
  for (int i = 0; i < d->n; i++) free(d->s[i].x), free(d->s[i].y);
  free(d);
  return rc;
}
#endif

int cli_plot(int argc, char **argv) {
  const char *logdir = NULL, *out = "curves.png";
  double smooth = 0;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--out") && i + 1 < argc) {
      out = argv[++i];
    } else if (!strcmp(argv[i], "--smooth") && i + 1 < argc) {
      char *end;
      smooth = strtod(argv[++i], &end);
      if (*end || !(smooth >= 0 && smooth < 1)) {
        fprintf(stderr, "kiln plot: --smooth '%s': give a number in [0, 1)\n", argv[i]);
        return 2;
      }
    } else if (argv[i][0] == '-' || logdir) {
      fprintf(stderr, "usage: kiln plot LOGDIR [--out FILE.png|FILE.svg] [--smooth X]\n");
      return 2;
    } else {
      logdir = argv[i];
    }
  }
  if (!logdir) {
    fprintf(stderr, "usage: kiln plot LOGDIR [--out FILE.png|FILE.svg] [--smooth X]\n");
    return 2;
  }
#if defined(KILN_HAVE_CAIRO) && KILN_HAVE_CAIRO
  return plot(logdir, out, smooth);
#else
  (void)smooth;
  fprintf(stderr, "kiln plot: this kiln was built without cairo (install libcairo2-dev and rebuild), or open "
                  "'%s' with tensorboard --logdir\n", logdir);
  return 1;
#endif
}
