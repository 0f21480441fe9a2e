/*
** Image transforms: a dataset wrapper that reads a sample from its base and passes one
** field, an image, through a list of transforms (kiln_data.h says which and how).
**
** The plan (each step's input and output shape and dtype) is worked out once in
** kiln_transform_dataset_new, so every mistake in the list is reported there, not from a
** worker thread in the middle of an epoch. Per sample, the image is widened to f32 in a
** scratch buffer and every step reads one buffer and writes the other; a u8 image that
** never met to_float is narrowed back at the end. For u8 pixels that is exact (crop, flip
** and pad move values; f32 holds every u8), so widening costs nothing in results.
**
** Randomness: step k of sample i in epoch e takes the Philox block for key (seed mixed
** with a constant, so a transform seed equal to the loader's shuffle seed does not reuse
** its stream), counter (e, i * 64 + k). Independent of threads and of read order.
*/
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "data_int.h"

#define WHO "kiln_transform_dataset_new"
#define MAX_TRANSFORMS 64

/* The epoch of the loader reading on this thread (set by loader.c around each build). */
static _Thread_local uint64_t cur_epoch;

uint64_t kiln__data_epoch_swap(uint64_t epoch) {
  uint64_t prev = cur_epoch;
  cur_epoch = epoch;
  return prev;
}

kiln_transform kiln_transform_to_float(void) {
  return (kiln_transform){.kind = KILN_TRANSFORM_TO_FLOAT};
}

kiln_transform kiln_transform_normalize(int n_channels, const float *mean, const float *std) {
  return (kiln_transform){.kind = KILN_TRANSFORM_NORMALIZE, .n_channels = n_channels,
                          .mean = mean, .std = std};
}

kiln_transform kiln_transform_pad(int64_t padding, kiln_pad_mode mode) {
  return (kiln_transform){.kind = KILN_TRANSFORM_PAD, .padding = padding, .pad_mode = mode};
}

kiln_transform kiln_transform_random_crop(int64_t height, int64_t width, int64_t padding,
                                          kiln_pad_mode mode) {
  return (kiln_transform){.kind = KILN_TRANSFORM_RANDOM_CROP, .height = height, .width = width,
                          .padding = padding, .pad_mode = mode};
}

kiln_transform kiln_transform_random_hflip(double p) {
  return (kiln_transform){.kind = KILN_TRANSFORM_RANDOM_HFLIP, .p = p};
}

kiln_transform kiln_transform_resize(int64_t height, int64_t width) {
  return (kiln_transform){.kind = KILN_TRANSFORM_RESIZE, .height = height, .width = width};
}

/* One step of the plan: the transform and the image it reads (C is the same throughout). */
typedef struct step {
  kiln_transform t;
  float *mean, *std; /* NORMALIZE: owned copies */
  int64_t h, w;      /* input height and width */
  int64_t oh, ow;    /* output */
} step;

typedef struct tds {
  kiln_dataset *base;
  int field;
  uint64_t key;
  int n;
  step *steps;
  int64_t c, h, w;        /* the base's image */
  kiln_dtype in_dt, out_dt;
  size_t in_bytes;        /* one base image */
  size_t max_px;          /* the largest image of the plan, in elements */
} tds;

static const char *kind_name(kiln_transform_kind k) {
  switch (k) {
  case KILN_TRANSFORM_TO_FLOAT: return "to_float";
  case KILN_TRANSFORM_NORMALIZE: return "normalize";
  case KILN_TRANSFORM_PAD: return "pad";
  case KILN_TRANSFORM_RANDOM_CROP: return "random_crop";
  case KILN_TRANSFORM_RANDOM_HFLIP: return "random_hflip";
  case KILN_TRANSFORM_RESIZE: return "resize";
  }
  return "unknown";
}

/* ------------------------------------------------------------------------------------ */
/* The steps. Images are (C, H, W) f32, C-order. */

/* Index of padded coordinate q (in [-pad, n + pad)) in an image of n pixels, or -1 for a
** zero. Reflect mirrors without repeating the edge (PyTorch's reflect): -1 -> 1, n -> n-2;
** the plan keeps pad < n, so one reflection suffices. */
static int64_t pad_src(int64_t q, int64_t n, kiln_pad_mode mode) {
  if (q >= 0 && q < n) return q;
  if (mode == KILN_PAD_CONSTANT) return -1;
  return q < 0 ? -q : 2 * (n - 1) - q;
}

