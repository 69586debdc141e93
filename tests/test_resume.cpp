// Resuming from a checkpoint folder that has been damaged (part of test_checkpoint, run at np = 1..4): a `latest` that is
// empty, garbage, names a missing file or a corrupt one falls back to the newest checkpoint that
// loads; a folder whose checkpoints are all unreadable stops the run instead of starting over; and
// checkpoints past the one resumed from are moved aside, never overwritten by the resumed run.
#include <boost/test/unit_test.hpp>

#include "torch_common.hpp"

#include <fsdp/fsdp.hpp>

#include <filesystem>
#include <fstream>
#include <string>
#include "fsdp/file_tree.hpp"

namespace fs = std::filesystem;
using fsdp::MpiComm;

namespace resume_tests {

auto make_model() {
  torch::manual_seed(7);
  auto net = torch::nn::Sequential(torch::nn::Linear(5, 9), torch::nn::ReLU(), torch::nn::Linear(9, 3));
  fsdp::FsdpOptions options;
  options.auto_wrap_policy = fsdp::AutoWrapPolicy::module_types({"Linear"});
  return fsdp::make_fsdp(net, MpiComm::world(), options);
}

/// A folder with checkpoints at steps 8, 16 and 24 (latest: 24), new for each call.
template <class Model>
fs::path folder_with_three_checkpoints(Model& model, const std::string& name) {
  const fs::path dir = fs::path("resume_np" + std::to_string(MpiComm::world().size())) / name;
  if (MpiComm::world().rank() == 0) fsdp::remove_tree(dir);
  MpiComm::world().barrier();
  for (std::int64_t step : {8, 16, 24}) fsdp::save_checkpoint(*model, nullptr, dir.string(), {.step = step});
  return dir;
}

/// Runs `f` on rank 0 (a change to the shared folder); every rank waits for it.
void on_rank0(const std::function<void()>& f) {
  if (MpiComm::world().rank() == 0) f();
  MpiComm::world().barrier();
}

bool any_starts_with(const std::vector<std::string>& lines, const std::string& prefix) {
  for (const auto& l : lines)
    if (l.rfind(prefix, 0) == 0) return true;
  return false;
}

}  // namespace resume_tests

using namespace resume_tests;

BOOST_AUTO_TEST_CASE(a_damaged_latest_falls_back_to_the_newest_checkpoint_that_loads) {
  auto model = make_model();
  const std::vector<std::pair<std::string, std::string>> pointers = {
      {"empty", ""}, {"garbage", "garbage\n"}, {"missing", "step_00000099.h5\n"}, {"path", "../step_00000024.h5\n"}};
  for (const auto& [name, text] : pointers) {
    BOOST_TEST_CONTEXT("latest " << name) {
      const auto dir = folder_with_three_checkpoints(model, name);
      on_rank0([&, &text = text] { std::ofstream(dir / "latest") << text; });
      fsdp::TrainState state;
      const auto r = fsdp::resume_from_latest(*model, nullptr, dir.string(), &state);
      BOOST_TEST(r.path == (dir / "step_00000024.h5").string());
      BOOST_TEST(state.step == 24);
      BOOST_TEST(any_starts_with(r.skipped, "latest: "), "a warning names what was wrong with latest");
      BOOST_TEST(fs::exists(dir / "step_00000008.h5"));
    }
  }
}

BOOST_AUTO_TEST_CASE(a_corrupt_latest_checkpoint_falls_back_and_is_kept_aside) {
  auto model = make_model();
  const auto dir = folder_with_three_checkpoints(model, "corrupt");
  const auto size = fs::file_size(dir / "step_00000024.h5");
  MpiComm::world().barrier();  // every rank has the size before rank 0 truncates the file
  on_rank0([&] { fs::resize_file(dir / "step_00000024.h5", size / 2); });
  fsdp::TrainState state;
  const auto r = fsdp::resume_from_latest(*model, nullptr, dir.string(), &state);
  BOOST_TEST(r.path == (dir / "step_00000016.h5").string());
  BOOST_TEST(state.step == 16);
  BOOST_TEST(any_starts_with(r.skipped, "step_00000024.h5: "));
  // The unreadable file is kept for inspection, out of the way of this run's next save at step 24.
  BOOST_TEST(r.set_aside == std::vector<std::string>{"step_00000024.h5"});
  BOOST_TEST(!fs::exists(dir / "step_00000024.h5"));
  BOOST_TEST(fs::file_size(dir / "abandoned" / "step_00000024.h5") == size / 2);
  fsdp::save_checkpoint(*model, nullptr, dir.string(), {.step = 24});
  BOOST_TEST(fs::file_size(dir / "abandoned" / "step_00000024.h5") == size / 2);
  BOOST_TEST(fsdp::ckpt::inspect_latest(dir).name == "step_00000024.h5");
}

BOOST_AUTO_TEST_CASE(checkpoints_of_another_trajectory_are_never_overwritten) {
  auto model = make_model();
  const auto dir = folder_with_three_checkpoints(model, "trajectory");
  // A restart from step 8 (latest moved back): 16 and 24 belong to the abandoned trajectory.
  on_rank0([&] { std::ofstream(dir / "latest") << "step_00000008.h5\n"; });
  fsdp::TrainState state;
  const auto r = fsdp::resume_from_latest(*model, nullptr, dir.string(), &state);
  BOOST_TEST(state.step == 8);
  BOOST_TEST(r.set_aside == (std::vector<std::string>{"step_00000024.h5", "step_00000016.h5"}));
  BOOST_TEST(fs::exists(dir / "abandoned" / "step_00000016.h5"));
  BOOST_TEST(fs::exists(dir / "abandoned" / "step_00000024.h5"));
  BOOST_TEST(any_starts_with(r.skipped, "step_00000024.h5: newer than latest"));
}

BOOST_AUTO_TEST_CASE(unreadable_checkpoints_stop_the_run_instead_of_a_fresh_start) {
  auto model = make_model();
  const auto dir = folder_with_three_checkpoints(model, "all_bad");
  on_rank0([&] {
    for (const char* name : {"step_00000008.h5", "step_00000016.h5", "step_00000024.h5"}) fs::resize_file(dir / name, 100);
  });
  try {
    fsdp::resume_from_latest(*model, nullptr, dir.string());
    BOOST_FAIL("resumed from nothing");
  } catch (const fsdp::CheckpointError& e) {
    const std::string what = e.what();
    BOOST_TEST(what.find("none of the 3 checkpoint(s)") != std::string::npos, what);
    BOOST_TEST(what.find("checkpoint.resume = \"none\"") != std::string::npos, what);
  }
  // Nothing was moved or deleted.
  BOOST_TEST(fs::exists(dir / "step_00000024.h5"));
  // An empty folder is a fresh start.
  const auto empty = fs::path("resume_np" + std::to_string(MpiComm::world().size())) / "empty";
  on_rank0([&] { fsdp::remove_tree(empty); });
  BOOST_TEST(fsdp::resume_from_latest(*model, nullptr, empty.string()).path.empty());
}
