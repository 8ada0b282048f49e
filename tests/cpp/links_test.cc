// Link tests: std::threads stand in for devices and drive the real Communicator / CallContext. The tcp
// link must give results bitwise equal to shm's (the reference engine_test checks) for every kind,
// dtype, op, group size and sub-range; its handshake must drop strangers; a silent peer must give a
// deadline error naming it; the emulated link must pace to its formula. Plain C++: prints
// "N passed, N failed" and exits non-zero on any failure. `links_test --bench` prints throughput.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <sys/socket.h>
#include <unistd.h>

#include "xla_ffi/core/communicator.h"
#include "xla_ffi/core/config.h"
#include "xla_ffi/links/emulated.h"
#include "xla_ffi/links/shm.h"
#include "xla_ffi/links/socket.h"
#include "xla_ffi/links/tcp.h"
#include "xla_ffi/plan/link_spec.h"
#include "tests/cpp/check.h"
#include "tests/cpp/reference.h"

using namespace flexlink;
using namespace flexlink::testing;
using Clock = std::chrono::steady_clock;

namespace {

// A communicator of n ranks with the given links' channels (channel i is lane i).
std::unique_ptr<Communicator> MakeComm(int n, const std::vector<Link*>& links) {
  std::vector<int64_t> devices;
  for (int i = 0; i < n; ++i) devices.push_back(100 + i);
  auto comm = std::make_unique<Communicator>(devices);
  for (Link* l : links) comm->AddChannel(l->Open(devices));
  return comm;
}

// A range of part 0 on a channel.
struct Step {
  size_t channel;
  UnitRange range;
};

// One call: every rank arrives, then runs `pieces` in order, each on its channel; `concurrent`: each
// piece on its own thread at once, as the multi-path executor does (pieces on distinct channels).
std::vector<Status> RunCall(Communicator& comm, const std::vector<CallDesc>& descs,
                            const std::vector<Step>& pieces, std::vector<double>* seconds = nullptr,
                            bool concurrent = false) {
  const int n = comm.size();
  const int64_t run = NextRunId();
  std::vector<Status> st(n);
  if (seconds) seconds->assign(n, 0);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      auto call = comm.Join(r, run, "links_test");
      Status s = call->Arrive(r, descs[r], "test");
      const auto t0 = Clock::now();
      if (concurrent && s.ok()) {
        std::vector<Status> ps(pieces.size());
        std::vector<std::thread> workers;
        for (size_t i = 0; i < pieces.size(); ++i)
          workers.emplace_back([&, i] {
            const Piece piece{0, pieces[i].range};
            ps[i] = comm.channel(pieces[i].channel).Run(*call, r, static_cast<int>(pieces[i].channel), {&piece, 1});
          });
        for (auto& w : workers) w.join();
        for (const Status& p : ps)
          if (!p.ok()) s = p;
      }
      for (size_t i = 0; i < pieces.size() && !concurrent; ++i) {
        if (!s.ok()) break;
        const Piece piece{0, pieces[i].range};
        s = comm.channel(pieces[i].channel).Run(*call, r, static_cast<int>(pieces[i].channel), {&piece, 1});
      }
      if (seconds) (*seconds)[r] = std::chrono::duration<double>(Clock::now() - t0).count();
      st[r] = s;
    });
  for (auto& t : threads) t.join();
  return st;
}

struct Case {
  Kind kind;
  DType dtype;
  ReduceOp op;
  size_t outer, inner;
  bool in_place = false;
  std::vector<std::pair<int, int>> pairs = {};  // ppermute: (source, destination)
};

// ppermute's per-destination source table for n ranks.
std::vector<int32_t> Sources(const std::vector<std::pair<int, int>>& pairs, int n) {
  std::vector<int32_t> s(n, -1);
  for (const auto& [src, dst] : pairs) s[dst] = src;
  return s;
}

size_t InCount(Kind kind, size_t units, int n) {
  return kind == Kind::kReduceScatter || kind == Kind::kAllToAll ? units * n : units;
}
size_t OutCount(Kind kind, size_t units, int n) {
  return kind == Kind::kAllGather || kind == Kind::kAllToAll ? units * n : units;
}

std::string Describe(const Case& c, int n) {
  std::string s = std::string(Name(c.kind)) + "(" + std::string(Name(c.op)) + ") " + std::string(Name(c.dtype)) +
                  " [" + std::to_string(c.outer) + "x" + std::to_string(c.inner) + "] n=" + std::to_string(n) +
                  (c.in_place ? " in-place" : "");
  for (const auto& [a, b] : c.pairs) s += " " + std::to_string(a) + "->" + std::to_string(b);
  return s;
}

