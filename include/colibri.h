/*
 * Colibri: a low-latency CPU runtime for Mixture-of-Experts layers.
 *
 * Plain C ABI. The caller decides the routing (top-k expert ids and weights
 * per token); Colibri runs each chosen expert's SwiGLU feed-forward network
 * and writes the weighted sum.
 *
 * Conventions
 *  - Every entry point that can fail returns a colibri_status_t (0 = success).
 *    On failure, colibri_last_error() returns a message for the calling thread
 *    that names the file, field or line at fault. The library never aborts,
 *    exits or writes to stdout.
 *  - Handles are opaque. Option structs are filled by *_default() first, so
 *    fields added later get sane values.
 *  - Before 1.0, structs the library fills (colibri_model_info_t,
 *    colibri_stats_t) may gain fields at their end in a new minor version:
 *    compile against the header of the library you load (colibri_version()
 *    tells which), or leave spare room after them as the Python binding does.
 *  - Thread safety is stated per function below.
 */
#ifndef COLIBRI_H
#define COLIBRI_H

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#define COLIBRI_API __declspec(dllexport)
#elif defined(__GNUC__)
#define COLIBRI_API __attribute__((visibility("default")))
#else
#define COLIBRI_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define COLIBRI_VERSION_MAJOR 0
#define COLIBRI_VERSION_MINOR 2
#define COLIBRI_VERSION_PATCH 0

typedef enum colibri_status {
  COLIBRI_OK = 0,
  COLIBRI_ERR_INVALID_ARGUMENT = 1, /* NULL pointer, bad size, out-of-range index */
  COLIBRI_ERR_IO = 2,               /* file missing, unreadable, unwritable */
  COLIBRI_ERR_FORMAT = 3,           /* malformed manifest, routing or weight file */
  COLIBRI_ERR_CHECKSUM = 4,         /* checksum mismatch */
  COLIBRI_ERR_OUT_OF_MEMORY = 5,
  COLIBRI_ERR_UNSUPPORTED = 6, /* valid but not supported by this build */
  COLIBRI_ERR_INTERNAL = 7,
  COLIBRI_ERR_CANCELLED = 8 /* the open's progress callback asked to stop */
} colibri_status_t;

/* Weight types. The block-quantised ones store GGUF's blocks byte for byte
 * (docs/FORMAT.md): q8_0 and q4_0 in blocks of 32 weights (8.5 and 4.5
 * bits per weight), q4_k, q5_k and q6_k in super-blocks of 256 (4.5, 5.5,
 * 6.5625 bits), mxfp4 (OCP microscaling FP4: 32 E2M1 values with a
 * shared power-of-two scale, 4.25 bits, gpt-oss's format), the legacy
 * q4_1, q5_0 and q5_1 (blocks of 32: 5, 5.5 and 6 bits), iq4_nl (q4_0's
 * layout with a non-uniform table of levels, 4.5 bits) and iq4_xs (eight
 * iq4_nl blocks under one f16 scale with 6-bit sub-scales, 4.25 bits),
 * q2_k and q3_k (super-blocks of 256 in sub-blocks of 16: 2.625 and 3.4375
 * bits), and the grid i-quants, read as stored, not made: iq2_xxs (256
 * weights in 66 bytes, 2.06 bits: grid points of 8 values with sign
 * bits), iq3_xxs (98 bytes, 3.06 bits: grid points of 4 values with sign
 * bits), iq1_s and iq1_m (50 and 56 bytes, 1.56 and 1.75 bits: grid points
 * of 8 values from {-1, 0, 1} with a shift of +-1/8), iq2_xs and iq2_s
 * (74 and 82 bytes, 2.31 and 2.56 bits: larger grids of 8 values, scales
 * per 16), iq3_s (110 bytes, 3.44 bits: grid points of 4 values, sign
 * bytes); and fp8_e4m3 (blocks of 128 FP8 E4M3FN codes under a float
 * scale, 132 bytes, 8.25 bits: Hugging Face's block-scaled FP8
 * checkpoints, each row of a 128 x 128 tile keeping the tile's scale);
 * and the ternary tq1_0 and tq2_0 (256 weights of d times -1, 0 or 1 in
 * 54 and 66 bytes, 1.69 and 2.06 bits: base-3 packed, and 2-bit codes). A
 * row of n weights is ceil(n / block) whole blocks, the last padded with
 * zeros (colibri_dtype_row_bytes). */
typedef enum colibri_dtype {
  COLIBRI_DTYPE_F32 = 0,
  COLIBRI_DTYPE_F16 = 1,
  COLIBRI_DTYPE_BF16 = 2,
  COLIBRI_DTYPE_Q8_0 = 3,
  COLIBRI_DTYPE_Q4_0 = 4,
  COLIBRI_DTYPE_Q4_K = 5,
  COLIBRI_DTYPE_Q5_K = 6,
  COLIBRI_DTYPE_Q6_K = 7,
  COLIBRI_DTYPE_MXFP4 = 8,
  COLIBRI_DTYPE_Q4_1 = 9,
  COLIBRI_DTYPE_Q5_0 = 10,
  COLIBRI_DTYPE_Q5_1 = 11,
  COLIBRI_DTYPE_IQ4_NL = 12,
  COLIBRI_DTYPE_IQ4_XS = 13,
  COLIBRI_DTYPE_Q2_K = 14,
  COLIBRI_DTYPE_Q3_K = 15,
  COLIBRI_DTYPE_IQ2_XXS = 16,
  COLIBRI_DTYPE_IQ3_XXS = 17,
  COLIBRI_DTYPE_IQ1_S = 18,
  COLIBRI_DTYPE_IQ1_M = 19,
  COLIBRI_DTYPE_IQ2_XS = 20,
  COLIBRI_DTYPE_IQ2_S = 21,
  COLIBRI_DTYPE_IQ3_S = 22,
  COLIBRI_DTYPE_FP8_E4M3 = 23,
  COLIBRI_DTYPE_TQ1_0 = 24,
  COLIBRI_DTYPE_TQ2_0 = 25
} colibri_dtype_t;

