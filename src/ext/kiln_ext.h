/*
** kiln's extension header: the few internals that the layers above the op layer (nn,
** optim, data, io, dist) really need beyond the public headers, as ggml keeps
** ggml-backend-impl.h beside ggml-backend.h. Not API and not installed: the names are
** kiln__, and a program built on the installed headers never sees them.
**
** Layering (tests/test_layering.sh checks it on every build): a file of those layers, of
** tools/ or of examples/ includes only public headers (include/kiln*.h), this header and
** its own layer's private header. Everything here is declared in terms of public types
** (kiln_tensor, kiln_dict, kiln_module, ...) plus one opaque one (kiln__storage); the
** implementations live in the layer named in each section, which declares the same
** prototypes in its own private header.
*/
#ifndef KILN_EXT_H
#define KILN_EXT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "kiln.h"
#include "kiln_data.h"
#include "kiln_io.h"
#include "kiln_nn.h"
#include "kiln_optim.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- helpers (core: src/core/error.c) ----
** The same definitions as src/core/kiln_int.h (a file may include both). */
#define KILN__UNUSED(x) ((void)(x))

/* Broken invariant: a bug in kiln, never bad input. Goes through the abort hook. */
void kiln__abort(const char *file, int line, const char *msg);
#define KILN__ASSERT(cond)                                                                \
  do {                                                                                    \
    if (!(cond)) kiln__abort(__FILE__, __LINE__, "assertion failed: " #cond);             \
  } while (0)

/* Error helper that returns NULL, for tensor-returning functions. */
#define KILN__FAIL_NULL(code, ...)                                                        \
  do {                                                                                    \
    kiln_set_error((code), __VA_ARGS__);                                                  \
    return NULL;                                                                          \
  } while (0)

/* ---- tensor memory (core: src/core/tensor.c, storage.c) ----
** For file formats, collectives and the loader's staged batches: the bytes behind a
** tensor, and tensors made over a block the caller filled. */

/* The address of t's element 0 in its device's memory (a device pointer for a CUDA
** tensor). With kiln_is_contiguous(t), kiln_nbytes(t) bytes from there are t. */
void *kiln__tensor_data(const kiln_tensor *t);

/* A refcounted block of device memory (opaque here). */
typedef struct kiln__storage kiln__storage;
/* n bytes on dev, one reference (the caller's); NULL + KILN_ERR_OOM/DEVICE. */
kiln__storage *kiln__storage_new(kiln_device dev, size_t nbytes);
void kiln__storage_release(kiln__storage *s); /* NULL is a no-op */
/* The block's first byte (device memory for a device block). */
void *kiln__storage_data(const kiln__storage *s);
/* Whether anyone but the caller's one reference still holds s (a tensor over it): the
** loader reuses a staged block only once its batch's tensors are gone. */
bool kiln__storage_in_use(const kiln__storage *s);
/* Marks s as one batch's block: tensors over it and padding between them only, so that
** kiln_copy_many_ may copy the whole span in one transfer. */
void kiln__storage_mark_packed(kiln__storage *s);
/* A tensor over s at offset elements, with ndim/shape (strides NULL: contiguous) and
** dtype dt; takes its own reference on s; registered with the current scope. NULL + OOM. */
kiln_tensor *kiln__tensor_make(kiln__storage *s, int64_t offset, int ndim, const int64_t *shape,
                               const int64_t *strides, kiln_dtype dt);
/* Releases t now whether or not a scope owns it (error paths). NULL is a no-op. */
void kiln__discard(kiln_tensor *t);
/* Ends the innermost scope (kiln_scope_begin) and hands r (which may be NULL) to the
** scope around it: r survives, everything else made in the scope goes. A module's forward
** (nn/transformer.c) runs in a scope of its own this way, so the intermediates that no
** node saved (a norm's f32 output once cast, a residual branch once added) are freed when
** the module returns instead of when the step's scope ends. */
kiln_tensor *kiln__scope_return(kiln_tensor *r);
/* Registers a reference the caller owns with the innermost scope (if any), which then
** releases it: how a scope hands a second result to the scope around it. Returns t. */
kiln_tensor *kiln__scope_track(kiln_tensor *t);

/* ---- datasets (data: src/data/dataset.c; used by dist's sharded dataset) ---- */
#define KILN__MAX_FIELDS 64 /* fields of a dataset (kiln_dataset_new's limit) */
/* The self pointer of ds when ds was made by kiln_dataset_new with a vtable whose get is
** get (a wrapper recognising its own datasets); NULL for any other dataset or NULL ds. */
void *kiln__dataset_self(const kiln_dataset *ds, kiln_status (*get)(void *self, int64_t index, void *const *bufs));

/* ---- grad-ready hooks (autograd: src/autograd/engine.c) ---- */
/* Whether t's grad-ready hook (kiln_set_grad_ready_hook) is fn with ctx: DDP takes off
** only the hooks it set. */
bool kiln__grad_ready_hook_is(const kiln_tensor *t, kiln_grad_hook fn, const void *ctx);

/* ---- rng (core: src/core/rng.c) ---- */
/* p = the random permutation of 0..n-1 that kiln_randperm(n, g) gives; parallel: the draws
** may use the OpenMP team (not from a thread of kiln's own). KILN_ERR_OOM. */
kiln_status kiln__randperm_fill(int64_t n, kiln_generator *g, int64_t *p, bool parallel);
/* Moves g (NULL: the global generator) on as kiln_uniform_ or kiln_normal_ of n elements
** would, drawing nothing: a constructor that would throw its draws away skips them and
** still leaves the generator where PyTorch's order of construction leaves it. */
void kiln__generator_skip(kiln_generator *g, int64_t n);

/* ---- environment (core: src/core/device.c) ---- */
const char *kiln__getenv(const char *name); /* NULL when unset or empty */
/* The tuning switches' readers the upper layers use (src/core/knobs.h says how they read). */
bool kiln__knob_on(const char *name, bool dflt);
int kiln__knob_choice(const char *name, int dflt);

/* ---- regular files only (io: src/io/file.c; used by the data readers) ----
** Opens path for reading, refusing anything but a regular file without blocking (a FIFO,
** a directory, a device, a socket): the descriptor, or -1 with KILN_ERR_IO naming `who`,
** the path and the kind of file. The FILE form opens "rb"; NULL with the error set. */
int kiln__open_regular(const char *who, const char *path);
FILE *kiln__fopen_regular(const char *who, const char *path);
/* A whole regular file in a new buffer (free()) of *n bytes plus a NUL after them (the
** JSON and text readers of nn and text); NULL with KILN_ERR_IO (as above, or a read
** error), KILN_ERR_OOM or KILN_ERR_INVALID_ARGUMENT (NULL path) naming `who`. */
char *kiln__read_regular(const char *who, const char *path, size_t *n);

/* ---- a JSON cursor (io: src/io/json_cursor.c; the safetensors header, text's tokenizer, nn's config.json) ----
** A cursor over a whole file in memory; errors name the file, the line and the byte
** offset of the cursor (kiln_set_error with KILN_ERR_FORMAT) and make every later call
** fail. Strings are decoded (escapes, \u surrogate pairs) into jr->buf, valid until the
** next string is read. */
typedef struct {
  const char *what;  /* the function name that prefixes the errors */
  const char *path;  /* the file, for the errors */
  const char *s;
  size_t n, pos;
  int failed;
  kiln_status code; /* of the next error: KILN_ERR_FORMAT unless the caller sets another */
  size_t key_pos;   /* the offset of the last member name kiln__jr_member read */
  size_t base;      /* added to offsets in errors (0; 8 for a safetensors header) */
  char *buf;
  size_t len, cap; /* the last string read: buf[0, len), NUL-terminated */
} kiln__jreader;

void kiln__jr_init(kiln__jreader *jr, const char *what, const char *path, const char *s, size_t n);
void kiln__jr_release(kiln__jreader *jr);
/* Sets the error "what: path:LINE: byte OFF: msg" at offset off (OFF = base + off), with
** jr->code. Returns that code. */
kiln_status kiln__jr_fail_at(kiln__jreader *jr, size_t off, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
/* The next non-space byte (0 at the end), not consumed. */
int kiln__jr_peek(kiln__jreader *jr);
/* Consumes byte c after spaces; 0 and an error naming what was expected otherwise. */
int kiln__jr_expect(kiln__jreader *jr, int c);
/* Consumes c after spaces when it is next: 1; else 0, nothing consumed. */
int kiln__jr_accept(kiln__jreader *jr, int c);
int kiln__jr_string(kiln__jreader *jr);             /* a string into jr->buf; 1 on success */
int kiln__jr_int(kiln__jreader *jr, int64_t *v);    /* an integer (no fraction/exponent) */
/* A non-negative integer up to 2^64-1 (as serde reads a u64): 1 and consumed; else 0 with
** no error set and nothing consumed, for the caller to say what it expected there. */
int kiln__jr_try_uint(kiln__jreader *jr, uint64_t *v);
int kiln__jr_number(kiln__jreader *jr, double *v);  /* a JSON number (no nan, inf or hex) */
int kiln__jr_skip(kiln__jreader *jr);               /* any value, checked as JSON */
/* After the top value: KILN_OK when only spaces follow; else the error (or the earlier one). */
kiln_status kiln__jr_end(kiln__jreader *jr);
/* Object members: call kiln__jr_object_begin, then kiln__jr_member while it returns 1
** (the key is in jr->buf, the cursor on the value, which the caller must read or skip);
** 0 at the closing brace, -1 on an error. */
int kiln__jr_object_begin(kiln__jreader *jr);
int kiln__jr_member(kiln__jreader *jr, int *first);
/* Arrays likewise: 1 with the cursor on the next element, 0 at ']', -1 on an error. */
int kiln__jr_array_begin(kiln__jreader *jr);
int kiln__jr_element(kiln__jreader *jr, int *first);

/* ---- ownership (io: src/io/file.c) ---- */
/* A tensor made here and owned by the calling code, whether or not a scope is open:
** kiln_keep() after creation (a no-op without a scope). NULL stays NULL. */
kiln_tensor *kiln__own(kiln_tensor *t);

/* ---- messages that list many problems (nn: src/nn/util.c; used by nn and optim) ---- */
/* A growable string. On OOM it silently stops growing (shorter, never wrong). */
typedef struct kiln__sb {
  char *buf;
  size_t len, cap;
} kiln__sb;
void kiln__sb_printf(kiln__sb *sb, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
const char *kiln__sb_str(const kiln__sb *sb); /* "" when empty */
void kiln__sb_free(kiln__sb *sb);

/* Problems of three kinds, printed as "N missing keys: a, b; ..." with at most a handful
** of names per kind (the last error's message buffer is 1 KiB). */
typedef struct kiln__problems {
  kiln__sb missing, unexpected, mismatch;
  int n_missing, n_unexpected, n_mismatch;
  kiln_status mismatch_code; /* first mismatch's code (SHAPE or DTYPE) */
} kiln__problems;
void kiln__problems_missing(kiln__problems *p, const char *name);
void kiln__problems_unexpected(kiln__problems *p, const char *name);
void kiln__problems_mismatch(kiln__problems *p, kiln_status code, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
int kiln__problems_count(const kiln__problems *p);
/* Sets the last error "<who>: <the list>" and returns its code (KILN_OK when empty). */
kiln_status kiln__problems_report(kiln__problems *p, const char *who);
void kiln__problems_free(kiln__problems *p);

/* ---- dict metadata numbers (nn: src/nn/util.c; used by nn, optim, io/checkpoint) ---- */
/* KILN_ERR_FORMAT naming key, text and who when the entry is missing or not a number. */
kiln_status kiln__meta_i64(const kiln_dict *d, const char *key, int64_t *out, const char *who);
kiln_status kiln__meta_f64(const kiln_dict *d, const char *key, double *out, const char *who);
kiln_status kiln__meta_set_i64(kiln_dict *d, const char *key, int64_t v);
kiln_status kiln__meta_set_f64(kiln_dict *d, const char *key, double v);

/* ---- state dicts checked before any is applied (nn, optim; used by io/checkpoint) ----
** Each validates d against its object (apply false) or validates and then restores it
** (apply true), naming who in messages; a checkpoint validates every part before it
** applies any, so a bad file changes nothing. The public kiln_*_load_state_dict are
** these with apply true. */
kiln_status kiln__module_load_state_dict(kiln_module *m, const kiln_dict *d, bool strict, bool apply,
                                         const char *who); /* src/nn/module.c */
kiln_status kiln__optimizer_load_state_dict(kiln_optimizer *o, const kiln_dict *d, bool apply,
                                            const char *who); /* src/optim/optimizer.c */
kiln_status kiln__scheduler_load_state_dict(kiln_scheduler *s, const kiln_dict *d, bool apply,
                                            const char *who); /* src/optim/scheduler.c */
kiln_status kiln__grad_scaler_load_state_dict(kiln_grad_scaler *s, const kiln_dict *d, bool apply,
                                              const char *who); /* src/optim/grad_scaler.c */

/* ---- module scope (ops: src/ops/module_scope.c) ----
** kiln_module_forward runs a module's forward between push and pop of its label, so that
** the profiler and the anomaly check can name the module an op ran in. label must live
** as long as the process: kiln__intern gives such a copy. */
void kiln__module_scope_push(const char *label);
void kiln__module_scope_pop(void);
const char *kiln__intern(const char *s);

/* ---- attention's packed gradients (ops: src/ops/ops_attention.c; used by nn's GPT) ----
** When the gradients dq, dk, dv (B, H, T, D) of q, k, v split from one qkv (B, T, 3C) by
** views are the thirds of one contiguous (B, T, 3C) buffer (attention's backward makes
** them so for such inputs), a (B, T, 3C) tensor over that buffer, owned by the current
** scope: qkv's gradient with no copy. NULL otherwise, with no error set. */
kiln_tensor *kiln__attention_qkv_grad(kiln_tensor *const dqkv[3]);

/* ---- the residual norm's padded output (ops: src/ops/ops_layernorm.c; used by nn's GPT) ----
** kiln_residual_layer_norm whose 16-bit y comes padded where the device's kernel can: rows
** N + 8 apart in their buffer, each followed by a 1 and seven 0s, so that the linear
** reading y (alone) makes its bias gradient as one more column of its weight gradient's
** product instead of a column-sum kernel. Elsewhere the plain op. */
kiln_tensor *kiln__residual_layer_norm_ones(kiln_tensor *x, kiln_tensor *r, kiln_tensor *weight, kiln_tensor *bias,
                                            double eps, kiln_dtype y_dtype, kiln_tensor **sum);

/* ---- batch norm, ReLU and max-pool in one op (ops: src/ops/ops_norm.c; used by nn's ResNet stem) ---- */
/* max_pool2d(relu(batch_norm(x))) as one op where x's device has it (CUDA, channels-last:
** the normalized map never made); elsewhere the ops it stands for. _native says which. The
** pool's dilation is 1 (ops_norm.c). */
bool kiln__batch_norm_relu_max_pool2d_native(kiln_tensor *x, kiln_tensor *running_mean, kiln_tensor *running_var,
                                             kiln_tensor *weight, kiln_tensor *bias, bool training,
                                             const int64_t kernel[2], const int64_t stride[2], const int64_t padding[2]);
kiln_tensor *kiln__batch_norm_relu_max_pool2d(kiln_tensor *x, kiln_tensor *running_mean, kiln_tensor *running_var,
                                              kiln_tensor *weight, kiln_tensor *bias, bool training, double momentum,
                                              double eps, const int64_t kernel[2], const int64_t stride[2],
                                              const int64_t padding[2]);

#ifdef __cplusplus
}
#endif
#endif /* KILN_EXT_H */
