#version 450
// ce.glsl with the shared-memory tree
#define KV_SUBGROUP 0
#include "ce.glsl"
