/*
** bench-gpt2: a GPT-2 training step and GPT-2 generation, kiln and the PyTorch peer
** (torch_peer.py `gpt2` and `gpt2-generate`) in the same run, side by side.
**
** Training: the peer's workload exactly (its GPT class is nanoGPT's layout with the head
** tied, GPT-2's init, AdamW lr 3e-4 weight decay 0.01, random ids and targets, a context of
** --seq): --steps steps, each timed between device syncs, the median of those after the
** first 3. Prints tokens/s, peak memory (kiln_memory_stats: allocated bytes, as the peer's
** torch.cuda.max_memory_allocated), and MFU = tokens/s * (6 N + 12 L D T) / peak FLOP/s
** (the peer's FLOP count: N parameters with the tied head once, plus attention), with the
** peak from --peak-tflops (default 989, the H100/H200 bf16 dense data-sheet figure, when
** the device is one of those; otherwise MFU is printed only when given). --checkpoint runs
** a second kiln step with every block checkpointed (kiln_module_set_checkpoint) and the
** peer's --checkpoint; --checkpoint-mlp one with only each block's MLP checkpointed (kiln alone);
** --checkpoint-products one with every block checkpointed keeping its products
** (KILN_CHECKPOINT_KEEP_PRODUCTS: c_attn's and attention's c_proj's outputs; kiln alone).
** Each checkpointed pass also prints its tokens/s and peak memory against kiln's unchecked
** pass of the same run ("of_unchecked" in its JSON line; 0 for the unchecked pass).
** --graph records the training step after the first (kiln_graph_capture, the AdamW step
** count on the device) and replays it for the others: on CUDA one graph launch a step
** instead of ~400 kernel launches (the peer's torch.compile keeps its launches). On the
** H100 the replayed GPT-2 step ran slower than the eager one (bench/RESULTS.md).
**
** Generation (--generate): greedy kiln_gpt_generate of --new tokens after a random prompt
** of --prompt tokens at each batch in --gen-batches (default 1,16), the model's weights in
** bf16 on CUDA (f32 on the CPU) as the peer's; a warm-up of 8 tokens first, as the peer.
** --gen-graph sets kiln_sample_opts.graph (the per-token step as a CUDA graph: auto, on,
** off); --gen-sample samples (temperature 0.8, top-k 50, top-p 0.95, a seeded generator)
** instead of taking the argmax (the peer stays greedy).
**
** Usage: bench-gpt2 [--device D] [--layers N] [--dim D] [--heads H] [--vocab V] [--seq T]
**                   [--batch B] [--steps N] [--autocast bf16|f16|none] [--checkpoint] [--checkpoint-mlp]
**                   [--checkpoint-products] [--sdpa fused|math]
**                   [--graph] [--no-train] [--generate] [--gen-batches 1,16] [--prompt P] [--new N]
**                   [--gen-graph auto|on|off] [--gen-sample]
**                   [--peer PATH] [--python PY] [--peer-threads N] [--no-peer] [--peer-eager]
**                   [--peak-tflops X] [--json] [--profile] [--memory] [--logits-loss]
** --profile prints kiln's op table (kiln_profiler, device times: each op waits for its device,
** so those steps run slower) for the training steps after the first. --memory prints
** kiln_memory_summary after the training steps (peak, saved-for-backward bytes, the modules
** that saved the most). The loss is kiln_gpt_forward_loss (the head and cross-entropy
** in row chunks, the classes padded to 64: the logits are never whole; the peer, too,
** computes its loss inside the model's forward); --logits-loss takes the model's logits
** then kiln_cross_entropy instead.
** Defaults: GPT-2 124M (12 layers, 768 wide, 12 heads, vocab 50257), seq 1024, batch 16,
** 15 steps, autocast bf16 on every device, as the peer's training pass (it autocasts to bf16
** on the CPU too; --autocast none gives kiln's f32 step, faster than its bf16 on a CPU
** without bf16 dot products, where kiln's products convert). The peer: --peer PATH, else
** $KILN_TORCH_PEER, else the first that exists of .peer/torch_peer.py,
** ../shared/bench/torch_peer.py beside the source tree, then from the working directory,
** and /work/shared/bench/torch_peer.py (bench_peer.h); run by --python (default python3);
** on the CPU it runs at OMP_NUM_THREADS 1 and kiln's thread count and the faster is its
** figure (bench_peer.h); --peer-threads N runs it at N alone. On a GPU the peer's plain training
** pass runs under torch.compile (the goal is against compiled PyTorch; its checkpointed
** pass stays eager, as the figure); --peer-eager runs it eager.
** The CPU line:
**   bench-gpt2 --device cpu --layers 4 --dim 256 --heads 4 --vocab 4096 --seq 256 --batch 8
*/
#define _POSIX_C_SOURCE 200809L
#include <kiln.h>
#include <kiln_nn.h>
#include <kiln_optim.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_args.h"
#include "bench_clock.h"
#include "bench_peer.h"

