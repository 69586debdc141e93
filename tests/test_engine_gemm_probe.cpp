// fsdp-train's model FLOP utilization (part of test_engine, np 1..4): the products the GEMM probe
// times, its cache in the run directory, the run's peak over ranks, the FLOPs per sample it is
// divided into, and the warm-up kept out of the median step.
#include <boost/test/unit_test.hpp>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "engine_harness.hpp"
#include "models.hpp"
#include "train/gemm_probe.hpp"
#include "train/summary.hpp"
#include "fsdp/file_tree.hpp"

namespace gemm_probe_tests {

namespace app = fsdp::app;

app::ModelSection gpt6m() {
  app::ModelSection m{.kind = app::ModelKind::kTransformer};
  m.vocab_size = 4096;
  m.context = 128;
  m.d_model = 256;
  m.n_heads = 8;
  m.n_layers = 6;
  return m;
}

// The model's products, capped at 1024 per dimension, distinct, most FLOPs per step first: the tied
// head (256 -> 4096, capped) has the MLP's up-projection's shape and adds its FLOPs to it.
BOOST_AUTO_TEST_CASE(model_products_by_flops) {
  const auto shapes = app::model_gemm_shapes(app::describe_model(gpt6m()), 8 * 128);
  BOOST_TEST_REQUIRE(shapes.size() == 4u);
  const std::int64_t expected[4][3] = {{1024, 256, 1024}, {1024, 1024, 256}, {1024, 256, 768}, {1024, 256, 256}};
  for (std::size_t i = 0; i < 4; ++i) {
    BOOST_TEST(shapes[i].rows == expected[i][0]);
    BOOST_TEST(shapes[i].inner == expected[i][1]);
    BOOST_TEST(shapes[i].cols == expected[i][2]);
  }
  BOOST_TEST(shapes[0].name == "block0.fc");
  // The CNN: its two linear layers at the micro-batch's rows (the convolutions are not linear layers).
  const auto cnn = app::model_gemm_shapes(app::describe_model({.kind = app::ModelKind::kCnn}), 64);
  BOOST_TEST_REQUIRE(cnn.size() == 2u);
  BOOST_TEST((cnn[0].rows == 64 && cnn[0].inner == 1024 && cnn[0].cols == 128));  // fc1: 9216 inputs, capped
  BOOST_TEST((cnn[1].rows == 64 && cnn[1].inner == 128 && cnn[1].cols == 10));
}

BOOST_AUTO_TEST_CASE(flops_per_sample) {
  const auto g = gpt6m();
  const auto& gpt = app::model_family(g.kind);
  const std::int64_t n = app::closed_form_num_params(g);
  BOOST_TEST(gpt.flops_per_sample(g, n) == gpt.flops_per_token(g, n) * 128);
  BOOST_TEST(gpt.flops_per_token(g, n) == 6.0 * static_cast<double>(n) + 12.0 * 6 * 256 * 128);
  const app::ModelSection cnn{.kind = app::ModelKind::kCnn};
  const double forward = 2.0 * (26 * 26 * 32 * 9 + 24 * 24 * 64 * 32 * 9 + 9216 * 128 + 128 * 10);
  BOOST_TEST(app::model_family(cnn.kind).flops_per_sample(cnn, 0) == 3 * forward);
  const app::ModelSection mlp{.kind = app::ModelKind::kMlp, .hidden_sizes = {96, 33}};
  BOOST_TEST(app::model_family(mlp.kind).flops_per_sample(mlp, 1000) == 6000.0);
}

// One thread for the probe, both pools restored after it; the run's random numbers untouched.
BOOST_AUTO_TEST_CASE(probe_leaves_threads_and_generator) {
  const int torch_before = torch::get_num_threads(), blas_before = app::blas_threads();
  const bool openblas = app::detail::blas_thread_calls().set != nullptr;  // another BLAS has no threads to set
  app::set_compute_threads(2);
  torch::manual_seed(11);
  const auto expected = torch::randn({5});
  torch::manual_seed(11);
  {
    const app::OneComputeThread one;
    BOOST_TEST(torch::get_num_threads() == 1);
    BOOST_TEST(app::blas_threads() == 1);  // 1 also without OpenBLAS
    const auto rate = app::time_linear({"t", 64, 48, 32}, 0.001);
    BOOST_TEST(rate.gflops > 0);
    BOOST_TEST(rate.shape.flops() == 2.0 * 64 * 48 * 32);
  }
  BOOST_TEST(torch::get_num_threads() == 2);
  BOOST_TEST(app::blas_threads() == (openblas ? 2 : 1));
  BOOST_TEST(torch::equal(torch::randn({5}), expected));
  torch::set_num_threads(torch_before);
  if (openblas) app::detail::blas_thread_calls().set(blas_before);
}

// Every rank: the node's first rank measures and keeps the probe in the run directory; the peak is
// its per-thread rate x threads summed over the ranks; a second start reads the kept probe, and one
// with other products measures again.
BOOST_AUTO_TEST_CASE(run_peak_and_cache) {
  auto world = MpiComm::world();
  std::int64_t id = world.rank() == 0 ? static_cast<std::int64_t>(getpid()) : 0;
  world.broadcast(&id, 1, fsdp::DType::kInt64, 0);
  const auto dir = std::filesystem::temp_directory_path() / ("fsdp_gemm_probe_" + std::to_string(id));
  if (world.rank() == 0) std::filesystem::create_directories(dir);
  world.barrier();
  const std::vector<app::GemmShape> shapes = {{"a", 32, 64, 48}, {"b", 16, 16, 16}};
  const auto first = app::probe_run_peak(world, dir, shapes, 2);
  const bool leader = world.split_node().rank() == 0;
  if (leader) {
    BOOST_TEST(!first.probe.cached);
    BOOST_TEST_REQUIRE(first.probe.shapes.size() == 2u);
    BOOST_TEST(first.probe.peak_gflops_per_thread() == std::max(first.probe.shapes[0].gflops, first.probe.shapes[1].gflops));
    BOOST_TEST(std::filesystem::exists(app::gemm_probe_path(dir, app::host_name())));
  }
  // One node in these tests: every rank's threads at its rate.
  double rate = first.probe.peak_gflops_per_thread();
  world.broadcast(&rate, 1, fsdp::DType::kFloat64, 0);
  BOOST_TEST(first.flops_per_s == rate * 1e9 * 2 * world.size(), boost::test_tools::tolerance(1e-12));
  world.barrier();
  const auto again = app::probe_run_peak(world, dir, shapes, 2);
  BOOST_TEST(again.flops_per_s == first.flops_per_s);
  if (leader) {
    BOOST_TEST(again.probe.cached);
    BOOST_TEST(again.probe.fixed.gflops == first.probe.fixed.gflops);
  }
  world.barrier();
  if (world.rank() == 0) {
    BOOST_TEST(!app::read_gemm_probe(app::gemm_probe_path(dir, app::host_name()), {{"a", 32, 64, 49}, {"b", 16, 16, 16}}));
    BOOST_TEST(!app::read_gemm_probe(app::gemm_probe_path(dir, app::host_name()), {shapes[0]}));
    std::ofstream(app::gemm_probe_path(dir, app::host_name())) << "{ not json";
    BOOST_TEST(!app::read_gemm_probe(app::gemm_probe_path(dir, app::host_name()), shapes));
    fsdp::remove_tree(dir);
  }
  world.barrier();
}

BOOST_AUTO_TEST_CASE(utilization_and_warmup) {
  app::Utilization u{.flops_per_sample = 1e9};
  BOOST_TEST(!u.at(10.0));  // no peak (a GPU)
  u.peak.flops_per_s = 4e10;
  BOOST_TEST(*u.at(10.0) == 0.25);
  const std::vector<double> steps = {9, 7, 5, 1, 2, 3};
  const auto split = app::split_warmup(steps, 3);
  BOOST_TEST(split.warmup == (std::vector<double>{9, 7, 5}), boost::test_tools::per_element());
  BOOST_TEST(split.median() == 2.0);
  const auto short_run = app::split_warmup({9, 7, 5}, 3);  // no step after the warm-up: all are measured
  BOOST_TEST(short_run.warmup.empty());
  BOOST_TEST(short_run.median() == 7.0);
}

}  // namespace gemm_probe_tests
