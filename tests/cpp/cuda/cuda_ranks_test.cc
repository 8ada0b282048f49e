// The GPU engine on a real GPU (benchmarks/gpu_check.sh runs it; it needs one): every collective of
// gpu_cases.h's StandardCases, each rank a thread with its own stream and buffers as XLA runs them,
// checked against the independent reference.
//   - pcie with 2, 3 and 8 virtual ranks on device 0: the link's cross-rank protocol (events between
//     ranks' streams, host slots, chunking) on one GPU's copy engines;
//   - with 2+ GPUs, one rank per GPU: nccl alone, pcie alone, and both with pinned shares (NCCL's
//     float reductions are compared with a tolerance: its order is not rank order).
// NCCL refuses two ranks of one communicator on one device, so nccl across ranks needs 2+ GPUs (a
// SKIP line); one rank on GPU 0 runs through nccl (and nccl;pcie) on any machine, the engine told
// to send a 1-rank group through its links (GpuEngineOptions::single_rank_through_links).
// Stage 1 on the device (CheckStageOne, gpu_cases.h): with autotune on, the first 1 MiB all_reduce
// profiles the links on the ranks' streams, the fits come from CUDA events read once complete, and
// stage 2 plans from them; two pcie links on GPU 0's virtual ranks, and nccl;pcie across 2+ GPUs.
// Everything else here pins its shares (autotune off), so that the suites test the links' ranges.
// Each engine is then shut down (GpuEngine::Shutdown): every group released on the real runtime
// (cudaStreamQuery, cudaStreamDestroy, cudaEventDestroy, cudaFree, cudaFreeHost, the scratch pools,
// and with 2+ GPUs ncclCommFinalize and ncclCommDestroy), nothing kept, no error. Twice an earlier
// link set's group is released with the engine open (GpuEngine::ReleaseEarlierLinks) and the new
// links' calls checked after it: 3 virtual ranks on GPU 0, and the nccl group across 2+ GPUs.
#include <chrono>
#include <cstdio>
#include <optional>

#include "tests/cpp/cuda/cuda_harness.h"
#include "xla_ffi/core/config.h"

namespace flexlink::testing {
namespace {

using Clock = std::chrono::steady_clock;

void Suite(gpu::GpuEngine& engine, Harness& h, const std::string& links, const std::vector<double>& shares,
           size_t big, const std::string& what, bool approx) {
  const auto t0 = Clock::now();
  const int before = g_failed;
  Status st = engine.ConfigureLinks(links);
  Expect(st.ok(), what + ": configure " + links + ": " + st.message());
  if (!st.ok()) return;
  const auto cases = StandardCases(h.ranks, big);
  for (const Case& c : cases) {
    if (!shares.empty()) PinShares(engine, c, h.ranks, shares);
    CheckCase(engine, h, c, what, approx);
  }
  std::printf("  %-52s %4zu cases %7.2f s  %s\n", what.c_str(), cases.size(),
              std::chrono::duration<double>(Clock::now() - t0).count(), g_failed == before ? "ok" : "FAILED");
}

void StageOne(gpu::GpuEngine& engine, Harness& h, const std::string& links, const std::string& what, bool approx) {
  const auto t0 = Clock::now();
  const int before = g_failed;
  int calls = 0;
  const std::optional<plan::CostModel> model = CheckStageOne(engine, h, links, what, approx, &calls);
  std::string fits;
  if (model)
    for (size_t i = 0; i < model->num_links(); ++i) {
      char text[96];
      const plan::AlphaBeta& f = model->Fits(Kind::kAllReduce)[i];
      std::snprintf(text, sizeof text, "%s%s %.3g GB/s + %.3g us", i ? ", " : "", model->links()[i].c_str(),
                    f.bytes_per_second() / 1e9, f.alpha * 1e6);
      fits += text;
    }
  std::printf("  %-52s %4d calls %7.2f s  %s (all_reduce fits: %s)\n", what.c_str(), calls,
              std::chrono::duration<double>(Clock::now() - t0).count(), g_failed == before ? "ok" : "FAILED",
              fits.empty() ? "none" : fits.c_str());
}

void ExpectShutdown(gpu::GpuEngine& engine, const std::string& what, size_t groups) {
  const auto t0 = Clock::now();
  const gpu::ShutdownReport r = engine.Shutdown(30);
  for (const std::string& e : r.errors) Expect(false, what + ": shutdown: " + e);
  for (const std::string& k : r.kept) Expect(false, what + ": shutdown kept " + k);
  Expect(r.released.size() == groups, what + ": shutdown released " + std::to_string(r.released.size()) + " of " +
                                          std::to_string(groups) + " groups");
  std::printf("  %-52s %4zu groups %6.3f s  %s\n", (what + ": shutdown").c_str(), r.released.size(),
              std::chrono::duration<double>(Clock::now() - t0).count(),
              r.errors.empty() && r.kept.empty() && r.released.size() == groups ? "ok" : "FAILED");
}

// GpuEngine::ReleaseEarlierLinks after a link change: the earlier set's `groups` released on the real
// runtime while the engine stays open, nothing kept.
void ExpectReleaseEarlier(gpu::GpuEngine& engine, const std::string& what, size_t groups) {
  const auto t0 = Clock::now();
  const gpu::ShutdownReport r = engine.ReleaseEarlierLinks(30);
  for (const std::string& e : r.errors) Expect(false, what + ": release of the earlier links: " + e);
  for (const std::string& k : r.kept) Expect(false, what + ": release of the earlier links kept " + k);
  const bool ok = r.errors.empty() && r.kept.empty() && r.released.size() == groups && !engine.shut_down();
  Expect(ok, what + ": released " + std::to_string(r.released.size()) + " of " + std::to_string(groups) +
                 " groups of the earlier links, the engine open");
  std::printf("  %-52s %4zu groups %6.3f s  %s\n", (what + ": earlier links released").c_str(), r.released.size(),
              std::chrono::duration<double>(Clock::now() - t0).count(), ok ? "ok" : "FAILED");
}

}  // namespace
}  // namespace flexlink::testing

