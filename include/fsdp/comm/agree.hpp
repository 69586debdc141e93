// Agreeing on the outcome of a step every rank ran (comm layer, std only): did any rank fail, which
// one first and with what message. The checkpoint layer, NcclComm's setup and fsdp-train each turn
// the agreed failure into their own error, so that every rank stops, none waits in a collective the
// failed rank never reaches.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "fsdp/comm/communicator.hpp"

namespace fsdp {

/// Rank `root`'s `text` on every rank. Collective.
template <Communicator Comm>
std::string broadcast_string(Comm& comm, std::string text, int root = 0) {
  std::int64_t n = static_cast<std::int64_t>(text.size());
  comm.broadcast(&n, 1, DType::kInt64, root);
  text.resize(static_cast<std::size_t>(n));
  if (n > 0) comm.broadcast(text.data(), n, DType::kUInt8, root);
  return text;
}

/// What the ranks agreed after a step some of them failed.
struct AgreedFailure {
  int rank = -1;         ///< the lowest rank that failed
  std::string message;   ///< its message
  int failed_ranks = 0;  ///< how many ranks failed
  bool flagged = false;  ///< a failing rank passed flag = true (e.g. "the input was bad")
};

/// Every rank learns whether any rank failed (`error` set there) and, if so, the lowest failing rank's
/// message, how many failed and whether any of them set `flag`. Collective: one all-reduce when no
/// rank failed.
template <Communicator Comm>
std::optional<AgreedFailure> agree_on_failure(Comm& comm, const std::optional<std::string>& error, bool flag = false) {
  std::int64_t key[2] = {error ? comm.size() - comm.rank() : 0, error && flag ? 1 : 0};  // max picks the lowest failing rank
  comm.all_reduce(key, key, 2, DType::kInt64, ReduceOp::kMax);
  if (key[0] == 0) return std::nullopt;
  std::int64_t failed = error ? 1 : 0;
  comm.all_reduce(&failed, &failed, 1, DType::kInt64, ReduceOp::kSum);
  AgreedFailure f;
  f.rank = comm.size() - static_cast<int>(key[0]);
  f.message = broadcast_string(comm, error ? *error : std::string(), f.rank);
  f.failed_ranks = static_cast<int>(failed);
  f.flagged = key[1] != 0;
  return f;
}

}  // namespace fsdp
