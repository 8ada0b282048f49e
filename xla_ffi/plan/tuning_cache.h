// The tuning cache: stage-1 fits persisted as JSON so a process does not re-profile its links on
// every start. One file holds entries keyed by (host, link set, ranks); the link set is the
// normalised link spec (link_spec.h FormatLinkSpecs), so "shm; tcp" and "shm;tcp" share an entry.
// Ranks are part of the key because a collective's time depends on the group size as much as on the
// link (a ring over 8 ranks is not a ring over 2); 0 means "not recorded".
//
// Writes are atomic (a unique temporary file in the same directory, then rename), so a reader never
// sees half a file; concurrent writers do not corrupt it, the last rename wins. A missing, unreadable
// or corrupt file is never an error for loading: it is ignored and a warning (for the log) says why;
// storing over a corrupt file replaces it.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "xla_ffi/core/status.h"
#include "xla_ffi/plan/cost_model.h"

namespace flexlink::plan {

struct CacheKey {
  std::string host;   // HostName()
  std::string links;  // a link spec; normalised on use
  int ranks = 0;
};

struct TuneRecord {
  CacheKey key;
  CostModel model;         // link names = the spec's names, in spec order; fits for the profiled kinds
  uint64_t max_bytes = 0;  // largest profiled size (a later, larger call may warrant re-profiling)
};

// Where the cache lives: `configured` (FLEXLINK_TUNE_CACHE) when not empty, else
// <home>/.cache/jax_flexlink/tune.json, else (no home) ./jax_flexlink_tune.json. Pure, so the one place
// that reads the environment (the Python config module) passes the values in.
std::string ResolveCachePath(std::string_view configured, std::string_view home);
// ResolveCachePath(getenv("FLEXLINK_TUNE_CACHE"), getenv("HOME")), for C++-only callers.
std::string DefaultCachePath();
// This machine's host name (gethostname), "localhost" if unavailable.
std::string HostName();

// Loads the entry for `key` into `out`. Returns false when there is none; `warning` is set (else
// cleared) when the file exists but could not be used in whole or in part (unreadable, not JSON,
// wrong structure, an entry with bad numbers).
bool LoadTuning(const std::string& path, const CacheKey& key, TuneRecord* out, std::string* warning);

// Adds or replaces the entry for `record.key`, keeping the file's other entries. Creates the
// directory. `warning` is set when an existing file was corrupt and is being replaced.
Status StoreTuning(const std::string& path, const TuneRecord& record, std::string* warning);

}  // namespace flexlink::plan
