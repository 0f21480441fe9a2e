/*
** The Vulkan backend: the probe (loader, instance, devices), the vtable, copies and
** synchronization. vk_int.h has the design in one paragraph.
*/
#define _GNU_SOURCE
#include "vk_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static VkInstance instance;
static vk_dev devs[KILN_VK_MAX_DEVICES];
static int n_devs;
static char loader_path[256];
static uint32_t instance_version;
/* Why devices were skipped (for the probe's message and kiln doctor). */
static char skipped[512];

int kiln__vk_count(void) { return n_devs; }
vk_dev *kiln__vk_dev(int i) { return i >= 0 && i < n_devs ? &devs[i] : NULL; }
VkInstance kiln__vk_instance(void) { return instance; }
const char *kiln__vk_loader_path(void) { return loader_path; }
int kiln__vk_api_version(void) { return (int)instance_version; }
const char *kiln__vk_skipped(void);
const char *kiln__vk_skipped(void) { return skipped; }

kiln_status kiln__vk_fail(vk_dev *d, int index, VkResult r, const char *what) {
  if (r == VK_ERROR_DEVICE_LOST) {
    if (d) d->lost = true;
    return kiln_set_error(KILN_ERR_DEVICE,
                          "kiln: vulkan:%d was lost (VK_ERROR_DEVICE_LOST) in %s: the driver "
                          "reset the device (a fault, or a kernel that ran too long); its tensors "
                          "are gone and it refuses further work until the program restarts; the "
                          "CPU and other devices still work",
                          index, what);
  }
  if (r == VK_ERROR_OUT_OF_DEVICE_MEMORY || r == VK_ERROR_OUT_OF_HOST_MEMORY)
    return kiln_set_error(KILN_ERR_OOM, "kiln: vulkan:%d: %s failed: %s", index, what,
                          kiln__vk_result_str(r));
  return kiln_set_error(KILN_ERR_DEVICE, "kiln: vulkan:%d: %s failed: %s", index, what,
                        kiln__vk_result_str(r));
}

kiln_status kiln__vk_check_lost(vk_dev *d, int index) {
  if (!d) return kiln_set_error(KILN_ERR_DEVICE, "kiln: no device vulkan:%d", index);
  if (d->lost)
    return kiln_set_error(KILN_ERR_DEVICE,
                          "kiln: vulkan:%d was lost earlier (VK_ERROR_DEVICE_LOST); restart the "
                          "program to use it again (the CPU still works)", index);
  return KILN_OK;
}

/* ---- the probe ---- */
static bool has_ext(const VkExtensionProperties *e, uint32_t n, const char *name) {
  for (uint32_t i = 0; i < n; i++)
    if (strcmp(e[i].extensionName, name) == 0) return true;
  return false;
}

static int type_order(VkPhysicalDeviceType t) {
  switch (t) {
  case VK_PHYSICAL_DEVICE_TYPE_DISCRETE_GPU: return 0;
  case VK_PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU: return 1;
  case VK_PHYSICAL_DEVICE_TYPE_VIRTUAL_GPU: return 2;
  case VK_PHYSICAL_DEVICE_TYPE_CPU: return 3;
  default: return 4;
  }
}

static void skip_note(const char *name, const char *why) {
  size_t k = strlen(skipped);
  snprintf(skipped + k, sizeof skipped - k, "%s%s: %s", k ? "; " : "", name, why);
}

static int find_type(const VkPhysicalDeviceMemoryProperties *mp, uint32_t bits,
                     VkMemoryPropertyFlags need, VkMemoryPropertyFlags avoid, uint64_t *heap) {
  int best = -1;
  uint64_t best_heap = 0;
  for (uint32_t i = 0; i < mp->memoryTypeCount; i++) {
    VkMemoryPropertyFlags f = mp->memoryTypes[i].propertyFlags;
    if (!(bits & (1u << i)) || (f & need) != need || (f & avoid)) continue;
    uint64_t h = mp->memoryHeaps[mp->memoryTypes[i].heapIndex].size;
    if (best < 0 || h > best_heap) best = (int)i, best_heap = h;
  }
  if (heap) *heap = best_heap;
  return best;
}

static const char *nv_type(VkComponentTypeNV t) {
  switch (t) {
  case VK_COMPONENT_TYPE_FLOAT16_NV: return "f16";
  case VK_COMPONENT_TYPE_FLOAT32_NV: return "f32";
  case VK_COMPONENT_TYPE_FLOAT64_NV: return "f64";
  case VK_COMPONENT_TYPE_SINT8_NV: return "s8";
  case VK_COMPONENT_TYPE_UINT8_NV: return "u8";
  case VK_COMPONENT_TYPE_SINT32_NV: return "s32";
  case VK_COMPONENT_TYPE_UINT32_NV: return "u32";
  default: return "?";
  }
}