// Runs `c` with `pieces` on `comm`; returns every rank's output.
std::vector<std::vector<uint8_t>> RunCase(Communicator& comm, const Case& c, const std::vector<Step>& pieces,
                                          std::vector<Status>* st, bool concurrent = false,
                                          std::vector<std::vector<uint8_t>>* inputs = nullptr) {
  const int n = comm.size();
  const size_t w = ByteWidth(c.dtype), units = c.outer * c.inner;
  const size_t in_count = InCount(c.kind, units, n), out_count = OutCount(c.kind, units, n);
  const bool nan = c.op == ReduceOp::kMax || c.op == ReduceOp::kMin;
  std::vector<std::vector<uint8_t>> ins(n), outs(n);
  std::vector<CallDesc> descs(n);
  for (int r = 0; r < n; ++r) {
    ins[r] = RandomData(c.dtype, in_count, static_cast<uint32_t>(r * 7919 + units), nan);
    outs[r].assign(out_count * w, 0xAB);
    CallDesc& d = descs[r];
    d.kind = c.kind, d.op = c.op;
    Part p;
    p.dtype = c.dtype, p.units = units;
    p.outer = c.kind == Kind::kAllReduce ? 1 : c.outer;
    p.inner = c.kind == Kind::kAllReduce ? units : c.inner;
    p.in = ins[r].data();
    p.out = c.in_place ? ins[r].data() : outs[r].data();
    d.AddPart(p);
    if (c.kind == Kind::kPpermute) d.sources = Sources(c.pairs, n);
  }
  if (inputs) *inputs = ins;  // before the call: in place overwrites them
  *st = RunCall(comm, descs, pieces, nullptr, concurrent);
  return c.in_place ? ins : outs;
}

// tcp alone, tcp / shm / tcp on uneven sub-ranges (ending mid-row and mid-cache-line) one after the
// other, and shm / tcp at once on two threads per rank, against shm alone. Channel 0 is shm, 1 tcp.
void CheckTcpMatchesShm(Communicator& comm, const Case& c) {
  const size_t units = c.outer * c.inner;
  const size_t a = std::min(units, units / 3 + 1), b = std::max(a, std::min(units, 2 * units / 3 + 3));
  std::vector<Status> st_ref, st_tcp, st_mix;
  std::vector<std::vector<uint8_t>> inputs;
  auto ref = RunCase(comm, c, {{0, {0, units}}}, &st_ref, false, &inputs);
  auto tcp = RunCase(comm, c, {{1, {0, units}}}, &st_tcp);
  auto mix = RunCase(comm, c, {{1, {0, a}}, {0, {a, b}}, {1, {b, units}}}, &st_mix);
  std::vector<Status> st_par;
  auto par = RunCase(comm, c, {{0, {0, b}}, {1, {b, units}}}, &st_par, /*concurrent=*/true);
  std::string why;
  for (int r = 0; r < comm.size() && why.empty(); ++r) {
    if (!st_ref[r].ok()) why = "shm: " + st_ref[r].message();
    else if (!st_tcp[r].ok()) why = "tcp: " + st_tcp[r].message();
    else if (!st_mix[r].ok()) why = "mixed: " + st_mix[r].message();
    else if (tcp[r] != ref[r]) why = "tcp differs from shm at rank " + std::to_string(r);
    else if (mix[r] != ref[r]) why = "tcp+shm ranges differ from shm at rank " + std::to_string(r);
    else if (!st_par[r].ok()) why = "concurrent: " + st_par[r].message();
    else if (par[r] != ref[r]) why = "concurrent shm+tcp differ from shm at rank " + std::to_string(r);
  }
  // The kinds that only move bytes: against reference.h as well (the others: engine_test).
  const int n = comm.size();
  std::vector<const uint8_t*> srcs;
  for (const auto& in : inputs) srcs.push_back(in.data());
  for (int r = 0; r < n && why.empty(); ++r) {
    const size_t w = ByteWidth(c.dtype), count = InCount(c.kind, units, n);
    std::vector<std::pair<int64_t, int64_t>> pairs(c.pairs.begin(), c.pairs.end());
    if (c.kind == Kind::kPpermute && tcp[r] != RefPpermute(pairs, srcs, count * w, r))
      why = "tcp differs from the reference at rank " + std::to_string(r);
    const std::vector<int64_t> dims = {static_cast<int64_t>(c.outer), static_cast<int64_t>(n * c.inner)};
    if (c.kind == Kind::kAllToAll && tcp[r] != RefAllToAll(dims, 1, srcs, w, r))
      why = "tcp differs from the reference at rank " + std::to_string(r);
  }
  Expect(why.empty(), Describe(c, comm.size()) + ": " + why);
}

