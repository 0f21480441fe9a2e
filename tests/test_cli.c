/*
** The kiln CLI as a user runs it: doctor (text and --json), info on a file this test
** writes and on corrupt ones, --help / --version, usage errors (exit 2).
*/
#define _POSIX_C_SOURCE 200809L
#include <kiln.h>
#include <kiln_io.h>

#include "cli_run.h"
#include "scratch.h"

#include <sys/stat.h>

#if defined(KILN_HAVE_CJSON) && KILN_HAVE_CJSON
#include <cjson/cJSON.h>
#endif

static void test_doctor_text(void) {
  cr_result r = cr_run(NULL, "kiln", "doctor");
  CR_CHECK(r.status == 0, "kiln doctor exited %d\n%s%s", r.status, r.out, r.err);
  CR_CHECK(strstr(r.out, "Backends") && strstr(r.out, "cpu"), "no backend table:\n%s", r.out);
  CR_CHECK(strstr(r.out, "PASS"), "no passing smoke test:\n%s", r.out);
  CR_CHECK(strstr(r.out, "products") && strstr(r.out, "GFLOP/s"), "no CPU product rates:\n%s", r.out);
  CR_CHECK(strstr(r.out, KILN_VERSION), "version %s not shown", KILN_VERSION);
  CR_CHECK(!strstr(r.out, "\033["), "escape codes in plain (non-terminal) output");
  if (!kiln_backend_built(KILN_DEVICE_CUDA))
    CR_CHECK(strstr(r.out, "KILN_CUDA=ON"), "no fix line for a build without CUDA:\n%s", r.out);
  cr_free(&r);
}

