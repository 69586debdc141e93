// Pure layout math: padding, shard ranges and per-parameter slices over many numel x world sizes.
#define BOOST_TEST_MODULE fsdp_core
#include <boost/test/unit_test.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <numeric>
#include <random>
#include <stdexcept>

#include "fsdp/core/device_choice.hpp"
#include "fsdp/core/layout.hpp"
#include "fsdp/core/lean_backward.hpp"
#include "fsdp/core/loss_scale.hpp"
#include "fsdp/core/execution_order.hpp"
#include "fsdp/core/strategy.hpp"
#include "fsdp/core/text.hpp"
#include "fsdp/core/unit_plan.hpp"
#include "fsdp/io/run_lock.hpp"
#include "fsdp/io/safetensors_format.hpp"
#include "fsdp/trace.hpp"
#include "fsdp/file_tree.hpp"

#include <filesystem>
#include <fstream>
#include <sstream>

using fsdp::FlatLayout;

BOOST_AUTO_TEST_CASE(padding_and_ranges_cover_every_element_once) {
  for (std::int64_t world = 1; world <= 9; ++world) {
    for (std::int64_t numel = 0; numel <= 50; ++numel) {
      const auto shard = fsdp::shard_numel(numel, world);
      BOOST_TEST(shard * world >= numel);
      BOOST_TEST((shard - 1) * world < numel + (numel == 0 ? world : 0));
      BOOST_TEST(fsdp::padded_numel(numel, world) % world == 0);
      std::int64_t covered = 0;
      for (std::int64_t r = 0; r < world; ++r) {
        const auto range = fsdp::shard_range(numel, world, r);
        BOOST_TEST(range.begin == covered);
        covered = range.end;
      }
      BOOST_TEST(covered == fsdp::padded_numel(numel, world));
    }
  }
}

BOOST_AUTO_TEST_CASE(worked_example_from_design) {
  const FlatLayout layout({6, 3, 1}, 4);
  BOOST_TEST(layout.numel() == 10);
  BOOST_TEST(layout.shard_numel() == 3);
  BOOST_TEST(layout.padded_numel() == 12);
  BOOST_TEST(layout.padding() == 2);
  const auto s3 = layout.slices(3);
  BOOST_TEST_REQUIRE(s3.size() == 1u);
  BOOST_TEST(s3[0].param_index == 2);
  BOOST_TEST(s3[0].numel == 1);
  BOOST_TEST(layout.real_numel(3) == 1);
  const auto s1 = layout.slices(1);  // [3, 6): the second half of parameter 0
  BOOST_TEST_REQUIRE(s1.size() == 1u);
  BOOST_TEST(s1[0].param_offset == 3);
  BOOST_TEST(s1[0].numel == 3);
}

BOOST_AUTO_TEST_CASE(a_parameter_inside_part_of_a_shard) {
  const FlatLayout layout({6, 3, 1}, 2);  // shards [0, 5) and [5, 10)
  // The second half of rank 1's shard, [7, 10) (a replica's part): parameter 1 from its element 1,
  // parameter 2 whole, parameter 0 not at all.
  const auto p1 = layout.slice_in(1, {7, 10});
  BOOST_TEST(p1.param_offset == 1);
  BOOST_TEST(p1.shard_offset == 0);
  BOOST_TEST(p1.numel == 2);
  const auto p2 = layout.slice_in(2, {7, 10});
  BOOST_TEST(p2.param_offset == 0);
  BOOST_TEST(p2.shard_offset == 2);
  BOOST_TEST(p2.numel == 1);
  BOOST_TEST(layout.slice_in(0, {7, 10}).numel == 0);
  BOOST_TEST(
      (layout.slices(1) == std::vector<fsdp::ParamSlice>{layout.slice_in(0, {5, 10}), layout.slice_in(1, {5, 10}), layout.slice_in(2, {5, 10})}));
}

BOOST_AUTO_TEST_CASE(slices_reassemble_every_parameter_at_any_world_size) {
  std::mt19937 rng(42);
  std::uniform_int_distribution<int> count(1, 7), size(0, 40);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<std::int64_t> numels(static_cast<std::size_t>(count(rng)));
    for (auto& n : numels) n = size(rng);
    const std::int64_t total = std::accumulate(numels.begin(), numels.end(), std::int64_t{0});
    for (std::int64_t world = 1; world <= 8; ++world) {
      const FlatLayout layout(numels, world);
      std::vector<int> hits(static_cast<std::size_t>(total), 0);
      std::int64_t real = 0;
      for (std::int64_t r = 0; r < world; ++r) {
        std::int64_t last_shard_offset = -1;
        for (const auto& s : layout.slices(r)) {
          BOOST_TEST(s.numel > 0);
          BOOST_TEST(s.shard_offset > last_shard_offset);
          BOOST_TEST(s.shard_offset + s.numel <= layout.shard_numel());
          BOOST_TEST(s.param_offset + s.numel <= layout.param_numel(s.param_index));
          last_shard_offset = s.shard_offset;
          for (std::int64_t k = 0; k < s.numel; ++k) ++hits[static_cast<std::size_t>(layout.param_offset(s.param_index) + s.param_offset + k)];
        }
        real += layout.real_numel(r);
      }
      BOOST_TEST(real == total);
      for (int h : hits) BOOST_TEST(h == 1);
    }
  }
}

BOOST_AUTO_TEST_CASE(numel_smaller_than_world_is_legal) {
  const FlatLayout layout({1}, 4);
  BOOST_TEST(layout.shard_numel() == 1);
  BOOST_TEST(layout.padded_numel() == 4);
  BOOST_TEST(layout.real_numel(0) == 1);
  for (int r = 1; r < 4; ++r) BOOST_TEST(layout.slices(r).empty());
  const FlatLayout empty({}, 3);
  BOOST_TEST(empty.shard_numel() == 0);
  BOOST_TEST(empty.padded_numel() == 0);
}

BOOST_AUTO_TEST_CASE(bad_input_throws_config_error) {
  BOOST_CHECK_THROW(fsdp::shard_numel(10, 0), fsdp::ConfigError);
  BOOST_CHECK_THROW(FlatLayout({-1}, 2), fsdp::ConfigError);
  BOOST_CHECK_THROW(FlatLayout({4}, 2).rank_range(2), fsdp::ConfigError);
}

BOOST_AUTO_TEST_CASE(hash_is_stable) {
  static_assert(fsdp::fnv1a64("") == 14695981039346656037ull);
  BOOST_TEST(fsdp::fnv1a64("a") == 0xaf63dc4c8601ec8cull);
  BOOST_TEST(fsdp::fnv1a64("fc1.weight") != fsdp::fnv1a64("fc1.bias"));
}