#define PROG "bench-gpt2"

typedef struct opts {
  kiln_device dev;
  int64_t layers, dim, heads, vocab, seq, batch, steps, prompt, new_tokens;
  kiln_dtype autocast; /* KILN_F32: none */
  bool checkpoint, checkpoint_mlp, checkpoint_products, train, generate, peer, json, profile, memory, fused_loss;
  bool peer_eager; /* --peer-eager: the GPU peer's plain pass without torch.compile */
  bool graph; /* --graph: the training step recorded after the first and replayed */
  int64_t gen_batches[8];
  int n_gen_batches;
  kiln_gen_graph gen_graph; /* --gen-graph auto|on|off */
  bool gen_sample;          /* --gen-sample: temperature 0.8, top-k 50, top-p 0.95, seeded */
  const char *peer_path, *python;
  int peer_threads;
  double peak_tflops; /* 0: unknown */
} opts;

/* ---- the peer ---------------------------------------------------------------------- */

/* torch.compile for the GPU peer's plain pass (PyTorch 1.13, the CPU peer, has none) */
static bool peer_compiled(const opts *o) { return o->dev.type != KILN_DEVICE_CPU && !o->peer_eager; }

/* The peer at its best thread count (peer_run_best: on the CPU 1 and kiln's count, the more
** tokens/s taken, both printed); false when no run gave a line. */
static bool run_peer(const opts *o, const char *args, char *out, size_t n) {
  char tail[2048];
  snprintf(tail, sizeof tail, "%s '%s' %s 2>&1", o->python, o->peer_path, args);
  return peer_run_best(PROG, o->dev.type == KILN_DEVICE_CPU, o->peer_threads, tail, "tokens_per_s", "tokens/s", 23,
                       out, n, NULL);
}

/* ---- training ----------------------------------------------------------------------- */

typedef struct train_result {
  double tokens_per_s, ms_per_step, peak_gib, loss;
  int64_t params;
} train_result;

/* One training step (kiln_graph_fn): forward with the loss, backward, the optimizer's
** step and zero_grad; the loss copied into ts->loss when ts->keep_loss (a recorded step
** writes it there; an eager one only on the step whose loss is read: no extra kernel in
** the timed steps). */
typedef struct train_step {
  const opts *o;
  kiln_module *m;
  kiln_optimizer *opt;
  kiln_tensor *idx, *tgt, *loss;
  bool keep_loss;
} train_step;

static kiln_status train_step_run(void *ctx) {
  const train_step *ts = ctx;
  const opts *o = ts->o;
  kiln_scope_begin();
  if (o->autocast != KILN_F32) kiln_autocast_begin(o->dev.type, o->autocast);
  /* The forward and the loss in a scope of their own, the loss kept: the logits (B*T*V:
  ** 1.5 GiB in bf16 for GPT-2 at B=16, T=1024) are dead once cross_entropy has made its
  ** gradient, and go here, as the peer's do when its forward returns the loss. */
  kiln_scope_begin();
  kiln_tensor *loss;
  if (o->fused_loss) { /* the head and the loss in chunks: the logits never whole */
    loss = kiln_keep(kiln_gpt_forward_loss(ts->m, ts->idx, ts->tgt, -100));
  } else {
    kiln_tensor *logits = kiln_module_forward(ts->m, ts->idx); /* (B, T, V) */
    loss = kiln_keep(kiln_cross_entropy(kiln_reshape(logits, KILN_SHAPE(o->batch * o->seq, o->vocab)), ts->tgt,
                                        KILN_REDUCTION_MEAN, -100, 0.0));
  }
  kiln_scope_end();
  if (o->autocast != KILN_F32) kiln_autocast_end();
  kiln_status st = kiln_backward(loss, NULL);
  if (st == KILN_OK) st = kiln_optimizer_step(ts->opt);
  if (st == KILN_OK) st = kiln_optimizer_zero_grad(ts->opt);
  if (st == KILN_OK && ts->keep_loss) st = kiln_copy_(ts->loss, kiln_reshape(loss, KILN_SHAPE(1)));
  kiln_tensor_free(loss);
  kiln_scope_end();
  return st;
}

