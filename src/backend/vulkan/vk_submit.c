/*
** Recording and submission. Work is recorded into the current frame's command buffer and
** submitted in batches: when KILN_VK_BATCH commands are recorded or the frame's parameter
** ring is full (then the next of KILN_VK_FRAMES frames is taken, waiting for its fence if
** it is still in flight), and at sync points (kiln__vk_finish: copies to and from the
** host, synchronize), which submit and wait for everything. Not one submit per op.
**
** Ordering: a global memory barrier (compute and transfer writes -> compute and transfer
** reads and writes) is recorded before every command, so each kernel sees all earlier
** writes, including those of earlier submissions on the queue (a barrier's first scope is
** everything before it in submission order). Coarser than tracking which buffers each
** kernel touches, and what lets the allocator reuse freed memory at once. A last barrier
** makes device writes visible to the host before the fence signals.
*/
#include "vk_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

kiln_status kiln__vk_submit_init(vk_dev *d, int index) {
  VkCommandPoolCreateInfo pi = {.sType = VK_STRUCTURE_TYPE_COMMAND_POOL_CREATE_INFO,
                                .flags = VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT,
                                .queueFamilyIndex = d->qfam};
  VkResult r = VK->vkCreateCommandPool(d->dev, &pi, NULL, &d->pool);
  if (r != VK_SUCCESS) return kiln__vk_fail(d, index, r, "vkCreateCommandPool");
  for (int i = 0; i < KILN_VK_FRAMES; i++) {
    vk_frame *f = &d->frames[i];
    VkCommandBufferAllocateInfo ai = {.sType = VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO,
                                      .commandPool = d->pool,
                                      .level = VK_COMMAND_BUFFER_LEVEL_PRIMARY,
                                      .commandBufferCount = 1};
    r = VK->vkAllocateCommandBuffers(d->dev, &ai, &f->cb);
    if (r != VK_SUCCESS) return kiln__vk_fail(d, index, r, "vkAllocateCommandBuffers");
    VkFenceCreateInfo fi = {.sType = VK_STRUCTURE_TYPE_FENCE_CREATE_INFO};
    r = VK->vkCreateFence(d->dev, &fi, NULL, &f->fence);
    if (r != VK_SUCCESS) return kiln__vk_fail(d, index, r, "vkCreateFence");
    r = kiln__vk_block_make(d, KILN_VK_PARAM_RING, d->ring_type, true, &f->params);
    if (r != VK_SUCCESS && d->ring_type != d->host_type) /* a small BAR already full */
      r = kiln__vk_block_make(d, KILN_VK_PARAM_RING, d->host_type, true, &f->params);
    if (r != VK_SUCCESS) return kiln__vk_fail(d, index, r, "the parameter ring");
  }
  const int timing = kiln__knob_choice("KILN_VK_TIMING", 0); /* 0, 1, trace */
  d->trace = timing == 2;
  if (timing > 0 && d->ts_bits > 0) {
    VkQueryPoolCreateInfo qi = {.sType = VK_STRUCTURE_TYPE_QUERY_POOL_CREATE_INFO,
                                .queryType = VK_QUERY_TYPE_TIMESTAMP,
                                .queryCount = 2 * KILN_VK_FRAMES};
    if (VK->vkCreateQueryPool(d->dev, &qi, NULL, &d->qpool) != VK_SUCCESS) d->qpool = VK_NULL_HANDLE;
  }
  r = kiln__vk_block_make(d, 256, d->host_type, true, &d->flag);
  if (r != VK_SUCCESS) return kiln__vk_fail(d, index, r, "the error word");
  memset(d->flag.map, 0, 4);
  if (!d->unified) {
    r = kiln__vk_block_make(d, (uint64_t)16 << 20, d->host_type, true, &d->staging);
    if (r != VK_SUCCESS) return kiln__vk_fail(d, index, r, "the staging buffer");
  }
  return KILN_OK;
}

