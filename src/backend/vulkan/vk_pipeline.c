/*
** Pipelines (one per embedded shader, made on first use) and the dispatch of a kernel.
** Every shader has the same interface: no descriptor sets, one push constant — the device
** address of its parameter block, in the frame's ring (vk_submit.c) — and workgroups of
** its own size. A pipeline the driver refuses to create fails that kernel with a clear
** error (and is not retried); the device and the CPU stay usable.
*/
#include "vk_int.h"

#include <stdio.h>

#include <string.h>

int kiln__vk_shader_index(const char *name) {
  for (int i = 0; i < kiln__vk_shader_count; i++)
    if (strcmp(kiln__vk_shaders[i].name, name) == 0) return i;
  return -1;
}

static kiln_status make_pipeline(vk_dev *d, int index, int s) {
  if (d->pipe_failed[s])
    return kiln_set_error(KILN_ERR_DEVICE,
                          "kiln: vulkan:%d (%s) could not create the pipeline of shader '%s' "
                          "earlier; its ops fail on this device (run them on the CPU)",
                          index, d->props.deviceName, kiln__vk_shaders[s].name);
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
    VkComputePipelineCreateInfo ci = {
        .sType = VK_STRUCTURE_TYPE_COMPUTE_PIPELINE_CREATE_INFO,
        .stage = {.sType = VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_CREATE_INFO,
                  .stage = VK_SHADER_STAGE_COMPUTE_BIT,
                  .module = mod,
                  .pName = "main"},
        .layout = d->layout};
    r = VK->vkCreateComputePipelines(d->dev, VK_NULL_HANDLE, 1, &ci, NULL, &d->pipes[s]);
    VK->vkDestroyShaderModule(d->dev, mod, NULL);
  }
  if (r != VK_SUCCESS) {
    d->pipes[s] = VK_NULL_HANDLE;
    if (r == VK_ERROR_DEVICE_LOST) return kiln__vk_fail(d, index, r, "vkCreateComputePipelines");
    d->pipe_failed[s] = true;
    return kiln_set_error(KILN_ERR_DEVICE,
                          "kiln: vulkan:%d (%s): the driver could not create the pipeline of "
                          "shader '%s' (%s); its ops fail on this device: run them on the CPU, "
                          "and report the driver and kiln doctor's output",
                          index, d->props.deviceName, kiln__vk_shaders[s].name, kiln__vk_result_str(r));
  }
  return KILN_OK;
}

kiln_status kiln__vk_dispatch(int device, const char *name, const void *params, size_t n,
                              uint32_t gx, uint32_t gy, uint32_t gz) {
  vk_dev *d = kiln__vk_dev(device);
  if (!d) return kiln_set_error(KILN_ERR_DEVICE, "kiln: no device vulkan:%d", device);
  if (gx == 0 || gy == 0 || gz == 0) return KILN_OK;
  int s = kiln__vk_shader_index(name);
  if (s < 0) return kiln_set_error(KILN_ERR_INTERNAL, "kiln: vulkan: no shader '%s' embedded", name);
  pthread_mutex_lock(&d->lock);
  kiln_status st = kiln__vk_check_lost(d, device);
  if (st == KILN_OK && !d->pipes[s]) st = make_pipeline(d, device, s);
  uint64_t addr = 0;
  void *p = st == KILN_OK ? kiln__vk_params(d, device, n, &addr) : NULL;
  if (st == KILN_OK && !p) st = kiln_last_error();
  VkCommandBuffer cb = p ? kiln__vk_cmd(d, device) : NULL;
  if (p && !cb) st = kiln_last_error();
  if (cb) {
    memcpy(p, params, n);
    uint64_t pc[2] = {addr, 0};
    VK->vkCmdBindPipeline(cb, VK_PIPELINE_BIND_POINT_COMPUTE, d->pipes[s]);
    VK->vkCmdPushConstants(cb, d->layout, VK_SHADER_STAGE_COMPUTE_BIT, 0, sizeof pc, pc);
    VK->vkCmdDispatch(cb, gx, gy, gz);
    if (d->trace) fprintf(stderr, "kiln: vulkan:%d dispatch %s %ux%ux%u\n", device, name, gx, gy, gz);
    st = kiln__vk_cmd_done(d, device);
  }
  pthread_mutex_unlock(&d->lock);
  return st;
}

void kiln__vk_pipelines_destroy(vk_dev *d) {
  for (int i = 0; d->pipes && i < kiln__vk_shader_count; i++)
    if (d->pipes[i]) VK->vkDestroyPipeline(d->dev, d->pipes[i], NULL);
  if (d->layout) VK->vkDestroyPipelineLayout(d->dev, d->layout, NULL);
}

bool kiln__vk_pipeline_ok(int device, const char *name) {
  vk_dev *d = kiln__vk_dev(device);
  int s = kiln__vk_shader_index(name);
  if (!d || s < 0) return false;
  pthread_mutex_lock(&d->lock);
  bool ok = !d->lost && (d->pipes[s] || (!d->pipe_failed[s] && make_pipeline(d, device, s) == KILN_OK));
  pthread_mutex_unlock(&d->lock);
  if (!ok) kiln_clear_error();
  return ok;
}
