/*
** kiln_io — named-tensor dictionaries and file formats (safetensors, .npy).
**
** Built only on the public API (kiln.h). Every function follows kiln's rules: errors are
** values (NULL or a status code, with the thread-local last error naming the file, the
** tensor and the byte offset), freeing NULL is a no-op.
**
**   kiln_dict *d = kiln_dict_new();
**   kiln_dict_set(d, "fc1.weight", w);               // the dict takes its own reference
**   kiln_dict_set_meta(d, "format", "pt");
**   if (kiln_safetensors_save("model.safetensors", d) != KILN_OK) ...
**   kiln_dict_free(d);
**   kiln_dict *back = kiln_safetensors_load("model.safetensors", kiln_device_cpu());
**   kiln_tensor *w2 = kiln_dict_get(back, "fc1.weight");   // borrowed from the dict
*/
#ifndef KILN_IO_H
#define KILN_IO_H

#include "kiln.h"

#ifdef __cplusplus
extern "C" {
#endif

/* --------------------------------------------------------------------------------------
** kiln_dict: an ordered name -> tensor map plus an ordered string -> string metadata map.
** Used for state dicts and safetensors files. Tensors in a dict hold no scope reference:
** the dict holds a plain reference (kiln_tensor_ref) and releases it in kiln_dict_free.
** Names and metadata are copied. A dict is not thread-safe for concurrent writes.
*/
typedef struct kiln_dict kiln_dict;

/* A new, empty dict. NULL + KILN_ERR_OOM on failure. Free with kiln_dict_free. */
KILN_API kiln_dict *kiln_dict_new(void);
/* Releases the dict's tensor references, names and metadata. NULL is a no-op. */
KILN_API void kiln_dict_free(kiln_dict *d);
/* Stores t under name, taking its own reference (the caller keeps its own). An existing
** entry of that name is replaced in place (its position is kept, the old tensor released).
** KILN_ERR_INVALID_ARGUMENT for a NULL d, name or t, or an empty name; KILN_ERR_OOM. */
KILN_API kiln_status kiln_dict_set(kiln_dict *d, const char *name, kiln_tensor *t);
/* The tensor stored under name, borrowed (valid while the entry lives); NULL if absent
** or d/name is NULL. Sets no error. */
KILN_API kiln_tensor *kiln_dict_get(const kiln_dict *d, const char *name);
/* Number of tensor entries (0 for NULL). */
KILN_API int kiln_dict_size(const kiln_dict *d);
/* The name / tensor (borrowed) of entry i in insertion order; NULL when i is out of
** range. */
KILN_API const char *kiln_dict_key(const kiln_dict *d, int i);
KILN_API kiln_tensor *kiln_dict_value(const kiln_dict *d, int i);
/* Sets metadata key -> value (both copied; an existing key is replaced in place).
** KILN_ERR_INVALID_ARGUMENT for NULL arguments; KILN_ERR_OOM. */
KILN_API kiln_status kiln_dict_set_meta(kiln_dict *d, const char *key, const char *value);
/* The metadata value for key (borrowed), NULL if absent. Sets no error. */
KILN_API const char *kiln_dict_get_meta(const kiln_dict *d, const char *key);
KILN_API int kiln_dict_meta_size(const kiln_dict *d);
/* Metadata entry i in insertion order (borrowed); NULL when out of range. */
KILN_API const char *kiln_dict_meta_key(const kiln_dict *d, int i);
KILN_API const char *kiln_dict_meta_value(const kiln_dict *d, int i);

/* --------------------------------------------------------------------------------------
** safetensors (https://github.com/huggingface/safetensors). Layout: see src/io/safetensors.c.
** Dtypes: F32 F64 F16 BF16 I64 I32 U8 BOOL (others: KILN_ERR_DTYPE when read; listed by
** kiln_safetensors_open).
*/
/* Writes d to path atomically (path.tmp.<pid>, fsync, rename, fsync of the directory).
** Tensors on any device and with any strides are copied to the host in C order. Keys are
** written sorted by dtype size (largest first) then name, as the reference does; the
** metadata becomes "__metadata__". KILN_ERR_INVALID_ARGUMENT (NULL, a name
** "__metadata__"), KILN_ERR_IO (naming the path and errno), KILN_ERR_OOM. */
KILN_API kiln_status kiln_safetensors_save(const char *path, const kiln_dict *d);
/* Reads a safetensors file; tensors are created on dev (read on the CPU, then moved).
** Returns a new dict the caller frees; its tensors are owned by the dict only (no scope).
** The whole file is validated first: header length against the file size, JSON syntax,
** dtype, shape, data_offsets in range, shape * dtype size equal to the byte length, the
** tensors covering the data area exactly (contiguous, no overlap, no gap), no duplicate
** names, "__metadata__" a string map. NULL + KILN_ERR_IO (open/read) or KILN_ERR_FORMAT
** (a message naming the file, the tensor and the file byte offset), KILN_ERR_DTYPE for a
** valid but unsupported dtype (I8, U16, F8_E4M3, ...), KILN_ERR_OOM. */
KILN_API kiln_dict *kiln_safetensors_load(const char *path, kiln_device dev);

/* A safetensors file opened for reading tensor by tensor: listing a big file, or taking a
** few of its tensors, costs its header and those tensors, not the whole file.
**
**   kiln_safetensors *f = kiln_safetensors_open("model.safetensors");
**   int i = kiln_safetensors_find(f, "wte.weight");
**   kiln_tensor *w = i >= 0 ? kiln_safetensors_read(f, i, dev) : NULL;
**   kiln_safetensors_close(f);
**
** The header is checked as kiln_safetensors_load checks it (the same errors, prefixed
** kiln_safetensors_open), except that a dtype kiln does not hold is listed, not refused;
** the tensors' bytes are read by kiln_safetensors_read, in any order. The file stays open
** until kiln_safetensors_close (NULL: nothing). */
typedef struct kiln_safetensors kiln_safetensors;
KILN_API kiln_safetensors *kiln_safetensors_open(const char *path);
KILN_API void kiln_safetensors_close(kiln_safetensors *f);
/* Tensors in data order (the writer's order: kiln_safetensors_load's dict order). */
KILN_API int kiln_safetensors_count(const kiln_safetensors *f);
/* Tensor i's name (borrowed, valid until close); NULL + KILN_ERR_INVALID_ARGUMENT when
** out of range. */
KILN_API const char *kiln_safetensors_name(const kiln_safetensors *f, int i);
/* Tensor i's dims (returned; -1 + KILN_ERR_INVALID_ARGUMENT when out of range), dtype
** and shape (KILN_MAX_DIMS entries at most); dtype and shape may be NULL. A tensor of a
** dtype kiln does not hold (I8 I16 U16 U32 U64 C64, the F8, F6 and F4 kinds of quantized
** checkpoints) is listed with dtype KILN_DTYPE__COUNT; reading it is KILN_ERR_DTYPE, and
** kiln_safetensors_load refuses the file. */
KILN_API int kiln_safetensors_info(const kiln_safetensors *f, int i, kiln_dtype *dtype, int64_t *shape);
/* Tensor i's dtype as the file names it ("F32", "BF16", "F8_E4M3", ...; static) and its
** size in the file in bytes; NULL or -1 + KILN_ERR_INVALID_ARGUMENT when out of range. */
KILN_API const char *kiln_safetensors_dtype(const kiln_safetensors *f, int i);
KILN_API int64_t kiln_safetensors_nbytes(const kiln_safetensors *f, int i);
/* The path it was opened from (borrowed, valid until close); NULL for NULL. */
KILN_API const char *kiln_safetensors_path(const kiln_safetensors *f);
/* The index of the tensor called name, or -1 (no error set: absence is an answer). */
KILN_API int kiln_safetensors_find(const kiln_safetensors *f, const char *name);
/* "__metadata__" as a dict with no tensors (borrowed; read it with kiln_dict_meta_*). */
KILN_API const kiln_dict *kiln_safetensors_metadata(const kiln_safetensors *f);
/* Reads tensor i onto dev (read on the CPU, then moved); the result follows the usual
** rule (owned by the current scope, else by the caller). NULL + KILN_ERR_INVALID_ARGUMENT
** (NULL f, i out of range), KILN_ERR_IO (a failed read, or a file cut short since it was
** opened, naming the path, the tensor and the file offset), KILN_ERR_OOM. */
KILN_API kiln_tensor *kiln_safetensors_read(kiln_safetensors *f, int i, kiln_device dev);
/* A sharded checkpoint: the index beside the shards of a large model, as Hugging Face's
** save_pretrained writes it (model.safetensors.index.json: "weight_map", tensor name ->
** shard file in the index's directory). Each shard is opened once (kiln_safetensors_open),
** in the order the map first names it; every name the map gives must be in its shard, and
** no tensor may be in two shards. Returns the number of shards with *shards a new array of
** them (close each, then free() the array), or -1 (*shards NULL) with KILN_ERR_IO (the
** index or a shard unreadable), KILN_ERR_FORMAT (naming the index's line and byte, or the
** shard), KILN_ERR_OOM. */
KILN_API int kiln_safetensors_open_index(const char *index_path, kiln_safetensors ***shards);
/* Atomic whole-file write used by checkpoints: writes n bytes to path.tmp.<pid>, fsyncs,
** renames over path, fsyncs the directory. On failure path is untouched and the temporary
** file removed. KILN_ERR_INVALID_ARGUMENT, KILN_ERR_IO (naming the path and errno). */
KILN_API kiln_status kiln_file_write_atomic(const char *path, const void *data, size_t n);

/* --------------------------------------------------------------------------------------
** NumPy .npy (format versions 1.0, 2.0, 3.0). Layout: see src/io/npy.c.
** Dtypes: <f4 <f8 <f2 <i8 <i4 |u1 |b1 (also written with '=' or '|' where numpy allows).
*/
/* Loads an array as a new tensor on dev, contiguous in C order. A fortran_order file is
** read and transposed so the tensor has the array's logical shape and values. The result
** follows the usual rule (owned by the current scope, else by the caller).
** NULL + KILN_ERR_IO (open/read), KILN_ERR_FORMAT (bad magic, header, a big-endian dtype,
** truncated data; the message gives the byte offset), KILN_ERR_DTYPE (a dtype kiln lacks),
** KILN_ERR_OOM. */
KILN_API kiln_tensor *kiln_npy_load(const char *path, kiln_device dev);
/* Writes t (any device, any strides) as a C-order .npy, format version 1.0 (kiln's at most
** 8 dims always fit its header), data 64-aligned, atomically like kiln_file_write_atomic.
** BF16 has no numpy dtype: KILN_ERR_DTYPE (convert to f32 first).
** KILN_ERR_INVALID_ARGUMENT, KILN_ERR_IO, KILN_ERR_OOM. */
KILN_API kiln_status kiln_npy_save(const char *path, const kiln_tensor *t);

/* --------------------------------------------------------------------------------------
** TensorBoard logs: scalars (loss, learning rate, throughput, memory) as TensorFlow event
** files that `tensorboard --logdir DIR` reads; `kiln plot DIR` draws them without it.
**
**   kiln_summary_writer *w = kiln_summary_writer_open("runs/mlp");   // before training
**   kiln_summary_writer_add_scalar(w, "train/loss", step, loss);
**   kiln_summary_writer_close(w);
**
** Layout: TFRecord framing (uint64 length, masked CRC-32C of it, the Event protobuf, its
** masked CRC-32C); the first Event carries file_version "brain.Event:2", each scalar an
** Event{wall_time, step, summary{value{tag, simple_value}}}. Values are stored as float.
*/
typedef struct kiln_summary_writer kiln_summary_writer;
/* Makes logdir (and its parents) when missing and starts a new event file in it
** (events.out.tfevents.<time>.<host>.<pid>.<n>). NULL with KILN_ERR_IO naming the path when
** the directory cannot be made or the file cannot be written, KILN_ERR_INVALID_ARGUMENT
** for a NULL or empty logdir: open it before training, so no work is lost to a bad path. */
KILN_API kiln_summary_writer *kiln_summary_writer_open(const char *logdir);
/* Appends one scalar (tag: at most 1024 bytes, "train/loss"). KILN_ERR_IO on a failed write. */
KILN_API kiln_status kiln_summary_writer_add_scalar(kiln_summary_writer *w, const char *tag, int64_t step,
                                                    double value);
/* Pushes buffered events to the file (TensorBoard sees them while training runs). */
KILN_API kiln_status kiln_summary_writer_flush(kiln_summary_writer *w);
/* Flushes and closes; NULL is a no-op. KILN_ERR_IO when the last write failed. */
KILN_API kiln_status kiln_summary_writer_close(kiln_summary_writer *w);
/* The event file's path (owned by w). */
KILN_API const char *kiln_summary_writer_path(const kiln_summary_writer *w);

/* One scalar read back. tag is valid only during the callback. */
typedef struct kiln_scalar_event {
  double wall_time;
  int64_t step;
  const char *tag;
  double value;
} kiln_scalar_event;
/* Return false to stop reading. */
typedef bool (*kiln_scalar_fn)(const kiln_scalar_event *e, void *ctx);
/* Calls fn for each simple scalar in the event file at path, in file order, checking every
** record's CRCs; other summaries (images, histograms) are skipped. KILN_ERR_IO (cannot
** open), KILN_ERR_FORMAT naming the offset (truncated record, bad CRC, malformed event). */
KILN_API kiln_status kiln_summary_read(const char *path, kiln_scalar_fn fn, void *ctx);
/* CRC-32C (Castagnoli) of n bytes, as TFRecord uses (before masking). */
KILN_API uint32_t kiln_crc32c(const void *data, size_t n);

#ifdef __cplusplus
}
#endif
#endif /* KILN_IO_H */
