#version 450
// MATMUL f16 on tensor cores: 128x128 tiles, 4 subgroups of 64x64, K steps of 32 (matmul_cm.glsl)
#define WM 2
#define WN 2
#define FM 4
#define FN 4
#define BK 32
#include "matmul_cm.glsl"
