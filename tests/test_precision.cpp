// The accuracy contract of every kernel table, on many random tiny and odd
// layers (docs/PRECISION.md):
//   - tables that compute at fp32 grade (every decode table, the fp32
//     prefill tables, amx-f16-split): relative L2 error against float64 on
//     the stored weights <= 1e-5 for f32 models, <= 5e-3 for f16 and bf16;
//   - tables that round activations to bf16 (amx-bf16, avx512-bf16): within
//     5e-3 or within the error of a PyTorch-style bf16 computation of the
//     same layer on the same data, whichever is larger.
// Shapes are small enough that one rounding is not averaged away (d_model
// and d_ff 1..40, one expert, one token), which is where a rounding decode
// table once gave 2.5e-2. Token counts are chosen so that each active
// expert reaches every prefill tier (4, 5, 64 and 128 tokens per expert).
// The binary is registered once per ISA level (COLIBRI_ISA), so together the
// runs reach every table the machine has; each run prints which tables it
// reached and the worst error of each.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "colibri.h"
#include "kernels/kernels.h"
#include "lib/float64_reference.h"
#include "util/half.h"

namespace {

namespace k = colibri::kernels;

float round_bf16(float v) { return colibri::bf16_to_float(colibri::float_to_bf16(v)); }

// Weights as the model stores them, widened to float exactly.
struct Expert {
  std::vector<float> gate, up, down;  // [F][D], [F][D], [D][F]
};

struct Layer {
  int32_t E = 0, D = 0, F = 0;
  colibri_dtype_t dtype = COLIBRI_DTYPE_F32;
  std::vector<Expert> experts;
  std::vector<std::vector<uint16_t>> stored16;  // per expert gate|up|down (f16 / bf16 bits)
  std::vector<std::vector<float>> stored32;     // per expert gate|up|down (f32)
};

Layer random_layer(std::mt19937& rng, int32_t E, int32_t D, int32_t F, colibri_dtype_t dtype) {
  Layer L;
  L.E = E;
  L.D = D;
  L.F = F;
  L.dtype = dtype;
  const size_t DF = static_cast<size_t>(D) * static_cast<size_t>(F);
  // Scaled so that gate/up outputs are O(1) (silu neither linear nor flat).
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const float sg = 2.0f / std::sqrt(static_cast<float>(D)), sd = 1.0f / std::sqrt(static_cast<float>(F));
  for (int32_t e = 0; e < E; ++e) {
    std::vector<float> all(3 * DF);
    for (size_t i = 0; i < all.size(); ++i) all[i] = u(rng) * (i < 2 * DF ? sg : sd);
    if (dtype == COLIBRI_DTYPE_F32) {
      L.stored32.push_back(all);
    } else {
      std::vector<uint16_t> bits(all.size());
      for (size_t i = 0; i < all.size(); ++i) {
        bits[i] = dtype == COLIBRI_DTYPE_F16 ? colibri::float_to_f16(all[i]) : colibri::float_to_bf16(all[i]);
        all[i] = dtype == COLIBRI_DTYPE_F16 ? colibri::f16_to_float(bits[i]) : colibri::bf16_to_float(bits[i]);
      }
      L.stored16.push_back(std::move(bits));
    }
    Expert x;
    x.gate.assign(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(DF));
    x.up.assign(all.begin() + static_cast<std::ptrdiff_t>(DF), all.begin() + static_cast<std::ptrdiff_t>(2 * DF));
    x.down.assign(all.begin() + static_cast<std::ptrdiff_t>(2 * DF), all.end());
    L.experts.push_back(std::move(x));
  }
  return L;
}

// colibri_open_memory on the layer's stored weights; *out is the model or
// null, the status is returned.
colibri_status_t open_layer(const Layer& L, const colibri_open_options_t& o, colibri_model_t** out) {
  const size_t DF = static_cast<size_t>(L.D) * static_cast<size_t>(L.F);
  const size_t elem = L.dtype == COLIBRI_DTYPE_F32 ? 4 : 2;
  std::vector<colibri_expert_weights_t> ew(static_cast<size_t>(L.E));
  for (int32_t e = 0; e < L.E; ++e) {
    const char* base = L.dtype == COLIBRI_DTYPE_F32
                           ? reinterpret_cast<const char*>(L.stored32[static_cast<size_t>(e)].data())
                           : reinterpret_cast<const char*>(L.stored16[static_cast<size_t>(e)].data());
    ew[static_cast<size_t>(e)] = {base, base + DF * elem, base + 2 * DF * elem, nullptr, nullptr, nullptr};
  }
  colibri_layer_weights_t lw{};
  lw.experts = ew.data();
  colibri_model_desc_t desc;
  colibri_model_desc_default(&desc);
  desc.n_layers = 1;
  desc.n_experts = L.E;
  desc.d_model = L.D;
  desc.d_ff = L.F;
  desc.dtype = L.dtype;
  desc.layers = &lw;
  return colibri_open_memory(&desc, &o, out);
}

double silu(double g) { return g / (1.0 + std::exp(-g)); }

// The layer in float64 on the stored weights and the caller's activations.
std::vector<double> exact_layer(const Layer& L, int32_t T, int32_t kk, const std::vector<float>& x,
                                const std::vector<int32_t>& ids, const std::vector<float>& w) {
  const size_t D = static_cast<size_t>(L.D), F = static_cast<size_t>(L.F);
  std::vector<double> y(static_cast<size_t>(T) * D, 0.0), h(F);
  for (int32_t t = 0; t < T; ++t) {
    const float* xt = x.data() + static_cast<size_t>(t) * D;
    for (int32_t j = 0; j < kk; ++j) {
      const size_t slot = static_cast<size_t>(t) * static_cast<size_t>(kk) + static_cast<size_t>(j);
      const Expert& ex = L.experts[static_cast<size_t>(ids[slot])];
      for (size_t f = 0; f < F; ++f) {
        double g = 0.0, u = 0.0;
        for (size_t d = 0; d < D; ++d) {
          g += static_cast<double>(ex.gate[f * D + d]) * xt[d];
          u += static_cast<double>(ex.up[f * D + d]) * xt[d];
        }
        h[f] = silu(g) * u;
      }
      for (size_t d = 0; d < D; ++d) {
        double acc = 0.0;
        for (size_t f = 0; f < F; ++f) acc += static_cast<double>(ex.down[d * F + f]) * h[f];
        y[static_cast<size_t>(t) * D + d] += static_cast<double>(w[slot]) * acc;
      }
    }
  }
  return y;
}

// What PyTorch computes for the same layer in bf16 (the model and its
// activations in torch.bfloat16, a Hugging Face sparse MoE block):
// activations rounded to bf16; each matmul accumulated in float32 and its
// output rounded to bf16; silu's output and silu(g) * up rounded to bf16;
// the routing weights cast to bf16, each expert's output times its weight
// rounded to bf16 and added into the bf16 result expert by expert (index_add_
// in ascending expert order). Weights not stored in bf16 are rounded to it
// (model.to(torch.bfloat16)).
std::vector<float> pytorch_bf16_layer(const Layer& L, int32_t T, int32_t kk, const std::vector<float>& x,
                                       const std::vector<int32_t>& ids, const std::vector<float>& w) {
  const size_t D = static_cast<size_t>(L.D), F = static_cast<size_t>(L.F);
  std::vector<float> y(static_cast<size_t>(T) * D, 0.0f), xb(D), h(F);
  for (int32_t e = 0; e < L.E; ++e) {
    const Expert& ex = L.experts[static_cast<size_t>(e)];
    for (int32_t t = 0; t < T; ++t) {
      for (int32_t j = 0; j < kk; ++j) {
        const size_t slot = static_cast<size_t>(t) * static_cast<size_t>(kk) + static_cast<size_t>(j);
        if (ids[slot] != e) continue;
        for (size_t d = 0; d < D; ++d) xb[d] = round_bf16(x[static_cast<size_t>(t) * D + d]);
        for (size_t f = 0; f < F; ++f) {
          float g = 0.0f, u = 0.0f;
          for (size_t d = 0; d < D; ++d) {
            g += round_bf16(ex.gate[f * D + d]) * xb[d];
            u += round_bf16(ex.up[f * D + d]) * xb[d];
          }
          const float gb = round_bf16(g), ub = round_bf16(u);
          h[f] = round_bf16(round_bf16(static_cast<float>(silu(gb))) * ub);
        }
        const float wb = round_bf16(w[slot]);
        for (size_t d = 0; d < D; ++d) {
          float acc = 0.0f;
          for (size_t f = 0; f < F; ++f) acc += round_bf16(ex.down[d * F + f]) * h[f];
          float& out = y[static_cast<size_t>(t) * D + d];
          out = round_bf16(out + round_bf16(round_bf16(acc) * wb));
        }
      }
    }
  }
  return y;
}

bool rounds_activations(const k::KernelTable& t) {
  return std::strcmp(t.name, "amx-bf16") == 0 || std::strcmp(t.name, "avx512-bf16") == 0;
}

struct Worst {
  double error = 0.0;       // worst relative L2 error seen
  double allowed = 0.0;     // the contract of that case
  double worst_ratio = 0.0; // max error / allowed
  int cases = 0;
};

enum class Option { kDefault, kExactPrefill, kBf16Compute };
const char* option_name(Option o) {
  switch (o) {
    case Option::kDefault: return "default";
    case Option::kExactPrefill: return "exact_prefill";
    case Option::kBf16Compute: return "bf16_compute";
  }
  return "?";
}

k::PrefillPrecision option_precision(Option o) {
  switch (o) {
    case Option::kDefault: return k::PrefillPrecision::kDefault;
    case Option::kExactPrefill: return k::PrefillPrecision::kExact;
    case Option::kBf16Compute: return k::PrefillPrecision::kBf16;
  }
  return k::PrefillPrecision::kDefault;
}

k::WeightType weight_type(colibri_dtype_t d) {
  return d == COLIBRI_DTYPE_F32 ? k::WeightType::kF32 : d == COLIBRI_DTYPE_F16 ? k::WeightType::kF16 : k::WeightType::kBF16;
}

TEST(PrecisionContract, EveryTableOnTinyRandomLayers) {
  // Layers: kTiny with d_model, d_ff in 1..40, then kLarge from
  // kBf16RoundingMinDim up (where the rounding tables run). More with
  // COLIBRI_PRECISION_LAYERS (that many of each).
  const char* layers_env = std::getenv("COLIBRI_PRECISION_LAYERS");
  const int kTiny = layers_env != nullptr ? std::atoi(layers_env) : 150;
  const int kLarge = layers_env != nullptr ? kTiny : 90;
  const int kLayers = kTiny + kLarge;
  const k::Isa isa = k::default_isa();
  // decode is chosen per weight type below
  // Tokens per call. T=1 and T=3 are routed at random (decode); the others
  // send every token to the same k experts, so each active expert gets T.
  const int32_t kTokenCounts[] = {1, 3, 4, 5, 8, 64, 130};
  std::map<std::string, Worst> by_table;  // "dtype option table" -> worst case
  int failures = 0;
  std::mt19937 rng(20261201);
  for (int c = 0; c < kLayers; ++c) {
    const colibri_dtype_t dtype = static_cast<colibri_dtype_t>(c % 3);  // f32, f16, bf16
    const int32_t lo = c < kTiny ? 1 : k::kBf16RoundingMinDim;
    std::uniform_int_distribution<int32_t> size(lo, lo + 39), experts(1, 4);
    const int32_t E = experts(rng), D = size(rng), F = size(rng);
    const int32_t kk = std::uniform_int_distribution<int32_t>(1, std::min(E, 3))(rng);
    const Layer L = random_layer(rng, E, D, F, dtype);
    for (const Option option : {Option::kDefault, Option::kExactPrefill, Option::kBf16Compute}) {
      colibri_open_options_t o;
      colibri_open_options_default(&o);
      o.n_threads = 1 + c % 2;
      o.lock_memory = 0;
      o.huge_pages = 0;
      o.exact_prefill = option == Option::kExactPrefill ? 1 : 0;
      o.bf16_compute = option == Option::kBf16Compute ? 1 : 0;
      colibri_model_t* m = nullptr;
      ASSERT_EQ(open_layer(L, o, &m), COLIBRI_OK) << colibri_last_error();
      const k::KernelPlan plan = k::plan_kernels(isa, k::make_expert_shape(D, F, weight_type(dtype)), option_precision(option));
      const k::KernelTable& decode = *plan.decode;
      const k::PrefillTiers& tiers = plan.prefill;
      for (const int32_t T : kTokenCounts) {
        std::uniform_real_distribution<float> u(-1.0f, 1.0f), wd(-1.0f, 2.0f);
        std::vector<float> x(static_cast<size_t>(T) * static_cast<size_t>(D));
        for (float& v : x) v = u(rng);
        std::vector<int32_t> ids(static_cast<size_t>(T) * static_cast<size_t>(kk));
        std::vector<float> w(ids.size());
        std::vector<int32_t> perm(static_cast<size_t>(E));
        for (int32_t e = 0; e < E; ++e) perm[static_cast<size_t>(e)] = e;
        std::shuffle(perm.begin(), perm.end(), rng);
        for (int32_t t = 0; t < T; ++t) {
          if (T <= 3) std::shuffle(perm.begin(), perm.end(), rng);
          for (int32_t j = 0; j < kk; ++j) {
            ids[static_cast<size_t>(t * kk + j)] = perm[static_cast<size_t>(j)];
            w[static_cast<size_t>(t * kk + j)] = wd(rng);
          }
        }
        std::vector<int32_t> per_expert(static_cast<size_t>(E), 0);
        for (const int32_t id : ids) ++per_expert[static_cast<size_t>(id)];
        bool rounded = false;
        std::string tables;
        for (int32_t e = 0; e < E; ++e) {
          if (per_expert[static_cast<size_t>(e)] == 0) continue;
          const k::KernelTable& t = tiers.pick(per_expert[static_cast<size_t>(e)], decode);
          rounded = rounded || rounds_activations(t);
          if (tables.find(t.name) == std::string::npos) tables += std::string(tables.empty() ? "" : "+") + t.name;
        }
        std::vector<float> y(x.size(), std::numeric_limits<float>::quiet_NaN());
        colibri_infer_t r;
        colibri_infer_default(&r);
        r.n_tokens = T;
        r.input = x.data();
        r.output = y.data();
        r.top_k = kk;
        r.expert_ids = ids.data();
        r.expert_weights = w.data();
        ASSERT_EQ(colibri_infer(m, &r), COLIBRI_OK) << colibri_last_error();
        const std::vector<double> exact = exact_layer(L, T, kk, x, ids, w);
        const double err = colibri::relative_l2(y.data(), exact);
        double allowed = dtype == COLIBRI_DTYPE_F32 ? 1e-5 : 5e-3;
        double pytorch = 0.0;
        if (rounded) {
          pytorch = colibri::relative_l2(pytorch_bf16_layer(L, T, kk, x, ids, w).data(), exact);
          allowed = std::max(5e-3, pytorch);
        }
        const std::string key = std::string(colibri_dtype_name(dtype)) + " " + option_name(option) + " " + tables;
        Worst& wst = by_table[key];
        ++wst.cases;
        const double ratio = err / allowed;
        if (ratio > wst.worst_ratio) wst = {err, allowed, ratio, wst.cases};
        if (err > allowed) {
          if (++failures <= 20) {
            ADD_FAILURE() << key << ": E=" << E << " k=" << kk << " D=" << D << " F=" << F << " T=" << T
                          << " threads=" << o.n_threads << ": relative L2 error " << err << " > " << allowed
                          << (rounded ? " (max of 5e-3 and PyTorch-style bf16 " + std::to_string(pytorch) + ")"
                                      : std::string());
          }
        }
      }
      colibri_free(m);
    }
  }
  std::printf("ISA level %s: %zu (dtype, option, tables) groups\n", k::isa_name(isa), by_table.size());
  for (const auto& [key, wst] : by_table) {
    std::printf("  %-48s %5d calls, worst %.3g of allowed %.3g\n", key.c_str(), wst.cases, wst.error, wst.allowed);
  }
  EXPECT_EQ(failures, 0) << failures << " calls over their contract";
}

// The two precision options contradict each other: refused, naming both.
TEST(PrecisionContract, ExactPrefillWithBf16ComputeIsRefused) {
  std::mt19937 rng(3);
  const Layer L = random_layer(rng, 2, 8, 8, COLIBRI_DTYPE_BF16);
  colibri_open_options_t o;
  colibri_open_options_default(&o);
  o.exact_prefill = 1;
  o.bf16_compute = 1;
  o.lock_memory = 0;
  colibri_model_t* m = nullptr;
  EXPECT_EQ(open_layer(L, o, &m), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(m, nullptr);
  const std::string error = colibri_last_error();
  EXPECT_NE(error.find("bf16_compute"), std::string::npos) << error;
  EXPECT_NE(error.find("exact_prefill"), std::string::npos) << error;
}

}  // namespace