/* Whether VK_NV_cooperative_matrix has the one shape matmul_cm.comp uses: 16x16x16,
** f16 A and B, f32 C and D, subgroup scope. Lists every shape offered in d->coop_shapes
** (kiln doctor prints them: the first thing to read when tensor cores do not engage). */
static bool coop_nv_f16(vk_dev *d) {
  PFN_vkGetPhysicalDeviceCooperativeMatrixPropertiesNV fn =
      (PFN_vkGetPhysicalDeviceCooperativeMatrixPropertiesNV)VK->vkGetInstanceProcAddr(
          instance, "vkGetPhysicalDeviceCooperativeMatrixPropertiesNV");
  if (!fn) {
    snprintf(d->coop_shapes, sizeof d->coop_shapes, "(vkGetPhysicalDeviceCooperativeMatrixPropertiesNV missing)");
    return false;
  }
  uint32_t n = 0;
  if (fn(d->pd, &n, NULL) != VK_SUCCESS || n == 0) return false;
  VkCooperativeMatrixPropertiesNV *p = calloc(n, sizeof *p);
  if (!p) return false;
  for (uint32_t i = 0; i < n; i++) p[i].sType = VK_STRUCTURE_TYPE_COOPERATIVE_MATRIX_PROPERTIES_NV;
  bool ok = false;
  if (fn(d->pd, &n, p) == VK_SUCCESS)
    for (uint32_t i = 0; i < n; i++) {
      size_t k = strlen(d->coop_shapes);
      snprintf(d->coop_shapes + k, sizeof d->coop_shapes - k, "%s%ux%ux%u %s/%s/%s/%s%s", k ? ", " : "",
               p[i].MSize, p[i].NSize, p[i].KSize, nv_type(p[i].AType), nv_type(p[i].BType),
               nv_type(p[i].CType), nv_type(p[i].DType),
               p[i].scope == VK_SCOPE_SUBGROUP_NV ? "" : " (not subgroup)");
      ok = ok || (p[i].MSize == 16 && p[i].NSize == 16 && p[i].KSize == 16 &&
                  p[i].AType == VK_COMPONENT_TYPE_FLOAT16_NV && p[i].BType == VK_COMPONENT_TYPE_FLOAT16_NV &&
                  p[i].CType == VK_COMPONENT_TYPE_FLOAT32_NV && p[i].DType == VK_COMPONENT_TYPE_FLOAT32_NV &&
                  p[i].scope == VK_SCOPE_SUBGROUP_NV);
    }
  free(p);
  return ok;
}

