/* Shared by the examples that train on Fashion-MNIST: the split checked before any
** training. Header-only; include kiln.h first. */
#ifndef KILN_EXAMPLES_FMNIST_DATA_H
#define KILN_EXAMPLES_FMNIST_DATA_H

#include <stdio.h>

/* Images (N, 28, 28) with N > 0 and labels (N) in 0..9; else prints why (needs: what the
** example does with the images, for the shape message) and returns 1, else 0. */
static inline int ex_check_fmnist_split(const char *prog, const char *needs, const char *split, kiln_tensor *x,
                                        kiln_tensor *y) {
  char b[96];
  if (kiln_ndim(x) != 3 || kiln_size(x, 1) != 28 || kiln_size(x, 2) != 28) {
    fprintf(stderr, "%s: the %s images are %s; %s\n", prog, split, kiln_shape_str(x, b, sizeof b), needs);
    return 1;
  }
  if (kiln_size(x, 0) == 0) {
    fprintf(stderr, "%s: the %s set has no images\n", prog, split);
    return 1;
  }
  const int64_t *l = kiln_data_ptr(y);
  for (int64_t i = 0, n = kiln_numel(y); l && i < n; i++)
    if (l[i] < 0 || l[i] > 9) {
      fprintf(stderr, "%s: %s label %lld is %lld; Fashion-MNIST has classes 0 to 9\n", prog, split, (long long)i,
              (long long)l[i]);
      return 1;
    }
  return 0;
}

#endif /* KILN_EXAMPLES_FMNIST_DATA_H */
