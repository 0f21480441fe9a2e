/*
** safetensors: kiln reads the reference implementation's file exactly (every dtype, a
** 0-dim and a size-0 tensor, metadata), writes files it reads back and that the reference
** opens (checked with python3 only where `import safetensors` works), gives clear errors
** on hand-made bad headers, and survives every truncation and single-bit flip of the
** fixture (FORMAT/IO/DTYPE/SHAPE, no crash, no leak).
*/
#define _POSIX_C_SOURCE 200809L
#include "scratch.h"
#include <kiln.h>
#include <kiln_io.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "fixture.h"

static char g_fixture[1024], g_tmp[256];

/* The expected fixture content (scripts/make_fixtures.py). */
static int check_tensor(const kiln_dict *d, const char *name, kiln_dtype dt, int nd,
                        const int64_t *shape, const void *bytes) {
  kiln_tensor *t = kiln_dict_get(d, name);
  if (!t) {
    fprintf(stderr, "missing tensor %s\n", name);
    return 0;
  }
  if (kiln_dtype_of(t) != dt || kiln_ndim(t) != nd) {
    fprintf(stderr, "%s: dtype %s ndim %d\n", name, kiln_dtype_name(kiln_dtype_of(t)), kiln_ndim(t));
    return 0;
  }
  for (int i = 0; i < nd; i++)
    if (kiln_size(t, i) != shape[i]) return 0;
  size_t nb = kiln_nbytes(t);
  unsigned char *buf = malloc(nb + 1);
  int ok = kiln_to_host(t, buf, nb) == KILN_OK && memcmp(buf, bytes, nb) == 0;
  free(buf);
  if (!ok) fprintf(stderr, "%s: values differ\n", name);
  return ok;
}

static int check_fixture_dict(const kiln_dict *d) {
  float a[6];
  for (int i = 0; i < 6; i++) a[i] = (float)i * 0.5f - 1.25f;
  double b[3];
  for (int i = 0; i < 3; i++) b[i] = (i + 1) / 3.0;
  const uint16_t c[4] = {0xB800, 0xB400, 0x0000, 0x3400}; /* -0.5 -0.25 0 0.25 */
  const uint16_t bf[4] = {0x3F80, 0xC000, 0x3F00, 0x4040};
  const int64_t e[4] = {-(INT64_C(1) << 40), -1, 0, INT64_C(1) << 62};
  const int32_t f[3] = {-7, 0, 2147483647};
  const uint8_t g[5] = {0, 1, 127, 128, 255};
  const uint8_t h[3] = {1, 0, 1};
  const float s = 3.5f;
  int ok = 1;
  ok &= check_tensor(d, "a.f32", KILN_F32, 2, (int64_t[]){2, 3}, a);
  ok &= check_tensor(d, "b.f64", KILN_F64, 1, (int64_t[]){3}, b);
  ok &= check_tensor(d, "c.f16", KILN_F16, 2, (int64_t[]){2, 2}, c);
  ok &= check_tensor(d, "d.bf16", KILN_BF16, 1, (int64_t[]){4}, bf);
  ok &= check_tensor(d, "e.i64", KILN_I64, 2, (int64_t[]){2, 2}, e);
  ok &= check_tensor(d, "f.i32", KILN_I32, 1, (int64_t[]){3}, f);
  ok &= check_tensor(d, "g.u8", KILN_U8, 1, (int64_t[]){5}, g);
  ok &= check_tensor(d, "h.bool", KILN_BOOL, 1, (int64_t[]){3}, h);
  ok &= check_tensor(d, "scalar", KILN_F32, 0, NULL, &s);
  ok &= check_tensor(d, "empty", KILN_F32, 2, (int64_t[]){0, 3}, "");
  ok &= kiln_dict_size(d) == 10;
  ok &= kiln_dict_meta_size(d) == 2;
  const char *m1 = kiln_dict_get_meta(d, "format"), *m2 = kiln_dict_get_meta(d, "kiln");
  ok &= m1 && strcmp(m1, "np") == 0;
  ok &= m2 && strcmp(m2, "fixture \"quoted\"") == 0;
  return ok;
}

static void test_reference_file(void) {
  kiln_dict *d = kiln_safetensors_load(g_fixture, kiln_device_cpu());
  CHECK(d != NULL);
  if (!d) return;
  CHECK(check_fixture_dict(d));
  /* round trip through kiln's writer */
  char out[300];
  snprintf(out, sizeof out, "%s/rt.safetensors", g_tmp);
  CHECK(kiln_safetensors_save(out, d) == KILN_OK);
  kiln_dict *d2 = kiln_safetensors_load(out, kiln_device_cpu());
  CHECK(d2 != NULL);
  if (d2) CHECK(check_fixture_dict(d2));
  /* the data area starts 8-aligned and larger dtypes come first */
  size_t n;
  unsigned char *b = read_all(out, &n);
  CHECK(b && n >= 8);
  if (b) {
    uint64_t hl = 0;
    for (int i = 7; i >= 0; i--) hl = hl << 8 | b[i];
    CHECK((8 + hl) % 8 == 0);
    b[8 + hl - 1] = 0;
    const char *p64 = strstr((char *)b + 8, "\"b.f64\""), *p8 = strstr((char *)b + 8, "\"g.u8\"");
    CHECK(p64 && p8 && p64 < p8);
    free(b);
  }
  /* the reference opens kiln's file (skipped without the module: CI has none) */
  if (system("python3 -c 'import safetensors, numpy' >/dev/null 2>&1") == 0) {
    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             "python3 -c \"\n"
             "import numpy as np, safetensors.numpy as sn, safetensors\n"
             "from safetensors import safe_open\n"
             "f = safe_open('%s', 'np')\n"
             "t = {k: f.get_tensor(k) for k in f.keys() if k != 'd.bf16'}\n"
             "assert np.array_equal(t['a.f32'], (np.arange(6, dtype=np.float32)*0.5-1.25).reshape(2,3))\n"
             "assert t['scalar'].shape == () and t['scalar'] == 3.5\n"
             "assert t['empty'].shape == (0, 3)\n"
             "assert list(t['h.bool']) == [True, False, True]\n"
             "assert t['e.i64'][1,1] == 1 << 62\n"
             "raw = dict(safetensors.deserialize(open('%s','rb').read()))\n"
             "assert raw['d.bf16']['dtype'] == 'BF16' and bytes(raw['d.bf16']['data']) == bytes([0x80,0x3f,0,0xc0,0,0x3f,0x40,0x40])\n"
             "m = safe_open('%s', 'np').metadata()\n"
             "assert m == {'format': 'np', 'kiln': 'fixture ' + chr(34) + 'quoted' + chr(34)}, m\n"
             "\"",
             out, out, out);
    int rc = system(cmd);
    CHECK(rc == 0);
    printf("reference check of kiln's file: %s\n", rc == 0 ? "ok" : "FAILED");
  } else {
    printf("reference check of kiln's file: skipped (python3 has no safetensors module)\n");
  }
  kiln_dict_free(d2);
  kiln_dict_free(d);
}

