/*
** CONV2D on the CPU through oneDNN (built when libdnnl-dev is found: KILN_HAVE_DNNL).
**
** and its two backward kernels, CONV2D_BACKWARD_DATA and CONV2D_BACKWARD_WEIGHT (with the
** bias gradient), in f32 on contiguous NCHW/OIHW tensors; other dtypes and layouts take the
** reference loops of cpu_conv.c. oneDNN is what PyTorch runs on the CPU; its plain-layout
** forward beat im2col + OpenBLAS at every ResNet shape measured (bench/RESULTS.md), and the
** im2col + GEMM backward it replaces was the larger part of a CNN step. Its blocked layouts
** (faster again standalone, reorders aside) are not used.
**
** A oneDNN primitive is compiled (JIT) for one geometry, which costs far more than a small
** convolution: primitives are kept in a small cache keyed by the geometry. One lock covers
** the cache and the execution (the CPU backend runs one op at a time per thread; oneDNN
** parallelises inside).
*/
#include "cpu.h"

#ifdef KILN_HAVE_DNNL
#include <dnnl.h>
#include <pthread.h>
#include <string.h>

#define DNNL_CACHE 48

typedef struct dnnl_key {
  int64_t v[21];
} dnnl_key;

typedef struct dnnl_entry {
  dnnl_key key;
  dnnl_primitive_t prim;
  dnnl_memory_desc_t x, w, b, y;
} dnnl_entry;

static pthread_mutex_t dnnl_lock = PTHREAD_MUTEX_INITIALIZER;
static dnnl_engine_t dnnl_eng;
static dnnl_stream_t dnnl_str;
static dnnl_entry dnnl_cache[DNNL_CACHE];
static int dnnl_n, dnnl_next;

static kiln_status dnnl_fail(const char *what, dnnl_status_t s) {
  return kiln_set_error(KILN_ERR_INTERNAL, "kiln: conv2d: oneDNN %s failed (status %d)", what, (int)s);
}

/* The tensors of a convolution kernel by role: the image x (N, C, H, W), the weight
** (OC, C/G, kh, kw), the output-side y (N, OC, OH, OW) and the bias (OC), each an input or
** an output depending on the kernel. */
typedef struct dnnl_roles {
  const kiln__view *x, *w, *y, *b;
} dnnl_roles;

static dnnl_roles roles_of(const kiln__kargs *a) {
  switch (a->op) {
  case KILN__K_CONV2D_BACKWARD_DATA: return (dnnl_roles){&a->out[0], &a->in[1], &a->in[0], NULL};
  case KILN__K_CONV2D_BACKWARD_WEIGHT:
    return (dnnl_roles){&a->in[0], &a->out[0], &a->in[1], a->n_out > 1 ? &a->out[1] : NULL};
  default: return (dnnl_roles){&a->in[0], &a->in[1], &a->out[0], a->n_in > 2 ? &a->in[2] : NULL};
  }
}

