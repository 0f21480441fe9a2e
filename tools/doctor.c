/*
** kiln doctor: what this kiln was built with, which backends work and why not, the CPU,
** the environment kiln reads, the CPU's f32 and bf16 product rates (a note where bf16 runs
** slower, so that bf16 autocast saves no time there), and a smoke test on every device that
** works (a 256x256 matmul against a reference, host->device bandwidth). Every failure comes
** with a diagnosis and a fix line. `--json` prints exactly one JSON object on stdout instead.
** Exit 0 when the CPU works, 1 otherwise (a missing GPU is a finding, not a failure).
** Public API only: detailed CUDA device properties live behind a backend-internal
** function, which a tool must not call; device count and memory statistics are public.
*/
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <kiln.h>
#include <kiln_nn.h> /* kiln_format_bytes */

#include "cli.h"

extern char **environ; /* POSIX: the process's environment, for the KILN_ names set */

#define SMOKE_N 256
#define BW_BYTES (64 << 20)
#define MAX_CUDA 16
#define MAX_BACKENDS 8
#define MAX_PROBLEMS 16
/* A 256-term f32 dot product of N(0,1) values: the expected rounding error is ~1e-5, a
** blocked or FMA BLAS differs from the naive loop by about that; 1e-3 leaves a wide
** margin and still catches a wrong kernel (errors of order 1). */
#define SMOKE_TOL 1e-3

typedef struct problem {
  const char *severity; /* "error" (kiln cannot work), "warning", "note" */
  char what[640];
  char fix[640];
} problem;

/* One GPU's results (CUDA or Vulkan). */
typedef struct cuda_result {
  int index;
  kiln_device dev;
  bool ran;
  bool ok;
  double max_err;
  double h2d_gbps; /* NAN when not measured */
  bool mem_ok;
  kiln_memory_stats mem;
  bool info_ok;
  kiln_device_info info;
  double pinned_h2d, pinned_d2h; /* GB/s with pinned memory, NAN when not measured */
  bool vk_ok;         /* Vulkan only: vk holds the device's features */
  kiln_vulkan_info vk;
  char msg[320];
} cuda_result;

static const char *const env_names[] = {"KILN_DEVICE",  "KILN_NUM_THREADS", "KILN_FALLBACK",
                                        "KILN_DATA_DIR", "OMP_NUM_THREADS",  "CUDA_VISIBLE_DEVICES"};
#define N_ENV ((int)(sizeof env_names / sizeof env_names[0]))

typedef struct doctor {
  const char *version;
  bool version_match;
  const char *build;
  char blas[64];
  const char *blas_info; /* kiln_blas_info(): the kernels OpenBLAS picked, and kiln's f32 route */
  struct {
    const char *name;
    kiln_device_type type;
    bool built, available;
    const char *why;
    int count;
  } be[MAX_BACKENDS]; /* [0] cpu, [1] cuda (built or not), then any other registered */
  int nbe;
  char default_device[32];
  char cpu_model[256];
  long cores;
  char simd[128];
  const char *arch;
  int threads;
  bool cpu_ok;
  double gflops_f32, gflops_bf16; /* the CPU's products, RATE_N^3, best of RATE_REPS; NAN: not measured */
  double cpu_err;
  double cpu_ms;
  char cpu_msg[320];
  int ncuda;
  cuda_result cuda[MAX_CUDA];
  int vk_slot; /* be[] index of the Vulkan backend, -1 when this build has none */
  int nvk;
  cuda_result vk[MAX_CUDA];
  int nprob;
  problem prob[MAX_PROBLEMS];
} doctor;

static void add_problem(doctor *d, const char *severity, const char *what, const char *fix) {
  if (d->nprob >= MAX_PROBLEMS) return;
  problem *p = &d->prob[d->nprob++];
  p->severity = severity;
  snprintf(p->what, sizeof p->what, "%s", what);
  snprintf(p->fix, sizeof p->fix, "%s", fix);
}

/* ---- the machine -------------------------------------------------------------------- */

/* Whether flags (a /proc/cpuinfo "flags" line) lists flag as a whole word. */
static bool has_flag(const char *flags, const char *flag) {
  size_t n = strlen(flag);
  for (const char *p = strstr(flags, flag); p; p = strstr(p + 1, flag))
    if ((p == flags || p[-1] == ' ' || p[-1] == '\t') && (p[n] == ' ' || p[n] == '\n' || p[n] == 0)) return true;
  return false;
}

/* /proc/cpuinfo's first "flags" line into out ("" where there is none). */
static void read_cpu_flags(char *out, size_t n) {
  out[0] = 0;
  FILE *f = fopen("/proc/cpuinfo", "r");
  if (!f) return;
  while (fgets(out, (int)n, f))
    if (!strncmp(out, "flags", 5)) break;
  if (strncmp(out, "flags", 5) != 0) out[0] = 0;
  fclose(f);
}

static void detect_simd(doctor *d) {
  d->simd[0] = 0;
#if defined(__x86_64__) || defined(__i386__)
  d->arch = "x86";
  __builtin_cpu_init();
  struct {
    const char *name;
    int on;
  } f[] = {{"avx512f", __builtin_cpu_supports("avx512f")},
           {"avx2", __builtin_cpu_supports("avx2")},
           {"fma", __builtin_cpu_supports("fma")},
           {"sse4.2", __builtin_cpu_supports("sse4.2")}};
  for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
    if (f[i].on) {
      size_t len = strlen(d->simd);
      snprintf(d->simd + len, sizeof d->simd - len, "%s%s", len ? " " : "", f[i].name);
    }
  /* the bf16 units, which decide what bf16 autocast buys on the CPU: Linux names them in
  ** /proc/cpuinfo (the compilers' __builtin_cpu_supports knows AMX only from gcc 13) */
  char flags[8192];
  read_cpu_flags(flags, sizeof flags);
  const char *bf16[] = {"avx512_bf16", "amx_bf16"};
  for (size_t i = 0; i < sizeof bf16 / sizeof bf16[0]; i++)
    if (has_flag(flags, bf16[i])) {
      size_t len = strlen(d->simd);
      snprintf(d->simd + len, sizeof d->simd - len, "%s%s", len ? " " : "", bf16[i]);
    }
#elif defined(__aarch64__)
  d->arch = "arm64";
  snprintf(d->simd, sizeof d->simd, "neon"); /* Advanced SIMD is mandatory on AArch64 */
#elif defined(__ARM_NEON)
  d->arch = "arm";
  snprintf(d->simd, sizeof d->simd, "neon");
#else
  d->arch = "other";
#endif
  if (!d->simd[0]) snprintf(d->simd, sizeof d->simd, "none");
}

