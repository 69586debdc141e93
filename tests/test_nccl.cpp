// NcclComm against MpiComm on the same host data; run at np = 1 and 2 with one CUDA device per rank of
// a node. Without a usable device every rank prints "no CUDA device: skipped" and exits 77 before any
// test runs, which CTest reports as skipped (SKIP_RETURN_CODE 77). The suite id_file (the Slurm
// bootstrap's id file) needs no device: with FSDP_TEST_NCCL_WITHOUT_DEVICE=1 the device check is left
// out, and --run_test=id_file runs that suite alone.
#define BOOST_TEST_MODULE fsdp_nccl
#define BOOST_TEST_NO_MAIN
#include <boost/test/unit_test.hpp>

#include <cuda_runtime_api.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "common.hpp"
#include "fsdp/comm/nccl_comm.hpp"
#include "fsdp/file_tree.hpp"

using fsdp::DType;
using fsdp::MpiComm;
using fsdp::NcclComm;
using fsdp::NcclOptions;
using fsdp::ReduceOp;

namespace {

constexpr int kSkipped = 77;
constexpr DType kAllTypes[] = {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16, DType::kInt32, DType::kInt64, DType::kUInt8};

bool is_float(DType t) { return t == DType::kFloat32 || t == DType::kFloat64 || t == DType::kFloat16 || t == DType::kBFloat16; }

/// NcclOptions for the tests: a deadline, so a broken collective fails the test instead of hanging it.
NcclOptions test_options() {
  NcclOptions o;
  o.timeout_s = 120;
  return o;
}

/// Element i of rank r: exact in every dtype, and sums over <= 4 ranks stay exact (|x| <= 11, halves).
double sample(DType t, int rank, std::int64_t i) {
  const int base = static_cast<int>((rank * 7 + i * 3) % 23);
  if (t == DType::kUInt8) return base;
  if (t == DType::kInt32 || t == DType::kInt64) return base - 11;
  return (base - 11) * 0.5;
}

std::vector<double> samples(DType t, int rank, std::int64_t n) {
  std::vector<double> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = sample(t, rank, i);
  return v;
}

std::vector<std::byte> encode(DType t, const std::vector<double>& v) {
  std::vector<std::byte> out(v.size() * fsdp::dtype_bytes(t));
  for (std::size_t i = 0; i < v.size(); ++i) {
    void* p = out.data() + i * fsdp::dtype_bytes(t);
    switch (t) {
      case DType::kFloat32: {
        const float x = static_cast<float>(v[i]);
        std::memcpy(p, &x, sizeof x);
        break;
      }
      case DType::kFloat64: {
        std::memcpy(p, &v[i], sizeof(double));
        break;
      }
      case DType::kFloat16: {
        const std::uint16_t x = fsdp::detail::float_to_f16(static_cast<float>(v[i]));
        std::memcpy(p, &x, sizeof x);
        break;
      }
      case DType::kBFloat16: {
        const std::uint16_t x = fsdp::detail::float_to_bf16(static_cast<float>(v[i]));
        std::memcpy(p, &x, sizeof x);
        break;
      }
      case DType::kInt32: {
        const auto x = static_cast<std::int32_t>(v[i]);
        std::memcpy(p, &x, sizeof x);
        break;
      }
      case DType::kInt64: {
        const auto x = static_cast<std::int64_t>(v[i]);
        std::memcpy(p, &x, sizeof x);
        break;
      }
      case DType::kUInt8: {
        const auto x = static_cast<std::uint8_t>(v[i]);
        std::memcpy(p, &x, sizeof x);
        break;
      }
    }
  }
  return out;
}

std::vector<double> decode(DType t, const std::vector<std::byte>& b) {
  const std::size_t eb = fsdp::dtype_bytes(t);
  std::vector<double> out(b.size() / eb);
  for (std::size_t i = 0; i < out.size(); ++i) {
    const void* p = b.data() + i * eb;
    switch (t) {
      case DType::kFloat32: {
        float x;
        std::memcpy(&x, p, sizeof x);
        out[i] = x;
        break;
      }
      case DType::kFloat64: {
        std::memcpy(&out[i], p, sizeof(double));
        break;
      }
      case DType::kFloat16: {
        std::uint16_t x;
        std::memcpy(&x, p, sizeof x);
        out[i] = fsdp::detail::f16_to_float(x);
        break;
      }
      case DType::kBFloat16: {
        std::uint16_t x;
        std::memcpy(&x, p, sizeof x);
        out[i] = fsdp::detail::bf16_to_float(x);
        break;
      }
      case DType::kInt32: {
        std::int32_t x;
        std::memcpy(&x, p, sizeof x);
        out[i] = static_cast<double>(x);
        break;
      }
      case DType::kInt64: {
        std::int64_t x;
        std::memcpy(&x, p, sizeof x);
        out[i] = static_cast<double>(x);
        break;
      }
      case DType::kUInt8: {
        std::uint8_t x;
        std::memcpy(&x, p, sizeof x);
        out[i] = x;
        break;
      }
    }
  }
  return out;
}

/// Device memory for the tests (freed at scope end).
class DeviceBuffer {
 public:
  explicit DeviceBuffer(std::size_t bytes) : bytes_(bytes) { FSDP_CUDA_CHECK(cudaMalloc(&ptr_, std::max<std::size_t>(bytes, 1))); }
  DeviceBuffer(const std::vector<std::byte>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return ptr_; }
  /// Copies `host` in and waits until it is there (a pageable copy may still be in flight when
  /// cudaMemcpy returns, and collectives are ordered against the compute stream only).
  void upload(const std::vector<std::byte>& host) {
    if (host.empty()) return;
    FSDP_CUDA_CHECK(cudaMemcpy(ptr_, host.data(), host.size(), cudaMemcpyHostToDevice));
    FSDP_CUDA_CHECK(cudaDeviceSynchronize());
  }
  /// The host's copy once everything queued on the device is done (collectives are stream-ordered:
  /// the host does not wait for them).
  std::vector<std::byte> download() const {
    FSDP_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<std::byte> host(bytes_);
    if (!host.empty()) FSDP_CUDA_CHECK(cudaMemcpy(host.data(), ptr_, bytes_, cudaMemcpyDeviceToHost));
    return host;
  }

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

/// One failure per comparison (not one per element); never returns early across a collective.
void expect_close(DType t, const std::vector<double>& got, const std::vector<double>& want, const std::string& what) {
  if (got.size() != want.size()) {
    BOOST_ERROR(what << ": " << got.size() << " elements, expected " << want.size());
    return;
  }
  const double tol = t == DType::kFloat16 || t == DType::kBFloat16 ? 1e-2 : t == DType::kFloat32 ? 1e-6 : t == DType::kFloat64 ? 1e-12 : 0.0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::abs(got[i] - want[i]) > tol * std::max(1.0, std::abs(want[i]))) {
      BOOST_ERROR(what << " (" << fsdp::dtype_name(t) << "): element " << i << " is " << got[i] << ", expected " << want[i]);
      return;
    }
  }
  BOOST_CHECK(true);
}

