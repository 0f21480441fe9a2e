/*
** Device memory: a caching sub-allocator over VkDeviceMemory blocks (the CUDA backend's
** idea, simpler). Each block is one vkAllocateMemory bound to one VkBuffer with the
** device-address usage; what kiln gets is a device address inside it.
**
**   small (<= 1 MiB): rounded up to a power of two >= 256 B and cut from 8 MiB chunks;
**          a freed slot goes to its class's free list and is reused as is. A chunk goes
**          back to the driver (empty_cache) once none of its slots is in use.
**   large: rounded up to 1 MiB, one block each; a freed block is cached and reused for a
**          request it fits without wasting more than a quarter (+ 1 MiB).
** When the driver refuses a block (or the limit would be passed), the cache is emptied
** and the allocation tried once more; then KILN_ERR_OOM with the numbers, and the
** program can free tensors and go on. Freed memory may be reused by the next kernel at
** once: every kernel runs in queue order behind a barrier (vk_submit.c), so a kernel
** still reading the old tensor has finished before the new one is written.
*/
#include "vk_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

VkResult kiln__vk_block_make(vk_dev *d, uint64_t size, uint32_t type, bool map, vk_block *b) {
  memset(b, 0, sizeof *b);
  b->size = size;
  VkBufferCreateInfo bi = {.sType = VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO,
                           .size = size,
                           .usage = VK_BUFFER_USAGE_STORAGE_BUFFER_BIT | VK_BUFFER_USAGE_TRANSFER_SRC_BIT |
                                    VK_BUFFER_USAGE_TRANSFER_DST_BIT |
                                    VK_BUFFER_USAGE_SHADER_DEVICE_ADDRESS_BIT,
                           .sharingMode = VK_SHARING_MODE_EXCLUSIVE};
  VkResult r = VK->vkCreateBuffer(d->dev, &bi, NULL, &b->buf);
  if (r != VK_SUCCESS) return r;
  VkMemoryRequirements mr;
  VK->vkGetBufferMemoryRequirements(d->dev, b->buf, &mr);
  VkMemoryAllocateFlagsInfo fl = {.sType = VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_FLAGS_INFO,
                                  .flags = VK_MEMORY_ALLOCATE_DEVICE_ADDRESS_BIT};
  VkMemoryAllocateInfo ai = {.sType = VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO,
                             .pNext = &fl,
                             .allocationSize = mr.size,
                             .memoryTypeIndex = type};
  r = VK->vkAllocateMemory(d->dev, &ai, NULL, &b->mem);
  if (r == VK_SUCCESS) r = VK->vkBindBufferMemory(d->dev, b->buf, b->mem, 0);
  if (r == VK_SUCCESS && map) {
    void *p = NULL;
    r = VK->vkMapMemory(d->dev, b->mem, 0, VK_WHOLE_SIZE, 0, &p);
    b->map = p;
  }
  if (r == VK_SUCCESS) {
    VkBufferDeviceAddressInfo ba = {.sType = VK_STRUCTURE_TYPE_BUFFER_DEVICE_ADDRESS_INFO, .buffer = b->buf};
    b->addr = VK->vkGetBufferDeviceAddress(d->dev, &ba);
    if (!b->addr) r = VK_ERROR_UNKNOWN;
  }
  if (r != VK_SUCCESS) kiln__vk_block_release(d, b);
  return r;
}

void kiln__vk_block_release(vk_dev *d, vk_block *b) {
  if (b->map) VK->vkUnmapMemory(d->dev, b->mem);
  if (b->buf) VK->vkDestroyBuffer(d->dev, b->buf, NULL);
  if (b->mem) VK->vkFreeMemory(d->dev, b->mem, NULL);
  memset(b, 0, sizeof *b);
}

/* ---- the sorted table of blocks ---- */
vk_block *kiln__vk_find(vk_dev *d, uint64_t a) {
  int lo = 0, hi = d->n_blocks - 1;
  while (lo <= hi) {
    int mid = (lo + hi) / 2;
    vk_block *b = d->blocks[mid];
    if (a < b->addr) hi = mid - 1;
    else if (a >= b->addr + b->size) lo = mid + 1;
    else return b;
  }
  return NULL;
}

static bool table_insert(vk_dev *d, vk_block *b) {
  if (d->n_blocks == d->cap_blocks) {
    int cap = d->cap_blocks ? 2 * d->cap_blocks : 64;
    vk_block **nb = realloc(d->blocks, (size_t)cap * sizeof *nb);
    if (!nb) return false;
    d->blocks = nb;
    d->cap_blocks = cap;
  }
  int i = d->n_blocks;
  while (i > 0 && d->blocks[i - 1]->addr > b->addr) {
    d->blocks[i] = d->blocks[i - 1];
    i--;
  }
  d->blocks[i] = b;
  d->n_blocks++;
  return true;
}

static void table_remove(vk_dev *d, vk_block *b) {
  int k = 0;
  for (int i = 0; i < d->n_blocks; i++)
    if (d->blocks[i] != b) d->blocks[k++] = d->blocks[i];
  d->n_blocks = k;
}

