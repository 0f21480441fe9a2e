#version 450
// softmax.glsl with the shared-memory tree
#define KV_SUBGROUP 0
#include "softmax.glsl"
