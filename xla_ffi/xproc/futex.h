// Shared (not FUTEX_PRIVATE_FLAG) futex waits on words in a MAP_SHARED segment, so a rank in one
// process wakes waiters in another.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace flexlink::xproc {

// Sleeps while `*word == expected`, at most `timeout`; returns on a wake, a change, a signal or the
// timeout (callers re-check their condition in every case).
void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::nanoseconds timeout);
void FutexWakeAll(std::atomic<uint32_t>* word);

}  // namespace flexlink::xproc
