// HDF5 checkpoints (run at np = 1..4): save with every strategy and load at every smaller world size
// and another strategy, FULL and LOCAL round trips, bit-exact resume, loading into a plain module,
// corrupt and truncated files, keep_last and the latest pointer.
#define BOOST_TEST_MODULE fsdp_checkpoint
#include <boost/test/unit_test.hpp>

#include <fsdp/fsdp.hpp>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <thread>

#include "torch_common.hpp"

namespace F = torch::nn::functional;
namespace fs = std::filesystem;
using fsdp::AutoWrapPolicy;
using fsdp::FsdpOptions;
using fsdp::MpiComm;
using fsdp::ShardingStrategy;
using fsdp::StateDictType;

using CheckpointFixture = TorchMpiFixture<>;
BOOST_TEST_GLOBAL_FIXTURE(CheckpointFixture);

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

std::shared_ptr<NetImpl> make_net(int seed) {
  torch::manual_seed(seed);
  return Net().ptr();
}

FsdpOptions options_for(ShardingStrategy s, int world, bool wrap_linears) {
  FsdpOptions o;
  o.sharding_strategy = s;
  if (s == ShardingStrategy::HYBRID_SHARD || s == ShardingStrategy::HYBRID_SHARD_ZERO2) o.shard_group_size = world % 2 == 0 ? 2 : 1;
  o.auto_wrap_policy = wrap_linears ? AutoWrapPolicy::module_types({"Linear", "BatchNorm1d"}) : AutoWrapPolicy::none();
  return o;
}

const std::vector<ShardingStrategy> kStrategies = {ShardingStrategy::FULL_SHARD, ShardingStrategy::SHARD_GRAD_OP, ShardingStrategy::NO_SHARD,
                                                   ShardingStrategy::HYBRID_SHARD, ShardingStrategy::HYBRID_SHARD_ZERO2};

std::unique_ptr<torch::optim::Optimizer> make_adam(Engine& e) {
  return std::make_unique<torch::optim::Adam>(e.parameters(), torch::optim::AdamOptions(1e-2));
}

/// One optimizer step on this rank's slice of global batch `step` (seeded by the step only).
void train_step(Engine& model, torch::optim::Optimizer& opt, int step) {
  auto& comm = model.comm();
  auto gen = at::detail::createCPUGenerator(500 + step);
  const int64_t rows = 4;
  auto x = torch::randn({rows * comm.size(), 11}, gen).narrow(0, rows * comm.rank(), rows);
  auto y = torch::randn({rows * comm.size(), 11}, gen).narrow(0, rows * comm.rank(), rows);
  opt.zero_grad();
  F::mse_loss(model.forward(x), y).backward();
  opt.step();
}

/// Full parameters and full optimizer state by name ("fc1.weight", "optim/fc1.weight/exp_avg",
/// "optim/fc1.weight/step"). Collective.
std::map<std::string, torch::Tensor> full_state(Engine& model, torch::optim::Optimizer* opt) {
  std::map<std::string, torch::Tensor> out;
  for (auto& [name, t] : model.full_parameters()) out[name] = t;
  for (const auto& b : model.module()->named_buffers()) out["buffer/" + b.key()] = b.value().clone();
  if (!opt) return out;
  for (const auto& up : model.flat_units()) {
    if (up->params.empty()) continue;
    const auto it = opt->state().find(fsdp::optimizer_state_key(up->shard));
    if (it == opt->state().end()) continue;
    const auto view = fsdp::optimizer_state_view(*it->second);
    for (const auto& [sname, t] : view.tensors) {
      const auto flat = model.gather_flat(up->info.index, t);
      for (std::size_t i = 0; i < up->params.size(); ++i) {
        const auto i64 = static_cast<int64_t>(i);
        out["optim/" + up->info.param_names[i] + "/" + sname] =
            flat.narrow(0, up->layout.param_offset(i64), up->layout.param_numel(i64)).view(up->shapes[i]).clone();
      }
    }
    for (const auto& n : up->info.param_names) out["optim/" + n + "/step"] = torch::tensor(view.step);
  }
  return out;
}

