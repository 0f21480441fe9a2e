/* Private header of the text layer (src/text/): the Unicode tables, the pre-tokenizer and
** the small JSON reader the tokenizer files are read with. Not API. */
#ifndef KILN_TEXT_INT_H
#define KILN_TEXT_INT_H

#include <stddef.h>
#include <stdint.h>

#include "kiln_text.h"

/* ---- Unicode classes (unicode_tables.c, generated; pretok.c) ---- */
typedef struct {
  int n;
  const uint32_t (*r)[2]; /* sorted, disjoint, inclusive [first, last] */
} kiln__uranges;
extern const kiln__uranges kiln__uletters; /* general category L* */
extern const kiln__uranges kiln__unumbers; /* general category N* */
extern const char kiln__unicode_version[];

/* The pre-tokenizer's classes of a code point: \p{L}, \p{N}, \s, anything else. */
enum { KILN__UC_OTHER = 0, KILN__UC_LETTER = 1, KILN__UC_NUMBER = 2, KILN__UC_SPACE = 3 };
int kiln__uclass(int32_t cp);

/* Calls fn(ctx, start, len) for each piece GPT-2's pre-tokenizer regex
**   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
** splits s[0, n) into, in order; the pieces cover s. A byte that is no valid UTF-8 is a
** character of its own of the class "other". Stops at fn's first nonzero return and
** returns it; 0 otherwise. */
typedef int (*kiln__piece_fn)(void *ctx, const char *s, size_t n);
int kiln__pretokenize(const char *s, size_t n, kiln__piece_fn fn, void *ctx);

/* ---- the JSON reader (json.c) ----
** A cursor over a whole file in memory; errors name the file, the line and the byte
** offset of the cursor (kiln_set_error with KILN_ERR_FORMAT) and make every later call
** fail. Strings are decoded (escapes, \u surrogate pairs) into jr->buf, valid until the
** next string is read. */
typedef struct {
  const char *what;  /* the function name that prefixes the errors */
  const char *path;  /* the file, for the errors */
  const char *s;
  size_t n, pos;
  int failed;
  kiln_status code; /* of the next error: KILN_ERR_FORMAT unless the caller sets another */
  size_t key_pos;   /* the offset of the last member name kiln__jr_member read */
  char *buf;
  size_t len, cap; /* the last string read: buf[0, len), NUL-terminated */
} kiln__jreader;

void kiln__jr_init(kiln__jreader *jr, const char *what, const char *path, const char *s, size_t n);
void kiln__jr_release(kiln__jreader *jr);
/* Sets the error "what: path:LINE: byte OFF: msg" at offset off. Returns KILN_ERR_FORMAT. */
kiln_status kiln__jr_fail_at(kiln__jreader *jr, size_t off, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
/* The next non-space byte (0 at the end), not consumed. */
int kiln__jr_peek(kiln__jreader *jr);
/* Consumes byte c after spaces; 0 and an error naming what was expected otherwise. */
int kiln__jr_expect(kiln__jreader *jr, int c);
/* Consumes c after spaces when it is next: 1; else 0, nothing consumed. */
int kiln__jr_accept(kiln__jreader *jr, int c);
int kiln__jr_string(kiln__jreader *jr);             /* a string into jr->buf; 1 on success */
int kiln__jr_int(kiln__jreader *jr, int64_t *v);    /* an integer (no fraction/exponent) */
int kiln__jr_skip(kiln__jreader *jr);               /* any value */
/* Object members: call kiln__jr_object_begin, then kiln__jr_member while it returns 1
** (the key is in jr->buf, the cursor on the value, which the caller must read or skip);
** 0 at the closing brace, -1 on an error. */
int kiln__jr_object_begin(kiln__jreader *jr);
int kiln__jr_member(kiln__jreader *jr, int *first);
/* Arrays likewise: 1 with the cursor on the next element, 0 at ']', -1 on an error. */
int kiln__jr_array_begin(kiln__jreader *jr);
int kiln__jr_element(kiln__jreader *jr, int *first);

#endif
