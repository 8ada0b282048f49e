#include "tests/cpp/sim/sim_device.h"

#include <algorithm>
#include <atomic>
#include <functional>
#include <cstdlib>
#include <cstring>
#include <random>

namespace flexlink::sim {

struct SimDevice::SimStream {
  int device = 0;
  std::atomic<bool> destroyed{false};
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> ops;
  std::deque<std::function<bool()>> settled;  // per op in `ops` (Enqueue)
  std::function<bool()> running_settled;      // the op being run's; `running` while one is
  bool running = false;
  uint64_t enqueued = 0, done = 0;
  bool stop = false;
  std::atomic<int> delay_us{0};
  std::thread worker;
};

struct SimDevice::SimEvent {
  int device = 0;
  std::atomic<bool> destroyed{false};
  std::mutex mu;
  std::condition_variable cv;
  uint64_t recorded = 0;  // Record calls so far (host side)
  std::map<uint64_t, std::chrono::steady_clock::time_point> done;  // completed records and when
};

namespace {
thread_local int t_device = 0;
}

SimDevice::SimDevice(SimOptions options) : options_(options) {}

SimDevice::~SimDevice() {
  SynchronizeAll();
  for (auto& s : streams_) {
    {
      std::lock_guard<std::mutex> lock(s->mu);
      s->stop = true;
    }
    s->cv.notify_all();
    s->worker.join();
  }
  for (void* p : allocations_) std::free(p);
}

int SimDevice::DeviceCount(std::string* why) {
  if (options_.devices == 0 && why) *why = "the simulation has no device";
  return options_.devices;
}

Status SimDevice::GetDevice(int* device) {
  *device = t_device;
  return Status::Ok();
}

Status SimDevice::SetDevice(int device) {
  if (device < 0 || device >= options_.devices) return Status::Internal("sim: no device " + std::to_string(device));
  t_device = device;
  return Status::Ok();
}

Status SimDevice::CreateStream(int device, gpu::Stream* stream) {
  auto s = std::make_unique<SimStream>();
  s->device = device;
  SimStream* raw = s.get();
  const int jitter = options_.jitter_us;
  raw->worker = std::thread([raw, jitter] {
    std::mt19937 rng(static_cast<uint32_t>(reinterpret_cast<uintptr_t>(raw)));
    std::unique_lock<std::mutex> lock(raw->mu);
    for (;;) {
      raw->cv.wait(lock, [&] { return raw->stop || !raw->ops.empty(); });
      if (raw->ops.empty()) return;
      std::function<void()> op = std::move(raw->ops.front());
      raw->ops.pop_front();
      raw->running_settled = std::move(raw->settled.front());
      raw->settled.pop_front();
      raw->running = true;
      lock.unlock();
      const int delay = raw->delay_us.load() + (jitter > 0 ? static_cast<int>(rng() % jitter) : 0);
      if (delay > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay));
      op();
      lock.lock();
      raw->running = false;
      raw->running_settled = nullptr;
      ++raw->done;
      raw->cv.notify_all();
    }
  });
  std::lock_guard<std::mutex> lock(mu_);
  *stream = raw;
  streams_.push_back(std::move(s));
  ++live_streams_;
  return Status::Ok();
}

Status SimDevice::CreateEvent(int device, bool, gpu::Event* event) {
  auto e = std::make_unique<SimEvent>();
  e->device = device;
  std::lock_guard<std::mutex> lock(mu_);
  *event = e.get();
  events_.push_back(std::move(e));
  ++live_events_;
  return Status::Ok();
}

void* SimDevice::AllocBuffer(size_t bytes) {
  void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64 + 64);
  if (!p) return nullptr;
  std::memset(p, 0xA5, bytes);  // garbage, as fresh device memory would be
  std::lock_guard<std::mutex> lock(mu_);
  allocations_.push_back(p);
  return p;
}

Status SimDevice::AllocDevice(int device, size_t bytes, void** ptr) {
  *ptr = AllocBuffer(bytes);
  if (!*ptr) return Status::Internal("sim: out of memory");
  std::lock_guard<std::mutex> lock(mu_);
  engine_memory_[*ptr] = {false, device};
  return Status::Ok();
}

Status SimDevice::AllocPinnedHost(size_t bytes, void** ptr) {
  *ptr = AllocBuffer(bytes);
  if (!*ptr) return Status::Internal("sim: out of memory");
  std::lock_guard<std::mutex> lock(mu_);
  engine_memory_[*ptr] = {true, -1};
  return Status::Ok();
}

