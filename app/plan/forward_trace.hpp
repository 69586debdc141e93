// Memory planning (app layer): one forward pass as tensors created, saved for backward and released.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "models/families.hpp"
#include "plan/run_shape.hpp"
#include "plan/trace.hpp"

namespace fsdp::app {

// ==== 4. One forward pass as tensors created, saved for backward and released =======================

/// The forward pass of the deck's model on a batch of `batch` samples whose activations take `eb` bytes
/// per element, in training mode (dropout on) or evaluation (dropout off): its family's trace. Tensor 0
/// stands for the batch, which the training loop holds (and the simulator counts as data); the model's
/// output is dropped by the loss, whose saved tensors close the trace.
inline Trace trace_forward(const ModelSection& m, const ModelDesc& d, std::int64_t batch, int eb, bool training, bool cast_input) {
  Trace t;
  TraceBuilder b(d, t);
  t.tensor_bytes.push_back(0);
  model_family(m.kind).trace(b, m, batch, eb, training, cast_input);
  return t;
}

}  // namespace fsdp::app
