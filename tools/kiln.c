/*
** kiln — the command-line tool: `kiln doctor`, `kiln info FILE|DIR`, `kiln plot LOGDIR`.
** Exit codes: 0 success, 1 the command ran and failed, 2 a usage error.
*/
#include <stdio.h>
#include <string.h>

#include <kiln.h>

#include "cli.h"

static void usage(FILE *f) {
  fprintf(f,
          "usage: kiln <command> [options]\n"
          "\n"
          "commands:\n"
          "  doctor [--json]        check the build, the backends and the devices; run a smoke test\n"
          "  doctor --switches      list the tuning switches (KILN_ATTENTION, ...) and their values\n"
          "  info FILE|DIR [--json] list the tensors and metadata of a safetensors file\n"
          "  plot LOGDIR [--out F]  draw the TensorBoard scalars of LOGDIR to F (.png, .svg)\n"
          "\n"
          "options:\n"
          "  -h, --help             this help (also: kiln <command> --help)\n"
          "  -V, --version          the version of kiln\n"
          "\n"
          "environment: KILN_DEVICE, KILN_NUM_THREADS, KILN_FALLBACK, KILN_DATA_DIR\n");
}

int main(int argc, char **argv) {
  if (argc < 2) {
    usage(stderr);
    return 2;
  }
  const char *cmd = argv[1];
  if (!strcmp(cmd, "-h") || !strcmp(cmd, "--help") || !strcmp(cmd, "help")) {
    usage(stdout);
    return 0;
  }
  if (!strcmp(cmd, "-V") || !strcmp(cmd, "--version") || !strcmp(cmd, "version")) {
    printf("kiln %s\n", kiln_version());
    return 0;
  }
  if (!strcmp(cmd, "doctor")) return cli_doctor(argc - 1, argv + 1);
  if (!strcmp(cmd, "info")) return cli_info(argc - 1, argv + 1);
  if (!strcmp(cmd, "plot")) return cli_plot(argc - 1, argv + 1);
  fprintf(stderr, "kiln: unknown command '%s'\n\n", cmd);
  usage(stderr);
  return 2;
}