static void blas_from_build(const char *build, char *out, size_t n) {
  snprintf(out, n, "unknown");
  const char *p = build ? strstr(build, "blas=") : NULL;
  if (!p) return;
  p += 5;
  size_t len = strcspn(p, " ");
  snprintf(out, n, "%.*s", (int)len, p);
  if (!strcmp(out, "off") || !strcmp(out, "none")) snprintf(out, n, "none (portable kernels)");
}

/* ---- the CPU's product rates -------------------------------------------------------- */

/* why bf16 products run slower than f32 here, from the CPU's bf16 units (d->simd) */
static const char *slow_bf16_reason(const char *simd) {
  if (strstr(simd, "amx_bf16"))
    return getenv("ONEDNN_MAX_CPU_ISA") ? "ONEDNN_MAX_CPU_ISA keeps oneDNN off the AMX unit"
                                        : "the AMX unit is not reached";
  if (strstr(simd, "avx512_bf16")) return "AVX512-BF16 dot products, no AMX tile unit";
  return "no bf16 instructions";
}

/* f32 and bf16 products of RATE_N square matrices on the CPU, best of RATE_REPS after one
** warm-up call: what bf16 autocast buys for the products on this CPU. With a tile unit
** (AMX) bf16 runs several times f32's rate; with only AVX512-BF16 dot products (half an
** instruction a cycle on some Xeons) or none, bf16 can run slower than f32, and autocast then
** saves memory, not time. */
#define RATE_N 512
#define RATE_REPS 5
static double product_gflops(kiln_dtype dt) {
  kiln_scope_begin(); /* the operands and the products go at its end */
  kiln_generator *g = kiln_generator_new(99);
  kiln_tensor *a = kiln_randn(KILN_SHAPE(RATE_N, RATE_N), KILN_F32, kiln_device_cpu(), g);
  kiln_tensor *b = kiln_randn(KILN_SHAPE(RATE_N, RATE_N), KILN_F32, kiln_device_cpu(), g);
  kiln_generator_free(g);
  if (dt != KILN_F32) a = kiln_to_dtype(a, dt), b = kiln_to_dtype(b, dt);
  double best = INFINITY;
  for (int r = 0; r <= RATE_REPS && a && b; r++) {
    double t0 = cli_now();
    if (!kiln_matmul(a, b) || kiln_device_synchronize(kiln_device_cpu()) != KILN_OK) {
      best = INFINITY;
      break;
    }
    double t = cli_now() - t0;
    if (r > 0 && t < best) best = t;
  }
  kiln_scope_end();
  return isfinite(best) ? 2.0 * RATE_N * RATE_N * (double)RATE_N / best / 1e9 : NAN;
}

/* ---- the smoke test ----------------------------------------------------------------- */

static void smoke_cpu(doctor *d, float *c_host /* SMOKE_N^2 out */, kiln_tensor **a_out,
                      kiln_tensor **b_out) {
  const int64_t n = SMOKE_N;
  d->cpu_ok = false;
  d->cpu_err = NAN;
  kiln_generator *g = kiln_generator_new(1234);
  kiln_tensor *a = kiln_randn(KILN_SHAPE(n, n), KILN_F32, kiln_device_cpu(), g);
  kiln_tensor *b = kiln_randn(KILN_SHAPE(n, n), KILN_F32, kiln_device_cpu(), g);
  kiln_generator_free(g);
  double t0 = cli_now();
  kiln_tensor *c = kiln_matmul(a, b);
  float *ha = malloc(sizeof(float) * (size_t)(n * n));
  float *hb = malloc(sizeof(float) * (size_t)(n * n));
  if (!c || !ha || !hb || kiln_to_host(c, c_host, sizeof(float) * (size_t)(n * n)) != KILN_OK ||
      kiln_to_host(a, ha, sizeof(float) * (size_t)(n * n)) != KILN_OK ||
      kiln_to_host(b, hb, sizeof(float) * (size_t)(n * n)) != KILN_OK) {
    snprintf(d->cpu_msg, sizeof d->cpu_msg, "%s",
             (ha && hb) ? kiln_last_error_message() : "out of host memory");
    free(ha);
    free(hb);
    *a_out = *b_out = NULL;
    return;
  }
  d->cpu_ms = 1e3 * (cli_now() - t0);
  double err = 0;
  for (int64_t i = 0; i < n; i++)
    for (int64_t j = 0; j < n; j++) {
      double s = 0;
      for (int64_t k = 0; k < n; k++) s += (double)ha[i * n + k] * (double)hb[k * n + j];
      double e = fabs(s - (double)c_host[i * n + j]);
      if (!(e <= err)) err = e; /* NaN propagates as a failure */
    }
  free(ha);
  free(hb);
  d->cpu_err = err;
  d->cpu_ok = err <= SMOKE_TOL;
  if (!d->cpu_ok)
    snprintf(d->cpu_msg, sizeof d->cpu_msg, "max error %.3g over the tolerance %.0e", err,
             SMOKE_TOL);
  *a_out = a;
  *b_out = b;
}

static void smoke_cuda(cuda_result *r, kiln_tensor *a, kiln_tensor *b, const float *c_ref) {
  const int64_t n = SMOKE_N;
  kiln_device dev = r->dev;
  r->ran = true;
  r->ok = false;
  r->max_err = NAN;
  r->h2d_gbps = NAN;
  kiln_scope_begin();
  float *hc = malloc(sizeof(float) * (size_t)(n * n));
  kiln_tensor *c = kiln_matmul(kiln_to_device(a, dev), kiln_to_device(b, dev));
  if (!hc || !c || kiln_to_host(c, hc, sizeof(float) * (size_t)(n * n)) != KILN_OK) {
    snprintf(r->msg, sizeof r->msg, "matmul: %s", hc ? kiln_last_error_message() : "out of host memory");
  } else {
    double err = 0;
    for (int64_t i = 0; i < n * n; i++) {
      double e = fabs((double)hc[i] - (double)c_ref[i]);
      if (!(e <= err)) err = e;
    }
    r->max_err = err;
    r->ok = err <= SMOKE_TOL;
    if (!r->ok)
      snprintf(r->msg, sizeof r->msg, "max error %.3g against the CPU over the tolerance %.0e",
               err, SMOKE_TOL);
  }
  free(hc);
  kiln_scope_end();

  /* Host->device bandwidth: 64 MiB, one warm-up copy (first-touch, allocator), then the
  ** best of 3; each copy waits with kiln_device_synchronize so the time is the transfer. */
  kiln_scope_begin();
  kiln_tensor *big = kiln_zeros(KILN_SHAPE(BW_BYTES / 4), KILN_F32, kiln_device_cpu());
  double best = INFINITY;
  for (int rep = 0; big && rep < 4; rep++) {
    kiln_scope_begin();
    double t0 = cli_now();
    kiln_tensor *dbig = kiln_to_device(big, dev);
    kiln_status st = dbig ? kiln_device_synchronize(dev) : kiln_last_error();
    double dt = cli_now() - t0;
    kiln_scope_end();
    if (st != KILN_OK) {
      if (r->ok) snprintf(r->msg, sizeof r->msg, "host->device copy: %s", kiln_last_error_message());
      r->ok = false;
      best = INFINITY;
      break;
    }
    if (rep > 0 && dt < best) best = dt;
  }
  if (isfinite(best) && best > 0) r->h2d_gbps = (double)BW_BYTES / best / 1e9;
  kiln_scope_end();
  r->mem_ok = kiln_memory_stats_get(dev, &r->mem) == KILN_OK;
  r->info_ok = kiln_device_info_get(dev, &r->info) == KILN_OK;
  r->pinned_h2d = r->pinned_d2h = NAN;
  if (kiln_device_bandwidth(dev, &r->pinned_h2d, &r->pinned_d2h) != KILN_OK) {
    r->pinned_h2d = r->pinned_d2h = NAN;
    kiln_clear_error();
  }
}

