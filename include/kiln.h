/*
** kiln — tensors, autograd and device-agnostic ops, in C.
**
** A complete small program (README.md shows it too, and a test builds it):
**
**   #include <kiln.h>
**   #include <stdio.h>
**
**   int main(void) {
**     kiln_device dev = kiln_device_best();          // cuda:0 when a GPU works, else cpu
**     kiln_scope_begin();                            // owns every tensor made below
**     kiln_tensor *w = kiln_randn(KILN_SHAPE(3, 2), KILN_F32, dev, NULL);
**     kiln_requires_grad_(w, true);
**     kiln_tensor *x = kiln_ones(KILN_SHAPE(4, 3), KILN_F32, dev);
**     kiln_tensor *loss = kiln_mean_all(kiln_relu(kiln_matmul(x, w)));
**     if (kiln_backward(loss, NULL) != KILN_OK) {    // NULL anywhere above lands here
**       fprintf(stderr, "%s\n", kiln_last_error_message());
**       return 1;
**     }
**     printf("loss %.4f\n", kiln_item(loss));
**     kiln_print(kiln_grad(w));
**     kiln_scope_end();                              // frees x, w, loss and the graph
**     return 0;
**   }
**
** Rules (DESIGN.md):
** - Errors are values. A function that makes a tensor returns NULL on failure and sets
**   the thread-local last error (kiln_last_error(), kiln_last_error_message()). Any op
**   given a NULL input returns NULL without touching the last error, so a whole step can
**   be checked once at its end. Functions returning kiln_status return KILN_OK or a code.
** - Lifetime. Every tensor returned to you is a new reference. If a scope is open on this
**   thread, the innermost scope owns that reference and releases it at kiln_scope_end();
**   kiln_keep() takes it out of the scope so that you own it (release with
**   kiln_tensor_free()). With no scope open, you own it. Freeing NULL is a no-op.
** - Synchronization is explicit: ops queue work; only kiln_item(), kiln_to_host(),
**   kiln_print() and kiln_device_synchronize() wait for the device.
*/
#ifndef KILN_H
#define KILN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KILN_VERSION "0.1.0"
#define KILN_VERSION_NUMBER 1000 /* major*1000000 + minor*1000 + patch */

#if defined(_WIN32) && defined(KILN_SHARED_BUILD)
#define KILN_API __declspec(dllexport)
#elif defined(__GNUC__)
#define KILN_API __attribute__((visibility("default")))
#else
#define KILN_API
#endif

#define KILN_MAX_DIMS 8

/* --------------------------------------------------------------------------------------
** Errors. One table makes the enum, kiln_error_name() and kiln_error_string().
*/
#define KILN_ERRNO_MAP(X)                                                                 \
  X(OK, "success")                                                                        \
  X(INVALID_ARGUMENT, "invalid argument")                                                 \
  X(SHAPE, "shape mismatch or invalid shape")                                             \
  X(DTYPE, "unsupported or mismatched dtype")                                             \
  X(DEVICE, "tensors on different devices, or no such device")                            \
  X(OOM, "out of memory")                                                                 \
  X(IO, "input/output error")                                                             \
  X(FORMAT, "corrupt or unsupported file format")                                         \
  X(INDEX, "index out of range")                                                          \
  X(UNSUPPORTED, "operation not supported on this device (fallback policy is error)")     \
  X(UNAVAILABLE, "backend not built or not available")                                    \
  X(STATE, "API misuse: call not valid in this state")                                    \
  X(AUTOGRAD, "autograd error")                                                           \
  X(INTERNAL, "internal error")                                                           \
  X(NUMERIC, "NaN or infinity found by the anomaly check")

typedef enum kiln_status {
#define KILN__ERR_ENUM(name, msg) KILN_ERR_##name,
  KILN_ERRNO_MAP(KILN__ERR_ENUM)
#undef KILN__ERR_ENUM
  KILN_ERR__COUNT
} kiln_status;
#define KILN_OK KILN_ERR_OK

