/* Compiled as C and linked against the shared library: proves colibri.h is
 * plain C and that the exported symbols are visible from libcolibri.so. */
#include <stdio.h>
#include <string.h>

#include "colibri.h"

static int failures = 0;

#define CHECK(cond)                                                   \
  do {                                                                \
    if (!(cond)) {                                                    \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                     \
    }                                                                 \
  } while (0)

int main(void) {
  colibri_open_options_t options;
  colibri_infer_t infer;
  colibri_route_compile_options_t route_options;
  colibri_model_t* model = (colibri_model_t*)&options; /* must be reset to NULL */
  colibri_status_t status;
  const char* error;
  char saved_error[512];

  colibri_open_options_default(&options);
  CHECK(options.n_threads == 0);
  CHECK(options.lock_memory == 1);
  CHECK(options.huge_pages == 1);
  CHECK(options.verify_checksums == 1);
  CHECK(options.pin_threads == 0);

  colibri_infer_default(&infer);
  CHECK(infer.n_tokens == 0 && infer.routing_blob == NULL);
  colibri_route_compile_options_default(&route_options);
  CHECK(route_options.weight_encoding == COLIBRI_ROUTE_WEIGHTS_F32);

  CHECK(strcmp(colibri_status_name(COLIBRI_OK), "ok") == 0);
  CHECK(strlen(colibri_status_name(COLIBRI_ERR_IO)) > 0);
  CHECK(strlen(colibri_status_name(COLIBRI_ERR_CHECKSUM)) > 0);
  CHECK(strcmp(colibri_dtype_name(COLIBRI_DTYPE_BF16), "bf16") == 0);
  CHECK(colibri_version() != NULL && strlen(colibri_version()) > 0);

  status = colibri_open("/nonexistent/colibri-c-header-test", &options, &model);
  CHECK(status == COLIBRI_ERR_IO);
  CHECK(model == NULL);
  error = colibri_last_error();
  CHECK(error != NULL && strstr(error, "colibri-c-header-test") != NULL);
  /* The pointer is only valid until the next Colibri call. */
  snprintf(saved_error, sizeof saved_error, "%s", error != NULL ? error : "");

  CHECK(colibri_init("/nonexistent/colibri-c-header-test") == NULL);
  CHECK(colibri_verify_dir(NULL) == COLIBRI_ERR_INVALID_ARGUMENT);
  CHECK(strlen(colibri_last_error()) > 0);
  colibri_free(NULL);

  if (failures != 0) {
    fprintf(stderr, "%d check(s) failed\n", failures);
    return 1;
  }
  printf("C header test passed (%s; last error: %s)\n", colibri_version(), saved_error);
  return 0;
}