/* Kind of huge pages backing the packed weights. */
typedef enum colibri_huge_page_kind {
  COLIBRI_HUGE_PAGES_NONE = 0,        /* normal 4 KiB pages */
  COLIBRI_HUGE_PAGES_TRANSPARENT = 1, /* THP via madvise(MADV_HUGEPAGE) */
  COLIBRI_HUGE_PAGES_HUGETLBFS = 2    /* explicit MAP_HUGETLB pages */
} colibri_huge_page_kind_t;

typedef struct colibri_model colibri_model_t;

/* ---------------------------------------------------------------- errors */

/* Message of the last failure on the calling thread ("" if none), at most
 * 4095 bytes (a longer one is cut short, ending in "..."). Kept in a fixed
 * per-thread buffer, so reporting a failure never allocates. The pointer
 * stays valid until the next Colibri call on this thread. */
COLIBRI_API const char* colibri_last_error(void);

/* Non-fatal notices from the last colibri_open on this thread (e.g. "mlock
 * refused: ..."), "" if none. Same lifetime rule as colibri_last_error. */
COLIBRI_API const char* colibri_last_warning(void);

COLIBRI_API const char* colibri_status_name(colibri_status_t status);
COLIBRI_API const char* colibri_dtype_name(colibri_dtype_t dtype);
COLIBRI_API const char* colibri_version(void);
/* The instruction-set level models opened in this process compute at:
 * "scalar", "avx2", "avx512" or "amx" (avx512 with AMX tiles for prefill),
 * the best this CPU supports, or the lower level COLIBRI_ISA names when it
 * is set (read once, at the first call or open). A model may still pick a
 * lower level per call (colibri_model_kernels). Static storage; thread-safe. */
COLIBRI_API const char* colibri_cpu_isa(void);

/* Bytes of one row of n weights of `dtype` as model files and buffers hold
 * it; 0 for an unknown dtype. */
COLIBRI_API size_t colibri_dtype_row_bytes(colibri_dtype_t dtype, size_t n);

/* Converts rows x n floats (row-major) into rows of `dtype`
 * (colibri_dtype_row_bytes(dtype, n) bytes each, rows * that in all at dst,
 * which holds dst_bytes): rounding to nearest even for f16 / bf16, and for
 * the block formats the reference quantisers of ggml (so q8_0 and q4_0
 * blocks equal what the gguf package writes). Thread-safe. Block formats
 * are quantised on up to one thread per core (threads started for the call
 * and joined before it returns, only for more than a million weights); the
 * bytes are the same as on one. */
COLIBRI_API colibri_status_t colibri_quantize(colibri_dtype_t dtype, const float* src, size_t rows, size_t n,
                                              void* dst, size_t dst_bytes);

/* The inverse: rows of `dtype` (src_bytes in all) to rows x n floats, as
 * the kernels' reference and the gguf package read them. */
COLIBRI_API colibri_status_t colibri_dequantize(colibri_dtype_t dtype, const void* src, size_t src_bytes,
                                                size_t rows, size_t n, float* dst);

/* ------------------------------------------------------------ open/close */

/* How far an open has come, `progress` in [0, 1] (non-decreasing; 0 before
 * the experts are read, 1 when the model is ready), on the opening thread.
 * Return nonzero to go on, 0 to cancel: the open then returns
 * COLIBRI_ERR_CANCELLED with nothing left open or allocated (llama.cpp's
 * load-progress convention). Called about 200 times at most. */
typedef int32_t (*colibri_progress_fn)(float progress, void* user_data);

