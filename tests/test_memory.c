/*
** Memory you can read: the bytes autograd saves for backward (live, peak, back to where
** they were once the graph goes), per module for a given input (kiln_model_memory_summary,
** kiln_module_activation_bytes), the device summary, and the out-of-memory error's
** breakdown and advice (naming the modules that save the most).
*/
#define _POSIX_C_SOURCE 200809L
#include <kiln.h>
#include <kiln_nn.h>
#include <kiln_optim.h>

#include <stdlib.h>
#include <string.h>

#include "check.h"

enum { B = 16, IN = 32, HID = 64, OUT = 8 };

static char *text;
static size_t text_n;
static FILE *mem_open(void) {
  free(text);
  text = NULL;
  return open_memstream(&text, &text_n);
}

int main(void) {
  kiln_device cpu = kiln_device_cpu();
  kiln_manual_seed(3);
  kiln_module *net = kiln_sequential_new();
  kiln_sequential_append(net, kiln_linear_new(IN, HID, true, KILN_F32, cpu, NULL));
  kiln_sequential_append(net, kiln_relu_new());
  kiln_sequential_append(net, kiln_linear_new(HID, OUT, true, KILN_F32, cpu, NULL));
  kiln_module *last = kiln_module_child_at(net, 2);
  kiln_optim_config cfg = kiln_adam_config(1e-3);
  kiln_optimizer *opt = kiln_optimizer_new_module(&cfg, net);
  kiln_tensor *x = kiln_keep(kiln_randn(2, (int64_t[]){B, IN}, KILN_F32, cpu, NULL));

  int64_t live0, peak0;
  kiln_autograd_saved_bytes(&live0, &peak0);
  /* The last Linear saves its input, (B, HID) f32; its weight is a parameter, not counted. */
  CHECK(kiln_module_activation_bytes(net, x, last) == (int64_t)B * HID * 4);
  int64_t whole = kiln_module_activation_bytes(net, x, NULL);
  CHECK(whole >= (int64_t)B * HID * 4 * 2); /* at least the two layers' (B, HID) tensors */
  int64_t live1;
  kiln_autograd_saved_bytes(&live1, NULL);
  CHECK(live1 == live0); /* the graph went with the scope, and its count with it */

  FILE *f = mem_open();
  CHECK(kiln_model_memory_summary(f, net, opt, x) == KILN_OK);
  fclose(f);
  CHECK(text && strstr(text, "parameters") && strstr(text, "optimizer state") && strstr(text, "none yet"));
  CHECK(text && strstr(text, "activations saved for backward") && strstr(text, "2 (Linear)") &&
        strstr(text, "[16, 32]"));
  if (getenv("KILN_TEST_VERBOSE")) fputs(text, stderr);

  /* one step: gradients and Adam's two moments appear */
  kiln_scope_begin();
  kiln_tensor *y = kiln_zeros(2, (int64_t[]){B, OUT}, KILN_F32, cpu);
  kiln_tensor *loss = kiln_mse_loss(kiln_module_forward(net, x), y, KILN_REDUCTION_MEAN);
  int64_t during;
  kiln_autograd_saved_bytes(&during, NULL);
  CHECK(during > live0);
  CHECK(kiln_backward(loss, NULL) == KILN_OK && kiln_optimizer_step(opt) == KILN_OK);
  kiln_scope_end();
  CHECK(kiln_optimizer_state_bytes(opt) == 2 * kiln_module_param_bytes(net));
  f = mem_open();
  CHECK(kiln_model_memory_summary(f, net, opt, NULL) == KILN_OK);
  fclose(f);
  CHECK(text && !strstr(text, "none yet"));

  f = mem_open();
  CHECK(kiln_memory_summary(cpu, f) == KILN_OK);
  fclose(f);
  CHECK(text && strstr(text, "allocated") && strstr(text, "cached") && strstr(text, "saved for backward"));
  CHECK(text && strstr(text, "(Linear)")); /* the modules that saved the most */
  if (getenv("KILN_TEST_VERBOSE")) fputs(text, stderr);
  CHECK(kiln_memory_summary(cpu, NULL) == KILN_ERR_INVALID_ARGUMENT);

  /* OOM: the message carries the breakdown and the advice */
  kiln_memory_stats s;
  CHECK(kiln_memory_stats_get(cpu, &s) == KILN_OK);
  CHECK(kiln_memory_set_limit(cpu, s.reserved + 4096) == KILN_OK);
  kiln_scope_begin();
  kiln_tensor *big = kiln_randn(2, (int64_t[]){4096, IN}, KILN_F32, cpu, NULL);
  kiln_tensor *out = big ? kiln_module_forward(net, big) : NULL;
  CHECK(out == NULL && kiln_last_error() == KILN_ERR_OOM);
  const char *msg = kiln_last_error_message();
  if (getenv("KILN_TEST_VERBOSE")) fprintf(stderr, "%s\n", msg);
  CHECK(strstr(msg, "saved for backward") && strstr(msg, "smaller batch") && strstr(msg, "checkpointing") &&
        strstr(msg, "(Linear)") && strstr(msg, "kiln_memory_empty_cache"));
  kiln_clear_error();
  kiln_scope_end();
  CHECK(kiln_memory_set_limit(cpu, 0) == KILN_OK);

  kiln_tensor_free(x);
  kiln_optimizer_free(opt);
  kiln_module_free(net);
  free(text);
  if (failures) fprintf(stderr, "test_memory: %d failed\n", failures);
  else printf("test_memory: ok\n");
  return failures ? 1 : 0;
}