void TestTcpEqualsShm(Link& shm, Link& tcp) {
  const std::vector<std::pair<DType, ReduceOp>> reductions = {
      {DType::kF32, ReduceOp::kSum},  {DType::kF32, ReduceOp::kProd}, {DType::kF32, ReduceOp::kMax},
      {DType::kBF16, ReduceOp::kSum}, {DType::kF16, ReduceOp::kSum},  {DType::kF16, ReduceOp::kMin},
      {DType::kF64, ReduceOp::kSum},  {DType::kS32, ReduceOp::kSum},  {DType::kS32, ReduceOp::kProd},
      {DType::kU8, ReduceOp::kSum},   {DType::kU8, ReduceOp::kMax},   {DType::kPred, ReduceOp::kMax},
      {DType::kPred, ReduceOp::kMin}, {DType::kC64, ReduceOp::kSum}};
  for (int n : {2, 3, 8}) {
    auto comm = MakeComm(n, {&shm, &tcp});
    Expect(static_cast<TcpChannel&>(comm->channel(1)).health().ok(), "tcp ring of " + std::to_string(n));
    for (const auto& [t, op] : reductions) {
      // One row of odd length for all_reduce; rows for the others (short and long).
      CheckTcpMatchesShm(*comm, {Kind::kAllReduce, t, op, 1, n == 8 ? 70001u : 1237u});
      CheckTcpMatchesShm(*comm, {Kind::kReduceScatter, t, op, 3, 333});
      CheckTcpMatchesShm(*comm, {Kind::kReduceScatter, t, op, 1, 5003});
    }
    for (DType t : {DType::kF32, DType::kBF16, DType::kU8, DType::kC64}) {
      CheckTcpMatchesShm(*comm, {Kind::kAllGather, t, ReduceOp::kSum, 1, 5003});
      CheckTcpMatchesShm(*comm, {Kind::kAllGather, t, ReduceOp::kSum, 7, 131});
    }
    CheckTcpMatchesShm(*comm, {Kind::kAllReduce, DType::kF32, ReduceOp::kSum, 1, 1});
    CheckTcpMatchesShm(*comm, {Kind::kAllReduce, DType::kF32, ReduceOp::kSum, 1, 100003, true});
    CheckTcpMatchesShm(*comm, {Kind::kAllReduce, DType::kBF16, ReduceOp::kSum, 1, 100003, true});
  }
  // Many pipeline chunks on a big group.
  auto comm = MakeComm(8, {&shm, &tcp});
  CheckTcpMatchesShm(*comm, {Kind::kAllReduce, DType::kF32, ReduceOp::kSum, 1, 1 << 19});
  CheckTcpMatchesShm(*comm, {Kind::kAllGather, DType::kF32, ReduceOp::kSum, 1, 200001});
  CheckTcpMatchesShm(*comm, {Kind::kReduceScatter, DType::kF16, ReduceOp::kSum, 1, 200001});
}

