/*
** cuBLASLt plans for cuda_matmul.cu (cuda_blaslt.cu): one per problem (epilogue, types,
** ops, M, N, K, leading dims, device), made on first use and kept, each with the
** algorithm it runs: the heuristic's first, or the fastest of its candidates with the
** same bits (lt_tune) for products of 2MNK >= kc_lt_tune_flops.
*/
#ifndef KILN_CUDA_BLASLT_CUH
#define KILN_CUDA_BLASLT_CUH

#include "cuda_int.cuh"

#include <cublasLt.h>
#include <cublas_v2.h>

/* A's and B's data type and the compute type (and whether it is DGEMM) of a kiln dtype;
** tf32 allows TF32 for f32. false: not a dtype cuBLAS multiplies. */
struct kc_blas_types {
  cudaDataType_t data;
  cublasComputeType_t compute;
  bool f64;
};
bool kc_blas_types_of(kiln_dtype dt, bool tf32, kc_blas_types *t);

/* The products lt_tune times: 2MNK at least this (2^30, ~2 us of an H100's bf16 products). */
extern const double kc_lt_tune_flops;

/* One 2-D product through its plan, kiln's row-major C = alpha A@B + beta C with the
** epilogue epi (bias, aux as it says). KILN_OK when done; KILN_ERR_UNSUPPORTED, without
** setting the last error, when cuBLASLt has no algorithm or refuses: the caller does it
** itself. */
kiln_status kc_lt_matmul(kiln__cuda_dev *d, cublasLtEpilogue_t epi, const kc_blas_types &t, cudaDataType_t cdata,
                         cublasOperation_t opB, cublasOperation_t opA, int64_t M, int64_t N, int64_t K,
                         const void *B, int64_t ldb, const void *A, int64_t lda, void *C, int64_t ldc,
                         const void *bias, float alpha, float beta, void *aux = NULL);

#endif
