#version 450
// MATMUL f16 on tensor cores (matmul_cmv.glsl), variant g: 128x128 tiles, 4x2 subgroups of 32x64, K steps of 32, 2 shared buffer(s)
#define WM 4
#define WN 2
#define FM 2
#define FN 4
#define BK 32
#define STAGES 2
#include "matmul_cmv.glsl"
