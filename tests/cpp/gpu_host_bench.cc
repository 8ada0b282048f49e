// The GPU engine's own host cost per call, measured without a GPU: ranks as threads (XLA's device
// threads), each calling GpuEngine::Run back to back, over a device and a collective library that do
// nothing (every operation counted and returned at once, every event complete). What remains is
// FlexLink's host path: the group's arrival (a host rendezvous of the ranks), the plan, the timing
// slots, the links' enqueue logic. Beside it, the runtime operations each rank issues per call, to
// be costed with the runtime's own per-operation times on a GPU (cudaEventRecord,
// cudaStreamWaitEvent, a kernel launch, ncclAllReduce's launch): together they bound the host part
// of the 4 KiB AllReduce budget of issue 12 (within 10 us of the native collective). docs/cuda.md,
// "The host path of a call".
//
// It also counts the heap allocations (operator new, replaced in this program) per rank and call.
//
//   gpu_host_bench [--ranks 2,4] [--links 'nccl,pcie,nccl;pcie'] [--bytes 4096] [--calls 20000] [--reps 5]
//
// Not a test: it checks nothing but that every call returned OK. bazel run //tests/cpp:gpu_host_bench.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "xla_ffi/core/call.h"
#include "xla_ffi/core/config.h"
#include "xla_ffi/cuda/comm_api.h"
#include "xla_ffi/cuda/device_api.h"
#include "xla_ffi/cuda/gpu_engine.h"

// Every heap allocation of the program, to print allocations per call (the host path's malloc and
// free were a fifth of its time: docs/cuda.md, "The host path of a call").
static std::atomic<uint64_t> g_allocations{0};

void* operator new(std::size_t size) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(size ? size : 1)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t size) { return ::operator new(size); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }

namespace flexlink::bench {
namespace {

using gpu::Comm;
using gpu::CommOp;
using gpu::CommType;
using gpu::Event;
using gpu::Poll;
using gpu::Stream;

// What a rank's call enqueues, by operation (summed over ranks; divided by ranks x calls to print).
enum Op { kRecord, kWait, kCopy, kKernel, kNccl, kGroup, kQuery, kOps };
constexpr const char* kOpNames[kOps] = {"record", "wait", "copy", "kernel", "nccl", "group", "query"};

class Counts {
 public:
  void Add(Op op) { counts_[op].fetch_add(1, std::memory_order_relaxed); }
  std::vector<uint64_t> Take() {
    std::vector<uint64_t> out;
    for (auto& c : counts_) out.push_back(c.exchange(0));
    return out;
  }

 private:
  std::atomic<uint64_t> counts_[kOps] = {};
};

// A device on which nothing runs: handles are distinct addresses, memory is real host memory (the
// engine's set-up writes flags and reads back nothing else), every event has completed, and every
// elapsed time is 10 us.
class NullDevice : public gpu::DeviceApi {
 public:
  NullDevice(int devices, Counts* counts) : devices_(devices), counts_(*counts) {}
  int DeviceCount(std::string*) override { return devices_; }
  Status GetDevice(int* device) override {
    *device = current_;
    return Status::Ok();
  }
  Status SetDevice(int device) override {
    current_ = device;
    return Status::Ok();
  }
  Status CreateStream(int, Stream* stream) override {
    *stream = Handle();
    return Status::Ok();
  }
  Status CreateEvent(int, bool, Event* event) override {
    *event = Handle();
    return Status::Ok();
  }
  Status AllocDevice(int, size_t bytes, void** ptr) override { return Alloc(bytes, ptr); }
  Status AllocPinnedHost(size_t bytes, void** ptr) override { return Alloc(bytes, ptr); }
  Status DestroyStream(Stream) override { return Status::Ok(); }
  Status DestroyEvent(Event) override { return Status::Ok(); }
  Status FreeDevice(void* ptr) override { return Free(ptr); }
  Status FreePinnedHost(void* ptr) override { return Free(ptr); }
  Status PreloadKernels(int) override { return Status::Ok(); }
  Status Record(Event, Stream) override { return Count(kRecord); }
  Status Wait(Stream, Event) override { return Count(kWait); }
  Status Copy(void*, const void*, size_t, Stream) override { return Count(kCopy); }
  Status Copy2D(void*, size_t, const void*, size_t, size_t, size_t, Stream) override { return Count(kCopy); }
  Status Zero(void*, size_t, Stream) override { return Count(kKernel); }
  Status Reduce(const gpu::ReduceArgs&, Stream) override { return Count(kKernel); }
  Status Layout(const gpu::LayoutArgs&, Stream) override { return Count(kKernel); }
  Status MallocAsync(size_t bytes, Stream, void** ptr) override { return Alloc(bytes, ptr); }
  Status FreeAsync(void* ptr, Stream) override { return Free(ptr); }
  Status Delay(double, Stream) override { return Count(kKernel); }
  Status WaitFlag(const uint32_t*, double, Stream) override { return Count(kKernel); }
  Poll Query(Event, std::string*) override {
    counts_.Add(kQuery);
    return Poll::kDone;
  }
  Poll QueryStream(Stream, std::string*) override { return Poll::kDone; }
  Status ElapsedSeconds(Event, Event, double* seconds) override {
    *seconds = 10e-6;
    return Status::Ok();
  }

