/*
** kiln info FILE: the tensors of a safetensors file (name, dtype, shape, bytes), its
** metadata and totals. The file is read and validated in full by kiln_safetensors_load,
** so a corrupt file is reported with the loader's message (naming the byte offset).
*/
#include <stdlib.h>
#include <string.h>

#include <kiln.h>
#include <kiln_io.h>
#include <kiln_nn.h> /* kiln_format_bytes */

#include "cli.h"

static void info_usage(FILE *f) {
  fprintf(f, "usage: kiln info FILE [--json]\n"
             "  Lists the tensors (name, dtype, shape, bytes) and metadata of a safetensors\n"
             "  file, with totals. --json prints one JSON object on stdout.\n");
}

/* "[2, 3]"; "[]" for a 0-dim tensor. */
static void shape_text(const kiln_tensor *t, char *buf, size_t n) { kiln_shape_str(t, buf, n); }

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
  kiln_dict *d = kiln_safetensors_load(path, kiln_device_cpu());
  if (!d) {
    fputs("kiln info: cannot read '", stderr);
    cli_write_safe(stderr, path);
    fputs("' as safetensors: ", stderr);
    cli_write_safe(stderr, kiln_last_error_message()); /* may quote a name from the file */
    fprintf(stderr, " (%s)\n", kiln_error_name(kiln_last_error()));
    return 1;
  }
  int n = kiln_dict_size(d);
  int64_t params = 0, bytes = 0;
  for (int i = 0; i < n; i++) {
    kiln_tensor *t = kiln_dict_value(d, i);
    params += kiln_numel(t);
    bytes += (int64_t)kiln_nbytes(t);
  }
  char sh[256], by[64];
  if (json) {
    cli_json j;
    cli_json_init(&j, stdout);
    cli_json_object_begin(&j, NULL);
    cli_json_string(&j, "file", path);
    cli_json_array_begin(&j, "tensors");
    for (int i = 0; i < n; i++) {
      kiln_tensor *t = kiln_dict_value(d, i);
      cli_json_object_begin(&j, NULL);
      cli_json_string(&j, "name", kiln_dict_key(d, i));
      cli_json_string(&j, "dtype", kiln_dtype_name(kiln_dtype_of(t)));
      cli_json_array_begin(&j, "shape");
      for (int k = 0; k < kiln_ndim(t); k++) cli_json_int(&j, NULL, kiln_shape(t)[k]);
      cli_json_array_end(&j);
      cli_json_int(&j, "numel", kiln_numel(t));
      cli_json_int(&j, "bytes", (int64_t)kiln_nbytes(t));
      cli_json_object_end(&j);
    }
    cli_json_array_end(&j);
    cli_json_object_begin(&j, "metadata");
    for (int i = 0; i < kiln_dict_meta_size(d); i++)
      cli_json_string(&j, kiln_dict_meta_key(d, i), kiln_dict_meta_value(d, i));
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
      kiln_tensor *x = kiln_dict_value(d, i);
      char ne[32], nb[32];
      shape_text(x, sh, sizeof sh);
      snprintf(ne, sizeof ne, "%lld", (long long)kiln_numel(x));
      snprintf(nb, sizeof nb, "%lld", (long long)kiln_nbytes(x));
      const char *row[] = {kiln_dict_key(d, i), kiln_dtype_name(kiln_dtype_of(x)), sh, ne, nb};
      cli_table_row(t, row);
    }
    cli_table_print(stdout, t, pretty);
    cli_table_free(t);
    int nm = kiln_dict_meta_size(d);
    if (nm > 0) {
      cli_heading(stdout, pretty, "Metadata");
      const char *mh[] = {"key", "value"};
      t = cli_table_new(2, mh);
      for (int i = 0; i < nm; i++) {
        const char *row[] = {kiln_dict_meta_key(d, i), kiln_dict_meta_value(d, i)};
        cli_table_row(t, row);
      }
      cli_table_print(stdout, t, pretty);
      cli_table_free(t);
    }
    kiln_format_bytes(bytes, by, sizeof by);
    printf("\n%d tensors, %lld parameters, %lld bytes (%s)\n", n, (long long)params,
           (long long)bytes, by);
  }
  kiln_dict_free(d);
  return 0;
}
