#include "xla_ffi/plan/tuning_cache.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <vector>

#include "xla_ffi/plan/json.h"
#include "xla_ffi/plan/link_spec.h"

namespace flexlink::plan {
namespace {

namespace fs = std::filesystem;
constexpr const char* kFormat = "jax_flexlink tuning cache";
// Bounds of a fit that came from a measurement on some machine: anything outside is corruption, not
// a link (1 PB/s to 100 B/s; emulated links go down to 1 kB/s, docs/links.md; a latency of a minute).
constexpr double kMaxAlphaSeconds = 60;
constexpr double kMinBetaSecondsPerByte = 1e-15, kMaxBetaSecondsPerByte = 1e-2;
// Byte counts are stored as doubles; beyond 2^53 they are not exact integers any more.
constexpr double kMaxCount = 9007199254740992.0;

std::string Quote(const std::string& s) { return "\"" + s + "\""; }

std::string Ignoring(const std::string& path, const std::string& why) {
  return "flexlink: ignoring tuning cache " + path + ": " + why;
}

// A finite, non-negative integer no larger than kMaxCount.
bool AsCount(const json::Value* v, uint64_t* out) {
  if (!v || !v->is_number()) return false;
  const double d = v->as_number();
  if (!std::isfinite(d) || d < 0 || d > kMaxCount || d != std::floor(d)) return false;
  *out = static_cast<uint64_t>(d);
  return true;
}

std::string NormaliseLinks(const std::string& spec, std::vector<std::string>* names) {
  std::vector<LinkSpec> links;
  if (ParseLinkSpecs(spec, {}, &links).ok()) {
    if (names) for (const auto& l : links) names->push_back(l.name);
    return FormatLinkSpecs(links);
  }
  return spec;  // not a spec we can parse: still a usable (exact-match) key
}

// An entry's process count: absent (every version-2 entry) is 1, a group inside one process; 0 when
// the field is not a count from 1 to the entry's ranks (corrupt).
uint64_t ProcessesOf(const json::Value& entry) {
  const json::Value* p = entry.Find("processes");
  if (p == nullptr) return 1;
  uint64_t processes = 0, ranks = 0;
  if (!AsCount(p, &processes) || !AsCount(entry.Find("ranks"), &ranks) || processes < 1 || processes > ranks) return 0;
  return processes;
}

// The key without its process count: host, link set, ranks.
bool SameGroupSize(const json::Value& entry, const CacheKey& key, const std::string& links) {
  const json::Value* host = entry.Find("host");
  const json::Value* spec = entry.Find("links");
  const json::Value* ranks = entry.Find("ranks");
  return host && host->is_string() && host->as_string() == key.host && spec && spec->is_string() &&
         spec->as_string() == links && ranks && ranks->is_number() && ranks->as_number() == key.ranks;
}

// An entry of this key, or one of its host, link set and ranks whose process count is corrupt (it
// might be of this key: a store replaces it).
bool SameKey(const json::Value& entry, const CacheKey& key, const std::string& links) {
  if (!SameGroupSize(entry, key, links)) return false;
  const uint64_t processes = ProcessesOf(entry);
  return processes == 0 || processes == static_cast<uint64_t>(key.processes);
}

// Reads the whole file; false when it does not exist (no warning) or cannot be used (warning).
bool ReadFile(const std::string& path, std::string* text, std::string* warning) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (ec || !fs::exists(st)) return false;
  if (!fs::is_regular_file(st)) {
    *warning = Ignoring(path, fs::is_directory(st) ? "it is a directory, not a file" : "it is not a regular file");
    return false;
  }
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    *warning = Ignoring(path, std::string("cannot open it (") + std::strerror(errno) + ")");
    return false;
  }
  struct stat sb;
  if (::fstat(fd, &sb) != 0 || static_cast<uint64_t>(sb.st_size) > kMaxCacheFileBytes) {
    *warning = Ignoring(path, "it is " + std::to_string(static_cast<uint64_t>(sb.st_size)) +
                                  " bytes, more than a tuning cache can be (" +
                                  std::to_string(kMaxCacheFileBytes >> 20) + " MiB)");
    ::close(fd);
    return false;
  }
  text->clear();
  char buf[1 << 16];
  while (true) {
    const ssize_t got = ::read(fd, buf, sizeof buf);
    if (got == 0) break;
    if (got < 0) {
      if (errno == EINTR) continue;
      *warning = Ignoring(path, std::string("cannot read it (") + std::strerror(errno) + ")");
      ::close(fd);
      return false;
    }
    text->append(buf, static_cast<size_t>(got));
    if (text->size() > kMaxCacheFileBytes) {  // grew while being read: not a cache
      *warning = Ignoring(path, "it grew past " + std::to_string(kMaxCacheFileBytes >> 20) + " MiB while read");
      ::close(fd);
      return false;
    }
  }
  ::close(fd);
  return true;
}

