/*
** The backend seam: what the op layer asks of a device, in plain data.
**
** A backend is a vtable: memory (alloc, free, copies, memset, synchronize) and a kernel
** table indexed by kiln__kop. Every kernel has the one signature
**     kiln_status kernel(const kiln__kargs *a);
** and receives views (pointer to the first element, dtype, shape, strides in elements) and
** scalars — never tensors, autograd nodes or scopes — so a backend can be read and tested
** alone, and the CPU fallback can run any kernel of any backend the same way.
**
** Conventions for every kernel:
** - Inputs are in a->in[0..n_in), outputs in a->out[0..n_out). Unless the op says
**   otherwise, inputs have already been broadcast to the output's shape (stride 0 on the
**   broadcast dims) by the op layer, so in[i].ndim == out[0].ndim and shapes agree.
** - Views may be non-contiguous and may have stride 0; outputs never overlap inputs
**   except where an op says "accumulates into out", and except that unary and binary
**   elementwise ops (and COPY) may be given out0 identical to in0 (the same data, shape
**   and strides): in-place updates (kiln_mul_scalar_, kiln_axpy_). Each element is read
**   before it is written, so this is safe for elementwise loops.
** - 16-bit floats are computed in f32 inside the kernel; f64 in f64.
** - A kernel returns KILN_OK, or sets the last error (kiln_set_error) and returns a code.
**   It never aborts on bad data (an out-of-range index is KILN_ERR_INDEX).
** - Kernels queue work on the backend's current stream; they do not synchronize.
*/
#ifndef KILN_BACKEND_H
#define KILN_BACKEND_H

#include "kiln.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kiln__view {
  void *data; /* address of element [0, 0, ...] of the view */
  kiln_dtype dtype;
  int ndim;
  int64_t shape[KILN_MAX_DIMS];
  int64_t strides[KILN_MAX_DIMS]; /* elements, may be 0 */
} kiln__view;

