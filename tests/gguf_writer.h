// A small GGUF writer for tests: builds a file's bytes field by field, so
// tests can write valid files of any shape and then break one field.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace colibri_test {

class GgufBytes {
 public:
  std::vector<uint8_t> bytes;

  template <typename T>
  void put(T v) {
    const size_t at = bytes.size();
    bytes.resize(at + sizeof(T));
    std::memcpy(bytes.data() + at, &v, sizeof(T));
  }
  void put_string(const std::string& s) {
    put<uint64_t>(s.size());
    bytes.insert(bytes.end(), s.begin(), s.end());
  }
  void pad_to(size_t alignment) {
    while (bytes.size() % alignment != 0) bytes.push_back(0);
  }
};

// A GGUF file built from metadata and tensors; tensor data is laid out in
// order, each at the next multiple of the alignment.
struct GgufSpec {
  struct Kv {
    std::string key;
    uint32_t type;  // GgufType value
    std::vector<uint8_t> value;  // the encoded value (after the type)
  };
  struct Tensor {
    std::string name;
    std::vector<uint64_t> ne;
    uint32_t type;  // ggml type
    std::vector<uint8_t> data;
  };
  uint32_t version = 3;
  uint32_t alignment = 32;
  std::vector<Kv> kvs;
  std::vector<Tensor> tensors;

  void add_u32(const std::string& key, uint32_t v) { add_scalar(key, 4, v); }
  void add_f32(const std::string& key, float v) { add_scalar(key, 6, v); }
  void add_bool(const std::string& key, bool v) { add_scalar(key, 7, static_cast<uint8_t>(v ? 1 : 0)); }
  void add_string(const std::string& key, const std::string& v) {
    GgufBytes b;
    b.put_string(v);
    kvs.push_back({key, 8, b.bytes});
  }
  template <typename T>
  void add_scalar(const std::string& key, uint32_t type, T v) {
    GgufBytes b;
    b.put(v);
    kvs.push_back({key, type, b.bytes});
  }
  void add_tensor(const std::string& name, std::vector<uint64_t> ne, uint32_t type, std::vector<uint8_t> data) {
    tensors.push_back({name, std::move(ne), type, std::move(data)});
  }

  std::vector<uint8_t> build() const {
    GgufBytes b;
    b.bytes = {'G', 'G', 'U', 'F'};
    b.put<uint32_t>(version);
    b.put<uint64_t>(tensors.size());
    b.put<uint64_t>(kvs.size());
    for (const Kv& kv : kvs) {
      b.put_string(kv.key);
      b.put<uint32_t>(kv.type);
      b.bytes.insert(b.bytes.end(), kv.value.begin(), kv.value.end());
    }
    uint64_t offset = 0;
    for (const Tensor& t : tensors) {
      b.put_string(t.name);
      b.put<uint32_t>(static_cast<uint32_t>(t.ne.size()));
      for (uint64_t d : t.ne) b.put<uint64_t>(d);
      b.put<uint32_t>(t.type);
      b.put<uint64_t>(offset);
      offset += (t.data.size() + alignment - 1) / alignment * alignment;
    }
    b.pad_to(alignment);
    for (const Tensor& t : tensors) {
      b.bytes.insert(b.bytes.end(), t.data.begin(), t.data.end());
      b.pad_to(alignment);
    }
    return b.bytes;
  }
};

}  // namespace colibri_test
