#include "xla_ffi/plan/tuning_cache.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <vector>

#include "xla_ffi/plan/json.h"
#include "xla_ffi/plan/link_spec.h"

namespace flexlink::plan {
namespace {

namespace fs = std::filesystem;
constexpr double kVersion = 1;
constexpr const char* kFormat = "jax_flexlink tuning cache";

std::string NormaliseLinks(const std::string& spec) {
  std::vector<LinkSpec> links;
  if (ParseLinkSpecs(spec, {}, &links).ok()) return FormatLinkSpecs(links);
  return spec;  // not a spec we can parse: still a usable (exact-match) key
}

bool SameKey(const json::Value& entry, const CacheKey& key, const std::string& links) {
  const json::Value* host = entry.Find("host");
  const json::Value* spec = entry.Find("links");
  const json::Value* ranks = entry.Find("ranks");
  return host && host->is_string() && host->as_string() == key.host && spec && spec->is_string() &&
         spec->as_string() == links && ranks && ranks->is_number() && ranks->as_number() == key.ranks;
}

// Reads the whole file; false when it does not exist (no warning) or cannot be read (warning).
bool ReadFile(const std::string& path, std::string* text, std::string* warning) {
  std::error_code ec;
  if (!fs::exists(path, ec)) return false;
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  if (!in.good() && !in.eof()) {
    *warning = "flexlink: ignoring tuning cache " + path + ": cannot read it";
    return false;
  }
  *text = ss.str();
  return true;
}

// Parses the file's document; false (with a warning) when it is not a tuning cache.
bool ParseCache(const std::string& path, const std::string& text, json::Value* doc, std::string* warning) {
  Status s = json::Parse(text, doc);
  const json::Value* entries = s.ok() ? doc->Find("entries") : nullptr;
  if (!s.ok() || !entries || !entries->is_array()) {
    *warning = "flexlink: ignoring tuning cache " + path + " (corrupt: " +
               (s.ok() ? std::string("no \"entries\" list") : s.message()) + ")";
    return false;
  }
  const json::Value* version = doc->Find("version");
  if (!version || !version->is_number() || version->as_number() != kVersion) {
    *warning = "flexlink: ignoring tuning cache " + path + " (unknown version)";
    return false;
  }
  return true;
}

// Reads one entry's fits into a model for `names`; false when anything is missing or not a valid fit.
bool DecodeEntry(const json::Value& entry, TuneRecord* out) {
  const json::Value* names = entry.Find("link_names");
  const json::Value* fits = entry.Find("fits");
  const json::Value* max_bytes = entry.Find("max_bytes");
  if (!names || !names->is_array() || !fits || !fits->is_object() || !max_bytes || !max_bytes->is_number() ||
      max_bytes->as_number() < 0) {
    return false;
  }
  std::vector<std::string> links;
  for (const json::Value& n : names->array()) {
    if (!n.is_string()) return false;
    links.push_back(n.as_string());
  }
  CostModel model(links);
  for (const auto& [kind_name, per_link] : fits->object()) {
    std::optional<Kind> kind = ParseKind(kind_name);
    if (!kind || !per_link.is_array() || per_link.array().size() != links.size()) return false;
    for (size_t i = 0; i < links.size(); ++i) {
      const json::Value* a = per_link.array()[i].Find("alpha_s");
      const json::Value* b = per_link.array()[i].Find("beta_s_per_byte");
      if (!a || !b || !a->is_number() || !b->is_number() || !(a->as_number() >= 0) || !(b->as_number() > 0)) {
        return false;
      }
      model.Set(*kind, i, AlphaBeta{a->as_number(), b->as_number()});
    }
  }
  // Optional: thresholds stage 1 measured in the engine ({kind: bytes}, -1 = never split).
  if (const json::Value* measured = entry.Find("split_min_bytes")) {
    if (!measured->is_object()) return false;
    for (const auto& [kind_name, v] : measured->object()) {
      std::optional<Kind> kind = ParseKind(kind_name);
      if (!kind || !v.is_number() || !model.Has(*kind)) return false;
      const double b = v.as_number();
      model.SetMeasuredThreshold(*kind, b < 0 ? kNeverSplit : static_cast<uint64_t>(b));
    }
  }
  // Optional: the largest size profiled per kind ({kind: bytes}); else the entry's max_bytes.
  const json::Value* profiled = entry.Find("profiled_bytes");
  if (profiled && !profiled->is_object()) return false;
  for (size_t k = 0; k < kNumKinds; ++k) {
    const Kind kind = static_cast<Kind>(k);
    if (!model.Has(kind)) continue;
    const json::Value* v = profiled ? profiled->Find(std::string(Name(kind))) : nullptr;
    if (v && (!v->is_number() || v->as_number() < 0)) return false;
    model.SetProfiledBytes(kind, static_cast<uint64_t>(v ? v->as_number() : max_bytes->as_number()));
  }
  out->model = std::move(model);
  out->max_bytes = static_cast<uint64_t>(max_bytes->as_number());
  return true;
}

json::Value EncodeEntry(const TuneRecord& r, const std::string& links) {
  json::Value e = json::Value::MakeObject();
  e.Set("host", r.key.host);
  e.Set("links", links);
  e.Set("ranks", static_cast<double>(r.key.ranks));
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

bool LoadTuning(const std::string& path, const CacheKey& key, TuneRecord* out, std::string* warning) {
  warning->clear();
  std::string text;
  json::Value doc;
  if (!ReadFile(path, &text, warning) || !ParseCache(path, text, &doc, warning)) return false;
  std::string links = NormaliseLinks(key.links);
  for (const json::Value& entry : doc.Find("entries")->array()) {
    if (!SameKey(entry, key, links)) continue;
    TuneRecord record;
    record.key = {key.host, links, key.ranks};
    if (!DecodeEntry(entry, &record)) {
      *warning = "flexlink: ignoring corrupt tuning cache entry for \"" + links + "\" in " + path;
      return false;
    }
    *out = std::move(record);
    return true;
  }
  return false;
}

Status StoreTuning(const std::string& path, const TuneRecord& record, std::string* warning) {
  warning->clear();
  std::string links = NormaliseLinks(record.key.links);
  json::Value doc = json::Value::MakeObject();
  std::string text;
  json::Value old;
  json::Value entries = json::Value::MakeArray();
  if (ReadFile(path, &text, warning) && ParseCache(path, text, &old, warning)) {
    for (const json::Value& e : old.Find("entries")->array()) {
      if (!SameKey(e, record.key, links)) entries.Push(e);
    }
  } else if (!warning->empty()) {
    *warning += "; replacing it";
  }
  entries.Push(EncodeEntry(record, links));
  doc.Set("format", kFormat);
  doc.Set("version", kVersion);
  doc.Set("entries", std::move(entries));

  std::error_code ec;
  fs::path target(path);
  if (target.has_parent_path()) fs::create_directories(target.parent_path(), ec);
  // Unique per process and call, in the same directory (rename is atomic only within a filesystem).
  static std::atomic<uint64_t> counter{0};
  uint64_t stamp = std::chrono::steady_clock::now().time_since_epoch().count();
  std::string tmp = path + ".tmp." + std::to_string(getpid()) + "." + std::to_string(stamp) + "." +
                    std::to_string(counter++);
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f << json::Write(doc);
    f.flush();
    if (!f.good()) {
      fs::remove(tmp, ec);
      return Status::Internal("flexlink: cannot write tuning cache " + tmp);
    }
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