typedef struct colibri_open_options_s {
  int32_t n_threads;        /* worker threads incl. caller; 0 = one per online core */
  int32_t lock_memory;      /* 1 = mlock packed weights (best effort), 0 = don't */
  int32_t huge_pages;       /* 1 = try hugetlbfs, then THP, then normal pages */
  int32_t verify_checksums; /* 1 = verify manifest checksums at open */
  int32_t pin_threads;      /* 1 = pin worker i to core i */
  int32_t reserve_tokens;   /* scratch (the engine's and the kernels', for every
                               pool thread) sized at open for calls of up to
                               this many tokens x min(n_experts, 8) experts;
                               such calls allocate nothing, from any thread.
                               Larger calls grow it once. */
  int32_t bf16_compute;     /* 1 = f16 and f32 weights may be computed through
                               bf16 (weights and activations rounded to bf16,
                               AMX tiles where present) for many-token calls;
                               0 = accurate fp32 (default; f16 weights may run
                               on AMX tiles through an exact split into bf16
                               parts, fp32-grade). With bf16 weights, 1 also
                               lets CPUs without AMX use bf16 dot products
                               for many-token calls. See docs/PRECISION.md. */
  int32_t exact_prefill;    /* 1 = every call at fp32-grade precision, also
                               many-token calls of bf16 models (by default
                               those run on AMX bf16 tiles with activations
                               rounded to bf16, within the error of PyTorch's
                               bf16 arithmetic). Decode (few tokens per
                               expert) is always fp32-grade. Not together
                               with bf16_compute. */
  /* Memory budget for the routed experts' weights (docs/CACHE.md). With
   * neither set, or a budget the experts fit in, every expert is packed
   * into memory at open. Under a smaller one the experts stay in the
   * model's files (a directory or a GGUF file; not colibri_open_memory)
   * and a pool of max(budget) / (one packed expert) slots holds those
   * calls use, read on demand; routers and shared experts stay resident.
   * Any budget holding one expert works: a call computes its experts as
   * they land and frees their slots for the rest. Outputs are
   * bit-identical to the fully resident model's. */
  uint64_t max_resident_bytes;   /* 0 = no byte budget */
  float max_resident_percent;    /* of the packed experts' bytes, 0-100; 0 = none */
  int32_t io_threads;            /* reader threads under a budget; 0 = enough for about
                                    128 MiB in flight, 2 to 8 */
  int32_t eviction_policy;       /* colibri_eviction_t */
  int32_t direct_io;             /* 1 = O_DIRECT reads where the filesystem allows */
  int32_t speculate;             /* 1 = the built-in router's guess of the next
                                    layer's experts starts their reads */
  int32_t io_engine;             /* colibri_io_engine_t */
  /* 1 = where more than one instruction-set level can compute the experts'
   * block formats, time each level's kernels on the model's own experts at
   * open (about 0.1-0.5 s a distinct expert shape) and keep the fastest,
   * remembered per CPU, library version, thread count and shape in
   * $COLIBRI_CACHE_DIR/kernels.tsv (else $XDG_CACHE_HOME/colibri/, else
   * ~/.cache/colibri/) so later opens measure nothing;
   * colibri_model_kernels says what was chosen and the timings. Off under
   * a memory budget, with COLIBRI_ISA set or COLIBRI_TUNE=0. 0 = the
   * registry's choice for the level (docs/KERNELS.md). */
  int32_t tune_kernels;
  colibri_progress_fn progress; /* NULL = none */
  void* progress_user_data;     /* passed to progress */
  /* Expert parallelism: the routed experts this process computes, for
   * processes that each hold a share of a model's experts and add their
   * outputs (an all-reduce). NULL = all. Otherwise local_experts_len
   * bytes, nonzero = computed here: n_experts of them (the same experts in
   * every layer) or n_layers * n_experts (layer-major, a placement per
   * layer). Only these experts are read and packed, so memory is about
   * their share plus routers and shared experts. Routing still chooses
   * among all experts; slots routed to the others add nothing, so the
   * outputs of processes holding disjoint shares that cover every expert
   * sum to the whole layer's (within float summation order). Kernels are
   * not timed at open (tune_kernels) for a share. */
  const uint8_t* local_experts;
  int64_t local_experts_len;
  int32_t skip_shared_expert; /* 1 = the shared expert is another process's: left out */
} colibri_open_options_t;

typedef enum {
  COLIBRI_EVICT_DECAYED_FREQUENCY = 0, /* default; docs/CACHE.md */
  COLIBRI_EVICT_LRU = 1
} colibri_eviction_t;

/* How reads under a budget reach the disk (docs/CACHE.md: the two were
 * equal within noise at the same bytes in flight where measured). */
typedef enum {
  COLIBRI_IO_PREAD = 0, /* default: blocking pread, one expert in flight per reader thread */
  COLIBRI_IO_URING = 1  /* io_uring, each expert's reads in 2 MiB pieces all in flight;
                           colibri_open fails with COLIBRI_ERR_UNSUPPORTED where this
                           build or kernel cannot run it */
} colibri_io_engine_t;

/* Defaults: n_threads 0, lock_memory 1, huge_pages 1, verify_checksums 1,
 * pin_threads 0, reserve_tokens 64, bf16_compute 0, exact_prefill 0,
 * max_resident_bytes 0, max_resident_percent 0, io_threads 0,
 * eviction_policy DECAYED_FREQUENCY, direct_io 1, speculate 1, io_engine PREAD,
 * tune_kernels 1, progress NULL, local_experts NULL, skip_shared_expert 0. */
COLIBRI_API void colibri_open_options_default(colibri_open_options_t* options);

/* Opens the model directory `path` (holding colibri.json). On success
 * *out_model owns every resource; release it with colibri_free. On failure
 * *out_model is NULL and nothing is leaked. Thread-safe. */
COLIBRI_API colibri_status_t colibri_open(const char* path, const colibri_open_options_t* options,
                                          colibri_model_t** out_model);

/* The seed's entry point: colibri_open with default options; NULL on failure
 * (see colibri_last_error). */
COLIBRI_API colibri_model_t* colibri_init(const char* path);

/* Unlocks and unmaps everything. NULL is a no-op. Must not race with other
 * calls on the same model. */
COLIBRI_API void colibri_free(colibri_model_t* model);

/* ------------------------------------------------- built-in router (v2) */

/* A model may carry, per layer, its router (gate weights [n_experts][d_model]
 * in float32) and the rule of the family it comes from; colibri_infer then
 * routes by itself when the caller gives no routing. Rules (see
 * docs/ROUTER.md; ties in top-k go to the lower expert index):
 *   MIXTRAL            softmax over all experts, top-k, renormalised to sum 1
 *   QWEN2_MOE, QWEN3_MOE, OLMOE
 *                      softmax, top-k, renormalised only if norm_topk_prob
 *   DEEPSEEK_V2        softmax; greedy top-k (n_group <= 1) or group-limited
 *                      (group score = max in group, keep topk_group groups);
 *                      renormalised if norm_topk_prob, else times
 *                      routed_scaling_factor
 *   DEEPSEEK_V3        sigmoid; choice on sigmoid + e_score_correction_bias;
 *                      group score = sum of the group's top two; experts of
 *                      dropped groups never chosen; weights = unbiased sigmoid
 *                      scores, renormalised if norm_topk_prob, times
 *                      routed_scaling_factor
 *   GPT_OSS            logits + router bias; top-k of those; weights = softmax
 *                      over the k chosen (norm_topk_prob must be 1) */
