// The GPU engine's stream discipline where it is easy to get wrong, on the simulated device
// (tests/cpp/sim), with a device subclass of this file's own that counts every stream's work,
// fails or stalls chosen operations and slows the kernels:
//   - errors after a fork: a call that fails half way through its enqueue (a copy or kernel
//     refused on one rank, the others stopped by the pcie gate) still joins every stream it forked
//     back into XLA's stream, so XLA's next operation runs after all of the call's device work;
//     and a peer's range left waiting for a rank that gave up is released by the hang detector;
//   - the timing slots' lock: stats() and the watchdog's poll return while a rank is blocked inside
//     its enqueue (a host call that stalls, the pcie gate waiting for that rank);
//   - buffer reuse across calls: consecutive calls on two different XLA streams (multi-stream
//     scheduling) with slow kernels and jitter, bitwise against the reference, through the links'
//     double-buffered scratch (pcie's recv/send, nccl's staging).
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "tests/cpp/check.h"
#include "tests/cpp/gpu_cases.h"
#include "tests/cpp/reference.h"
#include "tests/cpp/sanitizers.h"
#include "tests/cpp/sim/sim_comm.h"
#include "tests/cpp/sim/sim_device.h"
#include "xla_ffi/core/config.h"
#include "xla_ffi/core/health.h"
#include "xla_ffi/cuda/gpu_engine.h"

namespace flexlink::testing {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Deadlines stretched under a sanitizer, but not as far as its whole slowdown: the failure tests
// wait out a deadline on purpose.
const double kStretch = std::min(kSanitizerSlowdown, 10.0);

// The simulated device, plus what these tests need (tests/cpp/sim is shared; this stays here):
//   - per stream, the operations the engine issued (host) and those done (device): after each of
//     its enqueuing entry points (before a Record) a counting operation goes on the same stream, so
//     "done >= n" means everything issued before the n-th count has run;
//   - an injected failure: the n-th copy (Copy, Copy2D) or kernel (Reduce) on a device returns an
//     error and enqueues nothing, as a failing CUDA call would;
//   - a stall: the n-th copy on a device holds its calling (host) thread for a while first (a slow
//     host call, such as NCCL's, inside a rank's enqueue);
//   - slow kernels: Reduce and Layout sleep on their stream first, so that a kernel still reading a
//     scratch buffer is overtaken by whatever is not ordered after it.
class JoinSim : public sim::SimDevice {
 public:
  enum class What { kCopy, kReduce };
  struct Counter {
    int device = 0;
    bool xla = false;
    std::atomic<uint64_t> issued{0}, done{0};
  };

  using SimDevice::SimDevice;

  Status CreateStream(int device, gpu::Stream* stream) override {
    FLEXLINK_RETURN_IF_ERROR(SimDevice::CreateStream(device, stream));
    auto c = std::make_shared<Counter>();
    c->device = device;
    std::lock_guard<std::mutex> lock(mu_);
    counters_[*stream] = c;
    return Status::Ok();
  }
  // A record's count goes before it (the record captures it): a join is a record waited on, and
  // everything up to the record is what the join covers.
  Status Record(gpu::Event e, gpu::Stream s) override {
    (void)Tick(s, Status::Ok());
    return SimDevice::Record(e, s);
  }
  Status Wait(gpu::Stream s, gpu::Event e) override { return Tick(s, SimDevice::Wait(s, e)); }
  Status Copy(void* dst, const void* src, size_t bytes, gpu::Stream s) override {
    FLEXLINK_RETURN_IF_ERROR(Inject(What::kCopy, s));
    return Tick(s, SimDevice::Copy(dst, src, bytes, s));
  }
  Status Copy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                gpu::Stream s) override {
    FLEXLINK_RETURN_IF_ERROR(Inject(What::kCopy, s));
    return Tick(s, SimDevice::Copy2D(dst, dpitch, src, spitch, width, height, s));
  }
  Status Zero(void* dst, size_t bytes, gpu::Stream s) override { return Tick(s, SimDevice::Zero(dst, bytes, s)); }
  Status Reduce(const gpu::ReduceArgs& a, gpu::Stream s) override {
    FLEXLINK_RETURN_IF_ERROR(Inject(What::kReduce, s));
    SlowKernel(s);
    return Tick(s, SimDevice::Reduce(a, s));
  }
  Status Layout(const gpu::LayoutArgs& a, gpu::Stream s) override {
    SlowKernel(s);
    return Tick(s, SimDevice::Layout(a, s));
  }
  Status Delay(double seconds, gpu::Stream s) override { return Tick(s, SimDevice::Delay(seconds, s)); }
  Status WaitFlag(const uint32_t* flag, double max_seconds, gpu::Stream s) override {
    return Tick(s, SimDevice::WaitFlag(flag, max_seconds, s));
  }

