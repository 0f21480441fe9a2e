/*
** Image transforms (kiln_transform_dataset_new): exact values of each transform on small
** images (to_float, normalize, pad constant/reflect, random crop, flip, bilinear resize
** against PyTorch's known values and an f64 reference); the output field's spec and the
** other fields passing through; the same batches for 1 and 4 workers, new crops each
** epoch, the same images for the same seed and other ones for another seed; a read
** outside a loader is epoch 0; bad lists fail at construction with clear errors.
*/
#include <kiln.h>
#include <kiln_data.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

/* A tensor dataset of n images (shape of one image: ndim dims) from data, with labels
** 0..n-1. The dataset holds its own references. */
static kiln_dataset *image_ds(const void *data, kiln_dtype dt, int64_t n, int ndim,
                              const int64_t *shape) {
  int64_t s[4] = {n};
  memcpy(s + 1, shape, sizeof(int64_t) * (size_t)ndim);
  kiln_scope_begin();
  kiln_tensor *x = kiln_from_data(data, ndim + 1, s, dt, kiln_device_cpu());
  int64_t *lab = malloc(sizeof(int64_t) * (size_t)(n ? n : 1));
  for (int64_t i = 0; i < n; i++) lab[i] = i;
  kiln_tensor *y = kiln_from_data(lab, 1, (int64_t[]){n}, KILN_I64, kiln_device_cpu());
  free(lab);
  kiln_dataset *ds = x && y ? kiln_tensor_dataset_new(2, (kiln_tensor *[]){x, y}) : NULL;
  kiln_scope_end();
  return ds;
}

/* Sample i's image field as f32 values in out (n of them); checks the label passed. */
static int read_image(kiln_dataset *ds, int64_t i, float *out, int64_t n) {
  const kiln_field_spec *s = kiln_dataset_field(ds, 0);
  size_t bytes = kiln_dtype_size(s->dtype);
  for (int d = 0; d < s->ndim; d++) bytes *= (size_t)s->shape[d];
  void *buf = malloc(bytes);
  int64_t label = -1;
  kiln_status st = kiln_dataset_read(ds, i, (void *[]){buf, &label});
  CHECK(st == KILN_OK);
  CHECK(label == i);
  if (st == KILN_OK)
    for (int64_t k = 0; k < n; k++)
      out[k] = s->dtype == KILN_U8 ? (float)((uint8_t *)buf)[k] : ((float *)buf)[k];
  free(buf);
  return st == KILN_OK;
}

static int same(const float *a, const float *b, int64_t n, double tol) {
  for (int64_t i = 0; i < n; i++)
    if (!(fabs((double)a[i] - (double)b[i]) <= tol)) {
      fprintf(stderr, "  element %lld: %.9g vs %.9g\n", (long long)i, (double)a[i], (double)b[i]);
      return 0;
    }
  return 1;
}

static void test_to_float_and_normalize(void) {
  /* one sample, (2, 1, 3) u8 */
  const uint8_t px[6] = {0, 51, 255, 10, 100, 200};
  kiln_dataset *base = image_ds(px, KILN_U8, 1, 3, (int64_t[]){2, 1, 3});
  CHECK(base != NULL);
  kiln_transform t[2] = {kiln_transform_to_float(),
                         kiln_transform_normalize(2, (const float[]){0.5f, 0.25f},
                                                  (const float[]){0.5f, 2.0f})};
  kiln_dataset *a = kiln_transform_dataset_new(base, 0, 1, t, 1);
  kiln_dataset *b = kiln_transform_dataset_new(base, 0, 2, t, 1);
  CHECK(a && b);
  if (!a || !b) return;
  const kiln_field_spec *s = kiln_dataset_field(b, 0);
  CHECK(s->dtype == KILN_F32 && s->ndim == 3 && s->shape[0] == 2 && s->shape[1] == 1 &&
        s->shape[2] == 3);
  CHECK(kiln_dataset_field(b, 1)->dtype == KILN_I64); /* the label passes through */
  CHECK(kiln_dataset_len(b) == 1);
  float got[6], want[6];
  for (int i = 0; i < 6; i++) want[i] = (float)px[i] / 255.0f;
  read_image(a, 0, got, 6);
  CHECK(same(got, want, 6, 0));
  for (int i = 0; i < 6; i++) want[i] = (want[i] - (i < 3 ? 0.5f : 0.25f)) / (i < 3 ? 0.5f : 2.0f);
  read_image(b, 0, got, 6);
  CHECK(same(got, want, 6, 0));
  CHECK(got[0] == -1.0f && got[2] == 1.0f); /* 0 and 255 map to -1 and 1 */
  kiln_dataset_free(a);
  kiln_dataset_free(b);
  kiln_dataset_free(base);
}