void check_equal(const std::map<std::string, torch::Tensor>& expected, const std::map<std::string, torch::Tensor>& got, const std::string& what) {
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
    path = fsdp::detail::broadcast_string(comm, name);
  }
  ~TempDir() {
    comm_.barrier();
    if (comm_.rank() == 0) fs::remove_all(path);
  }
  std::string operator/(const std::string& sub) const { return (fs::path(path) / sub).string(); }
  MpiComm& comm_;
  std::string path;
};

// ---- tests ------------------------------------------------------------------------------------

BOOST_AUTO_TEST_CASE(sharded_save_loads_at_every_smaller_world_size_and_other_strategies) {
  auto world = MpiComm::world();
  TempDir dir(world);
  for (std::size_t si = 0; si < kStrategies.size(); ++si) {
    const auto strategy = kStrategies[si];
    BOOST_TEST_CONTEXT("saved with " << strategy << " at world size " << world.size()) {
      auto model = fsdp::make_fsdp(make_net(3), world, options_for(strategy, world.size(), true));
      auto opt = make_adam(*model);
      for (int s = 0; s < 3; ++s) train_step(*model, *opt, s);
      const auto expected = full_state(*model, opt.get());
      fsdp::TrainState state;
      state.step = 3;
      state.epoch = 1;
      state.sample_index = 24;
      state.scheduler = {{"last_epoch", 3}, {"base_lr", 1e-2}};
      state.deck = "[run]\nname = \"t\"\n";
      const std::string sub = "s" + std::to_string(si);
      const auto saved = fsdp::save_checkpoint(*model, opt.get(), dir / sub, state);
      BOOST_TEST(saved.path == dir / (sub + "/step_00000003.h5"));
      BOOST_TEST(fs::exists(saved.path));

      for (int k = 1; k <= world.size(); ++k) {
        auto sub_comm = world.split(world.rank() < k ? 0 : 1, world.rank());
        if (world.rank() >= k) continue;
        const auto load_strategy = kStrategies[(si + static_cast<std::size_t>(k)) % kStrategies.size()];
        BOOST_TEST_CONTEXT("loaded with " << load_strategy << " at world size " << k) {
          auto loaded = fsdp::make_fsdp(make_net(99), sub_comm, options_for(load_strategy, k, k % 2 == 0));
          auto opt2 = make_adam(*loaded);
          fsdp::TrainState got;
          fsdp::load_checkpoint(*loaded, opt2.get(), saved.path, &got);
          check_equal(expected, full_state(*loaded, opt2.get()), "parameters, buffers and optimizer state");
          BOOST_TEST(got.step == 3);
          BOOST_TEST(got.epoch == 1);
          BOOST_TEST(got.sample_index == 24);
          BOOST_TEST(got.scheduler.at("base_lr") == 1e-2);
          BOOST_TEST(got.deck == state.deck);
          BOOST_TEST(got.rng_restored == (k == world.size()));
        }
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(full_state_dict_round_trip_rank0_only_and_every_rank) {
  auto world = MpiComm::world();
  TempDir dir(world);
  auto model = fsdp::make_fsdp(make_net(3), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), true));
  auto opt = make_adam(*model);
  for (int s = 0; s < 2; ++s) train_step(*model, *opt, s);
  const auto expected = full_state(*model, opt.get());
  fsdp::CheckpointOptions o;
  o.state_dict_type = StateDictType::FULL_STATE_DICT;
  const auto saved = fsdp::save_checkpoint(*model, opt.get(), dir.path, {.step = 2}, o);
  for (bool rank0_only : {true, false}) {
    BOOST_TEST_CONTEXT("rank0_only " << rank0_only) {
      auto loaded = fsdp::make_fsdp(make_net(5), world, options_for(ShardingStrategy::SHARD_GRAD_OP, world.size(), false));
      auto opt2 = make_adam(*loaded);
      o.rank0_only = rank0_only;
      fsdp::load_checkpoint(*loaded, opt2.get(), saved.path, nullptr, o);
      check_equal(expected, full_state(*loaded, opt2.get()), "full round trip");
    }
  }
}

BOOST_AUTO_TEST_CASE(local_state_dict_same_plan_only) {
  auto world = MpiComm::world();
  TempDir dir(world);
  auto model = fsdp::make_fsdp(make_net(3), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), true));
  auto opt = make_adam(*model);
  train_step(*model, *opt, 0);
  const auto expected = full_state(*model, opt.get());
  fsdp::CheckpointOptions o;
  o.state_dict_type = StateDictType::LOCAL_STATE_DICT;
  const auto saved = fsdp::save_checkpoint(*model, opt.get(), dir.path, {.step = 1}, o);
  BOOST_TEST(fs::is_directory(saved.path));
  BOOST_TEST(fs::exists(fs::path(saved.path) / fsdp::ckpt::local_rank_file(world.rank())));
  // SHARD_GRAD_OP shards exactly like FULL_SHARD: same plan.
  auto same = fsdp::make_fsdp(make_net(8), world, options_for(ShardingStrategy::SHARD_GRAD_OP, world.size(), true));
  auto opt2 = make_adam(*same);
  fsdp::load_checkpoint(*same, opt2.get(), saved.path, nullptr, o);
  check_equal(expected, full_state(*same, opt2.get()), "local round trip");
  // Another wrapping is another plan: refused on every rank, naming the plan.
  auto other = fsdp::make_fsdp(make_net(8), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), false));
  auto opt3 = make_adam(*other);
  const auto before = full_state(*other, nullptr);
  try {
    fsdp::load_checkpoint(*other, opt3.get(), saved.path, nullptr, o);
    BOOST_ERROR("loading a LOCAL checkpoint into another plan must fail");
  } catch (const fsdp::CheckpointError& e) {
    const std::string what = e.what();
    BOOST_TEST(what.find("plan") != std::string::npos, what);
    BOOST_TEST(what.find("rank_0000") != std::string::npos, what);
  }
  check_equal(before, full_state(*other, nullptr), "a refused load changes nothing");
}