static void test_doctor_json(void) {
  cr_result r = cr_run(NULL, "kiln", "doctor --json");
  CR_CHECK(r.status == 0, "kiln doctor --json exited %d: %s", r.status, r.err);
  const char *keys[] = {"\"version\"", "\"build\"", "\"backends\"", "\"name\"", "\"built\"",
                        "\"available\"", "\"cpu\"", "\"threads\"", "\"env\"", "\"smoke\"",
                        "\"cpu_matmul_max_err\""};
  for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
    CR_CHECK(strstr(r.out, keys[i]), "key %s missing from:\n%s", keys[i], r.out);
  CR_CHECK(r.out[0] == '{', "stdout does not start with an object: %.40s", r.out);
#if defined(KILN_HAVE_CJSON) && KILN_HAVE_CJSON
  const char *end = NULL;
  cJSON *j = cJSON_ParseWithOpts(r.out, &end, 1); /* exactly one value, then only space */
  CR_CHECK(j != NULL, "doctor --json is not one JSON value (at '%.40s')", end ? end : "?");
  if (j) {
    cJSON *ver = cJSON_GetObjectItemCaseSensitive(j, "version");
    CR_CHECK(cJSON_IsString(ver) && !strcmp(ver->valuestring, kiln_version()), "version");
    cJSON *be = cJSON_GetObjectItemCaseSensitive(j, "backends");
    /* cpu and cuda always, then every other backend of this build (vulkan when built) */
    int n_be = 2 + (kiln_backend_built(KILN_DEVICE_VULKAN) ? 1 : 0);
    CR_CHECK(cJSON_IsArray(be) && cJSON_GetArraySize(be) == n_be, "backends is not a %d-array", n_be);
    bool saw_cpu = false, saw_cuda = false;
    cJSON *b;
    cJSON_ArrayForEach(b, be) {
      cJSON *name = cJSON_GetObjectItemCaseSensitive(b, "name");
      cJSON *built = cJSON_GetObjectItemCaseSensitive(b, "built");
      cJSON *av = cJSON_GetObjectItemCaseSensitive(b, "available");
      CR_CHECK(cJSON_IsString(name) && cJSON_IsBool(built) && cJSON_IsBool(av), "backend fields");
      if (!cJSON_IsString(name)) continue;
      if (!strcmp(name->valuestring, "cpu")) {
        saw_cpu = true;
        CR_CHECK(cJSON_IsTrue(built) && cJSON_IsTrue(av), "cpu not built/available");
      }
      if (!strcmp(name->valuestring, "cuda")) {
        saw_cuda = true;
        CR_CHECK(cJSON_IsTrue(built) == kiln_backend_built(KILN_DEVICE_CUDA), "cuda built flag");
        if (!cJSON_IsTrue(av))
          CR_CHECK(cJSON_IsString(cJSON_GetObjectItemCaseSensitive(b, "reason")), "no reason");
      }
    }
    CR_CHECK(saw_cpu && saw_cuda, "cpu and cuda rows");
    cJSON *smoke = cJSON_GetObjectItemCaseSensitive(j, "smoke");
    CR_CHECK(cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(smoke, "ok")), "smoke.ok");
    cJSON *err = cJSON_GetObjectItemCaseSensitive(smoke, "cpu_matmul_max_err");
    CR_CHECK(cJSON_IsNumber(err) && err->valuedouble < 1e-3, "cpu_matmul_max_err");
    /* each Vulkan device: its type, driver, heaps, subgroup and features (kiln_vulkan_info_get) */
    cJSON *vks = cJSON_GetObjectItemCaseSensitive(smoke, "vulkan");
    if (kiln_backend_available(KILN_DEVICE_VULKAN, NULL) && kiln_device_count(KILN_DEVICE_VULKAN) > 0) {
      cJSON *v0 = cJSON_IsArray(vks) ? cJSON_GetArrayItem(vks, 0) : NULL;
      CR_CHECK(v0 && cJSON_IsString(cJSON_GetObjectItemCaseSensitive(v0, "type")) &&
                   cJSON_IsString(cJSON_GetObjectItemCaseSensitive(v0, "driver")) &&
                   cJSON_IsArray(cJSON_GetObjectItemCaseSensitive(v0, "heaps")) &&
                   cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(v0, "heaps")) >= 1 &&
                   cJSON_IsNumber(cJSON_GetObjectItemCaseSensitive(v0, "subgroup_size")) &&
                   cJSON_IsBool(cJSON_GetObjectItemCaseSensitive(v0, "cooperative_matrix")) &&
                   cJSON_IsBool(cJSON_GetObjectItemCaseSensitive(v0, "unified_memory")),
               "vulkan:0's details (type, driver, heaps, subgroup, features) missing");
    }
    /* the CPU's f32 and bf16 product rates (what bf16 autocast buys on this CPU) */
    cJSON *cpu = cJSON_GetObjectItemCaseSensitive(j, "cpu");
    cJSON *gf = cJSON_GetObjectItemCaseSensitive(cpu, "gflops_f32"), *gb = cJSON_GetObjectItemCaseSensitive(cpu, "gflops_bf16");
    CR_CHECK(cJSON_IsNumber(gf) && gf->valuedouble > 0 && cJSON_IsNumber(gb) && gb->valuedouble > 0,
             "cpu.gflops_f32 / gflops_bf16 missing or not positive");
    cJSON *th = cJSON_GetObjectItemCaseSensitive(j, "threads");
    CR_CHECK(cJSON_IsNumber(th) && th->valueint >= 1, "threads");
    cJSON *env = cJSON_GetObjectItemCaseSensitive(j, "env");
    CR_CHECK(cJSON_IsObject(env) && cJSON_GetObjectItemCaseSensitive(env, "KILN_DEVICE"), "env");
    cJSON_Delete(j);
  }
