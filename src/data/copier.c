/*
** The loader's copier: what a staged batch needs from its device, in plain C. Pinned
** host blocks, device blocks, a side copy stream, and events on it and on the device's
** own (compute) stream: the backend's optional kiln__backend_async entries (CUDA has
** them). A device whose backend lacks them gets no copier, and the loader copies its
** batches with plain kiln_to_device.
**
** The emulated device (kiln__copier_emulate, for tests) gives the same machinery on the
** CPU, so that the loader's threads, buffer recycling and error paths run in CI and
** under valgrind without a GPU: its "pinned" blocks are malloc'd, its device blocks are
** CPU storages, and its side stream is a thread that runs the queued memcpys in order
** (after an optional delay, which makes a missing wait show up as a wrong batch). Its
** compute stream is the host itself (CPU ops finish before they return), so an event on
** it is complete at once and making it wait for a copy means waiting on the host.
*/
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/kiln_int.h" /* the backend vtable's async entries (see tests/test_layering.sh) */
#include "data_int.h"

/* ---- the emulated side stream ----
** Copies get sequence numbers 1, 2, ... as they are queued and run in that order; `done`
** is the number of the last one finished. An event holds the number of the last copy
** queued before it was recorded (0: complete from the start). */
enum { EMU_QUEUE = 64 };

typedef struct emu_op {
  void *dst;
  const void *src;
  size_t n;
} emu_op;

typedef struct emu_event {
  uint64_t seq;
} emu_event;

typedef struct emu_stream {
  pthread_t thread;
  pthread_mutex_t mu;
  pthread_cond_t cv_work, cv_done;
  emu_op q[EMU_QUEUE];
  uint64_t queued, done;
  int stop;
  int delay_us;
} emu_stream;

struct kiln__copier {
  kiln_device dev;
  const kiln__backend_async *as; /* the device's (NULL when emulated) */
  bool emulated;
  emu_stream emu;
  atomic_int host_countdown, block_countdown; /* the allocation that sees 1 fails */
};

/* The settings copiers made from now on take. */
static struct {
  pthread_mutex_t mu;
  kiln__copier_emulation e;
} g_emu = {PTHREAD_MUTEX_INITIALIZER, {false, 0, 0, 0}};

void kiln__copier_emulate(const kiln__copier_emulation *e) {
  pthread_mutex_lock(&g_emu.mu);
  g_emu.e = e ? *e : (kiln__copier_emulation){false, 0, 0, 0};
  pthread_mutex_unlock(&g_emu.mu);
}

static bool emu_fails(atomic_int *countdown) { return atomic_fetch_sub(countdown, 1) == 1; }

static void *emu_main(void *arg) {
  emu_stream *s = arg;
  pthread_mutex_lock(&s->mu);
  for (;;) {
    while (!s->stop && s->done == s->queued) pthread_cond_wait(&s->cv_work, &s->mu);
    if (s->done == s->queued) break; /* stopping, and nothing left to run */
    emu_op op = s->q[s->done % EMU_QUEUE];
    pthread_mutex_unlock(&s->mu);
    if (s->delay_us > 0) {
      struct timespec ts = {s->delay_us / 1000000, (long)(s->delay_us % 1000000) * 1000L};
      nanosleep(&ts, NULL);
    }
    if (op.n) memcpy(op.dst, op.src, op.n);
    pthread_mutex_lock(&s->mu);
    s->done++;
    pthread_cond_broadcast(&s->cv_done);
  }
  pthread_mutex_unlock(&s->mu);
  return NULL;
}

static void emu_wait(emu_stream *s, const emu_event *ev) {
  pthread_mutex_lock(&s->mu);
  while (s->done < ev->seq) pthread_cond_wait(&s->cv_done, &s->mu);
  pthread_mutex_unlock(&s->mu);
}

/* ---- the copier ---- */

bool kiln__copier_capturing(kiln_device dev) {
  const kiln__backend *b = kiln__backend_get(dev.type);
  return b && b->graph && b->graph->capturing && b->graph->capturing(dev.index);
}

