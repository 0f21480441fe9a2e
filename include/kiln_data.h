/*
** kiln_data — datasets, the batch loader, and dataset file readers (IDX, CSV).
** Built only on the public API (kiln.h); .npy and safetensors live in kiln_io.h.
**
**   kiln_tensor *x, *y, *tx, *ty;                   // (60000, 28, 28) f32, (60000) i64
**   if (kiln_fashion_mnist_load(NULL, &x, &y, &tx, &ty) != KILN_OK) ...
**   kiln_dataset *ds = kiln_tensor_dataset_new(2, (kiln_tensor *[]){x, y});
**   kiln_loader_opts o = kiln_loader_opts_default();
**   o.batch_size = 64; o.shuffle = true; o.seed = 1; o.num_workers = 2;
**   o.device = kiln_device_best();
**   kiln_loader *l = kiln_loader_new(ds, &o);
**   for (int epoch = 0; epoch < 10; epoch++) {
**     kiln_loader_epoch(l, epoch);
**     kiln_tensor *b[2];
**     for (;;) {
**       kiln_scope_begin();                         // one scope per step
**       int r = kiln_loader_next(l, b);             // 1 batch, 0 end of epoch, -1 error
**       if (r == 1) { ... a step on b[0] (64, 28, 28) and b[1] (64) ... }
**       kiln_scope_end();                           // frees the batch with the step
**       if (r < 0) fprintf(stderr, "%s\n", kiln_last_error_message());
**       if (r != 1) break;
**     }
**   }
**   kiln_loader_free(l);
**   kiln_dataset_free(ds);
*/
#ifndef KILN_DATA_H
#define KILN_DATA_H

#include "kiln.h"