/* The kernel ops. Ordered by family; new ones go at the end of their family's block only
** before a release — after that, at the end (KILN__K_COUNT moves). Each line: inputs ->
** outputs, and the scalars used. */
#define KILN__KOP_MAP(X)                                                                  \
  /* memory-ish */                                                                        \
  X(COPY, "copy")                 /* in0 -> out0, any dtypes (casts) */                   \
  X(FILL, "fill")                 /* -> out0 = s0 */                                      \
  X(ARANGE, "arange")             /* -> out0 (1-d) = s0 + k*s1 */                         \
  X(EYE, "eye")                   /* -> out0 (2-d) = (i==j) */                            \
  /* random, Philox4x32-10 keyed by a->seed; element k (C order of out0) uses block */    \
  /* counter a->offset + k/4, lane k%4 (see src/core/rng.c for the exact mapping) */      \
  X(RAND_UNIFORM, "rand")         /* -> out0 = s0 + (s1-s0)*u */                          \
  X(RAND_NORMAL, "randn")         /* -> out0 = s0 + s1*n */                               \
  X(RAND_INT, "randint")          /* -> out0 = i0 + floor(u*(i1-i0)) */                   \
  X(RAND_BERNOULLI, "bernoulli")  /* -> out0 = (u < s0) ? s1 : 0  (dropout mask) */       \
  /* unary: in0 -> out0 (same dtype unless noted) */                                      \
  X(NEG, "neg")                                                                           \
  X(EXP, "exp")                                                                           \
  X(LOG, "log")                                                                           \
  X(SQRT, "sqrt")                                                                         \
  X(RSQRT, "rsqrt")                                                                       \
  X(ABS, "abs")                                                                           \
  X(SIGN, "sign")                                                                         \
  X(RELU, "relu")                                                                         \
  X(LEAKY_RELU, "leaky_relu")     /* s0 = negative slope */                               \
  X(GELU, "gelu")                                                                         \
  X(GELU_TANH, "gelu_tanh")                                                               \
  X(SILU, "silu")                                                                         \
  X(SIGMOID, "sigmoid")                                                                   \
  X(TANH, "tanh")                                                                         \
  X(SOFTPLUS, "softplus")         /* s0 = beta, s1 = threshold */                         \
  X(CLAMP, "clamp")               /* s0 = lo, s1 = hi (+-inf for none) */                 \
  X(POW_SCALAR, "pow_scalar")     /* s0 = exponent */                                     \
  X(AFFINE, "affine")             /* out0 = in0*s0 + s1 */                                \
  /* unary backward: in0 = forward input x (or output y where noted), in1 = grad out */   \
  X(RELU_BACKWARD, "relu_backward")           /* x */                                     \
  X(LEAKY_RELU_BACKWARD, "leaky_relu_backward") /* x, s0 slope */                         \
  X(GELU_BACKWARD, "gelu_backward")           /* x */                                     \
  X(GELU_TANH_BACKWARD, "gelu_tanh_backward") /* x */                                     \
  X(SILU_BACKWARD, "silu_backward")           /* x */                                     \
  X(SIGMOID_BACKWARD, "sigmoid_backward")     /* y */                                     \
  X(TANH_BACKWARD, "tanh_backward")           /* y */                                     \
  X(SOFTPLUS_BACKWARD, "softplus_backward")   /* x, s0 beta, s1 threshold */              \
  X(CLAMP_BACKWARD, "clamp_backward")         /* x, s0 lo, s1 hi: g where lo<=x<=hi */    \
  /* binary: in0, in1 -> out0 (out dtype is the promoted one; comparisons give bool) */   \
  X(ADD, "add")                   /* out0 = in0 + s0*in1  (s0 = alpha, 1 for add) */      \
  X(SUB, "sub")                                                                           \
  X(MUL, "mul")                                                                           \
  X(DIV, "div")                   /* integer dtypes: truncating */                        \
  X(POW, "pow")                                                                           \
  X(MAXIMUM, "maximum")           /* NaN propagates */                                    \
  X(MINIMUM, "minimum")                                                                   \
  X(EQ, "eq")                                                                             \
  X(NE, "ne")                                                                             \
  X(LT, "lt")                                                                             \
  X(LE, "le")                                                                             \
  X(GT, "gt")                                                                             \
  X(GE, "ge")                                                                             \
  X(WHERE, "where")               /* in0 cond (any dtype, nonzero = true), in1, in2 */    \
  /* reductions: in0 (full shape) -> out0 with the same ndim, reduced dims of size 1. */  \
  /* The reduced dims are exactly those where out0.shape is 1 and in0.shape is not, */    \
  /* plus any listed in the bit mask i0 (so size-1 dims may be named too). */             \
  X(SUM, "sum")                   /* accumulates in f64 for f64, else f32 (i64 ints) */   \
  X(PROD, "prod")                                                                         \
  X(AMAX, "amax")                                                                         \
  X(AMIN, "amin")                                                                         \
  X(MAX_DIM, "max_dim")           /* one dim i1; out0 values, out1 i64 indices */         \
  X(MIN_DIM, "min_dim")                                                                   \
  /* along one dim i0, in0 -> out0 same shape */                                          \
  X(SOFTMAX, "softmax")                                                                   \
  X(LOG_SOFTMAX, "log_softmax")                                                           \
  X(SOFTMAX_BACKWARD, "softmax_backward")         /* in0 y, in1 grad: y*(g - sum(g*y)) */ \
  X(LOG_SOFTMAX_BACKWARD, "log_softmax_backward") /* in0 y, in1 grad: g - exp(y)*sum(g)*/ \
  /* matrix product, not broadcast by the op layer beyond the batch dims: */              \
  /* in0 A (B..., M, K), in1 B (B..., K, N), out0 (B..., M, N); all three have the same */ \
  /* ndim >= 2 with batch dims already expanded (stride 0 allowed). Optional in2 bias */  \
  /* (N) when n_in == 3. out0 = s0 * A@B + s1 * out0 + bias (s1 == 0: out0 not read). */ \
  /* i0 = 1 allows TF32 (or another reduced-precision f32 path). With n_out == 2 (2-d */  \
  /* only), out1 (M) also gets the sums of A's rows over K: dW = g^T x and the bias */    \
  /* gradient db (g^T's row sums) in one call (cuBLASLt's BGRADB epilogue on CUDA). */   \
  /* i1 flags (a linear layer fused with its ReLU): 1 applies ReLU to out0 last; 2 */     \
  /* makes the last input a mask of A's shape, A read as where(mask > 0, A, 0) (ReLU's */ \
  /* backward folded into the products that consume it). Use the helpers below. */       \
  X(MATMUL, "matmul")                                                                     \
  /* indexing; index views are i64 or i32; i0 = dim */                                    \
  X(INDEX_SELECT, "index_select") /* in0 src, in1 index (1-d) -> out0 */                  \
  X(INDEX_ADD, "index_add")       /* in0 src, in1 index (1-d); accumulates into out0: */  \
                                  /* out0.select(dim, index[k]) += src.select(dim, k) */  \
  X(GATHER, "gather")             /* in0 src, in1 index (out shape) -> out0 */            \
  X(SCATTER_ADD, "scatter_add")   /* in0 src, in1 index (src shape); accumulates into */  \
                                  /* out0[..index..] += src */                            \
  /* fused loss: in0 logits (N, C), in1 target (N) -> out0 loss (N) f32/f64, out1 lse */  \
  /* (N) (logsumexp, saved for backward); i0 ignore_index; s0 label smoothing. Rows */    \
  /* whose target is ignore_index give 0. Out-of-range targets: KILN_ERR_INDEX. With */   \
  /* n_out == 3, out2 (N, out0's dtype) gets each row's weight: 1 kept, 0 ignored, so */  \
  /* the mean over kept rows needs one reduction. i1 flags: 1 adds one more output, */    \
  /* last (see kiln__ce_dlogits): dlogits (N, C, in0's dtype), the gradient of the sum */ \
  /* of the row losses, i.e. CROSS_ENTROPY_BACKWARD with grad 1 (ignored rows 0), so */   \
  /* a unit-seeded backward needs no kernel. With that output and n_in == 3, in2 (N, */   \
  /* out0's dtype) divides each row's gradient (a mean over several calls: the count of */ \
  /* kept rows of them all, broadcast), as CROSS_ENTROPY_BACKWARD's in4 does. */           \
  X(CROSS_ENTROPY, "cross_entropy")                                                       \
  /* in0 logits (N,C), in1 target (N), in2 lse (N), in3 grad (N) -> out0 dlogits (N,C) */ \
  /* With n_in == 5, in4 (N) divides each row's grad (mean: the count of kept rows, */    \
  /* broadcast), so the mean's backward needs no division kernel of its own. */          \
  X(CROSS_ENTROPY_BACKWARD, "cross_entropy_backward")                                   \
  /* the mean in one kernel: in0 logits (N,C), in1 target (N) -> out0 (1) the mean loss */ \
  /* over kept rows (f32/f64), out1 lse (N), out2 (1) the count of kept rows; i0, s0 as */ \
  /* CROSS_ENTROPY. Every row ignored (or N == 0) gives 0/0 = NaN, as PyTorch. i1 flag */ \
  /* 1: out3 dlogits (N, C, in0's dtype), the mean's gradient: CROSS_ENTROPY_BACKWARD */  \
  /* with grad 1 divided by the count (all rows ignored: zeros, as that kernel gives). */ \
  X(CROSS_ENTROPY_MEAN, "cross_entropy_mean")                                           \
  /* fused optimizer step, every view the same shape and float dtype (in place): */      \
  /* in0 grad; out0 param, out1 exp_avg, out2 exp_avg_sq, out3 max_exp_avg_sq (amsgrad, */ \
  /* n_out == 4) — all read and written. s0 lr, s1 beta1, s2 beta2, s3 eps; i0 step */   \
  /* (>= 1, for bias correction), i1 flags: 1 decoupled weight decay (AdamW), 2 */        \
  /* amsgrad, 4 step on the device: in1 is an f64 one-element step count (the kernel */  \
  /* uses in1 + 1 and does not write it); i2 = weight decay as the bits of a double. */   \
  /* i1 flag 8, found_inf (loss scaling): the last input (in1, or in2 after step_t) is */  \
  /* an f32 one-element flag read on the device; when it is non-zero the kernel writes */  \
  /* nothing (a skipped step, no host read). A backend that does not know flag 8 must */   \
  /* refuse it in supports. */                                                            \
  X(ADAM, "adam")                                                                         \
  /* ADAM over many tensors in few launches (a list op: see kiln__kargs.list). Each */    \
  /* group is [grad, param, exp_avg, exp_avg_sq, max_exp_avg_sq (amsgrad only), step_t */ \
  /* (flag 4 only)], all groups one float dtype, contiguous; list_i[g] is the group's */   \
  /* step (>= 1) when the step is on the host. s0-s3, i1, i2 as ADAM. With flag 4 the */  \
  /* kernel reads step_t + 1 and then advances every step_t by one (unlike ADAM). */     \
  /* Flag 8 (found_inf): in0 (n_in 1) is an f32 one-element flag read on the device; */   \
  /* non-zero: nothing is written and no step_t advances (PyTorch's skipped step). */      \
  /* Flag 16: one more view per group, last: autocast's f16/bf16 copy of an f32 param */  \
  /* (NULL data: none), written from the param after the update (or as it stays when */  \
  /* skipped) as COPY converts it. A backend that does not know flag 16 must refuse it. */ \
  X(ADAM_MULTI, "adam_multi")                                                             \
  /* loss-scaling unscale over many tensors (a list op, list_w 1): each floating */        \
  /* contiguous view is multiplied in place by s0 (1/scale); out0, an f32 one-element */   \
  /* flag, is set to 1 when any value is inf or NaN (never cleared here). With n_in 1, */ \
  /* in0 (f32, one element, on the device) is the multiplier instead of s0, so the scale */ \
  /* can live on the device (graph replays read its current value). */                    \
  X(AMP_UNSCALE, "amp_unscale")                                                          \
  /* the loss scale's update (torch._amp_update_scale_), one element each, in place: */   \
  /* out0 scale (f32), out1 growth tracker (f32/f64), in0 found_inf (f32); s0 growth, */   \
  /* s1 backoff, i0 growth interval. found_inf != 0: scale *= backoff, tracker = 0; */     \
  /* else tracker + 1 == interval: scale *= growth when that is finite, tracker = 0; */    \
  /* else tracker += 1. */                                                                 \
  X(AMP_UPDATE_SCALE, "amp_update_scale")                                                 \
  /* ---- transformer ops (issue 16); CPU and CUDA kernels ---- */                       \
  /* fused norms over the last dim: in0 x (R, N), then the weight (N) when i0 flag 1 */  \
  /* and the bias (N) when flag 2, in that order -> out0 y (R, N), out1 mean (R), out2 */ \
  /* rstd (R) (both f32 for f32/f16/bf16, f64 for f64); s0 eps; i1 1: RMS norm (no */     \
  /* mean, no bias; out1 rstd, no out2) */                                                \
  X(LAYER_NORM, "layer_norm")                                                             \
  /* in0 x (R, N), in1 grad (R, N), in2 mean (R), in3 rstd (R), optional in4 weight */    \
  /* (N) (i0 flag 1) -> out0 dx (R, N); with n_out 2 out1 dweight (N), with n_out 3 */    \
  /* out2 dbias (N). i1 1: RMS norm (in2 ignored: rstd is in3 all the same) */            \
  X(LAYER_NORM_BACKWARD, "layer_norm_backward")                                           \
  /* attention, blocked over keys with an online softmax (no Tq x Tk buffer): in0 q */    \
  /* (B, H, Tq, D), in1 k (B, H, Tk, D), in2 v (B, H, Tk, Dv), optional in3 additive */   \
  /* mask (B, H, Tq, Tk) (stride 0 where broadcast; bool: true attends) -> out0 */      \
  /* (B, H, Tq, Dv), out1 lse */                                                          \
  /* (B, H, Tq) (f32, f64 for f64). s0 scale, s1 dropout p; i0 flags 1 causal (key */     \
  /* j <= query i), 2 mask given. Dropout keeps score (b, h, i, j) when the f32 */        \
  /* Philox uniform of element ((b*H + h)*Tq + i)*Tk + j is < 1 - p (rng.c's mapping) */  \
  X(ATTENTION, "attention")                                                               \
  /* in0 q, in1 k, in2 v, in3 grad of out0, optional in4 mask (i0 flag 2); out0 dq, */    \
  /* out1 dk, out2 dv, and out3 the forward's lse, READ ONLY: it rides in an output */    \
  /* slot because the five input slots are taken. Scalars and seed as ATTENTION. */       \
  /* params, when not NULL, points at a kiln__view of the forward's out0 on the device */ \
  /* (read only): delta_i = dO_i . O_i for kernels that want it (cuda_flash.cu); */       \
  /* others ignore it, and the CPU fallback passes it through unstaged, unread. */        \
  X(ATTENTION_BACKWARD, "attention_backward")                                             \
  /* along dim i0, in0 -> out0 (same shape; i64 for integer or bool in0): running sum; */ \
  /* i1 1: from the end (the backward of cumsum) */                                       \
  X(CUMSUM, "cumsum")                                                                     \
  /* in0 (..., M, N) -> out0 same shape and dtype: elements (i, j) with j - i <= i0 */    \
  /* kept (tril), or with j - i >= i0 when i1 is 1 (triu); the rest 0 */                  \
  X(TRIL, "tril")                                                                         \
  /* in0 along dim i0 -> out0 values, out1 i64 indices (dim i0 of size k = i1): the k */  \
  /* largest (i2 flag 1, else smallest), sorted, NaN largest, ties by lower index */      \
  X(TOPK, "topk")                                                                         \
  /* in0 probabilities (N, C), any float, non-negative, rows not all 0 -> out0 (N, S) */  \
  /* i64; i0 1: with replacement. Sample s of row r: u = the f64 Philox uniform of */     \
  /* element r*S + s; the first class j with cdf[j] > u * total (f64 prefix sums in */    \
  /* class order; without replacement, the classes drawn so far weigh 0) */               \
  X(MULTINOMIAL, "multinomial")                                                           \
  /* ---- decoding with a KV cache (issue 16, generation) ---- */                         \
  /* in0 src, in1 index (i64, src's size along dim i0, contiguous or strided 1-d) -> */   \
  /* out0 dst, written in place: dst[.., index[t], ..] = src[.., t, ..] along dim i0 */   \
  /* (src has dst's ndim and shape but along i0). An index outside [0, dst size) is */    \
  /* KILN_ERR_INDEX (CUDA: the device flag; that slice is skipped). */                    \
  X(INDEX_COPY, "index_copy")                                                             \
  /* in0 q (B, H, Tq, D), in1 k (B, H, M, D), in2 v (B, H, M, Dv), in3 len (i64, n = */    \
  /* i0 elements, 1 or B; strided 1-d) -> out0 (B, H, Tq, Dv); s0 scale. Query i of */   \
  /* row b attends keys j <= len[b] - Tq + i (len[b] <= M, else KILN_ERR_INDEX / the */  \
  /* device flag); no key gives 0. f64 accumulation on the CPU (the reference). i1 1 */   \
  /* (append): in4 kv_new (2, B, H, Tq, D) is first written into k and v at slots */      \
  /* len[b] - Tq + t (len[b] < Tq: KILN_ERR_INDEX / the flag, nothing written); out1 */   \
  /* and out2 are k and v again (what the op writes, for graph dependencies) */           \
  X(KV_ATTENTION, "kv_attention")                                                         \
  /* in0 logits (N, V) float, in1 rng (2 i64: seed, offset) -> out0 (N) i64: one draw */  \
  /* per row after temperature s0, top-k i0 (0 off), top-p s1 (1 off), with weights in */ \
  /* 2^-32 fixed point (kiln.h, kiln_sample_tokens: the exact rule; cpu_kv.c) */           \
  X(SAMPLE_TOKENS, "sample_tokens")                                                       \
  /* in0 x (R, N), in1 r (R, N) (stride 0 where broadcast), then the weight (N) when i0 */ \
  /* flag 1 and the bias (N) when flag 2 -> out0 y (R, N) = layer_norm(s) over N, out1 */   \
  /* s = x + r rounded to the dtype (the norm reads the rounded s); s0 eps */              \
  X(ADD_LAYER_NORM, "add_layer_norm")                                                     \
  /* in0 x (M, K), in1 weight (N, K), optional in2 bias (N) (i0 flag 1) -> out0 (M, N) = */ \
  /* x W^T + b rounded to the dtype, then the tanh GELU when i1 is 1 (rounded again); */  \
  /* for few rows M (a decode step): CUDA only (M <= 16, unit column strides, 16-byte */  \
  /* aligned rows, f32/f16/bf16: its supports()); elsewhere the op composes LINEAR, GELU */ \
  X(LINEAR_DECODE, "linear_decode")                                                       \
  /* ---- convolution (issue 15) ---- */                                                 \
  /* convolution's unfold (a->params: kiln__conv_params; kernel, stride, padding */       \
  /* before, dilation): in0 x (N, C, H, W) -> out0 cols (N, C, kh, kw, OH, OW), */         \
  /* cols[n,c,i,j,oh,ow] = x[n, c, oh*sh - ph + i*dh, ow*sw - pw + j*dw], 0 outside x. */  \
  X(IM2COL, "im2col")                                                                     \
  /* its adjoint: in0 cols (N, C, kh, kw, OH, OW); accumulates into out0 (N, C, H, W) */  \
  /* every column entry at the pixel IM2COL read it from (entries outside x dropped). */  \
  X(COL2IM, "col2im")                                                                     \
  /* in0 x (N, C, H, W) -> out0 (N, C, OH, OW) the max over each window (padding never */ \
  /* wins; NaN propagates; the first maximum on ties), out1 (same shape, i64) its flat */ \
  /* index h*W + w in x's plane. a->params: kiln__conv_params. */                         \
  X(MAX_POOL2D, "max_pool2d")                                                             \
  /* a library's convolution, where it beats IM2COL + MATMUL (oneDNN on the CPU, f32; */ \
  /* cuDNN on CUDA, every float dtype): in0 x (N, C, H, W), in1 weight (OC, C/G, kh, */   \
  /* kw), optional in2 bias (OC) -> out0 (N, OC, OH, OW); a->params kiln__conv_params */  \
  /* (the padding after follows from OH, OW), i0 groups, i1 flag 1 allows TF32 for f32. */ \
  /* Layouts: contiguous, or on CUDA also channels-last (NHWC strides). The op layer */    \
  /* asks kiln__dispatch_has first and composes IM2COL + MATMUL where it is missing. */   \
  X(CONV2D, "conv2d")                                                                     \
  /* CONV2D's input gradient: in0 grad (N, OC, OH, OW), in1 weight (OC, C/G, kh, kw) -> */ \
  /* out0 dx (N, C, H, W) (written, not accumulated); params, i0, i1 as CONV2D. */         \
  X(CONV2D_BACKWARD_DATA, "conv2d_backward_data")                                         \
  /* the same, added into out0 instead of written (out0 += dx: cuDNN's beta 1): a */       \
  /* gradient summed into the one already pending for x (kiln__grad_into). CUDA only; */  \
  /* conv2d's rule asks kiln__dispatch_has and writes a new tensor where it is missing. */ \
  X(CONV2D_BACKWARD_DATA_ACC, "conv2d_backward_data_acc")                                 \
  /* CONV2D's weight gradient: in0 x (N, C, H, W), in1 grad (N, OC, OH, OW) -> out0 dW */  \
  /* (OC, C/G, kh, kw); with n_out == 2, out1 (OC) the bias gradient (grad summed over */ \
  /* N, OH, OW). params, i0, i1 as CONV2D. */                                              \
  X(CONV2D_BACKWARD_WEIGHT, "conv2d_backward_weight")                                     \
  /* MAX_POOL2D's backward as a gather (deterministic: no atomics): in0 grad (N, C, OH, */ \
  /* OW), in1 its indices (i64, as MAX_POOL2D gave them) -> out0 dx (N, C, H, W) */       \
  /* (written): each pixel sums the grads of the windows (in window order i, j) whose */  \
  /* index names it. a->params: the forward's kiln__conv_params. */                         \
  X(MAX_POOL2D_BACKWARD, "max_pool2d_backward")                                          \
  /* ---- SGD over many tensors in few launches (a list op: see kiln__kargs.list) ---- */ \
  /* torch.optim.SGD's update; each group is [grad, param, momentum_buffer (i1 flag */   \
  /* 16 only), step_t (flag 4 only)], all groups one float dtype, contiguous, in place. */ \
  /* s0 lr, s1 momentum, s2 dampening, s3 weight decay; i1 flags: 1 nesterov, 2 */         \
  /* maximize, 4 step on the device (the f64 one-element step_t: the buffer is taken */   \
  /* from the gradient where step_t == 0, and every step_t advances by one after), 8 */   \
  /* found_inf (in0, f32 one element, read on the device: non-zero writes nothing and */  \
  /* advances no step_t), 16 momentum (the group has a buffer). Without flag 4, */        \
  /* list_i[g] == 1 marks a buffer made for this step (taken from the gradient). The */   \
  /* element update rounds to the dtype after each step exactly as the composed ops */    \
  /* (neg, axpy, mul_scalar_, axpy_) do: see cpu_optim.c. Flag 32: autocast's copy, */   \
  /* the last view of a group, as ADAM_MULTI's flag 16. */                                \
  X(SGD_MULTI, "sgd_multi")                                                               \
  /* dtype conversions over a list (see kiln__kargs.list): groups [in, out] (list_w 2), */ \
  /* each pair contiguous with one element count, out[k] = in[k] converted as COPY does */ \
  /* (autocast's casts of one op's inputs, and of their gradients, in one call) */         \
  X(CAST_MULTI, "cast_multi")                                                             \
  /* batch norm over (N, S) per channel; x is seen as (N, C, S), S the spatial dims */    \
  /* merged (1 for (N, C)), any strides (CUDA: the channels or S innermost, stride 1). */ \
  /* in0 x, then the weight (C) when i0 flag 1 and the bias (C) when flag 2 (any float */ \
  /* dtypes) -> out0 y (N, C, S) (x's dtype), out1 stats (2, C) (f32; f64 for f64 x): */ \
  /* row 0 the mean, row 1 invstd = 1/sqrt(var + eps) (CUDA: stats may be (4, C); rows */ \
  /* 2, 3 get the normalizing coefficients k = w invstd and b as y = (x - mean) k + b */  \
  /* used them, for BATCH_NORM_BACKWARD's flag 8); with i0 flag 4, out2 */               \
  /* running_mean and out3 running_var (C, any float dtype), read and written. i1 1 */   \
  /* training: batch statistics (var biased, accumulated in f32 or better), and the */   \
  /* running ones (flag 4) become (1 - s1) r + s1 stat, the variance's with the */       \
  /* unbiased var (PyTorch's rule; N*S >= 2); i1 0 eval: the running statistics */        \
  /* (flag 4 required, not written) normalize and go to out1. s0 eps, s1 momentum. */     \
  /* i0 flag 8: y = max(y, 0) (NaN kept), a ReLU fused (kiln_batch_norm_relu). i0 flag */ \
  /* 16: one more input after the weight and bias, a residual (N, C, S) (x's dtype) */     \
  /* added before that ReLU: y = max(bn(x) + residual, 0) (kiln_batch_norm_add_relu; */    \
  /* the CPU and CUDA). */                                                                 \
  X(BATCH_NORM, "batch_norm")                                                             \
  /* in0 x (N, C, S), in1 grad (N, C, S), in2 stats (2, C) as BATCH_NORM gave them, */    \
  /* optional in3 weight (C) (i0 flag 1), optional last input a mask (N, C, S) (x's */   \
  /* dtype; i0 flag 2): grad counts only where mask > 0 (a ReLU's backward folded in) */ \
  /* -> out0 dx (N, C, S) (x's dtype), out1 */                                           \
  /* dweight (C) = sum of g xhat, out2 dbias (C) = sum of g (any float dtypes). i1 1 */   \
  /* training: dx = w invstd (g - mean(g) - xhat mean(g xhat)); i1 0 eval: dx = g w */    \
  /* invstd (the statistics were constants). i0 flag 4 (with flag 2): n_out 4, out3 gm */  \
  /* (N, C, S) (x's dtype) = g where mask > 0, else 0 (RELU_BACKWARD's values: the */      \
  /* residual's gradient of kiln_batch_norm_add_relu), written alongside; CUDA's pass 1 */ \
  /* writes it and its dx pass reads it instead of g and the mask. The op layer asks */    \
  /* for it on CUDA only (the CPU has it for a fallback: the same values). i0 flag 8 */   \
  /* (CUDA; not with 2 or 4, no mask input): g counts only where the forward's output */  \
  /* y = relu(bn(x)) (or bn(x) under a ReLU) was > 0, recomputed from x and stats (4, C) */ \
  /* rows 0, 2, 3 (in the compute type) exactly as the forward rounded y. */               \
  X(BATCH_NORM_BACKWARD, "batch_norm_backward")                                          \
  /* ---- a linear layer fused with its tanh GELU (issue 16: GPT-2's MLP) ---- */          \
  /* in0 A (M, K), in1 B (K, N) (2-d, any strides), optional in2 bias (N) -> out0 y */      \
  /* (M, N) = gelu_tanh(z) and out1 z (M, N) = A@B + bias (the pre-activation, kept for */  \
  /* the backward), both with unit column stride; n_out 1: y alone (a call that records */ \
  /* no node). i0 = 1 allows TF32. CUDA only (cuBLASLt's GELU_AUX(_BIAS) epilogue, */      \
  /* GELU(_BIAS) for y alone); the op layer asks kiln__dispatch_has and */                 \
  /* composes MATMUL + GELU_TANH where it is missing, the CPU reference included. */        \
  X(LINEAR_GELU, "linear_gelu")                                                           \
  /* ---- the residual add and the next layer norm in one pass (training) ---- */         \
  /* in0 x (R, N), in1 r (R, N) (any float dtypes; unit column stride), then the weight */ \
  /* (N) when i0 flag 1 and the bias (N) when flag 2 -> out0 y (R, N) = layer_norm(s) */   \
  /* in any float dtype (computed as LAYER_NORM computes it, rounded to x's dtype, then */  \
  /* to y's: what the f32 norm then a cast gives), out1 s (R, N) = x + r in x's dtype */   \
  /* (the norm reads the rounded s), out2 stats (2, R) f32 (f64 for f64 x): row 0 the */   \
  /* mean, row 1 rstd. s0 eps. CUDA only; the op layer composes ADD, LAYER_NORM, COPY. */  \
  X(RESIDUAL_LAYER_NORM, "residual_layer_norm")                                           \
  /* in0 s (R, N), in1 gy (R, N) (any float dtype), in2 stats (2, R) as the forward */    \
  /* gave them, optional weight (N) (i0 flag 1), optional gs (R, N) in s's dtype (i0 */   \
  /* flag 2): the gradient that reached s from elsewhere -> out0 ds (R, N) in s's dtype */ \
  /* = layer_norm's dx (+ gs), out1 dr (R, N) (any float) = ds rounded to it (i1 flag */   \
  /* 1), out2 dweight (N) (i1 flag 2), out3 dbias (N) (i1 flag 4); n_out 4, or 5 with */   \
  /* out4 (N) (i1 flag 8) = the column sums of r's gradient as written (dr, or ds): the */ \
  /* bias gradient of the linear that made r (a backend may refuse flag 8: supports). */  \
  X(RESIDUAL_LAYER_NORM_BACKWARD, "residual_layer_norm_backward")                         \
  /* in0 A (M, K), in1 B (K, N) (2-d, any strides), in2 z (M, N) (unit column stride) -> */ \
  /* out0 (M, N) = (A@B) * gelu_tanh'(z) (unit column stride; one dtype): the gradient */  \
  /* of a linear_gelu's pre-activation made inside the next layer's input-gradient */     \
  /* product (cuBLASLt's DGELU epilogue on CUDA). i0 = 1 allows TF32. CUDA only; the op */ \
  /* layer composes MATMUL + GELU_TANH_BACKWARD elsewhere. */                             \
  X(MATMUL_DGELU, "matmul_dgelu")                                                         \
  /* ---- ReLU then max-pool in one pass (a CNN's ReLU, MaxPool2d) ---- */                \
  /* in0 x (N, C, H, W) (f32, any strides), windows that tile x (stride = kernel, no */    \
  /* padding, no dilation, kh*kw <= 256) -> out0 y (N, C, OH, OW) = relu(the window's */   \
  /* max by MAX_POOL2D's rule; ReLU's: v < 0 ? 0 : v, NaN passes), x's dtype, out1 (N, */  \
  /* C, OH, OW) u8 the max's offset i*kw + j in its window. a->params: the window. */      \
  X(RELU_MAX_POOL2D, "relu_max_pool2d")                                                   \
  /* its backward: in0 g (N, C, OH, OW), in1 y and in2 the offsets as the forward gave */ \
  /* them -> out0 dx (N, C, H, W) (written): g at each window's max where y > 0, zero */  \
  /* elsewhere. a->params: the forward's window. */                                      \
  X(RELU_MAX_POOL2D_BACKWARD, "relu_max_pool2d_backward")                                \
  /* ---- a one-channel conv, ReLU, MaxPool2d in one pass (an image CNN's first layers) */ \
  /* in0 x (N, 1, H, W), in1 weight (OC, 1, kh, kw), optional in2 bias (OC), f32 dense */  \
  /* -> out0 y (N, OC, POH, POW), out1 offsets (u8): RELU_MAX_POOL2D of CONV2D's output, */ \
  /* which is not made. a->params: two kiln__conv_params, the conv's (stride 1, */         \
  /* dilation 1) then the pool's (tiling); i0 groups (1). CPU with oneDNN, and CUDA. */     \
  X(CONV1_RELU_MAX_POOL2D, "conv1_relu_max_pool2d")                                       \
  /* its weight gradient: in0 x, in1 g (N, OC, POH, POW), in2 y, in3 the offsets -> */    \
  /* out0 dW (OC, 1, kh, kw), optional out1 db (OC); params, i0 as the forward. */         \
  X(CONV1_RELU_MAX_POOL2D_BACKWARD, "conv1_relu_max_pool2d_backward")

