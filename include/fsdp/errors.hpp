// Typed errors thrown by every layer of fsdp. The library never exits; the application decides policy.
// Each message starts with a stable, searchable id in brackets, e.g. "[fsdp.comm] ...".
#pragma once

#include <stdexcept>
#include <string>

namespace fsdp {

/// Base of every error the library throws.
class Error : public std::runtime_error {
 public:
  Error(const std::string& id, const std::string& what) : std::runtime_error("[" + id + "] " + what), id_(id) {}
  /// The stable id, e.g. "fsdp.comm".
  const std::string& id() const noexcept { return id_; }

 private:
  std::string id_;
};

/// Invalid configuration or usage (options, wrap policy, model structure).
class ConfigError : public Error {
 public:
  explicit ConfigError(const std::string& what, const std::string& id = "fsdp.config") : Error(id, what) {}
};

/// A collective or the communicator failed.
class CommError : public Error {
 public:
  explicit CommError(const std::string& what, const std::string& id = "fsdp.comm") : Error(id, what) {}
};

/// A checkpoint could not be written, read or verified.
class CheckpointError : public Error {
 public:
  explicit CheckpointError(const std::string& what, const std::string& id = "fsdp.ckpt") : Error(id, what) {}
};

/// The message of an exception without the "[id] " prefix of fsdp errors (for a sentence that
/// carries its own context).
inline std::string message_without_id(const std::exception& e) {
  std::string m = e.what();
  if (!m.empty() && m[0] == '[') {
    const auto close = m.find("] ");
    if (close != std::string::npos) m = m.substr(close + 2);
  }
  return m;
}

}  // namespace fsdp