/* checkpoint: 0 none, 1 every block (the peer's --checkpoint), 2 each block's MLP only (ln_2's
** output kept, c_fc + GELU + c_proj recomputed: the largest saved tensors for a third of the
** block's forward), 3 every block keeping its products. */
static kiln_status train(const opts *o, int checkpoint, train_result *r) {
  kiln_gpt_config cfg = kiln_gpt2_config();
  cfg.n_layer = o->layers, cfg.n_head = o->heads, cfg.n_embd = o->dim, cfg.vocab_size = o->vocab;
  cfg.block_size = o->seq;
  kiln_manual_seed(0);
  kiln_memory_empty_cache(o->dev);
  kiln_module *m = kiln_gpt_new(&cfg, KILN_F32, o->dev, NULL);
  if (!m) return kiln_last_error();
  kiln_module *h = kiln_module_child(m, "h");
  if (checkpoint == 1 || checkpoint == 3) kiln_module_set_checkpoint(h, true);
  if (checkpoint == 3) kiln_module_set_checkpoint_keep(h, KILN_CHECKPOINT_KEEP_PRODUCTS);
  for (int i = 0; checkpoint == 2 && i < kiln_module_num_children(h); i++)
    kiln_module_set_checkpoint(kiln_module_child(kiln_module_child_at(h, i), "mlp"), true);
  kiln_optim_config oc = kiln_adamw_config(3e-4); /* torch's AdamW defaults: wd 0.01 */
  oc.capturable = o->graph; /* the step count on the device: replays advance it */
  kiln_optimizer *opt = kiln_optimizer_new_module(&oc, m);
  kiln_tensor *idx = kiln_keep(kiln_randint(0, o->vocab, KILN_SHAPE(o->batch, o->seq), KILN_I64, o->dev, NULL));
  kiln_tensor *tgt = kiln_keep(kiln_randint(0, o->vocab, KILN_SHAPE(o->batch * o->seq), KILN_I64, o->dev, NULL));
  kiln_tensor *loss = kiln_keep(kiln_zeros(KILN_SHAPE(1), KILN_F32, o->dev)); /* the step's, copied */
  kiln_status st = opt && idx && tgt && loss ? KILN_OK : kiln_last_error();
  r->params = kiln_module_num_params(m);
  double *times = calloc((size_t)o->steps, sizeof *times);
  kiln_memory_reset_peak(o->dev);
  bool profiling = false;
  train_step ts = {o, m, opt, idx, tgt, loss, o->graph};
  kiln_graph *g = NULL;
  for (int64_t s = 0; s < o->steps && st == KILN_OK; s++) {
    kiln_device_synchronize(o->dev);
    if (o->profile && s == 1 && !profiling) /* after the first step (allocations, warm-up) */
      profiling = kiln_profiler_start(&(kiln_profiler_options){.device_time = true}) == KILN_OK;
    if (o->graph && s == 1 && !(g = kiln_graph_capture(o->dev, train_step_run, &ts))) { /* records; runs nothing */
      st = kiln_last_error();
      break;
    }
    double t0 = now();
    ts.keep_loss = o->graph || s == o->steps - 1;
    st = g ? kiln_graph_replay(g) : train_step_run(&ts);
    if (st == KILN_OK && s == o->steps - 1) r->loss = kiln_item(loss);
    kiln_device_synchronize(o->dev);
    times[s] = now() - t0;
  }
  kiln_graph_free(g);
  kiln_tensor_free(loss);
  if (profiling) kiln_profiler_stop(stdout);
  if (o->memory && st == KILN_OK) kiln_memory_summary(o->dev, stdout); /* the step's peak and saved bytes */
  if (st == KILN_OK) {
    int64_t skip = o->steps > 4 ? 3 : 0;
    qsort(times + skip, (size_t)(o->steps - skip), sizeof *times, cmp);
    double med = times[skip + (o->steps - skip) / 2];
    r->ms_per_step = med * 1e3;
    r->tokens_per_s = (double)(o->batch * o->seq) / med;
    kiln_memory_stats ms;
    r->peak_gib = kiln_memory_stats_get(o->dev, &ms) == KILN_OK ? (double)ms.peak_allocated / (1 << 30) : NAN;
  }
  free(times);
  kiln_tensor_free(idx);
  kiln_tensor_free(tgt);
  kiln_optimizer_free(opt);
  kiln_module_free(m);
  return st;
}