BOOST_AUTO_TEST_CASE(resume_is_bit_exact) {
  auto world = MpiComm::world();
  for (auto type : {StateDictType::SHARDED_STATE_DICT, StateDictType::FULL_STATE_DICT, StateDictType::LOCAL_STATE_DICT}) {
    BOOST_TEST_CONTEXT(fsdp::to_string(type)) {
      TempDir dir(world);
      torch::manual_seed(1234 + world.rank());  // dropout draws differ per rank, as in a real run
      auto straight = fsdp::make_fsdp(make_net(3), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), true));
      auto opt = make_adam(*straight);
      torch::manual_seed(1234 + world.rank());
      for (int s = 0; s < 10; ++s) train_step(*straight, *opt, s);
      const auto expected = full_state(*straight, opt.get());

      fsdp::CheckpointOptions o;
      o.state_dict_type = type;
      {
        auto first = fsdp::make_fsdp(make_net(3), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), true));
        auto opt1 = make_adam(*first);
        torch::manual_seed(1234 + world.rank());
        for (int s = 0; s < 5; ++s) train_step(*first, *opt1, s);
        fsdp::save_checkpoint(*first, opt1.get(), dir.path, {.step = 5, .epoch = 0, .sample_index = 5}, o);
      }
      torch::manual_seed(777);  // the restarted job's RNG starts elsewhere
      auto second = fsdp::make_fsdp(make_net(42), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), true));
      auto opt2 = make_adam(*second);
      fsdp::TrainState state;
      const auto resumed = fsdp::resume_from_latest(*second, opt2.get(), dir.path, &state, o);
      BOOST_TEST(resumed.path == dir / "step_00000005.h5");
      BOOST_TEST(resumed.skipped.empty());
      BOOST_TEST(state.rng_restored);
      for (auto s = state.step; s < 10; ++s) train_step(*second, *opt2, static_cast<int>(s));
      check_equal(expected, full_state(*second, opt2.get()), "10 steps straight == 5 + save + load + 5");
    }
  }
}