void kiln__vk_submit_destroy(vk_dev *d) {
  if (!d->dev) return;
  VK->vkDeviceWaitIdle(d->dev);
  for (int i = 0; i < KILN_VK_FRAMES; i++) {
    vk_frame *f = &d->frames[i];
    if (f->fence) VK->vkDestroyFence(d->dev, f->fence, NULL);
    kiln__vk_block_release(d, &f->params);
  }
  kiln__vk_block_release(d, &d->staging);
  kiln__vk_block_release(d, &d->flag);
  if (d->qpool) VK->vkDestroyQueryPool(d->dev, d->qpool, NULL);
  if (d->pool) VK->vkDestroyCommandPool(d->dev, d->pool, NULL);
}

static kiln_status wait_frame(vk_dev *d, int index, vk_frame *f) {
  if (!f->pending) return KILN_OK;
  VkResult r = VK->vkWaitForFences(d->dev, 1, &f->fence, VK_TRUE, UINT64_MAX);
  if (r != VK_SUCCESS) return kiln__vk_fail(d, index, r, "vkWaitForFences");
  VK->vkResetFences(d->dev, 1, &f->fence);
  if (d->qpool) {
    uint64_t t[2] = {0, 0};
    uint32_t q = (uint32_t)(2 * (f - d->frames));
    if (VK->vkGetQueryPoolResults(d->dev, d->qpool, q, 2, sizeof t, t, sizeof t[0], VK_QUERY_RESULT_64_BIT) ==
        VK_SUCCESS) {
      uint64_t mask = d->ts_bits >= 64 ? ~(uint64_t)0 : (((uint64_t)1 << d->ts_bits) - 1);
      d->gpu_s += (double)((t[1] - t[0]) & mask) * (double)d->props.limits.timestampPeriod * 1e-9;
      d->gpu_n++;
    }
  }
  f->pending = false;
  f->params_used = 0;
  return KILN_OK;
}

static void barrier(VkCommandBuffer cb, VkPipelineStageFlags dst_stage, VkAccessFlags dst_access) {
  VkMemoryBarrier mb = {.sType = VK_STRUCTURE_TYPE_MEMORY_BARRIER,
                        .srcAccessMask = VK_ACCESS_SHADER_WRITE_BIT | VK_ACCESS_TRANSFER_WRITE_BIT |
                                         VK_ACCESS_HOST_WRITE_BIT,
                        .dstAccessMask = dst_access};
  VK->vkCmdPipelineBarrier(cb,
                           VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT | VK_PIPELINE_STAGE_TRANSFER_BIT |
                               VK_PIPELINE_STAGE_HOST_BIT,
                           dst_stage, 0, 1, &mb, 0, NULL, 0, NULL);
}

/* Submits the current frame (if anything is recorded) and moves to the next one. */
static kiln_status submit(vk_dev *d, int index) {
  vk_frame *f = &d->frames[d->cur];
  if (!f->recording) return KILN_OK;
  barrier(f->cb, VK_PIPELINE_STAGE_HOST_BIT, VK_ACCESS_HOST_READ_BIT);
  if (d->qpool)
    VK->vkCmdWriteTimestamp(f->cb, VK_PIPELINE_STAGE_BOTTOM_OF_PIPE_BIT, d->qpool, (uint32_t)(2 * d->cur + 1));
  VkResult r = VK->vkEndCommandBuffer(f->cb);
  f->recording = false;
  if (r != VK_SUCCESS) return kiln__vk_fail(d, index, r, "vkEndCommandBuffer");
  VkSubmitInfo si = {.sType = VK_STRUCTURE_TYPE_SUBMIT_INFO, .commandBufferCount = 1, .pCommandBuffers = &f->cb};
  r = VK->vkQueueSubmit(d->queue, 1, &si, f->fence);
  if (r != VK_SUCCESS) return kiln__vk_fail(d, index, r, "vkQueueSubmit");
  f->pending = true;
  d->cur = (d->cur + 1) % KILN_VK_FRAMES;
  return KILN_OK;
}