typedef enum colibri_router_family {
  COLIBRI_ROUTER_NONE = 0,
  COLIBRI_ROUTER_MIXTRAL = 1,
  COLIBRI_ROUTER_QWEN2_MOE = 2,
  COLIBRI_ROUTER_QWEN3_MOE = 3,
  COLIBRI_ROUTER_OLMOE = 4,
  COLIBRI_ROUTER_DEEPSEEK_V2 = 5,
  COLIBRI_ROUTER_DEEPSEEK_V3 = 6,
  COLIBRI_ROUTER_GPT_OSS = 7
} colibri_router_family_t;

typedef struct colibri_router_desc_s {
  colibri_router_family_t family; /* NONE = the model has no router */
  int32_t top_k;                  /* experts per token, 1 .. n_experts */
  int32_t norm_topk_prob;         /* 1 = renormalise the chosen weights */
  int32_t n_group;                /* DeepSeek: expert groups (<= 1: no grouping) */
  int32_t topk_group;             /* DeepSeek: groups kept, 1 .. n_group */
  float routed_scaling_factor;    /* DeepSeek; 1 elsewhere */
} colibri_router_desc_t;

/* Defaults: family NONE, top_k 0, norm_topk_prob 0, n_group 1, topk_group 1,
 * routed_scaling_factor 1. */
COLIBRI_API void colibri_router_desc_default(colibri_router_desc_t* router);
COLIBRI_API const char* colibri_router_family_name(colibri_router_family_t family);

/* What each expert computes from its gate and up products g and u (after
 * their biases, when the model has them):
 *   SWIGLU          h = silu(g) * u
 *   CLAMPED_SWIGLU  (gpt-oss) g = min(g, limit), u = clamp(u, -limit, limit),
 *                   h = (u + 1) * g * sigmoid(alpha * g)
 * and then y += w * (down . h + down_bias). */
typedef enum colibri_activation {
  COLIBRI_ACTIVATION_SWIGLU = 0,
  COLIBRI_ACTIVATION_CLAMPED_SWIGLU = 1
} colibri_activation_t;

/* ------------------------------------------------ models from memory (v2) */

/* One expert's three matrices, each row-major as nn.Linear.weight, in the
 * model's dtype (down in down_dtype): gate [d_ff][d_model], up
 * [d_ff][d_model], down [d_model][d_ff]; block formats in rows of whole
 * blocks (colibri_dtype_row_bytes). The fused layout's gate_up_proj[e] ([2*d_ff][d_model],
 * gate first) is gate = gate_up_proj[e], up = gate + d_ff*d_model.
 * The biases are read when the model desc says expert_bias (NULL = zeros),
 * float32: gate_bias [d_ff], up_bias [d_ff], down_bias [d_model]. */
typedef struct colibri_expert_weights_s {
  const void* gate;
  const void* up;
  const void* down;
  const float* gate_bias;
  const float* up_bias;
  const float* down_bias;
} colibri_expert_weights_t;

typedef struct colibri_layer_weights_s {
  const colibri_expert_weights_t* experts; /* [n_experts] */
  const float* router;      /* [n_experts][d_model]; required when the model
                               has a router, else ignored */
  const float* router_bias; /* [n_experts] DeepSeek-V3's e_score_correction_bias
                               or gpt-oss's router bias (added to the
                               logits); those two only (NULL = zeros) */
  colibri_expert_weights_t shared; /* used when shared_d_ff > 0; d_ff is
                                      shared_d_ff */
  const float* shared_gate; /* [d_model] or NULL: with it the shared expert's
                               output is scaled by sigmoid(shared_gate . x)
                               (Qwen2-MoE); without, added as is (DeepSeek) */
} colibri_layer_weights_t;

typedef struct colibri_model_desc_s {
  int32_t n_layers;
  int32_t n_experts;
  int32_t d_model;
  int32_t d_ff;
  colibri_dtype_t dtype;     /* of the expert buffers and of the model */
  int32_t shared_d_ff;       /* 0 = no shared expert */
  colibri_router_desc_t router;
  const colibri_layer_weights_t* layers; /* [n_layers] */
  colibri_dtype_t down_dtype; /* of the down matrices when dtype is a block
                                 format (another block format may be
                                 given, e.g. q6_k down with q4_k gate and
                                 up); ignored for float dtypes */
  colibri_activation_t activation; /* default SWIGLU */
  float swiglu_alpha;  /* CLAMPED_SWIGLU: default 1.702 */
  float swiglu_limit;  /* CLAMPED_SWIGLU: default 7 */
  int32_t expert_bias; /* 1 = the experts have biases (gpt-oss) */
  /* Optional: the routed experts handed over one at a time, so a caller
   * converting weights (reading a checkpoint, quantising) never holds more
   * than one expert. With fetch_expert set, every layers[l].experts must be
   * NULL; the library calls fetch_expert(fetch_user, l, e, &w) for each
   * layer l and expert e, in that order, and copies what w points to
   * (biases included) before the next call, so those buffers need live only
   * until then. A non-zero return fails the open with
   * COLIBRI_ERR_INVALID_ARGUMENT naming the layer and expert. */
  int32_t (*fetch_expert)(void* fetch_user, int32_t layer, int32_t expert, colibri_expert_weights_t* out);
  void* fetch_user;
} colibri_model_desc_t;

