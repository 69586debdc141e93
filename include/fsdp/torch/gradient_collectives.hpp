// One unit's gradient collectives (torch layer): run in place by the computing thread or the
// collective worker, or issued non-blocking where the communicator progresses on its own; and
// on_contiguous, for the collectives on parameters and buffers that may be strided views, with the
// averaging of buffers over the world.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <future>
#include <memory>
#include <utility>
#include <vector>

#include "fsdp/comm/communicator.hpp"
#include "fsdp/torch/flat_unit.hpp"
#include "fsdp/torch/options.hpp"

namespace fsdp::detail {

// Runs `collective` on `t`'s elements in a contiguous buffer (a copy when `t` is strided, written
// back after): the collectives take flat memory, buffers and parameters may be views.
template <class F>
void on_contiguous(const torch::Tensor& t, F&& collective) {
  torch::NoGradGuard no_grad;
  auto c = t.contiguous();
  collective(c);
  if (!c.is_same(t)) t.copy_(c);
}

// fsdp.buffer_sync = AVERAGE: averages `root`'s floating-point buffers over `world` and broadcasts
// the integer ones (counters) from rank 0, so every rank holds the same.
template <class Comm>
void average_buffers(Comm& world, torch::nn::Module& root) {
  if (world.size() == 1) return;
  for (auto& b : root.buffers(/*recurse=*/true)) {
    if (!b.defined() || b.numel() == 0) continue;
    on_contiguous(b, [&world](const torch::Tensor& c) {
      const DType dt = to_comm_dtype(c.scalar_type());
      if (c.is_floating_point())
        world.all_reduce(c.data_ptr(), c.data_ptr(), c.numel(), dt, ReduceOp::kAvg);
      else
        world.broadcast(c.data_ptr(), c.numel(), dt, 0);
    });
  }
}

// One unit's gradient collectives, on the computing thread or the collective worker (with its
// duplicates of the groups), all averaging: a reduce-scatter of `flat` over the shard group into
// `shard_grad` (null group: not sharded, `shard_grad` is `flat`), then across the replicas an
// all-reduce of it, or with `part_grad` (optimizer sharded over the world) a reduce-scatter into that.
template <class Comm>
void reduce_gradient(Comm* shard_group, Comm* replica_group, const torch::Tensor& flat, const torch::Tensor& shard_grad, std::int64_t shard_numel,
                     const torch::Tensor& part_grad, DType dt) {
  if (shard_group) shard_group->reduce_scatter(flat.data_ptr(), shard_grad.data_ptr(), shard_numel, dt, ReduceOp::kAvg);
  if (!replica_group) return;
  if (part_grad.defined())
    replica_group->reduce_scatter(shard_grad.data_ptr(), part_grad.data_ptr(), part_grad.numel(), dt, ReduceOp::kAvg);
  else
    replica_group->all_reduce(shard_grad.data_ptr(), shard_grad.data_ptr(), shard_numel, dt, ReduceOp::kAvg);
}

// reduce_gradient's collectives issued non-blocking (a communicator that progresses on its own): the
// returned future, when waited for, orders their results for this thread (on a GPU: the compute
// stream waits; the host does not) and until then keeps every buffer they use alive. The replica
// stage reads the shard stage's result: a GPU lane runs them in issue order; elsewhere the shard
// stage is waited for first.
template <class Comm>
std::shared_future<void> issue_gradient_reduction(Comm* shard_group, Comm* replica_group, const torch::Tensor& flat, const torch::Tensor& shard_grad,
                                                  std::int64_t shard_numel, const torch::Tensor& part_grad, DType dt) {
  using Request = decltype(std::declval<Comm&>().ireduce_scatter(nullptr, nullptr, 0, dt, ReduceOp::kAvg));
  auto requests = std::make_shared<std::vector<Request>>();
  if (shard_group) requests->push_back(shard_group->ireduce_scatter(flat.data_ptr(), shard_grad.data_ptr(), shard_numel, dt, ReduceOp::kAvg));
  if (replica_group) {
    if constexpr (!comm_moves_device_memory<Comm>())
      if (!requests->empty()) requests->back().wait();
    if (part_grad.defined())
      requests->push_back(replica_group->ireduce_scatter(shard_grad.data_ptr(), part_grad.data_ptr(), part_grad.numel(), dt, ReduceOp::kAvg));
    else
      requests->push_back(replica_group->iall_reduce(shard_grad.data_ptr(), shard_grad.data_ptr(), shard_numel, dt, ReduceOp::kAvg));
  }
  return std::async(std::launch::deferred,
                    [requests, flat, shard_grad, part_grad] {
                      for (auto& r : *requests) r.wait();
                    })
      .share();
}

}  // namespace fsdp::detail
