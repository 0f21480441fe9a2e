/*
** The op suite on CUDA: every op family's cases with only the cross-backend part (d) of
** the harness (forward and backward on each cuda:N against the CPU, every variant and
** dtype). Skipped (exit 77) without a CUDA device. It includes the family files so that
** their case tables are written once; H_NO_MAIN drops their main().
*/
#define H_NO_MAIN
#include "test_ops_elementwise.c"
#include "test_ops_activation.c"
#include "test_ops_reduce.c"
#include "test_ops_softmax.c"
#include "test_ops_matmul.c"
#include "test_ops_index.c"
#include "test_ops_compare.c"
#include "test_ops_loss.c"
#include "test_ops_view.c"

int main(int argc, char **argv) {
  h_init(argc, argv, "test_cuda_ops");
  h_set_cross_only(true);
  if (kiln_device_count(KILN_DEVICE_CUDA) == 0) return h_finish(); /* 77: skipped */
  ew_family();
  act_family();
  red_family();
  sm_family();
  mm_family();
  ix_family();
  cmp_family();
  loss_family();
  vw_family();
  return h_finish();
}
