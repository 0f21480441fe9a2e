/*
** oneDNN's f32 convolution forward at bench-conv's shapes (batch 8), to decide whether the
** CPU backend should call oneDNN instead of im2col + BLAS. Not part of the build (it needs
** libdnnl-dev, which macOS and most CI images lack):
**
**   cc -O2 bench/onednn/conv_onednn.c -ldnnl -o /tmp/conv_onednn && /tmp/conv_onednn
**
** Two layouts: the blocked one oneDNN picks (format any; the reorders from and to NCHW
** are timed apart) and plain NCHW/OIHW, which is what kiln's tensors are.
*/
#include <dnnl.h>
#include <stdio.h>
#include <time.h>

#define CK(x) do { dnnl_status_t s_ = (x); if (s_ != dnnl_success) { printf("%s: %d\n", #x, (int)s_); return -1; } } while (0)

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static double run(dnnl_engine_t eng, dnnl_stream_t st, const dnnl_dim_t *xd, const dnnl_dim_t *wd, dnnl_dim_t stride,
                  dnnl_dim_t pad, dnnl_dim_t groups, int any, const char **impl) {
  dnnl_dim_t oh = (xd[2] + 2 * pad - wd[2]) / stride + 1, ow = (xd[3] + 2 * pad - wd[3]) / stride + 1;
  dnnl_dims_t yd = {xd[0], wd[0], oh, ow}, bd = {wd[0]};
  dnnl_dims_t gwd = {groups, wd[0] / groups, wd[1], wd[2], wd[3]};
  dnnl_memory_desc_t x_md, w_md, b_md, y_md;
  dnnl_format_tag_t tx = any ? dnnl_format_tag_any : dnnl_nchw;
  dnnl_format_tag_t tw = any ? dnnl_format_tag_any : (groups > 1 ? dnnl_goihw : dnnl_oihw);
  CK(dnnl_memory_desc_init_by_tag(&x_md, 4, xd, dnnl_f32, tx));
  if (groups > 1) CK(dnnl_memory_desc_init_by_tag(&w_md, 5, gwd, dnnl_f32, tw));
  else CK(dnnl_memory_desc_init_by_tag(&w_md, 4, wd, dnnl_f32, tw));
  CK(dnnl_memory_desc_init_by_tag(&b_md, 1, bd, dnnl_f32, dnnl_x));
  CK(dnnl_memory_desc_init_by_tag(&y_md, 4, yd, dnnl_f32, tx));
  dnnl_dims_t s = {stride, stride}, p = {pad, pad};
  dnnl_convolution_desc_t cd;
  CK(dnnl_convolution_forward_desc_init(&cd, dnnl_forward_training, dnnl_convolution_direct, &x_md, &w_md, &b_md,
                                        &y_md, s, p, p));
  dnnl_primitive_desc_t pd;
  CK(dnnl_primitive_desc_create(&pd, &cd, NULL, eng, NULL));
  CK(dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, impl));
  dnnl_memory_t mx, mw, mb, my;
  CK(dnnl_memory_create(&mx, dnnl_primitive_desc_query_md(pd, dnnl_query_src_md, 0), eng, DNNL_MEMORY_ALLOCATE));
  CK(dnnl_memory_create(&mw, dnnl_primitive_desc_query_md(pd, dnnl_query_weights_md, 0), eng, DNNL_MEMORY_ALLOCATE));
  CK(dnnl_memory_create(&mb, dnnl_primitive_desc_query_md(pd, dnnl_query_weights_md, 1), eng, DNNL_MEMORY_ALLOCATE));
  CK(dnnl_memory_create(&my, dnnl_primitive_desc_query_md(pd, dnnl_query_dst_md, 0), eng, DNNL_MEMORY_ALLOCATE));
  dnnl_primitive_t prim;
  CK(dnnl_primitive_create(&prim, pd));
  dnnl_exec_arg_t args[4] = {{DNNL_ARG_SRC, mx}, {DNNL_ARG_WEIGHTS, mw}, {DNNL_ARG_BIAS, mb}, {DNNL_ARG_DST, my}};
  double best = 1e30;
  for (int r = 0; r < 5; r++) {
    double t0 = now_ms();
    CK(dnnl_primitive_execute(prim, st, 4, args));
    CK(dnnl_stream_wait(st));
    double t = now_ms() - t0;
    if (r && t < best) best = t;
  }
  dnnl_primitive_destroy(prim);
  dnnl_memory_destroy(mx), dnnl_memory_destroy(mw), dnnl_memory_destroy(mb), dnnl_memory_destroy(my);
  return best;
}

int main(void) {
  dnnl_engine_t eng;
  dnnl_stream_t st;
  if (dnnl_engine_create(&eng, dnnl_cpu, 0) != dnnl_success) return 1;
  if (dnnl_stream_create(&st, eng, dnnl_stream_default_flags) != dnnl_success) return 1;
  struct { const char *name; dnnl_dim_t x[4], w[4], s, p, g; } cs[] = {
      {"resnet stem 7x7/2 3->64 @112", {8, 3, 112, 112}, {64, 3, 7, 7}, 2, 3, 1},
      {"3x3 64->64 @56", {8, 64, 56, 56}, {64, 64, 3, 3}, 1, 1, 1},
      {"3x3 128->128 @28", {8, 128, 28, 28}, {128, 128, 3, 3}, 1, 1, 1},
      {"1x1 256->64 @56", {8, 256, 56, 56}, {64, 256, 1, 1}, 1, 0, 1},
      {"depthwise 3x3 128 @28", {8, 128, 28, 28}, {128, 1, 3, 3}, 1, 1, 128},
  };
  printf("| shape (batch 8, f32) | oneDNN blocked ms | impl | oneDNN NCHW ms | impl | fwd GFLOP/s (NCHW) |\n|---|---|---|---|---|---|\n");
  for (int i = 0; i < 5; i++) {
    const char *i1 = "?", *i2 = "?";
    double a = run(eng, st, cs[i].x, cs[i].w, cs[i].s, cs[i].p, cs[i].g, 1, &i1);
    double b = run(eng, st, cs[i].x, cs[i].w, cs[i].s, cs[i].p, cs[i].g, 0, &i2);
    dnnl_dim_t oh = (cs[i].x[2] + 2 * cs[i].p - cs[i].w[2]) / cs[i].s + 1;
    double flop = 2.0 * cs[i].x[0] * cs[i].w[0] * oh * oh * cs[i].w[1] * cs[i].w[2] * cs[i].w[3];
    printf("| %s | %.2f | %s | %.2f | %s | %.1f |\n", cs[i].name, a, i1, b, i2, flop / b / 1e6);
  }
  return 0;
}
