// Attention over a KV cache (moe/attention.h and colibri_attention) against
// float64 on random data: grouped-query heads, decode and several query
// tokens, causal, windowed and explicit masks, sinks, strided and
// broadcast inputs, dimensions off the vector widths, every
// instruction-set level this CPU has and 1 or 2 threads, outputs poisoned
// with NaN; then the C ABI's refusals; colibri_rope likewise.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "colibri.h"
#include "kernels/attn.h"
#include "kernels/kernels.h"
#include "moe/attention.h"
#include "runtime/thread_pool.h"

namespace {

namespace kernels = colibri::kernels;

struct Case {
  int32_t batch, heads, kv_heads, q_len, kv_len, qk_dim, v_dim;
  int32_t window = 0;
  bool sinks = false;
  bool mask = false;
  bool q_token_major = false;  // q laid out [batch][token][head][dim], as a projection writes it
  bool additive = false;       // the mask as an eager attention's floats (with a random bias where visible)
  int32_t qk2_dim = 0;         // a key in two parts (DeepSeek's latent and rope parts)
};

struct Data {
  std::vector<float> q, k, v, k2, sinks;
  std::vector<uint8_t> mask;
  std::vector<float> additive;
  colibri::AttentionArgs args;
};

Data make(const Case& c, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Data d;
  const auto fill = [&](std::vector<float>* x, size_t n) {
    x->resize(n);
    for (float& e : *x) e = normal(rng);
  };
  const int32_t q_dim = c.qk_dim + c.qk2_dim;
  fill(&d.q, static_cast<size_t>(c.batch) * c.heads * c.q_len * q_dim);
  // Cache rows padded past kv_len, as a preallocated cache holds them.
  const int32_t capacity = c.kv_len + 3;
  fill(&d.k, static_cast<size_t>(c.batch) * c.kv_heads * capacity * c.qk_dim);
  fill(&d.v, static_cast<size_t>(c.batch) * c.kv_heads * capacity * c.v_dim);
  colibri::AttentionArgs& a = d.args;
  a.batch = c.batch;
  a.heads = c.heads;
  a.kv_heads = c.kv_heads;
  a.q_len = c.q_len;
  a.kv_len = c.kv_len;
  a.qk_dim = c.qk_dim;
  a.v_dim = c.v_dim;
  a.q = d.q.data();
  if (c.q_token_major) {
    a.q_stride[0] = static_cast<int64_t>(c.q_len) * c.heads * q_dim;
    a.q_stride[1] = q_dim;
    a.q_stride[2] = static_cast<int64_t>(c.heads) * q_dim;
  } else {
    a.q_stride[0] = static_cast<int64_t>(c.heads) * c.q_len * q_dim;
    a.q_stride[1] = static_cast<int64_t>(c.q_len) * q_dim;
    a.q_stride[2] = q_dim;
  }
  if (c.qk2_dim > 0) {
    fill(&d.k2, static_cast<size_t>(c.batch) * c.kv_heads * capacity * c.qk2_dim);
    a.k2 = d.k2.data();
    a.k2_stride[0] = static_cast<int64_t>(c.kv_heads) * capacity * c.qk2_dim;
    a.k2_stride[1] = static_cast<int64_t>(capacity) * c.qk2_dim;
    a.k2_stride[2] = c.qk2_dim;
    a.qk2_dim = c.qk2_dim;
  }
  a.k = d.k.data();
  a.k_stride[0] = static_cast<int64_t>(c.kv_heads) * capacity * c.qk_dim;
  a.k_stride[1] = static_cast<int64_t>(capacity) * c.qk_dim;
  a.k_stride[2] = c.qk_dim;
  a.v = d.v.data();
  a.v_stride[0] = static_cast<int64_t>(c.kv_heads) * capacity * c.v_dim;
  a.v_stride[1] = static_cast<int64_t>(capacity) * c.v_dim;
  a.v_stride[2] = c.v_dim;
  a.window = c.window;
  a.scale = 1.0f / std::sqrt(static_cast<float>(q_dim));
  if (c.sinks) {
    fill(&d.sinks, static_cast<size_t>(c.heads));
    a.sinks = d.sinks.data();
  }
  if (c.mask) {
    // Causal, with batch 0 left-padded: its first two positions are
    // hidden from every query, as a padded batch's mask hides them.
    d.mask.resize(static_cast<size_t>(c.batch) * c.q_len * c.kv_len);
    for (int32_t b = 0; b < c.batch; ++b) {
      for (int32_t t = 0; t < c.q_len; ++t) {
        for (int32_t s = 0; s < c.kv_len; ++s) {
          const bool causal = s <= c.kv_len - c.q_len + t;
          const bool padded = b == 0 && s < 2;
          d.mask[(static_cast<size_t>(b) * c.q_len + t) * c.kv_len + s] = causal && !padded ? 1 : 0;
        }
      }
    }
    if (c.additive) {
      std::uniform_real_distribution<float> bias(-1.0f, 1.0f);
      for (uint8_t m : d.mask) d.additive.push_back(m ? bias(rng) : std::numeric_limits<float>::lowest());
      a.additive_mask = d.additive.data();
    } else {
      a.mask = d.mask.data();
    }
    a.mask_stride[0] = static_cast<int64_t>(c.q_len) * c.kv_len;
    a.mask_stride[1] = c.kv_len;
    a.mask_stride[2] = 1;
  }
  return d;
}

std::vector<double> reference(const colibri::AttentionArgs& a) {
  std::vector<double> out(static_cast<size_t>(a.batch) * a.q_len * a.heads * a.v_dim, 0.0);
  const int32_t rep = a.heads / a.kv_heads;
  for (int32_t b = 0; b < a.batch; ++b) {
    for (int32_t h = 0; h < a.heads; ++h) {
      const int32_t g = h / rep;
      for (int32_t t = 0; t < a.q_len; ++t) {
        const int64_t p = static_cast<int64_t>(a.kv_len) - a.q_len + t;
        std::vector<double> score(static_cast<size_t>(a.kv_len), -INFINITY);
        double m = a.sinks != nullptr ? a.sinks[h] : -INFINITY;
        for (int32_t s = 0; s < a.kv_len; ++s) {
          bool seen;
          double add = 0.0;
          if (a.mask != nullptr) {
            seen = a.mask[b * a.mask_stride[0] + t * a.mask_stride[1] + s * a.mask_stride[2]] != 0;
          } else if (a.additive_mask != nullptr) {
            add = a.additive_mask[b * a.mask_stride[0] + t * a.mask_stride[1] + s * a.mask_stride[2]];
            seen = true;
          } else {
            seen = s <= p && (a.window == 0 || s > p - a.window);
          }
          if (!seen) continue;
          double dot = 0.0;
          for (int32_t i = 0; i < a.qk_dim; ++i) {
            dot += static_cast<double>(a.q[b * a.q_stride[0] + h * a.q_stride[1] + t * a.q_stride[2] + i]) *
                   a.k[b * a.k_stride[0] + g * a.k_stride[1] + s * a.k_stride[2] + i];
          }
          for (int32_t i = 0; i < a.qk2_dim; ++i) {
            dot += static_cast<double>(
                       a.q[b * a.q_stride[0] + h * a.q_stride[1] + t * a.q_stride[2] + a.qk_dim + i]) *
                   a.k2[b * a.k2_stride[0] + g * a.k2_stride[1] + s * a.k2_stride[2] + i];
          }
          score[static_cast<size_t>(s)] = dot * a.scale + add;
          m = std::max(m, score[static_cast<size_t>(s)]);
        }
        if (m == -INFINITY) continue;
        double sum = a.sinks != nullptr ? std::exp(a.sinks[h] - m) : 0.0;
        for (double& e : score) {
          e = std::exp(e - m);
          sum += e;
        }
        double* o = &out[((static_cast<size_t>(b) * a.q_len + t) * a.heads + h) * a.v_dim];
        for (int32_t s = 0; s < a.kv_len; ++s) {
          for (int32_t i = 0; i < a.v_dim; ++i) {
            o[i] += score[static_cast<size_t>(s)] / sum * a.v[b * a.v_stride[0] + g * a.v_stride[1] + s * a.v_stride[2] + i];
          }
        }
      }
    }
  }
  return out;
}

std::vector<kernels::Isa> levels() {
  std::vector<kernels::Isa> out;
  for (kernels::Isa isa : {kernels::Isa::kScalar, kernels::Isa::kAvx2, kernels::Isa::kAvx512}) {
    if (kernels::isa_supported(isa)) out.push_back(isa);
  }
  return out;
}

TEST(Attention, EveryShapeMaskAndLevelAgainstFloat64) {
  const std::vector<Case> cases = {
      {1, 32, 4, 1, 60, 128, 128},                  // Qwen3-30B-A3B decode
      {1, 64, 8, 1, 37, 64, 64, 0, true},           // gpt-oss decode, sinks
      {1, 64, 8, 1, 37, 64, 64, 16, true},          // gpt-oss's sliding layers
      {2, 8, 2, 5, 9, 24, 16, 0, false, false, true},  // several tokens, dims off the vectors, token-major q
      {2, 6, 6, 4, 11, 33, 17, 3},                  // no grouping, windowed prefill
      {2, 4, 1, 3, 8, 20, 20, 0, false, true},      // explicit mask with left padding
      {1, 16, 16, 1, 1, 192, 128},                  // latent attention's widths, first position
      {1, 4, 2, 7, 7, 7, 5, 0, true, false, true},  // prefill from empty, sinks
      {2, 8, 2, 3, 8, 16, 16, 0, true, true, false, true},  // eager's float mask and sinks (gpt-oss)
      {1, 13, 1, 2, 700, 40, 48, 300},              // 13 heads a kv head (blocks of 8, 4, 1), long, windowed
      {1, 24, 2, 1, 129, 96, 96},                   // GLM-4.5-Air-like: 12 heads a kv head
      {2, 16, 1, 1, 40, 512, 128, 0, false, true, false, false, 64},  // DeepSeek's absorbed decode, padded
      {1, 5, 1, 3, 9, 24, 16, 0, false, false, false, false, 9},      // two-part key, odd widths
  };
  std::mt19937 rng(7);
  const auto pool = colibri::shared_thread_pool(2, false);
  for (const Case& c : cases) {
    Data d = make(c, rng);
    const std::vector<double> want = reference(d.args);
    // Float32 errors scale with the values averaged, not with the average:
    // over hundreds of positions the output shrinks towards 0 while each
    // product's rounding stays that of |v| ~ 1.
    double norm = 0.0;
    for (double w : want) norm += w * w;
    norm = std::sqrt(norm / std::max<size_t>(want.size(), 1));
    double v_norm = 0.0;
    for (float x : d.v) v_norm += static_cast<double>(x) * x;
    norm = std::max(norm, std::sqrt(v_norm / static_cast<double>(d.v.size())));
    for (kernels::Isa isa : levels()) {
      for (colibri::ThreadPool* p : {static_cast<colibri::ThreadPool*>(nullptr), pool.get()}) {
        std::vector<float> out(want.size(), std::numeric_limits<float>::quiet_NaN());
        d.args.out = out.data();
        colibri::attention(d.args, isa, p);
        double worst = 0.0;
        for (size_t i = 0; i < out.size(); ++i) worst = std::max(worst, std::abs(out[i] - want[i]));
        EXPECT_LE(worst, 2e-6 * std::max(norm, 1e-3))
            << "heads " << c.heads << "/" << c.kv_heads << " T=" << c.q_len << " S=" << c.kv_len << " at "
            << kernels::isa_name(isa) << (p ? " on 2 threads" : " on 1");
        if (c.mask) {
          // Batch 0's first query sees positions 2..5 only: still a finite answer.
          for (int32_t i = 0; i < c.v_dim; ++i) EXPECT_TRUE(std::isfinite(out[static_cast<size_t>(i)]));
        }
      }
    }
  }
}

TEST(Attention, ExponentialsWithinFourUlpAtEveryLevel) {
  // The softmax's exp(x - max), x - max in [-100, 0] plus -inf, at lengths
  // off the vector widths; each value against double, and the sum.
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-100.0f, 0.0f);
  for (int32_t n : {1, 7, 16, 37, 1000}) {
    std::vector<float> x(static_cast<size_t>(n));
    for (float& e : x) e = u(rng) + 3.0f;
    x[0] = -std::numeric_limits<float>::infinity();
    if (n > 3) x[3] = 3.0f;  // the maximum itself: exp(0) = 1
    for (kernels::Isa isa : levels()) {
      std::vector<float> y = x;
      const float sum = kernels::attn_kernels(isa).exp_sum(y.data(), n, 3.0f);
      double want_sum = 0.0;
      for (int32_t i = 0; i < n; ++i) {
        const double want = std::exp(static_cast<double>(x[static_cast<size_t>(i)]) - 3.0);
        want_sum += want;
        // 4 ulp relative; values below float's normal range to within its smallest normal.
        EXPECT_NEAR(y[static_cast<size_t>(i)], want, 4 * 6e-8 * want + 1.2e-38)
            << "x - max = " << x[static_cast<size_t>(i)] - 3.0f << " at " << kernels::isa_name(isa);
      }
      EXPECT_NEAR(sum, want_sum, 1e-6 * want_sum) << "n " << n << " at " << kernels::isa_name(isa);
    }
  }
}

