// The engine's equivalence test on CUDA tensors with NcclComm (label gpu; docs/gpu.md): every
// strategy, hybrid, CPU offload, prefetching, overlapped reductions, activation checkpointing, bf16
// mixed precision and a checkpoint save and load, against single-process training on the same global
// batch on the same device. fp32 cases: relative error of the whole model <= 1e-5 (per tensor it would
// not hold: under Adam a nearly-zero gradient turns another GEMM's summation order into a large error
// of that one tensor); bf16: the loss within 5% (+1e-3) of fp32's at every step, as the CPU suite;
// resume: bit for bit. Needs a CUDA-enabled LibTorch, NCCL and one GPU per rank; otherwise every rank
// says why and exits 77 (skipped). With --cpu the same cases run on CPU over MPI (CTest
// test_engine_gpu_cases_on_cpu_np2), which checks the cases and their tolerances where no GPU is.
//   mpirun -np 2 build/bin/test_engine_gpu [--cpu]
#include <fsdp/comm/nccl_comm.hpp>
#include <fsdp/fsdp.hpp>
#include <stdlib.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "collective_deadline.hpp"
#include "crash_report.hpp"
#include "model_error.hpp"
#include "fsdp/file_tree.hpp"

namespace {

using fsdp::FsdpOptions;
using fsdp::MpiComm;
using fsdp::NcclComm;
using fsdp::ShardingStrategy;

constexpr int kSteps = 4;
constexpr int kLocalRows = 8;

struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(16, 64));
    fc2 = register_module("fc2", torch::nn::Linear(64, 32));
    fc3 = register_module("fc3", torch::nn::Linear(32, 4));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(fsdp::forward(fc1, x));
    x = torch::relu(fsdp::forward(fc2, x));
    return fsdp::forward(fc3, x);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};
TORCH_MODULE(Net);

std::shared_ptr<NetImpl> make_net(const torch::Device& device) {
  torch::manual_seed(7);
  auto net = std::make_shared<NetImpl>();
  net->to(device);
  return net;
}

std::pair<torch::Tensor, torch::Tensor> batch(int step, int rows, const torch::Device& device) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  auto x = torch::randn({rows, 16}, gen);
  auto y = torch::randint(0, 4, {rows}, gen);
  return {x.to(device), y.to(device)};
}

struct Trained {
  std::map<std::string, torch::Tensor> params;  // on the host
  std::vector<double> losses;                   // this rank's, per step
};

Trained reference(int world, const torch::Device& device) {
  auto net = make_net(device);
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
  Trained out;
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step, kLocalRows * world, device);
    opt.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(net->forward(x), y);
    loss.backward();
    out.losses.push_back(loss.item<double>());
    opt.step();
  }
  for (const auto& p : net->named_parameters()) out.params[p.key()] = p.value().detach().cpu();
  return out;
}

bool bitwise_equal(const std::map<std::string, torch::Tensor>& a, const std::map<std::string, torch::Tensor>& b) {
  for (const auto& [name, t] : a)
    if (!torch::equal(t, b.at(name))) return false;
  return true;
}

template <class Comm>
class Cases {
 public:
  Cases(MpiComm world, Comm comm, torch::Device device) : world_(std::move(world)), comm_(std::move(comm)), device_(device) {}

  /// Trains steps [from, to) of the global schedule; `loaded` is the checkpoint to start from, `save`
  /// the folder to save into after the last step (both optional).
  Trained train(const FsdpOptions& options, int from = 0, int to = kSteps, const std::string& loaded = "", const std::string& save = "") {
    auto model = fsdp::make_fsdp(make_net(device_), comm_, options);
    torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
    if (!loaded.empty()) fsdp::load_checkpoint(*model, &opt, loaded);
    const int r = world_.rank(), n = world_.size();
    Trained out;
    for (int step = from; step < to; ++step) {
      auto [x, y] = batch(step, kLocalRows * n, device_);
      opt.zero_grad();
      auto loss =
          torch::nn::functional::cross_entropy(model->forward(x.narrow(0, r * kLocalRows, kLocalRows)), y.narrow(0, r * kLocalRows, kLocalRows));
      loss.backward();
      out.losses.push_back(loss.template item<double>());
      opt.step();
    }
    if (!save.empty()) saved_ = fsdp::save_checkpoint(*model, &opt, save, {.step = to}).path;
    for (auto& [name, t] : model->full_parameters()) out.params[name] = t.cpu();
    return out;
  }

