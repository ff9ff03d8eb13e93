/* Expert parallelism from a C host under MPI: each rank opens its share of a
 * model's experts (colibri_open_options_t.local_experts: a contiguous block
 * of about E / N experts, the shared expert on rank 0 only), every rank runs
 * the same MoE layers on the same tokens with the model's built-in router
 * (routing chooses among all experts; slots routed to another rank's expert
 * add nothing), and one MPI_Allreduce (SUM) of the partial outputs per layer
 * gives every rank the whole layer's output. With --check, rank 0 also
 * opens the whole model and compares.
 *
 *   mpirun -np 2 colibri_mpi_experts MODEL_DIR --experts E [--tokens T]
 *          [--seed S] [--threads N] [--check]
 *
 * E is the model's expert count (the host's configuration knows it; the
 * share is a mask of that many flags, and colibri_open checks its length).
 * Prints one line per layer on rank 0; exits 0 when every call succeeded
 * (and, with --check, every layer matched within 1e-5 relative L2). */
#include <math.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "colibri.h"

/* Whether any rank failed: every rank calls it at the same points, so a
 * rank that failed never leaves the others waiting in a reduction. */
static int any_failed(int failed) {
  int any = 0;
  MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  return any;
}

static int fail(int rank, const char* what, colibri_status_t status) {
  fprintf(stderr, "rank %d: %s failed (%s): %s\n", rank, what, colibri_status_name(status), colibri_last_error());
  return 1;
}

/* Deterministic inputs in [-1, 1), the same on every rank. */
static void fill(float* x, size_t n, uint32_t seed) {
  uint32_t s = seed * 2654435761u + 1u;
  for (size_t i = 0; i < n; ++i) {
    s ^= s << 13;
    s ^= s >> 17;
    s ^= s << 5;
    x[i] = (float)((int32_t)(s >> 8) - (1 << 23)) / (float)(1 << 23);
  }
}

static int run(int rank, int world, const char* path, int32_t n_experts, int32_t tokens, uint32_t seed,
               int32_t threads, int check) {
  /* This rank's share: experts [rank E / N, (rank + 1) E / N). */
  uint8_t* mask = calloc((size_t)n_experts, 1);
  if (mask == NULL) return 1;
  const int64_t begin = (int64_t)rank * n_experts / world, end = (int64_t)(rank + 1) * n_experts / world;
  for (int64_t e = begin; e < end; ++e) mask[e] = 1;

  colibri_open_options_t options;
  colibri_open_options_default(&options);
  options.n_threads = threads;
  options.lock_memory = 0;
  options.local_experts = mask;
  options.local_experts_len = n_experts;
  options.skip_shared_expert = rank != 0;
  colibri_model_t* share = NULL;
  colibri_model_t* whole = NULL;
  colibri_model_info_t info;
  memset(&info, 0, sizeof info);
  colibri_status_t st = colibri_open(path, &options, &share);
  free(mask);
  int bad = st != COLIBRI_OK ? fail(rank, "colibri_open (share)", st) : 0;
  if (!bad && check && rank == 0) {
    colibri_open_options_t all;
    colibri_open_options_default(&all);
    all.n_threads = threads;
    all.lock_memory = 0;
    st = colibri_open(path, &all, &whole);
    if (st != COLIBRI_OK) bad = fail(rank, "colibri_open (whole)", st);
  }
  if (!bad) {
    st = colibri_model_info(share, &info);
    if (st != COLIBRI_OK) bad = fail(rank, "colibri_model_info", st);
  }
  if (!bad && info.router_family == COLIBRI_ROUTER_NONE) {
    fprintf(stderr, "rank %d: %s has no built-in router (this example routes with it)\n", rank, path);
    bad = 1;
  }
  if (any_failed(bad)) {
    colibri_free(share);
    colibri_free(whole);
    return 1;
  }

  const size_t n = (size_t)tokens * (size_t)info.d_model;
  float* x = malloc(n * sizeof(float));
  float* part = malloc(n * sizeof(float));
  float* sum = malloc(n * sizeof(float));
  float* ref = malloc(n * sizeof(float));
  /* `bad` changes only through any_failed, so every rank leaves the loop at
   * the same layer; rank 0's own check is `mismatch`. */
  bad = any_failed(x == NULL || part == NULL || sum == NULL || ref == NULL);
  int mismatch = 0;
  for (int32_t layer = 0; layer < info.n_layers && !bad; ++layer) {
    fill(x, n, seed + (uint32_t)layer);
    colibri_infer_t call;
    colibri_infer_default(&call);
    call.layer = layer;
    call.n_tokens = tokens;
    call.input = x;
    call.output = part;
    st = colibri_infer(share, &call);
    if (any_failed(st != COLIBRI_OK ? fail(rank, "colibri_infer (share)", st) : 0)) {
      bad = 1;
      break;
    }
    MPI_Allreduce(part, sum, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    if (whole != NULL) {
      call.output = ref;
      st = colibri_infer(whole, &call);
      if (st != COLIBRI_OK) {
        mismatch = fail(rank, "colibri_infer (whole)", st);
        continue;
      }
      double num = 0.0, den = 0.0;
      for (size_t i = 0; i < n; ++i) {
        const double d = (double)sum[i] - (double)ref[i];
        num += d * d;
        den += (double)ref[i] * (double)ref[i];
      }
      const double rel = sqrt(num / (den > 0.0 ? den : 1e-300));
      printf("layer %d: %d ranks, %d tokens, relative L2 against one process %.3g\n", layer, world, tokens, rel);
      if (!(rel <= 1e-5)) mismatch = 1;
    } else if (rank == 0) {
      printf("layer %d: %d ranks, %d tokens, all-reduced\n", layer, world, tokens);
    }
  }
  free(x);
  free(part);
  free(sum);
  free(ref);
  colibri_free(share);
  colibri_free(whole);
  return bad || mismatch;
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  const char* path = NULL;
  long experts = 0, tokens = 5, threads = 1;
  unsigned long seed = 1;
  int check = 0, usage = 0;
  for (int i = 1; i < argc; ++i) {
    const int more = i + 1 < argc;
    if (strcmp(argv[i], "--experts") == 0 && more) {
      experts = strtol(argv[++i], NULL, 10);
    } else if (strcmp(argv[i], "--tokens") == 0 && more) {
      tokens = strtol(argv[++i], NULL, 10);
    } else if (strcmp(argv[i], "--seed") == 0 && more) {
      seed = strtoul(argv[++i], NULL, 10);
    } else if (strcmp(argv[i], "--threads") == 0 && more) {
      threads = strtol(argv[++i], NULL, 10);
    } else if (strcmp(argv[i], "--check") == 0) {
      check = 1;
    } else if (argv[i][0] != '-' && path == NULL) {
      path = argv[i];
    } else {
      usage = 1;
    }
  }
  if (usage || path == NULL || experts < world || experts > 65536 || tokens < 1 || tokens > 65536 || threads < 0) {
    if (rank == 0) {
      fprintf(stderr,
              "usage: mpirun -np N %s MODEL_DIR --experts E [--tokens T] [--seed S] [--threads N] [--check]\n"
              "  (E: the model's expert count, at least N)\n",
              argv[0]);
    }
    MPI_Finalize();
    return 2;
  }
  const int bad = run(rank, world, path, (int32_t)experts, (int32_t)tokens, (uint32_t)seed, (int32_t)threads, check);
  const int any = any_failed(bad);  /* rank 0's check counts for every rank */
  MPI_Finalize();
  return any ? 1 : 0;
}
