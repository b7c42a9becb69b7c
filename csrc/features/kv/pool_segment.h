// The shared memory layout of a KV pool (a header, then the holder table and
// the free stack) and the process-local geometry that every index read from
// it is checked against (Note [nothing trusted from the pool's segment]).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <pthread.h>
#include <string>
#include <utility>
#include <vector>

namespace torch_ipc {

// Note [nothing trusted from the pool's segment]
// Every process attached to a pool can write anything into its segment (a
// bug, a stray pointer, a hostile process of the same uid). So a process
// reads the geometry once, when it creates or attaches (max_blocks, the
// layout, checked against the segment's size), keeps it in its own memory
// and never reads it again; every index and count it later reads from the
// segment (free stack entries, counts, holder words, chunk records) is
// checked against that geometry before it indexes anything, and an
// inconsistency is a PoolCorrupted error in the caller, never a write out of
// bounds or a block handed out twice. Each shared value is read once into a
// local and the local is what is checked and used: another process changing
// the value meanwhile changes what the operation means, never where it writes.

// What every block of a pool is: its shape and dtype (c10::ScalarType).
constexpr int kMaxBlockDims = 8;
struct BlockLayout {
  std::vector<int64_t> shape;
  int32_t dtype = 0;
  uint64_t block_bytes = 0;
};

// Most processes attached at once, most chunks of one pool, the room for one
// chunk's descriptor, and the most blocks of a pool.
constexpr uint32_t kPoolMaxProcesses = 128;
constexpr uint32_t kPoolMaxChunks = 64;
constexpr uint32_t kPoolDescriptorBytes = 2048;
constexpr uint64_t kPoolMaxBlocks = uint64_t(1) << 31;

// Note [pool slots across PID namespaces]
// A slot names its process as every identity of torch_ipc does (ProcessId in
// base/ids.h): pid and start time, checked by pidfd and /proc where the pid
// is counted in the checker's PID namespace, and the life key and the PID
// namespace, so that a process of another namespace (another container
// sharing /dev/shm) is judged by its life file (Note [life files] in
// os/life.h), never by an unrelated process of the same number here. A
// process needs a life key to attach. Layout version 3; version 2 slots named
// pid and start time only and are refused.
struct PoolProcessSlot {
  uint32_t in_use;  // 0 or 1
  uint32_t pid;
  uint64_t start_time;
  uint32_t life;   // its life key (never 0 in a slot in use)
  uint32_t pidns;  // the inode of the PID namespace `pid` is counted in (0: unknown)
  uint64_t held;   // blocks whose holder word names this slot
};
static_assert(sizeof(PoolProcessSlot) == 32, "pool slot layout");

struct PoolChunkEntry {
  uint64_t first;
  uint64_t count;
  uint32_t descriptor_bytes;
  uint32_t reserved;
  char descriptor[kPoolDescriptorBytes];
};

struct PoolHeader {
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
  std::atomic<uint32_t> locker_pid;  // who holds the mutex, for the timed lock's message; 0: nobody
  std::atomic<uint32_t> locker_tid;
  std::atomic<uint64_t> num_blocks;
  std::atomic<uint64_t> free_count;
  std::atomic<uint32_t> num_chunks;
  uint32_t reserved;
  PoolProcessSlot processes[kPoolMaxProcesses];
  PoolChunkEntry chunks[kPoolMaxChunks];
  // Followed by uint32_t holder[max_blocks] (0: free, else a slot + 1) and
  // uint32_t free_stack[max_blocks].
};
static_assert(std::atomic<uint64_t>::is_always_lock_free, "need address-free atomics");

// What a process keeps of a pool in its own memory (Note [nothing trusted
// from the pool's segment]).
struct PoolGeometry {
  uint64_t max_blocks = 0;
  BlockLayout layout;
};

size_t pool_segment_bytes(uint64_t max_blocks);
// The layout's bytes per block, or 0 when it is not a valid layout.
uint64_t checked_block_bytes(uint32_t ndim, const int64_t* shape, int32_t dtype);
// Fill a zeroed header for `geometry`, all but the mutex (pool_lock.h) and
// the magic word; publish_pool_header then makes it attachable.
void init_pool_header(PoolHeader* h, const PoolGeometry& geometry);
void publish_pool_header(PoolHeader* h);
// The geometry of a segment of `segment_bytes` that another process made:
// DescriptorError when it is not a pool of this version, PoolCorrupted when
// its geometry does not fit the segment.
PoolGeometry read_pool_geometry(const PoolHeader* h, size_t segment_bytes, const std::string& name);

// "torch_ipc: KV pool <name> is corrupted: <what> ..." (Python: PoolCorruptedError).
[[noreturn]] void throw_pool_corrupted(const std::string& name, const std::string& what);

// Tests only: where each shared field lies, as (name, offset, bytes) from the
// start of the segment's file, for a pool of `max_blocks` blocks.
std::vector<std::pair<std::string, std::pair<size_t, size_t>>> pool_field_offsets(uint64_t max_blocks);

}  // namespace torch_ipc