static void test_dict_api(void) {
  kiln_dict *d = kiln_dict_new();
  kiln_tensor *a = kiln_zeros(KILN_SHAPE(2), KILN_F32, kiln_device_cpu());
  kiln_tensor *b = kiln_zeros(KILN_SHAPE(3), KILN_I64, kiln_device_cpu());
  CHECK(kiln_dict_set(d, "x", a) == KILN_OK);
  CHECK(kiln_dict_set(d, "y", b) == KILN_OK);
  CHECK(kiln_dict_set(d, "x", b) == KILN_OK); /* replaced in place */
  CHECK(kiln_dict_size(d) == 2);
  CHECK(strcmp(kiln_dict_key(d, 0), "x") == 0 && kiln_dict_value(d, 0) == b);
  CHECK(kiln_dict_get(d, "nope") == NULL);
  CHECK(kiln_dict_key(d, 2) == NULL && kiln_dict_value(d, -1) == NULL);
  CHECK(kiln_dict_set(d, NULL, a) == KILN_ERR_INVALID_ARGUMENT);
  CHECK(kiln_dict_set(d, "", a) == KILN_ERR_INVALID_ARGUMENT);
  CHECK(kiln_dict_set(d, "z", NULL) == KILN_ERR_INVALID_ARGUMENT);
  CHECK(kiln_dict_set_meta(d, "k", "v1") == KILN_OK);
  CHECK(kiln_dict_set_meta(d, "k", "v2") == KILN_OK);
  CHECK(kiln_dict_meta_size(d) == 1 && strcmp(kiln_dict_get_meta(d, "k"), "v2") == 0);
  CHECK(kiln_dict_get_meta(d, "q") == NULL);
  kiln_tensor_free(a);
  kiln_tensor_free(b);
  CHECK(kiln_numel(kiln_dict_get(d, "y")) == 3); /* the dict keeps its own reference */
  CHECK(kiln_dict_set(d, "__metadata__", kiln_dict_get(d, "y")) == KILN_OK);
  char out[300];
  snprintf(out, sizeof out, "%s/bad.safetensors", g_tmp);
  CHECK(kiln_safetensors_save(out, d) == KILN_ERR_INVALID_ARGUMENT);
  kiln_dict_free(d);
  kiln_dict_free(NULL);
  CHECK(kiln_dict_size(NULL) == 0);

  /* a strided tensor is written in C order; an empty dict makes a valid file */
  kiln_scope_begin();
  float v[6] = {0, 1, 2, 3, 4, 5};
  kiln_tensor *m = kiln_from_data(v, KILN_SHAPE(2, 3), KILN_F32, kiln_device_cpu());
  kiln_tensor *mt = kiln_transpose(m, 0, 1); /* (3, 2) */
  d = kiln_dict_new();
  CHECK(kiln_dict_set(d, "t", mt) == KILN_OK);
  kiln_scope_end();
  snprintf(out, sizeof out, "%s/strided.safetensors", g_tmp);
  CHECK(kiln_safetensors_save(out, d) == KILN_OK);
  kiln_dict_free(d);
  d = kiln_safetensors_load(out, kiln_device_cpu());
  CHECK(d && kiln_dict_size(d) == 1);
  if (d) {
    const float want[6] = {0, 3, 1, 4, 2, 5};
    CHECK(check_tensor(d, "t", KILN_F32, 2, (int64_t[]){3, 2}, want));
  }
  kiln_dict_free(d);
  d = kiln_dict_new();
  CHECK(kiln_safetensors_save(out, d) == KILN_OK);
  kiln_dict_free(d);
  d = kiln_safetensors_load(out, kiln_device_cpu());
  CHECK(d && kiln_dict_size(d) == 0);
  kiln_dict_free(d);

  CHECK(kiln_safetensors_load(NULL, kiln_device_cpu()) == NULL &&
        kiln_last_error() == KILN_ERR_INVALID_ARGUMENT);
  CHECK(kiln_safetensors_load("/nonexistent/x.safetensors", kiln_device_cpu()) == NULL &&
        kiln_last_error() == KILN_ERR_IO);
  CHECK(kiln_safetensors_save("/nonexistent/dir/x.safetensors", NULL) == KILN_ERR_INVALID_ARGUMENT);
  d = kiln_dict_new();
  CHECK(kiln_safetensors_save("/nonexistent/dir/x.safetensors", d) == KILN_ERR_IO);
  kiln_dict_free(d);
}

