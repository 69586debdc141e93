// Document-aware packing (data.document_mask): where the documents of a packed sequence begin (at
// each data.eot_token), each token's position inside its document, and the attention that never
// crosses a document boundary. The GPT and the Llama compute it once per forward and share it with
// their attention modules, whose signature stays forward(x) (FSDP units call them one tensor in).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>

namespace fsdp::app {

/// One forward's documents: positions (batch, t) restart at 0 where a document begins (at every
/// separator token, and at the sequence's first token, which may continue a document cut by the
/// packing); blocked (batch, 1, t, t) is true where a query must not see a key: a later token, or
/// one of another document.
struct DocumentLayout {
  torch::Tensor positions, blocked;
};

/// Shared by a model and its attention modules: set by the model's forward before its layers run, read
/// by each attention (also when activation checkpointing recomputes it in backward: the layout is only
/// replaced by the next forward).
using SharedDocumentLayout = std::shared_ptr<DocumentLayout>;

/// The layout of `idx` (batch, t) whose documents each begin with `separator`.
inline DocumentLayout document_layout(const torch::Tensor& idx, std::int64_t separator) {
  const auto t = idx.size(1);
  const auto at = torch::arange(t, idx.options().dtype(torch::kLong)).unsqueeze(0).expand({idx.size(0), t});
  const auto begins = idx.eq(separator);
  // Where the document of each token began: the latest separator at or before it (0 if none).
  const auto began = std::get<0>(torch::where(begins, at, torch::zeros_like(at)).cummax(1));
  const auto document = begins.to(torch::kLong).cumsum(1);
  DocumentLayout layout;
  layout.positions = at - began;
  const auto later = torch::ones({t, t}, idx.options().dtype(torch::kBool)).triu(1);
  layout.blocked = later.unsqueeze(0).logical_or(document.unsqueeze(2).ne(document.unsqueeze(1))).unsqueeze(1);
  return layout;
}

}  // namespace fsdp::app
