// Example: train a student MLP to imitate a fixed random teacher with FSDP, with checkpoints.
//   mpirun -np 2 build/bin/fsdp_example [--steps N] [--strategy FULL_SHARD|SHARD_GRAD_OP|NO_SHARD|...]
//          [--checkpoint-dir DIR --checkpoint-every N [--state-dict-type SHARDED|FULL|LOCAL] [--keep-last K]]
//          [--resume]
// Every rank draws its own slice of each global batch; rank 0 prints the loss averaged over ranks.
// With --resume the run continues from the newest usable checkpoint in --checkpoint-dir.
#include <CLI/CLI.hpp>
#include <fsdp/fsdp.hpp>
#include <mpi.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

struct StudentImpl : torch::nn::Module {
  StudentImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(64, 256));
    fc2 = register_module("fc2", torch::nn::Linear(256, 256));
    fc3 = register_module("fc3", torch::nn::Linear(256, 8));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(fsdp::forward(fc1, x));  // fsdp::forward lets each unit free its parameters after use
    x = torch::relu(fsdp::forward(fc2, x));
    return fsdp::forward(fc3, x);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};

int main(int argc, char** argv) {
  int steps = 200;
  std::string strategy = "FULL_SHARD";
  std::string checkpoint_dir, state_dict_type = "SHARDED", crash_at;
  int checkpoint_every = 0, keep_last = 0;
  bool resume = false;
  CLI::App cli{"fsdp example: a student MLP learns a random teacher", "fsdp_example"};
  cli.add_option("--steps", steps, "optimizer steps")->check(CLI::PositiveNumber);
  cli.add_option("--strategy", strategy, "sharding strategy");
  cli.add_option("--checkpoint-dir", checkpoint_dir, "folder for checkpoints");
  cli.add_option("--checkpoint-every", checkpoint_every, "save every N steps (0: never)")->check(CLI::NonNegativeNumber);
  cli.add_option("--state-dict-type", state_dict_type, "SHARDED, FULL or LOCAL");
  cli.add_option("--keep-last", keep_last, "keep the newest K checkpoints (0: all)")->check(CLI::NonNegativeNumber);
  cli.add_flag("--resume", resume, "continue from the newest usable checkpoint in --checkpoint-dir");
  cli.add_option("--crash-at", crash_at, "testing: STAGE:STEP exits the process at that stage of that step's save")->group("");
  CLI11_PARSE(cli, argc, argv);
  int mpi_initialized = 0;
  try {
    fsdp::MpiEnvironment env(&argc, &argv);
    auto world = fsdp::MpiComm::world();
    torch::set_num_threads(1);
    torch::manual_seed(0);
    auto teacher = torch::nn::Sequential(torch::nn::Linear(64, 32), torch::nn::Tanh(), torch::nn::Linear(32, 8));
    auto student = std::make_shared<StudentImpl>();

    fsdp::FsdpOptions options;
    options.sharding_strategy = fsdp::parse_sharding_strategy(strategy);
    options.auto_wrap_policy = fsdp::AutoWrapPolicy::size_based(10000);
    auto model = fsdp::make_fsdp(student, world, options);
    if (world.rank() == 0) std::printf("%s", model->describe().c_str());

    torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-3));
    fsdp::CheckpointOptions ckpt_options;
    ckpt_options.state_dict_type = fsdp::parse_state_dict_type(
        state_dict_type.find('_') == std::string::npos ? state_dict_type + "_STATE_DICT" : state_dict_type);  // SHARDED or SHARDED_STATE_DICT ...
    ckpt_options.keep_last = keep_last;
    if (!crash_at.empty()) {
      const auto colon = crash_at.find(':');
      const std::string stage = crash_at.substr(0, colon);
      const std::int64_t crash_step = std::stoll(crash_at.substr(colon + 1));
      ckpt_options.on_stage = [stage, crash_step, &world](const std::string& s, std::int64_t step) {
        if (s == stage && step == crash_step) {
          std::fprintf(stderr, "rank %d: crashing on purpose at stage '%s' of the save of step %lld\n", world.rank(), s.c_str(),
                       static_cast<long long>(step));
          _exit(17);
        }
      };
    }
    int start = 0;
    if (resume) {
      if (checkpoint_dir.empty()) throw fsdp::ConfigError("--resume needs --checkpoint-dir");
      fsdp::TrainState state;
      const auto r = fsdp::resume_from_latest(*model, &opt, checkpoint_dir, &state, ckpt_options);
      if (world.rank() == 0) {
        for (const auto& why : r.skipped) std::printf("skipped checkpoint %s\n", why.c_str());
        if (r.path.empty())
          std::printf("no usable checkpoint in %s: starting fresh\n", checkpoint_dir.c_str());
        else
          std::printf("resumed from %s at step %lld\n", r.path.c_str(), static_cast<long long>(state.step));
      }
      start = static_cast<int>(state.step);
    }
    const int64_t local_batch = 32;
    float first = 0, last = 0;
    const auto t0 = std::chrono::steady_clock::now();
    for (int step = start; step < steps; ++step) {
      auto gen = at::detail::createCPUGenerator(1000 * step + world.rank());
      auto x = torch::randn({local_batch, 64}, gen);
      torch::Tensor y;
      {
        torch::NoGradGuard no_grad;
        y = teacher->forward(x);
      }
      opt.zero_grad();
      auto loss = torch::mse_loss(model->forward(x), y);
      loss.backward();
      opt.step();
      float value = loss.item<float>();
      world.all_reduce(&value, &value, 1, fsdp::DType::kFloat32, fsdp::ReduceOp::kAvg);
      if (step == start) first = value;
      last = value;
      if (world.rank() == 0 && (step % 20 == 0 || step == steps - 1)) std::printf("step %4d  loss %.5f\n", step, value);
      if (checkpoint_every > 0 && !checkpoint_dir.empty() && (step + 1) % checkpoint_every == 0) {
        const auto saved = fsdp::save_checkpoint(*model, &opt, checkpoint_dir, {.step = step + 1}, ckpt_options);
        if (world.rank() == 0) std::printf("saved %s (%.1f KiB, %.3f s)\n", saved.path.c_str(), saved.bytes / 1024.0, saved.seconds);
      }
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const auto stats = model->memory_stats(&opt);
    if (world.rank() == 0) {
      std::printf("%d steps in %.2f s on %d ranks (%s); state per rank %.2f MiB of %.2f MiB unsharded\n", steps, seconds, world.size(),
                  strategy.c_str(), stats.total() / 1048576.0, 4.0 * stats.unsharded_param_bytes / 1048576.0);
      std::printf(last < first ? "loss decreased from %.5f to %.5f\n" : "loss did not decrease (%.5f -> %.5f)\n", first, last);
    }
    return last < first || steps - start < 2 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fsdp_example: %s\n", e.what());
    // An error on some ranks only would leave the others waiting in a collective: stop them all.
    MPI_Initialized(&mpi_initialized);
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (mpi_initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, 1);
    return 1;
  }
}
