/* Prints the size and field offsets of every struct in colibri.h that the
 * Python package mirrors with ctypes, as JSON, for python/tests/
 * test_abi_layout.py. Compiled as C against the public header, so the
 * figures are the C ABI's own. A field added to the header but not listed
 * here still shows, as a size that no longer matches the ctypes mirror. */
#include <stddef.h>
#include <stdio.h>

#include "colibri.h"

static int first_struct = 1;
static int first_field = 1;

static void begin(const char* name, size_t size) {
  printf("%s\n  \"%s\": {\"size\": %zu, \"fields\": {", first_struct ? "{" : ",", name, size);
  first_struct = 0;
  first_field = 1;
}

static void field(const char* name, size_t offset) {
  printf("%s\"%s\": %zu", first_field ? "" : ", ", name, offset);
  first_field = 0;
}

static void end(void) { printf("}}"); }

#define BEGIN(type) begin(#type, sizeof(type))
#define FIELD(type, f) field(#f, offsetof(type, f))

int main(void) {
  BEGIN(colibri_open_options_t);
  FIELD(colibri_open_options_t, n_threads);
  FIELD(colibri_open_options_t, lock_memory);
  FIELD(colibri_open_options_t, huge_pages);
  FIELD(colibri_open_options_t, verify_checksums);
  FIELD(colibri_open_options_t, pin_threads);
  FIELD(colibri_open_options_t, reserve_tokens);
  FIELD(colibri_open_options_t, bf16_compute);
  FIELD(colibri_open_options_t, exact_prefill);
  FIELD(colibri_open_options_t, max_resident_bytes);
  FIELD(colibri_open_options_t, max_resident_percent);
  FIELD(colibri_open_options_t, io_threads);
  FIELD(colibri_open_options_t, eviction_policy);
  FIELD(colibri_open_options_t, direct_io);
  FIELD(colibri_open_options_t, speculate);
  FIELD(colibri_open_options_t, io_engine);
  FIELD(colibri_open_options_t, tune_kernels);
  FIELD(colibri_open_options_t, progress);
  FIELD(colibri_open_options_t, progress_user_data);
  FIELD(colibri_open_options_t, local_experts);
  FIELD(colibri_open_options_t, local_experts_len);
  FIELD(colibri_open_options_t, skip_shared_expert);
  end();

  BEGIN(colibri_router_desc_t);
  FIELD(colibri_router_desc_t, family);
  FIELD(colibri_router_desc_t, top_k);
  FIELD(colibri_router_desc_t, norm_topk_prob);
  FIELD(colibri_router_desc_t, n_group);
  FIELD(colibri_router_desc_t, topk_group);
  FIELD(colibri_router_desc_t, routed_scaling_factor);
  end();

  BEGIN(colibri_expert_weights_t);
  FIELD(colibri_expert_weights_t, gate);
  FIELD(colibri_expert_weights_t, up);
  FIELD(colibri_expert_weights_t, down);
  FIELD(colibri_expert_weights_t, gate_bias);
  FIELD(colibri_expert_weights_t, up_bias);
  FIELD(colibri_expert_weights_t, down_bias);
  end();

  BEGIN(colibri_layer_weights_t);
  FIELD(colibri_layer_weights_t, experts);
  FIELD(colibri_layer_weights_t, router);
  FIELD(colibri_layer_weights_t, router_bias);
  FIELD(colibri_layer_weights_t, shared);
  FIELD(colibri_layer_weights_t, shared_gate);
  end();

  BEGIN(colibri_model_desc_t);
  FIELD(colibri_model_desc_t, n_layers);
  FIELD(colibri_model_desc_t, n_experts);
  FIELD(colibri_model_desc_t, d_model);
  FIELD(colibri_model_desc_t, d_ff);
  FIELD(colibri_model_desc_t, dtype);
  FIELD(colibri_model_desc_t, shared_d_ff);
  FIELD(colibri_model_desc_t, router);
  FIELD(colibri_model_desc_t, layers);
  FIELD(colibri_model_desc_t, down_dtype);
  FIELD(colibri_model_desc_t, activation);
  FIELD(colibri_model_desc_t, swiglu_alpha);
  FIELD(colibri_model_desc_t, swiglu_limit);
  FIELD(colibri_model_desc_t, expert_bias);
  FIELD(colibri_model_desc_t, fetch_expert);
  FIELD(colibri_model_desc_t, fetch_user);
  end();

  BEGIN(colibri_linear_desc_t);
  FIELD(colibri_linear_desc_t, dtype);
  FIELD(colibri_linear_desc_t, out_features);
  FIELD(colibri_linear_desc_t, in_features);
  FIELD(colibri_linear_desc_t, weight);
  FIELD(colibri_linear_desc_t, weight_size);
  FIELD(colibri_linear_desc_t, bias);
  FIELD(colibri_linear_desc_t, n_threads);
  FIELD(colibri_linear_desc_t, exact);
  FIELD(colibri_linear_desc_t, huge_pages);
  FIELD(colibri_linear_desc_t, lock_memory);
  FIELD(colibri_linear_desc_t, name);
  FIELD(colibri_linear_desc_t, groups);
  FIELD(colibri_linear_desc_t, fixed_kernels);
  end();

  BEGIN(colibri_rope_desc_t);
  FIELD(colibri_rope_desc_t, batch);
  FIELD(colibri_rope_desc_t, heads);
  FIELD(colibri_rope_desc_t, tokens);
  FIELD(colibri_rope_desc_t, head_dim);
  FIELD(colibri_rope_desc_t, rotary_dim);
  FIELD(colibri_rope_desc_t, half_table);
  FIELD(colibri_rope_desc_t, x);
  FIELD(colibri_rope_desc_t, x_stride);
  FIELD(colibri_rope_desc_t, out);
  FIELD(colibri_rope_desc_t, out_stride);
  FIELD(colibri_rope_desc_t, cos);
  FIELD(colibri_rope_desc_t, sin);
  FIELD(colibri_rope_desc_t, table_stride);
  end();

  BEGIN(colibri_attention_desc_t);
  FIELD(colibri_attention_desc_t, batch);
  FIELD(colibri_attention_desc_t, heads);
  FIELD(colibri_attention_desc_t, kv_heads);
  FIELD(colibri_attention_desc_t, q_len);
  FIELD(colibri_attention_desc_t, kv_len);
  FIELD(colibri_attention_desc_t, qk_dim);
  FIELD(colibri_attention_desc_t, v_dim);
  FIELD(colibri_attention_desc_t, window);
  FIELD(colibri_attention_desc_t, n_threads);
  FIELD(colibri_attention_desc_t, scale);
  FIELD(colibri_attention_desc_t, q);
  FIELD(colibri_attention_desc_t, q_stride);
  FIELD(colibri_attention_desc_t, k);
  FIELD(colibri_attention_desc_t, k_stride);
  FIELD(colibri_attention_desc_t, v);
  FIELD(colibri_attention_desc_t, v_stride);
  FIELD(colibri_attention_desc_t, mask);
  FIELD(colibri_attention_desc_t, additive_mask);
  FIELD(colibri_attention_desc_t, mask_stride);
  FIELD(colibri_attention_desc_t, sinks);
  FIELD(colibri_attention_desc_t, out);
  FIELD(colibri_attention_desc_t, k2);
  FIELD(colibri_attention_desc_t, k2_stride);
  FIELD(colibri_attention_desc_t, qk2_dim);
  end();

  BEGIN(colibri_infer_t);
  FIELD(colibri_infer_t, layer);
  FIELD(colibri_infer_t, n_tokens);
  FIELD(colibri_infer_t, input);
  FIELD(colibri_infer_t, output);
  FIELD(colibri_infer_t, top_k);
  FIELD(colibri_infer_t, expert_ids);
  FIELD(colibri_infer_t, expert_weights);
  FIELD(colibri_infer_t, routing_blob);
  FIELD(colibri_infer_t, routing_blob_size);
  FIELD(colibri_infer_t, n_threads);
  end();

  BEGIN(colibri_swap_source_t);
  FIELD(colibri_swap_source_t, path);
  FIELD(colibri_swap_source_t, data);
  FIELD(colibri_swap_source_t, size);
  FIELD(colibri_swap_source_t, dtype);
  FIELD(colibri_swap_source_t, has_checksum);
  FIELD(colibri_swap_source_t, checksum);
  end();

  BEGIN(colibri_model_info_t);
  FIELD(colibri_model_info_t, n_layers);
  FIELD(colibri_model_info_t, n_experts);
  FIELD(colibri_model_info_t, d_model);
  FIELD(colibri_model_info_t, d_ff);
  FIELD(colibri_model_info_t, dtype);
  FIELD(colibri_model_info_t, n_threads);
  FIELD(colibri_model_info_t, format_version);
  FIELD(colibri_model_info_t, router_family);
  FIELD(colibri_model_info_t, router_top_k);
  FIELD(colibri_model_info_t, shared_d_ff);
  FIELD(colibri_model_info_t, down_dtype);
  FIELD(colibri_model_info_t, activation);
  FIELD(colibri_model_info_t, swiglu_alpha);
  FIELD(colibri_model_info_t, swiglu_limit);
  FIELD(colibri_model_info_t, expert_bias);
  end();

  BEGIN(colibri_stats_t);
  FIELD(colibri_stats_t, bytes_mapped);
  FIELD(colibri_stats_t, bytes_locked);
  FIELD(colibri_stats_t, bytes_huge_pages);
  FIELD(colibri_stats_t, huge_page_kind);
  FIELD(colibri_stats_t, bytes_files);
  FIELD(colibri_stats_t, load_seconds);
  FIELD(colibri_stats_t, verify_seconds);
  FIELD(colibri_stats_t, infer_calls);
  FIELD(colibri_stats_t, expert_swaps);
  FIELD(colibri_stats_t, cache_slots);
  FIELD(colibri_stats_t, resident_bytes);
  FIELD(colibri_stats_t, resident_experts);
  FIELD(colibri_stats_t, experts_bytes);
  FIELD(colibri_stats_t, cache_hits);
  FIELD(colibri_stats_t, cache_misses);
  FIELD(colibri_stats_t, cache_evictions);
  FIELD(colibri_stats_t, expert_reads);
  FIELD(colibri_stats_t, expert_read_failures);
  FIELD(colibri_stats_t, bytes_read);
  FIELD(colibri_stats_t, direct_reads);
  FIELD(colibri_stats_t, read_seconds);
  FIELD(colibri_stats_t, checksum_seconds);
  FIELD(colibri_stats_t, wait_seconds);
  FIELD(colibri_stats_t, prefetch_reads);
  FIELD(colibri_stats_t, prefetch_used);
  FIELD(colibri_stats_t, predicted);
  FIELD(colibri_stats_t, predicted_used);
  FIELD(colibri_stats_t, uring_reads);
  end();

  BEGIN(colibri_route_compile_options_t);
  FIELD(colibri_route_compile_options_t, n_experts);
  FIELD(colibri_route_compile_options_t, compact);
  FIELD(colibri_route_compile_options_t, q4_weights);
  FIELD(colibri_route_compile_options_t, weight_encoding);
  end();
  printf("\n}\n");
  return 0;
}