BOOST_AUTO_TEST_CASE(full_file_loads_into_a_plain_module) {
  auto world = MpiComm::world();
  TempDir dir(world);
  auto model = fsdp::make_fsdp(make_net(3), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), true));
  auto opt = make_adam(*model);
  for (int s = 0; s < 2; ++s) train_step(*model, *opt, s);
  model->eval();
  const auto x = torch::randn({5, 11}, at::detail::createCPUGenerator(9));
  torch::Tensor fsdp_out;
  {
    torch::NoGradGuard ng;
    fsdp_out = model->forward(x);
  }
  fsdp::CheckpointOptions full;
  full.state_dict_type = StateDictType::FULL_STATE_DICT;
  const auto full_path = fsdp::save_checkpoint(*model, opt.get(), dir / "full", {.step = 2}, full).path;
  const auto sharded_path = fsdp::save_checkpoint(*model, opt.get(), dir / "sharded", {.step = 2}).path;
  if (world.rank() == 0) {
    for (const auto& path : {full_path, sharded_path}) {
      auto plain = make_net(11);
      fsdp::load_full_state_dict(*plain, path);
      plain->eval();
      torch::NoGradGuard ng;
      BOOST_TEST(torch::equal(plain->forward(x), fsdp_out), path);
    }
    // Strict checks name every problem and change nothing.
    struct Other : torch::nn::Module {
      Other() {
        register_module("fc1", torch::nn::Linear(11, 23));
        register_module("fc9", torch::nn::Linear(4, 4));
        register_module("fc2", torch::nn::Linear(23, 7));
      }
    } other;
    try {
      fsdp::load_full_state_dict(other, full_path);
      BOOST_ERROR("a different module must be refused");
    } catch (const fsdp::CheckpointError& e) {
      const std::string what = e.what();
      BOOST_TEST(what.find("missing fc9.weight") != std::string::npos, what);
      BOOST_TEST(what.find("unexpected bn.running_mean") != std::string::npos, what);
      BOOST_TEST(what.find("mismatched fc2.weight (file [23, 23] float32, module [7, 23] float32)") != std::string::npos, what);
    }
  }
  world.barrier();
}