  int run() {
    const auto ref = reference(world_.size(), device_);
    const auto fp32 = [&](const std::string& name, const FsdpOptions& options) {
      const double err = relative_error_of_model(train(options).params, ref.params);
      std::array<char, 32> text{};
      std::snprintf(text.data(), text.size(), "%.3g", err);
      report(name, err <= 1e-5, std::string("relative error of the model ") + text.data());
    };
    for (auto strategy : {ShardingStrategy::FULL_SHARD, ShardingStrategy::SHARD_GRAD_OP, ShardingStrategy::NO_SHARD})
      for (bool offload : {false, true})
        for (auto prefetch : {fsdp::BackwardPrefetch::NO_PREFETCH, fsdp::BackwardPrefetch::BACKWARD_PRE}) {
          auto o = base(strategy);
          o.offload_params = offload;
          o.backward_prefetch = prefetch;
          fp32(std::string(fsdp::to_string(strategy)) + " offload=" + std::to_string(offload) + " prefetch=" + fsdp::to_string(prefetch), o);
        }
    for (int group = 1; group <= world_.size(); ++group) {
      if (world_.size() % group != 0) continue;
      auto o = base(ShardingStrategy::HYBRID_SHARD);
      o.shard_group_size = group;
      fp32("HYBRID_SHARD group " + std::to_string(group), o);
      o.overlap_grad_reduce = true;
      o.backward_prefetch = fsdp::BackwardPrefetch::BACKWARD_PRE;
      fp32("HYBRID_SHARD group " + std::to_string(group) + " overlap_grad_reduce prefetch", o);
    }
    for (auto strategy : {ShardingStrategy::FULL_SHARD, ShardingStrategy::NO_SHARD}) {
      auto o = base(strategy);
      o.overlap_grad_reduce = true;
      fp32(std::string(fsdp::to_string(strategy)) + " overlap_grad_reduce", o);
      o = base(strategy);
      o.activation_checkpointing = true;
      fp32(std::string(fsdp::to_string(strategy)) + " activation_checkpointing", o);
    }
    {
      auto o = base(ShardingStrategy::FULL_SHARD);
      o.mixed_precision = fsdp::MixedPrecision::bf16();
      const auto bf16 = train(o);
      bool close = bf16.losses.size() == ref.losses.size();
      for (std::size_t s = 0; close && s < ref.losses.size(); ++s) close = std::abs(bf16.losses[s] - ref.losses[s]) <= 0.05 * ref.losses[s] + 1e-3;
      report("FULL_SHARD bf16", close, "loss " + std::to_string(bf16.losses.back()) + " against fp32's " + std::to_string(ref.losses.back()));
    }
    {
      // Stopped after 2 steps (SHARDED checkpoint), resumed in a new model: the same bits as 4 steps.
      const auto o = base(ShardingStrategy::FULL_SHARD);
      std::string folder;
      if (world_.rank() == 0) {
        std::string pattern = (std::filesystem::temp_directory_path() / "fsdp_gpu_ckpt_XXXXXX").string();
        folder = mkdtemp(pattern.data());
      }
      folder = fsdp::broadcast_string(world_, folder);
      const auto whole = train(o);
      (void)train(o, 0, 2, "", folder);
      const auto resumed = train(o, 2, kSteps, saved_);
      report("FULL_SHARD checkpoint save, load and resume", bitwise_equal(resumed.params, whole.params), "resumed against uninterrupted");
      stage("after the resume case: barrier");
      world_.barrier();
      stage("removing the checkpoint folder");
      if (world_.rank() == 0) fsdp::remove_tree(folder);
      stage("leaving the resume case");
    }
    stage("summing the failures");
    int total = 0;
    world_.all_reduce(&failures_, &total, 1, fsdp::DType::kInt32, fsdp::ReduceOp::kSum);
    if (world_.rank() == 0)
      std::printf(total == 0 ? "engine on %s matches single-process training\n" : "engine on %s: %d failure(s)\n", device_.is_cuda() ? "CUDA" : "CPU",
                  total);
    return total == 0 ? 0 : 1;
  }

