// The link-selection syntax shared by FLEXLINK_LINKS, jax_flexlink.configure(links=...) and the
// tuning cache key:
//
//   spec  := link (';' link)*
//   link  := kind [':' name] ['@' param (',' param)*]
//   param := key '=' value
//
// e.g. "shm;tcp" or "emulated:nvlink@gbps=2.0,latency_us=5;emulated:pcie@gbps=0.6,latency_us=10".
// The first link is the primary (the one "offload" is measured against); a link's name (default: its
// kind) is how stats, plans and faults refer to it, so names must be unique. Parsing is pure: which
// kinds exist is the caller's knowledge (the link registry), passed in, so this file does not depend
// on the links layer. What a parameter means is the link's business; GetDoubleParam and
// CheckParamKeys let the link constructors reject bad values with the same style of message.
#pragma once

#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "xla_ffi/core/status.h"

namespace flexlink::plan {

struct LinkSpec {
  std::string kind;                           // e.g. "emulated"
  std::string name;                           // e.g. "nvlink"; == kind when not given
  std::map<std::string, std::string> params;  // ordered, so Format() is canonical
};

// Parses `text` (surrounding whitespace of every token is ignored). `known_kinds` empty accepts any
// kind. Errors name the offending part, e.g.
//   flexlink: link spec "shm;;tcp": part 2 is empty
//   flexlink: link spec "shm;foo": part 2 "foo": unknown link kind "foo" (known: shm, tcp, emulated)
Status ParseLinkSpecs(std::string_view text, const std::vector<std::string>& known_kinds,
                      std::vector<LinkSpec>* out);

// Canonical text of one link / of a list: no whitespace, ":name" only when it differs from the kind,
// params sorted by key. Parse(Format(x)) == x, and two spellings of the same link set format equal,
// which is what makes the result usable as a cache key.
std::string FormatLinkSpec(const LinkSpec& link);
std::string FormatLinkSpecs(const std::vector<LinkSpec>& links);

// Reads params[key] as a finite number in [min_value, max_value]; absent -> `fallback`. Errors name
// the link and the key: `link spec "nvlink": gbps="fast" is not a number`.
Status GetDoubleParam(const LinkSpec& link, std::string_view key, double fallback,
                      double min_value, double max_value, double* out);

// Rejects params whose key is not in `allowed` (a typo like "gpbs" must not silently mean default).
Status CheckParamKeys(const LinkSpec& link, const std::vector<std::string>& allowed);

}  // namespace flexlink::plan