static void test_atomic(void) {
  char out[300];
  snprintf(out, sizeof out, "%s/atomic.bin", g_tmp);
  CHECK(kiln_file_write_atomic(out, "hello", 5) == KILN_OK);
  size_t n;
  unsigned char *b = read_all(out, &n);
  CHECK(b && n == 5 && memcmp(b, "hello", 5) == 0);
  free(b);
  CHECK(kiln_file_write_atomic(out, "", 0) == KILN_OK);
  CHECK(kiln_file_write_atomic(NULL, "x", 1) == KILN_ERR_INVALID_ARGUMENT);
  CHECK(kiln_file_write_atomic("/nonexistent/dir/f", "x", 1) == KILN_ERR_IO);
  char tmpname[400];
  snprintf(tmpname, sizeof tmpname, "%s.tmp.%ld", out, (long)getpid());
  CHECK(access(tmpname, F_OK) != 0); /* no temporary left behind */
}

/* A file from a header string and a data area of n zero bytes. */
static kiln_dict *load_crafted(const char *hdr, size_t ndata) {
  size_t hl = strlen(hdr);
  unsigned char *b = calloc(8 + hl + ndata + 1, 1);
  for (int i = 0; i < 8; i++) b[i] = (unsigned char)((uint64_t)hl >> (8 * i));
  memcpy(b + 8, hdr, hl);
  char p[300];
  snprintf(p, sizeof p, "%s/crafted.safetensors", g_tmp);
  write_all(p, b, 8 + hl + ndata);
  free(b);
  return kiln_safetensors_load(p, kiln_device_cpu());
}

static void expect_error(const char *hdr, size_t ndata, kiln_status code, const char *needle) {
  kiln_clear_error();
  kiln_dict *d = load_crafted(hdr, ndata);
  int ok = d == NULL && kiln_last_error() == code && strstr(kiln_last_error_message(), needle);
  if (!ok)
    fprintf(stderr, "header %s: got %s \"%s\", want %s containing \"%s\"\n", hdr,
            kiln_error_name(kiln_last_error()), kiln_last_error_message(), kiln_error_name(code),
            needle);
  CHECK(ok);
  kiln_dict_free(d);
}

