#version 450
// MATMUL f16 on tensor cores (matmul_cmv.glsl), variant f: 128x256 tiles, 2x4 subgroups of 64x64, K steps of 16, 2 shared buffer(s)
#define WM 2
#define WN 4
#define FM 4
#define FN 4
#define BK 16
#define STAGES 2
#include "matmul_cmv.glsl"
