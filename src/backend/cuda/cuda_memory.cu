/*
** The caching allocator: device memory is taken from cudaMalloc in segments and kept;
** tensors get blocks cut from them, and a freed block goes back to a free list instead of
** to the driver (DESIGN.md: no allocation per op on the GPU).
**
** Sizes are rounded to 512 bytes. Requests up to 1 MiB come from 2 MiB segments (the
** small pool); larger ones from segments rounded up to 2 MiB (the large pool). A free
** list per pool is ordered by (size, address), so lower_bound is best fit; a block much
** larger than asked is split, and neighbours in a segment merge again when both are free.
** This is PyTorch's scheme (c10/cuda/CUDACachingAllocator.cpp), minus its refinements.
**
** Frees are stream-ordered without events: all work on a device goes on one stream, so a
** block freed on the host while kernels that use it are still queued is only reused by
** kernels queued after them.
**
** Graph capture: no cudaMalloc/cudaFree may happen while a stream captures. Blocks
** allocated or freed during a capture carry the graph's id; when the capture ends, such
** blocks that are free, and later frees of the rest, are parked with the graph instead of
** going back to the free lists, so a replay never touches memory given to someone else.
** They return to the pools when the graph is freed.
*/
#include "cuda_int.cuh"

#include <mutex>
#include <set>
#include <stdio.h>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace {

const size_t kRound = 512;
const size_t kSmallSize = (size_t)1 << 20;   /* requests up to this are "small" */
const size_t kSmallSegment = (size_t)2 << 20; /* segment size for small requests */
const size_t kLargeRound = (size_t)2 << 20;  /* large segments are multiples of this */

struct Block {
  char *ptr;
  size_t size;
  bool allocated;
  bool parked; /* held for a graph */
  bool small;
  int graph;   /* id of the capture that allocated it, 0 none */
  Block *prev, *next; /* neighbours within one segment */
};

struct BlockLess {
  bool operator()(const Block *a, const Block *b) const {
    if (a->size != b->size) return a->size < b->size;
    return (uintptr_t)a->ptr < (uintptr_t)b->ptr;
  }
};

typedef std::set<Block *, BlockLess> FreeSet;

struct DevAlloc {
  std::mutex mu;
  FreeSet free_small, free_large;
  std::unordered_map<void *, Block *> live;
  int64_t allocated = 0, reserved = 0, peak = 0, num_allocs = 0, num_device_allocs = 0,
          num_ooms = 0, limit = 0;
  int capture_id = 0;
  std::unordered_set<int> graphs; /* ids of graphs that hold blocks */
  std::unordered_map<int, std::vector<Block *>> parked;
};

DevAlloc *g_alloc[KC_MAX_DEV];
std::mutex g_alloc_mu;

DevAlloc *get(int device) {
  if (device < 0 || device >= KC_MAX_DEV) return NULL;
  std::lock_guard<std::mutex> lock(g_alloc_mu);
  if (!g_alloc[device]) g_alloc[device] = new DevAlloc();
  return g_alloc[device];
}

FreeSet &pool_of(DevAlloc *m, const Block *b) { return b->small ? m->free_small : m->free_large; }

void fmt_bytes(char *buf, size_t n, double b) {
  if (b >= 1073741824.0) snprintf(buf, n, "%.2f GiB", b / 1073741824.0);
  else if (b >= 1048576.0) snprintf(buf, n, "%.2f MiB", b / 1048576.0);
  else if (b >= 1024.0) snprintf(buf, n, "%.2f KiB", b / 1024.0);
  else snprintf(buf, n, "%.0f bytes", b);
}

/* cudaFree every segment that is wholly free. Caller holds m->mu. */
void release_cached(DevAlloc *m) {
  FreeSet *pools[2] = {&m->free_small, &m->free_large};
  for (FreeSet *p : pools) {
    for (auto it = p->begin(); it != p->end();) {
      Block *b = *it;
      if (!b->prev && !b->next) {
        if (cudaFree(b->ptr) != cudaSuccess) (void)cudaGetLastError();
        m->reserved -= (int64_t)b->size;
        it = p->erase(it);
        delete b;
      } else {
        ++it;
      }
    }
  }
}

/* Returns b to its pool, merging with free neighbours. Caller holds m->mu. */
void insert_free(DevAlloc *m, Block *b) {
  FreeSet &pool = pool_of(m, b);
  b->allocated = false;
  b->parked = false;
  Block *p = b->prev;
  if (p && !p->allocated && !p->parked) {
    pool.erase(p);
    p->size += b->size;
    p->next = b->next;
    if (b->next) b->next->prev = p;
    if (b->graph > p->graph) p->graph = b->graph;
    delete b;
    b = p;
  }
  Block *n = b->next;
  if (n && !n->allocated && !n->parked) {
    pool.erase(n);
    b->size += n->size;
    b->next = n->next;
    if (n->next) n->next->prev = b;
    if (n->graph > b->graph) b->graph = n->graph;
    delete n;
  }
  pool.insert(b);
}

