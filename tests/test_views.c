/*
** Views share storage: writing through each view kind with kiln_copy_/kiln_fill_ shows
** in the base. Shapes and strides of each view, and errors on invalid views.
*/
#include "harness.h"

#include <stdlib.h>
#include <string.h>

static kiln_device cpu;

/* base = arange(24) as f64 (2, 3, 4) */
static kiln_tensor *base24(void) {
  return kiln_reshape(kiln_arange(0, 24, 1, KILN_F64, cpu), KILN_SHAPE(2, 3, 4));
}

static double at(kiln_tensor *t, int64_t i, int64_t j, int64_t k) {
  return kiln_get(t, (int64_t[]){i, j, k});
}

static bool shape_is(kiln_tensor *t, int nd, const int64_t *s) {
  if (!t || kiln_ndim(t) != nd) return false;
  for (int i = 0; i < nd; i++)
    if (kiln_shape(t)[i] != s[i]) return false;
  return true;
}
#define SHAPE_IS(t, ...) shape_is((t), KILN_SHAPE(__VA_ARGS__))

static void test_shapes_and_values(void) {
  kiln_scope_begin();
  kiln_tensor *b = base24();
  char buf[64];
  kiln_tensor *v = kiln_view(b, KILN_SHAPE(6, 4));
  H_CHECK(SHAPE_IS(v, 6, 4) && kiln_get(v, (int64_t[]){5, 3}) == 23, "view [6,4]: got %s",
          kiln_shape_str(v, buf, 64));
  v = kiln_view(b, KILN_SHAPE(-1, 8));
  H_CHECK(SHAPE_IS(v, 3, 8), "view [-1, 8] infers 3: got %s", kiln_shape_str(v, buf, 64));
  v = kiln_view(b, KILN_SHAPE(24));
  H_CHECK(SHAPE_IS(v, 24) && kiln_get(v, (int64_t[]){17}) == 17, "view [24]");
  v = kiln_view(b, KILN_SHAPE(2, 1, 3, 4, 1));
  H_CHECK(SHAPE_IS(v, 2, 1, 3, 4, 1), "view with added size-1 dims");
  kiln_tensor *f = kiln_flatten(b, 1, 2);
  H_CHECK(SHAPE_IS(f, 2, 12) && kiln_get(f, (int64_t[]){1, 11}) == 23, "flatten(1, 2) [2, 12]");
  f = kiln_flatten(b, 0, -1);
  H_CHECK(SHAPE_IS(f, 24), "flatten(0, -1) [24]");
  kiln_tensor *p = kiln_permute(b, KILN_DIMS(2, 0, 1));
  H_CHECK(SHAPE_IS(p, 4, 2, 3) && at(p, 3, 1, 2) == at(b, 1, 2, 3) && !kiln_is_contiguous(p),
          "permute (2, 0, 1)");
  H_CHECK(p && kiln_strides(p)[0] == 1 && kiln_strides(p)[1] == 12 && kiln_strides(p)[2] == 4,
          "permute strides [1, 12, 4]");
  kiln_tensor *t = kiln_transpose(b, 0, -1);
  H_CHECK(SHAPE_IS(t, 4, 3, 2) && at(t, 3, 2, 1) == 23, "transpose(0, -1)");
  kiln_tensor *n = kiln_narrow(b, 2, 1, 2);
  H_CHECK(SHAPE_IS(n, 2, 3, 2) && at(n, 0, 0, 0) == 1 && at(n, 1, 2, 1) == 22, "narrow(2, 1, 2)");
  kiln_tensor *s = kiln_slice(b, 2, 0, 4, 2);
  H_CHECK(SHAPE_IS(s, 2, 3, 2) && at(s, 0, 0, 1) == 2 && kiln_strides(s)[2] == 2, "slice ::2");
  s = kiln_slice(b, 1, -2, 100, 1);
  H_CHECK(SHAPE_IS(s, 2, 2, 4) && at(s, 0, 0, 0) == 4, "slice -2:100 clamps");
  s = kiln_slice(b, 1, 2, 1, 1);
  H_CHECK(SHAPE_IS(s, 2, 0, 4), "slice 2:1 is empty");
  kiln_tensor *se = kiln_select(b, 1, 2);
  H_CHECK(SHAPE_IS(se, 2, 4) && kiln_get(se, (int64_t[]){1, 3}) == 23, "select(1, 2)");
  se = kiln_select(b, 0, -1);
  H_CHECK(SHAPE_IS(se, 3, 4) && kiln_get(se, (int64_t[]){0, 0}) == 12, "select(0, -1)");
  kiln_tensor *u = kiln_unsqueeze(b, 1);
  H_CHECK(SHAPE_IS(u, 2, 1, 3, 4), "unsqueeze(1)");
  u = kiln_unsqueeze(b, -1);
  H_CHECK(SHAPE_IS(u, 2, 3, 4, 1), "unsqueeze(-1) adds a last dim");
  kiln_tensor *q = kiln_squeeze(u, -1);
  H_CHECK(SHAPE_IS(q, 2, 3, 4), "squeeze(-1)");
  kiln_tensor *qa = kiln_squeeze_all(kiln_view(b, KILN_SHAPE(1, 2, 1, 12, 1)));
  H_CHECK(SHAPE_IS(qa, 2, 12), "squeeze_all");
  kiln_tensor *row = kiln_view(kiln_arange(0, 4, 1, KILN_F64, cpu), KILN_SHAPE(1, 4));
  kiln_tensor *e = kiln_expand(row, KILN_SHAPE(2, 3, 4));
  H_CHECK(SHAPE_IS(e, 2, 3, 4) && at(e, 1, 2, 3) == 3 && kiln_strides(e)[0] == 0 &&
              kiln_strides(e)[1] == 0,
          "expand [1,4] -> [2,3,4] with stride 0");
  e = kiln_expand(row, KILN_SHAPE(3, -1));
  H_CHECK(SHAPE_IS(e, 3, 4), "expand with -1 keeps a size");
  kiln_tensor *pieces[4] = {0};
  int np = kiln_split(b, 2, 2, pieces, 4);
  H_CHECK(np == 2 && SHAPE_IS(pieces[1], 2, 3, 2) && at(pieces[1], 0, 0, 0) == 2, "split(2, dim 2)");
  np = kiln_split(b, 2, 1, pieces, 4);
  H_CHECK(np == 2 && SHAPE_IS(pieces[0], 2, 2, 4) && SHAPE_IS(pieces[1], 2, 1, 4),
          "split(2, dim 1) gives [2,2,4] and [2,1,4]");
  /* reshape of a non-viewable tensor copies */
  kiln_tensor *r = kiln_reshape(t, KILN_SHAPE(24));
  H_CHECK(r && kiln_get(r, (int64_t[]){1}) == 12, "reshape of a transpose copies in C order");
  kiln_tensor *rv = kiln_reshape(b, KILN_SHAPE(4, 6));
  H_CHECK(rv && kiln_get(rv, (int64_t[]){3, 5}) == 23, "reshape of a contiguous tensor");
  /* a view of a view: narrow then transpose then select */
  kiln_tensor *vv = kiln_select(kiln_transpose(kiln_narrow(b, 1, 1, 2), 1, 2), 2, 1);
  H_CHECK(SHAPE_IS(vv, 2, 4) && kiln_get(vv, (int64_t[]){1, 2}) == 22, "a view of a view");
  kiln_scope_end();
}

