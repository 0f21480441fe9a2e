/*
** "testdev": a backend that exists only in the test suite (not in libkiln), registered at
** run time through the registry API alone, to prove that a backend plugs in without
** edits to core/, ops/ or autograd/ (issue 13, part 6).
**
** Memory is host malloc, but the backend does not declare it host-visible, so transfers
** and the CPU fallback's staging go through its copy entries as they would for a GPU. It
** keeps its own memory statistics. It implements a handful of kernels with plain loops of
** its own (not the CPU backend's, so a bug in either shows when they are compared):
**   COPY, FILL (every dtype); ADD, MUL, RELU, SUM (f32 and f64 only: its supports()
**   callback turns other dtypes away, so those fall back too).
** Everything else falls back to the CPU. No graphs, no async copies, no device timing.
*/
#ifndef KILN_TEST_BACKEND_TESTDEV_H
#define KILN_TEST_BACKEND_TESTDEV_H

#include "backend/backend.h"

/* Registers the backend (again: the same id) and returns its device type, -1 (cast) on
** failure with the last error set. */
kiln_device_type h_testdev_register(void);
/* testdev:0 (registers it first). */
kiln_device h_testdev_device(void);
/* The backend itself (for tests that look at its table). */
const kiln__backend *h_testdev_backend(void);
/* How many times its kernel for op ran (not counting the fallback's staging copies,
** which call the COPY kernel directly: those count too, as they run it). */
int64_t h_testdev_calls(kiln__kop op);
void h_testdev_reset_calls(void);

#endif /* KILN_TEST_BACKEND_TESTDEV_H */