/* out (C, oh, ow) := window at (top, left) of x (C, h, w) padded by pad on each side. */
static void crop_padded(const float *x, float *out, int64_t c, int64_t h, int64_t w, int64_t pad,
                        kiln_pad_mode mode, int64_t top, int64_t left, int64_t oh, int64_t ow) {
  for (int64_t ci = 0; ci < c; ci++) {
    const float *xc = x + ci * h * w;
    float *oc = out + ci * oh * ow;
    for (int64_t y = 0; y < oh; y++) {
      int64_t sy = pad_src(top + y - pad, h, mode);
      for (int64_t xx = 0; xx < ow; xx++) {
        int64_t sx = pad_src(left + xx - pad, w, mode);
        oc[y * ow + xx] = sy < 0 || sx < 0 ? 0.0f : xc[sy * w + sx];
      }
    }
  }
}

/* PyTorch's upsample_bilinear2d with align_corners=False, in f32 as PyTorch computes it
** for f32 input: source = max(scale * (dst + 0.5) - 0.5, 0), scale = in / out. */
static void resize_bilinear(const float *x, float *out, int64_t c, int64_t h, int64_t w, int64_t oh,
                            int64_t ow) {
  const float sh = (float)h / (float)oh, sw = (float)w / (float)ow;
  for (int64_t y = 0; y < oh; y++) {
    float fy = sh * ((float)y + 0.5f) - 0.5f;
    if (fy < 0) fy = 0;
    int64_t y0 = (int64_t)fy, y1 = y0 + (y0 < h - 1);
    float ly = fy - (float)y0, hy = 1.0f - ly;
    for (int64_t xx = 0; xx < ow; xx++) {
      float fx = sw * ((float)xx + 0.5f) - 0.5f;
      if (fx < 0) fx = 0;
      int64_t x0 = (int64_t)fx, x1 = x0 + (x0 < w - 1);
      float lx = fx - (float)x0, hx = 1.0f - lx;
      for (int64_t ci = 0; ci < c; ci++) {
        const float *xc = x + ci * h * w;
        out[ci * oh * ow + y * ow + xx] = hy * (hx * xc[y0 * w + x0] + lx * xc[y0 * w + x1]) +
                                          ly * (hx * xc[y1 * w + x0] + lx * xc[y1 * w + x1]);
      }
    }
  }
}

/* An integer in [0, n) from two 32-bit draws (bias below n / 2^64). */
static int64_t below(uint32_t a, uint32_t b, int64_t n) {
  return (int64_t)((((uint64_t)a << 32) | b) % (uint64_t)n);
}

/* Runs the plan on one image: in (C, h, w) f32 in buf[0]; returns the buffer holding the
** result. */
static float *run_plan(const tds *d, int64_t index, float *buf[2]) {
  const uint64_t epoch = cur_epoch;
  int cur = 0;
  const int64_t c = d->c;
  for (int k = 0; k < d->n; k++) {
    const step *s = &d->steps[k];
    float *x = buf[cur], *o = buf[cur ^ 1];
    const int64_t px = c * s->h * s->w;
    uint32_t r[4] = {0, 0, 0, 0};
    if (s->t.kind == KILN_TRANSFORM_RANDOM_CROP || s->t.kind == KILN_TRANSFORM_RANDOM_HFLIP)
      kiln_philox4x32(d->key, epoch, (uint64_t)index * MAX_TRANSFORMS + (uint64_t)k, r);
    switch (s->t.kind) {
    case KILN_TRANSFORM_TO_FLOAT:
      for (int64_t i = 0; i < px; i++) x[i] = x[i] / 255.0f;
      continue; /* in place */
    case KILN_TRANSFORM_NORMALIZE:
      for (int64_t ci = 0; ci < c; ci++) {
        float *xc = x + ci * s->h * s->w;
        for (int64_t i = 0; i < s->h * s->w; i++) xc[i] = (xc[i] - s->mean[ci]) / s->std[ci];
      }
      continue;
    case KILN_TRANSFORM_RANDOM_HFLIP:
      /* r[0] / 2^32 < p: p = 1 always flips, p = 0 never */
      if ((double)r[0] * 0x1p-32 < s->t.p)
        for (int64_t row = 0; row < c * s->h; row++) {
          float *xr = x + row * s->w;
          for (int64_t a = 0, b = s->w - 1; a < b; a++, b--) {
            float t = xr[a];
            xr[a] = xr[b];
            xr[b] = t;
          }
        }
      continue;
    case KILN_TRANSFORM_PAD:
      crop_padded(x, o, c, s->h, s->w, s->t.padding, s->t.pad_mode, 0, 0, s->oh, s->ow);
      break;
    case KILN_TRANSFORM_RANDOM_CROP: {
      /* torchvision: top uniform in [0, H + 2p - h], left in [0, W + 2p - w] */
      int64_t top = below(r[0], r[1], s->h + 2 * s->t.padding - s->oh + 1);
      int64_t left = below(r[2], r[3], s->w + 2 * s->t.padding - s->ow + 1);
      crop_padded(x, o, c, s->h, s->w, s->t.padding, s->t.pad_mode, top, left, s->oh, s->ow);
      break;
    }
    case KILN_TRANSFORM_RESIZE:
      resize_bilinear(x, o, c, s->h, s->w, s->oh, s->ow);
      break;
    }
    cur ^= 1;
  }
  return buf[cur];
}