#endif
  cr_free(&r);

  /* A bad environment is diagnosed (with a fix), and the CPU still works: exit 0. */
  r = cr_run("KILN_FALLBACK=sometimes KILN_NUM_THREADS=lots", "kiln", "doctor --json");
  CR_CHECK(r.status == 0, "doctor with a bad environment exited %d", r.status);
  CR_CHECK(strstr(r.out, "KILN_FALLBACK='sometimes'"), "bad KILN_FALLBACK not diagnosed:\n%s", r.out);
  CR_CHECK(strstr(r.out, "KILN_NUM_THREADS='lots'"), "bad KILN_NUM_THREADS not diagnosed");
  CR_CHECK(strstr(r.out, "\"sometimes\""), "env value not reported");
  cr_free(&r);

  /* Issue 17.5: every bad value is flagged, each naming what is accepted. */
  r = cr_run("KILN_NUM_THREADS=100000 KILN_DEVICE=nonsense KILN_FALLBACK=nonsense KILN_PROFILE=yes", "kiln",
             "doctor");
  CR_CHECK(r.status == 0, "doctor exited %d", r.status);
  CR_CHECK(strstr(r.out, "KILN_NUM_THREADS='100000' is not a thread count") && strstr(r.out, "1 to 1024"),
           "KILN_NUM_THREADS=100000 not flagged:\n%s", r.out);
  CR_CHECK(strstr(r.out, "KILN_DEVICE='nonsense' is not a device"), "KILN_DEVICE not flagged");
  CR_CHECK(strstr(r.out, "KILN_FALLBACK='nonsense'"), "KILN_FALLBACK not flagged");
  CR_CHECK(strstr(r.out, "KILN_PROFILE='yes'"), "KILN_PROFILE not flagged");
  cr_free(&r);
  r = cr_run("KILN_NUM_THREADS=4x", "kiln", "doctor");
  CR_CHECK(strstr(r.out, "KILN_NUM_THREADS='4x'"), "KILN_NUM_THREADS=4x not flagged:\n%s", r.out);
  cr_free(&r);

  /* A misspelt name (the setting meant is not in effect), a tuning switch's bad value (the
  ** default is kept), and the switches set, listed as such. */
  r = cr_run("KILN_FALLBAK=error KILN_ATTENTION=flash KILN_CONV_GEMM=0 KILN_TEST_ANYTHING=1", "kiln", "doctor");
  CR_CHECK(r.status == 0, "doctor exited %d", r.status);
  CR_CHECK(strstr(r.out, "KILN_FALLBAK is set, but kiln reads no variable of that name") &&
               strstr(r.out, "Did you mean KILN_FALLBACK?"),
           "KILN_FALLBAK not flagged:\n%s", r.out);
  CR_CHECK(strstr(r.out, "KILN_ATTENTION='flash' is not understood") && strstr(r.out, "own|cudnn-fwd|cudnn-bwd|cudnn"),
           "KILN_ATTENTION=flash not flagged:\n%s", r.out);
  CR_CHECK(strstr(r.out, "KILN_CONV_GEMM (tuning switch)") && !strstr(r.out, "KILN_CONV_GEMM='0'"),
           "KILN_CONV_GEMM=0 not listed, or flagged:\n%s", r.out);
  CR_CHECK(!strstr(r.out, "KILN_TEST_ANYTHING"), "a test's own variable flagged:\n%s", r.out);
  cr_free(&r);
  r = cr_run("KILN_CONV_GEMM=0", "kiln", "doctor --json");
  CR_CHECK(r.status == 0 && strstr(r.out, "\"switches\":{\"KILN_CONV_GEMM\":\"0\"}"), "doctor --json switches:\n%s",
           r.out);
  cr_free(&r);

  /* --switches: every one, with its value here (text and JSON) */
  r = cr_run("KILN_ATTENTION=own", "kiln", "doctor --switches");
  CR_CHECK(r.status == 0 && strstr(r.out, "KILN_CUDA_RLN") && strstr(r.out, "KILN_CONV_WINOGRAD") &&
               strstr(r.out, "own") && !strstr(r.out, "Smoke test"),
           "doctor --switches:\n%s", r.out);
  cr_free(&r);
  r = cr_run(NULL, "kiln", "doctor --switches --json");
  CR_CHECK(r.status == 0 && !strncmp(r.out, "{\"switches\":[{\"name\":\"KILN_", strlen("{\"switches\":[{\"name\":\"KILN_")) && strchr(r.out, '\n') &&
               strchr(r.out, '\n')[1] == 0,
           "doctor --switches --json is not one line:\n%s", r.out);
  cr_free(&r);
}

