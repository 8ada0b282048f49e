// What the plain C++ test programs share: counted checks, fresh run ids, the closing line.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

namespace flexlink::testing {

inline int g_passed = 0, g_failed = 0;

inline void Expect(bool ok, const std::string& what) {
  if (ok) {
    ++g_passed;
  } else {
    ++g_failed;
    std::printf("FAIL: %s\n", what.c_str());
  }
}

// Each call of a test is a new "launch": the engine matches calls by (group, run id, call number).
inline int64_t NextRunId() {
  static int64_t run = 1000;
  return ++run;
}

// Prints "N passed, N failed" and returns the exit status.
inline int Summary() {
  std::printf("%d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 ? 0 : 1;
}

}  // namespace flexlink::testing
