// Weighted mixtures of fsdp-train (app/mixture.hpp, data.sources): the blend gives every source its
// share within one sample, each source is reshuffled in its own epochs, the order does not depend on
// the world size, and a blend rebuilt at a resume continues the same draws. No MPI, no LibTorch.
#define BOOST_TEST_MODULE fsdp_mixture
#include <boost/test/unit_test.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <set>
#include <vector>

#include "data.hpp"
#include "data_test_helpers.hpp"
#include "mixture.hpp"

using namespace fsdp::app;
using fsdp::test::expect_data_error;

namespace {

/// For every window [a, a + w) of the first `draws` draws with w <= `max_window` (every start a), the
/// largest |samples of s in the window - share_s x w| over the sources.
double worst_window_error(Blend& blend, std::int64_t draws, std::int64_t max_window, bool prefixes_only) {
  const auto order = blend.draws(0, draws);
  const std::size_t n = blend.num_sources();
  // prefix[s][i]: draws of source s among the first i.
  std::vector<std::vector<std::int64_t>> prefix(n, std::vector<std::int64_t>(order.size() + 1, 0));
  for (std::size_t i = 0; i < order.size(); ++i) {
    const std::size_t src = blend.source_of(order[i]);
    for (std::size_t s = 0; s < n; ++s) prefix[s][i + 1] = prefix[s][i] + (s == src ? 1 : 0);
  }
  double worst = 0;
  for (std::size_t s = 0; s < n; ++s) {
    const double share = blend.share(s);
    for (std::int64_t a = 0; a < (prefixes_only ? 1 : draws); ++a)
      for (std::int64_t w = 1; w <= max_window && a + w <= draws; ++w) {
        const auto got = static_cast<double>(prefix[s][static_cast<std::size_t>(a + w)] - prefix[s][static_cast<std::size_t>(a)]);
        worst = std::max(worst, std::fabs(got - share * static_cast<double>(w)));
      }
  }
  return worst;
}

}  // namespace

BOOST_AUTO_TEST_CASE(every_prefix_holds_each_share_within_one_sample) {
  // Megatron's rule keeps every source within one sample of its share after any number of draws,
  // whatever the weights (tiny, equal, irrational ratios, many sources).
  std::mt19937_64 rng(7);
  std::vector<std::vector<double>> weight_sets = {{3, 1},
                                                  {0.7, 0.2, 0.1},
                                                  {1, 1, 1},
                                                  {1e-3, 1, 5, 0.25, 2},
                                                  {std::sqrt(2.0), 1, std::acos(-1.0)},
                                                  {1e308, 1e308, 5e307}};  // weights whose sum is not a finite double
  for (int k = 0; k < 10; ++k) {
    std::vector<double> w;
    for (int s = 0; s < 2 + k % 5; ++s) w.push_back(0.01 + static_cast<double>(rng() % 1000) / 100.0);
    weight_sets.push_back(w);
  }
  for (const auto& w : weight_sets) {
    Blend blend(w, std::vector<std::int64_t>(w.size(), 97), true, 1);
    const double worst = worst_window_error(blend, 20000, 20000, /*prefixes_only=*/true);
    BOOST_TEST_INFO("weights " << w.size() << " sources, first " << w.front());
    BOOST_TEST(worst < 1.0);
    double sum = 0;
    for (double x : w) sum += x / w.front();
    for (std::size_t s = 0; s < w.size(); ++s) BOOST_TEST(std::fabs(blend.share(s) - w[s] / w.front() / sum) < 1e-9);  // the shares asked
  }
}

BOOST_AUTO_TEST_CASE(two_sources_hold_their_shares_in_every_window) {
  // With two sources the blend is a balanced sequence: every window of w draws, wherever it starts
  // (a resumed run's, an evaluation interval's), holds share x w of each within one sample.
  for (const auto& w : std::vector<std::vector<double>>{{3, 1}, {0.7, 0.3}, {std::sqrt(2.0), 1}, {1, 99}}) {
    Blend blend(w, {1000, 1000}, false, 0);
    BOOST_TEST(worst_window_error(blend, 3000, 300, /*prefixes_only=*/false) < 1.0);
  }
  // With more sources any window is within two samples (the difference of two prefixes, each within one).
  Blend three({0.5, 0.3, 0.2}, {1000, 1000, 1000}, false, 0);
  BOOST_TEST(worst_window_error(three, 3000, 300, /*prefixes_only=*/false) < 2.0);
}

BOOST_AUTO_TEST_CASE(each_source_is_reshuffled_in_its_own_epochs) {
  // Source 0 (10 samples, share 3/4) runs through several epochs while source 1 (40 samples) is in its
  // first: each epoch of a source is a permutation of its samples, a new one every epoch.
  Blend blend({3, 1}, {10, 40}, true, 42);
  const auto order = blend.draws(0, 80);
  std::vector<std::vector<std::int64_t>> epochs_of_0;
  std::vector<std::int64_t> of_1;
  for (auto index : order) {
    if (blend.source_of(index) == 0) {
      if (epochs_of_0.empty() || epochs_of_0.back().size() == 10) epochs_of_0.emplace_back();
      epochs_of_0.back().push_back(index);
    } else {
      of_1.push_back(index - blend.offset(1));
    }
  }
  BOOST_TEST(epochs_of_0.size() == 6u);  // 60 draws of source 0
  for (const auto& e : epochs_of_0) BOOST_TEST(std::set<std::int64_t>(e.begin(), e.end()).size() == 10u);
  BOOST_TEST(epochs_of_0[0] != epochs_of_0[1]);
  BOOST_TEST(std::set<std::int64_t>(of_1.begin(), of_1.end()).size() == of_1.size());  // 20 distinct samples of its first epoch
  const auto positions = blend.positions_after(80);
  BOOST_TEST(positions[0].drawn == 60);
  BOOST_TEST(positions[0].epoch == 6);
  BOOST_TEST(positions[0].position == 0);
  BOOST_TEST(positions[1].drawn == 20);
  BOOST_TEST(positions[1].epoch == 0);
  BOOST_TEST(positions[1].position == 20);
  // Without shuffling each source is read in order.
  Blend plain({1, 1}, {3, 3}, false, 42);
  BOOST_TEST(plain.draws(0, 8) == (std::vector<std::int64_t>{0, 3, 1, 4, 2, 5, 0, 3}));
}