static double flops_per_token(const opts *o, int64_t params) {
  return 6.0 * (double)params + 12.0 * (double)o->layers * (double)o->dim * (double)o->seq;
}

/* base: kiln's unchecked step of the same run (a checkpointed pass's ratio to it), or NULL */
static void print_train(const opts *o, const char *name, const train_result *k, const char *peer_line,
                        bool peer_compiled_run, const train_result *base) {
  double fpt = flops_per_token(o, k->params);
  printf("%-22s kiln  %10.0f tokens/s  %8.2f ms/step  peak %6.2f GiB  %6.1f TFLOP/s", name, k->tokens_per_s,
         k->ms_per_step, k->peak_gib, k->tokens_per_s * fpt / 1e12);
  if (o->peak_tflops > 0) printf("  MFU %.1f%%", 100 * k->tokens_per_s * fpt / (o->peak_tflops * 1e12));
  printf("  loss %.3f\n", k->loss);
  if (peer_line && peer_line[0]) {
    double pt = json_num(peer_line, "tokens_per_s"), pm = json_num(peer_line, "peak_gib");
    printf("%-22s torch %10.0f tokens/s  %8.2f ms/step  peak ", peer_compiled_run ? "  (torch.compile)" : "", pt,
           json_num(peer_line, "ms_per_step"));
    if (isnan(pm)) printf("     - GiB"); /* the peer reports CUDA memory only */
    else printf("%6.2f GiB", pm);
    printf("  %6.1f TFLOP/s", pt * fpt / 1e12);
    if (o->peak_tflops > 0) printf("  MFU %.1f%%", 100 * pt * fpt / (o->peak_tflops * 1e12));
    printf("\n%-22s kiln / torch: %.2fx tokens/s", "", k->tokens_per_s / pt);
    if (!isnan(pm) && pm > 0) printf(", %.2fx peak memory", k->peak_gib / pm);
    printf("\n");
  }
  double of_unchecked = base && base->tokens_per_s > 0 ? k->tokens_per_s / base->tokens_per_s : 0;
  if (of_unchecked > 0)
    printf("%-22s kiln / kiln unchecked: %.3fx tokens/s, %.2fx peak memory\n", "", of_unchecked,
           base->peak_gib > 0 ? k->peak_gib / base->peak_gib : 0.0);
  if (o->json)
    printf("{\"bench\":\"gpt2-train\",\"name\":\"%s\",\"tokens_per_s\":%.0f,\"ms_per_step\":%.3f,\"peak_gib\":%.3f,"
           "\"params\":%lld,\"flops_per_token\":%.0f,\"peer_tokens_per_s\":%.0f,\"peer_compiled\":%s,"
           "\"of_unchecked\":%.4f}\n",
           name, k->tokens_per_s, k->ms_per_step, k->peak_gib, (long long)k->params, fpt,
           peer_line && peer_line[0] ? json_num(peer_line, "tokens_per_s") : 0.0,
           peer_line && peer_line[0] && peer_compiled_run ? "true" : "false", of_unchecked);
  fflush(stdout);
}

/* ---- generation --------------------------------------------------------------------- */