/* Features and properties of pd; false (with why) when kiln cannot use it. */
static bool inspect(vk_dev *d, const char **why) {
  VK->vkGetPhysicalDeviceProperties(d->pd, &d->props);
  if (d->props.apiVersion < VK_API_VERSION_1_2) {
    *why = "Vulkan 1.2 is needed (the driver offers less)";
    return false;
  }
  VkPhysicalDeviceVulkan12Features f12 = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES};
  VkPhysicalDeviceVulkan11Features f11 = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES, .pNext = &f12};
  VkPhysicalDeviceFeatures2 f = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2, .pNext = &f11};
  VK->vkGetPhysicalDeviceFeatures2(d->pd, &f);
  if (!f12.bufferDeviceAddress) {
    *why = "no bufferDeviceAddress (kiln reaches tensors by device address)";
    return false;
  }
  if (!f.features.shaderInt64) {
    *why = "no shaderInt64 (needed for device addresses and i64 indices)";
    return false;
  }
  if (!f12.storageBuffer8BitAccess || !f11.storageBuffer16BitAccess) {
    *why = "no 8- or 16-bit storage buffer access (needed for bool/u8 and f16/bf16 tensors)";
    return false;
  }
  d->f64 = f.features.shaderFloat64;
  d->i16 = f.features.shaderInt16;
  d->i64 = true;
  d->f16 = f12.shaderFloat16;
  d->i8 = f12.shaderInt8;
  VkPhysicalDeviceSubgroupProperties sg = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SUBGROUP_PROPERTIES};
  VkPhysicalDeviceProperties2 p2 = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2, .pNext = &sg};
  VK->vkGetPhysicalDeviceProperties2(d->pd, &p2);
  d->subgroup_size = sg.subgroupSize;
  d->subgroup_arith = (sg.supportedStages & VK_SHADER_STAGE_COMPUTE_BIT) &&
                      (sg.supportedOperations & VK_SUBGROUP_FEATURE_ARITHMETIC_BIT) &&
                      (sg.supportedOperations & VK_SUBGROUP_FEATURE_VOTE_BIT);
  /* KILN_VK_SUBGROUP=0: the shared-memory reductions, as on a device without (tests it) */
  if (!kiln__knob_on("KILN_VK_SUBGROUP", true)) d->subgroup_arith = false;
  uint32_t ne = 0;
  VK->vkEnumerateDeviceExtensionProperties(d->pd, NULL, &ne, NULL);
  VkExtensionProperties *ext = calloc(ne ? ne : 1, sizeof *ext);
  if (ext) {
    VK->vkEnumerateDeviceExtensionProperties(d->pd, NULL, &ne, ext);
    d->coop_matrix = has_ext(ext, ne, "VK_KHR_cooperative_matrix") ||
                     has_ext(ext, ne, "VK_NV_cooperative_matrix");
    d->atomic_f32 = has_ext(ext, ne, "VK_EXT_shader_atomic_float");
    d->coop_nv = has_ext(ext, ne, "VK_NV_cooperative_matrix") && coop_nv_f16(d);
    /* KILN_VK_PIPESTATS=1: registers, spills and shared memory of each pipeline (tuning) */
    const bool ps = kiln__knob_on("KILN_VK_PIPESTATS", false);
    d->pipestats = ps && has_ext(ext, ne, "VK_KHR_pipeline_executable_properties");
    if (ps && !d->pipestats)
      fprintf(stderr, "kiln: vulkan: KILN_VK_PIPESTATS: %s has no VK_KHR_pipeline_executable_properties\n",
              d->props.deviceName);
    if (!has_ext(ext, ne, "VK_NV_cooperative_matrix"))
      snprintf(d->coop_why, sizeof d->coop_why, "%s",
               has_ext(ext, ne, "VK_KHR_cooperative_matrix")
                   ? "the device offers VK_KHR_cooperative_matrix only; kiln's shaders use the NV extension "
                     "(the build's glslc has no GL_KHR_cooperative_matrix)"
                   : "the device has no cooperative-matrix extension");
    else if (!d->coop_nv)
      snprintf(d->coop_why, sizeof d->coop_why, "VK_NV_cooperative_matrix lacks 16x16x16 f16/f16/f32/f32");
    free(ext);
  }
  uint32_t nq = 0;
  VK->vkGetPhysicalDeviceQueueFamilyProperties(d->pd, &nq, NULL);
  VkQueueFamilyProperties qf[16];
  if (nq > 16) nq = 16;
  VK->vkGetPhysicalDeviceQueueFamilyProperties(d->pd, &nq, qf);
  int fam = -1;
  for (uint32_t i = 0; i < nq && fam < 0; i++)
    if (qf[i].queueFlags & VK_QUEUE_COMPUTE_BIT) fam = (int)i;
  if (fam < 0) {
    *why = "no compute queue";
    return false;
  }
  d->qfam = (uint32_t)fam;
  d->ts_bits = qf[fam].timestampValidBits;
  VK->vkGetPhysicalDeviceMemoryProperties(d->pd, &d->memprops);
  return true;
}