static void test_crafted_errors(void) {
  kiln_dict *d = load_crafted("{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8);
  CHECK(d && kiln_dict_size(d) == 1);
  kiln_dict_free(d);
  /* JSON order need not be data order; the dict follows the data */
  d = load_crafted("{\"b\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[4,6]},"
                   "\"a\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,4]}}    ", 6);
  CHECK(d && kiln_dict_size(d) == 2 && strcmp(kiln_dict_key(d, 0), "a") == 0 &&
        kiln_ndim(kiln_dict_get(d, "a")) == 0 && kiln_numel(kiln_dict_get(d, "b")) == 2);
  kiln_dict_free(d);
  expect_error("{\"fc1.weight\":{\"dtype\":\"F32\",\"shape\":[1024],\"data_offsets\":[0,4096]}}", 1024,
               KILN_ERR_FORMAT, "tensor 'fc1.weight' data_offsets [0, 4096) end past the data area of 1024 bytes");
  expect_error("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
               "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 12,
               KILN_ERR_FORMAT, "overlap");
  expect_error("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
               "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[12,20]}}", 20,
               KILN_ERR_FORMAT, "gap");
  expect_error("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 12,
               KILN_ERR_FORMAT, "stray bytes");
  expect_error("{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 8,
               KILN_ERR_FORMAT, "need 12");
  expect_error("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
               "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}", 16,
               KILN_ERR_FORMAT, "duplicate tensor name 'a'");
  expect_error("{\"a\":{\"dtype\":\"F33\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8,
               KILN_ERR_FORMAT, "unknown dtype");
  expect_error("{\"a\":{\"dtype\":\"I8\",\"shape\":[2],\"data_offsets\":[0,2]}}", 2,
               KILN_ERR_DTYPE, "I8");
  expect_error("{\"a\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", 8,
               KILN_ERR_FORMAT, "shape[0]");
  expect_error("{\"a\":{\"dtype\":\"F32\",\"shape\":[2.5],\"data_offsets\":[0,8]}}", 8,
               KILN_ERR_FORMAT, "shape[0]");
  expect_error("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]}}", 8,
               KILN_ERR_FORMAT, "end before begin");
  expect_error("{\"a\":{\"dtype\":\"F32\",\"shape\":[2]}}", 8, KILN_ERR_FORMAT, "data_offsets");
  expect_error("{\"a\":{\"shape\":[2],\"data_offsets\":[0,8]}}", 8, KILN_ERR_FORMAT, "dtype");
  expect_error("{\"a\":3}", 0, KILN_ERR_FORMAT, "not a JSON object");
  expect_error("[1,2]", 0, KILN_ERR_FORMAT, "start with '{'");
  /* JSON errors name the line and the file offset of the byte where the header went wrong */
  expect_error("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}", 8,
               KILN_ERR_FORMAT, "crafted.safetensors:1: byte 61: expected ',', found the end of the file");
  expect_error("{}  x", 0, KILN_ERR_FORMAT, ":1: byte 12: more after the end of the JSON value");
  expect_error("{\n\"a\": {\"dtype\": \"F32\",\n \"shape\": [2,],\"data_offsets\":[0,8]}}", 8,
               KILN_ERR_FORMAT, ":3: byte 45: tensor 'a' shape[1] is not a non-negative integer");
  /* strict JSON numbers, as the reference's serde reads them: no fraction, exponent or
  ** leading zero in a dim or an offset, nothing past 2^64 */
  expect_error("{\"a\":{\"dtype\":\"F32\",\"shape\":[2e0],\"data_offsets\":[0,8]}}", 8,
               KILN_ERR_FORMAT, "shape[0]");
  expect_error("{\"a\":{\"dtype\":\"F32\",\"shape\":[02],\"data_offsets\":[0,8]}}", 8,
               KILN_ERR_FORMAT, "shape[0]");
  expect_error("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8.0]}}", 8,
               KILN_ERR_FORMAT, "\"data_offsets\" is not [begin, end]");
  expect_error("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8,16]}}", 8,
               KILN_ERR_FORMAT, "\"data_offsets\" is not [begin, end]");
  expect_error("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,18446744073709551616]}}", 8,
               KILN_ERR_FORMAT, "\"data_offsets\" is not [begin, end]");
  /* a member twice (the second would silently win), a second "__metadata__", values of
  ** the wrong kind, a broken value in a member kiln ignores */
  expect_error("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"dtype\":\"U8\",\"data_offsets\":[0,8]}}", 8,
               KILN_ERR_FORMAT, "byte 40: tensor 'a' has \"dtype\" twice");
  expect_error("{\"__metadata__\":{},\"__metadata__\":null}", 0, KILN_ERR_FORMAT,
               "duplicate \"__metadata__\"");
  expect_error("{\"__metadata__\":{\"k\":\"v\",\"k\":\"w\"}}", 0, KILN_ERR_FORMAT,
               "duplicate \"__metadata__\" key 'k'");
  expect_error("{\"__metadata__\":[]}", 0, KILN_ERR_FORMAT, "\"__metadata__\" is not a JSON object");
  expect_error("{\"__metadata__\":nul}", 0, KILN_ERR_FORMAT, "expected a value");
  expect_error("{\"a\":{\"dtype\":7,\"shape\":[2],\"data_offsets\":[0,8]}}", 8,
               KILN_ERR_FORMAT, "\"dtype\" is not a string");
  expect_error("{\"a\":{\"dtype\":\"F32\",\"shape\":2,\"data_offsets\":[0,8]}}", 8,
               KILN_ERR_FORMAT, "\"shape\" is not an array");
  expect_error("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8],\"x\":[1,}}}", 8,
               KILN_ERR_FORMAT, "expected a value");
  /* the second of two equal names is the one named, with its offset */
  expect_error("{\"b\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
               "\"b\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]}}", 2,
               KILN_ERR_FORMAT, "byte 61: duplicate tensor name 'b'");
  /* members kiln does not read are skipped, in any order; "__metadata__": null is no metadata */
  d = load_crafted("{\"__metadata__\":null,\"w\":{\"data_offsets\":[0,2],\"note\":{\"k\":[true,null,-1.5e3]},"
                   "\"shape\":[2],\"dtype\":\"U8\"}}", 2);
  CHECK(d && kiln_dict_size(d) == 1 && kiln_dict_meta_size(d) == 0 && kiln_numel(kiln_dict_get(d, "w")) == 2);
  kiln_dict_free(d);
  /* no tensors at all: an empty dict */
  d = load_crafted("{}", 0);
  CHECK(d && kiln_dict_size(d) == 0);
  kiln_dict_free(d);
  expect_error("{\"__metadata__\":{\"k\":1}}", 0, KILN_ERR_FORMAT, "not a string");
  expect_error("{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,4]}}", 4,
               KILN_ERR_SHAPE, "dims");
  /* issue 17.1: no elements, but a partial product of the dims passes 2^63 */
  expect_error("{\"a\":{\"dtype\":\"F32\",\"shape\":[0,4294967296,4294967296],\"data_offsets\":[0,0]}}",
               0, KILN_ERR_SHAPE, "too large");
  expect_error("{\"a\":{\"dtype\":\"U8\",\"shape\":[4294967296,0,4294967296],\"data_offsets\":[0,0]}}",
               0, KILN_ERR_SHAPE, "too large");
  d = load_crafted("{\"a\":{\"dtype\":\"F32\",\"shape\":[0,65536,65536],\"data_offsets\":[0,0]}}", 0);
  CHECK(d && kiln_numel(kiln_dict_get(d, "a")) == 0);
  kiln_dict_free(d);
  /* header length past the end of the file */
  char p[300];
  snprintf(p, sizeof p, "%s/hl.safetensors", g_tmp);
  write_all(p, "\xff\xff\x00\x00\x00\x00\x00\x00{}", 10);
  CHECK(kiln_safetensors_load(p, kiln_device_cpu()) == NULL && kiln_last_error() == KILN_ERR_FORMAT &&
        strstr(kiln_last_error_message(), "header length 65535"));
  write_all(p, "\x01\x00", 2);
  CHECK(kiln_safetensors_load(p, kiln_device_cpu()) == NULL && kiln_last_error() == KILN_ERR_FORMAT);
}

/* Issue 17.3: names and metadata must be UTF-8 without NUL; the error names the offset. */
static void test_names(void) {
  /* raw 0xFF in a name: the byte sits at file offset 8 + 2 */
  expect_error("{\"\xff\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1,
               KILN_ERR_FORMAT, "invalid UTF-8 in the header at file offset 10");
  /* an overlong form of '/', a lone surrogate (ED A0 80), a cut sequence, in metadata */
  expect_error("{\"__metadata__\":{\"k\":\"\xc0\xaf\"}}", 0, KILN_ERR_FORMAT, "invalid UTF-8");
  expect_error("{\"__metadata__\":{\"k\":\"\xed\xa0\x80\"}}", 0, KILN_ERR_FORMAT, "invalid UTF-8");
  expect_error("{\"__metadata__\":{\"\xe2\x82\":\"v\"}}", 0, KILN_ERR_FORMAT, "file offset 26");
  /* escaped NUL: two names that would both be cut to "a" */
  expect_error("{\"a\\u0000x\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
               "\"a\\u0000y\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]}}",
               2, KILN_ERR_FORMAT, "escaped NUL (\\u0000) in a string at file offset 11");
  expect_error("{\"__metadata__\":{\"k\":\"v\\u0000\"}}", 0, KILN_ERR_FORMAT, "escaped NUL");
  /* a raw NUL byte */
  {
    static const char h[] = "{\"__metadata__\":{\"k\":\"v\0w\"}}";
    unsigned char b[8 + sizeof h];
    size_t hl = sizeof h - 1;
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)((uint64_t)hl >> (8 * i));
    memcpy(b + 8, h, hl);
    char p[300];
    snprintf(p, sizeof p, "%s/nul.safetensors", g_tmp);
    write_all(p, b, 8 + hl);
    CHECK(kiln_safetensors_load(p, kiln_device_cpu()) == NULL && kiln_last_error() == KILN_ERR_FORMAT &&
          strstr(kiln_last_error_message(), "NUL byte in the header at file offset 31"));
  }
  /* valid: UTF-8 names, an escaped backslash before "u0000" (the name is \u0000 as text),
  ** an escaped control character */
  kiln_dict *d = load_crafted("{\"caf\xc3\xa9.\xe2\x82\xac.\xf0\x9f\x94\xa5\":{\"dtype\":\"U8\",\"shape\":[1],"
                              "\"data_offsets\":[0,1]},\"b\\\\u0000\":{\"dtype\":\"U8\",\"shape\":[1],"
                              "\"data_offsets\":[1,2]},\"\\u001b[31m\":{\"dtype\":\"U8\",\"shape\":[1],"
                              "\"data_offsets\":[2,3]}}", 3);
  CHECK(d && kiln_dict_size(d) == 3 && kiln_dict_get(d, "caf\xc3\xa9.\xe2\x82\xac.\xf0\x9f\x94\xa5") &&
        kiln_dict_get(d, "b\\u0000") && kiln_dict_get(d, "\x1b[31m"));
  kiln_dict_free(d);
}

