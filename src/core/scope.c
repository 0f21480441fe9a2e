/*
** Scopes: a thread-local stack of frames; each frame holds references to the tensors
** created while it was innermost. Ending a scope releases them; kiln_keep() takes one out.
*/
#include "kiln_int.h"

#include <pthread.h>
#include <stdlib.h>

typedef struct frame {
  kiln_tensor **items;
  int n, cap;
} frame;

static _Thread_local frame *frames;
static _Thread_local int depth, frames_cap;

/* A thread that used scopes frees its frames when it exits (loader workers, user
** threads): a pthread key whose destructor runs at thread exit. */
static pthread_key_t frames_key;
static pthread_once_t frames_key_once = PTHREAD_ONCE_INIT;

static void free_frames(void *p) {
  frame *fs = p;
  if (!fs) return;
  if (fs == frames) {
    for (int i = 0; i < frames_cap; i++) free(frames[i].items);
    frames_cap = 0;
    depth = 0;
    frames = NULL;
  }
  free(fs);
}

static void make_frames_key(void) { pthread_key_create(&frames_key, free_frames); }

void kiln_scope_begin(void) {
  if (depth == frames_cap) {
    pthread_once(&frames_key_once, make_frames_key);
    int ncap = frames_cap ? frames_cap * 2 : 8;
    frame *nf = realloc(frames, (size_t)ncap * sizeof *nf);
    if (!nf) kiln__abort(__FILE__, __LINE__, "out of host memory for a scope frame");
    for (int i = frames_cap; i < ncap; i++) nf[i] = (frame){NULL, 0, 0};
    frames = nf;
    frames_cap = ncap;
    pthread_setspecific(frames_key, frames);
  }
  frames[depth].n = 0;
  depth++;
}

kiln_status kiln_scope_end(void) {
  if (depth == 0) return kiln_set_error(KILN_ERR_STATE, "kiln_scope_end: no scope is open");
  frame *f = &frames[depth - 1];
  /* Release in reverse order of creation: later tensors often refer to earlier ones. */
  for (int i = f->n - 1; i >= 0; i--) {
    kiln_tensor *t = f->items[i];
    if (!t) continue;
    t->scope_refs--;
    kiln_tensor_free(t);
  }
  f->n = 0;
  depth--;
  if (depth == 0) { /* give back large frames once a loop is over */
    for (int i = 0; i < frames_cap; i++) {
      if (frames[i].cap > 4096) {
        free(frames[i].items);
        frames[i] = (frame){NULL, 0, 0};
      }
    }
  }
  return KILN_OK;
}

int kiln_scope_depth(void) { return depth; }

kiln_tensor *kiln__scope_track(kiln_tensor *t) {
  if (!t || depth == 0) return t;
  frame *f = &frames[depth - 1];
  if (f->n == f->cap) {
    int ncap = f->cap ? f->cap * 2 : 64;
    kiln_tensor **ni = realloc(f->items, (size_t)ncap * sizeof *ni);
    if (!ni) kiln__abort(__FILE__, __LINE__, "out of host memory for a scope entry");
    f->items = ni;
    f->cap = ncap;
  }
  f->items[f->n++] = t;
  t->scope_refs++;
  return t;
}

kiln_tensor *kiln_keep(kiln_tensor *t) {
  if (!t || t->scope_refs == 0) return t;
  for (int d = depth - 1; d >= 0; d--) {
    frame *f = &frames[d];
    for (int i = f->n - 1; i >= 0; i--) {
      if (f->items[i] == t) {
        f->items[i] = NULL;
        if (i == f->n - 1) f->n--;
        t->scope_refs--;
        return t;
      }
    }
  }
  return t; /* owned by another thread's scope: left as it is */
}

kiln_tensor *kiln__scope_return(kiln_tensor *r) {
  if (r) kiln_tensor_ref(r);
  kiln_scope_end();
  return kiln__scope_track(r);
}

void kiln__discard(kiln_tensor *t) {
  if (t) kiln_tensor_free(kiln_keep(t));
}
