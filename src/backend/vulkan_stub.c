/*
** kiln_vulkan_info_get in a build without the Vulkan backend (src/backend/vulkan/ is
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
#else
typedef int kiln__vulkan_stub_unused; /* ISO C wants a translation unit to declare something */
#endif