// The handshake: a stranger with a wrong token and a silent one are dropped; the right one is taken.
void TestHandshake() {
  int lfd = -1;
  uint16_t port = 0;
  Expect(net::Listen(&lfd, &port).ok(), "listen");
  const std::vector<uint8_t> good(24, 7);
  std::vector<uint8_t> bad = good;
  bad[3] ^= 1;
  const auto deadline = net::DeadlineIn(5);
  int bad_fd = -1, silent_fd = -1, good_fd = -1, accepted = -1, rejected = 0;
  Expect(net::ConnectHello(port, bad, deadline, &bad_fd).ok(), "connect stranger");
  Expect(net::ConnectHello(port, {}, deadline, &silent_fd).ok(), "connect silent stranger");
  Expect(net::ConnectHello(port, good, deadline, &good_fd).ok(), "connect peer");
  Status s = net::AcceptHello(lfd, good, deadline, &accepted, &rejected);
  Expect(s.ok() && accepted >= 0, "accept with token: " + s.message());
  Expect(rejected == 2, "strangers dropped: " + std::to_string(rejected));
  // The accepted socket is the peer's: a byte sent on it reaches good_fd.
  const char x = 'x';
  char y = 0;
  Expect(send(accepted, &x, 1, MSG_NOSIGNAL) == 1, "send on accepted");
  const Status got = [&] {
    for (int i = 0; i < 500; ++i) {
      if (recv(good_fd, &y, 1, MSG_DONTWAIT) == 1) return Status::Ok();
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    return Status::Internal("nothing");
  }();
  Expect(got.ok() && y == 'x', "accepted socket is the peer's");
  char z;
  ssize_t eof = -1;
  for (int i = 0; i < 500 && eof < 0; ++i) {
    eof = recv(bad_fd, &z, 1, MSG_DONTWAIT);
    if (eof < 0) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  Expect(eof == 0, "stranger sees its connection closed");
  // Nothing but strangers: the deadline ends the accept.
  int lone = -1;
  Expect(net::ConnectHello(port, bad, deadline, &lone).ok(), "connect stranger 2");
  s = net::AcceptHello(lfd, good, net::DeadlineIn(0.2), &accepted, &rejected);
  Expect(s.code() == StatusCode::kDeadlineExceeded, "accept deadline: " + s.message());
  for (int fd : {lfd, bad_fd, silent_fd, good_fd, lone}) close(fd);
}

// A rank that arrives but never runs its range: its neighbour's wait ends at the deadline with an
// error naming it; the channel is then broken until the next call connects it again.
void TestSilentPeer(Link& tcp) {
  const double saved = TimeoutSeconds();
  SetTimeoutSeconds(0.5);
  auto comm = MakeComm(3, {&tcp});
  std::vector<float> in(3 * 1000, 1.f), out(3 * 1000);
  std::vector<CallDesc> descs(3);
  for (int r = 0; r < 3; ++r) {
    Part p;
    p.units = p.inner = 1000;
    p.in = in.data() + r * 1000;
    p.out = out.data() + r * 1000;
    descs[r].AddPart(p);
  }
  const int64_t run = NextRunId();
  std::vector<Status> st(3);
  std::vector<std::thread> threads;
  const auto t0 = Clock::now();
  for (int r = 0; r < 3; ++r)
    threads.emplace_back([&, r] {
      auto call = comm->Join(r, run, "links_test");
      st[r] = call->Arrive(r, descs[r], "test");
      const Piece piece{0, {0, 1000}};
      if (st[r].ok() && r != 2) st[r] = comm->channel(0).Run(*call, r, 0, {&piece, 1});
    });
  for (auto& t : threads) t.join();
  const double took = std::chrono::duration<double>(Clock::now() - t0).count();
  const std::string& m = st[0].message();
  std::printf("silent peer: %s\n", m.c_str());
  Expect(st[0].code() == StatusCode::kDeadlineExceeded && m.find(": rank 2 (device 102) did not start") != std::string::npos &&
             m.find("link tcp") != std::string::npos && m.find("[100, 101, 102]") != std::string::npos,
         "silent peer named: " + m);
  Expect(!st[1].ok(), "rank 1 fails too: " + st[1].message());
  Expect(took < 3, "deadline honoured: " + std::to_string(took) + " s");
  // Broken; the next call that gives the ring a range (in the engine: the health probe) connects
  // it anew, and it runs exactly.
  auto& ring = static_cast<TcpChannel&>(comm->channel(0));
  Expect(!ring.health().ok() && ring.reconnects() == 0, "the ring is broken after the silent peer");
  std::fill(out.begin(), out.end(), 0.f);
  auto st2 = RunCall(*comm, descs, {{0, {0, 1000}}});
  Expect(st2[0].ok() && st2[1].ok() && st2[2].ok() && ring.reconnects() == 1 && ring.health().ok(),
         "the next call reconnects the ring: " + st2[0].message() + " " + st2[1].message() + " " + st2[2].message());
  Expect(std::all_of(out.begin(), out.end(), [](float x) { return x == 3.f; }), "and its sums are exact");
  SetTimeoutSeconds(saved);
}

// The same for a ppermute on a fresh ring: the rank waiting for the silent one's message names it,
// the collective and the link.
void TestSilentPeerPpermute(Link& tcp) {
  const double saved = TimeoutSeconds();
  SetTimeoutSeconds(0.5);
  auto comm = MakeComm(3, {&tcp});
  std::vector<float> in(3 * 1000, 1.f), out(3 * 1000);
  std::vector<CallDesc> descs(3);
  for (int r = 0; r < 3; ++r) {
    descs[r].kind = Kind::kPpermute;
    descs[r].sources = {2, 0, 1};  // a shift by one: 0 -> 1 -> 2 -> 0
    Part p;
    p.units = p.inner = 1000;
    p.in = in.data() + r * 1000;
    p.out = out.data() + r * 1000;
    descs[r].AddPart(p);
  }
  const int64_t run = NextRunId();
  std::vector<Status> st(3);
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r)
    threads.emplace_back([&, r] {
      auto call = comm->Join(r, run, "links_test");
      st[r] = call->Arrive(r, descs[r], "test");
      const Piece piece{0, {0, 1000}};
      if (st[r].ok() && r != 2) st[r] = comm->channel(0).Run(*call, r, 0, {&piece, 1});
    });
  for (auto& t : threads) t.join();
  const std::string& m = st[0].message();
  Expect(st[0].code() == StatusCode::kDeadlineExceeded && m.find("ppermute(0->1, 1->2, 2->0)") != std::string::npos &&
             m.find("rank 2 (device 102) did not start") != std::string::npos && m.find("link tcp") != std::string::npos,
         "silent peer of a ppermute named: " + m);
  SetTimeoutSeconds(saved);
}

// The fastest of `reps` calls, each timed by its slowest rank. Pacing only adds time, and so does a
// neighbour on two cores (Bazel runs another test beside this one: a median of 5 once read 7.59 ms
// against the formula's 6.59), so the least disturbed call is the one to hold to the formula; a link
// that paces too fast still reads below it.
double TimeCall(Communicator& comm, const std::vector<CallDesc>& descs, size_t units, int reps) {
  double best = std::numeric_limits<double>::infinity();
  for (int i = 0; i < reps; ++i) {
    std::vector<double> s;
    RunCall(comm, descs, {{0, {0, units}}}, &s);
    best = std::min(best, *std::max_element(s.begin(), s.end()));
  }
  return best;
}

std::vector<CallDesc> Descs(Kind kind, int n, size_t units, std::vector<std::vector<float>>& bufs) {
  std::vector<CallDesc> d(n);
  bufs.assign(2 * n, {});
  for (int r = 0; r < n; ++r) {
    bufs[2 * r].assign(kind == Kind::kReduceScatter ? units * n : units, 1.f);
    bufs[2 * r + 1].assign(kind == Kind::kAllGather ? units * n : units, 0.f);
    d[r].kind = kind;
    Part p;
    p.units = p.inner = units;
    p.in = bufs[2 * r].data();
    p.out = bufs[2 * r + 1].data();
    d[r].AddPart(p);
  }
  return d;
}

void TestEmulatedPacing() {
  const int n = 8;
  EmulatedLink emu("slow", std::make_unique<ShmLink>(), 0.2, 500);
  auto comm = MakeComm(n, {&emu});
  std::vector<std::vector<float>> bufs;
  struct P { Kind kind; size_t units; double gbps, lat_us; };
  for (const P& p : {P{Kind::kAllReduce, 256 << 10, 0.2, 500}, P{Kind::kAllReduce, 64 << 10, 0.1, 2000},
                     P{Kind::kAllGather, 32 << 10, 0.15, 200}, P{Kind::kReduceScatter, 32 << 10, 0.3, 1000}}) {
    emu.SetRate(p.gbps, p.lat_us);
    auto descs = Descs(p.kind, n, p.units, bufs);
    const double bytes = p.units * 4.0 * (p.kind == Kind::kAllReduce ? 1 : n);
    const double f = p.kind == Kind::kAllReduce ? 2.0 * (n - 1) / n : (n - 1.0) / n;
    const double want = p.lat_us * 1e-6 + bytes * f / (p.gbps * 1e9);
    const double got = TimeCall(*comm, descs, p.units, 5);
    char b[160];
    std::snprintf(b, sizeof b, "emulated %s %zu units @%.2f GB/s +%.0f us: %.2f ms, formula %.2f ms",
                  std::string(Name(p.kind)).c_str(), p.units, p.gbps, p.lat_us, got * 1e3, want * 1e3);
    std::printf("%s\n", b);
    Expect(std::fabs(got / want - 1) <= 0.15, b);
  }
  // The setter mid-run: a quarter of the rate takes four times as long (no latency).
  emu.SetRate(0.2, 0);
  auto descs = Descs(Kind::kAllReduce, n, 64 << 10, bufs);
  const double fast = TimeCall(*comm, descs, 64 << 10, 5);
  emu.SetRate(0.05, 0);
  const double slow = TimeCall(*comm, descs, 64 << 10, 5);
  Expect(std::fabs(slow / fast / 4 - 1) <= 0.15,
         "SetRate 0.2 -> 0.05 GB/s: " + std::to_string(fast * 1e3) + " -> " + std::to_string(slow * 1e3) + " ms");
  // Spec parsing (one spec per parse: names in one list must be unique).
  std::vector<plan::LinkSpec> specs;
  for (const char* text : {"emulated:nv@gbps=2,latency_us=5,base=tcp", "tcp:t2", "emulated@gbps=1",
                           "emulated@gbps=1,base=x", "emulated@latency_us=1", "tcp@x=1"}) {
    std::vector<plan::LinkSpec> one;
    const Status s = plan::ParseLinkSpecs(text, {}, &one);
    Expect(s.ok() && one.size() == 1, std::string("parse ") + text + ": " + s.message());
    specs.push_back(one.empty() ? plan::LinkSpec{} : one[0]);
  }
  std::unique_ptr<Link> l;
  Expect(EmulatedLink::FromSpec(specs[0], &l).ok() && l->name() == "nv" &&
             static_cast<EmulatedLink&>(*l).gbps() == 2 && static_cast<EmulatedLink&>(*l).latency_us() == 5,
         "emulated from spec");
  Expect(TcpLink::FromSpec(specs[1], &l).ok() && l->name() == "t2", "tcp from spec");
  Expect(EmulatedLink::FromSpec(specs[2], &l).ok() && l->name() == "emulated", "emulated default name");
  Status s = EmulatedLink::FromSpec(specs[3], &l);
  Expect(!s.ok() && s.message().find("base=\"x\"") != std::string::npos, "bad base: " + s.message());
  s = EmulatedLink::FromSpec(specs[4], &l);
  Expect(!s.ok() && s.message().find("gbps") != std::string::npos, "missing gbps: " + s.message());
  Expect(!TcpLink::FromSpec(specs[5], &l).ok(), "tcp rejects params");
}

void Bench(Link& shm, Link& tcp) {
  const int n = 8;
  auto comm = MakeComm(n, {&shm, &tcp});
  std::vector<std::vector<float>> bufs;
  for (Kind kind : {Kind::kAllReduce, Kind::kAllGather, Kind::kReduceScatter})
    for (size_t bytes : {size_t{64} << 10, size_t{1} << 20, size_t{16} << 20}) {
      const size_t units = bytes / 4 / (kind == Kind::kAllReduce ? 1 : n);
      auto descs = Descs(kind, n, units, bufs);
      const double f = kind == Kind::kAllReduce ? 2.0 * (n - 1) / n : (n - 1.0) / n;
      for (size_t ch : {0, 1}) {
        std::vector<double> t;
        for (int i = 0; i < 5; ++i) {
          std::vector<double> s;
          RunCall(*comm, descs, {{ch, {0, units}}}, &s);
          t.push_back(*std::max_element(s.begin(), s.end()));
        }
        std::sort(t.begin(), t.end());
        std::printf("%-15s %s %6zu KiB (algbw bytes): %8.3f ms  busbw %6.2f GB/s\n", std::string(Name(kind)).c_str(),
                    ch ? "tcp" : "shm", bytes >> 10, t[2] * 1e3, bytes * f / t[2] / 1e9);
      }
    }
}

// ---- k-part calls: one arrival, pieces cut over the virtual space of all parts.

struct PartShape {
  DType dtype;
  size_t outer, inner;
};

struct MultiCase {
  Kind kind;
  ReduceOp op;
  std::vector<PartShape> parts;
  std::vector<std::pair<int, int>> pairs = {};  // ppermute
  uint32_t in_place = 0;                        // bit i: part i's output is its input
};

// A range of the call's virtual bytes on a channel.
struct VStep {
  size_t channel;
  UnitRange bytes;
};

// Runs `c` with every rank running `steps` (in order, or each on its own thread at once when
// `concurrent`); returns out[rank][part].
std::vector<std::vector<std::vector<uint8_t>>> RunMultiCase(Communicator& comm, const MultiCase& c,
                                                            const std::vector<VStep>& steps,
                                                            std::vector<Status>* st, bool concurrent) {
  const int n = comm.size();
  const bool nan = c.op == ReduceOp::kMax || c.op == ReduceOp::kMin;
  std::vector<std::vector<std::vector<uint8_t>>> ins(n), outs(n);
  std::vector<CallDesc> descs(n);
  for (int r = 0; r < n; ++r) {
    descs[r].kind = c.kind;
    descs[r].op = c.op;
    ins[r].resize(c.parts.size());
    outs[r].resize(c.parts.size());
    for (size_t i = 0; i < c.parts.size(); ++i) {
      const PartShape& ps = c.parts[i];
      Part p;
      p.dtype = ps.dtype;
      p.units = ps.outer * ps.inner;
      p.outer = c.kind == Kind::kAllReduce ? 1 : ps.outer;
      p.inner = c.kind == Kind::kAllReduce ? p.units : ps.inner;
      const size_t in_count = InCount(c.kind, p.units, n), out_count = OutCount(c.kind, p.units, n);
      ins[r][i] = RandomData(ps.dtype, in_count, static_cast<uint32_t>(r * 7919 + i * 31 + p.units), nan);
      outs[r][i].assign(out_count * ByteWidth(ps.dtype), 0xAB);
      p.in = ins[r][i].data();
      p.out = c.in_place >> i & 1 ? ins[r][i].data() : outs[r][i].data();
      descs[r].AddPart(p);
    }
    if (c.kind == Kind::kPpermute) descs[r].sources = Sources(c.pairs, n);
  }
  const int64_t run = NextRunId();
  st->assign(n, Status());
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      auto call = comm.Join(r, run, "links_test");
      Status s = call->Arrive(r, descs[r], "test");
      std::vector<std::vector<Piece>> pieces(steps.size());
      for (size_t i = 0; i < steps.size(); ++i) descs[r].PiecesOf(steps[i].bytes, &pieces[i]);
      auto run_step = [&](size_t i) {
        return comm.channel(steps[i].channel).Run(*call, r, static_cast<int>(steps[i].channel), pieces[i]);
      };
      if (concurrent && s.ok()) {
        std::vector<Status> ps(steps.size());
        std::vector<std::thread> workers;
        for (size_t i = 0; i < steps.size(); ++i) workers.emplace_back([&, i] { ps[i] = run_step(i); });
        for (auto& w : workers) w.join();
        for (const Status& p : ps)
          if (!p.ok()) s = p;
      }
      for (size_t i = 0; i < steps.size() && !concurrent && s.ok(); ++i) s = run_step(i);
      (*st)[r] = s;
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r)
    for (size_t i = 0; i < c.parts.size(); ++i)
      if (c.in_place >> i & 1) outs[r][i] = ins[r][i];
  return outs;
}