kiln_status oom(DevAlloc *m, int device, size_t want, const char *why) {
  m->num_ooms++;
  size_t free_b = 0, total_b = 0;
  if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) (void)cudaGetLastError();
  char w[32], al[32], rs[32], fr[32], tt[32], lm[32];
  fmt_bytes(w, sizeof w, (double)want);
  fmt_bytes(al, sizeof al, (double)m->allocated);
  fmt_bytes(rs, sizeof rs, (double)m->reserved);
  fmt_bytes(fr, sizeof fr, (double)free_b);
  fmt_bytes(tt, sizeof tt, (double)total_b);
  fmt_bytes(lm, sizeof lm, (double)m->limit);
  return kiln_set_error(
      KILN_ERR_OOM,
      "kiln: CUDA out of memory on cuda:%d: tried to allocate %s%s%s; %s allocated, %s "
      "reserved, %s free of %s%s%s. Try a smaller batch, free tensors you no longer need, "
      "or kiln_memory_empty_cache()",
      device, w, why ? " " : "", why ? why : "", al, rs, fr, tt, m->limit ? "; limit " : "",
      m->limit ? lm : "");
}

} // namespace

static void *cached_alloc(kiln__cuda_dev *d, int device, size_t nbytes) {
  DevAlloc *m = get(device);
  if (nbytes > ((size_t)1 << 48)) {
    std::lock_guard<std::mutex> lock(m->mu);
    oom(m, device, nbytes, "(more than any device has)");
    return NULL;
  }
  size_t size = nbytes == 0 ? kRound : (nbytes + kRound - 1) / kRound * kRound;
  bool small = size <= kSmallSize;
  std::lock_guard<std::mutex> lock(m->mu);
  FreeSet &pool = small ? m->free_small : m->free_large;
  Block key = {NULL, size, false, false, small, 0, NULL, NULL};
  Block *b = NULL;
  auto it = pool.lower_bound(&key);
  if (it != pool.end()) {
    b = *it;
    pool.erase(it);
  } else {
    size_t seg = small ? kSmallSegment : (size + kLargeRound - 1) / kLargeRound * kLargeRound;
    /* Inside a capture a new segment is still allowed, as PyTorch's allocator allows it:
    ** cudaMalloc is called with the thread's capture mode relaxed for that call alone
    ** (the capture's own mode forbids it), and the graph then keeps the block
    ** (capture_note below). What a capture must not do is free cached blocks (cudaFree
    ** waits for the device), so the cache is only trimmed outside one. A warm-up step
    ** still makes a capture allocate nothing new in most steps, but a step whose eager
    ** form held different memory (autocast's kept copies are used eagerly, not in a
    ** capture) no longer fails to capture. */
    bool cap = d->capturing;
    if (m->limit && m->reserved + (int64_t)seg > m->limit) {
      if (!cap) release_cached(m);
      if (m->reserved + (int64_t)seg > m->limit) {
        oom(m, device, nbytes, "(over the memory limit)");
        return NULL;
      }
    }
    void *p = NULL;
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    if (cap) (void)cudaThreadExchangeStreamCaptureMode(&mode);
    cudaError_t e = cudaMalloc(&p, seg);
    if (e != cudaSuccess && !cap) {
      (void)cudaGetLastError();
      release_cached(m);
      e = cudaMalloc(&p, seg);
    }
    if (cap) (void)cudaThreadExchangeStreamCaptureMode(&mode);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      oom(m, device, nbytes, NULL);
      return NULL;
    }
    m->reserved += (int64_t)seg;
    m->num_device_allocs++;
    b = new Block{(char *)p, seg, false, false, small, 0, NULL, NULL};
  }
  /* Split off the rest when it is worth keeping apart. */
  size_t rest = b->size - size;
  if ((small && rest >= kRound) || (!small && rest > kSmallSize)) {
    Block *r = new Block{b->ptr + size, rest, false, false, small, b->graph, b, b->next};
    if (b->next) b->next->prev = r;
    b->next = r;
    b->size = size;
    pool.insert(r);
  }
  b->allocated = true;
  if (m->capture_id) b->graph = m->capture_id;
  m->live[b->ptr] = b;
  m->allocated += (int64_t)b->size;
  if (m->allocated > m->peak) m->peak = m->allocated;
  m->num_allocs++;
  return b->ptr;
}