/* ---- checks and diagnoses ----------------------------------------------------------- */

/* Whether build (kiln_build_info()) is a Debug or sanitizer build, whose timings are not the CPU's. */
static bool slow_build(const char *build) {
  return build && (strstr(build, "type=Debug") || strstr(build, "sanitize="));
}

static void diagnose(doctor *d) {
  char what[640], fix[640];
  if (!d->version_match) {
    snprintf(what, sizeof what, "the library is version %s but this tool was built against %s",
             d->version, KILN_VERSION);
    add_problem(d, "error", what, "rebuild the kiln tool against the library it runs with (or fix LD_LIBRARY_PATH)");
  }
  if (!d->be[0].available) {
    snprintf(what, sizeof what, "the CPU backend is not available: %s", d->be[0].why ? d->be[0].why : "no reason given");
    add_problem(d, "error", what, "this is a bug in the build; report it with the output of `kiln doctor --json`");
  }
  if (!d->cpu_ok) {
    snprintf(what, sizeof what, "the CPU matmul smoke test failed: %s", d->cpu_msg);
    add_problem(d, "error", what,
                "rebuild with -DKILN_BLAS=OFF to rule out the BLAS library; if that passes, the "
                "BLAS install is broken, else report a bug with `kiln doctor --json`");
  }
  /* false when either is NAN; a Debug or sanitizer build's rates say nothing of the CPU */
  if (d->gflops_bf16 < 0.9 * d->gflops_f32 && !slow_build(d->build)) {
    snprintf(what, sizeof what,
             "bf16 products run slower than f32 on this CPU (%.0f against %.0f GFLOP/s: %s): bf16 autocast "
             "saves memory here, not time", d->gflops_bf16, d->gflops_f32, slow_bf16_reason(d->simd));
    add_problem(d, "note", what, "train in f32 on this CPU where time matters more than memory (leave autocast off)");
  }
  const char *cvd = getenv("CUDA_VISIBLE_DEVICES");
  if (!d->be[1].built) {
    add_problem(d, "note", "this kiln was built without the CUDA backend (CPU only)",
                "reconfigure with KILN_CUDA=ON on a machine with the CUDA toolkit "
                "(cmake -S . -B build -DKILN_CUDA=ON && cmake --build build)");
  } else if (!d->be[1].available) {
    snprintf(what, sizeof what, "the CUDA backend is built but not available: %s",
             d->be[1].why && *d->be[1].why ? d->be[1].why : "no reason given");
    if (cvd && (!*cvd || !strcmp(cvd, "-1") || !strcmp(cvd, "none")))
      snprintf(fix, sizeof fix, "CUDA_VISIBLE_DEVICES='%s' hides every GPU: unset it or list a device (CUDA_VISIBLE_DEVICES=0)", cvd);
    else
      snprintf(fix, sizeof fix, "%s", "check that `nvidia-smi` lists a GPU and that the driver is at least as new as the CUDA runtime kiln was built with; kiln runs on the CPU meanwhile");
    add_problem(d, "warning", what, fix);
  }
  if (d->vk_slot >= 0 && !d->be[d->vk_slot].available) {
    const char *why = d->be[d->vk_slot].why ? d->be[d->vk_slot].why : "no reason given";
    snprintf(what, sizeof what, "the Vulkan backend is built but not available: %s", why);
    if (strstr(why, "loader"))
#if defined(__APPLE__)
      snprintf(fix, sizeof fix, "%s", "install the Vulkan loader and MoltenVK (brew install vulkan-loader molten-vk, or the LunarG Vulkan SDK); kiln runs on the CPU meanwhile");
#else
      snprintf(fix, sizeof fix, "%s", "install the Vulkan loader and a driver: sudo apt install libvulkan1 mesa-vulkan-drivers (AMD, Intel, and lavapipe on the CPU) or NVIDIA's driver; kiln runs on the CPU meanwhile");
#endif
    else if (strstr(why, "driver") || strstr(why, "no device") || strstr(why, "ICD"))
      snprintf(fix, sizeof fix, "%s", "install a Vulkan driver (ICD) for the GPU: mesa-vulkan-drivers for AMD and Intel, the NVIDIA driver's Vulkan part (libnvidia-gl), MoltenVK on macOS; `vulkaninfo --summary` must list the device");
    else if (strstr(why, "KILN_VULKAN_DISABLE"))
      snprintf(fix, sizeof fix, "%s", "unset KILN_VULKAN_DISABLE");
    else
      snprintf(fix, sizeof fix, "%s", "update the GPU driver (kiln needs Vulkan 1.2 with bufferDeviceAddress, shaderInt64 and 8/16-bit storage); `vulkaninfo` shows what the device offers");
    add_problem(d, "warning", what, fix);
  }
  bool vk_gpu = false;
  for (int i = 0; i < d->nvk; i++) vk_gpu = vk_gpu || (d->vk[i].vk_ok && strcmp(d->vk[i].vk.type, "cpu") != 0);
  if (d->nvk > 0 && !vk_gpu && d->ncuda == 0)
    add_problem(d, "note", "the only Vulkan device is a CPU (lavapipe/llvmpipe): slower than kiln's own CPU backend, so kiln_device_best() keeps the CPU",
                "for a GPU, install its Vulkan driver: mesa-vulkan-drivers (AMD radv, Intel anv), NVIDIA's driver with its Vulkan part, MoltenVK on macOS; `vulkaninfo --summary` must list it");
  for (int i = 0; i < d->nvk; i++) {
    const cuda_result *r = &d->vk[i];
    if (r->vk_ok && strcmp(r->vk.type, "cpu") != 0 && !r->vk.subgroup_arith) {
      snprintf(what, sizeof what, "vulkan:%d has no subgroup arithmetic in compute shaders: reductions take the shared-memory path", r->index);
      add_problem(d, "note", what, "update the GPU driver (subgroup arithmetic is in Vulkan 1.1 drivers of every current GPU)");
    }
    if (r->ran && !r->ok) {
      snprintf(what, sizeof what, "vulkan:%d (%s) smoke test failed: %s", r->index,
               r->info_ok ? r->info.name : "?", r->msg);
      add_problem(d, "error", what, "update the Vulkan driver; run with KILN_FALLBACK=error to find the op, and report it with `kiln doctor --json` and `vulkaninfo --summary`");
    }
  }
  const char *coretype = kiln_blas_coretype_fix();
  if (coretype) { /* OpenBLAS did not know this CPU */
    bool routed = strstr(d->blas_info, "oneDNN") != NULL;
    snprintf(what, sizeof what,
             "OpenBLAS picked generic (pre-AVX2) kernels for this CPU: its f32 products run several times "
             "slower than the CPU allows%s",
             routed ? "; kiln's own f32 products go to oneDNN's sgemm instead" : "");
    snprintf(fix, sizeof fix,
             "export OPENBLAS_CORETYPE=%s before starting the program (OpenBLAS reads it when it loads; it "
             "also speeds up numpy and PyTorch in the same shell)", coretype);
    add_problem(d, routed ? "note" : "warning", what, fix);
  }
  for (int i = 0; i < d->ncuda; i++) {
    const cuda_result *r = &d->cuda[i];
    if (r->ran && !r->ok) {
      snprintf(what, sizeof what, "cuda:%d smoke test failed: %s", r->index, r->msg);
      add_problem(d, "error", what, "run with KILN_FALLBACK=error to find the op, and report it with `kiln doctor --json`");
    }
  }
  /* Every variable kiln reads, each checked by the library's own rules (kiln_env_check):
  ** a bad value is an error, since the examples refuse to start with it. */
  static const char *const checked[] = {"KILN_DEVICE", "KILN_NUM_THREADS", "KILN_FALLBACK", "KILN_PROFILE"};
  static const char *const fixes[] = {
      "unset KILN_DEVICE or set it to cpu, cuda or cuda:N (a device that exists)",
      "set KILN_NUM_THREADS to a thread count from 1 to 1024 (at most the number of cores is best), or unset it",
      "set KILN_FALLBACK=warn (the default), error or silent",
      "set KILN_PROFILE=1, device or 0, or unset it"};
  for (int i = 0; i < 4; i++)
    if (kiln_env_check(checked[i]) != KILN_OK) {
      snprintf(what, sizeof what, "%s", kiln_last_error_message());
      add_problem(d, "error", what, fixes[i]);
      kiln_clear_error();
    }
  const char *nt = getenv("KILN_NUM_THREADS");
  if (nt && *nt && kiln_env_check("KILN_NUM_THREADS") == KILN_OK && atol(nt) > d->cores && d->cores > 0) {
    snprintf(what, sizeof what, "KILN_NUM_THREADS=%s is more than the %ld cores: threads will wait on each other", nt,
             d->cores);
    add_problem(d, "warning", what, "set KILN_NUM_THREADS to the number of cores or fewer, or unset it");
  }
  const char *dd = getenv("KILN_DATA_DIR");
  struct stat stt;
  if (dd && *dd && (stat(dd, &stt) != 0 || !S_ISDIR(stt.st_mode))) {
    snprintf(what, sizeof what, "KILN_DATA_DIR='%s' is not a directory", dd);
    add_problem(d, "warning", what, "point KILN_DATA_DIR at the folder holding the data sets, or unset it");
  }
  /* The other KILN_ variables set: a name kiln does not read (a typo: the setting it meant
  ** is not in effect), and a tuning switch's value it does not accept (the library keeps
  ** the default). A switch set as accepted moves kiln off its measured defaults, which a
  ** benchmark or a bug report should say: the Environment table lists it. */
  for (char **e = environ; e && *e; e++) {
    char name[128];
    const char *eq = strchr(*e, '=');
    if (strncmp(*e, "KILN_", 5) || !eq || eq - *e >= (long)sizeof name || !eq[1]) continue;
    snprintf(name, sizeof name, "%.*s", (int)(eq - *e), *e);
    kiln_env_kind kind = kiln_env_about(name, NULL);
    if (kind != KILN_ENV_UNKNOWN && kind != KILN_ENV_TUNING) continue;
    if (kiln_env_check(name) == KILN_OK) continue;
    const char *msg = kiln_last_error_message();
    if (kind == KILN_ENV_TUNING) {
      snprintf(what, sizeof what, "%s; kiln uses the default", msg);
      add_problem(d, "warning", what, "set it to an accepted value, or unset it (`kiln doctor --switches` lists them)");
    } else {
      const char *near = kiln_env_nearest(name);
      snprintf(what, sizeof what, "%s is set, but kiln reads no variable of that name", name);
      char to_do[256];
      if (near) snprintf(to_do, sizeof to_do, "Did you mean %s? (else unset it)", near);
      else snprintf(to_do, sizeof to_do, "unset it (`kiln doctor --switches` lists the tuning switches)");
      add_problem(d, "warning", what, to_do);
    }
    kiln_clear_error();
  }
}