  // Streams made so far are XLA's (the harness's), not the engine's.
  void MarkXlaStreams() {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [s, c] : counters_) c->xla = true;
  }
  // Every engine stream: `us` before each operation (0: off).
  void SlowEngineStreams(int us) {
    std::vector<gpu::Stream> streams;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [s, c] : counters_)
        if (!c->xla) streams.push_back(s);
    }
    for (gpu::Stream s : streams) SetStreamDelay(s, us);
  }
  void SetKernelDelay(int us) { kernel_delay_us_.store(us); }
  // The n-th (from 1) operation of kind `what` on `device` from now on fails, after holding its
  // calling thread for `delay` seconds (so that the peers are past the point where they would learn
  // of the failure: a channel that failed is off for every rank's later enqueues, gpu_link.h).
  void FailNth(What what, int device, int n, double delay = 0) {
    std::lock_guard<std::mutex> lock(mu_);
    fail_ = {what, device, n, delay};
    injected_ = 0;
  }
  int injected() const { return injected_.load(); }
  // The n-th copy on `device` from now on first holds its calling thread for `seconds`.
  void StallNthCopy(int device, int n, double seconds) {
    std::lock_guard<std::mutex> lock(mu_);
    stall_ = {device, n, seconds};
  }
  bool stalling() const { return stalling_.load(); }
  int stalls() const { return stalls_.load(); }  // stalls that began

  // A later operation on XLA's stream: enqueued on `xla` now, it records, when it runs, how many
  // engine streams of `device` still had work issued before it pending (0: XLA's stream waited for
  // all of it), and how many had pending work when it was enqueued (the check's premise).
  struct Marker {
    std::atomic<bool> ran{false};
    int pending_at_enqueue = 0;
    std::atomic<int> pending_at_run{-1};
  };
  void EnqueueMarker(gpu::Stream xla, int device, Marker* m) {
    std::vector<std::pair<std::shared_ptr<Counter>, uint64_t>> snap;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [s, c] : counters_) {
        if (c->xla || c->device != device) continue;
        const uint64_t issued = c->issued.load();
        snap.emplace_back(c, issued);
        m->pending_at_enqueue += c->done.load() < issued;
      }
    }
    Enqueue(xla, [snap, m] {
      int pending = 0;
      for (const auto& [c, n] : snap) pending += c->done.load() < n;
      m->pending_at_run.store(pending);
      m->ran.store(true);
    });
  }

 private:
  struct Fail {
    What what = What::kCopy;
    int device = -1;
    int n = 0;
    double delay = 0;
  };
  struct Stall {
    int device = -1;
    int n = 0;
    double seconds = 0;
  };
  std::shared_ptr<Counter> CounterOf(gpu::Stream s) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = counters_.find(s);
    return it == counters_.end() ? nullptr : it->second;
  }
  Status Tick(gpu::Stream s, Status st) {
    if (!st.ok()) return st;
    if (std::shared_ptr<Counter> c = CounterOf(s)) {
      c->issued.fetch_add(1);
      Enqueue(s, [c] { c->done.fetch_add(1); });
    }
    return st;
  }
  Status Inject(What what, gpu::Stream s) {
    std::shared_ptr<Counter> c = CounterOf(s);
    if (!c) return Status::Ok();
    double stall = 0;
    bool fail = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (fail_.n > 0 && fail_.what == what && fail_.device == c->device && --fail_.n == 0) {
        fail = true;
        stall = fail_.delay;
      } else if (what == What::kCopy && stall_.n > 0 && stall_.device == c->device && --stall_.n == 0) {
        stall = stall_.seconds;
      }
    }
    if (fail) {
      if (stall > 0) std::this_thread::sleep_for(std::chrono::duration<double>(stall));
      injected_.fetch_add(1);
      return Status::Internal(std::string("sim: an injected failure of a ") +
                              (what == What::kCopy ? "copy" : "kernel") + " on device " + std::to_string(c->device));
    }
    if (stall > 0) {
      stalls_.fetch_add(1);
      stalling_.store(true);
      std::this_thread::sleep_for(std::chrono::duration<double>(stall));
      stalling_.store(false);
    }
    return Status::Ok();
  }
  void SlowKernel(gpu::Stream s) {
    const int us = kernel_delay_us_.load();
    if (us > 0) Enqueue(s, [us] { std::this_thread::sleep_for(std::chrono::microseconds(us)); });
  }

  std::mutex mu_;
  std::map<gpu::Stream, std::shared_ptr<Counter>> counters_;
  Fail fail_;
  Stall stall_;
  std::atomic<int> injected_{0};
  std::atomic<bool> stalling_{false};
  std::atomic<int> stalls_{0};
  std::atomic<int> kernel_delay_us_{0};
};