static bool open_device(vk_dev *d, int index, const char **why) {
  VkPhysicalDeviceVulkan12Features f12 = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES,
                                          .bufferDeviceAddress = VK_TRUE,
                                          .storageBuffer8BitAccess = VK_TRUE,
                                          .shaderFloat16 = d->f16,
                                          .shaderInt8 = d->i8};
  VkPhysicalDeviceVulkan11Features f11 = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES,
                                          .pNext = &f12,
                                          .storageBuffer16BitAccess = VK_TRUE};
  VkPhysicalDeviceFeatures2 f = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2, .pNext = &f11};
  f.features.shaderInt64 = VK_TRUE;
  f.features.shaderFloat64 = d->f64;
  f.features.shaderInt16 = d->i16;
  float prio = 1.0f;
  VkDeviceQueueCreateInfo q = {.sType = VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO,
                               .queueFamilyIndex = d->qfam,
                               .queueCount = 1,
                               .pQueuePriorities = &prio};
  VkDeviceCreateInfo ci = {.sType = VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO,
                           .pNext = &f,
                           .queueCreateInfoCount = 1,
                           .pQueueCreateInfos = &q};
  /* Tensor cores through VK_NV_cooperative_matrix, on wherever the device offers the
  ** shape matmul_cm.comp uses; KILN_VK_COOPMAT=0 turns them off (an A/B switch, and a way
  ** out should a driver miscompile it). A device that refuses the feature is opened
  ** without it. */
  d->cm_variant = kiln__vk_cm_variant(kiln__knob_text("KILN_VK_CM"));
  d->mm_k16 = kiln__knob_choice("KILN_VK_MMBK", 0) == 1; /* 8, 16 */
  const bool cm_off = !kiln__knob_on("KILN_VK_COOPMAT", true);
  VkPhysicalDeviceCooperativeMatrixFeaturesNV cm = {
      .sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_FEATURES_NV, .cooperativeMatrix = VK_TRUE};
  const char *cm_ext[2] = {"VK_NV_cooperative_matrix", "VK_KHR_pipeline_executable_properties"};
  VkResult r = VK_ERROR_FEATURE_NOT_PRESENT;
  /* the statistics (d->pipestats) ride in front of whatever else the device is opened with */
  VkPhysicalDevicePipelineExecutablePropertiesFeaturesKHR pe = {
      .sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PIPELINE_EXECUTABLE_PROPERTIES_FEATURES_KHR,
      .pNext = &f,
      .pipelineExecutableInfo = VK_TRUE};
  if (d->pipestats) {
    ci.pNext = &pe;
    ci.enabledExtensionCount = 1;
    ci.ppEnabledExtensionNames = cm_ext + 1;
  }
  d->coop_on = false;
  if (d->coop_nv && cm_off) snprintf(d->coop_why, sizeof d->coop_why, "off: KILN_VK_COOPMAT=0");
  else if (d->coop_nv && !d->f16) snprintf(d->coop_why, sizeof d->coop_why, "the device has no shaderFloat16");
  else if (d->coop_nv && d->subgroup_size != 32)
    snprintf(d->coop_why, sizeof d->coop_why, "subgroups of %u (matmul_cm.comp needs 32)", d->subgroup_size);
  if (d->coop_nv && d->f16 && !cm_off && d->subgroup_size == 32) {
    f12.pNext = &cm;
    ci.enabledExtensionCount = d->pipestats ? 2 : 1;
    ci.ppEnabledExtensionNames = cm_ext;
    r = VK->vkCreateDevice(d->pd, &ci, NULL, &d->dev);
    d->coop_on = r == VK_SUCCESS;
    if (!d->coop_on)
      snprintf(d->coop_why, sizeof d->coop_why, "vkCreateDevice with VK_NV_cooperative_matrix failed: %s",
               kiln__vk_result_str(r));
    f12.pNext = NULL;
    ci.enabledExtensionCount = d->pipestats ? 1 : 0;
    ci.ppEnabledExtensionNames = d->pipestats ? cm_ext + 1 : NULL;
  }
  if (!d->coop_on) r = VK->vkCreateDevice(d->pd, &ci, NULL, &d->dev);
  d->cm_emu = !d->coop_on && kiln__knob_on("KILN_VK_CM_EMU", false) && d->f16 && !cm_off;
  if (r != VK_SUCCESS && d->pipestats) { /* the statistics are a tuning aid: never a reason to fail */
    d->pipestats = false;
    ci.pNext = &f;
    ci.enabledExtensionCount = 0;
    ci.ppEnabledExtensionNames = NULL;
    r = VK->vkCreateDevice(d->pd, &ci, NULL, &d->dev);
  }
  if (r != VK_SUCCESS) {
    *why = "vkCreateDevice failed";
    return false;
  }
  VK->vkGetDeviceQueue(d->dev, d->qfam, 0, &d->queue);
  pthread_mutex_init(&d->lock, NULL);

  /* Memory types: a buffer's allowed types, then the kind of memory kiln wants. */
  VkBufferCreateInfo bi = {.sType = VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO,
                           .size = 4096,
                           .usage = VK_BUFFER_USAGE_STORAGE_BUFFER_BIT | VK_BUFFER_USAGE_TRANSFER_SRC_BIT |
                                    VK_BUFFER_USAGE_TRANSFER_DST_BIT |
                                    VK_BUFFER_USAGE_SHADER_DEVICE_ADDRESS_BIT};
  VkBuffer tb;
  if (VK->vkCreateBuffer(d->dev, &bi, NULL, &tb) != VK_SUCCESS) {
    *why = "vkCreateBuffer failed";
    return false;
  }
  VkMemoryRequirements mr;
  VK->vkGetBufferMemoryRequirements(d->dev, tb, &mr);
  VK->vkDestroyBuffer(d->dev, tb, NULL);
  const VkMemoryPropertyFlags DL = VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT,
                              HV = VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | VK_MEMORY_PROPERTY_HOST_COHERENT_BIT;
  uint64_t heap_dl = 0, heap_uni = 0;
  int t_dl = find_type(&d->memprops, mr.memoryTypeBits, DL, 0, &heap_dl);
  int t_uni = find_type(&d->memprops, mr.memoryTypeBits, DL | HV, 0, &heap_uni);
  /* Unified memory: the host-visible device-local type lives on the biggest device-local
  ** heap (integrated GPUs, Apple Silicon, lavapipe), not a 256 MiB BAR window of a
  ** discrete GPU. Then tensors are mapped and host copies are memcpy. */
  d->unified = t_uni >= 0 && heap_uni >= heap_dl &&
               d->props.deviceType != VK_PHYSICAL_DEVICE_TYPE_DISCRETE_GPU;
  if (d->unified) {
    d->mem_type = (uint32_t)t_uni;
    d->heap_size = heap_uni;
  } else if (t_dl >= 0) {
    d->mem_type = (uint32_t)t_dl;
    d->heap_size = heap_dl;
  } else {
    int t = find_type(&d->memprops, mr.memoryTypeBits, HV, 0, &d->heap_size);
    if (t < 0) {
      *why = "no usable memory type";
      return false;
    }
    d->mem_type = (uint32_t)t;
    d->unified = true;
  }
  int th = find_type(&d->memprops, mr.memoryTypeBits, HV | VK_MEMORY_PROPERTY_HOST_CACHED_BIT, 0, NULL);
  if (th < 0) th = find_type(&d->memprops, mr.memoryTypeBits, HV, 0, NULL);
  if (th < 0) {
    *why = "no host-visible memory type";
    return false;
  }
  d->host_type = (uint32_t)th;
  int tr = find_type(&d->memprops, mr.memoryTypeBits, DL | HV, 0, NULL);
  d->ring_type = tr >= 0 ? (uint32_t)tr : d->host_type;
  if (kiln__vk_submit_init(d, index) != KILN_OK) {
    *why = "cannot create command buffers or the parameter ring";
    kiln_clear_error();
    return false;
  }
  d->pipes = calloc((size_t)kiln__vk_shader_count * KV_NSPEC, sizeof *d->pipes);
  d->pipe_failed = calloc((size_t)kiln__vk_shader_count * KV_NSPEC, sizeof *d->pipe_failed);
  if (!d->pipes || !d->pipe_failed) {
    *why = "out of host memory";
    return false;
  }
  return true;
}