/* `kiln doctor --switches`: every tuning switch, what it changes, its value here. */
static int print_switches(bool json, bool pretty) {
  if (json) {
    cli_json j;
    cli_json_init(&j, stdout);
    cli_json_object_begin(&j, NULL);
    cli_json_array_begin(&j, "switches");
    for (int i = 0; kiln_env_switch(i); i++) {
      const char *name = kiln_env_switch(i), *what = NULL;
      kiln_env_about(name, &what);
      cli_json_object_begin(&j, NULL);
      cli_json_string(&j, "name", name);
      cli_json_string(&j, "what", what);
      cli_json_string(&j, "value", getenv(name));
      cli_json_object_end(&j);
    }
    cli_json_array_end(&j);
    cli_json_object_end(&j);
    return 0;
  }
  cli_heading(stdout, pretty, "Tuning switches (the defaults are kiln's measured choices; for A/B runs and bug reports)");
  const char *h[] = {"variable", "value", "what it changes"};
  cli_table *t = cli_table_new(3, h);
  for (int i = 0; kiln_env_switch(i); i++) {
    const char *name = kiln_env_switch(i), *what = NULL, *v = getenv(name);
    kiln_env_about(name, &what);
    const char *row[] = {name, v && *v ? v : "(unset)", what};
    cli_table_row(t, row);
  }
  cli_table_print(stdout, t, pretty);
  cli_table_free(t);
  return 0;
}

/* ---- output ------------------------------------------------------------------------- */


