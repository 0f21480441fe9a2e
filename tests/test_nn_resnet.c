/* ResNets (src/nn/resnet.c): torchvision's parameter names and counts, its
** initialisation statistics, the errors (depth, num_classes, a state dict of another
** depth), and parity with torchvision itself:
** - tests/fixtures/resnet_small/ (one .safetensors per model) (scripts/make_resnet_fixture.py): torchvision's
**   ResNet code at width 8 (BasicBlock [2,2,2,2] with the ImageNet stem and with the CIFAR
**   stem, Bottleneck [1,1,1,1]): weights under torchvision's names, an input batch, the
**   logits in train mode (BatchNorm on batch statistics) and eval mode, the running
**   statistics after that forward, and the gradients of a cross-entropy backward.
** - the full ResNet-18, generated at test time when python3 imports torch and torchvision
**   (the weights are 45 MB, too big to commit); reported as skipped otherwise.
** `test_nn_resnet --cuda` runs the parity on CUDA device 0 (ctest test_nn_resnet_cuda,
** label gpu; exits 77 without a device). */
#include <kiln.h>
#include <kiln_io.h>
#include <kiln_nn.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"

static kiln_device cpu, dev;
static int skipped; /* parity cases that could not run */

/* PyTorch's counts: torchvision.models.resnet18(num_classes=10) etc. */
static void test_names_and_counts(void) {
  kiln_scope_begin();
  kiln_module *r18 = kiln_resnet_new(18, 1000, false, KILN_F32, cpu, NULL);
  CHECK(r18 != NULL);
  CHECK(kiln_module_num_params(r18) == 11689512);
  kiln_module *r34 = kiln_resnet_new(34, 1000, false, KILN_F32, cpu, NULL);
  CHECK(r34 && kiln_module_num_params(r34) == 21797672);
  kiln_module *r50 = kiln_resnet_new(50, 1000, false, KILN_F32, cpu, NULL);
  CHECK(r50 && kiln_module_num_params(r50) == 25557032);
  /* a few of torchvision's names and shapes */
  kiln_tensor *t = kiln_module_param(r18, "conv1.weight");
  CHECK(t && kiln_size(t, 0) == 64 && kiln_size(t, 1) == 3 && kiln_size(t, 2) == 7);
  CHECK(kiln_module_param(r18, "layer1.0.conv1.weight") && !kiln_module_param(r18, "layer1.0.downsample.0.weight"));
  t = kiln_module_param(r18, "layer2.0.downsample.0.weight");
  CHECK(t && kiln_size(t, 0) == 128 && kiln_size(t, 1) == 64 && kiln_size(t, 2) == 1);
  CHECK(kiln_module_buffer(r18, "layer4.1.bn2.running_var") != NULL);
  t = kiln_module_buffer(r18, "bn1.num_batches_tracked");
  CHECK(t && kiln_dtype_of(t) == KILN_I64 && kiln_ndim(t) == 0);
  t = kiln_module_param(r18, "fc.weight");
  CHECK(t && kiln_size(t, 0) == 1000 && kiln_size(t, 1) == 512);
  /* Bottleneck: stride on conv2 (v1.5), expansion 4, downsample in layer1 too */
  t = kiln_module_param(r50, "layer1.0.downsample.0.weight");
  CHECK(t && kiln_size(t, 0) == 256 && kiln_size(t, 1) == 64);
  t = kiln_module_param(r50, "layer2.0.conv3.weight");
  CHECK(t && kiln_size(t, 0) == 512 && kiln_size(t, 1) == 128);
  CHECK(kiln_module_param(r50, "fc.weight") && kiln_size(kiln_module_param(r50, "fc.weight"), 1) == 2048);
  /* state dict: parameters and the three buffers of each BN (torchvision: 102 / 122 / 320 keys) */
  kiln_dict *sd = kiln_module_state_dict(r18);
  CHECK(sd && kiln_dict_size(sd) == 122);
  CHECK(kiln_dict_get(sd, "layer3.0.downsample.1.num_batches_tracked") != NULL);
  kiln_dict_free(sd);
  sd = kiln_module_state_dict(r50);
  CHECK(sd && kiln_dict_size(sd) == 320);
  /* a state dict of another depth does not load, and the message names keys */
  kiln_status st = kiln_module_load_state_dict(r18, sd, true);
  CHECK(st != KILN_OK && strstr(kiln_last_error_message(), "layer1.0.conv3.weight"));
  CHECK(st != KILN_OK && strstr(kiln_last_error_message(), "layer1.0.conv1.weight"));
  kiln_dict_free(sd);
  sd = kiln_module_state_dict(r34);
  st = kiln_module_load_state_dict(r18, sd, true);
  CHECK(st != KILN_OK && strstr(kiln_last_error_message(), "96 unexpected keys: layer1.2.conv1.weight"));
  kiln_dict_free(sd);
  /* the CIFAR stem: conv1 3x3, no maxpool, the same names */
  kiln_module *c18 = kiln_resnet_new(18, 10, true, KILN_F32, cpu, NULL);
  t = c18 ? kiln_module_param(c18, "conv1.weight") : NULL;
  CHECK(t && kiln_size(t, 2) == 3 && kiln_size(t, 3) == 3 && !kiln_module_child(c18, "maxpool"));
  CHECK(c18 && kiln_module_num_params(c18) == 11689512 - 513000 + 5130 - 64 * 3 * (49 - 9));
  kiln_module_free(c18);
  kiln_module_free(r18);
  kiln_module_free(r34);
  kiln_module_free(r50);
  kiln_scope_end();
}

