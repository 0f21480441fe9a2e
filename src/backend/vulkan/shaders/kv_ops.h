/* Op codes and dtype codes shared by the kernels' host code (vk_kernels.c) and the
** shaders (#include'd by both: defines only). */
#ifndef KV_OPS_H
#define KV_OPS_H

/* dtype codes: kiln_dtype's values (checked by a static assert in vk_kernels.c) */
#define KV_F32 0
#define KV_F64 1
#define KV_F16 2
#define KV_BF16 3
#define KV_I64 4
#define KV_I32 5
#define KV_U8 6
#define KV_BOOL 7

/* ew.comp: unary (view 1 -> view 0) */
#define KV_NEG 1
#define KV_EXP 2
#define KV_LOG 3
#define KV_SQRT 4
#define KV_RSQRT 5
#define KV_ABS 6
#define KV_SIGN 7
#define KV_RELU 8
#define KV_LEAKY_RELU 9
#define KV_GELU 10
#define KV_GELU_TANH 11
#define KV_SILU 12
#define KV_SIGMOID 13
#define KV_TANH 14
#define KV_SOFTPLUS 15
#define KV_CLAMP 16
#define KV_POW_SCALAR 17
#define KV_AFFINE 18
/* unary backward: view 1 x (or y), view 2 grad */
#define KV_RELU_BW 30
#define KV_LEAKY_RELU_BW 31
#define KV_GELU_BW 32
#define KV_GELU_TANH_BW 33
#define KV_SILU_BW 34
#define KV_SIGMOID_BW 35
#define KV_TANH_BW 36
#define KV_SOFTPLUS_BW 37
#define KV_CLAMP_BW 38
/* binary: views 1, 2 -> 0 */
#define KV_ADD 50
#define KV_SUB 51
#define KV_MUL 52
#define KV_DIV 53
#define KV_POW 54
#define KV_MAXIMUM 55
#define KV_MINIMUM 56
#define KV_EQ 57
#define KV_NE 58
#define KV_LT 59
#define KV_LE 60
#define KV_GT 61
#define KV_GE 62
#define KV_WHERE 63 /* views 1 cond, 2, 3 */

/* reduce.comp */
#define KV_R_SUM 1
#define KV_R_PROD 2
#define KV_R_MAX 3
#define KV_R_MIN 4

/* softmax.comp */
#define KV_SOFTMAX 1
#define KV_LOG_SOFTMAX 2
#define KV_SOFTMAX_BW 3
#define KV_LOG_SOFTMAX_BW 4

/* index.comp */
#define KV_INDEX_SELECT 1
#define KV_INDEX_ADD 2
#define KV_GATHER 3
#define KV_SCATTER_ADD 4

/* random.comp */
#define KV_RAND_UNIFORM 1
#define KV_RAND_NORMAL 2
#define KV_RAND_INT 3
#define KV_RAND_BERNOULLI 4

/* misc.comp */
#define KV_M_EYE 1
#define KV_M_TRIL 2
#define KV_M_UNSCALE 3

/* layernorm.comp */
#define KV_LN_FWD 1
#define KV_LN_BWD 2
#define KV_LN_WGRAD 3

/* window.comp */
#define KV_W_IM2COL 1
#define KV_W_COL2IM 2
#define KV_W_MAXPOOL 3

#define KV_MAXV 6  /* views per dispatch */
#define KV_MAXD 8  /* dims */

#endif
