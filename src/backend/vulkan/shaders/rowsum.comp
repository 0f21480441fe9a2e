#version 450
// rowsum.glsl with the shared-memory tree
#define KV_SUBGROUP 0
#include "rowsum.glsl"
