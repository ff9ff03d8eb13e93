// colibri_io_probe: random whole-file reads (a model directory's expert
// files) with O_DIRECT, several in flight, two ways: a pool of threads each
// doing blocking pread (what src/io/expert_reader.cpp does), and one thread
// keeping a queue of reads in flight through io_uring (liburing). It answers
// which of the two keeps this machine's disk busier at the same number of
// reads in flight (docs/CACHE.md).
//
//   colibri_io_probe --seconds 3 --depths 1,2,4,8 [--chunk BYTES] [--repeat N] FILE...
//
// --repeat runs the whole sweep N times, the two engines alternating, so
// the host's swings in bandwidth fall on both (compare medians).
// --chunk splits each file into reads of at most that many bytes (all of a
// file's pieces are queued together, as one expert's parts would be); by
// default one read per file. Output: one JSON line per (engine, depth).
#include <fcntl.h>
#include <liburing.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

struct File {
  std::string path;
  int fd = -1;
  size_t size = 0;  // whole 4 KiB blocks: O_DIRECT reads whole blocks
};

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "colibri_io_probe: %s\n", what.c_str());
  std::exit(2);
}

void* aligned(size_t bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, 4096, bytes) != 0) die("out of memory");
  std::memset(p, 1, bytes);
  return p;
}

struct Result {
  double seconds = 0;
  uint64_t bytes = 0, requests = 0;
};

// `depth` threads, each reading whole random files with pread in chunks.
Result run_pread(const std::vector<File>& files, int depth, double seconds, size_t chunk) {
  std::atomic<uint64_t> bytes{0}, requests{0};
  std::atomic<bool> stop{false};
  std::vector<std::thread> team;
  const double t0 = now_s();
  for (int t = 0; t < depth; ++t) {
    team.emplace_back([&, t] {
      std::mt19937_64 rng(1234 + static_cast<uint64_t>(t));
      size_t largest = 0;
      for (const File& f : files) largest = std::max(largest, f.size);
      auto* buf = static_cast<uint8_t*>(aligned(largest));
      while (!stop.load(std::memory_order_relaxed)) {
        const File& f = files[rng() % files.size()];
        for (size_t off = 0; off < f.size; off += chunk) {
          const size_t n = std::min(chunk, f.size - off);
          const ssize_t got = pread(f.fd, buf + off, n, static_cast<off_t>(off));
          if (got != static_cast<ssize_t>(n)) die("pread of " + f.path + " failed: " + std::strerror(errno));
        }
        bytes += f.size;
        ++requests;
      }
      std::free(buf);
    });
  }
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  stop = true;
  for (auto& th : team) th.join();
  return {now_s() - t0, bytes.load(), requests.load()};
}

// One thread, `depth` files in flight through one io_uring; a file's
// chunks are submitted together and the file counts when all are back.
Result run_uring(const std::vector<File>& files, int depth, double seconds, size_t chunk) {
  size_t largest = 0, max_chunks = 0;
  for (const File& f : files) {
    largest = std::max(largest, f.size);
    max_chunks = std::max(max_chunks, (f.size + chunk - 1) / chunk);
  }
  const unsigned entries = static_cast<unsigned>(std::min<size_t>(4096, static_cast<size_t>(depth) * max_chunks));
  io_uring ring;
  if (const int rc = io_uring_queue_init(entries, &ring, 0); rc < 0)
    die(std::string("io_uring_queue_init: ") + std::strerror(-rc));
  struct Slot {
    uint8_t* buf = nullptr;
    const File* file = nullptr;
    size_t pending = 0;
  };
  std::vector<Slot> slots(static_cast<size_t>(depth));
  std::mt19937_64 rng(99);
  uint64_t bytes = 0, requests = 0;
  auto issue = [&](size_t s) {
    Slot& slot = slots[s];
    slot.file = &files[rng() % files.size()];
    slot.pending = 0;
    for (size_t off = 0; off < slot.file->size; off += chunk) {
      io_uring_sqe* sqe = io_uring_get_sqe(&ring);
      if (!sqe) die("io_uring: submission queue full");
      const size_t n = std::min(chunk, slot.file->size - off);
      io_uring_prep_read(sqe, slot.file->fd, slot.buf + off, static_cast<unsigned>(n), off);
      io_uring_sqe_set_data64(sqe, s);
      ++slot.pending;
    }
  };
  for (size_t s = 0; s < slots.size(); ++s) {
    slots[s].buf = static_cast<uint8_t*>(aligned(largest));
    issue(s);
  }
  const double t0 = now_s();
  io_uring_submit(&ring);
  bool stopping = false;
  size_t busy = slots.size();
  while (busy > 0) {
    io_uring_cqe* cqe = nullptr;
    if (const int rc = io_uring_wait_cqe(&ring, &cqe); rc < 0) die(std::string("io_uring_wait_cqe: ") + std::strerror(-rc));
    const size_t s = io_uring_cqe_get_data64(cqe);
    if (cqe->res < 0) die("io_uring read of " + slots[s].file->path + ": " + std::strerror(-cqe->res));
    io_uring_cqe_seen(&ring, cqe);
    if (--slots[s].pending > 0) continue;
    bytes += slots[s].file->size;
    ++requests;
    if (!stopping && now_s() - t0 >= seconds) stopping = true;
    if (stopping) {
      --busy;
    } else {
      issue(s);
      io_uring_submit(&ring);
    }
  }
  const double dt = now_s() - t0;
  io_uring_queue_exit(&ring);
  for (Slot& s : slots) std::free(s.buf);
  return {dt, bytes, requests};
}

}  // namespace

