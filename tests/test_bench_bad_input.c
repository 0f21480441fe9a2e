/*
** The benchmarks' command lines (bench/bench_args.h): a bad number, an unknown flag or a
** flag without its value is refused with exit 2, a message that names the flag (or the
** positional argument) and what was given, and the usage line on stderr, before anything
** is timed; -h and --help print the usage on stdout and exit 0. Nothing here runs a
** benchmark but tiny CPU GPT steps (bench-gpt2 with too few steps for its peer, and with
** tuning switches set, which it names), so the test is fast and needs no GPU.
*/
#define _POSIX_C_SOURCE 200809L
#include <kiln.h>

#include "cli_run.h"

/* prog args: exit 2, needle on stderr with the usage line, nothing on stdout. */
static void expect_refused(const char *prog, const char *args, const char *needle) {
  cr_result r = cr_run(NULL, prog, args);
  char usage[128];
  snprintf(usage, sizeof usage, "usage: %s ", prog);
  CR_CHECK(r.status == 2 && strstr(r.err, needle) && strstr(r.err, usage),
           "%s %s: exit %d (want 2), stderr (want '%s' and the usage line):\n%s", prog, args, r.status, needle, r.err);
  CR_CHECK(!r.out[0], "%s %s printed on stdout:\n%s", prog, args, r.out);
  cr_free(&r);
}

/* prog --help (or -h): exit 0, the usage on stdout, nothing on stderr. */
static void expect_help(const char *prog, const char *flag) {
  cr_result r = cr_run(NULL, prog, flag);
  char usage[128];
  snprintf(usage, sizeof usage, "usage: %s ", prog);
  CR_CHECK(r.status == 0 && !strncmp(r.out, usage, strlen(usage)) && !r.err[0],
           "%s %s: exit %d (want 0), stdout:\n%s\nstderr:\n%s", prog, flag, r.status, r.out, r.err);
  cr_free(&r);
}

/* bench-gpt2 --steps 2 with a peer: the peer (which times the steps after its first 3) is not
** run, stderr says why, and kiln's figure is still printed. --python /bin/false: a peer run
** would fail loudly ("the peer failed"). */
static void expect_gpt2_few_steps(void) {
  cr_result r = cr_run(NULL, "bench-gpt2",
                       "--device cpu --layers 1 --dim 32 --heads 2 --vocab 64 --seq 16 --batch 2 --steps 2 "
                       "--peer /nonexistent/torch_peer.py --python /bin/false");
  CR_CHECK(r.status == 0 &&
               strstr(r.err, "--steps 2: the peer times the steps after its first 3, so it needs --steps 4 or more") &&
               !strstr(r.err, "peer failed") && strstr(r.out, "kiln"),
           "bench-gpt2 --steps 2: exit %d (want 0), stdout:\n%s\nstderr:\n%s", r.status, r.out, r.err);
  cr_free(&r);
  /* a figure measured off kiln's defaults says so (one stderr line naming the switches set) */
  for (int i = 0; kiln_env_switch(i); i++) unsetenv(kiln_env_switch(i)); /* whatever the shell set */
  r = cr_run("KILN_LINEAR_GELU=0 KILN_CHECKPOINT_ELIDE=0", "bench-gpt2",
             "--device cpu --layers 1 --dim 32 --heads 2 --vocab 64 --seq 16 --batch 2 --steps 2 --no-peer");
  CR_CHECK(r.status == 0 && strstr(r.err, "bench-gpt2: tuning switches set (kiln off its defaults): "
                                          "KILN_CHECKPOINT_ELIDE=0, KILN_LINEAR_GELU=0"),
           "bench-gpt2 with switches set: exit %d, stderr:\n%s", r.status, r.err);
  cr_free(&r);
  r = cr_run(NULL, "bench-gpt2", "--device cpu --layers 1 --dim 32 --heads 2 --vocab 64 --seq 16 --batch 2 --steps 2 --no-peer");
  CR_CHECK(r.status == 0 && !strstr(r.err, "tuning switches"), "bench-gpt2 without switches: exit %d, stderr:\n%s",
           r.status, r.err);
  cr_free(&r);
}

