// Fault injection and failover (docs/faults.md): the fault-spec parser, and the executor re-running a
// failed link's range on a healthy one in the same call (exact against a reference), the in-place
// rule (a link that failed after writing part of an aliased call's range is an error, not a wrong
// result), a failed link excluded from the next calls and probed back, and the error naming every
// link when none can carry the bytes. Ranks are std::threads on one executor, as in engine_test.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/cpp/check.h"
#include "xla_ffi/core/call.h"
#include "xla_ffi/core/communicator.h"
#include "xla_ffi/core/config.h"
#include "xla_ffi/core/executor.h"
#include "xla_ffi/core/faults.h"
#include "xla_ffi/core/health.h"
#include "xla_ffi/core/link_set.h"
#include "xla_ffi/links/faulty.h"
#include "xla_ffi/links/shm.h"
#include "xla_ffi/links/tcp.h"
#include "xla_ffi/plan/balancer.h"

namespace flexlink {
namespace {

using testing::Expect;
using testing::NextRunId;

bool Contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

void TestParser() {
  const std::vector<std::string> links = {"shm", "tcp", "pcie"};
  std::vector<Fault> f;
  Status s = ParseFaults(" shm:slow@factor=2.5,from_call=3 ; tcp:error@at_call=2,sticky=1;pcie:hang@at_call=4;"
                         "rank:absent@rank=3,at_call=7",
                         links, &f);
  Expect(s.ok() && f.size() == 4, "parser: four faults: " + s.message());
  if (f.size() == 4) {
    Expect(f[0].kind == Fault::Kind::kSlow && f[0].link == "shm" && f[0].factor == 2.5 && f[0].from_call == 3,
           "parser: slow");
    Expect(!f[0].FiresAt(2) && f[0].FiresAt(3) && f[0].FiresAt(100), "slow fires from its call on");
    Expect(f[1].kind == Fault::Kind::kError && f[1].sticky && f[1].at_call == 2 && f[1].FiresAt(9) &&
               !f[1].FiresAt(1),
           "parser: sticky error");
    Expect(f[2].kind == Fault::Kind::kHang && f[2].FiresAt(4) && !f[2].FiresAt(5), "parser: hang at one call");
    Expect(f[3].kind == Fault::Kind::kAbsent && f[3].rank == 3 && f[3].at_call == 7, "parser: rank absent");
  }
  Expect(ParseFaults("", links, &f).ok() && f.empty(), "parser: empty is no fault");
  Expect(ParseFaults("tcp:error@at_call=1", links, &f).ok() && !f[0].FiresAt(2), "non-sticky error fires once");
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"nvlink:error@at_call=1", "no link named \"nvlink\""},
      {"shm:explode@at_call=1", "unknown fault kind \"explode\""},
      {"shm:error", "error needs at_call"},
      {"shm:error@at_call=0", "at_call=\"0\" is not an integer >= 1"},
      {"shm:error@at_call=x", "at_call=\"x\""},
      {"shm:slow@factor=0.5", "factor=\"0.5\""},
      {"shm:slow@from_call=2", "slow needs factor"},
      {"shm:hang@at_call=1,sticky=1", "unknown parameter \"sticky\""},
      {"shm:error@at_call=1,sticky=2", "sticky=\"2\""},
      {"shm:error@at_call=1;;tcp:hang@at_call=1", "part 2 \"\": is empty"},
      {"shm", "expected NAME:kind@params"},
      {"rank:absent@at_call=1", "absent needs rank"},
      {"rank:slow@factor=2", "a rank fault is"},
      {"shm:error@at_call=1,at_call=2", "given twice"},
      {"shm:error@at_call", "is not key=value"},
  };
  for (const auto& [spec, want] : bad) {
    s = ParseFaults(spec, links, &f);
    Expect(!s.ok() && s.code() == StatusCode::kInvalidArgument && Contains(s.message(), want) &&
               Contains(s.message(), "grammar: ") && Contains(s.message(), spec),
           "bad spec \"" + spec + "\": " + s.message());
  }
}