static void fmt_bytes(char *buf, size_t n, double b) {
  if (b >= 1073741824.0) snprintf(buf, n, "%.2f GiB", b / 1073741824.0);
  else if (b >= 1048576.0) snprintf(buf, n, "%.2f MiB", b / 1048576.0);
  else if (b >= 1024.0) snprintf(buf, n, "%.2f KiB", b / 1024.0);
  else snprintf(buf, n, "%.0f bytes", b);
}

static void oom(vk_dev *d, int device, uint64_t want, const char *why) {
  d->num_ooms++;
  char w[32], al[32], rs[32], tt[32], lm[32];
  fmt_bytes(w, sizeof w, (double)want);
  fmt_bytes(al, sizeof al, (double)d->allocated);
  fmt_bytes(rs, sizeof rs, (double)d->reserved);
  fmt_bytes(tt, sizeof tt, (double)d->heap_size);
  fmt_bytes(lm, sizeof lm, (double)d->limit);
  kiln_set_error(KILN_ERR_OOM,
                 "kiln: Vulkan out of memory on vulkan:%d: tried to allocate %s (%s); %s "
                 "allocated, %s reserved, heap of %s%s%s. Try a smaller batch, free tensors you "
                 "no longer need, or kiln_memory_empty_cache()",
                 device, w, why, al, rs, tt, d->limit ? "; limit " : "", d->limit ? lm : "");
}

/* Releases cached large blocks and empty small chunks. The queue is drained first: a
** block's memory may still be read by queued work (its tensor freed after the kernel was
** queued). d->lock held. */
static void release_cache(vk_dev *d, int device) {
  if (kiln__vk_finish(d, device) != KILN_OK) kiln_clear_error();
  for (int c = 0; c < VK_N_CLASSES; c++) { /* drop free slots of chunks about to go */
    int k = 0;
    for (int i = 0; i < d->n_free_small[c]; i++) {
      vk_block *b = kiln__vk_find(d, d->free_small[c][i]);
      if (b && b->live > 0) d->free_small[c][k++] = d->free_small[c][i];
    }
    d->n_free_small[c] = k;
  }
  int i = 0;
  while (i < d->n_blocks) {
    vk_block *b = d->blocks[i];
    bool go = b->kind == VK_BLOCK_LARGE ? b->cached : (b->live == 0 && b != d->chunk);
    if (!go) {
      i++;
      continue;
    }
    table_remove(d, b);
    d->reserved -= (int64_t)b->size;
    kiln__vk_block_release(d, b);
    free(b);
  }
  if (d->chunk && d->chunk->live == 0) { /* the current chunk too: start a fresh one later */
    vk_block *b = d->chunk;
    for (int c = 0; c < VK_N_CLASSES; c++) { /* its free slots, if any, were kept above */
      int k = 0;
      for (int j = 0; j < d->n_free_small[c]; j++)
        if (kiln__vk_find(d, d->free_small[c][j]) != b) d->free_small[c][k++] = d->free_small[c][j];
      d->n_free_small[c] = k;
    }
    table_remove(d, b);
    d->reserved -= (int64_t)b->size;
    kiln__vk_block_release(d, b);
    free(b);
    d->chunk = NULL;
  }
}

/* A new block of size bytes in the table; NULL with the OOM error set. */
static vk_block *new_block(vk_dev *d, int device, uint64_t size, int kind) {
  for (int attempt = 0; attempt < 2; attempt++) {
    if (attempt) release_cache(d, device);
    if (d->limit && d->reserved + (int64_t)size > d->limit) continue;
    vk_block *b = calloc(1, sizeof *b);
    if (!b) break;
    VkResult r = kiln__vk_block_make(d, size, d->mem_type, d->unified, b);
    if (r == VK_ERROR_DEVICE_LOST) {
      free(b);
      kiln__vk_fail(d, device, r, "vkAllocateMemory");
      return NULL;
    }
    if (r != VK_SUCCESS || !table_insert(d, b)) {
      if (r == VK_SUCCESS) kiln__vk_block_release(d, b);
      free(b);
      continue;
    }
    b->kind = kind;
    d->reserved += (int64_t)size;
    d->num_device_allocs++;
    return b;
  }
  oom(d, device, size, d->limit && d->reserved + (int64_t)size > d->limit ? "past the memory limit"
                                                                          : "the driver refused");
  return NULL;
}

static int size_class(uint64_t n, uint64_t *rounded) {
  uint64_t s = VK_SMALL_MIN;
  int c = 0;
  while (s < n) s <<= 1, c++;
  *rounded = s;
  return c;
}

