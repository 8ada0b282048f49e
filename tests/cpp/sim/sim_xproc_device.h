// The simulated device with what groups across processes need beyond SimDevice (pcie_xproc.h):
// registering shared host memory (nothing to do: simulated device memory is host memory) and the
// stream memory operations on 32-bit flags, which the stream's worker runs in order like any other
// operation. A wait polls the flag (another process's stream writes it) with the device's
// wait_timeout_s, and records an error instead of hanging.
#pragma once

#include <atomic>
#include <chrono>
#include <string>
#include <thread>

#include "tests/cpp/sim/sim_device.h"

namespace flexlink::sim {

class SimXprocDevice : public SimDevice {
 public:
  using SimDevice::SimDevice;

  Status RegisterHost(void* ptr, size_t bytes) override {
    if (!ptr || !bytes) return Status::InvalidArgument("sim: RegisterHost of nothing");
    registered_.fetch_add(1);
    return Status::Ok();
  }
  Status UnregisterHost(void* ptr) override {
    if (!ptr || registered_.fetch_sub(1) <= 0) {
      Error("sim: UnregisterHost of memory not registered");
      return Status::InvalidArgument("sim: UnregisterHost of memory not registered");
    }
    return Status::Ok();
  }
  Status WriteValue32(uint32_t* flag, uint32_t value, gpu::Stream stream) override {
    Enqueue(stream, [flag, value] { std::atomic_ref<uint32_t>(*flag).store(value, std::memory_order_release); });
    return Status::Ok();
  }
  Status WaitValue32(const uint32_t* flag, uint32_t value, gpu::Stream stream) override {
    const double timeout = wait_timeout_s();
    Enqueue(stream, [this, flag, value, timeout] {
      const auto start = std::chrono::steady_clock::now();
      auto* f = const_cast<uint32_t*>(flag);
      for (int spins = 0; static_cast<int32_t>(std::atomic_ref<uint32_t>(*f).load(std::memory_order_acquire) - value) < 0;
           ++spins) {
        if (std::chrono::steady_clock::now() - start > std::chrono::duration<double>(timeout)) {
          Error("sim: a stream waited more than " + std::to_string(timeout) + " s for a flag to reach " +
                std::to_string(value) + " (a peer process gone, or a missing write?)");
          return;
        }
        if (spins < 16) std::this_thread::yield();
        else std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    });
    return Status::Ok();
  }
  int registered() const { return registered_.load(); }  // registrations not undone

 private:
  std::atomic<int> registered_{0};
};

}  // namespace flexlink::sim
