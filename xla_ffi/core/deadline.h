// Deadlines from seconds, as every bounded wait of the engines computes them: clamped, so that an
// "infinite" setting (a timeout of 1e300 s) cannot overflow the clock's integer nanoseconds, and
// the seconds left of one, never negative (a wait given them must not see a negative timeout).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>

namespace flexlink {

using SteadyClock = std::chrono::steady_clock;

// Longer than any deadline means (about 31 years), short enough for the clock's count.
inline constexpr double kMaxDeadlineSeconds = 1e9;

inline SteadyClock::duration ClampedSeconds(double seconds) {
  return std::chrono::duration_cast<SteadyClock::duration>(
      std::chrono::duration<double>(std::clamp(seconds, 0.0, kMaxDeadlineSeconds)));
}

inline SteadyClock::time_point DeadlineAfter(double seconds) { return SteadyClock::now() + ClampedSeconds(seconds); }

inline double SecondsLeft(SteadyClock::time_point deadline) {
  return std::max(0.0, std::chrono::duration<double>(deadline - SteadyClock::now()).count());
}

// "%g": how messages write a timeout ("after 0.5 s", "after 1e+06 s").
inline std::string FormatSeconds(double seconds) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", seconds);
  return text;
}

}  // namespace flexlink