#ifdef __cplusplus
extern "C" {
#endif

/* --------------------------------------------------------------------------------------
** Datasets: a length and, for each index, a sample made of n_fields tensors (like a
** PyTorch Dataset returning a tuple). Every sample's field f has the same dtype and shape
** (the field's spec), so the loader can stack samples into (B, ...) batches.
*/
typedef struct kiln_dataset kiln_dataset;

typedef struct kiln_field_spec {
  kiln_dtype dtype;
  int ndim;                      /* dims of one sample's field (0: a scalar per sample) */
  int64_t shape[KILN_MAX_DIMS];
} kiln_field_spec;

/* A user dataset. get is called from loader worker threads concurrently (with different
** indices): it must be thread-safe. It writes sample `index` (0 <= index < len) into
** field_bufs[f], host memory for one contiguous C-order element of field f's spec (in
** the spec's dtype), and returns KILN_OK or an error code (setting kiln_set_error with a
** message; the loader reports it from kiln_loader_next). destroy (may be NULL) is called
** with self by kiln_dataset_free. */
typedef struct kiln_dataset_vtable {
  int64_t (*len)(void *self);
  kiln_status (*get)(void *self, int64_t index, void *const *field_bufs);
  void (*destroy)(void *self);
} kiln_dataset_vtable;

/* A dataset over a user's vtable. vt and fields are copied; self is passed to every call.
** NULL + KILN_ERR_INVALID_ARGUMENT (NULL vt/len/get, n_fields < 1 or over 64, a bad spec),
** KILN_ERR_OOM. */
KILN_API kiln_dataset *kiln_dataset_new(const kiln_dataset_vtable *vt, void *self, int n_fields,
                                        const kiln_field_spec *fields);
/* A dataset whose sample i is (fields[0][i], ..., fields[n-1][i]). Every field has at
** least one dim and the same size of dim 0. The dataset takes its own reference to each
** tensor (released by kiln_dataset_free), so scoped tensors may be passed. The loader
** gathers a batch with one kiln_index_select per field on the field's device.
** NULL + KILN_ERR_INVALID_ARGUMENT (NULL, n_fields < 1 or over 64), KILN_ERR_SHAPE. */
KILN_API kiln_dataset *kiln_tensor_dataset_new(int n_fields, kiln_tensor *const *fields);
/* Number of samples (-1 with KILN_ERR_INVALID_ARGUMENT for NULL). */
KILN_API int64_t kiln_dataset_len(const kiln_dataset *ds);
/* Number of fields per sample (0 for NULL) and field i's spec (NULL when out of range). */
KILN_API int kiln_dataset_num_fields(const kiln_dataset *ds);
KILN_API const kiln_field_spec *kiln_dataset_field(const kiln_dataset *ds, int i);
/* Sample index as n_fields new CPU tensors written to out (owned by the current scope,
** else by the caller). KILN_ERR_INDEX for an index out of range, the dataset's error. */
KILN_API kiln_status kiln_dataset_get(kiln_dataset *ds, int64_t index, kiln_tensor **out);
/* Sample index written into per-field host buffers, as a user dataset's get does (each
** buffer holds one contiguous C-order element of field f's spec). For datasets built on
** other datasets (shards, subsets, transforms). Thread-safe when the dataset's get is.
** KILN_ERR_INVALID_ARGUMENT (NULL), KILN_ERR_INDEX, the dataset's error. */
KILN_API kiln_status kiln_dataset_read(kiln_dataset *ds, int64_t index, void *const *field_bufs);
/* Frees the dataset (calls destroy, releases tensor fields). It must outlive every loader
** made from it. NULL is a no-op. */
KILN_API void kiln_dataset_free(kiln_dataset *ds);

/* --------------------------------------------------------------------------------------
** Loader: batches of a dataset, in a per-epoch order, prefetched by worker threads.
*/
typedef struct kiln_loader kiln_loader;

/* A custom collate: makes n_out batch tensors from n_samples samples. samples[s * n_fields
** + f] is sample s's field f (a CPU tensor of the field's spec, or for a tensor dataset a
** view of the field's row on its device), borrowed. It writes n_out tensors to out and
** returns KILN_OK, or an error code (with kiln_set_error). It runs inside a scope that the
** loader opens (in a worker thread, or in the caller's thread when num_workers is 0), and
** the outputs are borrowed: the loader takes its own reference to each before closing
** that scope. So write op results, or samples themselves, to out as they are (no
** kiln_keep, no kiln_tensor_ref); intermediates go with the scope. Must be thread-safe. */
typedef kiln_status (*kiln_collate_fn)(void *user, int n_samples, int n_fields,
                                       kiln_tensor *const *samples, kiln_tensor **out);

typedef struct kiln_loader_opts {
  int64_t batch_size;   /* samples per batch, >= 1 */
  bool shuffle;         /* a new permutation each epoch from seed + epoch */
  uint64_t seed;
  bool drop_last;       /* drop the last, smaller batch */
  int num_workers;      /* 0: batches are made in the caller's thread by kiln_loader_next
                           (staged copies: by one background thread, see device) */
  int prefetch_factor;  /* batches in flight per worker (queue: prefetch_factor *
                           num_workers); 0 means 2 */
  kiln_device device;   /* where batches are delivered (kiln_to_device after collate).
                           A GPU, with the samples on the host (a user dataset or CPU
                           tensors): staged copies. Worker threads write each batch into
                           pinned host memory and its copy runs on a side stream while
                           the current step runs (see kiln_loader_next) */
  kiln_collate_fn collate; /* NULL: stack each field into (B, ...) */
  void *collate_user;
  int collate_n_out;    /* tensors a custom collate makes; 0 means n_fields */
} kiln_loader_opts;

/* batch_size 1, no shuffle, seed 0, keep the last batch, no workers, prefetch 2, cpu. */
KILN_API kiln_loader_opts kiln_loader_opts_default(void);

/* A loader over ds (borrowed: ds must outlive the loader). opts is copied; NULL means
** kiln_loader_opts_default(). NULL + KILN_ERR_INVALID_ARGUMENT (NULL ds, batch_size < 1,
** num_workers < 0 or over 256, prefetch_factor < 0, collate_n_out < 0 or over 64),
** KILN_ERR_OOM. No thread starts before the first epoch. */
KILN_API kiln_loader *kiln_loader_new(kiln_dataset *ds, const kiln_loader_opts *opts);
/* Starts epoch `epoch`: stops the workers of an unfinished epoch (dropping its batches),
** fixes the order (shuffle: kiln_randperm with a generator seeded seed + epoch, so the
** order is the same for any num_workers; else 0..n-1) and starts the workers. The
** dataset's length is read again here. KILN_ERR_INVALID_ARGUMENT, KILN_ERR_OOM,
** KILN_ERR_INTERNAL (a thread could not start), KILN_ERR_STATE (a graph capture is open
** on the loader's device or its dataset's). */
KILN_API kiln_status kiln_loader_epoch(kiln_loader *l, uint64_t epoch);
/* The next batch of the epoch, in order, written to fields[0 .. kiln_loader_num_fields-1].
** Returns
**    1  a batch: fields hold new tensors on opts.device, (B, ...) for the default collate
**       (B = batch_size except for a smaller last batch when !drop_last), owned by the
**       current scope like any op result, or by the caller when no scope is open;
**    0  the end of the epoch (fields untouched); further calls return 0 until the next
**       kiln_loader_epoch. With no epoch started, the first call starts epoch 0;
**   -1  an error (fields untouched): kiln_last_error() tells which (the dataset's or
**       collate's error, KILN_ERR_OOM, KILN_ERR_DEVICE, KILN_ERR_INVALID_ARGUMENT). The
**       failed batch is skipped: the next call goes on with the one after it. A failure
**       in a worker thread (an allocation, the dataset) is the error of the call that
**       would have returned its batch. KILN_ERR_STATE when a graph capture is open on
**       the loader's device or its dataset's: nothing is taken, so call it before the
**       captured step and copy the batch into the step's static inputs.
** Staged copies (opts.device): the fields are views of one device block; the call makes
** the device's stream wait for the block's copy (the host does not wait) and queues the
** next batch's copy, which then runs beside the step. The loader writes a block again
** only once every tensor that shares it (the fields, views of them, tensors autograd
** saved) has been freed, so a batch may be kept across calls. */
KILN_API int kiln_loader_next(kiln_loader *l, kiln_tensor **fields);
/* Batches per epoch for the dataset's current length: ceil(n / B), or floor(n / B) with
** drop_last, which is 0 when the dataset is shorter than one batch (every epoch is then
** empty: kiln_loader_next returns 0 at once). -1 for NULL. */
KILN_API int64_t kiln_loader_len(const kiln_loader *l);
/* Tensors per batch (collate_n_out, or the dataset's n_fields). 0 for NULL. */
KILN_API int kiln_loader_num_fields(const kiln_loader *l);
/* Stops and joins the workers, even mid-epoch, and frees undelivered batches (waiting
** for copies in flight). Batches already delivered stay valid. Not inside a captured
** step. NULL is a no-op. */
KILN_API void kiln_loader_free(kiln_loader *l);

/* --------------------------------------------------------------------------------------
** Image transforms (src/data/transform.c): a dataset whose image field goes through a list
** of transforms as each sample is read, so they run on the loader's worker threads (as a
** torchvision Dataset given transforms.Compose([...])).
**
**   kiln_transform t[] = {
**     kiln_transform_pad(2, KILN_PAD_CONSTANT),                 // (1, 28, 28) -> (1, 32, 32)
**     kiln_transform_random_crop(32, 32, 4, KILN_PAD_CONSTANT), // pad 4, crop 32x32
**     kiln_transform_random_hflip(0.5),
**     kiln_transform_normalize(1, (const float[]){0.2860f}, (const float[]){0.3530f}),
**   };
**   kiln_dataset *aug = kiln_transform_dataset_new(base, 0, 4, t, seed);  // base: (x, y)
**   kiln_loader *l = kiln_loader_new(aug, &o);   // batches of (B, 1, 32, 32) f32 and (B)
**
** Images are (C, H, W), or (H, W) read as one channel; u8 or f32. The transformed field is
** (C, H', W'): f32 once to_float ran or when the input was f32, else u8 (rounded to the
** nearest, clamped to [0, 255], after a resize). Every other field passes through.
**
** Randomness: random transform k of sample i in epoch e draws from kiln's Philox with key
** seed and counter (e, i, k) — not from a thread's generator — so a seed gives the same
** images whatever num_workers and whichever worker reads the sample, and each epoch gives
** new ones. The epoch is the one of the loader reading the sample (kiln_loader_epoch);
** a read outside a loader (kiln_dataset_get/read) is epoch 0.
*/
typedef enum kiln_transform_kind {
  KILN_TRANSFORM_TO_FLOAT = 1, /* u8 -> f32 as x / 255 (ToTensor, ConvertImageDtype) */
  KILN_TRANSFORM_NORMALIZE,    /* f32: (x - mean[c]) / std[c] (Normalize) */
  KILN_TRANSFORM_PAD,          /* padding on each side of H and W (Pad) */
  KILN_TRANSFORM_RANDOM_CROP,  /* pad, then a uniform (height, width) window (RandomCrop) */
  KILN_TRANSFORM_RANDOM_HFLIP, /* mirror along W with probability p (RandomHorizontalFlip) */
  KILN_TRANSFORM_RESIZE        /* bilinear to (height, width), half-pixel centres as
                                  PyTorch's interpolate(align_corners=False), no antialias */
} kiln_transform_kind;

/* One transform; make it with the constructors below. */
typedef struct kiln_transform {
  kiln_transform_kind kind;
  int64_t height, width;   /* RANDOM_CROP, RESIZE: the output size */
  int64_t padding;         /* PAD, RANDOM_CROP: pixels added on each side (>= 0) */
  kiln_pad_mode pad_mode;  /* PAD, RANDOM_CROP: KILN_PAD_CONSTANT pads with 0; REFLECT needs
                              padding < H and < W */
  double p;                /* RANDOM_HFLIP: in [0, 1] */
  int n_channels;          /* NORMALIZE: entries in mean and std (must equal C) */
  const float *mean, *std; /* NORMALIZE: copied by kiln_transform_dataset_new; std != 0 */
} kiln_transform;

KILN_API kiln_transform kiln_transform_to_float(void);
KILN_API kiln_transform kiln_transform_normalize(int n_channels, const float *mean, const float *std);
KILN_API kiln_transform kiln_transform_pad(int64_t padding, kiln_pad_mode mode);
KILN_API kiln_transform kiln_transform_random_crop(int64_t height, int64_t width, int64_t padding,
                                                   kiln_pad_mode mode);
KILN_API kiln_transform kiln_transform_random_hflip(double p);
KILN_API kiln_transform kiln_transform_resize(int64_t height, int64_t width);

/* A dataset over base whose field `field` is passed through transforms[0 .. n) in order
** (n in [0, 64]; the list and the mean/std arrays are copied). base is borrowed and must
** outlive the new dataset; free it with kiln_dataset_free. Shapes and dtypes are checked
** here, through the whole list, so a bad list fails at once: NULL with
** KILN_ERR_INVALID_ARGUMENT (NULL base or transforms, field out of range, an unknown kind,
** to_float on f32, normalize on u8, p outside [0, 1], std 0 or not finite, a negative
** padding or a size < 1, reflect padding not smaller than the image), KILN_ERR_SHAPE
** (the field is not (H, W) or (C, H, W), mean/std length not C, a crop larger than the
** padded image; the message names the transform and the shapes), KILN_ERR_DTYPE (the
** field not u8 or f32), KILN_ERR_OOM. An empty base is an error too (KILN_ERR_INVALID_
** ARGUMENT): a dataset to augment with no samples is a mistake upstream. */
KILN_API kiln_dataset *kiln_transform_dataset_new(kiln_dataset *base, int field, int n,
                                                  const kiln_transform *transforms, uint64_t seed);

/* --------------------------------------------------------------------------------------
** IDX files (MNIST, Fashion-MNIST). Layout: see src/data/idx.c.
*/
/* Loads an IDX file, gzip-compressed (when built with zlib) or raw, as a new CPU tensor of
** the file's dims: u8 for type 0x08; 0x09 (i8) and 0x0B (i16) widen to i32; 0x0C i32,
** 0x0D f32, 0x0E f64. Owned by the current scope, else by the caller. NULL +
** KILN_ERR_IO (open/read, a broken gzip stream), KILN_ERR_FORMAT (bad magic, type, dims,
** truncated or trailing data; the message gives the byte offset, counted in the
** uncompressed stream for .gz), KILN_ERR_UNSUPPORTED (a .gz file in a build without
** zlib), KILN_ERR_OOM. */
KILN_API kiln_tensor *kiln_idx_load(const char *path);
/* Fashion-MNIST (or MNIST: the same file names) from dir: train-images-idx3-ubyte,
** train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte, each raw or
** with .gz. dir NULL: $KILN_DATA_DIR (the directory itself, or its fashion-mnist/ child)
** when set, else /usr/share/datasets/fashion-mnist. Images become f32 (N, 28, 28) scaled
** to [0, 1], labels i64 (N). Any output pointer may be NULL to skip that file. On success
** the outputs are new tensors (owned by the current scope, else by the caller); on error
** none is set (all NULL) and nothing leaks. KILN_ERR_IO naming the missing file and the
** directories tried, KILN_ERR_FORMAT (wrong dims, image and label counts disagree). */
KILN_API kiln_status kiln_fashion_mnist_load(const char *dir, kiln_tensor **train_x,
                                             kiln_tensor **train_y, kiln_tensor **test_x,
                                             kiln_tensor **test_y);

/* --------------------------------------------------------------------------------------
** CSV with numeric columns (src/data/csv.c).
*/
typedef enum kiln_csv_header {
  KILN_CSV_HEADER_AUTO = 0, /* a first line with a non-numeric field is a header */
  KILN_CSV_HEADER_YES,
  KILN_CSV_HEADER_NO
} kiln_csv_header;

typedef struct kiln_csv_opts {
  char delimiter;          /* 0 means ',' */
  kiln_csv_header header;
  const char *label_name;  /* the label column by header name; NULL: use label_col */
  int label_col;           /* the label column by index (negative counts from the end) */
  bool no_label;           /* every column is a feature; *labels is set to NULL */
} kiln_csv_opts;

/* Reads a CSV file of numbers (fields may be quoted and padded with spaces; blank lines
** are skipped; \n or \r\n). A zero-filled opts (or NULL) means: ',' delimiter, header
** detected, the label in column 0. Features become f32 (N, F) with every column but the
** label's, labels i64 (N) (each label must be an integer). Both are new CPU tensors owned
** by the current scope, else by the caller; on error neither is set. labels may be NULL
** when no_label is set. KILN_ERR_IO, KILN_ERR_FORMAT naming the line and column (a
** non-number, a wrong number of fields, a non-integer label, no data rows),
** KILN_ERR_INVALID_ARGUMENT (no such label column), KILN_ERR_OOM. */
KILN_API kiln_status kiln_csv_load(const char *path, const kiln_csv_opts *opts,
                                   kiln_tensor **features, kiln_tensor **labels);

#ifdef __cplusplus
}
#endif
#endif /* KILN_DATA_H */
