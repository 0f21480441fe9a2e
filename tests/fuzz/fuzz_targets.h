/*
** kiln's fuzz targets, one per file reader. Each takes the bytes of one file, writes them
** to a scratch file, runs the reader on it and checks the reader's promises:
**   - it returns a value or an error (a crash is found by the sanitizers);
**   - no tensor outlives the call (kiln_live_tensors() is back where it was);
**   - checkpoint: a failed load changes nothing (the model's parameters, the optimizer's
**     step count and learning rate are as before);
**   - tokenizer: a loaded tokenizer encodes any bytes into ids of its vocabulary that
**     decode back to the same bytes, and refuses ids outside it;
**   - gpt_config: an accepted config.json gives a config kiln_gpt_new takes;
**   - hf_index: a sharded checkpoint's index loads the model or is refused with an error.
** The same code runs under libFuzzer (fuzz_main.c, one executable per target) and in the
** ordinary test suite (tests/test_fuzz_corpus.c replays tests/fuzz/regressions/).
*/
#ifndef KILN_FUZZ_TARGETS_H
#define KILN_FUZZ_TARGETS_H

#include <stddef.h>
#include <stdint.h>

#include <kiln_nn.h>

/* hf_index's model: this GPT's kiln_gpt_hf_state_dict, entry i in HF_SHARD_A when i is in
** the first half, else in HF_SHARD_B (the target writes the shards once a process; the seed
** program writes the index that lists them). */
#define KILN_FUZZ_HF_SHARD_A "a.safetensors"
#define KILN_FUZZ_HF_SHARD_B "b.safetensors"
static inline kiln_gpt_config kiln_fuzz_hf_config(void) {
  kiln_gpt_config c = kiln_gpt2_config();
  c.n_layer = 1, c.n_head = 1, c.n_embd = 4, c.vocab_size = 8, c.block_size = 4, c.dropout = 0;
  return c;
}

/* The targets, by name: safetensors npy idx idx_gz csv checkpoint tokenizer (vocab.json,
** a NUL byte, merges.txt) tokenizer_json gpt_config (a Hugging Face config.json) tfevents (TensorBoard's
** event files; an even first byte: records the target frames with good CRCs) hf_index (a
** sharded checkpoint's model.safetensors.index.json, over the shards below). */
extern const char *const kiln_fuzz_target_names[];

/* Runs target `name` on data. 0: the reader kept its promises (whether or not the file
** was valid); -1: it broke one (the reason is printed on stderr); -2: no such target. */
int kiln_fuzz_run(const char *name, const uint8_t *data, size_t size);

#endif
