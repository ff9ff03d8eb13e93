// Header-only C++ wrapper over colibri.h: RAII handles, exceptions carrying
// the library's status and message. Nothing here is compiled into the library.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

#include "colibri.h"

namespace colibri_cpp {

class Error : public std::runtime_error {
 public:
  Error(colibri_status_t status, const std::string& message)
      : std::runtime_error(message), status_(status) {}
  colibri_status_t status() const noexcept { return status_; }

 private:
  colibri_status_t status_;
};

inline void check(colibri_status_t status) {
  if (status != COLIBRI_OK) throw Error(status, colibri_last_error());
}

inline colibri_open_options_t default_open_options() {
  colibri_open_options_t o;
  colibri_open_options_default(&o);
  return o;
}

class Routing {
 public:
  // Loads routing.bin or .route text (n_experts needed for text).
  static Routing load(const std::string& path, int32_t n_experts = 0, bool q4_weights = false) {
    colibri_routing_t* r = nullptr;
    check(colibri_routing_load(path.c_str(), n_experts, q4_weights ? 1 : 0, &r));
    return Routing(r);
  }
  Routing(Routing&& o) noexcept : r_(std::exchange(o.r_, nullptr)) {}
  Routing& operator=(Routing&& o) noexcept {
    if (this != &o) {
      colibri_routing_free(r_);
      r_ = std::exchange(o.r_, nullptr);
    }
    return *this;
  }
  Routing(const Routing&) = delete;
  Routing& operator=(const Routing&) = delete;
  ~Routing() { colibri_routing_free(r_); }

  int32_t n_tokens() const { return colibri_routing_n_tokens(r_); }
  int32_t top_k() const { return colibri_routing_top_k(r_); }
  const int32_t* ids() const { return colibri_routing_expert_ids(r_); }
  const float* weights() const { return colibri_routing_expert_weights(r_); }

 private:
  explicit Routing(colibri_routing_t* r) : r_(r) {}
  colibri_routing_t* r_;
};

class Model {
 public:
  explicit Model(const std::string& dir, const colibri_open_options_t& options = default_open_options()) {
    check(colibri_open(dir.c_str(), &options, &m_));
    warning_ = colibri_last_warning();
  }
  // From caller buffers (copied; see colibri_open_memory).
  explicit Model(const colibri_model_desc_t& desc, const colibri_open_options_t& options = default_open_options()) {
    check(colibri_open_memory(&desc, &options, &m_));
    warning_ = colibri_last_warning();
  }
  Model(Model&& o) noexcept : m_(std::exchange(o.m_, nullptr)), warning_(std::move(o.warning_)) {}
  Model& operator=(Model&& o) noexcept {
    if (this != &o) {
      colibri_free(m_);
      m_ = std::exchange(o.m_, nullptr);
      warning_ = std::move(o.warning_);
    }
    return *this;
  }
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;
  ~Model() { colibri_free(m_); }

  colibri_model_info_t info() const {
    colibri_model_info_t i;
    check(colibri_model_info(m_, &i));
    return i;
  }
  colibri_stats_t stats() const {
    colibri_stats_t s;
    check(colibri_stats(m_, &s));
    return s;
  }
  // Non-fatal notice from opening (e.g. mlock refused), "" if none.
  const std::string& warning() const { return warning_; }

  // output[T][d_model] = MoE layer of input[T][d_model] with explicit routing.
  void infer(int32_t layer, int32_t n_tokens, const float* input, float* output, int32_t top_k,
             const int32_t* ids, const float* weights, int32_t n_threads = 0) {
    colibri_infer_t r;
    colibri_infer_default(&r);
    r.layer = layer;
    r.n_tokens = n_tokens;
    r.input = input;
    r.output = output;
    r.top_k = top_k;
    r.expert_ids = ids;
    r.expert_weights = weights;
    r.n_threads = n_threads;
    check(colibri_infer(m_, &r));
  }

  void infer(int32_t layer, const Routing& routing, const float* input, float* output) {
    infer(layer, routing.n_tokens(), input, output, routing.top_k(), routing.ids(), routing.weights());
  }

  // The model's built-in router chooses (the model must have one).
  void infer(int32_t layer, int32_t n_tokens, const float* input, float* output, int32_t n_threads = 0) {
    infer(layer, n_tokens, input, output, 0, nullptr, nullptr, n_threads);
  }

  // The built-in router's choice alone: ids/weights [T][info().router_top_k].
  void route(int32_t layer, int32_t n_tokens, const float* input, int32_t* ids, float* weights) {
    check(colibri_route(m_, layer, n_tokens, input, ids, weights));
  }

  colibri_model_t* get() const { return m_; }

 private:
  colibri_model_t* m_ = nullptr;
  std::string warning_;
};

}  // namespace colibri_cpp