static void test_usage(void) {
  cr_result r = cr_run(NULL, "kiln", "--version");
  char want[64];
  snprintf(want, sizeof want, "kiln %s", KILN_VERSION);
  CR_CHECK(r.status == 0 && strstr(r.out, want), "--version: %d '%s'", r.status, r.out);
  cr_free(&r);
  r = cr_run(NULL, "kiln", "--help");
  CR_CHECK(r.status == 0 && strstr(r.out, "doctor") && strstr(r.out, "info"), "--help");
  cr_free(&r);
  r = cr_run(NULL, "kiln", "frobnicate");
  CR_CHECK(r.status == 2 && strstr(r.err, "unknown command") && strstr(r.err, "usage"),
           "unknown command: %d '%s'", r.status, r.err);
  cr_free(&r);
  r = cr_run(NULL, "kiln", "");
  CR_CHECK(r.status == 2 && strstr(r.err, "usage"), "no command: %d", r.status);
  cr_free(&r);
  r = cr_run(NULL, "kiln", "doctor --bogus");
  CR_CHECK(r.status == 2, "doctor --bogus: %d", r.status);
  cr_free(&r);
  r = cr_run(NULL, "kiln", "info");
  CR_CHECK(r.status == 2 && strstr(r.err, "missing FILE"), "info without a file: %d", r.status);
  cr_free(&r);
}

static void write_bytes(const char *path, const void *p, size_t n) {
  FILE *f = fopen(path, "wb");
  if (!f) return;
  fwrite(p, 1, n, f);
  fclose(f);
}

static void test_info(void) {
  char path[256], bad[256], cut[256];
  snprintf(path, sizeof path, "%s/model.safetensors", cr_tmpdir());
  snprintf(bad, sizeof bad, "%s/garbage.safetensors", cr_tmpdir());
  snprintf(cut, sizeof cut, "%s/cut.safetensors", cr_tmpdir());
  kiln_scope_begin();
  kiln_dict *d = kiln_dict_new();
  kiln_dict_set(d, "fc.weight", kiln_ones(KILN_SHAPE(2, 3), KILN_F32, kiln_device_cpu()));
  kiln_dict_set(d, "ids", kiln_zeros(KILN_SHAPE(4), KILN_I64, kiln_device_cpu()));
  kiln_dict_set_meta(d, "format", "pt");
  kiln_dict_set_meta(d, "note", "say \"hi\"\n");
  kiln_status st = kiln_safetensors_save(path, d);
  kiln_dict_free(d);
  kiln_scope_end();
  CR_CHECK(st == KILN_OK, "saving the fixture: %s", kiln_last_error_message());

  char args[512];
  snprintf(args, sizeof args, "info '%s'", path);
  cr_result r = cr_run(NULL, "kiln", args);
  CR_CHECK(r.status == 0, "info exited %d: %s", r.status, r.err);
  CR_CHECK(strstr(r.out, "fc.weight") && strstr(r.out, "float32") && strstr(r.out, "[2, 3]"),
           "fc.weight row:\n%s", r.out);
  CR_CHECK(strstr(r.out, "ids") && strstr(r.out, "int64") && strstr(r.out, "[4]"), "ids row");
  CR_CHECK(strstr(r.out, "format") && strstr(r.out, "pt"), "metadata");
  CR_CHECK(strstr(r.out, "2 tensors, 10 parameters, 56 bytes"), "totals:\n%s", r.out);
  cr_free(&r);

  snprintf(args, sizeof args, "info --json '%s'", path);
  r = cr_run(NULL, "kiln", args);
  CR_CHECK(r.status == 0, "info --json exited %d", r.status);
  const char *tot = strstr(r.out, "\"totals\"");
  CR_CHECK(cr_json_num(tot, "parameters") == 10 && cr_json_num(tot, "tensors") == 2,
           "json totals: %s", r.out);
  CR_CHECK(strstr(r.out, "\"note\":\"say \\\"hi\\\"\\n\""), "metadata escaping: %s", r.out);
#if defined(KILN_HAVE_CJSON) && KILN_HAVE_CJSON
  cJSON *j = cJSON_ParseWithOpts(r.out, NULL, 1);
  CR_CHECK(j && cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(j, "tensors")) == 2,
           "info --json parse");
  cJSON_Delete(j);
