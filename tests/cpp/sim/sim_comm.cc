#include "tests/cpp/sim/sim_comm.h"

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>

#include "tests/cpp/sim/sim_reduce.h"

namespace flexlink::sim {

struct SimComm::Op {
  enum Type { kAllReduce, kAllGather, kReduceScatter, kSend, kRecv } type;
  const void* send = nullptr;
  void* recv = nullptr;
  size_t count = 0;
  gpu::CommType ctype = gpu::CommType::kUint8;
  gpu::CommOp op = gpu::CommOp::kSum;
  int peer = -1;
};

struct SimComm::Clique {
  int n = 0;
  std::mutex mu;
  std::condition_variable cv;
  // Collectives, by their sequence number on the communicator: each rank's operation once it
  // arrived; done when the last one ran it for everyone.
  struct Slot {
    std::vector<const Op*> ops;
    int count = 0;
    bool done = false;
  };
  std::map<uint64_t, Slot> slots;
  // Point-to-point messages, by (source, destination, index of the pair's message), as NCCL matches
  // sends and receives per pair; a message is posted when the sender's stream reaches the send.
  struct Message {
    const void* data = nullptr;
    size_t bytes = 0;
    bool posted = false, consumed = false;
  };
  std::map<std::tuple<int, int, uint64_t>, Message> messages;
  size_t operations = 0;
  // Abort: every operation still waiting wakes and returns without touching its buffers (what
  // ncclCommAbort does to kernels in flight), later ones are skipped, issuing more is an error.
  bool aborted = false;
};

struct SimComm::Rank {
  Clique* clique = nullptr;
  int rank = 0;
  bool destroyed = false;                 // under the clique's mu
  uint64_t next_collective = 0;           // issue order, as NCCL matches collectives
  std::map<int, uint64_t> sent, received;  // per peer: messages issued so far
};

namespace {

struct Pending {
  int depth = 0;
  SimComm::Rank* rank = nullptr;
  gpu::Stream stream = nullptr;
  std::vector<SimComm::Op> ops;
  bool mixed = false;
};
thread_local Pending t_group;

}  // namespace

SimComm::SimComm(SimDevice* device) : device_(*device) {}
SimComm::~SimComm() = default;

size_t SimComm::operations() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t total = 0;
  for (const auto& c : cliques_) {
    std::lock_guard<std::mutex> cl(c->mu);
    total += c->operations;
  }
  return total;
}

Status SimComm::InitAll(std::span<const int> devices, std::vector<gpu::Comm>* comms) {
  for (size_t a = 0; a < devices.size(); ++a)
    for (size_t b = a + 1; b < devices.size(); ++b)
      if (devices[a] == devices[b]) return Status::Internal("sim nccl: Duplicate GPU detected");
  std::lock_guard<std::mutex> lock(mu_);
  ++inits_;
  auto clique = std::make_unique<Clique>();
  clique->n = static_cast<int>(devices.size());
  comms->clear();
  for (int r = 0; r < clique->n; ++r) {
    auto rank = std::make_unique<Rank>();
    rank->clique = clique.get();
    rank->rank = r;
    comms->push_back(rank.get());
    ranks_.push_back(std::move(rank));
  }
  cliques_.push_back(std::move(clique));
  return Status::Ok();
}

Status SimComm::GroupStart() {
  ++t_group.depth;
  return Status::Ok();
}

Status SimComm::GroupEnd() {
  if (t_group.depth == 0) return Status::Internal("sim nccl: GroupEnd without GroupStart");
  if (--t_group.depth > 0) return Status::Ok();
  Pending p = std::move(t_group);
  t_group = Pending{};
  if (p.mixed) return Status::Internal("sim nccl: one group mixed communicators or streams");
  if (p.rank) Submit(p.rank, p.stream, std::move(p.ops));
  return Status::Ok();
}

Status SimComm::Issue(Op op, gpu::Comm comm, gpu::Stream stream) {
  Rank* rank = static_cast<Rank*>(comm);
  if (!rank) return Status::Internal("sim nccl: no communicator");
  {
    std::lock_guard<std::mutex> lock(rank->clique->mu);
    if (rank->clique->aborted) return Status::Internal("sim nccl: operation on an aborted communicator");
    if (rank->destroyed) {
      device_.Error("sim nccl: operation on a destroyed communicator");
      return Status::Internal("sim nccl: operation on a destroyed communicator");
    }
  }
  if (t_group.depth == 0) {
    Submit(rank, stream, {op});
    return Status::Ok();
  }
  if (t_group.rank && (t_group.rank != rank || t_group.stream != stream)) t_group.mixed = true;
  t_group.rank = rank;
  t_group.stream = stream;
  t_group.ops.push_back(op);
  return Status::Ok();
}