/* Zeroes *desc and sets the router's and the activation's defaults. */
COLIBRI_API void colibri_model_desc_default(colibri_model_desc_t* desc);

/* Builds a model from buffers: the weights are copied (packed, huge-page
 * backed and locked as colibri_open does), so the caller may free them when
 * this returns. Same options and ownership rules as colibri_open.
 * Thread-safe. */
COLIBRI_API colibri_status_t colibri_open_memory(const colibri_model_desc_t* desc,
                                                 const colibri_open_options_t* options,
                                                 colibri_model_t** out_model);

/* ------------------------------------------------------------ inference */

typedef struct colibri_infer_s {
  int32_t layer;    /* 0 .. n_layers-1 */
  int32_t n_tokens; /* T; 0 is a no-op */
  const float* input; /* [T][d_model] float32, row-major */
  float* output;      /* [T][d_model] float32, overwritten; must not alias input */

  /* Routing, either explicit arrays ... */
  int32_t top_k;          /* k */
  const int32_t* expert_ids; /* [T][k]; -1 = no expert in this slot */
  const float* expert_weights; /* [T][k]; applied as given (no renormalisation) */

  /* ... or a compiled routing blob (routing.bin bytes); used when
   * routing_blob != NULL, in which case top_k/expert_ids/expert_weights are
   * ignored and n_tokens must equal the blob's token count.
   * With neither (expert_ids and routing_blob both NULL) the model's own
   * router chooses; a model without one returns INVALID_ARGUMENT. */
  const void* routing_blob;
  size_t routing_blob_size;

  int32_t n_threads; /* 0 = the model's thread count; otherwise at most that */
} colibri_infer_t;

/* Zeroes *infer (n_threads 0, no routing). */
COLIBRI_API void colibri_infer_default(colibri_infer_t* infer);

/* y[t] = sum_j w[t][j] * down_e(silu(gate_e x[t]) * up_e x[t]), e = ids[t][j],
 * plus, when the model has a shared expert, s[t] * shared(x[t]) with s[t] =
 * sigmoid(shared_gate . x[t]) (or 1 without a shared gate).
 * Safe to call concurrently from several threads on one model (calls are
 * serialised on the model's thread pool; each call gets its own scratch).
 * On error the output is left untouched. */
COLIBRI_API colibri_status_t colibri_infer(colibri_model_t* model, const colibri_infer_t* infer);

/* Runs only the model's router on `input` ([n_tokens][d_model] float32) of
 * `layer`: writes the chosen ids and weights, [n_tokens][top_k] each
 * (top_k from colibri_model_info's router_top_k). Same thread safety as
 * colibri_infer. */
COLIBRI_API colibri_status_t colibri_route(colibri_model_t* model, int32_t layer, int32_t n_tokens,
                                           const float* input, int32_t* out_expert_ids,
                                           float* out_expert_weights);

/* ------------------------------------------------------- hot swap (v2) */

/* Where a new copy of one expert comes from: a file in the model's expert
 * format (gate, up, down; exactly the bytes of an expert file: 3 * d_model
 * * d_ff values of the model's dtype, or its blocks), or the same bytes in
 * memory. */
typedef struct colibri_swap_source_s {
  const char* path;      /* the file, or NULL to use data/size */
  const void* data;      /* expert-file bytes (copied; may be freed on return) */
  size_t size;           /* bytes at data */
  colibri_dtype_t dtype; /* dtype of data; must be the model's (ignored for path) */
  int32_t has_checksum;  /* 1 = verify xxh64 of the bytes against checksum */
  uint64_t checksum;
} colibri_swap_source_t;

/* Zeroes *source and sets has_checksum 0. */
COLIBRI_API void colibri_swap_source_default(colibri_swap_source_t* source);

/* Replaces one expert's weights while other threads keep calling
 * colibri_infer on the same model. The new copy is read, checked (size,
 * dtype, checksum when given) and packed into its own huge-page backed,
 * locked memory before anything changes; then it is published between two
 * calls, so every call sees the whole old expert or the whole new one. The
 * old copy is freed once no call can read it. On any error the old expert
 * keeps serving. Thread-safe against colibri_infer / colibri_route and other
 * swaps; must not race colibri_free. */
COLIBRI_API colibri_status_t colibri_swap_expert(colibri_model_t* model, int32_t layer, int32_t expert,
                                                 const colibri_swap_source_t* source);

/* ------------------------------------------------------------ prefetch */

/* Starts reads of experts[0..n) of `layer` into the cache of a model opened
 * under a memory budget, for a caller that knows a coming call's routing;
 * returns at once (the reads run on the cache's readers). Evicts only
 * experts no call is using; ids already resident or on their way, and -1,
 * are skipped. A failed read is not reported here: the call that needs the
 * expert reads it again and reports. Without a budget it does nothing.
 * *out_started (may be NULL) receives the reads started. Thread-safe,
 * also against colibri_infer on the same model. */
COLIBRI_API colibri_status_t colibri_prefetch(colibri_model_t* model, int32_t layer, const int32_t* experts,
                                              int32_t n, int32_t* out_started);

/* ----------------------------------------------------------- inspection */

typedef struct colibri_model_info_s {
  int32_t n_layers;
  int32_t n_experts;
  int32_t d_model;
  int32_t d_ff;
  colibri_dtype_t dtype;
  int32_t n_threads;
  int32_t format_version;
  colibri_router_family_t router_family; /* NONE without a built-in router */
  int32_t router_top_k;                  /* 0 without a router */
  int32_t shared_d_ff;                   /* 0 without a shared expert */
  colibri_dtype_t down_dtype;            /* of the down matrices (= dtype unless mixed) */
  colibri_activation_t activation;
  float swiglu_alpha;                    /* CLAMPED_SWIGLU only */
  float swiglu_limit;                    /* CLAMPED_SWIGLU only */
  int32_t expert_bias;                   /* 1 = experts with biases */
} colibri_model_info_t;