/* The end of a GPU's JSON object, the same for CUDA and Vulkan: its memory, its error. */
static void json_device_tail(cli_json *j, const cuda_result *r) {
  if (r->mem_ok) {
    cli_json_object_begin(j, "memory");
    cli_json_int(j, "allocated", r->mem.allocated);
    cli_json_int(j, "reserved", r->mem.reserved);
    cli_json_int(j, "peak_allocated", r->mem.peak_allocated);
    cli_json_int(j, "num_device_allocs", r->mem.num_device_allocs);
    cli_json_int(j, "limit", r->mem.limit);
    cli_json_object_end(j);
  }
  if (!r->ok) cli_json_string(j, "error", r->msg);
  cli_json_object_end(j);
}

static void print_json(const doctor *d) {
  cli_json j;
  cli_json_init(&j, stdout);
  cli_json_object_begin(&j, NULL);
  cli_json_string(&j, "version", d->version);
  cli_json_string(&j, "header_version", KILN_VERSION);
  cli_json_string(&j, "build", d->build);
  cli_json_array_begin(&j, "backends");
  for (int i = 0; i < d->nbe; i++) {
    cli_json_object_begin(&j, NULL);
    cli_json_string(&j, "name", d->be[i].name);
    cli_json_bool(&j, "built", d->be[i].built);
    cli_json_bool(&j, "available", d->be[i].available);
    cli_json_int(&j, "devices", d->be[i].count);
    if (!d->be[i].available) cli_json_string(&j, "reason", d->be[i].why ? d->be[i].why : "");
    cli_json_object_end(&j);
  }
  cli_json_array_end(&j);
  cli_json_string(&j, "default_device", d->default_device);
  cli_json_object_begin(&j, "cpu");
  cli_json_string(&j, "model", d->cpu_model);
  cli_json_int(&j, "cores", d->cores);
  cli_json_string(&j, "arch", d->arch);
  cli_json_string(&j, "simd", d->simd);
  cli_json_string(&j, "blas", d->blas);
  cli_json_string(&j, "blas_kernels", d->blas_info);
  cli_json_string(&j, "blas_coretype_fix", kiln_blas_coretype_fix());
  cli_json_double(&j, "gflops_f32", d->gflops_f32);
  cli_json_double(&j, "gflops_bf16", d->gflops_bf16);
  cli_json_object_end(&j);
  cli_json_int(&j, "threads", d->threads);
  cli_json_object_begin(&j, "env");
  for (int i = 0; i < N_ENV; i++) cli_json_string(&j, env_names[i], getenv(env_names[i]));
  cli_json_object_end(&j);
  cli_json_object_begin(&j, "switches"); /* the tuning switches set */
  for (int i = 0; kiln_env_switch(i); i++) {
    const char *v = getenv(kiln_env_switch(i));
    if (v && *v) cli_json_string(&j, kiln_env_switch(i), v);
  }
  cli_json_object_end(&j);
  cli_json_object_begin(&j, "smoke");
  cli_json_double(&j, "cpu_matmul_max_err", d->cpu_err);
  cli_json_double(&j, "cpu_matmul_ms", d->cpu_ms);
  cli_json_bool(&j, "ok", d->cpu_ok);
  cli_json_array_begin(&j, "cuda");
  for (int i = 0; i < d->ncuda; i++) {
    const cuda_result *r = &d->cuda[i];
    cli_json_object_begin(&j, NULL);
    cli_json_int(&j, "index", r->index);
    cli_json_bool(&j, "ok", r->ok);
    cli_json_double(&j, "matmul_max_err_vs_cpu", r->max_err);
    cli_json_double(&j, "h2d_gb_per_s", r->h2d_gbps);
    cli_json_double(&j, "pinned_h2d_gb_per_s", r->pinned_h2d);
    cli_json_double(&j, "pinned_d2h_gb_per_s", r->pinned_d2h);
    if (r->info_ok) {
      char cc[16];
      snprintf(cc, sizeof cc, "%d.%d", r->info.compute_major, r->info.compute_minor);
      cli_json_string(&j, "name", r->info.name);
      cli_json_string(&j, "compute_capability", cc);
      cli_json_int(&j, "multiprocessors", r->info.multiprocessors);
      cli_json_int(&j, "total_memory", r->info.total_memory);
      cli_json_int(&j, "free_memory", r->info.free_memory);
      cli_json_int(&j, "driver_version", r->info.driver_version);
      cli_json_int(&j, "runtime_version", r->info.runtime_version);
      cli_json_int(&j, "cublas_version", r->info.blas_version);
      cli_json_int(&j, "cudnn_version", r->info.dnn_version);
    }
    json_device_tail(&j, r);
  }
  cli_json_array_end(&j);
  cli_json_array_begin(&j, "vulkan");
  for (int i = 0; i < d->nvk; i++) {
    const cuda_result *r = &d->vk[i];
    cli_json_object_begin(&j, NULL);
    cli_json_int(&j, "index", r->index);
    cli_json_bool(&j, "ok", r->ok);
    cli_json_double(&j, "matmul_max_err_vs_cpu", r->max_err);
    cli_json_double(&j, "h2d_gb_per_s", r->h2d_gbps);
    if (r->info_ok) {
      char api[16];
      snprintf(api, sizeof api, "%d.%d", r->info.runtime_version / 1000, (r->info.runtime_version % 1000) / 10);
      cli_json_string(&j, "name", r->info.name);
      cli_json_string(&j, "api_version", api);
      cli_json_int(&j, "driver_version", r->info.driver_version);
      cli_json_int(&j, "total_memory", r->info.total_memory);
    }
    if (r->vk_ok) {
      cli_json_string(&j, "type", r->vk.type);
      cli_json_string(&j, "driver", r->vk.driver);
      cli_json_bool(&j, "unified_memory", r->vk.unified);
      cli_json_int(&j, "subgroup_size", r->vk.subgroup_size);
      cli_json_bool(&j, "subgroup_arithmetic", r->vk.subgroup_arith);
      cli_json_bool(&j, "f64", r->vk.f64);
      cli_json_bool(&j, "f16", r->vk.f16);
      cli_json_bool(&j, "bf16", r->vk.bf16);
      cli_json_bool(&j, "int8", r->vk.int8);
      cli_json_bool(&j, "cooperative_matrix", r->vk.coop_matrix);
      {
        char mp[512];
        if (kiln_vulkan_matmul_path(r->index, KILN_F16, 8192, 8192, 8192, mp, sizeof mp) == KILN_OK)
          cli_json_string(&j, "matmul_f16_path", mp);
        else kiln_clear_error();
        if (kiln_vulkan_matmul_path(r->index, KILN_F32, 8192, 8192, 8192, mp, sizeof mp) == KILN_OK)
          cli_json_string(&j, "matmul_f32_path", mp);
        else kiln_clear_error();
      }
      cli_json_array_begin(&j, "heaps");
      for (int h = 0; h < r->vk.n_heaps; h++) {
        cli_json_object_begin(&j, NULL);
        cli_json_int(&j, "size", r->vk.heap_size[h]);
        cli_json_bool(&j, "device_local", r->vk.heap_device_local[h]);
        cli_json_object_end(&j);
      }
      cli_json_array_end(&j);
    }
    json_device_tail(&j, r);
  }
  cli_json_array_end(&j);
  cli_json_object_end(&j);
  cli_json_array_begin(&j, "diagnosis");
  for (int i = 0; i < d->nprob; i++) {
    cli_json_object_begin(&j, NULL);
    cli_json_string(&j, "severity", d->prob[i].severity);
    cli_json_string(&j, "problem", d->prob[i].what);
    cli_json_string(&j, "fix", d->prob[i].fix);
    cli_json_object_end(&j);
  }
  cli_json_array_end(&j);
  cli_json_bool(&j, "ok", d->cpu_ok && d->be[0].available);
  cli_json_object_end(&j);
}