TEST(Attention, AQueryThatSeesNothingGetsZeros) {
  std::mt19937 rng(3);
  Case c{1, 2, 1, 2, 4, 8, 8, 0, false, true};
  Data d = make(c, rng);
  std::fill(d.mask.begin(), d.mask.begin() + c.kv_len, 0);  // query 0 sees nothing
  std::vector<float> out(static_cast<size_t>(c.q_len) * c.heads * c.v_dim, std::numeric_limits<float>::quiet_NaN());
  d.args.out = out.data();
  colibri::attention(d.args, kernels::default_isa(), nullptr);
  for (int32_t i = 0; i < c.heads * c.v_dim; ++i) EXPECT_EQ(out[static_cast<size_t>(i)], 0.0f);
  for (size_t i = static_cast<size_t>(c.heads * c.v_dim); i < out.size(); ++i) EXPECT_TRUE(std::isfinite(out[i]));
}

TEST(AttentionAbi, ComputesAndRefusesBadArguments) {
  std::mt19937 rng(11);
  Case c{1, 8, 2, 2, 6, 16, 16, 0, true};
  Data d = make(c, rng);
  const std::vector<double> want = reference(d.args);
  colibri_attention_desc_t desc;
  colibri_attention_desc_default(&desc);
  EXPECT_EQ(desc.scale, 1.0f);
  desc.batch = c.batch;
  desc.heads = c.heads;
  desc.kv_heads = c.kv_heads;
  desc.q_len = c.q_len;
  desc.kv_len = c.kv_len;
  desc.qk_dim = c.qk_dim;
  desc.v_dim = c.v_dim;
  desc.scale = d.args.scale;
  desc.q = d.args.q;
  desc.k = d.args.k;
  desc.v = d.args.v;
  desc.sinks = d.args.sinks;
  for (int i = 0; i < 3; ++i) {
    desc.q_stride[i] = d.args.q_stride[i];
    desc.k_stride[i] = d.args.k_stride[i];
    desc.v_stride[i] = d.args.v_stride[i];
  }
  std::vector<float> out(want.size(), std::numeric_limits<float>::quiet_NaN());
  desc.out = out.data();
  ASSERT_EQ(colibri_attention(&desc), COLIBRI_OK) << colibri_last_error();
  for (size_t i = 0; i < out.size(); ++i) EXPECT_NEAR(out[i], want[i], 1e-5);

  const auto refused = [&](colibri_attention_desc_t bad, const std::string& words) {
    EXPECT_EQ(colibri_attention(&bad), COLIBRI_ERR_INVALID_ARGUMENT) << words;
    EXPECT_NE(std::string(colibri_last_error()).find(words), std::string::npos) << colibri_last_error();
  };
  EXPECT_EQ(colibri_attention(nullptr), COLIBRI_ERR_INVALID_ARGUMENT);
  colibri_attention_desc_t bad = desc;
  bad.kv_heads = 3;
  refused(bad, "not a multiple of kv_heads");
  bad = desc;
  std::vector<uint8_t> mask(static_cast<size_t>(c.q_len * c.kv_len), 1);
  std::vector<float> additive(mask.size(), 0.0f);
  bad.mask = mask.data();
  bad.additive_mask = additive.data();
  refused(bad, "both mask and additive_mask");
  bad = desc;
  bad.q_len = 7;
  refused(bad, "q_len (7) <= kv_len (6)");
  bad = desc;
  bad.k = nullptr;
  refused(bad, "k");
  bad = desc;
  bad.out = nullptr;
  refused(bad, "out");
  bad = desc;
  bad.k_stride[1] = -1;
  refused(bad, "strides");
  bad = desc;
  bad.qk2_dim = 4;  // without k2
  refused(bad, "k2 and qk2_dim");
  bad = desc;
  bad.scale = std::numeric_limits<float>::infinity();
  refused(bad, "scale");
  bad = desc;
  bad.qk_dim = 0;
  refused(bad, "qk_dim");
  bad = desc;
  bad.q_len = 0;
  bad.q = nullptr;
  EXPECT_EQ(colibri_attention(&bad), COLIBRI_OK);  // nothing to compute
}

}  // namespace

