/*
** The CPU backend's internal declarations: one entry point per kernel family (each
** switches on a->op), the memory functions of the vtable, and the fault-injection hook.
*/
#ifndef KILN_CPU_H
#define KILN_CPU_H

#include "../backend.h"
#include "../../core/knobs.h"

/* ---- memory (cpu_memory.c) ---- */
void *kiln__cpu_alloc(int device, size_t nbytes);
void kiln__cpu_free(int device, void *ptr, size_t nbytes);
kiln_status kiln__cpu_memcpy(int device, void *dst, const void *src, size_t nbytes);
kiln_status kiln__cpu_memset_zero(int device, void *ptr, size_t nbytes);
kiln_status kiln__cpu_synchronize(int device);
kiln_status kiln__cpu_memory_stats(int device, kiln_memory_stats *out);
kiln_status kiln__cpu_empty_cache(int device);
kiln_status kiln__cpu_set_memory_limit(int device, int64_t bytes);
void kiln__cpu_reset_peak(int device);
/* Fault injection for tests (SQLite/Lua style): after n more successful allocations,
** every allocation fails with KILN_ERR_OOM until this is called again; n < 0 turns it
** off. The env var KILN_CPU_FAIL_ALLOC_AFTER=N does the same from the first allocation. */
void kiln__cpu_fail_alloc_after(int64_t n);

/* ---- kernels ---- */
kiln_status kiln__cpu_copy(const kiln__kargs *a);
kiln_status kiln__cpu_fill(const kiln__kargs *a);
kiln_status kiln__cpu_arange(const kiln__kargs *a);
kiln_status kiln__cpu_eye(const kiln__kargs *a);
kiln_status kiln__cpu_unary(const kiln__kargs *a);    /* unary ops and their backward */
kiln_status kiln__cpu_binary(const kiln__kargs *a);   /* arithmetic and comparisons */
kiln_status kiln__cpu_where(const kiln__kargs *a);
kiln_status kiln__cpu_random(const kiln__kargs *a);
kiln_status kiln__cpu_reduce(const kiln__kargs *a);   /* SUM PROD AMAX AMIN */
kiln_status kiln__cpu_minmax_dim(const kiln__kargs *a);
kiln_status kiln__cpu_softmax(const kiln__kargs *a);  /* and LOG_SOFTMAX, backward ones */
kiln_status kiln__cpu_cross_entropy(const kiln__kargs *a);
kiln_status kiln__cpu_cross_entropy_backward(const kiln__kargs *a);
kiln_status kiln__cpu_cross_entropy_mean(const kiln__kargs *a);
kiln_status kiln__cpu_adam(const kiln__kargs *a); /* cpu_optim.c */
kiln_status kiln__cpu_adam_multi(const kiln__kargs *a);
kiln_status kiln__cpu_sgd_multi(const kiln__kargs *a); /* cpu_optim.c */
kiln_status kiln__cpu_cast_multi(const kiln__kargs *a); /* cpu_elementwise.c */
kiln_status kiln__cpu_amp_unscale(const kiln__kargs *a);
kiln_status kiln__cpu_amp_update_scale(const kiln__kargs *a);
kiln_status kiln__cpu_matmul(const kiln__kargs *a);
/* one row-major f32 GEMM for kernels with their own parallel loops (cpu_matmul.c) */
int kiln__cpu_sgemm(int ta, int tb, int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
                    const float *B, int64_t ldb, float beta, float *C, int64_t ldc);
void kiln__cpu_blas_serial(void); /* the BLAS on one thread: call before such a loop */
kiln_status kiln__cpu_conv_window(const kiln__kargs *a); /* IM2COL COL2IM (cpu_conv.c) */
/* MAX_POOL2D and its backward: f32/bf16 kernels, NCHW and channels-last, else general loops (cpu_maxpool.c) */
kiln_status kiln__cpu_max_pool2d(const kiln__kargs *a);
kiln_status kiln__cpu_relu_max_pool2d(const kiln__kargs *a); /* RELU_MAX_POOL2D(_BACKWARD) (cpu_maxpool.c) */
/* one f32 plane of RELU_MAX_POOL2D (fast: the SIMD loops where the CPU has them; false: the
** portable ones, KILN_CONV_C1_PORTABLE), and of its 2x2 backward (returns false, nothing
** done, without AVX-512 or AVX2 or unless fast), for CONV1_RELU_MAX_POOL2D's loops (cpu_maxpool.c) */
void kiln__cpu_relu_max_pool_plane_f32(const float *xp, int64_t xs2, float *yp, int64_t ys2, uint8_t *ip, int64_t is2,
                                       int64_t kh, int64_t kw, int64_t OH, int64_t OW, bool fast);
bool kiln__cpu_relu_max_pool_bwd2_plane_f32(float *dx, int64_t H, int64_t W, const float *g, const float *y,
                                            const uint8_t *ix, int64_t OH, int64_t OW, bool fast);