kiln_status kiln__vk_probe(const char **why) {
  *why = NULL;
  if (kiln__knob_on("KILN_VULKAN_DISABLE", false)) {
    *why = "disabled by KILN_VULKAN_DISABLE";
    return KILN_ERR_UNAVAILABLE;
  }
  if (!kiln__vk_load(why, loader_path, sizeof loader_path)) return KILN_ERR_UNAVAILABLE;
  instance_version = VK_API_VERSION_1_0;
  if (VK->vkEnumerateInstanceVersion) VK->vkEnumerateInstanceVersion(&instance_version);
  if (instance_version < VK_API_VERSION_1_2) {
    *why = "the Vulkan loader is older than 1.2 (update libvulkan1)";
    return KILN_ERR_UNAVAILABLE;
  }
  /* MoltenVK is a "portability" implementation: the loader lists it only when asked to. */
  uint32_t ne = 0;
  VK->vkEnumerateInstanceExtensionProperties(NULL, &ne, NULL);
  VkExtensionProperties *ext = calloc(ne ? ne : 1, sizeof *ext);
  if (!ext) {
    *why = "out of host memory";
    return KILN_ERR_OOM;
  }
  VK->vkEnumerateInstanceExtensionProperties(NULL, &ne, ext);
  const char *exts[2];
  uint32_t n_ext = 0;
  VkInstanceCreateFlags flags = 0;
  if (has_ext(ext, ne, "VK_KHR_portability_enumeration")) {
    exts[n_ext++] = "VK_KHR_portability_enumeration";
    flags |= 0x00000001; /* VK_INSTANCE_CREATE_ENUMERATE_PORTABILITY_BIT_KHR */
  }
  free(ext);
  VkApplicationInfo app = {.sType = VK_STRUCTURE_TYPE_APPLICATION_INFO,
                           .pApplicationName = "kiln",
                           .pEngineName = "kiln",
                           .apiVersion = VK_API_VERSION_1_2};
  VkInstanceCreateInfo ci = {.sType = VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO,
                             .flags = flags,
                             .pApplicationInfo = &app,
                             .enabledExtensionCount = n_ext,
                             .ppEnabledExtensionNames = exts};
  VkResult r = VK->vkCreateInstance(&ci, NULL, &instance);
  if (r == VK_ERROR_INCOMPATIBLE_DRIVER) {
    *why = "no Vulkan driver (ICD) found: install one (Linux: mesa-vulkan-drivers for AMD/Intel "
           "GPUs and the CPU, or NVIDIA's driver; macOS: MoltenVK)";
    return KILN_ERR_UNAVAILABLE;
  }
  if (r != VK_SUCCESS) {
    *why = "vkCreateInstance failed";
    return KILN_ERR_UNAVAILABLE;
  }
  if (!kiln__vk_load_instance(instance, why) || !kiln__vk_load_device(VK_NULL_HANDLE, why))
    return KILN_ERR_UNAVAILABLE;
  uint32_t np = 0;
  VK->vkEnumeratePhysicalDevices(instance, &np, NULL);
  VkPhysicalDevice pds[KILN_VK_MAX_DEVICES];
  if (np > KILN_VK_MAX_DEVICES) np = KILN_VK_MAX_DEVICES;
  if (np) VK->vkEnumeratePhysicalDevices(instance, &np, pds);
  if (np == 0) {
    *why = "the Vulkan loader found no device (is a driver installed? apt install "
           "mesa-vulkan-drivers, or the GPU vendor's driver)";
    return KILN_ERR_UNAVAILABLE;
  }
  /* discrete GPUs first, then integrated, virtual, CPU (lavapipe): vulkan:0 is the best */
  vk_dev cand[KILN_VK_MAX_DEVICES];
  int nc = 0;
  for (uint32_t i = 0; i < np; i++) {
    memset(&cand[nc], 0, sizeof cand[nc]);
    cand[nc].pd = pds[i];
    const char *w = NULL;
    if (inspect(&cand[nc], &w)) nc++;
    else skip_note(cand[nc].props.deviceName, w);
  }
  for (int i = 1; i < nc; i++)
    for (int j = i; j > 0 && type_order(cand[j].props.deviceType) < type_order(cand[j - 1].props.deviceType); j--) {
      vk_dev t = cand[j];
      cand[j] = cand[j - 1];
      cand[j - 1] = t;
    }
  for (int i = 0; i < nc; i++) {
    devs[n_devs] = cand[i];
    const char *w = NULL;
    if (open_device(&devs[n_devs], n_devs, &w)) n_devs++;
    else skip_note(cand[i].props.deviceName, w);
  }
  if (n_devs == 0) {
    static char msg[600];
    snprintf(msg, sizeof msg, "no Vulkan device kiln can use (%s)", skipped);
    *why = msg;
    return KILN_ERR_UNAVAILABLE;
  }
  /* kiln_device_best: CUDA (100), then a discrete GPU, then an integrated one; a CPU
  ** implementation (lavapipe) or a virtual GPU is never picked over the CPU itself. */
  int t = type_order(devs[0].props.deviceType);
  kiln__vulkan_backend.best_rank = t == 0 ? 60 : t == 1 ? 40 : 0;
  return KILN_OK;
}