BOOST_AUTO_TEST_CASE(integers_are_joined_by_commas) {
  BOOST_TEST(fsdp::comma_separated(std::vector<int>{}) == "");
  BOOST_TEST(fsdp::comma_separated(std::vector<int>{7}) == "7");
  BOOST_TEST(fsdp::comma_separated(std::vector<unsigned long long>{0, 2, 18446744073709551615ull}) == "0,2,18446744073709551615");
}

BOOST_AUTO_TEST_CASE(tracer_records_only_when_enabled_and_writes_chrome_json) {
  auto& tracer = fsdp::Tracer::instance();
  tracer.clear();
  { const fsdp::TraceScope off("ignored", "app"); }
  tracer.counter("memory", {{"MiB", 1.0}});
  BOOST_TEST(tracer.size() == 0u);
  tracer.enable();
  { const fsdp::TraceScope on("all_gather", "comm", {{"bytes", 4096.0}, {"unit", 2.0}}); }
  { const fsdp::TraceScope named(std::string("forward \"layers.0\""), "forward"); }
  tracer.counter("resident memory", {{"MiB", 12.5}});
  tracer.enable(false);
  const auto events = tracer.events();
  BOOST_TEST_REQUIRE(events.size() == 3u);
  BOOST_TEST(events[0].name == "all_gather");
  BOOST_TEST(events[0].phase == 'X');
  BOOST_TEST(events[0].duration_us >= 0);
  BOOST_TEST(events[2].phase == 'C');
  // The process's own name: the sanitizer builds run this suite too, maybe at the same time.
  const auto path = std::filesystem::temp_directory_path() / ("fsdp_test_trace_" + std::to_string(::getpid()) + ".json");
  tracer.write_json(path.string(), 3);
  std::stringstream text;
  text << std::ifstream(path).rdbuf();
  const std::string json = text.str();
  for (const char* want : {"\"traceEvents\"", "\"pid\":3", "\"name\":\"rank 3\"", "\"name\":\"all_gather\",\"cat\":\"comm\",\"ph\":\"X\"",
                           "\"bytes\":4096", "\"unit\":2", "forward \\\"layers.0\\\"", "\"ph\":\"C\"", "\"MiB\":12.5"})
    BOOST_TEST(json.find(want) != std::string::npos, "missing " << want << " in\n" << json);
  BOOST_CHECK_THROW(tracer.write_json("/nonexistent/dir/trace.json", 0), fsdp::Error);
  tracer.clear();
  std::filesystem::remove(path);
}

BOOST_AUTO_TEST_CASE(strategy_names_parse_in_any_case) {
  for (auto s : fsdp::kShardingStrategies) BOOST_TEST(fsdp::parse_sharding_strategy(fsdp::to_string(s)) == s);
  BOOST_TEST(fsdp::parse_sharding_strategy("shard_grad_op") == fsdp::ShardingStrategy::SHARD_GRAD_OP);
  BOOST_TEST(fsdp::parse_backward_prefetch("backward_post") == fsdp::BackwardPrefetch::BACKWARD_POST);
  try {
    (void)fsdp::parse_sharding_strategy("FULLSHARD");
    BOOST_FAIL("FULLSHARD parsed");
  } catch (const fsdp::ConfigError& e) {
    BOOST_TEST(std::string(e.what()).find("unknown sharding strategy 'FULLSHARD' (valid: FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, "
                                          "HYBRID_SHARD_ZERO2)") != std::string::npos);
  }
  BOOST_CHECK_THROW((void)fsdp::parse_backward_prefetch("BACKWARDS"), fsdp::ConfigError);
}

BOOST_AUTO_TEST_CASE(shard_group_size_per_strategy) {
  using S = fsdp::ShardingStrategy;
  for (int world = 1; world <= 8; ++world) {
    BOOST_TEST(fsdp::shard_group_size(S::FULL_SHARD, world, 0, 1) == world);
    BOOST_TEST(fsdp::shard_group_size(S::SHARD_GRAD_OP, world, world, 1) == world);
    BOOST_TEST(fsdp::shard_group_size(S::NO_SHARD, world, 0, 1) == 1);
    for (int group = 1; group <= world; ++group) {
      if (world % group == 0) {
        BOOST_TEST(fsdp::shard_group_size(S::HYBRID_SHARD, world, group, 1) == group);
        BOOST_TEST(fsdp::shard_group_size(S::HYBRID_SHARD_ZERO2, world, 0, group) == group);  // 0: the node's ranks
      } else {
        BOOST_CHECK_THROW(fsdp::shard_group_size(S::HYBRID_SHARD, world, group, 1), fsdp::ConfigError);
      }
    }
  }
  BOOST_CHECK_THROW(fsdp::shard_group_size(S::FULL_SHARD, 4, 2, 1), fsdp::ConfigError);  // hybrid only
  BOOST_CHECK_THROW(fsdp::shard_group_size(S::HYBRID_SHARD, 4, -1, 1), fsdp::ConfigError);
  try {
    (void)fsdp::shard_group_size(S::HYBRID_SHARD, 6, 4, 1);
    BOOST_FAIL("6 ranks in groups of 4 accepted");
  } catch (const fsdp::ConfigError& e) {
    BOOST_TEST(std::string(e.what()).find("world size 6 is not divisible by shard_group_size 4") != std::string::npos);
  }
}

BOOST_AUTO_TEST_CASE(reshard_after_forward_defaults) {
  using S = fsdp::ShardingStrategy;
  static_assert(fsdp::reshard_after_forward_default(S::FULL_SHARD) && fsdp::reshard_after_forward_default(S::HYBRID_SHARD));
  static_assert(!fsdp::reshard_after_forward_default(S::SHARD_GRAD_OP) && !fsdp::reshard_after_forward_default(S::HYBRID_SHARD_ZERO2));
  static_assert(!fsdp::reshard_after_forward_default(S::NO_SHARD));
  BOOST_TEST(fsdp::is_hybrid(S::HYBRID_SHARD_ZERO2));
  BOOST_TEST(!fsdp::is_hybrid(S::FULL_SHARD));
}

