#include "xla_ffi/xproc/xproc_profile.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "xla_ffi/core/call.h"
#include "xla_ffi/core/config.h"
#include "xla_ffi/core/executor.h"
#include "xla_ffi/core/executor_state.h"
#include "xla_ffi/core/health.h"
#include "xla_ffi/core/profile_calls.h"
#include "xla_ffi/links/tcp.h"
#include "xla_ffi/plan/ranges.h"
#include "xla_ffi/plan/shares.h"
#include "xla_ffi/xproc/layout.h"
#include "xla_ffi/xproc/process_group.h"

namespace flexlink::xproc {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

class Profiler {
 public:
  Profiler(const ProfiledLinks& links, int rank, uint64_t call, std::string_view label, int64_t run_id)
      : l_(links), g_(*links.group), rank_(rank), call_(call), label_(label), run_id_(run_id) {}

  // One run of `d` on the calling thread (segment) and the workers (tcp ranges): everything on link
  // `only`, or `shares` across the links. This rank's wall time; *ok false when a link failed here.
  Status RunOnce(const CallDesc& d, size_t only, const std::vector<double>* shares, double* seconds, bool* ok) {
    const size_t L = l_.names.size();
    const int n = g_.size();
    std::vector<plan::UnitRange> ranges(L);
    if (shares) {
      ranges = plan::CutRanges(d.virtual_bytes(), 1, *shares);
    } else {
      ranges[only] = plan::UnitRange{0, d.virtual_bytes()};
    }
    auto pieces_of = [&](size_t i) {
      std::vector<Piece> pieces;
      if (!ranges[i].empty()) d.PiecesOf(UnitRange{ranges[i].begin, ranges[i].end}, &pieces);
      return pieces;
    };
    const auto t0 = Clock::now();
    std::vector<Status> status(L);
    std::vector<size_t> posted;
    size_t segment_link = L;
    for (size_t i = 0; i < L; ++i) {
      if (ranges[i].empty()) continue;
      if (!l_.tcp[i]) {
        segment_link = i;
        continue;
      }
      // No fit exists yet for this kind: the unfitted prediction.
      const double budget = LinkBudgetSeconds(plan::UnfittedSeconds(static_cast<double>(ranges[i].size())));
      TcpLimits limits{t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(budget)),
                       budget, label_};
      TcpChannel* ch = l_.tcp[i];
      if (!shares) {  // alone: on this thread
        status[i] = ch->RunPieces(d, n, rank_, pieces_of(i), limits);
        continue;
      }
      (*l_.workers)[i][rank_]->Post([ch, &d, n, rank = rank_, pieces = pieces_of(i), limits] {
        return ch->RunPieces(d, n, rank, pieces, limits);
      });
      posted.push_back(i);
    }
    if (segment_link < L) status[segment_link] = g_.RunPieces(rank_, d, pieces_of(segment_link), label_, run_id_);
    for (size_t i : posted) status[i] = (*l_.workers)[i][rank_]->Wait(2 * TimeoutSeconds() + 5);
    *seconds = Since(t0);
    *ok = true;
    for (size_t i = 0; i < L; ++i) {
      if (status[i].ok()) continue;
      // The segment failing fails the group (its steps set the abort word): nothing can carry on.
      if (!l_.tcp[i]) return status[i];
      *ok = false;
      if (first_error_.empty()) first_error_ = status[i].message();
    }
    return Status::Ok();
  }

  // Publishes this rank's values of one round and returns the slowest rank's per value (negative:
  // failed somewhere). Round r uses the times slot of call_ + r: alternating parities, each rewritten
  // two rounds later, after a barrier every reader of it has passed (xproc_profile.h).
  Status Exchange(const std::vector<double>& mine, std::vector<double>* slowest, const CallDesc& d) {
    const size_t k = mine.size();  // <= kMaxXprocLinks
    TimesSlot& slot = g_.times_slot(rank_, call_ + round_);
    for (size_t i = 0; i < k; ++i) slot.seconds[i] = mine[i];
    FLEXLINK_RETURN_IF_ERROR(g_.Sync(rank_, d, label_, run_id_));
    slowest->assign(k, 0.0);
    for (int q = 0; q < g_.size(); ++q) {
      const TimesSlot& t = g_.times_slot(q, call_ + round_);
      for (size_t i = 0; i < k; ++i) {
        const double v = t.seconds[i];
        if (!(v >= 0) || !std::isfinite(v)) (*slowest)[i] = -1;
        else if ((*slowest)[i] >= 0) (*slowest)[i] = std::max((*slowest)[i], v);
      }
    }
    ++round_;
    return Status::Ok();
  }

  const std::string& first_error() const { return first_error_; }

 private:
  const ProfiledLinks& l_;
  ProcessGroup& g_;
  const int rank_;
  const uint64_t call_;
  const std::string_view label_;
  const int64_t run_id_;
  uint64_t round_ = 0;
  std::string first_error_;
};

}  // namespace

