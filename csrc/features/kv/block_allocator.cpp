// Block ownership of a shared KV pool in one POSIX shared memory segment,
// guarded by a robust process-shared mutex.
#include "features/kv/block_allocator.h"

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include "base/errors.h"
#include "os/names.h"
#include "os/process.h"
#include "os/refcount.h"

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
// holder (process_alive, process.h). Blocks of a process that died are given
// back by whoever next runs short of blocks, or calls reclaim_dead() (each
// attached process does, from its background collector).

namespace {

constexpr uint64_t kSegmentMagic = 0x3130564b43504954ull;  // "TIPCKV01"
constexpr uint32_t kSegmentVersion = 1;

struct ProcessSlot {
  uint32_t in_use;
  uint32_t pid;
  uint64_t start_time;
  uint64_t held;
  uint64_t reserved;
};

struct ChunkEntry {
  uint64_t first;
  uint64_t count;
  uint32_t descriptor_bytes;
  uint32_t reserved;
  char descriptor[BlockAllocator::kDescriptorBytes];
};

}  // namespace

struct BlockAllocator::Header {
  uint64_t magic;
  uint32_t version;
  uint32_t max_processes;
  uint32_t max_chunks;
  uint32_t descriptor_bytes;
  uint64_t max_blocks;
  uint32_t ndim;
  int32_t dtype;
  int64_t shape[kMaxBlockDims];
  uint64_t block_bytes;
  pthread_mutex_t mutex;
  std::atomic<uint64_t> num_blocks;
  std::atomic<uint64_t> free_count;
  std::atomic<uint32_t> num_chunks;
  uint32_t reserved;
  ProcessSlot processes[kMaxProcesses];
  ChunkEntry chunks[kMaxChunks];
  // Followed by uint32_t holder[max_blocks] and uint32_t free_stack[max_blocks].
};
static_assert(std::atomic<uint64_t>::is_always_lock_free, "need address-free atomics");

namespace {

size_t segment_bytes(uint64_t max_blocks) {
  return sizeof(BlockAllocator::Header) + 2 * sizeof(uint32_t) * max_blocks;  // max_blocks <= 2^31
}

uint32_t* holder_table(BlockAllocator::Header* h) { return reinterpret_cast<uint32_t*>(h + 1); }
uint32_t* free_stack(BlockAllocator::Header* h) { return holder_table(h) + h->max_blocks; }

// The layout's bytes per block, or 0 when it is not a valid layout.
uint64_t checked_block_bytes(uint32_t ndim, const int64_t* shape, int32_t dtype) {
  if (ndim > kMaxBlockDims || dtype < 0 ||
      dtype >= static_cast<int32_t>(c10::ScalarType::NumOptions) ||
      dtype == static_cast<int32_t>(c10::ScalarType::Undefined))
    return 0;
  uint64_t bytes = c10::elementSize(static_cast<c10::ScalarType>(dtype));
  for (uint32_t i = 0; i < ndim; ++i) {
    if (shape[i] <= 0 || bytes > UINT64_MAX / static_cast<uint64_t>(shape[i])) return 0;
    bytes *= static_cast<uint64_t>(shape[i]);
  }
  return bytes;
}

}  // namespace

class BlockAllocator::Lock {
 public:
  explicit Lock(const BlockAllocator& a) : h_(a.header()) {
    const int r = pthread_mutex_lock(&h_->mutex);
    if (r == EOWNERDEAD) {  // Note [block ownership under a robust mutex]
      const_cast<BlockAllocator&>(a).rebuild_locked();
      pthread_mutex_consistent(&h_->mutex);
    } else if (r != 0) {
      throw os_error(r, "pthread_mutex_lock", a.name());
    }
  }
  ~Lock() { pthread_mutex_unlock(&h_->mutex); }
  Lock(const Lock&) = delete;
  Lock& operator=(const Lock&) = delete;

 private:
  Header* h_;
};

BlockAllocator::BlockAllocator(std::unique_ptr<ShmMapping> shm) : shm_(std::move(shm)) {}