enum class FileState { kUsable, kCorrupt, kOlder, kNewer };

// Parses the file's document and checks its version.
FileState ParseCache(const std::string& path, const std::string& text, json::Value* doc, std::string* warning) {
  Status s = json::Parse(text, doc);
  if (!s.ok()) {
    *warning = Ignoring(path, "corrupt (" + s.message() + ")" + (text.empty() ? " (the file is empty)" : ""));
    return FileState::kCorrupt;
  }
  if (!doc->is_object()) {
    *warning = Ignoring(path, "corrupt (the document is not a JSON object)");
    return FileState::kCorrupt;
  }
  const json::Value* version = doc->Find("version");
  if (!version || !version->is_number() || !std::isfinite(version->as_number())) {
    *warning = Ignoring(path, "corrupt (no numeric \"version\")");
    return FileState::kCorrupt;
  }
  const double v = version->as_number();
  if (v != kCacheFormatVersion && !(v >= kOldestReadableCacheFormat && v < kCacheFormatVersion && v == std::floor(v))) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%g", v);
    if (v > kCacheFormatVersion) {
      *warning = Ignoring(path, std::string("written by a newer jax_flexlink (format version ") + buf +
                                    ", this one reads " + std::to_string(kCacheFormatVersion) + ")");
      return FileState::kNewer;
    }
    *warning = Ignoring(path, std::string("format version ") + buf + " is out of date (this jax_flexlink writes " +
                                  std::to_string(kCacheFormatVersion) +
                                  ", whose entries carry the host fingerprint and engine revision)");
    return FileState::kOlder;
  }
  const json::Value* entries = doc->Find("entries");
  if (!entries || !entries->is_array()) {
    *warning = Ignoring(path, "corrupt (no \"entries\" list)");
    return FileState::kCorrupt;
  }
  return FileState::kUsable;
}

// A fit for one link: finite, in the bounds above.
bool DecodeFit(const json::Value& v, AlphaBeta* out, std::string* why) {
  const json::Value* a = v.Find("alpha_s");
  const json::Value* b = v.Find("beta_s_per_byte");
  if (!a || !b || !a->is_number() || !b->is_number()) {
    *why = "a fit without numeric alpha_s and beta_s_per_byte";
    return false;
  }
  const double alpha = a->as_number(), beta = b->as_number();
  if (!std::isfinite(alpha) || alpha < 0 || alpha > kMaxAlphaSeconds) {
    *why = "alpha_s=" + std::to_string(alpha) + " is not a latency in [0, 60] s";
    return false;
  }
  if (!std::isfinite(beta) || beta < kMinBetaSecondsPerByte || beta > kMaxBetaSecondsPerByte) {
    char buf[48];
    std::snprintf(buf, sizeof buf, "%g", beta);
    *why = std::string("beta_s_per_byte=") + buf + " is not a link's (1e-15 to 1e-2 s per byte)";
    return false;
  }
  *out = AlphaBeta{alpha, beta};
  return true;
}