/// Flips one byte inside the stored data of dataset `name` (its first chunk).
void flip_byte_in_dataset(const std::string& file, const std::string& name) {
  haddr_t addr = 0;
  {
    hid_t f = H5Fopen(file.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
    hid_t d = H5Dopen2(f, name.c_str(), H5P_DEFAULT);
    hid_t space = H5Dget_space(d);
    unsigned mask = 0;
    hsize_t size = 0;
    std::vector<hsize_t> offset(8, 0);
    BOOST_REQUIRE(H5Dget_chunk_info(d, space, 0, offset.data(), &mask, &addr, &size) >= 0);
    H5Sclose(space);
    H5Dclose(d);
    H5Fclose(f);
  }
  std::fstream io(file, std::ios::in | std::ios::out | std::ios::binary);
  io.seekg(static_cast<std::streamoff>(addr + 8));
  char c = 0;
  io.read(&c, 1);
  c = static_cast<char>(c ^ 0x40);
  io.seekp(static_cast<std::streamoff>(addr + 8));
  io.write(&c, 1);
}

BOOST_AUTO_TEST_CASE(corrupt_and_truncated_files_are_refused_and_resume_falls_back) {
  auto world = MpiComm::world();
  TempDir dir(world);
  auto model = fsdp::make_fsdp(make_net(3), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), true));
  auto opt = make_adam(*model);
  train_step(*model, *opt, 0);
  fsdp::save_checkpoint(*model, opt.get(), dir.path, {.step = 1});
  const auto at_step1 = full_state(*model, opt.get());
  train_step(*model, *opt, 1);
  const auto step2 = fsdp::save_checkpoint(*model, opt.get(), dir.path, {.step = 2}).path;
  const std::string truncated = dir / "truncated.h5", flipped = dir / "flipped.h5";
  if (world.rank() == 0) {
    fs::copy_file(step2, truncated);
    fs::resize_file(truncated, fs::file_size(truncated) / 2);
    fs::copy_file(step2, flipped);
    flip_byte_in_dataset(flipped, "/model/fc2.weight");
  }
  world.barrier();
  auto fresh = fsdp::make_fsdp(make_net(4), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), true));
  auto opt2 = make_adam(*fresh);
  const auto before = full_state(*fresh, nullptr);
  for (const auto& [path, expect] : std::vector<std::pair<std::string, std::string>>{{truncated, "truncated.h5"}, {flipped, "/model/fc2.weight"}}) {
    try {
      fsdp::load_checkpoint(*fresh, opt2.get(), path);
      BOOST_ERROR(path << " must be refused");
    } catch (const fsdp::CheckpointError& e) {
      const std::string what = e.what();
      BOOST_TEST(what.find(expect) != std::string::npos, what);
    }
  }
  check_equal(before, full_state(*fresh, nullptr), "refused loads change nothing");
  // Corrupt the newest checkpoint itself: resume falls back to step 1 and says why.
  world.barrier();
  if (world.rank() == 0) flip_byte_in_dataset(step2, "/model/fc2.weight");
  world.barrier();
  fsdp::TrainState state;
  const auto resumed = fsdp::resume_from_latest(*fresh, opt2.get(), dir.path, &state);
  BOOST_TEST(resumed.path == dir / "step_00000001.h5");
  BOOST_REQUIRE(resumed.skipped.size() == 1u);
  BOOST_TEST(resumed.skipped[0].find("step_00000002.h5") == 0u, resumed.skipped[0]);
  BOOST_TEST(state.step == 1);
  check_equal(at_step1, full_state(*fresh, opt2.get()), "fell back to step 1");
}

BOOST_AUTO_TEST_CASE(latest_pointer_and_keep_last) {
  auto world = MpiComm::world();
  TempDir dir(world);
  auto model = fsdp::make_fsdp(make_net(3), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), true));
  fsdp::CheckpointOptions o;
  o.keep_last = 2;
  for (int step = 1; step <= 4; ++step) {
    const auto r = fsdp::save_checkpoint(*model, nullptr, dir.path, {.step = step}, o);
    BOOST_TEST(fsdp::ckpt::read_latest(dir.path).value() == fsdp::ckpt::checkpoint_name(step));
    if (step >= 3 && world.rank() == 0) BOOST_TEST(r.pruned == std::vector<std::string>{fsdp::ckpt::checkpoint_name(step - 2)});
  }
  world.barrier();
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(dir.path)) names.insert(e.path().filename().string());
  BOOST_TEST((names == std::set<std::string>{"latest", "step_00000003.h5", "step_00000004.h5"}));
  world.barrier();
}

