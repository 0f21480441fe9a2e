#version 450
// COPY with f64 casts (devices with shaderFloat64)
#define KV_HAVE_F64 1
#include "copy.glsl"
