// Dynamic loss scaling for fp16 training (core layer: arithmetic only, std only). fp16 gradients
// underflow to zero below about 6e-8; the loss is multiplied by a large scale before backward so that
// they do not, and the gradients are divided by it before the optimizer step. A step whose gradients
// overflowed (an inf or NaN on any rank) is skipped and the scale halved; after a run of good steps the
// scale doubles again. The arithmetic and defaults are PyTorch's GradScaler / ShardedGradScaler's.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "fsdp/errors.hpp"

namespace fsdp {

struct LossScaleOptions {
  double init_scale = 65536.0;          ///< 2^16
  double growth_factor = 2.0;           ///< applied after growth_interval good steps in a row
  double backoff_factor = 0.5;          ///< applied after a step with an inf or NaN gradient
  std::int64_t growth_interval = 2000;  ///< good steps in a row before the scale grows
  /// The floor: an overflow at this scale is not a range problem that backing off can cure (DeepSpeed's
  /// and Megatron's min_loss_scale); at_floor() tells the caller to treat it as a non-finite step.
  double min_scale = 1.0;
};

class DynamicLossScale {
 public:
  explicit DynamicLossScale(const LossScaleOptions& options = {}) : options_(options), scale_(options.init_scale) {
    if (!(options.init_scale > 0) || !std::isfinite(options.init_scale))
      throw ConfigError("loss scale: init_scale must be positive and finite, got " + std::to_string(options.init_scale));
    if (!(options.growth_factor > 1)) throw ConfigError("loss scale: growth_factor must exceed 1");
    if (!(options.backoff_factor > 0 && options.backoff_factor < 1)) throw ConfigError("loss scale: backoff_factor must lie in (0, 1)");
    if (options.growth_interval < 1) throw ConfigError("loss scale: growth_interval must be at least 1");
    if (!(options.min_scale > 0) || options.min_scale > options.init_scale)
      throw ConfigError("loss scale: min_scale must be positive and at most init_scale");
  }

  double scale() const noexcept { return scale_; }
  /// Good steps in a row since the scale last changed (PyTorch's growth tracker).
  std::int64_t good_steps() const noexcept { return good_steps_; }
  /// The scale cannot back off any further: an overflow now means gradients that are inf or NaN.
  bool at_floor() const noexcept { return scale_ <= options_.min_scale; }

  /// Records a step's outcome, agreed by every rank; returns whether its optimizer step is taken.
  bool update(bool found_nonfinite) noexcept {
    if (found_nonfinite) {
      scale_ = std::max(scale_ * options_.backoff_factor, options_.min_scale);
      good_steps_ = 0;
      return false;
    }
    if (++good_steps_ == options_.growth_interval) {
      const double grown = scale_ * options_.growth_factor;
      if (std::isfinite(grown)) scale_ = grown;
      good_steps_ = 0;
    }
    return true;
  }

  /// The state a checkpoint kept. A run resumed with a shorter growth interval than the saved count
  /// starts counting again.
  void restore(double scale, std::int64_t good_steps) {
    if (!(scale > 0) || !std::isfinite(scale))
      throw ConfigError("loss scale: a saved scale must be positive and finite, got " + std::to_string(scale));
    if (good_steps < 0) throw ConfigError("loss scale: saved good steps " + std::to_string(good_steps) + " is negative");
    scale_ = std::max(scale, options_.min_scale);
    good_steps_ = good_steps < options_.growth_interval ? good_steps : 0;
  }

 private:
  LossScaleOptions options_;
  double scale_;
  std::int64_t good_steps_ = 0;
};

}  // namespace fsdp
