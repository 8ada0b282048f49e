// The cross-process tcp ring's two connection phases and its registry (see tcp_xproc.h).
#include "xla_ffi/links/tcp_xproc.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "xla_ffi/core/call.h"
#include "xla_ffi/core/config.h"
#include "xla_ffi/links/socket.h"

namespace flexlink {
namespace {

struct Group {
  std::vector<int> local_ranks;     // positions in the group, in the order of local_devices
  std::vector<int> listeners;       // pending between Listen and Connect (-1: none, a group of one)
  std::unique_ptr<TcpChannel> channel;
  int refused = 0;
};

using Key = std::pair<std::vector<int64_t>, std::string>;

struct Registry {
  std::mutex mu;
  std::map<Key, Group> groups;
};

// Never destroyed: the engine may still run a channel on a device thread while the process exits,
// and a static destructor closing its sockets under it would be a use after free.
Registry& Reg() {
  static Registry* r = new Registry;
  return *r;
}

std::string GroupText(std::span<const int64_t> devices, std::string_view link) {
  return "flexlink: tcp link \"" + std::string(link) + "\" across processes on group " + FormatIds(devices);
}

std::string Rank(std::span<const int64_t> devices, int r) {
  return "rank " + std::to_string(r) + " (device " + std::to_string(devices[r]) + ")";
}

// The positions of `local_devices` in `devices`, checked: distinct groups, no stranger, no repeat.
Status LocalRanks(std::span<const int64_t> devices, std::span<const int64_t> local_devices, std::string_view link,
                  std::vector<int>* ranks) {
  const std::string where = GroupText(devices, link);
  FLEXLINK_RETURN_IF_ERROR(CheckDistinct(devices, "tcp link \"" + std::string(link) + "\" across processes"));
  if (devices.empty()) return Status::InvalidArgument(where + ": the group is empty");
  if (local_devices.empty()) return Status::InvalidArgument(where + ": no device of the group is local");
  ranks->clear();
  for (int64_t d : local_devices) {
    const auto it = std::find(devices.begin(), devices.end(), d);
    if (it == devices.end())
      return Status::InvalidArgument(where + ": local device " + std::to_string(d) + " is not in the group");
    const int r = static_cast<int>(it - devices.begin());
    if (std::find(ranks->begin(), ranks->end(), r) != ranks->end())
      return Status::InvalidArgument(where + ": local device " + std::to_string(d) + " is named twice");
    ranks->push_back(r);
  }
  return Status::Ok();
}

}  // namespace

Status ListenCrossProcessTcp(std::span<const int64_t> devices, std::span<const int64_t> local_devices,
                             std::string_view link_name, std::vector<uint16_t>* ports) {
  std::vector<int> ranks;
  FLEXLINK_RETURN_IF_ERROR(LocalRanks(devices, local_devices, link_name, &ranks));
  Group fresh;
  fresh.local_ranks = ranks;
  ports->assign(ranks.size(), 0);
  if (devices.size() >= 2) {  // a group of one has no ring (every kind is a copy)
    for (size_t i = 0; i < ranks.size(); ++i) {
      int fd = -1;
      const Status s = net::Listen(&fd, &(*ports)[i]);
      if (!s.ok()) {
        for (int l : fresh.listeners) close(l);
        return Status(s.code(), GroupText(devices, link_name) + ": " + Rank(devices, ranks[i]) +
                                    " could not listen: " + s.message());
      }
      fresh.listeners.push_back(fd);
    }
  }
  Registry& reg = Reg();
  std::lock_guard<std::mutex> lock(reg.mu);
  Group& g = reg.groups[Key({devices.begin(), devices.end()}, std::string(link_name))];
  if (g.channel) {
    for (int l : fresh.listeners) close(l);
    return Status::FailedPrecondition(GroupText(devices, link_name) +
                                      ": already connected in this process (a group connects once)");
  }
  for (int l : g.listeners)
    if (l >= 0) close(l);
  g = std::move(fresh);
  return Status::Ok();
}

Status ConnectCrossProcessTcp(std::span<const int64_t> devices, std::span<const int64_t> local_devices,
                              std::span<const uint16_t> ports, std::span<const uint8_t> token,
                              std::string_view link_name, int* refused) {
  *refused = 0;
  const std::string where = GroupText(devices, link_name);
  const int n = static_cast<int>(devices.size());
  std::vector<int> ranks;
  FLEXLINK_RETURN_IF_ERROR(LocalRanks(devices, local_devices, link_name, &ranks));
  if (ports.size() != devices.size())
    return Status::InvalidArgument(where + ": " + std::to_string(ports.size()) + " ports for " +
                                   std::to_string(n) + " ranks (one per rank, in rank order)");
  if (token.size() != kTcpTokenBytes)
    return Status::InvalidArgument(where + ": the token has " + std::to_string(token.size()) + " bytes, not " +
                                   std::to_string(kTcpTokenBytes));
  if (n >= 2)
    for (int r = 0; r < n; ++r)
      if (ports[r] == 0) return Status::InvalidArgument(where + ": no port for " + Rank(devices, r));

  // Take the pending listeners out under the lock; connect without it (this blocks up to the
  // deadline, and other groups may connect meanwhile).
  const Key key({devices.begin(), devices.end()}, std::string(link_name));
  std::vector<int> listeners;
  {
    Registry& reg = Reg();
    std::lock_guard<std::mutex> lock(reg.mu);
    auto it = reg.groups.find(key);
    if (it == reg.groups.end() || it->second.channel)
      return Status::FailedPrecondition(where + (it == reg.groups.end() ? ": Connect before Listen"
                                                                        : ": already connected in this process"));
    std::vector<int> a = ranks, b = it->second.local_ranks;
    std::sort(a.begin(), a.end());
    std::sort(b.begin(), b.end());
    if (a != b)
      return Status::InvalidArgument(where + ": the local devices differ from those Listen was given");
    ranks = it->second.local_ranks;  // the listeners' order
    listeners = std::move(it->second.listeners);
    it->second.listeners.clear();
  }

  std::vector<TcpChannel::RankFds> fds(ranks.size());
  Status s;
  int rejected_total = 0;
  if (n >= 2) {
    const double secs = TimeoutSeconds();
    const auto deadline = net::DeadlineIn(secs);
    // Every connect first: the successor's backlog holds it, so no process waits for another here.
    for (size_t i = 0; i < ranks.size() && s.ok(); ++i) {
      const int r = ranks[i], to = (r + 1) % n;
      const Status c = net::ConnectHello(ports[to], net::RingHello(token, r, to), deadline, &fds[i].send_fd);
      if (!c.ok())
        s = Status(c.code(), where + ": " + Rank(devices, r) + " could not connect to " + Rank(devices, to) +
                                 " at 127.0.0.1:" + std::to_string(ports[to]) + ": " + c.message());
    }
    for (size_t i = 0; i < ranks.size() && s.ok(); ++i) {
      const int r = ranks[i], from = (r + n - 1) % n;
      int rejected = 0;
      const Status a = net::AcceptHello(listeners[i], net::RingHello(token, from, r), deadline, &fds[i].recv_fd, &rejected);
      rejected_total += rejected;
      if (!a.ok()) {
        char t[32];
        std::snprintf(t, sizeof t, "%g", secs);
        s = Status(a.code(), where + ": " + Rank(devices, r) + " got no connection from " + Rank(devices, from) +
                                 " presenting the job's token within " + t + " s (" + std::to_string(rejected) +
                                 " other connection(s) refused): " + a.message());
      }
    }
  }
  for (int l : listeners)
    if (l >= 0) close(l);
  *refused = rejected_total;

  auto channel = std::make_unique<TcpChannel>(std::string(link_name), devices, ranks, fds, s, token);
  Registry& reg = Reg();
  std::lock_guard<std::mutex> lock(reg.mu);
  Group& g = reg.groups[key];
  g.channel = std::move(channel);
  g.refused = rejected_total;
  return s;
}

TcpChannel* CrossProcessTcp(std::span<const int64_t> devices, std::string_view link_name) {
  Registry& reg = Reg();
  std::lock_guard<std::mutex> lock(reg.mu);
  auto it = reg.groups.find(Key({devices.begin(), devices.end()}, std::string(link_name)));
  return it == reg.groups.end() ? nullptr : it->second.channel.get();
}

int CrossProcessTcpRefused(std::span<const int64_t> devices, std::string_view link_name) {
  Registry& reg = Reg();
  std::lock_guard<std::mutex> lock(reg.mu);
  auto it = reg.groups.find(Key({devices.begin(), devices.end()}, std::string(link_name)));
  return it == reg.groups.end() || !it->second.channel ? -1 : it->second.refused;
}

}  // namespace flexlink
