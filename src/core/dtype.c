/* Dtype names, sizes, promotion and the scalar 16-bit float conversions. */
#include "kiln_int.h"
#include "half.h"

static const char *const dtype_names[KILN_DTYPE__COUNT] = {
    "float32", "float64", "float16", "bfloat16", "int64", "int32", "uint8", "bool"};
static const size_t dtype_sizes[KILN_DTYPE__COUNT] = {4, 8, 2, 2, 8, 4, 1, 1};

const char *kiln_dtype_name(kiln_dtype dt) {
  if ((int)dt < 0 || dt >= KILN_DTYPE__COUNT) return "?";
  return dtype_names[dt];
}

size_t kiln_dtype_size(kiln_dtype dt) {
  if ((int)dt < 0 || dt >= KILN_DTYPE__COUNT) return 0;
  return dtype_sizes[dt];
}

bool kiln_dtype_is_float(kiln_dtype dt) {
  return dt == KILN_F32 || dt == KILN_F64 || dt == KILN_F16 || dt == KILN_BF16;
}

/* Rank within a category: bool < u8 < i32 < i64 < (f16, bf16) < f32 < f64. f16 with bf16
** goes to f32, as in PyTorch. */
static int dtype_rank(kiln_dtype dt) {
  switch (dt) {
  case KILN_BOOL: return 0;
  case KILN_U8: return 1;
  case KILN_I32: return 2;
  case KILN_I64: return 3;
  case KILN_F16: return 4;
  case KILN_BF16: return 4;
  case KILN_F32: return 5;
  case KILN_F64: return 6;
  default: return -1;
  }
}

kiln_dtype kiln_dtype_promote(kiln_dtype a, kiln_dtype b) {
  if (a == b) return a;
  if ((a == KILN_F16 && b == KILN_BF16) || (a == KILN_BF16 && b == KILN_F16)) return KILN_F32;
  return dtype_rank(a) >= dtype_rank(b) ? a : b;
}

uint16_t kiln_f32_to_f16(float f) { return kiln__f32_to_f16(f); }
float kiln_f16_to_f32(uint16_t h) { return kiln__f16_to_f32(h); }
uint16_t kiln_f32_to_bf16(float f) { return kiln__f32_to_bf16(f); }
float kiln_bf16_to_f32(uint16_t b) { return kiln__bf16_to_f32(b); }
