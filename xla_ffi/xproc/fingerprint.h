// What every rank of a cross-process call must agree on, in bytes another process can read back:
// kind, reduction, every part's dtype/units/outer/inner, ppermute's sources (not the buffers).
#pragma once

#include <cstddef>
#include <cstdint>

#include "xla_ffi/core/call.h"

namespace flexlink::xproc {

// Writes `desc`'s fingerprint into `area` (kFingerprintBytes). A description too long to fit (many
// thousands of operands) is kept as its hash alone: still compared exactly enough to refuse a
// mismatch, only the error cannot describe the peer's side.
void WriteFingerprint(const CallDesc& desc, char* area);

// Whether two areas describe the same call.
bool SameFingerprint(const char* a, const char* b);

// The peer's description for messages ("(a call of more operands than fit in a fingerprint)" when
// only its hash travelled).
std::string DescribeFingerprint(const char* area);

}  // namespace flexlink::xproc