// Ranks on their own devices, each with two XLA streams (multi-stream scheduling hands consecutive
// collectives different ones).
struct Fixture {
  explicit Fixture(int ranks, sim::SimOptions options = {}) : device(Opts(options, ranks)), comm(&device) {
    h.api = &device;
    h.ranks = ranks;
    h.device_of = [](int64_t id) { return static_cast<int>(id); };
    h.alloc = [this](int dev, size_t bytes) {
      (void)dev;
      return device.AllocBuffer(bytes);
    };
    h.upload = [](void* d, const void* s, size_t b) { std::memcpy(d, s, b); };
    h.download = [](void* d, const void* s, size_t b) { std::memcpy(d, s, b); };
    h.sync = [this](gpu::Stream) { device.SynchronizeAll(); };
    MakeStreams(h);
    second.resize(ranks);
    for (int r = 0; r < ranks; ++r) {
      (void)device.SetDevice(r);
      (void)device.CreateStream(r, &second[r]);
    }
    device.MarkXlaStreams();
    gpu::GpuEngineOptions eo;
    eo.device_of = h.device_of;
    engine = std::make_unique<gpu::GpuEngine>(&device, &comm, eo);
  }
  static sim::SimOptions Opts(sim::SimOptions o, int ranks) {
    o.devices = std::max(o.devices, ranks);
    return o;
  }
  gpu::Stream Xla(int rank, size_t call) const { return call % 2 ? second[rank] : h.streams[rank]; }
  void ExpectNoSimErrors(const std::string& what) {
    for (const std::string& e : device.TakeErrors()) Expect(false, what + ": " + e);
  }
  JoinSim device;
  sim::SimComm comm;
  Harness h;
  std::vector<gpu::Stream> second;
  std::unique_ptr<gpu::GpuEngine> engine;
};

// A sequence of calls, every rank on its own thread issuing them in order without waiting for the
// device in between (as XLA's device threads do); call j of rank r on stream_of(r, j). `after` runs
// on the rank's thread right after each of its calls returns. Inputs differ per call (seeded by the
// call's index too), so a buffer read after the next call overwrote it shows as wrong elements.
struct Sequence {
  std::vector<Case> cases;
  std::vector<std::vector<Status>> status;                               // [call][rank]
  std::vector<std::vector<std::vector<std::vector<uint8_t>>>> in, out;   // [call][rank][operand]
};

uint32_t Seed(size_t call, int rank, size_t operand) {
  return static_cast<uint32_t>(7919 * call + 1000 * rank + 17 * operand + 1);
}

