// The tcp link across OS processes (xla_ffi/links/tcp_xproc.h): the test forks P processes, passes the
// ports of phase 1 through pipes (as the Python glue passes them through jax.distributed's store),
// connects with a random token and runs every kind through TcpChannel::RunPieces — whole calls, calls
// cut into virtual ranges (as the executor's split gives), a range alone, several operands — over
// several dtypes. Each child checks its ranks' outputs against an independent reference computed here
// (reference.h's arithmetic, unit by unit) and bitwise against the in-process tcp link run in the
// same child on threads. Also: strangers at a listener are refused and counted while the ring still
// forms; a wrong token fails the connection with a clear error and a broken channel; a peer that dies
// mid-call or never starts makes the others fail naming it, long before the deadline; every child is
// reaped. Plain C++: prints "N passed, N failed". `tcp_xproc_test --bench` prints all_reduce
// throughput of the cross-process ring (2 and 4 processes, 1/16/64 MiB per rank).
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "xla_ffi/core/call.h"
#include "xla_ffi/core/config.h"
#include "xla_ffi/core/reduce.h"
#include "xla_ffi/links/socket.h"
#include "xla_ffi/links/tcp.h"
#include "xla_ffi/links/tcp_xproc.h"
#include "tests/cpp/check.h"
#include "tests/cpp/reference.h"

using namespace flexlink;
using namespace flexlink::testing;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int64_t kDevice0 = 2048;  // global device ids 2048, 2049, ... (rank order)

double Since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// ---------------------------------------------------------------------------------------------
// Pipes between the parent and its children: whole writes, reads bounded by a deadline.

bool WriteAll(int fd, const void* p, size_t len) {
  const char* c = static_cast<const char*>(p);
  while (len > 0) {
    const ssize_t w = write(fd, c, len);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    c += w, len -= static_cast<size_t>(w);
  }
  return true;
}

