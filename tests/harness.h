/*
** The op test harness (ggml's test-backend-ops, DESIGN.md "Testing").
**
** An op case names a builder that calls public ops on its inputs, the inputs' specs, an
** optional independent f64 reference written with naive loops, and which inputs are
** differentiable. h_run_case() then checks, for every shape variant of the case:
**   (a) forward in f64 on the CPU against the reference (rel. tolerance 1e-10);
**   (b) forward in f32, f16, bf16 against kiln's f64 forward on the *same rounded
**       inputs* (the host rounds each input to the dtype first, so only the op's own
**       arithmetic and the output rounding are measured, not how the op amplifies
**       input rounding);
**   (c) gradcheck in f64: backward with a random upstream gradient g against central
**       differences of sum(out * g), eps 1e-6, for every differentiable input;
**   (d) cross-backend: for every device of every registered backend but the CPU (CUDA,
**       and the test-only backend testdev that h_init registers), the same inputs copied
**       over, forward and backward, compared to the CPU in the same dtype. Real backends
**       run under KILN_FALLBACK=error, so a missing kernel fails the case (the message
**       names op, device and dtype); testdev, which has six kernels, and Vulkan, which
**       claims part of the ops, run with fallback allowed (what they claim runs natively
**       and is compared; the rest checks the CPU fallback path). KILN_HARNESS_STRICT=1
**       puts Vulkan under KILN_FALLBACK=error too.
** Variants: contiguous; non-contiguous (the input is a transposed view of a buffer laid
** out the other way, or a step-2 slice for 1-d); expanded (a stride-0 view of a base
** whose dim 0 is 1); broadcast (for broadcasting ops: one input gets dim 0 = 1, or loses
** its leading dim); size-1 and size-0 (each shape symbol in turn set to 1, then 0: the
** result shape is checked against the reference and nothing may crash).
** In every non-CPU-only variant the leaves are the base buffers, so gradients also flow
** through the view ops that build the variant.
**
** Tolerance rule (h_close): element i passes when
**     |got_i - want_i| <= rtol * |want_i| + atol * scale,   scale = max_j |want_j|
** i.e. a relative bound per element plus an absolute floor relative to the tensor's
** magnitude, so that results that cancel to ~0 next to O(scale) values are judged
** against what the dtype can represent at that magnitude. For gradients scale is at
** least 1 (gradcheck's 1e-6 is then relative and absolute). Both NaN, or equal infinities,
** match. Integer and bool outputs must match exactly.
**     f64 1e-10/1e-10, f32 1e-5/1e-5, f16 1e-2/5e-3, bf16 3e-2/3e-2 (times tol_scale).
**
** KILN_TEST_DEVICE=cuda (or any backend's name; or the argument --cross-only: every real
** backend) runs only part (d); with no such device the test then exits 77 (ctest
** SKIP_RETURN_CODE). KILN_HARNESS_TESTDEV=0 leaves testdev out.
**
** Support mode (KILN_HARNESS_SUPPORT=1 or --support) checks nothing: each case's
** contiguous variant runs forward and backward on every registered backend in f32, f64,
** f16 and bf16 with the fallback policy silent, a dispatch observer records whether every
** kernel ran natively, and h_finish prints a Markdown table (docs/ops.md, `make ops-doc`).
** A backend that is built but has no device here is judged from its kernel table and its
** supports() callback on the kernel calls of the CPU run, and marked "(tables)".
*/
#ifndef KILN_TEST_HARNESS_H
#define KILN_TEST_HARNESS_H

#include <kiln.h>

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#define H_MAX_IN 6
#define H_MAX_SYM 6

/* A symbolic dim in an input shape: the case's sym[k] gives its size. Literal dims are
** >= 0. Size-1 / size-0 variants change one symbol at a time. */
#define H_SYM(k) (-1 - (k))

typedef enum h_fill {
  H_RANDN = 0, /* standard normal (times hi when hi != 0) */
  H_UNIFORM,   /* uniform [lo, hi) */
  H_POSITIVE,  /* uniform [0.5, 2) */
  H_INTVAL,    /* small integers in [lo, hi] stored in the float dtype (exact) */
  H_INDEX,     /* integers in [lo, hi) (hi_sym: hi = that symbol's size) in .dtype */
  H_BOOLS      /* random true/false, KILN_BOOL */
} h_fill;