Status SimDevice::DestroyStream(gpu::Stream stream) {
  SimStream* s = S(stream);
  bool pending;
  {
    std::lock_guard<std::mutex> lock(s->mu);
    pending = s->enqueued != s->done;
  }
  // Error takes mu_, which Free holds while it takes a stream's: never under the stream's lock.
  if (pending) Error("sim: a stream of device " + std::to_string(s->device) + " destroyed with work pending");
  if (s->destroyed.exchange(true)) {
    Error("sim: a stream destroyed twice");
    return Status::Internal("sim: stream destroyed twice");
  }
  std::lock_guard<std::mutex> lock(mu_);
  --live_streams_;
  return Status::Ok();  // its worker stays (joined by the destructor): nothing runs on it any more
}

Status SimDevice::DestroyEvent(gpu::Event event) {
  SimEvent* e = E(event);
  bool pending;
  {
    std::lock_guard<std::mutex> lock(e->mu);
    pending = e->recorded != 0 && !e->done.count(e->recorded) && (e->done.empty() || e->done.begin()->first < e->recorded);
  }
  if (pending) Error("sim: an event of device " + std::to_string(e->device) + " destroyed before its last record completed");
  if (e->destroyed.exchange(true)) {
    Error("sim: an event destroyed twice");
    return Status::Internal("sim: event destroyed twice");
  }
  std::lock_guard<std::mutex> lock(mu_);
  --live_events_;
  return Status::Ok();
}

Status SimDevice::Free(void* ptr, bool pinned) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = engine_memory_.find(ptr);
  if (it == engine_memory_.end() || it->second.pinned != pinned) {
    const std::string what = std::string("sim: freeing ") + (pinned ? "pinned" : "device") +
                             " memory that is not a live allocation of that kind";
    errors_.push_back(what);
    return Status::Internal(what);
  }
  if (!pinned)
    for (const auto& s : streams_) {
      if (s->device != it->second.device) continue;
      std::vector<std::function<bool()>> pending;
      {
        std::lock_guard<std::mutex> sl(s->mu);
        if (s->enqueued == s->done) continue;
        if (s->running) pending.push_back(s->running_settled);
        pending.insert(pending.end(), s->settled.begin(), s->settled.end());
      }
      // Only records and waits on events that have completed: nothing left for the device to do.
      const bool busy = std::any_of(pending.begin(), pending.end(), [](const auto& settled) { return !settled || !settled(); });
      if (busy) {
        errors_.push_back("sim: device memory of device " + std::to_string(s->device) +
                          " freed while a stream of the device has work pending (cudaFree would wait for it)");
        break;
      }
    }
  engine_memory_.erase(it);
  allocations_.erase(std::find(allocations_.begin(), allocations_.end(), ptr));
  std::free(ptr);  // really: a device operation still using it is a use after free (the ASan build)
  return Status::Ok();
}

Status SimDevice::FreeDevice(void* ptr) { return Free(ptr, false); }

Status SimDevice::FreePinnedHost(void* ptr) { return Free(ptr, true); }

Status SimDevice::ReleaseShared() {
  shared_releases_.fetch_add(1);
  return Status::Ok();
}

SimDevice::Live SimDevice::live() const {
  std::lock_guard<std::mutex> lock(mu_);
  Live l;
  l.streams = live_streams_;
  l.events = live_events_;
  for (const auto& [p, m] : engine_memory_) (m.pinned ? l.pinned : l.device)++;
  return l;
}

std::string SimDevice::Describe(const Live& l) const {
  return std::to_string(l.streams) + " streams, " + std::to_string(l.events) + " events, " + std::to_string(l.device) +
         " device and " + std::to_string(l.pinned) + " pinned allocations";
}

Status SimDevice::PreloadKernels(int) {
  ++preloads_;
  return Status::Ok();
}

void SimDevice::Enqueue(gpu::Stream stream, std::function<void()> f, std::function<bool()> settled) {
  SimStream* s = S(stream);
  if (s->destroyed.load()) Error("sim: work enqueued on a destroyed stream of device " + std::to_string(s->device));
  {
    std::lock_guard<std::mutex> lock(s->mu);
    s->ops.push_back(std::move(f));
    s->settled.push_back(std::move(settled));
    ++s->enqueued;
  }
  s->cv.notify_all();
}

void SimDevice::Error(std::string message) {
  std::lock_guard<std::mutex> lock(mu_);
  errors_.push_back(std::move(message));
}