typedef enum kiln__kop {
#define KILN__KOP_ENUM(name, str) KILN__K_##name,
  KILN__KOP_MAP(KILN__KOP_ENUM)
#undef KILN__KOP_ENUM
  KILN__K_COUNT
} kiln__kop;

const char *kiln__kop_name(kiln__kop op);

#define KILN__MAX_KIN 5
#define KILN__MAX_KOUT 5 /* RESIDUAL_LAYER_NORM_BACKWARD with r's column sums */

typedef struct kiln__kargs {
  kiln__kop op;
  int device; /* device index within the backend */
  int n_in, n_out;
  kiln__view in[KILN__MAX_KIN];
  kiln__view out[KILN__MAX_KOUT];
  double s[4];  /* scalar parameters, per op */
  int64_t i[4]; /* integer parameters, per op */
  uint64_t seed, offset; /* RNG ops */
  /* List ops (ADAM_MULTI): list_n groups of list_w views, group-major in list, and one
  ** integer per group in list_i. Owned by the caller. The CPU fallback does not stage
  ** lists: the op layer asks kiln__dispatch_has() first and loops the single-tensor op
  ** where a backend lacks the list op. */
  int list_n, list_w;
  const kiln__view *list;
  const int64_t *list_i;
  /* Ops whose parameters do not fit s[] and i[] (IM2COL, COL2IM, MAX_POOL2D: a
  ** kiln__conv_params) point here at a typed record in host memory, owned by the caller
  ** for the length of the call. Backends read it; the CPU fallback passes it through as
  ** it is (it is host memory, never staged). NULL for every other op. */
  const void *params;
} kiln__kargs;

