// Input decks of fsdp-train (app layer): which keys decide the training, and where two decks differ in
// them (a resume's comparison with its checkpoint's deck, fsdp-sweep's with the decks it wrote).
#include <set>
#include <string>
#include <vector>

#include "deck.hpp"

namespace fsdp::app {

bool changes_the_trajectory(const std::string& key) {
  // model.hf_config says where the sizes came from (they are compared); optim.state_dtype is a precision, as fsdp.mixed_precision;
  // the tokens and limits only an export and generation read (the context itself is compared) and attention's recomputation
  // (the same bits) do not change what a step computes.
  static const std::set<std::string> evaluation_or_loading = {
      "data.test_batch_size", "data.test_samples",  "data.val_path",       "data.num_workers",     "model.hf_config",          "optim.state_dtype",
      "model.bos_token_id",   "model.eos_token_id", "model.max_positions", "model.sliding_window", "model.recompute_attention"};
  if (evaluation_or_loading.count(key)) return false;
  const std::string section = key.substr(0, key.find('.'));
  return section == "model" || section == "data" || section == "optim" || key == "run.seed";
}

std::vector<KeyChange> trajectory_changes(const Deck& before, const Deck& now) {
  std::vector<KeyChange> out;
  // Under one data.global_batch_size, data.batch_size only bounds the micro-batches: the steps are the same.
  const Value& global_batch = now.entry("data.global_batch_size").value;
  const bool fixed_global_batch = global_batch == before.entry("data.global_batch_size").value && global_batch != Value{std::int64_t{0}};
  for (const auto& spec : deck_schema()) {
    if (!changes_the_trajectory(spec.key) || (fixed_global_batch && spec.key == "data.batch_size")) continue;
    const std::string a = format_value(before.entry(spec.key).value), b = format_value(now.entry(spec.key).value);
    if (a != b) out.push_back({spec.key, a, b});
  }
  return out;
}

}  // namespace fsdp::app
