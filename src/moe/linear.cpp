#include "moe/linear.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "moe/kernel_choice.h"

#include "util/error.h"

namespace colibri {

namespace {

// Output rows per work item: about 8 items per thread so a thread that
// finishes early takes more, in whole groups of 16 rows (the kernels'
// micro-tiles), 16 to 512.
int32_t linear_rows_per_item(int32_t rows, int threads) {
  const int64_t want_items = 8LL * threads;
  int64_t r = (rows + want_items - 1) / want_items;
  r = std::clamp<int64_t>(r, 16, 512);
  r = (r + 15) / 16 * 16;
  return static_cast<int32_t>(std::min<int64_t>(r, rows));
}

// Below this many multiply-adds a call runs on the caller alone: waking the
// workers costs more than they save.
constexpr double kParallelMinMacs = 65536.0;

}  // namespace

Linear::Linear(WeightType type, int32_t out_features, int32_t in_features, const void* rows, size_t size,
               const float* bias, const LinearOptions& options, const std::string& name, std::string* warnings,
               int32_t groups)
    : groups_(groups) {
  if (static_cast<int>(type) >= kWeightTypeCount) {
    fail(Status::kInvalidArgument, name + ": unknown weight type " + std::to_string(static_cast<int>(type)));
  }
  constexpr int32_t kMaxFeatures = int32_t{1} << 26;
  if (out_features < 1 || in_features < 1 || out_features > kMaxFeatures || in_features > kMaxFeatures) {
    fail(Status::kInvalidArgument, name + ": out_features and in_features must be 1.." +
                                       std::to_string(kMaxFeatures) + ", got " + std::to_string(out_features) +
                                       " x " + std::to_string(in_features));
  }
  const WeightFormat& format = weight_format(type);
  if (format.quantized && in_features % static_cast<int32_t>(format.block_elements) != 0) {
    fail(Status::kInvalidArgument, name + ": in_features " + std::to_string(in_features) + " is not a multiple of " +
                                       format.name + "'s block of " + std::to_string(format.block_elements));
  }
  constexpr int32_t kMaxGroups = int32_t{1} << 16;
  if (groups < 1 || groups > kMaxGroups) {
    fail(Status::kInvalidArgument, name + ": groups must be 1.." + std::to_string(kMaxGroups) + ", got " +
                                       std::to_string(groups));
  }
  if (static_cast<int64_t>(groups) * out_features > kMaxFeatures ||
      static_cast<int64_t>(groups) * in_features > kMaxFeatures) {
    fail(Status::kInvalidArgument, name + ": " + std::to_string(groups) + " groups of " +
                                       std::to_string(out_features) + " x " + std::to_string(in_features) +
                                       " exceed " + std::to_string(kMaxFeatures) + " features");
  }
  if (rows == nullptr) fail(Status::kInvalidArgument, name + ": the weight rows are NULL");
  if (options.threads < 0) {
    fail(Status::kInvalidArgument, name + ": threads must be >= 0 (0 = one per core), got " +
                                       std::to_string(options.threads));
  }
  const size_t src_row = weight_row_bytes(type, static_cast<size_t>(in_features));
  const size_t total_rows = static_cast<size_t>(groups) * static_cast<size_t>(out_features);
  const size_t expected = src_row * total_rows;
  if (size != expected) {
    fail(Status::kFormat, name + ": " + std::to_string(size) + " bytes of weights, " +
                              (groups > 1 ? std::to_string(groups) + " " + format.name + " matrices" :
                                            std::string("a ") + format.name + " matrix") +
                              " of " + std::to_string(out_features) + " x " + std::to_string(in_features) +
                              " take" + (groups > 1 ? "" : "s") + " " + std::to_string(expected));
  }

  // W is the down block of an expert of d_model = out, d_ff = in.
  shape_ = kernels::make_expert_shape(out_features, in_features, type, type);
  const size_t packed_row = weight_row_bytes(type, shape_.down_stride);
  group_bytes_ = packed_row * static_cast<size_t>(out_features);
  weight_bytes_ = group_bytes_ * static_cast<size_t>(groups);
  // Huge pages only where the matrix fills some: each region is rounded to
  // whole 2 MiB pages, which small projections would mostly waste.
  weights_ = WeightRegion(weight_bytes_, options.huge_pages && weight_bytes_ >= (size_t{4} << 20));
  const auto* src = static_cast<const uint8_t*>(rows);
  for (size_t r = 0; r < total_rows; ++r) std::memcpy(weights_.data() + r * packed_row, src + r * src_row, src_row);
  if (options.lock_memory) {
    std::string why;
    if (!weights_.lock(&why) && warnings != nullptr) *warnings = why;
  }
  if (bias != nullptr) bias_.assign(bias, bias + total_rows);

  kernels::Isa isa = kernels::default_isa();
  if (options.isa >= 0) isa = std::min(isa, static_cast<kernels::Isa>(options.isa));
  plan_ = kernels::plan_kernels(isa, shape_,
                                options.exact ? kernels::PrefillPrecision::kExact : kernels::PrefillPrecision::kDefault);
  kernels_ = kernels::describe_plan(plan_, "tokens");

  const int cores = online_cores();
  int threads = options.threads == 0 ? cores : std::min(options.threads, cores);
  pool_ = shared_thread_pool(threads, false);
  scratch_ = std::make_unique<kernels::KernelScratch[]>(static_cast<size_t>(pool_->size()));
  if (options.tune && options.isa < 0 && format.quantized && kernel_choice_allowed_by_environment()) {
    choose_kernels(isa, options.exact, warnings);
  }
}

void Linear::choose_kernels(kernels::Isa isa, bool exact, std::string* warnings) {
  KernelChoiceRequest request;
  request.isa = isa;
  request.precision = exact ? kernels::PrefillPrecision::kExact : kernels::PrefillPrecision::kDefault;
  request.threads = pool_->size();
  request.cache_path = kernel_choice_cache_path();
  // Inputs for up to the measurement's 16 tokens, not zeros: a kernel's time
  // must not depend on a shortcut for them.
  constexpr int32_t kTokens = 16;
  const size_t in = static_cast<size_t>(groups_) * static_cast<size_t>(shape_.d_ff);
  const size_t out = static_cast<size_t>(groups_) * static_cast<size_t>(shape_.d_model);
  std::vector<float> x(kTokens * in), y(kTokens * out);
  uint32_t state = 2463534242u;
  for (float& v : x) {
    state ^= state << 13;
    state ^= state >> 17;
    state ^= state << 5;
    v = static_cast<float>(static_cast<int32_t>(state >> 8) - (1 << 23)) / static_cast<float>(1 << 23);
  }
  const kernels::KernelPlan top = plan_;
  const std::string what = groups_ > 1 ? "linear groups " + std::to_string(groups_) : std::string("linear");
  const PlanChoice choice =
      choose_plan_by_measurement(request, shape_, top, what, [&](const kernels::KernelPlan& plan, int32_t tokens) {
        plan_ = plan;
        // One-token calls from memory, as in a model whose weights exceed the
        // last-level cache: a matrix left in L3 by the previous call would
        // time the kernels' arithmetic alone, which can rank the levels
        // differently. Many-token calls are bound by arithmetic either way,
        // and a matrix far larger than any L3 streams from memory anyway
        // (clflush of an LM head's hundreds of MB would cost more than its call).
        constexpr size_t kEvictMaxBytes = size_t{128} << 20;
        if (tokens == 1 && weight_bytes_ <= kEvictMaxBytes) evict_from_caches(weights_.data(), weight_bytes_);
        const auto t0 = std::chrono::steady_clock::now();
        forward(std::min(tokens, kTokens), x.data(), in, y.data(), out);
        return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      });
  plan_ = choice.plan;
  if (choice.had_choice) {
    kernels_ = kernels::describe_plan(plan_, "tokens") + " (chosen by measurement: " + choice.description + ")";
  }
  if (warnings != nullptr && !choice.warning.empty()) {
    if (!warnings->empty()) *warnings += "; ";
    *warnings += choice.warning;
  }
}

void Linear::forward(int32_t n_tokens, const float* x, size_t ldx, float* y, size_t ldy) {
  if (n_tokens <= 0) return;
  const std::lock_guard<std::mutex> lock(mutex_);
  const size_t T = static_cast<size_t>(n_tokens);
  if (identity_.size() < T) {
    const size_t old = identity_.size();
    identity_.resize(T);
    for (size_t t = old; t < T; ++t) identity_[t] = static_cast<int32_t>(t);
    ones_.assign(T, 1.0f);
  }
  const int32_t D = shape_.d_model;
  const size_t G = static_cast<size_t>(groups_);
  const size_t in = static_cast<size_t>(shape_.d_ff);
  const kernels::KernelTable& table = plan_.pick(n_tokens);
  int threads = pool_->size();
  if (static_cast<double>(n_tokens) * D * shape_.d_ff * static_cast<double>(G) < kParallelMinMacs) threads = 1;

  // Tables that convert activations into a layout of their own (int8
  // blocks, bf16 tiles) do it once here, not once per block of rows: each
  // group's slice of the tokens apart, group g's at prepared_ + g * prepared.
  const size_t prepared = table.prepared_bytes != nullptr ? table.prepared_bytes(shape_, kernels::Phase::kDown, n_tokens) : 0;
  if (prepared > 0) {
    if (prepared_.size() < prepared * G) prepared_.resize(prepared * G);
    const size_t per_token = table.prepared_bytes(shape_, kernels::Phase::kDown, 1);
    if (per_token * T == prepared && threads > 1 && T * G > 1) {
      // Token rows are independent in this layout: convert them in parallel.
      const int64_t chunks_per_group = std::min<int64_t>(n_tokens, (4LL * threads + static_cast<int64_t>(G) - 1) /
                                                                       static_cast<int64_t>(G));
      const int64_t per = (n_tokens + chunks_per_group - 1) / chunks_per_group;
      pool_->parallel_for(chunks_per_group * static_cast<int64_t>(G), threads, [&](int64_t c, int /*thread*/) {
        const auto g = static_cast<size_t>(c / chunks_per_group);
        const int64_t t0 = (c % chunks_per_group) * per;
        const int64_t tn = std::min<int64_t>(per, n_tokens - t0);
        if (tn <= 0) return;
        table.prepare(shape_, kernels::Phase::kDown, x + static_cast<size_t>(t0) * ldx + g * in, ldx, nullptr,
                      static_cast<int32_t>(tn), prepared_.data() + g * prepared + static_cast<size_t>(t0) * per_token);
      });
    } else {
      for (size_t g = 0; g < G; ++g) {
        table.prepare(shape_, kernels::Phase::kDown, x + g * in, ldx, nullptr, n_tokens, prepared_.data() + g * prepared);
      }
    }
  }

  // Items never straddle two groups (the constructor keeps G x D in int32).
  const int32_t rows = std::min(D, linear_rows_per_item(static_cast<int32_t>(G) * D, threads));
  const int64_t items_per_group = (D + rows - 1) / rows;
  pool_->parallel_for(items_per_group * static_cast<int64_t>(G), threads, [&](int64_t item, int thread) {
    const auto g = static_cast<size_t>(item / items_per_group);
    const int32_t d0 = static_cast<int32_t>(item % items_per_group) * rows;
    const int32_t d1 = std::min(D, d0 + rows);
    const float* bias = bias_.empty() ? nullptr : bias_.data() + g * static_cast<size_t>(D);
    float* yg = y + g * static_cast<size_t>(D);
    for (size_t t = 0; t < T; ++t) {
      float* yt = yg + t * ldy;
      if (bias != nullptr) {
        std::copy(bias + d0, bias + d1, yt + d0);
      } else {
        std::fill(yt + d0, yt + d1, 0.0f);
      }
    }
    kernels::KernelScratch* scratch = &scratch_[static_cast<size_t>(thread)];
    const uint8_t* w = weights_.data() + g * group_bytes_;
    const float* xg = x + g * in;
    if (prepared > 0) {
      table.down_prepared(shape_, w, xg, ldx, prepared_.data() + g * prepared, identity_.data(), ones_.data(),
                          n_tokens, d0, d1, yg, ldy, scratch);
    } else {
      table.down(shape_, w, xg, ldx, identity_.data(), ones_.data(), n_tokens, d0, d1, yg, ldy, scratch);
    }
  });
}

}  // namespace colibri