void RunSequence(Fixture& f, Sequence* seq, const std::function<gpu::Stream(int, size_t)>& stream_of,
                 const std::function<void(int, size_t, const Status&)>& after = {}) {
  const int n = f.h.ranks;
  const size_t calls = seq->cases.size();
  std::vector<int64_t> groups, sizes{n};
  for (int r = 0; r < n; ++r) groups.push_back(r);
  struct Buffers {
    std::vector<std::vector<void*>> din, dout;               // [rank][operand]
    std::vector<std::vector<std::vector<int64_t>>> out_dims;  // [rank][operand]
    std::vector<int64_t> pairs;
    int64_t run = 0;
  };
  std::vector<Buffers> b(calls);
  seq->status.assign(calls, std::vector<Status>(n));
  seq->in.assign(calls, {});
  seq->out.assign(calls, {});
  for (size_t j = 0; j < calls; ++j) {
    const Case& c = seq->cases[j];
    const size_t k = c.dims.size();
    b[j].din.assign(n, std::vector<void*>(k));
    b[j].dout.assign(n, std::vector<void*>(k));
    b[j].out_dims.assign(n, std::vector<std::vector<int64_t>>(k));
    for (const auto& [s, d] : c.pairs) b[j].pairs.insert(b[j].pairs.end(), {s, d});
    b[j].run = NextRunId();
    seq->in[j].assign(n, std::vector<std::vector<uint8_t>>(k));
    seq->out[j].assign(n, std::vector<std::vector<uint8_t>>(k));
    for (int r = 0; r < n; ++r)
      for (size_t i = 0; i < k; ++i) {
        const size_t w = ByteWidth(c.dtypes[i]), in = Count(c.dims[i]), outc = OutCount(c, i, n);
        seq->in[j][r][i] = RandomData(c.dtypes[i], in, Seed(j, r, i), false);
        b[j].din[r][i] = f.h.alloc(r, in * w);
        f.h.upload(b[j].din[r][i], seq->in[j][r][i].data(), in * w);
        b[j].dout[r][i] = c.in_place ? b[j].din[r][i] : f.h.alloc(r, outc * w);
        if (!c.in_place) {
          std::vector<uint8_t> garbage(outc * w, 0xCD);
          f.h.upload(b[j].dout[r][i], garbage.data(), outc * w);
        }
        b[j].out_dims[r][i] = {static_cast<int64_t>(outc)};
      }
  }
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      for (size_t j = 0; j < calls; ++j) {
        std::vector<OperandRequest> ops;
        const CollectiveArgs a = RankArgs(seq->cases[j], groups, sizes, r, b[j].run, "join test", b[j].pairs,
                                          b[j].din[r], b[j].dout[r], b[j].out_dims[r], &ops);
        seq->status[j][r] = f.engine->Run(a, stream_of(r, j));
        if (after) after(r, j, seq->status[j][r]);
      }
    });
  for (auto& t : threads) t.join();
  f.device.SynchronizeAll();
  for (size_t j = 0; j < calls; ++j)
    for (int r = 0; r < n; ++r)
      for (size_t i = 0; i < seq->cases[j].dims.size(); ++i) {
        const size_t bytes = OutCount(seq->cases[j], i, n) * ByteWidth(seq->cases[j].dtypes[i]);
        seq->out[j][r][i].resize(bytes);
        f.h.download(seq->out[j][r][i].data(), b[j].dout[r][i], bytes);
      }
}

// Every call of `seq` succeeded on every rank and its results are the reference's, bitwise; returns
// the wrong elements in all.
size_t CheckSequence(const Sequence& seq, int n, const std::string& what) {
  size_t all = 0;
  for (size_t j = 0; j < seq.cases.size(); ++j) {
    const Case& c = seq.cases[j];
    bool ok = true;
    for (int r = 0; r < n; ++r) ok = ok && seq.status[j][r].ok();
    if (!ok) {
      for (int r = 0; r < n; ++r)
        Expect(seq.status[j][r].ok(), what + ": call " + std::to_string(j) + " (" + c.Name() + ") rank " +
                                          std::to_string(r) + ": " + seq.status[j][r].message());
      continue;
    }
    for (size_t i = 0; i < c.dims.size(); ++i) {
      std::vector<std::vector<uint8_t>> xs(n);
      for (int r = 0; r < n; ++r) xs[r] = seq.in[j][r][i];
      for (int r = 0; r < n; ++r) {
        const size_t wrong = CountWrong(c.dtypes[i], seq.out[j][r][i], Expected(c, i, n, r, xs));
        all += wrong;
        Expect(wrong == 0, what + ": call " + std::to_string(j) + " (" + c.Name() + ") operand " + std::to_string(i) +
                               " rank " + std::to_string(r) + ": " + std::to_string(wrong) + " wrong elements");
      }
    }
  }
  return all;
}

