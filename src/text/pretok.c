/* GPT-2's pre-tokenizer, the regex
**   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
** as Hugging Face's ByteLevel pre-tokenizer runs it (Oniguruma, leftmost-first
** alternation, non-overlapping matches from the start), written out by hand: at each
** position the alternatives are tried in the regex's order. Every character is \s, L, N
** or "other", so the matches cover the text. \s is Unicode White_Space (Oniguruma's \s
** for UTF-8); L and N are the general categories, from the generated tables. */
#include "text_int.h"

static int in_ranges(const kiln__uranges *t, uint32_t cp) {
  int lo = 0, hi = t->n - 1;
  while (lo <= hi) {
    int mid = (lo + hi) / 2;
    if (cp < t->r[mid][0]) hi = mid - 1;
    else if (cp > t->r[mid][1]) lo = mid + 1;
    else return 1;
  }
  return 0;
}

static int is_white_space(int32_t cp) {
  /* The White_Space property (PropList.txt; unchanged since Unicode 6.3). */
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

int kiln__uclass(int32_t cp) {
  if (cp < 0) return KILN__UC_OTHER;
  if (cp < 0x80) {
    if ((cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z')) return KILN__UC_LETTER;
    if (cp >= '0' && cp <= '9') return KILN__UC_NUMBER;
    if (cp == ' ' || (cp >= 0x09 && cp <= 0x0D)) return KILN__UC_SPACE;
    return KILN__UC_OTHER;
  }
  if (is_white_space(cp)) return KILN__UC_SPACE;
  if (in_ranges(&kiln__uletters, (uint32_t)cp)) return KILN__UC_LETTER;
  if (in_ranges(&kiln__unumbers, (uint32_t)cp)) return KILN__UC_NUMBER;
  return KILN__UC_OTHER;
}

/* The code point at s[0, n) (n > 0) and its length in bytes; -1 and length 1 for a byte
** that starts no valid UTF-8 sequence (overlong forms, surrogates and values past
** U+10FFFF included). */
static int32_t next_cp(const unsigned char *s, size_t n, size_t *len) {
  unsigned c = s[0];
  *len = 1;
  if (c < 0x80) return (int32_t)c;
  size_t k;
  uint32_t cp, min;
  if (c >= 0xC2 && c <= 0xDF) k = 2, cp = c & 0x1F, min = 0x80;
  else if (c >= 0xE0 && c <= 0xEF) k = 3, cp = c & 0x0F, min = 0x800;
  else if (c >= 0xF0 && c <= 0xF4) k = 4, cp = c & 0x07, min = 0x10000;
  else return -1;
  if (k > n) return -1;
  for (size_t i = 1; i < k; i++) {
    if ((s[i] & 0xC0) != 0x80) return -1;
    cp = cp << 6 | (s[i] & 0x3F);
  }
  if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp < 0xE000)) return -1;
  *len = k;
  return (int32_t)cp;
}

/* The class of the character at p (and its length), or -1 at the end. */
static int class_at(const unsigned char *s, size_t n, size_t p, size_t *len) {
  if (p >= n) {
    *len = 0;
    return -1;
  }
  if (s[p] < 0x80) { /* the common case, without the decoder */
    *len = 1;
    return kiln__uclass(s[p]);
  }
  return kiln__uclass(next_cp(s + p, n - p, len));
}

/* The end of the run of characters of class k that starts at p. */
static size_t run_of(const unsigned char *s, size_t n, size_t p, int k) {
  size_t len;
  while (class_at(s, n, p, &len) == k) p += len;
  return p;
}

int kiln__pretokenize(const char *text, size_t n, kiln__piece_fn fn, void *ctx) {
  const unsigned char *s = (const unsigned char *)text;
  size_t p = 0, len, len1;
  while (p < n) {
    size_t end;
    /* 's|'t|'re|'ve|'m|'ll|'d */
    if (s[p] == '\'' && p + 1 < n) {
      unsigned char a = s[p + 1], b = p + 2 < n ? s[p + 2] : 0;
      if (a == 's' || a == 't' || a == 'm' || a == 'd') {
        end = p + 2;
        goto emit;
      }
      if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) {
        end = p + 3;
        goto emit;
      }
    }
    int k = class_at(s, n, p, &len);
    /* ' ?\p{L}+', ' ?\p{N}+', ' ?[^\s\p{L}\p{N}]+' with the optional space */
    if (s[p] == ' ') {
      int k1 = class_at(s, n, p + 1, &len1);
      if (k1 == KILN__UC_LETTER || k1 == KILN__UC_NUMBER || k1 == KILN__UC_OTHER) {
        end = run_of(s, n, p + 1, k1);
        goto emit;
      }
    }
    if (k != KILN__UC_SPACE) {
      end = run_of(s, n, p, k);
      goto emit;
    }
    /* '\s+(?!\S)': the whole run at the end of the text, else the run less its last
    ** character (which the next piece takes, e.g. ' ' + word); '\s+' when that is empty */
    {
      size_t q = p, last = p;
      while (class_at(s, n, q, &len) == KILN__UC_SPACE) {
        last = q;
        q += len;
      }
      end = q >= n || last == p ? q : last;
    }
  emit:;
    int r = fn(ctx, text + p, end - p);
    if (r) return r;
    p = end;
  }
  return 0;
}