/* A new primitive for the geometry and kernel (the lock held). A backward primitive is
** made from the forward's description (oneDNN's hint), which is then dropped. */
static kiln_status dnnl_build(const kiln__kargs *a, const dnnl_key *k, dnnl_entry *e) {
  dnnl_roles r = roles_of(a);
  const kiln__view *x = r.x, *w = r.w, *y = r.y;
  const kiln__conv_params *p = a->params;
  int64_t G = a->i[0];
  bool bias = r.b != NULL;
  dnnl_dims_t xd = {x->shape[0], x->shape[1], x->shape[2], x->shape[3]};
  dnnl_dims_t yd = {y->shape[0], y->shape[1], y->shape[2], y->shape[3]};
  dnnl_dims_t wd = {w->shape[0], w->shape[1], w->shape[2], w->shape[3]};
  dnnl_dims_t gwd = {G, w->shape[0] / G, w->shape[1], w->shape[2], w->shape[3]};
  dnnl_dims_t bd = {w->shape[0]};
  dnnl_status_t s;
  if ((s = dnnl_memory_desc_init_by_tag(&e->x, 4, xd, dnnl_f32, dnnl_nchw)) != dnnl_success) return dnnl_fail("src", s);
  if ((s = dnnl_memory_desc_init_by_tag(&e->y, 4, yd, dnnl_f32, dnnl_nchw)) != dnnl_success) return dnnl_fail("dst", s);
  s = G > 1 ? dnnl_memory_desc_init_by_tag(&e->w, 5, gwd, dnnl_f32, dnnl_goihw)
            : dnnl_memory_desc_init_by_tag(&e->w, 4, wd, dnnl_f32, dnnl_oihw);
  if (s != dnnl_success) return dnnl_fail("weights", s);
  if ((s = dnnl_memory_desc_init_by_tag(&e->b, 1, bd, dnnl_f32, dnnl_x)) != dnnl_success) return dnnl_fail("bias", s);
  dnnl_dims_t st, dl, pl, pr;
  for (int d = 0; d < 2; d++) {
    st[d] = p->stride[d];
    dl[d] = p->dilation[d] - 1; /* oneDNN counts the gaps */
    pl[d] = p->padding[d];
    /* the padding after: what the last window reaches past the input */
    pr[d] = (y->shape[2 + d] - 1) * p->stride[d] + p->dilation[d] * (w->shape[2 + d] - 1) + 1 - x->shape[2 + d] - pl[d];
    if (pr[d] < 0) pr[d] = 0;
  }
  bool fwd = a->op == KILN__K_CONV2D;
  dnnl_convolution_desc_t fd, bd_;
  s = dnnl_dilated_convolution_forward_desc_init(&fd, fwd ? dnnl_forward_inference : dnnl_forward_training,
                                                 dnnl_convolution_direct, &e->x, &e->w, bias ? &e->b : NULL, &e->y,
                                                 st, dl, pl, pr);
  if (s != dnnl_success) return dnnl_fail("convolution descriptor", s);
  dnnl_primitive_desc_t fpd, pd = NULL;
  if ((s = dnnl_primitive_desc_create(&fpd, &fd, NULL, dnnl_eng, NULL)) != dnnl_success)
    return dnnl_fail("primitive descriptor", s);
  if (fwd) {
    pd = fpd, fpd = NULL;
  } else {
    s = a->op == KILN__K_CONV2D_BACKWARD_DATA
            ? dnnl_dilated_convolution_backward_data_desc_init(&bd_, dnnl_convolution_direct, &e->x, &e->w, &e->y, st,
                                                               dl, pl, pr)
            : dnnl_dilated_convolution_backward_weights_desc_init(&bd_, dnnl_convolution_direct, &e->x, &e->w,
                                                                  bias ? &e->b : NULL, &e->y, st, dl, pl, pr);
    if (s == dnnl_success) s = dnnl_primitive_desc_create(&pd, &bd_, NULL, dnnl_eng, fpd);
    dnnl_primitive_desc_destroy(fpd);
    if (s != dnnl_success) return dnnl_fail("backward primitive descriptor", s);
  }
  s = dnnl_primitive_create(&e->prim, pd);
  dnnl_primitive_desc_destroy(pd);
  if (s != dnnl_success) return dnnl_fail("primitive", s);
  e->key = *k;
  return KILN_OK;
}

static kiln_status dnnl_run(const kiln__kargs *a) {
  dnnl_roles r = roles_of(a);
  const kiln__view *x = r.x, *w = r.w, *y = r.y;
  const kiln__conv_params *p = a->params;
  dnnl_status_t s;
  if (!dnnl_eng) {
    if ((s = dnnl_engine_create(&dnnl_eng, dnnl_cpu, 0)) != dnnl_success) return dnnl_fail("engine", s);
    if ((s = dnnl_stream_create(&dnnl_str, dnnl_eng, dnnl_stream_default_flags)) != dnnl_success) {
      dnnl_engine_destroy(dnnl_eng);
      dnnl_eng = NULL;
      return dnnl_fail("stream", s);
    }
  }
  dnnl_key k;
  memset(&k, 0, sizeof k);
  for (int d = 0; d < 4; d++) k.v[d] = x->shape[d], k.v[4 + d] = w->shape[d], k.v[8 + d] = y->shape[d];
  for (int d = 0; d < 2; d++)
    k.v[12 + d] = p->stride[d], k.v[14 + d] = p->padding[d], k.v[16 + d] = p->dilation[d];
  k.v[18] = a->i[0];
  k.v[19] = r.b != NULL;
  k.v[20] = a->op;
  dnnl_entry *e = NULL;
  for (int i = 0; i < dnnl_n && !e; i++)
    if (memcmp(&dnnl_cache[i].key, &k, sizeof k) == 0) e = &dnnl_cache[i];
  if (!e) {
    dnnl_entry fresh;
    kiln_status st = dnnl_build(a, &k, &fresh);
    if (st != KILN_OK) return st;
    if (dnnl_n < DNNL_CACHE) {
      e = &dnnl_cache[dnnl_n++];
    } else { /* round robin: a network has few distinct layer shapes */
      e = &dnnl_cache[dnnl_next];
      dnnl_next = (dnnl_next + 1) % DNNL_CACHE;
      dnnl_primitive_destroy(e->prim);
    }
    *e = fresh;
  }
  dnnl_memory_t mx = NULL, mw = NULL, mb = NULL, my = NULL;
  kiln_status st = KILN_OK;
  if ((s = dnnl_memory_create(&mx, &e->x, dnnl_eng, x->data)) != dnnl_success ||
      (s = dnnl_memory_create(&mw, &e->w, dnnl_eng, w->data)) != dnnl_success ||
      (r.b && (s = dnnl_memory_create(&mb, &e->b, dnnl_eng, r.b->data)) != dnnl_success) ||
      (s = dnnl_memory_create(&my, &e->y, dnnl_eng, y->data)) != dnnl_success) {
    st = dnnl_fail("memory", s);
  } else {
    dnnl_exec_arg_t args[4];
    int n = 0;
    switch (a->op) {
    case KILN__K_CONV2D_BACKWARD_DATA:
      args[n++] = (dnnl_exec_arg_t){DNNL_ARG_DIFF_DST, my};
      args[n++] = (dnnl_exec_arg_t){DNNL_ARG_WEIGHTS, mw};
      args[n++] = (dnnl_exec_arg_t){DNNL_ARG_DIFF_SRC, mx};
      break;
    case KILN__K_CONV2D_BACKWARD_WEIGHT:
      args[n++] = (dnnl_exec_arg_t){DNNL_ARG_SRC, mx};
      args[n++] = (dnnl_exec_arg_t){DNNL_ARG_DIFF_DST, my};
      args[n++] = (dnnl_exec_arg_t){DNNL_ARG_DIFF_WEIGHTS, mw};
      if (mb) args[n++] = (dnnl_exec_arg_t){DNNL_ARG_DIFF_BIAS, mb};
      break;
    default:
      args[n++] = (dnnl_exec_arg_t){DNNL_ARG_SRC, mx};
      args[n++] = (dnnl_exec_arg_t){DNNL_ARG_WEIGHTS, mw};
      args[n++] = (dnnl_exec_arg_t){DNNL_ARG_DST, my};
      if (mb) args[n++] = (dnnl_exec_arg_t){DNNL_ARG_BIAS, mb};
    }
    if ((s = dnnl_primitive_execute(e->prim, dnnl_str, n, args)) != dnnl_success ||
        (s = dnnl_stream_wait(dnnl_str)) != dnnl_success)
      st = dnnl_fail("execution", s);
  }
  dnnl_memory_destroy(mx), dnnl_memory_destroy(mw), dnnl_memory_destroy(mb), dnnl_memory_destroy(my);
  return st;
}