static kiln_status begin(vk_dev *d, int index) {
  vk_frame *f = &d->frames[d->cur];
  if (f->recording) return KILN_OK;
  kiln_status st = wait_frame(d, index, f);
  if (st != KILN_OK) return st;
  VK->vkResetCommandBuffer(f->cb, 0);
  VkCommandBufferBeginInfo bi = {.sType = VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO,
                                 .flags = VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT};
  VkResult r = VK->vkBeginCommandBuffer(f->cb, &bi);
  if (r != VK_SUCCESS) return kiln__vk_fail(d, index, r, "vkBeginCommandBuffer");
  if (d->qpool) {
    VK->vkCmdResetQueryPool(f->cb, d->qpool, (uint32_t)(2 * d->cur), 2);
    VK->vkCmdWriteTimestamp(f->cb, VK_PIPELINE_STAGE_TOP_OF_PIPE_BIT, d->qpool, (uint32_t)(2 * d->cur));
  }
  f->recording = true;
  f->n_cmds = 0;
  f->params_used = 0;
  return KILN_OK;
}

VkCommandBuffer kiln__vk_cmd(vk_dev *d, int index) {
  if (kiln__vk_check_lost(d, index) != KILN_OK || begin(d, index) != KILN_OK) return NULL;
  vk_frame *f = &d->frames[d->cur];
  if (d->no_barrier)
    d->no_barrier = false;
  else
    barrier(f->cb, VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT | VK_PIPELINE_STAGE_TRANSFER_BIT,
            VK_ACCESS_SHADER_READ_BIT | VK_ACCESS_SHADER_WRITE_BIT | VK_ACCESS_TRANSFER_READ_BIT |
                VK_ACCESS_TRANSFER_WRITE_BIT);
  return f->cb;
}

void *kiln__vk_params(vk_dev *d, int index, size_t n, uint64_t *addr) {
  n = (n + 255) & ~(size_t)255;
  if (n > KILN_VK_PARAM_RING) {
    kiln_set_error(KILN_ERR_INTERNAL, "kiln: vulkan: a parameter block of %zu bytes", n);
    return NULL;
  }
  if (begin(d, index) != KILN_OK) return NULL;
  vk_frame *f = &d->frames[d->cur];
  if (f->params_used + n > KILN_VK_PARAM_RING) { /* full: submit it, take the next frame */
    if (submit(d, index) != KILN_OK || begin(d, index) != KILN_OK) return NULL;
    f = &d->frames[d->cur];
  }
  void *p = f->params.map + f->params_used;
  *addr = f->params.addr + f->params_used;
  f->params_used += n;
  return p;
}

kiln_status kiln__vk_cmd_done(vk_dev *d, int index) {
  vk_frame *f = &d->frames[d->cur];
  if (++f->n_cmds >= KILN_VK_BATCH) return submit(d, index);
  return KILN_OK;
}

kiln_status kiln__vk_finish(vk_dev *d, int index) {
  kiln_status st = kiln__vk_check_lost(d, index);
  if (st == KILN_OK) st = submit(d, index);
  for (int i = 0; i < KILN_VK_FRAMES && st == KILN_OK; i++) st = wait_frame(d, index, &d->frames[i]);
  /* Kernels cannot fail as they run: an index out of range is skipped and sets the error
  ** word, which the next sync turns into KILN_ERR_INDEX (as the CUDA backend does). */
  if (d->qpool && st == KILN_OK && d->gpu_n > 0) {
    fprintf(stderr, "kiln: vulkan:%d sync: GPU busy %.3f ms in %d command buffers\n", index, d->gpu_s * 1e3,
            d->gpu_n);
    d->gpu_s = 0, d->gpu_n = 0;
  }
  volatile uint32_t *flag = (volatile uint32_t *)d->flag.map;
  if (st == KILN_OK && flag && *flag) {
    uint32_t code = *flag;
    *flag = 0;
    st = kiln_set_error(KILN_ERR_INDEX,
                        "kiln: vulkan:%d: %s out of range in an op queued since the last sync "
                        "(the element was skipped)",
                        index, code == 2 ? "a cross-entropy target was" : "an index was");
  }
  return st;
}

void kiln__vk_next_independent(int device, bool on) {
  vk_dev *d = kiln__vk_dev(device);
  if (!d) return;
  pthread_mutex_lock(&d->lock);
  d->no_barrier = on;
  pthread_mutex_unlock(&d->lock);
}