// One clean call of `c` on the first XLA streams (setup, and a check that the configuration runs).
void Warm(Fixture& f, const Case& c, const std::string& what) {
  Sequence seq;
  seq.cases = {c};
  RunSequence(f, &seq, [&](int r, size_t) { return f.h.streams[r]; });
  CheckSequence(seq, f.h.ranks, what + ": a clean call first");
}

// The failed call's verdict: every rank's marker (an operation enqueued on XLA's stream right after
// the rank's Run returned) ran after all of the rank's engine streams' work, and at least one rank
// had such work still pending when its marker was enqueued (else the check proves nothing).
void ExpectJoined(const std::vector<JoinSim::Marker>& markers, const std::string& what) {
  int premise = 0;
  std::string detail;
  for (size_t r = 0; r < markers.size(); ++r) {
    premise += markers[r].pending_at_enqueue;
    detail += " rank " + std::to_string(r) + ": " + std::to_string(markers[r].pending_at_enqueue) + " -> " +
              std::to_string(markers[r].pending_at_run.load()) + ";";
    Expect(markers[r].ran.load() && markers[r].pending_at_run.load() == 0,
           what + ": rank " + std::to_string(r) + "'s XLA stream ran its next operation with " +
               std::to_string(markers[r].pending_at_run.load()) +
               " engine stream(s) still running the failed call's work (not joined back)");
  }
  Expect(premise > 0, what + ": the failed call left work pending on some engine stream when its Run returned");
  std::printf("  %-64s engine streams pending at return -> when XLA's next op ran:%s\n", what.c_str(), detail.c_str());
}

// Joins on error, a: a pcie enqueue that fails after its streams were forked: rank 0's third copy
// is refused, the other rank's gate is aborted; by then rank 0's nccl range is on side stream 0 and
// both ranks have pcie copies on the link's own streams, forked from side stream 1. Every one of
// them must be joined back into XLA's stream before XLA's next operation, on every rank.
void TestPcieErrorAfterForkJoins() {
  SetAutotuneMinBytes(0);
  SetTimeoutSeconds(20);
  Fixture f(2, {.jitter_us = 10});
  Expect(f.engine->ConfigureLinks("nccl;pcie@slot_mib=0.0625").ok(), "pcie error: configure");
  const Case c{Kind::kAllReduce, ReduceOp::kSum, {DType::kF32}, {{100000}}, 0, {}, false};
  PinShares(*f.engine, c, 2, {0.5, 0.5});
  Warm(f, c, "pcie error");
  f.device.SlowEngineStreams(3000);  // the device far behind the host: the failed call's work pending
  f.device.FailNth(JoinSim::What::kCopy, 0, 3);
  std::vector<JoinSim::Marker> markers(2);
  Sequence seq;
  seq.cases = {c};
  RunSequence(f, &seq, [&](int r, size_t) { return f.h.streams[r]; },
              [&](int r, size_t, const Status&) { f.device.EnqueueMarker(f.h.streams[r], r, &markers[r]); });
  f.device.SlowEngineStreams(0);
  Expect(f.device.injected() == 1, "pcie error: the copy failure was injected");
  for (int r = 0; r < 2; ++r)
    Expect(!seq.status[0][r].ok() && seq.status[0][r].message().find("pcie") != std::string::npos,
           "pcie error: rank " + std::to_string(r) + " fails naming the link: " + seq.status[0][r].message());
  ExpectJoined(markers, "pcie copy refused on rank 0 after the fork (nccl;pcie 50/50)");
  f.ExpectNoSimErrors("pcie error");
}