static void kv(const char *k, const char *v) { printf("  %-14s %s\n", k, v); }

static void print_text(const doctor *d) {
  bool pretty = cli_is_tty(stdout);
  char buf[512], b2[64];
  if (pretty) printf("\033[1mkiln doctor\033[0m\n");
  else printf("kiln doctor\n");
  snprintf(buf, sizeof buf, "%s%s", d->version, d->version_match ? "" : "  (MISMATCH with the tool's header)");
  kv("version", buf);
  kv("build", d->build);
  kv("default device", d->default_device);

  cli_heading(stdout, pretty, "Backends");
  const char *bh[] = {"backend", "built", "available", "devices", "reason"};
  cli_table *t = cli_table_new(5, bh);
  cli_table_align_right(t, 3);
  for (int i = 0; i < d->nbe; i++) {
    snprintf(b2, sizeof b2, "%d", d->be[i].count);
    const char *row[] = {d->be[i].name, d->be[i].built ? "yes" : "no",
                         d->be[i].available ? "yes" : "no", b2,
                         d->be[i].available ? "" : (d->be[i].why ? d->be[i].why : "")};
    cli_table_row(t, row);
  }
  cli_table_print(stdout, t, pretty);
  cli_table_free(t);

  cli_heading(stdout, pretty, "CPU");
  kv("model", d->cpu_model);
  snprintf(buf, sizeof buf, "%ld", d->cores);
  kv("cores", buf);
  kv("SIMD", d->simd);
  kv("BLAS", d->blas);
  if (d->blas_info && *d->blas_info) kv("BLAS kernels", d->blas_info);
  if (isfinite(d->gflops_f32) && isfinite(d->gflops_bf16)) {
    snprintf(buf, sizeof buf, "f32 %.0f GFLOP/s, bf16 %.0f GFLOP/s (%dx%d, %d threads%s)", d->gflops_f32,
             d->gflops_bf16, RATE_N, RATE_N, d->threads, slow_build(d->build) ? "; a Debug or sanitizer build" : "");
    kv("products", buf);
  }
  snprintf(buf, sizeof buf, "%d", d->threads);
  kv("threads", buf);

  cli_heading(stdout, pretty, "Environment");
  const char *eh[] = {"variable", "value"};
  t = cli_table_new(2, eh);
  for (int i = 0; i < N_ENV; i++) {
    const char *v = getenv(env_names[i]);
    const char *row[] = {env_names[i], v ? (*v ? v : "(empty)") : "(unset)"};
    cli_table_row(t, row);
  }
  for (int i = 0; kiln_env_switch(i); i++) { /* the tuning switches set: kiln off its defaults */
    const char *v = getenv(kiln_env_switch(i));
    char name[96];
    snprintf(name, sizeof name, "%s (tuning switch)", kiln_env_switch(i));
    const char *row[] = {name, v};
    if (v && *v) cli_table_row(t, row);
  }
  cli_table_print(stdout, t, pretty);
  cli_table_free(t);

  if (d->ncuda > 0) {
    cli_heading(stdout, pretty, "CUDA devices");
    const char *ch[] = {"device", "name", "compute", "SMs", "memory (free/total)", "driver/runtime", "cuBLAS / cuDNN", "pinned h2d/d2h"};
    cli_table *ct = cli_table_new(8, ch); /* CLI_TABLE_MAX_COLS */
    for (int i = 0; i < d->ncuda; i++) {
      const cuda_result *r = &d->cuda[i];
      if (!r->info_ok) continue;
      char dv[16], cc[16], sm[16], mem[64], drv[16], rt[16], dr[40], bl[48], bw[48];
      snprintf(dv, sizeof dv, "cuda:%d", r->index);
      snprintf(cc, sizeof cc, "sm_%d%d", r->info.compute_major, r->info.compute_minor);
      snprintf(sm, sizeof sm, "%d", r->info.multiprocessors);
      snprintf(mem, sizeof mem, "%.1f / %.1f GiB", (double)r->info.free_memory / 1073741824.0,
               (double)r->info.total_memory / 1073741824.0);
      snprintf(drv, sizeof drv, "%d.%d", r->info.driver_version / 1000, (r->info.driver_version % 1000) / 10);
      snprintf(rt, sizeof rt, "%d.%d", r->info.runtime_version / 1000, (r->info.runtime_version % 1000) / 10);
      /* cuDNN 9 counts 91400 for 9.14.0, cuDNN 8 8907 for 8.9.7 */
      int dn = r->info.dnn_version, dmaj = dn >= 90000 ? dn / 10000 : dn / 1000;
      int drest = dn >= 90000 ? dn % 10000 : dn % 1000;
      char dnn[24];
      if (dn > 0) snprintf(dnn, sizeof dnn, "%d.%d.%d", dmaj, drest / 100, drest % 100);
      else snprintf(dnn, sizeof dnn, "none");
      snprintf(bl, sizeof bl, "%d.%d.%d / %s", r->info.blas_version / 10000, r->info.blas_version / 100 % 100,
               r->info.blas_version % 100, dnn);
      if (isfinite(r->pinned_h2d)) snprintf(bw, sizeof bw, "%.1f / %.1f GB/s", r->pinned_h2d, r->pinned_d2h);
      else snprintf(bw, sizeof bw, "not measured");
      snprintf(dr, sizeof dr, "%s / %s", drv, rt);
      const char *row[] = {dv, r->info.name, cc, sm, mem, dr, bl, bw};
      cli_table_row(ct, row);
    }
    cli_table_print(stdout, ct, pretty);
    cli_table_free(ct);
  }

  if (d->nvk > 0) {
    cli_heading(stdout, pretty, "Vulkan devices");
    const char *vh[] = {"device", "name", "Vulkan", "memory heap", "allocated/reserved"};
    cli_table *vt = cli_table_new(5, vh);
    for (int i = 0; i < d->nvk; i++) {
      const cuda_result *r = &d->vk[i];
      if (!r->info_ok) continue;
      char dv[16], api[16], mem[32], al[32], rs[32], ar[72];
      snprintf(dv, sizeof dv, "vulkan:%d", r->index);
      snprintf(api, sizeof api, "%d.%d", r->info.runtime_version / 1000, (r->info.runtime_version % 1000) / 10);
      kiln_format_bytes(r->info.total_memory, mem, sizeof mem);
      kiln_format_bytes(r->mem_ok ? r->mem.allocated : 0, al, sizeof al);
      kiln_format_bytes(r->mem_ok ? r->mem.reserved : 0, rs, sizeof rs);
      snprintf(ar, sizeof ar, "%s / %s", al, rs);
      const char *row[] = {dv, r->info.name, api, mem, ar};
      cli_table_row(vt, row);
    }
    cli_table_print(stdout, vt, pretty);
    cli_table_free(vt);
    for (int i = 0; i < d->nvk; i++) {
      const cuda_result *r = &d->vk[i];
      if (!r->vk_ok) continue;
      char b1[400], hb[32];
      printf("  vulkan:%d\n", r->index);
      kv("type", r->vk.type);
      kv("driver", r->vk.driver);
      size_t used = 0;
      b1[0] = 0;
      for (int h = 0; h < r->vk.n_heaps && used < sizeof b1 - 64; h++) {
        kiln_format_bytes(r->vk.heap_size[h], hb, sizeof hb);
        used += (size_t)snprintf(b1 + used, sizeof b1 - used, "%s%s%s", h ? ", " : "", hb,
                                 r->vk.heap_device_local[h] ? " (device-local)" : "");
      }
      kv("memory heaps", b1);
      kv("unified", r->vk.unified ? "yes (host copies are memcpy of mapped device memory)" : "no (copies go through a staging buffer)");
      snprintf(b1, sizeof b1, "%d, arithmetic %s", r->vk.subgroup_size, r->vk.subgroup_arith ? "yes" : "no");
      kv("subgroup", b1);
      snprintf(b1, sizeof b1, "f64 %s, f16 %s, bf16 %s, int8 %s, cooperative matrix %s", r->vk.f64 ? "yes" : "no",
               r->vk.f16 ? "yes" : "no", r->vk.bf16 ? "yes" : "no", r->vk.int8 ? "yes" : "no",
               r->vk.coop_matrix ? "yes" : "no");
      kv("features", b1);
      if (kiln_vulkan_coop_shapes(r->index, b1, sizeof b1) == KILN_OK && b1[0]) kv("coop matrix (NV)", b1);
      else kiln_clear_error();
      /* the kernel an 8192^3 product takes, per dtype (bench-ceilings' sizes) */
      const kiln_dtype mdt[3] = {KILN_F16, KILN_BF16, KILN_F32};
      const char *mk[3] = {"matmul f16", "matmul bf16", "matmul f32"};
      for (int q = 0; q < 3; q++) {
        if (kiln_vulkan_matmul_path(r->index, mdt[q], 8192, 8192, 8192, b1, sizeof b1) == KILN_OK) kv(mk[q], b1);
        else kiln_clear_error();
      }
    }
  }

  cli_heading(stdout, pretty, "Smoke test");
  const char *sh[] = {"test", "device", "result", "detail"};
  t = cli_table_new(4, sh);
  if (d->cpu_ok) snprintf(buf, sizeof buf, "max err %.2e vs a naive loop (%.1f ms)", d->cpu_err, d->cpu_ms);
  else snprintf(buf, sizeof buf, "%s", d->cpu_msg);
  const char *row0[] = {"matmul 256x256", "cpu", d->cpu_ok ? "PASS" : "FAIL", buf};
  cli_table_row(t, row0);
  for (int i = 0; i < d->ncuda; i++) {
    const cuda_result *r = &d->cuda[i];
    snprintf(b2, sizeof b2, "cuda:%d", r->index);
    if (isfinite(r->max_err) && r->max_err <= SMOKE_TOL)
      snprintf(buf, sizeof buf, "max err %.2e vs cpu", r->max_err);
    else
      snprintf(buf, sizeof buf, "%s", r->msg);
    const char *row[] = {"matmul 256x256", b2, r->ok ? "PASS" : "FAIL", buf};
    cli_table_row(t, row);
    if (isfinite(r->h2d_gbps)) snprintf(buf, sizeof buf, "%.1f GB/s", r->h2d_gbps);
    else snprintf(buf, sizeof buf, "not measured");
    const char *row2[] = {"host->device 64 MiB", b2, isfinite(r->h2d_gbps) ? "PASS" : "FAIL", buf};
    cli_table_row(t, row2);
  }
  for (int i = 0; i < d->nvk; i++) {
    const cuda_result *r = &d->vk[i];
    snprintf(b2, sizeof b2, "vulkan:%d", r->index);
    if (isfinite(r->max_err) && r->max_err <= SMOKE_TOL)
      snprintf(buf, sizeof buf, "max err %.2e vs cpu", r->max_err);
    else
      snprintf(buf, sizeof buf, "%s", r->msg);
    const char *row[] = {"matmul 256x256", b2, r->ok ? "PASS" : "FAIL", buf};
    cli_table_row(t, row);
  }
  cli_table_print(stdout, t, pretty);
  cli_table_free(t);

  if (d->ncuda > 0) {
    cli_heading(stdout, pretty, "CUDA memory (after the smoke test)");
    const char *mh[] = {"device", "allocated", "reserved", "peak", "device allocs", "limit"};
    t = cli_table_new(6, mh);
    for (int c = 1; c < 6; c++) cli_table_align_right(t, c);
    for (int i = 0; i < d->ncuda; i++) {
      const cuda_result *r = &d->cuda[i];
      if (!r->mem_ok) continue;
      char dn[16], a[32], rs[32], pk[32], na[32], lim[32];
      snprintf(dn, sizeof dn, "cuda:%d", r->index);
      kiln_format_bytes(r->mem.allocated, a, sizeof a);
      kiln_format_bytes(r->mem.reserved, rs, sizeof rs);
      kiln_format_bytes(r->mem.peak_allocated, pk, sizeof pk);
      snprintf(na, sizeof na, "%lld", (long long)r->mem.num_device_allocs);
      if (r->mem.limit > 0) kiln_format_bytes(r->mem.limit, lim, sizeof lim);
      else snprintf(lim, sizeof lim, "none");
      const char *row[] = {dn, a, rs, pk, na, lim};
      cli_table_row(t, row);
    }
    cli_table_print(stdout, t, pretty);
    cli_table_free(t);
  }

  cli_heading(stdout, pretty, "Diagnosis");
  if (d->nprob == 0) printf("  no problems found\n");
  for (int i = 0; i < d->nprob; i++) {
    const problem *p = &d->prob[i];
    const char *mark = !strcmp(p->severity, "error") ? "✗" : !strcmp(p->severity, "warning") ? "!" : "-";
    if (!pretty) mark = !strcmp(p->severity, "error") ? "ERROR" : !strcmp(p->severity, "warning") ? "WARNING" : "NOTE";
    printf("  %s %s\n      fix: %s\n", mark, p->what, p->fix);
  }
  bool ok = d->cpu_ok && d->be[0].available;
  /* the devices whose smoke test passed, named in the verdict beside the CPU */
  char gpus[256] = "";
  size_t used = 0;
  for (int i = 0; i < d->ncuda && used < sizeof gpus; i++)
    if (d->cuda[i].ran && d->cuda[i].ok)
      used += (size_t)snprintf(gpus + used, sizeof gpus - used, "cuda:%d, ", d->cuda[i].index);
  for (int i = 0; i < d->nvk && used < sizeof gpus; i++)
    if (d->vk[i].ran && d->vk[i].ok)
      used += (size_t)snprintf(gpus + used, sizeof gpus - used, "vulkan:%d, ", d->vk[i].index);
  if (!ok) printf("\nkiln does NOT work on this machine: see the errors above.\n");
  else if (!*gpus) printf("\nkiln works on this machine (CPU).\n");
  else printf("\nkiln works on this machine (%sCPU); programs run on %s by default.\n", gpus, d->default_device);
}

