// The tcp link: the ranks of a communicator connected in a ring over loopback sockets (rank r sends
// to r+1 and receives from r-1), a NIC-like path. Bytes move only through the sockets: a rank reads
// and writes nothing but its own buffers, as it would with a real network between the devices.
//
// Connecting (Open, once per communicator, from one thread): a listener per rank on 127.0.0.1 port 0;
// rank r connects to rank r+1's listener and sends a hello (a per-communicator random 16-byte token +
// both ranks) as its first bytes. A connection that does not present it is closed and the accept goes
// on until the deadline; the listeners are closed once the ring stands.
//
// Order of reduction: results must equal shm's bit for bit, and shm reduces every element left to
// right in rank order 0..n-1 with reduce.h's kernels. A textbook ring reduce-scatter accumulates in
// ring order (different rounding for floats), so instead every chunk's partial value travels the
// ring as a chain 0 -> 1 -> ... -> n-1, each rank folding in its own contribution with the same
// kernel (acc op x_k). float16/bfloat16 partials travel as float32, which is exactly the kernel's
// accumulator, and are rounded once at rank n-1. The chain is pipelined in chunks, so the bytes on
// each socket are those of a ring:
//   all_reduce      partials 0 -> ... -> n-1, then the results n-1 -> 0 -> ... -> n-2 (2(n-1)N in all,
//                   like ring reduce-scatter + all-gather).
//   all_gather      ring all-gather: each rank sends its block, then forwards what it receives.
//   reduce_scatter  every block's chain 0 -> ... -> n-1, then block c's result n-1 -> 0 -> ... -> c
//                   (1.5x the bytes of an unordered ring: the price of the fixed order).
//   ppermute        message s -> d per pair, forwarded by the ranks in between (tcp_exchange.cc).
//   all_to_all      message o -> t (block t of rank o's input) for every pair of ranks, likewise.
// Sockets are non-blocking and one poll() loop per rank moves its send and receive streams together,
// so a ring of device threads never deadlocks on full buffers. Every receive has a destination from
// the start (the outputs, or per-rank scratch kept across calls), so no rank ever stops reading.
//
// Streams carry calls back to back, so every rank must run the pieces of a channel in the same order
// (the engine's one-split-per-call rule gives that); each piece (a part's unit range) starts with a
// small header that is checked, so a mismatch is an error, not garbage. Files: this channel and the
// ring's connection (tcp.cc), one rank's run of one piece (tcp_run.{h,cc}), the kinds (tcp_reduce.cc,
// tcp_exchange.cc); the same ring across processes (tcp_xproc.h: connected there, run with
// RunPieces). Any failure (deadline, peer gone, mismatch) breaks the channel for all ranks (peers
// blocked in poll wake at once; in other processes, through the closed sockets) and later runs fail
// fast, so the engine can move the bytes to another link. The health probe that re-admits the link
// (docs/faults.md) connects the ring again: in one process the probe's Run does it (fresh listeners
// and token); across processes the executor does it with ListenAgain / ConnectAgain around a
// barrier of the group's segment, through which the new ports travel.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "xla_ffi/links/link.h"
#include "xla_ffi/plan/link_spec.h"

namespace flexlink {

// What bounds one range on a tcp channel besides the global deadline (FLEXLINK_TIMEOUT_S): the lane's
// own deadline (docs/faults.md, "Per-link deadlines"), so that a ring that stalls mid-range fails at
// the link's deadline and its range is failed over in the same call, while the other links' waits
// still have time. `label` is the collective's, for messages.
struct TcpLimits {
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
  double budget_s = 0;  // the lane's budget (its length), for messages; 0: no deadline of its own
  std::string_view label;
};

class TcpChannel final : public Channel {
 public:
  // One rank's two sockets: to rank r+1 and from rank r-1 (non-blocking; the channel owns them).
  struct RankFds {
    int send_fd = -1, recv_fd = -1;
  };

  // Connects the ring of `devices.size()` ranks, all in this process (blocks up to the configured
  // timeout). A failure does not throw: the channel is born broken and every Run returns the
  // connection error.
  TcpChannel(std::string name, std::span<const int64_t> devices);
  // A ring already connected elsewhere (tcp_xproc.cc: across processes) of which only `local_ranks`
  // live in this process; `fds[i]` are local_ranks[i]'s sockets, owned from now on (also on error).
  // A non-OK `error` makes a broken channel whose runs return it. `token`: the job's hello token,
  // kept for reconnecting (ListenAgain/ConnectAgain).
  TcpChannel(std::string name, std::span<const int64_t> devices, std::span<const int> local_ranks,
             std::span<const RankFds> fds, Status error, std::span<const uint8_t> token = {});
  ~TcpChannel() override;

