/*
** The Vulkan backend's internals, shared by its files (never included outside
** src/backend/vulkan/).
**
** Design in one paragraph. The loader is opened with dlopen (vk_loader.c), so libkiln
** runs where there is none. Each physical device that can run kiln (Vulkan 1.2, a compute
** queue, bufferDeviceAddress, shaderInt64) is one device vulkan:N, discrete GPUs first.
** Device memory is served by a caching sub-allocator (vk_memory.c) over large
** VkDeviceMemory blocks, each bound to one VkBuffer created with the device-address usage:
** the pointer kiln sees for a tensor is its *device address* (VkDeviceAddress), so views
** do pointer arithmetic as on CUDA, shaders reach every tensor through
** GL_EXT_buffer_reference with no descriptor sets at all, and only copies look the
** address up (a sorted table of blocks) to find a VkBuffer and an offset. Kernels are
** recorded into the current command buffer (vk_submit.c) with a global memory barrier
** before each, and submitted in batches: when a batch is large, and at every sync point
** (a copy to the host, a large copy from it, synchronize). Each dispatch's parameters
** (views' shapes and strides, scalars) are written into a host-visible ring of the batch
** and reached through a device address in the push constants; small copies from the host
** (up to 1 MiB: a batch of inputs) are staged in the same ring and copied in the queue, so
** they wait for nothing.
*/
#ifndef KILN_VK_INT_H
#define KILN_VK_INT_H

#define VK_NO_PROTOTYPES
#include <vulkan/vulkan.h>

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "backend/backend.h"
#include "core/knobs.h"
#include "vk_shaders.h"

/* ---- the loader: function pointers, loaded in three levels ---- */
#define KILN_VK_GLOBAL_FNS(X)                                                            \
  X(vkCreateInstance)                                                                    \
  X(vkEnumerateInstanceExtensionProperties)                                              \
  X(vkEnumerateInstanceVersion)

#define KILN_VK_INSTANCE_FNS(X)                                                          \
  X(vkDestroyInstance)                                                                   \
  X(vkEnumeratePhysicalDevices)                                                          \
  X(vkGetPhysicalDeviceProperties)                                                       \
  X(vkGetPhysicalDeviceProperties2)                                                      \
  X(vkGetPhysicalDeviceFeatures2)                                                        \
  X(vkGetPhysicalDeviceMemoryProperties)                                                 \
  X(vkGetPhysicalDeviceQueueFamilyProperties)                                            \
  X(vkEnumerateDeviceExtensionProperties)                                                \
  X(vkCreateDevice)                                                                      \
  X(vkGetDeviceProcAddr)

#define KILN_VK_DEVICE_FNS(X)                                                            \
  X(vkDestroyDevice)                                                                     \
  X(vkGetDeviceQueue)                                                                    \
  X(vkAllocateMemory)                                                                    \
  X(vkFreeMemory)                                                                        \
  X(vkMapMemory)                                                                         \
  X(vkUnmapMemory)                                                                       \
  X(vkCreateBuffer)                                                                      \
  X(vkDestroyBuffer)                                                                     \
  X(vkGetBufferMemoryRequirements)                                                       \
  X(vkBindBufferMemory)                                                                  \
  X(vkGetBufferDeviceAddress)                                                            \
  X(vkCreateShaderModule)                                                                \
  X(vkDestroyShaderModule)                                                               \
  X(vkCreatePipelineLayout)                                                              \
  X(vkDestroyPipelineLayout)                                                             \
  X(vkCreateComputePipelines)                                                            \
  X(vkDestroyPipeline)                                                                   \
  X(vkCreateCommandPool)                                                                 \
  X(vkDestroyCommandPool)                                                                \
  X(vkAllocateCommandBuffers)                                                            \
  X(vkResetCommandBuffer)                                                                \
  X(vkBeginCommandBuffer)                                                                \
  X(vkEndCommandBuffer)                                                                  \
  X(vkCmdBindPipeline)                                                                   \
  X(vkCmdPushConstants)                                                                  \
  X(vkCmdDispatch)                                                                       \
  X(vkCmdPipelineBarrier)                                                                \
  X(vkCmdCopyBuffer)                                                                     \
  X(vkCmdFillBuffer)                                                                     \
  X(vkQueueSubmit)                                                                       \
  X(vkQueueWaitIdle)                                                                     \
  X(vkCreateFence)                                                                       \
  X(vkDestroyFence)                                                                      \
  X(vkWaitForFences)                                                                     \
  X(vkResetFences)                                                                       \
  X(vkDeviceWaitIdle)                                                                    \
  X(vkCreateQueryPool)                                                                   \
  X(vkDestroyQueryPool)                                                                  \
  X(vkCmdResetQueryPool)                                                                 \
  X(vkCmdWriteTimestamp)                                                                 \
  X(vkGetQueryPoolResults)