// A link that writes garbage over its range of this rank's output (and so, in place, its input) and
// then fails: what a real link breaking mid-range does.
class ScribbleChannel : public Channel {
 public:
  std::string_view link_name() const override { return "scribble"; }
  Status Run(CallContext& ctx, int rank, int, std::span<const Piece> pieces) override {
    const CallDesc& d = ctx.desc(rank);
    for (const Piece& p : pieces) {
      const Part& part = d.parts[p.part];
      std::memset(static_cast<char*>(part.out) + p.units.begin * part.width(), 0x5a, p.units.size() * part.width());
    }
    return Status::Internal("scribble: the link broke after writing its range");
  }
};

// Two links on one group of `n` ranks: shm and `second`; the balancer's all_reduce shares pinned.
struct Rig {
  int n;
  std::vector<int64_t> devices;
  std::unique_ptr<Communicator> comm;
  std::unique_ptr<plan::Balancer> balancer;
  std::unique_ptr<Executor> executor;
  Rig(int ranks, std::unique_ptr<Channel> second, std::vector<double> shares, uint64_t bucket,
      const std::string& second_name = "scribble")
      : n(ranks) {
    for (int i = 0; i < n; ++i) devices.push_back(100 + i);
    comm = std::make_unique<Communicator>(devices);
    comm->AddChannel(std::make_unique<FaultyChannel>(ShmLink().Open(devices), n));
    comm->AddChannel(std::make_unique<FaultyChannel>(std::move(second), n));
    balancer = std::make_unique<plan::Balancer>(std::vector<std::string>{"shm", second_name});
    (void)balancer->SetShares(Kind::kAllReduce, bucket, shares, true);
    executor = std::make_unique<Executor>(comm.get(), std::vector<std::string>{"shm", second_name}, "test",
                                          balancer.get());
  }
  // One int32 sum all_reduce of `count` elements per rank; in place when asked. Checks exactness.
  std::vector<Status> AllReduce(size_t count, bool in_place, bool* exact) {
    std::vector<std::vector<int32_t>> x(n, std::vector<int32_t>(count)), y(n, std::vector<int32_t>(count));
    std::vector<int32_t> want(count, 0);
    for (int r = 0; r < n; ++r)
      for (size_t i = 0; i < count; ++i) {
        x[r][i] = static_cast<int32_t>((i * 2654435761u) ^ (r * 40503u));
        want[i] = static_cast<int32_t>(static_cast<uint32_t>(want[i]) + static_cast<uint32_t>(x[r][i]));
      }
    const int64_t run = NextRunId();
    std::vector<Status> st(n);
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r)
      threads.emplace_back([&, r] {
        const std::vector<int64_t> dims = {static_cast<int64_t>(count)};
        OperandRequest op;
        op.in_dtype = op.out_dtype = DType::kS32;
        op.in_dims = dims;
        op.out_dims = dims;
        op.in = x[r].data();
        op.out = in_place ? x[r].data() : y[r].data();
        CallRequest req;
        req.kind = Kind::kAllReduce;
        req.reduction = "sum";
        req.operands = {&op, 1};
        CallDesc desc;
        st[r] = DescribeCall(req, n, "faults_test", &desc);
        if (!st[r].ok()) return;
        auto call = comm->Join(r, run, "faults_test");
        st[r] = executor->Run(*call, r, desc);
      });
    for (auto& t : threads) t.join();
    *exact = true;
    for (int r = 0; r < n; ++r)
      *exact &= st[r].ok() && (in_place ? x[r] : y[r]) == want;
    return st;
  }
};

std::string Messages(const std::vector<Status>& st) {
  std::string m;
  for (const Status& s : st)
    if (!s.ok()) return s.message();
  return m;
}

LinkHealthSnapshot HealthOf(Rig& rig, const std::string& link) {
  std::vector<LinkHealthSnapshot> all;
  rig.executor->health()->Snapshot(&all);
  for (const auto& h : all)
    if (h.link == link) return h;
  return {};
}

