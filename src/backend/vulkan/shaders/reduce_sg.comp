#version 450
// reduce.glsl with subgroup arithmetic
#define KV_SUBGROUP 1
#include "reduce.glsl"
