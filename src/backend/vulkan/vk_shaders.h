/* The embedded SPIR-V modules (generated vk_spirv.c, from the shaders folder by glslc). */
#ifndef KILN_VK_SHADERS_H
#define KILN_VK_SHADERS_H

#include <stddef.h>
#include <stdint.h>

typedef struct kiln__vk_shader {
  const char *name; /* the .comp file's name without the extension */
  const uint32_t *code;
  size_t words;
} kiln__vk_shader;

extern const kiln__vk_shader kiln__vk_shaders[];
extern const int kiln__vk_shader_count;

#endif