Status SimDevice::Record(gpu::Event event, gpu::Stream stream) {
  SimEvent* e = E(event);
  if (e->destroyed.load()) Error("sim: a destroyed event recorded");
  if (e->device != S(stream)->device) return Status::Internal("sim: event and stream on different devices");
  uint64_t gen;
  {
    std::lock_guard<std::mutex> lock(e->mu);
    gen = ++e->recorded;
  }
  Enqueue(
      stream,
      [e, gen] {
        std::lock_guard<std::mutex> lock(e->mu);
        e->done[gen] = std::chrono::steady_clock::now();
        while (e->done.size() > 64) e->done.erase(e->done.begin());
        e->cv.notify_all();
      },
      [] { return true; });  // a record takes no device time and touches no memory
  return Status::Ok();
}

Status SimDevice::Wait(gpu::Stream stream, gpu::Event event) {
  SimEvent* e = E(event);
  if (e->destroyed.load()) Error("sim: a stream waits on a destroyed event");
  uint64_t target;
  {
    std::lock_guard<std::mutex> lock(e->mu);
    target = e->recorded;  // CUDA: the most recent record at the time of this call
  }
  if (target == 0) return Status::Ok();
  const double timeout = options_.wait_timeout_s;
  auto reached = [e, target] { return e->done.count(target) || (!e->done.empty() && e->done.begin()->first > target); };
  Enqueue(
      stream,
      [this, e, reached, timeout] {
        bool ok;
        {
          std::unique_lock<std::mutex> lock(e->mu);
          ok = e->cv.wait_for(lock, std::chrono::duration<double>(timeout), reached);
        }
        // Not under the event's lock: Free holds the device's lock while it asks the event (settled).
        if (!ok) Error("sim: a stream waited more than " + std::to_string(timeout) + " s for an event (deadlock?)");
      },
      // Done work a stream is only still to see (a join on a completed event; its worker not yet
      // scheduled on a loaded machine): cudaFree would not wait on the device for it.
      [e, reached] {
        std::lock_guard<std::mutex> lock(e->mu);
        return reached();
      });
  return Status::Ok();
}

namespace {
// A copy's time at `gbps` (none when 0).
void Pace(size_t bytes, double gbps) {
  if (gbps > 0) std::this_thread::sleep_for(std::chrono::duration<double>(bytes / (gbps * 1e9)));
}
}  // namespace

Status SimDevice::Copy(void* dst, const void* src, size_t bytes, gpu::Stream stream) {
  if (!bytes) return Status::Ok();
  if (S(stream)->device == copy_fails_on_.load())
    return Status::Internal("sim: copy failed (injected) on device " + std::to_string(S(stream)->device));
  if (!dst || !src) return Status::Internal("sim: copy with a null pointer");
  const double pace = options_.copy_gbps;
  Enqueue(stream, [dst, src, bytes, pace] {
    Pace(bytes, pace);
    std::memmove(dst, src, bytes);
  });
  return Status::Ok();
}

Status SimDevice::Copy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                         gpu::Stream stream) {
  if (width > dpitch || width > spitch) return Status::Internal("sim: copy2d width exceeds a pitch");
  if (S(stream)->device == copy_fails_on_.load())
    return Status::Internal("sim: copy failed (injected) on device " + std::to_string(S(stream)->device));
  const double pace = options_.copy_gbps;
  Enqueue(stream, [=] {
    Pace(width * height, pace);
    for (size_t r = 0; r < height; ++r)
      std::memmove(static_cast<uint8_t*>(dst) + r * dpitch, static_cast<const uint8_t*>(src) + r * spitch, width);
  });
  return Status::Ok();
}

Status SimDevice::Zero(void* dst, size_t bytes, gpu::Stream stream) {
  Enqueue(stream, [dst, bytes] { std::memset(dst, 0, bytes); });
  return Status::Ok();
}

Status SimDevice::Reduce(const gpu::ReduceArgs& a, gpu::Stream stream) {
  bool ok = gpu::DispatchReduce(a.dtype, a.op, [&]<class Op>() {
    Enqueue(stream, [a] {
      for (size_t i = 0; i < a.count; ++i) gpu::ReduceAt<Op>(a, i);
    });
  });
  return ok ? Status::Ok() : Status::Internal("sim: no reduction for this dtype and op");
}

