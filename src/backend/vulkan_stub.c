/*
** kiln_vulkan_info_get, kiln_vulkan_matmul_path and kiln_vulkan_coop_shapes in a build without the Vulkan backend (src/backend/vulkan/ is
** left out of the library then, and this file is all that answers).
*/
#include "kiln.h"

#include <string.h>

#ifndef KILN_HAVE_VULKAN
kiln_status kiln_vulkan_info_get(int index, kiln_vulkan_info *out) {
  if (out) memset(out, 0, sizeof *out);
  return kiln_set_error(KILN_ERR_DEVICE, "kiln_vulkan_info_get: no device vulkan:%d (kiln was built without Vulkan)",
                        index);
}

kiln_status kiln_vulkan_matmul_path(int index, kiln_dtype dtype, int64_t m, int64_t n, int64_t k, char *out,
                                    size_t out_n) {
  (void)dtype, (void)m, (void)n, (void)k;
  if (out && out_n) out[0] = 0;
  return kiln_set_error(KILN_ERR_DEVICE,
                        "kiln_vulkan_matmul_path: no device vulkan:%d (kiln was built without Vulkan)", index);
}

kiln_status kiln_vulkan_coop_shapes(int index, char *out, size_t out_n) {
  if (out && out_n) out[0] = 0;
  return kiln_set_error(KILN_ERR_DEVICE,
                        "kiln_vulkan_coop_shapes: no device vulkan:%d (kiln was built without Vulkan)", index);
}
#else
typedef int kiln__vulkan_stub_unused; /* ISO C wants a translation unit to declare something */
#endif
