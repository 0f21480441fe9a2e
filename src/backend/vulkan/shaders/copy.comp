#version 450
// COPY for devices without shaderFloat64
#include "copy.glsl"