 private:
  Stream Handle() { return reinterpret_cast<Stream>(next_handle_.fetch_add(1) * 64); }
  Status Count(Op op) {
    counts_.Add(op);
    return Status::Ok();
  }
  static Status Alloc(size_t bytes, void** ptr) {
    *ptr = std::calloc(std::max<size_t>(bytes, 1), 1);
    return *ptr ? Status::Ok() : Status::Internal("null device: out of host memory");
  }
  static Status Free(void* ptr) {
    std::free(ptr);
    return Status::Ok();
  }

  const int devices_;
  Counts& counts_;
  std::atomic<uintptr_t> next_handle_{1};
  static thread_local int current_;
};
thread_local int NullDevice::current_ = 0;

// NCCL that issues nothing: communicators are handles, every operation is counted and returns.
class NullComm : public gpu::CommApi {
 public:
  explicit NullComm(Counts* counts) : counts_(*counts) {}
  Status InitAll(std::span<const int> devices, std::vector<Comm>* comms) override {
    comms->clear();
    for (size_t i = 0; i < devices.size(); ++i) comms->push_back(reinterpret_cast<Comm>(next_.fetch_add(1) * 64));
    return Status::Ok();
  }
  Status GroupStart() override { return Count(kGroup); }
  Status GroupEnd() override { return Count(kGroup); }
  Status AllReduce(const void*, void*, size_t, CommType, CommOp, Comm, Stream) override { return Count(kNccl); }
  Status AllGather(const void*, void*, size_t, CommType, Comm, Stream) override { return Count(kNccl); }
  Status ReduceScatter(const void*, void*, size_t, CommType, CommOp, Comm, Stream) override { return Count(kNccl); }
  Status Send(const void*, size_t, CommType, int, Comm, Stream) override { return Count(kNccl); }
  Status Recv(void*, size_t, CommType, int, Comm, Stream) override { return Count(kNccl); }
  Status Abort(Comm) override { return Status::Ok(); }
  Status Destroy(Comm, double) override { return Status::Ok(); }

