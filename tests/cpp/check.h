// What the plain C++ test programs share: counted checks, fresh run ids, the closing line.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

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

// Test selection from the command line (reproducing a failure, or a sanitizer run's subset): no
// arguments select every test; "=Name" selects one by its whole name, "-PART" leaves out every test
// whose name contains PART, any other argument selects every test whose name contains it (only
// exclusions: everything else is selected).
inline std::vector<std::string> g_only;

inline void SelectTests(int argc, char** argv) { g_only.assign(argv + 1, argv + argc); }

inline bool Selected(std::string_view name) {
  bool any_include = false, included = false;
  for (const std::string& s : g_only) {
    if (s.starts_with("-")) {
      if (name.find(std::string_view(s).substr(1)) != std::string_view::npos) return false;
      continue;
    }
    any_include = true;
    included |= s.starts_with("=") ? name == std::string_view(s).substr(1) : name.find(s) != std::string_view::npos;
  }
  return !any_include || included;
}

// Runs `test` if it is selected and prints its time.
template <typename Fn>
void Timed(std::string_view name, Fn&& test) {
  if (!Selected(name)) return;
  const auto t0 = std::chrono::steady_clock::now();
  test();
  std::printf("%-48.*s %6.2f s\n", static_cast<int>(name.size()), name.data(),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

// Prints "N passed, N failed" and returns the exit status.
inline int Summary() {
  std::printf("%d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 ? 0 : 1;
}

}  // namespace flexlink::testing
