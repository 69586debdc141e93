// fsdp-train (app layer): what the resolved deck builds: the model, the engine's options, the backend,
// the optimizer and its learning-rate schedule; and --check-plan, the model against fsdp-plan's closed form.
#pragma once

#include <fsdp/fsdp.hpp>
#include <torch/torch.h>
#ifdef FSDP_WITH_NCCL
#include <fsdp/comm/nccl_comm.hpp>
#endif

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "models.hpp"
#include "plan/model_check.hpp"
#include "run_config.hpp"
#include "train/ranks.hpp"
#include "train/schedule.hpp"

namespace fsdp::app {

// ---- model and optimizer --------------------------------------------------------------------------

inline std::shared_ptr<AppModel> build_model(const RunConfig& cfg) { return build_model(cfg.model, cfg.fsdp.deferred_init); }

/// A class name to wrap that no module of the model has is a mistake, not a no-op.
inline void check_layer_classes(const RunConfig& cfg, const torch::nn::Module& model) {
  std::set<std::string> types;
  for (const auto& m : model.modules(/*include_self=*/true)) types.insert(fsdp::module_type_name(*m));
  check_wrap_classes(cfg.fsdp, types);
}

inline fsdp::FsdpOptions fsdp_options(const RunConfig& cfg) {
  fsdp::FsdpOptions o;
  o.sharding_strategy = cfg.fsdp.sharding_strategy;
  switch (cfg.fsdp.auto_wrap_policy) {
    case WrapPolicy::SIZE_BASED_WRAP: o.auto_wrap_policy = fsdp::AutoWrapPolicy::size_based(cfg.fsdp.min_num_params); break;
    case WrapPolicy::TRANSFORMER_BASED_WRAP: o.auto_wrap_policy = fsdp::AutoWrapPolicy::module_types(cfg.fsdp.transformer_layer_cls_to_wrap); break;
    case WrapPolicy::NO_WRAP: break;
  }
  o.reshard_after_forward = cfg.fsdp.reshard_after_forward;
  o.reshard_after_forward_group = cfg.fsdp.reshard_after_forward_group;
  o.shard_group_size = cfg.fsdp.shard_group_size;
  o.optimizer_sharding = cfg.fsdp.optimizer_sharding;
  o.sync_module_states = cfg.fsdp.sync_module_states;
  o.buffer_sync = cfg.fsdp.buffer_sync;
  switch (cfg.fsdp.mixed_precision) {
    case Precision::kBf16: o.mixed_precision = fsdp::MixedPrecision::bf16(); break;
    case Precision::kFp16: o.mixed_precision = fsdp::MixedPrecision::fp16(); break;
    case Precision::kFp16Reduce: o.mixed_precision = fsdp::MixedPrecision::fp16_reduce(); break;
    case Precision::kNo: break;
  }
  o.activation_checkpointing = cfg.fsdp.activation_checkpointing;
  o.offload_params = cfg.fsdp.offload_params;
  o.backward_prefetch = cfg.fsdp.backward_prefetch;
  o.forward_prefetch = cfg.fsdp.forward_prefetch;
  o.limit_all_gathers = static_cast<int>(cfg.fsdp.limit_all_gathers);
  if (cfg.fsdp.deferred_init) {  // the layers were released as built: initialized unit by unit
    o.param_init_fn = [init = torch_model(cfg.model.kind).init_module](torch::nn::Module& m, const std::string&) { init(m); };
    o.init_seed = cfg.run.seed;
    o.sync_module_states = false;  // every rank computes the same values: nothing to broadcast
  }
  o.overlap_grad_reduce = cfg.fsdp.overlap_grad_reduce;  // agreed by every rank
  o.all_units_called_through_forward = true;             // every model here calls its children through fsdp::forward
  return o;
}

/// The engine over `net` with the deck's options: on MpiComm over `world`, or on NcclComm (this rank's
/// GPU on its node; NCCL's own deadline is comm.timeout_s). Collective.
template <class Engine>
std::shared_ptr<Engine> make_engine(std::shared_ptr<AppModel> net, MpiComm& world, const RunConfig& cfg) {
  auto options = fsdp_options(cfg);
#ifdef FSDP_WITH_NCCL
  if constexpr (std::is_same_v<typename Engine::communicator_type, fsdp::NcclComm>) {
    fsdp::NcclOptions nccl;
    nccl.timeout_s = cfg.comm.timeout_s;
    nccl.device = cfg.fsdp.cuda_device;  // -1: fsdp::choose_device from what this rank sees
    auto comm = fsdp::NcclComm::from_mpi(world, nccl);
    options.device = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(comm.device()));
    return std::make_shared<Engine>(net, comm, options);
  } else
#endif
  {
    return std::make_shared<Engine>(net, world, options);
  }
}