static int acceptable(kiln_status s) {
  return s == KILN_ERR_FORMAT || s == KILN_ERR_IO || s == KILN_ERR_DTYPE || s == KILN_ERR_SHAPE;
}

static void test_fuzz(void) {
  size_t n;
  unsigned char *orig = read_all(g_fixture, &n);
  CHECK(orig != NULL);
  if (!orig) return;
  unsigned char *b = malloc(n);
  char p[300];
  snprintf(p, sizeof p, "%s/fuzz.safetensors", g_tmp);
  int64_t live0 = kiln_live_tensors();
  int trunc_ok = 1, flip_bad = 0, loaded = 0;
  for (size_t len = 0; len < n; len++) { /* every truncation is invalid */
    write_all(p, orig, len);
    kiln_dict *d = kiln_safetensors_load(p, kiln_device_cpu());
    if (d || !acceptable(kiln_last_error())) trunc_ok = 0;
    kiln_dict_free(d);
  }
  CHECK(trunc_ok);
  for (size_t i = 0; i < n; i++)
    for (int bit = 0; bit < 8; bit++) {
      memcpy(b, orig, n);
      b[i] ^= (unsigned char)(1u << bit);
      write_all(p, b, n);
      kiln_clear_error();
      kiln_dict *d = kiln_safetensors_load(p, kiln_device_cpu());
      if (d) loaded++;
      else if (!acceptable(kiln_last_error())) {
        flip_bad++;
        fprintf(stderr, "flip %zu.%d: %s %s\n", i, bit, kiln_error_name(kiln_last_error()),
                kiln_last_error_message());
      }
      kiln_dict_free(d);
    }
  CHECK(flip_bad == 0);
  /* random multi-byte damage from a fixed LCG */
  uint64_t s = 12345;
  for (int it = 0; it < 3000; it++) {
    memcpy(b, orig, n);
    int k = 1 + it % 4;
    for (int j = 0; j < k; j++) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      size_t at = (size_t)(s >> 33) % n;
      b[at] = (unsigned char)(s >> 24);
    }
    write_all(p, b, n);
    kiln_dict *d = kiln_safetensors_load(p, kiln_device_cpu());
    if (!d && !acceptable(kiln_last_error())) flip_bad++;
    kiln_dict_free(d);
  }
  CHECK(flip_bad == 0);
  CHECK(kiln_live_tensors() == live0);
  printf("fuzz: %zu truncations, %zu bit flips (%d still valid), 3000 random edits\n", n, n * 8,
         loaded);
  free(b);
  free(orig);
}