// Joins on error, b: an nccl enqueue that fails after its kernel stream was forked: a staged all_reduce (bfloat16:
// NCCL gathers each chunk, the engine's kernel reduces it on the link's kernel stream) of two
// chunks, whose second reduction kernel is refused on rank 0 while the first, slow, still runs on
// the kernel stream, writing the output. Rank 0 must join both side stream 0 and the nccl link's
// kernel stream. The other rank completes its nccl range, then waits at the pcie gate for rank 0,
// which never comes, until the deadline.
void TestNcclErrorAfterForkJoins() {
  SetAutotuneMinBytes(0);
  SetTimeoutSeconds(1 * kStretch);
  Fixture f(2, {.jitter_us = 10});
  Expect(f.engine->ConfigureLinks("nccl@staging_mib=0.0625;pcie@slot_mib=0.0625").ok(), "nccl error: configure");
  // 25000 units on nccl: two staged chunks of at most 16384 (64 KiB over 2 ranks of 2 bytes).
  const Case c{Kind::kAllReduce, ReduceOp::kSum, {DType::kBF16}, {{50000}}, 0, {}, false};
  PinShares(*f.engine, c, 2, {0.5, 0.5});
  Warm(f, c, "nccl error");
  f.device.SlowEngineStreams(20000);
  f.device.SetKernelDelay(300000);
  f.device.FailNth(JoinSim::What::kReduce, 0, 2, 0.5 * kStretch);  // rank 1's nccl range enqueued meanwhile
  std::vector<JoinSim::Marker> markers(2);
  Sequence seq;
  seq.cases = {c};
  RunSequence(f, &seq, [&](int r, size_t) { return f.h.streams[r]; },
              [&](int r, size_t, const Status&) { f.device.EnqueueMarker(f.h.streams[r], r, &markers[r]); });
  f.device.SlowEngineStreams(0);
  f.device.SetKernelDelay(0);
  Expect(f.device.injected() == 1, "nccl error: the kernel failure was injected");
  Expect(!seq.status[0][0].ok() && seq.status[0][0].message().find("nccl") != std::string::npos,
         "nccl error: rank 0 fails naming the link: " + seq.status[0][0].message());
  Expect(!seq.status[0][1].ok() && seq.status[0][1].code() == StatusCode::kDeadlineExceeded,
         "nccl error: rank 1 fails at the pcie gate's deadline: " + seq.status[0][1].message());
  ExpectJoined(markers, "nccl kernel refused on rank 0 after the fork (nccl;pcie 50/50)");
  f.ExpectNoSimErrors("nccl error");
  SetTimeoutSeconds(20);
}

