#version 450
// ce_mean.glsl with the shared-memory tree
#define KV_SUBGROUP 0
#include "ce_mean.glsl"