/* Many names: the dict's hash index through its growth (every name found at its position,
** replacement in place, metadata alike), and a header of 100,000 tensors, which loads in
** linear time (a lookup scan per name made such a file take minutes). */
static void test_many(void) {
  enum { N = 100000 };
  kiln_dict *d = kiln_dict_new();
  kiln_tensor *a = kiln_zeros(KILN_SHAPE(1), KILN_U8, kiln_device_cpu());
  kiln_tensor *b = kiln_zeros(KILN_SHAPE(2), KILN_U8, kiln_device_cpu());
  char k[64], v[64];
  int bad = 0;
  for (int i = 0; i < N && !bad; i++) {
    snprintf(k, sizeof k, "h.%d.w", i);
    snprintf(v, sizeof v, "%d", i);
    bad = kiln_dict_set(d, k, a) != KILN_OK || kiln_dict_set_meta(d, k, v) != KILN_OK;
  }
  CHECK(!bad && kiln_dict_size(d) == N && kiln_dict_meta_size(d) == N);
  for (int i = 0; i < N; i += 7) { /* replaced in place: sizes and order stay */
    snprintf(k, sizeof k, "h.%d.w", i);
    bad |= kiln_dict_set(d, k, b) != KILN_OK || kiln_dict_set_meta(d, k, "r") != KILN_OK;
  }
  CHECK(!bad && kiln_dict_size(d) == N && kiln_dict_meta_size(d) == N);
  for (int i = 0; i < N && !bad; i++) {
    snprintf(k, sizeof k, "h.%d.w", i);
    snprintf(v, sizeof v, "%d", i);
    const char *m = kiln_dict_get_meta(d, k);
    bad = strcmp(kiln_dict_key(d, i), k) != 0 || kiln_dict_get(d, k) != (i % 7 ? a : b) ||
          !m || strcmp(m, i % 7 ? v : "r") != 0 || strcmp(kiln_dict_meta_key(d, i), k) != 0;
  }
  CHECK(!bad);
  CHECK(kiln_dict_get(d, "h.100000.w") == NULL && kiln_dict_get_meta(d, "h.-1.w") == NULL);
  char out[300];
  snprintf(out, sizeof out, "%s/many.safetensors", g_tmp);
  CHECK(kiln_safetensors_save(out, d) == KILN_OK);
  kiln_dict_free(d);
  kiln_tensor_free(a);
  kiln_tensor_free(b);
  d = kiln_safetensors_load(out, kiln_device_cpu());
  CHECK(d && kiln_dict_size(d) == N && kiln_dict_meta_size(d) == N);
  CHECK(d && kiln_numel(kiln_dict_get(d, "h.99999.w")) == 1 && kiln_numel(kiln_dict_get(d, "h.7.w")) == 2 &&
        !strcmp(kiln_dict_get_meta(d, "h.5.w"), "5"));
  kiln_dict_free(d);
}

/* kiln_safetensors_open: the header alone, tensors read one by one with the bytes and the
** order kiln_safetensors_load gives; bad indices, a file cut short after it was opened, and a
** 4 GiB tensor (a sparse file) listed without its bytes being read. */
/* A quantized checkpoint's dtypes (F8_E4M3, F4, U16, ...) are listed by open, with the
** file's dtype name and byte size, and refused by read and load (KILN_ERR_DTYPE naming the
** tensor); the held tensors beside them still read. F4 packs two elements per byte: an odd
** count is not a whole number of bytes. */
static void test_unheld_dtypes(void) {
  const char *hdr = "{\"q\":{\"dtype\":\"F8_E4M3\",\"shape\":[2,3],\"data_offsets\":[0,6]},"
                    "\"s\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[6,14]},"
                    "\"p\":{\"dtype\":\"F4\",\"shape\":[4,2],\"data_offsets\":[14,18]},"
                    "\"u\":{\"dtype\":\"U16\",\"shape\":[1],\"data_offsets\":[18,20]}}";
  kiln_clear_error();
  kiln_dict *d = load_crafted(hdr, 20);
  CHECK(!d && kiln_last_error() == KILN_ERR_DTYPE && strstr(kiln_last_error_message(), "tensor 'q'") &&
        strstr(kiln_last_error_message(), "F8_E4M3") && strstr(kiln_last_error_message(), "kiln_safetensors_open"));
  kiln_dict_free(d);
  char p[300];
  snprintf(p, sizeof p, "%s/crafted.safetensors", g_tmp);
  kiln_safetensors *f = kiln_safetensors_open(p);
  CHECK(f && kiln_safetensors_count(f) == 4);
  if (!f) return;
  static const struct {
    const char *name, *dtype;
    int64_t nbytes;
    bool held;
  } want[] = {{"q", "F8_E4M3", 6, false}, {"s", "F32", 8, true}, {"p", "F4", 4, false}, {"u", "U16", 2, false}};
  for (int k = 0; k < 4; k++) {
    int i = kiln_safetensors_find(f, want[k].name);
    kiln_dtype dt = KILN_F64;
    int64_t shape[KILN_MAX_DIMS];
    CHECK(i == k && kiln_safetensors_info(f, i, &dt, shape) >= 1 &&
          !strcmp(kiln_safetensors_dtype(f, i), want[k].dtype) && kiln_safetensors_nbytes(f, i) == want[k].nbytes &&
          (dt == KILN_DTYPE__COUNT) == !want[k].held);
    kiln_clear_error();
    kiln_tensor *t = kiln_safetensors_read(f, i, kiln_device_cpu());
    if (want[k].held) {
      CHECK(t && kiln_numel(t) == 2);
    } else {
      CHECK(!t && kiln_last_error() == KILN_ERR_DTYPE && strstr(kiln_last_error_message(), want[k].dtype) &&
            strstr(kiln_last_error_message(), "kiln_safetensors_read"));
    }
    kiln_tensor_free(t);
  }
  CHECK(kiln_safetensors_dtype(f, 4) == NULL && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT);
  CHECK(kiln_safetensors_nbytes(f, -1) == -1 && kiln_safetensors_dtype(NULL, 0) == NULL);
  kiln_safetensors_close(f);
  expect_error("{\"p\":{\"dtype\":\"F4\",\"shape\":[3],\"data_offsets\":[0,2]}}", 2, KILN_ERR_FORMAT,
               "not a whole number of bytes");
  expect_error("{\"p\":{\"dtype\":\"F6_E2M3\",\"shape\":[4],\"data_offsets\":[0,4]}}", 4, KILN_ERR_FORMAT,
               "need 3");
  kiln_clear_error();
}