void TestFailoverOfATouchedRange() {
  const size_t count = 1 << 16;  // 256 KiB per rank
  Rig rig(4, std::make_unique<ScribbleChannel>(), {0.5, 0.5}, 1 << 18);
  const uint64_t before = FailoverCount();
  bool exact = false;
  auto st = rig.AllReduce(count, /*in_place=*/false, &exact);
  Expect(exact, "a broken link's range (written, then failed) re-runs on shm exactly: " + Messages(st));
  Expect(FailoverCount() == before + 1, "one failover counted");
  const LinkHealthSnapshot h = HealthOf(rig, "scribble");
  Expect(h.state == LinkState::kUnhealthy && h.errors == 1 && Contains(h.reason, "the link broke"),
         "the broken link is unhealthy with its error as the reason: " + h.reason);
  // The next calls exclude it (shm alone, exact) until its probe fails over again.
  st = rig.AllReduce(count, false, &exact);
  Expect(exact && FailoverCount() == before + 1, "an unhealthy link gets no range: " + Messages(st));
  // In place, the scribbled input cannot be recovered: the call fails and says why.
  Rig aliased(4, std::make_unique<ScribbleChannel>(), {0.5, 0.5}, 1 << 18);
  st = aliased.AllReduce(count, /*in_place=*/true, &exact);
  const std::string m = Messages(st);
  Expect(!exact && Contains(m, "in-place") && Contains(m, "cannot be recovered") && Contains(m, "scribble"),
         "in place, a range a failed link may have written is an error naming it: " + m);
}

void TestInjectedFaultsInPlace() {
  // Injected faults fire before the link touches anything: failover is exact even in place.
  const size_t count = 1 << 16;
  Rig rig(4, ShmLink("scribble").Open(std::vector<int64_t>{100, 101, 102, 103}), {0.5, 0.5}, 1 << 18);
  Expect(ConfigureLinks("shm;emulated:scribble@gbps=100").ok(), "configure two links for the fault names");
  Expect(SetFaults("scribble:error@at_call=1").ok(), "inject an error");
  bool exact = false;
  auto st = rig.AllReduce(count, /*in_place=*/true, &exact);
  Expect(exact, "an injected error's range re-runs exactly in place: " + Messages(st));
  Expect(HealthOf(rig, "scribble").state == LinkState::kUnhealthy, "the injected link is unhealthy");
  // Probed back: a non-sticky error is over, so the probe succeeds and re-admits the link.
  HealthOptions o = GetHealthOptions();
  o.probe_calls = 2;
  o.probe_bytes = 64 << 10;
  SetHealthOptions(o);
  rig.executor->health()->Reset();
  Expect(SetFaults("scribble:error@at_call=1").ok(), "inject again");
  for (int i = 0; i < 4; ++i) {
    st = rig.AllReduce(count, false, &exact);
    Expect(exact, "call " + std::to_string(i) + " exact: " + Messages(st));
  }
  const LinkHealthSnapshot h = HealthOf(rig, "scribble");
  Expect(h.state == LinkState::kHealthy && h.probes == 1 && Contains(h.reason, "re-admitted"),
         "re-admitted after one probe: " + std::string(Name(h.state)) + " " + h.reason);
  // Both links failing: the error names the collective, the group and each link's report.
  Expect(SetFaults("scribble:error@at_call=1,sticky=1;shm:error@at_call=1,sticky=1").ok(), "inject both");
  st = rig.AllReduce(count, false, &exact);
  const std::string m = Messages(st);
  Expect(!exact && Contains(m, "all_reduce on group [100, 101, 102, 103]") && Contains(m, "no link could carry") &&
             Contains(m, "shm: ") && Contains(m, "scribble: ") && Contains(m, "injected error"),
         "no link left: " + m);
  // A hang ends at the link's deadline and fails over; later calls are not blocked by it.
  rig.executor->health()->Reset();
  o.link_timeout_s = 0.3;
  SetHealthOptions(o);
  Expect(SetFaults("scribble:hang@at_call=1").ok(), "inject a hang");
  const auto t0 = std::chrono::steady_clock::now();
  st = rig.AllReduce(count, false, &exact);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  Expect(exact && secs < 0.3 + 3, "a hang fails over at the link's deadline: " + std::to_string(secs) + " s " +
                                      Messages(st));
  st = rig.AllReduce(count, false, &exact);
  Expect(exact, "the call after a hang runs: " + Messages(st));
  Expect(SetFaults("").ok(), "clear");
  SetHealthOptions(HealthOptions{});
  Expect(ConfigureLinks("shm").ok(), "back to shm");
}

