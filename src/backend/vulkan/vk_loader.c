/*
** The Vulkan loader, opened at run time (dlopen), so that libkiln needs no libvulkan to
** load and "no loader" is a message, not a failed program start. Functions come in three
** levels, as the loader hands them out: global (no instance), instance, device.
*/
#define _GNU_SOURCE
#include "vk_int.h"

#include <dlfcn.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

kiln__vk_api kiln__vk;

bool kiln__vk_load(const char **why, char *path_out, size_t path_n) {
  static const char *const names[] = {
#if defined(__APPLE__)
      /* the Vulkan SDK's loader, then MoltenVK itself (an ICD that is also a loader) */
      "libvulkan.1.dylib", "libvulkan.dylib", "libMoltenVK.dylib",
#else
      "libvulkan.so.1", "libvulkan.so",
#endif
  };
  const char *env = kiln__knob_text("KILN_VULKAN_LOADER"); /* a loader elsewhere, or a test's bad path */
  void *lib = NULL;
  const char *used = NULL;
  if (env && *env) {
    lib = dlopen(env, RTLD_NOW | RTLD_LOCAL);
    used = env;
  } else {
    for (size_t i = 0; i < sizeof names / sizeof names[0] && !lib; i++) {
      lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
      used = names[i];
    }
  }
  if (!lib) {
    *why = env && *env ? "no Vulkan loader at KILN_VULKAN_LOADER"
#if defined(__APPLE__)
                       : "no Vulkan loader (install the Vulkan SDK or MoltenVK: brew install molten-vk vulkan-loader)";
#else
                       : "no Vulkan loader (install libvulkan1 and a driver: apt install libvulkan1 mesa-vulkan-drivers)";
#endif
    return false;
  }
  if (path_out && path_n) snprintf(path_out, path_n, "%s", used);
  kiln__vk.lib = lib;
  /* the one symbol a loader exports for sure; everything else comes through it */
  void *sym = dlsym(lib, "vkGetInstanceProcAddr");
  memcpy(&kiln__vk.vkGetInstanceProcAddr, &sym, sizeof sym);
  if (!kiln__vk.vkGetInstanceProcAddr) {
    *why = "the Vulkan loader has no vkGetInstanceProcAddr (not a Vulkan loader?)";
    dlclose(lib);
    kiln__vk.lib = NULL;
    return false;
  }
#define KILN_VK_LOAD_G(name) kiln__vk.name = (PFN_##name)kiln__vk.vkGetInstanceProcAddr(NULL, #name);
  KILN_VK_GLOBAL_FNS(KILN_VK_LOAD_G)
#undef KILN_VK_LOAD_G
  if (!kiln__vk.vkCreateInstance || !kiln__vk.vkEnumerateInstanceExtensionProperties) {
    *why = "the Vulkan loader lacks vkCreateInstance";
    return false;
  }
  return true;
}

bool kiln__vk_load_instance(VkInstance inst, const char **why) {
#define KILN_VK_LOAD_I(name)                                                             \
  kiln__vk.name = (PFN_##name)kiln__vk.vkGetInstanceProcAddr(inst, #name);             \
  if (!kiln__vk.name) {                                                                  \
    *why = "the Vulkan loader lacks " #name " (a Vulkan 1.2 loader is needed)";          \
    return false;                                                                        \
  }
  KILN_VK_INSTANCE_FNS(KILN_VK_LOAD_I)
#undef KILN_VK_LOAD_I
  return true;
}

/* Device functions through vkGetDeviceProcAddr skip the loader's dispatch. With several
** devices the pointers of the first device would be wrong for the others, so they are
** loaded per instance instead (the loader's trampolines work for every device). */
bool kiln__vk_load_device(VkDevice dev, const char **why) {
  (void)dev;
#define KILN_VK_LOAD_D(name)                                                             \
  kiln__vk.name = (PFN_##name)kiln__vk.vkGetInstanceProcAddr(kiln__vk_instance(), #name); \
  if (!kiln__vk.name) {                                                                  \
    *why = "the Vulkan loader lacks " #name " (a Vulkan 1.2 loader is needed)";          \
    return false;                                                                        \
  }
  KILN_VK_DEVICE_FNS(KILN_VK_LOAD_D)
#undef KILN_VK_LOAD_D
  return true;
}

const char *kiln__vk_result_str(VkResult r) {
  switch (r) {
#define KILN_VK_R(x) case x: return #x;
    KILN_VK_R(VK_SUCCESS)
    KILN_VK_R(VK_NOT_READY)
    KILN_VK_R(VK_TIMEOUT)
    KILN_VK_R(VK_INCOMPLETE)
    KILN_VK_R(VK_ERROR_OUT_OF_HOST_MEMORY)
    KILN_VK_R(VK_ERROR_OUT_OF_DEVICE_MEMORY)
    KILN_VK_R(VK_ERROR_INITIALIZATION_FAILED)
    KILN_VK_R(VK_ERROR_DEVICE_LOST)
    KILN_VK_R(VK_ERROR_MEMORY_MAP_FAILED)
    KILN_VK_R(VK_ERROR_LAYER_NOT_PRESENT)
    KILN_VK_R(VK_ERROR_EXTENSION_NOT_PRESENT)
    KILN_VK_R(VK_ERROR_FEATURE_NOT_PRESENT)
    KILN_VK_R(VK_ERROR_INCOMPATIBLE_DRIVER)
    KILN_VK_R(VK_ERROR_TOO_MANY_OBJECTS)
    KILN_VK_R(VK_ERROR_FORMAT_NOT_SUPPORTED)
    KILN_VK_R(VK_ERROR_FRAGMENTED_POOL)
    KILN_VK_R(VK_ERROR_UNKNOWN)
    KILN_VK_R(VK_ERROR_OUT_OF_POOL_MEMORY)
    KILN_VK_R(VK_ERROR_INVALID_EXTERNAL_HANDLE)
    KILN_VK_R(VK_ERROR_FRAGMENTATION)
    KILN_VK_R(VK_ERROR_INVALID_OPAQUE_CAPTURE_ADDRESS)
    KILN_VK_R(VK_ERROR_INVALID_SHADER_NV)
#undef KILN_VK_R
  default: return "VkResult(?)";
  }
}
