#include "tests/cpp/sim/sim_xproc_comm.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <thread>

#include "tests/cpp/sim/sim_reduce.h"
#include "xla_ffi/xproc/process_group.h"

namespace flexlink::sim {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint64_t kMagic = 0x4d4f43584d495346ull;  // "FSIMXCOM"

// The operation's description as the shared file holds it (every rank compares them).
struct OpDesc {
  uint32_t type;
  uint32_t ctype;
  uint32_t op;
  uint32_t pad;
  uint64_t count;
};

struct Header {
  std::atomic<uint64_t> magic;
  std::atomic<uint32_t> joined;  // ranks that mapped the file (the last one unlinks it)
  uint32_t n;
  uint64_t slot_bytes;
};

struct alignas(64) RankCtl {
  std::atomic<uint64_t> posted;  // collectives staged so far
  std::atomic<int32_t> pid;      // 0 until the rank joined
  std::atomic<uint32_t> connected;  // 1: the rank saw every rank join (its communicator's second phase)
  OpDesc desc[2];
};

struct alignas(64) PairCtl {  // messages from rank s to rank d
  std::atomic<uint64_t> posted, consumed;
  uint64_t bytes[2];
};

size_t RoundUp(size_t x, size_t m) { return (x + m - 1) / m * m; }

struct Offsets {
  size_t ranks, pairs, slots, mail, total;
};

Offsets Layout(int n, size_t slot) {
  Offsets o;
  o.ranks = RoundUp(sizeof(Header), 64);
  o.pairs = o.ranks + n * sizeof(RankCtl);
  o.slots = RoundUp(o.pairs + size_t(n) * n * sizeof(PairCtl), 4096);
  o.mail = o.slots + 2 * size_t(n) * slot;
  o.total = o.mail + size_t(n) * n * 2 * slot;
  return o;
}



}  // namespace

struct SimXprocComm::Op {
  enum Type : uint32_t { kAllReduce, kAllGather, kReduceScatter, kSend, kRecv } type;
  const void* send = nullptr;
  void* recv = nullptr;
  size_t count = 0;
  gpu::CommType ctype = gpu::CommType::kUint8;
  gpu::CommOp op = gpu::CommOp::kSum;
  int peer = -1;
};

// One communicator's shared file, mapped in this process.
struct SimXprocComm::Shared {
  std::string name;
  char* base = nullptr;
  size_t bytes = 0;
  int n = 0;
  size_t slot = 0;
  Offsets off{};
  std::atomic<size_t> operations{0};
  std::atomic<bool> aborted{false};  // this process's side (Abort)
  ~Shared() {
    if (base) munmap(base, bytes);
  }
  Header* header() const { return reinterpret_cast<Header*>(base); }
  RankCtl& rank(int r) const { return reinterpret_cast<RankCtl*>(base + off.ranks)[r]; }
  PairCtl& pair(int s, int d) const { return reinterpret_cast<PairCtl*>(base + off.pairs)[s * n + d]; }
  char* slot_of(int buffer, int r) const { return base + off.slots + (size_t(buffer) * n + r) * slot; }
  char* mail(int s, int d, int parity) const { return base + off.mail + ((size_t(s) * n + d) * 2 + parity) * slot; }
};

struct SimXprocComm::Rank {
  std::shared_ptr<Shared> shared;
  int rank = 0;
  bool complete = false;  // JoinState saw every rank connected
  std::atomic<bool> destroyed{false};
  // Operations issued and not yet finished on their stream (Destroy with one is an error); shared
  // with the operations themselves, which may outlive this object on a stream.
  std::shared_ptr<std::atomic<int>> unfinished = std::make_shared<std::atomic<int>>(0);
  uint64_t next_collective = 0;
  std::map<int, uint64_t> sent, received;
};