typedef struct kiln__vk_api {
  void *lib; /* dlopen handle */
  PFN_vkGetInstanceProcAddr vkGetInstanceProcAddr;
#define KILN_VK_FN_FIELD(name) PFN_##name name;
  KILN_VK_GLOBAL_FNS(KILN_VK_FN_FIELD)
  KILN_VK_INSTANCE_FNS(KILN_VK_FN_FIELD)
  KILN_VK_DEVICE_FNS(KILN_VK_FN_FIELD)
#undef KILN_VK_FN_FIELD
} kiln__vk_api;

extern kiln__vk_api kiln__vk;
#define VK (&kiln__vk)

/* Opens the loader; false with *why set (a static string) when there is none. */
bool kiln__vk_load(const char **why, char *path_out, size_t path_n);
bool kiln__vk_load_instance(VkInstance inst, const char **why);
bool kiln__vk_load_device(VkDevice dev, const char **why);
const char *kiln__vk_result_str(VkResult r);

/* ---- devices ---- */
#define KILN_VK_MAX_DEVICES 8
#define KILN_VK_FRAMES 3             /* command buffers in flight */
#define KILN_VK_PARAM_RING (4 << 20) /* bytes of dispatch parameters (and small uploads) per frame */
#define KILN_VK_UPLOAD_MAX (1 << 20) /* host->device copies up to this go through the ring */
#define KILN_VK_BATCH 256            /* dispatches per submit at most */

typedef struct vk_block {
  VkDeviceMemory mem;
  VkBuffer buf;
  uint64_t addr; /* device address of byte 0 */
  uint64_t size;
  char *map;     /* host pointer of byte 0 when the memory is mapped, else NULL */
  int kind;      /* VK_BLOCK_LARGE (one allocation) or VK_BLOCK_SMALL (slots of a class) */
  int live;      /* slots in use (small) / 1 when in use (large) */
  bool cached;   /* large: free, kept for reuse */
} vk_block;
enum { VK_BLOCK_LARGE = 0, VK_BLOCK_SMALL = 1 };

#define VK_SMALL_MAX ((uint64_t)1 << 20) /* requests up to 1 MiB share chunks */
#define VK_SMALL_MIN 256                 /* and are rounded to a power of two >= 256 */
#define VK_N_CLASSES 13                  /* 256 B .. 1 MiB */
#define VK_CHUNK ((uint64_t)8 << 20)     /* the chunk small slots are cut from */

typedef struct vk_frame {
  VkCommandBuffer cb;
  VkFence fence;
  bool pending;    /* submitted, fence not yet waited for */
  bool recording;  /* begun, not yet submitted */
  int n_cmds;
  vk_block params; /* host-visible ring of dispatch parameters */
  uint64_t params_used;
} vk_frame;

