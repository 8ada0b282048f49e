// The leader's model of a call's kind, carried by the call's plan slot (layout.h) to every process
// of a group across processes. Only the leader's balancer plans; the other processes predict a
// range's time (deadlines, injected slow faults) from the slot's fits and report the same model
// through group_fits as the leader, however the leader got it: stage 1 across processes, the tuning
// cache (which only the leader's process reads), tune() or a model installed there.
#pragma once

#include <cstddef>

#include "xla_ffi/core/types.h"
#include "xla_ffi/plan/balancer.h"
#include "xla_ffi/plan/cost_model.h"
#include "xla_ffi/xproc/layout.h"

namespace flexlink::xproc {

// The leader, before its arrival: the balancer's fits of `kind` for the group's `links` links (with
// the measured threshold and profiled size), or has_fits = 0 without them.
void WriteSlotModel(const plan::Balancer& balancer, Kind kind, size_t links, PlanSlot* slot);

// The slot's fits, when it has fits a balancer could hold (finite, alpha >= 0, beta > 0); else false.
bool SlotFits(const PlanSlot& slot, size_t links, plan::AlphaBeta* fits);

// Another process: makes `kind` in *model the slot's (fits, measured threshold, profiled size) when
// the slot has valid fits and they differ from the model's; true when it changed *model.
bool LearnSlotModel(const PlanSlot& slot, Kind kind, size_t links, plan::CostModel* model);

}  // namespace flexlink::xproc
