// Block ownership of a shared KV pool in one POSIX shared memory segment,
// guarded by a robust process-shared mutex.
#include "features/kv/block_allocator.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <pthread.h>
#include <unistd.h>

#include <c10/util/Exception.h>

#include "base/env.h"
#include "base/errors.h"

#include "os/names.h"
#include "os/process.h"
#include "os/refcount.h"

#include "features/kv/pool_lock.h"

namespace torch_ipc {

// Note [block ownership under a robust mutex]
// allocate/free/take_over change a few hundred words at once and must look
// atomic to every process: no block handed out twice, none lost. A lock-free
// structure (a CAS'd free stack) would need tagged pointers and still could
// not move 256 blocks at once; a mutex makes each operation a plain loop. The
// mutex is process-shared and robust: when its holder dies mid-operation the
// next locker gets EOWNERDEAD and repairs the segment before going on. The
// repair is possible because one table is the truth, `holder[block]` (0: free,
// else the holder's process slot + 1), written one word per block; the free
// stack, the free count and each slot's count are derived from it and rebuilt
// (rebuild_locked). A block's holder is a slot, and a slot records the
// process by pid AND start time, so a recycled pid is never mistaken for the
// holder (process_alive, process.h), and by life key and PID namespace, so a
// holder in another container is judged by its life file (Note [pool slots
// across PID namespaces] in pool_segment.h). Blocks of a process that died are given
// back by whoever next runs short of blocks, or calls reclaim_dead() (each
// attached process does, from its background collector). Every lock checks
// the counts against each other first (check_locked), and every index read
// from the segment is checked where it is used (Note [nothing trusted from
// the pool's segment] in pool_segment.h).

class BlockAllocator::Lock {
 public:
  // Takes the lock, repairs after a holder that died, checks the counts.
  // `interruptible`: Ctrl-C ends the wait (not where nothing could raise it: a detach at exit).
  explicit Lock(const BlockAllocator& a, bool wait = true, bool interruptible = true)
      : mutex_(a.header(), a.lock_timeout_, wait, a.name(), interruptible) {
    if (!mutex_.locked()) return;
    if (mutex_.owner_died()) {  // Note [block ownership under a robust mutex]
      try {
        const_cast<BlockAllocator&>(a).rebuild_locked();
      } catch (...) {
        mutex_.mark_consistent();  // the next locker finds the same damage and says so
        throw;
      }
      mutex_.mark_consistent();
    }
    a.check_locked();  // a throw here unlocks (mutex_ is built)
  }
  bool locked() const { return mutex_.locked(); }

