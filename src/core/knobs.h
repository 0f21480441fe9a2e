/*
** The tuning switches: environment variables that pick among kiln's own paths and kernels
** (KILN_ATTENTION=own, KILN_CONV_GEMM=0, ...), for A/B runs, bug reports and a way around
** a driver's fault. Not the settings users set (KILN_DEVICE, ...: env.c); the defaults are
** the measured, tested choices. One table (knobs.c) says each switch's accepted values and
** what it changes. The readers take a value from it; a value the table does not accept is
** said once on stderr, and the caller's default is used. kiln_env_check() refuses such a
** value and `kiln doctor` lists the switches set. Not API.
**
** Each reader looks the name up (a binary search) and reads the environment: callers on a
** hot path read once into a static, and those a test flips at run time read at each call.
** A name missing from the table is a bug in kiln (tests/test_env.c scans the sources).
*/
#ifndef KILN_KNOBS_H
#define KILN_KNOBS_H

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A 0/1 switch: dflt when unset, empty or not accepted. */
bool kiln__knob_on(const char *name, bool dflt);
/* An integer in the table's range: dflt when unset, empty or not accepted. */
int64_t kiln__knob_int(const char *name, int64_t dflt);
/* The value's place in the table's list of words ("own|cudnn-fwd|..." gives 0 for own):
** dflt when unset, empty or not in the list. */
int kiln__knob_choice(const char *name, int dflt);
/* A comma-separated list of the table's words: whether it holds word. */
bool kiln__knob_lists(const char *name, const char *word);
/* Free text the reader checks itself (a path, a kernel's key): NULL when unset or empty. */
const char *kiln__knob_text(const char *name);

#ifdef __cplusplus
}
#endif

#endif /* KILN_KNOBS_H */