static void test_pad(void) {
  /* (2, 3) u8, read as one channel; stays u8 */
  const uint8_t px[6] = {1, 2, 3, 4, 5, 6};
  kiln_dataset *base = image_ds(px, KILN_U8, 1, 2, (int64_t[]){2, 3});
  kiln_transform tc = kiln_transform_pad(1, KILN_PAD_CONSTANT);
  kiln_transform tr = kiln_transform_pad(1, KILN_PAD_REFLECT);
  kiln_dataset *c = kiln_transform_dataset_new(base, 0, 1, &tc, 0);
  kiln_dataset *r = kiln_transform_dataset_new(base, 0, 1, &tr, 0);
  CHECK(c && r);
  if (!c || !r) return;
  const kiln_field_spec *s = kiln_dataset_field(c, 0);
  CHECK(s->dtype == KILN_U8 && s->ndim == 3 && s->shape[0] == 1 && s->shape[1] == 4 &&
        s->shape[2] == 5);
  const float wc[20] = {0, 0, 0, 0, 0, /**/ 0, 1, 2, 3, 0, /**/ 0, 4, 5, 6, 0, /**/ 0, 0, 0, 0, 0};
  /* PyTorch's reflect: F.pad(x, (1, 1, 1, 1), mode='reflect') */
  const float wr[20] = {5, 4, 5, 6, 5, /**/ 2, 1, 2, 3, 2, /**/ 5, 4, 5, 6, 5, /**/ 2, 1, 2, 3, 2};
  float got[20];
  read_image(c, 0, got, 20);
  CHECK(same(got, wc, 20, 0));
  read_image(r, 0, got, 20);
  CHECK(same(got, wr, 20, 0));
  kiln_dataset_free(c);
  kiln_dataset_free(r);
  kiln_dataset_free(base);
}

/* The padded image P of x (h, w) as f64, for the crop reference. */
static double padded(const float *x, int64_t h, int64_t w, int64_t p, int reflect, int64_t y,
                     int64_t xx) {
  y -= p;
  xx -= p;
  if (reflect) {
    if (y < 0) y = -y;
    if (y >= h) y = 2 * (h - 1) - y;
    if (xx < 0) xx = -xx;
    if (xx >= w) xx = 2 * (w - 1) - xx;
  } else if (y < 0 || y >= h || xx < 0 || xx >= w) {
    return 0.0;
  }
  return x[y * w + xx];
}

