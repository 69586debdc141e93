// How a model's tensors are named and laid out in another program's files (io layer, std only): the
// safetensors reader and writers and the checkpoint export map each model tensor through a
// TensorNaming. Without one, a tensor is stored as it is, under its own name.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace fsdp {

/// A model tensor as another program stores it.
struct ExternalTensor {
  std::string name;
  /// Only the first `rows` rows are stored (a vocabulary padded in the model); -1: every row.
  std::int64_t rows = -1;
  /// A matrix stored as its transpose (GPT-2's Conv1D keeps [in, out] where Linear keeps [out, in]);
  /// applied after the rows are cut.
  bool transposed = false;
  /// Other names a file may give it (read only; e.g. without a model prefix).
  std::vector<std::string> aliases;
};

struct TensorNaming {
  std::string scheme = "native";
  /// The external form of model tensor `name` of `shape`; nullopt: the scheme does not store it (a
  /// buffer the other program rebuilds).
  std::function<std::optional<ExternalTensor>(const std::string& name, const std::vector<std::int64_t>& shape)> external;
  /// Tensors a file may hold that no model tensor claims and that are not an error (e.g. GPT-2's
  /// attention masks); unset: none.
  std::function<bool(const std::string& name)> ignorable;
};

/// `name` under `naming`, or as it is when there is no naming.
inline std::optional<ExternalTensor> external_tensor(const TensorNaming* naming, const std::string& name, const std::vector<std::int64_t>& shape) {
  if (!naming || !naming->external) return ExternalTensor{name};
  return naming->external(name, shape);
}

/// The shape stored for a model tensor of `shape`.
inline std::vector<std::int64_t> external_shape(std::vector<std::int64_t> shape, const ExternalTensor& e) {
  if (e.rows >= 0 && !shape.empty()) shape[0] = e.rows;
  if (e.transposed && shape.size() == 2) std::swap(shape[0], shape[1]);
  return shape;
}

/// Elements stored of a model tensor of `shape`: a prefix of its flat elements unless transposed.
inline std::int64_t external_numel(const std::vector<std::int64_t>& shape, const ExternalTensor& e) {
  std::int64_t n = 1;
  for (auto d : external_shape(shape, e)) n *= d;
  return n;
}

}  // namespace fsdp