/* ------------------------------------------------------------------------------------ */
/* The dataset. */

static int64_t tds_len(void *self) { return kiln_dataset_len(((tds *)self)->base); }

static kiln_status tds_get(void *self, int64_t index, void *const *bufs) {
  tds *d = self;
  const int nf = kiln_dataset_num_fields(d->base);
  /* one block: the base's image, then two f32 work images */
  size_t in_al = (d->in_bytes + 63) / 64 * 64;
  char *mem = malloc(in_al + 2 * d->max_px * sizeof(float) + 1);
  if (!mem) return kiln_set_error(KILN_ERR_OOM, "kiln_transform_dataset: out of memory");
  void *base_bufs[KILN__MAX_FIELDS];
  for (int f = 0; f < nf; f++) base_bufs[f] = f == d->field ? (void *)mem : bufs[f];
  kiln_status st = kiln_dataset_read(d->base, index, base_bufs);
  if (st != KILN_OK) {
    free(mem);
    return st;
  }
  float *work[2] = {(float *)(mem + in_al), (float *)(mem + in_al) + d->max_px};
  const size_t n_in = (size_t)(d->c * d->h * d->w);
  if (d->in_dt == KILN_U8) {
    const uint8_t *s = (const uint8_t *)mem;
    for (size_t i = 0; i < n_in; i++) work[0][i] = (float)s[i];
  } else {
    memcpy(work[0], mem, n_in * sizeof(float));
  }
  const float *res = run_plan(d, index, work);
  const step *last = d->n ? &d->steps[d->n - 1] : NULL;
  const size_t n_out = last ? (size_t)(d->c * last->oh * last->ow) : n_in;
  if (d->out_dt == KILN_U8) {
    uint8_t *o = bufs[d->field];
    for (size_t i = 0; i < n_out; i++) {
      float v = nearbyintf(res[i]);
      o[i] = (uint8_t)(v < 0 ? 0 : v > 255 ? 255 : v);
    }
  } else {
    memcpy(bufs[d->field], res, n_out * sizeof(float));
  }
  free(mem);
  return KILN_OK;
}

static void tds_destroy(void *self) {
  tds *d = self;
  if (!d) return;
  for (int k = 0; d->steps && k < d->n; k++) {
    free(d->steps[k].mean);
    free(d->steps[k].std);
  }
  free(d->steps);
  free(d);
}