namespace {
// root: embed (tied to head), block0 {attn {qkv, frozen_bias}, mlp}, block1 {attn, mlp}, head (tied to embed)
fsdp::ModuleTree transformer_like_tree() {
  fsdp::ModuleTree t;
  const int root = t.add_module(-1, "", "Net", "my::Net");
  const int embed = t.add_module(root, "embed", "Embedding", "torch::nn::Embedding");
  t.add_param(embed, "weight", {10, 4}, /*tensor_id=*/1);
  int id = 2;
  for (int b = 0; b < 2; ++b) {
    const int block = t.add_module(root, "block" + std::to_string(b), "Block", "my::Block");
    const int attn = t.add_module(block, "attn", "Linear", "torch::nn::Linear");
    t.add_param(attn, "weight", {4, 4}, id++);
    t.add_param(attn, "bias", {4}, id++, /*frozen=*/b == 0);
    const int mlp = t.add_module(block, "mlp", "Linear", "torch::nn::Linear");
    t.add_param(mlp, "weight", {4, 4}, id++);
  }
  const int head = t.add_module(root, "head", "Linear", "torch::nn::Linear");
  t.add_param(head, "weight", {10, 4}, /*tensor_id=*/1);  // tied to embed.weight
  t.add_param(head, "bias", {10}, id++);
  return t;
}
}  // namespace

BOOST_AUTO_TEST_CASE(unit_plan_nested_tied_and_frozen) {
  const auto tree = transformer_like_tree();
  const auto plan = fsdp::plan_units(tree, fsdp::WrapRule::module_types({"BlockImpl", "torch::nn::Embedding"}), 3);
  // Regular units in pre-order (root, embed, block0, block1), then block0's frozen companion.
  BOOST_TEST_REQUIRE(plan.units.size() == 5u);
  BOOST_TEST(plan.units[0].path == "");
  BOOST_TEST(plan.units[1].path == "embed");
  BOOST_TEST(plan.units[2].path == "block0");
  BOOST_TEST(plan.units[3].path == "block1");
  BOOST_TEST(plan.units[4].path == "block0");
  BOOST_TEST(plan.units[4].frozen);
  BOOST_TEST(plan.units[4].parent == 2);
  BOOST_TEST(plan.units[2].companion == 4);
  for (int i : {1, 2, 3}) BOOST_TEST(plan.units[static_cast<std::size_t>(i)].parent == 0);
  // embed.weight is used by embed (unit 1) and head (unit 0): it belongs to their common ancestor, the root.
  BOOST_TEST_REQUIRE(plan.units[0].params.size() == 2u);
  BOOST_TEST(plan.units[0].params[0].name == "embed.weight");
  BOOST_TEST(plan.units[0].params[0].aliases == std::vector<std::string>{"head.weight"});
  BOOST_TEST(plan.units[0].params[1].name == "head.bias");
  BOOST_TEST(plan.units[1].params.empty());
  BOOST_TEST(plan.units[2].params.size() == 2u);  // attn.weight, mlp.weight; attn.bias is frozen
  BOOST_TEST(plan.units[4].params.size() == 1u);
  BOOST_TEST(plan.units[4].params[0].name == "block0.attn.bias");
  BOOST_TEST(plan.units[3].params.size() == 3u);
  // Owners: every module maps to its nearest wrapped ancestor.
  BOOST_TEST(plan.owner == (std::vector<int>{0, 1, 2, 2, 2, 3, 3, 3, 0}));
  // Layouts over 3 ranks.
  BOOST_TEST(plan.units[0].layout.numel() == 50);
  BOOST_TEST(plan.units[0].layout.shard_numel() == 17);
  BOOST_TEST(plan.units[0].layout.group_size() == 3);
  BOOST_TEST(plan.num_params() == 40 + 10 + 2 * (16 + 4 + 16));
}

BOOST_AUTO_TEST_CASE(unit_plan_size_based_is_bottom_up) {
  const auto tree = transformer_like_tree();
  // Each Linear has 16-20 elements: at 16 every Linear wraps on its own, the blocks keep nothing and
  // do not wrap (their non-wrapped numel is 0), embed (40) and head (50) wrap.
  const auto plan = fsdp::plan_units(tree, fsdp::WrapRule::size_based(16), 2);
  std::vector<std::string> paths;
  for (const auto& u : plan.units) paths.push_back(u.path + (u.frozen ? "(frozen)" : ""));
  BOOST_TEST(paths ==
             (std::vector<std::string>{"", "embed", "block0.attn", "block0.mlp", "block1.attn", "block1.mlp", "head", "block0.attn(frozen)"}));
  // The tied weight is used by embed and head: the root owns it.
  BOOST_TEST(plan.units[0].params.size() == 1u);
  BOOST_TEST(plan.units[0].params[0].name == "embed.weight");
  // Containers are never wrapped.
  fsdp::ModuleTree list;
  const int root = list.add_module(-1, "", "Net", "Net");
  const int layers = list.add_module(root, "layers", "ModuleList", "torch::nn::ModuleList");
  const int l0 = list.add_module(layers, "0", "Linear", "torch::nn::Linear");
  list.add_param(l0, "weight", {8}, 0);
  const auto p = fsdp::plan_units(list, fsdp::WrapRule::size_based(1), 1);
  BOOST_TEST(p.units.size() == 2u);
  BOOST_TEST(p.units[1].path == "layers.0");
}

BOOST_AUTO_TEST_CASE(unit_plan_one_element_and_empty_units) {
  fsdp::ModuleTree t;
  const int root = t.add_module(-1, "", "Net", "Net");
  const int a = t.add_module(root, "a", "Scale", "Scale");
  t.add_param(a, "s", {}, 0);  // 0-d: one element
  const auto plan = fsdp::plan_units(t, fsdp::WrapRule::module_types({"Scale"}), 4);
  BOOST_TEST_REQUIRE(plan.units.size() == 2u);
  BOOST_TEST(plan.units[0].layout.numel() == 0);
  BOOST_TEST(plan.units[0].layout.padded_numel() == 0);
  BOOST_TEST(plan.units[1].layout.numel() == 1);
  BOOST_TEST(plan.units[1].layout.padded_numel() == 4);
  BOOST_TEST(plan.units[1].layout.real_numel(0) == 1);
  BOOST_TEST(plan.units[1].layout.real_numel(3) == 0);
  BOOST_TEST(fsdp::plan_units(t, fsdp::WrapRule::none(), 4).units.size() == 1u);
  // A custom rule sees the module and its index.
  const auto custom =
      fsdp::plan_units(t, fsdp::WrapRule::custom([](const fsdp::TreeModule& m, int index, std::int64_t) { return index == 1 && m.path == "a"; }), 1);
  BOOST_TEST(custom.units.size() == 2u);
}