#ifdef FSDP_WITH_NCCL
inline constexpr bool kBuiltWithNccl = true;
#else
inline constexpr bool kBuiltWithNccl = false;
#endif

/// fsdp.backend resolved: "mpi" or "nccl". auto means NCCL when the tensors can live on a GPU (a CUDA
/// LibTorch with a visible device, and an fsdp-train built with NCCL), MPI otherwise. Asking for
/// nccl where that does not hold is a deck error naming what is missing.
/// What this rank can run NCCL on, for resolve_run_config's choice of fsdp.backend.
inline Placement::Gpu probe_gpu() {
  Placement::Gpu gpu;
  gpu.usable = torch::cuda::is_available();
  gpu.built_with_nccl = kBuiltWithNccl;
  if (!gpu.usable) {
    const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
    gpu.why_not =
        (torch::cuda::device_count() == 0 && !at::hasCUDA() ? std::string("this LibTorch was built without CUDA") : std::string("no GPU visible")) +
        (visible ? std::string(", CUDA_VISIBLE_DEVICES=") + visible : std::string());
  }
  return gpu;
}

/// The optimizer of the deck. With optim.no_decay, adamw runs without decay of its own: the
/// WeightDecayMask (weight_decay.hpp) applies it, element by element, before each step. adam and adamw
/// update each shard in one pass (fsdp::optim::OnePassAdam: LibTorch's update, bit for bit where ATen
/// runs its AVX2 or AVX-512 kernels); with optim.state_dtype = bf16 they keep their moments in bf16
/// (fsdp::optim::Bf16MomentsAdam).
template <class Engine>
inline std::unique_ptr<torch::optim::Optimizer> build_optimizer(const RunConfig& cfg, Engine& model) {
  const double lr = cfg.optim.lr, wd = cfg.optim.no_decay.empty() ? cfg.optim.weight_decay : 0.0;
  const auto params = model.parameters();
  const auto& betas = cfg.optim.betas;
  const bool bf16_moments = cfg.optim.state_dtype == StateDtype::kBf16;
  switch (cfg.optim.kind) {
    case OptimizerKind::kSgd:
      return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(lr).momentum(cfg.optim.momentum).weight_decay(wd));
    case OptimizerKind::kAdam: {
      const auto options = torch::optim::AdamOptions(lr).betas({betas[0], betas[1]}).weight_decay(wd);
      if (bf16_moments) return std::make_unique<fsdp::optim::AdamBf16Moments>(params, options, fsdp::optim::places_in_units(model));
      return std::make_unique<fsdp::optim::OnePassAdamL2>(params, options);
    }
    case OptimizerKind::kAdamW: {
      const auto options = torch::optim::AdamWOptions(lr).betas({betas[0], betas[1]}).weight_decay(wd);
      if (bf16_moments) return std::make_unique<fsdp::optim::AdamWBf16Moments>(params, options, fsdp::optim::places_in_units(model));
      return std::make_unique<fsdp::optim::OnePassAdamW>(params, options);
    }
    case OptimizerKind::kAdadelta: break;
  }
  return std::make_unique<fsdp::optim::Adadelta>(params, fsdp::optim::AdadeltaOptions(lr).weight_decay(wd));
}

/// --check-plan: fsdp-plan's closed-form model (app/plan/) against the model LibTorch builds: module
/// tree, types, parameter names and shapes, ties, buffers and the parameter count. 0 if they match, 1 if not.
inline int check_plan_model(const std::string& deck_path, const std::vector<std::string>& overrides) {
  const ModelSection model = resolve_model_section(Deck::from_file(deck_path, overrides));
  const ModelFamily& family = model_family(model.kind);
  const ModelDesc desc = family.describe(model);
  torch::manual_seed(0);
  auto built = build_model(model);
  std::int64_t numel = 0, tensors = 0;
  std::set<const void*> seen;  // Module::parameters() lists a tied tensor once per name: count it once
  for (const auto& p : built->parameters()) {
    if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
    numel += p.numel();
    ++tensors;
  }
  std::string diff = compare_descriptions(desc, describe_module(*built, model.kind));
  if (family.num_params(model) != numel)
    diff += "parameter count: formula " + std::to_string(family.num_params(model)) + ", built " + std::to_string(numel) + "\n";
  if (desc.num_params() != numel)
    diff += "parameter count: description " + std::to_string(desc.num_params()) + ", built " + std::to_string(numel) + "\n";
  if (!diff.empty()) {
    std::fprintf(stderr, "fsdp-train: error: the closed-form model differs from the built one:\n%s", diff.c_str());
    return kExitFailure;
  }
  std::printf("model check: the closed form matches the built model (%lld parameters in %lld tensors, %zu modules)\n", static_cast<long long>(numel),
              static_cast<long long>(tensors), desc.modules.size());
  return 0;
}

}  // namespace fsdp::app
