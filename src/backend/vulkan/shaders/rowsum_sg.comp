#version 450
// rowsum.glsl with subgroup arithmetic
#define KV_SUBGROUP 1
#include "rowsum.glsl"
