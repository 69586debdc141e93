// Raw collective bandwidth at given buffer sizes (bench): the ceiling for the all-gathers and
// reduce-scatters fsdp-train runs inside training. For each size (elements of float32 in a unit's full
// flat buffer) it times, over the same padded buffer the engine uses (shard = ceil(numel / N) elements
// per rank):
//   allgather            MPI_Allgather of one shard per rank
//   reduce_scatter_block MPI_Reduce_scatter_block (MPI_SUM) of the full buffer
//   fsdp_all_gather      fsdp::MpiComm::all_gather (MPI_Allgather + the engine's counters and deadline)
//   fsdp_reduce_scatter  fsdp::MpiComm::reduce_scatter, kAvg: the ring of MPI_Sendrecv the engine uses
//   allreduce            MPI_Allreduce (MPI_SUM) of the full buffer
//   fsdp_all_reduce      fsdp::MpiComm::all_reduce, kAvg: the ring reduce-scatter + MPI_Allgather the
//                        engine runs for NO_SHARD's and the hybrid replicas' gradients
// and, to tell what the engine's all-gathers inside training meet that these do not:
//   fsdp_all_gather_fresh   into an output buffer allocated for the call (posix_memalign, 64-byte
//                           aligned like LibTorch's CPU allocator) and freed after: the engine
//                           allocates a unit's gathered buffer at each gather and frees it at reshard
//   fsdp_all_gather_cold    the reused buffers, with the caches flushed before each call (a 64 MiB
//                           buffer written outside the timed span): the computation evicts them
//   fsdp_all_gather_fresh_cold  both
// Each repetition: MPI_Barrier, the call timed on every rank, the slowest rank's time taken
// (MPI_Allreduce MAX). Warm-up repetitions are dropped; the median of the rest is reported.
// Bandwidth = full buffer bytes (padded numel x 4) / median time, 1 GB/s = 1e9 bytes/s.
//
//   mpirun -np 2 build/bin/fsdp_mpi_bandwidth --sizes 1199882,198272 [--reps 30] [--warmup 5]
//          [--min-seconds 0.2] [--out build/bench/mpi_np2.json]
// Rank 0 prints one line per size and kind and writes the JSON (world_size, sizes: [{numel, padded,
// bytes, kinds: {name: {median_s, min_s, gbps, reps}}}]).
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "fsdp/comm/mpi_comm.hpp"

namespace {

struct Args {
  std::vector<long long> sizes;
  int reps = 30, warmup = 5;
  double min_seconds = 0.2;  // more repetitions for small sizes, until this much time is spent
  std::string out;
};

std::vector<long long> parse_sizes(const std::string& text) {
  std::vector<long long> v;
  std::stringstream ss(text);
  for (std::string item; std::getline(ss, item, ',');) {
    if (item.empty()) continue;
    char* end = nullptr;
    const long long n = std::strtoll(item.c_str(), &end, 10);
    if (end == item.c_str() || *end != '\0' || n < 1) throw std::runtime_error("--sizes: '" + item + "' is not a positive integer");
    v.push_back(n);
  }
  if (v.empty()) throw std::runtime_error("--sizes: no sizes given");
  return v;
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::runtime_error(k + " needs a value");
      return argv[++i];
    };
    if (k == "--sizes")
      a.sizes = parse_sizes(value());
    else if (k == "--reps")
      a.reps = std::max(1, std::atoi(value().c_str()));
    else if (k == "--warmup")
      a.warmup = std::max(0, std::atoi(value().c_str()));
    else if (k == "--min-seconds")
      a.min_seconds = std::atof(value().c_str());
    else if (k == "--out")
      a.out = value();
    else if (k == "-h" || k == "--help") {
      std::printf("usage: fsdp_mpi_bandwidth --sizes N[,N...] [--reps 30] [--warmup 5] [--min-seconds 0.2] [--out FILE.json]\n");
      std::exit(0);
    } else
      throw std::runtime_error("unknown option " + k);
  }
  if (a.sizes.empty()) throw std::runtime_error("--sizes is required");
  return a;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

struct Result {
  double median_s = 0, min_s = 0;
  int reps = 0;
};

// Times `op` (a collective) as the slowest rank's time, after a barrier; warm-up runs dropped.
Result time_collective(const Args& a, const std::function<void()>& op, const std::function<void()>& prepare) {
  std::vector<double> t;
  double spent = 0;
  for (int r = 0; r < a.warmup + a.reps || (spent < a.min_seconds && r < a.warmup + 100 * a.reps); ++r) {
    if (prepare) prepare();  // not timed
    MPI_Barrier(MPI_COMM_WORLD);
    const auto t0 = std::chrono::steady_clock::now();
    op();
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    MPI_Allreduce(MPI_IN_PLACE, &s, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    // Every rank takes the same decision (s and spent are identical after the MAX reduction).
    if (r >= a.warmup) {
      t.push_back(s);
      spent += s;
    }
  }
  return {median(t), *std::min_element(t.begin(), t.end()), static_cast<int>(t.size())};
}

// Writes a buffer larger than the last-level cache, so the collective's buffers start cold.
void flush_caches() {
  static std::vector<char> scratch(64u << 20);
  static char value = 0;
  std::memset(scratch.data(), ++value, scratch.size());
}

}  // namespace