/* A sharded checkpoint's index opens its shards once each, in the map's order; the index's
** own problems name it. (test_nn_gpt_hf checks the wrong-shard and duplicate cases.) */
static void test_open_index(void) {
  char a[300], b[300], ix[300];
  snprintf(a, sizeof a, "%s/model-00001-of-00002.safetensors", g_tmp);
  snprintf(b, sizeof b, "%s/model-00002-of-00002.safetensors", g_tmp);
  snprintf(ix, sizeof ix, "%s/model.safetensors.index.json", g_tmp);
  kiln_scope_begin();
  kiln_dict *d = kiln_dict_new();
  kiln_dict_set(d, "x", kiln_ones(KILN_SHAPE(2), KILN_F32, kiln_device_cpu()));
  kiln_dict_set(d, "y", kiln_ones(KILN_SHAPE(3), KILN_F32, kiln_device_cpu()));
  CHECK(kiln_safetensors_save(b, d) == KILN_OK);
  kiln_dict_free(d);
  d = kiln_dict_new();
  kiln_dict_set(d, "z", kiln_zeros(KILN_SHAPE(1), KILN_I64, kiln_device_cpu()));
  CHECK(kiln_safetensors_save(a, d) == KILN_OK);
  kiln_dict_free(d);
  kiln_scope_end();
  const char map[] = "{\"metadata\": {\"total_size\": 28}, \"weight_map\": {\"y\": \"model-00002-of-00002.safetensors\", "
                     "\"z\": \"model-00001-of-00002.safetensors\", \"x\": \"model-00002-of-00002.safetensors\"}}";
  write_all(ix, map, sizeof map - 1);
  kiln_safetensors **sh = NULL;
  int n = kiln_safetensors_open_index(ix, &sh);
  CHECK(n == 2 && sh && !strcmp(kiln_safetensors_path(sh[0]), b) && !strcmp(kiln_safetensors_path(sh[1]), a) &&
        kiln_safetensors_count(sh[0]) == 2 && kiln_safetensors_find(sh[1], "z") == 0);
  for (int i = 0; i < n; i++) kiln_safetensors_close(sh[i]);
  free(sh);
  const char *bad[] = {"{\"metadata\": {}}", "{\"weight_map\": []}", "{\"weight_map\": {\"x\": \"../x\"}}",
                       "{\"weight_map\": {\"x\": \"model-00002-of-00002.safetensors\"}", "[]"};
  const char *why[] = {"no \"weight_map\"", "not an object", "not a file name", "expected", "expected '{'"};
  for (int k = 0; k < 5; k++) {
    write_all(ix, bad[k], strlen(bad[k]));
    sh = (kiln_safetensors **)&n; /* overwritten with NULL on failure */
    n = kiln_safetensors_open_index(ix, &sh);
    bool ok = n == -1 && !sh && kiln_last_error() == KILN_ERR_FORMAT && strstr(kiln_last_error_message(), why[k]) &&
              strstr(kiln_last_error_message(), "index.json");
    if (!ok) fprintf(stderr, "index %s: %d %s\n", bad[k], n, kiln_last_error_message());
    CHECK(ok);
  }
  /* a shard that is not there: its own error (IO), said where the index names it */
  const char gone[] = "{\"weight_map\": {\"x\": \"model-00009-of-00009.safetensors\"}}";
  write_all(ix, gone, sizeof gone - 1);
  CHECK(kiln_safetensors_open_index(ix, &sh) == -1 && kiln_last_error() == KILN_ERR_IO &&
        strstr(kiln_last_error_message(), "index.json:1: byte") && strstr(kiln_last_error_message(), "the shard of x") &&
        strstr(kiln_last_error_message(), "model-00009-of-00009"));
  CHECK(kiln_safetensors_open_index(ix, NULL) == -1 && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT);
  CHECK(kiln_safetensors_open_index(NULL, &sh) == -1 && !sh);
  CHECK(kiln_safetensors_path(NULL) == NULL);
  remove(a), remove(b), remove(ix);
  kiln_clear_error();
}