int main() {
  using namespace flexlink::testing;
  flexlink::SetTimeoutSeconds(60);
  flexlink::SetAutotuneMinBytes(0);  // pinned shares or equal ones, except in StageOne
  flexlink::SetTuneUseCache(false);
  UseNcclLibrary();
  std::string why;
  const int gpus = flexlink::gpu::ProcessDevice().DeviceCount(&why);
  if (gpus < 1) {
    std::printf("FAIL: no CUDA device: %s\n", why.c_str());
    return 1;
  }
  std::printf("cuda_ranks_test: %d GPU(s)\n", gpus);
  flexlink::gpu::GpuEngineOptions one_device;
  one_device.device_of = [](int64_t) { return 0; };
  for (int n : {2, 3, 8}) {
    flexlink::gpu::GpuEngine engine(&flexlink::gpu::ProcessDevice(), &flexlink::gpu::ProcessNccl(), one_device);
    Harness h = CudaHarness(n, one_device.device_of);
    Suite(engine, h, "pcie@slot_mib=0.25", {}, 300000,
          std::to_string(n) + " virtual ranks on GPU 0, pcie", false);
    if (n == 3) {
      // The link set changed: the first one's group released with the engine open, the new one's
      // calls right, and the shutdown left with only the new group.
      Suite(engine, h, "pcie@slot_mib=1", {}, 300000, "3 virtual ranks on GPU 0, pcie in 1 MiB slots", false);
      ExpectReleaseEarlier(engine, "3 virtual ranks on GPU 0", 1);
      for (const Case& c : StandardCases(n, 300000)) CheckCase(engine, h, c, "3 virtual ranks on GPU 0, after it", false);
    }
    ExpectShutdown(engine, std::to_string(n) + " virtual ranks on GPU 0", 1);
  }
  {
    flexlink::gpu::GpuEngine engine(&flexlink::gpu::ProcessDevice(), &flexlink::gpu::ProcessNccl(), one_device);
    Harness h = CudaHarness(3, one_device.device_of);
    StageOne(engine, h, "pcie@slot_mib=0.25;pcie:b@slot_mib=0.25", "3 virtual ranks on GPU 0, stage 1 on two pcie links",
             false);
    ExpectShutdown(engine, "3 virtual ranks on GPU 0, stage 1", 1);
  }
  {
    // One rank on GPU 0 through the links (single_rank_through_links; XLA itself runs such a group
    // as a copy): the only way a 1-GPU machine makes NCCL's calls (communicator set-up, every
    // collective and its send/recv pairs with one rank, the staged half-precision sums, finalize
    // and destroy at the shutdown) and checks what they wrote.
    flexlink::gpu::GpuEngineOptions single;
    single.single_rank_through_links = true;
    flexlink::gpu::GpuEngine engine(&flexlink::gpu::ProcessDevice(), &flexlink::gpu::ProcessNccl(), single);
    Harness h = CudaHarness(1, single.device_of);
    Suite(engine, h, "nccl", {}, 1 << 20, "1 rank on GPU 0, nccl", false);
    Suite(engine, h, "nccl@staging_mib=0.0625", {}, 1 << 18, "1 rank on GPU 0, nccl staged in 64 KiB", false);
    Suite(engine, h, "nccl;pcie@slot_mib=0.25", {0.5, 0.5}, 1 << 20, "1 rank on GPU 0, nccl;pcie 50/50", false);
    ExpectShutdown(engine, "1 rank on GPU 0, 3 link sets", 3);
    // Stage 1 with NCCL's profiling calls timed by CUDA events.
    flexlink::gpu::GpuEngine staged(&flexlink::gpu::ProcessDevice(), &flexlink::gpu::ProcessNccl(), single);
    StageOne(staged, h, "nccl;pcie", "1 rank on GPU 0, stage 1 on nccl;pcie", false);
    ExpectShutdown(staged, "1 rank on GPU 0, stage 1", 1);
  }
  if (gpus >= 2) {
    flexlink::gpu::GpuEngine engine(&flexlink::gpu::ProcessDevice(), &flexlink::gpu::ProcessNccl());
    Harness h = CudaHarness(gpus, [](int64_t id) { return static_cast<int>(id); });
    const std::string n = std::to_string(gpus) + " GPUs, ";
    Suite(engine, h, "nccl", {}, 1 << 20, n + "nccl", true);
    Suite(engine, h, "pcie", {}, 1 << 20, n + "pcie", false);
    // The nccl group's communicators finalized and destroyed while the pcie group's live on.
    ExpectReleaseEarlier(engine, n + "nccl then pcie", 1);
    Suite(engine, h, "nccl;pcie", {0.7, 0.3}, 1 << 20, n + "nccl;pcie 70/30", true);
    Suite(engine, h, "nccl@staging_mib=0.0625", {}, 1 << 18, n + "nccl staged in 64 KiB", true);
    ExpectShutdown(engine, n + "3 link sets", 3);
    flexlink::gpu::GpuEngine staged(&flexlink::gpu::ProcessDevice(), &flexlink::gpu::ProcessNccl());
    StageOne(staged, h, "nccl;pcie", n + "stage 1 on nccl;pcie", true);
    ExpectShutdown(staged, n + "stage 1", 1);
  } else {
    std::printf("SKIP: nccl needs 2+ GPUs (NCCL refuses two ranks of one communicator on one GPU)\n");
  }
  return Summary();
}