namespace {

// colibri_rope against float64, for the three table layouts, strided
// input and output (and in place), outputs poisoned; then its refusals.
TEST(RopeAbi, RotatesAgainstFloat64AndRefusesBadArguments) {
  std::mt19937 rng(13);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int32_t B = 2, H = 3, T = 4, D = 20;
  struct Style {
    int32_t rotary, table;
    bool half;
  };
  for (const Style st : {Style{20, 20, false}, Style{12, 12, false}, Style{20, 10, true}}) {
    // x laid out [B][T][H][D] (as a projection writes it), read as [B][H][T][D].
    std::vector<float> x(static_cast<size_t>(B) * T * H * D);
    for (float& e : x) e = normal(rng);
    std::vector<float> cos(static_cast<size_t>(T) * st.table), sin(cos.size());  // batch-broadcast
    for (size_t i = 0; i < cos.size(); ++i) {
      const float angle = normal(rng) * 3.0f;
      cos[i] = std::cos(angle);
      sin[i] = std::sin(angle);
    }
    colibri_rope_desc_t d{};
    d.batch = B;
    d.heads = H;
    d.tokens = T;
    d.head_dim = D;
    d.rotary_dim = st.rotary;
    d.half_table = st.half ? 1 : 0;
    d.x = x.data();
    d.x_stride[0] = static_cast<int64_t>(T) * H * D;
    d.x_stride[1] = D;
    d.x_stride[2] = static_cast<int64_t>(H) * D;
    std::vector<float> out(x.size(), std::numeric_limits<float>::quiet_NaN());  // [B][H][T][D]
    d.out = out.data();
    d.out_stride[0] = static_cast<int64_t>(H) * T * D;
    d.out_stride[1] = static_cast<int64_t>(T) * D;
    d.out_stride[2] = D;
    d.cos = cos.data();
    d.sin = sin.data();
    d.table_stride[0] = 0;
    d.table_stride[1] = st.table;
    ASSERT_EQ(colibri_rope(&d), COLIBRI_OK) << colibri_last_error();
    const int32_t h = st.rotary / 2;
    for (int32_t b = 0; b < B; ++b) {
      for (int32_t head = 0; head < H; ++head) {
        for (int32_t t = 0; t < T; ++t) {
          const float* xi = &x[static_cast<size_t>(b * d.x_stride[0] + head * d.x_stride[1] + t * d.x_stride[2])];
          const float* yi = &out[static_cast<size_t>(b * d.out_stride[0] + head * d.out_stride[1] + t * d.out_stride[2])];
          const float* c = &cos[static_cast<size_t>(t) * st.table];
          const float* s = &sin[static_cast<size_t>(t) * st.table];
          for (int32_t i = 0; i < D; ++i) {
            double want = xi[i];
            if (i < st.rotary) {
              const int32_t j = st.half ? i % h : i;  // the table entry of dimension i
              const double rotated = i < h ? -static_cast<double>(xi[i + h]) : xi[i - h];
              want = static_cast<double>(xi[i]) * c[j] + rotated * s[j];
            }
            EXPECT_NEAR(yi[i], want, 1e-6 * (std::abs(xi[i]) + std::abs(xi[(i + h) % D]) + 1e-3))
                << "rotary " << st.rotary << (st.half ? " half table" : "") << " dim " << i;
          }
        }
      }
    }
    // In place gives the same bits.
    colibri_rope_desc_t in_place = d;
    std::vector<float> y(x);
    in_place.x = y.data();
    in_place.out = y.data();
    in_place.out_stride[0] = d.x_stride[0];
    in_place.out_stride[1] = d.x_stride[1];
    in_place.out_stride[2] = d.x_stride[2];
    ASSERT_EQ(colibri_rope(&in_place), COLIBRI_OK);
    for (int32_t b = 0; b < B; ++b) {
      for (int32_t head = 0; head < H; ++head) {
        for (int32_t t = 0; t < T; ++t) {
          for (int32_t i = 0; i < D; ++i) {
            ASSERT_EQ(y[static_cast<size_t>(b * d.x_stride[0] + head * d.x_stride[1] + t * d.x_stride[2] + i)],
                      out[static_cast<size_t>(b * d.out_stride[0] + head * d.out_stride[1] + t * d.out_stride[2] + i)]);
          }
        }
      }
    }
  }
  colibri_rope_desc_t bad{};
  EXPECT_EQ(colibri_rope(nullptr), COLIBRI_ERR_INVALID_ARGUMENT);
  bad.batch = bad.heads = bad.tokens = 1;
  bad.head_dim = 8;
  bad.rotary_dim = 5;
  EXPECT_EQ(colibri_rope(&bad), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(colibri_last_error()).find("rotary_dim (5) must be even"), std::string::npos);
  bad.rotary_dim = 8;
  EXPECT_EQ(colibri_rope(&bad), COLIBRI_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(colibri_last_error()).find("x"), std::string::npos);
}

}  // namespace
