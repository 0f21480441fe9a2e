#version 450
// MATMUL, register-blocked 128x128 tiles, A and B of f32: matmul_big.glsl
#define KV_ELEM 0
#include "matmul_big.glsl"
