/*
** Internals shared by the io and data layers (not API). Built only on kiln.h.
*/
#ifndef KILN_IO_INT_H
#define KILN_IO_INT_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "kiln.h"

/* A file being written atomically: bytes go to path.tmp.<pid>; commit fsyncs it, renames
** it over path and fsyncs the directory; abort removes it. Every failure sets
** KILN_ERR_IO naming `who`, the path and errno, and leaves path untouched. */
typedef struct kiln__atomic_file {
  FILE *f;
  char *path;
  char *tmp;
  const char *who;
  int failed;
} kiln__atomic_file;

kiln_status kiln__atomic_open(kiln__atomic_file *af, const char *who, const char *path);
kiln_status kiln__atomic_write(kiln__atomic_file *af, const void *data, size_t n);
kiln_status kiln__atomic_commit(kiln__atomic_file *af);
void kiln__atomic_abort(kiln__atomic_file *af);

/* Opens path for reading, refusing anything but a regular file without blocking: a FIFO
** (whose open would wait for a writer forever), a directory, a device or a socket. The
** open is non-blocking and the type comes from fstat of the same descriptor (no race);
** blocking mode is restored before returning. Returns the descriptor, or -1 with
** KILN_ERR_IO set naming `who`, the path and the kind of file. */
int kiln__open_regular(const char *who, const char *path);
/* The same as a FILE opened "rb"; NULL with the error set. */
FILE *kiln__fopen_regular(const char *who, const char *path);
/* The same, with the file's size in bytes in *size (the loaders check lengths against it);
** a NULL path is refused (KILN_ERR_INVALID_ARGUMENT "who: NULL path"). */
FILE *kiln__fopen_regular_size(const char *who, const char *path, uint64_t *size);
/* The whole file, NUL-terminated (kiln_ext.h says more). */
char *kiln__read_regular(const char *who, const char *path, size_t *n);
/* The JSON cursor (json_cursor.c) is declared in ext/kiln_ext.h only: its struct cannot be
** defined twice in a file that includes both headers. */

/* 1 on a little-endian host. File formats here are little-endian; on a big-endian host
** element bytes are swapped after reading and before writing. */
int kiln__host_is_le(void);
/* Reverses the bytes of each of n elements of size esize (1: nothing). */
void kiln__swap_bytes(void *data, size_t n, size_t esize);

/* A tensor made here and owned by the calling code, whether or not a scope is open:
** kiln_keep() after creation (a no-op without a scope). */
kiln_tensor *kiln__own(kiln_tensor *t);

#endif /* KILN_IO_INT_H */