typedef struct h_input {
  int ndim;
  int64_t shape[KILN_MAX_DIMS]; /* literal >= 0, or H_SYM(k) */
  h_fill fill;
  double lo, hi;
  int hi_sym;       /* H_INDEX: 1 + k makes hi = sym[k] (0: use hi) */
  kiln_dtype dtype; /* H_INDEX: I64 or I32 (F32, the zero value, means I64) */
  bool diff;        /* differentiable: gradchecked */
} h_input;

/* Array passed to a reference: logical shape and C-order f64 data. */
typedef struct h_arr {
  int ndim;
  int64_t shape[KILN_MAX_DIMS];
  double *data;
} h_arr;

typedef kiln_tensor *(*h_build_fn)(kiln_tensor **in, const void *ctx);
/* Sets out->ndim/shape for the given inputs and, when out->data is not NULL, fills it.
** Returns 0, or 1 when kiln is expected to fail (return NULL) for these inputs. */
typedef int (*h_ref_fn)(const h_arr *in, int n_in, h_arr *out, const void *ctx);

enum {
  H_BROADCAST = 1 << 0,    /* the op broadcasts its inputs: add broadcast variants */
  H_NO_EXPAND = 1 << 1,    /* skip the stride-0 variant (ties break max/min gradients) */
  H_NO_GRAD = 1 << 2,      /* no gradcheck (integer output or non-differentiable) */
  H_NO_LOWP = 1 << 3,      /* skip f16/bf16 */
  H_NO_NONCONTIG = 1 << 4, /* skip the non-contiguous variant */
  H_NO_SIZE0 = 1 << 5,     /* skip size-0 variants */
  H_INT_DTYPES = 1 << 6,   /* also run forward with float inputs as i32 and i64 */
  H_NO_SIZE1 = 1 << 7,
  /* Some of the op's kernels exist only on the CPU so far (the transformer ops of issue
  ** 16, the convolution family of issue 15): in part (d) real backends (CUDA, Vulkan under
  ** KILN_HARNESS_STRICT) run the case with the fallback allowed instead of
  ** KILN_FALLBACK=error, so it checks the CPU fallback path there rather than failing for
  ** the kernel still to be written. Remove the flag from a case when its kernels land. */
  H_CPU_ONLY = 1 << 8,
  /* With H_CPU_ONLY: CUDA has the case's kernels now (the convolution family), so a CUDA
  ** device runs it under KILN_FALLBACK=error after all; other backends still fall back. */
  H_CUDA_NATIVE = 1 << 9,
  /* With H_CPU_ONLY: Vulkan has the case's kernels, so a strict Vulkan run
  ** (KILN_HARNESS_STRICT=1) keeps the fallback at error for it. */
  H_VK_NATIVE = 1 << 10
};

typedef struct h_case {
  const char *name;
  h_build_fn fn;
  h_ref_fn ref; /* may be NULL: then (a) is skipped, (b)-(d) still run */
  const void *ctx;
  int n_in;
  h_input in[H_MAX_IN];
  int64_t sym[H_MAX_SYM];
  unsigned flags;
  double tol_scale;  /* multiplies the f16/bf16/f32 tolerances (0 = 1) */
  double grad_tol;   /* gradcheck tolerance (0 = 1e-6) */
  /* multiplies (d)'s tolerances only (0 = 1), where two f32 implementations of the same
  ** long or ill-conditioned reduction may each err by the f32 bound: the case says why */
  double xtol_scale;
} h_case;

/* ---- running ---- */
void h_init(int argc, char **argv, const char *test_name);
/* Prints "<test>: N passed, M failed" and returns the exit code (77: skipped). */
int h_finish(void);
bool h_cross_only(void);
void h_set_cross_only(bool on);
/* The H_CPU_ONLY cases' kernels exist on backends of type t (CUDA's transformer kernels):
** part (d) runs them there under KILN_FALLBACK=error, so a missing kernel fails. */
void h_set_native_type(kiln_device_type t);
bool h_support_mode(void); /* KILN_HARNESS_SUPPORT=1 / --support: hand-written checks skip */
/* Whether a test's hand-written checks on backend `name` ("cuda") run: in a full run, and in
** a cross-only run that takes that backend (KILN_TEST_DEVICE=cuda: the test's `_cuda` ctest
** entry, label gpu); never in support mode. The caller still asks for a device. */
bool h_backend_checks(const char *name);
void h_run_case(const h_case *c);
void h_run_cases(const h_case *cs, int n);

