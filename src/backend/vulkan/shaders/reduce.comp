#version 450
// reduce.glsl with the shared-memory tree
#define KV_SUBGROUP 0
#include "reduce.glsl"
