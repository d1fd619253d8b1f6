// Host work bound once (docs/DESIGN.md, "Host work bound once"): what a launcher computes from
// inputs that do not change between a workspace's calls (CUTLASS's checked and initialized
// parameters, TMA descriptors, kernel attributes, occupancy) is computed on the first launch with
// those inputs and reused after. Nothing that depends on the step's data is bound: the experts'
// row counts are read on the device (the prepare kernel), so one binding serves every step.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>

namespace moekit::cuda::detail {

// Whether the launchers reuse bound host work (default on). Off: every launch does it afresh, as
// the tests and the host-time benchmark compare (the kernels' results are the same bits).
inline std::atomic<bool>& launch_cache_flag() {
  static std::atomic<bool> on{true};
  return on;
}
inline bool launch_cache_enabled() {
  return launch_cache_flag().load(std::memory_order_relaxed);
}
inline void set_launch_cache_enabled(bool on) {
  launch_cache_flag().store(on, std::memory_order_relaxed);
}

// The values bound for the last kSlots keys, one cache per thread and per use (a thread_local in
// the launcher): no lock on the launch path. A key is compared byte for byte, so every input of
// the bound work must be a member, and it may have no padding (checked). A full cache replaces its
// slots round robin: an engine alternates between a few workspaces, never dozens.
template <class Key, class Value, int kSlots = 8>
class BoundCache {
  static_assert(std::has_unique_object_representations_v<Key>,
                "a BoundCache key is compared bytewise: it must have no padding and no floating-point member");

 public:
  // The value bound for `key`, or null (also whenever the launch cache is off).
  const Value* find(const Key& key) const {
    if (!launch_cache_enabled()) return nullptr;
    for (const auto& slot : slots_)
      if (slot && std::memcmp(&slot->key, &key, sizeof(Key)) == 0) return &slot->value;
    return nullptr;
  }
  const Value& bind(const Key& key, const Value& value) {
    auto& slot = slots_[next_];
    next_ = (next_ + 1) % kSlots;
    slot.emplace(Slot{key, value});
    return slot->value;
  }

 private:
  struct Slot {
    Key key;
    Value value;
  };
  std::array<std::optional<Slot>, kSlots> slots_{};
  int next_ = 0;
};

// Runs `fn` (idempotent: e.g. a kernel attribute) the first time it is asked for on `device`,
// recorded in `done` once it returned; devices past 63 run it every time.
template <class Fn>
void once_per_device(std::atomic<std::uint64_t>& done, int device, Fn&& fn) {
  const std::uint64_t bit = device >= 0 && device < 64 ? std::uint64_t{1} << device : 0;
  if (bit != 0 && launch_cache_enabled() && (done.load(std::memory_order_acquire) & bit) != 0) return;
  fn();
  done.fetch_or(bit, std::memory_order_release);
}

}  // namespace moekit::cuda::detail
