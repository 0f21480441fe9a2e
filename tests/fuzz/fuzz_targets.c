/* The fuzz targets (see fuzz_targets.h). Built only on the public headers. */
#define _POSIX_C_SOURCE 200809L
#include "fuzz_targets.h"

#include <kiln.h>
#include <kiln_checkpoint.h>
#include <kiln_data.h>
#include <kiln_io.h>
#include <kiln_nn.h>
#include <kiln_optim.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zlib.h>

const char *const kiln_fuzz_target_names[] = {"safetensors", "npy", "idx", "idx_gz", "csv",
                                              "checkpoint", NULL};

/* One scratch file per process, in memory when /dev/shm is there. */
static const char *scratch_path(void) {
  static char path[128];
  if (!path[0])
    snprintf(path, sizeof path, "%s/kiln_fuzz_%ld",
             access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp", (long)getpid());
  return path;
}

static int write_file(const char *path, const uint8_t *data, size_t size) {
  FILE *f = fopen(path, "wb");
  if (!f) return -1;
  if (size && fwrite(data, 1, size, f) != size) {
    fclose(f);
    return -1;
  }
  return fclose(f) == 0 ? 0 : -1;
}

/* data gzip-compressed into a file (the IDX reader's usual input). */
static int write_gz(const char *path, const uint8_t *data, size_t size) {
  gzFile g = gzopen(path, "wb1");
  if (!g) return -1;
  if (size && gzwrite(g, data, (unsigned)size) != (int)size) {
    gzclose(g);
    return -1;
  }
  return gzclose(g) == Z_OK ? 0 : -1;
}

/* ---- checkpoint: a small model, Adam and a step scheduler, made once ------------------ */
static kiln_module *ck_model;
static kiln_optimizer *ck_opt;
static kiln_scheduler *ck_sched;

static int64_t ck_base; /* live tensors before the objects were made */

static void ck_teardown(void) {
  kiln_scheduler_free(ck_sched);
  kiln_optimizer_free(ck_opt);
  kiln_module_free(ck_model);
  ck_sched = NULL;
  ck_opt = NULL;
  ck_model = NULL;
}

static int ck_setup(void) {
  if (ck_model) return 0;
  ck_base = kiln_live_tensors();
  kiln_manual_seed(1);
  ck_model = kiln_sequential_new();
  kiln_sequential_append(ck_model, kiln_linear_new(4, 3, true, KILN_F32, kiln_device_cpu(), NULL));
  kiln_sequential_append(ck_model, kiln_relu_new());
  kiln_sequential_append(ck_model, kiln_linear_new(3, 2, true, KILN_F32, kiln_device_cpu(), NULL));
  kiln_optim_config cfg = kiln_adam_config(1e-2);
  ck_opt = ck_model ? kiln_optimizer_new_module(&cfg, ck_model) : NULL;
  ck_sched = ck_opt ? kiln_step_lr_new(ck_opt, 2, 0.5) : NULL;
  return ck_sched ? 0 : -1;
}

/* The model's parameters as one host array (n floats), for before/after comparisons. */
static float *ck_snapshot(size_t *n) {
  kiln_dict *d = kiln_module_state_dict(ck_model);
  if (!d) return NULL;
  size_t total = 0;
  for (int i = 0; i < kiln_dict_size(d); i++) total += (size_t)kiln_numel(kiln_dict_value(d, i));
  float *v = malloc((total ? total : 1) * sizeof *v);
  size_t at = 0;
  for (int i = 0; v && i < kiln_dict_size(d); i++) {
    kiln_tensor *t = kiln_dict_value(d, i);
    kiln_to_host(t, v + at, kiln_nbytes(t));
    at += (size_t)kiln_numel(t);
  }
  kiln_dict_free(d);
  *n = total;
  return v;
}

/* What a loaded checkpoint promises: training goes on from it. One step of the model,
** the optimizer and the scheduler must succeed and leave a finite learning rate. */
static int train_step(void) {
  kiln_scope_begin();
  kiln_tensor *x = kiln_ones(KILN_SHAPE(2, 4), KILN_F32, kiln_device_cpu());
  kiln_status st = kiln_optimizer_zero_grad(ck_opt);
  if (st == KILN_OK) st = kiln_backward(kiln_mean_all(kiln_module_forward(ck_model, x)), NULL);
  if (st == KILN_OK) st = kiln_optimizer_step(ck_opt);
  if (st == KILN_OK) st = kiln_scheduler_step(ck_sched);
  kiln_scope_end();
  double lr = kiln_optimizer_get_lr(ck_opt);
  if (st != KILN_OK || !isfinite(lr)) {
    fprintf(stderr, "fuzz checkpoint: the load succeeded but the next step failed: %s (lr %g)\n",
            st != KILN_OK ? kiln_last_error_message() : "ok", lr);
    return -1;
  }
  return 0;
}

static int run_checkpoint(const char *path, uint8_t flags) {
  if (ck_setup() != 0) {
    fprintf(stderr, "fuzz checkpoint: setup failed: %s\n", kiln_last_error_message());
    return -1;
  }
  size_t n0 = 0, n1 = 0;
  float *before = ck_snapshot(&n0);
  int64_t steps0 = kiln_optimizer_steps(ck_opt);
  double lr0 = kiln_optimizer_get_lr(ck_opt);
  int64_t epoch = -7, step = -7;
  kiln_dict *extra = NULL;
  kiln_status st = kiln_checkpoint_load(path, ck_model, (flags & 1) ? ck_opt : NULL,
                                        (flags & 2) ? ck_sched : NULL, NULL, &epoch, &step,
                                        (flags & 4) ? &extra : NULL);
  int rc = 0;
  if (st != KILN_OK) {
    float *after = ck_snapshot(&n1);
    if (!before || !after || n0 != n1 || memcmp(before, after, n0 * sizeof *before) ||
        kiln_optimizer_steps(ck_opt) != steps0 ||
        !(kiln_optimizer_get_lr(ck_opt) == lr0 || (isnan(lr0) && isnan(kiln_optimizer_get_lr(ck_opt))))) {
      fprintf(stderr, "fuzz checkpoint: a failed load (%s) changed the objects\n",
              kiln_last_error_message());
      rc = -1;
    }
    if (epoch != -7 || step != -7 || extra) {
      fprintf(stderr, "fuzz checkpoint: a failed load set epoch/step/extra\n");
      rc = -1;
    }
    free(after);
  } else if (epoch < 0 || step < 0) {
    fprintf(stderr, "fuzz checkpoint: loaded a negative epoch %lld or step %lld\n",
            (long long)epoch, (long long)step);
    rc = -1;
  }
  if (st == KILN_OK && rc == 0 && train_step() != 0) rc = -1;
  kiln_dict_free(extra);
  free(before);
  if (st == KILN_OK) {
    /* A load may rightly give the optimizer state tensors it did not have: start the next
    ** input from fresh objects, and count leaks against the count before they existed. */
    ck_teardown();
    return rc ? rc : 1;
  }
  return rc;
}

int kiln_fuzz_run(const char *name, const uint8_t *data, size_t size) {
  const char *path = scratch_path();
  int64_t live0 = kiln_live_tensors();
  int rc = 0;
  /* The first byte of csv, idx_gz and checkpoint inputs picks options; the rest is the file. */
  uint8_t opt = size ? data[0] : 0;
  const uint8_t *body = size ? data + 1 : data;
  size_t bsize = size ? size - 1 : 0;
  if (!strcmp(name, "safetensors")) {
    if (write_file(path, data, size)) return 0;
    kiln_dict_free(kiln_safetensors_load(path, kiln_device_cpu()));
  } else if (!strcmp(name, "npy")) {
    if (write_file(path, data, size)) return 0;
    kiln_tensor_free(kiln_npy_load(path, kiln_device_cpu()));
  } else if (!strcmp(name, "idx")) {
    if (write_file(path, data, size)) return 0;
    kiln_tensor_free(kiln_idx_load(path));
  } else if (!strcmp(name, "idx_gz")) {
    /* odd first byte: the rest is written as it is (damaged gzip streams);
    ** even: the rest is an IDX file, gzip-compressed on the way */
    if ((opt & 1) ? write_file(path, body, bsize) : write_gz(path, body, bsize)) return 0;
    kiln_tensor_free(kiln_idx_load(path));
  } else if (!strcmp(name, "csv")) {
    if (write_file(path, body, bsize)) return 0;
    static const char delims[4] = {0, ';', '\t', ' '};
    kiln_csv_opts o;
    memset(&o, 0, sizeof o);
    o.delimiter = delims[opt & 3];
    o.header = (kiln_csv_header)((opt >> 2) % 3);
    o.no_label = (opt >> 4) & 1;
    o.label_col = (opt >> 5) & 1 ? -1 : 0;
    if ((opt >> 6) & 1) o.label_name = "label";
    kiln_tensor *x = NULL, *y = NULL;
    if (kiln_csv_load(path, &o, &x, o.no_label ? NULL : &y) == KILN_OK) {
      if (!x || (!o.no_label && !y)) {
        fprintf(stderr, "fuzz csv: success without tensors\n");
        rc = -1;
      }
      kiln_tensor_free(x);
      kiln_tensor_free(y);
    } else if (x || y) {
      fprintf(stderr, "fuzz csv: an error that still set the outputs\n");
      rc = -1;
    }
  } else if (!strcmp(name, "checkpoint")) {
    if (write_file(path, body, bsize)) return 0;
    if (ck_setup() != 0) return -1;
    live0 = kiln_live_tensors(); /* the model and optimizer stay between inputs */
    rc = run_checkpoint(path, opt);
    if (rc == 1) { /* loaded; the objects were freed */
      rc = 0;
      live0 = ck_base;
    }
  } else {
    return -2;
  }
  kiln_clear_error();
  if (kiln_live_tensors() != live0) {
    fprintf(stderr, "fuzz %s: %lld tensor(s) leaked\n", name,
            (long long)(kiln_live_tensors() - live0));
    rc = -1;
  }
  return rc;
}
