#version 450
// MATMUL bf16 on tensor cores through f16 with per-line scales: 128x256 tiles, 8 subgroups of 64x64, K steps of 16 (matmul_cm.glsl)
#define KV_CM_BF16 1
#define WM 2
#define WN 4
#define FM 4
#define FN 4
#define BK 16
#include "matmul_cm.glsl"
