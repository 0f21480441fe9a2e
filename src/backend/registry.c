/*
** The table of built backends and the names of the kernel ops.
*/
#include "backend.h"

const kiln__backend *kiln__backend_get(kiln_device_type type) {
  switch (type) {
  case KILN_DEVICE_CPU:
    return &kiln__cpu_backend;
#ifdef KILN_HAVE_CUDA
  case KILN_DEVICE_CUDA:
    return &kiln__cuda_backend;
#endif
  default:
    return NULL;
  }
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