typedef struct vk_dev {
  VkPhysicalDevice pd;
  VkDevice dev;
  VkQueue queue;
  uint32_t qfam;
  VkPhysicalDeviceProperties props;
  VkPhysicalDeviceMemoryProperties memprops;
  uint32_t subgroup_size;
  bool f64, f16, i8, i16, i64, atomic_f32, coop_matrix, subgroup_arith;
  bool unified;        /* device memory is host-visible (integrated GPUs, lavapipe) */
  bool coop_nv;        /* VK_NV_cooperative_matrix offered with 16x16x16 f16 -> f32 */
  bool coop_on;        /* and enabled (unless KILN_VK_COOPMAT=0): matmul_cm.comp for f16 */
  bool cm_emu;          /* KILN_VK_CM_EMU=1 on a device without them: tensor cores emulated
                        ** (matmul_cmv_*_emu), so lavapipe tests every index of matmul_cmv.glsl */
  int cm_variant;       /* the tensor-core kernel (KILN_VK_CM): an index into vk_kernels.c's cm_variants */
  bool mm_k16;          /* KILN_VK_MMBK=16: f32 products take matmul_big_f32_k16 (K steps of 16) */
  char coop_shapes[256]; /* the NV extension's shapes, "MxNxK A/B/C/D" (kiln doctor) */
  char coop_why[160];    /* why coop_on is false ("" when it is true) */
  uint32_t mem_type;   /* for tensors */
  uint32_t host_type;  /* host-visible, coherent, cached where offered (staging: the host reads it) */
  uint32_t ring_type;  /* the parameter rings': device-local and host-visible where offered
                       ** (a discrete GPU's BAR), so kernels read parameters from their own
                       ** memory, not across the bus; host_type otherwise */
  uint64_t heap_size;  /* of mem_type's heap */
  pthread_mutex_t lock;
  bool lost;           /* VK_ERROR_DEVICE_LOST seen: every later call fails */
  /* memory (vk_memory.c) */
  vk_block **blocks;   /* sorted by addr */
  int n_blocks, cap_blocks;
  uint64_t *free_small[VK_N_CLASSES];
  int n_free_small[VK_N_CLASSES], cap_free_small[VK_N_CLASSES];
  vk_block *chunk;     /* the small chunk being cut */
  uint64_t chunk_used;
  int64_t allocated, reserved, peak, num_allocs, num_device_allocs, num_ooms, limit;
  /* submission (vk_submit.c) */
  VkCommandPool pool;
  vk_frame frames[KILN_VK_FRAMES];
  int cur;
  bool no_barrier;  /* the next command is independent of the previous one: no barrier */
  /* KILN_VK_TIMING=1: each command buffer's GPU time (timestamps at its start and end),
  ** summed between syncs and printed at each sync on stderr: the device's own time,
  ** apart from the host's and the driver's */
  uint32_t ts_bits;     /* the queue family's timestampValidBits */
  VkQueryPool qpool;
  bool trace;           /* KILN_VK_TIMING=trace: each dispatch's shader and grid on stderr */
  double gpu_s;         /* GPU time of the command buffers waited for since the last sync */
  int gpu_n;
  vk_block staging; /* host-visible bounce buffer (devices without unified memory) */
  vk_block flag;    /* host-visible word kernels set on a bad index (checked at syncs) */
  /* pipelines (vk_pipeline.c), created on first use */
  VkPipelineLayout layout;
  VkPipeline *pipes;  /* kiln__vk_shader_count * KV_NSPEC: shader s specialised to v at s * KV_NSPEC + v */
  bool *pipe_failed;
  bool pipestats;     /* KILN_VK_PIPESTATS=1 and VK_KHR_pipeline_executable_properties: print them */
} vk_dev;

/* The devices, after the probe (vk_backend.c). */
int kiln__vk_count(void);
vk_dev *kiln__vk_dev(int i);
VkInstance kiln__vk_instance(void);
const char *kiln__vk_loader_path(void);
int kiln__vk_api_version(void);

/* Turns a failed VkResult into kiln's last error (and marks the device lost on
** VK_ERROR_DEVICE_LOST); returns the status. */
kiln_status kiln__vk_fail(vk_dev *d, int index, VkResult r, const char *what);
kiln_status kiln__vk_check_lost(vk_dev *d, int index);

/* memory (vk_memory.c); callers hold d->lock */
void *kiln__vk_alloc(int device, size_t nbytes);
void kiln__vk_free(int device, void *ptr, size_t nbytes);
kiln_status kiln__vk_memory_stats(int device, kiln_memory_stats *out);
kiln_status kiln__vk_empty_cache(int device);
kiln_status kiln__vk_set_limit(int device, int64_t bytes);
void kiln__vk_reset_peak(int device);
/* The block holding device address addr (NULL when none); d->lock held. */
vk_block *kiln__vk_find(vk_dev *d, uint64_t addr);
VkResult kiln__vk_block_make(vk_dev *d, uint64_t size, uint32_t type, bool map, vk_block *b);
void kiln__vk_block_release(vk_dev *d, vk_block *b);
void kiln__vk_memory_destroy(vk_dev *d);

