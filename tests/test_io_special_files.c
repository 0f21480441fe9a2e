/* Issue 17.4: every reader (the tokenizer's and the GPT config's too) refuses a FIFO, a directory and a device at once, with an error
** naming the kind of file, instead of blocking in open() (a FIFO waits for a writer
** forever). An alarm turns a hang into a failure. */
#define _POSIX_C_SOURCE 200809L
#include <kiln.h>
#include <kiln_checkpoint.h>
#include <kiln_data.h>
#include <kiln_io.h>
#include <kiln_nn.h>
#include <kiln_text.h>

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check.h"

static char g_tmp[256];

static void on_alarm(int sig) {
  (void)sig;
  static const char m[] = "test_io_special_files: a reader blocked on a special file\n";
  if (write(2, m, sizeof m - 1) < 0) _exit(2);
  _exit(1);
}

static void expect_refused(const char *what, const char *path, kiln_status st, const char *kind) {
  int ok = st == KILN_ERR_IO && strstr(kiln_last_error_message(), "not a regular file") &&
           strstr(kiln_last_error_message(), kind);
  if (!ok)
    fprintf(stderr, "%s on %s: got %s \"%s\", want KILN_ERR_IO naming %s\n", what, path,
            kiln_error_name(st), kiln_last_error_message(), kind);
  CHECK(ok);
}

static bool count_event(const kiln_scalar_event *e, void *ctx) {
  (void)e;
  (void)ctx;
  return true;
}

static void all_readers(const char *path, const char *kind) {
  alarm(20);
  kiln_clear_error();
  kiln_dict *d = kiln_safetensors_load(path, kiln_device_cpu());
  expect_refused("kiln_safetensors_load", path, d ? KILN_OK : kiln_last_error(), kind);
  kiln_dict_free(d);
  kiln_safetensors *f = kiln_safetensors_open(path);
  expect_refused("kiln_safetensors_open", path, f ? KILN_OK : kiln_last_error(), kind);
  kiln_safetensors_close(f);
  kiln_tensor *t = kiln_npy_load(path, kiln_device_cpu());
  expect_refused("kiln_npy_load", path, t ? KILN_OK : kiln_last_error(), kind);
  kiln_tensor_free(t);
  t = kiln_idx_load(path);
  expect_refused("kiln_idx_load", path, t ? KILN_OK : kiln_last_error(), kind);
  kiln_tensor_free(t);
  kiln_tensor *x = NULL, *y = NULL;
  expect_refused("kiln_csv_load", path, kiln_csv_load(path, NULL, &x, &y), kind);
  kiln_module *m = kiln_linear_new(2, 2, true, KILN_F32, kiln_device_cpu(), NULL);
  expect_refused("kiln_checkpoint_load", path,
                 kiln_checkpoint_load(path, m, NULL, NULL, NULL, NULL, NULL, NULL), kind);
  kiln_module_free(m);
  /* the text readers: the tokenizer's files and a Hugging Face config.json */
  kiln_tokenizer *tok = kiln_tokenizer_load(path, path);
  expect_refused("kiln_tokenizer_load", path, tok ? KILN_OK : kiln_last_error(), kind);
  kiln_tokenizer_free(tok);
  tok = kiln_tokenizer_load_json(path);
  expect_refused("kiln_tokenizer_load_json", path, tok ? KILN_OK : kiln_last_error(), kind);
  kiln_tokenizer_free(tok);
  kiln_gpt_config c;
  expect_refused("kiln_gpt_hf_config", path, kiln_gpt_hf_config(path, &c), kind);
  expect_refused("kiln_summary_read", path, kiln_summary_read(path, count_event, NULL), kind);
  alarm(0);
}

int main(void) {
  signal(SIGALRM, on_alarm);
  snprintf(g_tmp, sizeof g_tmp, "/tmp/kiln_special_XXXXXX");
  if (!mkdtemp(g_tmp)) return 1;
  char fifo[300];
  snprintf(fifo, sizeof fifo, "%s/fifo", g_tmp);
  if (mkfifo(fifo, 0600) != 0) {
    perror("mkfifo");
    return 77;
  }
  all_readers(fifo, "a FIFO");
  all_readers(g_tmp, "a directory");
  all_readers("/dev/null", "a character device");

  /* A FIFO in place of a dataset file: the loader refuses it instead of hanging. */
  char img[300];
  snprintf(img, sizeof img, "%s/train-images-idx3-ubyte", g_tmp);
  CHECK(mkfifo(img, 0600) == 0);
  alarm(20);
  kiln_tensor *x = NULL, *y = NULL;
  kiln_status st = kiln_fashion_mnist_load(g_tmp, &x, &y, NULL, NULL);
  alarm(0);
  expect_refused("kiln_fashion_mnist_load", img, st, "a FIFO");
  CHECK(!x && !y);
  remove(img);
  remove(fifo);
  rmdir(g_tmp);
  if (failures) fprintf(stderr, "%d check(s) failed\n", failures);
  else printf("test_io_special_files: all passed\n");
  return failures ? 1 : 0;
}
