/*
** kiln_text — text for language models: GPT-2's byte-level BPE tokenizer.
**
** Built only on the public API (kiln.h). Errors are values: NULL or a status code, with
** the thread-local last error naming the file, the line and the byte offset of what is
** wrong (kiln_last_error_message()). Freeing NULL is a no-op.
**
**   kiln_tokenizer *tok = kiln_tokenizer_load("vocab.json", "merges.txt");
**   // or kiln_tokenizer_load_json("tokenizer.json")
**   int32_t *ids; int64_t n;
**   if (kiln_tokenizer_encode(tok, text, strlen(text), &ids, &n) != KILN_OK) ...
**   char *back; size_t len;
**   kiln_tokenizer_decode(tok, ids, n, &back, &len);    // back[0, len) == text
**   kiln_tokenizer_buffer_free(back);
**   kiln_tokenizer_buffer_free(ids);
**   kiln_tokenizer_free(tok);
**
** The files, as Hugging Face `tokenizers` (and OpenAI's GPT-2 release) write them:
**   vocab.json      one JSON object, token -> id. A token is written in the byte-level
**                   alphabet: each byte of the text is one character (bytes that print
**                   as themselves in Latin-1 map to themselves, the others to U+0100..;
**                   a space is 'Ġ', U+0120).
**   merges.txt      an optional first line "#version: ...", then one merge per line, two
**                   tokens separated by one space ("Ġ t"), highest priority first; the
**                   pair's concatenation must be in the vocabulary.
**   tokenizer.json  one object: "added_tokens" (special tokens, matched whole in the text
**                   before anything else), "model" {"type": "BPE", "vocab": {...},
**                   "merges": ["a b", ...] or [["a", "b"], ...]}, a ByteLevel
**                   pre-tokenizer; "normalizer" must be null.
**
** Encoding is Hugging Face's for these files (tests/test_tokenizer.c checks the ids on a
** 1 MB text): special tokens are split out first; the rest is cut by GPT-2's regex
** ('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+), each piece
** mapped to the byte-level alphabet and merged by rank. The Unicode classes come from
** tables generated with Unicode 14.0 (kiln_tokenizer_unicode_version()). The text is
** bytes: invalid UTF-8 is encoded too, one byte at a time, and decodes back unchanged.
** Special tokens: from tokenizer.json, its added_tokens; from vocab.json, the entry
** "<|endoftext|>" when present.
*/
#ifndef KILN_TEXT_H
#define KILN_TEXT_H

#include <stddef.h>
#include <stdint.h>

#include "kiln.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kiln_tokenizer kiln_tokenizer;

/* Loads GPT-2's file pair. NULL on failure with KILN_ERR_IO (a file that cannot be read),
** KILN_ERR_FORMAT (the message names the file, the line and the byte offset: a JSON
** error, an id that is not an integer in [0, 2^31) or given twice, a token with a
** character outside the byte-level alphabet, a merge line that is not two tokens
** separated by one space, a merge of a token that is not in the vocabulary or whose
** result is not, a byte with no token, a special token whose id the vocabulary gives to
** another token), KILN_ERR_OOM. Free with kiln_tokenizer_free. */
KILN_API kiln_tokenizer *kiln_tokenizer_load(const char *vocab_json, const char *merges_txt);
/* The same from Hugging Face's single file; KILN_ERR_UNSUPPORTED names a setting kiln
** does not implement (a normalizer, a model other than BPE, add_prefix_space, dropout). */
KILN_API kiln_tokenizer *kiln_tokenizer_load_json(const char *tokenizer_json);
KILN_API void kiln_tokenizer_free(kiln_tokenizer *tok); /* NULL is a no-op */

/* One more than the largest id (ids without a token are possible, and refused by
** decode). */
KILN_API int64_t kiln_tokenizer_vocab_size(const kiln_tokenizer *tok);
/* The id of a token written in the byte-level alphabet ("Ġthe") or of a special token
** ("<|endoftext|>"); -1 when there is none. */
KILN_API int32_t kiln_tokenizer_token_id(const kiln_tokenizer *tok, const char *token);
/* The id of "<|endoftext|>", -1 when the vocabulary has none. */
KILN_API int32_t kiln_tokenizer_eos_id(const kiln_tokenizer *tok);
/* "14.0.0": the Unicode version of the letter and number tables. */
KILN_API const char *kiln_tokenizer_unicode_version(void);

/* Encodes text[0, len) (any bytes; text may be NULL when len is 0). On success *ids is a
** new array of *n ids that the caller frees with kiln_tokenizer_buffer_free; an empty
** text gives *n = 0 and *ids = NULL (a model's generate must refuse a prompt of 0 tokens
** itself: there is no position to start from). Errors: KILN_ERR_INVALID_ARGUMENT (NULL
** arguments), KILN_ERR_OOM; *ids is NULL and *n 0 then. Encoding uses the tokenizer's
** cache of recent pieces, so one tokenizer encodes on one thread at a time. */
KILN_API kiln_status kiln_tokenizer_encode(kiln_tokenizer *tok, const char *text, size_t len,
                                           int32_t **ids, int64_t *n);
/* Decodes ids[0, n) into *text, a new NUL-terminated buffer of *len bytes (the NUL not
** counted) that the caller frees with kiln_tokenizer_buffer_free. The bytes are the
** tokens' bytes exactly; ids that cut a character in two give bytes that are not UTF-8.
** Errors: KILN_ERR_INDEX naming the position and the id when an id is negative, past the
** vocabulary or without a token; KILN_ERR_INVALID_ARGUMENT, KILN_ERR_OOM. Safe to call
** from several threads at once. */
KILN_API kiln_status kiln_tokenizer_decode(const kiln_tokenizer *tok, const int32_t *ids, int64_t n,
                                           char **text, size_t *len);
/* Frees what encode and decode returned. NULL is a no-op. */
KILN_API void kiln_tokenizer_buffer_free(void *p);

#ifdef __cplusplus
}
#endif

#endif
