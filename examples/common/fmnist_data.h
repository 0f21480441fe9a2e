/* Shared by the examples that train on Fashion-MNIST: the data loaded, checked before any
** training and cut to the sizes asked for. Header-only; include kiln.h and kiln_data.h first. */
#ifndef KILN_EXAMPLES_FMNIST_DATA_H
#define KILN_EXAMPLES_FMNIST_DATA_H

#include <stdio.h>

#include "output.h"

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

/* Keeps the first n images and labels of a split (n <= 0 or past the end: all of it). The
** narrowed views keep the data alive; the originals are freed. Returns 1 when a view fails. */
static inline int ex_keep_first(kiln_tensor **x, kiln_tensor **y, int64_t n) {
  if (n <= 0 || n >= kiln_size(*x, 0)) return 0;
  kiln_tensor *lx = kiln_narrow(*x, 0, 0, n), *ly = kiln_narrow(*y, 0, 0, n);
  kiln_tensor_free(*x);
  kiln_tensor_free(*y);
  *x = lx;
  *y = ly;
  return lx && ly ? 0 : 1;
}

/* Fashion-MNIST from dir (NULL: where the Debian package puts it) into t: training images
** and labels, test images and labels, both splits checked (needs: as for
** ex_check_fmnist_split) and cut to limit and test_limit images (0: all). Prints why and
** returns 1 on failure, else 0; either way t holds what was loaded, for the caller to free. */
static inline int ex_load_fmnist(const char *prog, const char *dir, const char *needs, int64_t limit,
                                 int64_t test_limit, kiln_tensor *t[4]) {
  t[0] = t[1] = t[2] = t[3] = NULL;
  if (kiln_fashion_mnist_load(dir, &t[0], &t[1], &t[2], &t[3]) != KILN_OK) {
    fprintf(stderr, "%s: cannot load Fashion-MNIST: %s\n"
                    "  (install the Debian package dataset-fashion-mnist, or pass --data DIR with the four *-ubyte[.gz] files)\n",
            prog, kiln_last_error_message());
    return 1;
  }
  if (ex_check_fmnist_split(prog, needs, "training", t[0], t[1]) ||
      ex_check_fmnist_split(prog, needs, "test", t[2], t[3]))
    return 1;
  if (ex_keep_first(&t[0], &t[1], limit) || ex_keep_first(&t[2], &t[3], test_limit)) {
    ex_report_failure(prog, "preparing the data");
    return 1;
  }
  return 0;
}

#endif /* KILN_EXAMPLES_FMNIST_DATA_H */