/* Fills the view with -1 and counts how many base elements became -1. */
static int64_t writes_through(kiln_tensor *b, kiln_tensor *v, bool use_copy) {
  kiln_status st;
  if (use_copy) st = kiln_copy_(v, kiln_full(KILN_SHAPE0, -1, KILN_F64, cpu));
  else st = kiln_fill_(v, -1);
  if (st != KILN_OK) return -1;
  int64_t n = 0, cnt = 0;
  double *vals = h_values(b, &n);
  for (int64_t k = 0; vals && k < n; k++) cnt += vals[k] == -1;
  free(vals);
  return cnt;
}

static void test_sharing(void) {
  struct {
    const char *name;
    int64_t expect;
  } cases[] = {{"view", 24}, {"reshape", 24}, {"flatten", 24}, {"permute", 24},
               {"transpose", 24}, {"narrow", 12}, {"slice ::2", 12}, {"select", 8},
               {"squeeze", 24}, {"unsqueeze", 24}, {"split piece", 12},
               {"slice of a transpose", 6}};
  int nc = (int)(sizeof cases / sizeof cases[0]);
  for (int use_copy = 0; use_copy < 2; use_copy++)
    for (int i = 0; i < nc; i++) {
      kiln_scope_begin();
      kiln_tensor *b = base24(), *v = NULL, *pieces[4];
      switch (i) {
      case 0: v = kiln_view(b, KILN_SHAPE(4, 6)); break;
      case 1: v = kiln_reshape(b, KILN_SHAPE(12, 2)); break;
      case 2: v = kiln_flatten(b, 0, 1); break;
      case 3: v = kiln_permute(b, KILN_DIMS(1, 2, 0)); break;
      case 4: v = kiln_transpose(b, 1, 2); break;
      case 5: v = kiln_narrow(b, 2, 2, 2); break;
      case 6: v = kiln_slice(b, 2, 0, 4, 2); break;
      case 7: v = kiln_select(b, 1, 0); break;
      case 8: v = kiln_squeeze(kiln_unsqueeze(b, 0), 0); break;
      case 9: v = kiln_unsqueeze(b, 2); break;
      case 10: v = kiln_split(b, 1, 0, pieces, 4) == 2 ? pieces[1] : NULL; break;
      case 11: v = kiln_slice(kiln_transpose(b, 0, 2), 0, 1, 2, 1); break;
      }
      int64_t got = v ? writes_through(b, v, use_copy) : -2;
      H_CHECK(got == cases[i].expect, "%s through %s: %lld base elements written, want %lld",
              use_copy ? "copy_" : "fill_", cases[i].name, (long long)got, (long long)cases[i].expect);
      kiln_scope_end();
    }
  /* writing to the base is seen by the view; a specific element lands in place */
  kiln_scope_begin();
  kiln_tensor *b = base24();
  kiln_tensor *t = kiln_transpose(b, 0, 2); /* (4, 3, 2) */
  kiln_tensor *el = kiln_select(kiln_select(kiln_select(t, 0, 3), 0, 1), 0, 0);
  kiln_fill_(el, 100);
  H_CHECK(at(b, 0, 1, 3) == 100, "t[3][1][0] of transpose(0,2) is base[0][1][3]");
  kiln_copy_(kiln_narrow(b, 0, 1, 1), kiln_zeros(KILN_SHAPE(1, 3, 4), KILN_F64, cpu));
  H_CHECK(kiln_get(t, (int64_t[]){2, 1, 1}) == 0 && kiln_get(t, (int64_t[]){2, 1, 0}) == 6,
          "base written through narrow is seen by the transpose");
  kiln_scope_end();
}

