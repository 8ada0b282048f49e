// The tuning cache: stage-1 fits persisted as JSON so a process does not re-profile its links on
// every start. One file holds entries keyed by (host, link set, ranks, processes); the link set is the
// normalised link spec (link_spec.h FormatLinkSpecs), so "shm; tcp" and "shm;tcp" share an entry.
// Ranks are part of the key because a collective's time depends on the group size as much as on the
// link (a ring over 8 ranks is not a ring over 2); 0 means "not recorded". Processes (how many the
// group spans; 1: a group inside one process) too, because the same link names are other paths across
// processes: "shm" is the process group's shared segment staging every byte, not one process's
// memory, and a GPU group's "pcie" stages through a segment registered by every process.
//
// An entry is trusted only when it was made on this machine by this engine: each carries the host
// fingerprint (HostFingerprint: a host name is not a machine — containers and cloned images share
// one) and the engine revision that measured it; an entry of this key with another fingerprint or
// revision, or with any field out of range (not finite, negative, absurd), is ignored with a warning
// and stage 1 runs again. Files of another format version, not JSON, of the wrong shape, unreadable,
// not a regular file or larger than kMaxCacheFileBytes are ignored with a warning, never an error.
//
// Writes are atomic (a unique temporary file in the same directory, written and fsync'ed, then
// renamed), so a reader never sees half a file; concurrent writers do not corrupt it, the last rename
// wins. Storing over a corrupt or older-format file replaces it; a file of a newer format version
// (a newer jax_flexlink's) or something that is not a regular file is left alone.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "xla_ffi/core/status.h"
#include "xla_ffi/plan/cost_model.h"

namespace flexlink::plan {

// The file's "version"; 1 (entries without fingerprint or engine revision) is read as out of date.
// Version 3 added "processes" to the key. A version-2 file is still read (its entries are all of
// groups inside one process) and is rewritten as version 3 with its entries kept; version 3 exists so
// that a jax_flexlink that knows nothing of processes leaves a file holding cross-process entries
// alone instead of taking them for in-process ones.
inline constexpr int kCacheFormatVersion = 3;
inline constexpr int kOldestReadableCacheFormat = 2;
// What measured an entry's fits. Bump it when a change to the engine or a link moves their timings
// enough that fits measured before would mislead the balancer: older entries are then re-profiled.
inline constexpr const char* kEngineRevision = "flexlink-engine-1";
// A cache holds a few KiB per (link set, group size); a file far larger is not one (and reading a
// huge file into memory at a collective's first call is not acceptable).
inline constexpr uint64_t kMaxCacheFileBytes = uint64_t{16} << 20;

// This machine as far as link timings go: CPU model, online CPUs, memory (GiB) and a hash of
// /etc/machine-id, e.g. "cpu=Intel(R) Xeon(R) Processor;cpus=2;mem_gib=126;machine=3f2a...". Computed
// once per process.
std::string HostFingerprint();

struct CacheKey {
  std::string host;   // HostName()
  std::string links;  // a link spec; normalised on use
  int ranks = 0;
  // Not part of the lookup (declared here so that {host, links, ranks} initialisers stay short): an entry of this (host, links, ranks) made elsewhere or by another engine
  // is reported and ignored. Tests set them to simulate such entries.
  std::string fingerprint = HostFingerprint();
  std::string engine = kEngineRevision;
  // Part of the lookup: the processes the group spans (1: inside one process).
  int processes = 1;
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
// cleared) when the file exists but could not be used in whole or in part (unreadable, too large, not
// JSON, wrong structure or version, an entry with bad numbers, an entry of this key from another
// machine or engine revision). Every warning names the file and what was wrong.
bool LoadTuning(const std::string& path, const CacheKey& key, TuneRecord* out, std::string* warning);

// Adds or replaces the entry for `record.key`, keeping the file's other entries. Creates the
// directory. `warning` is set when an existing file was corrupt and is being replaced. An error (the
// file is left as it was) when the path is not a regular file, the file has a newer format version,
// or it cannot be written.
Status StoreTuning(const std::string& path, const TuneRecord& record, std::string* warning);

// Reports a tuning-cache problem found inside the engine (where no Python warning can be raised):
// "flexlink: warning: <msg>" on stderr, once per distinct message per process, whatever
// FLEXLINK_DEBUG says. MarkReported(msg) notes one that was already shown another way (a Python
// warning), so the engine does not repeat it.
void ReportCacheProblem(const std::string& msg);
void MarkReported(const std::string& msg);

}  // namespace flexlink::plan
