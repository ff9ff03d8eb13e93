#include "io/verify.h"

#include <chrono>

#include "io/checksum.h"
#include "io/manifest.h"
#include "io/mapped_file.h"
#include "util/error.h"

namespace colibri {

void verify_model_dir(const std::string& dir, const std::function<void(const FileReport&)>& on_file) {
  const Manifest m = load_manifest(dir);
  Status first_status = Status::kOk;
  std::string first_problem;
  {
    FileReport r;
    r.file = kManifestName;
    try {
      const auto t0 = std::chrono::steady_clock::now();
      r.has_checksum = verify_manifest_checksum(dir);
      r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      r.ok = true;
    } catch (const Error& err) {
      r.problem = err.what();
      first_status = err.status();
      first_problem = r.problem;
    }
    if (on_file) on_file(r);
  }
  m.for_each_weight_file([&](const std::string& name, uint64_t expected, int32_t /*layer*/) {
    FileReport r;
    r.file = name;
    const std::string path = dir + "/" + r.file;
    Status status = Status::kOk;
    try {
      MappedFile f(path);
      r.bytes = f.size();
      if (f.size() != expected) {
        status = Status::kFormat;
        r.problem = path + ": " + (f.size() < expected ? "truncated" : "oversized") + ": " +
                    std::to_string(f.size()) + " bytes, expected " + std::to_string(expected);
      } else if (auto it = m.checksums.find(r.file); it != m.checksums.end()) {
        r.has_checksum = true;
        const auto t0 = std::chrono::steady_clock::now();
        const uint64_t actual = xxh64(f.data(), f.size());
        r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (actual != it->second) {
          status = Status::kChecksum;
          r.problem = path + ": checksum mismatch: manifest says " + format_checksum(it->second) +
                      ", file is " + format_checksum(actual);
        }
      }
    } catch (const Error& err) {
      status = err.status();
      r.problem = err.what();
    }
    r.ok = status == Status::kOk;
    if (!r.ok && first_status == Status::kOk) {
      first_status = status;
      first_problem = r.problem;
    }
    if (on_file) on_file(r);
  });
  if (first_status != Status::kOk) fail(first_status, first_problem);
}

}  // namespace colibri