static void doctor_usage(FILE *f) {
  fprintf(f, "usage: kiln doctor [--json] [--switches]\n"
             "  Checks the build, the backends and devices, the environment, and runs a smoke\n"
             "  test. --json prints one JSON object on stdout. Exit 0 when the CPU works.\n"
             "  --switches lists kiln's tuning switches (environment variables that pick among\n"
             "  its paths and kernels) with their values here, and checks nothing else.\n");
}

int cli_doctor(int argc, char **argv) {
  bool json = false, switches = false;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--json")) json = true;
    else if (!strcmp(argv[i], "--switches")) switches = true;
    else if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
      doctor_usage(stdout);
      return 0;
    } else {
      fprintf(stderr, "kiln doctor: unknown option '%s'\n", argv[i]);
      doctor_usage(stderr);
      return 2;
    }
  }
  if (switches) return print_switches(json, cli_is_tty(stdout));
  doctor *d = calloc(1, sizeof *d);
  float *c_ref = malloc(sizeof(float) * SMOKE_N * SMOKE_N);
  if (!d || !c_ref) {
    fprintf(stderr, "kiln doctor: out of memory\n");
    free(d);
    free(c_ref);
    return 1;
  }
  d->version = kiln_version();
  d->version_match = !strcmp(d->version, KILN_VERSION);
  d->build = kiln_build_info();
  blas_from_build(d->build, d->blas, sizeof d->blas);
  d->blas_info = kiln_blas_info();
  /* cpu and cuda always (cuda's row says why it is missing), then whatever else the
  ** registry holds, in its order */
  kiln_device_type types[MAX_BACKENDS] = {KILN_DEVICE_CPU, KILN_DEVICE_CUDA};
  d->nbe = 2;
  for (int i = 0; i < kiln_backend_count() && d->nbe < MAX_BACKENDS; i++) {
    kiln_device_type ty = kiln_backend_type(i);
    if (ty != KILN_DEVICE_CPU && ty != KILN_DEVICE_CUDA) types[d->nbe++] = ty;
  }
  for (int i = 0; i < d->nbe; i++) {
    kiln_device_type ty = types[i];
    d->be[i].name = kiln_backend_name(ty);
    d->be[i].type = ty;
    d->be[i].built = kiln_backend_built(ty);
    d->be[i].why = NULL;
    d->be[i].available = kiln_backend_available(ty, &d->be[i].why);
    d->be[i].count = d->be[i].available ? kiln_device_count(ty) : 0;
    if (!d->be[i].available && !d->be[i].why) d->be[i].why = d->be[i].built ? "no reason given" : "not built";
  }
  d->vk_slot = -1;
  for (int i = 0; i < d->nbe; i++)
    if (d->be[i].name && !strcmp(d->be[i].name, "vulkan") && d->be[i].built) d->vk_slot = i;
  kiln_device_str(kiln_device_best(), d->default_device, sizeof d->default_device);
  kiln_device_info ci = {0};
  if (kiln_device_info_get(kiln_device_cpu(), &ci) != KILN_OK) snprintf(ci.name, sizeof ci.name, "unknown CPU");
  snprintf(d->cpu_model, sizeof d->cpu_model, "%s", ci.name);
  d->cores = sysconf(_SC_NPROCESSORS_ONLN);
  detect_simd(d);
  d->threads = kiln_num_threads();

  kiln_scope_begin();
  kiln_tensor *a = NULL, *b = NULL;
  smoke_cpu(d, c_ref, &a, &b);
  d->gflops_f32 = d->gflops_bf16 = NAN;
  if (d->cpu_ok) d->gflops_f32 = product_gflops(KILN_F32), d->gflops_bf16 = product_gflops(KILN_BF16);
  if (d->cpu_ok && d->be[1].available) {
    int n = d->be[1].count;
    if (n > MAX_CUDA) n = MAX_CUDA;
    for (int i = 0; i < n; i++) {
      d->cuda[i].index = i;
      d->cuda[i].dev = kiln_device_cuda(i);
      smoke_cuda(&d->cuda[i], a, b, c_ref);
    }
    d->ncuda = n;
  }
  if (d->cpu_ok && d->vk_slot >= 0 && d->be[d->vk_slot].available) {
    int n = d->be[d->vk_slot].count;
    if (n > MAX_CUDA) n = MAX_CUDA;
    for (int i = 0; i < n; i++) {
      d->vk[i].index = i;
      d->vk[i].dev = (kiln_device){d->be[d->vk_slot].type, i};
      smoke_cuda(&d->vk[i], a, b, c_ref); /* the same checks: matmul vs CPU, copies */
      d->vk[i].vk_ok = kiln_vulkan_info_get(i, &d->vk[i].vk) == KILN_OK;
      if (!d->vk[i].vk_ok) kiln_clear_error();
    }
    d->nvk = n;
  }
  kiln_scope_end();
  diagnose(d);

  if (json) print_json(d);
  else print_text(d);
  fflush(stdout);
  int rc = d->cpu_ok && d->be[0].available ? 0 : 1;
  free(c_ref);
  free(d);
  return rc;
}