/* "KILN_ERR_SHAPE" for a code; "unknown" outside the table. Static strings. */
KILN_API const char *kiln_error_name(kiln_status code);
/* A one-line description of the code ("shape mismatch or invalid shape"). Static. */
KILN_API const char *kiln_error_string(kiln_status code);
/* This thread's last error code (KILN_OK after kiln_clear_error()). */
KILN_API kiln_status kiln_last_error(void);
/* This thread's last error message, naming the op and the shapes; "" when none.
** Valid until the next failing kiln call on this thread. */
KILN_API const char *kiln_last_error_message(void);
KILN_API void kiln_clear_error(void);
/* Sets the last error (for layers built on kiln: nn, data, user code). Returns code. */
KILN_API kiln_status kiln_set_error(kiln_status code, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
/* Broken internal invariants (bugs) call this hook; default prints and aborts.
** Replace it to log or longjmp in an embedding program. */
typedef void (*kiln_abort_hook)(const char *file, int line, const char *msg);
KILN_API kiln_abort_hook kiln_set_abort_hook(kiln_abort_hook hook);

/* Library version at run time; equals KILN_VERSION of the header it was built with. */
KILN_API const char *kiln_version(void);
/* A short description of the build options ("cuda=on blas=openblas openmp=on ..."). */
KILN_API const char *kiln_build_info(void);
/* The CPU's BLAS as it runs: the kernels OpenBLAS picked for this CPU, and whether kiln's
** f32 products go around them (to oneDNN's sgemm where OpenBLAS picked generic kernels
** for a CPU with AVX2; KILN_CPU_SGEMM=blas|dnnl forces either); "" without a BLAS. */
KILN_API const char *kiln_blas_info(void);
/* The OPENBLAS_CORETYPE value that gives OpenBLAS its own kernels for this CPU where it
** picked generic ones ("SkylakeX", "Haswell"), else NULL. */
KILN_API const char *kiln_blas_coretype_fix(void);

/* --------------------------------------------------------------------------------------
** Dtypes.
*/
typedef enum kiln_dtype {
  KILN_F32 = 0,
  KILN_F64,
  KILN_F16,
  KILN_BF16,
  KILN_I64,
  KILN_I32,
  KILN_U8,
  KILN_BOOL,
  KILN_DTYPE__COUNT
} kiln_dtype;

KILN_API const char *kiln_dtype_name(kiln_dtype dt); /* "float32", ...; "?" if invalid */
KILN_API size_t kiln_dtype_size(kiln_dtype dt);      /* bytes per element; 0 if invalid */
KILN_API bool kiln_dtype_is_float(kiln_dtype dt);    /* f32 f64 f16 bf16 */
/* The dtype of a binary op's result, PyTorch's promotion rules (no 0-dim special case). */
KILN_API kiln_dtype kiln_dtype_promote(kiln_dtype a, kiln_dtype b);
/* Scalar conversions for the 16-bit floats (round to nearest even). */
KILN_API uint16_t kiln_f32_to_f16(float f);
KILN_API float kiln_f16_to_f32(uint16_t h);
KILN_API uint16_t kiln_f32_to_bf16(float f);
KILN_API float kiln_bf16_to_f32(uint16_t b);

/* --------------------------------------------------------------------------------------
** Devices.
*/
typedef enum kiln_device_type {
  KILN_DEVICE_CPU = 0,
  KILN_DEVICE_CUDA = 1,
  KILN_DEVICE_VULKAN = 2 /* Vulkan compute: AMD, Intel, NVIDIA, Apple (MoltenVK) GPUs */
} kiln_device_type;
typedef struct kiln_device {
  kiln_device_type type;
  int index;
} kiln_device;

KILN_API kiln_device kiln_device_cpu(void);
KILN_API kiln_device kiln_device_cuda(int index);
/* KILN_DEVICE from the environment if set and valid, else device 0 of the best backend
** that works (cuda:0 when CUDA is built and a device works), else cpu. */
KILN_API kiln_device kiln_device_best(void);
/* Parses "cpu", "cuda", "cuda:N" (and "<name>", "<name>:N" for any other backend
** registered). KILN_ERR_DEVICE (with a message) on anything else or a device that does
** not exist. */
KILN_API kiln_status kiln_device_parse(const char *s, kiln_device *out);
/* "cpu" or "<backend>:N" ("cuda:0") into buf (at least 24 bytes); returns buf. */
KILN_API const char *kiln_device_str(kiln_device dev, char *buf, size_t n);
KILN_API bool kiln_device_equal(kiln_device a, kiln_device b);
/* Number of devices of a type that work now (cpu: 1; cuda: 0 when unavailable). */
KILN_API int kiln_device_count(kiln_device_type type);
/* Waits for all queued work on dev. */
KILN_API kiln_status kiln_device_synchronize(kiln_device dev);
/* Device-side timing, as torch.cuda.Event(enable_timing=True): a mark is a timestamp put
** on dev's queue in order with its work, so the time between two marks is the device's
** time for the work queued between them, without waiting for anything when recorded. On
** the CPU (which runs each op as it is called) a mark is the host clock. */
typedef struct kiln_mark kiln_mark;
/* NULL on error (inside a graph capture, for one: a captured step cannot be timed). */
KILN_API kiln_mark *kiln_mark_record(kiln_device dev);
/* Waits until stop has been reached and returns the milliseconds from start to stop; frees
** both marks (either may be NULL: then -1 and the error). -1 on any error. */
KILN_API double kiln_mark_elapsed_ms(kiln_mark *start, kiln_mark *stop);
/* Whether the backend was compiled in, and whether it works now; when not, *why (static
** or thread-local string) says why. */
KILN_API bool kiln_backend_built(kiln_device_type type);
KILN_API bool kiln_backend_available(kiln_device_type type, const char **why);
/* The backends this process has: the built-in ones (cpu first, then cuda when built) and
** any registered at run time (those get type ids of their own, beyond the named values).
** kiln_backend_type(i) is the i-th (0 <= i < kiln_backend_count(); -1 past the end);
** kiln_backend_name(type) is the name its devices print and parse with ("cpu", "cuda";
** NULL for an unknown type). */
KILN_API int kiln_backend_count(void);
KILN_API kiln_device_type kiln_backend_type(int i);
KILN_API const char *kiln_backend_name(kiln_device_type type);

/* Details of a device, for tools and logs. */
typedef struct kiln_device_info {
  char name[256];                    /* "NVIDIA H200"; the CPU model on the CPU */
  int compute_major, compute_minor;  /* CUDA compute capability; 0 on the CPU */
  int multiprocessors;               /* streaming multiprocessors; cores on the CPU */
  int64_t total_memory, free_memory; /* bytes */
  int driver_version, runtime_version, blas_version; /* CUDA's integers (12040 = 12.4) */
  /* cuDNN's version as cudnnGetVersion() gives it (91400 = 9.14.0; cuDNN 8: 8907 =
  ** 8.9.7): the library loaded, which may be newer than the one kiln was built with; 0
  ** without cuDNN. Its fused attention and convolution engines change from release to
  ** release. */
  int dnn_version;
} kiln_device_info;
KILN_API kiln_status kiln_device_info_get(kiln_device dev, kiln_device_info *out);
/* Host<->device copy bandwidth in GB/s, pinned memory (KILN_ERR_INVALID_ARGUMENT on cpu). */
KILN_API kiln_status kiln_device_bandwidth(kiln_device dev, double *h2d_gbs, double *d2h_gbs);

/* What a Vulkan device offers, for diagnostics (kiln doctor): its type ("discrete",
** "integrated", "virtual", "cpu", "other"), driver ("name: info" from the driver's
** properties), Vulkan version (major*1000 + minor*10, as kiln_device_info), memory heaps
** (size, device-local or not), whether its device memory is host-visible (unified: the
** host copies are memcpy of mapped memory), its subgroup size and whether compute shaders
** have subgroup arithmetic (subgroupAdd/subgroupMax), and its optional features: f64, f16
** and int8 arithmetic, bf16 (VK_KHR_shader_bfloat16) and cooperative matrices
** (VK_KHR_cooperative_matrix or VK_NV_cooperative_matrix). index is N of vulkan:N.
** Errors: KILN_ERR_DEVICE (no such device, or a build without Vulkan). */
#define KILN_VK_MAX_HEAPS 16
typedef struct kiln_vulkan_info {
  char type[16];
  char driver[288];
  int api_version;
  int vendor_id, device_id;
  int n_heaps;
  int64_t heap_size[KILN_VK_MAX_HEAPS];
  bool heap_device_local[KILN_VK_MAX_HEAPS];
  bool unified;
  int subgroup_size;
  bool subgroup_arith;
  bool f64, f16, int8, bf16, coop_matrix;
} kiln_vulkan_info;
KILN_API kiln_status kiln_vulkan_info_get(int index, kiln_vulkan_info *out);
/* Which kernel vulkan:index runs a plain row-major product of dtype (f32, f16, bf16)
** [m, k] @ [k, n] with, and why not a faster one: a sentence in out (out_n bytes, cut to
** fit), e.g. "tensor cores: VK_NV_cooperative_matrix 16x16x16 f16 -> f32, 128x128 tiles".
** Errors: KILN_ERR_DEVICE (no such device, or a build without Vulkan),
** KILN_ERR_INVALID_ARGUMENT (out NULL, another dtype, a size < 1 or >= 2^31). */
KILN_API kiln_status kiln_vulkan_matmul_path(int index, kiln_dtype dtype, int64_t m, int64_t n, int64_t k,
                                             char *out, size_t out_n);
/* The cooperative-matrix shapes vulkan:index's driver offers through
** VK_NV_cooperative_matrix ("MxNxK A/B/C/D" types, comma-separated; "" when none), for
** diagnosing why tensor cores do not engage. Errors as kiln_vulkan_matmul_path. */
KILN_API kiln_status kiln_vulkan_coop_shapes(int index, char *out, size_t out_n);

/* Threads of the CPU backend (KILN_NUM_THREADS, else the number of cores). */
KILN_API int kiln_num_threads(void);
KILN_API void kiln_set_num_threads(int n);

/* Checks the environment variables kiln reads: name is one of "KILN_DEVICE" (cpu, cuda or
** cuda:N, a device that exists), "KILN_NUM_THREADS" (an integer from 1 to 1024),
** "KILN_FALLBACK" (warn, error or silent), "KILN_PROFILE" (0, 1 or device), or a tuning
** switch (kiln_env_about: KILN_ENV_TUNING) against its accepted values; NULL checks all
** of them and returns the first problem. Unset or empty is fine. Returns KILN_OK, or
** KILN_ERR_INVALID_ARGUMENT (a value that is not one of the accepted ones: the message
** names the variable, the value and what is accepted; or a name kiln does not read: the
** message names the nearest one it does) or KILN_ERR_DEVICE (KILN_DEVICE names a device
** this machine lacks). The library itself warns once on stderr and goes on with the
** default when it meets a bad value; programs call this at start to refuse it. */
KILN_API kiln_status kiln_env_check(const char *name);
/* What kiln makes of the environment variable `name`: KILN_ENV_SETTING for those above and
** KILN_DATA_DIR; KILN_ENV_TUNING for a tuning switch, which picks among kiln's own paths and
** kernels for comparisons, bug reports or a way around a driver's fault (KILN_ATTENTION=own,
** KILN_CONV_GEMM=0, ...; the defaults are the measured, tested choices); KILN_ENV_TOOL for
** one read by kiln's programs, tests or build; KILN_ENV_UNKNOWN for any other name (a
** typo, when it starts KILN_). *what, when not NULL, gets a line saying what it sets (NULL
** for an unknown name). */
typedef enum { KILN_ENV_UNKNOWN = 0, KILN_ENV_SETTING, KILN_ENV_TUNING, KILN_ENV_TOOL } kiln_env_kind;
KILN_API kiln_env_kind kiln_env_about(const char *name, const char **what);
/* The i-th tuning switch's name, in alphabetical order; NULL past the last (for listing
** them: kiln doctor --switches). */
KILN_API const char *kiln_env_switch(int i);
/* The variable kiln reads (a setting, a tuning switch, or a tool's own) nearest to `name`,
** at most two edits away: the fix to suggest for a misspelt name ("KILN_FALLBAK" ->
** "KILN_FALLBACK"); name itself when it is one of them; NULL when none is that near. */
KILN_API const char *kiln_env_nearest(const char *name);

/* --------------------------------------------------------------------------------------
** Tensors: an opaque, refcounted view (storage + offset + shape + strides + dtype).
*/
typedef struct kiln_tensor kiln_tensor;

/* KILN_SHAPE(2, 3) expands to the two arguments `2, (const int64_t[]){2, 3}`. */
#define KILN__NARGS(...) ((int)(sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)))
#define KILN_SHAPE(...) KILN__NARGS(__VA_ARGS__), ((const int64_t[]){__VA_ARGS__})
#define KILN_SHAPE0 0, ((const int64_t *)0) /* a 0-dim (scalar) tensor */
/* KILN_DIMS(0, 2) expands to `2, (const int[]){0, 2}` for reductions and permute. */
#define KILN_DIMS(...)                                                                    \
  ((int)(sizeof((int[]){__VA_ARGS__}) / sizeof(int))), ((const int[]){__VA_ARGS__})

/* Lifetime. */
KILN_API kiln_tensor *kiln_tensor_ref(kiln_tensor *t); /* +1 reference, returns t */
KILN_API void kiln_tensor_free(kiln_tensor *t);        /* -1 reference; NULL is a no-op */
/* Takes t out of the scope that owns it: the caller then owns that reference. Returns t.
** A tensor that no scope owns is returned unchanged. */
KILN_API kiln_tensor *kiln_keep(kiln_tensor *t);

/* Scopes (thread-local stack). kiln_scope_end() releases every reference the innermost
** scope holds; it returns KILN_ERR_STATE if no scope is open. */
KILN_API void kiln_scope_begin(void);
KILN_API kiln_status kiln_scope_end(void);
KILN_API int kiln_scope_depth(void);
/* Live tensor handles in this process (for leak tests). */
KILN_API int64_t kiln_live_tensors(void);
/* A number that names t's handle for the life of the process (never reused; views get
** their own). Traces name tensors by it. 0 for NULL. */
KILN_API int64_t kiln_tensor_id(const kiln_tensor *t);

/* Accessors (t must not be NULL, except where noted). */
KILN_API int kiln_ndim(const kiln_tensor *t);
KILN_API int64_t kiln_size(const kiln_tensor *t, int dim); /* negative dim counts back */
KILN_API const int64_t *kiln_shape(const kiln_tensor *t);
KILN_API const int64_t *kiln_strides(const kiln_tensor *t); /* in elements */
KILN_API int64_t kiln_numel(const kiln_tensor *t);
KILN_API kiln_dtype kiln_dtype_of(const kiln_tensor *t);
KILN_API kiln_device kiln_device_of(const kiln_tensor *t);
KILN_API bool kiln_is_contiguous(const kiln_tensor *t);
KILN_API size_t kiln_nbytes(const kiln_tensor *t); /* numel * element size */
/* "[2, 3]" into buf; returns buf. NULL t gives "(null)". */
KILN_API const char *kiln_shape_str(const kiln_tensor *t, char *buf, size_t n);
/* The same for ndim dims given as numbers (a shape read from a file's header). */
KILN_API const char *kiln_dims_str(int ndim, const int64_t *shape, char *buf, size_t n);

/* Creation. shape may be NULL when ndim is 0. gen may be NULL: the global generator. */
typedef struct kiln_generator kiln_generator;
KILN_API kiln_tensor *kiln_empty(int ndim, const int64_t *shape, kiln_dtype dt, kiln_device dev);
KILN_API kiln_tensor *kiln_zeros(int ndim, const int64_t *shape, kiln_dtype dt, kiln_device dev);
KILN_API kiln_tensor *kiln_ones(int ndim, const int64_t *shape, kiln_dtype dt, kiln_device dev);
KILN_API kiln_tensor *kiln_full(int ndim, const int64_t *shape, double value, kiln_dtype dt,
                                kiln_device dev);
KILN_API kiln_tensor *kiln_scalar(double value, kiln_dtype dt, kiln_device dev); /* 0-dim */
KILN_API kiln_tensor *kiln_zeros_like(const kiln_tensor *t);
KILN_API kiln_tensor *kiln_ones_like(const kiln_tensor *t);
KILN_API kiln_tensor *kiln_full_like(const kiln_tensor *t, double value);
/* [start, end) by step (1-d). Errors on step 0 or a count over 2^40. */
KILN_API kiln_tensor *kiln_arange(double start, double end, double step, kiln_dtype dt,
                                  kiln_device dev);
KILN_API kiln_tensor *kiln_linspace(double start, double end, int64_t steps, kiln_dtype dt,
                                    kiln_device dev);
KILN_API kiln_tensor *kiln_eye(int64_t n, int64_t m, kiln_dtype dt, kiln_device dev);
/* Uniform [0, 1), standard normal, integers in [low, high). Counter-based: the same
** generator state gives the same values for any thread count and device. */
KILN_API kiln_tensor *kiln_rand(int ndim, const int64_t *shape, kiln_dtype dt, kiln_device dev,
                                kiln_generator *gen);
KILN_API kiln_tensor *kiln_randn(int ndim, const int64_t *shape, kiln_dtype dt, kiln_device dev,
                                 kiln_generator *gen);
KILN_API kiln_tensor *kiln_randint(int64_t low, int64_t high, int ndim, const int64_t *shape,
                                   kiln_dtype dt, kiln_device dev, kiln_generator *gen);
/* uniform in [low, high) / normal(mean, std) into an existing tensor (no autograd). */
KILN_API kiln_status kiln_uniform_(kiln_tensor *t, double low, double high, kiln_generator *gen);
KILN_API kiln_status kiln_normal_(kiln_tensor *t, double mean, double std, kiln_generator *gen);
/* A random permutation of 0..n-1 (i64, on the CPU), from the generator. */
KILN_API kiln_tensor *kiln_randperm(int64_t n, kiln_generator *gen);
/* Copies numel elements of dtype dt from host memory (C order). */
KILN_API kiln_tensor *kiln_from_data(const void *data, int ndim, const int64_t *shape,
                                     kiln_dtype dt, kiln_device dev);

/* Reading values (these wait for the device). */
/* Copies t (any strides) to host memory in C order, as t's dtype. nbytes must be at
** least kiln_nbytes(t). */
KILN_API kiln_status kiln_to_host(const kiln_tensor *t, void *dst, size_t nbytes);
/* The value of a one-element tensor as double; NAN and KILN_ERR_SHAPE otherwise. */
KILN_API double kiln_item(const kiln_tensor *t);
/* Element at a multi-index, as double (slow; for tests and printing). */
KILN_API double kiln_get(const kiln_tensor *t, const int64_t *index);
/* The bytes of a contiguous CPU tensor (NULL otherwise, with KILN_ERR_DEVICE). */
KILN_API void *kiln_data_ptr(kiln_tensor *t);

/* Printing, PyTorch-like: tensor([[1.0000, 2.0000]], dtype=..., device=...). */
KILN_API kiln_status kiln_print(const kiln_tensor *t);
KILN_API kiln_status kiln_fprint(FILE *f, const kiln_tensor *t);
/* The same text into buf; returns the length it needs (snprintf-like), -1 on error. */
KILN_API int kiln_snprint(char *buf, size_t n, const kiln_tensor *t);

/* Conversion and movement (new tensors; the same tensor, +1 ref, when nothing changes). */
KILN_API kiln_tensor *kiln_to_dtype(kiln_tensor *t, kiln_dtype dt);
KILN_API kiln_tensor *kiln_to_device(kiln_tensor *t, kiln_device dev);
/* kiln_to_device of n tensors into out[0..n): compact host tensors that do not require
** grad (a loader's batch) go to a GPU in one transfer, into one device block, each result
** a view of its part; otherwise each goes by kiln_to_device. Results are owned by the
** scope like any new tensor. On error out[] is all NULL. */
KILN_API kiln_status kiln_to_device_many(int n, kiln_tensor *const *ts, kiln_device dev, kiln_tensor **out);
KILN_API kiln_tensor *kiln_contiguous(kiln_tensor *t);
/* Memory formats (PyTorch's torch.channels_last): the shape stays (N, C, H, W); a
** channels-last tensor has strides (H*W*C, 1, W*C, C), each pixel's channels adjacent.
** Ops keep a channels-last input's format, as PyTorch's do: conv2d (on CUDA cuDNN reads
** and writes NHWC as it is), the elementwise ops, casts and clone, max_pool2d, batch_norm,
** the _like creations; other ops read it as any strided tensor (results contiguous), and
** kiln_contiguous gives NCHW memory. A model's weights: kiln_module_to_format (kiln_nn.h). */
typedef enum kiln_memory_format {
  KILN_CONTIGUOUS_FORMAT = 0, /* C order */
  KILN_CHANNELS_LAST = 1      /* 4-d only */
} kiln_memory_format;
/* t laid out in format: t itself (a new reference, owned by the scope) when it already
** is, else a copy (differentiable). KILN_ERR_SHAPE for channels-last of a tensor that is
** not 4-d, KILN_ERR_INVALID_ARGUMENT for an unknown format; NULL in passes through. */
KILN_API kiln_tensor *kiln_contiguous_format(kiln_tensor *t, kiln_memory_format format);
/* Whether t's strides are format's (size-1 dims may have any stride). false for NULL. */
KILN_API bool kiln_is_contiguous_format(const kiln_tensor *t, kiln_memory_format format);
KILN_API kiln_tensor *kiln_clone(kiln_tensor *t);

/* --------------------------------------------------------------------------------------
** Views: no copy; they share storage. Negative dims count from the end.
*/
/* reshape that never copies: KILN_ERR_SHAPE when strides do not allow it. One -1 infers. */
KILN_API kiln_tensor *kiln_view(kiln_tensor *t, int ndim, const int64_t *shape);
/* view when possible, else a contiguous copy. */
KILN_API kiln_tensor *kiln_reshape(kiln_tensor *t, int ndim, const int64_t *shape);
KILN_API kiln_tensor *kiln_flatten(kiln_tensor *t, int start_dim, int end_dim);
KILN_API kiln_tensor *kiln_permute(kiln_tensor *t, int ndim, const int *dims);
KILN_API kiln_tensor *kiln_transpose(kiln_tensor *t, int dim0, int dim1);
/* Elements [start, start+length) of dim. */
KILN_API kiln_tensor *kiln_narrow(kiln_tensor *t, int dim, int64_t start, int64_t length);
/* Python-style t[start:end:step] on one dim (negative start/end count back; clamps). */
KILN_API kiln_tensor *kiln_slice(kiln_tensor *t, int dim, int64_t start, int64_t end,
                                 int64_t step);
/* t[index] on dim: removes that dim. */
KILN_API kiln_tensor *kiln_select(kiln_tensor *t, int dim, int64_t index);
/* Broadcasts size-1 dims (and new leading dims) to shape; -1 keeps a size. */
KILN_API kiln_tensor *kiln_expand(kiln_tensor *t, int ndim, const int64_t *shape);
KILN_API kiln_tensor *kiln_squeeze(kiln_tensor *t, int dim); /* dim must have size 1 */
KILN_API kiln_tensor *kiln_squeeze_all(kiln_tensor *t);
KILN_API kiln_tensor *kiln_unsqueeze(kiln_tensor *t, int dim);
/* Splits t along dim into pieces of split_size (the last may be smaller). Writes up to
** max_out views into out; returns their number, or -1 on error. */
KILN_API int kiln_split(kiln_tensor *t, int64_t split_size, int dim, kiln_tensor **out,
                        int max_out);

/* --------------------------------------------------------------------------------------
** Ops. Each returns a new tensor (owned by the current scope) and records autograd when
** an input requires grad and grad mode is on. Binary ops broadcast and promote dtypes.
** Floating ops take f32, f64, f16, bf16 (16-bit floats computed in f32); arithmetic and
** comparisons also take the integer dtypes.
*/
KILN_API kiln_tensor *kiln_add(kiln_tensor *a, kiln_tensor *b);
KILN_API kiln_tensor *kiln_sub(kiln_tensor *a, kiln_tensor *b);
KILN_API kiln_tensor *kiln_mul(kiln_tensor *a, kiln_tensor *b);
KILN_API kiln_tensor *kiln_div(kiln_tensor *a, kiln_tensor *b);
KILN_API kiln_tensor *kiln_pow(kiln_tensor *a, kiln_tensor *b);
KILN_API kiln_tensor *kiln_maximum(kiln_tensor *a, kiln_tensor *b);
KILN_API kiln_tensor *kiln_minimum(kiln_tensor *a, kiln_tensor *b);
/* With a scalar (result keeps a's dtype). */
KILN_API kiln_tensor *kiln_add_scalar(kiln_tensor *a, double s);
KILN_API kiln_tensor *kiln_mul_scalar(kiln_tensor *a, double s);
KILN_API kiln_tensor *kiln_pow_scalar(kiln_tensor *a, double exponent);
/* a + alpha * b */
KILN_API kiln_tensor *kiln_axpy(kiln_tensor *a, double alpha, kiln_tensor *b);

KILN_API kiln_tensor *kiln_neg(kiln_tensor *t);
KILN_API kiln_tensor *kiln_exp(kiln_tensor *t);
KILN_API kiln_tensor *kiln_log(kiln_tensor *t);
KILN_API kiln_tensor *kiln_sqrt(kiln_tensor *t);
KILN_API kiln_tensor *kiln_rsqrt(kiln_tensor *t);
KILN_API kiln_tensor *kiln_abs(kiln_tensor *t);
/* Clamp to [lo, hi]; pass -INFINITY / INFINITY for no bound. */
KILN_API kiln_tensor *kiln_clamp(kiln_tensor *t, double lo, double hi);

/* Activations. */
KILN_API kiln_tensor *kiln_relu(kiln_tensor *t);
KILN_API kiln_tensor *kiln_leaky_relu(kiln_tensor *t, double negative_slope);
KILN_API kiln_tensor *kiln_gelu(kiln_tensor *t);      /* exact, with erf */
KILN_API kiln_tensor *kiln_gelu_tanh(kiln_tensor *t); /* tanh approximation */
KILN_API kiln_tensor *kiln_silu(kiln_tensor *t);
KILN_API kiln_tensor *kiln_sigmoid(kiln_tensor *t);
KILN_API kiln_tensor *kiln_tanh(kiln_tensor *t);
/* log(1 + exp(beta x)) / beta, linear above threshold (PyTorch: beta 1, threshold 20). */
KILN_API kiln_tensor *kiln_softplus(kiln_tensor *t, double beta, double threshold);

/* Comparisons (bool results, no gradient) and selection. */
KILN_API kiln_tensor *kiln_eq(kiln_tensor *a, kiln_tensor *b);
KILN_API kiln_tensor *kiln_ne(kiln_tensor *a, kiln_tensor *b);
KILN_API kiln_tensor *kiln_lt(kiln_tensor *a, kiln_tensor *b);
KILN_API kiln_tensor *kiln_le(kiln_tensor *a, kiln_tensor *b);
KILN_API kiln_tensor *kiln_gt(kiln_tensor *a, kiln_tensor *b);
KILN_API kiln_tensor *kiln_ge(kiln_tensor *a, kiln_tensor *b);
KILN_API kiln_tensor *kiln_gt_scalar(kiln_tensor *a, double s);
KILN_API kiln_tensor *kiln_lt_scalar(kiln_tensor *a, double s);
KILN_API kiln_tensor *kiln_eq_scalar(kiln_tensor *a, double s);
/* cond ? a : b, broadcasting all three; cond is bool (or any dtype: nonzero is true). */
KILN_API kiln_tensor *kiln_where(kiln_tensor *cond, kiln_tensor *a, kiln_tensor *b);

/* Reductions over a set of dims (ndims 0 with dims NULL: all dims). */
KILN_API kiln_tensor *kiln_sum(kiln_tensor *t, int ndims, const int *dims, bool keepdim);
KILN_API kiln_tensor *kiln_mean(kiln_tensor *t, int ndims, const int *dims, bool keepdim);
KILN_API kiln_tensor *kiln_amax(kiln_tensor *t, int ndims, const int *dims, bool keepdim);
KILN_API kiln_tensor *kiln_amin(kiln_tensor *t, int ndims, const int *dims, bool keepdim);
/* correction 1 is the unbiased estimate (PyTorch's default), 0 the population one. */
KILN_API kiln_tensor *kiln_var(kiln_tensor *t, int ndims, const int *dims, int correction,
                               bool keepdim);
KILN_API kiln_tensor *kiln_std(kiln_tensor *t, int ndims, const int *dims, int correction,
                               bool keepdim);
KILN_API kiln_tensor *kiln_sum_all(kiln_tensor *t);  /* 0-dim */
KILN_API kiln_tensor *kiln_mean_all(kiln_tensor *t); /* 0-dim */
/* max/min along one dim; *indices (may be NULL) gets the i64 positions (first on ties). */
KILN_API kiln_tensor *kiln_max_dim(kiln_tensor *t, int dim, bool keepdim, kiln_tensor **indices);
KILN_API kiln_tensor *kiln_min_dim(kiln_tensor *t, int dim, bool keepdim, kiln_tensor **indices);
KILN_API kiln_tensor *kiln_argmax(kiln_tensor *t, int dim, bool keepdim); /* i64 */
KILN_API kiln_tensor *kiln_argmin(kiln_tensor *t, int dim, bool keepdim); /* i64 */

KILN_API kiln_tensor *kiln_softmax(kiln_tensor *t, int dim);
KILN_API kiln_tensor *kiln_log_softmax(kiln_tensor *t, int dim);

/* Transformer ops (CPU and CUDA kernels; other backends run them through the CPU fallback).
** layer_norm over the last ndims dims, which must equal normalized_shape:
** (x - mean) / sqrt(var + eps) * weight + bias, var biased; weight and bias (of
** normalized_shape; either may be NULL) as PyTorch's. rms_norm: x / sqrt(mean(x^2) + eps)
** * weight. Both fused: the backward uses the mean and rstd the forward kept. Errors:
** KILN_ERR_SHAPE (normalized_shape vs the input, weight or bias), KILN_ERR_DTYPE. */
KILN_API kiln_tensor *kiln_layer_norm(kiln_tensor *x, int ndims, const int64_t *normalized_shape,
                                      kiln_tensor *weight, kiln_tensor *bias, double eps);
KILN_API kiln_tensor *kiln_rms_norm(kiln_tensor *x, int ndims, const int64_t *normalized_shape,
                                    kiln_tensor *weight, double eps);
/* softmax(q k^T * scale + mask) v for q (B, H, Tq, D), k (B, H, Tk, D), v (B, H, Tk, Dv)
** -> (B, H, Tq, Dv), one dtype. mask (may be NULL) broadcasts to (B, H, Tq, Tk): bool
** (true attends) or floating (added to the scores); is_causal lets query i attend keys
** j <= i (not both). dropout_p drops attention weights (scaled by 1/(1-p)) from gen (NULL:
** the global generator); pass 0 in eval. scale 0 means 1/sqrt(D). On the CPU no Tq x Tk
** matrix is made for long sequences: blocks of query rows against the keys they see (f32:
** 64 rows; bf16 with oneDNN: ~1 MiB of scores). A row with every key masked gives 0.
** The mask gets no gradient. Errors: KILN_ERR_SHAPE, KILN_ERR_DTYPE,
** KILN_ERR_INVALID_ARGUMENT (dropout_p outside [0, 1], mask with is_causal). */
KILN_API kiln_tensor *kiln_scaled_dot_product_attention(kiln_tensor *q, kiln_tensor *k, kiln_tensor *v,
                                                        kiln_tensor *mask, bool is_causal,
                                                        double dropout_p, double scale,
                                                        kiln_generator *gen);
/* Which implementation kiln_scaled_dot_product_attention uses (process-wide, as PyTorch's
** sdpa_kernel): FUSED (default) the ATTENTION kernels, no Tq x Tk matrix; MATH the
** composition matmul, scale, mask, softmax, matmul, which keeps the B x H x Tq x Tk weights
** for backward but runs on the BLAS (faster where a device's fused kernel is slow: see
** bench/RESULTS.md). MATH applies to calls without dropout (others stay FUSED) and gives
** NaN for a row whose keys are all masked, as PyTorch's math backend does. Returns the
** previous setting; an unknown value is KILN_ERR_INVALID_ARGUMENT's -1. */
typedef enum kiln_sdpa_backend { KILN_SDPA_FUSED = 0, KILN_SDPA_MATH = 1 } kiln_sdpa_backend;
KILN_API int kiln_sdpa_set_backend(kiln_sdpa_backend b);
/* kiln_linear for a few rows (a decode step: x (..., K) with one or two rows), with the
** tanh GELU of kiln_gelu_tanh fused when gelu: one pass over weight (N, K) per call, every
** row's product from the same weight loads (on CUDA a warp per output column, 16-byte
** loads), so the time is the weight's bytes over the bandwidth. The linear's output is
** rounded to the dtype before the GELU, as the two ops would. Where the device has no such
** kernel for these arguments (more rows: cuBLAS is faster from 16; f64, unaligned or strided
** rows) it is kiln_linear
** then kiln_gelu_tanh (always, under the environment variable KILN_LINEAR_DECODE=0).
** Inference only. Errors as kiln_linear. */
KILN_API kiln_tensor *kiln_linear_decode(kiln_tensor *x, kiln_tensor *weight, kiln_tensor *bias, bool gelu);
/* The residual add and the layer norm after it, one kernel (a transformer block's
** x + branch, then LayerNorm): *sum (may be NULL) = x + r rounded to x's dtype, and the
** result is kiln_layer_norm of that rounded sum over the last dim (weight, bias of that
** size, either may be NULL; eps). r broadcasts to x; one floating dtype. Inference only
** (KILN_ERR_AUTOGRAD when grad mode is on and an input requires grad). Errors as
** kiln_add and kiln_layer_norm. */
KILN_API kiln_tensor *kiln_add_layer_norm(kiln_tensor *x, kiln_tensor *r, kiln_tensor *weight, kiln_tensor *bias,
                                          double eps, kiln_tensor **sum);
/* The same for training (a GPT block's residual stream): *sum (may be NULL) = x + r in
** promote(x, r)'s dtype (r x's shape, or x's trailing dims repeated over the leading
** ones, as a position embedding (T, C) under x (B, T, C); any floating dtypes, as
** kiln_add then casts would give it), and the result is kiln_layer_norm of the sum over the last dim
** (weight, bias of that size, either NULL), in y_dtype: the f32 norm rounded then cast
** (under autocast the lower dtype the next product reads). Differentiable in x, r,
** weight and bias, through both outputs; on CUDA one kernel each way. Results owned by
** the current scope. KILN_ERR_SHAPE / KILN_ERR_DTYPE naming kiln_residual_layer_norm. */
KILN_API kiln_tensor *kiln_residual_layer_norm(kiln_tensor *x, kiln_tensor *r, kiln_tensor *weight,
                                               kiln_tensor *bias, double eps, kiln_dtype y_dtype, kiln_tensor **sum);
/* Attention of queries over a key/value cache whose valid length is read on the device (so
** a decode step keeps one shape for a whole generation and can be graph-captured):
** q (B, H, Tq, D), k (B, H, M, D), v (B, H, M, Dv) -> (B, H, Tq, Dv), one floating dtype;
** len an i64 tensor of 1 or B elements on the same device: row b holds L_b valid slots
** (L_b <= M), and query i is the position L_b - Tq + i of that row, attending the keys
** j <= L_b - Tq + i (causal over the cache; slots >= L_b are never read). scale 0 means
** 1/sqrt(D). A query with no key gives 0. Inference only: no gradient (KILN_ERR_AUTOGRAD
** when grad mode is on and an input requires grad). Errors: KILN_ERR_SHAPE, KILN_ERR_DTYPE;
** L_b > M is KILN_ERR_INDEX on the CPU, the device's index flag on CUDA. */
KILN_API kiln_tensor *kiln_kv_attention(kiln_tensor *q, kiln_tensor *k, kiln_tensor *v, kiln_tensor *len,
                                        double scale);
/* A decode step's cache write and attention in one: kv_new (2, B, H, Tq, D) (the new keys
** then values) is written into cache (2, B, H, M, D) at slots L_b - Tq + t of row b (the
** last Tq of its L_b valid slots, len as kiln_kv_attention's), then q attends the cache as
** kiln_kv_attention(q, cache[0], cache[1], len, scale). One kernel where the device has it
** (CUDA: 16-bit, one query per row, head dims 32/64/128; the new row is attended from
** kv_new, not read back), else kiln_index_copy_ then kiln_kv_attention. Errors as those
** two; L_b < Tq is KILN_ERR_INDEX on the CPU, the device's index flag on CUDA (nothing is
** written for that row). */
KILN_API kiln_tensor *kiln_kv_attention_append(kiln_tensor *q, kiln_tensor *cache, kiln_tensor *kv_new,
                                               kiln_tensor *len, double scale);
/* One token per row of logits (N, V) floating -> (N) i64, drawn with the RNG state held in
** the device tensor rng (2 i64 elements: a generator's seed and offset, bit for bit, as
** kiln_generator_get_state gives them), so that the draw can be part of a captured graph:
** the caller advances rng[1] by (N + 1) / 2 between draws, as kiln_multinomial advances a
** generator. The logits are divided by temperature (> 0) in f32; top_k (0: off) keeps the
** values >= the k-th largest; top_p (1: off) then keeps the values >= the smallest value v
** whose higher values hold less than top_p of the kept probability (transformers' order,
** ties with the last kept value kept); one draw from what is left. Temperature 0 is the
** argmax instead (the first maximum, NaN counted largest; rng may be NULL). Weights are
** exp(z - max) in 2^-32 fixed point, so every sum is exact and the draw is the same for
** every thread count (a weight under 2^-32 of the largest is 0). Row r draws the f64
** Philox uniform of element r (kiln_multinomial's mapping). Never synchronizes: a row
** with no finite logit gives token 0 (and the device's index flag on CUDA, KILN_ERR_INDEX
** at once on the CPU). Errors: KILN_ERR_SHAPE, KILN_ERR_DTYPE, KILN_ERR_INVALID_ARGUMENT
** (temperature < 0 or not finite, a NULL rng to sample with, top_k < 0, top_p outside
** (0, 1]). */
KILN_API kiln_tensor *kiln_sample_tokens(kiln_tensor *logits, kiln_tensor *rng, double temperature, int64_t top_k,
                                         double top_p);
/* torch.Tensor.index_copy_: dst[..., index[t], ...] = src[..., t, ...] along dim, index an
** i64 tensor of src's size along dim (1-d, or one element), read on the device (a KV cache
** write at a position held on the device). src has dst's dtype and its shape but along dim.
** Returns the status; never recorded by autograd. Errors: KILN_ERR_SHAPE, KILN_ERR_DTYPE,
** KILN_ERR_INDEX (an index outside dst: at once on the CPU, the device's flag on CUDA). */
KILN_API kiln_status kiln_index_copy_(kiln_tensor *dst, int dim, kiln_tensor *index, kiln_tensor *src);
/* Running sum along dim; integer and bool inputs give i64. */
KILN_API kiln_tensor *kiln_cumsum(kiln_tensor *t, int dim);
/* The lower (upper) triangle of the last two dims: elements with j - i <= diagonal
** (>= diagonal for triu) kept, the rest 0. 2 or more dims (KILN_ERR_SHAPE otherwise). */
KILN_API kiln_tensor *kiln_tril(kiln_tensor *t, int64_t diagonal);
KILN_API kiln_tensor *kiln_triu(kiln_tensor *t, int64_t diagonal);
/* The k largest (smallest) values along dim, sorted, NaN counted largest, ties by lower
** index; *indices (may be NULL) gets their i64 positions. Both owned by the caller's
** scope. KILN_ERR_INVALID_ARGUMENT when k is outside [0, size of dim]. */
KILN_API kiln_tensor *kiln_topk(kiln_tensor *t, int64_t k, int dim, bool largest, bool sorted,
                                kiln_tensor **indices);
/* num_samples i64 class indices per row of probs (C) or (N, C) -> (S) or (N, S), drawn
** with weights probs (non-negative, finite, not all 0 in a row; need not sum to 1), with
** or without replacement, from gen (NULL: global). Same seed, same samples on every
** backend (the mapping: src/backend/cpu/cpu_scan.c). KILN_ERR_INVALID_ARGUMENT for a bad
** distribution or too many samples without replacement. */
KILN_API kiln_tensor *kiln_multinomial(kiln_tensor *probs, int64_t num_samples, bool replacement,
                                       kiln_generator *gen);

/* Matrix products. matmul follows torch.matmul: 1-d operands are promoted and the
** result squeezed; batch dims broadcast. Exact f32 by default (see kiln_set_matmul_tf32). */
KILN_API kiln_tensor *kiln_matmul(kiln_tensor *a, kiln_tensor *b);
/* x (..., in) @ weight(out, in)^T + bias(out); bias may be NULL. Bias is fused. */
KILN_API kiln_tensor *kiln_linear(kiln_tensor *x, kiln_tensor *weight, kiln_tensor *bias);
/* relu(kiln_linear(x, weight, bias)) as one op: the ReLU is applied inside the product's
** kernel, and its backward folded into the products of the linear's backward (two kernel
** launches fewer a step each way on a GPU). Same values and errors as the two ops; a
** Sequential of Linear then ReLU uses it by itself. */
KILN_API kiln_tensor *kiln_linear_relu(kiln_tensor *x, kiln_tensor *weight, kiln_tensor *bias);
/* kiln_gelu_tanh(kiln_linear(x, weight, bias)) as one op (GPT-2's MLP uses it): on CUDA
** one cuBLASLt call with a GELU epilogue writes the output and the pre-activation, which
** the node keeps for the backward (as the two ops would keep it); elsewhere the product
** then the GELU. Same errors as kiln_linear, named kiln_linear_gelu; the result is owned
** by the current scope. */
KILN_API kiln_tensor *kiln_linear_gelu(kiln_tensor *x, kiln_tensor *weight, kiln_tensor *bias);
/* Allows TF32 tensor cores for f32 matmul on devices that have them (default off). */
KILN_API void kiln_set_matmul_tf32(bool allow);
KILN_API bool kiln_matmul_tf32(void);

/* Joining and indexing. */
KILN_API kiln_tensor *kiln_cat(int n, kiln_tensor *const *ts, int dim);
KILN_API kiln_tensor *kiln_stack(int n, kiln_tensor *const *ts, int dim);
/* index is 1-d i64 or i32; KILN_ERR_INDEX on an out-of-range entry. */
KILN_API kiln_tensor *kiln_index_select(kiln_tensor *t, int dim, kiln_tensor *index);
/* out[i][j] = t[i][index[i][j]] (dim 1), index i64/i32 with t's ndim. */
KILN_API kiln_tensor *kiln_gather(kiln_tensor *t, int dim, kiln_tensor *index);
/* A copy of t with src added at index along dim: out[i][index[i][j]] += src[i][j]. */
KILN_API kiln_tensor *kiln_scatter_add(kiln_tensor *t, int dim, kiln_tensor *index,
                                       kiln_tensor *src);
/* weight (num, dim) rows picked by integer ids (any shape): (..., dim). */
KILN_API kiln_tensor *kiln_embedding(kiln_tensor *weight, kiln_tensor *ids);

/* Dropout with probability p (scaled by 1/(1-p)); identity when !train or p == 0. */
KILN_API kiln_tensor *kiln_dropout(kiln_tensor *t, double p, bool train, kiln_generator *gen);

/* Convolutional layers, NCHW. Two-element arrays are (height, width); NULL gives the
** default (stride 1, padding 0, dilation 1). Every floating dtype (16-bit floats computed
** in f32), forward and backward. Results are owned by the current scope. Errors:
** KILN_ERR_SHAPE when a kernel is larger than the padded input, groups do not divide the
** channels, or shapes disagree (the message names the op and the shapes);
** KILN_ERR_DTYPE for mixed or integer dtypes; KILN_ERR_INVALID_ARGUMENT for a stride,
** dilation or groups < 1 and for negative padding. */
/* A padding value meaning "same" for that dim: the output keeps the input's size (stride 1
** only); an odd total puts the extra row/column after, as PyTorch. */
#define KILN_PADDING_SAME (-1)
/* x (N, C, H, W), weight (OC, C/groups, kh, kw), bias (OC) or NULL -> (N, OC, OH, OW).
** groups == C with weight (C*m, 1, kh, kw) is a depthwise convolution. */
KILN_API kiln_tensor *kiln_conv2d(kiln_tensor *x, kiln_tensor *weight, kiln_tensor *bias, const int64_t *stride,
                                  const int64_t *padding, const int64_t *dilation, int64_t groups);
/* x (N, C, L), weight (OC, C/groups, k), bias (OC) or NULL -> (N, OC, OL); padding may be
** KILN_PADDING_SAME. */
KILN_API kiln_tensor *kiln_conv1d(kiln_tensor *x, kiln_tensor *weight, kiln_tensor *bias, int64_t stride,
                                  int64_t padding, int64_t dilation, int64_t groups);
/* The adjoint of conv2d in x: x (N, C, H, W), weight (C, OC/groups, kh, kw), bias (OC) ->
** (N, OC, (H-1)*stride - 2*padding + dilation*(kh-1) + output_padding + 1, ...). */
KILN_API kiln_tensor *kiln_conv_transpose2d(kiln_tensor *x, kiln_tensor *weight, kiln_tensor *bias,
                                            const int64_t *stride, const int64_t *padding,
                                            const int64_t *output_padding, const int64_t *dilation,
                                            int64_t groups);
/* The max of each window (stride NULL: the kernel size; padding at most half the kernel,
** never chosen). *indices (may be NULL) gets the i64 flat index h*W + w of each maximum
** in its plane, owned by the current scope. */
KILN_API kiln_tensor *kiln_max_pool2d(kiln_tensor *x, const int64_t *kernel, const int64_t *stride,
                                      const int64_t *padding, const int64_t *dilation, kiln_tensor **indices);
/* kiln_max_pool2d(kiln_relu(x), ...) as one op: the same values and gradients. Where the
** windows tile x (stride = kernel, no padding, no dilation; MaxPool2d(k)) in f32 on the
** CPU, one pass each way that keeps a byte per output for the backward instead
** of two full-size maps; elsewhere the two ops. A Sequential of ReLU then MaxPool2d uses
** it by itself. */
KILN_API kiln_tensor *kiln_relu_max_pool2d(kiln_tensor *x, const int64_t *kernel, const int64_t *stride,
                                           const int64_t *padding, const int64_t *dilation);
/* kiln_relu_max_pool2d(kiln_conv2d(x, weight, bias, ...), pool...) as one op: the same
** values and gradients. Where x has one channel and needs no gradient (an image CNN's
** first layer), stride and dilation 1, groups 1, f32, and the pool windows tile (CPU with
** oneDNN), one pass each way that never makes the conv's full-size output or its
** gradient; elsewhere the ops it stands for. A Sequential of Conv2d, ReLU, MaxPool2d uses
** it by itself. */
KILN_API kiln_tensor *kiln_conv2d_relu_max_pool2d(kiln_tensor *x, kiln_tensor *weight, kiln_tensor *bias,
                                                  const int64_t *stride, const int64_t *padding,
                                                  const int64_t *dilation, int64_t groups, const int64_t *pool_kernel,
                                                  const int64_t *pool_stride, const int64_t *pool_padding,
                                                  const int64_t *pool_dilation);
/* The mean of each window, the padding's zeros counted (PyTorch's count_include_pad). */
KILN_API kiln_tensor *kiln_avg_pool2d(kiln_tensor *x, const int64_t *kernel, const int64_t *stride,
                                      const int64_t *padding);
/* (N, C, H, W) -> (N, C, output_size[0], output_size[1]), PyTorch's windows. */
KILN_API kiln_tensor *kiln_adaptive_avg_pool2d(kiln_tensor *x, const int64_t *output_size);
typedef enum kiln_upsample_mode {
  KILN_UPSAMPLE_NEAREST = 0, /* source floor(o * in / out) */
  KILN_UPSAMPLE_BILINEAR     /* align_corners = false */
} kiln_upsample_mode;
/* (N, C, H, W) -> (N, C, size[0], size[1]). */
KILN_API kiln_tensor *kiln_upsample(kiln_tensor *x, const int64_t *size, kiln_upsample_mode mode);
typedef enum kiln_pad_mode {
  KILN_PAD_CONSTANT = 0, /* value */
  KILN_PAD_REFLECT       /* mirrored without the edge; each pad smaller than its dim */
} kiln_pad_mode;
/* n pad sizes >= 0 in PyTorch's order: (last dim before, after, the dim before it ...). */
KILN_API kiln_tensor *kiln_pad(kiln_tensor *x, int n, const int64_t *pads, kiln_pad_mode mode, double value);
/* x (N, C, ...). Training: normalized with the batch's mean and biased variance over every
** dim but 1, and running_mean/running_var (C, either may be NULL) updated in place,
** r = (1-momentum) r + momentum stat (the unbiased variance); KILN_ERR_SHAPE when there
** is one value per channel. Eval: normalized with the running statistics (required).
** weight, bias (C) or NULL. */
KILN_API kiln_tensor *kiln_batch_norm(kiln_tensor *x, kiln_tensor *running_mean, kiln_tensor *running_var,
                                      kiln_tensor *weight, kiln_tensor *bias, bool training, double momentum,
                                      double eps);
/* relu(kiln_batch_norm(...)) as one op: the same values and gradients, without the
** normalized tensor before the ReLU (not written, not kept for the backward: the output
** itself tells where the ReLU let the gradient through). ResNet's conv-bn-relu. */
KILN_API kiln_tensor *kiln_batch_norm_relu(kiln_tensor *x, kiln_tensor *running_mean, kiln_tensor *running_var,
                                           kiln_tensor *weight, kiln_tensor *bias, bool training, double momentum,
                                           double eps);
/* relu(kiln_batch_norm(x, ...) + residual) as one op (ResNet's block tail): the same
** values as the three ops up to one rounding (the sum is not rounded to x's dtype before
** the ReLU), without the normalized tensor and the sum (neither written nor kept), where
** the device has the fused kernel (the CPU; elsewhere, CUDA included for now, the three
** ops run). The residual has x's shape and dtype (else the three ops run). */
KILN_API kiln_tensor *kiln_batch_norm_add_relu(kiln_tensor *x, kiln_tensor *residual, kiln_tensor *running_mean,
                                               kiln_tensor *running_var, kiln_tensor *weight, kiln_tensor *bias,
                                               bool training, double momentum, double eps);
/* x (N, C, ...) normalized over each group of C/groups channels; weight, bias (C) or NULL. */
KILN_API kiln_tensor *kiln_group_norm(kiln_tensor *x, int64_t groups, kiln_tensor *weight, kiln_tensor *bias,
                                      double eps);
/* Zeroes whole channels of x (N, C, ...) with probability p, scales the rest by 1/(1-p);
** identity when !train or p == 0. */
KILN_API kiln_tensor *kiln_dropout2d(kiln_tensor *x, double p, bool train, kiln_generator *gen);

/* Losses. */
typedef enum kiln_reduction {
  KILN_REDUCTION_MEAN = 0,
  KILN_REDUCTION_SUM,
  KILN_REDUCTION_NONE
} kiln_reduction;
/* logits (N, C) or (N, C, d...) and class indices (N) / (N, d...) in [0, C) (i64/i32).
** Mean is over targets that are not ignore_index (PyTorch's rule). label_smoothing in
** [0, 1]. Use ignore_index -100 for PyTorch's default. When the logits require grad,
** the forward also computes their gradient (the same size as the logits, kept with the
** graph), so that kiln_backward(loss) runs no kernel for this op. */
KILN_API kiln_tensor *kiln_cross_entropy(kiln_tensor *logits, kiln_tensor *target,
                                         kiln_reduction red, int64_t ignore_index,
                                         double label_smoothing);
/* kiln_cross_entropy(kiln_linear(x, weight, NULL) as (M, C), target as (M)) without the
** (M, C) logits: x (..., K), weight (C, K), target of x's leading dims. The rows go in
** chunks (logits of about 2^27 elements at a time, classes padded to 64); the forward also makes the gradients
** of x and weight when they need them (kept with the graph: x's and weight's sizes, not
** the logits'). Reduction mean or sum (KILN_ERR_INVALID_ARGUMENT for none). The loss's
** dtype is kiln_cross_entropy's (f32 under autocast, else the inputs'); the weight's
** gradient is summed over the chunks in its dtype. Owned by the current scope. A language model's head and loss
** (kiln_gpt_forward_loss uses it). */
KILN_API kiln_tensor *kiln_linear_cross_entropy(kiln_tensor *x, kiln_tensor *weight, kiln_tensor *target,
                                                kiln_reduction red, int64_t ignore_index, double label_smoothing);
KILN_API kiln_tensor *kiln_mse_loss(kiln_tensor *input, kiln_tensor *target, kiln_reduction red);

/* In-place updates, for optimizers and initialisers: never recorded by autograd and
** refused (KILN_ERR_AUTOGRAD) on a tensor that requires grad while grad mode is on. */
KILN_API kiln_status kiln_copy_(kiln_tensor *dst, kiln_tensor *src); /* broadcasts, casts */
/* kiln_copy_(dsts[i], srcs[i]) for i < n. Destinations made together by
** kiln_to_device_many, refilled from compact host tensors of their shapes and dtypes (a
** captured step's static inputs), take one transfer for all. Errors name the pair. */
KILN_API kiln_status kiln_copy_many_(int n, kiln_tensor *const *dsts, kiln_tensor *const *srcs);
KILN_API kiln_status kiln_fill_(kiln_tensor *t, double value);
KILN_API kiln_status kiln_zero_(kiln_tensor *t);
KILN_API kiln_status kiln_mul_scalar_(kiln_tensor *t, double s);
KILN_API kiln_status kiln_add_scalar_(kiln_tensor *t, double s);
KILN_API kiln_status kiln_axpy_(kiln_tensor *t, double alpha, kiln_tensor *x); /* t += a*x */

/* Fused Adam/AdamW update of one parameter, in place, in one kernel (PyTorch's formulas:
** torch.optim.Adam/AdamW). param, grad and the state tensors must have one shape, dtype
** and device and be contiguous; max_exp_avg_sq may be NULL unless amsgrad. step is the
** update count after this one (>= 1). decoupled selects AdamW's weight decay. When
** step_t (an f64 one-element tensor on the parameter's device) is given, the kernel reads
** the count from it instead (step_t + 1) and the call then adds 1 to it on the device:
** nothing the host passes changes between steps, so the update can be graph-captured. */
KILN_API kiln_status kiln_adam_step_(kiln_tensor *param, kiln_tensor *grad, kiln_tensor *exp_avg,
                                     kiln_tensor *exp_avg_sq, kiln_tensor *max_exp_avg_sq,
                                     double lr, double beta1, double beta2, double eps,
                                     double weight_decay, int64_t step, bool decoupled,
                                     bool amsgrad, kiln_tensor *step_t);
/* kiln_adam_step_ over n parameters at once (PyTorch's fused/multi-tensor Adam): the
** tensors of one device and dtype are updated in as few kernel launches as the backend
** allows (CUDA: one launch for up to 32 tensors), with the same numbers as n single
** calls. Each array holds n tensors; max_exp_avg_sq may be NULL unless amsgrad. Either
** step_t (n step tensors, read and then advanced on the device, as above) or steps (the
** n update counts, >= 1) is given. Every tensor is checked before any is changed; errors
** name the tensor's position. */
KILN_API kiln_status kiln_adam_multi_step_(int n, kiln_tensor *const *params,
                                           kiln_tensor *const *grads, kiln_tensor *const *exp_avg,
                                           kiln_tensor *const *exp_avg_sq,
                                           kiln_tensor *const *max_exp_avg_sq,
                                           const int64_t *steps, kiln_tensor *const *step_t,
                                           double lr, double beta1, double beta2, double eps,
                                           double weight_decay, bool decoupled, bool amsgrad);
/* kiln_adam_multi_step_ for loss scaling (PyTorch's fused Adam with found_inf): found_inf
** (one float32 element on the parameters' device, or NULL) is read by the kernels on the
** device; when it is non-zero nothing is written and no step_t advances, so a skipped step
** needs no host read and works inside a captured graph. With found_inf the steps live on
** the device: step_t is required (KILN_ERR_INVALID_ARGUMENT without it). Errors and
** ownership as kiln_adam_multi_step_. */
KILN_API kiln_status kiln_adam_multi_step_amp_(int n, kiln_tensor *const *params,
                                               kiln_tensor *const *grads, kiln_tensor *const *exp_avg,
                                               kiln_tensor *const *exp_avg_sq,
                                               kiln_tensor *const *max_exp_avg_sq,
                                               const int64_t *steps, kiln_tensor *const *step_t,
                                               double lr, double beta1, double beta2, double eps,
                                               double weight_decay, bool decoupled, bool amsgrad,
                                               kiln_tensor *found_inf);

/* torch.optim.SGD's update of n parameters at once, in place (PyTorch's foreach SGD): the
** tensors of one device and dtype in as few kernel launches as the backend allows (CUDA:
** one launch for up to 48 tensors), with the numbers of kiln's per-parameter rule (axpy,
** mul_scalar_, axpy_; on the CPU to the bit):
**   g = grad (negated when maximize); g += weight_decay * p
**   momentum != 0: b = g on b's first step, else b = momentum * b + (1 - dampening) * g;
**                  g = nesterov ? g + momentum * b : b
**   p -= lr * g
** params, grads and (with a momentum) momentum_buffers hold n tensors of one shape,
** dtype and device each, contiguous. The first step of a buffer is told by first[i]
** (NULL: none is first; the caller makes the buffer, of any contents), or, when step_t is
** given (n f64 one-element counts on the parameters' devices), by step_t[i] == 0 on the
** device; each step_t then advances by one. found_inf (one float32 element, or NULL;
** needs step_t) is read on the device: non-zero writes nothing and advances no step_t, so
** a skipped step needs no host read. Everything is checked before anything changes
** (KILN_ERR_INVALID_ARGUMENT / _SHAPE / _DTYPE / _DEVICE naming the tensor's position);
** lr, momentum and weight_decay must be >= 0, and nesterov needs a momentum and zero
** dampening, as PyTorch's constructor says. */
KILN_API kiln_status kiln_sgd_multi_step_(int n, kiln_tensor *const *params, kiln_tensor *const *grads,
                                          kiln_tensor *const *momentum_buffers, const bool *first,
                                          kiln_tensor *const *step_t, double lr, double momentum,
                                          double dampening, double weight_decay, bool nesterov,
                                          bool maximize, kiln_tensor *found_inf);

/* Loss scaling's unscale (torch._amp_foreach_non_finite_check_and_unscale_): multiplies
** each of the n gradients (floating, contiguous, on found_inf's device; NULL entries are
** skipped) by inv_scale in place, and sets found_inf (one float32 element) to 1 when any
** result is inf or NaN; it never clears it. One kernel launch for all of them where the
** backend has the list kernel; nothing is read on the host. */
KILN_API kiln_status kiln_amp_unscale_(int n, kiln_tensor *const *grads, kiln_tensor *found_inf,
                                       double inv_scale);
/* kiln_amp_unscale_ with the multiplier on the device: inv_scale is one float32 element on
** found_inf's device (the scaler's 1/scale), read by the kernel, so a captured graph
** replays with the scale's current value. KILN_ERR_INVALID_ARGUMENT for a NULL or
** wrong-shaped inv_scale; otherwise as kiln_amp_unscale_. */
KILN_API kiln_status kiln_amp_unscale_dev_(int n, kiln_tensor *const *grads, kiln_tensor *found_inf,
                                           kiln_tensor *inv_scale);
/* The loss scale's update on the device (torch._amp_update_scale_): when found_inf (one
** float32 element) is non-zero, scale *= backoff_factor and growth_tracker = 0; otherwise
** growth_tracker += 1 and, when it reaches growth_interval, scale *= growth_factor (kept
** if that overflows) and growth_tracker = 0. scale is one float32 element, growth_tracker
** one float32 or float64 element, all three on one device; both are updated in place (one
** kernel where the backend has AMP_UPDATE_SCALE) and nothing is
** read on the host. KILN_ERR_INVALID_ARGUMENT / KILN_ERR_DEVICE for bad tensors. */
KILN_API kiln_status kiln_amp_update_scale_(kiln_tensor *scale, kiln_tensor *growth_tracker,
                                            kiln_tensor *found_inf, double growth_factor,
                                            double backoff_factor, int64_t growth_interval);

/* --------------------------------------------------------------------------------------
** Autograd.
*/
KILN_API kiln_status kiln_requires_grad_(kiln_tensor *t, bool on); /* leaves only */
KILN_API bool kiln_requires_grad(const kiln_tensor *t);
KILN_API bool kiln_is_leaf(const kiln_tensor *t);
/* The accumulated gradient of t, or NULL. Borrowed: t owns it (do not free). */
KILN_API kiln_tensor *kiln_grad(const kiln_tensor *t);
/* Sets (or with NULL clears) t's gradient; t takes its own reference to g. */
KILN_API kiln_status kiln_set_grad(kiln_tensor *t, kiln_tensor *g);
/* Keep the gradient of a non-leaf tensor during backward (torch's retain_grad). */
KILN_API kiln_status kiln_retain_grad(kiln_tensor *t);
/* Backpropagates from root. grad may be NULL only when root has one element. Adds into
** the .grad of every leaf that requires grad (and of retained non-leaves). The tensors
** the graph saved for backward are released as each node's rule runs (PyTorch's default,
** retain_graph=False), so a step's activations go during its backward, not when its
** scope ends; a second backward through those nodes fails with KILN_ERR_AUTOGRAD. */
KILN_API kiln_status kiln_backward(kiln_tensor *root, kiln_tensor *grad);
/* kiln_backward, keeping the graph when retain_graph is true: backward may then be called
** again (gradients add up). */
KILN_API kiln_status kiln_backward_ex(kiln_tensor *root, kiln_tensor *grad, bool retain_graph);
/* d(outputs)/d(inputs) without touching any .grad: writes n_inputs new tensors into
** grads_out (NULL where an input does not reach the outputs). grad_outputs may be NULL
** for one-element outputs. The graph is kept (a kiln_backward may follow). */
KILN_API kiln_status kiln_autograd_grad(int n_outputs, kiln_tensor *const *outputs,
                                        kiln_tensor *const *grad_outputs, int n_inputs,
                                        kiln_tensor *const *inputs, kiln_tensor **grads_out);
/* Calls fn(t, ctx) inside kiln_backward as soon as the gradient of leaf t is complete for
** that backward (every path into t has been processed), while the rest of the backward
** still runs: data-parallel training starts communicating a bucket of gradients there.
** One hook per tensor; fn NULL removes it. */
typedef void (*kiln_grad_hook)(kiln_tensor *t, void *ctx);
KILN_API kiln_status kiln_set_grad_ready_hook(kiln_tensor *t, kiln_grad_hook fn, void *ctx);
/* A tensor sharing t's data, cut from the graph. */
KILN_API kiln_tensor *kiln_detach(kiln_tensor *t);
/* Grad mode (thread-local, default on). Returns the previous value. */
KILN_API bool kiln_set_grad_enabled(bool on);
KILN_API bool kiln_grad_enabled(void);
/* The name of the op that made t ("mul", "matmul", ...), or NULL for a leaf. */
KILN_API const char *kiln_grad_fn_name(const kiln_tensor *t);

/* Anomaly mode (torch.autograd.detect_anomaly): every floating output of every op, in
** forward and backward, is checked for NaN and infinity; the first one found fails that
** op with KILN_ERR_NUMERIC naming the op, its input and output shapes, the nn module it
** ran in, and during a backward the forward op and module that made the node whose rule
** produced the value. Copies each output to the host:
** for debugging. KILN_ANOMALY=1 turns it on at start. */
KILN_API kiln_status kiln_set_anomaly_enabled(bool on);
KILN_API bool kiln_anomaly_enabled(void);

/* Profiler (torch.profiler): between start and stop, every op the program calls (and each
** op of a backward) is timed, with its bytes moved (inputs + outputs) and FLOPs (matmul
** family 2*M*N*K; elementwise and reductions one per element; softmax family five), and
** each nn module's forward is a span. kiln_profiler_stop prints the table per op and per
** module (calls, host ms, device us per call, MB, GFLOP, TFLOP/s, GB/s, share of a known
** GPU's data-sheet peak) to table (NULL: none) and writes the Chrome-trace JSON (Perfetto,
** chrome://tracing) when trace_path was given. KILN_PROFILE=1|device|trace:FILE does the
** same for the whole run. start: KILN_ERR_STATE when already on, KILN_ERR_IO when
** trace_path cannot be written (checked at start, before any work). stop: KILN_ERR_STATE
** when off, KILN_ERR_IO when writing the trace failed. */
typedef struct kiln_profiler_options {
  bool device_time;       /* time each op on its device between marks (waits for each op) */
  const char *trace_path; /* the Chrome trace, written at stop; NULL: none */
} kiln_profiler_options;
KILN_API kiln_status kiln_profiler_start(const kiln_profiler_options *opt); /* NULL: host times only */
KILN_API kiln_status kiln_profiler_stop(FILE *table);
KILN_API bool kiln_profiler_enabled(void);

/* --------------------------------------------------------------------------------------
** Autocast (torch.autocast): mixed precision without changing the model. Inside a region
** the ops of a class (docs/autocast.md) cast their floating inputs on the device type
** the region names: matmul and linear run in dtype (f16 or bf16); softmax, log_softmax,
** losses, reductions, exp/log/pow in f32; binary ops with mixed inputs promote to the
** widest. Casts are recorded ops: parameters stay f32 (the master weights) and get f32
** gradients. The cast of a parameter is made once per region and reused (the outermost
** kiln_autocast_end drops the cache). Backward rules are never cast. Per thread; regions
** nest, and a nested region may switch autocast off (enabled false) or change the dtype.
** Open a scope per step inside a region: casts made with no scope open are kept until
** the outermost end.
**
**   kiln_autocast_begin(KILN_DEVICE_CUDA, KILN_BF16);
**   kiln_tensor *loss = kiln_cross_entropy(kiln_module_forward(net, x), y, ...);  // f32
**   kiln_autocast_end();
**   kiln_backward(loss, NULL);
**
** Errors: KILN_ERR_DTYPE for a dtype other than f16/bf16 (an integer dtype), KILN_ERR_DEVICE
** for an unknown device type, KILN_ERR_STATE past 64 nested regions or for an end with
** no region open. */
KILN_API kiln_status kiln_autocast_begin(kiln_device_type device_type, kiln_dtype dtype);
KILN_API kiln_status kiln_autocast_begin_enabled(kiln_device_type device_type, kiln_dtype dtype,
                                                 bool enabled);
KILN_API kiln_status kiln_autocast_end(void);
/* Whether ops on device_type are cast now on this thread, and to what (f32 when not). */
KILN_API bool kiln_autocast_is_enabled(kiln_device_type device_type);
KILN_API kiln_dtype kiln_autocast_dtype(kiln_device_type device_type);

/* --------------------------------------------------------------------------------------
** Custom autograd functions (torch.autograd.Function): an op written by the program as a
** forward and a backward in C. forward runs with grad mode off and makes n_out outputs
** from the inputs with any kiln ops; when grad mode is on and an input requires grad, the
** outputs get one node whose backward is the program's. backward receives the gradient
** of each output (NULL where none reached it) and writes a new tensor, or NULL, for each
** input (kiln_function_grad_needed says which are wanted); the tensors it makes belong to
** a scope the engine closes, so it need not free them. Saved tensors are kept by the
** node until its backward has run (kiln_backward; kept for kiln_backward_ex with
** retain_graph and for kiln_autograd_grad) or the graph is freed.
**
**   static kiln_status sq_fwd(kiln_function_ctx *c, int n_in, kiln_tensor *const *x,
**                             int n_out, kiln_tensor **y) {
**     kiln_function_save(c, x[0]);
**     y[0] = kiln_mul(x[0], x[0]);
**     return y[0] ? KILN_OK : kiln_last_error();
**   }
**   static kiln_status sq_bwd(kiln_function_ctx *c, int n_out, kiln_tensor *const *gy,
**                             int n_in, kiln_tensor **gx) {
**     gx[0] = kiln_mul(gy[0], kiln_mul_scalar(kiln_function_saved(c, 0), 2.0));
**     return gx[0] ? KILN_OK : kiln_last_error();
**   }
**   static const kiln_function square = {"square", sq_fwd, sq_bwd};
**   kiln_tensor *y;
**   kiln_function_apply(&square, NULL, NULL, 1, &x, 1, &y);
*/
typedef struct kiln_function_ctx kiln_function_ctx;
typedef struct kiln_function {
  const char *name; /* shown as the grad_fn name and in traces */
  kiln_status (*forward)(kiln_function_ctx *ctx, int n_in, kiln_tensor *const *inputs, int n_out,
                         kiln_tensor **outputs);
  kiln_status (*backward)(kiln_function_ctx *ctx, int n_out, kiln_tensor *const *grad_outputs, int n_in,
                          kiln_tensor **grad_inputs);
} kiln_function;
/* Runs fn on n_in inputs (none NULL) into n_out outputs (1..8), owned by the current
** scope. state is handed to both functions (kiln_function_state) and, when state_free is
** given, freed with the node (or at once when no node is made). Errors: whatever forward
** returns; KILN_ERR_INVALID_ARGUMENT for bad counts or an output forward left NULL. */
KILN_API kiln_status kiln_function_apply(const kiln_function *fn, void *state, void (*state_free)(void *),
                                         int n_in, kiln_tensor *const *inputs, int n_out,
                                         kiln_tensor **outputs);
/* In forward: keeps t for backward (appended; index = order of the calls, from 0). */
KILN_API kiln_status kiln_function_save(kiln_function_ctx *ctx, kiln_tensor *t);
/* In backward: saved tensor k (borrowed), NULL when out of range. */
KILN_API kiln_tensor *kiln_function_saved(kiln_function_ctx *ctx, int k);
KILN_API void *kiln_function_state(kiln_function_ctx *ctx);
/* In backward: whether input k needs a gradient. */
KILN_API bool kiln_function_grad_needed(kiln_function_ctx *ctx, int k);

/* --------------------------------------------------------------------------------------
** Gradient checkpointing (torch.utils.checkpoint): trade compute for memory. fn runs with
** grad mode off inside a scope of its own, so only the segment's inputs and outputs are
** kept; during backward it runs again with grad mode on and the gradient goes through
** the recomputed graph. The parameters fn uses (leaves that require grad, seen as it
** runs) get their gradients as if it had run normally, under kiln_backward (into .grad)
** and kiln_autograd_grad (into its results) alike. The recompute restores the state of
** the global generator (and of the generators given to kiln_checkpoint_ex) as it was at
** forward, so dropout draws the same mask, and leaves them as they were; it runs under
** the autocast state of the forward. Checkpoints nest. With grad mode off, or when
** nothing fn touches requires grad, fn just runs. The recompute does not run the kernels
** of a last op whose output the backward does not need (a linear, matmul, add or sub
** whose output no other op read): that output holds zeros during the recompute, so fn
** must not read its outputs' values on the host. And the forward keeps the output of each
** scaled_dot_product_attention without dropout (with its log-sum-exp: the output's size
** again, for T^2 work), which the recompute takes instead of running it.
** KILN_CHECKPOINT_ELIDE=0 recomputes everything, as PyTorch does.
**
** fn must be deterministic given its inputs and the generators, write n_out new
** tensors (or inputs) into outputs and read tensors that have a history only through
** its inputs (one it reads from ctx gets no gradient). ctx must live until the graph is
** freed. On the CPU the gradients are the bits of the run without checkpointing.
**
** Errors: KILN_ERR_INVALID_ARGUMENT for bad counts, a NULL input or generator, or fn
** returning no tensor for an output; whatever fn returns; the outputs are then NULL. */
typedef kiln_status (*kiln_checkpoint_fn)(void *ctx, int n_in, kiln_tensor *const *inputs, int n_out,
                                          kiln_tensor **outputs);
KILN_API kiln_status kiln_checkpoint(kiln_checkpoint_fn fn, void *ctx, int n_in, kiln_tensor *const *inputs,
                                     int n_out, kiln_tensor **outputs);
/* The same, restoring n_gens (at most 8) explicit generators too. */
KILN_API kiln_status kiln_checkpoint_ex(kiln_checkpoint_fn fn, void *ctx, int n_gens,
                                        kiln_generator *const *gens, int n_in,
                                        kiln_tensor *const *inputs, int n_out, kiln_tensor **outputs);

/* What a segment's forward keeps for its recompute besides its inputs and outputs. */
typedef enum kiln_checkpoint_keep {
  KILN_CHECKPOINT_KEEP_DEFAULT = 0,  /* attention's results (above) */
  /* And the output of each kiln_matmul and kiln_linear (no fused activation) fn calls
  ** itself, which the recompute takes instead of multiplying again: PyTorch's selective
  ** checkpointing with a policy that saves matmul outputs: much of a transformer block's
  ** recompute for a part of its activations (GPT-2's c_attn and attention's c_proj: 100 MB
  ** a block in bf16 at batch 16, context 1024). A kept output that fn writes in place
  ** afterwards is made again instead. */
  KILN_CHECKPOINT_KEEP_PRODUCTS = 1,
} kiln_checkpoint_keep;

typedef struct kiln_checkpoint_options {
  int n_gens;                   /* generators restored besides the global one (at most 8) */
  kiln_generator *const *gens;
  kiln_checkpoint_keep keep;
} kiln_checkpoint_options;

/* kiln_checkpoint with options (NULL: none, as kiln_checkpoint). Errors as above, and
** KILN_ERR_INVALID_ARGUMENT for an unknown keep. */
KILN_API kiln_status kiln_checkpoint_with(kiln_checkpoint_fn fn, void *ctx, const kiln_checkpoint_options *opts,
                                          int n_in, kiln_tensor *const *inputs, int n_out,
                                          kiln_tensor **outputs);

/* --------------------------------------------------------------------------------------
** Traces: the ops a forward pass runs, in order, each with its name, named attributes and
** the ids (kiln_tensor_id) of its inputs and outputs — what an exporter needs. Only the
** ops the program calls are recorded, not the ops they are made of, and nothing a
** backward runs. Tensors that no recorded op made (parameters, the batch) are the
** trace's inputs. Recording is per thread; traces nest (the inner one records too).
**
**   kiln_trace *tr = kiln_trace_begin();
**   kiln_tensor *y = kiln_nn_forward(model, x);
**   kiln_trace_end(tr);
**   kiln_trace_print(tr, stdout);     // 0: linear(%1, %2, %3) -> %4 ...
**   kiln_trace_free(tr);
*/
typedef enum kiln_attr_type {
  KILN_ATTR_INT,    /* i */
  KILN_ATTR_FLOAT,  /* f */
  KILN_ATTR_BOOL,   /* i (0 or 1) */
  KILN_ATTR_INTS,   /* n values at ints */
  KILN_ATTR_DTYPE,  /* i (a kiln_dtype), s its name */
  KILN_ATTR_STRING  /* s (enums by name, devices as "cuda:0") */
} kiln_attr_type;
typedef struct kiln_attr {
  const char *name;
  kiln_attr_type type;
  int64_t i;
  double f;
  int n;
  const int64_t *ints;
  const char *s;
} kiln_attr;
typedef struct kiln_trace_op {
  const char *name;         /* "linear", "relu", ...; a custom function's own name */
  int n_inputs;
  const int64_t *inputs;    /* tensor ids; 0 for an absent optional input (a bias) */
  int n_outputs;
  const int64_t *outputs;
  int n_attrs;
  const kiln_attr *attrs;
} kiln_trace_op;
typedef struct kiln_trace kiln_trace;
/* Starts recording on this thread. NULL on OOM. */
KILN_API kiln_trace *kiln_trace_begin(void);
/* Stops recording into tr (the innermost trace must end first: KILN_ERR_STATE). */
KILN_API kiln_status kiln_trace_end(kiln_trace *tr);
KILN_API int kiln_trace_count(const kiln_trace *tr);
/* Op i (borrowed from tr), NULL when out of range. */
KILN_API const kiln_trace_op *kiln_trace_get(const kiln_trace *tr, int i);
/* One line per op: "3: linear(%5, %2, %3) -> %6" with its attributes. */
KILN_API kiln_status kiln_trace_print(const kiln_trace *tr, FILE *f);
KILN_API void kiln_trace_free(kiln_trace *tr); /* NULL is a no-op; ends it if recording */

/* --------------------------------------------------------------------------------------
** RNG: Philox 4x32-10, counter-based. A generator is a (seed, offset) pair; each op
** that draws n values advances the offset by a fixed amount derived from n.
*/
KILN_API kiln_generator *kiln_generator_new(uint64_t seed);
KILN_API void kiln_generator_free(kiln_generator *g);
KILN_API void kiln_generator_seed(kiln_generator *g, uint64_t seed); /* resets offset */
KILN_API kiln_generator *kiln_generator_global(void);
KILN_API void kiln_manual_seed(uint64_t seed); /* the global generator */
/* State for checkpoints: the seed and the offset, restored exactly. */
KILN_API void kiln_generator_get_state(const kiln_generator *g, uint64_t *seed, uint64_t *offset);
KILN_API void kiln_generator_set_state(kiln_generator *g, uint64_t seed, uint64_t offset);
/* One uniform double in [0,1) / one integer in [0, n) from the generator (host only). */
KILN_API double kiln_generator_uniform(kiln_generator *g);
KILN_API uint64_t kiln_generator_below(kiln_generator *g, uint64_t n);
/* The raw Philox4x32-10 block for (key, counter), for tests and other backends. */
KILN_API void kiln_philox4x32(uint64_t key, uint64_t counter_hi, uint64_t counter_lo,
                              uint32_t out[4]);

/* --------------------------------------------------------------------------------------
** CPU fallback and device memory.
*/
typedef enum kiln_fallback_policy {
  KILN_FALLBACK_WARN = 0, /* run on the CPU, warn once per op kind (default) */
  KILN_FALLBACK_ERROR,    /* KILN_ERR_UNSUPPORTED naming the op and device */
  KILN_FALLBACK_SILENT    /* run on the CPU, say nothing */
} kiln_fallback_policy;
/* The policy starts from KILN_FALLBACK=warn|error|silent. */
KILN_API void kiln_set_fallback_policy(kiln_fallback_policy p);
KILN_API kiln_fallback_policy kiln_fallback_policy_get(void);
/* Per op kind that fell back: name, count, seconds. Returns the number of kinds; writes
** at most max entries. */
typedef struct kiln_fallback_entry {
  const char *op;
  const char *device;
  int64_t count;
  double seconds;
} kiln_fallback_entry;
KILN_API int kiln_fallback_stats(kiln_fallback_entry *out, int max);
/* Prints the table (nothing when no op fell back). */
KILN_API void kiln_fallback_report(FILE *f);
KILN_API void kiln_fallback_reset(void);

typedef struct kiln_memory_stats {
  int64_t allocated;       /* bytes in live tensors' storage */
  int64_t reserved;        /* bytes held from the device (allocated + cached) */
  int64_t peak_allocated;  /* high-water mark of allocated */
  int64_t num_allocs;      /* allocations served */
  int64_t num_device_allocs; /* calls into the device allocator (cudaMalloc) */
  int64_t num_ooms;
  int64_t limit;           /* 0: none */
} kiln_memory_stats;
KILN_API kiln_status kiln_memory_stats_get(kiln_device dev, kiln_memory_stats *out);
KILN_API kiln_status kiln_memory_empty_cache(kiln_device dev);
/* Caps reserved bytes on dev (0 removes the cap); allocations past it fail with OOM. */
KILN_API kiln_status kiln_memory_set_limit(kiln_device dev, int64_t bytes);
KILN_API void kiln_memory_reset_peak(kiln_device dev);
/* Bytes autograd holds in tensors saved for backward (activations), over all devices:
** live now and the high-water mark (either pointer may be NULL). Each saved view counts
** its own elements. */
KILN_API void kiln_autograd_saved_bytes(int64_t *live, int64_t *peak);
KILN_API void kiln_autograd_saved_reset_peak(void);
/* Prints dev's memory to f: allocated (and peak), reserved, cached (the share of reserved
** holding no tensor: cache and fragmentation), the limit, saved-for-backward bytes live
** and peak, and the modules that saved the most in their last forward. Parameters,
** gradients and optimizer state: kiln_model_memory_summary (kiln_nn.h).
** KILN_ERR_INVALID_ARGUMENT (NULL f), KILN_ERR_DEVICE. */
KILN_API kiln_status kiln_memory_summary(kiln_device dev, FILE *f);

/* --------------------------------------------------------------------------------------
** Graphs: record a whole training step once and replay it, so that small models stop
** paying a launch per op. The same code runs everywhere: on CUDA the step's device work
** is captured into a CUDA graph; on the CPU replay simply calls the step again.
**
**   step(ctx) must be static: the same ops on the same shapes every time, reading its
**   inputs from tensors made before the capture (copy each new batch into them with
**   kiln_copy_) and writing results into tensors the program reads after a replay. Run
**   it once eagerly before capturing (it creates optimizer state and warms the memory
**   cache). Inside a captured step nothing may be read on the host (kiln_item,
**   kiln_to_host: KILN_ERR_STATE). Memory the step allocates comes from the cache,
**   which the warm-up step fills; a capture that needs more takes new device memory,
**   which the graph keeps until kiln_graph_free.
**
**   kiln_graph *g = kiln_graph_capture(dev, step, &ctx);   // records; does not run
**   for (...) { kiln_copy_(x_static, batch); kiln_graph_replay(g); kiln_item(loss); }
*/
typedef struct kiln_graph kiln_graph;
typedef kiln_status (*kiln_graph_fn)(void *ctx);
/* NULL with the error of the step, or of the capture, on failure. */
KILN_API kiln_graph *kiln_graph_capture(kiln_device dev, kiln_graph_fn step, void *ctx);
/* Runs the recorded step once (queued; waits for nothing). */
KILN_API kiln_status kiln_graph_replay(kiln_graph *g);
/* true when replays launch a device graph; false when they call the step (CPU). */
KILN_API bool kiln_graph_is_device_graph(const kiln_graph *g);
KILN_API void kiln_graph_free(kiln_graph *g); /* NULL is a no-op */

#ifdef __cplusplus
}
#endif
#endif /* KILN_H */
