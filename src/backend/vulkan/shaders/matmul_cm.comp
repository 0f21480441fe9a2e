#version 450
// MATMUL f16 on tensor cores: 128x128 tiles, 8 subgroups of 64x32, K steps of 32 (matmul_cm.glsl)
#define WM 2
#define WN 4
#define FM 4
#define FN 2
#define BK 32
#include "matmul_cm.glsl"