BOOST_AUTO_TEST_CASE(h5dump_reads_the_schema) {
  auto world = MpiComm::world();
  TempDir dir(world);
  auto model = fsdp::make_fsdp(make_net(3), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), true));
  auto opt = make_adam(*model);
  train_step(*model, *opt, 0);
  const auto path = fsdp::save_checkpoint(*model, opt.get(), dir.path, {.step = 1, .deck = "x = 1"}).path;
  if (world.rank() == 0) {
    std::string out;
    FILE* pipe = popen(("h5dump -A " + path + " 2>&1").c_str(), "r");
    BOOST_REQUIRE(pipe);
    char buf[4096];
    while (std::size_t n = fread(buf, 1, sizeof buf, pipe)) out.append(buf, n);
    BOOST_TEST(pclose(pipe) == 0, out.substr(0, 2000));
    for (const char* expected : {"GROUP \"model\"", "DATASET \"fc1.weight\"", "DATASET \"tied.weight\"", "DATASET \"bn.running_mean\"",
                                 "GROUP \"optim\"", "DATASET \"exp_avg_sq\"", "ATTRIBUTE \"plan_hash\"", "\"fsdp-checkpoint\"",
                                 "\"SHARDED_STATE_DICT\"", "GROUP \"rng\"", "ATTRIBUTE \"sample_index\""})
      BOOST_TEST(out.find(expected) != std::string::npos, expected);
    // The weights themselves, verified (Fletcher32) by h5dump.
    pipe = popen(("h5dump -d /model/fc1.weight " + path + " 2>&1").c_str(), "r");
    out.clear();
    while (std::size_t n = fread(buf, 1, sizeof buf, pipe)) out.append(buf, n);
    BOOST_TEST(pclose(pipe) == 0, out.substr(0, 2000));
    BOOST_TEST(out.find("DATASPACE  SIMPLE { ( 23, 11 ) / ( 23, 11 ) }") != std::string::npos, out.substr(0, 400));
  }
  world.barrier();
}

BOOST_AUTO_TEST_CASE(save_on_some_ranks_only_is_reported_not_a_hang) {
  auto world = MpiComm::world();
  TempDir dir(world);
  auto model = fsdp::make_fsdp(make_net(3), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), true));
  if (world.size() == 1) {
    BOOST_TEST(fsdp::save_checkpoint(*model, nullptr, dir.path, {.step = 1}).bytes > 0);
    return;
  }
  fsdp::CheckpointOptions o;
  o.collective_timeout_s = 1;
  if (world.rank() == 0) {
    try {
      fsdp::save_checkpoint(*model, nullptr, dir.path, {.step = 1}, o);
      BOOST_ERROR("a save on rank 0 alone must fail");
    } catch (const fsdp::CommError& e) {
      const std::string what = e.what();
      BOOST_TEST(what.find("fsdp.comm.deadline") != std::string::npos, what);
      BOOST_TEST(what.find("save_checkpoint") != std::string::npos, what);
    }
    BOOST_TEST(!fs::exists(dir / "latest"));
  } else {
    std::this_thread::sleep_for(std::chrono::seconds(2));
    world.barrier_within(60, "matching the abandoned barrier");  // completes rank 0's pending one
  }
}

/// Edge cases: a root unit without parameters (every layer wrapped), a bool and an int buffer, an
/// empty parameter, fp64 parameters, a frozen parameter.
struct EdgeImpl : torch::nn::Module {
  explicit EdgeImpl(bool with_empty = true) {
    a = register_module("a", torch::nn::Linear(5, 7));
    b = register_module("b", torch::nn::Linear(7, 3));
    a->to(torch::kDouble);
    b->to(torch::kDouble);
    b->bias.set_requires_grad(false);  // a frozen parameter: saved and loaded, no optimizer state
    empty = with_empty ? register_parameter("empty", torch::zeros({0, 4}, torch::kDouble)) : torch::zeros({0}, torch::kDouble);
    mask = register_buffer("mask", torch::tensor({true, false, true}));
    counter = register_buffer("counter", torch::tensor({7, 8}, torch::kLong));
  }
  torch::Tensor forward(torch::Tensor x) { return fsdp::forward(b, torch::tanh(fsdp::forward(a, x))) * mask.to(torch::kDouble) + empty.sum(); }
  torch::nn::Linear a{nullptr}, b{nullptr};
  torch::Tensor empty, mask, counter;
};
TORCH_MODULE(Edge);

