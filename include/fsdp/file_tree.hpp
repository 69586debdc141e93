#pragma once
// Removing and measuring a directory tree with POSIX calls instead of std::filesystem::remove_all
// and recursive_directory_iterator. PyTorch's wheels export their own copies of libstdc++'s
// std::filesystem functions, and a program linked with LibTorch before libstdc++ binds to them; the
// copy of remove_all in PyTorch 2.11's libtorch.so calls through a null pointer (SIGSEGV on an H200
// node, docs/gpu.md). Code in this project calls these instead; tests/lint_file_tree.sh keeps it so.

#include <ftw.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <system_error>

namespace fsdp {

namespace detail {
// nftw's callback takes no user pointer: the walk in progress keeps its state per thread.
struct TreeWalk {
  std::uintmax_t count = 0;
  int error = 0;
};
inline thread_local TreeWalk* current_tree_walk = nullptr;

inline int remove_tree_entry(const char* path, const struct stat*, int type, struct FTW*) {
  if (type == FTW_DNR) {  // a folder that cannot be read: its entries cannot be removed
    current_tree_walk->error = EACCES;
    return 1;
  }
  if (::remove(path) != 0) {  // remove(): unlink for a file or link, rmdir for an emptied folder
    current_tree_walk->error = errno;
    return 1;  // stops the walk
  }
  ++current_tree_walk->count;
  return 0;
}

inline int add_regular_file_size(const char*, const struct stat* st, int type, struct FTW*) {
  if (type == FTW_F && S_ISREG(st->st_mode)) current_tree_walk->count += static_cast<std::uintmax_t>(st->st_size);
  return 0;
}

inline int walk_tree(const std::filesystem::path& root, TreeWalk& walk, int (*visit)(const char*, const struct stat*, int, struct FTW*), int flags) {
  current_tree_walk = &walk;
  const int result = ::nftw(root.c_str(), visit, 16, flags | FTW_PHYS);
  current_tree_walk = nullptr;
  return result;
}
}  // namespace detail

/// What std::filesystem::remove_all(path, ec) does: removes a file, a link or a folder with
/// everything in it (links are removed, never followed) and returns the number of entries removed;
/// a missing path is 0 and no error. On failure it returns static_cast<std::uintmax_t>(-1) (as the
/// standard's does) and `ec` holds the errno of the first entry that could not be removed (EACCES for
/// a folder that cannot be read); what came before it in the walk is gone.
inline std::uintmax_t remove_tree(const std::filesystem::path& root, std::error_code& ec) noexcept {
  ec.clear();
  struct stat st {};
  if (::lstat(root.c_str(), &st) != 0) {
    if (errno == ENOENT) return 0;
    ec.assign(errno, std::generic_category());
    return static_cast<std::uintmax_t>(-1);
  }
  detail::TreeWalk walk;
  // Depth first: a folder's entries go before the folder.
  if (detail::walk_tree(root, walk, detail::remove_tree_entry, FTW_DEPTH) != 0) {
    const int error = walk.error != 0 ? walk.error : errno;
    struct stat now {};
    // Ignored only when the root itself is gone meanwhile (as remove_all); a vanished subfolder stops
    // nftw with ENOENT too, and then the rest of the tree is still there.
    if (walk.error != 0 || error != ENOENT || ::lstat(root.c_str(), &now) == 0) {
      ec.assign(error, std::generic_category());
      return static_cast<std::uintmax_t>(-1);
    }
  }
  return walk.count;
}

/// remove_tree that throws std::filesystem::filesystem_error naming the path.
inline std::uintmax_t remove_tree(const std::filesystem::path& root) {
  std::error_code ec;
  const std::uintmax_t removed = remove_tree(root, ec);
  if (ec) throw std::filesystem::filesystem_error("cannot remove the tree", root, ec);
  return removed;
}

/// The bytes of the regular files in a folder and its subfolders (links not followed), or of one
/// regular file; 0 for a missing path.
inline std::uintmax_t tree_size_bytes(const std::filesystem::path& root) noexcept {
  detail::TreeWalk walk;
  detail::walk_tree(root, walk, detail::add_regular_file_size, 0);
  return walk.count;
}

}  // namespace fsdp
