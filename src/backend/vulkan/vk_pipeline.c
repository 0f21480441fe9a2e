/*
** Pipelines (one per embedded shader, made on first use) and the dispatch of a kernel.
** Every shader has the same interface: no descriptor sets, one push constant — the device
** address of its parameter block, in the frame's ring (vk_submit.c) — and workgroups of
** its own size. A pipeline the driver refuses to create fails that kernel with a clear
** error (and is not retried); the device and the CPU stay usable.
**
** A shader may declare one integer specialisation constant, constant_id 0 (the matrix
** products' layout bits: the driver then compiles one branch-free build per layout); each
** (shader, value) pair, value 0..KV_NSPEC-1, is its own pipeline. Shaders that declare
** none ignore it. KILN_VK_PIPESTATS=1 prints each pipeline's statistics (registers,
** spills, shared memory: VK_KHR_pipeline_executable_properties) on stderr as it is made.
*/
#include "vk_int.h"

#include <stdio.h>

#include <string.h>

int kiln__vk_shader_index(const char *name) {
  for (int i = 0; i < kiln__vk_shader_count; i++)
    if (strcmp(kiln__vk_shaders[i].name, name) == 0) return i;
  return -1;
}

/* KILN_VK_PIPESTATS=1: the driver's statistics of each executable of pipeline p, one line */
static void print_stats(vk_dev *d, int index, int s, int spec, VkPipeline p) {
  PFN_vkGetPipelineExecutablePropertiesKHR props =
      (PFN_vkGetPipelineExecutablePropertiesKHR)VK->vkGetDeviceProcAddr(d->dev, "vkGetPipelineExecutablePropertiesKHR");
  PFN_vkGetPipelineExecutableStatisticsKHR stats =
      (PFN_vkGetPipelineExecutableStatisticsKHR)VK->vkGetDeviceProcAddr(d->dev, "vkGetPipelineExecutableStatisticsKHR");
  if (!props || !stats) return;
  VkPipelineInfoKHR pi = {.sType = VK_STRUCTURE_TYPE_PIPELINE_INFO_KHR, .pipeline = p};
  uint32_t ne = 0;
  if (props(d->dev, &pi, &ne, NULL) != VK_SUCCESS) return;
  for (uint32_t e = 0; e < ne && e < 4; e++) {
    VkPipelineExecutableInfoKHR ei = {.sType = VK_STRUCTURE_TYPE_PIPELINE_EXECUTABLE_INFO_KHR, .pipeline = p,
                                      .executableIndex = e};
    VkPipelineExecutableStatisticKHR st[32];
    uint32_t ns = 32;
    for (uint32_t i = 0; i < ns; i++) st[i] = (VkPipelineExecutableStatisticKHR){.sType = VK_STRUCTURE_TYPE_PIPELINE_EXECUTABLE_STATISTIC_KHR};
    VkResult r = stats(d->dev, &ei, &ns, st);
    if (r != VK_SUCCESS && r != VK_INCOMPLETE) continue;
    char line[1024];
    int n = snprintf(line, sizeof line, "kiln: vulkan:%d pipeline %s/%d:", index, kiln__vk_shaders[s].name, spec);
    for (uint32_t i = 0; i < ns && n > 0 && (size_t)n < sizeof line; i++) {
      VkPipelineExecutableStatisticKHR *x = &st[i];
      if (x->format == VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_BOOL32_KHR)
        n += snprintf(line + n, sizeof line - (size_t)n, " %s=%u", x->name, (unsigned)x->value.b32);
      else if (x->format == VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_INT64_KHR)
        n += snprintf(line + n, sizeof line - (size_t)n, " %s=%lld", x->name, (long long)x->value.i64);
      else if (x->format == VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_UINT64_KHR)
        n += snprintf(line + n, sizeof line - (size_t)n, " %s=%llu", x->name, (unsigned long long)x->value.u64);
      else n += snprintf(line + n, sizeof line - (size_t)n, " %s=%g", x->name, x->value.f64);
    }
    fprintf(stderr, "%s\n", line);
  }
}

