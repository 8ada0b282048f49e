// The word that lets a group (the CPU engine's, a cross-process entry, a GPU executor) be released
// while device threads still hold raw pointers to it: it counts the ranks inside a call of the group
// and has a "retired" bit. A rank enters only while the bit is clear; the release retires the group
// only when no rank is inside. Since every rank of a call waits at the arrival for all of them, a
// group with nobody inside has run the same calls on every rank, and all of them find its
// successor for the next call (docs/multipath.md, "Changing links while calls are queued").
#pragma once

#include <atomic>
#include <cstdint>

namespace flexlink {

class EntryWord {
 public:
  // Enters for one call; false once retired (the caller looks up the group's successor).
  bool Enter() {
    uint64_t s = word_.load(std::memory_order_acquire);
    do {
      if (s & kRetired) return false;
    } while (!word_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel));
    return true;
  }
  // Enters where nothing can retire the group meanwhile (under the registry's lock).
  void EnterUnretired() { word_.fetch_add(1, std::memory_order_acq_rel); }
  void Leave() { word_.fetch_sub(1, std::memory_order_acq_rel); }
  // Retires the group if no rank is inside; false (nothing changed) otherwise.
  bool Retire() {
    uint64_t idle = 0;
    return word_.compare_exchange_strong(idle, kRetired, std::memory_order_acq_rel);
  }
  // Takes a retirement back (the group turned out busy elsewhere: its workers), under the lock
  // that keeps callers from looking for a successor meanwhile.
  void Unretire() { word_.store(0, std::memory_order_release); }
  int Inside() const { return static_cast<int>(word_.load(std::memory_order_acquire) & ~kRetired); }

 private:
  static constexpr uint64_t kRetired = uint64_t{1} << 63;
  std::atomic<uint64_t> word_{0};
};

// Leaves an entered group when the call's scope ends.
class Entered {
 public:
  explicit Entered(EntryWord& w) : w_(w) {}
  Entered(const Entered&) = delete;
  Entered& operator=(const Entered&) = delete;
  ~Entered() { w_.Leave(); }

 private:
  EntryWord& w_;
};

// One release pass over a registry's map (under its lock) of objects with an `entry` word: each one
// `earlier(key)` picks is retired if no rank is inside and, unless `busy(object)` finds it still in
// use elsewhere (a worker finishing a range some call gave up on: then it stays, for the next
// release), handed to `take(iterator)`, which moves its parts out, and erased from the map.
template <class Map, class Earlier, class Busy, class Take>
void RetireEarlier(Map& map, Earlier earlier, Busy busy, Take take, int* released, int* kept) {
  for (auto it = map.begin(); it != map.end();) {
    auto& object = *it->second;
    if (!earlier(it->first)) {
      ++it;
    } else if (!object.entry.Retire()) {
      ++*kept;  // a rank is inside a call of it
      ++it;
    } else if (busy(object)) {
      object.entry.Unretire();
      ++*kept;
      ++it;
    } else {
      take(it);
      it = map.erase(it);
      ++*released;
    }
  }
}

}  // namespace flexlink
