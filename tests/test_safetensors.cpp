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
#include "fsdp/file_tree.hpp"

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
    fsdp::remove_tree(dir);
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

namespace safetensors_tests {

/// Another program's layout for Net: renamed, fc weights transposed (Conv1D-like), the embedding's
/// last 3 rows not stored (a padded vocabulary), the BatchNorm's running mean not stored, and a file
/// tensor "attn.mask" that is fine to ignore.
fsdp::TensorNaming foreign_naming() {
  fsdp::TensorNaming n;
  n.scheme = "foreign";
  n.external = [](const std::string& name, const std::vector<std::int64_t>&) -> std::optional<fsdp::ExternalTensor> {
    if (name == "bn.running_mean") return std::nullopt;
    if (name == "emb.weight" || name == "head.weight") return fsdp::ExternalTensor{"model.wte", 10, false, {"wte"}};
    if (name == "fc1.weight" || name == "fc2.weight") return fsdp::ExternalTensor{"model." + name.substr(0, 3) + ".w", -1, true, {}};
    return fsdp::ExternalTensor{"model." + name, -1, false, {}};
  };
  n.ignorable = [](const std::string& name) { return name == "attn.mask"; };
  return n;
}

/// Writes `tensors` as a safetensors file (rank 0; the test's own writer, through the format layer).
void write_file(const std::string& path, const std::map<std::string, torch::Tensor>& tensors) {
  std::vector<fsdp::safetensors::TensorEntry> entries;
  for (const auto& [name, t] : tensors) entries.push_back({name, fsdp::safetensors_dtype(t.scalar_type()), t.sizes().vec()});
  fsdp::safetensors::Header layout;
  const auto header = fsdp::safetensors::encode_header(entries, {}, &layout);
  std::ofstream out(path, std::ios::binary);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  for (const auto& e : layout.tensors) {
    const auto t = tensors.at(e.name).contiguous();
    out.write(static_cast<const char*>(t.data_ptr()), e.end - e.begin);
  }
}

}  // namespace safetensors_tests

BOOST_AUTO_TEST_CASE(a_naming_renames_cuts_rows_and_transposes_and_reads_back) {
  const auto dir = shared_dir("naming");
  const auto naming = foreign_naming();
  auto saved = make_engine(3, ShardingStrategy::FULL_SHARD);
  const auto path = dir + "/model.safetensors";
  fsdp::save_safetensors(*saved, path, {.naming = &naming});
  const auto want = full_state(saved);
  const auto got = read_all(path);
  BOOST_TEST(got.size() == want.size() - 1);  // no running mean (want, like the file, has the tied tensor once)
  BOOST_TEST(torch::equal(got.at("model.wte"), want.at("emb.weight").narrow(0, 0, 10)));
  BOOST_TEST(torch::equal(got.at("model.fc1.w"), want.at("fc1.weight").t()));
  BOOST_TEST(torch::equal(got.at("model.fc2.w"), want.at("fc2.weight").t()));
  BOOST_TEST(torch::equal(got.at("model.fc1.bias"), want.at("fc1.bias")));
  BOOST_TEST(torch::equal(got.at("model.bn.num_batches_tracked"), want.at("bn.num_batches_tracked")));
  BOOST_TEST(got.count("model.bn.running_mean") == 0u);

  // Loads at every strategy; the rows the file lacks keep the loading model's values. A tensor the
  // naming ignores is no error.
  std::map<std::string, torch::Tensor> with_mask = got;
  with_mask["attn.mask"] = torch::ones({2, 2});
  if (MpiComm::world().rank() == 0) write_file(dir + "/with_mask.safetensors", with_mask);
  MpiComm::world().barrier();
  for (const auto strategy : {ShardingStrategy::FULL_SHARD, ShardingStrategy::NO_SHARD, ShardingStrategy::SHARD_GRAD_OP}) {
    BOOST_TEST_CONTEXT("strategy " << fsdp::to_string(strategy)) {
      auto loaded = make_engine(99, strategy);
      const auto before = full_state(loaded);
      const auto result = fsdp::load_safetensors(*loaded, dir + "/with_mask.safetensors", {.naming = &naming});
      BOOST_TEST(result.unexpected.empty());
      const auto after = full_state(loaded);
      BOOST_TEST(torch::equal(after.at("emb.weight").narrow(0, 0, 10), want.at("emb.weight").narrow(0, 0, 10)));
      BOOST_TEST(torch::equal(after.at("emb.weight").narrow(0, 10, 3), before.at("emb.weight").narrow(0, 10, 3)));
      for (const auto* name : {"fc1.weight", "fc2.weight", "fc1.bias", "scale", "bn.running_var"})
        BOOST_TEST(torch::equal(after.at(name), want.at(name)), name);
      BOOST_TEST(torch::equal(after.at("bn.running_mean"), before.at("bn.running_mean")));
    }
  }
  // The file under the model's own names is all unexpected tensors and missing parameters.
  auto other = make_engine(98, ShardingStrategy::FULL_SHARD);
  expect_error([&] { fsdp::load_safetensors(*other, path); }, "parameter 'fc1.weight' is missing");
  // A mis-shaped tensor is named with the shape the naming expects.
  std::map<std::string, torch::Tensor> bad = got;
  bad["model.fc1.w"] = torch::zeros({11, 7});
  if (MpiComm::world().rank() == 0) write_file(dir + "/bad.safetensors", bad);
  MpiComm::world().barrier();
  expect_error([&] { fsdp::load_safetensors(*other, dir + "/bad.safetensors", {.naming = &naming}); },
               "tensor 'model.fc1.w': shape [11, 7] in the file, [7, 11] expected for 'fc1.weight' [11, 7]");
}