BlockAllocator::Header* BlockAllocator::header() const { return static_cast<Header*>(shm_->data()); }

std::unique_ptr<BlockAllocator> BlockAllocator::create(const BlockLayout& layout, uint64_t max_blocks) {
  TORCH_IPC_CHECK_VALUE(max_blocks >= 1 && max_blocks <= kMaxBlocks, "torch_ipc: a KV pool has 1 to ", kMaxBlocks,
                    " blocks, not ", max_blocks);
  TORCH_IPC_CHECK_VALUE(!layout.shape.empty() && layout.shape.size() <= kMaxBlockDims,
                    "torch_ipc: a block has 1 to ", kMaxBlockDims, " dimensions, not ", layout.shape.size());
  const uint64_t block_bytes =
      checked_block_bytes(static_cast<uint32_t>(layout.shape.size()), layout.shape.data(), layout.dtype);
  TORCH_IPC_CHECK_VALUE(block_bytes > 0, "torch_ipc: a block's dimensions must be positive and its size fit in 64 bits");

  // Named as a host segment of this process: the sweep removes the name once
  // the owner is gone (Note [sweep]); attached processes keep their mapping.
  const uint32_t anchor = lease_anchor_segment();
  auto shm = create_under_random_name("a KV pool's segment", [&](uint64_t random) {
    return ShmMapping::create(host_segment_name(self_process(), anchor, random), segment_bytes(max_blocks));
  });
  auto* h = static_cast<Header*>(shm->data());  // zero-filled
  h->version = kSegmentVersion;
  h->max_processes = kMaxProcesses;
  h->max_chunks = kMaxChunks;
  h->descriptor_bytes = kDescriptorBytes;
  h->max_blocks = max_blocks;
  h->ndim = static_cast<uint32_t>(layout.shape.size());
  h->dtype = layout.dtype;
  std::copy(layout.shape.begin(), layout.shape.end(), h->shape);
  h->block_bytes = block_bytes;
  pthread_mutexattr_t attr;
  pthread_mutexattr_init(&attr);
  pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
  const int r = pthread_mutex_init(&h->mutex, &attr);
  pthread_mutexattr_destroy(&attr);
  if (r != 0) throw os_error(r, "pthread_mutex_init", shm->name());
  std::atomic_thread_fence(std::memory_order_seq_cst);
  reinterpret_cast<std::atomic<uint64_t>*>(&h->magic)->store(kSegmentMagic);  // attachable from here on
  std::unique_ptr<BlockAllocator> a(new BlockAllocator(std::move(shm)));
  a->register_self();
  return a;
}

std::unique_ptr<BlockAllocator> BlockAllocator::attach(const std::string& name, const ProcessId& creator) {
  TORCH_IPC_CHECK_VALUE(name.rfind("/torch_ipc.", 0) == 0 && name.find('/', 1) == std::string::npos,
                    "torch_ipc: '", name, "' is not the name of a KV pool's segment");
  auto shm = ShmMapping::open(name, sizeof(Header));
  if (!shm) {
    if (!process_alive(creator)) throw producer_gone(creator.pid, "the KV pool it made can no longer be attached");
    throw Released("torch_ipc: the KV pool " + name + " was closed by its owner (pid " +
                   std::to_string(creator.pid) + ")");
  }
  const auto* h = static_cast<const Header*>(shm->data());
  const auto bad = [&](const std::string& why) {
    return DescriptorError("torch_ipc: " + name + " is not a KV pool segment of this version: " + why);
  };
  if (reinterpret_cast<const std::atomic<uint64_t>*>(&h->magic)->load() != kSegmentMagic || h->version != kSegmentVersion)
    throw bad("wrong magic or version");
  if (h->max_processes != kMaxProcesses || h->max_chunks != kMaxChunks || h->descriptor_bytes != kDescriptorBytes)
    throw bad("other table sizes");
  if (h->max_blocks < 1 || h->max_blocks > kMaxBlocks || shm->size() < segment_bytes(h->max_blocks))
    throw bad("its block tables do not fit in it");
  if (checked_block_bytes(h->ndim, h->shape, h->dtype) != h->block_bytes || h->ndim == 0)
    throw bad("its block layout is inconsistent");
  std::unique_ptr<BlockAllocator> a(new BlockAllocator(std::move(shm)));
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
  try {
    Lock lock(*this);
    release_slot_locked(slot_);
  } catch (const std::exception& e) {
    TORCH_WARN("torch_ipc: detaching from KV pool ", name(), " failed: ", e.what());
  }
}

