#!/usr/bin/env bash
# Fails when code calls std::filesystem::remove_all or recursive_directory_iterator: a program linked
# with a PyTorch wheel's LibTorch binds them to the wheel's copies, and its remove_all crashes
# (include/fsdp/file_tree.hpp; docs/gpu.md). Use fsdp::remove_tree and fsdp::tree_size_bytes.
cd "$(dirname "$0")/.." || exit 2
command -v git >/dev/null || { echo "lint_file_tree: git not found" >&2; exit 2; }
git rev-parse --git-dir >/dev/null || { echo "lint_file_tree: not a working git checkout" >&2; exit 2; }
# Unqualified calls too (found by argument-dependent lookup); untracked files as well.
raw=$(git grep --untracked -nE '(^|[^_[:alnum:]])remove_all[[:space:]]*\(|recursive_directory_iterator' -- \
  include app tests bench examples ':!include/fsdp/file_tree.hpp' ':!*.cmake' ':!*.md' ':!*.sh' ':!*.py' ':!*.txt')
status=$?
((status <= 1)) || { echo "lint_file_tree: git grep failed ($status)" >&2; exit 2; }
hits=$(grep -vE '^[^:]+:[0-9]+:[[:space:]]*//' <<<"$raw")  # comments may name them
if [[ -n $hits ]]; then
  echo "lint_file_tree: std::filesystem::remove_all / recursive_directory_iterator in:" >&2
  echo "$hits" >&2
  echo "use fsdp::remove_tree / fsdp::tree_size_bytes (include/fsdp/file_tree.hpp)" >&2
  exit 1
fi
echo "lint_file_tree: none"