BOOST_AUTO_TEST_CASE(an_index_folder_loads_tensors_from_several_files) {
  const auto dir = shared_dir("index");
  auto saved = make_engine(4, ShardingStrategy::FULL_SHARD);
  fsdp::save_safetensors(*saved, dir + "/whole.safetensors");
  const auto want = full_state(saved);
  const auto all = read_all(dir + "/whole.safetensors");
  // Split as Hugging Face does: model-0000k-of-00002.safetensors and an index naming each tensor's file.
  fs::create_directories(dir + "/split");
  if (MpiComm::world().rank() == 0) {
    std::map<std::string, torch::Tensor> first, second;
    nlohmann::json weight_map;
    for (const auto& [name, t] : all) {
      const bool in_first = name.rfind("fc", 0) == 0;
      (in_first ? first : second)[name] = t;
      weight_map[name] = in_first ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
    }
    write_file(dir + "/split/model-00001-of-00002.safetensors", first);
    write_file(dir + "/split/model-00002-of-00002.safetensors", second);
    std::ofstream(dir + "/split/model.safetensors.index.json")
        << nlohmann::json{{"metadata", {{"total_size", 0}}}, {"weight_map", weight_map}}.dump();
    // An index that places a tensor in a file without it.
    fs::create_directories(dir + "/wrong");
    fs::copy(dir + "/split/model-00001-of-00002.safetensors", dir + "/wrong/model-00001-of-00002.safetensors");
    fs::copy(dir + "/split/model-00002-of-00002.safetensors", dir + "/wrong/model-00002-of-00002.safetensors");
    weight_map["fc1.bias"] = "model-00002-of-00002.safetensors";
    std::ofstream(dir + "/wrong/model.safetensors.index.json") << nlohmann::json{{"weight_map", weight_map}}.dump();
  }
  MpiComm::world().barrier();
  auto loaded = make_engine(97, ShardingStrategy::FULL_SHARD);
  fsdp::load_safetensors(*loaded, dir + "/split");
  check_equal(full_state(loaded), want);
  expect_error([&] { fsdp::load_safetensors(*loaded, dir + "/wrong"); }, "places tensor 'fc1.bias' in '");
  expect_error([&] { fsdp::load_safetensors(*loaded, dir); }, "holds neither model.safetensors nor model.safetensors.index.json");
}