static void test_random_crop(void) {
  /* 64 samples of (1, 5, 6) f32 with distinct values, so a window is identified by its
  ** corner; crop 4x4 with padding 2 (constant and reflect) */
  enum { N = 64, H = 5, W = 6 };
  float *px = malloc(sizeof(float) * N * H * W);
  for (int i = 0; i < N * H * W; i++) px[i] = (float)(i + 1);
  kiln_dataset *base = image_ds(px, KILN_F32, N, 3, (int64_t[]){1, H, W});
  for (int reflect = 0; reflect < 2; reflect++) {
    kiln_transform t = kiln_transform_random_crop(4, 4, 2, reflect ? KILN_PAD_REFLECT : KILN_PAD_CONSTANT);
    kiln_dataset *ds = kiln_transform_dataset_new(base, 0, 1, &t, 7);
    CHECK(ds != NULL);
    if (!ds) continue;
    const kiln_field_spec *s = kiln_dataset_field(ds, 0);
    CHECK(s->shape[0] == 1 && s->shape[1] == 4 && s->shape[2] == 4 && s->dtype == KILN_F32);
    int seen[(H + 4 - 4 + 1) * (W + 4 - 4 + 1)] = {0};
    for (int64_t i = 0; i < N; i++) {
      float got[16];
      read_image(ds, i, got, 16);
      /* exactly one corner (top, left) of the padded image gives this window */
      int found = -1, matches = 0;
      for (int top = 0; top <= H; top++)
        for (int left = 0; left <= W + 4 - 4; left++) {
          int ok = 1;
          for (int y = 0; y < 4 && ok; y++)
            for (int x = 0; x < 4 && ok; x++)
              ok = got[y * 4 + x] == (float)padded(px + i * H * W, H, W, 2, reflect, top + y, left + x);
          if (ok) {
            found = top * (W + 1) + left;
            matches++;
          }
        }
      CHECK(matches >= 1);
      if (found >= 0) seen[found]++;
    }
    /* 64 draws over 42 corners: a uniform draw hits well over a third of them (a constant
    ** corner, or a draw ignoring the sample index, would hit one) */
    int distinct = 0;
    for (int k = 0; k < (int)(sizeof seen / sizeof seen[0]); k++) distinct += seen[k] > 0;
    CHECK(distinct >= 20);
    kiln_dataset_free(ds);
  }
  /* a crop the size of the padded image has one place: reflect pad 2 of a 3x3, crop 7x7 */
  const float sq[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  kiln_dataset *b3 = image_ds(sq, KILN_F32, 1, 2, (int64_t[]){3, 3});
  kiln_transform t7 = kiln_transform_random_crop(7, 7, 2, KILN_PAD_REFLECT);
  kiln_dataset *d7 = kiln_transform_dataset_new(b3, 0, 1, &t7, 3);
  CHECK(d7 != NULL);
  if (d7) {
    float got[49];
    const float want[49] = {9, 8, 7, 8, 9, 8, 7, /**/ 6, 5, 4, 5, 6, 5, 4, /**/ 3, 2, 1, 2, 3, 2, 1,
                            /**/ 6, 5, 4, 5, 6, 5, 4, /**/ 9, 8, 7, 8, 9, 8, 7,
                            /**/ 6, 5, 4, 5, 6, 5, 4, /**/ 3, 2, 1, 2, 3, 2, 1};
    read_image(d7, 0, got, 49);
    CHECK(same(got, want, 49, 0));
  }
  kiln_dataset_free(d7);
  kiln_dataset_free(b3);
  kiln_dataset_free(base);
  free(px);
}

static void test_hflip(void) {
  enum { N = 200 };
  float *px = malloc(sizeof(float) * N * 2 * 3);
  for (int i = 0; i < N * 6; i++) px[i] = (float)(i % 6);
  kiln_dataset *base = image_ds(px, KILN_F32, N, 3, (int64_t[]){1, 2, 3});
  const float id[6] = {0, 1, 2, 3, 4, 5}, fl[6] = {2, 1, 0, 5, 4, 3};
  for (int k = 0; k < 3; k++) {
    double p = k == 0 ? 0.0 : k == 1 ? 1.0 : 0.5;
    kiln_transform t = kiln_transform_random_hflip(p);
    kiln_dataset *ds = kiln_transform_dataset_new(base, 0, 1, &t, 11);
    CHECK(ds != NULL);
    if (!ds) continue;
    int flipped = 0;
    for (int64_t i = 0; i < N; i++) {
      float got[6];
      read_image(ds, i, got, 6);
      int is_fl = !memcmp(got, fl, sizeof got), is_id = !memcmp(got, id, sizeof got);
      CHECK(is_fl || is_id);
      flipped += is_fl;
    }
    if (k == 0) CHECK(flipped == 0);
    if (k == 1) CHECK(flipped == N);
    /* binomial(200, 0.5): sd 7; 60..140 is more than 5 sd either side */
    if (k == 2) CHECK(flipped > 60 && flipped < 140);
    kiln_dataset_free(ds);
  }
  kiln_dataset_free(base);
  free(px);
}

/* f64 bilinear, align_corners = False (PyTorch's formula), for the reference. */
static void resize_ref(const float *x, int64_t c, int64_t h, int64_t w, int64_t oh, int64_t ow,
                       double *out) {
  for (int64_t ci = 0; ci < c; ci++)
    for (int64_t y = 0; y < oh; y++)
      for (int64_t xx = 0; xx < ow; xx++) {
        double fy = fmax((double)h / (double)oh * (y + 0.5) - 0.5, 0.0);
        double fx = fmax((double)w / (double)ow * (xx + 0.5) - 0.5, 0.0);
        int64_t y0 = (int64_t)fy, x0 = (int64_t)fx;
        int64_t y1 = y0 < h - 1 ? y0 + 1 : y0, x1 = x0 < w - 1 ? x0 + 1 : x0;
        double ly = fy - (double)y0, lx = fx - (double)x0;
        const float *p = x + ci * h * w;
        out[(ci * oh + y) * ow + xx] = (1 - ly) * ((1 - lx) * p[y0 * w + x0] + lx * p[y0 * w + x1]) +
                                       ly * ((1 - lx) * p[y1 * w + x0] + lx * p[y1 * w + x1]);
      }
}

static void test_resize(void) {
  /* PyTorch: F.interpolate(tensor([[[[0., 1.], [2., 3.]]]]), size=(4, 4), mode='bilinear') */
  const float x[4] = {0, 1, 2, 3};
  const float want[16] = {0.0f, 0.25f, 0.75f, 1.0f, 0.5f, 0.75f, 1.25f, 1.5f,
                          1.5f, 1.75f, 2.25f, 2.5f, 2.0f, 2.25f, 2.75f, 3.0f};
  kiln_dataset *b = image_ds(x, KILN_F32, 1, 2, (int64_t[]){2, 2});
  kiln_transform t = kiln_transform_resize(4, 4);
  kiln_dataset *ds = kiln_transform_dataset_new(b, 0, 1, &t, 0);
  CHECK(ds != NULL);
  float got[64];
  if (ds) {
    read_image(ds, 0, got, 16);
    CHECK(same(got, want, 16, 0));
  }
  kiln_dataset_free(ds);
  kiln_dataset_free(b);

  /* down and up at once: (2, 5, 7) -> (2, 3, 9) against the f64 reference */
  float big[70];
  for (int i = 0; i < 70; i++) big[i] = (float)((i * 37) % 23) / 7.0f;
  b = image_ds(big, KILN_F32, 1, 3, (int64_t[]){2, 5, 7});
  t = kiln_transform_resize(3, 9);
  ds = kiln_transform_dataset_new(b, 0, 1, &t, 0);
  CHECK(ds != NULL);
  if (ds) {
    double ref[54];
    float reff[54];
    resize_ref(big, 2, 5, 7, 3, 9, ref);
    for (int i = 0; i < 54; i++) reff[i] = (float)ref[i];
    read_image(ds, 0, got, 54);
    CHECK(same(got, reff, 54, 1e-5)); /* f32 arithmetic on values below 4 */
  }
  kiln_dataset_free(ds);
  kiln_dataset_free(b);

  /* u8 stays u8, rounded: 0 and 255 side by side, 1x2 -> 1x4 gives 0, 64, 191, 255 */
  const uint8_t u[2] = {0, 255};
  b = image_ds(u, KILN_U8, 1, 2, (int64_t[]){1, 2});
  t = kiln_transform_resize(1, 4);
  ds = kiln_transform_dataset_new(b, 0, 1, &t, 0);
  CHECK(ds && kiln_dataset_field(ds, 0)->dtype == KILN_U8);
  if (ds) {
    read_image(ds, 0, got, 4);
    const float wu[4] = {0, 64, 191, 255}; /* 63.75 and 191.25 rounded */
    CHECK(same(got, wu, 4, 0));
  }
  kiln_dataset_free(ds);
  kiln_dataset_free(b);
}

/* Every batch of an epoch (images and labels) flattened into img/lab; returns the count of
** samples. */
static int64_t epoch_images(kiln_dataset *ds, int workers, uint64_t epoch, float *img,
                            int64_t *lab, int64_t per) {
  kiln_loader_opts o = kiln_loader_opts_default();
  o.batch_size = 8;
  o.shuffle = true;
  o.seed = 5;
  o.num_workers = workers;
  kiln_loader *l = kiln_loader_new(ds, &o);
  CHECK(l != NULL);
  if (!l) return 0;
  CHECK(kiln_loader_epoch(l, epoch) == KILN_OK);
  int64_t k = 0;
  for (;;) {
    kiln_scope_begin();
    kiln_tensor *b[2];
    int r = kiln_loader_next(l, b);
    if (r == 1) {
      int64_t bs = kiln_size(b[0], 0);
      CHECK(kiln_numel(b[0]) == bs * per);
      kiln_to_host(b[0], img + k * per, sizeof(float) * (size_t)(bs * per));
      kiln_to_host(b[1], lab + k, sizeof(int64_t) * (size_t)bs);
      k += bs;
    }
    kiln_scope_end();
    if (r != 1) {
      CHECK(r == 0);
      break;
    }
  }
  kiln_loader_free(l);
  return k;
}

static void test_workers_and_epochs(void) {
  /* 50 u8 (1, 6, 6) images -> to_float, crop 6 pad 2 reflect, flip, normalize */
  enum { N = 50, PER = 36 };
  uint8_t *px = malloc(N * PER);
  for (int i = 0; i < N * PER; i++) px[i] = (uint8_t)((i * 131) % 251);
  kiln_dataset *base = image_ds(px, KILN_U8, N, 2, (int64_t[]){6, 6});
  kiln_transform t[4] = {kiln_transform_to_float(),
                         kiln_transform_random_crop(6, 6, 2, KILN_PAD_REFLECT),
                         kiln_transform_random_hflip(0.5),
                         kiln_transform_normalize(1, (const float[]){0.5f}, (const float[]){0.25f})};
  kiln_dataset *ds = kiln_transform_dataset_new(base, 0, 4, t, 42);
  kiln_dataset *ds2 = kiln_transform_dataset_new(base, 0, 4, t, 43);
  CHECK(ds && ds2);
  if (!ds || !ds2) return;
  float *a = malloc(sizeof(float) * N * PER), *b = malloc(sizeof(float) * N * PER);
  int64_t la[N], lb[N];
  CHECK(epoch_images(ds, 1, 3, a, la, PER) == N);
  CHECK(epoch_images(ds, 4, 3, b, lb, PER) == N);
  CHECK(!memcmp(la, lb, sizeof la) && !memcmp(a, b, sizeof(float) * N * PER));
  CHECK(epoch_images(ds, 0, 3, b, lb, PER) == N);
  CHECK(!memcmp(la, lb, sizeof la) && !memcmp(a, b, sizeof(float) * N * PER));

  /* epoch 4 shuffles differently; compare per sample id: most images change */
  float *a_by = malloc(sizeof(float) * N * PER), *b_by = malloc(sizeof(float) * N * PER);
  for (int i = 0; i < N; i++) memcpy(a_by + la[i] * PER, a + i * PER, sizeof(float) * PER);
  CHECK(epoch_images(ds, 4, 4, b, lb, PER) == N);
  for (int i = 0; i < N; i++) memcpy(b_by + lb[i] * PER, b + i * PER, sizeof(float) * PER);
  int differ = 0;
  for (int i = 0; i < N; i++) differ += memcmp(a_by + i * PER, b_by + i * PER, sizeof(float) * PER) != 0;
  CHECK(differ > N / 2); /* 50 corners x 2 flips: a repeat is 1 in 50 per sample */

  /* another seed: other images in the same epoch */
  CHECK(epoch_images(ds2, 2, 3, b, lb, PER) == N);
  for (int i = 0; i < N; i++) memcpy(b_by + lb[i] * PER, b + i * PER, sizeof(float) * PER);
  differ = 0;
  for (int i = 0; i < N; i++) differ += memcmp(a_by + i * PER, b_by + i * PER, sizeof(float) * PER) != 0;
  CHECK(differ > N / 2);

  /* a read outside a loader is epoch 0: the same as a loader's epoch 0 */
  CHECK(epoch_images(ds, 2, 0, b, lb, PER) == N);
  int agree = 1;
  for (int i = 0; i < N && agree; i++) {
    float got[PER];
    read_image(ds, lb[i], got, PER);
    agree = !memcmp(got, b + i * PER, sizeof got);
  }
  CHECK(agree);
  free(a);
  free(b);
  free(a_by);
  free(b_by);
  kiln_dataset_free(ds);
  kiln_dataset_free(ds2);
  kiln_dataset_free(base);
  free(px);
}

/* bad(list, n) must fail with code and a message containing what. */
static void expect_bad(kiln_dataset *base, int field, int n, const kiln_transform *t,
                       kiln_status code, const char *what) {
  kiln_clear_error();
  kiln_dataset *ds = kiln_transform_dataset_new(base, field, n, t, 0);
  CHECK(ds == NULL);
  kiln_dataset_free(ds);
  if (kiln_last_error() != code || !strstr(kiln_last_error_message(), what)) {
    fprintf(stderr, "  wanted %s with \"%s\", got %s: %s\n", kiln_error_name(code), what,
            kiln_error_name(kiln_last_error()), kiln_last_error_message());
    failures++;
  }
}

static void test_bad_input(void) {
  float px[2 * 3 * 4] = {0};
  kiln_dataset *b = image_ds(px, KILN_F32, 1, 3, (int64_t[]){3, 2, 4}); /* (3, 2, 4) f32 */
  const float m2[2] = {0, 0}, s3[3] = {1, 0, 1}, m3[3] = {0, 0, 0}, s3ok[3] = {1, 1, 1};
  kiln_transform t;
  t = kiln_transform_normalize(2, m2, s3ok);
  expect_bad(b, 0, 1, &t, KILN_ERR_SHAPE, "2 mean/std values for an image of 3 channels");
  t = kiln_transform_normalize(3, m3, s3);
  expect_bad(b, 0, 1, &t, KILN_ERR_INVALID_ARGUMENT, "channel 1 has mean 0, std 0");
  t = kiln_transform_normalize(3, NULL, s3ok);
  expect_bad(b, 0, 1, &t, KILN_ERR_INVALID_ARGUMENT, "NULL mean");
  t = kiln_transform_random_crop(5, 4, 1, KILN_PAD_CONSTANT);
  expect_bad(b, 0, 1, &t, KILN_ERR_SHAPE, "crop 5x4 is larger than the padded image 4x6");
  t = kiln_transform_random_crop(0, 4, 1, KILN_PAD_CONSTANT);
  expect_bad(b, 0, 1, &t, KILN_ERR_INVALID_ARGUMENT, "at least 1x1");
  t = kiln_transform_pad(2, KILN_PAD_REFLECT);
  expect_bad(b, 0, 1, &t, KILN_ERR_INVALID_ARGUMENT, "reflect padding 2 needs an image larger");
  t = kiln_transform_pad(-1, KILN_PAD_CONSTANT);
  expect_bad(b, 0, 1, &t, KILN_ERR_INVALID_ARGUMENT, "padding -1");
  t = kiln_transform_random_hflip(1.5);
  expect_bad(b, 0, 1, &t, KILN_ERR_INVALID_ARGUMENT, "p 1.5 is not in [0, 1]");
  t = kiln_transform_to_float();
  expect_bad(b, 0, 1, &t, KILN_ERR_INVALID_ARGUMENT, "to_float) needs a uint8 image, it gets float32");
  t = kiln_transform_resize(0, 3);
  expect_bad(b, 0, 1, &t, KILN_ERR_INVALID_ARGUMENT, "resize");
  t = (kiln_transform){.kind = (kiln_transform_kind)99};
  expect_bad(b, 0, 1, &t, KILN_ERR_INVALID_ARGUMENT, "unknown kind 99");
  /* the second transform is the one named */
  kiln_transform two[2] = {kiln_transform_resize(2, 2),
                           kiln_transform_random_crop(3, 3, 0, KILN_PAD_CONSTANT)};
  expect_bad(b, 0, 2, two, KILN_ERR_SHAPE, "transform 1 (random_crop)");
  t = kiln_transform_random_hflip(0.5);
  expect_bad(b, 1, 1, &t, KILN_ERR_SHAPE, "field 1 must be an image"); /* the labels */
  expect_bad(b, 2, 1, &t, KILN_ERR_INVALID_ARGUMENT, "field 2 out of range");
  expect_bad(NULL, 0, 1, &t, KILN_ERR_INVALID_ARGUMENT, "base NULL");
  expect_bad(b, 0, 1, NULL, KILN_ERR_INVALID_ARGUMENT, "transforms NULL");

  /* normalize on u8 */
  uint8_t u[4] = {0};
  kiln_dataset *bu = image_ds(u, KILN_U8, 1, 2, (int64_t[]){2, 2});
  t = kiln_transform_normalize(1, m3, s3ok);
  expect_bad(bu, 0, 1, &t, KILN_ERR_INVALID_ARGUMENT, "needs a float32 image, it gets uint8");
  /* an i32 image */
  int32_t i32[4] = {0};
  kiln_dataset *bi = image_ds(i32, KILN_I32, 1, 2, (int64_t[]){2, 2});
  t = kiln_transform_random_hflip(0.5);
  expect_bad(bi, 0, 1, &t, KILN_ERR_DTYPE, "images are uint8 or float32");
  /* an empty dataset */
  kiln_dataset *be = image_ds(px, KILN_F32, 0, 3, (int64_t[]){3, 2, 4});
  CHECK(be != NULL);
  expect_bad(be, 0, 1, &t, KILN_ERR_INVALID_ARGUMENT, "the base dataset is empty");
  /* no transforms is allowed: the image comes through as (C, H, W) */
  kiln_dataset *id = kiln_transform_dataset_new(bu, 0, 0, NULL, 0);
  CHECK(id && kiln_dataset_field(id, 0)->ndim == 3 && kiln_dataset_field(id, 0)->shape[0] == 1);
  kiln_dataset_free(id);
  kiln_dataset_free(be);
  kiln_dataset_free(bi);
  kiln_dataset_free(bu);
  kiln_dataset_free(b);
}

int main(void) {
  test_to_float_and_normalize();
  test_pad();
  test_random_crop();
  test_hflip();
  test_resize();
  test_workers_and_epochs();
  test_bad_input();
  printf("test_data_transform: %d failure(s)\n", failures);
  return failures ? 1 : 0;
}
