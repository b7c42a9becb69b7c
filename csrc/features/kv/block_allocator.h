// Block ownership of a shared KV pool: which process holds each block, the
// free blocks, and the pool's layout and chunks, in one shared memory segment.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "base/ids.h"

#include "os/process.h"
#include "os/shm.h"

#include "features/kv/pool_segment.h"

namespace torch_ipc {

// Memory of a range of block ids [first, first + count): one allocation,
// reached through the torch_ipc descriptor its creator exported.
struct PoolChunk {
  uint64_t first = 0;
  uint64_t count = 0;
  std::string descriptor;
};

// A process attached to the pool, as the pool records it.
struct PoolHolder {
  ProcessId process;
  uint64_t blocks = 0;
};

// Hidden, like the pybind11 type that binds it (csrc/python/).
// Every value it reads from the segment is checked before use (Note [nothing
// trusted from the pool's segment] in pool_segment.h): an inconsistency throws
// PoolCorrupted, a lock held past lock_timeout() OsError(ETIMEDOUT).
class __attribute__((visibility("hidden"))) BlockAllocator {
 public:
  static constexpr uint32_t kMaxProcesses = kPoolMaxProcesses;
  static constexpr uint32_t kMaxChunks = kPoolMaxChunks;
  static constexpr uint32_t kDescriptorBytes = kPoolDescriptorBytes;
  static constexpr uint64_t kMaxBlocks = kPoolMaxBlocks;
  // Seconds: TORCH_IPC_KV_LOCK_TIMEOUT, read at load (Note [checked settings]),
  // else 10 (Note [the pool's lock] in pool_lock.h). An attach waits this long.
  static double default_lock_timeout();

  // A new segment with room for max_blocks blocks (none committed yet; see
  // add_chunk); this process is attached.
  static std::unique_ptr<BlockAllocator> create(const BlockLayout& layout, uint64_t max_blocks);
  // Attach to an existing segment, made by the process its name names (Note
  // [names]); `creator`, when not zero, must be that process. ProducerGone
  // when the name is gone and its creator exited, Released when it was closed
  // or the file there is not the creator's (Note [segment identity] in
  // os/shm.h), DescriptorError when it is not a pool's segment.
  static std::unique_ptr<BlockAllocator> attach(const std::string& name, const ProcessId& creator);
  // Detach: give back every block this process holds and free its process
  // slot. Idempotent; the destructor detaches if this was not called.
  void detach() noexcept;
  ~BlockAllocator();
  BlockAllocator(const BlockAllocator&) = delete;
  BlockAllocator& operator=(const BlockAllocator&) = delete;

  const std::string& name() const { return shm_->name(); }
  const BlockLayout& layout() const { return geometry_.layout; }
  uint64_t num_blocks() const;  // committed (grows with add_chunk)
  uint64_t max_blocks() const { return geometry_.max_blocks; }
  uint64_t free_blocks() const;
  uint32_t slot() const { return slot_; }
  // Seconds an operation waits for the lock before OsError(ETIMEDOUT).
  double lock_timeout() const { return lock_timeout_; }
  void set_lock_timeout(double seconds);

  // n free block ids, now held by this process; empty when fewer than n are
  // free even after reclaiming dead holders' blocks.
  std::vector<int64_t> allocate(uint64_t n);
  // Give back blocks this process holds. All or nothing: IndexError for an id
  // out of range, ValueError for a repeated id or one this process does not hold.
  void free(const int64_t* ids, size_t n);
  // Check that this process holds every block (errors as free()).
  void check_held(const int64_t* ids, size_t n) const;
  // Take over blocks that `from` (attached in slot from_slot) holds: how a
  // hand-over moves them to the reader. All or nothing, errors as free().
  void take_over(const int64_t* ids, size_t n, uint32_t from_slot, const ProcessId& from);
  // Return the blocks of holders that exited; how many came back. With
  // `wait` false, nothing is done (0) when the lock is busy now.
  uint64_t reclaim_dead(bool wait = true);
  // The holder of one block (pid 0: free), and every attached process.
  ProcessId holder_of(int64_t id) const;
  std::vector<PoolHolder> holders() const;
  std::vector<int64_t> held_by_self() const;

  // Commit `count` more blocks, ids [num_blocks, num_blocks + count), whose
  // memory `descriptor` shares; they join the free blocks.
  void add_chunk(uint64_t count, const std::string& descriptor);
  // The chunks from index `from` on.
  std::vector<PoolChunk> chunks(size_t from) const;
  // For tests: take the lock, leave the free count as a half-done operation
  // would, and never return (the test kills this process).
  [[noreturn]] void stall_mid_operation_for_tests();
  // Remove the segment's name (the creator, at close); mappings stay valid.
  void unlink() { shm_->unlink(); }
  // Tests only: (name, (offset, bytes)) of each shared field in the segment's file.
  std::vector<std::pair<std::string, std::pair<size_t, size_t>>> field_offsets() const {
    return pool_field_offsets(geometry_.max_blocks);
  }

 private:
  class Lock;
  BlockAllocator(std::unique_ptr<ShmMapping> shm, PoolGeometry geometry);
  PoolHeader* header() const { return static_cast<PoolHeader*>(shm_->data()); }
  uint32_t* holder_table() const { return reinterpret_cast<uint32_t*>(header() + 1); }
  uint32_t* free_stack() const { return holder_table() + geometry_.max_blocks; }
  [[noreturn]] void corrupted(const std::string& what) const { throw_pool_corrupted(name(), what); }
  void register_self();
  void check_attached() const;
  uint64_t committed_by_chunks_locked() const;
  void check_locked() const;
  uint64_t checked_count(uint64_t value, uint64_t bound, const char* what) const;
  uint32_t holder_slot(uint32_t word, uint64_t id) const;
  void push_free(uint32_t* stack, uint64_t& n_free, uint64_t id) const;
  void rebuild_locked();
  uint64_t reclaim_dead_locked();
  void release_slot_locked(uint32_t slot);
  void check_ids_locked(const int64_t* ids, size_t n, uint32_t holder, const char* what) const;
  void take_from_slot_locked(uint32_t slot, uint64_t n);

  std::unique_ptr<ShmMapping> shm_;
  PoolGeometry geometry_;  // this process's copy, never read again from the segment
  double lock_timeout_ = default_lock_timeout();
  uint32_t slot_ = 0;
  bool registered_ = false;
  bool detached_ = false;
  MadeHere made_here_;  // a forked child uses the pool through an attachment of its own
};

}  // namespace torch_ipc