/* Checks step k and works out its output (s->h, s->w set to its input). */
static kiln_status plan_step(step *s, int k, int64_t c, kiln_dtype *dt) {
  const kiln_transform *t = &s->t;
  const char *name = kind_name(t->kind);
  s->oh = s->h;
  s->ow = s->w;
  switch (t->kind) {
  case KILN_TRANSFORM_TO_FLOAT:
    if (*dt != KILN_U8)
      return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                            WHO ": transform %d (to_float) needs a uint8 image, it gets %s", k,
                            kiln_dtype_name(*dt));
    *dt = KILN_F32;
    return KILN_OK;
  case KILN_TRANSFORM_NORMALIZE:
    if (*dt != KILN_F32)
      return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                            WHO ": transform %d (normalize) needs a float32 image, it gets %s (put "
                            "to_float before it)",
                            k, kiln_dtype_name(*dt));
    if (!t->mean || !t->std)
      return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, WHO ": transform %d (normalize): NULL %s", k,
                            t->mean ? "std" : "mean");
    if (t->n_channels != c)
      return kiln_set_error(KILN_ERR_SHAPE,
                            WHO ": transform %d (normalize) has %d mean/std values for an image of "
                            "%lld channels",
                            k, t->n_channels, (long long)c);
    for (int i = 0; i < t->n_channels; i++)
      if (!(t->std[i] != 0.0f) || !isfinite(t->std[i]) || !isfinite(t->mean[i]))
        return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                              WHO ": transform %d (normalize): channel %d has mean %g, std %g; "
                              "std must be finite and not 0",
                              k, i, (double)t->mean[i], (double)t->std[i]);
    s->mean = malloc(sizeof(float) * (size_t)c);
    s->std = malloc(sizeof(float) * (size_t)c);
    if (!s->mean || !s->std) return kiln_set_error(KILN_ERR_OOM, WHO ": out of memory");
    memcpy(s->mean, t->mean, sizeof(float) * (size_t)c);
    memcpy(s->std, t->std, sizeof(float) * (size_t)c);
    return KILN_OK;
  case KILN_TRANSFORM_RANDOM_HFLIP:
    if (!(t->p >= 0.0 && t->p <= 1.0))
      return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                            WHO ": transform %d (random_hflip): p %g is not in [0, 1]", k, t->p);
    return KILN_OK;
  case KILN_TRANSFORM_PAD:
  case KILN_TRANSFORM_RANDOM_CROP: {
    const int64_t p = t->padding;
    if (p < 0 || p > (INT64_C(1) << 30))
      return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, WHO ": transform %d (%s): padding %lld",
                            k, name, (long long)p);
    if (t->pad_mode != KILN_PAD_CONSTANT && t->pad_mode != KILN_PAD_REFLECT)
      return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, WHO ": transform %d (%s): unknown pad mode %d",
                            k, name, (int)t->pad_mode);
    if (t->pad_mode == KILN_PAD_REFLECT && p > 0 && (p >= s->h || p >= s->w))
      return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                            WHO ": transform %d (%s): reflect padding %lld needs an image larger "
                            "than it, the image is %lldx%lld",
                            k, name, (long long)p, (long long)s->h, (long long)s->w);
    if (t->kind == KILN_TRANSFORM_PAD) {
      s->oh = s->h + 2 * p;
      s->ow = s->w + 2 * p;
      return KILN_OK;
    }
    if (t->height < 1 || t->width < 1)
      return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                            WHO ": transform %d (random_crop): size %lldx%lld must be at least 1x1",
                            k, (long long)t->height, (long long)t->width);
    if (t->height > s->h + 2 * p || t->width > s->w + 2 * p)
      return kiln_set_error(KILN_ERR_SHAPE,
                            WHO ": transform %d (random_crop): crop %lldx%lld is larger than the "
                            "padded image %lldx%lld (%lldx%lld with padding %lld)",
                            k, (long long)t->height, (long long)t->width, (long long)(s->h + 2 * p),
                            (long long)(s->w + 2 * p), (long long)s->h, (long long)s->w,
                            (long long)p);
    s->oh = t->height;
    s->ow = t->width;
    return KILN_OK;
  }
  case KILN_TRANSFORM_RESIZE:
    if (t->height < 1 || t->width < 1 || t->height > (INT64_C(1) << 20) ||
        t->width > (INT64_C(1) << 20))
      return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                            WHO ": transform %d (resize): size %lldx%lld must be in [1, 2^20]", k,
                            (long long)t->height, (long long)t->width);
    s->oh = t->height;
    s->ow = t->width;
    return KILN_OK;
  }
  return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, WHO ": transform %d has unknown kind %d", k,
                        (int)t->kind);
}

