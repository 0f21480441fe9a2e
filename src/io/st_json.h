/*
** The JSON the safetensors header needs. With cJSON (KILN_HAVE_CJSON) this is cJSON;
** without it, a small strict parser (st_json.c) provides the same subset under the same
** names: parse with a length, walk child/next, read string/valuestring/valuedouble.
*/
#ifndef KILN_ST_JSON_H
#define KILN_ST_JSON_H

#ifdef KILN_HAVE_CJSON
#include <cjson/cJSON.h>
#else
#include <stddef.h>

typedef struct kiln__json {
  struct kiln__json *next, *child;
  int type;          /* KILN__JSON_* */
  char *valuestring; /* strings */
  double valuedouble;
  char *string; /* the key, for members of an object */
} kiln__json;

enum { KILN__JSON_NULL = 1, KILN__JSON_FALSE, KILN__JSON_TRUE, KILN__JSON_NUMBER,
       KILN__JSON_STRING, KILN__JSON_ARRAY, KILN__JSON_OBJECT };

/* Parses one JSON value from s[0..n) (leading whitespace allowed); *end gets the first
** byte after it, or the position of the error. NULL on a syntax error or OOM. */
kiln__json *kiln__json_parse(const char *s, size_t n, const char **end);
void kiln__json_delete(kiln__json *j);
kiln__json *kiln__json_get(const kiln__json *obj, const char *key);
int kiln__json_array_size(const kiln__json *a);

#define cJSON kiln__json
#define cJSON_ParseWithLengthOpts(s, n, end, req) kiln__json_parse((s), (n), (end))
#define cJSON_Delete kiln__json_delete
#define cJSON_GetObjectItemCaseSensitive kiln__json_get
#define cJSON_GetArraySize kiln__json_array_size
#define cJSON_IsObject(j) ((j) && (j)->type == KILN__JSON_OBJECT)
#define cJSON_IsArray(j) ((j) && (j)->type == KILN__JSON_ARRAY)
#define cJSON_IsString(j) ((j) && (j)->type == KILN__JSON_STRING)
#define cJSON_IsNumber(j) ((j) && (j)->type == KILN__JSON_NUMBER)
#define cJSON_IsNull(j) ((j) && (j)->type == KILN__JSON_NULL)
#endif

#endif /* KILN_ST_JSON_H */
