/*
** What the CUDA backend offers the layers above the backend seam (the loader, graphs,
** `kiln doctor`), in plain C: no CUDA types, so any C file may include it. Compiled in
** only with KILN_HAVE_CUDA; every function returns KILN_OK or sets the last error.
*/
#ifndef KILN_CUDA_API_H
#define KILN_CUDA_API_H

#include "kiln.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The device's one stream (a cudaStream_t as void *), created on first use; NULL (with
** the last error set) when the device does not work. All kiln work on the device goes on
** it, so work queued by another layer on it is ordered with kiln's. */
void *kiln__cuda_stream(int device);

/* Pinned (page-locked) host memory, for the data loader: copies from it are truly
** asynchronous (to any device). Made with `device` current, so that a thread that has
** used no device yet does not start device 0's context. Free with kiln__cuda_host_free
** (NULL is a no-op). */
kiln_status kiln__cuda_host_alloc(int device, void **p, size_t n);
void kiln__cuda_host_free(void *p);
/* Queues a host->device copy on the device's stream and returns at once. src must be
** pinned (kiln__cuda_host_alloc) and stay untouched until an event recorded after this
** call has completed. */
kiln_status kiln__cuda_copy_from_host_async(int device, void *dst, const void *src, size_t n);

/* Events (cudaEvent_t as void *), for the loader's buffer recycling. An event belongs to
** its device: it may be recorded on that device's streams only. */
kiln_status kiln__cuda_event_new(int device, void **ev);
void kiln__cuda_event_free(void *ev);
kiln_status kiln__cuda_event_record(int device, void *ev);        /* on the stream */
kiln_status kiln__cuda_event_wait(int device, void *ev);          /* stream waits for ev */
kiln_status kiln__cuda_event_synchronize(void *ev);               /* host waits for ev */
/* 1 when the event's work is done, 0 when not yet, -1 on error (last error set). */
int kiln__cuda_event_query(void *ev);

/* The side copy stream (one per device, non-blocking, created on first use): the data
** loader's host->device copies run on it, beside the kernels of the device's stream, and
** meet that stream only through events. It is never captured. */
/* Queues a host->device copy on the side stream and returns at once. src must be pinned
** (kiln__cuda_host_alloc) and stay untouched until an event recorded on the side stream
** after this call has completed; dst must not be touched by the device's stream until
** that stream has waited for such an event. */
kiln_status kiln__cuda_side_copy_from_host(int device, void *dst, const void *src, size_t n);
kiln_status kiln__cuda_side_event_record(int device, void *ev);   /* on the side stream */
kiln_status kiln__cuda_side_event_wait(int device, void *ev);     /* side stream waits for ev */

/* CUDA graphs by stream capture (cudaStreamCaptureModeThreadLocal). Between begin and
** end, kernels are recorded, not run; the caching allocator serves only memory it already
** holds (KILN_ERR_STATE "allocation during graph capture needs a warm-up step first"
** otherwise) and copies to the host fail with KILN_ERR_STATE. Memory allocated during
** the capture stays with the graph until kiln__cuda_graph_free, so replays never write
** into blocks handed to other tensors. */
kiln_status kiln__cuda_graph_begin(int device);
kiln_status kiln__cuda_graph_end(int device, void **graph_exec);
kiln_status kiln__cuda_graph_launch(int device, void *graph_exec);
void kiln__cuda_graph_free(void *graph_exec); /* NULL is a no-op */
/* The captured graph's node count and its longest chain of dependent nodes (-1 unknown):
** with data dependencies (cuda_capture.cu) independent ops make the chain shorter. */
void kiln__cuda_graph_shape(const void *graph_exec, int *nodes, int *depth);
/* Whether a capture is in progress on the device. */
bool kiln__cuda_capturing(int device);

/* For `kiln doctor`. Versions are CUDA's integers (12040 = 12.4). */
typedef struct kiln__cuda_info {
  char name[256];
  int major, minor; /* compute capability */
  int multiprocessors;
  int64_t total_mem, free_mem; /* bytes */
  int driver_version, runtime_version, cublas_version;
  int cudnn_version; /* cudnnGetVersion(); 0 in a build without cuDNN */
} kiln__cuda_info;
kiln_status kiln__cuda_device_info(int device, kiln__cuda_info *out);
/* Host<->device copy bandwidth in GB/s (1e9 bytes/s), pinned memory, 64 MiB, a few
** repetitions, best of them. */
kiln_status kiln__cuda_bandwidth(int device, double *h2d_gbs, double *d2h_gbs);

#ifdef __cplusplus
}
#endif
#endif /* KILN_CUDA_API_H */
