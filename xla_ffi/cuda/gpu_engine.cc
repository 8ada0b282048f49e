#include "xla_ffi/cuda/gpu_engine.h"

#include "xla_ffi/core/health.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <new>
#include <tuple>

#include "xla_ffi/core/config.h"
#include "xla_ffi/core/health.h"
#include "xla_ffi/core/stats.h"
#include "xla_ffi/cuda/gpu_xproc.h"
#include "xla_ffi/cuda/spin_rule.h"
#include "xla_ffi/plan/shares.h"

namespace flexlink::gpu {
namespace {

std::string JoinNames(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "" : ";") + n;
  return "'" + out + "'";
}

uint8_t* Bytes(const void* p) { return static_cast<uint8_t*>(const_cast<void*>(p)); }

}  // namespace

GpuEngine::GpuEngine(DeviceApi* api, CommApi* comm, GpuEngineOptions options)
    : serial_(NextSerial()),
      api_(*api),
      comm_(*comm),
      options_(std::move(options)),
      single_rank_through_links_(options_.single_rank_through_links) {}

GpuEngine::~GpuEngine() { StopWatchdog(); }

void GpuEngine::StopWatchdog() {
  {
    std::lock_guard<std::mutex> lock(watch_mu_);
    watch_stop_ = true;
  }
  watch_cv_.notify_all();
  if (watchdog_.joinable() && watchdog_.get_id() != std::this_thread::get_id()) watchdog_.join();
}

namespace {
std::atomic<GpuEngine*> g_stop_at_exit{nullptr};
}  // namespace

void GpuEngine::StartWatchdog() {
  std::lock_guard<std::mutex> lock(watch_mu_);
  if (watchdog_.joinable() || watch_stop_) return;
  watchdog_ = std::thread([this] { WatchLoop(); });
  if (options_.stop_watchdog_at_exit && g_stop_at_exit.exchange(this) == nullptr)
    std::atexit([] { g_stop_at_exit.load()->StopWatchdog(); });
}

void GpuEngine::WatchLoop() {
  std::unique_lock<std::mutex> lock(watch_mu_);
  while (!watch_cv_.wait_for(lock, std::chrono::duration<double>(kWatchTick), [&] { return watch_stop_; })) {
    lock.unlock();
    // Old link sets' groups too, retired ones kept included: a hang there still needs its streams
    // released.
    for (GpuExecutor* ex : LiveGroups()) ex->Watch();
    WatchGpuXprocGroups(*this);
    lock.lock();
  }
}

std::vector<GpuExecutor*> GpuEngine::LiveGroups() {
  std::vector<GpuExecutor*> out;
  std::lock_guard<std::mutex> lock(mu_);  // groups never freed while the engine lives
  for (auto& [key, ex] : groups_) out.push_back(ex.get());
  for (auto& [ids, ex] : retired_)
    if (!ex->released()) out.push_back(ex.get());
  return out;
}

uint64_t GpuEngine::NextSerial() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1);
}

std::shared_ptr<const GpuLinkSet> GpuEngine::CurrentLinks() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!links_) {
    Status s = MakeGpuLinkSet(kDefaultGpuLinks, next_version_++, &api_, &comm_, &links_);
    (void)s;  // cannot fail: the default always parses
    for (const std::string& name : links_->names()) MarkLinkHealth(name, true);
    current_.store(links_.get(), std::memory_order_release);
  }
  return links_;
}

const GpuLinkSet& GpuEngine::Links() {
  if (const GpuLinkSet* set = current_.load(std::memory_order_acquire)) return *set;
  return *CurrentLinks();  // the default, made once; kept by links_ or retired_links_ from then on
}

Status GpuEngine::ConfigureLinks(std::string_view spec) {
  std::lock_guard<std::mutex> lock(mu_);
  std::shared_ptr<const GpuLinkSet> set;
  FLEXLINK_RETURN_IF_ERROR(MakeGpuLinkSet(spec, next_version_, &api_, &comm_, &set));
  ++next_version_;
  for (const std::string& name : set->names()) MarkLinkHealth(name, true);
  DropHealthBefore(set->version);  // the old set's groups stay idle: their health is no longer reported
  if (links_) retired_links_.push_back(std::move(links_));
  links_ = std::move(set);
  current_.store(links_.get(), std::memory_order_release);
  overrides_.clear();
  seeds_.clear();
  return Status::Ok();
}