static kiln_status gen_bench(const opts *o, int64_t batch, double *tokens_per_s) {
  kiln_gpt_config cfg = kiln_gpt2_config();
  cfg.n_layer = o->layers, cfg.n_head = o->heads, cfg.n_embd = o->dim, cfg.vocab_size = o->vocab;
  if (cfg.block_size < o->prompt + o->new_tokens) cfg.block_size = o->prompt + o->new_tokens;
  kiln_manual_seed(0);
  kiln_module *m = kiln_gpt_new(&cfg, KILN_F32, o->dev, NULL);
  if (!m) return kiln_last_error();
  kiln_status st = o->dev.type != KILN_DEVICE_CPU ? kiln_module_to_dtype(m, KILN_BF16) : KILN_OK;
  kiln_module_eval(m);
  kiln_sample_opts so = kiln_sample_opts_default();
  so.greedy = !o->gen_sample;
  if (o->gen_sample) so.temperature = 0.8, so.top_k = 50, so.top_p = 0.95;
  so.graph = o->gen_graph;
  kiln_generator *gen = kiln_generator_new(1);
  kiln_scope_begin();
  kiln_tensor *ids = kiln_randint(0, o->vocab, KILN_SHAPE(batch, o->prompt), KILN_I64, o->dev, NULL);
  if (st == KILN_OK && !kiln_gpt_generate(m, ids, 8, &so, gen)) st = kiln_last_error(); /* warm-up */
  kiln_device_synchronize(o->dev);
  double t0 = now();
  kiln_tensor *out = st == KILN_OK ? kiln_gpt_generate(m, ids, o->new_tokens, &so, gen) : NULL;
  kiln_device_synchronize(o->dev);
  double dt = now() - t0;
  if (st == KILN_OK && !out) st = kiln_last_error();
  kiln_scope_end();
  kiln_generator_free(gen);
  kiln_module_free(m);
  *tokens_per_s = (double)(batch * o->new_tokens) / dt;
  return st;
}

/* ---- main --------------------------------------------------------------------------- */

static const char usage_text[] =
    "[--device D] [--layers N] [--dim D] [--heads H] [--vocab V] [--seq T] [--batch B]\n"
    "         [--steps N] [--autocast bf16|f16|none] [--checkpoint] [--checkpoint-mlp] [--checkpoint-products]\n"
    "         [--sdpa fused|math] [--graph]\n"
    "         [--no-train] [--generate] [--gen-batches 1,16] [--prompt P] [--new N] [--gen-graph auto|on|off]\n"
    "         [--gen-sample] [--peer PATH] [--python PY] [--peer-threads N] [--no-peer] [--peer-eager]\n"
    "         [--peak-tflops X] [--json] [--profile] [--memory] [--logits-loss]";

