/*
** A sharded safetensors checkpoint: the index Hugging Face's save_pretrained writes beside
** the shards of a large model (model.safetensors.index.json),
**
**   {"metadata": {"total_size": ...}, "weight_map": {"tensor name": "model-00001-of-00002.safetensors", ...}}
**
** opened as its shards (each a kiln_safetensors), so a reader sees every tensor of the
** model and reads none until asked. The index is read with the JSON cursor, whose errors
** name the line and byte of the wrong entry.
*/
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "io_int.h"
#include "kiln_io.h"
#include "ext/kiln_ext.h"

#define WHO "kiln_safetensors_open_index"

typedef struct shards {
  kiln_safetensors **files;
  int n;
} shards;

static void shards_close(shards *s) {
  for (int f = 0; f < s->n; f++) kiln_safetensors_close(s->files[f]);
  free(s->files);
  *s = (shards){0};
}

/* The shard of s opened from path, or -1. */
static int shard_of(const shards *s, const char *path) {
  for (int f = 0; f < s->n; f++)
    if (!strcmp(kiln_safetensors_path(s->files[f]), path)) return f;
  return -1;
}

/* Opens path as one more shard; none of its tensors may be in a shard opened before. */
static kiln_status shard_open(shards *s, const char *path) {
  kiln_safetensors **grown = realloc(s->files, sizeof *grown * (size_t)(s->n + 1));
  if (!grown) return kiln_set_error(KILN_ERR_OOM, WHO ": out of host memory");
  s->files = grown;
  kiln_safetensors *f = kiln_safetensors_open(path);
  if (!f) return kiln_last_error();
  for (int i = 0; i < kiln_safetensors_count(f); i++)
    for (int g = 0; g < s->n; g++)
      if (kiln_safetensors_find(s->files[g], kiln_safetensors_name(f, i)) >= 0) {
        kiln_status st = kiln_set_error(KILN_ERR_FORMAT, WHO ": %s holds %s, which an earlier shard holds too", path,
                                        kiln_safetensors_name(f, i));
        kiln_safetensors_close(f);
        return st;
      }
  s->files[s->n++] = f;
  return KILN_OK;
}

/* The directory part of path ("." when it has none) into out. */
static void dir_of(const char *path, char *out, size_t n) {
  const char *slash = strrchr(path, '/');
  if (!slash) snprintf(out, n, ".");
  else if (slash == path) snprintf(out, n, "/");
  else snprintf(out, n, "%.*s", (int)(slash - path), path);
}

/* "weight_map"'s members into s: each shard opened once, in the order the map first names
** it; every name must be in its shard. Shard names are plain file names (no '/'). */
static kiln_status read_weight_map(kiln__jreader *jr, const char *dir, shards *s) {
  if (kiln__jr_peek(jr) != '{')
    return kiln__jr_fail_at(jr, jr->pos, "\"weight_map\" is not an object of tensor name to shard file");
  kiln__jr_object_begin(jr);
  char path[4096];
  int first = 1, r;
  kiln_status st = KILN_OK;
  while (st == KILN_OK && (r = kiln__jr_member(jr, &first)) == 1) {
    char *name = strdup(jr->buf);
    size_t at = jr->pos;
    if (!name) return kiln_set_error(KILN_ERR_OOM, WHO ": out of host memory");
    if (kiln__jr_peek(jr) != '"') {
      st = kiln__jr_fail_at(jr, at, "the shard of %s is not a string", name);
    } else if (!kiln__jr_string(jr)) {
      st = kiln_last_error();
    } else if (!jr->buf[0] || strchr(jr->buf, '/') || !strcmp(jr->buf, "..")) {
      st = kiln__jr_fail_at(jr, at, "the shard of %s, '%s', is not a file name in the directory", name, jr->buf);
    } else if ((size_t)snprintf(path, sizeof path, "%s/%s", dir, jr->buf) >= sizeof path) {
      st = kiln__jr_fail_at(jr, at, "the shard of %s: its path is over %zu bytes", name, sizeof path - 1);
    } else {
      int f = shard_of(s, path);
      if (f < 0 && (st = shard_open(s, path)) == KILN_OK) f = s->n - 1;
      if (st != KILN_OK) { /* the shard's own error, said where the index names it */
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", kiln_last_error_message());
        jr->code = st;
        st = kiln__jr_fail_at(jr, at, "the shard of %s: %s", name, msg);
      }
      if (st == KILN_OK && kiln_safetensors_find(s->files[f], name) < 0)
        st = kiln__jr_fail_at(jr, at, "the index puts %s in %s, which does not hold it", name, jr->buf);
    }
    free(name);
  }
  return st == KILN_OK && r < 0 ? kiln_last_error() : st;
}

int kiln_safetensors_open_index(const char *index_path, kiln_safetensors ***out) {
  if (!out) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, WHO ": NULL result pointer"), -1;
  *out = NULL;
  size_t n;
  char *text = kiln__read_regular(WHO, index_path, &n); /* a NULL path refused */
  if (!text) return -1;
  char dir[4096];
  dir_of(index_path, dir, sizeof dir);
  kiln__jreader jr;
  kiln__jr_init(&jr, WHO, index_path, text, n);
  shards s = {0};
  kiln_status st = KILN_OK;
  int first = 1, r = -1, seen_map = 0;
  if (kiln__jr_object_begin(&jr))
    while (st == KILN_OK && (r = kiln__jr_member(&jr, &first)) == 1) {
      if (strcmp(jr.buf, "weight_map") != 0) { /* "metadata" and anything else */
        if (!kiln__jr_skip(&jr)) {
          r = -1;
          break;
        }
      } else if (seen_map) {
        st = kiln__jr_fail_at(&jr, jr.key_pos, "\"weight_map\" twice");
      } else {
        seen_map = 1;
        st = read_weight_map(&jr, dir, &s);
      }
    }
  if (st == KILN_OK && r < 0) st = kiln_last_error();
  if (st == KILN_OK && r == 0) st = kiln__jr_end(&jr);
  if (st == KILN_OK && (!seen_map || s.n == 0))
    st = kiln_set_error(KILN_ERR_FORMAT, WHO ": %s has no \"weight_map\" naming a shard", index_path);
  kiln__jr_release(&jr);
  free(text);
  if (st != KILN_OK) {
    shards_close(&s);
    return -1;
  }
  *out = s.files;
  return s.n;
}
