// Output files written so that a full disk, a quota or a file size limit never leaves a truncated
// file under the real name: whole files are written under a temporary name and renamed; files that
// grow line by line are cut back to their last complete line. Every failure is an OutputError naming
// the file and the cause. Used by the checkpoints' small files, traces and the programs' outputs.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <string_view>

#include "fsdp/errors.hpp"

namespace fsdp {

/// An output file could not be written (disk full, permissions, a file size limit, a missing folder).
class OutputError : public Error {
 public:
  explicit OutputError(const std::string& what) : Error("fsdp.output", what) {}
};

namespace detail {

/// Writes every byte of `bytes` to `fd` (partial writes and EINTR retried); false with errno set.
inline bool write_all(int fd, std::string_view bytes) {
  while (!bytes.empty()) {
    const ssize_t n = ::write(fd, bytes.data(), bytes.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (n == 0) errno = EIO;
      return false;
    }
    bytes.remove_prefix(static_cast<std::size_t>(n));
  }
  return true;
}

/// fsync of a folder after a rename in it; file systems that cannot (EINVAL) are not an error.
inline void fsync_folder(const std::filesystem::path& folder) {
  const int fd = ::open(folder.empty() ? "." : folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

}  // namespace detail

/// Writes `bytes` to `path` so that `path` holds either what it held before or all of `bytes`: a
/// temporary name in the same folder (`.NAME.tmp.PID`), every write checked, fsync, rename over
/// `path`, fsync of the folder. A failure removes the temporary file and throws OutputError.
inline void write_file_atomically(const std::filesystem::path& path, std::string_view bytes) {
  const auto folder = path.parent_path();
  const auto tmp = folder / ("." + path.filename().string() + ".tmp." + std::to_string(::getpid()));
  auto fail = [&](const std::string& what, int err) {
    std::error_code ignored;
    std::filesystem::remove(tmp, ignored);
    throw OutputError("cannot write '" + path.string() + "': " + what + ": " + std::strerror(err));
  };
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);  // the umask decides, as for any new file
  if (fd < 0) {
    const int err = errno;
    throw OutputError("cannot write '" + path.string() + "': cannot create '" + tmp.string() + "': " + std::strerror(err));
  }
  if (!detail::write_all(fd, bytes)) {
    const int err = errno;
    ::close(fd);
    fail("writing " + std::to_string(bytes.size()) + " bytes", err);
  }
  if (::fsync(fd) != 0 && errno != EINVAL) {
    const int err = errno;
    ::close(fd);
    fail("fsync", err);
  }
  if (::close(fd) != 0) fail("close", errno);
  if (::rename(tmp.c_str(), path.c_str()) != 0) fail("rename from '" + tmp.string() + "'", errno);
  detail::fsync_folder(folder);
}

/// A text file that grows by whole lines (metrics.csv): each append is written and checked at once,
/// and one that fails is cut off again, so the file always ends with a complete line. Not copyable.
class LineAppendFile {
 public:
  LineAppendFile() = default;
  ~LineAppendFile() { close(); }
  LineAppendFile(const LineAppendFile&) = delete;
  LineAppendFile& operator=(const LineAppendFile&) = delete;

  /// Replaces `path` atomically with `initial` (a header, the rows kept from an earlier run), then
  /// opens it for appending.
  void open(const std::filesystem::path& path, std::string_view initial) {
    close();
    write_file_atomically(path, initial);
    fd_ = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
    if (fd_ < 0) throw OutputError("cannot open '" + path.string() + "' to append to it: " + std::strerror(errno));
    path_ = path;
    size_ = static_cast<off_t>(initial.size());
  }
  bool is_open() const noexcept { return fd_ >= 0; }

  /// Appends `text` (whole lines); on failure the file is cut back to where it ended and OutputError
  /// names the file and the cause.
  void append(std::string_view text) {
    if (fd_ < 0) throw OutputError("append to a closed file");
    if (!detail::write_all(fd_, text)) {
      const int err = errno;
      const bool cut = ::ftruncate(fd_, size_) == 0;
      throw OutputError("cannot append to '" + path_.string() + "': " + std::strerror(err) +
                        (cut ? " (the incomplete line was removed)" : " (and it could not be cut back to its last complete line)"));
    }
    size_ += static_cast<off_t>(text.size());
  }

  void close() noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
  std::filesystem::path path_;
  off_t size_ = 0;
};

}  // namespace fsdp
