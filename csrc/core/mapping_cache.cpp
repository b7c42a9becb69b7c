#include "core/mapping_cache.h"

#include <algorithm>
#include <unordered_map>
#include <utility>

#include "base/clock.h"
#include "base/env.h"
#include "base/fork.h"

namespace torch_ipc {
namespace {

// Note [idle mappings]
// A consumer that receives the same weights again and again (an inference
// engine fed by a trainer) would pay cuIpcOpenMemHandle (45-80 us) per base
// allocation per message if mappings closed with their last tensor. So a
// mapping with no tensor left stays open, idle, and is closed when its
// producer exits, when it has been idle TORCH_IPC_IDLE_SECONDS, when more than
// TORCH_IPC_IDLE_MAPPINGS are idle (oldest first), or on collect(close_idle=True).
// Only legacy IPC mappings stay idle (MemoryKind::stays_open_idle); host and
// VMM ones close with their last tensor, since they would keep the producer's
// freed memory alive.
// The producer's lease is released already; the open handle may keep the
// segment's memory until it closes if the producer frees it (empty_cache).
constexpr int64_t kMaxIdleSetting = 1000000000;  // seconds (31 years) or mappings
using MappingKey = std::pair<uint8_t, Handle64>;
struct MappingKeyHash {
  size_t operator()(const MappingKey& k) const { return handle_hash(k.second) ^ k.first; }
};
struct MappingCache {
  std::recursive_mutex mu;
  std::unordered_map<MappingKey, std::shared_ptr<Mapping>, MappingKeyHash> mappings;
  // Note [checked settings]: junk warns and keeps the default.
  const int64_t idle_ns = env_int("TORCH_IPC_IDLE_SECONDS", 60, 0, kMaxIdleSetting) * 1000000000ll;
  const int64_t max_idle = env_int("TORCH_IPC_IDLE_MAPPINGS", 1024, 0, kMaxIdleSetting);
};

// A forked child starts with no mapping (Note [fork]).
MappingCache& cache() { return *process_state<MappingCache>(); }

std::shared_ptr<Mapping> open_mapping(const Allocation& where, const ProcessId& owner) {
  auto m = std::make_shared<Mapping>();
  m->where = where;
  m->producer = owner;
  m->kind = &memory_kind(where.kind);
  m->memory = m->kind->open(where, owner);
  return m;
}

}  // namespace

void mappings_forget_after_fork() { forget_after_fork<MappingCache>(); }
const AfterForkInChild reset_mappings_after_fork(&mappings_forget_after_fork);

std::unique_lock<std::recursive_mutex> lock_mappings() { return std::unique_lock<std::recursive_mutex>(cache().mu); }

std::shared_ptr<Mapping> get_mapping(const Allocation& where, const ProcessId& owner) {
  MappingCache& c = cache();
  MappingKey key{static_cast<uint8_t>(where.kind), where.handle};
  auto it = c.mappings.find(key);
  if (it != c.mappings.end() && it->second->where.size >= where.size && it->second->where.device == where.device) {
    it->second->idle_since_ns = 0;
    return it->second;
  }
  auto m = open_mapping(where, owner);
  c.mappings[key] = m;
  return m;
}

void drop_idle_mappings(bool close_idle, const std::function<bool(const ProcessId&)>& alive,
                        std::vector<std::shared_ptr<Mapping>>& closing) {
  MappingCache& c = cache();
  std::lock_guard<std::recursive_mutex> lock(c.mu);
  int64_t now = steady_now_ns();
  std::vector<std::pair<int64_t, decltype(c.mappings)::iterator>> idle;
  for (auto it = c.mappings.begin(); it != c.mappings.end();) {
    Mapping& m = *it->second;
    if (it->second.use_count() > 1) {
      m.idle_since_ns = 0;
      ++it;
    } else if (!m.kind->stays_open_idle) {
      // Closed at once, and not counted against TORCH_IPC_IDLE_MAPPINGS,
      // which bounds the ones that stay.
      closing.push_back(std::move(it->second));
      it = c.mappings.erase(it);
    } else {
      if (m.idle_since_ns == 0) m.idle_since_ns = now;
      idle.emplace_back(m.idle_since_ns, it++);
    }
  }
  std::sort(idle.begin(), idle.end(), [](auto& a, auto& b) { return a.first < b.first; });
  int64_t over = static_cast<int64_t>(idle.size()) - c.max_idle;
  for (auto& [since, it] : idle) {
    bool close = close_idle || over-- > 0 || now - since > c.idle_ns || !alive(it->second->producer);
    if (close) {
      closing.push_back(std::move(it->second));
      c.mappings.erase(it);
    }
  }
}

IdlePolicy idle_policy() {
  const MappingCache& c = cache();
  return IdlePolicy{c.idle_ns, c.max_idle};
}

MappingStats mapping_stats() {
  MappingCache& c = cache();
  std::lock_guard<std::recursive_mutex> lock(c.mu);
  MappingStats s{static_cast<int64_t>(c.mappings.size()), 0};
  for (auto& [k, m] : c.mappings) s.idle += m.use_count() == 1;
  return s;
}

}  // namespace torch_ipc
