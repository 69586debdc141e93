// Example: train a student MLP to imitate a fixed random teacher with FULL_SHARD FSDP.
//   mpirun -np 2 build/bin/fsdp_example [--steps N] [--strategy FULL_SHARD|SHARD_GRAD_OP|NO_SHARD|...]
// Every rank draws its own slice of each global batch; rank 0 prints the loss averaged over ranks.
#include <fsdp/fsdp.hpp>

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
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--steps" && i + 1 < argc) steps = std::atoi(argv[++i]);
    else if (arg == "--strategy" && i + 1 < argc) strategy = argv[++i];
    else if (arg.rfind("--", 0) == 0 && arg != "--help") { std::fprintf(stderr, "unknown option %s\n", arg.c_str()); return 2; }
    else if (arg == "--help") { std::printf("usage: fsdp_example [--steps N] [--strategy NAME]\n"); return 0; }
  }
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
    const int64_t local_batch = 32;
    float first = 0, last = 0;
    const auto t0 = std::chrono::steady_clock::now();
    for (int step = 0; step < steps; ++step) {
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
      if (step == 0) first = value;
      last = value;
      if (world.rank() == 0 && (step % 20 == 0 || step == steps - 1)) std::printf("step %4d  loss %.5f\n", step, value);
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const auto stats = model->memory_stats(&opt);
    if (world.rank() == 0) {
      std::printf("%d steps in %.2f s on %d ranks (%s); state per rank %.2f MiB of %.2f MiB unsharded\n", steps, seconds, world.size(),
                  strategy.c_str(), stats.total() / 1048576.0, 4.0 * stats.unsharded_param_bytes / 1048576.0);
      std::printf(last < first ? "loss decreased from %.5f to %.5f\n" : "loss did not decrease (%.5f -> %.5f)\n", first, last);
    }
    return last < first ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fsdp_example: %s\n", e.what());
    return 1;
  }
}