 private:
  Status Count(Op op) {
    counts_.Add(op);
    return Status::Ok();
  }
  Counts& counts_;
  std::atomic<uintptr_t> next_{1};
};

struct Result {
  double us_per_call = 0;            // median over the repetitions
  double us_min = 0, us_max = 0;     // the repetitions' extremes
  std::vector<double> ops_per_call;  // per rank and call, by Op
  double allocations_per_call = 0;   // per rank and call (the threads' own start included, ~0)
  std::string error;
};

// `reps` repetitions of `calls` all_reduce calls of `bytes` float32 on every rank, each rank a thread
// calling Run back to back (the first repetition's set-up call excluded).
Result Measure(int ranks, const std::string& links, size_t bytes, int calls, int reps) {
  Result result;
  Counts counts;
  NullDevice device(ranks, &counts);
  NullComm comm(&counts);
  gpu::GpuEngine engine(&device, &comm);
  if (Status s = engine.ConfigureLinks(links); !s.ok()) {
    result.error = s.message();
    return result;
  }
  const int64_t count = static_cast<int64_t>(bytes / 4);
  std::vector<int64_t> groups, sizes{ranks};
  for (int r = 0; r < ranks; ++r) groups.push_back(r);
  std::vector<std::vector<float>> in(ranks, std::vector<float>(count, 1.0f)), out(ranks, std::vector<float>(count));
  std::vector<Stream> streams(ranks);
  for (int r = 0; r < ranks; ++r) (void)device.CreateStream(r, &streams[r]);
  const std::vector<int64_t> dims{count};
  std::vector<Status> status(ranks);
  const int64_t run = 1;
  auto round = [&](int k) {
    std::vector<std::thread> threads;
    for (int r = 0; r < ranks; ++r)
      threads.emplace_back([&, r] {
        (void)device.SetDevice(r);
        OperandRequest op{DType::kF32, DType::kF32, dims, dims, in[r].data(), out[r].data()};
        CollectiveArgs a;
        a.groups = groups;
        a.group_sizes = sizes;
        a.device = r;
        a.run_id = run;
        a.label = "psum over axes ('i',)";  // as jax_flexlink.psum labels its calls (longer than SSO)
        a.request.kind = Kind::kAllReduce;
        a.request.reduction = "sum";
        a.request.operands = {&op, 1};
        for (int i = 0; i < k && status[r].ok(); ++i) status[r] = engine.Run(a, streams[r]);
      });
    for (auto& t : threads) t.join();
  };
  round(3);  // the group's set-up
  (void)counts.Take();
  const uint64_t allocations_before = g_allocations.load();
  std::vector<double> us;
  std::vector<uint64_t> total(kOps, 0);
  for (int rep = 0; rep < reps; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    round(calls);
    us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / calls);
    std::vector<uint64_t> c = counts.Take();
    for (int o = 0; o < kOps; ++o) total[o] += c[o];
  }
  result.allocations_per_call =
      static_cast<double>(g_allocations.load() - allocations_before) / (static_cast<double>(ranks) * calls * reps);
  for (const Status& s : status)
    if (!s.ok()) {
      result.error = s.message();
      return result;
    }
  std::sort(us.begin(), us.end());
  result.us_per_call = us[us.size() / 2];
  result.us_min = us.front();
  result.us_max = us.back();
  for (int o = 0; o < kOps; ++o)
    result.ops_per_call.push_back(static_cast<double>(total[o]) / (static_cast<double>(ranks) * calls * reps));
  (void)engine.Shutdown(10);
  return result;
}

std::vector<std::string> Split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string part; std::getline(in, part, sep);)
    if (!part.empty()) out.push_back(part);
  return out;
}

}  // namespace
}  // namespace flexlink::bench

int main(int argc, char** argv) {
  using namespace flexlink::bench;
  std::vector<int> ranks{2, 4};
  std::vector<std::string> links{"nccl", "pcie", "nccl;pcie"};
  size_t bytes = 4096;
  int calls = 20000, reps = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--ranks") {
      ranks.clear();
      for (const std::string& r : Split(value, ',')) ranks.push_back(std::atoi(r.c_str()));
    } else if (flag == "--links") {
      links = Split(value, ',');
    } else if (flag == "--bytes") {
      bytes = std::strtoull(value.c_str(), nullptr, 10);
    } else if (flag == "--calls") {
      calls = std::atoi(value.c_str());
    } else if (flag == "--reps") {
      reps = std::atoi(value.c_str());
    } else {
      std::fprintf(stderr, "gpu_host_bench: unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  if (bytes < 4 || calls < 1 || reps < 1 || ranks.empty()) {
    std::fprintf(stderr, "gpu_host_bench: --bytes >= 4, --calls >= 1, --reps >= 1 and --ranks are needed\n");
    return 2;
  }
  flexlink::SetTimeoutSeconds(60);
  flexlink::SetAutotuneMinBytes(0);  // no stage 1: equal shares from the first call, as pinned
  flexlink::SetTuneUseCache(false);
  std::printf("gpu_host_bench: all_reduce float32 %zu bytes per rank, %d calls x %d repetitions, %u hardware threads;\n"
              "the engine's host path over a device and NCCL that do nothing (us per call: wall / calls, every rank\n"
              "calling concurrently; ops: what each rank enqueues per call; allocs: heap allocations per rank and call)\n\n",
              bytes, calls, reps, std::thread::hardware_concurrency());
  std::printf("%5s  %-10s %9s %9s %9s ", "ranks", "links", "us/call", "min", "max");
  for (const char* name : kOpNames) std::printf(" %7s", name);
  std::printf(" %7s\n", "allocs");
  int failed = 0;
  for (int n : ranks)
    for (const std::string& l : links) {
      const Result r = Measure(n, l, bytes, calls, reps);
      if (!r.error.empty()) {
        std::printf("%5d  %-10s FAILED: %s\n", n, l.c_str(), r.error.c_str());
        ++failed;
        continue;
      }
      std::printf("%5d  %-10s %9.2f %9.2f %9.2f ", n, l.c_str(), r.us_per_call, r.us_min, r.us_max);
      for (double o : r.ops_per_call) std::printf(" %7.2f", o);
      std::printf(" %7.1f\n", r.allocations_per_call);
    }
  return failed ? 1 : 0;
}