// A unit's gathered weight is freed before its gradient only when nothing else can read it: every
// condition alone keeps it.
BOOST_AUTO_TEST_CASE(a_weight_is_released_early_only_when_nothing_else_reads_it) {
  fsdp::UnitAtWeightRelease alone;
  alone.sole_parameter = true;
  alone.called_through_forward = true;
  alone.pending_backwards = 1;
  BOOST_TEST(fsdp::may_release_before_gradient(alone));
  auto with = [&](auto change) {
    auto u = alone;
    change(u);
    return fsdp::may_release_before_gradient(u);
  };
  BOOST_TEST(!with([](auto& u) { u.sole_parameter = false; }), "another parameter of the unit");
  BOOST_TEST(!with([](auto& u) { u.called_through_forward = false; }), "gathered with the root");
  BOOST_TEST(!with([](auto& u) { u.recomputing = true; }), "inside a recomputation");
  BOOST_TEST(!with([](auto& u) { u.frozen_companion = true; }), "a frozen companion");
  BOOST_TEST(!with([](auto& u) { u.pending_backwards = 2; }), "a second forward's backward to come");
  BOOST_TEST(!with([](auto& u) { u.pending_backwards = 0; }), "no backward to come (retain_graph's second)");
  BOOST_TEST(!with([](auto& u) { u.releasing_reads_left = 1; }), "another read still to run");
  BOOST_TEST(fsdp::backward_gathers(false, false));
  BOOST_TEST(!fsdp::backward_gathers(true, false), "declared: not gathered");
  BOOST_TEST(fsdp::backward_gathers(true, true), "declared but checkpointed: its recomputation reads it");
}

BOOST_AUTO_TEST_CASE(execution_order_picks_the_next_unit_to_prefetch) {
  fsdp::ExecutionOrder order;
  order.begin_forward();
  BOOST_TEST(order.next_forward(1) == -1);           // no previous step yet
  for (int unit : {1, 2, 3, 2}) order.record(unit);  // unit 2 called twice: recorded once
  BOOST_TEST(order.current() == (std::vector<int>{1, 2, 3}));
  BOOST_TEST(order.next_backward(0) == 3);  // the root's backward begins first, then the last unit's
  BOOST_TEST(order.next_backward(3) == 2);
  BOOST_TEST(order.next_backward(1) == -1);
  BOOST_TEST(order.next_backward(7) == -1);
  order.begin_forward();
  BOOST_TEST(order.next_forward(1) == 2);  // the previous step's order
  BOOST_TEST(order.next_forward(3) == -1);
  BOOST_TEST(order.next_backward(0) == -1);  // nothing ran yet in this step
}

BOOST_AUTO_TEST_CASE(safetensors_header_round_trip_and_errors) {
  namespace st = fsdp::safetensors;
  std::vector<st::TensorEntry> tensors = {{"a.weight", "F32", {2, 3}}, {"a.bias", "BF16", {3}}, {"scale", "F64", {}}};
  st::Header layout;
  const std::string header = st::encode_header(tensors, {{"format", "pt"}}, &layout);
  BOOST_TEST(header.size() % 8 == 0u);  // the data starts 8-byte aligned
  BOOST_TEST(tensors[1].begin == 24);
  BOOST_TEST(tensors[2].end == 24 + 6 + 8);
  const std::int64_t file_bytes = layout.data_start + layout.data_bytes;
  const auto parsed = st::parse_header(header, file_bytes, "m.safetensors");
  BOOST_TEST(parsed.data_start == static_cast<std::int64_t>(header.size()));
  BOOST_TEST(parsed.tensors.size() == 3u);
  BOOST_TEST(parsed.find("a.bias")->dtype == "BF16");
  BOOST_TEST(parsed.find("scale")->shape.empty());
  BOOST_TEST(parsed.metadata.at("format") == "pt");
  auto fails = [&](const std::string& text, std::int64_t size, const std::string& expected) {
    try {
      (void)st::parse_header(text, size, "m.safetensors");
      BOOST_FAIL("parsed; expected: " << expected);
    } catch (const fsdp::CheckpointError& e) {
      BOOST_TEST(std::string(e.what()).find(expected) != std::string::npos, e.what());
    }
  };
  // A file of `json` as its header and `data_bytes` bytes of data.
  auto fails_json = [&](const std::string& json, std::int64_t data_bytes, const std::string& expected) {
    std::string file(8, '\0');
    for (int i = 0; i < 8; ++i) file[static_cast<std::size_t>(i)] = static_cast<char>((json.size() >> (8 * i)) & 0xff);
    fails(file + json, static_cast<std::int64_t>(8 + json.size()) + data_bytes, expected);
  };
  fails(header.substr(0, 5), 5, "too short");
  fails(header, file_bytes - 1, "data_offsets [30, 38) outside the data section of 37 bytes");
  fails_json("{\"x\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 4]}}", 4, "hold 4 bytes, its shape and dtype need 8");
  fails_json("{\"x\": {\"dtype\": \"Q7\", \"shape\": [1], \"data_offsets\": [0, 1]}}", 1, "unknown dtype 'Q7'");
  fails_json("{\"x\": {\"dtype\": \"U8\", \"shape\": [1], \"data_offsets\": [1, 2]}}", 2, "starts at data offset 1, expected 0");
  fails_json("{\"x\": 1", 0, "is not valid JSON");
  fails_json("{\"x\": {\"shape\": [1]}}", 0, "tensor 'x': malformed entry");
}

namespace {
/// A fresh folder under the system's temporary directory.
std::filesystem::path fresh_dir(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() / ("fsdp_test_core_" + std::to_string(::getpid()) + "_" + name);
  fsdp::remove_tree(dir);
  return dir;
}
void write_lock(const std::filesystem::path& dir, const fsdp::RunLockHolder& h) {
  std::filesystem::create_directories(dir);
  std::ofstream(dir / fsdp::RunLock::kFileName) << "host=" << h.host << "\npid=" << h.pid << "\njob_id=" << h.job_id << "\nrestart=" << h.restart
                                                << "\nstarted=" << h.started << "\nflock=" << (h.flocked ? 1 : 0) << "\n";
}
}  // namespace

BOOST_AUTO_TEST_CASE(run_lock_refuses_a_second_run_and_names_the_holder) {
  const auto dir = fresh_dir("lock");
  auto me = fsdp::RunLock::this_process();
  me.job_id = "";
  {
    const auto lock = fsdp::RunLock::acquire(dir, me);
    BOOST_TEST(std::filesystem::exists(dir / fsdp::RunLock::kFileName));
    try {
      (void)fsdp::RunLock::acquire(dir, me);  // a second run on the same folder
      BOOST_FAIL("second lock taken");
    } catch (const fsdp::RunLockError& e) {
      const std::string what = e.what();
      BOOST_TEST(what.find("is in use by another run (host " + me.host + ", pid " + std::to_string(me.pid)) != std::string::npos, what);
      BOOST_TEST(e.holder().pid == me.pid);
    }
  }
  BOOST_TEST(!std::filesystem::exists(dir / fsdp::RunLock::kFileName));  // released
  // A live process of this host that holds no flock (pid 1): held.
  write_lock(dir, {.host = me.host, .pid = 1, .started = "then"});
  BOOST_CHECK_THROW((void)fsdp::RunLock::acquire(dir, me), fsdp::RunLockError);
  // Another node's run: cannot be checked from here, so held.
  write_lock(dir, {.host = "another-node", .pid = 12345, .job_id = "77", .restart = "0", .started = "then", .flocked = true});
  BOOST_CHECK_THROW((void)fsdp::RunLock::acquire(dir, me), fsdp::RunLockError);
  fsdp::remove_tree(dir);
}

