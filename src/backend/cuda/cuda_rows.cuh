/*
** Row reductions shared by the softmax family (cuda_softmax.cu) and cross-entropy
** (cuda_cross_entropy.cu): a row's (max, sum of exponentials) found in one pass, combined
** across a group of threads. C++ only; not API.
*/
#ifndef KILN_CUDA_ROWS_CUH
#define KILN_CUDA_ROWS_CUH

#include <math.h>

#include "cuda_ew.cuh"

/* (max, sum of exp(x - max)) pairs combine associatively. */
template <class A> __device__ __forceinline__ void ms_combine(A &m, A &s, A m2, A s2) {
  if (m2 == -(A)INFINITY) return;
  if (m == -(A)INFINITY) {
    m = m2;
    s = s2;
    return;
  }
  if (m2 > m) {
    s = s * kc_exp(m - m2) + s2;
    m = m2;
  } else {
    s = s + s2 * kc_exp(m2 - m);
  }
}

/* Sum over a group of G threads (all in the block when G > 32); every lane gets it. */
template <class A, int G> __device__ __forceinline__ A group_sum(A v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if constexpr (G > 32) {
    __shared__ A part[G / 32];
    __syncthreads(); /* part may still be read from a previous call */
    if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
    __syncthreads();
    v = 0;
#pragma unroll
    for (int w = 0; w < G / 32; w++) v += part[w];
  }
  return v;
}
template <class A, int G> __device__ __forceinline__ void group_ms(A &m, A &s) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    A m2 = __shfl_xor_sync(0xffffffffu, m, o);
    A s2 = __shfl_xor_sync(0xffffffffu, s, o);
    ms_combine(m, s, m2, s2);
  }
  if constexpr (G > 32) {
    __shared__ A pm[G / 32], ps[G / 32];
    __syncthreads();
    if (threadIdx.x % 32 == 0) {
      pm[threadIdx.x / 32] = m;
      ps[threadIdx.x / 32] = s;
    }
    __syncthreads();
    m = -(A)INFINITY;
    s = 0;
#pragma unroll
    for (int w = 0; w < G / 32; w++) ms_combine(m, s, pm[w], ps[w]);
  }
}

#endif