std::string Describe(const MultiCase& c, int n) {
  std::string s = std::string(Name(c.kind)) + "(" + std::string(Name(c.op)) + ") of " +
                  std::to_string(c.parts.size()) + " parts n=" + std::to_string(n) + ":";
  for (size_t i = 0; i < c.parts.size(); ++i) {
    const PartShape& p = c.parts[i];
    s += " " + std::string(Name(p.dtype)) + "[" + std::to_string(p.outer) + "x" + std::to_string(p.inner) + "]";
    if (c.in_place >> i & 1) s += " in place";
  }
  return s;
}

// tcp alone, tcp/shm/tcp over virtual ranges whose boundaries fall inside parts (one of them not on a
// 64-byte multiple), and shm + tcp at once, against shm alone. Channel 0 is shm, 1 tcp.
void CheckMultiTcpMatchesShm(Communicator& comm, const MultiCase& c) {
  CallDesc probe;
  probe.kind = c.kind;
  for (const PartShape& ps : c.parts) {
    Part p;
    p.dtype = ps.dtype;
    p.units = ps.outer * ps.inner;
    probe.AddPart(p);
  }
  const uint64_t total = probe.virtual_bytes();
  const uint64_t a = total / 3 / 64 * 64 + 64, b = std::max<uint64_t>(a, 2 * total / 3 + 13);
  std::vector<Status> st_ref, st_tcp, st_mix, st_par, st_sep;
  auto ref = RunMultiCase(comm, c, {{0, {0, total}}}, &st_ref, false);
  // In place: bitwise the result of the same call with separate outputs (on shm).
  MultiCase separate = c;
  separate.in_place = 0;
  auto sep = c.in_place ? RunMultiCase(comm, separate, {{0, {0, total}}}, &st_sep, false) : ref;
  auto tcp = RunMultiCase(comm, c, {{1, {0, total}}}, &st_tcp, false);
  auto mix = RunMultiCase(comm, c, {{1, {0, a}}, {0, {a, b}}, {1, {b, total}}}, &st_mix, false);
  auto par = RunMultiCase(comm, c, {{0, {0, a}}, {1, {a, total}}}, &st_par, true);
  std::string why;
  for (int r = 0; r < comm.size() && why.empty(); ++r) {
    if (!st_ref[r].ok()) why = "shm: " + st_ref[r].message();
    else if (!st_tcp[r].ok()) why = "tcp: " + st_tcp[r].message();
    else if (!st_mix[r].ok()) why = "mixed: " + st_mix[r].message();
    else if (!st_par[r].ok()) why = "concurrent: " + st_par[r].message();
    for (size_t i = 0; i < c.parts.size() && why.empty(); ++i) {
      const std::string at = " at rank " + std::to_string(r) + " part " + std::to_string(i);
      if (ref[r][i] == std::vector<uint8_t>(ref[r][i].size(), 0xAB) && !ref[r][i].empty()) why = "shm wrote nothing" + at;
      else if (c.in_place && !st_sep[r].ok()) why = "shm, separate outputs: " + st_sep[r].message();
      else if (sep[r][i] != ref[r][i]) why = "shm in place differs from shm with separate outputs" + at;
      else if (tcp[r][i] != ref[r][i]) why = "tcp differs from shm" + at;
      else if (mix[r][i] != ref[r][i]) why = "tcp+shm ranges differ from shm" + at;
      else if (par[r][i] != ref[r][i]) why = "concurrent shm+tcp differ from shm" + at;
    }
  }
  Expect(why.empty(), Describe(c, comm.size()) + ": " + why);
}

