#version 450
// ce.glsl with subgroup arithmetic
#define KV_SUBGROUP 1
#include "ce.glsl"