/* The window geometry of IM2COL, COL2IM and MAX_POOL2D (2-d, [0] is the height): the
** window size, its step, the padding before the first row/column (the padding after is
** implied by the output's shape, so "same" padding may be asymmetric) and the dilation. */
typedef struct kiln__conv_params {
  int64_t kernel[2], stride[2], padding[2], dilation[2];
} kiln__conv_params;

typedef kiln_status (*kiln__kernel_fn)(const kiln__kargs *a);

/* Optional graph capture (kiln_graph_capture). A backend without it leaves
** kiln__backend.graph NULL: capture then only records the step and replay calls it (what
** the CPU does). Between begin and end, kernels queued on the device are recorded, not run;
** end instantiates them as an executable graph (an opaque pointer) that launch replays. */
typedef struct kiln__backend_graph {
  kiln_status (*begin)(int device);
  kiln_status (*end)(int device, void **exec);
  kiln_status (*launch)(int device, void *exec);
  void (*free)(void *exec); /* NULL is a no-op */
  /* node count and longest dependent chain (-1 unknown); may be NULL */
  void (*shape)(const void *exec, int *nodes, int *depth);
  bool (*capturing)(int device); /* whether a capture is in progress on the device */
} kiln__backend_graph;

/* Optional asynchronous host->device copies, for the data loader's copier
** (src/data/copier.c). A backend without them leaves kiln__backend.async NULL and the
** loader copies batches with plain kiln_to_device. Events are opaque pointers of the
** device; "the stream" is the device's queue of kernels, "the side stream" a second queue
** that only meets it through events. */
typedef struct kiln__backend_async {
  kiln_status (*host_alloc)(int device, void **p, size_t n); /* pinned host memory */
  void (*host_free)(void *p);                                /* NULL is a no-op */
  kiln_status (*event_new)(int device, void **ev);
  void (*event_free)(void *ev);                              /* NULL is a no-op */
  kiln_status (*event_record)(int device, void *ev);         /* on the stream */
  kiln_status (*event_wait)(int device, void *ev);           /* the stream waits for ev */
  kiln_status (*event_synchronize)(void *ev);                /* the host waits for ev */
  /* Queues a copy on the side stream and returns at once; src is pinned and untouched
  ** until an event recorded on the side stream after it has completed. */
  kiln_status (*side_copy_from_host)(int device, void *dst, const void *src, size_t n);
  kiln_status (*side_event_record)(int device, void *ev);    /* on the side stream */
  kiln_status (*side_event_wait)(int device, void *ev);      /* side stream waits for ev */
} kiln__backend_async;