std::string label(const char* op, DType t, std::int64_t n, const char* extra = "") {
  return std::string(op) + " " + fsdp::dtype_name(t) + " n=" + std::to_string(n) + extra;
}

/// A path every rank of `w` sees: a fresh folder made by rank 0 (under TMPDIR or /tmp), broadcast.
std::string shared_temp_dir(MpiComm& w) {
  std::array<char, 512> path{};
  if (w.rank() == 0) {
    const char* base = std::getenv("TMPDIR");
    std::string pattern = std::string(base != nullptr && *base != '\0' ? base : "/tmp") + "/fsdp_test_nccl_XXXXXX";
    std::vector<char> buf(pattern.begin(), pattern.end());
    buf.push_back('\0');
    if (mkdtemp(buf.data()) == nullptr) buf[0] = '\0';
    std::snprintf(path.data(), path.size(), "%s", buf.data());
  }
  w.broadcast(path.data(), static_cast<std::int64_t>(path.size()), DType::kUInt8, 0);
  return path.data();
}

/// Sets environment variables for its scope and restores what was there.
class ScopedEnv {
 public:
  void set(const std::string& name, const std::string& value) {
    remember(name);
    setenv(name.c_str(), value.c_str(), 1);
  }
  void unset(const std::string& name) {
    remember(name);
    unsetenv(name.c_str());
  }
  ~ScopedEnv() {
    for (const auto& [name, old] : saved_) {
      if (old) {
        setenv(name.c_str(), old->c_str(), 1);
      } else {
        unsetenv(name.c_str());
      }
    }
  }

 private:
  void remember(const std::string& name) {
    if (saved_.count(name) != 0) return;
    const char* old = std::getenv(name.c_str());
    saved_[name] = old ? std::optional<std::string>(old) : std::nullopt;
  }
  std::map<std::string, std::optional<std::string>> saved_;
};

}  // namespace

// ---- collectives on devices, compared with MpiComm --------------------------------------------------
BOOST_AUTO_TEST_SUITE(nccl)

BOOST_AUTO_TEST_CASE(bootstrap_over_mpi) {
  auto w = MpiComm::world();
  auto nc = NcclComm::from_mpi(w, test_options());
  BOOST_TEST(nc.rank() == w.rank());
  BOOST_TEST(nc.size() == w.size());
  int current = -1;
  FSDP_CUDA_CHECK(cudaGetDevice(&current));
  BOOST_TEST(current == nc.device());
  BOOST_TEST(nc.compute_stream() == nullptr);
  BOOST_TEST(nc.comm_stream() != nullptr);
  BOOST_TEST(!nc.aborted());
  NcclComm copy = nc;  // copies share the communicator
  BOOST_TEST(copy.native() == nc.native());
}

BOOST_AUTO_TEST_CASE(all_gather_matches_mpi) {
  auto w = MpiComm::world();
  auto nc = NcclComm::from_mpi(w, test_options());
  for (DType t : kAllTypes) {
    for (std::int64_t n : {0, 1, 7, 1001}) {
      const auto send = encode(t, samples(t, w.rank(), n));
      std::vector<std::byte> want(send.size() * static_cast<std::size_t>(w.size()));
      w.all_gather(send.data(), want.data(), n, t);
      DeviceBuffer d_send(send), d_recv(want.size());
      nc.all_gather(d_send.get(), d_recv.get(), n, t);
      expect_close(t, decode(t, d_recv.download()), decode(t, want), label("all_gather", t, n));
    }
  }
}