// Reads one entry's fits into a model; false (with the reason) when anything is missing, of the wrong
// type, out of range, or names other links than the key's link set (`spec_names`, empty: unknown).
bool DecodeEntry(const json::Value& entry, const std::vector<std::string>& spec_names, TuneRecord* out,
                 std::string* why) {
  const json::Value* names = entry.Find("link_names");
  const json::Value* fits = entry.Find("fits");
  uint64_t max_bytes = 0;
  if (!names || !names->is_array() || names->array().empty() || !fits || !fits->is_object() ||
      !AsCount(entry.Find("max_bytes"), &max_bytes)) {
    *why = "missing or malformed link_names, fits or max_bytes";
    return false;
  }
  std::vector<std::string> links;
  for (const json::Value& n : names->array()) {
    if (!n.is_string()) {
      *why = "a link name that is not a string";
      return false;
    }
    links.push_back(n.as_string());
  }
  if (!spec_names.empty() && links != spec_names) {
    *why = "its link_names do not match the link set";
    return false;
  }
  CostModel model(links);
  for (const auto& [kind_name, per_link] : fits->object()) {
    std::optional<Kind> kind = ParseKind(kind_name);
    if (!kind) {
      *why = "unknown collective " + Quote(kind_name);
      return false;
    }
    if (!per_link.is_array() || per_link.array().size() != links.size()) {
      *why = "fits of " + kind_name + " are not one per link";
      return false;
    }
    for (size_t i = 0; i < links.size(); ++i) {
      AlphaBeta fit;
      if (!DecodeFit(per_link.array()[i], &fit, why)) {
        *why = kind_name + " on " + links[i] + ": " + *why;
        return false;
      }
      model.Set(*kind, i, fit);
    }
  }
  // Optional: thresholds stage 1 measured in the engine ({kind: bytes}, -1 = never split).
  if (const json::Value* measured = entry.Find("split_min_bytes")) {
    if (!measured->is_object()) {
      *why = "split_min_bytes is not an object";
      return false;
    }
    for (const auto& [kind_name, v] : measured->object()) {
      std::optional<Kind> kind = ParseKind(kind_name);
      uint64_t b = 0;
      const bool never = v.is_number() && v.as_number() == -1;
      if (!kind || !model.Has(*kind) || (!never && !AsCount(&v, &b))) {
        *why = "split_min_bytes of " + Quote(kind_name) + " is not a byte count of a fitted collective";
        return false;
      }
      model.SetMeasuredThreshold(*kind, never ? kNeverSplit : b);
    }
  }
  // Optional: the largest size profiled per kind ({kind: bytes}); else the entry's max_bytes.
  const json::Value* profiled = entry.Find("profiled_bytes");
  if (profiled && !profiled->is_object()) {
    *why = "profiled_bytes is not an object";
    return false;
  }
  for (size_t k = 0; k < kNumKinds; ++k) {
    const Kind kind = static_cast<Kind>(k);
    if (!model.Has(kind)) continue;
    const json::Value* v = profiled ? profiled->Find(std::string(Name(kind))) : nullptr;
    uint64_t b = max_bytes;
    if (v && !AsCount(v, &b)) {
      *why = "profiled_bytes of " + std::string(Name(kind)) + " is not a byte count";
      return false;
    }
    model.SetProfiledBytes(kind, b);
  }
  out->model = std::move(model);
  out->max_bytes = max_bytes;
  return true;
}

// Whether an entry of the key was made here by this engine; else why not.
bool SameOrigin(const json::Value& entry, const CacheKey& key, std::string* why) {
  const json::Value* fp = entry.Find("fingerprint");
  const json::Value* engine = entry.Find("engine");
  if (!fp || !fp->is_string()) {
    *why = "it has no host fingerprint";
    return false;
  }
  if (fp->as_string() != key.fingerprint) {
    *why = "it was measured on another machine (fingerprint " + Quote(fp->as_string()) + ", this machine " +
           Quote(key.fingerprint) + ")";
    return false;
  }
  if (!engine || !engine->is_string() || engine->as_string() != key.engine) {
    *why = "it was measured by another engine revision (" +
           (engine && engine->is_string() ? Quote(engine->as_string()) : std::string("none")) + ", this is " +
           Quote(key.engine) + ")";
    return false;
  }
  return true;
}

