/*
** The module scope: which nn module the calling thread is inside, for the observers.
**
** nn's kiln_module_forward pushes the module's label ("layers.0 (Linear)", interned so
** that it outlives the module) before the module's forward and pops it after; a backward
** rule runs with its node as the thread's backward node (engine.c), and an op node
** remembers the label that was on top when its op ran (node.c). The profiler names
** module spans from it and the anomaly check names the module that made a bad value.
**
** Cost with no observer: a push/pop of a pointer per module forward, and one store per
** backward rule. The profiler, when on, is told of each push and pop (module spans).
*/
#include "ops/op.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define MAX_DEPTH 64

typedef struct frame {
  const char *label;
  double t0;           /* set only while a listener is on */
  int64_t saved0;      /* autograd's saved bytes when the module began */
} frame;

static _Thread_local frame stack[MAX_DEPTH];
static _Thread_local int top; /* frames in use; past MAX_DEPTH only counted */
static _Thread_local const kiln__node *bw_node;

static kiln__module_listener_fn listener;
static atomic_bool listening;

void kiln__module_scope_set_listener(kiln__module_listener_fn fn) {
  listener = fn;
  atomic_store(&listening, fn != NULL);
}

void kiln__module_scope_push(const char *label) {
  if (top < MAX_DEPTH) {
    frame *f = &stack[top];
    f->label = label;
    f->saved0 = kiln__saved_bytes_live();
    if (atomic_load_explicit(&listening, memory_order_relaxed)) {
      f->t0 = kiln__now();
      kiln__module_listener_fn fn = listener;
      if (fn) fn(label, true, f->t0, 0);
    }
  }
  top++;
}

void kiln__module_scope_pop(void) {
  if (top <= 0) return;
  top--;
  if (top >= MAX_DEPTH) return;
  frame *f = &stack[top];
  /* What the module left saved for backward feeds the OOM advice (core/memory.c); not
  ** the outermost module's: it holds everything, and checkpointing it saves nothing. */
  if (top > 0) {
    int64_t saved = kiln__saved_bytes_live() - f->saved0;
    if (saved > 0) kiln__memory_note_saver(f->label, saved);
  }
  if (atomic_load_explicit(&listening, memory_order_relaxed)) {
    kiln__module_listener_fn fn = listener;
    if (fn) fn(f->label, false, f->t0, kiln__now());
  }
}

const char *kiln__module_scope_current(void) {
  if (top <= 0) return NULL;
  return stack[(top <= MAX_DEPTH ? top : MAX_DEPTH) - 1].label;
}

int kiln__module_scope_depth(void) { return top < MAX_DEPTH ? top : MAX_DEPTH; }

const char *kiln__module_scope_at(int i) { return i >= 0 && i < top && i < MAX_DEPTH ? stack[i].label : NULL; }

const kiln__node *kiln__backward_node_swap(const kiln__node *n) {
  const kiln__node *prev = bw_node;
  bw_node = n;
  return prev;
}

const kiln__node *kiln__backward_node(void) { return bw_node; }

/* ---- interned strings: labels that outlive the modules that made them ----
** Never freed (nodes and profiler rows may name a label until the process ends, after
** library destructors run); leak checkers see them as still reachable. */
typedef struct istr {
  struct istr *next;
  char s[];
} istr;
static pthread_mutex_t intern_lock = PTHREAD_MUTEX_INITIALIZER;
#define INTERN_BUCKETS 256
static istr *buckets[INTERN_BUCKETS];

const char *kiln__intern(const char *s) {
  if (!s) return NULL;
  uint32_t h = 2166136261u; /* FNV-1a */
  for (const char *p = s; *p; p++) h = (h ^ (uint8_t)*p) * 16777619u;
  size_t n = strlen(s);
  pthread_mutex_lock(&intern_lock);
  istr *e = buckets[h % INTERN_BUCKETS];
  while (e && strcmp(e->s, s) != 0) e = e->next;
  if (!e && (e = malloc(sizeof *e + n + 1)) != NULL) {
    memcpy(e->s, s, n + 1);
    e->next = buckets[h % INTERN_BUCKETS];
    buckets[h % INTERN_BUCKETS] = e;
  }
  pthread_mutex_unlock(&intern_lock);
  return e ? e->s : NULL;
}