 private:
  FsdpOptions base(ShardingStrategy strategy) const {
    FsdpOptions o;
    o.sharding_strategy = strategy;
    o.auto_wrap_policy = fsdp::AutoWrapPolicy::module_types({"Linear"});
    o.device = device_;
    return o;
  }
  // A marker on stderr, flushed: where a crash without a usable stack happened (a GPU node's run).
  void stage(const char* where) const {
    std::fprintf(stderr, "stage (rank %d): %s\n", world_.rank(), where);
    std::fflush(stderr);
  }
  void report(const std::string& name, bool ok, const std::string& detail) {
    failures_ += ok ? 0 : 1;
    if (world_.rank() == 0) std::printf("%s np=%d %s: %s\n", ok ? "ok  " : "FAIL", world_.size(), name.c_str(), detail.c_str());
  }

  MpiComm world_;
  Comm comm_;
  torch::Device device_;
  std::string saved_;
  int failures_ = 0;
};

}  // namespace

int main(int argc, char** argv) {
  fsdp::MpiEnvironment env(&argc, &argv, MPI_THREAD_MULTIPLE);
  test_support::install_crash_report();  // after MPI_Init, whose handler prints no usable stack for a null call
  auto world = MpiComm::world();
  const bool on_cpu = argc > 1 && std::strcmp(argv[1], "--cpu") == 0;
  if (on_cpu) {
    arm_collective_deadline(world.rank());
    return Cases<MpiComm>(world, world, torch::Device(torch::kCPU)).run();
  }
  // Before CUDA starts: cuBLAS picks the same kernels run after run (the resume case compares bits).
  setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", 0);
  // Skip together: every rank must have a device, or none runs (no rank is left in a collective).
  const int devices = torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 0;
  const int local_rank = world.split_node().rank();
  // Each rank on its own device, as fsdp::choose_device picks them: all of a node's GPUs visible to
  // every rank (mpirun; as many as ranks on the node), or one per task (srun --gpus-per-task=1: each
  // task's CUDA_VISIBLE_DEVICES names another GPU). One GPU shown to two ranks is skipped, not failed.
  auto node = world.split_node();
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  std::array<char, 64> mine{};
  std::snprintf(mine.data(), mine.size(), "%s", devices == 1 && visible ? visible : (devices == 1 ? "all" : ""));
  std::vector<char> all(mine.size() * static_cast<std::size_t>(node.size()));
  node.all_gather(mine.data(), all.data(), static_cast<std::int64_t>(mine.size()), fsdp::DType::kUInt8);
  std::vector<std::string> seen;
  for (int r = 0; r < node.size(); ++r) seen.emplace_back(all.data() + static_cast<std::size_t>(r) * mine.size());
  const bool own_gpu = devices >= node.size() || (devices == 1 && !fsdp::first_shared_device(seen));
  int usable = own_gpu ? 1 : 0, all_usable = 0;
  world.all_reduce(&usable, &all_usable, 1, fsdp::DType::kInt32, fsdp::ReduceOp::kSum);
  if (all_usable != world.size()) {
    std::printf("rank %d: no CUDA device for every rank (%s): skipped\n", world.rank(),
                torch::cuda::is_available() ? "fewer GPUs than ranks on a node" : "this LibTorch has no CUDA or no GPU is visible");
    return 77;
  }
  arm_collective_deadline(world.rank());          // a rank left alone in an MPI collective ends the run
  at::globalContext().setAllowTF32CuBLAS(false);  // fp32 means fp32 for the 1e-5 bar
  at::globalContext().setAllowTF32CuDNN(false);
  at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);
  const int chosen = fsdp::choose_device(-1, local_rank, devices);
  const torch::Device device(torch::kCUDA, static_cast<c10::DeviceIndex>(chosen));
  fsdp::NcclOptions nccl;
  int rc = 0;
  {
    Cases<NcclComm> cases(world, NcclComm::from_mpi(world, nccl), device);
    rc = cases.run();
    std::fprintf(stderr, "stage (rank %d): destroying the NCCL communicator\n", world.rank());
  }
  std::fprintf(stderr, "stage (rank %d): finalizing MPI\n", world.rank());
  return rc;
}