BlockAllocator::~BlockAllocator() { detach(); }

void BlockAllocator::check_attached() const {
  TORCH_IPC_CHECK(!made_here_.inherited(), "torch_ipc: this attachment to KV pool ", name(),
              " was inherited through fork and is the parent's; attach in this process");
  TORCH_IPC_CHECK(!detached_, "torch_ipc: this process detached from KV pool ", name());
}

void BlockAllocator::register_self() {
  Header* h = header();
  Lock lock(*this);
  for (int attempt = 0; attempt < 2; ++attempt) {
    for (uint32_t i = 0; i < kMaxProcesses; ++i) {
      ProcessSlot& s = h->processes[i];
      if (s.in_use) continue;
      s.pid = self_process().pid;
      s.start_time = self_process().start_time;
      s.held = 0;
      s.in_use = 1;
      slot_ = i;
      return;
    }
    reclaim_dead_locked();
  }
  TORCH_IPC_CHECK(false, "torch_ipc: KV pool ", name(), " already has ", kMaxProcesses,
              " processes attached, the most it has room for");
}

void BlockAllocator::rebuild_locked() {
  Header* h = header();
  uint64_t committed = 0;
  const uint32_t n_chunks = std::min<uint32_t>(h->num_chunks.load(), kMaxChunks);
  for (uint32_t c = 0; c < n_chunks; ++c) committed += h->chunks[c].count;
  committed = std::min<uint64_t>(committed, h->max_blocks);
  h->num_blocks.store(committed);
  for (auto& s : h->processes) s.held = 0;
  uint32_t* holder = holder_table(h);
  uint32_t* stack = free_stack(h);
  uint64_t n_free = 0;
  for (uint64_t id = committed; id-- > 0;) {  // lowest ids on top of the stack
    uint32_t v = holder[id];
    if (v != 0 && v <= kMaxProcesses && h->processes[v - 1].in_use) {
      ++h->processes[v - 1].held;
    } else {
      holder[id] = 0;
      stack[n_free++] = static_cast<uint32_t>(id);
    }
  }
  h->free_count.store(n_free);
}

void BlockAllocator::release_slot_locked(uint32_t slot) {
  Header* h = header();
  ProcessSlot& s = h->processes[slot];
  if (s.held > 0) {
    uint32_t* holder = holder_table(h);
    uint32_t* stack = free_stack(h);
    uint64_t n_free = h->free_count.load();
    const uint64_t committed = h->num_blocks.load();
    for (uint64_t id = committed; id-- > 0;) {
      if (holder[id] != slot + 1) continue;
      holder[id] = 0;
      stack[n_free++] = static_cast<uint32_t>(id);
    }
    h->free_count.store(n_free);
  }
  s.held = 0;
  s.in_use = 0;
}

uint64_t BlockAllocator::reclaim_dead_locked() {
  Header* h = header();
  const uint64_t before = h->free_count.load();
  for (uint32_t i = 0; i < kMaxProcesses; ++i) {
    ProcessSlot& s = h->processes[i];
    if (!s.in_use || i == slot_) continue;
    if (process_alive(ProcessId{s.pid, s.start_time})) continue;
    release_slot_locked(i);
  }
  return h->free_count.load() - before;
}

BlockLayout BlockAllocator::layout() const {
  const Header* h = header();
  BlockLayout l;
  l.shape.assign(h->shape, h->shape + h->ndim);
  l.dtype = h->dtype;
  l.block_bytes = h->block_bytes;
  return l;
}

uint64_t BlockAllocator::num_blocks() const { return header()->num_blocks.load(); }
uint64_t BlockAllocator::max_blocks() const { return header()->max_blocks; }
uint64_t BlockAllocator::free_blocks() const { return header()->free_count.load(); }

