#version 450
// MATMUL f16 on tensor cores (matmul_cmv.glsl), variant h: 256x128 tiles, 4x2 subgroups of 64x64, K steps of 16, 2 shared buffer(s)
#define WM 4
#define WN 2
#define FM 4
#define FN 4
#define BK 16
#define STAGES 2
#include "matmul_cmv.glsl"
