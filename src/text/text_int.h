/* Private header of the text layer (src/text/): the Unicode tables and the pre-tokenizer;
** the JSON cursor the tokenizer files are read with is io's (ext/kiln_ext.h). Not API. */
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

#endif