int main(int argc, char **argv) {
  opts o;
  memset(&o, 0, sizeof o);
  o.dev = kiln_device_best();
  o.layers = 12, o.dim = 768, o.heads = 12, o.vocab = 50257, o.seq = 1024, o.batch = 16, o.steps = 15;
  o.prompt = 64, o.new_tokens = 256;
  o.train = true, o.peer = true, o.fused_loss = true;
  o.gen_batches[0] = 1, o.gen_batches[1] = 16, o.n_gen_batches = 2;
  o.python = "python3";
  int ac = 0; /* an index into autocast_names: bf16, the peer's mode on every device */
  static const char *const autocast_names[] = {"bf16", "f16", "none", NULL};
  static const kiln_dtype autocast_dtypes[] = {KILN_BF16, KILN_F16, KILN_F32};
  bench_args cli = bench_args_begin(PROG, usage_text, argc, argv);
  static const char *const sdpa_names[] = {"fused", "math", NULL};
  static const char *const gen_graph_names[] = {"auto", "on", "off", NULL};
  static const kiln_gen_graph graph_modes[] = {KILN_GEN_GRAPH_AUTO, KILN_GEN_GRAPH_ON, KILN_GEN_GRAPH_OFF};
  /* the sizes and counts: at least 1, at most bounds far above a real run (they catch typos;
  ** a model too large for memory is the library's to refuse) */
  const struct {
    const char *flag;
    int64_t *v;
    int64_t hi;
  } sizes[] = {{"--layers", &o.layers, 1 << 12}, {"--dim", &o.dim, 1 << 16},       {"--heads", &o.heads, 1 << 12},
               {"--vocab", &o.vocab, 1 << 24},   {"--seq", &o.seq, 1 << 20},       {"--batch", &o.batch, 1 << 20},
               {"--steps", &o.steps, 1000000},   {"--prompt", &o.prompt, 1 << 20}, {"--new", &o.new_tokens, 1 << 20}};
  for (const char *a; (a = bench_args_next(&cli));) {
    size_t k = 0;
    while (k < sizeof sizes / sizeof sizes[0] && strcmp(a, sizes[k].flag)) k++;
    if (k < sizeof sizes / sizeof sizes[0]) *sizes[k].v = bench_args_int(&cli, 1, sizes[k].hi);
    else if (!strcmp(a, "--checkpoint")) o.checkpoint = true;
    else if (!strcmp(a, "--checkpoint-mlp")) o.checkpoint_mlp = true;
    else if (!strcmp(a, "--checkpoint-products")) o.checkpoint_products = true;
    else if (!strcmp(a, "--no-train")) o.train = false;
    else if (!strcmp(a, "--generate")) o.generate = true;
    else if (!strcmp(a, "--no-peer")) o.peer = false;
    else if (!strcmp(a, "--peer-eager")) o.peer_eager = true;
    else if (!strcmp(a, "--json")) o.json = true;
    else if (!strcmp(a, "--profile")) o.profile = true;
    else if (!strcmp(a, "--memory")) o.memory = true;
    else if (!strcmp(a, "--logits-loss")) o.fused_loss = false;
    else if (!strcmp(a, "--fused-loss")) o.fused_loss = true; /* the default; kept for old scripts */
    else if (!strcmp(a, "--gen-sample")) o.gen_sample = true;
    else if (!strcmp(a, "--graph")) o.graph = true;
    else if (!strcmp(a, "--device")) bench_args_device(&cli, &o.dev);
    else if (!strcmp(a, "--autocast")) ac = bench_args_choice(&cli, autocast_names);
    else if (!strcmp(a, "--sdpa"))
      kiln_sdpa_set_backend(bench_args_choice(&cli, sdpa_names) ? KILN_SDPA_MATH : KILN_SDPA_FUSED);
    else if (!strcmp(a, "--gen-graph")) o.gen_graph = graph_modes[bench_args_choice(&cli, gen_graph_names)];
    else if (!strcmp(a, "--peer")) o.peer_path = bench_args_value(&cli);
    else if (!strcmp(a, "--python")) o.python = bench_args_value(&cli);
    else if (!strcmp(a, "--peer-threads")) o.peer_threads = (int)bench_args_int(&cli, 0, 1024); /* 0: default */
    else if (!strcmp(a, "--peak-tflops")) o.peak_tflops = bench_args_double(&cli, 0, 1e6);     /* 0: unknown */
    else if (!strcmp(a, "--gen-batches")) o.n_gen_batches = bench_args_int_list(&cli, o.gen_batches, 8, 1, 1 << 20);
    else bench_args_unknown(&cli);
  }
  bool cpu = o.dev.type == KILN_DEVICE_CPU;
  const char *autocast = autocast_names[ac];
  o.autocast = autocast_dtypes[ac];
  if (o.dim % o.heads) {
    fprintf(stderr, PROG ": --dim %lld is not a multiple of --heads %lld\n", (long long)o.dim, (long long)o.heads);
    return 2;
  }
  if (o.peer && !(o.peer_path = find_peer(o.peer_path))) {
    fprintf(stderr, PROG ": torch_peer.py not found (pass --peer PATH or set KILN_TORCH_PEER)\n");
    o.peer = false;
  }
  bool peer_train = o.peer && o.train && peer_steps_ok(PROG, (long long)o.steps);
  kiln_device_info info;
  memset(&info, 0, sizeof info);
  kiln_device_info_get(o.dev, &info);
  if (o.peak_tflops <= 0 && (strstr(info.name, "H100") || strstr(info.name, "H200")) && o.autocast != KILN_F32)
    o.peak_tflops = 989.0; /* bf16/f16 dense, the data sheet */
  if (!cpu) kiln_set_matmul_tf32(true); /* as the peer's allow_tf32 */
  char dname[32];
  kiln_device_str(o.dev, dname, sizeof dname);
  printf("device: %s (%s), threads %d; GPT %lld layers, %lld wide, %lld heads, vocab %lld, seq %lld, batch %lld; "
         "autocast %s\n",
         dname, info.name, kiln_num_threads(), (long long)o.layers, (long long)o.dim, (long long)o.heads,
         (long long)o.vocab, (long long)o.seq, (long long)o.batch, autocast);
  if (o.peer)
    printf("peer: %s (%s)%s\n", o.peer_path, o.python,
           o.peer_threads > 0 ? " with OMP_NUM_THREADS set" : cpu ? " at its best of OMP_NUM_THREADS 1 and kiln's threads" : "");
  fflush(stdout);

  char args[1024], line[4096];
  static const char *const pass_names[] = {"train", "train, checkpointed", "train, MLPs ckpt", "train, ckpt+products"};
  train_result unchecked;
  memset(&unchecked, 0, sizeof unchecked);
  for (int pass = 0; o.train && pass < 4; pass++) {
    if ((pass == 1 && !o.checkpoint) || (pass == 2 && !o.checkpoint_mlp) || (pass == 3 && !o.checkpoint_products))
      continue;
    train_result k;
    memset(&k, 0, sizeof k);
    kiln_status st = train(&o, pass, &k);
    if (st != KILN_OK) {
      fprintf(stderr, PROG ": kiln training step: %s\n", kiln_last_error_message());
      return 1;
    }
    line[0] = 0;
    if (peer_train) {
      snprintf(args, sizeof args,
               "gpt2 --device %s --layers %lld --dim %lld --heads %lld --vocab %lld --seq %lld --batch %lld "
               "--steps %lld%s",
               cpu ? "cpu" : "cuda", (long long)o.layers, (long long)o.dim, (long long)o.heads, (long long)o.vocab,
               (long long)o.seq, (long long)o.batch, (long long)o.steps,
               pass == 1 ? " --checkpoint" : peer_compiled(&o) ? " --compile" : "");
      /* the peer has no MLP-only or selective checkpointing: passes 2 and 3 print kiln alone */
      if (pass >= 2 || !run_peer(&o, args, line, sizeof line)) line[0] = 0;
    }
    print_train(&o, pass_names[pass], &k, line, pass == 0 && peer_compiled(&o), pass > 0 ? &unchecked : NULL);
    if (pass == 0) unchecked = k;
  }
  for (int i = 0; o.generate && i < o.n_gen_batches; i++) {
    double tps = 0;
    if (gen_bench(&o, o.gen_batches[i], &tps) != KILN_OK) {
      fprintf(stderr, PROG ": kiln generation: %s\n", kiln_last_error_message());
      return 1;
    }
    static const char *const graph_names[] = {"graph auto", "graph off", "graph on"};
    printf("generate, batch %-3lld kiln  %10.1f tokens/s, %.3f ms/step (prompt %lld, %lld new, %s, %s)\n",
           (long long)o.gen_batches[i], tps, 1e3 * (double)o.gen_batches[i] / tps, (long long)o.prompt,
           (long long)o.new_tokens, o.gen_sample ? "sampled T 0.8 top-k 50 top-p 0.95" : "greedy",
           graph_names[o.gen_graph]);
    if (o.peer) {
      snprintf(args, sizeof args, "gpt2-generate --device %s --batch %lld --prompt %lld --new %lld",
               cpu ? "cpu" : "cuda", (long long)o.gen_batches[i], (long long)o.prompt, (long long)o.new_tokens);
      if (run_peer(&o, args, line, sizeof line)) {
        double pt = json_num(line, "tokens_per_s");
        printf("%-22s torch %10.1f tokens/s\n%-22s kiln / torch: %.2fx\n", "", pt, "", tps / pt);
      }
    }
    if (o.json)
      printf("{\"bench\":\"gpt2-generate\",\"batch\":%lld,\"tokens_per_s\":%.1f}\n", (long long)o.gen_batches[i], tps);
    fflush(stdout);
  }
  kiln_fallback_report(stderr);
  return 0;
}