/* Whether oneDNN takes these arguments: f32, contiguous, something to compute. */
bool kiln__cpu_dnnl_conv_takes(const kiln__kargs *a) {
  for (int i = 0; i < a->n_in; i++)
    if (a->in[i].dtype != KILN_F32 || !kiln__view_is_contiguous(&a->in[i])) return false;
  for (int i = 0; i < a->n_out; i++)
    if (a->out[i].dtype != KILN_F32 || !kiln__view_is_contiguous(&a->out[i])) return false;
  return a->params && a->n_in >= 2 && a->n_out >= 1 && a->in[0].ndim == 4 && a->in[1].ndim == 4 &&
         a->out[0].ndim == 4;
}

/* CONV2D_BACKWARD_DATA / _WEIGHT through oneDNN; the caller checked kiln__cpu_dnnl_conv_takes. */
kiln_status kiln__cpu_dnnl_conv2d_backward(const kiln__kargs *a) {
  for (int i = 0; i < a->n_out; i++)
    if (kiln__view_numel(&a->out[i]) == 0) return KILN_OK;
  /* an empty batch or image: nothing flows back, the gradients are zeros */
  if (kiln__view_numel(&a->in[0]) == 0 || kiln__view_numel(&a->in[1]) == 0) {
    for (int i = 0; i < a->n_out; i++) memset(a->out[i].data, 0, (size_t)kiln__view_numel(&a->out[i]) * sizeof(float));
    return KILN_OK;
  }
  pthread_mutex_lock(&dnnl_lock);
  kiln_status st = dnnl_run(a);
  pthread_mutex_unlock(&dnnl_lock);
  return st;
}

kiln_status kiln__cpu_conv2d(const kiln__kargs *a) {
  if (!a->params) return kiln_set_error(KILN_ERR_INTERNAL, "kiln: conv2d without its window parameters");
  for (int i = 0; i < a->n_in; i++)
    if (a->in[i].dtype != KILN_F32 || !kiln__view_is_contiguous(&a->in[i]))
      return kiln_set_error(KILN_ERR_INTERNAL, "kiln: the CONV2D kernel takes contiguous f32 views");
  if (a->out[0].dtype != KILN_F32 || !kiln__view_is_contiguous(&a->out[0]))
    return kiln_set_error(KILN_ERR_INTERNAL, "kiln: the CONV2D kernel writes a contiguous f32 view");
  if (kiln__view_numel(&a->out[0]) == 0) return KILN_OK;
  pthread_mutex_lock(&dnnl_lock);
  kiln_status st = dnnl_run(a);
  pthread_mutex_unlock(&dnnl_lock);
  return st;
}
#endif /* KILN_HAVE_DNNL */