int kiln__vk_device_count(void) { return n_devs; }

/* ---- copies ---- */
/* The block and offset of [p, p+n); sets the error when p is not device memory. */
static vk_block *locate(vk_dev *d, int device, const void *p, size_t n, uint64_t *off, const char *what) {
  uint64_t a = (uint64_t)(uintptr_t)p;
  vk_block *b = kiln__vk_find(d, a);
  if (!b || a + n > b->addr + b->size) {
    kiln_set_error(KILN_ERR_INTERNAL, "kiln: %s: %p is not memory of vulkan:%d", what, p, device);
    return NULL;
  }
  *off = a - b->addr;
  return b;
}

#define VK_LOCKED(d, device)                                                             \
  vk_dev *d = kiln__vk_dev(device);                                                      \
  if (!d) return kiln_set_error(KILN_ERR_DEVICE, "kiln: no device vulkan:%d", device);    \
  pthread_mutex_lock(&d->lock);                                                          \
  kiln_status st = kiln__vk_check_lost(d, device)

kiln_status kiln__vk_copy_to_host(int device, void *dst, const void *src, size_t n) {
  if (n == 0) return KILN_OK;
  VK_LOCKED(d, device);
  uint64_t off = 0;
  vk_block *b = st == KILN_OK ? locate(d, device, src, n, &off, "copy to host") : NULL;
  if (!b) st = kiln_last_error();
  if (b && b->map) {
    st = kiln__vk_finish(d, device);
    if (st == KILN_OK) memcpy(dst, b->map + off, n);
  } else if (b) {
    for (size_t done = 0; done < n && st == KILN_OK;) {
      size_t k = n - done < d->staging.size ? n - done : (size_t)d->staging.size;
      VkCommandBuffer cb = kiln__vk_cmd(d, device);
      if (!cb) {
        st = kiln_last_error();
        break;
      }
      VkBufferCopy reg = {.srcOffset = off + done, .dstOffset = 0, .size = k};
      VK->vkCmdCopyBuffer(cb, b->buf, d->staging.buf, 1, &reg);
      st = kiln__vk_cmd_done(d, device);
      if (st == KILN_OK) st = kiln__vk_finish(d, device);
      if (st == KILN_OK) memcpy((char *)dst + done, d->staging.map, k);
      done += k;
    }
  }
  pthread_mutex_unlock(&d->lock);
  return st;
}

