#include "xla_ffi/xproc/peer_read.h"

#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

namespace flexlink::xproc {
namespace {

// The kernel takes at most IOV_MAX (1024) entries per side and call.
constexpr size_t kMaxRuns = 1024;

volatile const uint64_t g_canary = kPeerReadCanary;

}  // namespace

bool ReadPeer(pid_t pid, uint64_t remote, std::span<const LocalRun> runs, size_t bytes, std::string* error) {
#if defined(__linux__)
  thread_local std::vector<iovec> local;
  size_t run = 0, run_offset = 0, done = 0;
  while (done < bytes) {
    // The next batch of local runs (the first one maybe partly filled by a partial transfer).
    local.clear();
    size_t batch = 0;
    for (size_t r = run, off = run_offset; r < runs.size() && local.size() < kMaxRuns; ++r, off = 0) {
      local.push_back({runs[r].data + off, runs[r].bytes - off});
      batch += runs[r].bytes - off;
    }
    batch = std::min(batch, bytes - done);
    iovec from{reinterpret_cast<void*>(remote + done), batch};
    const ssize_t got = process_vm_readv(pid, local.data(), local.size(), &from, 1, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      *error = std::strerror(errno);
      return false;
    }
    if (got == 0) {
      *error = "no bytes transferred";
      return false;
    }
    done += static_cast<size_t>(got);
    // Advance the local position by `got` bytes.
    for (size_t left = static_cast<size_t>(got); left > 0;) {
      const size_t room = runs[run].bytes - run_offset;
      if (left < room) {
        run_offset += left;
        left = 0;
      } else {
        left -= room;
        ++run;
        run_offset = 0;
      }
    }
  }
  return true;
#else
  (void)pid, (void)remote, (void)runs, (void)bytes;
  *error = "not supported on this system";
  return false;
#endif
}

uint64_t CanaryAddress() { return reinterpret_cast<uint64_t>(&g_canary); }

bool CanReadPeer(pid_t pid, uint64_t address, std::string* error) {
  uint64_t value = 0;
  const LocalRun run{reinterpret_cast<char*>(&value), sizeof value};
  if (!ReadPeer(pid, address, {&run, 1}, sizeof value, error)) return false;
  if (value != kPeerReadCanary) {
    *error = "read a different value than the peer's canary";
    return false;
  }
  return true;
}

}  // namespace flexlink::xproc