typedef struct colibri_stats_s {
  uint64_t bytes_mapped;     /* bytes of packed weights the kernels read */
  uint64_t bytes_locked;     /* of which mlock succeeded */
  uint64_t bytes_huge_pages; /* of which backed by huge pages (see kind) */
  colibri_huge_page_kind_t huge_page_kind;
  uint64_t bytes_files;     /* bytes of weight files read at open */
  double load_seconds;      /* wall time of colibri_open */
  double verify_seconds;    /* of which spent verifying checksums */
  uint64_t infer_calls;     /* successful colibri_infer calls so far */
  uint64_t expert_swaps;    /* successful colibri_swap_expert calls so far */
  /* Under a memory budget (all 0 without one): */
  int32_t cache_slots;          /* experts the pool holds */
  uint64_t resident_bytes;      /* the pool's bytes (within the budget) */
  uint64_t resident_experts;    /* experts in it now */
  uint64_t experts_bytes;       /* every routed expert packed, for comparison */
  uint64_t cache_hits;          /* a call's expert found resident or already on its way */
  uint64_t cache_misses;        /* a call's expert that had to be read */
  uint64_t cache_evictions;
  uint64_t expert_reads;        /* reads finished (calls', prefetches') */
  uint64_t expert_read_failures;
  uint64_t bytes_read;          /* from the files, since open */
  uint64_t direct_reads;        /* of expert_reads, through O_DIRECT */
  double read_seconds;          /* summed over readers: read, check, pack */
  double checksum_seconds;      /* of which verifying checksums */
  double wait_seconds;          /* calls waiting for reads */
  uint64_t prefetch_reads;      /* reads started by colibri_prefetch or speculation */
  uint64_t prefetch_used;       /* of which a call used the expert before it was evicted */
  uint64_t predicted;           /* experts the router speculation predicted */
  uint64_t predicted_used;      /* of which the next call of that layer used */
  uint64_t uring_reads;         /* of expert_reads, through io_uring */
} colibri_stats_t;

/* Both thread-safe. */
COLIBRI_API colibri_status_t colibri_model_info(const colibri_model_t* model,
                                                colibri_model_info_t* out_info);
/* Layer `layer`'s weight types: gate and up, and down. colibri_model_info
 * gives layer 0's; they differ between layers only for block formats read
 * from files that vary them (a GGUF Q4_K_M gives some layers' down
 * matrices Q6_K and the others Q4_K; docs/FORMAT.md). Thread-safe. */
COLIBRI_API colibri_status_t colibri_layer_dtypes(const colibri_model_t* model, int32_t layer,
                                                  colibri_dtype_t* out_dtype, colibri_dtype_t* out_down_dtype);
COLIBRI_API colibri_status_t colibri_stats(const colibri_model_t* model, colibri_stats_t* out_stats);

/* Which kernels the model runs, by tokens per expert, e.g. "decode avx512,
 * prefill avx512-tokens from 5 tokens/expert, amx-f16-split from 64
 * tokens/expert". Owned by the model; valid until colibri_free. NULL model
 * gives "". Thread-safe. */
COLIBRI_API const char* colibri_model_kernels(const colibri_model_t* model);

/* Where the model's weights came from: "colibri model directory", or for
 * a GGUF file e.g. "gguf qwen3moe, layers 0-46 = blocks 1-47 of 48, gate/up
 * Q4_K, down Q6_K, dense blocks skipped: 0" (layer l is GGUF block
 * first + l; docs/FORMAT.md). Owned by the model; valid until colibri_free.
 * NULL model gives "". Thread-safe. */
COLIBRI_API const char* colibri_model_source(const colibri_model_t* model);
/* The source block of layer 0: for a GGUF file the first block with experts
 * (layer l is GGUF block first + l), 0 for a model directory or caller
 * memory; -1 for a NULL model. Thread-safe. */
COLIBRI_API int32_t colibri_model_first_block(const colibri_model_t* model);

/* Re-hashes every weight file named in the manifest's checksums and checks
 * sizes, independent of open. Thread-safe (reads files only). */
COLIBRI_API colibri_status_t colibri_verify_dir(const char* path);

/* --------------------------------------------------------- linear layers */

/* A dense linear layer y = x W^T (+ b), W stored in any colibri_dtype_t
 * (GGUF's block formats as the file holds them, or f32/f16/bf16), computed
 * by the experts' kernels with their precision contract (docs/PRECISION.md):
 * int8 activations against block formats by default, fp32 activations
 * against the dequantised weights with `exact`. The attention projections,
 * dense MLPs and LM head of a whole model. Layers and models asking for the
 * same thread count share one pool of threads in the process. */
typedef struct colibri_linear colibri_linear_t;