void TestMultiPartTcpEqualsShm(Link& shm, Link& tcp) {
  for (int n : {2, 3, 8}) {
    auto comm = MakeComm(n, {&shm, &tcp});
    const std::vector<PartShape> leaves = {{DType::kF32, 1, 3001}, {DType::kBF16, 1, 7}, {DType::kS32, 1, 1},
                                           {DType::kF16, 1, 70001}, {DType::kU8, 1, 129}, {DType::kC64, 1, 33}};
    CheckMultiTcpMatchesShm(*comm, {Kind::kAllReduce, ReduceOp::kSum, leaves});
    CheckMultiTcpMatchesShm(*comm, {Kind::kAllReduce, ReduceOp::kMax,
                                    {{DType::kF32, 1, 1237}, {DType::kF64, 1, 5}, {DType::kBF16, 1, 20001}}});
    const std::vector<PartShape> rows = {{DType::kF32, 3, 333}, {DType::kBF16, 7, 3}, {DType::kS32, 1, 5003},
                                         {DType::kU8, 2, 1}, {DType::kF16, 5, 1001}};
    CheckMultiTcpMatchesShm(*comm, {Kind::kAllGather, ReduceOp::kSum, rows});
    CheckMultiTcpMatchesShm(*comm, {Kind::kReduceScatter, ReduceOp::kSum, rows});
    CheckMultiTcpMatchesShm(*comm, {Kind::kReduceScatter, ReduceOp::kMin, rows});
  }
}

