// A simulated GPU for the CPU-only tests of the GPU engine: streams are host threads that run their
// operations in order, events follow CUDA's rules (a wait binds to the event's most recent record
// at the time of the wait call; waiting on an event never recorded returns at once), "device"
// memory is host memory, and the kernels run the same element code as the CUDA kernels
// (xla_ffi/cuda/kernel_args.h). Everything the engine enqueues therefore runs in the order the
// engine asked for — a missing dependency shows as a race, which `jitter_us` (a random delay before
// every operation) makes likely to bite. A wait that does not complete in `wait_timeout_s` records
// an error instead of hanging the test.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "xla_ffi/cuda/device_api.h"

namespace flexlink::sim {

struct SimOptions {
  int devices = 8;
  int jitter_us = 0;
  double wait_timeout_s = 30;
  // > 0: Copy and Copy2D take bytes / copy_gbps (a slow PCIe); the simulated NCCL does not copy
  // through them, so this slows the pcie link alone.
  double copy_gbps = 0;
};

class SimDevice : public gpu::DeviceApi {
 public:
  explicit SimDevice(SimOptions options);
  ~SimDevice() override;

  int DeviceCount(std::string* why) override;
  Status GetDevice(int* device) override;
  Status SetDevice(int device) override;
  Status CreateStream(int device, gpu::Stream* stream) override;
  Status CreateEvent(int device, bool timing, gpu::Event* event) override;
  Status AllocDevice(int device, size_t bytes, void** ptr) override;
  Status AllocPinnedHost(size_t bytes, void** ptr) override;
  // Checked as CUDA would not: destroying a stream with work pending or an event whose last record
  // has not completed, using either afterwards, and freeing memory twice or of the other kind are
  // errors (TakeErrors), because the engine's shutdown releases only what drained. So is freeing
  // device memory while any stream of its device has work pending: cudaFree may synchronise the
  // device, which would wait for that work (a hung range: for good).
  Status DestroyStream(gpu::Stream stream) override;
  Status DestroyEvent(gpu::Event event) override;
  Status FreeDevice(void* ptr) override;
  Status FreePinnedHost(void* ptr) override;
  Status ReleaseShared() override;
  Status PreloadKernels(int device) override;
  Status Record(gpu::Event event, gpu::Stream stream) override;
  Status Wait(gpu::Stream stream, gpu::Event event) override;
  Status Copy(void* dst, const void* src, size_t bytes, gpu::Stream stream) override;
  Status Copy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                gpu::Stream stream) override;
  Status Zero(void* dst, size_t bytes, gpu::Stream stream) override;
  Status Reduce(const gpu::ReduceArgs& args, gpu::Stream stream) override;
  Status Layout(const gpu::LayoutArgs& args, gpu::Stream stream) override;
  Status MallocAsync(size_t bytes, gpu::Stream stream, void** ptr) override;
  Status FreeAsync(void* ptr, gpu::Stream stream) override;
  Status Delay(double seconds, gpu::Stream stream) override;
  Status WaitFlag(const uint32_t* flag, double max_seconds, gpu::Stream stream) override;
  gpu::Poll Query(gpu::Event event, std::string* error) override;
  gpu::Poll QueryStream(gpu::Stream stream, std::string* error) override;
  Status ElapsedSeconds(gpu::Event start, gpu::Event stop, double* seconds) override;

  // Test helpers (the engine never calls these).
  // A test's own buffer (the ranks' inputs and outputs): device memory not counted by live().
  void* AllocBuffer(size_t bytes);
  // What the engine made and has not released yet (the tests' own streams and buffers included:
  // compare with a count taken before). `shared_releases`: ReleaseShared calls so far.
  struct Live {
    int streams = 0, events = 0, device = 0, pinned = 0;
    bool operator==(const Live&) const = default;
  };
  Live live() const;
  std::string Describe(const Live& l) const;
  int shared_releases() const { return shared_releases_.load(); }
  void Synchronize(gpu::Stream stream);  // until the stream ran everything enqueued so far
  void SynchronizeAll();
  std::vector<std::string> TakeErrors();
  int preloads() const { return preloads_.load(); }
  int flag_waits() const { return flag_waits_.load(); }  // WaitFlags that ended by the host's release
  // On: ElapsedSeconds fails, as cudaEventElapsedTime does once the device reported an error.
  void SetTimingFails(bool on) { timing_fails_.store(on); }
  // >= 0: MallocAsync on that device's streams fails (out of memory there), as stage 1's scratch
  // allocation would on a GPU whose memory XLA took; -1: none; kEveryDevice: on all of them.
  static constexpr int kEveryDevice = -2;
  void SetMallocFailsOn(int device) { malloc_fails_on_.store(device); }
  // MallocAsync's allocations not yet freed by a FreeAsync that ran on its stream (stage 1's
  // scratch: zero once the streams drained, or something leaked it).
  int live_scratch() const { return live_scratch_.load(); }
  // >= 0: Copy and Copy2D on that device's streams fail (the pcie link's staging); -1: none.
  void SetCopyFailsOn(int device) { copy_fails_on_.store(device); }
  // Makes a stream's worker sleep before each operation (a slow link).
  void SetStreamDelay(gpu::Stream stream, int delay_us);
  // Adds an operation that runs `f` on the stream (the simulated NCCL's collectives).
  // `settled`: for an operation that does no work of its own (an event's record, a wait on an
  // event), whether it would pass at once now; Free does not count such operations as work pending
  // (null: real work: copies, kernels, collectives, delays, flag waits).
  void Enqueue(gpu::Stream stream, std::function<void()> f, std::function<bool()> settled = nullptr);
  void Error(std::string message);
  double wait_timeout_s() const { return options_.wait_timeout_s; }

 private:
  struct SimStream;
  struct SimEvent;
  SimStream* S(gpu::Stream s) { return static_cast<SimStream*>(s); }
  Status Free(void* ptr, bool pinned);
  SimEvent* E(gpu::Event e) { return static_cast<SimEvent*>(e); }

  const SimOptions options_;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<SimStream>> streams_;
  std::vector<std::unique_ptr<SimEvent>> events_;
  std::vector<void*> allocations_;             // every allocation, freed by the destructor if still here
  struct Memory {
    bool pinned = false;
    int device = -1;
  };
  std::map<void*, Memory> engine_memory_;      // live engine allocations
  int live_streams_ = 0, live_events_ = 0;     // under mu_
  std::atomic<int> shared_releases_{0};
  std::vector<std::string> errors_;
  std::atomic<int> preloads_{0};
  std::atomic<int> flag_waits_{0};
  std::atomic<bool> timing_fails_{false};
  std::atomic<int> malloc_fails_on_{-1};
  std::atomic<int> copy_fails_on_{-1};
  std::atomic<int> live_scratch_{0};
};

}  // namespace flexlink::sim