#endif
  cr_free(&r);

  /* A quantized file's dtypes kiln does not hold are listed by the file's names, with their
  ** bytes (an F8_E4M3 [2, 3] beside an F32 [2]) */
  char quant[300];
  snprintf(quant, sizeof quant, "%s/quant.safetensors", cr_tmpdir());
  const char qh[] = "{\"q\":{\"dtype\":\"F8_E4M3\",\"shape\":[2,3],\"data_offsets\":[0,6]},"
                    "\"s\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[6,14]}}";
  unsigned char qb[8 + sizeof qh - 1 + 14] = {0};
  qb[0] = (unsigned char)(sizeof qh - 1);
  memcpy(qb + 8, qh, sizeof qh - 1);
  write_bytes(quant, qb, sizeof qb);
  snprintf(args, sizeof args, "info '%s'", quant);
  r = cr_run(NULL, "kiln", args);
  CR_CHECK(r.status == 0 && strstr(r.out, "F8_E4M3") && strstr(r.out, "2 tensors, 8 parameters, 14 bytes"),
           "info on an F8 file: %d %s %s", r.status, r.out, r.err);
  cr_free(&r);

  /* A sharded checkpoint: its index (given, or a directory's without model.safetensors)
  ** lists both shards' tensors, each row naming its shard, and totals over both */
  char shard_dir[300], shard[400], index_path[400];
  snprintf(shard_dir, sizeof shard_dir, "%s/sharded", cr_tmpdir());
  mkdir(shard_dir, 0777);
  for (int k = 0; k < 2; k++) {
    kiln_scope_begin();
    kiln_dict *sd = kiln_dict_new();
    kiln_dict_set(sd, k ? "h.1.w" : "h.0.w", kiln_ones(KILN_SHAPE(3, 4), k ? KILN_BF16 : KILN_F32, kiln_device_cpu()));
    snprintf(shard, sizeof shard, "%s/model-0000%d-of-00002.safetensors", shard_dir, k + 1);
    CR_CHECK(kiln_safetensors_save(shard, sd) == KILN_OK, "saving shard %d", k);
    kiln_dict_free(sd);
    kiln_scope_end();
  }
  snprintf(index_path, sizeof index_path, "%s/model.safetensors.index.json", shard_dir);
  const char ix[] = "{\"metadata\": {\"total_size\": 72}, \"weight_map\": {\"h.0.w\": "
                    "\"model-00001-of-00002.safetensors\", \"h.1.w\": \"model-00002-of-00002.safetensors\"}}";
  write_bytes(index_path, ix, sizeof ix - 1);
  const char *shard_args[] = {shard_dir, index_path};
  for (int k = 0; k < 2; k++) {
    snprintf(args, sizeof args, "info '%s'", shard_args[k]);
    r = cr_run(NULL, "kiln", args);
    CR_CHECK(r.status == 0 && strstr(r.out, "model-00002-of-00002.safetensors") && strstr(r.out, "bfloat16") &&
                 strstr(r.out, "2 tensors, 24 parameters, 72 bytes") && strstr(r.out, "in 2 shards"),
             "info on a sharded checkpoint (%s): %d %s %s", shard_args[k], r.status, r.out, r.err);
    cr_free(&r);
  }
  snprintf(args, sizeof args, "info --json '%s'", shard_dir);
  r = cr_run(NULL, "kiln", args);
  tot = strstr(r.out, "\"totals\"");
  CR_CHECK(r.status == 0 && strstr(r.out, "\"shard\":\"model-00001-of-00002.safetensors\"") &&
               strstr(r.out, "\"shards\"") && cr_json_num(tot, "bytes") == 72,
           "info --json on a sharded checkpoint: %d %s", r.status, r.out);
  cr_free(&r);
  write_bytes(index_path, "{\"weight_map\": {\"h.0.w\": \"model-00002-of-00002.safetensors\"}}", 61);
  snprintf(args, sizeof args, "info '%s'", shard_dir);
  r = cr_run(NULL, "kiln", args);
  CR_CHECK(r.status == 1 && strstr(r.err, "sharded checkpoint") && strstr(r.err, "does not hold it") && !r.out[0],
           "info on a wrong index: %d %s", r.status, r.err);
  cr_free(&r);

  /* A directory means its model.safetensors (a Hugging Face directory); one without says so. */
  snprintf(args, sizeof args, "info '%s'", cr_tmpdir());
  r = cr_run(NULL, "kiln", args);
  CR_CHECK(r.status == 0 && strstr(r.out, "/model.safetensors\n") && strstr(r.out, "2 tensors, 10 parameters"),
           "info on a directory: %d %s %s", r.status, r.out, r.err);
  cr_free(&r);
  r = cr_run(NULL, "kiln", "info /");
  CR_CHECK(r.status == 1 && strstr(r.err, "a directory without a model.safetensors"), "info on /: %d %s", r.status,
           r.err);
  cr_free(&r);

  /* Garbage, a truncated copy, a missing file: non-zero exit and a message. */
  write_bytes(bad, "this is not a safetensors file at all", 37);
  char *whole = cr_slurp(path);
  FILE *f = fopen(path, "rb");
  long n = 0;
  if (f) {
    fseek(f, 0, SEEK_END);
    n = ftell(f);
    fclose(f);
  }
  write_bytes(cut, whole, (size_t)(n > 10 ? n - 10 : 0));
  free(whole);
  const char *files[] = {bad, cut, "/nonexistent/dir/x.safetensors"};
  for (int i = 0; i < 3; i++) {
    snprintf(args, sizeof args, "info '%s'", files[i]);
    r = cr_run(NULL, "kiln", args);
    CR_CHECK(r.status == 1, "info on %s exited %d", files[i], r.status);
    CR_CHECK(strstr(r.err, "kiln info") && strlen(r.err) > 20, "no message for %s: '%s'", files[i], r.err);
    CR_CHECK(r.out[0] == 0, "stdout not empty on failure: %s", r.out);
    cr_free(&r);
  }
}