BOOST_AUTO_TEST_CASE(edge_cases_round_trip_in_every_kind) {
  auto world = MpiComm::world();
  TempDir dir(world);
  auto make = [&](int seed) {
    torch::manual_seed(seed);
    auto net = Edge().ptr();
    FsdpOptions o;
    o.auto_wrap_policy = AutoWrapPolicy::module_types({"Linear"});
    o.sync_buffers = false;  // the bool buffer cannot be averaged
    return fsdp::make_fsdp(net, world, o);
  };
  auto model = make(1);
  BOOST_TEST(model->flat_units()[0]->params.size() == 1u);  // only the empty parameter stays in the root
  auto opt = std::make_unique<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  auto x = torch::randn({4, 5}, torch::kDouble);
  opt->zero_grad();
  model->forward(x).sum().backward();
  opt->step();
  std::map<std::string, torch::Tensor> expected;
  for (auto& [n, t] : model->full_parameters()) expected[n] = t;
  for (auto type : {StateDictType::SHARDED_STATE_DICT, StateDictType::FULL_STATE_DICT, StateDictType::LOCAL_STATE_DICT}) {
    BOOST_TEST_CONTEXT(fsdp::to_string(type)) {
      fsdp::CheckpointOptions o;
      o.state_dict_type = type;
      o.keep_last = 1;
      // The same step twice: the second save replaces the first (LOCAL: an atomic folder swap).
      fsdp::save_checkpoint(*model, opt.get(), dir / fsdp::to_string(type), {.step = 1}, o);
      const auto saved = fsdp::save_checkpoint(*model, opt.get(), dir / fsdp::to_string(type), {.step = 1}, o);
      auto loaded = make(2);
      {
        torch::NoGradGuard ng;
        loaded->module()->mask.fill_(false);
        loaded->module()->counter.fill_(0);
      }
      auto opt2 = std::make_unique<torch::optim::SGD>(loaded->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      fsdp::load_checkpoint(*loaded, opt2.get(), saved.path, nullptr, o);
      for (auto& [n, t] : loaded->full_parameters()) BOOST_TEST(torch::equal(expected.at(n), t), n);
      BOOST_TEST(torch::equal(loaded->module()->mask, torch::tensor({true, false, true})));
      BOOST_TEST(torch::equal(loaded->module()->counter, torch::tensor({7, 8}, torch::kLong)));
      if (type != StateDictType::LOCAL_STATE_DICT && world.rank() == 0) {
        auto plain = Edge();
        fsdp::load_full_state_dict(*plain, saved.path);
        BOOST_TEST(torch::equal(plain->a->weight, expected.at("a.weight")));
        BOOST_TEST(torch::equal(plain->mask, torch::tensor({true, false, true})));
      }
      world.barrier();
    }
  }
}

BOOST_AUTO_TEST_CASE(a_root_unit_without_parameters_round_trips) {
  auto world = MpiComm::world();
  TempDir dir(world);
  auto make = [&](int seed) {
    torch::manual_seed(seed);
    FsdpOptions o;
    o.auto_wrap_policy = AutoWrapPolicy::module_types({"Linear"});
    o.sync_buffers = false;
    return fsdp::make_fsdp(std::make_shared<EdgeImpl>(false), world, o);
  };
  auto model = make(1);
  BOOST_TEST(model->flat_units()[0]->params.empty());
  for (auto type : {StateDictType::SHARDED_STATE_DICT, StateDictType::FULL_STATE_DICT, StateDictType::LOCAL_STATE_DICT}) {
    fsdp::CheckpointOptions o;
    o.state_dict_type = type;
    const auto saved = fsdp::save_checkpoint(*model, nullptr, dir / fsdp::to_string(type), {.step = 3}, o);
    auto loaded = make(2);
    fsdp::load_checkpoint(*loaded, nullptr, saved.path, nullptr, o);
    const auto a = model->full_parameters(), b = loaded->full_parameters();
    for (std::size_t i = 0; i < a.size(); ++i) BOOST_TEST(torch::equal(a[i].second, b[i].second), fsdp::to_string(type) << " " << a[i].first);
  }
}

BOOST_AUTO_TEST_CASE(checkpoints_newer_than_latest_are_neither_loaded_nor_pruned) {
  auto world = MpiComm::world();
  TempDir dir(world);
  auto model = fsdp::make_fsdp(make_net(3), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), true));
  fsdp::CheckpointOptions o;
  o.keep_last = 1;
  for (int step : {10, 20}) fsdp::save_checkpoint(*model, nullptr, dir.path, {.step = step}, o);
  // A restart from step 5 of another run: its saves must not delete or load step 20.
  fsdp::save_checkpoint(*model, nullptr, dir.path, {.step = 5}, o);
  fsdp::save_checkpoint(*model, nullptr, dir.path, {.step = 6}, o);
  world.barrier();
  BOOST_TEST(fs::exists(dir / "step_00000020.h5"));
  BOOST_TEST(!fs::exists(dir / "step_00000005.h5"));
  fsdp::TrainState state;
  const auto r = fsdp::resume_from_latest(*model, nullptr, dir.path, &state);
  BOOST_TEST(r.path == dir / "step_00000006.h5");
  BOOST_TEST(state.step == 6);
  BOOST_REQUIRE(r.skipped.size() == 1u);
  BOOST_TEST(r.skipped[0].find("step_00000020.h5: newer than latest") == 0u, r.skipped[0]);
}