BOOST_AUTO_TEST_CASE(run_lock_takes_over_a_stale_lock) {
  const auto dir = fresh_dir("stale");
  auto me = fsdp::RunLock::this_process();
  me.job_id = "";
  // A process of this host that is gone (a child that has exited and been reaped).
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ::waitpid(child, nullptr, 0);
  write_lock(dir, {.host = me.host, .pid = child, .started = "then"});
  { const auto lock = fsdp::RunLock::acquire(dir, me); }
  // A live pid that held flock but no longer does (the pid was reused): stale.
  write_lock(dir, {.host = me.host, .pid = 1, .started = "then", .flocked = true});
  { const auto lock = fsdp::RunLock::acquire(dir, me); }
  // An earlier incarnation of the same Slurm job (a requeue: a higher restart count), even from another node: taken over.
  me.job_id = "4242";
  me.restart = "0";
  // Another step of the same allocation (same job, same restart count) on another node: held.
  write_lock(dir, {.host = "other-node", .pid = 999, .job_id = "4242", .restart = "0", .started = "then", .flocked = true});
  BOOST_CHECK_THROW((void)fsdp::RunLock::acquire(dir, me), fsdp::RunLockError);
  me.restart = "1";  // the requeued incarnation
  {
    const auto lock = fsdp::RunLock::acquire(dir, me);
    BOOST_TEST(fsdp::RunLock::read_holder(lock.path())->job_id == "4242");
    BOOST_TEST(fsdp::RunLock::read_holder(lock.path())->restart == "1");
    BOOST_TEST(fsdp::RunLock::read_holder(lock.path())->host == me.host);
  }
  fsdp::remove_tree(dir);
}

#include "fsdp/comm/flight_recorder.hpp"

