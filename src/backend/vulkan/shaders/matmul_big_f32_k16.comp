#version 450
// MATMUL, register-blocked 128x128 tiles, A and B of f32, K steps of 16 (matmul_big.glsl)
#define KV_ELEM 0
#define BK 16
#include "matmul_big.glsl"