 private:
  PoolMutex mutex_;
};

BlockAllocator::BlockAllocator(std::unique_ptr<ShmMapping> shm, PoolGeometry geometry)
    : shm_(std::move(shm)), geometry_(std::move(geometry)) {}

namespace {

// The process a slot names, each field read once (any of them may be
// anyone's: it is only ever compared, never used as an index).
ProcessId slot_process(const PoolProcessSlot& s) { return ProcessId{s.pid, s.start_time, s.life, s.pidns}; }

// This process's identity for a slot: with its life key, without which a
// peer in another PID namespace could not tell whether it lives.
ProcessId self_for_slot(const std::string& pool) {
  const ProcessId& me = self_process();
  if (me.life == 0)
    throw os_error(life_file_error(), "creating", "this process's life file in /dev/shm",
                   "(a KV pool's process slot names it: Note [pool slots across PID namespaces]; pool " + pool + ")");
  return me;
}

}  // namespace

std::unique_ptr<BlockAllocator> BlockAllocator::create(const BlockLayout& layout, uint64_t max_blocks) {
  TORCH_IPC_CHECK_VALUE(max_blocks >= 1 && max_blocks <= kMaxBlocks, "torch_ipc: a KV pool has 1 to ", kMaxBlocks,
                        " blocks, not ", max_blocks);
  TORCH_IPC_CHECK_VALUE(!layout.shape.empty() && layout.shape.size() <= kMaxBlockDims, "torch_ipc: a block has 1 to ",
                        kMaxBlockDims, " dimensions, not ", layout.shape.size());
  PoolGeometry geometry{max_blocks, layout};
  geometry.layout.block_bytes =
      checked_block_bytes(static_cast<uint32_t>(layout.shape.size()), layout.shape.data(), layout.dtype);
  TORCH_IPC_CHECK_VALUE(geometry.layout.block_bytes > 0,
                        "torch_ipc: a block's dimensions must be positive and its size fit in 64 bits");

  // Named as a host segment of this process: the sweep removes the name once
  // the owner is gone (Note [sweep]); attached processes keep their mapping.
  const uint32_t anchor = lease_anchor_segment();
  auto shm = create_under_random_name("a KV pool's segment", [&](uint64_t random) {
    return ShmMapping::create(host_segment_name(self_process(), anchor, random), pool_segment_bytes(max_blocks),
                              self_process());
  });
  auto* h = static_cast<PoolHeader*>(shm->data());  // zero-filled
  init_pool_header(h, geometry);
  init_pool_mutex(&h->mutex, shm->name());
  publish_pool_header(h);  // attachable from here on
  std::unique_ptr<BlockAllocator> a(new BlockAllocator(std::move(shm), std::move(geometry)));
  a->register_self();
  return a;
}

std::unique_ptr<BlockAllocator> BlockAllocator::attach(const std::string& name, const ProcessId& creator) {
  auto parsed = name.size() > 1 && name[0] == '/' && name.find('/', 1) == std::string::npos
                    ? parse_shared_file_name(name.substr(1))
                    : std::nullopt;
  TORCH_IPC_CHECK_VALUE(parsed && !parsed->lease, "torch_ipc: '", name, "' is not the name of a KV pool's segment");
  // The name gives pid and start time; the creator's life key and PID
  // namespace (from the pool's pickle) let a process of another namespace
  // judge it (Note [pool slots across PID namespaces]).
  const ProcessId maker{parsed->pid, parsed->start_time, creator.life, creator.pidns};
  TORCH_IPC_CHECK_VALUE(creator.pid == 0 || creator == maker, "torch_ipc: KV pool ", name, " is named as pid ",
                        maker.pid, "'s, not pid ", creator.pid, "'s");
  auto shm = ShmMapping::open(name, sizeof(PoolHeader), maker);
  if (!shm) {
    if (!process_alive(maker)) throw producer_gone(maker.pid, "the KV pool it made can no longer be attached");
    throw Released("torch_ipc: the KV pool " + name + " was closed by its owner (pid " + std::to_string(maker.pid) +
                   ")");
  }
  PoolGeometry geometry = read_pool_geometry(static_cast<const PoolHeader*>(shm->data()), shm->size(), name);
  std::unique_ptr<BlockAllocator> a(new BlockAllocator(std::move(shm), std::move(geometry)));
  a->register_self();
  return a;
}

void BlockAllocator::detach() noexcept {
  if (detached_) return;
  detached_ = true;
  if (made_here_.inherited()) {  // the parent's slot, Note [fork]
    shm_->disown();
    return;
  }
  if (!registered_) return;
  try {
    Lock lock(*this, /*wait=*/true, /*interruptible=*/false);
    release_slot_locked(slot_);
  } catch (const std::exception& e) {
    TORCH_WARN("torch_ipc: detaching from KV pool ", name(), " failed: ", e.what());
  }
}

BlockAllocator::~BlockAllocator() { detach(); }

namespace {
constexpr double kMaxLockTimeout = 1e6;  // seconds
const double g_default_lock_timeout = env_number("TORCH_IPC_KV_LOCK_TIMEOUT", 10, 0, kMaxLockTimeout);
}  // namespace

double BlockAllocator::default_lock_timeout() { return g_default_lock_timeout; }

void BlockAllocator::set_lock_timeout(double seconds) {
  TORCH_IPC_CHECK_VALUE(std::isfinite(seconds) && seconds >= 0 && seconds <= kMaxLockTimeout,
                        "torch_ipc: lock_timeout is 0 to 1e6 seconds, not ", seconds);
  lock_timeout_ = seconds;
}

void BlockAllocator::check_attached() const {
  TORCH_IPC_CHECK(!made_here_.inherited(), "torch_ipc: this attachment to KV pool ", name(),
                  " was inherited through fork and is the parent's; attach in this process");
  TORCH_IPC_CHECK(!detached_, "torch_ipc: this process detached from KV pool ", name());
}

void BlockAllocator::register_self() {
  PoolHeader* h = header();
  const ProcessId me = self_for_slot(name());
  Lock lock(*this);
  for (int attempt = 0; attempt < 2; ++attempt) {
    for (uint32_t i = 0; i < kMaxProcesses; ++i) {
      PoolProcessSlot& s = h->processes[i];
      if (s.in_use) continue;
      s.pid = me.pid;
      s.start_time = me.start_time;
      s.life = me.life;
      s.pidns = me.pidns;
      s.held = 0;
      s.in_use = 1;
      slot_ = i;
      registered_ = true;
      return;
    }
    reclaim_dead_locked();
  }
  TORCH_IPC_CHECK(false, "torch_ipc: KV pool ", name(), " already has ", kMaxProcesses,
                  " processes attached, the most it has room for");
}

// ------------------------------------------------------------------ checks

// The blocks the chunk table commits: chunks back to back from block 0,
// within max_blocks.
uint64_t BlockAllocator::committed_by_chunks_locked() const {
  const PoolHeader* h = header();
  const uint32_t n_chunks = h->num_chunks.load();
  if (n_chunks > kMaxChunks) corrupted(str("it counts ", n_chunks, " chunks, more than the ", kMaxChunks, " it has"));
  uint64_t next = 0;
  for (uint32_t c = 0; c < n_chunks; ++c) {
    const uint64_t first = h->chunks[c].first, count = h->chunks[c].count;
    if (first != next || count == 0 || count > geometry_.max_blocks - next)
      corrupted(str("chunk ", c, " is recorded as ", count, " blocks from block ", first, " (expected from block ",
                    next, ", within its ", geometry_.max_blocks, " blocks)"));
    next += count;
  }
  return next;
}

// `value`, a count read from the segment, when it is at most `bound`.
uint64_t BlockAllocator::checked_count(uint64_t value, uint64_t bound, const char* what) const {
  if (value > bound) corrupted(str("its ", what, " is ", value, ", more than ", bound));
  return value;
}

// What every operation relies on: the chunks cover num_blocks, and the slots'
// counts plus the free count add up to it; this process's slot is its own.
void BlockAllocator::check_locked() const {
  const PoolHeader* h = header();
  const uint64_t committed = h->num_blocks.load();
  if (committed != committed_by_chunks_locked())
    corrupted(str("it counts ", committed, " blocks but its chunks hold ", committed_by_chunks_locked()));
  const uint64_t n_free = checked_count(h->free_count.load(), committed, "free count");
  uint64_t held = 0;
  for (uint32_t i = 0; i < kMaxProcesses; ++i) {
    const PoolProcessSlot& s = h->processes[i];
    const uint32_t in_use = s.in_use;
    const uint64_t n = s.held;
    if (in_use > 1 || (!in_use && n != 0))
      corrupted(str("process slot ", i, " reads in_use ", in_use, " holding ", n, " blocks"));
    held += checked_count(n, committed - held, "count of blocks held by one process");
  }
  if (held + n_free != committed)
    corrupted(str(held, " blocks held and ", n_free, " free do not add up to its ", committed, " blocks"));
  if (!registered_) return;
  const PoolProcessSlot& mine = h->processes[slot_];
  const uint32_t in_use = mine.in_use;
  const ProcessId named = slot_process(mine);
  const ProcessId& me = self_process();
  if (!in_use || named != me || named.life != me.life || named.pidns != me.pidns)
    corrupted(str("this process's slot ", slot_, " now names pid ", named.pid, " (in use: ", in_use,
                  "); another process took this one for dead or overwrote it"));
}

// The slot a holder word of block `id` names, or kMaxProcesses when it is free.
uint32_t BlockAllocator::holder_slot(uint32_t word, uint64_t id) const {
  if (word == 0) return kMaxProcesses;
  if (word > kMaxProcesses || !header()->processes[word - 1].in_use)
    corrupted(str("block ", id, " is recorded as held by process slot ", word - 1, ", which is not in use"));
  return word - 1;
}

void BlockAllocator::push_free(uint32_t* stack, uint64_t& n_free, uint64_t id) const {
  if (n_free >= geometry_.max_blocks) corrupted("its free stack overflows");
  stack[n_free++] = static_cast<uint32_t>(id);
}

void BlockAllocator::take_from_slot_locked(uint32_t slot, uint64_t n) {
  PoolProcessSlot& s = header()->processes[slot];
  const uint64_t held = s.held;
  if (held < n) corrupted(str("process slot ", slot, " counts ", held, " blocks, fewer than the ", n, " it gives up"));
  s.held = held - n;
}

// ------------------------------------------------------------------ repair and reclaim

void BlockAllocator::rebuild_locked() {
  PoolHeader* h = header();
  const uint64_t committed = committed_by_chunks_locked();
  h->num_blocks.store(committed);
  for (auto& s : h->processes) s.held = 0;
  uint32_t* holder = holder_table();
  uint32_t* stack = free_stack();
  uint64_t n_free = 0;
  for (uint64_t id = committed; id-- > 0;) {  // lowest ids on top of the stack
    const uint32_t v = holder[id];
    if (v > kMaxProcesses) corrupted(str("block ", id, " has holder word ", v));
    if (v != 0 && h->processes[v - 1].in_use) {
      ++h->processes[v - 1].held;
    } else {  // free, or held by a slot that its holder was giving up
      holder[id] = 0;
      push_free(stack, n_free, id);
    }
  }
  h->free_count.store(n_free);
}

void BlockAllocator::release_slot_locked(uint32_t slot) {
  PoolHeader* h = header();
  PoolProcessSlot& s = h->processes[slot];
  const uint64_t held = s.held;
  if (held > 0) {
    const uint64_t committed = num_blocks();
    uint32_t* holder = holder_table();
    uint64_t found = 0;
    for (uint64_t id = 0; id < committed; ++id) found += holder[id] == slot + 1;
    if (found != held)
      corrupted(str("process slot ", slot, " counts ", held, " blocks but the holder table gives it ", found));
    uint32_t* stack = free_stack();
    uint64_t n_free = h->free_count.load();
    for (uint64_t id = committed; id-- > 0;) {
      if (holder[id] != slot + 1) continue;
      holder[id] = 0;
      push_free(stack, n_free, id);
    }
    h->free_count.store(n_free);
  }
  s.held = 0;
  s.in_use = 0;
}

uint64_t BlockAllocator::reclaim_dead_locked() {
  PoolHeader* h = header();
  const uint64_t before = h->free_count.load();
  for (uint32_t i = 0; i < kMaxProcesses; ++i) {
    PoolProcessSlot& s = h->processes[i];
    if (!s.in_use || i == slot_) continue;
    if (process_alive(slot_process(s))) continue;
    release_slot_locked(i);
  }
  return h->free_count.load() - before;
}

uint64_t BlockAllocator::reclaim_dead(bool wait) {
  Lock lock(*this, wait);
  return lock.locked() ? reclaim_dead_locked() : 0;
}

// ------------------------------------------------------------------ counts

uint64_t BlockAllocator::num_blocks() const {
  return checked_count(header()->num_blocks.load(), geometry_.max_blocks, "block count");
}

uint64_t BlockAllocator::free_blocks() const {
  return checked_count(header()->free_count.load(), geometry_.max_blocks, "free count");
}

// ------------------------------------------------------------------ operations

std::vector<int64_t> BlockAllocator::allocate(uint64_t n) {
  check_attached();
  PoolHeader* h = header();
  Lock lock(*this);
  if (h->free_count.load() < n) reclaim_dead_locked();
  const uint64_t committed = num_blocks();
  const uint64_t n_free = checked_count(h->free_count.load(), committed, "free count");
  if (n_free < n) return {};
  uint32_t* holder = holder_table();
  const uint32_t* stack = free_stack();
  std::vector<int64_t> ids(n);
  for (uint64_t i = 0; i < n; ++i) {
    const uint32_t id = stack[n_free - 1 - i];
    const uint32_t word = id < committed ? holder[id] : 0;
    if (id >= committed || word != 0) {
      for (uint64_t j = 0; j < i; ++j) holder[ids[j]] = 0;  // nothing half done
      corrupted(id >= committed ? str("its free stack lists block ", id, ", past its ", committed, " blocks")
                                : str("its free stack lists block ", id, ", which is held (holder word ", word, ")"));
    }
    holder[id] = slot_ + 1;
    ids[i] = id;
  }
  h->free_count.store(n_free - n);
  h->processes[slot_].held += n;
  return ids;
}

// Note [repeated ids]
// Every free, hand-over and take-over checks that no id is listed twice. A
// sort of a copy was ~0.6 us of a 256-id hand-over's check on each side; a
// bitmap over the ids' span is one pass. The bitmap is used while it is no
// larger than a few words per id (a hand-over from a pool of up to ~64K
// blocks), the sort past that. `ids` are checked in range (>= 0) already.
namespace {

int64_t first_repeated(const int64_t* ids, size_t n) {
  if (n < 2) return -1;
  const auto [lo, hi] = std::minmax_element(ids, ids + n);
  const uint64_t words = (static_cast<uint64_t>(*hi - *lo) >> 6) + 1;
  if (words <= 4 * n + 16) {
    std::vector<uint64_t> seen(words, 0);
    for (size_t i = 0; i < n; ++i) {
      const uint64_t bit = static_cast<uint64_t>(ids[i] - *lo);
      uint64_t& word = seen[bit >> 6];
      const uint64_t mask = uint64_t{1} << (bit & 63);
      if (word & mask) return ids[i];
      word |= mask;
    }
    return -1;
  }
  std::vector<int64_t> sorted(ids, ids + n);
  std::sort(sorted.begin(), sorted.end());
  auto dup = std::adjacent_find(sorted.begin(), sorted.end());
  return dup == sorted.end() ? -1 : *dup;
}

}  // namespace

// Every id in range, none twice, each held by `holder` (a slot + 1).
void BlockAllocator::check_ids_locked(const int64_t* ids, size_t n, uint32_t holder, const char* what) const {
  const PoolHeader* h = header();
  const uint64_t committed = num_blocks();
  const uint32_t* table = holder_table();
  for (size_t i = 0; i < n; ++i) {
    TORCH_IPC_CHECK_INDEX(ids[i] >= 0 && static_cast<uint64_t>(ids[i]) < committed, "torch_ipc: block id ", ids[i],
                          " is out of range: the KV pool has blocks 0 to ", committed - 1);
    const uint32_t v = table[ids[i]];
    if (v == holder) continue;
    TORCH_IPC_CHECK_VALUE(v != 0, "torch_ipc: cannot ", what, " block ", ids[i],
                          ": it is free (given back already, or never allocated)");
    const PoolProcessSlot& s = h->processes[holder_slot(v, ids[i])];
    TORCH_IPC_CHECK_VALUE(false, "torch_ipc: cannot ", what, " block ", ids[i], ": it is held by pid ", s.pid,
                          holder == slot_ + 1 ? ", not by this process" : ", not by the sender");
  }
  const int64_t dup = first_repeated(ids, n);
  TORCH_IPC_CHECK_VALUE(dup < 0, "torch_ipc: block id ", dup, " is listed twice");
}

void BlockAllocator::free(const int64_t* ids, size_t n) {
  check_attached();
  PoolHeader* h = header();
  Lock lock(*this);
  check_ids_locked(ids, n, slot_ + 1, "free");
  take_from_slot_locked(slot_, n);
  uint32_t* holder = holder_table();
  uint32_t* stack = free_stack();
  uint64_t n_free = h->free_count.load();
  for (size_t i = n; i-- > 0;) {
    holder[ids[i]] = 0;
    push_free(stack, n_free, static_cast<uint64_t>(ids[i]));
  }
  h->free_count.store(n_free);
}

void BlockAllocator::check_held(const int64_t* ids, size_t n) const {
  check_attached();
  Lock lock(*this);
  check_ids_locked(ids, n, slot_ + 1, "hand over");
}

void BlockAllocator::take_over(const int64_t* ids, size_t n, uint32_t from_slot, const ProcessId& from) {
  check_attached();
  PoolHeader* h = header();
  TORCH_IPC_CHECK_VALUE(from_slot < kMaxProcesses, "torch_ipc: malformed hand-over: process slot ", from_slot);
  Lock lock(*this);
  const PoolProcessSlot& s = h->processes[from_slot];
  const ProcessId named = slot_process(s);
  TORCH_IPC_CHECK_VALUE(s.in_use && named == from && named.life == from.life,
                        "torch_ipc: the sender of this hand-over (pid ", from.pid,
                        ") is no longer attached to the KV pool: it closed the pool or exited before the "
                        "hand-over was received, and its blocks went back to the pool");
  if (from_slot == slot_) return;  // handed to itself
  check_ids_locked(ids, n, from_slot + 1, "take over");
  take_from_slot_locked(from_slot, n);
  uint32_t* holder = holder_table();
  for (size_t i = 0; i < n; ++i) holder[ids[i]] = slot_ + 1;
  h->processes[slot_].held += n;
}

ProcessId BlockAllocator::holder_of(int64_t id) const {
  const PoolHeader* h = header();
  Lock lock(*this);
  const uint64_t committed = num_blocks();
  TORCH_IPC_CHECK_INDEX(id >= 0 && static_cast<uint64_t>(id) < committed, "torch_ipc: block id ", id,
                        " is out of range: the KV pool has ", committed, " blocks");
  const uint32_t slot = holder_slot(holder_table()[id], static_cast<uint64_t>(id));
  if (slot == kMaxProcesses) return ProcessId{};
  return slot_process(h->processes[slot]);
}

std::vector<PoolHolder> BlockAllocator::holders() const {
  const PoolHeader* h = header();
  Lock lock(*this);
  std::vector<PoolHolder> out;
  for (const auto& s : h->processes)
    if (s.in_use) out.push_back(PoolHolder{slot_process(s), s.held});
  return out;
}

std::vector<int64_t> BlockAllocator::held_by_self() const {
  const PoolHeader* h = header();
  Lock lock(*this);
  std::vector<int64_t> out;
  const uint32_t* holder = holder_table();
  const uint64_t committed = num_blocks();
  for (uint64_t id = 0; id < committed; ++id)
    if (holder_slot(holder[id], id) == slot_) out.push_back(static_cast<int64_t>(id));
  const uint64_t counted = h->processes[slot_].held;
  if (counted != out.size())
    corrupted(str("this process's slot counts ", counted, " blocks but the holder table gives it ", out.size()));
  return out;
}

void BlockAllocator::add_chunk(uint64_t count, const std::string& descriptor) {
  PoolHeader* h = header();
  TORCH_IPC_CHECK_VALUE(descriptor.size() <= kDescriptorBytes, "torch_ipc: a chunk's descriptor has ",
                        descriptor.size(), " bytes, more than the ", kDescriptorBytes, " a KV pool has room for");
  Lock lock(*this);
  const uint64_t first = num_blocks();
  const uint32_t index = h->num_chunks.load();
  TORCH_IPC_CHECK_VALUE(count >= 1 && count <= geometry_.max_blocks - first, "torch_ipc: the KV pool has ", first,
                        " of at most ", geometry_.max_blocks, " blocks; it cannot grow by ", count,
                        " (max_blocks is set at creation)");
  TORCH_IPC_CHECK_VALUE(index < kMaxChunks, "torch_ipc: the KV pool already has ", kMaxChunks,
                        " chunks, the most it has room for");
  PoolChunkEntry& c = h->chunks[index];
  c.first = first;
  c.count = count;
  c.descriptor_bytes = static_cast<uint32_t>(descriptor.size());
  std::memcpy(c.descriptor, descriptor.data(), descriptor.size());
  h->num_chunks.store(index + 1);  // the commit point (rebuild_locked derives num_blocks from it)
  uint32_t* stack = free_stack();
  uint64_t n_free = h->free_count.load();
  for (uint64_t id = first + count; id-- > first;) push_free(stack, n_free, id);
  h->free_count.store(n_free);
  h->num_blocks.store(first + count);
}

void BlockAllocator::stall_mid_operation_for_tests() {
  Lock lock(*this);
  header()->free_count.store(0);
  for (;;) pause();
}

std::vector<PoolChunk> BlockAllocator::chunks(size_t from) const {
  const PoolHeader* h = header();
  Lock lock(*this);
  std::vector<PoolChunk> out;
  const uint32_t n = h->num_chunks.load();  // checked by the lock: at most kMaxChunks
  for (size_t i = from; i < std::min(n, kMaxChunks); ++i) {
    const PoolChunkEntry& c = h->chunks[i];
    const uint32_t bytes = c.descriptor_bytes;
    if (bytes > kDescriptorBytes) corrupted(str("chunk ", i, " has a descriptor of ", bytes, " bytes"));
    out.push_back(PoolChunk{c.first, c.count, std::string(c.descriptor, bytes)});
  }
  return out;
}

}  // namespace torch_ipc
