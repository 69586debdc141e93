// The engine's equivalence test on CUDA tensors with NcclComm (label gpu; docs/gpu.md): every strategy,
// with and without CPU offload and prefetching, must give the parameters of single-process training on
// the same global batch on the same device (fp32, relative error <= 1e-5). Needs a CUDA-enabled
// LibTorch, NCCL and one GPU per rank; otherwise every rank says why and exits 77 (skipped).
//   mpirun -np 2 build/bin/test_engine_gpu
#include <fsdp/comm/nccl_comm.hpp>
#include <fsdp/fsdp.hpp>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "collective_deadline.hpp"

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

std::map<std::string, torch::Tensor> reference(int world, const torch::Device& device) {
  auto net = make_net(device);
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step, kLocalRows * world, device);
    opt.zero_grad();
    torch::nn::functional::cross_entropy(net->forward(x), y).backward();
    opt.step();
  }
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : net->named_parameters()) out[p.key()] = p.value().detach().cpu();
  return out;
}

double worst_error(MpiComm& world, const NcclComm& comm, const torch::Device& device, const FsdpOptions& options,
                   const std::map<std::string, torch::Tensor>& ref) {
  auto net = make_net(device);
  auto model = fsdp::make_fsdp(net, comm, options);
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
  const int r = world.rank(), n = world.size();
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step, kLocalRows * n, device);
    opt.zero_grad();
    torch::nn::functional::cross_entropy(model->forward(x.narrow(0, r * kLocalRows, kLocalRows)), y.narrow(0, r * kLocalRows, kLocalRows)).backward();
    opt.step();
  }
  double worst = 0;
  for (auto& [name, t] : model->full_parameters()) {
    const auto& want = ref.at(name);
    worst = std::max(worst, (t.cpu() - want).norm().item<double>() / std::max(want.norm().item<double>(), 1e-12));
  }
  return worst;
}

}  // namespace

int main(int argc, char** argv) {
  fsdp::MpiEnvironment env(&argc, &argv, MPI_THREAD_MULTIPLE);
  auto world = MpiComm::world();
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
  const int chosen = fsdp::choose_device(-1, local_rank, devices);
  const torch::Device device(torch::kCUDA, static_cast<c10::DeviceIndex>(chosen));
  fsdp::NcclOptions nccl;
  const auto comm = NcclComm::from_mpi(world, nccl);
  const auto ref = reference(world.size(), device);

  int failures = 0;
  for (auto strategy : {ShardingStrategy::FULL_SHARD, ShardingStrategy::SHARD_GRAD_OP, ShardingStrategy::NO_SHARD}) {
    for (bool offload : {false, true}) {
      for (auto prefetch : {fsdp::BackwardPrefetch::NO_PREFETCH, fsdp::BackwardPrefetch::BACKWARD_PRE}) {
        FsdpOptions options;
        options.sharding_strategy = strategy;
        options.auto_wrap_policy = fsdp::AutoWrapPolicy::module_types({"Linear"});
        options.device = device;
        options.offload_params = offload;
        options.backward_prefetch = prefetch;
        const double err = worst_error(world, comm, device, options, ref);
        const bool ok = err <= 1e-5;
        failures += ok ? 0 : 1;
        if (world.rank() == 0)
          std::printf("%s np=%d %s offload=%d prefetch=%s: relative error %.3g\n", ok ? "ok  " : "FAIL", world.size(), fsdp::to_string(strategy),
                      offload ? 1 : 0, fsdp::to_string(prefetch), err);
      }
    }
  }
  int total = 0;
  world.all_reduce(&failures, &total, 1, fsdp::DType::kInt32, fsdp::ReduceOp::kSum);
  if (world.rank() == 0) std::printf(total == 0 ? "engine on CUDA matches single-process training\n" : "engine on CUDA: %d failure(s)\n", total);
  return total == 0 ? 0 : 1;
}