static kiln_status make_pipeline(vk_dev *d, int index, int s, int spec) {
  int ps = s * KV_NSPEC + spec;
  if (d->pipe_failed[ps])
    return kiln_set_error(KILN_ERR_DEVICE,
                          "kiln: vulkan:%d (%s) could not create the pipeline of shader '%s' (layout %d) "
                          "earlier; its ops fail on this device (run them on the CPU)",
                          index, d->props.deviceName, kiln__vk_shaders[s].name, spec);
  VkResult r = VK_SUCCESS;
  if (!d->layout) {
    VkPushConstantRange pc = {.stageFlags = VK_SHADER_STAGE_COMPUTE_BIT, .offset = 0, .size = 16};
    VkPipelineLayoutCreateInfo li = {.sType = VK_STRUCTURE_TYPE_PIPELINE_LAYOUT_CREATE_INFO,
                                     .pushConstantRangeCount = 1,
                                     .pPushConstantRanges = &pc};
    r = VK->vkCreatePipelineLayout(d->dev, &li, NULL, &d->layout);
    if (r != VK_SUCCESS) return kiln__vk_fail(d, index, r, "vkCreatePipelineLayout");
  }
  VkShaderModuleCreateInfo mi = {.sType = VK_STRUCTURE_TYPE_SHADER_MODULE_CREATE_INFO,
                                 .codeSize = kiln__vk_shaders[s].words * 4,
                                 .pCode = kiln__vk_shaders[s].code};
  VkShaderModule mod = VK_NULL_HANDLE;
  r = VK->vkCreateShaderModule(d->dev, &mi, NULL, &mod);
  if (r == VK_SUCCESS) {
    int32_t value = spec;
    VkSpecializationMapEntry me = {.constantID = 0, .offset = 0, .size = sizeof value};
    VkSpecializationInfo si = {.mapEntryCount = 1, .pMapEntries = &me, .dataSize = sizeof value, .pData = &value};
    VkComputePipelineCreateInfo ci = {
        .sType = VK_STRUCTURE_TYPE_COMPUTE_PIPELINE_CREATE_INFO,
        .flags = d->pipestats ? VK_PIPELINE_CREATE_CAPTURE_STATISTICS_BIT_KHR : 0,
        .stage = {.sType = VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_CREATE_INFO,
                  .stage = VK_SHADER_STAGE_COMPUTE_BIT,
                  .module = mod,
                  .pName = "main",
                  .pSpecializationInfo = &si},
        .layout = d->layout};
    r = VK->vkCreateComputePipelines(d->dev, VK_NULL_HANDLE, 1, &ci, NULL, &d->pipes[ps]);
    VK->vkDestroyShaderModule(d->dev, mod, NULL);
  }
  if (r != VK_SUCCESS) {
    d->pipes[ps] = VK_NULL_HANDLE;
    if (r == VK_ERROR_DEVICE_LOST) return kiln__vk_fail(d, index, r, "vkCreateComputePipelines");
    d->pipe_failed[ps] = true;
    return kiln_set_error(KILN_ERR_DEVICE,
                          "kiln: vulkan:%d (%s): the driver could not create the pipeline of "
                          "shader '%s' (layout %d) (%s); its ops fail on this device: run them on the CPU, "
                          "and report the driver and kiln doctor's output",
                          index, d->props.deviceName, kiln__vk_shaders[s].name, spec, kiln__vk_result_str(r));
  }
  if (d->pipestats) print_stats(d, index, s, spec, d->pipes[ps]);
  return KILN_OK;
}

kiln_status kiln__vk_dispatch_spec(int device, const char *name, int spec, const void *params, size_t n,
                                   uint32_t gx, uint32_t gy, uint32_t gz) {
  vk_dev *d = kiln__vk_dev(device);
  if (!d) return kiln_set_error(KILN_ERR_DEVICE, "kiln: no device vulkan:%d", device);
  if (gx == 0 || gy == 0 || gz == 0) return KILN_OK;
  int s = kiln__vk_shader_index(name);
  if (s < 0) return kiln_set_error(KILN_ERR_INTERNAL, "kiln: vulkan: no shader '%s' embedded", name);
  if (spec < 0 || spec >= KV_NSPEC)
    return kiln_set_error(KILN_ERR_INTERNAL, "kiln: vulkan: shader '%s' specialised to %d (0..%d)", name, spec,
                          KV_NSPEC - 1);
  int ps = s * KV_NSPEC + spec;
  pthread_mutex_lock(&d->lock);
  kiln_status st = kiln__vk_check_lost(d, device);
  if (st == KILN_OK && !d->pipes[ps]) st = make_pipeline(d, device, s, spec);
  uint64_t addr = 0;
  void *p = st == KILN_OK ? kiln__vk_params(d, device, n, &addr) : NULL;
  if (st == KILN_OK && !p) st = kiln_last_error();
  VkCommandBuffer cb = p ? kiln__vk_cmd(d, device) : NULL;
  if (p && !cb) st = kiln_last_error();
  if (cb) {
    memcpy(p, params, n);
    uint64_t pc[2] = {addr, 0};
    VK->vkCmdBindPipeline(cb, VK_PIPELINE_BIND_POINT_COMPUTE, d->pipes[ps]);
    VK->vkCmdPushConstants(cb, d->layout, VK_SHADER_STAGE_COMPUTE_BIT, 0, sizeof pc, pc);
    VK->vkCmdDispatch(cb, gx, gy, gz);
    if (d->trace) {
      if (spec) fprintf(stderr, "kiln: vulkan:%d dispatch %s/%d %ux%ux%u\n", device, name, spec, gx, gy, gz);
      else fprintf(stderr, "kiln: vulkan:%d dispatch %s %ux%ux%u\n", device, name, gx, gy, gz);
    }
    st = kiln__vk_cmd_done(d, device);
  }
  pthread_mutex_unlock(&d->lock);
  return st;
}

kiln_status kiln__vk_dispatch(int device, const char *name, const void *params, size_t n,
                              uint32_t gx, uint32_t gy, uint32_t gz) {
  return kiln__vk_dispatch_spec(device, name, 0, params, n, gx, gy, gz);
}

void kiln__vk_pipelines_destroy(vk_dev *d) {
  for (int i = 0; d->pipes && i < kiln__vk_shader_count * KV_NSPEC; i++)
    if (d->pipes[i]) VK->vkDestroyPipeline(d->dev, d->pipes[i], NULL);
  if (d->layout) VK->vkDestroyPipelineLayout(d->dev, d->layout, NULL);
}

bool kiln__vk_pipeline_ok_spec(int device, const char *name, int spec) {
  vk_dev *d = kiln__vk_dev(device);
  int s = kiln__vk_shader_index(name);
  if (!d || s < 0 || spec < 0 || spec >= KV_NSPEC) return false;
  int ps = s * KV_NSPEC + spec;
  pthread_mutex_lock(&d->lock);
  bool ok = !d->lost && (d->pipes[ps] || (!d->pipe_failed[ps] && make_pipeline(d, device, s, spec) == KILN_OK));
  pthread_mutex_unlock(&d->lock);
  if (!ok) kiln_clear_error();
  return ok;
}

bool kiln__vk_pipeline_ok(int device, const char *name) { return kiln__vk_pipeline_ok_spec(device, name, 0); }
