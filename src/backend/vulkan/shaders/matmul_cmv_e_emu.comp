#version 450
// MATMUL f16, tensor cores emulated (tests, KILN_VK_CM_EMU=1) (matmul_cmv.glsl), variant e: 256x128 tiles, 4x2 subgroups of 64x64, K steps of 32, 1 shared buffer(s)
#define WM 4
#define WN 2
#define FM 4
#define FN 4
#define BK 32
#define STAGES 1
#define KV_CM_EMU 1
#include "matmul_cmv.glsl"
