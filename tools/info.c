/*
** kiln info FILE|DIR: the tensors of a safetensors file (name, dtype, shape, bytes), its
** metadata and totals. The header is read and validated by kiln_safetensors_open (a corrupt
** one is reported with its message, naming the byte offset); the tensors' bytes are not
** read, so a file of many gigabytes lists at once. A sharded checkpoint's index
** (kiln_safetensors_open_index) lists the tensors of all its shards, each row naming its
** shard. A directory stands for its model.safetensors, or else its index (a Hugging Face
** save_pretrained directory).
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
             "  file, with totals, from its header (the tensors are not read). A sharded\n"
             "  checkpoint's index (model.safetensors.index.json) lists every shard's. A\n"
             "  directory means its model.safetensors, else its index. --json prints one JSON\n"
             "  object on stdout.\n");
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

/* The file name of a path (after its last '/'). */
static const char *base_name(const char *path) {
  const char *slash = strrchr(path, '/');
  return slash ? slash + 1 : path;
}

/* "metadata": {key: value, ...} */
static void json_metadata(cli_json *j, const kiln_dict *meta) {
  cli_json_object_begin(j, "metadata");
  for (int i = 0; i < kiln_dict_meta_size(meta); i++)
    cli_json_string(j, kiln_dict_meta_key(meta, i), kiln_dict_meta_value(meta, i));
  cli_json_object_end(j);
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
  bool index = false;
  if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) { /* a model directory: its model.safetensors */
    snprintf(in_dir, sizeof in_dir, "%s/model.safetensors", path);
    if (stat(in_dir, &st) != 0) { /* or its shards */
      snprintf(in_dir, sizeof in_dir, "%s/model.safetensors.index.json", path);
      index = stat(in_dir, &st) == 0;
      if (!index) {
        fputs("kiln info: '", stderr);
        cli_write_safe(stderr, path);
        fputs("' is a directory without a model.safetensors or a model.safetensors.index.json\n", stderr);
        return 1;
      }
    }
    path = in_dir;
  } else {
    const char *ix = ".index.json";
    index = strlen(path) > strlen(ix) && !strcmp(path + strlen(path) - strlen(ix), ix);
  }
  kiln_safetensors *single = NULL, **files = &single; /* the shards, or the one file */
  const int nf = index ? kiln_safetensors_open_index(path, &files) : (single = kiln_safetensors_open(path)) ? 1 : -1;
  if (nf < 0) {
    fputs("kiln info: cannot read '", stderr);
    cli_write_safe(stderr, path);
    fputs(index ? "' as a sharded checkpoint: " : "' as safetensors: ", stderr);
    cli_write_safe(stderr, kiln_last_error_message()); /* may quote a name from the file */
    fprintf(stderr, " (%s)\n", kiln_error_name(kiln_last_error()));
    return 1;
  }
  int n = 0;
  int64_t params = 0, bytes = 0;
  for (int s = 0; s < nf; s++)
    for (int i = 0; i < kiln_safetensors_count(files[s]); i++, n++) {
      entry e = entry_at(files[s], i);
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
    for (int s = 0; s < nf; s++)
      for (int i = 0; i < kiln_safetensors_count(files[s]); i++) {
        entry e = entry_at(files[s], i);
        cli_json_object_begin(&j, NULL);
        cli_json_string(&j, "name", e.name);
        if (index) cli_json_string(&j, "shard", base_name(kiln_safetensors_path(files[s])));
        cli_json_string(&j, "dtype", e.dtype);
        cli_json_array_begin(&j, "shape");
        for (int k = 0; k < e.ndim; k++) cli_json_int(&j, NULL, e.shape[k]);
        cli_json_array_end(&j);
        cli_json_int(&j, "numel", e.numel);
        cli_json_int(&j, "bytes", e.bytes);
        cli_json_object_end(&j);
      }
    cli_json_array_end(&j);
    if (index) { /* each shard's own metadata */
      cli_json_array_begin(&j, "shards");
      for (int s = 0; s < nf; s++) {
        cli_json_object_begin(&j, NULL);
        cli_json_string(&j, "file", kiln_safetensors_path(files[s]));
        cli_json_int(&j, "tensors", kiln_safetensors_count(files[s]));
        json_metadata(&j, kiln_safetensors_metadata(files[s]));
        cli_json_object_end(&j);
      }
      cli_json_array_end(&j);
    } else {
      json_metadata(&j, kiln_safetensors_metadata(files[0]));
    }
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
    const char *h[] = {"name", "dtype", "shape", "elements", "bytes", "shard"};
    cli_table *t = cli_table_new(index ? 6 : 5, h);
    cli_table_align_right(t, 3);
    cli_table_align_right(t, 4);
    for (int s = 0; s < nf; s++)
      for (int i = 0; i < kiln_safetensors_count(files[s]); i++) {
        entry e = entry_at(files[s], i);
        char ne[32], nb[32];
        kiln_dims_str(e.ndim, e.shape, sh, sizeof sh);
        snprintf(ne, sizeof ne, "%lld", (long long)e.numel);
        snprintf(nb, sizeof nb, "%lld", (long long)e.bytes);
        const char *row[] = {e.name, e.dtype, sh, ne, nb, base_name(kiln_safetensors_path(files[s]))};
        cli_table_row(t, row);
      }
    cli_table_print(stdout, t, pretty);
    cli_table_free(t);
    int nm = 0;
    for (int s = 0; s < nf; s++) nm += kiln_dict_meta_size(kiln_safetensors_metadata(files[s]));
    if (nm > 0) {
      cli_heading(stdout, pretty, "Metadata");
      const char *mh[] = {"key", "value", "shard"};
      t = cli_table_new(index ? 3 : 2, mh);
      for (int s = 0; s < nf; s++) {
        const kiln_dict *meta = kiln_safetensors_metadata(files[s]);
        for (int i = 0; i < kiln_dict_meta_size(meta); i++) {
          const char *row[] = {kiln_dict_meta_key(meta, i), kiln_dict_meta_value(meta, i),
                               base_name(kiln_safetensors_path(files[s]))};
          cli_table_row(t, row);
        }
      }
      cli_table_print(stdout, t, pretty);
      cli_table_free(t);
    }
    kiln_format_bytes(bytes, by, sizeof by);
    printf("\n%d tensors, %lld parameters, %lld bytes (%s)", n, (long long)params, (long long)bytes, by);
    if (index) printf(" in %d shards", nf);
    putchar('\n');
  }
  for (int s = 0; s < nf; s++) kiln_safetensors_close(files[s]);
  if (index) free(files);
  return 0;
}