typedef struct kiln__backend {
  const char *name;           /* "cpu", "cuda": devices print and parse as "<name>:N" */
  /* A named value of kiln_device_type (CPU, CUDA, later ones at the enum's end), or
  ** KILN__DEVICE_TYPE_ANY for a backend registered at run time: the registry gives it
  ** a type id of its own (kiln__backend_register). */
  kiln_device_type type;
  bool host_visible;          /* device memory is addressable by the CPU */

  /* Availability. probe() is called once; it returns KILN_OK when the backend works and
  ** otherwise sets *why to a static or heap string that says why not. */
  kiln_status (*probe)(const char **why);
  int (*device_count)(void);

  /* Memory. alloc returns NULL and sets KILN_ERR_OOM (with the numbers) on failure. */
  void *(*alloc)(int device, size_t nbytes);
  void (*free)(int device, void *ptr, size_t nbytes);
  kiln_status (*copy_to_host)(int device, void *dst, const void *src, size_t nbytes);
  kiln_status (*copy_from_host)(int device, void *dst, const void *src, size_t nbytes);
  kiln_status (*copy_device)(int device, void *dst, const void *src, size_t nbytes);
  kiln_status (*memset_zero)(int device, void *ptr, size_t nbytes);
  kiln_status (*synchronize)(int device);
  kiln_status (*memory_stats)(int device, kiln_memory_stats *out);
  kiln_status (*empty_cache)(int device);
  kiln_status (*set_memory_limit)(int device, int64_t bytes);
  void (*reset_peak)(int device);

  /* Kernels: NULL means "not implemented here" (the op layer falls back to the CPU). */
  kiln__kernel_fn kernels[KILN__K_COUNT];
  /* Optional finer check: whether kernels[op] handles these arguments (e.g. dtypes).
  ** NULL means every dtype the op layer allows. It looks at dtypes, shapes and scalars
  ** only, never at the data, so it may be asked about views of another device (the
  ** harness's support table does). */
  bool (*supports)(const kiln__kargs *a);

  /* Optional device timing (KILN_PROFILE=device): mark() puts a timestamp on the device's
  ** queue and returns it (NULL on failure); elapsed_ms() waits for the later mark and
  ** returns the device time between the two (-1 on failure or a NULL mark), freeing both
  ** (either may be NULL, to free the other). NULL where the host time of a
  ** kernel call is already its device time (the CPU). */
  void *(*mark)(int device);
  double (*elapsed_ms)(int device, void *start, void *stop);

  /* Everything below may be NULL; the caller then does the plain thing. */
  const kiln__backend_graph *graph; /* NULL: capture records, replay calls the step */
  const kiln__backend_async *async; /* NULL: the loader copies synchronously */
  /* kiln_device_info_get; NULL: only the name field, "<name> device". */
  kiln_status (*device_info)(int device, kiln_device_info *out);
  /* kiln_device_bandwidth; NULL: KILN_ERR_UNSUPPORTED. */
  kiln_status (*bandwidth)(int device, double *h2d_gbs, double *d2h_gbs);
  /* kiln_device_best picks the available backend of the highest rank > 0 (CUDA: 100);
  ** 0: never picked by itself (the CPU, which is the default anyway; test backends). */
  int best_rank;
} kiln__backend;