// ppermute and all_to_all: messages routed along the ring (forwarded by the ranks in between),
// against shm and the reference, for pair sets whose messages travel 0, 1 and n-1 hops.
void TestExchangeTcpEqualsShm(Link& shm, Link& tcp) {
  for (int n : {2, 3, 8}) {
    auto comm = MakeComm(n, {&shm, &tcp});
    std::vector<std::vector<std::pair<int, int>>> sets = {{}, {{0, 1}, {1, 0}}, {{n - 1, 0}}};
    std::vector<std::pair<int, int>> up, down, identity, partial;
    for (int r = 0; r < n; ++r) {
      up.push_back({r, (r + 1) % n});
      down.push_back({r, (r + n - 1) % n});
      identity.push_back({r, r});
    }
    partial = {{0, n - 1}, {n - 1, n / 2}};
    if (n > 2) partial.push_back({1, 1});
    for (const auto& p : {up, down, identity, partial}) sets.push_back(p);
    for (const auto& pairs : sets)
      for (DType t : {DType::kF32, DType::kBF16, DType::kU8, DType::kC128})
        for (bool in_place : {false, true}) {
          CheckTcpMatchesShm(*comm, {Kind::kPpermute, t, ReduceOp::kSum, 1, 1237, in_place, pairs});
          if (t == DType::kF32 || in_place)
            CheckTcpMatchesShm(*comm, {Kind::kPpermute, t, ReduceOp::kSum, 1, 200003, in_place, pairs});
        }
    // In place, all_to_all: one row per block, rows, one-element rows, many chunks.
    for (DType t : {DType::kF32, DType::kBF16, DType::kU8, DType::kC128, DType::kPred}) {
      CheckTcpMatchesShm(*comm, {Kind::kAllToAll, t, ReduceOp::kSum, 1, 5003, true});
      CheckTcpMatchesShm(*comm, {Kind::kAllToAll, t, ReduceOp::kSum, 7, 131, true});
      CheckTcpMatchesShm(*comm, {Kind::kAllToAll, t, ReduceOp::kSum, 1000, 1, true});
      CheckTcpMatchesShm(*comm, {Kind::kAllToAll, t, ReduceOp::kSum, 3, 30011, true});
    }
    for (DType t : {DType::kF32, DType::kBF16, DType::kU8, DType::kC128, DType::kPred}) {
      CheckTcpMatchesShm(*comm, {Kind::kAllToAll, t, ReduceOp::kSum, 1, 5003});  // one row per block
      CheckTcpMatchesShm(*comm, {Kind::kAllToAll, t, ReduceOp::kSum, 7, 131});   // rows: packed on the wire
      CheckTcpMatchesShm(*comm, {Kind::kAllToAll, t, ReduceOp::kSum, 1000, 1});  // one-element rows
    }
    CheckTcpMatchesShm(*comm, {Kind::kAllToAll, DType::kF32, ReduceOp::kSum, 1, 70001});  // many chunks
    const std::vector<PartShape> parts = {{DType::kF32, 3, 333}, {DType::kBF16, 7, 3}, {DType::kS32, 1, 5003},
                                          {DType::kU8, 2, 1}, {DType::kF16, 5, 1001}};
    CheckMultiTcpMatchesShm(*comm, {Kind::kAllToAll, ReduceOp::kSum, parts});
    CheckMultiTcpMatchesShm(*comm, {Kind::kPpermute, ReduceOp::kSum,
                                    {{DType::kF32, 1, 3001}, {DType::kBF16, 1, 7}, {DType::kF16, 1, 70001}}, down});
    // In-place subsets (and all parts in place), boundaries inside parts.
    CheckMultiTcpMatchesShm(*comm, {Kind::kAllToAll, ReduceOp::kSum, parts, {}, 0b10101});
    CheckMultiTcpMatchesShm(*comm, {Kind::kAllToAll, ReduceOp::kSum,
                                    {{DType::kF32, 3, 40001}, {DType::kU16, 5, 1001}, {DType::kC64, 2, 20001}}, {}, 0b111});
    const std::vector<PartShape> leaves = {{DType::kF32, 1, 3001}, {DType::kBF16, 1, 7}, {DType::kF16, 1, 300001},
                                           {DType::kU8, 1, 129}, {DType::kF64, 1, 100003}};
    for (const auto& pairs : {up, down, partial})
      for (uint32_t mask : {0b10110u, 0b11111u})
        CheckMultiTcpMatchesShm(*comm, {Kind::kPpermute, ReduceOp::kSum, leaves, pairs, mask});
  }
}