BOOST_AUTO_TEST_CASE(the_global_order_does_not_depend_on_the_world_size) {
  // DistributedSampler over the blend: rank r takes positions r, r + N, ...; interleaving the ranks'
  // batches gives the one global order at every world size, epoch after epoch.
  const std::int64_t n = 72;  // samples per epoch of the mixture
  auto sampler_order = [&](int world, std::int64_t epoch) {
    auto blend = std::make_shared<Blend>(std::vector<double>{2, 1, 1}, std::vector<std::int64_t>{30, 30, 12}, true, 9);
    std::vector<std::vector<std::int64_t>> per_rank;
    for (int r = 0; r < world; ++r) {
      DistributedSampler sampler(n, world, r, [blend, n](std::int64_t e) { return blend->draws(e * n, n); });
      sampler.set_epoch(epoch);
      per_rank.push_back(sampler.indices());
    }
    std::vector<std::int64_t> global;
    for (std::size_t i = 0; i < per_rank[0].size(); ++i)
      for (int r = 0; r < world; ++r) global.push_back(per_rank[static_cast<std::size_t>(r)][i]);
    return global;
  };
  for (std::int64_t epoch : {0, 1, 3}) {
    const auto one = sampler_order(1, epoch);
    for (int world : {2, 3, 4}) BOOST_TEST(sampler_order(world, epoch) == one);
  }
}

BOOST_AUTO_TEST_CASE(a_blend_rebuilt_at_a_resume_continues_the_same_draws) {
  // The run that never stopped, and one rebuilt from nothing (a resume), which first asks where the
  // sources stood (the checkpoint's counters) and then for the epoch's order: the same draws.
  Blend whole({5, 2, 1}, {40, 25, 9}, true, 3);
  std::vector<std::int64_t> epochs;
  for (int e = 0; e < 4; ++e) {
    const auto d = whole.draws(e * 74, 74);
    epochs.insert(epochs.end(), d.begin(), d.end());
  }
  Blend resumed({5, 2, 1}, {40, 25, 9}, true, 3);
  const std::int64_t stop = 2 * 74 + 30;  // inside epoch 2
  const auto at = resumed.positions_after(stop);
  const std::vector<std::int64_t> sizes{40, 25, 9};
  for (std::size_t s = 0; s < at.size(); ++s) {  // what the uninterrupted run drew from each source before the stop
    const auto drawn = std::count_if(epochs.begin(), epochs.begin() + stop, [&](std::int64_t i) { return whole.source_of(i) == s; });
    BOOST_TEST(at[s].drawn == drawn);
    BOOST_TEST(at[s].epoch == drawn / sizes[s]);
    BOOST_TEST(at[s].position == drawn % sizes[s]);
  }
  BOOST_TEST(at[2].epoch >= 2);                   // the small source is well into its own epochs
  const auto epoch2 = resumed.draws(2 * 74, 74);  // an earlier draw than the counters asked for
  BOOST_TEST(std::vector<std::int64_t>(epochs.begin() + 2 * 74, epochs.begin() + 3 * 74) == epoch2);
  // Counters asked inside the epoch just drawn, then the next epoch: still the same draws.
  resumed.positions_after(2 * 74 + 10);
  BOOST_TEST(std::vector<std::int64_t>(epochs.begin() + 3 * 74, epochs.end()) == resumed.draws(3 * 74, 74));
}

BOOST_AUTO_TEST_CASE(bad_mixtures_are_data_errors) {
  expect_data_error([] { Blend({}, {}, true, 0); }, {"at least one source"});
  expect_data_error([] { Blend({1, 0}, {5, 5}, true, 0); }, {"source 1 of the mixture: weight must be > 0"});
  expect_data_error([] { Blend({1, std::nan("")}, {5, 5}, true, 0); }, {"weight must be > 0"});
  expect_data_error([] { Blend({1, 1}, {5, 0}, true, 0); }, {"source 1 of the mixture holds no sample"});
  expect_data_error([] { Blend({1}, {5, 5}, true, 0); }, {"one weight per source"});
  Blend blend({1}, {5}, true, 0);
  expect_data_error([&] { blend.source_of(5); }, {"mixture sample 5 out of range [0, 5)"});
  expect_data_error([] { DistributedSampler(4, 1, 0, DistributedSampler::EpochOrder{}); }, {"no epoch order"});
  DistributedSampler short_order(4, 1, 0, [](std::int64_t) { return std::vector<std::int64_t>{0, 1}; });
  expect_data_error([&] { short_order.indices(); }, {"epoch order of 2 indices for 4 samples"});
}
