#include "xla_ffi/xproc/slot_model.h"

#include <array>
#include <cmath>
#include <optional>
#include <vector>

namespace flexlink::xproc {

void WriteSlotModel(const plan::Balancer& balancer, Kind kind, size_t links, PlanSlot* slot) {
  thread_local std::vector<plan::AlphaBeta> fits;  // the leader's call path: no allocation per call
  std::optional<uint64_t> measured;
  uint64_t profiled = 0;
  slot->has_fits = balancer.FitsFor(kind, &fits, &measured, &profiled) && fits.size() == links ? 1 : 0;
  for (size_t i = 0; i < kMaxXprocLinks; ++i) {
    slot->alpha[i] = slot->has_fits && i < links ? fits[i].alpha : 0.0;
    slot->beta[i] = slot->has_fits && i < links ? fits[i].beta : 0.0;
  }
  slot->has_measured = slot->has_fits && measured ? 1 : 0;
  slot->measured_bytes = slot->has_measured ? *measured : 0;
  slot->profiled_bytes = slot->has_fits ? profiled : 0;
}

bool SlotFits(const PlanSlot& slot, size_t links, plan::AlphaBeta* fits) {
  if (!slot.has_fits || links > kMaxXprocLinks) return false;
  for (size_t i = 0; i < links; ++i) {
    const plan::AlphaBeta f{slot.alpha[i], slot.beta[i]};
    // Not a fit the leader's balancer would have: no fits.
    if (!std::isfinite(f.alpha) || !std::isfinite(f.beta) || f.alpha < 0 || f.beta <= 0) return false;
    fits[i] = f;
  }
  return true;
}

bool LearnSlotModel(const PlanSlot& slot, Kind kind, size_t links, plan::CostModel* model) {
  std::array<plan::AlphaBeta, kMaxXprocLinks> fits;
  if (model->num_links() != links || !SlotFits(slot, links, fits.data())) return false;
  const bool has_measured = slot.has_measured != 0;
  const std::optional<uint64_t> current = model->MeasuredThreshold(kind);
  if (model->Has(kind) && current.has_value() == has_measured &&
      (!has_measured || current.value_or(0) == slot.measured_bytes) &&
      model->ProfiledBytes(kind) == slot.profiled_bytes) {
    bool same = true;
    for (size_t i = 0; i < links && same; ++i)
      same = model->Fits(kind)[i].alpha == fits[i].alpha && model->Fits(kind)[i].beta == fits[i].beta;
    if (same) return false;
  }
  model->ClearKind(kind);
  for (size_t i = 0; i < links; ++i) model->Set(kind, i, fits[i]);
  if (has_measured) model->SetMeasuredThreshold(kind, slot.measured_bytes);
  model->SetProfiledBytes(kind, slot.profiled_bytes);
  return true;
}

}  // namespace flexlink::xproc
