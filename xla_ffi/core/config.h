// Process-wide engine settings. Python sets them from FLEXLINK_* variables at import (one place reads
// the environment: jax_flexlink's config module); the engine only reads them.
#pragma once

#include <cstddef>

namespace flexlink {

// Deadline of every wait in the engine (arrival, phase barriers). Default 300 s.
double TimeoutSeconds();
void SetTimeoutSeconds(double seconds);

// Per-rank input size up to which the shm link stages inputs and lets every rank reduce the whole
// call itself (one rendezvous per call instead of two). Default: see config.cc.
size_t ShmStagingBytes();
void SetShmStagingBytes(size_t bytes);

// Whether large fresh outputs get transparent huge pages advised before they are written
// (core/pages.h). Default on.
bool HugePageOutputs();
void SetHugePageOutputs(bool on);

// Logging on stderr (FLEXLINK_DEBUG): 0 off, kDebugInfo logs stage-1 results and plan changes.
inline constexpr int kDebugInfo = 1;
int DebugLevel();
void SetDebugLevel(int level);

}  // namespace flexlink