// Joins on error, c: the join must not wait forever: rank 0's staged nccl range fails at its first chunk's kernel,
// after its first gather; rank 1 issues all four chunks' gathers, so its second one waits for a
// rank 0 that gave up. Rank 1's call then fails at the pcie gate, and its XLA stream, joined to that
// range, would wait forever, but for the hang detector: the failed call's ranges are watched too,
// so past link_timeout_s the group is broken and the communicators aborted, which releases the
// stream. Everything drains within the deadlines; the next call fails at once naming the break.
void TestFailedCallWatchedByHangDetector() {
  SetAutotuneMinBytes(0);
  SetTimeoutSeconds(1 * kStretch);
  const HealthOptions saved = GetHealthOptions();
  HealthOptions o = saved;
  o.link_timeout_s = 0.3 * kStretch;
  SetHealthOptions(o);
  Fixture f(2, {.jitter_us = 10, .wait_timeout_s = 8 * kStretch});
  Expect(f.engine->ConfigureLinks("nccl@staging_mib=0.0625;pcie@slot_mib=0.0625").ok(), "detector: configure");
  const Case c{Kind::kAllReduce, ReduceOp::kSum, {DType::kBF16}, {{100000}}, 0, {}, false};  // 4 staged chunks
  PinShares(*f.engine, c, 2, {0.5, 0.5});
  ResetHealth();
  Warm(f, c, "detector");
  f.device.FailNth(JoinSim::What::kReduce, 0, 1, 0.5 * kStretch);  // rank 1's four gathers enqueued meanwhile
  std::vector<JoinSim::Marker> markers(2);
  Sequence seq;
  seq.cases = {c};
  const auto t0 = Clock::now();
  RunSequence(f, &seq, [&](int r, size_t) { return f.h.streams[r]; },
              [&](int r, size_t, const Status&) { f.device.EnqueueMarker(f.h.streams[r], r, &markers[r]); });
  const double drained = Seconds(t0);
  Expect(!seq.status[0][0].ok() && !seq.status[0][1].ok(), "detector: the call fails on both ranks");
  ExpectJoined(markers, "nccl range of a failed call left waiting for a peer");
  Expect(drained < TimeoutSeconds() + 2 * o.link_timeout_s + 1.5 * kStretch,
         "detector: drained " + std::to_string(drained) + " s after the call began (released, not timed out)");
  const int aborted = f.comm.aborts();
  Expect(aborted == 2, "detector: both communicators aborted (" + std::to_string(aborted) + ")");
  seq.cases = {c};
  const auto t1 = Clock::now();
  RunSequence(f, &seq, [&](int r, size_t) { return f.h.streams[r]; });
  for (int r = 0; r < 2; ++r)
    Expect(!seq.status[0][r].ok() && seq.status[0][r].message().find("the group is broken") != std::string::npos &&
               seq.status[0][r].message().find("nccl range") != std::string::npos,
           "detector: the next call fails naming the break on rank " + std::to_string(r) + ": " +
               seq.status[0][r].message());
  Expect(Seconds(t1) < 1.0 * kStretch, "detector: the next call fails at once");
  std::printf("  failed call's nccl range released by the hang detector: drained in %.2f s\n", drained);
  f.ExpectNoSimErrors("detector");
  SetHealthOptions(saved);
  ResetHealth();
  SetTimeoutSeconds(20);
}

// The timing slots' lock is not held across the links' enqueues: while rank 1 is stalled in a
// host call inside its pcie enqueue (and rank 0 waits for it at the pcie gate), the engine's poll
// (stats(), and the watchdog's hang detection: PollAll) returns at once; the call then completes
// exactly.
void TestPollWhileEnqueueBlocked() {
  SetAutotuneMinBytes(0);
  SetTimeoutSeconds(20);
  Fixture f(2);
  Expect(f.engine->ConfigureLinks("pcie@slot_mib=0.0625").ok(), "poll: configure");
  const Case c{Kind::kAllReduce, ReduceOp::kSum, {DType::kF32}, {{40000}}, 0, {}, false};
  Warm(f, c, "poll");
  const double stall = 2.0 * std::min(kStretch, 3.0);
  f.device.StallNthCopy(1, 1, stall);
  double polled = -1;
  bool during = false;  // the poll returned while rank 1 was still stalled inside its enqueue
  std::thread poller([&] {
    const auto t0 = Clock::now();
    while (!f.device.stalling() && Seconds(t0) < 10) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // rank 0 reaches the gate meanwhile
    const auto t1 = Clock::now();
    f.engine->PollTimings();
    polled = Seconds(t1);
    during = f.device.stalling();
  });
  Sequence seq;
  seq.cases = {c};
  RunSequence(f, &seq, [&](int r, size_t) { return f.h.streams[r]; });
  poller.join();
  Expect(f.device.stalls() == 1 && during, "poll: rank 1 stalled inside its enqueue (" +
                                              std::to_string(f.device.stalls()) + " stalls) and the poll "
                                              "returned during it");
  Expect(polled >= 0 && polled < 0.25 * stall,
         "poll: PollTimings returned in " + std::to_string(polled) + " s while a rank was blocked " +
             std::to_string(stall) + " s inside its enqueue");
  CheckSequence(seq, 2, "poll: the stalled call");
  std::printf("  poll while rank 1 stalled %.1f s in its enqueue: returned in %.4f s\n", stall, polled);
  f.ExpectNoSimErrors("poll");
}