/* Issue 17.3: names with terminal escapes print escaped; --json stays valid JSON. */
static void test_info_unsafe_names(void) {
  char path[256], args[512];
  snprintf(path, sizeof path, "%s/esc.safetensors", cr_tmpdir());
  kiln_scope_begin();
  kiln_dict *d = kiln_dict_new();
  kiln_dict_set(d, "\x1b]0;pwned\x07\x1b[2J", kiln_ones(KILN_SHAPE(1), KILN_F32, kiln_device_cpu()));
  kiln_dict_set(d, "csi\xc2\x9b" "31m", kiln_ones(KILN_SHAPE(1), KILN_F32, kiln_device_cpu()));
  kiln_dict_set_meta(d, "\x1b[31mkey", "value\x1b[0m");
  kiln_status st = kiln_safetensors_save(path, d);
  kiln_dict_free(d);
  kiln_scope_end();
  CR_CHECK(st == KILN_OK, "saving: %s", kiln_last_error_message());
  snprintf(args, sizeof args, "info '%s'", path);
  cr_result r = cr_run(NULL, "kiln", args);
  CR_CHECK(r.status == 0, "info exited %d: %s", r.status, r.err);
  CR_CHECK(!strchr(r.out, '\x1b') && !strchr(r.out, '\x07') && !strstr(r.out, "\xc2\x9b"),
           "raw control bytes printed:\n%s", r.out);
  CR_CHECK(strstr(r.out, "\\x1b]0;pwned\\x07\\x1b[2J") && strstr(r.out, "csi\\xc2\\x9b31m") &&
           strstr(r.out, "value\\x1b[0m"), "escaped names missing:\n%s", r.out);
  cr_free(&r);
  snprintf(args, sizeof args, "info --json '%s'", path);
  r = cr_run(NULL, "kiln", args);
  CR_CHECK(r.status == 0 && !strchr(r.out, '\x1b') && strstr(r.out, "\\u001b]0;pwned\\u0007"),
           "json escaping: %s", r.out);
#if defined(KILN_HAVE_CJSON) && KILN_HAVE_CJSON
  cJSON *j = cJSON_ParseWithOpts(r.out, NULL, 1);
  CR_CHECK(j != NULL, "info --json is not JSON: %s", r.out);
  cJSON_Delete(j);
#endif
  cr_free(&r);
  /* a name of raw non-UTF-8 bytes is refused, with the offset */
  static const char hdr[] = "{\"\xff\xfe\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}";
  unsigned char b[8 + sizeof hdr];
  size_t hl = sizeof hdr - 1;
  for (int i = 0; i < 8; i++) b[i] = (unsigned char)((uint64_t)hl >> (8 * i));
  memcpy(b + 8, hdr, hl);
  b[8 + hl] = 7;
  write_bytes(path, b, 8 + hl + 1);
  snprintf(args, sizeof args, "info --json '%s'", path);
  r = cr_run(NULL, "kiln", args);
  CR_CHECK(r.status == 1 && r.out[0] == 0 && strstr(r.err, "invalid UTF-8") && strstr(r.err, "file offset 10"),
           "non-UTF-8 name: %d %s", r.status, r.err);
  cr_free(&r);
}