  std::string_view link_name() const override { return name_; }
  // RunPieces with the call's description of `rank`, the group size from `ctx` and the deadline of
  // `lane` in `ctx` (its budget from the arrival or its clock's start; docs/faults.md).
  Status Run(CallContext& ctx, int rank, int lane, std::span<const Piece> pieces) override;
  // The work of Run without an in-process CallContext: `rank` (local to this process) runs `pieces`
  // of `desc` (its own buffers) in a group of `n` ranks. Bytes move only through the sockets, so this
  // is all a rank needs when its peers live in other processes.
  // `limits`: the lane's deadline (a stalled ring fails there, the channel broken for every rank).
  Status RunPieces(const CallDesc& desc, int n, int rank, std::span<const Piece> pieces,
                   const TcpLimits& limits = {});

  // Test hook (a real stall, not an injected fault): from now on `rank`'s runs send nothing for its
  // next `runs` pieces (it still receives), as a peer whose socket writes stopped; -1 clears. The
  // ring's other ranks then wait on real sockets until their deadline.
  void StallSendsForTest(int rank, int runs = 1 << 30) {
    stall_runs_.store(runs);
    stall_rank_.store(rank);
  }

  // OK, or why the channel cannot be used (connection failure, or the first failure of a run).
  Status health() const;
  // How many times the ring was connected again (in process: by Run, once per break; across
  // processes: by ConnectAgain, counted per local rank).
  uint64_t reconnects() const { return reconnects_.load(); }

  // Across processes (tcp_xproc.h), at a health probe of the link: every rank of the group, in every
  // process, rebuilds the ring in two phases around a barrier of the caller's (the cross-process
  // executor's segment), because the new ports must travel between processes. ListenAgain closes
  // local rank `rank`'s sockets, clears the channel's failure (the first local rank to call it; no
  // local rank is inside a run then) and returns a new listener's port; ConnectAgain, once every
  // rank's port is known (`ports`, rank order), connects to the successor and accepts the
  // predecessor with the job's token, by `deadline`. An error breaks the channel again.
  Status ListenAgain(int rank, uint16_t* port);
  Status ConnectAgain(int rank, std::span<const uint16_t> ports, std::chrono::steady_clock::time_point deadline);
  std::span<const int64_t> devices() const { return devices_; }
  bool is_local(int rank) const { return local_[rank] != 0; }

 private:
  struct RankState {
    int send_fd = -1, recv_fd = -1;
    int listen_fd = -1;  // between ListenAgain and ConnectAgain
    // Ranges started so far: the header's sequence number. Atomic because a rank that times out reads
    // its peers' counters to name the ones that never started (diagnostics only; bytes still move
    // only through the sockets).
    std::atomic<uint64_t> runs{0};
    std::vector<char> scratch;  // partials / forwarded blocks; grows to the largest range seen
  };
  bool MakeAbortFd();
  // Listens, connects and accepts the whole ring with a fresh token (every rank in this process).
  Status ConnectRing();
  // Rebuilds a broken in-process ring, once per break whichever ranks ask (`seen`: the generation
  // the caller saw broken); the channel is usable again when it returns OK.
  Status Reconnect(uint64_t seen);
  // Undoes Break (under mu_): no error, the abort eventfd drained, runs allowed again.
  void ClearBreakLocked();
  // Records the first failure and wakes every local rank; across processes it also shuts this
  // process's sockets down, so the neighbours in other processes see the ring end at once instead of
  // waiting for their deadline (the abort eventfd reaches only this process).
  void Break(Status why);
  std::string Where(const CallDesc& d, const Piece& piece, std::string_view label = {}) const;
  // "rank 3 (device 2049)", or "rank 3 (device 2049, another process)" for a rank not local here.
  std::string RankName(int rank) const;
  friend class TcpRun;

  const std::string name_;
  const std::vector<int64_t> devices_;
  std::vector<RankState> ranks_;  // each rank touches only its own entry; remote ranks' stay unused
  std::vector<char> local_;       // per rank: whether it lives in this process
  bool all_local_ = true;
  int abort_fd_ = -1;             // eventfd, readable once the channel is broken
  std::atomic<bool> broken_{false};
  std::mutex reconnect_mu_;
  std::vector<uint8_t> token_;  // across processes: the job's hello token
  std::atomic<uint64_t> generation_{0}, reconnects_{0};
  std::atomic<int> stall_rank_{-1}, stall_runs_{0};  // StallSendsForTest
  mutable std::mutex mu_;
  Status first_error_;
};

class TcpLink final : public Link {
 public:
  explicit TcpLink(std::string name = "tcp") : name_(std::move(name)) {}
  // From a parsed spec ("tcp" or "tcp:name"; no parameters).
  static Status FromSpec(const plan::LinkSpec& spec, std::unique_ptr<Link>* out);

  std::string_view name() const override { return name_; }
  std::unique_ptr<Channel> Open(std::span<const int64_t> devices) override {
    return std::make_unique<TcpChannel>(name_, devices);
  }

 private:
  const std::string name_;
};

}  // namespace flexlink
