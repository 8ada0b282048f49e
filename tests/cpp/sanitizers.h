// Whether this test binary is built under a sanitizer (FLEXLINK_SANITIZE, docs/sanitizers.md).
// Sanitizers make host code several times slower; tests whose premise is a speed ratio between a
// computing and a sleeping (paced) simulated link widen the ratio there instead of weakening checks.
#pragma once

namespace flexlink::testing {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
inline constexpr bool kSanitized = true;
#else
inline constexpr bool kSanitized = false;
#endif
#else
inline constexpr bool kSanitized = false;
#endif

}  // namespace flexlink::testing