static void test_open(void) {
  kiln_safetensors *f = kiln_safetensors_open(g_fixture);
  kiln_dict *d = kiln_safetensors_load(g_fixture, kiln_device_cpu());
  CHECK(f && d && kiln_safetensors_count(f) == 10 && kiln_dict_size(d) == 10);
  if (!f || !d) {
    kiln_safetensors_close(f);
    kiln_dict_free(d);
    return;
  }
  kiln_dict *r = kiln_dict_new(); /* the tensors read one by one, then checked as a whole */
  for (int i = 0; i < kiln_safetensors_count(f); i++) {
    const char *name = kiln_safetensors_name(f, i);
    kiln_tensor *want = kiln_dict_value(d, i);
    kiln_dtype dt = KILN_F64;
    int64_t shape[KILN_MAX_DIMS];
    int nd = kiln_safetensors_info(f, i, &dt, shape);
    int same = name && !strcmp(name, kiln_dict_key(d, i)) && nd == kiln_ndim(want) && dt == kiln_dtype_of(want);
    for (int k = 0; same && k < nd; k++) same = shape[k] == kiln_size(want, k);
    CHECK(same && kiln_safetensors_find(f, name) == i && kiln_safetensors_info(f, i, NULL, NULL) == nd);
    kiln_tensor *t = kiln_safetensors_read(f, i, kiln_device_cpu());
    CHECK(t && kiln_dict_set(r, name, t) == KILN_OK);
    kiln_tensor_free(t);
  }
  const kiln_dict *m = kiln_safetensors_metadata(f);
  for (int i = 0; m && i < kiln_dict_meta_size(m); i++)
    kiln_dict_set_meta(r, kiln_dict_meta_key(m, i), kiln_dict_meta_value(m, i));
  CHECK(m && kiln_dict_size(m) == 0 && check_fixture_dict(r));
  kiln_dict_free(r);
  kiln_dict_free(d);
  CHECK(kiln_safetensors_find(f, "nope") == -1 && kiln_safetensors_find(f, "a.f3") == -1 &&
        kiln_safetensors_find(f, NULL) == -1 && kiln_safetensors_find(NULL, "a.f32") == -1);
  /* the usual rule: a read inside a scope is the scope's */
  int64_t live = kiln_live_tensors();
  kiln_scope_begin();
  CHECK(kiln_safetensors_read(f, kiln_safetensors_find(f, "a.f32"), kiln_device_cpu()) != NULL);
  kiln_scope_end();
  CHECK(kiln_live_tensors() == live);
  kiln_clear_error();
  CHECK(kiln_safetensors_name(f, 10) == NULL && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT &&
        strstr(kiln_last_error_message(), "tensor index 10 out of range (the file holds 10)"));
  CHECK(kiln_safetensors_info(f, -1, NULL, NULL) == -1 && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT);
  CHECK(kiln_safetensors_read(f, 10, kiln_device_cpu()) == NULL && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT);
  CHECK(kiln_safetensors_read(NULL, 0, kiln_device_cpu()) == NULL && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT);
  CHECK(kiln_safetensors_count(NULL) == 0 && kiln_safetensors_metadata(NULL) == NULL);
  kiln_safetensors_close(f);
  kiln_safetensors_close(NULL);
  /* the same checks as load, named for open */
  CHECK(kiln_safetensors_open(NULL) == NULL && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT);
  char p[300];
  snprintf(p, sizeof p, "%s/crafted.safetensors", g_tmp);
  kiln_dict_free(load_crafted("{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
                              "\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]}}",
                              2));
  CHECK(kiln_safetensors_open(p) == NULL && kiln_last_error() == KILN_ERR_FORMAT &&
        strstr(kiln_last_error_message(), "kiln_safetensors_open: ") &&
        strstr(kiln_last_error_message(), "duplicate tensor name 'a'"));
  /* cut short after the open: the read names the tensor and the offset; others still read */
  size_t n;
  unsigned char *b = read_all(g_fixture, &n);
  CHECK(b != NULL);
  if (!b) return;
  write_all(p, b, n);
  free(b);
  f = kiln_safetensors_open(p);
  CHECK(f != NULL);
  if (!f) return;
  CHECK(truncate(p, (off_t)(n - 1)) == 0);
  int last = kiln_safetensors_count(f) - 1, first = 0;
  while (last > 0 && !strcmp(kiln_safetensors_name(f, last), "empty")) last--; /* the last with bytes */
  kiln_clear_error();
  CHECK(kiln_safetensors_read(f, last, kiln_device_cpu()) == NULL && kiln_last_error() == KILN_ERR_IO &&
        strstr(kiln_last_error_message(), "kiln_safetensors_read: ") &&
        strstr(kiln_last_error_message(), "unexpected end of file"));
  kiln_tensor *t = kiln_safetensors_read(f, first, kiln_device_cpu());
  CHECK(t != NULL);
  kiln_tensor_free(t);
  kiln_safetensors_close(f);
  /* 4 GiB of one tensor, the data a hole in a sparse file: listed, found, not read */
  const char *hdr = "{\"big\":{\"dtype\":\"U8\",\"shape\":[65536,65536],\"data_offsets\":[0,4294967296]}}";
  size_t hl = strlen(hdr);
  unsigned char h8[8];
  for (int i = 0; i < 8; i++) h8[i] = (unsigned char)((uint64_t)hl >> (8 * i));
  FILE *out = fopen(p, "wb");
  int ok = out && fwrite(h8, 1, 8, out) == 8 && fwrite(hdr, 1, hl, out) == hl && fclose(out) == 0;
  CHECK(ok && truncate(p, (off_t)(8 + hl) + ((off_t)1 << 32)) == 0);
  live = kiln_live_tensors();
  f = kiln_safetensors_open(p);
  int64_t shape[KILN_MAX_DIMS] = {0};
  CHECK(f && kiln_live_tensors() == live && kiln_safetensors_find(f, "big") == 0 && kiln_safetensors_info(f, 0, NULL, shape) == 2 &&
        shape[0] == 65536 && shape[1] == 65536);
  kiln_safetensors_close(f);
  unlink(p);
}

int main(void) {
  snprintf(g_fixture, sizeof g_fixture, "%s", fixture("all_dtypes.safetensors"));
  if (scratch_begin(g_tmp, sizeof g_tmp, "st") != 0) return 1;
  int64_t live0 = kiln_live_tensors();
  test_reference_file();
  test_dict_api();
  test_atomic();
  test_crafted_errors();
  test_names();
  test_many();
  test_open();
  test_unheld_dtypes();
  test_open_index();
  test_fuzz();
  CHECK(kiln_live_tensors() == live0);
  scratch_end(g_tmp);
  return check_finish("test_io_safetensors");
}