int main(void) {
  int need = cr_require("bench-conv", false);
  if (need) return need;
  static const char *const progs[] = {"bench-amp",      "bench-attention", "bench-ceilings", "bench-cnn-ops",
                                      "bench-conv",     "bench-gpt2",      "bench-host-op",  "bench-mlp-step",
                                      "bench-resnet",   "bench-sgd-multi", "bench-sweep",    "bench-tokenizer"};
  for (size_t i = 0; i < sizeof progs / sizeof progs[0]; i++) {
    expect_help(progs[i], "--help");
    expect_help(progs[i], "-h");
    expect_refused(progs[i], "--no-such-flag", "unknown option '--no-such-flag'");
  }
  static const struct {
    const char *prog, *args, *needle;
  } cases[] = {
      /* bench-conv: the count as a positional argument or --reps; "--help" was once a count */
      {"bench-conv", "abc", "reps: expected an integer from 1 to 1000000, got 'abc'"},
      {"bench-conv", "--reps", "--reps needs a value"},
      {"bench-conv", "--reps abc", "--reps: expected an integer from 1 to 1000000, got 'abc'"},
      {"bench-conv", "-5", "got '-5'"},
      {"bench-conv", "0", "got '0'"},
      {"bench-conv", "--reps -1", "got '-1'"},
      {"bench-conv", "99999999999999999999", "got '99999999999999999999'"},
      {"bench-conv", "5x", "got '5x'"},
      {"bench-conv", "''", "got ''"},
      {"bench-conv", "' 5'", "got ' 5'"},
      {"bench-conv", "--cuda 5 6", "reps given twice"},
      {"bench-conv", "--cuda --cuda-fmnist", "--cuda-fmnist"},
      {"bench-conv", "--cuda --bogus", "unknown option '--bogus'"},
      /* bench-attention: positional B H T D [dtype [causal [reps]]] */
      {"bench-attention", "16 12 1024", "B H T D come together"},
      {"bench-attention", "16 12 x 64", "T: expected an integer"},
      {"bench-attention", "16 12 1024 64 f8", "dtype: expected one of f32, bf16, f16, got 'f8'"},
      {"bench-attention", "16 12 1024 64 bf16 2", "causal: expected an integer from 0 to 1, got '2'"},
      {"bench-attention", "16 12 1024 64 bf16 1 0", "reps: expected an integer from 1 to 1000000, got '0'"},
      {"bench-attention", "16 12 1024 64 bf16 1 5 9", "too many arguments ('9')"},
      {"bench-attention", "--device nope", "--device 'nope'"},
      {"bench-attention", "--device", "--device needs a value"},
      /* flags with numbers, choices, lists and devices */
      {"bench-ceilings", "--n abc", "--n: expected an integer from 1 to 65536, got 'abc'"},
      {"bench-ceilings", "--only nope", "--only: expected one of matmul-bf16"},
      {"bench-ceilings", "--reps", "--reps needs a value"},
      {"bench-ceilings", "--device nope", "--device 'nope'"},
      {"bench-mlp-step", "--steps 5", "--steps: expected an integer from 10 to 1000000, got '5'"},
      {"bench-mlp-step", "--steps", "--steps needs a value"},
      {"bench-sgd-multi", "--dtype f8", "--dtype: expected one of f32, bf16, f16, f64, got 'f8'"},
      {"bench-sgd-multi", "--steps 1e3", "got '1e3'"},
      {"bench-sweep", "--batches 32,,128", "got '32,,128'"},
      {"bench-sweep", "--batches 32,abc", "got 'abc'"},
      {"bench-sweep", "--batches 1,2,3,4,5,6,7,8,9", "at most 8 values"},
      {"bench-tokenizer", "fixtures 0", "PASSES: expected an integer from 1 to 1000000, got '0'"},
      {"bench-tokenizer", "fixtures 5 extra", "too many arguments ('extra')"},
      {"bench-host-op", "--iters 1x", "--iters: expected an integer"},
      {"bench-cnn-ops", "--reps -1", "--reps: expected an integer from 1 to 1000000, got '-1'"},
      {"bench-amp", "--part c", "--part: expected one of a, b, got 'c'"},
      {"bench-amp", "--steps 3", "--steps: expected an integer from 4 to 1000000, got '3'"},
      {"bench-gpt2", "--gen-batches 1,x", "--gen-batches: expected an integer"},
      {"bench-gpt2", "--peak-tflops nan", "--peak-tflops: expected a number"},
      {"bench-gpt2", "--layers 99999999999999999999", "--layers: expected an integer from 1 to 4096"},
      {"bench-gpt2", "--seq", "--seq needs a value"},
      {"bench-resnet", "--size 8", "--size: expected an integer from 16 to 100000, got '8'"},
      {"bench-resnet", "--arch resnet99", "--arch: expected one of resnet18, resnet34, resnet50"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
    expect_refused(cases[i].prog, cases[i].args, cases[i].needle);
  expect_gpt2_few_steps();
  return cr_finish("test_bench_bad_input");
}
