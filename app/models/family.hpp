// What the app and the planner know of one model kind (app layer, std only; fsdp-plan has no
// LibTorch): its data, its module tree in closed form, its parameter count, one forward pass as the
// memory planner replays it, its sizes and the knobs fsdp-plan --memory grows. Each kind has one
// ModelFamily in its own file (app/models/<kind>_family.hpp), found by model_family(kind) in
// app/models/families.hpp; the LibTorch model it describes is app/models/<kind>.hpp.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "deck.hpp"
#include "fsdp/io/tensor_naming.hpp"
#include "plan/measured.hpp"
#include "plan/model_desc.hpp"
#include "plan/trace.hpp"
#include "run_config.hpp"

namespace fsdp::app {

/// A model's parameters and a step's activations (elements), estimated in long double before any
/// 64-bit arithmetic: check_sizes_are_addressable refuses what no program could address.
struct SizeEstimate {
  long double params = 0;
  long double activations = 0;  ///< one step's, for a batch of the given size
  std::string keys;             ///< the keys that set them, named in the message
};

/// A model as Hugging Face's transformers holds it: checkpoint.export_names = "hf" and fsdp-ckpt
/// export --names hf write its tensors under `naming` and `config` as config.json beside them.
struct HfForm {
  nlohmann::ordered_json config;       ///< config.json, torch_dtype "float32" (the exporter sets the dtype written)
  std::optional<TensorNaming> naming;  ///< nullopt: the model's own names are Hugging Face's
};

/// A size key fsdp-plan --memory grows to find the largest model of the family that fits.
struct SizeKnob {
  std::string name;                                              ///< its column: "n_layers"
  std::int64_t multiple = 1;                                     ///< the values are multiples of this (d_model: n_heads)
  bool same_per_step = false;                                    ///< each step adds the same tensors (layers): extrapolated past 256
  std::function<ModelSection(ModelSection, std::int64_t)> with;  ///< the deck's model with the knob at a value
  std::function<std::string(const ModelSection&)> shown;         ///< the knob's value in that model, as printed
  std::string note;                                              ///< how the search moved it, for the table's footer
  int column = 12;                                               ///< the value's printf width (negative: left-aligned)
};

/// The decoders' knobs: n_layers at the deck's width (every layer adds the same tensors), and
/// d_model, a multiple of `multiple` (named `multiple_of`), at the deck's depth.
inline SizeKnob layers_knob(const ModelSection& m) {
  SizeKnob k{.name = "n_layers",
             .same_per_step = true,
             .note = "n_layers at d_model " + std::to_string(m.d_model) + ", ~: extrapolated from 128 and 256 layers"};
  k.with = [](ModelSection s, std::int64_t n) {
    s.n_layers = n;
    return s;
  };
  k.shown = [](const ModelSection& s) { return std::to_string(s.n_layers); };
  return k;
}
inline SizeKnob width_knob(const ModelSection& m, std::int64_t multiple, const std::string& multiple_of) {
  SizeKnob k{
      .name = "d_model",
      .multiple = multiple,
      .note = std::string("d_model") + (multiple > 1 ? ", a multiple of " + multiple_of + "," : "") + " at n_layers " + std::to_string(m.n_layers)};
  k.with = [](ModelSection s, std::int64_t d) {
    s.d_model = d;
    return s;
  };
  k.shown = [](const ModelSection& s) { return std::to_string(s.d_model); };
  return k;
}

class ModelFamily {
 public:
  virtual ~ModelFamily() = default;
  virtual ModelKind kind() const = 0;
  /// A language model trains on token sequences (data.kind tokens, text, token-shards, indexed; next-token
  /// loss, evaluated in chunks); the others classify 28x28 images into 10 classes.
  virtual bool language_model() const = 0;
  /// fsdp.transformer_layer_cls_to_wrap = "auto": the module classes that become units.
  virtual std::vector<std::string> layer_classes(const ModelSection& m) const = 0;
  /// The module tree of the model fsdp-train builds, in closed form (fsdp-train --check-plan compares).
  virtual ModelDesc describe(const ModelSection& m) const = 0;
  /// Distinct parameter elements by formula (docs/planning.md gives the GPT's, MLP's and CNN's; summary.json's "params").
  virtual std::int64_t num_params(const ModelSection& m) const = 0;
  /// One forward and the loss on a batch of `batch` samples whose activations take `eb` bytes per
  /// element, training (dropout on) or not. Tensor 0 is the batch; `cast_input`: the root forward
  /// casts floating-point inputs to the parameter dtype first.
  virtual void trace(TraceBuilder& b, const ModelSection& m, std::int64_t batch, int eb, bool training, bool cast_input) const = 0;
  /// Bytes of a batch's inputs and targets as the training loop holds them.
  virtual std::int64_t input_bytes(const ModelSection& m, std::int64_t batch) const = 0;
  virtual std::int64_t target_bytes(const ModelSection& m, std::int64_t batch) const = 0;
  /// Predictions per sample an evaluation compares with its targets.
  virtual std::int64_t predictions_per_sample(const ModelSection&) const { return 1; }
  /// Samples per evaluation forward for an evaluation batch of `batch`.
  virtual std::int64_t eval_chunk(const ModelSection&, std::int64_t batch) const { return batch; }
  /// Training FLOPs per token of a language model (`num_params` counted once); 0 for the others.
  virtual double flops_per_token(const ModelSection&, std::int64_t /*num_params*/) const { return 0; }
  /// Training FLOPs per sample (forward and backward, nothing recomputed counted): the model FLOP
  /// utilization's numerator. A language model's per token times the tokens it predicts (model.context).
  virtual double flops_per_sample(const ModelSection& m, std::int64_t num_params) const {
    return flops_per_token(m, num_params) * static_cast<double>(m.context);
  }
  virtual SizeEstimate size_estimate(const ModelSection& m, long double batch) const = 0;
  /// fsdp-plan --memory's knobs; none: only the batch is searched.
  virtual std::vector<SizeKnob> size_knobs(const ModelSection&) const { return {}; }
  /// Checks between the model's keys in the deck, each problem "<where>: <key>: <message>".
  virtual void cross_check(const Deck&, std::vector<std::string>& /*problems*/) const {}
  /// Resident heap per byte of the heap's live high-water mark under run.malloc = "reuse"
  /// (plan/measured.hpp says how each was measured); activations under activation checkpointing
  /// take kReuseHeapFactorCheckpointedActivations instead.
  virtual double reuse_heap_factor() const { return kReuseHeapFactor; }
  /// Its Hugging Face form; nullopt where transformers has no such architecture.
  virtual std::optional<HfForm> hf_form(const ModelSection&) const { return std::nullopt; }
};

namespace detail {
/// Module descriptions shared by the families.
inline void describe_linear(ModelDesc& d, int parent, const std::string& key, std::int64_t in, std::int64_t out, bool bias = true) {
  const int m = d.add(parent, key, "Linear", "torch::nn::Linear");
  d.param(m, "weight", {out, in});
  if (bias) d.param(m, "bias", {out});
}
inline void describe_layer_norm(ModelDesc& d, int parent, const std::string& key, std::int64_t n) {
  const int m = d.add(parent, key, "LayerNorm", "torch::nn::LayerNorm");
  d.param(m, "weight", {n});
  d.param(m, "bias", {n});
}
/// Where an entry was set, for a cross-check's message.
inline std::string where(const Deck& deck, const Entry& e) { return e.where.empty() ? deck.path() : e.where; }
inline bool set_explicitly(const Entry& e) { return e.source != Source::kDefault; }
}  // namespace detail

/// The two image classifiers' common part: 28x28 float images in (cast to the parameter dtype by the
/// root forward under mixed precision), one label each, the loss over 10 log-probabilities.
class ImageClassifierFamily : public ModelFamily {
 public:
  bool language_model() const final { return false; }
  std::int64_t input_bytes(const ModelSection&, std::int64_t batch) const final { return batch * kPixels * 4; }
  std::int64_t target_bytes(const ModelSection&, std::int64_t batch) const final { return batch * 8; }
  void trace(TraceBuilder& b, const ModelSection& m, std::int64_t batch, int eb, bool training, bool cast_input) const final {
    int x = 0;  // the batch
    std::int64_t x_bytes = batch * kPixels * 4;
    if (cast_input) {
      x = b.op(batch * kPixels * eb, {}, {}, {}, 0);
      x_bytes = batch * kPixels * eb;
    }
    trace_layers(b, m, batch, eb, training, x, x_bytes);
  }

 protected:
  static constexpr std::int64_t kPixels = 784;
  static constexpr std::int64_t kClasses = 10;
  /// The layers on the (possibly cast) input `x` of `x_bytes`, then the loss.
  virtual void trace_layers(TraceBuilder& b, const ModelSection& m, std::int64_t batch, int eb, bool training, int x, std::int64_t x_bytes) const = 0;
  /// log_softmax of the `logits` of the last layer (whose input `last_input` it drops), the cast to
  /// fp32 the loss makes under mixed precision, and nll_loss.
  static void trace_loss(TraceBuilder& b, std::int64_t batch, int eb, int logits, int last_input) {
    const std::int64_t out = batch * kClasses * eb, out32 = batch * kClasses * 4;
    const int ls = b.op(out, {}, {logits, last_input}, {}, 2 * out, true);  // log_softmax saves its result
    int lo = ls;
    if (eb != 4) lo = b.op(out32, {}, {}, {}, out32);
    b.op(8, {lo}, {ls, lo == ls ? -1 : lo}, {}, 2 * out32);
  }
};

}  // namespace fsdp::app
