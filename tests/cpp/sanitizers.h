// Whether this test binary is built under a sanitizer (FLEXLINK_SANITIZE, docs/sanitizers.md), and
// about how much slower host code runs there. Tests whose premise is a speed ratio between a
// computing and a sleeping (paced) simulated link widen the ratio by it instead of weakening checks.
#pragma once

namespace flexlink::testing {

#if defined(__SANITIZE_THREAD__)
#define FLEXLINK_TEST_TSAN 1
#elif defined(__SANITIZE_ADDRESS__)
#define FLEXLINK_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define FLEXLINK_TEST_TSAN 1
#elif __has_feature(address_sanitizer)
#define FLEXLINK_TEST_ASAN 1
#endif
#endif

// Measured on the gpu_sim_test stage-2 test: ASan needs 10x (shares stayed at 0.5 without), TSan
// more (0.63 at 10x).
#if defined(FLEXLINK_TEST_TSAN)
inline constexpr bool kSanitized = true;
inline constexpr double kSanitizerSlowdown = 40;
#elif defined(FLEXLINK_TEST_ASAN)
inline constexpr bool kSanitized = true;
inline constexpr double kSanitizerSlowdown = 10;
#else
inline constexpr bool kSanitized = false;
inline constexpr double kSanitizerSlowdown = 1;
#endif

}  // namespace flexlink::testing