/* ---- the registry (src/backend/registry.c) ----
** A fixed table of KILN__MAX_BACKENDS backends: the built-in ones (cpu, then cuda when
** built) come from a static list in registry.c; others register at run time, before
** their first use (a test backend, a plug-in). Lookups are lock-free; registering takes
** a lock. */
#define KILN__MAX_BACKENDS 8
/* Type ids: named kiln_device_type values are below KILN__DEVICE_TYPE_DYNAMIC; run-time
** registrations get ids from it upward, so the public enum can grow (Vulkan, Metal)
** without colliding. */
#define KILN__DEVICE_TYPE_DYNAMIC 16
#define KILN__DEVICE_TYPE_LIMIT (KILN__DEVICE_TYPE_DYNAMIC + KILN__MAX_BACKENDS)
#define KILN__DEVICE_TYPE_ANY ((kiln_device_type)-1)

/* Registers b (which must outlive the process: a static object) and returns its type id:
** b->type when that is a named value, else a new id. Registering the same b again returns
** its id. -1 (cast) with the last error set when the table is full, the name is taken, b
** lacks a required entry (name, alloc, free, the copies) or b->type is taken by another. */
kiln_device_type kiln__backend_register(const kiln__backend *b);
/* The backend of a type id (NULL when none is registered). */
const kiln__backend *kiln__backend_get(kiln_device_type type);
/* The backend named name ("cuda"), NULL when none; *type gets its id. */
const kiln__backend *kiln__backend_find(const char *name, kiln_device_type *type);
/* Iteration in registration order (cpu is 0): the count, and the i-th backend and id. */
int kiln__backend_count(void);
const kiln__backend *kiln__backend_at(int i, kiln_device_type *type);
/* The registry slot (0 .. KILN__MAX_BACKENDS-1) of a type id, -1 when not registered:
** per-backend state elsewhere (probes, profiles, test hooks) is indexed by it. */
int kiln__backend_slot(kiln_device_type type);
/* Name of a type id for messages and parsing: a registered backend's, else the named
** enum value's ("cuda" when kiln was built without it); NULL when unknown. */
const char *kiln__device_type_name(kiln_device_type type);
/* Why a named type has no backend ("kiln was built without CUDA ..."); NULL if unknown. */
const char *kiln__backend_missing_why(kiln_device_type type);
/* The CPU backend: the host, and the fallback of every other backend. */
extern const kiln__backend kiln__cpu_backend;
#ifdef KILN_HAVE_CUDA
extern const kiln__backend kiln__cuda_backend;
#endif

