// Reading another process's memory (Linux cross-memory attach, process_vm_readv): a cross-process
// all_gather copies each peer's input straight into its output, one copy per byte instead of two
// through the segment (docs/xproc.md, "Direct all_gather"). The kernel allows it where this process
// may ptrace the peer (same user, not refused by Yama or a seccomp filter); ProcessGroup::AgreeDirect
// finds out once per group, from every rank, before any call relies on it.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace flexlink::xproc {

// A run of bytes in this process that one read fills, in order.
struct LocalRun {
  char* data;
  size_t bytes;
};

// Reads `bytes` from address `remote` of process `pid` into `runs` (their sizes add up to `bytes`),
// looping over partial transfers. false with *error set (errno's text) when the kernel refuses or the
// peer's memory is not there.
bool ReadPeer(pid_t pid, uint64_t remote, std::span<const LocalRun> runs, size_t bytes, std::string* error);

// The address of a word whose value every process of this build knows (kPeerReadCanary), for the
// probe: a peer reads it from this process and compares.
uint64_t CanaryAddress();
inline constexpr uint64_t kPeerReadCanary = 0x44455249444b4c46ull;  // "FLKDIRED"
// Whether this process can read process `pid`'s memory: the canary at `address` there (*error: why not).
bool CanReadPeer(pid_t pid, uint64_t address, std::string* error);

}  // namespace flexlink::xproc