// Scratch across calls: consecutive calls alternating between two XLA streams, nothing ordering one call after the
// previous one but the engine's own waits: each link's scratch buffer (pcie's recv/send, nccl's
// staging) is written by the next call only after the previous call's last reader is done. Slow
// kernels (the readers of recv) and jitter make an overtaking copy or gather likely.
void RunAlternating(const std::string& links, const std::vector<Case>& kinds, int rounds, const std::string& what) {
  SetAutotuneMinBytes(0);
  SetTimeoutSeconds(20);
  Fixture f(2, {.jitter_us = 20});
  Expect(f.engine->ConfigureLinks(links).ok(), what + ": configure");
  Warm(f, kinds[0], what);
  f.device.SetKernelDelay(2000);
  Sequence seq;
  for (int i = 0; i < rounds; ++i) seq.cases.insert(seq.cases.end(), kinds.begin(), kinds.end());
  const auto t0 = Clock::now();
  RunSequence(f, &seq, [&](int r, size_t j) { return f.Xla(r, j); });
  f.device.SetKernelDelay(0);
  const size_t wrong = CheckSequence(seq, 2, what);
  std::printf("  %-64s %3zu calls, %zu wrong elements, %.2f s\n", what.c_str(), seq.cases.size(), wrong, Seconds(t0));
  f.ExpectNoSimErrors(what);
}

void TestTwoXlaStreams() {
  // pcie: an odd number of chunks per call, so that consecutive calls' first chunks meet the
  // previous call's last buffer; every kind whose schedule goes through recv (and send).
  const int64_t N = 2;
  RunAlternating("pcie@slot_mib=0.0625",
                 {{Kind::kAllReduce, ReduceOp::kSum, {DType::kF32}, {{3 * 8192 + 100}}, 0, {}, false},
                  {Kind::kAllGather, ReduceOp::kSum, {DType::kF32}, {{3, 3 * 16384 / 3 + 7}}, 1, {}, false},
                  {Kind::kReduceScatter, ReduceOp::kSum, {DType::kF32}, {{N * (3 * 4096 + 5)}}, 0, {}, false},
                  {Kind::kAllToAll, ReduceOp::kSum, {DType::kF32}, {{3, N * (4096 + 11)}}, 1, {}, false}},
                 3, "pcie alone, calls alternating between two XLA streams");
  // nccl, staged through its scratch (bfloat16 sums gathered and reduced by the engine's kernel,
  // all_gather / all_to_all with outer > 1 unpacked by a kernel, reduce_scatter packed first).
  RunAlternating("nccl@staging_mib=0.0625",
                 {{Kind::kAllReduce, ReduceOp::kSum, {DType::kBF16}, {{3 * 16384 + 100}}, 0, {}, false},
                  {Kind::kAllGather, ReduceOp::kSum, {DType::kF32}, {{3, 3 * 8192 / 3 + 7}}, 1, {}, false},
                  {Kind::kReduceScatter, ReduceOp::kSum, {DType::kF32}, {{3, N * (8192 / 3 + 5)}}, 1, {}, false},
                  {Kind::kAllToAll, ReduceOp::kSum, {DType::kF32}, {{3, N * (8192 / 3 + 11)}}, 1, {}, false}},
                 3, "nccl alone (staged), calls alternating between two XLA streams");
}

}  // namespace
}  // namespace flexlink::testing

int main(int argc, char** argv) {
  using namespace flexlink::testing;
  SelectTests(argc, argv);
  flexlink::SetTimeoutSeconds(20);
  flexlink::SetTuneCachePath("/tmp/flexlink-gpu-sim-join-none.json");
  flexlink::SetTuneUseCache(false);
  Timed("TestPcieErrorAfterForkJoins", TestPcieErrorAfterForkJoins);
  Timed("TestNcclErrorAfterForkJoins", TestNcclErrorAfterForkJoins);
  Timed("TestFailedCallWatchedByHangDetector", TestFailedCallWatchedByHangDetector);
  Timed("TestPollWhileEnqueueBlocked", TestPollWhileEnqueueBlocked);
  Timed("TestTwoXlaStreams", TestTwoXlaStreams);
  return Summary();
}
