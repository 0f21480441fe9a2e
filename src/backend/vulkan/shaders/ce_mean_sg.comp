#version 450
// ce_mean.glsl with subgroup arithmetic
#define KV_SUBGROUP 1
#include "ce_mean.glsl"
