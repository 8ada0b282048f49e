#include "xla_ffi/plan/link_spec.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <set>

namespace flexlink::plan {
namespace {

std::string_view Trim(std::string_view s) {
  const char* ws = " \t\r\n";
  size_t b = s.find_first_not_of(ws);
  if (b == std::string_view::npos) return {};
  size_t e = s.find_last_not_of(ws);
  return s.substr(b, e - b + 1);
}

std::vector<std::string_view> Split(std::string_view s, char sep) {
  std::vector<std::string_view> parts;
  size_t start = 0;
  while (true) {
    size_t pos = s.find(sep, start);
    parts.push_back(s.substr(start, pos == std::string_view::npos ? std::string_view::npos : pos - start));
    if (pos == std::string_view::npos) return parts;
    start = pos + 1;
  }
}

// Kinds, names and keys end up in stats dicts, log lines and JSON, so keep them to a plain
// identifier alphabet; this also catches a stray separator such as "shm,tcp" early.
bool IsIdentifier(std::string_view s) {
  if (s.empty()) return false;
  for (char c : s) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
              c == '-' || c == '.';
    if (!ok) return false;
  }
  return true;
}

std::string Join(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) {
    if (!out.empty()) out += ", ";
    out += s;
  }
  return out;
}

Status PartError(std::string_view text, size_t index, std::string_view part, const std::string& what) {
  return Status::InvalidArgument("flexlink: link spec \"" + std::string(text) + "\": part " +
                                 std::to_string(index + 1) + " \"" + std::string(part) + "\": " + what);
}

}  // namespace

Status ParseLinkSpecs(std::string_view text, const std::vector<std::string>& known_kinds,
                      std::vector<LinkSpec>* out) {
  out->clear();
  if (Trim(text).empty()) return Status::InvalidArgument("flexlink: link spec is empty (e.g. \"shm;tcp\")");
  std::vector<std::string_view> parts = Split(text, ';');
  std::set<std::string> names;
  for (size_t i = 0; i < parts.size(); ++i) {
    std::string_view part = Trim(parts[i]);
    if (part.empty()) {
      return Status::InvalidArgument("flexlink: link spec \"" + std::string(text) + "\": part " +
                                     std::to_string(i + 1) + " is empty");
    }
    LinkSpec link;
    std::string_view head = part, tail;
    bool has_params = false;
    if (size_t at = part.find('@'); at != std::string_view::npos) {
      head = Trim(part.substr(0, at));
      tail = part.substr(at + 1);
      has_params = true;
    }
    std::string_view kind = head, name;
    bool has_name = false;
    if (size_t colon = head.find(':'); colon != std::string_view::npos) {
      kind = Trim(head.substr(0, colon));
      name = Trim(head.substr(colon + 1));
      has_name = true;
    }
    if (!IsIdentifier(kind)) return PartError(text, i, part, "bad link kind \"" + std::string(kind) + "\"");
    if (!known_kinds.empty()) {
      bool known = false;
      for (const auto& k : known_kinds) known = known || k == kind;
      if (!known) {
        return PartError(text, i, part,
                         "unknown link kind \"" + std::string(kind) + "\" (known: " + Join(known_kinds) + ")");
      }
    }
    if (has_name && !IsIdentifier(name)) {
      return PartError(text, i, part, "bad link name \"" + std::string(name) + "\" (letters, digits, _ - .)");
    }
    link.kind = std::string(kind);
    link.name = has_name ? std::string(name) : link.kind;
    if (has_params) {
      if (Trim(tail).empty()) return PartError(text, i, part, "'@' without parameters");
      for (std::string_view kv : Split(tail, ',')) {
        kv = Trim(kv);
        size_t eq = kv.find('=');
        if (eq == std::string_view::npos) {
          return PartError(text, i, part, "parameter \"" + std::string(kv) + "\" is not key=value");
        }
        std::string_view key = Trim(kv.substr(0, eq)), value = Trim(kv.substr(eq + 1));
        if (!IsIdentifier(key)) {
          return PartError(text, i, part, "bad parameter key in \"" + std::string(kv) + "\"");
        }
        if (value.empty() || value.find_first_of("=@") != std::string_view::npos) {
          return PartError(text, i, part, "bad value in \"" + std::string(kv) + "\"");
        }
        if (!link.params.emplace(std::string(key), std::string(value)).second) {
          return PartError(text, i, part, "parameter \"" + std::string(key) + "\" given twice");
        }
      }
    }
    if (!names.insert(link.name).second) {
      return PartError(text, i, part,
                       "duplicate link name \"" + link.name + "\" (give each link a name: kind:name)");
    }
    out->push_back(std::move(link));
  }
  return Status::Ok();
}

std::string FormatLinkSpec(const LinkSpec& link) {
  std::string s = link.kind;
  if (link.name != link.kind) s += ":" + link.name;
  char sep = '@';
  for (const auto& [k, v] : link.params) {
    s += sep;
    s += k + "=" + v;
    sep = ',';
  }
  return s;
}

std::string FormatLinkSpecs(const std::vector<LinkSpec>& links) {
  std::string s;
  for (const auto& l : links) {
    if (!s.empty()) s += ';';
    s += FormatLinkSpec(l);
  }
  return s;
}

Status GetDoubleParam(const LinkSpec& link, std::string_view key, double fallback, double min_value,
                      double max_value, double* out) {
  auto it = link.params.find(std::string(key));
  if (it == link.params.end()) {
    *out = fallback;
    return Status::Ok();
  }
  const std::string& text = it->second;
  std::string where = "flexlink: link spec \"" + link.name + "\": " + std::string(key) + "=\"" + text + "\"";
  char* end = nullptr;
  errno = 0;
  double v = std::strtod(text.c_str(), &end);
  if (end == text.c_str() || *end != '\0' || errno == ERANGE || !std::isfinite(v)) {
    return Status::InvalidArgument(where + " is not a number");
  }
  if (v < min_value || v > max_value) {
    return Status::InvalidArgument(where + " is out of range [" + std::to_string(min_value) + ", " +
                                   std::to_string(max_value) + "]");
  }
  *out = v;
  return Status::Ok();
}

Status CheckParamKeys(const LinkSpec& link, const std::vector<std::string>& allowed) {
  for (const auto& [k, v] : link.params) {
    bool ok = false;
    for (const auto& a : allowed) ok = ok || a == k;
    if (!ok) {
      return Status::InvalidArgument("flexlink: link spec \"" + FormatLinkSpec(link) + "\": unknown parameter \"" +
                                     k + "\" for kind " + link.kind + " (known: " + Join(allowed) + ")");
    }
  }
  return Status::Ok();
}

}  // namespace flexlink::plan