std::unique_ptr<GpuExecutor> GpuEngine::MakeGroup(std::shared_ptr<const GpuLinkSet> links,
                                                  const std::vector<int64_t>& ids) {
  GroupInfo info;
  info.ids = ids;
  for (int64_t id : ids) info.devices.push_back(options_.device_of(id));
  info.spin = ArrivalSpin(info.size(), UsableHardwareThreads());
  plan::BalancerOptions options;
  options.profile_from_bytes = AutotuneMinBytes();
  options.profile_max_bytes = TuneMaxBytes();
  // Hand-set shares, seeds and health are the current set's: a group made for an earlier set (a
  // call lowered before the links changed) plans from the nominal start and is not reported.
  const bool current = !links_ || links->version == links_->version;
  if (!current)
    LogInfo("GPU group " + FormatIds(ids) + " runs calls lowered for link set " + std::to_string(links->version) +
            " (" + links->spec + ") while " + std::to_string(links_->version) + " (" + links_->spec +
            ") is current: an executable compiled before configure(links=...), or a call queued then");
  auto ex = std::make_unique<GpuExecutor>(std::move(info), std::move(links), options, &api_, &splits_);
  if (!current) return ex;
  for (const auto& [key, shares] : overrides_)
    (void)ex->balancer().SetShares(key.first, key.second, shares.first, shares.second);
  if (auto it = seeds_.find(static_cast<int>(ids.size())); it != seeds_.end())
    (void)ex->balancer().SetSeed(it->second);  // links checked by SetSeed (GpuEngine::SetSeed)
  if (ex->link_names().size() > 1) RegisterGroupHealth(ex->health_record(), ex->links_version());
  return ex;
}