/* submission (vk_submit.c); callers hold d->lock */
kiln_status kiln__vk_submit_init(vk_dev *d, int index);
void kiln__vk_submit_destroy(vk_dev *d);
/* The command buffer to record into (begun); a barrier is recorded before returning, so
** the next command sees every earlier one's writes. NULL with the error set. */
VkCommandBuffer kiln__vk_cmd(vk_dev *d, int index);
/* Reserves n bytes of parameters in the current frame: host pointer, device address. The
** frame may be submitted first to make room, so call it before kiln__vk_cmd. */
void *kiln__vk_params(vk_dev *d, int index, size_t n, uint64_t *addr);
/* The next command recorded is independent of the one before it (the groups of a
** multi-tensor op touch disjoint tensors), so kiln__vk_cmd records no barrier for it: the
** barrier before the first group already orders all of them after earlier work (a
** barrier's second scope is every later command in submission order). on = false takes
** the mark back (a group that dispatched nothing). Takes d->lock. */
void kiln__vk_next_independent(int device, bool on);
/* Ends the current command (counts toward the batch; submits a full batch). */
kiln_status kiln__vk_cmd_done(vk_dev *d, int index);
/* Submits what is recorded and waits for everything. */
kiln_status kiln__vk_finish(vk_dev *d, int index);

/* copies and synchronization (vk_backend.c) */
kiln_status kiln__vk_copy_to_host(int device, void *dst, const void *src, size_t n);
kiln_status kiln__vk_copy_from_host(int device, void *dst, const void *src, size_t n);
kiln_status kiln__vk_copy_device(int device, void *dst, const void *src, size_t n);
kiln_status kiln__vk_memset_zero(int device, void *ptr, size_t n);
kiln_status kiln__vk_synchronize(int device);

/* pipelines and dispatch (vk_pipeline.c) */
int kiln__vk_shader_index(const char *name);
/* Records a dispatch of shader `name` with its parameter block (copied into the frame's
** ring) over groups_x * groups_y * groups_z workgroups. Takes d->lock itself. */
kiln_status kiln__vk_dispatch(int device, const char *name, const void *params, size_t n,
                              uint32_t gx, uint32_t gy, uint32_t gz);
/* The values a shader's specialisation constant 0 may take (vk_pipeline.c) */
#define KV_NSPEC 8
/* kiln__vk_dispatch of the build of `name` with specialisation constant 0 = spec */
kiln_status kiln__vk_dispatch_spec(int device, const char *name, int spec, const void *params, size_t n,
                                   uint32_t gx, uint32_t gy, uint32_t gz);
void kiln__vk_pipelines_destroy(vk_dev *d);
/* Whether the pipeline of shader `name` exists or can be made now (false, with the error
** cleared, when the driver refused it): lets a kernel take another path instead of
** failing. Takes d->lock itself. */
bool kiln__vk_pipeline_ok(int device, const char *name);
bool kiln__vk_pipeline_ok_spec(int device, const char *name, int spec);
/* The tensor-core kernel KILN_VK_CM=key names (vk_kernels.c), the default for NULL or an
** unknown key (which it reports on stderr) */
int kiln__vk_cm_variant(const char *key);

/* the vtable's other entries (vk_backend.c) */
kiln_status kiln__vk_probe(const char **why);
int kiln__vk_device_count(void);
kiln_status kiln__vk_device_info(int device, kiln_device_info *out);
const char *kiln__vk_skipped(void);
/* The backend object (vk_kernels.c). Not const: the probe sets best_rank from the kind
** of device found. */
extern kiln__backend kiln__vulkan_backend;

/* kernels (vk_kernels.c) */
bool kiln__vk_supports(const kiln__kargs *a);

#endif /* KILN_VK_INT_H */
