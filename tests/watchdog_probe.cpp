// Exercises the collective deadline (CollectiveWatchdog) under mpirun.
//   watchdog_probe hang   rank 0 enters an all_reduce the others never call: it must end itself with
//                         exit code 6 and a message naming the collective, unit and step, within the
//                         deadline (1 s) plus the watchdog's polling period.
//   watchdog_probe bench  cost of the deadline on small all_reduces: off vs on (see docs/performance.md)
#include <fsdp/comm/mpi_comm.hpp>
#include <fsdp/comm/watchdog.hpp>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

int main(int argc, char** argv) {
  fsdp::MpiEnvironment env(&argc, &argv);
  auto world = fsdp::MpiComm::world();
  const bool hang = argc > 1 && std::strcmp(argv[1], "hang") == 0;
  auto& watchdog = fsdp::CollectiveWatchdog::instance();
  if (hang) {
    watchdog.configure(1.0, world.rank());
    watchdog.set_step(7);
    watchdog.set_unit(3);
    if (world.rank() == 0) {
      double x = 1;
      world.all_reduce(&x, &x, 1, fsdp::DType::kFloat64, fsdp::ReduceOp::kSum);  // the others never come
      std::printf("rank 0: the collective returned, which it must not\n");
      return 0;
    }
    std::this_thread::sleep_for(std::chrono::seconds(20));
    return 0;
  }
  // bench: the same small all_reduces with the deadline off, then on.
  const int calls = 20000;
  double times[2] = {0, 0};
  for (int on = 0; on < 2; ++on) {
    if (on) watchdog.configure(600, world.rank());
    double x = 1;
    for (int i = 0; i < 1000; ++i) world.all_reduce(&x, &x, 1, fsdp::DType::kFloat64, fsdp::ReduceOp::kMax);  // warm up
    world.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i) world.all_reduce(&x, &x, 1, fsdp::DType::kFloat64, fsdp::ReduceOp::kMax);
    times[on] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / calls;
  }
  if (world.rank() == 0)
    std::printf("watchdog_probe bench: %d ranks, %d all_reduce(8 bytes) calls: %.3f us per call without the deadline, %.3f us with it\n",
                world.size(), calls, times[0] * 1e6, times[1] * 1e6);
  return 0;
}