std::vector<int64_t> BlockAllocator::allocate(uint64_t n) {
  check_attached();
  Header* h = header();
  Lock lock(*this);
  if (h->free_count.load() < n) reclaim_dead_locked();
  const uint64_t n_free = h->free_count.load();
  if (n_free < n) return {};
  uint32_t* holder = holder_table(h);
  const uint32_t* stack = free_stack(h);
  std::vector<int64_t> ids(n);
  for (uint64_t i = 0; i < n; ++i) {
    const uint32_t id = stack[n_free - 1 - i];
    holder[id] = slot_ + 1;
    ids[i] = id;
  }
  h->free_count.store(n_free - n);
  h->processes[slot_].held += n;
  return ids;
}

// Every id in range, none twice, each held by `holder` (a slot + 1).
void BlockAllocator::check_ids_locked(const int64_t* ids, size_t n, uint32_t holder, const char* what) const {
  Header* h = header();
  const uint64_t committed = h->num_blocks.load();
  const uint32_t* table = holder_table(h);
  for (size_t i = 0; i < n; ++i) {
    TORCH_IPC_CHECK_INDEX(ids[i] >= 0 && static_cast<uint64_t>(ids[i]) < committed, "torch_ipc: block id ", ids[i],
                      " is out of range: the KV pool has blocks 0 to ", committed - 1);
    const uint32_t v = table[ids[i]];
    if (v == holder) continue;
    TORCH_IPC_CHECK_VALUE(v != 0, "torch_ipc: cannot ", what, " block ", ids[i],
                      ": it is free (given back already, or never allocated)");
    const ProcessSlot& s = h->processes[v - 1];
    TORCH_IPC_CHECK_VALUE(false, "torch_ipc: cannot ", what, " block ", ids[i], ": it is held by pid ", s.pid,
                      holder == slot_ + 1 ? ", not by this process" : ", not by the sender");
  }
  std::vector<int64_t> sorted(ids, ids + n);
  std::sort(sorted.begin(), sorted.end());
  auto dup = std::adjacent_find(sorted.begin(), sorted.end());
  TORCH_IPC_CHECK_VALUE(dup == sorted.end(), "torch_ipc: block id ", dup == sorted.end() ? 0 : *dup,
                    " is listed twice");
}

void BlockAllocator::free(const int64_t* ids, size_t n) {
  check_attached();
  Header* h = header();
  Lock lock(*this);
  check_ids_locked(ids, n, slot_ + 1, "free");
  uint32_t* holder = holder_table(h);
  uint32_t* stack = free_stack(h);
  uint64_t n_free = h->free_count.load();
  for (size_t i = n; i-- > 0;) {
    holder[ids[i]] = 0;
    stack[n_free++] = static_cast<uint32_t>(ids[i]);
  }
  h->free_count.store(n_free);
  h->processes[slot_].held -= n;
}

void BlockAllocator::check_held(const int64_t* ids, size_t n) const {
  check_attached();
  Lock lock(*this);
  check_ids_locked(ids, n, slot_ + 1, "hand over");
}

void BlockAllocator::take_over(const int64_t* ids, size_t n, uint32_t from_slot, const ProcessId& from) {
  check_attached();
  Header* h = header();
  TORCH_IPC_CHECK_VALUE(from_slot < kMaxProcesses, "torch_ipc: malformed hand-over: process slot ", from_slot);
  Lock lock(*this);
  const ProcessSlot& s = h->processes[from_slot];
  TORCH_IPC_CHECK_VALUE(s.in_use && s.pid == from.pid && s.start_time == from.start_time,
                    "torch_ipc: the sender of this hand-over (pid ", from.pid,
                    ") is no longer attached to the KV pool: it closed the pool or exited before the "
                    "hand-over was received, and its blocks went back to the pool");
  if (from_slot == slot_) return;  // handed to itself
  check_ids_locked(ids, n, from_slot + 1, "take over");
  uint32_t* holder = holder_table(h);
  for (size_t i = 0; i < n; ++i) holder[ids[i]] = slot_ + 1;
  h->processes[from_slot].held -= n;
  h->processes[slot_].held += n;
}