BOOST_AUTO_TEST_CASE(flight_recorder_keeps_the_last_collectives_per_communicator) {
  auto& fr = fsdp::FlightRecorder::instance();
  const auto dir = std::filesystem::temp_directory_path() / ("fsdp_flight_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  fr.configure(3, dir.string(), 0, 1);
  const int world = fr.register_comm("world", {0, 1});
  BOOST_TEST(fr.register_comm("world", {0, 1}) == world);  // the same communicator, wrapped again
  const std::string child = fr.child_name("world", "split");
  BOOST_TEST(child == "world/split#0");
  BOOST_TEST(fr.child_name("world", "split") == "world/split#1");
  const int shard = fr.register_comm(child, {0});
  for (int i = 0; i < 3; ++i) fsdp::FlightRecorder::Scope s(world, "all_reduce", 8, -1, i);
  { fsdp::FlightRecorder::Scope s(shard, "all_gather", 64, 2, 3); }
  const auto open = fr.begin(world, "barrier", 0, -1, 4);  // still running at the dump
  const auto recs = fr.records();
  BOOST_REQUIRE(recs.size() == 3u);  // a ring of 3: the oldest two went
  BOOST_TEST(recs[0].seq == 3u);
  BOOST_TEST(std::string(recs[1].kind) == "all_gather");
  BOOST_TEST(recs[1].seq == 1u);  // numbered per communicator
  BOOST_TEST(recs[2].seq == 4u);
  BOOST_TEST(recs[2].end_s < 0);
  const auto path = fr.dump();
  BOOST_REQUIRE(path.has_value());
  std::ifstream in(*path);
  const auto dump = fsdp::parse_flight_dump(nlohmann::json::parse(in));
  BOOST_TEST(dump.collectives.size() == 3u);
  BOOST_TEST(dump.collectives[2].comm == "world{0,1}");
  BOOST_TEST(!dump.collectives[2].finished);
  BOOST_TEST(fr.oldest_unfinished()->first.seq == 4u);
  BOOST_TEST(fr.oldest_unfinished()->second == "world{0,1}");
  fr.end(open);
  BOOST_TEST(!fr.oldest_unfinished().has_value());
  // A collective left by an exception (a deadline) stays unfinished: the record shows where it hung.
  try {
    fsdp::FlightRecorder::Scope s(shard, "all_gather", 64, 2, 5);
    throw std::runtime_error("deadline");
  } catch (const std::runtime_error&) {}
  BOOST_TEST(fr.records().back().end_s < 0);
  BOOST_TEST(fr.oldest_unfinished()->first.step == 5);
  fr.configure(0, "", 0, 1);
  fsdp::remove_tree(dir);
}

BOOST_AUTO_TEST_CASE(flight_recorder_names_where_the_ranks_part) {
  auto entry = [](std::uint64_t seq, const char* kind, std::int64_t bytes, bool finished) {
    return fsdp::FlightDump::Entry{seq, "world{0,1,2}", kind, bytes, 7, -1, finished};
  };
  const std::vector<fsdp::FlightComm> comms{{"world", {0, 1, 2}}};
  // Rank 1 skipped #5; ranks 0 and 2 wait in it.
  std::vector<fsdp::FlightDump> skipped = {
      {0, comms, {entry(4, "all_reduce", 16, true), entry(5, "all_reduce", 16, false)}},
      {1, comms, {entry(4, "all_reduce", 16, true)}},
      {2, comms, {entry(4, "all_reduce", 16, true), entry(5, "all_reduce", 16, false)}},
  };
  const auto a = fsdp::first_disagreement(skipped);
  BOOST_TEST(
      a.find("collective #5 of communicator world{0,1,2}: rank(s) 0,2 issued all_reduce (16 bytes, step 7, not finished); rank(s) 1 never did") ==
          std::string("flight recorder: ").size(),
      a);
  BOOST_TEST(a.find("rank 1's last there: #4 all_reduce") != std::string::npos, a);
  // Rank 2 issued a barrier where the others issued an all-gather.
  std::vector<fsdp::FlightDump> other = {
      {0, comms, {entry(4, "all_reduce", 16, true), entry(5, "all_gather", 1024, false)}},
      {1, comms, {entry(4, "all_reduce", 16, true), entry(5, "all_gather", 1024, false)}},
      {2, comms, {entry(4, "all_reduce", 16, true), entry(5, "barrier", 0, false)}},
  };
  const auto b = fsdp::first_disagreement(other);
  BOOST_TEST(b.find("#5") != std::string::npos, b);
  BOOST_TEST(b.find("rank(s) 0,1 issued all_gather of 1024 bytes while rank(s) 2 issued barrier of 0 bytes") != std::string::npos, b);
  // Agreeing dumps, and a ring whose oldest entries differ between ranks (only the overlap counts).
  std::vector<fsdp::FlightDump> agree = {{0, comms, {entry(3, "x", 1, true), entry(4, "all_reduce", 16, true)}},
                                         {1, comms, {entry(4, "all_reduce", 16, true)}},
                                         {2, comms, {entry(4, "all_reduce", 16, true)}}};
  BOOST_TEST(fsdp::first_disagreement(agree).empty());
}

BOOST_AUTO_TEST_CASE(dynamic_loss_scale_backs_off_and_grows_like_pytorchs_grad_scaler) {
  fsdp::DynamicLossScale scale(fsdp::LossScaleOptions{.init_scale = 1024, .growth_interval = 3});
  BOOST_TEST(scale.scale() == 1024.0);
  BOOST_TEST(!scale.update(true));  // an overflow: skipped, halved
  BOOST_TEST(scale.scale() == 512.0);
  BOOST_TEST(scale.update(false));
  BOOST_TEST(scale.update(false));
  BOOST_TEST(scale.good_steps() == 2);
  BOOST_TEST(!scale.update(true));  // the run of good steps starts again
  BOOST_TEST(scale.scale() == 256.0);
  BOOST_TEST(scale.good_steps() == 0);
  for (int i = 0; i < 3; ++i) BOOST_TEST(scale.update(false));
  BOOST_TEST(scale.scale() == 512.0);  // grown after 3 good steps in a row
  BOOST_TEST(scale.good_steps() == 0);
  // A scale that would overflow a double stays where it is.
  fsdp::DynamicLossScale huge(fsdp::LossScaleOptions{.init_scale = 1e308, .growth_interval = 1});
  BOOST_TEST(huge.update(false));
  BOOST_TEST(huge.scale() == 1e308);
  // Restore takes a checkpoint's state and refuses what no run could have saved.
  scale.restore(64, 2);
  BOOST_TEST(scale.scale() == 64.0);
  BOOST_TEST(scale.update(false));
  BOOST_TEST(scale.scale() == 128.0);
  BOOST_CHECK_THROW(scale.restore(0, 0), fsdp::ConfigError);
  scale.restore(8, 3);  // saved under a longer growth interval: counting starts again
  BOOST_TEST(scale.good_steps() == 0);
  BOOST_CHECK_THROW(scale.restore(8, -1), fsdp::ConfigError);
  // The floor: the scale never backs off below min_scale, and there it says so.
  fsdp::DynamicLossScale floored(fsdp::LossScaleOptions{.init_scale = 4, .min_scale = 2});
  BOOST_TEST(!floored.at_floor());
  floored.update(true);
  BOOST_TEST(floored.at_floor());
  floored.update(true);
  BOOST_TEST(floored.scale() == 2.0);
  BOOST_CHECK_THROW(fsdp::DynamicLossScale(fsdp::LossScaleOptions{.init_scale = 1, .min_scale = 2}), fsdp::ConfigError);
  BOOST_CHECK_THROW(fsdp::DynamicLossScale(fsdp::LossScaleOptions{.backoff_factor = 1.5}), fsdp::ConfigError);
}

BOOST_AUTO_TEST_CASE(each_rank_gets_its_own_gpu_under_every_launcher_layout) {
  // mpirun, and srun without --gpus-per-task: every task sees the node's 4 GPUs; the node-local rank picks.
  for (int local = 0; local < 4; ++local) BOOST_TEST(fsdp::choose_device(-1, local, 4) == local);
  BOOST_TEST(fsdp::choose_device(-1, 5, 4) == 1);  // more ranks than GPUs: shared, which the node check then names
  // srun --gpus-per-task=1 (or --gpu-bind=single:1, or CUDA_VISIBLE_DEVICES set per task): each task sees
  // only its own GPU, as device 0, whatever its node-local rank.
  for (int local = 0; local < 4; ++local) BOOST_TEST(fsdp::choose_device(-1, local, 1) == 0);
  // ... and without a node-local rank (a launcher fsdp does not know) a single device still works.
  BOOST_TEST(fsdp::choose_device(-1, -1, 1) == 0);
  // An explicit choice wins, if visible.
  BOOST_TEST(fsdp::choose_device(2, 0, 4) == 2);
  BOOST_CHECK_EXCEPTION(fsdp::choose_device(1, 0, 1), fsdp::ConfigError,
                        [](const fsdp::ConfigError& e) { return std::string(e.what()).find("sees 1 device(s)") != std::string::npos; });
  BOOST_CHECK_EXCEPTION(fsdp::choose_device(-1, 0, 0), fsdp::ConfigError,
                        [](const fsdp::ConfigError& e) { return std::string(e.what()).find("no CUDA device") != std::string::npos; });
  BOOST_CHECK_THROW(fsdp::choose_device(-1, -1, 2), fsdp::ConfigError);
  // Two ranks of a node on one GPU are named (NCCL cannot run them); distinct ones and ranks without a device pass.
  BOOST_TEST(!fsdp::first_shared_device({"0000:01:00.0", "0000:02:00.0", ""}).has_value());
  const auto shared = fsdp::first_shared_device({"0000:01:00.0", "0000:02:00.0", "0000:01:00.0"});
  BOOST_REQUIRE(shared.has_value());
  BOOST_TEST(shared->first == 0);
  BOOST_TEST(shared->second == 2);
}

#include "fsdp/comm/in_order_completions.hpp"
#include "fsdp/comm/periodic_thread.hpp"
#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>

BOOST_AUTO_TEST_CASE(completions_on_one_stream_are_released_oldest_first_and_the_oldest_pending_one_is_watched) {
  struct Entry {
    int id;
  };
  fsdp::InOrderCompletions<Entry> queue;
  BOOST_TEST(queue.drop_completed([](const Entry&) { return true; }, [](Entry) {}) == nullptr);
  for (int id = 0; id < 5; ++id) queue.push({id});
  std::vector<bool> done(5, false);
  std::vector<int> released;
  const auto is_done = [&](const Entry& e) { return static_cast<bool>(done[static_cast<std::size_t>(e.id)]); };
  const auto release = [&](Entry e) { released.push_back(e.id); };
  // Nothing complete: the oldest is the one to watch.
  Entry* oldest = queue.drop_completed(is_done, release);
  BOOST_TEST_REQUIRE(oldest != nullptr);
  BOOST_TEST(oldest->id == 0);
  // A later one reported complete before an earlier one (an event queried out of order) is kept:
  // on one stream it cannot have finished first, and its event must not be reused yet.
  done[2] = true;
  BOOST_TEST(queue.drop_completed(is_done, release)->id == 0);
  BOOST_TEST(released.empty());
  done[0] = done[1] = true;
  BOOST_TEST(queue.drop_completed(is_done, release)->id == 3);
  BOOST_TEST(released == (std::vector<int>{0, 1, 2}));
  BOOST_TEST(queue.size() == 2u);
  queue.release_all(release);
  BOOST_TEST(queue.empty());
  BOOST_TEST(released == (std::vector<int>{0, 1, 2, 3, 4}));
}

BOOST_AUTO_TEST_CASE(the_oldest_pending_completion_is_found_without_releasing_any) {
  struct Entry {
    int id;
  };
  fsdp::InOrderCompletions<Entry> queue;
  std::vector<bool> done{true, true, false, true};
  for (int id = 0; id < 4; ++id) queue.push({id});
  const auto is_done = [&](const Entry& e) { return static_cast<bool>(done[static_cast<std::size_t>(e.id)]); };
  BOOST_TEST_REQUIRE(queue.first_pending(is_done) != nullptr);
  BOOST_TEST(queue.first_pending(is_done)->id == 2);
  BOOST_TEST(queue.size() == 4u);  // the watcher looks; the issuing thread releases
  done[2] = true;
  BOOST_TEST(queue.first_pending(is_done) == nullptr);
  int seen = 0;
  queue.for_each([&](Entry& e) { seen += e.id; });
  BOOST_TEST(seen == 0 + 1 + 2 + 3);
}

BOOST_AUTO_TEST_CASE(a_periodic_thread_ticks_until_stopped_outlives_a_throwing_tick_and_stops_promptly) {
  using namespace std::chrono_literals;
  std::atomic<int> ticks{0};
  {
    fsdp::PeriodicThread thread;
    thread.start(1ms, [&] {
      if (ticks.fetch_add(1) == 0) throw std::runtime_error("a failed poll");
    });
    BOOST_TEST(thread.running());
    const auto give_up = std::chrono::steady_clock::now() + 30s;
    while (ticks.load() < 3 && std::chrono::steady_clock::now() < give_up) std::this_thread::sleep_for(1ms);
    BOOST_TEST(ticks.load() >= 3);
    thread.stop();
    BOOST_TEST(!thread.running());
    const int after_stop = ticks.load();
    std::this_thread::sleep_for(10ms);
    BOOST_TEST(ticks.load() == after_stop);
  }
  // A long period does not delay stopping: the thread is woken, not left to sleep it out.
  fsdp::PeriodicThread idle;
  idle.start(std::chrono::hours(1), [] {});
  const auto before = std::chrono::steady_clock::now();
  idle.stop();
  BOOST_TEST(std::chrono::duration<double>(std::chrono::steady_clock::now() - before).count() < 10.0);
}

// NcclLane's watcher (watch_oldest_pending, which NcclLane::watch_once calls), with fake completion
// events: a collective that never completes (a peer skipped it) and a host blocked in a wait of its own
// that has no deadline (LibTorch's device sync reading a loss). The watcher, on its own thread, finds
// the oldest pending collective past its deadline and aborts (which ends the queued work, as
// ncclCommAbort does); the blocked wait then returns and the issuing thread's next call reports the
// fault. While the issuing thread holds the lock, a look is skipped, not waited for. Run under
// ThreadSanitizer too.
BOOST_AUTO_TEST_CASE(a_watcher_thread_ends_a_hung_collective_the_host_is_blocked_behind) {
  using namespace std::chrono_literals;
  using Clock = std::chrono::steady_clock;
  struct FakeCollective {
    std::shared_ptr<std::atomic<bool>> complete;
    Clock::time_point deadline;
    int id;
  };
  struct FakeLane {
    std::recursive_mutex mutex;
    fsdp::InOrderCompletions<FakeCollective> pending;
    bool aborted = false;
    std::string fault;
  } lane;
  const auto is_done = [](const FakeCollective& c) { return c.complete->load(); };
  const auto fault_of = [](const FakeCollective& c) {
    return Clock::now() < c.deadline ? std::optional<std::string>()
                                     : std::optional<std::string>("collective " + std::to_string(c.id) + " passed its deadline");
  };
  std::vector<std::shared_ptr<std::atomic<bool>>> ended_outside_the_lock;
  const auto mark_aborted = [&](const std::string& why) {  // under the lock: mark, and hand the work over
    lane.aborted = true;
    lane.fault = why;
    lane.pending.for_each([&](FakeCollective& c) { ended_outside_the_lock.push_back(c.complete); });
  };
  const auto issue = [&](int id, Clock::duration timeout) {
    const std::lock_guard<std::recursive_mutex> lock(lane.mutex);
    if (lane.aborted) throw std::runtime_error(lane.fault);
    auto complete = std::make_shared<std::atomic<bool>>(false);
    lane.pending.push({complete, Clock::now() + timeout, id});
    return complete;
  };

  const auto first = issue(0, 60s);
  first->store(true);  // completed: not the watcher's concern, and not released by it
  const auto hung = issue(1, 1ms);
  const auto behind = issue(2, 60s);  // queued behind the hung one: its own deadline is far off
  std::this_thread::sleep_for(5ms);
  {
    // The issuing thread holds the lock (it is queuing a collective): the watcher skips, at once.
    const std::lock_guard<std::recursive_mutex> issuing(lane.mutex);
    std::optional<std::string> seen = std::string("not looked");
    std::thread([&] { seen = fsdp::watch_oldest_pending(lane.mutex, lane.pending, is_done, fault_of, mark_aborted); }).join();
    BOOST_TEST(!seen.has_value());
    BOOST_TEST(!lane.aborted);
  }

  std::atomic<int> aborts{0};
  std::string found_fault;  // read after stop() joined the watcher
  fsdp::PeriodicThread watcher;
  watcher.start(1ms, [&] {
    const auto found = fsdp::watch_oldest_pending(lane.mutex, lane.pending, is_done, fault_of, mark_aborted);
    if (!found) return;
    found_fault = *found;
    for (auto& c : ended_outside_the_lock) c->store(true);  // the abort, outside the lock
    aborts.fetch_add(1);
  });
  // The host's own blocking wait, without a deadline (bounded here only so that a broken watcher fails the test).
  const auto give_up = Clock::now() + 60s;
  while (!behind->load() && Clock::now() < give_up) std::this_thread::sleep_for(1ms);
  BOOST_TEST(watcher.stop());
  BOOST_TEST(behind->load());
  BOOST_TEST(hung->load());
  BOOST_TEST(aborts.load() == 1);                                 // once: an aborted lane's work is complete
  BOOST_TEST(found_fault == "collective 1 passed its deadline");  // the oldest pending one, not the completed one before it
  BOOST_TEST(lane.pending.size() == 3u);
  BOOST_CHECK_EXCEPTION(issue(3, 60s), std::runtime_error,
                        [](const std::runtime_error& e) { return std::string(e.what()) == "collective 1 passed its deadline"; });
}

// A tick that does not return (an ncclCommAbort that hangs) does not hold its owner: stop() lets the
// thread go after its patience, and the thread touches nothing of the owner afterwards.
BOOST_AUTO_TEST_CASE(a_periodic_thread_whose_tick_does_not_return_is_let_go) {
  using namespace std::chrono_literals;
  auto release = std::make_shared<std::atomic<bool>>(false);
  auto entered = std::make_shared<std::atomic<bool>>(false);
  auto thread = std::make_unique<fsdp::PeriodicThread>();
  thread->start(1ms, [release, entered] {
    entered->store(true);
    while (!release->load()) std::this_thread::sleep_for(1ms);
  });
  while (!entered->load()) std::this_thread::sleep_for(1ms);
  BOOST_TEST(!thread->stop(50ms));  // let go, not joined
  BOOST_TEST(!thread->running());
  thread.reset();        // its owner is gone
  release->store(true);  // the tick returns, then the thread ends on its own state
  std::this_thread::sleep_for(20ms);
}

#include <sys/resource.h>

#include <csignal>

#include "fsdp/output_file.hpp"

// A full disk, as a file size limit (ulimit -f) in a child process: a whole file written by
// write_file_atomically is either all there or its old content, with no temporary left; an append
// that does not fit is cut back, so the file ends with a complete line. Exit code 0: all held.
BOOST_AUTO_TEST_CASE(output_files_are_whole_or_absent_on_a_full_disk) {
  const auto dir = std::filesystem::temp_directory_path() / ("fsdp_output_" + std::to_string(::getpid()));
  fsdp::remove_tree(dir);
  std::filesystem::create_directories(dir);
  const auto summary = dir / "summary.json", metrics = dir / "metrics.csv";
  fsdp::write_file_atomically(summary, "{\"old\": true}\n");
  const pid_t child = ::fork();
  if (child == 0) {
    std::signal(SIGXFSZ, SIG_IGN);  // past the limit a write fails with EFBIG instead of killing the process
    const rlimit limit{4096, 4096};
    ::setrlimit(RLIMIT_FSIZE, &limit);
    int failures = 0;
    try {
      fsdp::write_file_atomically(summary, std::string(10000, 'x'));  // larger than the limit
    } catch (const fsdp::OutputError& e) {
      if (std::string(e.what()).find(summary.string()) == std::string::npos || std::string(e.what()).find("File too large") == std::string::npos)
        ++failures;
    }
    std::ifstream in(summary);
    std::string kept((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (kept != "{\"old\": true}\n") failures += 2;
    for (const auto& e : std::filesystem::directory_iterator(dir))
      if (e.path().filename().string().find(".tmp") != std::string::npos) failures += 4;
    fsdp::LineAppendFile log;
    log.open(metrics, "step,loss\n");
    bool refused = false;
    try {
      for (int i = 0; i < 1000; ++i) log.append(std::to_string(i) + "," + std::string(90, '7') + "\n");
    } catch (const fsdp::OutputError& e) {
      refused = std::string(e.what()).find("the incomplete line was removed") != std::string::npos;
    }
    if (!refused) failures += 8;
    std::ifstream rows(metrics);
    std::string all((std::istreambuf_iterator<char>(rows)), std::istreambuf_iterator<char>());
    if (all.empty() || all.back() != '\n' || all.size() > 4096) failures += 16;
    ::_exit(failures);
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  BOOST_TEST(WIFEXITED(status));
  BOOST_TEST(WEXITSTATUS(status) == 0, "failed checks (bit mask): " << WEXITSTATUS(status));
  fsdp::remove_tree(dir);
}

// fsdp::remove_tree and tree_size_bytes replace the standard library's remove_all and
// recursive_directory_iterator (a PyTorch wheel's copy of remove_all crashes: fsdp/file_tree.hpp).
BOOST_AUTO_TEST_CASE(remove_tree_removes_folders_files_and_links_without_following_them) {
  namespace fs = std::filesystem;
  const auto dir = fresh_dir("remove_tree");
  const auto kept = fresh_dir("remove_tree_kept");
  fs::create_directories(dir / "a" / "b" / "c");
  fs::create_directories(kept);
  std::ofstream(dir / "a" / "b" / "c" / "f.bin") << std::string(1000, 'x');
  std::ofstream(dir / "a" / "g.bin") << std::string(24, 'y');
  std::ofstream(kept / "outside.bin") << std::string(7, 'z');
  fs::create_directory_symlink(kept, dir / "a" / "link_to_kept");
  fs::create_symlink(kept / "outside.bin", dir / "file_link");

  BOOST_TEST(fsdp::tree_size_bytes(dir) == 1024u);  // links are not followed
  BOOST_TEST(fsdp::tree_size_bytes(dir / "a" / "g.bin") == 24u);
  BOOST_TEST(fsdp::tree_size_bytes(dir / "missing") == 0u);

  std::error_code ec;
  // dir, a, b, c, f.bin, g.bin, link_to_kept, file_link
  BOOST_TEST(fsdp::remove_tree(dir, ec) == 8u);
  BOOST_TEST(!ec, ec.message());
  BOOST_TEST(!fs::exists(dir));
  BOOST_TEST(fs::exists(kept / "outside.bin"));  // what a link points to stays
  BOOST_TEST(fsdp::remove_tree(dir, ec) == 0u);  // a missing path is no error
  BOOST_TEST(!ec);

  std::ofstream(kept / "single") << "s";
  BOOST_TEST(fsdp::remove_tree(kept / "single") == 1u);
  BOOST_TEST(!fs::exists(kept / "single"));

  // A path under a regular file cannot be looked at: the error comes back, or is thrown naming it.
  BOOST_TEST(fsdp::remove_tree(kept / "outside.bin" / "x", ec) == static_cast<std::uintmax_t>(-1));  // as remove_all
  BOOST_TEST(ec.value() == ENOTDIR);
  BOOST_CHECK_EXCEPTION(fsdp::remove_tree(kept / "outside.bin" / "x"), fs::filesystem_error,
                        [&](const fs::filesystem_error& e) { return e.path1() == kept / "outside.bin" / "x"; });
  fsdp::remove_tree(kept);
  BOOST_TEST(!fs::exists(kept));
}
