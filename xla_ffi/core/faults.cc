#include "xla_ffi/core/faults.h"

#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <map>
#include <mutex>

#include "xla_ffi/core/link_set.h"
#include "xla_ffi/core/rendezvous.h"

namespace flexlink {
namespace {

std::mutex g_mu;
std::shared_ptr<const FaultSet> g_current;  // under g_mu
std::atomic<bool> g_any{false};
uint64_t g_next_version = 1;

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\n')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\n')) s.remove_suffix(1);
  return s;
}

bool ParseUint(const std::string& v, uint64_t min_value, uint64_t* out) {
  if (v.empty() || v.find_first_not_of("0123456789") != std::string::npos) return false;
  errno = 0;
  const unsigned long long x = std::strtoull(v.c_str(), nullptr, 10);
  if (errno != 0 || x < min_value) return false;
  *out = x;
  return true;
}

struct PartParser {
  std::string_view text;
  size_t index = 0;
  std::string_view part;
  Status Error(const std::string& what) const {
    return Status::InvalidArgument("flexlink: fault spec \"" + std::string(text) + "\": part " +
                                   std::to_string(index) + " \"" + std::string(part) + "\": " + what +
                                   " (grammar: " + kFaultGrammar + ")");
  }
};

Status ParseOne(const PartParser& p, const std::vector<std::string>& links, Fault* f) {
  const size_t colon = p.part.find(':');
  if (colon == std::string_view::npos) return p.Error("expected NAME:kind@params");
  const std::string name(Trim(p.part.substr(0, colon)));
  std::string_view rest = p.part.substr(colon + 1);
  const size_t at = rest.find('@');
  const std::string kind(Trim(rest.substr(0, at)));
  std::map<std::string, std::string> params;
  if (at != std::string_view::npos) {
    std::string_view list = rest.substr(at + 1);
    while (!list.empty()) {
      const size_t comma = list.find(',');
      const std::string_view kv = Trim(list.substr(0, comma));
      list = comma == std::string_view::npos ? std::string_view() : list.substr(comma + 1);
      const size_t eq = kv.find('=');
      if (kv.empty() || eq == std::string_view::npos || eq == 0)
        return p.Error("parameter \"" + std::string(kv) + "\" is not key=value");
      const std::string key(Trim(kv.substr(0, eq)));
      if (params.count(key)) return p.Error("parameter \"" + key + "\" given twice");
      params[key] = std::string(Trim(kv.substr(eq + 1)));
    }
  }
  std::vector<std::string> allowed;
  if (name == "rank") {
    if (kind != "absent") return p.Error("a rank fault is \"rank:absent@rank=R,at_call=N\", not \"" + kind + "\"");
    f->kind = Fault::Kind::kAbsent;
    allowed = {"rank", "at_call"};
  } else {
    bool known = false;
    for (const std::string& l : links) known |= l == name;
    if (name.empty()) return p.Error("the link name is empty");
    if (!known) {
      std::string list;
      for (const std::string& l : links) list += (list.empty() ? "" : ", ") + l;
      return p.Error("no link named \"" + name + "\" is configured (links: " + list + ")");
    }
    f->link = name;
    if (kind == "slow") f->kind = Fault::Kind::kSlow, allowed = {"factor", "from_call"};
    else if (kind == "error") f->kind = Fault::Kind::kError, allowed = {"at_call", "sticky"};
    else if (kind == "hang") f->kind = Fault::Kind::kHang, allowed = {"at_call"};
    else return p.Error("unknown fault kind \"" + kind + "\" (kinds: slow, error, hang; rank:absent)");
  }
  for (const auto& [key, value] : params) {
    bool ok = false;
    for (const std::string& a : allowed) ok |= a == key;
    if (!ok) return p.Error("unknown parameter \"" + key + "\" for " + kind);
  }
  auto need = [&](const std::string& key) -> Status {
    if (!params.count(key)) return p.Error(kind + " needs " + key + "=...");
    return Status::Ok();
  };
  auto count = [&](const std::string& key, uint64_t min_value, uint64_t* out) -> Status {
    if (!params.count(key)) return Status::Ok();
    if (!ParseUint(params[key], min_value, out))
      return p.Error(key + "=\"" + params[key] + "\" is not an integer >= " + std::to_string(min_value));
    return Status::Ok();
  };
  switch (f->kind) {
    case Fault::Kind::kSlow: {
      FLEXLINK_RETURN_IF_ERROR(need("factor"));
      char* end = nullptr;
      const std::string& v = params["factor"];
      f->factor = std::strtod(v.c_str(), &end);
      if (v.empty() || *end != '\0' || !std::isfinite(f->factor) || f->factor < 1 || f->factor > 1000)
        return p.Error("factor=\"" + v + "\" is not a number in [1, 1000]");
      FLEXLINK_RETURN_IF_ERROR(count("from_call", 1, &f->from_call));
      break;
    }
    case Fault::Kind::kError: {
      FLEXLINK_RETURN_IF_ERROR(need("at_call"));
      FLEXLINK_RETURN_IF_ERROR(count("at_call", 1, &f->at_call));
      uint64_t sticky = 0;
      if (params.count("sticky") && (!ParseUint(params["sticky"], 0, &sticky) || sticky > 1))
        return p.Error("sticky=\"" + params["sticky"] + "\" is not 0 or 1");
      f->sticky = sticky == 1;
      break;
    }
    case Fault::Kind::kHang:
      FLEXLINK_RETURN_IF_ERROR(need("at_call"));
      FLEXLINK_RETURN_IF_ERROR(count("at_call", 1, &f->at_call));
      break;
    case Fault::Kind::kAbsent: {
      FLEXLINK_RETURN_IF_ERROR(need("rank"));
      FLEXLINK_RETURN_IF_ERROR(need("at_call"));
      uint64_t rank = 0;
      FLEXLINK_RETURN_IF_ERROR(count("rank", 0, &rank));
      if (rank > 1u << 20) return p.Error("rank=" + params["rank"] + " is out of range");
      f->rank = static_cast<int>(rank);
      FLEXLINK_RETURN_IF_ERROR(count("at_call", 1, &f->at_call));
      break;
    }
  }
  return Status::Ok();
}

}  // namespace