BOOST_AUTO_TEST_CASE(a_failure_on_one_rank_in_the_middle_of_a_save_fails_every_rank) {
  auto world = MpiComm::world();
  TempDir dir(world);
  auto model = fsdp::make_fsdp(make_net(3), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), true));
  auto opt = make_adam(*model);
  train_step(*model, *opt, 0);
  fsdp::save_checkpoint(*model, opt.get(), dir.path, {.step = 1});
  const int victim = world.size() - 1;
  for (auto type : {StateDictType::SHARDED_STATE_DICT, StateDictType::FULL_STATE_DICT, StateDictType::LOCAL_STATE_DICT}) {
    fsdp::CheckpointOptions o;
    o.state_dict_type = type;
    o.on_stage = [&](const std::string& stage, std::int64_t) {
      if (stage == "writing" && world.rank() == victim) throw std::runtime_error("disk full (simulated)");
    };
    try {
      fsdp::save_checkpoint(*model, opt.get(), dir.path, {.step = 2}, o);
      BOOST_ERROR(fsdp::to_string(type) << ": the save must fail on every rank");
    } catch (const fsdp::CheckpointError& e) {
      const std::string what = e.what();
      BOOST_TEST(what.find("disk full (simulated)") != std::string::npos, what);
    }
    BOOST_TEST(fsdp::ckpt::read_latest(dir.path).value() == "step_00000001.h5");
    BOOST_TEST(!fs::exists(dir / "step_00000002.h5"));
  }
}

BOOST_AUTO_TEST_CASE(resume_stops_at_a_checkpoint_of_another_run) {
  auto world = MpiComm::world();
  TempDir dir(world);
  auto model = fsdp::make_fsdp(make_net(3), world, options_for(ShardingStrategy::FULL_SHARD, world.size(), true));
  auto adam = make_adam(*model);
  train_step(*model, *adam, 0);
  fsdp::save_checkpoint(*model, adam.get(), dir.path, {.step = 1});
  // Readable, but written with another optimizer: not skipped (that would start a second run in the
  // same folder), an error on every rank.
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  try {
    fsdp::resume_from_latest(*model, &sgd, dir.path);
    BOOST_ERROR("resuming with another optimizer must fail");
  } catch (const fsdp::CheckpointError& e) {
    const std::string what = e.what();
    BOOST_TEST(e.id() == "fsdp.ckpt.mismatch");
    BOOST_TEST(what.find("holds Adam state but the optimizer is SGD") != std::string::npos, what);
    BOOST_TEST(what.find("(reported by rank") == std::string::npos, what);  // every rank found it
  }
}
