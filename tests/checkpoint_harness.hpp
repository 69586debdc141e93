// The checkpoint tests' shared part: the model (BatchNorm buffers, a tied weight, a 0-d parameter,
// dropout), training steps on each rank's slice, full state by name, and a temporary folder every rank
// knows.
#pragma once

#include <boost/test/unit_test.hpp>

#include <fsdp/fsdp.hpp>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "torch_common.hpp"
#include "fsdp/file_tree.hpp"

namespace F = torch::nn::functional;
namespace fs = std::filesystem;
using fsdp::AutoWrapPolicy;
using fsdp::FsdpOptions;
using fsdp::MpiComm;
using fsdp::ShardingStrategy;
using fsdp::StateDictType;

// ---- model ------------------------------------------------------------------------------------

/// Linear layers, BatchNorm buffers (one of them an int64 scalar), a tied weight, a 0-d parameter and
/// dropout (so a resume is exact only if the RNG state comes back too).
struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(11, 23));
    bn = register_module("bn", torch::nn::BatchNorm1d(23));
    fc2 = register_module("fc2", torch::nn::Linear(23, 23));
    tied = register_module("tied", TiedOut(fc1->weight));
    temperature = register_parameter("temperature", torch::tensor(1.5));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(fsdp::forward(bn, fsdp::forward(fc1, x)));
    x = F::dropout(x, F::DropoutFuncOptions().p(0.2).training(is_training()));
    x = torch::tanh(fsdp::forward(fc2, x));
    return fsdp::forward(tied, x) * temperature;
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
  TiedOut tied{nullptr};
  torch::Tensor temperature;
};
TORCH_MODULE(Net);

using Engine = fsdp::FullyShardedDataParallel<NetImpl, MpiComm>;

inline std::shared_ptr<NetImpl> make_net(int seed) {
  torch::manual_seed(seed);
  return Net().ptr();
}

inline FsdpOptions options_for(ShardingStrategy s, int world, bool wrap_linears) {
  FsdpOptions o;
  o.sharding_strategy = s;
  if (s == ShardingStrategy::HYBRID_SHARD || s == ShardingStrategy::HYBRID_SHARD_ZERO2) o.shard_group_size = world % 2 == 0 ? 2 : 1;
  o.auto_wrap_policy = wrap_linears ? AutoWrapPolicy::module_types({"Linear", "BatchNorm1d"}) : AutoWrapPolicy::none();
  return o;
}

inline const std::vector<ShardingStrategy> kStrategies = {ShardingStrategy::FULL_SHARD, ShardingStrategy::SHARD_GRAD_OP, ShardingStrategy::NO_SHARD,
                                                          ShardingStrategy::HYBRID_SHARD, ShardingStrategy::HYBRID_SHARD_ZERO2};

inline std::unique_ptr<torch::optim::Optimizer> make_adam(Engine& e) {
  return std::make_unique<torch::optim::Adam>(e.parameters(), torch::optim::AdamOptions(1e-2));
}

/// One optimizer step on this rank's slice of global batch `step` (seeded by the step only);
/// `before_update` (if any) runs between the backward and the optimizer step.
inline void train_step(Engine& model, torch::optim::Optimizer& opt, int step, const std::function<void()>& before_update = {}) {
  auto& comm = model.comm();
  auto gen = at::detail::createCPUGenerator(500 + step);
  const int64_t rows = 4;
  auto x = torch::randn({rows * comm.size(), 11}, gen).narrow(0, rows * comm.rank(), rows);
  auto y = torch::randn({rows * comm.size(), 11}, gen).narrow(0, rows * comm.rank(), rows);
  opt.zero_grad();
  F::mse_loss(model.forward(x), y).backward();
  if (before_update) before_update();
  opt.step();
}

/// Full parameters and full optimizer state by name ("fc1.weight", "optim/fc1.weight/exp_avg",
/// "optim/fc1.weight/step"). Collective.
inline std::map<std::string, torch::Tensor> full_state(Engine& model, torch::optim::Optimizer* opt) {
  std::map<std::string, torch::Tensor> out;
  for (auto& [name, t] : model.full_parameters()) out[name] = t;
  for (const auto& b : model.module()->named_buffers()) out["buffer/" + b.key()] = b.value().clone();
  if (!opt) return out;
  for (const auto& up : model.sharded_units()) {
    if (up.empty()) continue;
    const auto found = fsdp::detail::shard_optimizer_state(model, opt, up);  // shaped like the shard, every rank alike
    if (!found) continue;
    const auto& view = *found;
    for (const auto& [sname, t] : view.tensors) {
      const auto flat = model.gather_flat(up.index, t);
      for (std::size_t i = 0; i < up.param_names.size(); ++i) {
        const auto i64 = static_cast<int64_t>(i);
        out["optim/" + up.param_names[i] + "/" + sname] =
            flat.narrow(0, up.layout.param_offset(i64), up.layout.param_numel(i64)).view(up.shapes[i]).clone();
      }
    }
    for (const auto& n : up.param_names) out["optim/" + n + "/step"] = torch::tensor(view.step);
  }
  return out;
}

/// `state` with its buffers ("buffer/...") replaced by rank 0's. Collective.
inline std::map<std::string, torch::Tensor> with_rank0_buffers(MpiComm& comm, std::map<std::string, torch::Tensor> state) {
  for (auto& [name, t] : state) {
    if (name.rfind("buffer/", 0) != 0 || t.numel() == 0) continue;
    t = t.contiguous().clone();
    comm.broadcast(t.data_ptr(), t.numel(), fsdp::detail::to_comm_dtype(t.scalar_type()), 0);
  }
  return state;
}

inline void check_equal(const std::map<std::string, torch::Tensor>& expected, const std::map<std::string, torch::Tensor>& got,
                        const std::string& what) {
  BOOST_TEST_CONTEXT(what) {
    std::set<std::string> a, b;
    for (const auto& [k, v] : expected) a.insert(k);
    for (const auto& [k, v] : got) b.insert(k);
    BOOST_TEST((a == b), "same tensor names");
    for (const auto& [k, v] : expected) {
      const auto it = got.find(k);
      if (it == got.end()) continue;
      BOOST_TEST(torch::equal(v, it->second), k << " equal");
    }
  }
}

/// A fresh folder that every rank of `comm` knows; removed at the end of the test.
struct TempDir {
  explicit TempDir(MpiComm& comm) : comm_(comm) {
    std::string name;
    if (comm.rank() == 0) {
      std::string templ = (fs::temp_directory_path() / "fsdp_ckpt_XXXXXX").string();
      name = mkdtemp(templ.data());
    }
    path = fsdp::broadcast_string(comm, name);
  }
  ~TempDir() {
    comm_.barrier();
    if (comm_.rank() == 0) fsdp::remove_tree(path);
  }
  std::string operator/(const std::string& sub) const { return (fs::path(path) / sub).string(); }
  MpiComm& comm_;
  std::string path;
};