/* Issue 17.4: kiln info on a FIFO fails at once instead of waiting for a writer. */
static void test_info_fifo(void) {
  char fifo[256], args[512];
  snprintf(fifo, sizeof fifo, "%s/fifo.safetensors", cr_tmpdir());
  if (mkfifo(fifo, 0600) != 0) return;
  snprintf(args, sizeof args, "info '%s'", fifo);
  cr_result r = cr_run("timeout 20", "kiln", args); /* 124: it blocked */
  CR_CHECK(r.status == 1 && strstr(r.err, "not a regular file (a FIFO)"), "info on a FIFO: %d %s",
           r.status, r.err);
  cr_free(&r);
  remove(fifo);
}

/* kiln plot: a PNG (its signature) and an SVG from event files; a directory without
** events, and a path that is not one, fail with exit 1. Without cairo the command says so
** (exit 1). */
static void test_plot(void) {
  char dir[512], run[600], args[1400], png[700], svg[700];
  if (scratch_begin(dir, sizeof dir, "plot") != 0) return;
  snprintf(run, sizeof run, "%s/logs/run1", dir);
  kiln_summary_writer *w = kiln_summary_writer_open(run);
  CR_CHECK(w != NULL, "writer: %s", kiln_last_error_message());
  for (int i = 0; w && i < 50; i++) {
    kiln_summary_writer_add_scalar(w, "loss", i, 1.0 / (1 + i));
    kiln_summary_writer_add_scalar(w, "lr", i, 1e-3);
  }
  kiln_summary_writer_close(w);
  snprintf(png, sizeof png, "%s/c.png", dir);
  snprintf(svg, sizeof svg, "%s/c.svg", dir);
  snprintf(args, sizeof args, "plot %s/logs --out %s", dir, png);
  cr_result r = cr_run(NULL, "kiln", args);
  if (r.status == 1 && strstr(r.err, "without cairo")) {
    cr_free(&r);
    scratch_end(dir);
    return;
  }
  CR_CHECK(r.status == 0 && strstr(r.out, "2 tag(s)"), "kiln plot exited %d: %s%s", r.status, r.out, r.err);
  cr_free(&r);
  FILE *f = fopen(png, "rb");
  unsigned char sig[8] = {0};
  CR_CHECK(f && fread(sig, 1, 8, f) == 8 && !memcmp(sig, "\x89PNG\r\n\x1a\n", 8), "no PNG at %s", png);
  if (f) fclose(f);
  snprintf(args, sizeof args, "plot %s --out %s --smooth 0.5", run, svg);
  r = cr_run(NULL, "kiln", args);
  CR_CHECK(r.status == 0, "kiln plot svg exited %d: %s", r.status, r.err);
  cr_free(&r);
  f = fopen(svg, "rb");
  char head[64] = {0};
  CR_CHECK(f && fread(head, 1, 63, f) > 0 && strstr(head, "<?xml"), "no SVG at %s", svg);
  if (f) fclose(f);
  snprintf(args, sizeof args, "plot %s --out %s", dir, png); /* no events directly or one level down */
  r = cr_run(NULL, "kiln", args);
  CR_CHECK(r.status == 1 && strstr(r.err, "no scalars"), "empty dir: exit %d: %s", r.status, r.err);
  cr_free(&r);
  r = cr_run(NULL, "kiln", "plot /nonexistent-kiln-logs");
  CR_CHECK(r.status == 1 && strstr(r.err, "not a directory"), "missing dir: exit %d: %s", r.status, r.err);
  cr_free(&r);
  scratch_end(dir);
}

int main(void) {
  int need = cr_require("kiln", false);
  if (need) return need;
  test_usage();
  test_doctor_text();
  test_doctor_json();
  test_info();
  test_info_unsafe_names();
  test_info_fifo();
  test_plot();
  return cr_finish("test_cli");
}