uint64_t BlockAllocator::reclaim_dead() {
  Lock lock(*this);
  return reclaim_dead_locked();
}

ProcessId BlockAllocator::holder_of(int64_t id) const {
  Header* h = header();
  Lock lock(*this);
  const uint64_t committed = h->num_blocks.load();
  TORCH_IPC_CHECK_INDEX(id >= 0 && static_cast<uint64_t>(id) < committed, "torch_ipc: block id ", id,
                    " is out of range: the KV pool has ", committed, " blocks");
  const uint32_t v = holder_table(h)[id];
  if (v == 0) return ProcessId{};
  return ProcessId{h->processes[v - 1].pid, h->processes[v - 1].start_time};
}

std::vector<PoolHolder> BlockAllocator::holders() const {
  Header* h = header();
  Lock lock(*this);
  std::vector<PoolHolder> out;
  for (const auto& s : h->processes)
    if (s.in_use) out.push_back(PoolHolder{ProcessId{s.pid, s.start_time}, s.held});
  return out;
}

std::vector<int64_t> BlockAllocator::held_by_self() const {
  Header* h = header();
  Lock lock(*this);
  std::vector<int64_t> out;
  const uint32_t* holder = holder_table(h);
  for (uint64_t id = 0, n = h->num_blocks.load(); id < n; ++id)
    if (holder[id] == slot_ + 1) out.push_back(static_cast<int64_t>(id));
  return out;
}

void BlockAllocator::add_chunk(uint64_t count, const std::string& descriptor) {
  Header* h = header();
  TORCH_IPC_CHECK_VALUE(descriptor.size() <= kDescriptorBytes, "torch_ipc: a chunk's descriptor has ",
                    descriptor.size(), " bytes, more than the ", kDescriptorBytes, " a KV pool has room for");
  Lock lock(*this);
  const uint64_t first = h->num_blocks.load();
  const uint32_t index = h->num_chunks.load();
  TORCH_IPC_CHECK_VALUE(count >= 1 && count <= h->max_blocks - first, "torch_ipc: the KV pool has ", first, " of at most ",
                    h->max_blocks, " blocks; it cannot grow by ", count, " (max_blocks is set at creation)");
  TORCH_IPC_CHECK_VALUE(index < kMaxChunks, "torch_ipc: the KV pool already has ", kMaxChunks,
                    " chunks, the most it has room for");
  ChunkEntry& c = h->chunks[index];
  c.first = first;
  c.count = count;
  c.descriptor_bytes = static_cast<uint32_t>(descriptor.size());
  std::memcpy(c.descriptor, descriptor.data(), descriptor.size());
  h->num_chunks.store(index + 1);  // the commit point (rebuild_locked derives num_blocks from it)
  uint32_t* stack = free_stack(h);
  uint64_t n_free = h->free_count.load();
  for (uint64_t id = first + count; id-- > first;) stack[n_free++] = static_cast<uint32_t>(id);
  h->free_count.store(n_free);
  h->num_blocks.store(first + count);
}

void BlockAllocator::stall_mid_operation_for_tests() {
  Lock lock(*this);
  header()->free_count.store(0);
  for (;;) pause();
}

std::vector<PoolChunk> BlockAllocator::chunks(size_t from) const {
  Header* h = header();
  Lock lock(*this);
  std::vector<PoolChunk> out;
  const uint32_t n = h->num_chunks.load();
  if (n > kMaxChunks) throw DescriptorError("torch_ipc: KV pool " + name() + " has a corrupted chunk table");
  for (size_t i = from; i < n; ++i) {
    const ChunkEntry& c = h->chunks[i];
    if (c.descriptor_bytes > kDescriptorBytes)
      throw DescriptorError("torch_ipc: KV pool " + name() + " has a corrupted chunk table");
    out.push_back(PoolChunk{c.first, c.count, std::string(c.descriptor, c.descriptor_bytes)});
  }
  return out;
}

}  // namespace torch_ipc
