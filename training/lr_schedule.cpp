#include "training/lr_schedule.h"

#include <cmath>
#include <cstdio>

#include "core/error.h"

namespace iris {

LrScheduleKind parse_lr_schedule_kind(const std::string& name) {
  if (name == "constant") return LrScheduleKind::constant;
  if (name == "cosine") return LrScheduleKind::cosine;
  IRIS_FAIL("unknown learning-rate schedule '", name, "': use constant or cosine");
}

LrSchedule::LrSchedule(LrScheduleKind kind, float lr, float min_lr, int64_t warmup_steps,
                       int64_t total_steps)
    : kind(kind), lr(lr), min_lr(min_lr), warmup_steps(warmup_steps), total_steps(total_steps) {
  IRIS_CHECK(lr >= 0.0f && min_lr >= 0.0f && min_lr <= lr,
             "learning rates must satisfy 0 <= ", "min_lr (", min_lr, ") <= lr (", lr, ")");
  IRIS_CHECK(warmup_steps >= 0, "warmup_steps must not be negative, got ", warmup_steps);
  IRIS_CHECK(kind == LrScheduleKind::constant || total_steps > warmup_steps,
             "a cosine schedule needs total_steps (", total_steps, ") > warmup_steps (",
             warmup_steps, ")");
}

float LrSchedule::at(int64_t step) const {
  IRIS_CHECK(step >= 0, "learning-rate schedule queried at negative step ", step);
  if (warmup_steps > 0 && step <= warmup_steps)
    return static_cast<float>(double(lr) * double(step) / double(warmup_steps));
  if (kind == LrScheduleKind::constant) return lr;
  if (step > total_steps) return min_lr;
  const double ratio = double(step - warmup_steps) / double(total_steps - warmup_steps);
  const double coeff = 0.5 * (std::cos(M_PI * ratio) + 1.0);
  return static_cast<float>(double(min_lr) + coeff * (double(lr) - double(min_lr)));
}

LrSchedule ScheduleSettings::lr_schedule() const {
  return LrSchedule(parse_lr_schedule_kind(kind), static_cast<float>(lr),
                    static_cast<float>(min_lr), warmup_iters, decay_end());
}

namespace {

// As a recipe would spell the value: 0.00075, 1e-05, 100.
std::string value_text(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.10g", v);
  return buf;
}

}  // namespace

std::vector<ScheduleChange> schedule_changes(const ScheduleSettings& before,
                                             const ScheduleSettings& now) {
  std::vector<ScheduleChange> out;
  const auto number = [&](const char* key, double a, double b) {
    if (a != b) out.push_back({key, value_text(a), value_text(b)});
  };
  if (before.kind != now.kind) out.push_back({"schedule.kind", before.kind, now.kind});
  number("optimizer.lr", before.lr, now.lr);
  // 0 means optimizer.lr: only a change of the rate a part trains at counts.
  const auto part_lr = [](double part, double lr) { return part > 0 ? part : lr; };
  if (part_lr(before.vision_lr, before.lr) != part_lr(now.vision_lr, now.lr))
    number("optimizer.vision_lr", before.vision_lr, now.vision_lr);
  if (part_lr(before.merger_lr, before.lr) != part_lr(now.merger_lr, now.lr))
    number("optimizer.merger_lr", before.merger_lr, now.merger_lr);
  number("optimizer.weight_decay", before.weight_decay, now.weight_decay);
  number("schedule.warmup_iters", double(before.warmup_iters), double(now.warmup_iters));
  // A constant schedule never reads its floor or the decay's end.
  if (before.kind == "cosine" || now.kind == "cosine") {
    number("optimizer.min_lr", before.min_lr, now.min_lr);
    if (before.decay_end() != now.decay_end()) {
      number("schedule.decay_iters", double(before.decay_iters), double(now.decay_iters));
      if (before.decay_iters == 0 || now.decay_iters == 0)
        number("train.train_iters", double(before.train_iters), double(now.train_iters));
    }
  }
  return out;
}

}  // namespace iris
