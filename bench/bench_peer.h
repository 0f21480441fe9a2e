/*
** The PyTorch peer (torch_peer.py) of the benchmarks that run it beside kiln (bench-gpt2,
** bench-resnet): where the script is, how it is run (at its best thread count on the CPU), and the
** numbers of the JSON line it ends with.
*/
#ifndef KILN_BENCH_PEER_H
#define KILN_BENCH_PEER_H

#include <kiln.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* The number after "key": in a JSON line; NAN when absent or not a number (null). */
static inline double json_num(const char *line, const char *key) {
  char pat[64];
  snprintf(pat, sizeof pat, "\"%s\":", key);
  const char *p = strstr(line, pat);
  if (!p) return NAN;
  p += strlen(pat);
  while (*p == ' ') p++;
  if (!strncmp(p, "null", 4)) return NAN;
  char *end;
  double v = strtod(p, &end);
  return end == p ? NAN : v;
}

/* The training peers (gpt2, resnet) time the steps after their first PEER_WARMUP_STEPS and
** fail (a Python IndexError) when none is left. peer_steps_ok says so on stderr for a run of
** `steps`, so that the benchmark prints kiln alone instead of the peer's traceback. */
#define PEER_WARMUP_STEPS 3
static inline bool peer_steps_ok(const char *prog, long long steps) {
  if (steps > PEER_WARMUP_STEPS) return true;
  fprintf(stderr,
          "%s: --steps %lld: the peer times the steps after its first %d, so it needs --steps %d or more; "
          "kiln alone here\n",
          prog, steps, PEER_WARMUP_STEPS, PEER_WARMUP_STEPS + 1);
  return false;
}

/* The peer script: flag (--peer PATH) when given, else $KILN_TORCH_PEER, else the first
** that exists of .peer/torch_peer.py (from the working directory), ../shared/bench/
** torch_peer.py beside the source tree (this file is SRC/bench/bench_peer.h), the same
** from the working directory, and /work/shared/bench/torch_peer.py. NULL when none does. */
static inline const char *find_peer(const char *flag) {
  if (flag) return flag;
  const char *env = getenv("KILN_TORCH_PEER");
  if (env && *env) return env;
  static char beside[4096];
  snprintf(beside, sizeof beside, "%s", __FILE__);
  char *slash = strrchr(beside, '/');
  if (slash) *slash = 0; /* SRC/bench */
  slash = strrchr(beside, '/');
  if (slash) snprintf(slash, sizeof beside - (size_t)(slash - beside), "/../shared/bench/torch_peer.py");
  const char *const tries[] = {".peer/torch_peer.py", slash ? beside : NULL, "../shared/bench/torch_peer.py",
                               "/work/shared/bench/torch_peer.py"};
  for (size_t i = 0; i < sizeof tries / sizeof tries[0]; i++)
    if (tries[i] && access(tries[i], R_OK) == 0) return tries[i];
  return NULL;
}

/* The peer at its best BLAS: where OpenBLAS picked generic kernels for this CPU
** (kiln_blas_coretype_fix(), cpu_blas.c) and OPENBLAS_CORETYPE is unset, "OPENBLAS_CORETYPE=X "
** for the peer's command line (PyTorch loads the same OpenBLAS, 5-8x slower in f32 without
** it); else "". */
static inline const char *peer_blas_env(void) {
  static char out[64];
  const char *fix = kiln_blas_coretype_fix(), *set = getenv("OPENBLAS_CORETYPE");
  out[0] = 0;
  if (fix && !(set && *set)) snprintf(out, sizeof out, "OPENBLAS_CORETYPE=%s ", fix);
  return out;
}

/* Runs the peer: tail (python, script and arguments) behind peer_blas_env() and
** OMP_NUM_THREADS=threads (0: unset). Its last stdout line that starts with "{" (and holds
** key, when key is not NULL) goes into out without its newline; its other stdout lines go
** to stderr behind "  peer: ". false, with a note naming prog on stderr, when it cannot
** start, exits non-zero or prints no such line. */
static inline bool peer_run_json(const char *prog, int threads, const char *tail, const char *key, char *out,
                                 size_t n) {
  char cmd[4096], thr[48] = "";
  if (threads > 0) snprintf(thr, sizeof thr, "OMP_NUM_THREADS=%d ", threads);
  snprintf(cmd, sizeof cmd, "%s%s%s", peer_blas_env(), thr, tail);
  fprintf(stderr, "%s: peer: %s\n", prog, cmd);
  out[0] = 0;
  FILE *f = popen(cmd, "r");
  if (!f) {
    fprintf(stderr, "%s: cannot run the peer\n", prog);
    return false;
  }
  char line[4096];
  while (fgets(line, sizeof line, f))
    if (line[0] == '{' && (!key || strstr(line, key))) snprintf(out, n, "%.*s", (int)strcspn(line, "\n"), line);
    else fprintf(stderr, "  peer: %s", line);
  int rc = pclose(f);
  if (rc != 0 || !out[0]) {
    fprintf(stderr, "%s: the peer failed (exit status %d%s)\n", prog, rc, out[0] ? "" : ", no result line");
    out[0] = 0;
    return false;
  }
  return true;
}

/* The OMP_NUM_THREADS values to run a CPU peer at, the faster one being its figure (the peer
** at its best): 1 and kiln's thread count. PyTorch 1.13 starts one OpenMP thread on this
** project's 2-core VMs (omp_get_max_threads() 1), where its GPT runs about twice as fast with
** OMP_NUM_THREADS=2 and its small MLPs fastest with 1 (its threads fight OpenBLAS's).
** flag > 0 (--peer-threads N): that alone; a GPU peer: its default (0, nothing set). */
static inline int peer_thread_tries(bool cpu, int flag, int out[2]) {
  if (flag > 0 || !cpu) {
    out[0] = flag > 0 ? flag : 0;
    return 1;
  }
  out[0] = 1;
  out[1] = kiln_num_threads();
  return out[1] > 1 ? 2 : 1;
}

/* The peer at its best thread count: tail run by peer_run_json (result lines holding metric)
** at each of peer_thread_tries(cpu, flag), the line with the most metric kept in out and its
** OMP_NUM_THREADS in *threads (0: unset; threads may be NULL). With two counts, each one's
** figure goes to stdout behind indent spaces. false when no run gave a line. */
static inline bool peer_run_best(const char *prog, bool cpu, int flag, const char *tail, const char *metric,
                                 const char *unit, int indent, char *out, size_t n, int *threads) {
  int tries[2], nt = peer_thread_tries(cpu, flag, tries);
  double best = 0;
  out[0] = 0;
  for (int i = 0; i < nt; i++) {
    char line[4096];
    if (!peer_run_json(prog, tries[i], tail, metric, line, sizeof line)) continue;
    double v = json_num(line, metric);
    if (nt > 1) printf("%*storch at OMP_NUM_THREADS=%d: %.1f %s\n", indent, "", tries[i], v, unit);
    if (!out[0] || v > best) {
      best = v;
      snprintf(out, n, "%s", line);
      if (threads) *threads = tries[i];
    }
  }
  return out[0] != 0;
}

#endif