kiln_dataset *kiln_transform_dataset_new(kiln_dataset *base, int field, int n,
                                         const kiln_transform *transforms, uint64_t seed) {
  if (!base || (n > 0 && !transforms) || n < 0 || n > MAX_TRANSFORMS) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, WHO ": need a base dataset and 0..%d transforms (%s, n %d)",
                   MAX_TRANSFORMS, base ? "transforms NULL" : "base NULL", n);
    return NULL;
  }
  const int nf = kiln_dataset_num_fields(base);
  if (field < 0 || field >= nf) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, WHO ": field %d out of range (the base has %d)", field, nf);
    return NULL;
  }
  int64_t len = kiln_dataset_len(base);
  if (len <= 0) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, WHO ": the base dataset is empty (length %lld)",
                   (long long)len);
    return NULL;
  }
  const kiln_field_spec *in = kiln_dataset_field(base, field);
  if (in->ndim != 2 && in->ndim != 3) {
    kiln_set_error(KILN_ERR_SHAPE, WHO ": field %d must be an image (H, W) or (C, H, W), it has %d dims",
                   field, in->ndim);
    return NULL;
  }
  if (in->dtype != KILN_U8 && in->dtype != KILN_F32) {
    kiln_set_error(KILN_ERR_DTYPE, WHO ": field %d is %s; images are uint8 or float32", field,
                   kiln_dtype_name(in->dtype));
    return NULL;
  }
  const int64_t c = in->ndim == 3 ? in->shape[0] : 1;
  const int64_t h = in->shape[in->ndim - 2], w = in->shape[in->ndim - 1];
  if (c < 1 || h < 1 || w < 1) {
    kiln_set_error(KILN_ERR_SHAPE, WHO ": field %d is an empty image (%lld, %lld, %lld)", field,
                   (long long)c, (long long)h, (long long)w);
    return NULL;
  }
  tds *d = calloc(1, sizeof *d);
  if (!d || (n && !(d->steps = calloc((size_t)n, sizeof *d->steps)))) {
    free(d);
    kiln_set_error(KILN_ERR_OOM, WHO ": out of memory");
    return NULL;
  }
  d->base = base;
  d->field = field;
  d->n = n;
  /* a fixed odd constant (the golden ratio's) keeps the key apart from a shuffle seeded alike */
  d->key = seed ^ UINT64_C(0x9E3779B97F4A7C15);
  d->c = c;
  d->h = h;
  d->w = w;
  d->in_dt = in->dtype;
  d->in_bytes = kiln__field_bytes(in);
  kiln_dtype dt = in->dtype;
  int64_t ch = h, cw = w;
  size_t max_px = (size_t)(c * h * w);
  for (int k = 0; k < n; k++) {
    step *s = &d->steps[k];
    s->t = transforms[k];
    s->h = ch;
    s->w = cw;
    if (plan_step(s, k, c, &dt) != KILN_OK) {
      tds_destroy(d);
      return NULL;
    }
    ch = s->oh;
    cw = s->ow;
    if ((double)c * (double)ch * (double)cw > (double)(INT64_C(1) << 34)) {
      kiln_set_error(KILN_ERR_SHAPE, WHO ": transform %d makes a %lldx%lldx%lld image, too large",
                     k, (long long)c, (long long)ch, (long long)cw);
      tds_destroy(d);
      return NULL;
    }
    if ((size_t)(c * ch * cw) > max_px) max_px = (size_t)(c * ch * cw);
  }
  d->out_dt = dt;
  d->max_px = max_px;
  kiln_field_spec spec[KILN__MAX_FIELDS];
  for (int f = 0; f < nf; f++) spec[f] = *kiln_dataset_field(base, f);
  kiln_field_spec *o = &spec[field];
  memset(o->shape, 0, sizeof o->shape);
  o->dtype = dt;
  o->ndim = 3;
  o->shape[0] = c;
  o->shape[1] = ch;
  o->shape[2] = cw;
  const kiln_dataset_vtable vt = {tds_len, tds_get, tds_destroy};
  kiln_dataset *ds = kiln_dataset_new(&vt, d, nf, spec);
  if (!ds) tds_destroy(d);
  return ds;
}