const char kFaultGrammar[] =
    "NAME:slow@factor=K[,from_call=N] | NAME:error@at_call=N[,sticky=1] | NAME:hang@at_call=N | "
    "rank:absent@rank=R,at_call=N, ';' between faults, NAME a configured link";

bool Fault::FiresAt(uint64_t call) const {
  switch (kind) {
    case Kind::kSlow: return call >= from_call;
    case Kind::kError: return sticky ? call >= at_call : call == at_call;
    case Kind::kHang:
    case Kind::kAbsent: return call == at_call;
  }
  return false;
}

const Fault* FaultSet::ForLink(std::string_view link, uint64_t call) const {
  for (const Fault& f : faults)
    if (f.kind != Fault::Kind::kAbsent && f.link == link && f.FiresAt(call)) return &f;
  return nullptr;
}

const Fault* FaultSet::AbsentAt(int rank, uint64_t call) const {
  for (const Fault& f : faults)
    if (f.kind == Fault::Kind::kAbsent && f.rank == rank && f.FiresAt(call)) return &f;
  return nullptr;
}

Status ParseFaults(std::string_view text, const std::vector<std::string>& links, std::vector<Fault>* out) {
  out->clear();
  if (Trim(text).empty()) return Status::Ok();
  PartParser p;
  p.text = text;
  std::string_view rest = text;
  for (;;) {
    const size_t semi = rest.find(';');
    p.part = Trim(rest.substr(0, semi));
    ++p.index;
    if (p.part.empty()) return p.Error("is empty");
    Fault f;
    FLEXLINK_RETURN_IF_ERROR(ParseOne(p, links, &f));
    out->push_back(std::move(f));
    if (semi == std::string_view::npos) break;
    rest = rest.substr(semi + 1);
  }
  return Status::Ok();
}

Status SetFaults(std::string_view text) {
  std::vector<Fault> faults;
  FLEXLINK_RETURN_IF_ERROR(ParseFaults(text, CurrentLinkSet()->names(), &faults));
  SetParsedFaults(text, std::move(faults));
  return Status::Ok();
}

void SetParsedFaults(std::string_view text, std::vector<Fault> faults) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (faults.empty()) {
    g_current.reset();
    g_any.store(false);
    return;
  }
  auto set = std::make_shared<FaultSet>();
  set->version = g_next_version++;
  set->text = std::string(Trim(text));
  set->faults = std::move(faults);
  g_current = std::move(set);
  g_any.store(true);
}

std::shared_ptr<const FaultSet> CurrentFaults() {
  if (!g_any.load(std::memory_order_acquire)) return nullptr;
  std::lock_guard<std::mutex> lock(g_mu);
  return g_current;
}

Status StayAway(CallContext& call, std::string_view label, int rank, int64_t device, uint64_t call_number) {
  const Status others = call.WaitAbandoned(rank);
  return Status::DeadlineExceeded(ErrorPrefix(label) + "rank " + std::to_string(rank) + " (device " +
                                  std::to_string(device) + ") stayed away from call " + std::to_string(call_number) +
                                  " (injected rank:absent): " + others.message());
}

}  // namespace flexlink
