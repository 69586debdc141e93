// Pure layout math: padding, shard ranges and per-parameter slices over many numel x world sizes.
#define BOOST_TEST_MODULE fsdp_core
#include <boost/test/unit_test.hpp>

#include <numeric>
#include <random>

#include "fsdp/core/layout.hpp"
#include "fsdp/core/strategy.hpp"
#include "fsdp/trace.hpp"

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
  const auto path = std::filesystem::temp_directory_path() / "fsdp_test_trace.json";
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
