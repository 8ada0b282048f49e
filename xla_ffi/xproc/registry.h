// This process's cross-process groups, keyed by their devices in rank order. The engine asks here
// before it makes an in-process group (core/engine.cc); the nanobind module creates and attaches.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "xla_ffi/core/status.h"

namespace flexlink::xproc {

class ProcessGroup;

// Creates a segment for `devices`, claims `local_devices` for this process, registers the group;
// `*name` is the segment's name for the other processes. slot_bytes 0: the default; processes: how
// many processes own `devices` (0: not known; ProcessGroup::Create).
Status CreateProcessGroup(std::span<const int64_t> devices, std::span<const int64_t> local_devices,
                          size_t slot_bytes, int processes, std::string* name);
// Maps segment `name` made for `devices`, claims `local_devices`, registers the group.
Status AttachProcessGroup(const std::string& name, std::span<const int64_t> devices,
                          std::span<const int64_t> local_devices);
Status UnlinkProcessSegment(const std::string& name);

// The registered group with exactly these devices, or nullptr. Lock-free after a device thread's
// first lookup of a group (registered groups are never erased).
ProcessGroup* FindProcessGroup(std::span<const int64_t> devices);

struct ProcessGroupInfo {
  std::string name;
  std::vector<int64_t> devices, local_devices;
  size_t slot_bytes = 0;
  uint64_t calls = 0;
  std::optional<std::string> broken;
  // Direct all_gather and all_reduce (ProcessGroup::direct_from), as this process's first rank
  // agreed them: nullopt until agreed, UINT64_MAX for never; and why never.
  std::optional<uint64_t> direct_from, direct_reduce_from;
  std::string direct_refusal, direct_reduce_refusal;
};
std::vector<ProcessGroupInfo> ProcessGroups();

}  // namespace flexlink::xproc