extern "C" void *kiln__cuda_alloc(int device, size_t nbytes) {
  kiln__cuda_dev *d;
  if (kiln__cuda_ctx(device, &d) != KILN_OK) return NULL;
  void *p = cached_alloc(d, device, nbytes);
  /* scratch an op takes inside a capture: the op writes it (cuda_capture.cu) */
  if (p && d->capturing && kiln__cuda_capture_note(device, p, nbytes ? nbytes : 1) != KILN_OK) {
    kiln__cuda_free(device, p, nbytes);
    return NULL;
  }
  return p;
}

extern "C" void kiln__cuda_free(int device, void *ptr, size_t nbytes) {
  (void)nbytes;
  if (!ptr) return;
  DevAlloc *m = get(device);
  if (!m) return;
  std::lock_guard<std::mutex> lock(m->mu);
  auto it = m->live.find(ptr);
  if (it == m->live.end()) return; /* not ours: a bug above, but never corrupt the pools */
  Block *b = it->second;
  m->live.erase(it);
  m->allocated -= (int64_t)b->size;
  /* Freed while capturing: the graph may use it (an input freed at the end of the step),
  ** so it joins the capture's blocks, unless an older live graph already holds it. */
  if (m->capture_id && !(b->graph && b->graph != m->capture_id && m->graphs.count(b->graph)))
    b->graph = m->capture_id;
  if (b->graph && b->graph != m->capture_id && m->graphs.count(b->graph)) {
    b->allocated = false;
    b->parked = true;
    m->parked[b->graph].push_back(b);
    return;
  }
  if (b->graph && !m->graphs.count(b->graph)) b->graph = 0;
  insert_free(m, b);
}

extern "C" kiln_status kiln__cuda_memory_stats(int device, kiln_memory_stats *out) {
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(device, &d));
  DevAlloc *m = get(device);
  std::lock_guard<std::mutex> lock(m->mu);
  out->allocated = m->allocated;
  out->reserved = m->reserved;
  out->peak_allocated = m->peak;
  out->num_allocs = m->num_allocs;
  out->num_device_allocs = m->num_device_allocs;
  out->num_ooms = m->num_ooms;
  out->limit = m->limit;
  return KILN_OK;
}

extern "C" kiln_status kiln__cuda_empty_cache(int device) {
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(device, &d));
  if (d->capturing)
    return kiln_set_error(KILN_ERR_STATE, "kiln: empty_cache during graph capture (cuda:%d)",
                          device);
  DevAlloc *m = get(device);
  std::lock_guard<std::mutex> lock(m->mu);
  release_cached(m); /* cudaFree waits for the device, so queued users are done */
  return KILN_OK;
}

extern "C" kiln_status kiln__cuda_set_memory_limit(int device, int64_t bytes) {
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(device, &d));
  if (bytes < 0)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_memory_set_limit: negative limit %lld",
                          (long long)bytes);
  DevAlloc *m = get(device);
  std::lock_guard<std::mutex> lock(m->mu);
  m->limit = bytes;
  if (bytes && m->reserved > bytes && !d->capturing) release_cached(m);
  return KILN_OK;
}

extern "C" void kiln__cuda_reset_peak(int device) {
  DevAlloc *m = get(device);
  if (!m) return;
  std::lock_guard<std::mutex> lock(m->mu);
  m->peak = m->allocated;
}

extern "C" void kiln__cuda_mem_capture_begin(int device, int id) {
  DevAlloc *m = get(device);
  if (!m) return;
  std::lock_guard<std::mutex> lock(m->mu);
  m->capture_id = id;
  m->graphs.insert(id);
}

extern "C" void kiln__cuda_mem_capture_end(int device, int id, bool ok) {
  DevAlloc *m = get(device);
  if (!m) return;
  std::lock_guard<std::mutex> lock(m->mu);
  m->capture_id = 0;
  if (!ok) {
    m->graphs.erase(id);
    return;
  }
  /* Free blocks the capture used: the graph's replays still write them. */
  FreeSet *pools[2] = {&m->free_small, &m->free_large};
  for (FreeSet *p : pools) {
    for (auto it = p->begin(); it != p->end();) {
      Block *b = *it;
      if (b->graph == id) {
        it = p->erase(it);
        b->parked = true;
        m->parked[id].push_back(b);
      } else {
        ++it;
      }
    }
  }
}

extern "C" void kiln__cuda_mem_graph_release(int device, int id) {
  DevAlloc *m = get(device);
  if (!m) return;
  std::lock_guard<std::mutex> lock(m->mu);
  m->graphs.erase(id);
  auto it = m->parked.find(id);
  if (it == m->parked.end()) return;
  std::vector<Block *> blocks;
  blocks.swap(it->second);
  m->parked.erase(it);
  for (Block *b : blocks) b->parked = false, b->allocated = true; /* not yet mergeable */
  for (Block *b : blocks) {
    b->graph = 0;
    insert_free(m, b);
  }
}