json::Value EncodeEntry(const TuneRecord& r, const std::string& links) {
  json::Value e = json::Value::MakeObject();
  e.Set("host", r.key.host);
  e.Set("links", links);
  e.Set("ranks", static_cast<double>(r.key.ranks));
  e.Set("processes", static_cast<double>(r.key.processes));
  e.Set("fingerprint", r.key.fingerprint);
  e.Set("engine", r.key.engine);
  e.Set("max_bytes", static_cast<double>(r.max_bytes));
  json::Value names = json::Value::MakeArray();
  for (const auto& n : r.model.links()) names.Push(n);
  e.Set("link_names", std::move(names));
  json::Value fits = json::Value::MakeObject();
  for (size_t k = 0; k < kNumKinds; ++k) {
    Kind kind = static_cast<Kind>(k);
    if (!r.model.Has(kind)) continue;
    json::Value per_link = json::Value::MakeArray();
    for (size_t i = 0; i < r.model.num_links(); ++i) {
      json::Value f = json::Value::MakeObject();
      f.Set("link", r.model.links()[i]);
      f.Set("alpha_s", r.model.Fits(kind)[i].alpha);
      f.Set("beta_s_per_byte", r.model.Fits(kind)[i].beta);
      f.Set("gbps", r.model.Fits(kind)[i].bytes_per_second() * 8e-9);  // for people reading the file
      per_link.Push(std::move(f));
    }
    fits.Set(std::string(Name(kind)), std::move(per_link));
  }
  e.Set("fits", std::move(fits));
  json::Value measured = json::Value::MakeObject();
  bool any = false;
  for (size_t k = 0; k < kNumKinds; ++k) {
    Kind kind = static_cast<Kind>(k);
    std::optional<uint64_t> t = r.model.MeasuredThreshold(kind);
    if (!r.model.Has(kind) || !t) continue;
    measured.Set(std::string(Name(kind)), *t == kNeverSplit ? -1.0 : static_cast<double>(*t));
    any = true;
  }
  if (any) e.Set("split_min_bytes", std::move(measured));
  json::Value profiled = json::Value::MakeObject();
  any = false;
  for (size_t k = 0; k < kNumKinds; ++k) {
    Kind kind = static_cast<Kind>(k);
    if (!r.model.Has(kind) || r.model.ProfiledBytes(kind) == 0) continue;
    profiled.Set(std::string(Name(kind)), static_cast<double>(r.model.ProfiledBytes(kind)));
    any = true;
  }
  if (any) e.Set("profiled_bytes", std::move(profiled));
  return e;
}

}  // namespace

std::string ResolveCachePath(std::string_view configured, std::string_view home) {
  if (!configured.empty()) return std::string(configured);
  if (!home.empty()) return (fs::path(home) / ".cache" / "jax_flexlink" / "tune.json").string();
  return "jax_flexlink_tune.json";
}

std::string DefaultCachePath() {
  const char* configured = std::getenv("FLEXLINK_TUNE_CACHE");
  const char* home = std::getenv("HOME");
  return ResolveCachePath(configured ? configured : "", home ? home : "");
}

std::string HostName() {
  char buf[256] = {};
  if (gethostname(buf, sizeof buf - 1) != 0 || buf[0] == '\0') return "localhost";
  return buf;
}

namespace {

std::string FirstLine(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

std::string CpuModel() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0 || line.rfind("Model", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) {
        size_t b = line.find_first_not_of(" \t", colon + 1);
        return b == std::string::npos ? std::string() : line.substr(b);
      }
    }
  }
  struct utsname u;
  return uname(&u) == 0 ? std::string(u.machine) : std::string("unknown");
}

uint64_t Fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

std::mutex g_reported_mu;
std::set<std::string>& Reported() {
  static auto* seen = new std::set<std::string>();
  return *seen;
}

}  // namespace

std::string HostFingerprint() {
  static const std::string fingerprint = [] {
    std::string cpu = CpuModel();
    for (char& c : cpu) if (c == ';' || c == '"' || static_cast<unsigned char>(c) < 0x20) c = ' ';
    const long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    const uint64_t gib = pages > 0 && page > 0
                             ? (static_cast<uint64_t>(pages) * static_cast<uint64_t>(page) + (uint64_t{1} << 29)) >> 30
                             : 0;
    std::string fp = "cpu=" + cpu + ";cpus=" + std::to_string(cpus) + ";mem_gib=" + std::to_string(gib);
    std::string machine = FirstLine("/etc/machine-id");
    if (machine.empty()) machine = FirstLine("/var/lib/dbus/machine-id");
    if (!machine.empty()) {  // a hash, not the id itself (systemd asks that the id not be exposed)
      char buf[24];
      std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(Fnv1a("jax_flexlink:" + machine)));
      fp += std::string(";machine=") + buf;
    }
    return fp;
  }();
  return fingerprint;
}

void MarkReported(const std::string& msg) {
  std::lock_guard<std::mutex> lock(g_reported_mu);
  Reported().insert(msg);
}

void ReportCacheProblem(const std::string& msg) {
  if (msg.empty()) return;
  {
    std::lock_guard<std::mutex> lock(g_reported_mu);
    if (!Reported().insert(msg).second) return;
  }
  std::fprintf(stderr, "flexlink: warning: %s\n", msg.rfind("flexlink: ", 0) == 0 ? msg.c_str() + 10 : msg.c_str());
}

