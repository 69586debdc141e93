// A FULL or SHARDED checkpoint file loaded into a plain module in a single process, without MPI and
// without an engine (io layer).
#pragma once

#include <torch/torch.h>

#include <filesystem>
#include <string>
#include <vector>

#include "fsdp/io/checkpoint_state.hpp"

namespace fsdp {

/// Mismatches between a file and a plain module.
struct StateDictReport {
  std::vector<std::string> missing;     ///< in the module, not in the file
  std::vector<std::string> unexpected;  ///< in the file, not in the module
  std::vector<std::string> mismatched;  ///< "name (file [..] dtype, module [..] dtype)"
  bool ok() const noexcept { return missing.empty() && unexpected.empty() && mismatched.empty(); }
};

/// Loads the parameters and buffers of a FULL or SHARDED checkpoint file into a plain module, in a
/// single process without MPI (the hfai summon_full_params use case). Strict: any missing,
/// unexpected or mismatched tensor throws a CheckpointError listing them all and changes nothing.
/// With strict=false, missing and unexpected tensors are returned in the report instead (shape or
/// dtype mismatches still throw).
inline StateDictReport load_full_state_dict(torch::nn::Module& module, const std::string& path, bool strict = true) {
  if (std::filesystem::is_directory(path))
    throw CheckpointError("'" + path + "' is a LOCAL_STATE_DICT checkpoint folder; merge it first with `fsdp-ckpt merge " + path + " OUT.h5`");
  h5::Id file = h5::open_file_readonly(path);
  const std::string where = "checkpoint '" + path + "'";
  if (h5::read_string_attribute(file, "format", where) != ckpt::kFormatName) throw CheckpointError(where + " is not an fsdp checkpoint");
  StateDictReport report;
  std::vector<std::pair<torch::Tensor, torch::Tensor>> staged;  // destination, value
  std::set<std::string> names;
  auto take = [&](const std::string& name, const torch::Tensor& dst) {
    names.insert(name);
    const std::string p = detail::model_path(name);
    if (!h5::exists(file, p)) {
      report.missing.push_back(name);
      return;
    }
    h5::Id ds = h5::open_dataset(file, p, path);
    const auto shape = detail::logical_shape(ds);
    const auto stored = detail::tensor_element_type(ds, where + " " + p);
    const auto et = detail::element_type_of(dst.scalar_type());
    if (shape != dst.sizes().vec() || stored != et) {
      report.mismatched.push_back(name + " (file " + detail::shape_text(shape) + " " + h5::element_type_name(stored) + ", module " +
                                  detail::shape_text(dst.sizes().vec()) + " " + h5::element_type_name(et) + ")");
      return;
    }
    auto t = torch::empty(dst.sizes(), dst.options().requires_grad(false));
    h5::read_flat_range(ds, shape, 0, t.numel(), et, t.data_ptr(), where + " dataset " + p);
    staged.emplace_back(dst, t);
  };
  for (const auto& p : module.named_parameters(/*recurse=*/true)) take(p.key(), p.value());
  for (const auto& b : module.named_buffers(/*recurse=*/true))
    if (b.value().defined()) take(b.key(), b.value());
  for (const auto& n : h5::list_names(file, "/model"))
    if (!names.count(n)) report.unexpected.push_back(n);
  const bool fail = !report.mismatched.empty() || (strict && !report.ok());
  if (fail) {
    std::vector<std::string> problems;
    for (const auto& n : report.missing) problems.push_back("missing " + n);
    for (const auto& n : report.unexpected) problems.push_back("unexpected " + n);
    for (const auto& n : report.mismatched) problems.push_back("mismatched " + n);
    throw CheckpointError(detail::checkpoint_mismatch_message(path, problems));
  }
  torch::NoGradGuard no_grad;
  for (auto& [dst, value] : staged) dst.copy_(value);
  return report;
}

}  // namespace fsdp
