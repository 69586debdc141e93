// safetensors files of a sharded model (part of test_checkpoint, run at np = 1..4): every rank writes its own slices and the
// file reads back bit for bit, loads at another strategy and world layout, exports in bf16, and bad
// files fail on every rank naming the tensor or offset, leaving the model unchanged.
#include <boost/test/unit_test.hpp>

#include "torch_common.hpp"

#include <fsdp/fsdp.hpp>
#include <fsdp/io/safetensors.hpp>
#include <fsdp/io/safetensors_export.hpp>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>

namespace fs = std::filesystem;
using fsdp::AutoWrapPolicy;
using fsdp::FsdpOptions;
using fsdp::MpiComm;
using fsdp::ShardingStrategy;

namespace safetensors_tests {

struct TiedHeadImpl : torch::nn::Module {
  explicit TiedHeadImpl(torch::Tensor shared) { weight = register_parameter("weight", std::move(shared)); }
  torch::Tensor weight;
};
TORCH_MODULE(TiedHead);

/// An embedding tied to the output head, nested linears of odd sizes, a BatchNorm's buffers (one an
/// int64 scalar) and a 0-d parameter.
struct NetImpl : torch::nn::Module {
  NetImpl() {
    emb = register_module("emb", torch::nn::Embedding(13, 7));
    fc1 = register_module("fc1", torch::nn::Linear(7, 11));
    bn = register_module("bn", torch::nn::BatchNorm1d(11));
    fc2 = register_module("fc2", torch::nn::Linear(11, 7));
    head = register_module("head", TiedHead(emb->weight));
    scale = register_parameter("scale", torch::tensor(0.5));
    torch::NoGradGuard no_grad;
    bn->running_mean.uniform_();  // buffers that differ from their defaults
    bn->running_var.uniform_(1, 2);
    bn->num_batches_tracked.fill_(7);
  }
  torch::nn::Embedding emb{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
  TiedHead head{nullptr};
  torch::Tensor scale;
};
TORCH_MODULE(Net);

auto make_engine(std::uint64_t seed, ShardingStrategy strategy, int group = 0) {
  torch::manual_seed(seed);
  Net net;
  FsdpOptions options;
  options.sharding_strategy = strategy;
  options.shard_group_size = group;
  options.auto_wrap_policy = AutoWrapPolicy::module_types({"Linear", "TiedHead"});
  return fsdp::make_fsdp(net, MpiComm::world(), options);
}

/// A folder every rank sees, new for each test.
std::string shared_dir(const std::string& test) {
  const auto dir = fs::path("safetensors_np" + std::to_string(MpiComm::world().size())) / test;
  if (MpiComm::world().rank() == 0) {
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  MpiComm::world().barrier();
  return dir.string();
}

/// Every tensor of the file, read with the format parser alone (no engine).
std::map<std::string, torch::Tensor> read_all(const std::string& path) {
  const auto header = fsdp::safetensors::read_header(path);
  std::ifstream in(path, std::ios::binary);
  std::map<std::string, torch::Tensor> out;
  for (const auto& e : header.tensors) {
    const auto dtype = *fsdp::torch_dtype_of_safetensors(e.dtype);
    auto t = torch::empty(e.shape, torch::TensorOptions().dtype(dtype));
    in.seekg(header.data_start + e.begin);
    in.read(static_cast<char*>(t.data_ptr()), e.end - e.begin);
    out[e.name] = t;
  }
  return out;
}

template <class Engine>
std::map<std::string, torch::Tensor> full_state(Engine& engine) {
  std::map<std::string, torch::Tensor> out;
  for (auto& [name, t] : engine->full_parameters()) out[name] = t;
  for (const auto& b : engine->module()->named_buffers()) out[b.key()] = b.value().clone();
  return out;
}

void check_equal(const std::map<std::string, torch::Tensor>& got, const std::map<std::string, torch::Tensor>& want) {
  BOOST_TEST(got.size() == want.size());
  for (const auto& [name, t] : want) {
    const auto it = got.find(name);
    BOOST_TEST_REQUIRE((it != got.end()), "tensor " << name << " missing");
    BOOST_TEST((it->second.sizes() == t.sizes()), "shape of " << name);
    BOOST_TEST((it->second.scalar_type() == t.scalar_type()), "dtype of " << name);
    BOOST_TEST(torch::equal(it->second, t), "values of " << name);
  }
}

/// Runs `f` expecting a CheckpointError on this rank whose text contains `expected`.
template <class F>
void expect_error(F&& f, const std::string& expected) {
  try {
    f();
    BOOST_FAIL("no error; expected one containing: " << expected);
  } catch (const fsdp::CheckpointError& e) {
    BOOST_TEST(std::string(e.what()).find(expected) != std::string::npos, "message: " << e.what());
  }
}

}  // namespace safetensors_tests

using namespace safetensors_tests;

BOOST_AUTO_TEST_CASE(every_rank_writes_its_slices_and_the_file_reads_back_bit_for_bit) {
  const auto dir = shared_dir("roundtrip");
  auto engine = make_engine(1, ShardingStrategy::FULL_SHARD);
  const auto path = dir + "/model.safetensors";
  const auto result = fsdp::save_safetensors(*engine, path);
  BOOST_TEST(fs::file_size(path) == static_cast<std::uintmax_t>(result.bytes));
  BOOST_TEST(!fs::exists(dir + "/.model.safetensors.tmp"));
  const auto want = full_state(engine);
  const auto got = read_all(path);  // every rank reads the whole file
  check_equal(got, want);
  BOOST_TEST(got.count("emb.weight") == 1u);
  BOOST_TEST(got.count("head.weight") == 0u);  // a tied tensor is stored once, under its first name
  const auto header = fsdp::safetensors::read_header(path);
  BOOST_TEST(header.data_start % 8 == 0);
  BOOST_TEST(header.metadata.at("format") == "pt");
}

BOOST_AUTO_TEST_CASE(loads_at_another_strategy_reading_only_its_own_bytes) {
  const auto dir = shared_dir("strategies");
  const int world = MpiComm::world().size();
  auto saved = make_engine(2, ShardingStrategy::SHARD_GRAD_OP);
  fsdp::save_safetensors(*saved, dir + "/model.safetensors");
  const auto want = full_state(saved);
  std::vector<std::pair<ShardingStrategy, int>> targets = {{ShardingStrategy::FULL_SHARD, 0}, {ShardingStrategy::NO_SHARD, 0}};
  if (world % 2 == 0) targets.push_back({ShardingStrategy::HYBRID_SHARD, 2});
  for (const auto& [strategy, group] : targets) {
    BOOST_TEST_CONTEXT("strategy " << fsdp::to_string(strategy)) {
      auto loaded = make_engine(99, strategy, group);
      const auto result = fsdp::load_safetensors(*loaded, dir + "/model.safetensors");
      BOOST_TEST(result.missing.empty());
      BOOST_TEST(result.unexpected.empty());
      check_equal(full_state(loaded), want);
      // Each rank read its share of the parameters, not the whole file.
      std::int64_t param_bytes = 0;
      for (const auto& [name, t] : loaded->full_parameters()) param_bytes += t.numel() * 4;
      if (strategy == ShardingStrategy::FULL_SHARD && world > 1) BOOST_TEST(result.bytes_read < param_bytes);
    }
  }
}

BOOST_AUTO_TEST_CASE(bf16_export_holds_the_rounded_values) {
  const auto dir = shared_dir("bf16");
  auto engine = make_engine(3, ShardingStrategy::FULL_SHARD);
  fsdp::SafetensorsSaveOptions options;
  options.dtype = torch::kBFloat16;
  fsdp::save_safetensors(*engine, dir + "/model.safetensors", options);
  const auto header = fsdp::safetensors::read_header(dir + "/model.safetensors");
  BOOST_TEST(header.find("fc1.weight")->dtype == "BF16");
  BOOST_TEST(header.find("bn.num_batches_tracked")->dtype == "I64");  // integers keep their dtype
  const auto got = read_all(dir + "/model.safetensors");
  for (auto& [name, t] : full_state(engine)) BOOST_TEST(torch::equal(got.at(name), t.is_floating_point() ? t.to(torch::kBFloat16) : t), name);
}

BOOST_AUTO_TEST_CASE(bad_files_fail_on_every_rank_and_change_nothing) {
  const auto dir = shared_dir("bad");
  auto source = make_engine(4, ShardingStrategy::FULL_SHARD);
  const std::string good = dir + "/model.safetensors";
  fsdp::save_safetensors(*source, good);
  const auto bytes = fs::file_size(good);
  auto write_variant = [&](const std::string& name, const std::function<void(std::string&)>& edit) {
    if (MpiComm::world().rank() == 0) {
      std::ifstream in(good, std::ios::binary);
      std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      edit(text);
      std::ofstream(dir + "/" + name, std::ios::binary) << text;
    }
    MpiComm::world().barrier();
    return dir + "/" + name;
  };
  auto target = make_engine(5, ShardingStrategy::FULL_SHARD);
  const auto before = full_state(target);
  const auto truncated = write_variant("truncated.safetensors", [&](std::string& t) { t.resize(bytes - 5); });
  expect_error([&] { fsdp::load_safetensors(*target, truncated); }, "safetensors file '" + truncated + "'");
  const auto bad_json = write_variant("bad_json.safetensors", [](std::string& t) { t[8] = '['; });
  expect_error([&] { fsdp::load_safetensors(*target, bad_json); }, "is not valid JSON");
  const auto huge = write_variant("huge_header.safetensors", [](std::string& t) { t[6] = 1; });
  expect_error([&] { fsdp::load_safetensors(*target, huge); }, "at offset 0 exceeds the file");
  // Another model's file: fc2 is missing and a tensor of another shape is there.
  const auto other = write_variant("renamed.safetensors", [](std::string& t) {
    const auto pos = t.find("\"fc2.weight\"");
    t.replace(pos, 12, "\"fcX.weight\"");
  });
  expect_error([&] { fsdp::load_safetensors(*target, other); }, "parameter 'fc2.weight' is missing");
  expect_error([&] { fsdp::load_safetensors(*target, other); }, "unexpected tensor 'fcX.weight'");
  check_equal(full_state(target), before);  // nothing changed
  // allow_missing / allow_unexpected: the rest loads, the missing parameter keeps its value.
  fsdp::SafetensorsLoadOptions lenient;
  lenient.allow_missing = true;
  lenient.allow_unexpected = true;
  const auto result = fsdp::load_safetensors(*target, other, lenient);
  BOOST_TEST(result.missing == std::vector<std::string>{"fc2.weight"});
  BOOST_TEST(result.unexpected == std::vector<std::string>{"fcX.weight"});
  const auto after = full_state(target);
  BOOST_TEST(torch::equal(after.at("fc2.weight"), before.at("fc2.weight")));
  BOOST_TEST(torch::equal(after.at("fc1.weight"), full_state(source).at("fc1.weight")));
}

BOOST_AUTO_TEST_CASE(a_save_into_a_missing_folder_fails_on_every_rank) {
  auto engine = make_engine(6, ShardingStrategy::FULL_SHARD);
  const std::string path = "/proc/no-such-dir/model.safetensors";
  try {
    fsdp::save_safetensors(*engine, path);
    BOOST_FAIL("saved into /proc");
  } catch (const fsdp::CheckpointError&) {
  } catch (const std::exception& e) {
    BOOST_FAIL("expected CheckpointError, got " << e.what());
  }
}

BOOST_AUTO_TEST_CASE(checkpoints_of_every_type_export_to_the_same_file) {
  const auto dir = shared_dir("export");
  auto engine = make_engine(8, ShardingStrategy::FULL_SHARD);
  const auto want = full_state(engine);
  for (auto type : {fsdp::StateDictType::SHARDED_STATE_DICT, fsdp::StateDictType::FULL_STATE_DICT, fsdp::StateDictType::LOCAL_STATE_DICT}) {
    BOOST_TEST_CONTEXT(fsdp::to_string(type)) {
      fsdp::CheckpointOptions o;
      o.state_dict_type = type;
      const auto saved = fsdp::save_checkpoint(*engine, nullptr, dir + "/" + fsdp::to_string(type), {.step = 1}, o);
      const std::string out = dir + "/" + fsdp::to_string(type) + ".safetensors";
      const std::string out_bf16 = dir + "/" + fsdp::to_string(type) + ".bf16.safetensors";
      if (MpiComm::world().rank() == 0) {
        fsdp::ckpt::export_safetensors(saved.path, out);
        fsdp::ckpt::export_safetensors(saved.path, out_bf16, {.dtype = "bf16"});
      }
      MpiComm::world().barrier();
      check_equal(read_all(out), want);
      const auto bf16 = read_all(out_bf16);
      for (const auto& [name, t] : want) BOOST_TEST(torch::equal(bf16.at(name), t.is_floating_point() ? t.to(torch::kBFloat16) : t), name);
      // The export loads back into the engine like a live save does.
      auto loaded = make_engine(77, ShardingStrategy::NO_SHARD);
      fsdp::load_safetensors(*loaded, out);
      check_equal(full_state(loaded), want);
    }
  }
  BOOST_CHECK_THROW(fsdp::ckpt::export_safetensors(dir + "/nothing.h5", dir + "/x.safetensors"), fsdp::Error);
}
