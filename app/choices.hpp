// Deck choices as types (app layer, std only and the library's std-only enums). Each choice key of the deck is an enum here with one
// table of its names: the schema's list of choices, the resolved config's parse and every message or
// echo read that table, so a name is written once. Adding a model kind touches ModelKind's table, the
// model file and the schema's description.
#pragma once

#include <array>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fsdp/io/checkpoint_options.hpp"

namespace fsdp::app {

/// The names of enum `E`'s values as users write them in a deck: a specialisation with
/// `static constexpr std::array<std::pair<E, std::string_view>, N> kNames`.
template <class E>
struct ChoiceNames;

template <class E>
concept DeckChoice = requires {
  ChoiceNames<E>::kNames;
};

/// Every name of `E`, in the table's order (the schema's choices).
template <DeckChoice E>
std::vector<std::string> choice_names() {
  std::vector<std::string> names;
  for (const auto& [value, name] : ChoiceNames<E>::kNames) names.emplace_back(name);
  return names;
}

/// The name of `value` as the deck writes it.
template <DeckChoice E>
constexpr std::string_view name_of(E value) {
  for (const auto& [v, name] : ChoiceNames<E>::kNames)
    if (v == value) return name;
  return "?";
}

/// The value named `name`, if it is one of `E`'s names (exactly as the table writes it).
template <DeckChoice E>
constexpr std::optional<E> find_choice(std::string_view name) {
  for (const auto& [value, n] : ChoiceNames<E>::kNames)
    if (n == name) return value;
  return std::nullopt;
}

/// The value named `name`. The deck has checked every choice against the same table, so an unknown
/// name here is a bug of the caller (std::invalid_argument).
template <DeckChoice E>
E parse_choice(std::string_view name) {
  if (const auto value = find_choice<E>(name)) return *value;
  throw std::invalid_argument("not a choice of this key: '" + std::string(name) + "'");
}

template <DeckChoice E>
std::string to_string(E value) {
  return std::string(name_of(value));
}

// ---- the deck's choices -----------------------------------------------------------------------

enum class ModelKind { kCnn, kMlp, kTransformer, kLlama };
template <>
struct ChoiceNames<ModelKind> {
  static constexpr std::array kNames{std::pair{ModelKind::kCnn, std::string_view("cnn")}, std::pair{ModelKind::kMlp, std::string_view("mlp")},
                                     std::pair{ModelKind::kTransformer, std::string_view("transformer")},
                                     std::pair{ModelKind::kLlama, std::string_view("llama")}};
};

enum class Activation { kGelu, kGeluTanh };
template <>
struct ChoiceNames<Activation> {
  static constexpr std::array kNames{std::pair{Activation::kGelu, std::string_view("gelu")},
                                     std::pair{Activation::kGeluTanh, std::string_view("gelu_tanh")}};
};

/// model.rope_scaling: Llama 3.1/3.2's frequency scaling, or none.
enum class RopeScaling { kNone, kLlama3 };
template <>
struct ChoiceNames<RopeScaling> {
  static constexpr std::array kNames{std::pair{RopeScaling::kNone, std::string_view("none")},
                                     std::pair{RopeScaling::kLlama3, std::string_view("llama3")}};
};

enum class DataKind { kFashionMnist, kMnist, kTokens, kText, kTokenShards, kIndexed };
template <>
struct ChoiceNames<DataKind> {
  static constexpr std::array kNames{std::pair{DataKind::kFashionMnist, std::string_view("fashion-mnist")},
                                     std::pair{DataKind::kMnist, std::string_view("mnist")},
                                     std::pair{DataKind::kTokens, std::string_view("tokens")},
                                     std::pair{DataKind::kText, std::string_view("text")},
                                     std::pair{DataKind::kTokenShards, std::string_view("token-shards")},
                                     std::pair{DataKind::kIndexed, std::string_view("indexed")}};
};

/// Token sequences (for model.kind = "transformer") rather than images.
constexpr bool is_token_data(DataKind kind) {
  return kind == DataKind::kTokens || kind == DataKind::kText || kind == DataKind::kTokenShards || kind == DataKind::kIndexed;
}
/// Token files read memory-mapped as one stream (TokenStream): llm.c / nanoGPT files or a Megatron indexed dataset.
constexpr bool is_token_file_data(DataKind kind) { return kind == DataKind::kTokenShards || kind == DataKind::kIndexed; }

/// data.token_format: llm.c shards, or headerless uint16 / uint32 tokens (data.hpp reads them).
enum class TokenFormat { kLlmc, kUint16, kUint32 };
template <>
struct ChoiceNames<TokenFormat> {
  static constexpr std::array kNames{std::pair{TokenFormat::kLlmc, std::string_view("llmc")},
                                     std::pair{TokenFormat::kUint16, std::string_view("uint16")},
                                     std::pair{TokenFormat::kUint32, std::string_view("uint32")}};
};

enum class OptimizerKind { kSgd, kAdam, kAdamW, kAdadelta };
template <>
struct ChoiceNames<OptimizerKind> {
  static constexpr std::array kNames{
      std::pair{OptimizerKind::kSgd, std::string_view("sgd")}, std::pair{OptimizerKind::kAdam, std::string_view("adam")},
      std::pair{OptimizerKind::kAdamW, std::string_view("adamw")}, std::pair{OptimizerKind::kAdadelta, std::string_view("adadelta")}};
};

/// optim.state_dtype: the dtype Adam's moments are kept in (fp32: as the master parameters).
enum class StateDtype { kFp32, kBf16 };
template <>
struct ChoiceNames<StateDtype> {
  static constexpr std::array kNames{std::pair{StateDtype::kFp32, std::string_view("fp32")}, std::pair{StateDtype::kBf16, std::string_view("bf16")}};
};

enum class LrSchedule { kConstant, kStep, kCosine, kWsd };
template <>
struct ChoiceNames<LrSchedule> {
  static constexpr std::array kNames{
      std::pair{LrSchedule::kConstant, std::string_view("constant")}, std::pair{LrSchedule::kStep, std::string_view("step")},
      std::pair{LrSchedule::kCosine, std::string_view("cosine")}, std::pair{LrSchedule::kWsd, std::string_view("wsd")}};
};

/// fsdp.auto_wrap_policy (PyTorch's names, as users type them).
enum class WrapPolicy { NO_WRAP, SIZE_BASED_WRAP, TRANSFORMER_BASED_WRAP };
template <>
struct ChoiceNames<WrapPolicy> {
  static constexpr std::array kNames{std::pair{WrapPolicy::NO_WRAP, std::string_view("NO_WRAP")},
                                     std::pair{WrapPolicy::SIZE_BASED_WRAP, std::string_view("SIZE_BASED_WRAP")},
                                     std::pair{WrapPolicy::TRANSFORMER_BASED_WRAP, std::string_view("TRANSFORMER_BASED_WRAP")}};
};

/// fsdp.mixed_precision: no (fp32), bf16 or fp16 compute, or fp32 compute with fp16 reductions.
enum class Precision { kNo, kBf16, kFp16, kFp16Reduce };
template <>
struct ChoiceNames<Precision> {
  static constexpr std::array kNames{std::pair{Precision::kNo, std::string_view("no")}, std::pair{Precision::kBf16, std::string_view("bf16")},
                                     std::pair{Precision::kFp16, std::string_view("fp16")},
                                     std::pair{Precision::kFp16Reduce, std::string_view("fp16_reduce")}};
};

/// fsdp.backend as asked (auto) and as resolved (mpi or nccl).
enum class Backend { kAuto, kMpi, kNccl };
template <>
struct ChoiceNames<Backend> {
  static constexpr std::array kNames{std::pair{Backend::kAuto, std::string_view("auto")}, std::pair{Backend::kMpi, std::string_view("mpi")},
                                     std::pair{Backend::kNccl, std::string_view("nccl")}};
};

/// checkpoint.export_names: the model's own names, or Hugging Face GPT-2's.
/// checkpoint.export_names: the model's own, or Hugging Face's for its family (hf-gpt2: GPT-2's,
/// the older spelling for a GPT).
enum class ExportNames { kNative, kHf, kHfGpt2 };
template <>
struct ChoiceNames<ExportNames> {
  static constexpr std::array kNames{std::pair{ExportNames::kNative, std::string_view("native")}, std::pair{ExportNames::kHf, std::string_view("hf")},
                                     std::pair{ExportNames::kHfGpt2, std::string_view("hf-gpt2")}};
};

/// checkpoint.export_dtype: as trained (auto), or cast to one type.
enum class ExportDtype { kAsTrained, kFp32, kBf16, kFp16 };
template <>
struct ChoiceNames<ExportDtype> {
  static constexpr std::array kNames{std::pair{ExportDtype::kAsTrained, std::string_view("auto")},
                                     std::pair{ExportDtype::kFp32, std::string_view("fp32")}, std::pair{ExportDtype::kBf16, std::string_view("bf16")},
                                     std::pair{ExportDtype::kFp16, std::string_view("fp16")}};
};

/// log.progress: a live line on a terminal (auto decides), one line per log step, or nothing.
enum class ProgressMode { kAuto, kLive, kPlain, kNone };
template <>
struct ChoiceNames<ProgressMode> {
  static constexpr std::array kNames{
      std::pair{ProgressMode::kAuto, std::string_view("auto")}, std::pair{ProgressMode::kLive, std::string_view("live")},
      std::pair{ProgressMode::kPlain, std::string_view("plain")}, std::pair{ProgressMode::kNone, std::string_view("none")}};
};

/// checkpoint.state_dict_type: the library's enum, PyTorch's names.
template <>
struct ChoiceNames<StateDictType> {
  static constexpr std::array kNames{std::pair{StateDictType::SHARDED_STATE_DICT, std::string_view("SHARDED_STATE_DICT")},
                                     std::pair{StateDictType::FULL_STATE_DICT, std::string_view("FULL_STATE_DICT")},
                                     std::pair{StateDictType::LOCAL_STATE_DICT, std::string_view("LOCAL_STATE_DICT")}};
};

/// checkpoint.async_when_writing: what a save does while the previous background write still runs.
enum class AsyncWhenWriting { kQueue, kWait, kSkip };
template <>
struct ChoiceNames<AsyncWhenWriting> {
  static constexpr std::array kNames{std::pair{AsyncWhenWriting::kQueue, std::string_view("queue")},
                                     std::pair{AsyncWhenWriting::kWait, std::string_view("wait")},
                                     std::pair{AsyncWhenWriting::kSkip, std::string_view("skip")}};
};

/// checkpoint.async_copy: when an asynchronous save copies the shards and optimizer state to host memory.
enum class AsyncCopy { kBackground, kAtSave };
template <>
struct ChoiceNames<AsyncCopy> {
  static constexpr std::array kNames{std::pair{AsyncCopy::kBackground, std::string_view("background")},
                                     std::pair{AsyncCopy::kAtSave, std::string_view("at_save")}};
};

/// checkpoint.resume_changed: a resume whose deck changed a key that decides the training.
enum class ResumeChanged { kRefuse, kAllow };
template <>
struct ChoiceNames<ResumeChanged> {
  static constexpr std::array kNames{std::pair{ResumeChanged::kRefuse, std::string_view("refuse")},
                                     std::pair{ResumeChanged::kAllow, std::string_view("allow")}};
};

/// run.malloc: what the allocator does with freed memory (signals.hpp, apply_malloc_policy).
enum class MallocPolicy { kReuse, kReturn, kUntouched };
template <>
struct ChoiceNames<MallocPolicy> {
  static constexpr std::array kNames{std::pair{MallocPolicy::kReuse, std::string_view("reuse")},
                                     std::pair{MallocPolicy::kReturn, std::string_view("return")},
                                     std::pair{MallocPolicy::kUntouched, std::string_view("untouched")}};
};

/// run.memory_check: a predicted peak over the node's limit stops the run, warns, or is not checked.
enum class MemoryCheck { kRefuse, kWarn, kOff };
template <>
struct ChoiceNames<MemoryCheck> {
  static constexpr std::array kNames{std::pair{MemoryCheck::kRefuse, std::string_view("refuse")},
                                     std::pair{MemoryCheck::kWarn, std::string_view("warn")}, std::pair{MemoryCheck::kOff, std::string_view("off")}};
};

}  // namespace fsdp::app