void SimComm::Submit(Rank* rank, gpu::Stream stream, std::vector<Op> ops) {
  Clique* c = rank->clique;
  const int me = rank->rank;
  SimDevice* dev = &device_;
  const double timeout = dev->wait_timeout_s();
  bool p2p = false, coll = false;
  for (const Op& op : ops) (op.type == Op::kSend || op.type == Op::kRecv ? p2p : coll) = true;
  if (p2p && coll) dev->Error("sim nccl: a group mixed collectives and point-to-point operations");
  // Sequence numbers are taken at issue time, on the issuing thread, as NCCL does.
  std::vector<uint64_t> seqs;
  for (const Op& op : ops) {
    if (op.type == Op::kSend) seqs.push_back(rank->sent[op.peer]++);
    else if (op.type == Op::kRecv) seqs.push_back(rank->received[op.peer]++);
    else seqs.push_back(rank->next_collective++);
  }
  device_.Enqueue(stream, [c, me, dev, timeout, ops = std::move(ops), seqs = std::move(seqs)] {
    std::unique_lock<std::mutex> lock(c->mu);
    if (c->aborted) return;
    // false: the clique was aborted meanwhile (stop here, as an aborted NCCL kernel does).
    auto wait = [&](auto pred, const std::string& what) {
      if (!c->cv.wait_for(lock, std::chrono::duration<double>(timeout), [&] { return c->aborted || pred(); }))
        dev->Error("sim nccl: rank " + std::to_string(me) + " waited too long for " + what);
      return !c->aborted;
    };
    // Point to point: post every send of the group, complete every receive, then wait until the
    // sends were taken (all operations of a group progress together, as in NCCL).
    for (size_t i = 0; i < ops.size(); ++i)
      if (ops[i].type == Op::kSend) {
        auto& m = c->messages[{me, ops[i].peer, seqs[i]}];
        m.data = ops[i].send;
        m.bytes = ops[i].count * Width(ops[i].ctype);
        m.posted = true;
        c->cv.notify_all();
      }
    for (size_t i = 0; i < ops.size(); ++i)
      if (ops[i].type == Op::kRecv) {
        const auto key = std::make_tuple(ops[i].peer, me, seqs[i]);
        if (!wait([&] { return c->messages[key].posted; }, "a send from rank " + std::to_string(ops[i].peer))) return;
        auto& m = c->messages[key];
        const size_t bytes = ops[i].count * Width(ops[i].ctype);
        if (m.bytes != bytes) dev->Error("sim nccl: send and receive sizes differ");
        else std::memcpy(ops[i].recv, m.data, bytes);
        m.consumed = true;
        ++c->operations;
        c->cv.notify_all();
      }
    for (size_t i = 0; i < ops.size(); ++i)
      if (ops[i].type == Op::kSend) {
        const auto key = std::make_tuple(me, ops[i].peer, seqs[i]);
        if (!wait([&] { return c->messages[key].consumed; }, "rank " + std::to_string(ops[i].peer) + " to receive"))
          return;
        c->messages.erase(key);
      }
    // Collectives, one after another: each waits for every rank's operation of its sequence number.
    for (size_t i = 0; i < ops.size(); ++i) {
      if (ops[i].type == Op::kSend || ops[i].type == Op::kRecv) continue;
      Clique::Slot& slot = c->slots[seqs[i]];
      if (slot.ops.empty()) slot.ops.assign(c->n, nullptr);
      slot.ops[me] = &ops[i];
      if (++slot.count == c->n) {
        const Op& o = *slot.ops[0];
        bool same = true;
        for (int r = 1; r < c->n; ++r)
          same = same && slot.ops[r]->type == o.type && slot.ops[r]->count == o.count &&
                 slot.ops[r]->ctype == o.ctype && slot.ops[r]->op == o.op;
        if (!same) dev->Error("sim nccl: ranks issued different collectives at sequence " + std::to_string(seqs[i]));
        const size_t bytes = o.count * Width(o.ctype);
        if (same && o.type == Op::kAllReduce) {
          std::vector<std::vector<uint8_t>> copies(c->n);  // recv may alias send
          std::vector<const void*> srcs;
          for (int r = 0; r < c->n; ++r) {
            const uint8_t* p = static_cast<const uint8_t*>(slot.ops[r]->send);
            copies[r].assign(p, p + bytes);
            srcs.push_back(copies[r].data());
          }
          for (int r = 0; r < c->n; ++r) ReduceRows(o.ctype, o.op, srcs, slot.ops[r]->recv, o.count);
        } else if (same && o.type == Op::kAllGather) {
          for (int r = 0; r < c->n; ++r)
            for (int k = 0; k < c->n; ++k)
              std::memcpy(static_cast<uint8_t*>(slot.ops[r]->recv) + k * bytes, slot.ops[k]->send, bytes);
        } else if (same) {  // reduce-scatter
          for (int r = 0; r < c->n; ++r) {
            std::vector<const void*> srcs;
            for (int k = 0; k < c->n; ++k) srcs.push_back(static_cast<const uint8_t*>(slot.ops[k]->send) + r * bytes);
            ReduceRows(o.ctype, o.op, srcs, slot.ops[r]->recv, o.count);
          }
        }
        c->operations += c->n;
        slot.done = true;
        c->cv.notify_all();
      } else {
        if (!wait([&] { return slot.done; }, "collective " + std::to_string(seqs[i]))) return;
      }
      if (--slot.count == 0) c->slots.erase(seqs[i]);
    }
  });
}