/* MATMUL's optional inputs (see its flags above): the bias and the mask of A, or NULL. */
static inline const kiln__view *kiln__mm_bias(const kiln__kargs *a) {
  return a->n_in - ((a->i[1] & 2) ? 1 : 0) >= 3 ? &a->in[2] : NULL;
}
static inline const kiln__view *kiln__mm_mask(const kiln__kargs *a) {
  return (a->i[1] & 2) && a->n_in >= 3 ? &a->in[a->n_in - 1] : NULL;
}

/* CROSS_ENTROPY(_MEAN)'s optional dlogits output (i1 flag 1): the last output, or NULL. */
static inline const kiln__view *kiln__ce_dlogits(const kiln__kargs *a) {
  bool fwd = a->op == KILN__K_CROSS_ENTROPY || a->op == KILN__K_CROSS_ENTROPY_MEAN;
  return fwd && (a->i[1] & 1) && a->n_out > 0 ? &a->out[a->n_out - 1] : NULL;
}

/* ADAM_MULTI's group width for its flags (4 views, + max_exp_avg_sq, + step_t, + copy); -1 with
** the last error set when the list does not have it. (src/backend/view.c) */
int kiln__adam_list_width(const kiln__kargs *a);
/* The group width SGD_MULTI's flags give (2, +1 with momentum, +1 with a device step, +1
** with autocast's copy),
** checked against a->list_w; -1 with the error set when they disagree. */
int kiln__sgd_list_width(const kiln__kargs *a);

/* Helpers every backend may use (src/backend/view.c). */
int64_t kiln__view_numel(const kiln__view *v);
/* One past the largest element offset from v->data that v reaches (0 when empty): the
** elements a loop may read ahead of an element without leaving the view's memory. */
int64_t kiln__view_extent(const kiln__view *v);
bool kiln__view_is_contiguous(const kiln__view *v);
/* Merges adjacent dims that are contiguous with each other in every view given, and
** drops size-1 dims, so that iteration has the fewest dims. All views must have the same
** shape. Modifies the views in place; returns the new ndim (>= 1 unless numel is 0... it
** returns 1 with shape [0] in that case). */
int kiln__views_coalesce(kiln__view *views, int n);

#ifdef __cplusplus
}
#endif
#endif /* KILN_BACKEND_H */
