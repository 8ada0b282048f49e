// Fault injection for tests and drills (docs/faults.md): FLEXLINK_FAULTS / jax_flexlink.inject_faults.
//
//   faults := fault (';' fault)*
//   fault  := NAME ':' 'slow'  '@' 'factor=' K [',from_call=' N]      link NAME K x slower from its N-th call
//           | NAME ':' 'error' '@' 'at_call=' N [',sticky=1']        an error at call N (or from N on)
//           | NAME ':' 'hang'  '@' 'at_call=' N                      never completes call N (until its deadline)
//           | 'rank' ':' 'absent' '@' 'rank=' R ',at_call=' N        rank R never arrives at the group's call N
//
// NAME is a link's name in the current link set. A link's calls are counted per group and per rank
// from 1 after the faults were set: every time the executor hands the link a range (a failover re-run
// and a probe included). rank:absent counts the group's collective calls. Off (no faults) costs one
// atomic load per channel call.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "xla_ffi/core/status.h"

namespace flexlink {

struct Fault {
  enum class Kind { kSlow, kError, kHang, kAbsent };
  Kind kind = Kind::kError;
  std::string link;        // empty for kAbsent
  double factor = 1;       // kSlow
  uint64_t from_call = 1;  // kSlow
  uint64_t at_call = 1;    // kError, kHang, kAbsent
  bool sticky = false;     // kError
  int rank = 0;            // kAbsent
  // Whether the fault fires at the `call`-th call (counted from 1).
  bool FiresAt(uint64_t call) const;
};

struct FaultSet {
  uint64_t version = 0;  // new per SetFaults: counters restart
  std::string text;
  std::vector<Fault> faults;
  const Fault* ForLink(std::string_view link, uint64_t call) const;  // the first that fires, or null
  const Fault* AbsentAt(int rank, uint64_t call) const;
};

// The grammar above, for error messages.
extern const char kFaultGrammar[];

// Parses `text` (empty: no faults). `links`: the configured link names; a fault naming another link
// is an error. Errors name the bad part and the grammar.
Status ParseFaults(std::string_view text, const std::vector<std::string>& links, std::vector<Fault>* out);

// Parses against the current link set and makes the result current (empty clears). On error the
// current faults stay.
Status SetFaults(std::string_view text);
// Makes already parsed faults current (an engine with its own link names and rules: the CUDA
// module, cuda/gpu_faults.cc); `text` is kept for faults() and error messages.
void SetParsedFaults(std::string_view text, std::vector<Fault> faults);
// The current faults; null when none are set (the fast path).
std::shared_ptr<const FaultSet> CurrentFaults();

// Injected rank:absent in one process (the CPU and GPU engines): rank `rank` joins the group's call
// `call` but never arrives; it waits until the others abandon the call at their deadline (their
// error names it; CallContext::WaitAbandoned, at most 1.5 x the timeout) and returns their error
// after its own words.
class CallContext;
Status StayAway(CallContext& call, std::string_view label, int rank, int64_t device, uint64_t call_number);

// A per-rank call counter that restarts whenever the faults change (each rank counts on its own
// thread; all ranks of a group make the same calls, so their counts agree).
class FaultCounter {
 public:
  explicit FaultCounter(int n) : calls_(n, 0), version_(n, 0) {}
  uint64_t Next(int rank, const FaultSet& faults) {
    if (version_[rank] != faults.version) version_[rank] = faults.version, calls_[rank] = 0;
    return ++calls_[rank];
  }

 private:
  std::vector<uint64_t> calls_, version_;
};

}  // namespace flexlink
