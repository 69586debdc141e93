// One FSDP unit's flat parameter and its state, and the autograd Function that connects the unit's
// shard to its parameters (torch layer, the engine's internals; checkpoints see ShardedUnit instead).
#pragma once

#include <torch/torch.h>

#include <atomic>
#include <cstdint>
#include <future>
#include <string>
#include <unordered_map>
#include <vector>

#include "fsdp/comm/communicator.hpp"
#include "fsdp/core/layout.hpp"
#include "fsdp/errors.hpp"
#include "fsdp/torch/options.hpp"
#include "fsdp/torch/registry.hpp"
#include "fsdp/trace.hpp"

namespace fsdp {

namespace detail {

/// One FSDP unit's flat parameter and its state.
struct FlatUnit {
  UnitInfo info;
  const torch::nn::Module* module = nullptr;
  std::vector<torch::Tensor> params;  // the module's own parameter tensors (aliased to views of `full`)
  std::vector<std::vector<std::int64_t>> shapes;
  FlatLayout layout;
  torch::Tensor shard;      // this rank's part of the flat parameter over the shard group (gathered from)
  torch::Tensor optimized;  // leaf, requires grad: what the optimizer updates; `shard`, or its replica part (optimizer sharded over the world)
  std::int64_t replicas_synced_version = -1;  // shard's version counter when the replicas' parts were last all-gathered into it
  torch::Tensor full;                         // padded flat buffer; storage freed while resharded (group size > 1)
  bool gathered = false;
  std::int64_t gathered_version = 0;  // shard's version counter when `full` was last gathered
  int pending_backward = 0;           // UnitGather nodes of this unit not yet run in backward
  torch::Tensor unsynced_grad;        // flat gradients accumulated locally inside no_sync()
  torch::Tensor recomputed_grad;      // flat gradients from a checkpointed descendant's recomputation, for this unit's own backward
  enum class Hooked { kUnknown, kYes, kNo } hooked = Hooked::kUnknown;
  bool entered = false;                            // pre_forward seen since the last root forward began
  bool grafted_by_root = false;                    // the root forward gathered and grafted this unit
  bool frozen = false;                             // a companion holding another unit's frozen parameters
  int companion = -1;                              // index of this unit's frozen companion, if it has frozen parameters
  c10::ScalarType dtype = c10::ScalarType::Float;  // of the parameters and the (master) shard
  bool low_precision = false;                      // `full` is in MixedPrecision::param_dtype, not `dtype`
  torch::Tensor summoned;                          // full-precision flat buffer inside summon_full_params (low_precision)
  std::vector<torch::Tensor> param_views;          // the parameters' views of `full`, shown while `full` has storage
  std::vector<torch::Tensor> param_placeholders;   // the parameters' shapes without storage, shown while `full` is freed
  bool backward_reads_no_params = false;           // declared in this step's forward (fsdp::backward_reads_no_parameter): not gathered for backward
  int releasing_reads = 0;                         // fsdp::linear_releasing_weight calls whose backward is still to run (until backward ends)
  bool backward_done_since_fill = false;           // every backward through the unit ran since `full` was last filled: a step may follow
  bool refill_needed = false;                      // the shard's values changed without its version moving (replica parts all-gathered)
  bool offloaded = false;                          // `shard` lives in host memory, `full` on the compute device
  std::shared_future<void> in_flight;              // a prefetched all-gather into `full` not yet waited for
  torch::Tensor kept_slice;                        // reshard_after_forward_group: this rank's slice of `full` kept after forward
  std::int64_t kept_version = -1;                  // shard's version counter when `kept_slice` was cut
  std::int64_t forward_began_us = -1;              // trace clock when the unit's forward / backward began (tracing on)
  std::int64_t backward_began_us = -1;
  /// Parameter `i` as a view of `flat`, a padded flat buffer of this unit.
  torch::Tensor param_view(const torch::Tensor& flat, std::size_t i) const {
    const auto i64 = static_cast<std::int64_t>(i);
    return flat.narrow(0, layout.param_offset(i64), layout.param_numel(i64)).view(shapes[i]);
  }
  /// Makes the module's parameters views of `flat` (their metadata is set once; storage comes and goes).
  void point_params_at(const torch::Tensor& flat) {
    for (std::size_t i = 0; i < params.size(); ++i) params[i].set_data(param_view(flat, i));
  }
  /// Gives `full` storage of its padded size again (the contents are undefined until filled) and the
  /// parameters their views of it.
  void allocate_full() {
    const c10::DeviceGuard on_its_device(full.device());  // a GPU allocator allocates on the current device
    auto* storage = full.storage().unsafeGetStorageImpl();
    const std::size_t nbytes = static_cast<std::size_t>(layout.padded_numel()) * full.element_size();
    storage->set_data_ptr_noswap(storage->allocator()->allocate(nbytes));
    storage->set_nbytes(nbytes);
    show_params();
  }
  /// Frees `full`'s storage. The parameters keep their shapes but lose their storage, so a tensor
  /// kept from module() is refused by LibTorch when read instead of reading freed memory; views cut
  /// earlier (autograd's saved tensors, param_views) keep `full`'s storage and see it refilled.
  void free_full() {
    hide_params();
    auto* storage = full.storage().unsafeGetStorageImpl();
    storage->set_data_ptr_noswap(c10::DataPtr(nullptr, full.device()));
    storage->set_nbytes(0);
  }
  /// Points the parameters at their views of `full`, or at storage-less placeholders while it is freed.
  void show_params() {
    for (std::size_t i = 0; i < params.size() && i < param_views.size(); ++i) params[i].set_data(param_views[i]);
  }
  void hide_params() {
    if (param_placeholders.size() != params.size()) {
      param_placeholders.clear();
      for (const auto& v : param_views) param_placeholders.push_back(storageless_like(v));
    }
    for (std::size_t i = 0; i < params.size() && i < param_placeholders.size(); ++i) params[i].set_data(param_placeholders[i]);
  }
  void show_params_as_full_is() {
    if (full.storage().nbytes() > 0 || full.numel() == 0)
      show_params();
    else
      hide_params();
  }
  /// Called as `full` is filled again. Outside a backward, after every backward through the unit has
  /// run, the optimizer may have changed the values since the last fill: autograd's saved copies of
  /// the parameters from before become stale, so their version moves (a graph kept across an
  /// optimizer step is then refused, as PyTorch refuses a graph over an updated parameter). A fill for
  /// a backward (another backward of a kept graph included), or for another forward before every
  /// backward has run, moves nothing; a shard written in place (its version moved) always does.
  void note_fill(bool in_backward) {
    if ((backward_done_since_fill && !in_backward) || gathered_version != shard._version())
      for (auto& p : params) torch::autograd::impl::bump_version(p);
    if (!in_backward) backward_done_since_fill = false;
    refill_needed = false;
  }
  /// `full` holds the shard's current values (no refill is due).
  bool fill_is_current() const { return gathered && gathered_version == shard._version() && !refill_needed; }
  /// A tensor of `like`'s shape, dtype and device without storage: any read of its data throws.
  static torch::Tensor storageless_like(const torch::Tensor& like) {
    const auto key = c10::computeDispatchKey(like.scalar_type(), like.layout(), like.device());
    auto impl = c10::make_intrusive<c10::TensorImpl>(c10::DispatchKeySet(key), like.dtype(), like.device());
    impl->set_sizes_contiguous(like.sizes());
    return torch::Tensor(std::move(impl));
  }
  /// One backward's gradients of the parameters packed into a padded flat buffer (an unused
  /// parameter's undefined gradient counts as zero, and so does the padding).
  torch::Tensor pack_grads(const std::vector<torch::Tensor>& grads, const torch::Device& device) const {
    auto flat = torch::empty({layout.padded_numel()}, shard.options().device(device).requires_grad(false));
    if (layout.padding() > 0) flat.narrow(0, layout.numel(), layout.padding()).zero_();
    for (std::size_t i = 0; i < params.size(); ++i) {
      const auto i64 = static_cast<std::int64_t>(i);
      auto slot = flat.narrow(0, layout.param_offset(i64), layout.param_numel(i64));
      if (i < grads.size() && grads[i].defined())
        slot.copy_(grads[i].reshape({-1}));
      else
        slot.zero_();
    }
    return flat;
  }
  /// A unit of one parameter without padding whose gradient arrives contiguous, in the shard's dtype
  /// and on `device` is already its flat gradient: that tensor, to be only read (autograd may have handed
  /// the same tensor to another node); undefined otherwise, and then pack_grads() copies.
  torch::Tensor grad_as_flat(const std::vector<torch::Tensor>& grads, const torch::Device& device) const {
    if (params.size() != 1 || grads.size() != 1 || layout.padding() > 0 || !grads[0].defined()) return {};
    const auto& g = grads[0];
    if (!g.is_contiguous() || g.scalar_type() != shard.scalar_type() || g.device() != device || g.numel() != layout.padded_numel()) return {};
    return g.view({-1});
  }
  /// The unit's name in traces: its module path, "(root)" for unit 0.
  std::string trace_name() const { return info.module_path.empty() ? std::string("(root)") : info.module_path; }
  /// `full` has storage of its own that gather() fills and reshard() frees.
  bool needs_gather() const noexcept { return layout.group_size() > 1 || low_precision || offloaded; }
};

/// Something UnitGather can call back into, found by id so a destroyed engine is detected, not used.
class GradReducer {
 public:
  virtual ~GradReducer() = default;
  virtual torch::Tensor reduce_unit_grads(int unit, const torch::autograd::variable_list& grads) = 0;
  virtual void pre_backward(int unit) = 0;
  virtual void end_of_backward() = 0;
};

inline LockedMap<std::int64_t, GradReducer*>& reducer_registry() {
  static LockedMap<std::int64_t, GradReducer*> registry;
  return registry;
}
/// The engine with this id, or a clear error if it was destroyed while its autograd graph lived on.
inline GradReducer& live_engine(std::int64_t engine_id) {
  const auto found = reducer_registry().find(engine_id);
  if (!found) throw ConfigError("backward reached an FSDP model that was already destroyed", "fsdp.engine");
  return **found;
}
inline std::int64_t next_engine_id() {
  static std::atomic<std::int64_t> id{0};
  return ++id;
}

/// shard -> per-parameter views of the gathered flat buffer; backward reduce-scatters.
struct UnitGather : public torch::autograd::Function<UnitGather> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, torch::Tensor shard, std::int64_t engine_id,
                                                std::int64_t unit_index, FlatUnit* unit) {
    ctx->saved_data["engine"] = engine_id;
    ctx->saved_data["unit"] = unit_index;
    torch::autograd::variable_list views;
    views.reserve(unit->params.size());
    for (std::size_t i = 0; i < unit->params.size(); ++i) views.push_back(unit->param_view(unit->full, i));
    (void)shard;
    return views;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    torch::Tensor shard_grad =
        live_engine(ctx->saved_data["engine"].toInt()).reduce_unit_grads(static_cast<int>(ctx->saved_data["unit"].toInt()), grads);
    return {shard_grad, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

// Records [began, now) as "<what><unit name>" when tracing is on and the span began.
inline void trace_unit_span(std::int64_t& began_us, const char* what, const FlatUnit& u) {
  auto& tracer = Tracer::instance();
  if (began_us < 0 || !tracer.enabled()) return;
  tracer.complete(what + u.trace_name(), what[0] == 'f' ? "forward" : "backward", began_us, tracer.now_us(), {{"unit", u.info.index}});
  began_us = -1;
}

inline DType to_comm_dtype(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float: return DType::kFloat32;
    case c10::ScalarType::Double: return DType::kFloat64;
    case c10::ScalarType::Half: return DType::kFloat16;
    case c10::ScalarType::BFloat16: return DType::kBFloat16;
    case c10::ScalarType::Int: return DType::kInt32;
    case c10::ScalarType::Long: return DType::kInt64;
    case c10::ScalarType::Byte:
    case c10::ScalarType::Bool: return DType::kUInt8;
    default: throw ConfigError(std::string("dtype ") + c10::toString(t) + " cannot be communicated");
  }
}

inline std::string join_path(const std::string& a, const std::string& b) { return a.empty() ? b : a + "." + b; }

/// The elements `range` of a flat tensor (a view).
inline torch::Tensor narrow_flat(const torch::Tensor& flat, FlatRange range) { return flat.narrow(0, range.begin, range.numel()); }

/// Every replica's `part` of a shard (or of a shard-shaped optimizer state) all-gathered into `room`,
/// replica q's at q * part.numel(); `room` holds part.numel() * replicas.size() elements and may hold
/// `part` itself. Collective over `replicas`.
template <class Comm>
void all_gather_parts(Comm& replicas, const torch::Tensor& part, const torch::Tensor& room) {
  // MPI forbids a send buffer inside the receive buffer.
  const auto send = part.storage().is_alias_of(room.storage()) ? part.detach().clone() : part.detach().contiguous();
  replicas.all_gather(send.data_ptr(), room.data_ptr(), send.numel(), to_comm_dtype(send.scalar_type()));
}

}  // namespace detail

}  // namespace fsdp