BOOST_AUTO_TEST_CASE(reduce_scatter_sum_and_avg_match_mpi) {
  auto w = MpiComm::world();
  auto nc = NcclComm::from_mpi(w, test_options());
  for (DType t : kAllTypes) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
      if (op == ReduceOp::kAvg && !is_float(t)) continue;  // integer averages round differently by design
      for (std::int64_t n : {1, 7, 333}) {
        const auto send = encode(t, samples(t, w.rank(), n * w.size()));
        std::vector<std::byte> want(static_cast<std::size_t>(n) * fsdp::dtype_bytes(t));
        w.reduce_scatter(send.data(), want.data(), n, t, op);
        DeviceBuffer d_send(send), d_recv(want.size());
        nc.reduce_scatter(d_send.get(), d_recv.get(), n, t, op);
        expect_close(t, decode(t, d_recv.download()), decode(t, want), label("reduce_scatter", t, n, op == ReduceOp::kAvg ? " avg" : " sum"));
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(all_reduce_sum_avg_max_match_mpi) {
  auto w = MpiComm::world();
  auto nc = NcclComm::from_mpi(w, test_options());
  for (DType t : kAllTypes) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
      if (op == ReduceOp::kAvg && !is_float(t)) continue;
      for (std::int64_t n : {1, 5, 7, 1001}) {
        const auto values = samples(t, w.rank(), n);
        const auto send = encode(t, values);
        std::vector<double> want;
        if (op == ReduceOp::kMax && (t == DType::kFloat16 || t == DType::kBFloat16)) {
          // MpiComm has no 16-bit max; the samples of every rank are known here.
          want = values;
          for (int r = 0; r < w.size(); ++r)
            for (std::int64_t i = 0; i < n; ++i) want[static_cast<std::size_t>(i)] = std::max(want[static_cast<std::size_t>(i)], sample(t, r, i));
        } else {
          std::vector<std::byte> host = send;
          w.all_reduce(host.data(), host.data(), n, t, op);
          want = decode(t, host);
        }
        DeviceBuffer d_send(send), d_recv(send.size());
        nc.all_reduce(d_send.get(), d_recv.get(), n, t, op);
        const char* name = op == ReduceOp::kSum ? " sum" : op == ReduceOp::kAvg ? " avg" : " max";
        expect_close(t, decode(t, d_recv.download()), want, label("all_reduce", t, n, name));
        nc.all_reduce(d_send.get(), d_send.get(), n, t, op);  // in place
        expect_close(t, decode(t, d_send.download()), want, label("all_reduce in place", t, n, name));
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(host_buffers_are_staged_and_match_mpi) {
  // The checkpoint layer and fsdp-train pass host memory (flags, sizes, names) to the engine's
  // communicator: NcclComm stages it through device memory.
  auto w = MpiComm::world();
  auto nc = NcclComm::from_mpi(w, test_options());
  const DType t = DType::kInt64;
  const std::int64_t n = 3;
  const auto send = encode(t, samples(t, w.rank(), n));
  std::vector<std::byte> want(send.size() * static_cast<std::size_t>(w.size())), got(want.size());
  w.all_gather(send.data(), want.data(), n, t);
  nc.all_gather(send.data(), got.data(), n, t);
  BOOST_TEST((got == want), "all_gather of host buffers");
  std::vector<std::byte> sum = send, mpi_sum = send;
  nc.all_reduce(sum.data(), sum.data(), n, t, ReduceOp::kMax);
  w.all_reduce(mpi_sum.data(), mpi_sum.data(), n, t, ReduceOp::kMax);
  BOOST_TEST((sum == mpi_sum), "in-place all_reduce of a host buffer");
  std::vector<std::byte> root = encode(t, samples(t, 0, n)), mine = send;
  nc.broadcast(mine.data(), n, t, 0);
  BOOST_TEST((mine == root), "broadcast into a host buffer");
}

BOOST_AUTO_TEST_CASE(broadcast_and_barrier) {
  auto w = MpiComm::world();
  auto nc = NcclComm::from_mpi(w, test_options());
  for (DType t : kAllTypes) {
    for (std::int64_t n : {1, 7, 1001}) {
      const int root = w.size() - 1;
      auto host = encode(t, samples(t, w.rank(), n));
      DeviceBuffer d(host);
      w.broadcast(host.data(), n, t, root);
      nc.broadcast(d.get(), n, t, root);
      expect_close(t, decode(t, d.download()), decode(t, host), label("broadcast", t, n));
    }
  }
  nc.barrier();
  nc.barrier();
  BOOST_TEST(nc.counters().calls == static_cast<std::uint64_t>(std::size(kAllTypes) * 3));  // barriers are not counted
}

BOOST_AUTO_TEST_CASE(collectives_are_recorded_by_the_flight_recorder) {
  auto w = MpiComm::world();
  auto& recorder = fsdp::FlightRecorder::instance();
  recorder.configure(64, "", w.rank(), w.size());
  auto nc = NcclComm::from_mpi(w, test_options());
  auto sub = nc.split(0, w.rank());
  DeviceBuffer d(sizeof(float) * 3);
  nc.all_reduce(d.get(), d.get(), 3, DType::kFloat32, ReduceOp::kSum);
  sub.barrier();
  nc.iall_reduce(d.get(), d.get(), 3, DType::kFloat32, ReduceOp::kSum).wait();
  std::vector<std::string> seen;
  const auto comms = recorder.comms();
  for (const auto& r : recorder.records())
    if (comms.at(static_cast<std::size_t>(r.comm)).name.rfind("nccl:", 0) == 0) {
      seen.push_back(comms.at(static_cast<std::size_t>(r.comm)).name + " " + r.kind);
      BOOST_TEST(r.end_s >= r.start_s);  // every one of them finished
    }
  const std::string world = "nccl:" + w.flight_name();
  BOOST_TEST_REQUIRE(seen.size() == 3u);
  BOOST_TEST(seen[0] == world + " all_reduce");
  BOOST_TEST(seen[1].rfind(world + "/split#", 0) == 0);  // the n-th split of this communicator in this process
  BOOST_TEST(seen[1].substr(seen[1].size() - 8) == " barrier");
  BOOST_TEST(seen[2] == world + " iall_reduce");
  BOOST_TEST(comms.back().world_ranks == w.world_ranks(), boost::test_tools::per_element());
  recorder.configure(0, "", w.rank(), w.size());
}

BOOST_AUTO_TEST_CASE(split_groups_for_hybrid_sharding) {
  auto w = MpiComm::world();
  for (fsdp::NcclSplit method : {fsdp::NcclSplit::kAuto, fsdp::NcclSplit::kMpi}) {
    NcclOptions o = test_options();
    o.split = method;
    auto nc = NcclComm::from_mpi(w, o);
    for (int group : {1, 2}) {
      if (w.size() % group != 0) continue;
      BOOST_TEST_CONTEXT("split method " << static_cast<int>(method) << ", shard group " << group) {
        auto shard = nc.split(w.rank() / group, w.rank());
        auto replica = nc.split(w.rank() % group, w.rank());
        auto mpi_shard = w.split(w.rank() / group, w.rank());
        auto mpi_replica = w.split(w.rank() % group, w.rank());
        BOOST_TEST(shard.size() == mpi_shard.size());
        BOOST_TEST(shard.rank() == mpi_shard.rank());
        BOOST_TEST(replica.size() == mpi_replica.size());
        BOOST_TEST(replica.rank() == mpi_replica.rank());
        BOOST_TEST(shard.device() == nc.device());
        BOOST_TEST(shard.comm_stream() == nc.comm_stream());  // one lane: issue order is run order
        // hybrid gradient path: reduce-scatter inside the shard group, then all-reduce across replicas
        const DType t = DType::kFloat32;
        const std::int64_t n = 37;
        const auto send = encode(t, samples(t, w.rank(), n * shard.size()));
        std::vector<std::byte> want(static_cast<std::size_t>(n) * fsdp::dtype_bytes(t));
        mpi_shard.reduce_scatter(send.data(), want.data(), n, t, ReduceOp::kAvg);
        mpi_replica.all_reduce(want.data(), want.data(), n, t, ReduceOp::kAvg);
        DeviceBuffer d_send(send), d_shard(want.size());
        shard.reduce_scatter(d_send.get(), d_shard.get(), n, t, ReduceOp::kAvg);
        replica.all_reduce(d_shard.get(), d_shard.get(), n, t, ReduceOp::kAvg);
        expect_close(t, decode(t, d_shard.download()), decode(t, want), "hybrid reduce-scatter + all-reduce");
      }
    }
    auto node = nc.split_node();
    auto mpi_node = w.split_node();
    BOOST_TEST(node.size() == mpi_node.size());
    BOOST_TEST(node.rank() == mpi_node.rank());
  }
}

BOOST_AUTO_TEST_CASE(non_blocking_overlaps_the_compute_stream) {
  auto w = MpiComm::world();
  auto nc = NcclComm::from_mpi(w, test_options());
  cudaStream_t compute = nullptr;
  FSDP_CUDA_CHECK(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking));
  nc.set_compute_stream(compute);
  BOOST_TEST(nc.compute_stream() == compute);

  const DType t = DType::kFloat32;
  const std::int64_t n = (1 << 20) + 3;
  const auto send_host = encode(t, samples(t, w.rank(), n));
  std::vector<std::byte> want(send_host.size() * static_cast<std::size_t>(w.size()));
  w.all_gather(send_host.data(), want.data(), n, t);

  void* pinned_in = nullptr;
  void* pinned_out = nullptr;
  FSDP_CUDA_CHECK(cudaMallocHost(&pinned_in, send_host.size()));
  FSDP_CUDA_CHECK(cudaMallocHost(&pinned_out, want.size()));
  std::memcpy(pinned_in, send_host.data(), send_host.size());
  DeviceBuffer d_send(send_host.size()), d_recv(want.size());
  const std::size_t big = std::size_t{64} << 20;  // the "current unit's compute": a kernel-free copy
  DeviceBuffer a(big), b(big);
  FSDP_CUDA_CHECK(cudaMemset(d_send.get(), 0, send_host.size()));  // zeros if the ordering were broken
  FSDP_CUDA_CHECK(cudaDeviceSynchronize());

  // The input is produced on the compute stream right before the collective: the collective must wait for it.
  FSDP_CUDA_CHECK(cudaMemcpyAsync(d_send.get(), pinned_in, send_host.size(), cudaMemcpyHostToDevice, compute));
  auto gathered = nc.iall_gather(d_send.get(), d_recv.get(), n, t);
  FSDP_CUDA_CHECK(cudaMemcpyAsync(b.get(), a.get(), big, cudaMemcpyDeviceToDevice, compute));  // overlaps the gather
  gathered.wait();
  // ... and the compute stream consumes the result after wait().
  FSDP_CUDA_CHECK(cudaMemcpyAsync(pinned_out, d_recv.get(), want.size(), cudaMemcpyDeviceToHost, compute));
  FSDP_CUDA_CHECK(cudaStreamSynchronize(compute));
  std::vector<std::byte> got(want.size());
  std::memcpy(got.data(), pinned_out, got.size());
  expect_close(t, decode(t, got), decode(t, want), "iall_gather ordered against the compute stream");

  // A blocking collective is stream-ordered too: its input produced on the compute stream, its result
  // consumed there, and only that stream synchronized (no device-wide wait hides a missing order).
  {
    FSDP_CUDA_CHECK(cudaMemsetAsync(d_recv.get(), 0, want.size(), compute));
    FSDP_CUDA_CHECK(cudaMemcpyAsync(d_send.get(), pinned_in, send_host.size(), cudaMemcpyHostToDevice, compute));
    nc.all_gather(d_send.get(), d_recv.get(), n, t);
    FSDP_CUDA_CHECK(cudaMemcpyAsync(pinned_out, d_recv.get(), want.size(), cudaMemcpyDeviceToHost, compute));
    FSDP_CUDA_CHECK(cudaStreamSynchronize(compute));
    std::vector<std::byte> blocking_got(want.size());
    std::memcpy(blocking_got.data(), pinned_out, blocking_got.size());
    expect_close(t, decode(t, blocking_got), decode(t, want), "all_gather ordered against the compute stream, no host wait");
    nc.synchronize();  // the host has seen it complete: nothing is left pending
  }
  BOOST_TEST(gathered.test());  // a completed request stays complete

  // Every non-blocking variant equals its blocking one; test() polls without blocking.
  const std::int64_t m = 1001;
  const auto rs_host = encode(t, samples(t, w.rank(), m * w.size()));
  DeviceBuffer rs_send(rs_host), rs_a(static_cast<std::size_t>(m) * 4), rs_b(static_cast<std::size_t>(m) * 4);
  auto rs = nc.ireduce_scatter(rs_send.get(), rs_a.get(), m, t, ReduceOp::kAvg);
  while (!rs.test()) {}
  nc.reduce_scatter(rs_send.get(), rs_b.get(), m, t, ReduceOp::kAvg);
  expect_close(t, decode(t, rs_a.download()), decode(t, rs_b.download()), "ireduce_scatter vs reduce_scatter");

  const auto ar_host = encode(DType::kBFloat16, samples(DType::kBFloat16, w.rank(), m));
  DeviceBuffer ar_a(ar_host), ar_b(ar_host);
  nc.iall_reduce(ar_a.get(), ar_a.get(), m, DType::kBFloat16, ReduceOp::kSum).wait();
  nc.all_reduce(ar_b.get(), ar_b.get(), m, DType::kBFloat16, ReduceOp::kSum);
  expect_close(DType::kBFloat16, decode(DType::kBFloat16, ar_a.download()), decode(DType::kBFloat16, ar_b.download()), "iall_reduce vs all_reduce");

  const auto bc_host = encode(DType::kInt64, samples(DType::kInt64, w.rank(), 9));
  DeviceBuffer bc(bc_host);
  {
    auto request = nc.ibroadcast(bc.get(), 9, DType::kInt64, 0);  // never waited: the destructor completes it
  }
  FSDP_CUDA_CHECK(cudaStreamSynchronize(compute));
  expect_close(DType::kInt64, decode(DType::kInt64, bc.download()), samples(DType::kInt64, 0, 9), "ibroadcast completed by its destructor");

  // Two gathers in flight at once (the next unit's while this one's is consumed).
  DeviceBuffer r1(want.size()), r2(want.size());
  auto g1 = nc.iall_gather(d_send.get(), r1.get(), n, t);
  auto g2 = nc.iall_gather(d_send.get(), r2.get(), n, t);
  g2.wait();
  g1.wait();
  FSDP_CUDA_CHECK(cudaStreamSynchronize(compute));
  expect_close(t, decode(t, r2.download()), decode(t, want), "second of two gathers in flight");

  nc.set_compute_stream(nullptr);
  FSDP_CUDA_CHECK(cudaStreamDestroy(compute));
  FSDP_CUDA_CHECK(cudaFreeHost(pinned_in));
  FSDP_CUDA_CHECK(cudaFreeHost(pinned_out));
}

BOOST_AUTO_TEST_CASE(counters_count_bytes) {
  auto w = MpiComm::world();
  auto nc = NcclComm::from_mpi(w, test_options());
  DeviceBuffer send(64), recv(static_cast<std::size_t>(64 * w.size()));
  nc.all_gather(send.get(), recv.get(), 8, DType::kFloat32);
  BOOST_TEST(nc.counters().all_gather_bytes == 32u);
  BOOST_TEST(nc.counters().calls == 1u);
  BOOST_TEST(nc.counters().all_gather_seconds > 0.0);
  nc.reduce_scatter(recv.get(), send.get(), 3, DType::kFloat32, ReduceOp::kSum);
  BOOST_TEST(nc.counters().reduce_scatter_bytes == static_cast<std::uint64_t>(12 * w.size()));
  nc.iall_reduce(send.get(), send.get(), 2, DType::kFloat64, ReduceOp::kMax).wait();
  BOOST_TEST(nc.counters().all_reduce_bytes == 16u);
  nc.reset_counters();
  BOOST_TEST(nc.counters().total_bytes() == 0u);
}

BOOST_AUTO_TEST_CASE(invalid_arguments_throw_before_any_collective) {
  auto w = MpiComm::world();
  auto nc = NcclComm::from_mpi(w, test_options());
  DeviceBuffer buf(64);
  BOOST_CHECK_THROW(nc.reduce_scatter(buf.get(), buf.get(), 1, DType::kFloat32, ReduceOp::kMax), fsdp::CommError);
  BOOST_CHECK_THROW(nc.all_gather(buf.get(), buf.get(), -1, DType::kFloat32), fsdp::CommError);
  BOOST_CHECK_THROW(nc.broadcast(buf.get(), 1, DType::kFloat32, w.size()), fsdp::CommError);
  BOOST_CHECK_THROW(nc.split(-1, 0), fsdp::CommError);
  BOOST_TEST(!nc.aborted());
  nc.barrier();  // still usable, and every rank is still in step
}

BOOST_AUTO_TEST_CASE(slurm_file_bootstrap_with_faked_environment) {
  auto w = MpiComm::world();
  const std::string dir = shared_temp_dir(w);
  BOOST_REQUIRE(!dir.empty());  // the same on every rank
  const std::string id_file = dir + "/nccl_id";
  std::int64_t job = static_cast<std::int64_t>(getpid());
  w.broadcast(&job, 1, DType::kInt64, 0);
  const int local = w.split_node().rank();
  {
    ScopedEnv env;
    env.set("SLURM_PROCID", std::to_string(w.rank()));
    env.set("SLURM_NTASKS", std::to_string(w.size()));
    env.set("SLURM_LOCALID", std::to_string(local));
    env.set("SLURM_JOB_ID", "fsdp-test-" + std::to_string(job));
    env.set("SLURM_STEP_ID", "0");
    NcclOptions o = test_options();
    o.id_file_timeout_s = 60;
    auto nc = NcclComm::from_slurm_file(id_file, o);
    BOOST_TEST(nc.rank() == w.rank());
    BOOST_TEST(nc.size() == w.size());
    const DType t = DType::kInt64;
    auto host = encode(t, samples(t, w.rank(), 11));
    DeviceBuffer d(host);
    w.all_reduce(host.data(), host.data(), 11, t, ReduceOp::kSum);
    nc.all_reduce(d.get(), d.get(), 11, t, ReduceOp::kSum);
    expect_close(t, decode(t, d.download()), decode(t, host), "all_reduce over the Slurm-file communicator");
    auto node = nc.split_node();  // no MPI here: host names all-gathered through NCCL
    BOOST_TEST(node.size() == w.split_node().size());
    auto halves = nc.split(w.rank() % 2, w.rank());  // ncclCommSplit, no MPI needed
    BOOST_TEST(halves.size() == (w.size() + 1 - w.rank() % 2) / 2);
  }
  w.barrier();
  if (w.rank() == 0) {
    BOOST_TEST(!std::filesystem::exists(id_file));  // rank 0 removes it once the communicator is up
    fsdp::remove_tree(dir);
  }
}

// A collective that never completes, at any world size (at 1 too, where no peer can be left out: NCCL
// refuses two ranks on one GPU, so a single GPU runs this one). The test hook: the compute stream is
// held by a host function until the test lets it go, so the collective queued behind it cannot start.
// The communicator is marked aborted within the deadline plus 0.5 s, and the host waiting for it gets
// fsdp.comm.deadline within 5 s more (NCCL's own ncclCommAbort), no hang.
BOOST_AUTO_TEST_CASE(deadline_ends_a_collective_that_never_completes) {
  auto w = MpiComm::world();
  NcclOptions o = test_options();
  o.timeout_s = 2;
  auto nc = NcclComm::from_mpi(w, o);
  cudaStream_t held = nullptr;
  FSDP_CUDA_CHECK(cudaStreamCreateWithFlags(&held, cudaStreamNonBlocking));
  nc.set_compute_stream(held);
  DeviceBuffer buf(4);
  FSDP_CUDA_CHECK(cudaMemset(buf.get(), 0, 4));
  FSDP_CUDA_CHECK(cudaDeviceSynchronize());
  nc.all_reduce(buf.get(), buf.get(), 1, DType::kFloat32, ReduceOp::kSum);  // connections are up
  nc.synchronize();
  std::atomic<bool> release{false};
  const auto hold = [](void* flag) {
    while (!static_cast<std::atomic<bool>*>(flag)->load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  };
  FSDP_CUDA_CHECK(cudaLaunchHostFunc(held, hold, &release));
  const auto start = std::chrono::steady_clock::now();
  // The hold ends once the communicator is marked aborted (or at twice the deadline): should
  // ncclCommAbort wait for the device, it is not left waiting for a stream only this test releases.
  // It also notes when the communicator was marked aborted: the deadline is ours to keep, the
  // ncclCommAbort after it is NCCL's (1.0 s with NCCL 2.28.9 on an H100).
  std::atomic<double> aborted_after{-1.0};
  std::thread releaser([&] {
    const auto until = start + std::chrono::duration<double>(2 * o.timeout_s + 1);
    while (!nc.aborted() && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (nc.aborted()) aborted_after = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    release = true;
  });
  std::string id, what;
  try {
    nc.all_reduce(buf.get(), buf.get(), 1, DType::kFloat32, ReduceOp::kSum);  // queued behind the held stream
    nc.synchronize();                                                         // the host waits for it
  } catch (const fsdp::CommError& e) {
    id = e.id();
    what = e.what();
  }
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  releaser.join();  // the stream drains; the aborted collective's work is let go
  cudaError_t q = cudaErrorNotReady;
  while ((q = cudaStreamQuery(held)) == cudaErrorNotReady && std::chrono::steady_clock::now() - start < std::chrono::seconds(60))
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  if (w.rank() == 0) {  // scripts/gpu/check reads this line
    std::printf("deadline: %s after %.3f s (deadline %.0f s, marked aborted after %.3f s): %s\n", id.empty() ? "no error" : id.c_str(), waited,
                o.timeout_s, aborted_after.load(), what.c_str());
    std::fflush(stdout);
  }
  BOOST_TEST(id == "fsdp.comm.deadline");
  BOOST_TEST(what.find("all_reduce") != std::string::npos);
  BOOST_TEST(waited >= o.timeout_s - 0.1);
  BOOST_TEST(aborted_after.load() >= o.timeout_s - 0.1);
  BOOST_TEST(aborted_after.load() <= o.timeout_s + 0.5);  // our deadline: the waiting host's next poll, or the watcher's
  BOOST_TEST(waited <= aborted_after.load() + 5.0);       // NCCL's abort ends what was queued: no hang
  BOOST_TEST(nc.aborted());
  BOOST_TEST(q == cudaSuccess);
  nc.set_compute_stream(nullptr);
  cudaStreamDestroy(held);
  w.barrier();
}

// Last: it aborts a communicator on purpose.
BOOST_AUTO_TEST_CASE(deadline_aborts_a_collective_a_rank_skipped_while_the_host_waits_in_a_device_sync) {
  auto w = MpiComm::world();
  if (w.size() < 2) {
    BOOST_TEST_MESSAGE("needs 2 ranks");
    return;  // the same on every rank
  }
  NcclOptions o = test_options();
  o.timeout_s = 2;
  auto nc = NcclComm::from_mpi(w, o);
  auto half = nc.split(0, nc.rank());  // on the same lane: aborted with it
  DeviceBuffer buf(4);
  FSDP_CUDA_CHECK(cudaMemset(buf.get(), 0, 4));
  nc.all_reduce(buf.get(), buf.get(), 1, DType::kFloat32, ReduceOp::kSum);  // connections are up
  half.all_reduce(buf.get(), buf.get(), 1, DType::kFloat32, ReduceOp::kSum);
  nc.synchronize();
  std::int32_t caught = 0;
  if (w.rank() == 0) {  // the other ranks skip this collective
    const auto start = std::chrono::steady_clock::now();
    // Stream-ordered: the call returns once queued. The host then waits for the compute stream on its
    // own, without asking the communicator (as LibTorch's loss.item() does): the lane's watcher thread
    // aborts the communicator past the deadline, which ends the queued kernel, and the stream drains.
    nc.all_reduce(buf.get(), buf.get(), 1, DType::kFloat32, ReduceOp::kSum);
    cudaError_t q = cudaErrorNotReady;
    while ((q = cudaStreamQuery(nc.compute_stream())) == cudaErrorNotReady &&
           std::chrono::steady_clock::now() - start < std::chrono::seconds(60))  // bounded only so that a broken watcher fails here
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    BOOST_TEST(q == cudaSuccess);
    const double blocked = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    BOOST_TEST(blocked >= 1.9);
    BOOST_TEST(blocked < 60.0);
    BOOST_TEST(nc.aborted());
    BOOST_TEST(half.aborted());  // every communicator of the lane
    try {
      nc.synchronize();  // the next call reports what the watcher found
    } catch (const fsdp::CommError& e) {
      caught = 1;
      BOOST_TEST(e.id() == "fsdp.comm.deadline");
      BOOST_TEST(std::string(e.what()).find("all_reduce") != std::string::npos);
      BOOST_TEST(std::string(e.what()).find("aborted") != std::string::npos);
    }
    BOOST_TEST(nc.aborted());
  }
  w.barrier();
  if (w.rank() != 0) {
    nc.abort("test: rank 0 gave up on a collective this rank skipped");
    half.abort("test: rank 0 gave up on a collective this rank skipped");
  }
  BOOST_TEST(nc.aborted());
  BOOST_CHECK_THROW(nc.all_reduce(buf.get(), buf.get(), 1, DType::kFloat32, ReduceOp::kSum), fsdp::CommError);
  BOOST_CHECK_THROW(nc.iall_gather(buf.get(), buf.get(), 1, DType::kFloat32), fsdp::CommError);
  w.all_reduce(&caught, &caught, 1, DType::kInt32, ReduceOp::kSum);
  BOOST_TEST(caught == 1);
}

BOOST_AUTO_TEST_SUITE_END()

// ---- the Slurm bootstrap's id file (no device needed) ----------------------------------------------
BOOST_AUTO_TEST_SUITE(id_file)

BOOST_AUTO_TEST_CASE(round_trip_between_ranks) {
  auto w = MpiComm::world();
  const std::string dir = shared_temp_dir(w);
  BOOST_REQUIRE(!dir.empty());
  const std::string path = dir + "/nccl_id";
  const std::string tag = "job=test step=0 ntasks=" + std::to_string(w.size());
  ncclUniqueId id;
  for (int i = 0; i < NCCL_UNIQUE_ID_BYTES; ++i) id.internal[i] = static_cast<char>((i * 37 + 11) & 0xff);
  id.internal[5] = '\n';  // raw bytes, newlines included
  id.internal[6] = '\0';
  if (w.rank() == 0) fsdp::detail::write_id_file(path, tag, id);
  const ncclUniqueId got = w.rank() == 0 ? id : fsdp::detail::read_id_file(path, tag, 30);
  BOOST_TEST(std::memcmp(got.internal, id.internal, NCCL_UNIQUE_ID_BYTES) == 0);
  w.barrier();
  if (w.rank() == 0) {
    std::vector<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(dir)) names.push_back(e.path().filename().string());
    BOOST_TEST(names == std::vector<std::string>{"nccl_id"});  // no temporary left behind
    fsdp::remove_tree(dir);
  }
}

BOOST_AUTO_TEST_CASE(a_missing_file_is_an_error_naming_it) {
  const std::string path = "/tmp/fsdp_test_nccl_absent_" + std::to_string(getpid());
  const auto start = std::chrono::steady_clock::now();
  try {
    fsdp::detail::read_id_file(path, "job=1 step=0 ntasks=2", 0.3);
    BOOST_ERROR("no error for a missing id file");
  } catch (const fsdp::CommError& e) {
    BOOST_TEST(e.id() == "fsdp.comm.bootstrap");
    BOOST_TEST(std::string(e.what()).find(path) != std::string::npos);
    BOOST_TEST(std::string(e.what()).find("never appeared") != std::string::npos);
  }
  BOOST_TEST(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() >= 0.29);
}

BOOST_AUTO_TEST_CASE(a_file_of_another_job_is_not_used) {
  char pattern[] = "/tmp/fsdp_test_nccl_XXXXXX";
  BOOST_REQUIRE(mkdtemp(pattern) != nullptr);
  const std::string path = std::string(pattern) + "/nccl_id";
  ncclUniqueId id{};
  fsdp::detail::write_id_file(path, "job=1 step=0 ntasks=2", id);
  try {
    fsdp::detail::read_id_file(path, "job=2 step=0 ntasks=2", 0.3);
    BOOST_ERROR("another job's id file was used");
  } catch (const fsdp::CommError& e) {
    BOOST_TEST(std::string(e.what()).find("another job") != std::string::npos);
    BOOST_TEST(std::string(e.what()).find("job=1 step=0") != std::string::npos);
  }
  fsdp::remove_tree(pattern);
}

BOOST_AUTO_TEST_CASE(a_requeued_job_does_not_take_its_previous_runs_file) {
  ScopedEnv env;
  env.set("SLURM_JOB_ID", "77");
  env.set("SLURM_STEP_ID", "0");
  env.unset("SLURM_RESTART_COUNT");
  const std::string first = fsdp::detail::id_file_tag(2);
  BOOST_TEST(first == "job=77 restart=0 step=0 ntasks=2");
  env.set("SLURM_RESTART_COUNT", "1");  // scontrol requeue: same job id and step, the next run
  const std::string requeued = fsdp::detail::id_file_tag(2);
  BOOST_TEST(requeued == "job=77 restart=1 step=0 ntasks=2");
  char pattern[] = "/tmp/fsdp_test_nccl_XXXXXX";
  BOOST_REQUIRE(mkdtemp(pattern) != nullptr);
  const std::string path = std::string(pattern) + "/nccl_id";
  fsdp::detail::write_id_file(path, first, ncclUniqueId{});
  BOOST_CHECK_EXCEPTION(fsdp::detail::read_id_file(path, requeued, 0.3), fsdp::CommError,
                        [](const fsdp::CommError& e) { return std::string(e.what()).find("another job") != std::string::npos; });
  fsdp::remove_tree(pattern);
}

BOOST_AUTO_TEST_CASE(an_unwritable_folder_is_an_error_naming_the_file) {
  const std::string path = "/nonexistent_fsdp_folder/nccl_id";
  try {
    fsdp::detail::write_id_file(path, "job=1 step=0 ntasks=2", ncclUniqueId{});
    BOOST_ERROR("no error writing into a missing folder");
  } catch (const fsdp::CommError& e) {
    BOOST_TEST(e.id() == "fsdp.comm.bootstrap");
    BOOST_TEST(std::string(e.what()).find(path) != std::string::npos);
  }
}

BOOST_AUTO_TEST_CASE(slurm_variables_are_required_and_checked) {
  ScopedEnv env;
  env.unset("SLURM_PROCID");
  env.unset("SLURM_NTASKS");
  BOOST_CHECK_EXCEPTION(NcclComm::from_slurm_file("/tmp/unused"), fsdp::CommError,
                        [](const fsdp::CommError& e) { return std::string(e.what()).find("SLURM_PROCID") != std::string::npos; });
  env.set("SLURM_PROCID", "2");
  env.set("SLURM_NTASKS", "2");
  BOOST_CHECK_THROW(NcclComm::from_slurm_file("/tmp/unused"), fsdp::CommError);
  env.set("SLURM_PROCID", "one");
  BOOST_CHECK_EXCEPTION(NcclComm::from_slurm_file("/tmp/unused"), fsdp::CommError,
                        [](const fsdp::CommError& e) { return std::string(e.what()).find("not an integer") != std::string::npos; });
}

BOOST_AUTO_TEST_SUITE_END()

// Every rank agrees on skipping before Boost runs anything, so no rank waits in a collective alone.
int main(int argc, char** argv) {
  fsdp::MpiEnvironment env(&argc, &argv);
  auto world = MpiComm::world();
  if (std::getenv("FSDP_TEST_NCCL_WITHOUT_DEVICE") == nullptr) {
    int count = 0;
    const cudaError_t rc = cudaGetDeviceCount(&count);
    const int on_node = world.split_node().size();
    std::int32_t mine = 0;  // 0 usable, 1 fewer devices than ranks on the node, 2 no device
    if (rc != cudaSuccess || count == 0) {
      mine = 2;
    } else if (count < on_node) {
      mine = 1;  // NCCL needs one device per rank
    }
    std::int32_t any = mine;
    world.all_reduce(&any, &any, 1, DType::kInt32, ReduceOp::kMax);
    if (any != 0) {
      if (mine == 2) {
        std::printf("rank %d: no CUDA device: skipped (cudaGetDeviceCount: %s)\n", world.rank(),
                    rc == cudaSuccess ? "0 devices" : cudaGetErrorString(rc));
      } else if (mine == 1) {
        std::printf("rank %d: %d ranks on this node but %d CUDA devices: skipped\n", world.rank(), on_node, count);
      } else {
        std::printf("rank %d: another rank has no usable CUDA device: skipped\n", world.rank());
      }
      std::fflush(stdout);
      return kSkipped;
    }
  }
  // A rank left alone in an MPI collective (a test failed on one rank) ends the job instead of hanging.
  arm_collective_deadline(world.rank());
  return boost::unit_test::unit_test_main(&init_unit_test, argc, argv);
}