kiln_status kiln__vk_copy_from_host(int device, void *dst, const void *src, size_t n) {
  if (n == 0) return KILN_OK;
  VK_LOCKED(d, device);
  uint64_t off = 0;
  vk_block *b = st == KILN_OK ? locate(d, device, dst, n, &off, "copy from host") : NULL;
  if (!b) st = kiln_last_error();
  /* Small copies (a batch of inputs, a scalar) go through the frame's parameter ring: the
  ** bytes are copied there now (the caller may reuse src at once) and a buffer copy is
  ** recorded in the queue, ordered after every earlier kernel by the usual barrier. Nothing
  ** waits: the training loop's upload of the next batch no longer costs a round trip. */
  if (b && n <= KILN_VK_UPLOAD_MAX) {
    uint64_t ring = 0;
    void *p = kiln__vk_params(d, device, n, &ring);
    VkCommandBuffer cb = p ? kiln__vk_cmd(d, device) : NULL;
    if (!cb) {
      st = kiln_last_error();
    } else {
      vk_frame *f = &d->frames[d->cur];
      memcpy(p, src, n);
      VkBufferCopy reg = {.srcOffset = ring - f->params.addr, .dstOffset = off, .size = n};
      VK->vkCmdCopyBuffer(cb, f->params.buf, b->buf, 1, &reg);
      st = kiln__vk_cmd_done(d, device);
    }
    pthread_mutex_unlock(&d->lock);
    return st;
  }
  /* Larger ones: queued kernels may still read what the memory held before (a freed
  ** tensor's bytes reused by the allocator), so the host writes only once the queue is
  ** idle. */
  if (b) st = kiln__vk_finish(d, device);
  if (b && st == KILN_OK && b->map) {
    memcpy(b->map + off, src, n);
  } else if (b) {
    for (size_t done = 0; done < n && st == KILN_OK;) {
      size_t k = n - done < d->staging.size ? n - done : (size_t)d->staging.size;
      memcpy(d->staging.map, (const char *)src + done, k);
      VkCommandBuffer cb = kiln__vk_cmd(d, device);
      if (!cb) {
        st = kiln_last_error();
        break;
      }
      VkBufferCopy reg = {.srcOffset = 0, .dstOffset = off + done, .size = k};
      VK->vkCmdCopyBuffer(cb, d->staging.buf, b->buf, 1, &reg);
      st = kiln__vk_cmd_done(d, device);
      if (st == KILN_OK) st = kiln__vk_finish(d, device);
      done += k;
    }
  }
  pthread_mutex_unlock(&d->lock);
  return st;
}

kiln_status kiln__vk_copy_device(int device, void *dst, const void *src, size_t n) {
  if (n == 0 || dst == src) return KILN_OK;
  VK_LOCKED(d, device);
  uint64_t so = 0, dof = 0;
  vk_block *sb = st == KILN_OK ? locate(d, device, src, n, &so, "device copy") : NULL;
  vk_block *db = sb ? locate(d, device, dst, n, &dof, "device copy") : NULL;
  if (!db) st = kiln_last_error();
  VkCommandBuffer cb = db ? kiln__vk_cmd(d, device) : NULL;
  if (db && !cb) st = kiln_last_error();
  if (cb) {
    VkBufferCopy reg = {.srcOffset = so, .dstOffset = dof, .size = n};
    VK->vkCmdCopyBuffer(cb, sb->buf, db->buf, 1, &reg);
    st = kiln__vk_cmd_done(d, device);
  }
  pthread_mutex_unlock(&d->lock);
  return st;
}

kiln_status kiln__vk_memset_zero(int device, void *ptr, size_t n) {
  if (n == 0) return KILN_OK;
  uint64_t a = (uint64_t)(uintptr_t)ptr;
  if ((a | n) & 3) { /* vkCmdFillBuffer works in words: bytes go through the fill kernel */
    kiln__kargs k = {0};
    k.op = KILN__K_FILL;
    k.device = device;
    k.n_out = 1;
    k.out[0] = (kiln__view){.data = ptr, .dtype = KILN_U8, .ndim = 1, .shape = {(int64_t)n}, .strides = {1}};
    return kiln__vulkan_backend.kernels[KILN__K_FILL](&k);
  }
  VK_LOCKED(d, device);
  uint64_t off = 0;
  vk_block *b = st == KILN_OK ? locate(d, device, ptr, n, &off, "memset") : NULL;
  if (!b) st = kiln_last_error();
  VkCommandBuffer cb = b ? kiln__vk_cmd(d, device) : NULL;
  if (b && !cb) st = kiln_last_error();
  if (cb) {
    VK->vkCmdFillBuffer(cb, b->buf, off, n, 0);
    st = kiln__vk_cmd_done(d, device);
  }
  pthread_mutex_unlock(&d->lock);
  return st;
}