typedef struct colibri_linear_desc_s {
  colibri_dtype_t dtype;
  int32_t out_features; /* rows of W */
  int32_t in_features;  /* elements per row; a multiple of the block for block formats */
  const void* weight;   /* out_features rows of colibri_dtype_row_bytes(dtype, in_features)
                           bytes, as GGUF or nn.Linear.weight stores them; copied */
  size_t weight_size;   /* bytes at weight (checked) */
  const float* bias;    /* [out_features], or NULL; copied */
  int32_t n_threads;    /* 0 = one per online core */
  int32_t exact;        /* 1 = fp32 activations against the dequantised weights */
  int32_t huge_pages;   /* 1 = huge pages for matrices of 4 MiB and more */
  int32_t lock_memory;  /* 1 = mlock the packed rows (best effort; see colibri_last_warning) */
  const char* name;     /* used in messages (e.g. the GGUF tensor name); NULL = "linear" */
  int32_t groups;       /* 1 (or 0): one matrix. G: weight holds G matrices W_g of out_features x
                           in_features one after another (bias G x out_features), x rows are
                           G x in_features and y rows G x out_features: y[g] = x[g] W_g^T + b[g]
                           (DeepSeek's per-head attn_k_b / attn_v_b) */
  int32_t fixed_kernels; /* 0 (default): where more than one instruction-set level can compute W
                           (block formats), each level's kernels are timed on W at create and the
                           fastest kept, remembered per CPU in the kernel choice cache (as the
                           experts' at open; COLIBRI_ISA or COLIBRI_TUNE=0 turn it off for every
                           layer); 1: the registry's kernels for this CPU's level, nothing timed */
} colibri_linear_desc_t;

/* Defaults: dtype F32, sizes 0, pointers NULL, n_threads 0, exact 0,
 * huge_pages 1, lock_memory 0, groups 1, fixed_kernels 0. */
COLIBRI_API void colibri_linear_desc_default(colibri_linear_desc_t* desc);
/* Copies and packs the rows. On failure *out is NULL and the message names
 * desc->name. Thread-safe. */
COLIBRI_API colibri_status_t colibri_linear_create(const colibri_linear_desc_t* desc, colibri_linear_t** out);
/* y[T][groups x out_features] = x[T][groups x in_features] W^T + b, float32
 * row-major (per group, as the desc says); y is overwritten and must not
 * overlap x. Calls on one layer are serialised. */
COLIBRI_API colibri_status_t colibri_linear_forward(colibri_linear_t* linear, int32_t n_tokens, const float* x,
                                                    float* y);
/* Which kernels run it, e.g. "decode int8-avx512, prefill amx-bf16-dequant
 * from 24 tokens"; "" for NULL. Valid until colibri_linear_free. */
COLIBRI_API const char* colibri_linear_kernels(const colibri_linear_t* linear);
/* Bytes of packed weights it holds; 0 for NULL. */
COLIBRI_API uint64_t colibri_linear_bytes(const colibri_linear_t* linear);
COLIBRI_API void colibri_linear_free(colibri_linear_t* linear);

/* RMS norm of `rows` rows of `dim` floats: y = weight * x / sqrt(mean(x^2) + eps)
 * (the mean summed in double), as the MoE families' RMSNorm computes it in
 * float32; y may be x. Thread-safe. */
COLIBRI_API colibri_status_t colibri_rms_norm(const float* x, const float* weight, int32_t rows, int32_t dim,
                                              float eps, float* y);

/* Rotary position embedding, out = x * cos + rotate_half(x) * sin on the
 * first rotary_dim dimensions of each head (the rest copied), as the
 * transformers MoE families compute it in float32, to the bit: each
 * product rounded, then the difference or sum. Thread-safe. */
typedef struct colibri_rope_desc_s {
  int32_t batch;
  int32_t heads;
  int32_t tokens;
  int32_t head_dim;
  int32_t rotary_dim; /* even, 2 .. head_dim */
  int32_t half_table; /* 1: cos/sin hold rotary_dim / 2 values a position, shared by both
                         halves (gpt-oss); 0: rotary_dim values */
  const float* x;     /* element strides of [batch, head, token], >= 0; last dimension contiguous */
  int64_t x_stride[3];
  float* out; /* same shape, its own strides; may be x (then with x's strides) */
  int64_t out_stride[3];
  const float* cos; /* strides of [batch, token], >= 0 (0 broadcasts) */
  const float* sin;
  int64_t table_stride[2];
} colibri_rope_desc_t;

COLIBRI_API colibri_status_t colibri_rope(const colibri_rope_desc_t* desc);

/* Scaled dot-product attention of q_len query tokens over a KV cache of
 * kv_len positions (the new ones included), what one layer's attention
 * computes at each decode step: grouped-query heads, a causal or explicit
 * mask, a sliding window, per-head sink logits. Float32; scores, softmax
 * (maximum subtracted) and sums in float32. Thread-safe. */
typedef struct colibri_attention_desc_s {
  int32_t batch;
  int32_t heads;    /* query heads */
  int32_t kv_heads; /* divides heads: head h reads kv head h / (heads / kv_heads) */
  int32_t q_len;    /* the queries are the last q_len positions */
  int32_t kv_len;
  int32_t qk_dim;
  int32_t v_dim;
  int32_t window;    /* causal mask only: position p sees s > p - window; 0 = all earlier */
  int32_t n_threads; /* 0 = one per online core (the process's shared pool) */
  float scale;       /* multiplies q.k; e.g. 1/sqrt(qk_dim) */
  /* Element strides of [batch, head, token]; the last dimension is
   * contiguous; >= 0 (0 broadcasts). */
  const float* q; /* [batch][heads][q_len][qk_dim] */
  int64_t q_stride[3];
  const float* k; /* [batch][kv_heads][kv_len][qk_dim] */
  int64_t k_stride[3];
  const float* v; /* [batch][kv_heads][kv_len][v_dim] */
  int64_t v_stride[3];
  /* Nonzero where query t sees position s, [batch][q_len][kv_len] with
   * these strides, shared by all heads; NULL = causal (query t, at
   * position kv_len - q_len + t, sees every position up to its own). */
  const uint8_t* mask;
  /* Or added to the scaled scores, with the same layout and strides (an
   * eager attention's float mask: 0 visible, -inf or a large negative
   * hidden); at most one of mask and additive_mask. */
  const float* additive_mask;
  int64_t mask_stride[3];
  const float* sinks; /* [heads] logits joining each softmax's denominator (gpt-oss), or NULL */
  float* out;         /* [batch][q_len][heads][v_dim], contiguous, overwritten; a query that sees
                         no position (and has no sink) gets zeros. Must not overlap the inputs. */
  /* A key stored in two parts (DeepSeek's latent and rope parts, cached
   * apart): q rows hold qk_dim + qk2_dim floats, the last qk2_dim scored
   * against k2 [batch][kv_heads][kv_len][qk2_dim]. NULL and 0: one part. */
  const float* k2;
  int64_t k2_stride[3];
  int32_t qk2_dim;
} colibri_attention_desc_t;

