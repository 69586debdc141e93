// What the LibTorch test programs under mpirun share: the MPI fixture with one LibTorch thread per rank,
// and the modules more than one of them trains.
#pragma once

#include <fsdp/fsdp.hpp>

#include "common.hpp"

/// MpiFixture plus one LibTorch thread per rank (ranks x threads <= cores).
template <int kThreadLevel = MPI_THREAD_FUNNELED>
struct TorchMpiFixture : MpiFixture<kThreadLevel> {
  TorchMpiFixture() { torch::set_num_threads(1); }
};

/// Output projection that reuses (ties) an existing weight, transposed.
struct TiedOutImpl : torch::nn::Module {
  explicit TiedOutImpl(torch::Tensor shared) { weight = register_parameter("weight", std::move(shared)); }
  torch::Tensor forward(const torch::Tensor& x) { return torch::nn::functional::linear(x, weight.t()); }
  torch::Tensor weight;
};
TORCH_MODULE(TiedOut);
