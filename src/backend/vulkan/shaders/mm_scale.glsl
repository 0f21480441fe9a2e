// The power-of-two scale of one line (a row of A or a column of B) of a bf16 product run
// on f16 tensor cores (mm_cvt_f16.comp, matmul_cmv.glsl): from the line's largest |x|, as
// f32 bits mb (mm_absmax.comp), 2^(15 - e) for a largest in [2^(e-1), 2^e), which brings
// it into [2^14, 2^15), below f16's largest (65504); 1 for an all-zero line and for one
// holding an infinity or a NaN. Exact for every element within 2^-28 of its line's
// largest; smaller ones lose bits (f16 subnormals), far below the f32 accumulation's
// rounding.
float mm_line_scale(uint mb) {
  float mx = uintBitsToFloat(mb);
  if (mb == 0u || mb >= 0x7F800000u) return 1.0;
  int e;
  frexp(mx, e);
  return exp2(float(clamp(15 - e, -126, 127)));
}