bool LoadTuning(const std::string& path, const CacheKey& key, TuneRecord* out, std::string* warning) {
  warning->clear();
  std::string text;
  json::Value doc;
  if (!ReadFile(path, &text, warning) || ParseCache(path, text, &doc, warning) != FileState::kUsable) return false;
  std::vector<std::string> names;
  const std::string links = NormaliseLinks(key.links, &names);
  const json::Value::Array& entries = doc.Find("entries")->array();
  for (size_t i = 0; i < entries.size(); ++i) {
    const json::Value& entry = entries[i];
    if (!entry.is_object()) {
      if (warning->empty())  // the first one says enough
        *warning = Ignoring(path, "entry " + std::to_string(i + 1) + " is not an object") + " (other entries still used)";
      continue;
    }
    if (!SameKey(entry, key, links)) continue;
    TuneRecord record;
    record.key = key;
    record.key.links = links;
    std::string why;
    if (ProcessesOf(entry) == 0) {
      why = "its \"processes\" is not a process count from 1 to its ranks";
    }
    if (!why.empty() || !SameOrigin(entry, key, &why) || !DecodeEntry(entry, names, &record, &why)) {
      *warning = "flexlink: ignoring the tuning cache entry for " + Quote(links) + " on " +
                 std::to_string(key.ranks) + " ranks" +
                 (key.processes > 1 ? " in " + std::to_string(key.processes) + " processes" : std::string()) + " in " +
                 path + ": " + why + "; stage 1 runs again";
      return false;
    }
    *out = std::move(record);
    return true;
  }
  return false;
}

Status StoreTuning(const std::string& path, const TuneRecord& record, std::string* warning) {
  warning->clear();
  const std::string links = NormaliseLinks(record.key.links, nullptr);
  json::Value doc = json::Value::MakeObject();
  std::string text;
  json::Value old;
  json::Value entries = json::Value::MakeArray();
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (!ec && fs::exists(st) && !fs::is_regular_file(st)) {
    return Status::FailedPrecondition("flexlink: cannot store the tuning cache at " + path +
                                      ": it is not a regular file (FLEXLINK_TUNE_CACHE names the file)");
  }
  if (ReadFile(path, &text, warning)) {
    switch (ParseCache(path, text, &old, warning)) {
      case FileState::kUsable:
        for (const json::Value& e : old.Find("entries")->array()) {
          if (e.is_object() && !SameKey(e, record.key, links)) entries.Push(e);
        }
        break;
      case FileState::kNewer:
        return Status::FailedPrecondition("flexlink: not storing stage 1 in the tuning cache " + path +
                                          ": a newer jax_flexlink wrote it (format version above " +
                                          std::to_string(kCacheFormatVersion) + "); profiling again next time");
      case FileState::kCorrupt:
      case FileState::kOlder:
        *warning += "; replacing it";
        break;
    }
  } else if (!warning->empty()) {
    *warning += "; replacing it";
  }
  entries.Push(EncodeEntry(record, links));
  doc.Set("format", kFormat);
  doc.Set("version", static_cast<double>(kCacheFormatVersion));
  doc.Set("entries", std::move(entries));

  fs::path target(path);
  if (target.has_parent_path()) fs::create_directories(target.parent_path(), ec);
  // Unique per process and call, in the same directory (rename is atomic only within a filesystem).
  static std::atomic<uint64_t> counter{0};
  uint64_t stamp = std::chrono::steady_clock::now().time_since_epoch().count();
  std::string tmp = path + ".tmp." + std::to_string(getpid()) + "." + std::to_string(stamp) + "." +
                    std::to_string(counter++);
  const std::string body = json::Write(doc);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) {
    return Status::Internal("flexlink: cannot write the tuning cache next to " + path + " (" +
                            std::strerror(errno) + ")");
  }
  size_t done = 0;
  int err = 0;
  while (done < body.size()) {
    const ssize_t n = ::write(fd, body.data() + done, body.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      err = n < 0 ? errno : EIO;
      break;
    }
    done += static_cast<size_t>(n);
  }
  // Durable before the rename, so a crash leaves the old file or the new one, never an empty one.
  if (err == 0 && ::fsync(fd) != 0) err = errno;
  if (::close(fd) != 0 && err == 0) err = errno;
  if (err != 0) {
    fs::remove(tmp, ec);
    return Status::Internal("flexlink: cannot write the tuning cache " + tmp + " (" + std::strerror(err) + ")");
  }
  fs::rename(tmp, target, ec);
  if (ec) {
    std::string why = ec.message();
    fs::remove(tmp, ec);
    return Status::Internal("flexlink: cannot replace tuning cache " + path + ": " + why);
  }
  return Status::Ok();
}

}  // namespace flexlink::plan