// The emulated link paces the bytes of all pieces together.
void TestEmulatedMultiPart() {
  const int n = 8;
  EmulatedLink emu("slow", std::make_unique<ShmLink>(), 0.2, 300);
  auto comm = MakeComm(n, {&emu});
  std::vector<std::vector<float>> a, b;
  auto da = Descs(Kind::kAllReduce, n, 96 << 10, a), db = Descs(Kind::kAllReduce, n, 32 << 10, b);
  for (int r = 0; r < n; ++r) da[r].AddPart(db[r].parts[0]);  // two parts: 96 Ki and 32 Ki floats
  const double want = 300e-6 + (128 << 10) * 4.0 * 2 * (n - 1) / n / 0.2e9;
  std::vector<double> t;
  std::vector<Status> st(n);
  for (int i = 0; i < 5; ++i) {
    std::vector<double> sec(n);
    const int64_t run = NextRunId();
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r)
      threads.emplace_back([&, r] {
        auto call = comm->Join(r, run, "links_test");
        st[r] = comm->channel(0).RunAlone(*call, r, da[r]);
        // From the arrival, where the pace starts: thread start-up skew is not the link's.
        sec[r] = std::chrono::duration<double>(Clock::now() - call->ArrivedTime()).count();
      });
    for (auto& th : threads) th.join();
    t.push_back(*std::max_element(sec.begin(), sec.end()));
  }
  const double best = *std::min_element(t.begin(), t.end());  // the least disturbed call, as in TimeCall
  bool ok = true;
  for (int r = 0; r < n; ++r) ok &= st[r].ok() && a[2 * r + 1][0] == 8.f && b[2 * r + 1][0] == 8.f;
  Expect(ok, "emulated 2-part all_reduce: correct");
  char buf[160];
  std::snprintf(buf, sizeof buf, "emulated all_reduce of 2 parts (96 Ki + 32 Ki floats) @0.2 GB/s +300 us: %.2f ms, formula %.2f ms",
                best * 1e3, want * 1e3);
  std::printf("%s\n", buf);
  Expect(std::fabs(best / want - 1) <= 0.15, buf);
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  ShmLink shm;
  TcpLink tcp;
  if (argc > 1 && std::string(argv[1]) == "--bench") {
    Bench(shm, tcp);
    return 0;
  }
  const auto t0 = Clock::now();
  TestHandshake();
  TestTcpEqualsShm(shm, tcp);
  TestMultiPartTcpEqualsShm(shm, tcp);
  TestExchangeTcpEqualsShm(shm, tcp);
  TestSilentPeer(tcp);
  TestSilentPeerPpermute(tcp);
  TestEmulatedPacing();
  TestEmulatedMultiPart();
  std::printf("%d passed, %d failed (%.1f s)\n", g_passed, g_failed,
              std::chrono::duration<double>(Clock::now() - t0).count());
  return g_failed ? 1 : 0;
}