Status SimComm::AllReduce(const void* send, void* recv, size_t count, gpu::CommType type, gpu::CommOp op, gpu::Comm comm,
                          gpu::Stream stream) {
  return Issue({Op::kAllReduce, send, recv, count, type, op, -1}, comm, stream);
}
Status SimComm::AllGather(const void* send, void* recv, size_t count, gpu::CommType type, gpu::Comm comm,
                          gpu::Stream stream) {
  return Issue({Op::kAllGather, send, recv, count, type, gpu::CommOp::kSum, -1}, comm, stream);
}
Status SimComm::ReduceScatter(const void* send, void* recv, size_t count, gpu::CommType type, gpu::CommOp op,
                              gpu::Comm comm, gpu::Stream stream) {
  return Issue({Op::kReduceScatter, send, recv, count, type, op, -1}, comm, stream);
}
Status SimComm::Send(const void* send, size_t count, gpu::CommType type, int peer, gpu::Comm comm, gpu::Stream stream) {
  return Issue({Op::kSend, send, nullptr, count, type, gpu::CommOp::kSum, peer}, comm, stream);
}
Status SimComm::Recv(void* recv, size_t count, gpu::CommType type, int peer, gpu::Comm comm, gpu::Stream stream) {
  return Issue({Op::kRecv, nullptr, recv, count, type, gpu::CommOp::kSum, peer}, comm, stream);
}

Status SimComm::Abort(gpu::Comm comm) {
  Rank* rank = static_cast<Rank*>(comm);
  if (!rank) return Status::Internal("sim nccl: no communicator");
  Clique* c = rank->clique;
  {
    std::lock_guard<std::mutex> lock(c->mu);
    c->aborted = true;
  }
  c->cv.notify_all();
  std::lock_guard<std::mutex> lock(mu_);
  ++aborts_;
  return Status::Ok();
}

Status SimComm::Destroy(gpu::Comm comm, double) {
  Rank* rank = static_cast<Rank*>(comm);
  if (!rank) return Status::Internal("sim nccl: no communicator");
  Clique* c = rank->clique;
  {
    std::lock_guard<std::mutex> lock(c->mu);
    if (rank->destroyed) {
      device_.Error("sim nccl: a communicator destroyed twice");
      return Status::Internal("sim nccl: a communicator destroyed twice");
    }
    rank->destroyed = true;
    for (const auto& [seq, slot] : c->slots)
      if (!slot.done && !c->aborted)
        device_.Error("sim nccl: a communicator destroyed with collective " + std::to_string(seq) + " unfinished");
    for (const auto& [key, m] : c->messages)
      if (m.posted != m.consumed && !c->aborted) device_.Error("sim nccl: a communicator destroyed with a message in flight");
  }
  std::lock_guard<std::mutex> lock(mu_);
  ++destroys_;
  return Status::Ok();
}

int SimComm::destroys() const {
  std::lock_guard<std::mutex> lock(mu_);
  return destroys_;
}

int SimComm::live() const {
  std::lock_guard<std::mutex> lock(mu_);
  int n = 0;
  for (const auto& r : ranks_) {
    std::lock_guard<std::mutex> cl(r->clique->mu);
    n += !r->destroyed && !r->clique->aborted;
  }
  return n;
}

int SimComm::aborts() const {
  std::lock_guard<std::mutex> lock(mu_);
  return aborts_;
}

}  // namespace flexlink::sim