int main(int argc, char** argv) {
  double seconds = 3;
  std::vector<int> depths = {1, 2, 4, 8};
  size_t chunk = 0;
  int repeat = 1;
  std::vector<File> files;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) die(a + " needs a value");
      return argv[++i];
    };
    if (a == "--seconds") {
      seconds = std::atof(value().c_str());
    } else if (a == "--repeat") {
      repeat = std::max(1, std::atoi(value().c_str()));
    } else if (a == "--chunk") {
      chunk = std::strtoull(value().c_str(), nullptr, 10);
    } else if (a == "--depths") {
      depths.clear();
      const std::string v = value();
      for (size_t p = 0; p < v.size();) {
        const size_t q = std::min(v.find(',', p), v.size());
        depths.push_back(std::atoi(v.substr(p, q - p).c_str()));
        p = q + 1;
      }
    } else if (a.rfind("--", 0) == 0) {
      die("unknown option " + a + " (usage: --seconds S --depths 1,2,4 [--chunk BYTES] FILE...)");
    } else {
      File f;
      f.path = a;
      f.fd = open(a.c_str(), O_RDONLY | O_DIRECT);
      if (f.fd < 0) die("cannot open " + a + " with O_DIRECT: " + std::strerror(errno));
      struct stat st {};
      fstat(f.fd, &st);
      f.size = static_cast<size_t>(st.st_size) / 4096 * 4096;
      if (f.size == 0) die(a + " is smaller than one 4 KiB block");
      files.push_back(f);
    }
  }
  if (files.empty()) die("no files given");
  for (int d : depths) {
    if (d < 1 || d > 256) die("depths are 1 .. 256");
  }
  // Each read in flight has a buffer of the largest file (it reads whole
  // files, one expert's each); a whole model given by mistake would take
  // depth times its size in memory.
  constexpr size_t kMaxFileBytes = size_t{1} << 30;
  for (const File& f : files) {
    if (f.size > kMaxFileBytes) {
      die(f.path + " is " + std::to_string(f.size >> 20) +
          " MiB; the probe reads whole files, one expert's each: give expert files of at most 1 GiB");
    }
  }
  for (int rep = 0; rep < repeat; ++rep) {
  for (int d : depths) {
    for (const char* engine : {"pread", "io_uring"}) {
      size_t c = chunk;
      if (c == 0) {
        for (const File& f : files) c = std::max(c, f.size);
      }
      c = std::max<size_t>(4096, c / 4096 * 4096);
      const Result r = std::strcmp(engine, "pread") == 0 ? run_pread(files, d, seconds, c) : run_uring(files, d, seconds, c);
      std::printf("{\"engine\":\"%s\",\"depth\":%d,\"repeat\":%d,\"chunk_bytes\":%zu,\"seconds\":%.3f,\"requests\":%llu,"
                  "\"GBps\":%.4f,\"request_bytes\":%zu}\n",
                  engine, d, rep, c, r.seconds, static_cast<unsigned long long>(r.requests),
                  static_cast<double>(r.bytes) / r.seconds / 1e9, files[0].size);
      std::fflush(stdout);
    }
  }
  }
  for (File& f : files) close(f.fd);
  return 0;
}
