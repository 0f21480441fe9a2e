#version 450
// MATMUL f16, tensor cores emulated (tests, KILN_VK_CM_EMU=1) (matmul_cmv.glsl), variant i: 128x128 tiles, 2x2 subgroups of 64x64, K steps of 64, 1 shared buffer(s)
#define WM 2
#define WN 2
#define FM 4
#define FN 4
#define BK 64
#define STAGES 1
#define KV_CM_EMU 1
#include "matmul_cmv.glsl"
