// Document-aware packing (data.document_mask): where the documents of a packed sequence begin (at
// each data.eot_token, or where an indexed dataset's .idx says), each token's position inside its
// document, and the attention that never crosses a document boundary. The GPT and the Llama compute it once per forward and share it with
// their attention modules, whose signature stays forward(x) (FSDP units call them one tensor in).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>

#include "fsdp/errors.hpp"

namespace fsdp::app {

/// One forward's documents: positions (batch, t) restart at 0 where a document begins (at every
/// separator token, and at the sequence's first token, which may continue a document cut by the
/// packing); blocked (batch, 1, t, t) is true where a query must not see a key: a later token, or
/// one of another document.
struct DocumentLayout {
  torch::Tensor positions, blocked;
  /// The data's document starts for the next forward (batch, t) bool: an indexed dataset's boundaries
  /// (Batch::begins); the next forward consumes them (undefined: the separator decides).
  torch::Tensor given_begins;
};

/// Shared by a model and its attention modules: set by the model's forward before its layers run, read
/// by each attention (also when activation checkpointing recomputes it in backward: the layout is only
/// replaced by the next forward).
using SharedDocumentLayout = std::shared_ptr<DocumentLayout>;

/// The layout of sequences (batch, t) whose documents begin where `begins` (batch, t, bool) is true.
inline DocumentLayout document_layout_of(const torch::Tensor& begins) {
  const auto t = begins.size(1);
  const auto at = torch::arange(t, begins.options().dtype(torch::kLong)).unsqueeze(0).expand({begins.size(0), t});
  // Where the document of each token began: the latest separator at or before it (0 if none).
  const auto began = std::get<0>(torch::where(begins, at, torch::zeros_like(at)).cummax(1));
  const auto document = begins.to(torch::kLong).cumsum(1);
  DocumentLayout layout;
  layout.positions = at - began;
  const auto later = torch::ones({t, t}, begins.options().dtype(torch::kBool)).triu(1);
  layout.blocked = later.unsqueeze(0).logical_or(document.unsqueeze(2).ne(document.unsqueeze(1))).unsqueeze(1);
  return layout;
}

/// The layout of `idx` (batch, t) for a model's forward: the data's starts when given (consumed),
/// else a document begins at each `separator` (-1: none, one document per sequence).
inline DocumentLayout document_layout(const torch::Tensor& idx, std::int64_t separator, const DocumentLayout& previous) {
  if (previous.given_begins.defined()) {
    if (previous.given_begins.sizes() != idx.sizes())
      throw ConfigError("the batch's document starts have shape " + std::to_string(previous.given_begins.size(0)) + "x" +
                        std::to_string(previous.given_begins.size(-1)) + ", its tokens " + std::to_string(idx.size(0)) + "x" +
                        std::to_string(idx.size(-1)));
    return document_layout_of(previous.given_begins.to(idx.device()));
  }
  return document_layout_of(separator >= 0 ? idx.eq(separator) : torch::zeros(idx.sizes(), idx.options().dtype(torch::kBool)));
}

}  // namespace fsdp::app
