#version 450
// softmax.glsl with subgroup arithmetic
#define KV_SUBGROUP 1
#include "softmax.glsl"