kiln_status kiln__vk_synchronize(int device) {
  VK_LOCKED(d, device);
  if (st == KILN_OK) st = kiln__vk_finish(d, device);
  pthread_mutex_unlock(&d->lock);
  return st;
}

kiln_status kiln__vk_device_info(int device, kiln_device_info *out) {
  vk_dev *d = kiln__vk_dev(device);
  if (!d) return kiln_set_error(KILN_ERR_DEVICE, "kiln: no device vulkan:%d", device);
  snprintf(out->name, sizeof out->name, "%s", d->props.deviceName);
  out->total_memory = (int64_t)d->heap_size;
  pthread_mutex_lock(&d->lock);
  out->free_memory = (int64_t)d->heap_size - d->reserved;
  pthread_mutex_unlock(&d->lock);
  out->driver_version = (int)d->props.driverVersion;
  /* the device's Vulkan version, as CUDA's integers: 1.3 -> 1030 */
  out->runtime_version = (int)(VK_API_VERSION_MAJOR(d->props.apiVersion) * 1000 +
                               VK_API_VERSION_MINOR(d->props.apiVersion) * 10);
  return KILN_OK;
}


kiln_status kiln_vulkan_info_get(int index, kiln_vulkan_info *out) {
  if (!out) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_vulkan_info_get: out is NULL");
  memset(out, 0, sizeof *out);
  vk_dev *d = kiln_device_count(KILN_DEVICE_VULKAN) > index ? kiln__vk_dev(index) : NULL;
  if (!d) return kiln_set_error(KILN_ERR_DEVICE, "kiln_vulkan_info_get: no device vulkan:%d", index);
  const char *ty = "other";
  switch (d->props.deviceType) {
  case VK_PHYSICAL_DEVICE_TYPE_DISCRETE_GPU: ty = "discrete"; break;
  case VK_PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU: ty = "integrated"; break;
  case VK_PHYSICAL_DEVICE_TYPE_VIRTUAL_GPU: ty = "virtual"; break;
  case VK_PHYSICAL_DEVICE_TYPE_CPU: ty = "cpu"; break;
  default: break;
  }
  snprintf(out->type, sizeof out->type, "%s", ty);
  VkPhysicalDeviceDriverProperties dp = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_DRIVER_PROPERTIES};
  VkPhysicalDeviceProperties2 p2 = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2, .pNext = &dp};
  VK->vkGetPhysicalDeviceProperties2(d->pd, &p2);
  snprintf(out->driver, sizeof out->driver, "%.128s: %.150s", dp.driverName, dp.driverInfo);
  out->api_version = (int)(VK_API_VERSION_MAJOR(d->props.apiVersion) * 1000 +
                           VK_API_VERSION_MINOR(d->props.apiVersion) * 10);
  out->vendor_id = (int)d->props.vendorID, out->device_id = (int)d->props.deviceID;
  out->n_heaps = (int)d->memprops.memoryHeapCount;
  if (out->n_heaps > KILN_VK_MAX_HEAPS) out->n_heaps = KILN_VK_MAX_HEAPS;
  for (int h = 0; h < out->n_heaps; h++) {
    out->heap_size[h] = (int64_t)d->memprops.memoryHeaps[h].size;
    out->heap_device_local[h] = (d->memprops.memoryHeaps[h].flags & VK_MEMORY_HEAP_DEVICE_LOCAL_BIT) != 0;
  }
  out->unified = d->unified;
  out->subgroup_size = (int)d->subgroup_size;
  out->subgroup_arith = d->subgroup_arith;
  out->f64 = d->f64, out->f16 = d->f16, out->int8 = d->i8, out->coop_matrix = d->coop_matrix;
  uint32_t ne = 0;
  VK->vkEnumerateDeviceExtensionProperties(d->pd, NULL, &ne, NULL);
  VkExtensionProperties *ext = calloc(ne ? ne : 1, sizeof *ext);
  if (ext) {
    VK->vkEnumerateDeviceExtensionProperties(d->pd, NULL, &ne, ext);
    out->bf16 = has_ext(ext, ne, "VK_KHR_shader_bfloat16");
    free(ext);
  }
  return KILN_OK;
}
