// Engine timing without XLA: 8 persistent threads as devices (as XLA:CPU runs them), float32
// all_reduce / all_gather / ppermute (ring shift) / all_to_all per size, in place (but all_gather) and
// out of place, buffers allocated and touched once (what a donated, reused buffer costs), then a psum of 13 gradient-like leaves as one call of
// 13 operands against 13 calls. Not a test; build and run by hand:
//   g++ -std=c++20 -O3 -I. tests/cpp/engine_bench.cc -L<build> -lflexlink_core -lpthread -o /tmp/engine_bench
//   /tmp/engine_bench [staging_bytes] [max_bytes]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "xla_ffi/core/config.h"
#include "xla_ffi/core/engine.h"

using namespace flexlink;

int main(int argc, char** argv) {
  if (argc > 1) SetShmStagingBytes(std::strtoull(argv[1], nullptr, 10));
  const size_t max_bytes = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : (64u << 20);
  const int n = 8;
  std::vector<int64_t> group = {0, 1, 2, 3, 4, 5, 6, 7}, sizes = {n};
  std::printf("%-14s %10s %12s %12s %12s\n", "collective", "bytes", "in-place us", "out-place us",
              "algbw GB/s");
  int64_t run = 1;
  const std::vector<int64_t> shift = {0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 0};
  for (Kind kind : {Kind::kAllReduce, Kind::kAllGather, Kind::kPpermute, Kind::kAllToAll}) {
    for (size_t bytes = 4096; bytes <= max_bytes; bytes *= 4) {
      const size_t count = bytes / 4;
      const int iters = bytes <= (1 << 20) ? 200 : bytes <= (16 << 20) ? 20 : 6;
      double us[2] = {0, 0};
      for (int in_place = 1; in_place >= 0; --in_place) {
        if (kind == Kind::kAllGather && in_place) continue;
        std::vector<std::vector<float>> x(n, std::vector<float>(count, 1.f));
        std::vector<std::vector<float>> y(n, std::vector<float>(kind == Kind::kAllGather ? count * n : count));
        std::vector<double> elapsed(n);
        ++run;
        std::vector<std::thread> threads;
        for (int d = 0; d < n; ++d)
          threads.emplace_back([&, d] {
            std::vector<int64_t> in_dims = {static_cast<int64_t>(count)};
            std::vector<int64_t> out_dims = {static_cast<int64_t>(y[d].size())};
            CollectiveArgs a;
            a.groups = group;
            a.group_sizes = sizes;
            a.device = d;
            a.run_id = run;
            a.request.kind = kind;
            a.request.reduction = "sum";
            a.request.pairs = shift;
            OperandRequest op;
            op.in_dims = in_dims;
            op.out_dims = out_dims;
            op.in = x[d].data();
            op.out = in_place ? x[d].data() : y[d].data();
            a.request.operands = {&op, 1};
            for (int w = 0; w < 3; ++w) (void)RunCollective(a);  // warm-up
            const auto t0 = std::chrono::steady_clock::now();
            for (int i = 0; i < iters; ++i) {
              Status s = RunCollective(a);
              if (!s.ok()) std::printf("error: %s\n", s.message().c_str());
            }
            elapsed[d] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          });
        for (auto& t : threads) t.join();
        double worst = 0;
        for (double e : elapsed) worst = std::max(worst, e);
        us[in_place] = worst / iters * 1e6;
      }
      std::printf("%-14s %10zu %12.1f %12.1f %12.2f\n", std::string(Name(kind)).c_str(), bytes,
                  kind == Kind::kAllGather ? 0.0 : us[1], us[0], bytes / (us[0] * 1e3));
    }
  }
  // 13 leaves (sizes relative to the largest, as in a small model's gradients), one call vs 13.
  std::printf("\n%-14s %10s %12s %12s\n", "13 leaves", "largest", "1 call us", "13 calls us");
  const double rel[13] = {1, 7e-6, 1e-6, 1.0 / 4, 1.0 / 2, 3e-5, 1.0 / 4, 1e-4, 1e-5, 2e-5, 1.0 / 8, 1e-3, 6e-5};
  for (size_t bytes = 4096; bytes <= std::min<size_t>(max_bytes, 16u << 20); bytes *= 4) {
    std::vector<size_t> counts;
    for (double r : rel) counts.push_back(std::max<size_t>(1, static_cast<size_t>(r * bytes / 4)));
    const int iters = bytes <= (1 << 20) ? 200 : 20;
    double us[2] = {0, 0};
    for (int one = 1; one >= 0; --one) {
      std::vector<std::vector<std::vector<float>>> x(n), y(n);
      for (int d = 0; d < n; ++d)
        for (size_t c : counts) {
          x[d].emplace_back(c, 1.f);
          y[d].emplace_back(c, 0.f);
        }
      std::vector<double> elapsed(n);
      ++run;
      std::vector<std::thread> threads;
      for (int d = 0; d < n; ++d)
        threads.emplace_back([&, d] {
          std::vector<std::vector<int64_t>> dims;
          for (size_t c : counts) dims.push_back({static_cast<int64_t>(c)});
          std::vector<OperandRequest> ops(counts.size());
          for (size_t i = 0; i < counts.size(); ++i) {
            ops[i].in_dims = ops[i].out_dims = dims[i];
            ops[i].in = x[d][i].data();
            ops[i].out = y[d][i].data();
          }
          CollectiveArgs a;
          a.groups = group;
          a.group_sizes = sizes;
          a.device = d;
          a.run_id = run;
          a.request.reduction = "sum";
          auto step = [&] {
            if (one) {
              a.request.operands = ops;
              (void)RunCollective(a);
            } else {
              for (size_t i = 0; i < ops.size(); ++i) {
                a.request.operands = std::span<const OperandRequest>(ops).subspan(i, 1);
                (void)RunCollective(a);
              }
            }
          };
          for (int w = 0; w < 3; ++w) step();
          const auto t0 = std::chrono::steady_clock::now();
          for (int i = 0; i < iters; ++i) step();
          elapsed[d] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        });
      for (auto& t : threads) t.join();
      double worst = 0;
      for (double e : elapsed) worst = std::max(worst, e);
      us[one] = worst / iters * 1e6;
    }
    std::printf("%-14s %10zu %12.1f %12.1f\n", "all_reduce", bytes, us[1], us[0]);
  }
  return 0;
}