Status SimDevice::Layout(const gpu::LayoutArgs& a, gpu::Stream stream) {
  bool ok = gpu::DispatchWidth(a.width, [&]<class E>() {
    Enqueue(stream, [a] {
      for (size_t t = 0; t < a.total(); ++t) gpu::LayoutAt<E>(a, t);
    });
  });
  return ok ? Status::Ok() : Status::Internal("sim: no layout copy of this width");
}

Status SimDevice::MallocAsync(size_t bytes, gpu::Stream stream, void** ptr) {
  const int fails = malloc_fails_on_.load();
  if (fails == kEveryDevice || S(stream)->device == fails)
    return Status::Internal("sim: out of memory (injected) allocating " + std::to_string(bytes) + " bytes on device " +
                            std::to_string(S(stream)->device));
  *ptr = std::aligned_alloc(64, (bytes + 63) / 64 * 64 + 64);
  if (!*ptr) return Status::Internal("sim: out of memory");
  live_scratch_.fetch_add(1);
  return Status::Ok();
}

Status SimDevice::FreeAsync(void* ptr, gpu::Stream stream) {
  Enqueue(stream, [this, ptr] {
    std::free(ptr);
    live_scratch_.fetch_sub(1);
  });
  return Status::Ok();
}

Status SimDevice::Delay(double seconds, gpu::Stream stream) {
  if (!(seconds > 0)) return Status::Ok();
  Enqueue(stream, [seconds] { std::this_thread::sleep_for(std::chrono::duration<double>(seconds)); });
  return Status::Ok();
}

Status SimDevice::WaitFlag(const uint32_t* flag, double max_seconds, gpu::Stream stream) {
  if (!flag) return Status::Internal("sim: wait on a null flag");
  Enqueue(stream, [this, flag, max_seconds] {
    // Polls as the CUDA kernel does (a host write has no way to wake a device), in 100 us naps.
    const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(max_seconds);
    std::atomic_ref<uint32_t> word(*const_cast<uint32_t*>(flag));  // the host writes it with atomic_ref too
    while (word.load(std::memory_order_acquire) == 0) {
      if (std::chrono::steady_clock::now() >= end) {
        Error("sim: a flag wait ran out its " + std::to_string(max_seconds) + " s without the host releasing it");
        return;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    flag_waits_.fetch_add(1);
  });
  return Status::Ok();
}

gpu::Poll SimDevice::Query(gpu::Event event, std::string*) {
  SimEvent* e = E(event);
  if (e->destroyed.load()) Error("sim: a destroyed event queried");
  std::lock_guard<std::mutex> lock(e->mu);
  if (e->recorded == 0) return gpu::Poll::kDone;
  return e->done.count(e->recorded) ? gpu::Poll::kDone : gpu::Poll::kPending;
}

gpu::Poll SimDevice::QueryStream(gpu::Stream stream, std::string*) {
  SimStream* s = S(stream);
  if (s->destroyed.load()) Error("sim: a destroyed stream queried");
  std::lock_guard<std::mutex> lock(s->mu);
  return s->enqueued == s->done ? gpu::Poll::kDone : gpu::Poll::kPending;
}

Status SimDevice::ElapsedSeconds(gpu::Event start, gpu::Event stop, double* seconds) {
  if (timing_fails_.load()) return Status::Internal("sim: an injected device error (no event timing)");
  SimEvent *a = E(start), *b = E(stop);
  std::scoped_lock lock(a->mu, b->mu);
  auto ia = a->done.find(a->recorded), ib = b->done.find(b->recorded);
  if (ia == a->done.end() || ib == b->done.end()) return Status::Internal("sim: elapsed time of an event not done");
  *seconds = std::chrono::duration<double>(ib->second - ia->second).count();
  return Status::Ok();
}

void SimDevice::Synchronize(gpu::Stream stream) {
  SimStream* s = S(stream);
  std::unique_lock<std::mutex> lock(s->mu);
  const uint64_t target = s->enqueued;
  s->cv.wait(lock, [&] { return s->done >= target; });
}

void SimDevice::SynchronizeAll() {
  std::vector<SimStream*> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& s : streams_) all.push_back(s.get());
  }
  // Twice: a stream may be waiting for another that gets work from a third.
  for (int round = 0; round < 2; ++round)
    for (SimStream* s : all) Synchronize(s);
}

std::vector<std::string> SimDevice::TakeErrors() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> out;
  out.swap(errors_);
  return out;
}

void SimDevice::SetStreamDelay(gpu::Stream stream, int delay_us) { S(stream)->delay_us.store(delay_us); }

}  // namespace flexlink::sim