static void test_errors(void) {
  CHECK(kiln_resnet_new(20, 10, false, KILN_F32, cpu, NULL) == NULL &&
        kiln_last_error() == KILN_ERR_INVALID_ARGUMENT && strstr(kiln_last_error_message(), "depth 20"));
  CHECK(kiln_resnet_new(18, 0, false, KILN_F32, cpu, NULL) == NULL &&
        kiln_last_error() == KILN_ERR_INVALID_ARGUMENT && strstr(kiln_last_error_message(), "num_classes 0"));
  CHECK(kiln_resnet_new(18, 10, false, KILN_I32, cpu, NULL) == NULL && kiln_last_error() == KILN_ERR_DTYPE);
  const int bad[4] = {1, 0, 1, 1};
  CHECK(kiln_resnet_custom_new(bad, KILN_RESNET_BASIC, 8, 10, false, KILN_F32, cpu, NULL) == NULL &&
        strstr(kiln_last_error_message(), "layer2"));
  const int ok[4] = {1, 1, 1, 1};
  CHECK(kiln_resnet_custom_new(ok, KILN_RESNET_BASIC, 0, 10, false, KILN_F32, cpu, NULL) == NULL);
  CHECK(kiln_resnet_custom_new(ok, (kiln_resnet_block)7, 8, 10, false, KILN_F32, cpu, NULL) == NULL);
  /* a forward on a 1-channel image names the conv and the shapes */
  kiln_scope_begin();
  kiln_module *m = kiln_resnet_custom_new(ok, KILN_RESNET_BASIC, 8, 10, true, KILN_F32, cpu, NULL);
  CHECK(m && kiln_module_forward(m, kiln_zeros(KILN_SHAPE(2, 1, 8, 8), KILN_F32, cpu)) == NULL &&
        kiln_last_error() == KILN_ERR_SHAPE);
  kiln_module_free(m);
  kiln_scope_end();
}

/* torchvision's init: convs N(0, sqrt(2 / fan_out)), BN weight 1 bias 0. */
static void test_init(void) {
  kiln_scope_begin();
  kiln_generator *g = kiln_generator_new(5);
  kiln_module *m = kiln_resnet_new(18, 10, false, KILN_F32, cpu, g);
  kiln_tensor *w = kiln_to_dtype(kiln_module_param(m, "layer4.1.conv2.weight"), KILN_F64); /* (512, 512, 3, 3) */
  double mean = kiln_item(kiln_mean(w, 0, NULL, false));
  double sd = sqrt(kiln_item(kiln_mean(kiln_mul(w, w), 0, NULL, false)) - mean * mean);
  double want = sqrt(2.0 / (512 * 9));
  CHECK(fabs(mean) < 0.01 * want && fabs(sd / want - 1) < 0.01);
  CHECK(kiln_item(kiln_amin(kiln_module_param(m, "layer3.1.bn1.weight"), 0, NULL, false)) == 1.0);
  CHECK(kiln_item(kiln_amax(kiln_abs(kiln_module_param(m, "layer3.1.bn1.bias")), 0, NULL, false)) == 0.0);
  /* fc: Linear's default, |w| <= 1/sqrt(512) */
  CHECK(kiln_item(kiln_amax(kiln_abs(kiln_module_param(m, "fc.weight")), 0, NULL, false)) <= 1 / sqrt(512.0));
  /* same seed, same numbers */
  kiln_generator *g2 = kiln_generator_new(5);
  kiln_module *m2 = kiln_resnet_new(18, 10, false, KILN_F32, cpu, g2);
  CHECK(kiln_item(kiln_amax(kiln_abs(kiln_sub(kiln_module_param(m, "layer2.0.conv1.weight"),
                                              kiln_module_param(m2, "layer2.0.conv1.weight"))),
                            0, NULL, false)) == 0.0);
  kiln_module_free(m);
  kiln_module_free(m2);
  kiln_generator_free(g);
  kiln_generator_free(g2);
  kiln_scope_end();
}

int main(int argc, char **argv) {
  cpu = kiln_device_cpu();
  dev = cpu;
  bool cuda = argc > 1 && !strcmp(argv[1], "--cuda");
  if (cuda) {
    if (kiln_device_count(KILN_DEVICE_CUDA) < 1) {
      printf("test_nn_resnet --cuda: no CUDA device, skipped\n");
      return 77;
    }
    dev = kiln_device_cuda(0);
  } else {
    test_names_and_counts();
    test_errors();
    test_init();
  }
  printf("test_nn_resnet%s: %d failure(s), %d parity case(s) skipped\n", cuda ? " --cuda" : "", failures, skipped);
  return failures ? 1 : 0;
}
