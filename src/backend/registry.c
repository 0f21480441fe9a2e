/*
** The registry of backends, and the names of the kernel ops.
**
** Built-in backends are one line each in `builtin` below, the only place (with
** backend.h) where KILN_HAVE_CUDA decides anything outside backend/cuda/. A static list
** rather than constructor functions: an object file of a static library that nothing
** references is not linked, so a backend registering itself from a constructor would
** silently vanish from static builds, and constructors run in an unspecified order while
** the CPU must be slot 0. Backends that are not built in (a test backend, later a
** plug-in) call kiln__backend_register() before their first use.
**
** Lookups take no lock: built-ins are constant, and a run-time entry is written before
** the count that publishes it (release/acquire). Entries are never removed.
*/
#include "backend.h"

#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

#ifdef KILN_HAVE_VULKAN
extern kiln__backend kiln__vulkan_backend;
#endif

static const kiln__backend *const builtin[] = {
    &kiln__cpu_backend, /* slot 0: the host, and every other backend's fallback */
#ifdef KILN_HAVE_CUDA
    &kiln__cuda_backend,
#endif
#ifdef KILN_HAVE_VULKAN
    &kiln__vulkan_backend, /* not const: its probe sets best_rank (src/backend/vulkan/) */
#endif
};
#define N_BUILTIN ((int)(sizeof builtin / sizeof builtin[0]))

/* The named values of kiln_device_type, so that their devices print and parse (and say
** why they are missing) in builds without their backend. */
static const struct {
  const char *name;
  const char *missing_why;
} named[] = {
    [KILN_DEVICE_CPU] = {"cpu", "backend not built"},
    [KILN_DEVICE_CUDA] = {"cuda", "kiln was built without CUDA (configure with KILN_CUDA=ON "
                                  "on a machine with the CUDA toolkit)"},
    [KILN_DEVICE_VULKAN] = {"vulkan", "kiln was built without Vulkan (install libvulkan-dev and "
                                      "glslc, and configure with KILN_VULKAN=ON)"},
};
#define N_NAMED ((int)(sizeof named / sizeof named[0]))

static struct {
  const kiln__backend *b;
  kiln_device_type type;
} dyn[KILN__MAX_BACKENDS];
static atomic_int n_dyn;
static pthread_mutex_t reg_lock = PTHREAD_MUTEX_INITIALIZER;

int kiln__backend_count(void) { return N_BUILTIN + atomic_load_explicit(&n_dyn, memory_order_acquire); }

const kiln__backend *kiln__backend_at(int i, kiln_device_type *type) {
  const kiln__backend *b = NULL;
  kiln_device_type t = KILN__DEVICE_TYPE_ANY;
  if (i >= 0 && i < N_BUILTIN) {
    b = builtin[i];
    t = b->type;
  } else if (i >= N_BUILTIN && i < kiln__backend_count()) {
    b = dyn[i - N_BUILTIN].b;
    t = dyn[i - N_BUILTIN].type;
  }
  if (type) *type = t;
  return b;
}

int kiln__backend_slot(kiln_device_type type) {
  for (int i = 0; i < N_BUILTIN; i++)
    if (builtin[i]->type == type) return i;
  int n = atomic_load_explicit(&n_dyn, memory_order_acquire);
  for (int i = 0; i < n; i++)
    if (dyn[i].type == type) return N_BUILTIN + i;
  return -1;
}

const kiln__backend *kiln__backend_get(kiln_device_type type) {
  /* the dispatch path: one or two compares for the built-ins, as the switch it replaces */
  for (int i = 0; i < N_BUILTIN; i++)
    if (builtin[i]->type == type) return builtin[i];
  int n = atomic_load_explicit(&n_dyn, memory_order_acquire);
  for (int i = 0; i < n; i++)
    if (dyn[i].type == type) return dyn[i].b;
  return NULL;
}