static void test_errors(void) {
  kiln_scope_begin();
  kiln_tensor *b = base24();
  kiln_tensor *t = kiln_transpose(b, 0, 1);
  H_EXPECT_ERR(kiln_view(t, KILN_SHAPE(24)), KILN_ERR_SHAPE, "view of a transpose as [24]");
  H_EXPECT_ERR(kiln_view(b, KILN_SHAPE(5, 5)), KILN_ERR_SHAPE, "view [2,3,4] as [5,5]");
  kiln_tensor *r = kiln_view(b, KILN_SHAPE(-1, -1));
  H_CHECK(!r && kiln_last_error() != KILN_OK, "view with two -1 is an error");
  kiln_clear_error();
  r = kiln_view(b, KILN_SHAPE(-1, 5));
  H_CHECK(!r && kiln_last_error() == KILN_ERR_SHAPE, "view [-1, 5] of 24 elements: KILN_ERR_SHAPE");
  kiln_clear_error();
  r = kiln_permute(b, KILN_DIMS(0, 0, 1));
  H_CHECK(!r && kiln_last_error() != KILN_OK, "permute with a repeated dim is an error");
  kiln_clear_error();
  r = kiln_permute(b, KILN_DIMS(0, 1));
  H_CHECK(!r && kiln_last_error() != KILN_OK, "permute with too few dims is an error");
  kiln_clear_error();
  H_EXPECT_ERR(kiln_transpose(b, 0, 3), KILN_ERR_INVALID_ARGUMENT, "transpose dim 3 of 3-d");
  r = kiln_narrow(b, 2, 3, 2);
  H_CHECK(!r && kiln_last_error() != KILN_OK, "narrow past the end is an error");
  kiln_clear_error();
  r = kiln_narrow(b, 2, -1, 1);
  H_CHECK(!r || (kiln_size(r, 2) == 1 && at(r, 0, 0, 0) == 3),
          "narrow with a negative start counts back or is refused");
  kiln_clear_error();
  r = kiln_select(b, 0, 2);
  H_CHECK(!r && (kiln_last_error() == KILN_ERR_INDEX || kiln_last_error() == KILN_ERR_INVALID_ARGUMENT),
          "select index 2 of size 2 is an error (%s)", kiln_error_name(kiln_last_error()));
  kiln_clear_error();
  r = kiln_slice(b, 0, 0, 2, 0);
  H_CHECK(!r && kiln_last_error() != KILN_OK, "slice step 0 is an error");
  kiln_clear_error();
  r = kiln_slice(b, 0, 0, 2, -1);
  H_CHECK(!r && kiln_last_error() != KILN_OK, "slice with a negative step is an error");
  kiln_clear_error();
  r = kiln_squeeze(b, 0);
  H_CHECK(!r && kiln_last_error() != KILN_OK, "squeeze of a size-2 dim is an error");
  kiln_clear_error();
  H_EXPECT_ERR(kiln_expand(b, KILN_SHAPE(2, 5, 4)), KILN_ERR_SHAPE, "expand size 3 to 5");
  H_EXPECT_ERR(kiln_expand(b, KILN_SHAPE(3, 4)), KILN_ERR_SHAPE, "expand to fewer dims");
  H_EXPECT_ERR(kiln_unsqueeze(b, 5), KILN_ERR_INVALID_ARGUMENT, "unsqueeze(5) of 3-d");
  kiln_tensor *nine = kiln_view(kiln_ones(KILN_SHAPE(1, 1, 1, 1, 1, 1, 1, 1), KILN_F32, cpu),
                                KILN_SHAPE(1, 1, 1, 1, 1, 1, 1, 1));
  r = nine ? kiln_unsqueeze(nine, 0) : NULL;
  H_CHECK(!r && kiln_last_error() != KILN_OK, "unsqueeze past 8 dims is an error");
  kiln_clear_error();
  kiln_scope_end();
}

int main(int argc, char **argv) {
  h_init(argc, argv, "test_views");
  cpu = kiln_device_cpu();
  int64_t live0 = kiln_live_tensors();
  test_shapes_and_values();
  test_sharing();
  test_errors();
  H_CHECK(kiln_live_tensors() == live0, "no leaks: %lld -> %lld", (long long)live0,
          (long long)kiln_live_tensors());
  return h_finish();
}