kiln_status kiln__copier_new(kiln_device dev, kiln__copier **out) {
  *out = NULL;
  pthread_mutex_lock(&g_emu.mu);
  kiln__copier_emulation emu = g_emu.e;
  pthread_mutex_unlock(&g_emu.mu);
  bool emulated = dev.type == KILN_DEVICE_CPU && emu.on;
  const kiln__backend *b = kiln__backend_get(dev.type);
  if (!emulated) {
    if (!b || !b->async || !kiln_backend_available(dev.type, NULL) || dev.index < 0 ||
        dev.index >= kiln_device_count(dev.type))
      return KILN_OK; /* kiln_loader_next reports a bad device as it always has */
  }
  kiln__copier *c = calloc(1, sizeof *c);
  if (!c) return kiln_set_error(KILN_ERR_OOM, "kiln_loader_new: out of memory");
  c->dev = dev;
  c->emulated = emulated;
  c->as = emulated ? NULL : b->async;
  if (emulated) {
    emu_stream *s = &c->emu;
    s->delay_us = emu.copy_delay_us;
    atomic_init(&c->host_countdown, emu.fail_host_alloc);
    atomic_init(&c->block_countdown, emu.fail_block_alloc);
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv_work, NULL);
    pthread_cond_init(&s->cv_done, NULL);
    if (pthread_create(&s->thread, NULL, emu_main, s) != 0) {
      pthread_mutex_destroy(&s->mu);
      pthread_cond_destroy(&s->cv_work);
      pthread_cond_destroy(&s->cv_done);
      free(c);
      return kiln_set_error(KILN_ERR_INTERNAL, "kiln_loader_new: cannot start the emulated copy stream");
    }
  }
  *out = c;
  return KILN_OK;
}

void kiln__copier_free(kiln__copier *c) {
  if (!c) return;
  if (c->emulated) {
    emu_stream *s = &c->emu;
    pthread_mutex_lock(&s->mu);
    s->stop = 1;
    pthread_cond_broadcast(&s->cv_work);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->thread, NULL); /* it runs what is queued first */
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv_work);
    pthread_cond_destroy(&s->cv_done);
  }
  free(c);
}

kiln_status kiln__copier_host_alloc(kiln__copier *c, void **p, size_t n) {
  *p = NULL;
  if (c->emulated) {
    if (!emu_fails(&c->host_countdown)) *p = malloc(n ? n : 1);
    return *p ? KILN_OK
              : kiln_set_error(KILN_ERR_OOM, "kiln: cannot pin %zu bytes of host memory (emulated device)", n);
  }
  return c->as->host_alloc(c->dev.index, p, n);
}

void kiln__copier_host_free(kiln__copier *c, void *p) {
  if (!p) return;
  if (c->emulated) free(p);
  else c->as->host_free(p);
}

kiln__storage *kiln__copier_block_new(kiln__copier *c, size_t n) {
  if (c->emulated && emu_fails(&c->block_countdown)) {
    kiln_set_error(KILN_ERR_OOM, "kiln: out of memory on the emulated device: tried to allocate %zu bytes", n);
    return NULL;
  }
  return kiln__storage_new(c->emulated ? kiln_device_cpu() : c->dev, n);
}

kiln_status kiln__copier_event_new(kiln__copier *c, void **ev) {
  *ev = NULL;
  if (c->emulated) {
    *ev = calloc(1, sizeof(emu_event));
    return *ev ? KILN_OK : kiln_set_error(KILN_ERR_OOM, "kiln: out of memory for an event");
  }
  return c->as->event_new(c->dev.index, ev);
}

void kiln__copier_event_free(kiln__copier *c, void *ev) {
  if (!ev) return;
  if (c->emulated) free(ev);
  else c->as->event_free(ev);
}

kiln_status kiln__copier_mark(kiln__copier *c, void *ev) {
  if (c->emulated) {
    ((emu_event *)ev)->seq = 0; /* the host's work is done when it returns */
    return KILN_OK;
  }
  return c->as->event_record(c->dev.index, ev);
}

kiln_status kiln__copier_copy(kiln__copier *c, void *dst, const void *src, size_t n, void *after,
                              void *done) {
  if (c->emulated) {
    emu_stream *s = &c->emu; /* `after` is an event of the host: complete already */
    pthread_mutex_lock(&s->mu);
    while (s->queued - s->done >= EMU_QUEUE) pthread_cond_wait(&s->cv_done, &s->mu);
    s->q[s->queued % EMU_QUEUE] = (emu_op){dst, src, n};
    s->queued++;
    ((emu_event *)done)->seq = s->queued;
    pthread_cond_signal(&s->cv_work);
    pthread_mutex_unlock(&s->mu);
    return KILN_OK;
  }
  int d = c->dev.index;
  kiln_status st = after ? c->as->side_event_wait(d, after) : KILN_OK;
  if (st == KILN_OK) st = c->as->side_copy_from_host(d, dst, src, n);
  if (st == KILN_OK) st = c->as->side_event_record(d, done);
  return st;
}

kiln_status kiln__copier_join(kiln__copier *c, void *ev) {
  if (c->emulated) {
    emu_wait(&c->emu, ev);
    return KILN_OK;
  }
  return c->as->event_wait(c->dev.index, ev);
}

kiln_status kiln__copier_sync(kiln__copier *c, void *ev) {
  if (c->emulated) {
    emu_wait(&c->emu, ev);
    return KILN_OK;
  }
  return c->as->event_synchronize(ev);
}
