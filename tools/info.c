/*
** kiln info FILE|DIR: the tensors of a safetensors file (name, dtype, shape, bytes), its
** metadata and totals. The header is read and validated by kiln_safetensors_open (a corrupt
** one is reported with its message, naming the byte offset); the tensors' bytes are not
** read, so a file of many gigabytes lists at once. A directory stands for its
** model.safetensors (a Hugging Face save_pretrained directory).
*/
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <kiln.h>
#include <kiln_io.h>
#include <kiln_nn.h> /* kiln_format_bytes */

#include "cli.h"

static void info_usage(FILE *f) {
  fprintf(f, "usage: kiln info FILE|DIR [--json]\n"
             "  Lists the tensors (name, dtype, shape, bytes) and metadata of a safetensors\n"
             "  file, with totals, from its header (the tensors are not read). A directory\n"
             "  means its model.safetensors. --json prints one JSON object on stdout.\n");
}

/* Tensor i's entry: name, dtype (kiln's name; one kiln does not hold, as the file names
** it: F8_E4M3, ...), dims into shape, elements and bytes. */
typedef struct entry {
  const char *name, *dtype;
  int ndim;
  int64_t shape[KILN_MAX_DIMS], numel, bytes;
} entry;

static entry entry_at(const kiln_safetensors *f, int i) {
  entry e = {.name = kiln_safetensors_name(f, i), .numel = 1};
  kiln_dtype dt;
  e.ndim = kiln_safetensors_info(f, i, &dt, e.shape);
  e.dtype = dt == KILN_DTYPE__COUNT ? kiln_safetensors_dtype(f, i) : kiln_dtype_name(dt);
  for (int k = 0; k < e.ndim; k++) e.numel *= e.shape[k];
  e.bytes = kiln_safetensors_nbytes(f, i);
  return e;
}

int cli_info(int argc, char **argv) {
  bool json = false;
  const char *path = NULL;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--json")) json = true;
    else if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
      info_usage(stdout);
      return 0;
    } else if (argv[i][0] == '-' && argv[i][1]) {
      fprintf(stderr, "kiln info: unknown option '%s'\n", argv[i]);
      info_usage(stderr);
      return 2;
    } else if (path) {
      fprintf(stderr, "kiln info: one FILE at a time (got '%s' and '%s')\n", path, argv[i]);
      return 2;
    } else {
      path = argv[i];
    }
  }
  if (!path) {
    fprintf(stderr, "kiln info: missing FILE\n");
    info_usage(stderr);
    return 2;
  }
  struct stat st;
  char in_dir[4096];
  if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) { /* a model directory: its model.safetensors */
    snprintf(in_dir, sizeof in_dir, "%s/model.safetensors", path);
    if (stat(in_dir, &st) != 0) {
      fputs("kiln info: '", stderr);
      cli_write_safe(stderr, path);
      fputs("' is a directory without a model.safetensors (give a .safetensors file: a sharded\n"
            "  checkpoint's shards are listed one by one, their names in model.safetensors.index.json)\n",
            stderr);
      return 1;
    }
    path = in_dir;
  }
  kiln_safetensors *f = kiln_safetensors_open(path);
  if (!f) {
    fputs("kiln info: cannot read '", stderr);
    cli_write_safe(stderr, path);
    fputs("' as safetensors: ", stderr);
    cli_write_safe(stderr, kiln_last_error_message()); /* may quote a name from the file */
    fprintf(stderr, " (%s)\n", kiln_error_name(kiln_last_error()));
    return 1;
  }
  const kiln_dict *meta = kiln_safetensors_metadata(f);
  int n = kiln_safetensors_count(f);
  int64_t params = 0, bytes = 0;
  for (int i = 0; i < n; i++) {
    entry e = entry_at(f, i);
    params += e.numel;
    bytes += e.bytes;
  }
  char sh[256], by[64];
  if (json) {
    cli_json j;
    cli_json_init(&j, stdout);
    cli_json_object_begin(&j, NULL);
    cli_json_string(&j, "file", path);
    cli_json_array_begin(&j, "tensors");
    for (int i = 0; i < n; i++) {
      entry e = entry_at(f, i);
      cli_json_object_begin(&j, NULL);
      cli_json_string(&j, "name", e.name);
      cli_json_string(&j, "dtype", e.dtype);
      cli_json_array_begin(&j, "shape");
      for (int k = 0; k < e.ndim; k++) cli_json_int(&j, NULL, e.shape[k]);
      cli_json_array_end(&j);
      cli_json_int(&j, "numel", e.numel);
      cli_json_int(&j, "bytes", e.bytes);
      cli_json_object_end(&j);
    }
    cli_json_array_end(&j);
    cli_json_object_begin(&j, "metadata");
    for (int i = 0; i < kiln_dict_meta_size(meta); i++)
      cli_json_string(&j, kiln_dict_meta_key(meta, i), kiln_dict_meta_value(meta, i));
    cli_json_object_end(&j);
    cli_json_object_begin(&j, "totals");
    cli_json_int(&j, "tensors", n);
    cli_json_int(&j, "parameters", params);
    cli_json_int(&j, "bytes", bytes);
    cli_json_object_end(&j);
    cli_json_object_end(&j);
  } else {
    bool pretty = cli_is_tty(stdout);
    cli_write_safe(stdout, path);
    putchar('\n');
    const char *h[] = {"name", "dtype", "shape", "elements", "bytes"};
    cli_table *t = cli_table_new(5, h);
    cli_table_align_right(t, 3);
    cli_table_align_right(t, 4);
    for (int i = 0; i < n; i++) {
      entry e = entry_at(f, i);
      char ne[32], nb[32];
      kiln_dims_str(e.ndim, e.shape, sh, sizeof sh);
      snprintf(ne, sizeof ne, "%lld", (long long)e.numel);
      snprintf(nb, sizeof nb, "%lld", (long long)e.bytes);
      const char *row[] = {e.name, e.dtype, sh, ne, nb};
      cli_table_row(t, row);
    }
    cli_table_print(stdout, t, pretty);
    cli_table_free(t);
    int nm = kiln_dict_meta_size(meta);
    if (nm > 0) {
      cli_heading(stdout, pretty, "Metadata");
      const char *mh[] = {"key", "value"};
      t = cli_table_new(2, mh);
      for (int i = 0; i < nm; i++) {
        const char *row[] = {kiln_dict_meta_key(meta, i), kiln_dict_meta_value(meta, i)};
        cli_table_row(t, row);
      }
      cli_table_print(stdout, t, pretty);
      cli_table_free(t);
    }
    kiln_format_bytes(bytes, by, sizeof by);
    printf("\n%d tensors, %lld parameters, %lld bytes (%s)\n", n, (long long)params,
           (long long)bytes, by);
  }
  kiln_safetensors_close(f);
  return 0;
}