void *kiln__vk_alloc(int device, size_t nbytes) {
  vk_dev *d = kiln__vk_dev(device);
  if (!d) {
    kiln_set_error(KILN_ERR_DEVICE, "kiln: no device vulkan:%d", device);
    return NULL;
  }
  pthread_mutex_lock(&d->lock);
  uint64_t addr = 0, size = 0;
  if (kiln__vk_check_lost(d, device) != KILN_OK) goto out;
  if (nbytes > d->heap_size) {
    oom(d, device, nbytes, "more than the device's memory heap");
    goto out;
  }
  if (nbytes <= VK_SMALL_MAX) {
    int c = size_class(nbytes ? nbytes : 1, &size);
    if (d->n_free_small[c] > 0) {
      addr = d->free_small[c][--d->n_free_small[c]];
    } else {
      if (!d->chunk || d->chunk_used + size > d->chunk->size) {
        vk_block *b = new_block(d, device, VK_CHUNK, VK_BLOCK_SMALL);
        if (!b) goto out;
        d->chunk = b;
        d->chunk_used = 0;
      }
      addr = d->chunk->addr + d->chunk_used;
      d->chunk_used += size;
    }
    kiln__vk_find(d, addr)->live++;
  } else {
    size = (nbytes + ((1u << 20) - 1)) & ~(uint64_t)((1u << 20) - 1);
    vk_block *best = NULL;
    for (int i = 0; i < d->n_blocks; i++) {
      vk_block *b = d->blocks[i];
      if (b->kind == VK_BLOCK_LARGE && b->cached && b->size >= size &&
          b->size <= size + size / 4 + (1u << 20) && (!best || b->size < best->size))
        best = b;
    }
    if (!best) best = new_block(d, device, size, VK_BLOCK_LARGE);
    if (!best) goto out;
    best->cached = false;
    best->live = 1;
    size = best->size;
    addr = best->addr;
  }
  d->allocated += (int64_t)size;
  if (d->allocated > d->peak) d->peak = d->allocated;
  d->num_allocs++;
out:
  pthread_mutex_unlock(&d->lock);
  return (void *)(uintptr_t)addr;
}

void kiln__vk_free(int device, void *ptr, size_t nbytes) {
  vk_dev *d = kiln__vk_dev(device);
  if (!d || !ptr) return;
  pthread_mutex_lock(&d->lock);
  uint64_t a = (uint64_t)(uintptr_t)ptr;
  vk_block *b = kiln__vk_find(d, a);
  if (b && b->kind == VK_BLOCK_LARGE) {
    b->cached = true;
    b->live = 0;
    d->allocated -= (int64_t)b->size;
  } else if (b) {
    uint64_t size;
    int c = size_class(nbytes ? nbytes : 1, &size);
    if (d->n_free_small[c] == d->cap_free_small[c]) {
      int cap = d->cap_free_small[c] ? 2 * d->cap_free_small[c] : 64;
      uint64_t *nf = realloc(d->free_small[c], (size_t)cap * sizeof *nf);
      if (!nf) { /* the slot is lost to the cache until the chunk goes: harmless */
        pthread_mutex_unlock(&d->lock);
        return;
      }
      d->free_small[c] = nf;
      d->cap_free_small[c] = cap;
    }
    d->free_small[c][d->n_free_small[c]++] = a;
    b->live--;
    d->allocated -= (int64_t)size;
  }
  pthread_mutex_unlock(&d->lock);
}

kiln_status kiln__vk_memory_stats(int device, kiln_memory_stats *out) {
  vk_dev *d = kiln__vk_dev(device);
  if (!d) return kiln_set_error(KILN_ERR_DEVICE, "kiln: no device vulkan:%d", device);
  pthread_mutex_lock(&d->lock);
  out->allocated = d->allocated;
  out->reserved = d->reserved;
  out->peak_allocated = d->peak;
  out->num_allocs = d->num_allocs;
  out->num_device_allocs = d->num_device_allocs;
  out->num_ooms = d->num_ooms;
  out->limit = d->limit;
  pthread_mutex_unlock(&d->lock);
  return KILN_OK;
}

kiln_status kiln__vk_empty_cache(int device) {
  vk_dev *d = kiln__vk_dev(device);
  if (!d) return kiln_set_error(KILN_ERR_DEVICE, "kiln: no device vulkan:%d", device);
  pthread_mutex_lock(&d->lock);
  release_cache(d, device);
  pthread_mutex_unlock(&d->lock);
  return KILN_OK;
}

kiln_status kiln__vk_set_limit(int device, int64_t bytes) {
  vk_dev *d = kiln__vk_dev(device);
  if (!d) return kiln_set_error(KILN_ERR_DEVICE, "kiln: no device vulkan:%d", device);
  pthread_mutex_lock(&d->lock);
  d->limit = bytes;
  pthread_mutex_unlock(&d->lock);
  return KILN_OK;
}

void kiln__vk_reset_peak(int device) {
  vk_dev *d = kiln__vk_dev(device);
  if (!d) return;
  pthread_mutex_lock(&d->lock);
  d->peak = d->allocated;
  pthread_mutex_unlock(&d->lock);
}

void kiln__vk_memory_destroy(vk_dev *d) {
  for (int i = 0; i < d->n_blocks; i++) {
    kiln__vk_block_release(d, d->blocks[i]);
    free(d->blocks[i]);
  }
  free(d->blocks);
  d->blocks = NULL;
  d->n_blocks = d->cap_blocks = 0;
  for (int c = 0; c < VK_N_CLASSES; c++) free(d->free_small[c]), d->free_small[c] = NULL;
}
