/*
** Errors are values: a thread-local last error (code + message) set by failing calls.
** Abort is only for broken invariants, through a replaceable hook.
*/
#include "kiln_int.h"

#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

static _Thread_local kiln_status tl_code = KILN_OK;
static _Thread_local char tl_msg[2048]; /* an OOM carries its breakdown and advice */

static const char *const err_names[] = {
#define KILN__ERR_NAME(name, msg) "KILN_ERR_" #name,
    KILN_ERRNO_MAP(KILN__ERR_NAME)
#undef KILN__ERR_NAME
};
static const char *const err_strings[] = {
#define KILN__ERR_STR(name, msg) msg,
    KILN_ERRNO_MAP(KILN__ERR_STR)
#undef KILN__ERR_STR
};

const char *kiln_error_name(kiln_status code) {
  if ((int)code < 0 || code >= KILN_ERR__COUNT) return "unknown";
  return err_names[code];
}

const char *kiln_error_string(kiln_status code) {
  if ((int)code < 0 || code >= KILN_ERR__COUNT) return "unknown error code";
  return err_strings[code];
}

kiln_status kiln_last_error(void) { return tl_code; }
const char *kiln_last_error_message(void) { return tl_msg; }

void kiln_clear_error(void) {
  tl_code = KILN_OK;
  tl_msg[0] = 0;
}

kiln_status kiln_set_error(kiln_status code, const char *fmt, ...) {
  tl_code = code;
  if (!fmt) {
    snprintf(tl_msg, sizeof tl_msg, "%s", kiln_error_string(code));
    return code;
  }
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(tl_msg, sizeof tl_msg, fmt, ap);
  va_end(ap);
  return code;
}

static void default_abort(const char *file, int line, const char *msg) {
  fprintf(stderr, "kiln: internal error at %s:%d: %s\n", file, line, msg);
  fflush(stderr);
  abort();
}

static kiln_abort_hook abort_hook = default_abort;

kiln_abort_hook kiln_set_abort_hook(kiln_abort_hook hook) {
  kiln_abort_hook old = abort_hook;
  abort_hook = hook ? hook : default_abort;
  return old;
}

void kiln__abort(const char *file, int line, const char *msg) {
  abort_hook(file, line, msg);
  abort(); /* a hook that returns still must not continue past a broken invariant */
}
