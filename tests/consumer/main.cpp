// Includes only torch-free headers so the check stays fast; linking fsdp::fsdp still pulls in
// LibTorch and MPI through the exported package config.
#include <fsdp/core/layout.hpp>
#include <fsdp/version.hpp>

#include <cstdio>

int main() {
  std::printf("fsdp %s: shard of 10 over 4 = %lld\n", fsdp::kVersion, static_cast<long long>(fsdp::shard_numel(10, 4)));
  return fsdp::shard_numel(10, 4) == 3 ? 0 : 1;
}