int main(int argc, char** argv) {
  fsdp::MpiEnvironment env(&argc, &argv);
  auto world = fsdp::MpiComm::world();
  const int rank = world.rank(), n = world.size();
  try {
    const Args a = parse(argc, argv);
    std::ostringstream js;
    js.precision(9);
    js << "{\n  \"tool\": \"fsdp_mpi_bandwidth\",\n  \"world_size\": " << n << ",\n  \"dtype\": \"float32\",\n  \"reps\": " << a.reps
       << ",\n  \"warmup\": " << a.warmup << ",\n  \"sizes\": [";
    if (rank == 0)
      std::printf("# fsdp_mpi_bandwidth: %d ranks, float32, median of >= %d reps (slowest rank per rep), GB/s = padded buffer bytes / time\n", n,
                  a.reps);
    for (std::size_t si = 0; si < a.sizes.size(); ++si) {
      const long long numel = a.sizes[si];
      const long long shard = (numel + n - 1) / n, padded = shard * n;
      std::vector<float> full(static_cast<std::size_t>(padded)), part(static_cast<std::size_t>(shard)), out(static_cast<std::size_t>(padded));
      for (std::size_t i = 0; i < full.size(); ++i) full[i] = static_cast<float>((i * 7 + static_cast<std::size_t>(rank)) % 13) * 0.25f;
      for (std::size_t i = 0; i < part.size(); ++i) part[i] = full[i];
      const int s = static_cast<int>(shard), p = static_cast<int>(padded);
      std::vector<std::pair<std::string, std::function<void()>>> kinds;
      kinds.emplace_back("allgather", [&] { MPI_Allgather(part.data(), s, MPI_FLOAT, out.data(), s, MPI_FLOAT, MPI_COMM_WORLD); });
      kinds.emplace_back("reduce_scatter_block", [&] { MPI_Reduce_scatter_block(full.data(), part.data(), s, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD); });
      kinds.emplace_back("fsdp_all_gather", [&] { world.all_gather(part.data(), out.data(), shard, fsdp::DType::kFloat32); });
      kinds.emplace_back("fsdp_reduce_scatter",
                         [&] { world.reduce_scatter(full.data(), part.data(), shard, fsdp::DType::kFloat32, fsdp::ReduceOp::kAvg); });
      kinds.emplace_back("allreduce", [&] { MPI_Allreduce(full.data(), out.data(), p, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD); });
      kinds.emplace_back("fsdp_all_reduce", [&] { world.all_reduce(full.data(), out.data(), padded, fsdp::DType::kFloat32, fsdp::ReduceOp::kAvg); });
      auto gather_fresh = [&] {
        void* fresh = nullptr;
        if (posix_memalign(&fresh, 64, static_cast<std::size_t>(padded) * sizeof(float)) != 0) throw std::runtime_error("out of memory");
        world.all_gather(part.data(), fresh, shard, fsdp::DType::kFloat32);
        std::free(fresh);
      };
      kinds.emplace_back("fsdp_all_gather_fresh", gather_fresh);
      kinds.emplace_back("fsdp_all_gather_cold", [&] { world.all_gather(part.data(), out.data(), shard, fsdp::DType::kFloat32); });
      kinds.emplace_back("fsdp_all_gather_fresh_cold", gather_fresh);
      const double bytes = static_cast<double>(padded) * 4.0;
      js << (si ? "," : "") << "\n    {\"numel\": " << numel << ", \"padded\": " << padded << ", \"bytes\": " << padded * 4 << ", \"kinds\": {";
      for (std::size_t k = 0; k < kinds.size(); ++k) {
        const bool cold = kinds[k].first.ends_with("_cold");
        const auto r = time_collective(a, kinds[k].second, cold ? std::function<void()>(flush_caches) : std::function<void()>());
        const double gbps = bytes / r.median_s / 1e9;
        if (rank == 0) {
          std::printf("numel %10lld (%8.3f MB)  %-21s median %10.6f s  min %10.6f s  %7.3f GB/s  (%d reps)\n", numel, bytes / 1e6,
                      kinds[k].first.c_str(), r.median_s, r.min_s, gbps, r.reps);
          std::fflush(stdout);
        }
        js << (k ? ", " : "") << "\"" << kinds[k].first << "\": {\"median_s\": " << r.median_s << ", \"min_s\": " << r.min_s << ", \"gbps\": " << gbps
           << ", \"reps\": " << r.reps << "}";
      }
      js << "}}";
    }
    js << "\n  ]\n}\n";
    if (rank == 0 && !a.out.empty()) {
      std::ofstream f(a.out);
      f << js.str();
      if (!f) throw std::runtime_error("cannot write " + a.out);
      std::printf("wrote %s\n", a.out.c_str());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fsdp_mpi_bandwidth (rank %d): %s\n", rank, e.what());
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  return 0;
}
