/* Uses an installed kiln through its public header only. */
#include <kiln.h>
#include <stdio.h>
#include <string.h>

int main(void) {
  if (strcmp(kiln_version(), KILN_VERSION) != 0) {
    fprintf(stderr, "consumer: header says %s, library says %s\n", KILN_VERSION, kiln_version());
    return 1;
  }
  printf("kiln %s\n", kiln_version());
  kiln_tensor *t = kiln_ones(KILN_SHAPE(2, 3), KILN_F32, kiln_device_cpu());
  if (!t) {
    fprintf(stderr, "consumer: %s\n", kiln_last_error_message());
    return 1;
  }
  if (kiln_print(t) != KILN_OK) return 1;
  kiln_tensor_free(t);
  return 0;
}