Status ProfileAcrossProcesses(const ProfiledLinks& links, int rank, uint64_t call, Kind kind,
                              uint64_t message_bytes, const plan::BalancerOptions& options,
                              std::string_view label, int64_t run_id, ProfileOutcome* out) {
  const size_t L = links.names.size();
  const int n = links.group->size();
  const auto started = Clock::now();
  *out = ProfileOutcome{};
  // The in-process stage 1's sizes and repetitions (core/executor_profile.cc): every rank computes
  // the same list from the same call.
  const std::vector<uint64_t> sizes = StageOneSizes(ProfileTopBytes(message_bytes));
  constexpr int kWarmup = 1, kIters = 2;
  auto first_rep = [&](size_t i) { return sizes[i] > kCoarseProfileBytes ? kWarmup : 0; };

  const CallDesc largest = ProfileDesc(kind, sizes.back(), n, nullptr, nullptr);
  ProfileBuffer in(largest.in_count(largest.parts[0], n) * sizeof(float)),
      scratch_out(largest.out_count(largest.parts[0], n) * sizeof(float));
  // Every rank must take part in every round whatever happened to it: out of memory is a failed
  // value in the exchange, not an early return.
  const bool have_memory = in.ptr && scratch_out.ptr;
  Profiler p(links, rank, call, label, run_id);
  std::vector<double> message(sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i)
    message[i] = static_cast<double>(MessageBytes(ProfileDesc(kind, sizes[i], n, nullptr, nullptr), n));

  // Every link alone, size by size; one exchange per size.
  std::vector<std::vector<double>> alone(L, std::vector<double>(sizes.size(), kInf));
  std::vector<double> best_alone(sizes.size(), kInf);
  bool ok = true;
  std::string why_not;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const CallDesc d = ProfileDesc(kind, sizes[i], n, in.ptr, scratch_out.ptr);
    std::vector<double> mine(L, kInf);
    for (size_t l = 0; l < L; ++l) {
      if (!have_memory) {
        mine[l] = -1;
        continue;
      }
      for (int r = first_rep(i); r < kWarmup + kIters; ++r) {
        double t = 0;
        bool run_ok = true;
        FLEXLINK_RETURN_IF_ERROR(p.RunOnce(d, l, nullptr, &t, &run_ok));
        if (!run_ok) {
          mine[l] = -1;
          break;
        }
        if (r >= kWarmup) mine[l] = std::min(mine[l], t);
      }
    }
    std::vector<double> slowest;
    FLEXLINK_RETURN_IF_ERROR(p.Exchange(mine, &slowest, d));
    for (size_t l = 0; l < L; ++l) {
      if (slowest[l] < 0) {
        if (ok) why_not = "link " + links.names[l] + " failed at " + std::to_string(sizes[i]) + " B" +
                          (p.first_error().empty() ? std::string(" on another rank") : ": " + p.first_error());
        ok = false;
      }
      alone[l][i] = slowest[l];
      best_alone[i] = std::min(best_alone[i], slowest[l]);
    }
  }
  if (!ok) {
    out->why_not = have_memory ? why_not : "out of memory for the profiling buffers";
    return Status::Ok();
  }

  // Every rank fits the same numbers the same way, so all of them time the same splits.
  plan::CostModel model(links.names);
  for (size_t l = 0; l < L; ++l) {
    std::vector<plan::Sample> samples;
    for (size_t i = 0; i < sizes.size(); ++i) samples.push_back({message[i], alone[l][i]});
    model.Set(kind, l, plan::FitOrLine(samples));
  }
  // Each size: the fitted split against the fastest link alone, repetitions paired (load that comes
  // and goes weighs on both); one exchange per size.
  std::vector<double> split(sizes.size(), 0.0), paired(sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    std::vector<double> shares = plan::EqualFinishShares(model.Fits(kind), message[i]);
    plan::DropBelow(shares, options.min_share);
    paired[i] = best_alone[i];
    if (std::count_if(shares.begin(), shares.end(), [](double x) { return x > 0; }) < 2) continue;
    const CallDesc d = ProfileDesc(kind, sizes[i], n, in.ptr, scratch_out.ptr);
    const size_t fastest = plan::FastestSingle(model.Fits(kind), message[i]);
    std::vector<double> mine{kInf, kInf};
    for (int r = first_rep(i); r < kWarmup + kIters; ++r) {
      double t_alone = 0, t_split = 0;
      bool ok_alone = true, ok_split = true;
      FLEXLINK_RETURN_IF_ERROR(p.RunOnce(d, fastest, nullptr, &t_alone, &ok_alone));
      FLEXLINK_RETURN_IF_ERROR(p.RunOnce(d, 0, &shares, &t_split, &ok_split));
      if (!ok_alone || !ok_split) {
        mine = {-1, -1};
        break;
      }
      if (r >= kWarmup) mine = {std::min(mine[0], t_alone), std::min(mine[1], t_split)};
    }
    std::vector<double> slowest;
    FLEXLINK_RETURN_IF_ERROR(p.Exchange(mine, &slowest, d));
    if (slowest[0] < 0 || slowest[1] < 0) {
      out->why_not = "the split check failed at " + std::to_string(sizes[i]) + " B" +
                     (p.first_error().empty() ? std::string(" on another rank") : ": " + p.first_error());
      return Status::Ok();
    }
    paired[i] = slowest[0];
    split[i] = slowest[1];
  }
  const uint64_t threshold = plan::MeasuredSplitThreshold(
      message, paired, split, options.min_split_gain,
      plan::SplitThreshold(model.Fits(kind), options.split_overhead_s));
  model.SetMeasuredThreshold(kind, threshold);
  model.SetProfiledBytes(kind, sizes.back());

  std::string timings;
  for (size_t i = 0; i < sizes.size(); ++i) {
    char buf[96];
    std::snprintf(buf, sizeof buf, "%s%.0f KiB %.3g/%.3g ms", i ? ", " : "", message[i] / 1024, paired[i] * 1e3,
                  split[i] > 0 ? split[i] * 1e3 : 0.0);
    timings += buf;
  }
  char secs[32];
  std::snprintf(secs, sizeof secs, "%.3g s", Since(started));
  out->summary = std::string(secs) + ", " + std::to_string(sizes.size()) + " sizes: " +
                 DescribeFits(links.names, model.Fits(kind)) + "; best alone/split: " + timings + "; " +
                 SplitThresholdText(threshold);
  out->model = std::move(model);
  out->ok = true;
  return Status::Ok();
}

}  // namespace flexlink::xproc