const kiln__backend *kiln__backend_find(const char *name, kiln_device_type *type) {
  if (!name) return NULL;
  for (int i = 0, n = kiln__backend_count(); i < n; i++) {
    kiln_device_type t;
    const kiln__backend *b = kiln__backend_at(i, &t);
    if (b && strcmp(b->name, name) == 0) {
      if (type) *type = t;
      return b;
    }
  }
  return NULL;
}

const char *kiln__device_type_name(kiln_device_type type) {
  const kiln__backend *b = kiln__backend_get(type);
  if (b) return b->name;
  if ((int)type >= 0 && (int)type < N_NAMED && named[type].name) return named[type].name;
  return NULL;
}

const char *kiln__backend_missing_why(kiln_device_type type) {
  if ((int)type >= 0 && (int)type < N_NAMED) return named[type].missing_why;
  return NULL;
}

static bool name_ok(const char *s) {
  if (!s || !*s || strlen(s) > 15) return false; /* kiln__device_cstr's buffers */
  for (; *s; s++)
    if (!((*s >= 'a' && *s <= 'z') || (*s >= '0' && *s <= '9') || *s == '_')) return false;
  return true;
}

kiln_device_type kiln__backend_register(const kiln__backend *b) {
  const kiln_device_type fail = KILN__DEVICE_TYPE_ANY;
  if (!b || !name_ok(b->name) || !b->alloc || !b->free || !b->copy_to_host ||
      !b->copy_from_host || !b->copy_device) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                   "kiln__backend_register: a backend needs a name (lower-case letters, digits, "
                   "'_'; at most 15) and alloc, free and the three copies");
    return fail;
  }
  pthread_mutex_lock(&reg_lock);
  kiln_device_type t = fail;
  int n = atomic_load_explicit(&n_dyn, memory_order_relaxed);
  for (int i = 0; i < N_BUILTIN + n; i++) {
    kiln_device_type ti;
    const kiln__backend *bi = kiln__backend_at(i, &ti);
    if (bi == b) { /* again: the same id */
      pthread_mutex_unlock(&reg_lock);
      return ti;
    }
  }
  bool named_type = (int)b->type >= 0 && (int)b->type < KILN__DEVICE_TYPE_DYNAMIC;
  const char *taken = NULL;
  for (int i = 0; i < N_BUILTIN + n && !taken; i++) {
    kiln_device_type ti;
    const kiln__backend *bi = kiln__backend_at(i, &ti);
    if (strcmp(bi->name, b->name) == 0 || (named_type && ti == b->type)) taken = bi->name;
  }
  /* A run-time backend may not take the name of a named type it is not (say "cuda"). */
  for (int k = 0; k < N_NAMED && !taken; k++)
    if (named[k].name && strcmp(named[k].name, b->name) == 0 && !(named_type && (int)b->type == k))
      taken = named[k].name;
  if (taken) {
    kiln_set_error(KILN_ERR_STATE, "kiln__backend_register: '%s' clashes with the registered backend '%s'",
                   b->name, taken);
  } else if (N_BUILTIN + n >= KILN__MAX_BACKENDS) {
    kiln_set_error(KILN_ERR_STATE, "kiln__backend_register: the table of %d backends is full",
                   KILN__MAX_BACKENDS);
  } else if (!named_type && b->type != KILN__DEVICE_TYPE_ANY) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                   "kiln__backend_register: type %d is neither a named device type nor "
                   "KILN__DEVICE_TYPE_ANY", (int)b->type);
  } else {
    t = named_type ? b->type : (kiln_device_type)(KILN__DEVICE_TYPE_DYNAMIC + n);
    dyn[n].b = b;
    dyn[n].type = t;
    atomic_store_explicit(&n_dyn, n + 1, memory_order_release);
  }
  pthread_mutex_unlock(&reg_lock);
  return t;
}

static const char *const kiln__kop_names[KILN__K_COUNT] = {
#define KILN__KOP_STR(name, str) str,
    KILN__KOP_MAP(KILN__KOP_STR)
#undef KILN__KOP_STR
};

const char *kiln__kop_name(kiln__kop op) {
  if ((int)op < 0 || op >= KILN__K_COUNT) return "?";
  return kiln__kop_names[op];
}