// A real tcp ring that stops mid-range (one rank's socket writes stop: a test hook, no injected fault)
// ends at the lane's own deadline, not at the global socket deadline, and its range fails over to
// shm in the same call, exactly; the error names the collective, the group, the link and the peer
// that was waited for.
void TestRealTcpStallFailsOverAtTheLinksDeadline() {
  const size_t count = 1 << 16;  // 256 KiB per rank: several pipeline chunks on the ring
  const std::vector<int64_t> devices = {100, 101, 102, 103};
  auto tcp = std::make_unique<TcpChannel>("tcp", devices);
  TcpChannel* ring = tcp.get();
  Expect(ring->health().ok(), "the ring connects: " + ring->health().message());
  Rig rig(4, std::move(tcp), {0.5, 0.5}, 1 << 18, "tcp");
  HealthOptions o = GetHealthOptions();
  o.link_timeout_s = 0.3;
  o.probe_calls = 2;  // probed 2 group calls after the failure (below)
  SetHealthOptions(o);
  bool exact = false;
  auto st = rig.AllReduce(count, false, &exact);
  Expect(exact, "a clean split call over shm and the real ring is exact: " + Messages(st));
  ring->StallSendsForTest(2, 1);
  const uint64_t before = FailoverCount();
  const auto t0 = std::chrono::steady_clock::now();
  st = rig.AllReduce(count, false, &exact);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("  real tcp stall: failed over after %.3f s (link deadline 0.3 s, global %g s)\n", secs,
              TimeoutSeconds());
  // The global timeout is 10 s here: failing over well before it is the link's deadline at work.
  Expect(exact && secs < 0.3 + 3, "a stalled ring's range fails over at the link's deadline: " +
                                      std::to_string(secs) + " s " + Messages(st));
  Expect(FailoverCount() == before + 1, "one failover counted");
  const LinkHealthSnapshot h = HealthOf(rig, "tcp");
  Expect(h.state == LinkState::kUnhealthy && Contains(h.reason, "missed its deadline of 0.3 s") &&
             Contains(h.reason, "all_reduce") && Contains(h.reason, "group [100, 101, 102, 103]") &&
             Contains(h.reason, "link tcp") && Contains(h.reason, "waiting for rank"),
         "the ring is unhealthy, its reason names collective, group, link and peer: " + h.reason);
  st = rig.AllReduce(count, false, &exact);
  Expect(exact, "the next call runs on shm: " + Messages(st));
  Expect(!ring->health().ok() && ring->reconnects() == 0, "the ring stays broken while the link is excluded (call 3)");
  // The health probe (probe_calls group calls after the failure) gives the link a small range again:
  // the ring is connected anew (fresh listeners and token) by that call, the probe succeeds and the
  // link is re-admitted; the calls after it split over both links again, exactly.
  int calls = 0;
  while (HealthOf(rig, "tcp").state != LinkState::kHealthy && calls < 8) {
    st = rig.AllReduce(count, false, &exact);
    Expect(exact, "exact while the link is probed: " + Messages(st));
    ++calls;
  }
  const LinkHealthSnapshot back = HealthOf(rig, "tcp");
  std::printf("  real tcp stall: re-admitted after %d more calls (%llu reconnect): %s\n", calls,
              static_cast<unsigned long long>(ring->reconnects()), back.reason.c_str());
  Expect(back.state == LinkState::kHealthy && back.probes >= 1 && Contains(back.reason, "re-admitted") &&
             ring->reconnects() == 1 && ring->health().ok(),
         "the probe reconnected the ring and re-admitted the link: " + back.reason);
  const uint64_t now = FailoverCount();
  for (int i = 0; i < 3; ++i) {
    st = rig.AllReduce(count, false, &exact);
    Expect(exact, "a split call over the reconnected ring: " + Messages(st));
  }
  Expect(FailoverCount() == now && HealthOf(rig, "tcp").state == LinkState::kHealthy,
         "the reconnected ring carries its ranges (no failover)");
  SetHealthOptions(HealthOptions{});
}

}  // namespace
}  // namespace flexlink

int main() {
  flexlink::SetTimeoutSeconds(10);
  flexlink::TestParser();
  flexlink::TestFailoverOfATouchedRange();
  flexlink::TestInjectedFaultsInPlace();
  flexlink::TestRealTcpStallFailsOverAtTheLinksDeadline();
  return flexlink::testing::Summary();
}