/* Zeros, scale 1, n_threads 0. */
COLIBRI_API void colibri_attention_desc_default(colibri_attention_desc_t* desc);
COLIBRI_API colibri_status_t colibri_attention(const colibri_attention_desc_t* desc);

/* --------------------------------------------------------------- routing */

typedef enum colibri_route_weight_encoding {
  COLIBRI_ROUTE_WEIGHTS_F32 = 1, /* exact (default) */
  COLIBRI_ROUTE_WEIGHTS_F16 = 2  /* half the bytes; ~3 significant digits */
} colibri_route_weight_encoding_t;

typedef struct colibri_route_compile_options_s {
  int32_t n_experts;  /* required: ids must lie in [0, n_experts) */
  int32_t compact;    /* 1 = seed's 1 byte/token mode (needs n_experts <= 4, k = 2) */
  int32_t q4_weights; /* 1 = weights in the text are 4-bit codes q, weight q/15 */
  colibri_route_weight_encoding_t weight_encoding; /* general mode only */
} colibri_route_compile_options_t;

/* Defaults: n_experts 0 (must be set), compact 0, q4_weights 0, F32. */
COLIBRI_API void colibri_route_compile_options_default(colibri_route_compile_options_t* options);

/* Compiles `.route` text to routing.bin bytes. `source_name` is used in
 * error messages (e.g. the file name; may be NULL). On success *out_blob is
 * allocated by the library: release with colibri_buffer_free. Thread-safe. */
COLIBRI_API colibri_status_t colibri_route_compile(const char* text, size_t text_size,
                                                   const char* source_name,
                                                   const colibri_route_compile_options_t* options,
                                                   void** out_blob, size_t* out_blob_size);

/* Reads a `.route` file and writes routing.bin to out_path (written to a
 * temporary file and renamed, so a failure never leaves a partial file). */
COLIBRI_API colibri_status_t colibri_route_compile_file(
    const char* route_path, const char* out_path, const colibri_route_compile_options_t* options);

COLIBRI_API void colibri_buffer_free(void* buffer);

/* What `colibri doctor` reports, as a JSON document (NUL-terminated, release
 * with colibri_buffer_free; *out_size, if not NULL, its length): "cpu" (name,
 * the kernel level used and detected, features), "cores" (online, allowed,
 * physical, recommended_threads), "memory", "huge_pages" (THP mode, hugetlbfs
 * pool), "memlock" (RLIMIT_MEMLOCK), "numa", "environment" (COLIBRI_ISA,
 * COLIBRI_TUNE, COLIBRI_PREFETCH, the kernel choice cache), "model" (null
 * without model_path; else a directory or GGUF file read without loading
 * its weights: shape, experts' bytes, each expert shape's kernels and what a
 * measurement at open remembered) and "problems" ([{"problem", "fix"}]: each
 * with the command that fixes it). n_threads: what the model would be
 * opened with (0 = one per online core). A model that cannot be read fails
 * with the message naming it. Thread-safe. */
COLIBRI_API colibri_status_t colibri_doctor(const char* model_path, int32_t n_threads, char** out_json,
                                            size_t* out_size);

/* Decoded routing: ids and weights as flat [T][k] arrays. */
typedef struct colibri_routing colibri_routing_t;

/* Decodes and fully validates routing.bin bytes. If n_experts > 0, ids must
 * also lie below it. `source_name` is used in messages. Thread-safe. */
COLIBRI_API colibri_status_t colibri_routing_decode(const void* blob, size_t blob_size,
                                                    int32_t n_experts, const char* source_name,
                                                    colibri_routing_t** out_routing);

/* Loads a routing file: routing.bin (recognised by its magic) or `.route`
 * text (then n_experts is required, and q4_weights applies). */
COLIBRI_API colibri_status_t colibri_routing_load(const char* path, int32_t n_experts,
                                                  int32_t q4_weights,
                                                  colibri_routing_t** out_routing);

COLIBRI_API int32_t colibri_routing_n_tokens(const colibri_routing_t* routing);
COLIBRI_API int32_t colibri_routing_n_experts(const colibri_routing_t* routing);
COLIBRI_API int32_t colibri_routing_top_k(const colibri_routing_t* routing);
/* Encoding of the source: 1 = compact, 0 = general; weight encoding below. */
COLIBRI_API int32_t colibri_routing_is_compact(const colibri_routing_t* routing);
COLIBRI_API colibri_route_weight_encoding_t colibri_routing_weight_encoding(
    const colibri_routing_t* routing);
COLIBRI_API const int32_t* colibri_routing_expert_ids(const colibri_routing_t* routing);
COLIBRI_API const float* colibri_routing_expert_weights(const colibri_routing_t* routing);
COLIBRI_API void colibri_routing_free(colibri_routing_t* routing);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* COLIBRI_H */