/* ---- checks for hand-written tests ---- */
/* Counts one check; on failure prints "FAIL <what>: <detail>" with file:line. */
bool h_check_(bool ok, const char *file, int line, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 4, 5)))
#endif
    ;
#define H_CHECK(cond, ...) h_check_((cond), __FILE__, __LINE__, __VA_ARGS__)
/* A kiln call that must fail with code; also checks the message is not empty. */
#define H_EXPECT_ERR(expr, code, what)                                                    \
  h_expect_err_((expr) == 0, (code), __FILE__, __LINE__, (what))
bool h_expect_err_(bool returned_failure, kiln_status code, const char *file, int line,
                   const char *what);
/* Element-wise comparison of a tensor against expected values with the tolerance rule
** above; prints the worst element. Returns true when close. */
bool h_close(const char *what, const double *got, const double *want, int64_t n, double rtol,
             double atol);
bool h_tensor_close(const char *what, kiln_tensor *t, const double *want, int64_t n,
                    double rtol, double atol);
/* Tolerances of a dtype (rtol and atol of the rule above). */
void h_dtype_tol(kiln_dtype dt, double *rtol, double *atol);

/* ---- helpers ---- */
/* t's values as f64 in C order into a malloc'd array (NULL on error); *n gets numel. */
double *h_values(kiln_tensor *t, int64_t *n);
/* A tensor from f64 host values, converted to dt (on the CPU). */
kiln_tensor *h_tensor(const double *v, int ndim, const int64_t *shape, kiln_dtype dt);
/* Deterministic host RNG (splitmix64), independent of kiln's. */
uint64_t h_rand_u64(void);
double h_rand_uniform(void); /* [0, 1) */
double h_rand_normal(void);
/* Rounds x to the nearest value of dt (host). */
double h_round_to(double x, kiln_dtype dt);
/* Shape helpers for references. */
int64_t h_numel(int ndim, const int64_t *shape);
/* Broadcast shape of a and b into out (returns false when incompatible). */
bool h_broadcast_shape(int na, const int64_t *sa, int nb, const int64_t *sb, int *nout,
                       int64_t *out);
/* The flat index into an array of shape (n, s) of the output multi-index idx (of nout
** dims), with broadcasting (size-1 dims read index 0, missing leading dims dropped). */
int64_t h_bcast_offset(int n, const int64_t *s, int nout, const int64_t *idx);
/* Advances a multi-index in C order; returns false after the last one. */
bool h_next_index(int ndim, const int64_t *shape, int64_t *idx);
const char *h_shape_text(int ndim, const int64_t *shape, char *buf, size_t n);

/* Reference building blocks: element-wise maps with broadcasting. Return 1 (kiln must
** fail) when shapes do not broadcast. */
int h_ref_map1(const h_arr *a, h_arr *out, double (*f)(double));
int h_ref_map2(const h_arr *a, const h_arr *b, h_arr *out, double (*f)(double, double));
int h_ref_map3(const h_arr *a, const h_arr *b, const h_arr *c, h_arr *out,
               double (*f)(double, double, double));

/* An f64 CPU tensor from literal values: H_T(KILN_SHAPE(2, 2), 1, 2, 3, 4). */
#define H_T(...) h_lit(__VA_ARGS__)
kiln_tensor *h_lit_(int ndim, const int64_t *shape, kiln_dtype dt, int n, const double *v);
#define h_lit(ndim, shape, dt, ...)                                                      \
  h_lit_((ndim), (shape), (dt), (int)(sizeof((double[]){__VA_ARGS__}) / sizeof(double)),     \
         (const double[]){__VA_ARGS__})

#endif /* KILN_TEST_HARNESS_H */