BOOST_AUTO_TEST_CASE(a_large_export_splits_as_save_pretrained_and_replaces_an_older_split) {
  namespace st = fsdp::safetensors;
  // The rule alone: a new file when the next tensor would pass the limit; a larger tensor alone, in
  // the next file at once (huggingface_hub's numbering), the file being filled going on.
  std::vector<st::TensorEntry> entries = {{"a", "F32", {10}}, {"b", "F32", {10}}, {"c", "F32", {30}}, {"d", "F32", {5}}, {"e", "BF16", {10}}};
  BOOST_TEST((st::split_into_files(entries, 80) == std::vector<int>{1, 1, 0, 2, 2}));
  BOOST_TEST((st::split_into_files(entries, 100) == std::vector<int>{1, 1, 0, 1, 2}));
  BOOST_TEST((st::split_into_files(entries, 0) == std::vector<int>{0, 0, 0, 0, 0}));
  BOOST_TEST((st::split_into_files(entries, 1000) == std::vector<int>{0, 0, 0, 0, 0}));
  BOOST_TEST(st::shard_path("out/model.safetensors", 1, 3).string() == "out/model-00002-of-00003.safetensors");
  BOOST_TEST(st::shard_path("out/model.safetensors", 0, 1).string() == "out/model.safetensors");
  BOOST_TEST(st::index_path("out/w.safetensors").string() == "out/w.safetensors.index.json");

  const auto dir = shared_dir("split");
  auto engine = make_engine(5, ShardingStrategy::FULL_SHARD);
  const auto want = full_state(engine);
  // A single-file export first: the split one replaces it. A file no fsdp index lists is not its to
  // remove (a downloaded model's shard).
  fsdp::save_safetensors(*engine, dir + "/model.safetensors");
  if (MpiComm::world().rank() == 0) std::ofstream(dir + "/model-00001-of-00009.safetensors") << "someone else's";
  MpiComm::world().barrier();
  fsdp::SafetensorsSaveOptions options;
  options.max_file_bytes = 600;
  const auto result = fsdp::save_safetensors(*engine, dir + "/model.safetensors", options);
  BOOST_TEST(result.files > 2);
  BOOST_TEST(result.path == dir + "/model.safetensors.index.json");
  BOOST_TEST(!fs::exists(dir + "/model.safetensors"));
  BOOST_TEST(fs::exists(dir + "/model-00001-of-00009.safetensors"));
  std::int64_t data = 0, largest_shared = 0;
  for (int k = 0; k < result.files; ++k) {
    const auto path = st::shard_path(dir + "/model.safetensors", k, result.files).string();
    const auto header = st::read_header(path);
    data += header.data_bytes;
    if (header.tensors.size() > 1) largest_shared = std::max(largest_shared, header.data_bytes);
  }
  BOOST_TEST(largest_shared <= 600);  // only a tensor larger than the limit has a file to itself
  std::ifstream in(result.path);
  const auto index = nlohmann::json::parse(in);
  BOOST_TEST(index["metadata"]["total_size"].get<std::int64_t>() == data);
  auto loaded = make_engine(98, ShardingStrategy::FULL_SHARD);
  fsdp::load_safetensors(*loaded, dir);
  check_equal(full_state(loaded), want);
  // And back: a single file replaces the split export, its index and files gone.
  fsdp::save_safetensors(*engine, dir + "/model.safetensors");
  BOOST_TEST(fs::exists(dir + "/model.safetensors"));
  BOOST_TEST(!fs::exists(result.path));
  BOOST_TEST(!fs::exists(st::shard_path(dir + "/model.safetensors", 0, result.files)));
  check_equal(read_all(dir + "/model.safetensors"), want);
  // Another program's index and files (a downloaded model) stay where a single file is exported.
  MpiComm::world().barrier();  // every rank has looked at the folder above
  if (MpiComm::world().rank() == 0)
    std::ofstream(dir + "/model.safetensors.index.json")
        << R"({"metadata": {"total_size": 5}, "weight_map": {"x": "model-00001-of-00009.safetensors"}})";
  MpiComm::world().barrier();
  fsdp::save_safetensors(*engine, dir + "/model.safetensors");
  BOOST_TEST(fs::exists(dir + "/model.safetensors.index.json"));
  BOOST_TEST(fs::exists(dir + "/model-00001-of-00009.safetensors"));
}