Status GpuEngine::LinksAt(uint64_t version, std::string_view label, std::shared_ptr<const GpuLinkSet>* out) {
  if (version == 0) {
    *out = CurrentLinks();
    return Status::Ok();
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (links_ && links_->version == version) {
    *out = links_;
    return Status::Ok();
  }
  for (const auto& set : retired_links_)
    if (set->version == version) {
      *out = set;
      return Status::Ok();
    }
  return Status::InvalidArgument(ErrorPrefix(label) + "the program was lowered for GPU link set " + std::to_string(version) +
                                 ", which this process never configured (it has made " +
                                 std::to_string(next_version_ - 1) +
                                 "); a compiled program runs only in the process that lowered it");
}

Status GpuEngine::GetGroup(uint64_t version, std::span<const int64_t> devices, std::string_view label,
                           GpuExecutor** out) {
  // Keyed by the engine's serial, not its address: an engine made where a destroyed one was (tests)
  // must not find the old one's executors.
  thread_local std::vector<std::tuple<uint64_t, uint64_t, std::vector<int64_t>, GpuExecutor*>> cache;
  if (version == 0) version = Links().version;
  for (auto it = cache.begin(); it != cache.end(); ++it) {
    const auto& [engine, v, ids, ex] = *it;
    if (engine != serial_ || v != version || !std::equal(ids.begin(), ids.end(), devices.begin(), devices.end()))
      continue;
    if (ex->entry.Enter()) {
      *out = ex;
      return Status::Ok();
    }
    cache.erase(it);  // retired: the engine has (or makes) its successor
    break;
  }
  std::shared_ptr<const GpuLinkSet> links;
  FLEXLINK_RETURN_IF_ERROR(LinksAt(version, label, &links));
  FLEXLINK_RETURN_IF_ERROR(FindOrMakeGroup(links, devices, label, /*enter=*/true, out));
  StartWatchdog();
  cache.emplace_back(serial_, version, std::vector<int64_t>(devices.begin(), devices.end()), *out);
  return Status::Ok();
}

Status GpuEngine::FindOrMakeGroup(const std::shared_ptr<const GpuLinkSet>& links, std::span<const int64_t> devices,
                                  std::string_view label, bool enter, GpuExecutor** out) {
  std::vector<int64_t> key(devices.begin(), devices.end());
  std::lock_guard<std::mutex> lock(mu_);
  auto it = groups_.find({links->version, key});
  if (it == groups_.end()) {
    FLEXLINK_RETURN_IF_ERROR(CheckDistinct(devices, label));
    std::string why;
    const int count = api_.DeviceCount(&why);
    for (int64_t id : devices) {
      const int dev = options_.device_of(id);
      if (dev < 0 || dev >= count)
        return Status::InvalidArgument(
            ErrorPrefix(label) + "device " + std::to_string(id) + " of group " + FormatIds(devices) +
            " is not a CUDA device of this process (" + std::to_string(count) + " visible" +
            (why.empty() ? std::string() : ": " + why) + "); FlexLink on GPU runs groups of the devices of one process");
    }
    it = groups_.emplace(std::make_pair(links->version, key), MakeGroup(links, key)).first;
  }
  *out = it->second.get();
  // Under mu_ nothing is retired (ReleaseEarlierLinks retires under it and takes the group out).
  if (enter) (*out)->entry.EnterUnretired();
  return Status::Ok();
}

Status GpuEngine::RunOrThrow(const CollectiveArgs& args, Stream stream) {
  std::span<const int64_t> members;
  int rank = 0;
  FLEXLINK_RETURN_IF_ERROR(ResolveGroup(args.groups, args.group_sizes, args.device, args.label, &members, &rank));
  const int n = static_cast<int>(members.size());
  if (args.request.kind == Kind::kAllToAll) FLEXLINK_RETURN_IF_ERROR(CheckEvenGroups(args.group_sizes, args.label));
  thread_local CallDesc desc;
  FLEXLINK_RETURN_IF_ERROR(DescribeCall(args.request, n, args.label, &desc));
  if (desc.total_units() == 0) return Status::Ok();
  DeviceGuard guard(api_);
  FLEXLINK_RETURN_IF_ERROR(api_.SetDevice(options_.device_of(args.device)));
  if (n == 1 && !single_rank_through_links_.load(std::memory_order_relaxed)) {
    // The identity (ppermute without the pair (0, 0): zeros), enqueued on XLA's stream.
    const bool zeros = desc.kind == Kind::kPpermute && desc.sources[0] < 0;
    for (const Part& p : desc.parts) {
      Status s = zeros ? api_.Zero(p.out, p.bytes(), stream)
                       : (p.out == p.in ? Status::Ok() : api_.Copy(p.out, Bytes(p.in), p.bytes(), stream));
      if (!s.ok()) return Status::Internal(ErrorPrefix(args.label) + std::string(Name(desc.kind)) + ": " + s.message());
    }
    return Status::Ok();
  }
  // A group spanning processes, set up at lowering (gpu_xproc.h), runs there.
  if (GpuXprocGroup* xgroup = FindGpuXprocGroup(*this, members, args.links_version, &Links()))
    return xgroup->Run(rank, desc, stream, args.label, args.run_id);
  // In this process: on the links the call was lowered with, so that every rank of a call queued
  // across configure(links=...) meets in one group.
  GpuExecutor* group = nullptr;
  FLEXLINK_RETURN_IF_ERROR(GetGroup(args.links_version, members, args.label, &group));
  const Entered entered(group->entry);
  std::shared_ptr<CallContext> call = group->comm().Join(rank, args.run_id, args.label);
  return group->Run(*call, rank, desc, stream);
}

Status GpuEngine::Run(const CollectiveArgs& args, Stream stream) {
  // Counted before the check, so that a Shutdown that saw no call inside has closed the door first.
  active_.fetch_add(1, std::memory_order_seq_cst);
  struct Leave {
    std::atomic<int>& active;
    ~Leave() { active.fetch_sub(1, std::memory_order_seq_cst); }
  } leave{active_};
  if (closed_.load(std::memory_order_seq_cst)) {
    constexpr std::string_view kShutDown =
        "FlexLink's GPU engine was shut down in this process (jax_flexlink.shutdown(), or the interpreter's exit), so "
        "no FlexLink collective runs on its GPUs any more; the jax.lax collectives still do";
    TellRefused(args, std::string("was refused: ") + std::string(kShutDown));
    return Status::FailedPrecondition(ErrorPrefix(args.label) + std::string(Name(args.request.kind)) + ": " +
                                      std::string(kShutDown));
  }
  // No input may abort the process (the CPU engine's rule): exceptions become this rank's error.
  try {
    return RunOrThrow(args, stream);
  } catch (const std::bad_alloc&) {
    return Status::Internal(ErrorPrefix(args.label) + std::string(Name(args.request.kind)) +
                            ": out of host memory for the engine's state of this call");
  } catch (const std::exception& e) {
    return Status::Internal(ErrorPrefix(args.label) + std::string(Name(args.request.kind)) + ": " + e.what());
  }
}

template <class F>
void GpuEngine::ForEachCurrent(F&& f) {
  const uint64_t version = links_ ? links_->version : 0;
  for (auto& [key, ex] : groups_)
    if (key.first == version) f(key.second, *ex);
}

Status GpuEngine::SetShares(Kind kind, uint64_t bucket_bytes, std::vector<double> shares, bool pinned) {
  std::shared_ptr<const GpuLinkSet> set = CurrentLinks();
  if (shares.size() != set->links.size())
    return Status::InvalidArgument("set_shares: " + std::to_string(shares.size()) + " shares for " +
                                   std::to_string(set->links.size()) + " links");
  // Normalised here: executors made later get the stored vector on a device thread (plan/shares.h).
  FLEXLINK_RETURN_IF_ERROR(plan::NormaliseShares(shares));
  std::lock_guard<std::mutex> lock(mu_);
  overrides_[{kind, bucket_bytes}] = {shares, pinned};
  Status status;
  ForEachCurrent([&](const std::vector<int64_t>&, GpuExecutor& ex) {
    Status s = ex.balancer().SetShares(kind, bucket_bytes, shares, pinned);
    if (status.ok()) status = s;
  });
  // Groups across processes too (only their leader's plans count; gpu_xproc.h).
  Status x = SetGpuXprocShares(*this, set->names(), kind, bucket_bytes, shares, pinned);
  return status.ok() ? x : status;
}

Status GpuEngine::SetSeed(int ranks, plan::CostModel seed) {
  std::shared_ptr<const GpuLinkSet> set = CurrentLinks();
  if (ranks < 2) return Status::InvalidArgument("flexlink: seed_model: a group has at least 2 ranks, got " + std::to_string(ranks));
  if (seed.links() != set->names())
    return Status::InvalidArgument("flexlink: seed_model: the fits are for links " + JoinNames(seed.links()) +
                                   ", the configured GPU links are " + JoinNames(set->names()));
  std::lock_guard<std::mutex> lock(mu_);
  Status status = Status::Ok();
  ForEachCurrent([&](const std::vector<int64_t>& ids, GpuExecutor& ex) {
    if (static_cast<int>(ids.size()) != ranks) return;
    Status s = ex.balancer().SetSeed(seed);
    if (status.ok()) status = s;
  });
  // Groups across processes of that size too (their used links' fits).
  SetGpuXprocSeed(*this, ranks, seed);
  seeds_[ranks] = std::move(seed);
  return status;
}

void GpuEngine::ForgetModel(Kind kind) {
  std::lock_guard<std::mutex> lock(mu_);
  ForEachCurrent([&](const std::vector<int64_t>&, GpuExecutor& ex) { ex.balancer().ForgetKind(kind); });
  ForgetGpuXprocModel(*this, kind);
}

std::optional<plan::CostModel> GpuEngine::SeedFor(int ranks) {
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = seeds_.find(ranks); it != seeds_.end()) return it->second;
  return std::nullopt;
}

