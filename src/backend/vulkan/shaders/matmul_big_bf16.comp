#version 450
// MATMUL, register-blocked 128x128 tiles, A and B of bf16: matmul_big.glsl
#define KV_ELEM 2
#include "matmul_big.glsl"