bool ReadAll(int fd, void* p, size_t len, double seconds) {
  char* c = static_cast<char*>(p);
  const auto deadline = net::DeadlineIn(seconds);
  while (len > 0) {
    pollfd f{fd, POLLIN, 0};
    const int r = poll(&f, 1, net::PollMillis(deadline));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    const ssize_t got = read(fd, c, len);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    c += got, len -= static_cast<size_t>(got);
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// A child's view: its ranks, the group, the connected channel.

struct Child {
  int proc = 0, n = 0;
  std::vector<int> ranks;           // local ranks
  std::vector<int64_t> devices;     // all ranks' devices
  Status connect;                   // what Connect returned
  double connect_seconds = 0;
  int refused = 0;
  TcpChannel* channel = nullptr;
};

// Runs `f(rank)` for every local rank at once (one thread per rank beyond the first).
void ForLocal(const std::vector<int>& ranks, const std::function<void(int)>& f) {
  std::vector<std::thread> threads;
  for (size_t i = 1; i < ranks.size(); ++i) threads.emplace_back([&, i] { f(ranks[i]); });
  f(ranks[0]);
  for (auto& t : threads) t.join();
}

// ---------------------------------------------------------------------------------------------
// Cases: one call of one or more parts, run whole or as virtual ranges one after the other.

struct PartSpec {
  DType dtype;
  size_t outer, inner;  // all_reduce / ppermute: outer 1
};

struct XCase {
  Kind kind;
  ReduceOp op;
  std::vector<PartSpec> parts;
  std::vector<int32_t> sources;  // ppermute
  std::vector<double> cuts;      // virtual-space cut points in (0, 1); ranges between them run in turn
  bool only_middle = false;      // run only the middle range: the rest of the output stays untouched
  bool in_place = false;
};

std::string Describe(const XCase& c, int n) {
  std::string s = std::string(Name(c.kind)) + "(" + std::string(Name(c.op)) + ")";
  for (const PartSpec& p : c.parts)
    s += " " + std::string(Name(p.dtype)) + "[" + std::to_string(p.outer) + "x" + std::to_string(p.inner) + "]";
  s += " n=" + std::to_string(n);
  if (!c.cuts.empty()) s += c.only_middle ? " middle range only" : " in " + std::to_string(c.cuts.size() + 1) + " ranges";
  if (c.in_place) s += " in place";
  if (!c.sources.empty()) {
    s += " sources";
    for (int32_t v : c.sources) s += " " + std::to_string(v);
  }
  return s;
}

// Every rank's buffers of one case (inputs deterministic from the case and rank, so any process can
// build any rank's input).
struct Buffers {
  std::vector<std::vector<std::vector<uint8_t>>> in, out;  // [rank][part]
  std::vector<CallDesc> desc;                              // per rank
};

Buffers MakeBuffers(const XCase& c, int n, uint32_t seed) {
  Buffers b;
  b.in.resize(n), b.out.resize(n), b.desc.resize(n);
  const bool nan = c.op == ReduceOp::kMax || c.op == ReduceOp::kMin;
  for (int r = 0; r < n; ++r) {
    CallDesc& d = b.desc[r];
    d.kind = c.kind, d.op = c.op, d.sources = c.sources;
    for (size_t i = 0; i < c.parts.size(); ++i) {
      const PartSpec& ps = c.parts[i];
      const size_t units = ps.outer * ps.inner, w = ByteWidth(ps.dtype);
      const size_t in_units = c.kind == Kind::kReduceScatter || c.kind == Kind::kAllToAll ? units * n : units;
      const size_t out_units = c.kind == Kind::kAllGather || c.kind == Kind::kAllToAll ? units * n : units;
      b.in[r].push_back(RandomData(ps.dtype, in_units, seed * 131 + static_cast<uint32_t>(r * 7919 + i * 17), nan));
      b.out[r].emplace_back(out_units * w, 0xAB);
    }
    for (size_t i = 0; i < c.parts.size(); ++i) {
      const PartSpec& ps = c.parts[i];
      Part p;
      p.dtype = ps.dtype, p.units = ps.outer * ps.inner, p.outer = ps.outer, p.inner = ps.inner;
      p.in = b.in[r][i].data();
      p.out = c.in_place ? b.in[r][i].data() : b.out[r][i].data();
      d.AddPart(p);
    }
  }
  return b;
}

// The ranges the case runs, as lists of pieces (the same on every rank: same layout).
std::vector<std::vector<Piece>> Ranges(const XCase& c, const CallDesc& d) {
  const uint64_t total = d.virtual_bytes();
  std::vector<uint64_t> at = {0};
  for (double f : c.cuts) at.push_back(std::min(total, (static_cast<uint64_t>(f * total) / 64) * 64));
  at.push_back(total);
  std::vector<std::vector<Piece>> out;
  for (size_t i = 0; i + 1 < at.size(); ++i) {
    if (c.only_middle && i != (at.size() - 2) / 2) continue;
    std::vector<Piece> p;
    d.PiecesOf({at[i], at[i + 1]}, &p);
    out.push_back(p);
  }
  return out;
}

// The expected output of `rank` (the output buffer's bytes after the case), computed unit by unit
// from the inputs (`ins[r][part]`, saved before the run): only the units of the pieces run are
// written; the rest keeps what was there (the input in place, else the 0xAB fill).
std::vector<std::vector<uint8_t>> Reference(const XCase& c, const Buffers& b0,
                                            const std::vector<std::vector<std::vector<uint8_t>>>& ins, int n, int rank) {
  std::vector<std::vector<uint8_t>> want(c.parts.size());
  for (size_t i = 0; i < c.parts.size(); ++i) want[i] = c.in_place ? ins[rank][i] : b0.out[rank][i];
  for (const auto& range : Ranges(c, b0.desc[rank]))
    for (const Piece& piece : range) {
      const PartSpec& ps = c.parts[piece.part];
      const size_t w = ByteWidth(ps.dtype), inner = ps.inner;
      uint8_t* out = want[piece.part].data();
      auto in = [&](int r, size_t e) { return ins[r][piece.part].data() + e * w; };
      for (size_t u = piece.units.begin; u < piece.units.end; ++u) {
        const size_t o = u / inner, i = u % inner;
        std::vector<const uint8_t*> srcs;
        switch (c.kind) {
          case Kind::kAllReduce:
            for (int r = 0; r < n; ++r) srcs.push_back(in(r, u));
            RefReduce(ps.dtype, c.op, srcs, 0, out + u * w);
            break;
          case Kind::kReduceScatter:
            for (int r = 0; r < n; ++r) srcs.push_back(in(r, (o * n + rank) * inner + i));
            RefReduce(ps.dtype, c.op, srcs, 0, out + u * w);
            break;
          case Kind::kAllGather:
            for (int r = 0; r < n; ++r) std::memcpy(out + ((o * n + r) * inner + i) * w, in(r, u), w);
            break;
          case Kind::kPpermute: {
            const int s = c.sources[rank];
            if (s < 0) std::memset(out + u * w, 0, w);
            else std::memcpy(out + u * w, in(s, u), w);
            break;
          }
          case Kind::kAllToAll:
            for (int j = 0; j < n; ++j)
              std::memcpy(out + ((o * n + j) * inner + i) * w, in(j, (o * n + rank) * inner + i), w);
            break;
        }
      }
    }
  return want;
}

const std::vector<uint8_t>& Result(const XCase& c, const Buffers& b, int r, size_t i) {
  return c.in_place ? b.in[r][i] : b.out[r][i];
}

// Runs `c` on the cross-process channel for the local ranks and on an in-process tcp ring for all
// ranks, and checks the local ranks' outputs: equal to the reference, and bit for bit to in-process.
void CheckCase(Child& ch, TcpChannel& inproc, const XCase& c, uint32_t seed) {
  const int n = ch.n;
  Buffers x = MakeBuffers(c, n, seed), y = MakeBuffers(c, n, seed);
  const Buffers fresh = MakeBuffers(c, n, seed);
  const auto ranges = Ranges(c, x.desc[0]);
  std::vector<Status> st(n), st_in(n);
  ForLocal(ch.ranks, [&](int r) {
    for (const auto& pieces : ranges)
      if (st[r].ok()) st[r] = ch.channel->RunPieces(x.desc[r], n, r, pieces);
  });
  std::vector<int> all(n);
  for (int r = 0; r < n; ++r) all[r] = r;
  ForLocal(all, [&](int r) {
    for (const auto& pieces : ranges)
      if (st_in[r].ok()) st_in[r] = inproc.RunPieces(y.desc[r], n, r, pieces);
  });
  std::string why;
  for (int r : ch.ranks) {
    if (!why.empty()) break;
    if (!st[r].ok()) { why = "cross-process rank " + std::to_string(r) + ": " + st[r].message(); break; }
    if (!st_in[r].ok()) { why = "in-process rank " + std::to_string(r) + ": " + st_in[r].message(); break; }
    const auto want = Reference(c, fresh, fresh.in, n, r);
    for (size_t i = 0; i < c.parts.size() && why.empty(); ++i) {
      const size_t wrong = CountWrong(c.parts[i].dtype, Result(c, x, r, i), want[i]);
      if (wrong) why = "rank " + std::to_string(r) + " part " + std::to_string(i) + ": " + std::to_string(wrong) +
                       " elements differ from the reference";
      else if (Result(c, x, r, i) != Result(c, y, r, i))
        why = "rank " + std::to_string(r) + " part " + std::to_string(i) + ": not bitwise the in-process tcp link's";
    }
  }
  Expect(why.empty(), "[proc " + std::to_string(ch.proc) + "] " + Describe(c, n) + ": " + why);
}

std::vector<XCase> AllCases(int n) {
  std::vector<XCase> cases;
  const std::vector<DType> dtypes = {DType::kF32, DType::kBF16, DType::kF16, DType::kS32,
                                     DType::kU8,  DType::kPred, DType::kC64};
  const std::vector<ReduceOp> ops = {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin, ReduceOp::kProd};
  for (DType t : dtypes)
    for (ReduceOp op : ops) {
      if (!CheckReduction(t, op).ok()) continue;  // complex numbers: sum and prod only
      cases.push_back({Kind::kAllReduce, op, {{t, 1, 1237}}, {}, {}});
      cases.push_back({Kind::kAllReduce, op, {{t, 1, 1237}}, {}, {0.3, 0.71}});
      cases.push_back({Kind::kReduceScatter, op, {{t, 3, 333}}, {}, {}});
      cases.push_back({Kind::kReduceScatter, op, {{t, 3, 333}}, {}, {0.4}});
    }
  for (DType t : dtypes) {
    cases.push_back({Kind::kAllGather, ReduceOp::kSum, {{t, 1, 5003}}, {}, {}});
    cases.push_back({Kind::kAllGather, ReduceOp::kSum, {{t, 7, 131}}, {}, {0.25, 0.6}});
    cases.push_back({Kind::kAllToAll, ReduceOp::kSum, {{t, 1, 301}}, {}, {}});
    cases.push_back({Kind::kAllToAll, ReduceOp::kSum, {{t, 5, 37}}, {}, {0.5}});
  }
  // ppermute: shift +1, shift -1, a partial permutation with zero-filled ranks (and an identity
  // pair where the group has room for one).
  std::vector<int32_t> up(n), down(n), partial(n, -1);
  for (int d = 0; d < n; ++d) up[d] = (d + n - 1) % n, down[d] = (d + 1) % n;
  partial[1] = 0;
  if (n > 2) partial[n - 1] = n - 1;
  for (DType t : {DType::kF32, DType::kBF16, DType::kU8, DType::kC64})
    for (const auto& src : {up, down, partial}) {
      cases.push_back({Kind::kPpermute, ReduceOp::kSum, {{t, 1, 2001}}, src, {}});
      cases.push_back({Kind::kPpermute, ReduceOp::kSum, {{t, 1, 2001}}, src, {0.5}});
    }
  // Several pipeline chunks (256 KiB) in one range.
  cases.push_back({Kind::kAllReduce, ReduceOp::kSum, {{DType::kF32, 1, 200001}}, {}, {}});
  cases.push_back({Kind::kAllReduce, ReduceOp::kSum, {{DType::kBF16, 1, 200001}}, {}, {0.37}});
  // Several operands (mixed dtypes and shapes), with range boundaries inside parts.
  const std::vector<PartSpec> multi = {{DType::kF32, 1, 1000}, {DType::kBF16, 1, 777}, {DType::kU8, 1, 93}};
  const std::vector<PartSpec> rows = {{DType::kF32, 3, 100}, {DType::kS32, 1, 257}, {DType::kF16, 2, 45}};
  cases.push_back({Kind::kAllReduce, ReduceOp::kSum, multi, {}, {}});
  cases.push_back({Kind::kAllReduce, ReduceOp::kMax, multi, {}, {0.2, 0.55, 0.9}});
  cases.push_back({Kind::kReduceScatter, ReduceOp::kSum, rows, {}, {0.33, 0.8}});
  cases.push_back({Kind::kAllGather, ReduceOp::kSum, rows, {}, {0.5}});
  cases.push_back({Kind::kAllToAll, ReduceOp::kSum, rows, {}, {0.45}});
  cases.push_back({Kind::kPpermute, ReduceOp::kSum, multi, up, {0.3, 0.6}});
  // A range alone (the other links' ranges untouched), one per kind.
  cases.push_back({Kind::kAllReduce, ReduceOp::kSum, multi, {}, {0.3, 0.7}, true});
  cases.push_back({Kind::kReduceScatter, ReduceOp::kProd, rows, {}, {0.3, 0.7}, true});
  cases.push_back({Kind::kAllGather, ReduceOp::kSum, rows, {}, {0.3, 0.7}, true});
  cases.push_back({Kind::kAllToAll, ReduceOp::kSum, rows, {}, {0.3, 0.7}, true});
  cases.push_back({Kind::kPpermute, ReduceOp::kSum, multi, down, {0.3, 0.7}, true});
  // In place (all_reduce, ppermute, all_to_all).
  cases.push_back({Kind::kAllReduce, ReduceOp::kSum, {{DType::kF32, 1, 3001}}, {}, {0.5}, false, true});
  cases.push_back({Kind::kPpermute, ReduceOp::kSum, {{DType::kF32, 1, 3001}}, down, {}, false, true});
  cases.push_back({Kind::kAllToAll, ReduceOp::kSum, {{DType::kBF16, 3, 51}}, {}, {0.5}, false, true});
  return cases;
}

// Runs the cases of `cases` and reports nothing extra.
std::vector<double> RunCases(Child& ch, const std::vector<XCase>& cases) {
  TcpChannel inproc("tcp", ch.devices);
  Expect(inproc.health().ok(), "in-process ring: " + inproc.health().message());
  uint32_t seed = 1;
  for (const XCase& c : cases) CheckCase(ch, inproc, c, seed++);
  return {};
}

// ---------------------------------------------------------------------------------------------
// A scenario: fork one child per process, pass ports and the token, run `body` in each child.

struct Scenario {
  std::string name;
  std::vector<std::vector<int>> procs;  // local ranks of each process
  std::function<std::vector<double>(Child&)> body;
  double timeout = 30;           // the engine's deadline in the children
  bool strangers = false;        // before Connect, the parent knocks at rank 0's listener twice
  int other_token_proc = -1;     // this process gets a different token
  int victim = -1;               // this process is expected to die (no report)
  int alarm_seconds = 120;       // backstop: a hung child dies of SIGALRM
};

struct Report {
  int passed = 0, failed = 0, refused = -1, connected = 0;
  std::vector<double> values;
  bool reported = false;
  int exit_status = -1;  // waitpid status
};

[[noreturn]] void ChildMain(const Scenario& sc, int proc, int n, int in_fd, int out_fd) {
  alarm(sc.alarm_seconds);
  g_passed = g_failed = 0;
  SetTimeoutSeconds(sc.timeout);
  Child ch;
  ch.proc = proc, ch.n = n, ch.ranks = sc.procs[proc];
  for (int r = 0; r < n; ++r) ch.devices.push_back(kDevice0 + r);
  std::vector<int64_t> local;
  for (int r : ch.ranks) local.push_back(kDevice0 + r);
  std::vector<uint16_t> ports;
  Status s = ListenCrossProcessTcp(ch.devices, local, "tcp", &ports);
  if (!s.ok()) std::printf("FAIL [proc %d] listen: %s\n", proc, s.message().c_str()), std::fflush(stdout), _exit(3);
  WriteAll(out_fd, ports.data(), ports.size() * sizeof(uint16_t));
  std::vector<uint16_t> all(n);
  uint8_t token[kTcpTokenBytes];
  if (!ReadAll(in_fd, all.data(), n * sizeof(uint16_t), 60) || !ReadAll(in_fd, token, sizeof token, 60)) _exit(4);
  const auto t0 = Clock::now();
  ch.connect = ConnectCrossProcessTcp(ch.devices, local, all, token, "tcp", &ch.refused);
  ch.connect_seconds = Since(t0);
  ch.channel = CrossProcessTcp(ch.devices, "tcp");
  Expect(ch.channel != nullptr, "channel registered (also when connecting failed)");
  Expect(CrossProcessTcpRefused(ch.devices, "tcp") == ch.refused, "refused count recorded");
  std::vector<double> values;
  if (ch.channel) values = sc.body(ch);
  std::fflush(stdout);
  const int head[4] = {g_passed, g_failed, ch.refused, ch.connect.ok() ? 1 : 0};
  const uint32_t count = static_cast<uint32_t>(values.size());
  WriteAll(out_fd, head, sizeof head);
  WriteAll(out_fd, &count, sizeof count);
  WriteAll(out_fd, values.data(), values.size() * sizeof(double));
  _exit(0);  // no static destructors: the registry's channel outlives everything on purpose
}

std::vector<Report> RunScenario(const Scenario& sc) {
  const int P = static_cast<int>(sc.procs.size());
  int n = 0;
  for (const auto& p : sc.procs) n += static_cast<int>(p.size());
  std::vector<pid_t> pids(P, -1);
  std::vector<int> to(P, -1), from(P, -1);
  std::fflush(stdout);
  for (int i = 0; i < P; ++i) {
    int a[2], b[2];
    if (pipe2(a, O_CLOEXEC) != 0 || pipe2(b, O_CLOEXEC) != 0) {
      Expect(false, sc.name + ": pipe");
      return {};
    }
    const pid_t pid = fork();
    if (pid == 0) {
      close(a[1]), close(b[0]);
      for (int j = 0; j < i; ++j) close(to[j]), close(from[j]);
      ChildMain(sc, i, n, a[0], b[1]);
    }
    close(a[0]), close(b[1]);
    pids[i] = pid, to[i] = a[1], from[i] = b[0];
    Expect(pid > 0, sc.name + ": fork");
  }
  // Phase 1's ports, in rank order.
  std::vector<uint16_t> ports(n, 0);
  bool have_ports = true;
  for (int i = 0; i < P; ++i) {
    std::vector<uint16_t> p(sc.procs[i].size());
    if (!ReadAll(from[i], p.data(), p.size() * sizeof(uint16_t), 30)) have_ports = false;
    for (size_t k = 0; k < p.size(); ++k) ports[sc.procs[i][k]] = p[k];
  }
  Expect(have_ports, sc.name + ": every child listened");
  // Strangers at rank 0's listener before anyone connects: one silent, one with a wrong token.
  int silent = -1, wrong = -1;
  if (sc.strangers && have_ports) {
    std::vector<uint8_t> bad(kTcpTokenBytes + 8, 0x5A);
    Expect(net::ConnectHello(ports[0], {}, net::DeadlineIn(5), &silent).ok(), sc.name + ": silent stranger connects");
    Expect(net::ConnectHello(ports[0], bad, net::DeadlineIn(5), &wrong).ok(), sc.name + ": wrong-token stranger connects");
  }
  uint8_t token[kTcpTokenBytes], other[kTcpTokenBytes];
  Expect(getrandom(token, sizeof token, 0) == sizeof token && getrandom(other, sizeof other, 0) == sizeof other,
         "getrandom");
  for (int i = 0; i < P; ++i) {
    WriteAll(to[i], ports.data(), ports.size() * sizeof(uint16_t));
    WriteAll(to[i], i == sc.other_token_proc ? other : token, sizeof token);
  }
  std::vector<Report> reports(P);
  for (int i = 0; i < P; ++i) {
    int head[4];
    uint32_t count = 0;
    Report& rep = reports[i];
    if (!ReadAll(from[i], head, sizeof head, sc.alarm_seconds + 10) || !ReadAll(from[i], &count, sizeof count, 10))
      continue;
    rep.values.resize(count);
    if (!ReadAll(from[i], rep.values.data(), count * sizeof(double), 10)) continue;
    rep.passed = head[0], rep.failed = head[1], rep.refused = head[2], rep.connected = head[3];
    rep.reported = true;
    g_passed += rep.passed, g_failed += rep.failed;
  }
  // The strangers were closed by the accept (EOF here), not left hanging.
  for (int fd : {silent, wrong}) {
    if (fd < 0) continue;
    char z;
    ssize_t r = -1;
    for (int k = 0; k < 500 && r < 0; ++k) {
      r = recv(fd, &z, 1, MSG_DONTWAIT);
      if (r < 0) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    Expect(r == 0, sc.name + ": a stranger sees its connection closed");
    close(fd);
  }
  // Reap every child; one that outlives its alarm backstop is killed (by its pid).
  for (int i = 0; i < P; ++i) {
    const auto t0 = Clock::now();
    int status = 0;
    pid_t w = 0;
    while ((w = waitpid(pids[i], &status, WNOHANG)) == 0 && Since(t0) < sc.alarm_seconds + 10)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    if (w == 0) {
      kill(pids[i], SIGKILL);
      waitpid(pids[i], &status, 0);
    }
    reports[i].exit_status = status;
    if (i != sc.victim)
      Expect(w == pids[i] && WIFEXITED(status) && WEXITSTATUS(status) == 0 && reports[i].reported,
             sc.name + ": process " + std::to_string(i) + " reported and exited cleanly (status " +
                 std::to_string(status) + ")");
    close(to[i]), close(from[i]);
  }
  return reports;
}

// ---------------------------------------------------------------------------------------------
// The scenarios.

void TestKinds(const std::string& name, std::vector<std::vector<int>> procs, bool strangers) {
  int n = 0;
  for (const auto& p : procs) n += static_cast<int>(p.size());
  const auto t0 = Clock::now();
  Scenario sc{name, procs};
  sc.strangers = strangers;
  sc.body = [&](Child& ch) {
    Expect(ch.connect.ok(), "[proc " + std::to_string(ch.proc) + "] connect: " + ch.connect.message());
    if (ch.connect.ok()) RunCases(ch, AllCases(ch.n));
    return std::vector<double>{};
  };
  const auto reps = RunScenario(sc);
  int refused = 0;
  for (const Report& r : reps) refused += std::max(0, r.refused);
  if (strangers) {
    // Both strangers reached rank 0's listener before the ring's own connection, so the accept took
    // and refused both; the process of rank 0 says so, the others refused nothing.
    Expect(!reps.empty() && reps[0].refused == 2, name + ": rank 0's process refused both strangers: " +
                                                      std::to_string(reps.empty() ? -1 : reps[0].refused));
    Expect(refused == 2, name + ": strangers refused in all: " + std::to_string(refused));
  } else {
    Expect(refused == 0, name + ": nothing refused without strangers: " + std::to_string(refused));
  }
  std::printf("%s: %zu cases per process, %.1f s\n", name.c_str(), AllCases(n).size(), Since(t0));
}

// A process gets another token: nobody's hello matches, both accepts end at the (short) deadline
// with an error naming the group and the rank, and the registered channel is broken, not hung.
void TestWrongToken() {
  Scenario sc{"wrong token", {{0}, {1}}};
  sc.timeout = 1.0;
  sc.other_token_proc = 1;
  sc.body = [](Child& ch) {
    const std::string& m = ch.connect.message();
    const std::string tag = "[proc " + std::to_string(ch.proc) + "] ";
    Expect(!ch.connect.ok() && m.find("[2048, 2049]") != std::string::npos &&
               m.find("rank " + std::to_string(ch.ranks[0]) + " (device") != std::string::npos &&
               m.find("token") != std::string::npos,
           tag + "wrong token fails naming group and rank: " + m);
    Expect(ch.connect_seconds < 3, tag + "connect ends at the deadline: " + std::to_string(ch.connect_seconds));
    Expect(ch.refused >= 1, tag + "the mismatched hello was refused: " + std::to_string(ch.refused));
    std::vector<float> in(100, 1.f), out(100);
    CallDesc d;
    Part p;
    p.units = p.inner = 100, p.in = in.data(), p.out = out.data();
    d.AddPart(p);
    const Piece piece{0, {0, 100}};
    const auto t0 = Clock::now();
    const Status s = ch.channel->RunPieces(d, 2, ch.ranks[0], {&piece, 1});
    Expect(!s.ok() && s.message() == m && Since(t0) < 0.5,
           tag + "a run on the broken channel returns the connection error at once: " + s.message());
    if (ch.proc == 0) std::printf("wrong token: %s\n", m.c_str());
    return std::vector<double>{};
  };
  RunScenario(sc);
}

CallDesc AllReduceDesc(std::vector<float>& in, std::vector<float>& out) {
  CallDesc d;
  Part p;
  p.units = p.inner = in.size(), p.in = in.data(), p.out = out.data();
  d.AddPart(p);
  return d;
}

// Process 2 of 4 dies (_exit) while its second large all_reduce is under way: the others fail,
// the neighbours naming rank 2, all well before the 30 s deadline; every child is reaped.
void TestKilledPeer() {
  Scenario sc{"killed peer", {{0}, {1}, {2}, {3}}};
  sc.timeout = 30;
  sc.victim = 2;
  sc.body = [](Child& ch) {
    const size_t units = size_t{64} << 18;  // 64 MiB of float32 per rank
    std::vector<float> in(units, 1.f), out(units);
    const CallDesc d = AllReduceDesc(in, out);
    const Piece piece{0, {0, units}};
    const int r = ch.ranks[0];
    // A first call that completes: it grows every rank's scratch, so in the second the victim's
    // header goes out as soon as its run starts (not after zero-filling 64 MiB).
    const Status first = ch.channel->RunPieces(d, ch.n, r, {&piece, 1});
    Expect(first.ok(), "[rank " + std::to_string(r) + "] the call before the death: " + first.message());
    if (ch.proc == 2) {
      std::atomic<bool> started{false};
      std::thread([&] {
        started.store(true);
        (void)ch.channel->RunPieces(d, ch.n, r, {&piece, 1});
      }).detach();
      while (!started.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      // 64 MiB take far longer than this on 4 ranks, so the call is under way (its header sent).
      std::this_thread::sleep_for(std::chrono::milliseconds(40));
      // Mid-call: the kernel closes this process's sockets. SIGKILL, not _exit: under TSan, _exit's
      // interceptor took over a second here, long enough for the call to complete first (a flake).
      raise(SIGKILL);
    }
    const auto t0 = Clock::now();
    const Status s = ch.channel->RunPieces(d, ch.n, r, {&piece, 1});
    const double took = Since(t0);
    const std::string& m = s.message();
    const std::string tag = "[rank " + std::to_string(r) + "] ";
    std::printf("killed peer, rank %d after %.2f s: %s\n", r, took, m.c_str());
    Expect(!s.ok(), tag + "fails when a peer dies");
    Expect(took < 10, tag + "fails long before the 30 s deadline: " + std::to_string(took) + " s");
    // Rank 3 reads from rank 2 for the whole call, so rank 2's FIN is in when rank 3 fails: it names
    // rank 2, alone or beside rank 0 (under ASan a send to rank 0, closed after the death went round
    // the ring, once failed before rank 3 had read the data queued ahead of rank 2's FIN). Ranks 0
    // and 1 may first see the ring end on another side (the failure travels as closed sockets:
    // nothing in-band can say which process died), so they name a neighbour.
    const bool closed = m.find("another process) closed its connection") != std::string::npos ||
                        m.find("another process) closed their connections") != std::string::npos;
    if (r == 3) {
      Expect(closed && m.find("rank 2 (device 2050, another process)") != std::string::npos,
             tag + "the successor names the dead rank: " + m);
      // Something of the call came from rank 2 before it died: it died mid-call, not before.
      const size_t at = m.find("(received ");
      Expect(at != std::string::npos && std::strtoull(m.c_str() + at + 10, nullptr, 10) > 0,
             tag + "rank 2 died mid-call: " + m);
    }
    else
      Expect(closed, tag + "the ring's end reached it: " + m);
    return std::vector<double>{took};
  };
  const auto reps = RunScenario(sc);
  if (reps.size() == 4)
    Expect(WIFSIGNALED(reps[2].exit_status) && WTERMSIG(reps[2].exit_status) == SIGKILL,
           "killed peer: the victim was reaped, killed by SIGKILL");
}

// Process 1 of 3 connects but never runs: rank 2, which waits for its bytes, times out after the 1 s
// deadline naming it as the rank that sent nothing; rank 0 fails by then too.
void TestSilentPeer() {
  Scenario sc{"silent peer", {{0}, {1}, {2}}};
  sc.timeout = 1.0;
  sc.victim = -1;
  sc.body = [](Child& ch) {
    const int r = ch.ranks[0];
    if (r == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2500));
      return std::vector<double>{};
    }
    std::vector<float> in(5000, 1.f), out(5000);
    const CallDesc d = AllReduceDesc(in, out);
    const Piece piece{0, {0, 5000}};
    const auto t0 = Clock::now();
    const Status s = ch.channel->RunPieces(d, ch.n, r, {&piece, 1});
    const double took = Since(t0);
    const std::string& m = s.message();
    std::printf("silent peer, rank %d after %.2f s: %s\n", r, took, m.c_str());
    Expect(!s.ok() && took < 2.5, "[rank " + std::to_string(r) + "] fails by the deadline: " + std::to_string(took));
    if (r == 2)
      Expect(s.code() == StatusCode::kDeadlineExceeded &&
                 m.find("rank 1 (device 2049, another process) sent nothing of this range") != std::string::npos &&
                 m.find("link tcp") != std::string::npos && m.find("[2048, 2049, 2050]") != std::string::npos,
             "rank 2 names the silent remote rank: " + m);
    return std::vector<double>{};
  };
  RunScenario(sc);
}

// A real stall across processes: process 1 of 3 is SIGSTOPped mid-call (a grandchild SIGCONTs it 2 s
// later). The others run the range with a lane deadline of 0.5 s (TcpLimits, what the cross-process
// executor passes; the global deadline is 30 s): they fail at that deadline, not the global one, and
// rank 2, which waits for the stopped rank's bytes, names it and the link's deadline.
void TestStoppedPeer() {
  Scenario sc{"stopped peer: the lane's deadline", {{0}, {1}, {2}}};
  sc.timeout = 30;
  sc.body = [](Child& ch) {
    const size_t units = size_t{64} << 18;  // 64 MiB of float32 per rank: the call is long enough to stop inside
    std::vector<float> in(units, 1.f), out(units);
    const CallDesc d = AllReduceDesc(in, out);
    const Piece piece{0, {0, units}};
    const int r = ch.ranks[0];
    const Status first = ch.channel->RunPieces(d, ch.n, r, {&piece, 1});
    Expect(first.ok(), "[rank " + std::to_string(r) + "] the call before the stall: " + first.message());
    const TcpLimits limits{net::DeadlineIn(0.5), 0.5, "tcp_xproc_test"};
    if (ch.proc == 1) {
      const pid_t self = getpid();
      const pid_t waker = fork();
      if (waker == 0) {
        std::this_thread::sleep_for(std::chrono::seconds(2));
        kill(self, SIGCONT);
        _exit(0);
      }
      std::atomic<bool> started{false};
      std::thread stopper([&] {
        while (!started.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        std::this_thread::sleep_for(std::chrono::milliseconds(40));
        raise(SIGSTOP);  // every thread of this process stops: its sockets go silent mid-call
      });
      started.store(true);
      const Status s = ch.channel->RunPieces(d, ch.n, r, {&piece, 1}, limits);
      stopper.join();
      int status = 0;
      waitpid(waker, &status, 0);
      Expect(!s.ok(), "[rank 1] the stopped rank's own run fails after it resumes: " + s.message());
      return std::vector<double>{};
    }
    const auto t0 = Clock::now();
    const Status s = ch.channel->RunPieces(d, ch.n, r, {&piece, 1}, limits);
    const double took = Since(t0);
    const std::string& m = s.message();
    const std::string tag = "[rank " + std::to_string(r) + "] ";
    std::printf("stopped peer, rank %d after %.2f s: %s\n", r, took, m.c_str());
    Expect(!s.ok() && took < 0.5 + 1.5, tag + "fails at the lane's deadline, not the 30 s one: " + std::to_string(took));
    if (r == 2)
      Expect(s.code() == StatusCode::kDeadlineExceeded && m.find("tcp_xproc_test: all_reduce") != std::string::npos &&
                 m.find("[2048, 2049, 2050]") != std::string::npos && m.find("link tcp missed its deadline of 0.5 s") != std::string::npos &&
                 m.find("waiting for rank 1 (device 2049, another process) to send") != std::string::npos,
             tag + "names the collective, group, link, deadline and the stopped rank: " + m);
    return std::vector<double>{took};
  };
  RunScenario(sc);
}

// Arguments the engine or the glue could get wrong are errors, never crashes (in this process).
void TestBadArguments() {
  std::vector<uint16_t> ports;
  const std::vector<int64_t> devices = {7001, 7002};
  Expect(!ListenCrossProcessTcp(devices, std::vector<int64_t>{7003}, "tcp", &ports).ok(), "stranger device refused");
  Expect(!ListenCrossProcessTcp(std::vector<int64_t>{7001, 7001}, std::vector<int64_t>{7001}, "tcp", &ports).ok(),
         "repeated device refused");
  int refused = 0;
  const uint8_t token[kTcpTokenBytes] = {};
  Expect(ConnectCrossProcessTcp(devices, std::vector<int64_t>{7001}, std::vector<uint16_t>{1, 2}, token, "tcp", &refused)
                 .code() == StatusCode::kFailedPrecondition,
         "connect before listen refused");
  Expect(ListenCrossProcessTcp(devices, std::vector<int64_t>{7001}, "tcp", &ports).ok() && ports.size() == 1 &&
             ports[0] != 0,
         "listen");
  Expect(!ConnectCrossProcessTcp(devices, std::vector<int64_t>{7001}, std::vector<uint16_t>{ports[0]}, token, "tcp",
                                 &refused).ok(),
         "wrong number of ports refused");
  Expect(!ConnectCrossProcessTcp(devices, std::vector<int64_t>{7001}, std::vector<uint16_t>{ports[0], 9},
                                 std::span<const uint8_t>(token, 5), "tcp", &refused).ok(),
         "short token refused");
  Expect(CrossProcessTcp(devices, "tcp") == nullptr && CrossProcessTcpRefused(devices, "tcp") == -1,
         "no channel before a connect ran");
  // A whole group in one process through the same two phases (the other rank's listener is ours).
  const std::vector<int64_t> both = {7011, 7012};
  std::vector<uint16_t> p2;
  Expect(ListenCrossProcessTcp(both, both, "tcp:x", &p2).ok() && p2.size() == 2, "listen both");
  uint8_t tok[kTcpTokenBytes];
  Expect(getrandom(tok, sizeof tok, 0) == sizeof tok, "getrandom");
  Status s = ConnectCrossProcessTcp(both, both, p2, tok, "tcp:x", &refused);
  Expect(s.ok() && refused == 0, "connect both in one process: " + s.message());
  TcpChannel* ch = CrossProcessTcp(both, "tcp:x");
  Expect(ch != nullptr && CrossProcessTcp(both, "tcp") == nullptr, "keyed by link name");
  if (!ch) return;
  Expect(ListenCrossProcessTcp(both, both, "tcp:x", &p2).code() == StatusCode::kFailedPrecondition,
         "a connected group does not listen again");
  std::vector<float> in(10, 1.f), out(10);
  CallDesc d = AllReduceDesc(in, out);
  const Piece piece{0, {0, 10}}, beyond{0, {0, 11}}, no_part{1, {0, 1}};
  Expect(ch->RunPieces(d, 3, 0, {&piece, 1}).code() == StatusCode::kInvalidArgument, "wrong group size refused");
  Expect(ch->RunPieces(d, 2, 2, {&piece, 1}).code() == StatusCode::kInvalidArgument, "rank outside refused");
  Expect(ch->RunPieces(d, 2, 0, {&beyond, 1}).code() == StatusCode::kInvalidArgument, "units beyond the part refused");
  Expect(ch->RunPieces(d, 2, 0, {&no_part, 1}).code() == StatusCode::kInvalidArgument, "missing part refused");
  d.parts[0].dtype = DType::kC64;
  d.op = ReduceOp::kMax;
  Expect(ch->RunPieces(d, 2, 0, {&piece, 1}).code() == StatusCode::kInvalidArgument, "complex max refused");
  Expect(ch->health().ok(), "argument errors do not break the channel");
}

// ---------------------------------------------------------------------------------------------
// Throughput: all_reduce float32 of `bytes` per rank, one rank per process, median of the slowest
// rank's time over `reps` calls (after one warm-up); results checked.

void Bench() {
  std::printf("cross-process tcp ring, all_reduce float32 (one rank per process; median of 5, slowest rank)\n");
  std::printf("%6s %10s %10s %10s %10s\n", "procs", "MiB/rank", "ms", "algbw GB/s", "busbw GB/s");
  for (int P : {2, 4})
    for (size_t mib : {1, 16, 64}) {
      std::vector<std::vector<int>> procs;
      for (int i = 0; i < P; ++i) procs.push_back({i});
      constexpr int kReps = 5;
      Scenario sc{"bench", procs};
      sc.alarm_seconds = 300;
      sc.body = [mib](Child& ch) {
        const size_t units = (mib << 20) / 4;
        const int r = ch.ranks[0];
        std::vector<float> in(units, static_cast<float>(r + 1)), out(units);
        const CallDesc d = AllReduceDesc(in, out);
        const Piece piece{0, {0, units}};
        std::vector<double> t;
        for (int k = 0; k <= kReps; ++k) {
          const auto t0 = Clock::now();
          const Status s = ch.channel->RunPieces(d, ch.n, r, {&piece, 1});
          if (k > 0) t.push_back(Since(t0));
          Expect(s.ok(), "bench run: " + s.message());
        }
        const float want = static_cast<float>(ch.n * (ch.n + 1) / 2);
        Expect(std::all_of(out.begin(), out.end(), [&](float v) { return v == want; }), "bench result");
        return t;
      };
      const auto reps = RunScenario(sc);
      std::vector<double> slowest(kReps, 0);
      for (const Report& rep : reps)
        for (size_t k = 0; k < rep.values.size() && k < slowest.size(); ++k) slowest[k] = std::max(slowest[k], rep.values[k]);
      std::sort(slowest.begin(), slowest.end());
      const double t = slowest[kReps / 2], bytes = static_cast<double>(mib << 20);
      std::printf("%6d %10zu %10.2f %10.3f %10.3f\n", P, mib, t * 1e3, bytes / t / 1e9,
                  bytes / t / 1e9 * 2 * (P - 1) / P);
      std::fflush(stdout);
    }
  // The same ring in one process (ranks as threads), for comparison; after every fork above.
  std::printf("in-process tcp ring (ranks as threads), same calls\n");
  for (int n : {2, 4})
    for (size_t mib : {1, 16, 64}) {
      std::vector<int64_t> devices;
      for (int r = 0; r < n; ++r) devices.push_back(kDevice0 + r);
      TcpChannel ch("tcp", devices);
      const size_t units = (mib << 20) / 4;
      std::vector<std::vector<float>> in(n), out(n);
      std::vector<CallDesc> d(n);
      for (int r = 0; r < n; ++r) {
        in[r].assign(units, static_cast<float>(r + 1)), out[r].resize(units);
        d[r] = AllReduceDesc(in[r], out[r]);
      }
      const Piece piece{0, {0, units}};
      std::vector<double> t;
      for (int k = 0; k <= 5; ++k) {
        std::vector<Status> st(n);
        std::vector<std::thread> threads;
        const auto t0 = Clock::now();
        for (int r = 0; r < n; ++r) threads.emplace_back([&, r] { st[r] = ch.RunPieces(d[r], n, r, {&piece, 1}); });
        for (auto& th : threads) th.join();
        if (k > 0) t.push_back(Since(t0));
        for (const Status& s : st) Expect(s.ok(), "in-process bench run: " + s.message());
      }
      std::sort(t.begin(), t.end());
      const double bytes = static_cast<double>(mib << 20);
      std::printf("%6d %10zu %10.2f %10.3f %10.3f\n", n, mib, t[2] * 1e3, bytes / t[2] / 1e9,
                  bytes / t[2] / 1e9 * 2 * (n - 1) / n);
    }
}

}  // namespace

int main(int argc, char** argv) {
  signal(SIGPIPE, SIG_IGN);  // sockets use MSG_NOSIGNAL; a pipe to a dead child must not kill us
  if (argc > 1 && std::string(argv[1]) == "--bench") {
    Bench();
    return Summary();
  }
  // Arguments select tests (check.h): the TSan run of .ci/sanitizers takes the cases whose
  // processes have several ranks on threads, and the peers' failures, not the sweep of every kind
  // and dtype over one thread per process again.
  SelectTests(argc, argv);
  const auto run = [](std::string_view name, auto&& test) { Timed(name, test); };
  const auto t0 = Clock::now();
  run("TestBadArguments", TestBadArguments);
  run("TestKinds: 2 processes", [] { TestKinds("2 processes", {{0}, {1}}, /*strangers=*/true); });
  run("TestKinds: 4 processes", [] { TestKinds("4 processes", {{0}, {1}, {2}, {3}}, false); });
  run("TestKinds: 2 processes x 2 ranks (interleaved)",
      [] { TestKinds("2 processes x 2 ranks (interleaved)", {{0, 2}, {1, 3}}, true); });
  run("TestKinds: 2 processes x 2 ranks (blocks)",
      [] { TestKinds("2 processes x 2 ranks (blocks)", {{0, 1}, {2, 3}}, false); });
  run("TestWrongToken", TestWrongToken);
  run("TestSilentPeer", TestSilentPeer);
  run("TestKilledPeer", TestKilledPeer);
  run("TestStoppedPeer", TestStoppedPeer);
  std::printf("(%.1f s)\n", Since(t0));
  return Summary();
}