/* CONV2D_BACKWARD_DATA/_WEIGHT: with oneDNN its kernels below, else reference loops (cpu_conv.c) */
kiln_status kiln__cpu_conv2d_backward(const kiln__kargs *a);
/* f32 3x3 stride-1 CONV2D and CONV2D_BACKWARD_DATA by Winograd F(2x2, 3x3) on AVX2+FMA
** (cpu_conv_winograd.c): whether it takes the arguments (dense NCHW, ungrouped, padding
** 0..2, 8 channels or more each side; KILN_CONV_WINOGRAD=0: never), and the kernel */
bool kiln__cpu_conv_winograd_takes(const kiln__kargs *a);
kiln_status kiln__cpu_conv_winograd(const kiln__kargs *a);
/* C = alpha op(A) op(B) + beta C, row-major (cblas_sgemm's contract), on threads threads:
** OpenBLAS's sgemm, or oneDNN's where OpenBLAS runs generic kernels (cpu_blas.c) */
void kiln__sgemm(int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda, const float *B, int ldb,
                 float beta, float *C, int ldc, int threads);
#ifdef KILN_HAVE_DNNL
kiln_status kiln__cpu_conv2d(const kiln__kargs *a); /* CONV2D: the one-channel loops or oneDNN (cpu_conv.c) */
bool kiln__cpu_dnnl_conv_takes(const kiln__kargs *a); /* f32, contiguous: oneDNN's case */
kiln_status kiln__cpu_dnnl_conv2d(const kiln__kargs *a); /* CONV2D through oneDNN (cpu_dnnl.c) */
kiln_status kiln__cpu_dnnl_conv2d_backward(const kiln__kargs *a); /* CONV2D_BACKWARD_* through oneDNN */
/* MATMUL of bf16 operands (bf16 or f32 out) through oneDNN (cpu_dnnl_matmul.c): true when
** it ran (*st its status), false when the arguments are not its case (the caller runs). */
bool kiln__cpu_dnnl_matmul(const kiln__kargs *a, kiln_status *st);
/* one input channel, stride 1: direct loops for CONV2D and the weight gradient, and
** CONV1_RELU_MAX_POOL2D(_BACKWARD) (cpu_conv_c1.c) */
bool kiln__cpu_conv_c1_takes(const kiln__kargs *a);
kiln_status kiln__cpu_conv_c1(const kiln__kargs *a);
kiln_status kiln__cpu_conv1_relu_max_pool2d(const kiln__kargs *a);
#endif
kiln_status kiln__cpu_index_select(const kiln__kargs *a);
kiln_status kiln__cpu_index_add(const kiln__kargs *a);
kiln_status kiln__cpu_gather(const kiln__kargs *a);
kiln_status kiln__cpu_scatter_add(const kiln__kargs *a);
kiln_status kiln__cpu_layer_norm(const kiln__kargs *a); /* cpu_transformer.c; and backward */
kiln_status kiln__cpu_batch_norm(const kiln__kargs *a); /* cpu_batchnorm.c; and backward */
kiln_status kiln__cpu_attention(const kiln__kargs *a);  /* and ATTENTION_BACKWARD */
/* The bf16 attention's row passes (cpu_attention_rows.c): forward P = bf16(softmax(s)) over keys
** [0, n) of a row w wide (0 in [n, w)), returning lse; backward P = bf16(exp(s - lse)) and
** dS = bf16(P (dP - sum P dP) scale). s and dp are overwritten. */
float kiln__attb_row_forward(float *s, uint16_t *p, int64_t n, int64_t w);
void kiln__attb_row_backward(float *s, float *dp, uint16_t *p, uint16_t *ds, int64_t n, int64_t w, float lse,
                             float scale);
/* The same attention with the products on AVX512-BF16 dot products (cpu_attention_vnni.c):
** whether it takes the call (a CPU with AVX512-BF16 and no AMX, bf16, no mask or dropout,
** even head dims up to 256, 16 query rows or more; KILN_ATTENTION_VNNI=0 or
** KILN_ATTENTION_BF16=0: never), and it. */
bool kiln__cpu_attv_takes(const kiln__kargs *a);
kiln_status kiln__cpu_attv_run(const kiln__kargs *a);
kiln_status kiln__cpu_cumsum(const kiln__kargs *a);     /* cpu_scan.c */
kiln_status kiln__cpu_tril(const kiln__kargs *a);
kiln_status kiln__cpu_topk(const kiln__kargs *a);
kiln_status kiln__cpu_multinomial(const kiln__kargs *a);
kiln_status kiln__cpu_index_copy(const kiln__kargs *a);   /* cpu_kv.c */
kiln_status kiln__cpu_kv_attention(const kiln__kargs *a);
kiln_status kiln__cpu_sample_tokens(const kiln__kargs *a);
kiln_status kiln__cpu_add_layer_norm(const kiln__kargs *a);

#endif /* KILN_CPU_H */