namespace {

struct Pending {
  int depth = 0;
  SimXprocComm::Rank* rank = nullptr;
  gpu::Stream stream = nullptr;
  std::vector<SimXprocComm::Op> ops;
  bool mixed = false;
};
thread_local Pending t_xgroup;

// Waits until `ready()` with the deadline, checking `peer`'s process every 20 ms; false (and the
// reason in *why) when the peer exited or the deadline passed.
template <class F>
bool WaitFor(F ready, const SimXprocComm::Shared& s, int peer, double timeout, const std::string& what,
             std::string* why) {
  const auto start = Clock::now();
  auto next_check = start;
  for (int spins = 0; !ready(); ++spins) {
    if (s.aborted.load(std::memory_order_acquire)) {
      *why = "";  // aborted: return without touching buffers, and without an error of its own
      return false;
    }
    if (spins < 16) {
      sched_yield();
      continue;
    }
    const auto now = Clock::now();
    if (now >= next_check) {
      next_check = now + std::chrono::milliseconds(20);
      const int32_t pid = s.rank(peer).pid.load(std::memory_order_relaxed);
      // Checked again after the liveness test: a peer may have done its part and exited since.
      if (xproc::ProcessGone(pid) && !ready()) {
        *why = "sim nccl across processes: rank " + std::to_string(peer) + " (pid " + std::to_string(pid) +
               ") exited while waiting for " + what;
        return false;
      }
    }
    if (now - start > std::chrono::duration<double>(timeout)) {
      *why = "sim nccl across processes: timed out after " + std::to_string(timeout) + " s waiting for " + what;
      return false;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  return true;
}

}  // namespace

SimXprocComm::SimXprocComm(SimDevice* device, size_t slot_bytes)
    : device_(*device), slot_bytes_(RoundUp(slot_bytes, 64)) {}

SimXprocComm::~SimXprocComm() = default;

int SimXprocComm::inits() const {
  std::lock_guard<std::mutex> lock(mu_);
  return inits_;
}

size_t SimXprocComm::operations() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t total = 0;
  for (const auto& s : shared_) total += s->operations.load();
  return total;
}

std::string SimXprocComm::NameOf(const gpu::CommId& id) {
  static const char* hex = "0123456789abcdef";
  std::string name = "/flexlink-simnccl-";
  for (int i = 0; i < 16; ++i) {
    name += hex[id[i] >> 4];
    name += hex[id[i] & 15];
  }
  return name;
}

Status SimXprocComm::InitAll(std::span<const int>, std::vector<gpu::Comm>*) {
  return Status::Internal("sim nccl across processes: InitAll is the in-process path (SimComm)");
}

Status SimXprocComm::NewId(gpu::CommId* id) {
  id->fill(0);
  if (getrandom(id->data(), 16, 0) != 16) return Status::Internal(std::string("getrandom: ") + std::strerror(errno));
  return Status::Ok();
}

Status SimXprocComm::InitRanksAsync(const gpu::CommId& id, int nranks, std::span<const int> ranks,
                                    std::span<const int> devices, std::vector<gpu::Comm>* comms) {
  comms->clear();
  if (ranks.size() != devices.size() || ranks.empty() || nranks < 1)
    return Status::InvalidArgument("sim nccl across processes: InitRanks needs one device per local rank");
  for (size_t a = 0; a < devices.size(); ++a)
    for (size_t b = a + 1; b < devices.size(); ++b)
      if (devices[a] == devices[b]) return Status::Internal("sim nccl: Duplicate GPU detected");
  for (int r : ranks)
    if (r < 0 || r >= nranks) return Status::InvalidArgument("sim nccl across processes: rank out of range");
  if (join_fault_ == JoinFault::kExitBeforeJoin) _exit(42);
  if (join_fault_ == JoinFault::kStallBeforeJoin) {
    // Alive but never joining (a process wedged elsewhere): its peers can only time out. Bounded
    // (the test SIGKILLs it sooner).
    for (int i = 0; i < 600; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    _exit(43);
  }
  auto s = std::make_shared<Shared>();
  s->name = NameOf(id);
  s->n = nranks;
  s->slot = slot_bytes_;
  s->off = Layout(nranks, slot_bytes_);
  s->bytes = s->off.total;
  // Whoever comes first creates the file; ftruncate to the same size keeps what another process
  // already wrote, and a fresh file reads as zeros, which is every counter's initial state.
  const int fd = shm_open(s->name.c_str(), O_RDWR | O_CREAT, 0600);
  if (fd < 0) return Status::Internal("sim nccl: shm_open(" + s->name + "): " + std::strerror(errno));
  if (ftruncate(fd, static_cast<off_t>(s->bytes)) != 0) {
    const int e = errno;
    close(fd);
    return Status::Internal("sim nccl: ftruncate: " + std::string(std::strerror(e)));
  }
  void* p = mmap(nullptr, s->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return Status::Internal("sim nccl: mmap: " + std::string(std::strerror(errno)));
  s->base = static_cast<char*>(p);
  Header* h = s->header();
  uint64_t expected = 0;
  if (h->magic.compare_exchange_strong(expected, kMagic)) {
    h->n = static_cast<uint32_t>(nranks);
    h->slot_bytes = slot_bytes_;
  }
  for (int r : ranks) s->rank(r).pid.store(getpid(), std::memory_order_release);
  if (h->joined.fetch_add(static_cast<uint32_t>(ranks.size())) + ranks.size() == static_cast<uint32_t>(nranks))
    shm_unlink(s->name.c_str());  // everyone mapped it: nothing is left in /dev/shm from here on
  // Joined but dead before the second phase: the others' communicators never complete, as NCCL's
  // do not when a peer dies inside its bootstrap.
  if (join_fault_ == JoinFault::kExitAfterJoin) _exit(42);
  std::lock_guard<std::mutex> lock(mu_);
  for (int r : ranks) {
    auto rank = std::make_unique<Rank>();
    rank->shared = s;
    rank->rank = r;
    comms->push_back(rank.get());
    ranks_.push_back(std::move(rank));
  }
  shared_.push_back(std::move(s));
  ++inits_;
  return Status::Ok();
}

Status SimXprocComm::JoinState(gpu::Comm comm, bool* done) {
  Rank* rank = static_cast<Rank*>(comm);
  if (!rank) return Status::Internal("sim nccl: no communicator");
  *done = rank->complete;
  if (rank->complete) return Status::Ok();
  Shared& s = *rank->shared;
  if (s.aborted.load(std::memory_order_acquire))
    return Status::Internal("sim nccl across processes: the communicator was aborted");
  // Two phases, as NCCL's bootstrap: every rank joins (pid, `joined`), then every rank, having seen
  // all joined, connects; complete when all have connected. A peer that died after joining never
  // connects, and nothing here notices it: the caller's deadline and liveness checks must.
  Header* h = s.header();
  if (h->joined.load(std::memory_order_acquire) < static_cast<uint32_t>(s.n)) return Status::Ok();
  if (h->n != static_cast<uint32_t>(s.n) || h->slot_bytes != s.slot)
    return Status::Internal("sim nccl across processes: processes disagree on the communicator's size");
  s.rank(rank->rank).connected.store(1, std::memory_order_release);
  for (int r = 0; r < s.n; ++r)
    if (s.rank(r).connected.load(std::memory_order_acquire) == 0) return Status::Ok();
  rank->complete = true;
  *done = true;
  return Status::Ok();
}

Status SimXprocComm::GroupStart() {
  ++t_xgroup.depth;
  return Status::Ok();
}

Status SimXprocComm::GroupEnd() {
  if (t_xgroup.depth == 0) return Status::Internal("sim nccl: GroupEnd without GroupStart");
  if (--t_xgroup.depth > 0) return Status::Ok();
  Pending p = std::move(t_xgroup);
  t_xgroup = Pending{};
  if (p.mixed) return Status::Internal("sim nccl: one group mixed communicators or streams");
  if (p.rank) Submit(p.rank, p.stream, std::move(p.ops));
  return Status::Ok();
}

Status SimXprocComm::Issue(Op op, gpu::Comm comm, gpu::Stream stream) {
  Rank* rank = static_cast<Rank*>(comm);
  if (!rank) return Status::Internal("sim nccl: no communicator");
  if (rank->shared->aborted.load()) return Status::Internal("sim nccl across processes: the communicator was aborted");
  if (rank->destroyed.load()) {
    device_.Error("sim nccl: operation on a destroyed communicator");
    return Status::Internal("sim nccl: operation on a destroyed communicator");
  }
  const size_t bytes = op.count * Width(op.ctype) * (op.type == Op::kReduceScatter ? rank->shared->n : 1);
  if (bytes > rank->shared->slot)
    return Status::Internal("sim nccl across processes: an operation of " + std::to_string(bytes) +
                            " bytes is larger than the simulation's " + std::to_string(rank->shared->slot) +
                            "-byte slot");
  if (t_xgroup.depth == 0) {
    Submit(rank, stream, {op});
    return Status::Ok();
  }
  if (t_xgroup.rank && (t_xgroup.rank != rank || t_xgroup.stream != stream)) t_xgroup.mixed = true;
  t_xgroup.rank = rank;
  t_xgroup.stream = stream;
  t_xgroup.ops.push_back(op);
  return Status::Ok();
}

void SimXprocComm::Submit(Rank* rank, gpu::Stream stream, std::vector<Op> ops) {
  std::shared_ptr<Shared> s = rank->shared;
  const int me = rank->rank;
  SimDevice* dev = &device_;
  const double timeout = dev->wait_timeout_s();
  bool p2p = false, coll = false;
  for (const Op& op : ops) (op.type == Op::kSend || op.type == Op::kRecv ? p2p : coll) = true;
  if (p2p && coll) dev->Error("sim nccl: a group mixed collectives and point-to-point operations");
  // Sequence numbers at issue time, on the issuing thread, as NCCL takes them.
  std::vector<uint64_t> seqs;
  for (const Op& op : ops) {
    if (op.type == Op::kSend) seqs.push_back(rank->sent[op.peer]++);
    else if (op.type == Op::kRecv) seqs.push_back(rank->received[op.peer]++);
    else seqs.push_back(rank->next_collective++);
  }
  rank->unfinished->fetch_add(1);
  device_.Enqueue(stream, [s, me, dev, timeout, ops = std::move(ops), seqs = std::move(seqs), left = rank->unfinished] {
    struct Finished {
      std::atomic<int>& left;
      ~Finished() { left.fetch_sub(1); }
    } finished{*left};
    const int n = s->n;
    std::string why;
    // Point to point: post every send, then complete every receive.
    for (size_t i = 0; i < ops.size(); ++i) {
      if (ops[i].type != Op::kSend) continue;
      const uint64_t m = seqs[i];
      PairCtl& pc = s->pair(me, ops[i].peer);
      if (!WaitFor([&] { return pc.consumed.load(std::memory_order_acquire) + 1 >= m; }, *s, ops[i].peer, timeout,
                   "rank " + std::to_string(ops[i].peer) + " to receive message " + std::to_string(m - 1) +
                       " from rank " + std::to_string(me),
                   &why))
        return why.empty() ? void() : dev->Error(why);
      const size_t bytes = ops[i].count * Width(ops[i].ctype);
      std::memcpy(s->mail(me, ops[i].peer, m & 1), ops[i].send, bytes);
      pc.bytes[m & 1] = bytes;
      pc.posted.store(m + 1, std::memory_order_release);
    }
    for (size_t i = 0; i < ops.size(); ++i) {
      if (ops[i].type != Op::kRecv) continue;
      const uint64_t m = seqs[i];
      PairCtl& pc = s->pair(ops[i].peer, me);
      if (!WaitFor([&] { return pc.posted.load(std::memory_order_acquire) >= m + 1; }, *s, ops[i].peer, timeout,
                   "a send from rank " + std::to_string(ops[i].peer), &why))
        return why.empty() ? void() : dev->Error(why);
      const size_t bytes = ops[i].count * Width(ops[i].ctype);
      if (pc.bytes[m & 1] != bytes) return dev->Error("sim nccl: send and receive sizes differ");
      std::memcpy(ops[i].recv, s->mail(ops[i].peer, me, m & 1), bytes);
      pc.consumed.store(m + 1, std::memory_order_release);
      s->operations.fetch_add(1);
    }
    // Collectives, one after another.
    for (size_t i = 0; i < ops.size(); ++i) {
      const Op& o = ops[i];
      if (o.type == Op::kSend || o.type == Op::kRecv) continue;
      const uint64_t k = seqs[i];
      const int buffer = static_cast<int>(k & 1);
      const size_t w = Width(o.ctype);
      const size_t send_bytes = o.count * w * (o.type == Op::kReduceScatter ? n : 1);
      RankCtl& mine = s->rank(me);
      mine.desc[buffer] = OpDesc{static_cast<uint32_t>(o.type), static_cast<uint32_t>(o.ctype),
                                 static_cast<uint32_t>(o.op), 0, o.count};
      std::memcpy(s->slot_of(buffer, me), o.send, send_bytes);
      mine.posted.store(k + 1, std::memory_order_release);
      for (int j = 0; j < n; ++j) {
        RankCtl& peer = s->rank(j);
        if (!WaitFor([&] { return peer.posted.load(std::memory_order_acquire) >= k + 1; }, *s, j, timeout,
                     "rank " + std::to_string(j) + " at collective " + std::to_string(k), &why))
          return why.empty() ? void() : dev->Error(why);
      }
      for (int j = 0; j < n; ++j) {
        const OpDesc& d = s->rank(j).desc[buffer];
        if (d.type != uint32_t(o.type) || d.ctype != uint32_t(o.ctype) || d.op != uint32_t(o.op) || d.count != o.count)
          return dev->Error("sim nccl across processes: ranks issued different collectives at sequence " +
                            std::to_string(k) + " (rank " + std::to_string(me) + " and rank " + std::to_string(j) + ")");
      }
      const size_t bytes = o.count * w;
      if (o.type == Op::kAllReduce) {
        std::vector<const void*> srcs;
        for (int j = 0; j < n; ++j) srcs.push_back(s->slot_of(buffer, j));
        ReduceRows(o.ctype, o.op, srcs, o.recv, o.count);
      } else if (o.type == Op::kAllGather) {
        for (int j = 0; j < n; ++j) std::memcpy(static_cast<uint8_t*>(o.recv) + j * bytes, s->slot_of(buffer, j), bytes);
      } else {  // reduce-scatter: block `me` of every rank's send
        std::vector<const void*> srcs;
        for (int j = 0; j < n; ++j) srcs.push_back(s->slot_of(buffer, j) + me * bytes);
        ReduceRows(o.ctype, o.op, srcs, o.recv, o.count);
      }
      s->operations.fetch_add(1);
    }
  });
}

Status SimXprocComm::Abort(gpu::Comm comm) {
  Rank* rank = static_cast<Rank*>(comm);
  if (!rank) return Status::Internal("sim nccl: no communicator");
  rank->shared->aborted.store(true, std::memory_order_release);
  // A join aborted before every rank mapped the file: the last joiner will never unlink it, so this
  // process does (a later joiner would make a fresh one, which its own abort or join removes).
  if (rank->shared->header()->joined.load() < static_cast<uint32_t>(rank->shared->n))
    shm_unlink(rank->shared->name.c_str());
  return Status::Ok();
}

Status SimXprocComm::Destroy(gpu::Comm comm, double) {
  Rank* rank = static_cast<Rank*>(comm);
  if (!rank) return Status::Internal("sim nccl: no communicator");
  if (rank->destroyed.exchange(true)) {
    device_.Error("sim nccl: a communicator destroyed twice");
    return Status::Internal("sim nccl: a communicator destroyed twice");
  }
  if (rank->unfinished->load() > 0 && !rank->shared->aborted.load())
    device_.Error("sim nccl: a communicator across processes destroyed with " + std::to_string(rank->unfinished->load()) +
                  " operation(s) unfinished");
  return Status::Ok();
}

int SimXprocComm::live() const {
  std::lock_guard<std::mutex> lock(mu_);
  int n = 0;
  for (const auto& r : ranks_) n += !r->destroyed.load() && !r->shared->aborted.load();
  return n;
}

Status SimXprocComm::AllReduce(const void* send, void* recv, size_t count, gpu::CommType type, gpu::CommOp op,
                               gpu::Comm comm, gpu::Stream stream) {
  return Issue({Op::kAllReduce, send, recv, count, type, op, -1}, comm, stream);
}
Status SimXprocComm::AllGather(const void* send, void* recv, size_t count, gpu::CommType type, gpu::Comm comm,
                               gpu::Stream stream) {
  return Issue({Op::kAllGather, send, recv, count, type, gpu::CommOp::kSum, -1}, comm, stream);
}
Status SimXprocComm::ReduceScatter(const void* send, void* recv, size_t count, gpu::CommType type, gpu::CommOp op,
                                   gpu::Comm comm, gpu::Stream stream) {
  return Issue({Op::kReduceScatter, send, recv, count, type, op, -1}, comm, stream);
}
Status SimXprocComm::Send(const void* send, size_t count, gpu::CommType type, int peer, gpu::Comm comm,
                          gpu::Stream stream) {
  return Issue({Op::kSend, send, nullptr, count, type, gpu::CommOp::kSum, peer}, comm, stream);
}
Status SimXprocComm::Recv(void* recv, size_t count, gpu::CommType type, int peer, gpu::Comm comm,
                          gpu::Stream stream) {
  return Issue({Op::kRecv, nullptr, recv, count, type, gpu::CommOp::kSum, peer}, comm, stream);
}

}  // namespace flexlink::sim