std::map<std::pair<Kind, uint64_t>, std::pair<std::vector<double>, bool>> GpuEngine::ShareOverrides() {
  std::lock_guard<std::mutex> lock(mu_);
  return overrides_;
}

std::optional<plan::CostModel> GpuEngine::GroupModel(std::span<const int64_t> devices) {
  CurrentLinks();
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = groups_.find({links_->version, std::vector<int64_t>(devices.begin(), devices.end())});
    if (it != groups_.end()) return it->second->balancer().Model();
  }
  // A group across processes: the leader's model in every process (GpuXprocGroup::Model).
  if (GpuXprocGroup* g = FindGpuXprocGroup(*this, devices)) return g->Model();
  return std::nullopt;
}

void GpuEngine::SetTuneMax(uint64_t bytes) {
  SetTuneMaxBytes(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [key, ex] : groups_) ex->balancer().SetProfileMaxBytes(bytes);
  SetGpuXprocProfileBytes(*this, AutotuneMinBytes(), bytes);
}

void GpuEngine::SetAutotune(uint64_t bytes) {
  SetAutotuneMinBytes(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [key, ex] : groups_) ex->balancer().SetProfileFromBytes(bytes);
  SetGpuXprocProfileBytes(*this, bytes, TuneMaxBytes());
}

std::vector<PlanSnapshot> GpuEngine::SnapshotPlans() {
  CurrentLinks();
  std::vector<PlanSnapshot> out;
  std::lock_guard<std::mutex> lock(mu_);
  ForEachCurrent([&](const std::vector<int64_t>& ids, GpuExecutor& ex) {
    for (const auto& p : ex.balancer().Plans()) out.push_back(PlanSnapshot{ids, *p, ex.balancer().links()});
  });
  AppendGpuXprocPlans(*this, &out);
  return out;
}

void GpuEngine::PollTimings() {
  for (GpuExecutor* ex : LiveGroups()) ex->PollAll();
}

}  // namespace flexlink::gpu
