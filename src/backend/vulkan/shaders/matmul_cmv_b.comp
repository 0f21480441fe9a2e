#version 450
// MATMUL f16 on tensor cores (matmul_cmv.glsl), variant b: 128x128 tiles, 2x4 subgroups of 64x32, K steps of 64, 1 shared buffer(s)
#define WM 2
#define WN 4
#define FM 4
#define FN 2
#define BK 64
#define STAGES 1
#include "matmul_cmv.glsl"
