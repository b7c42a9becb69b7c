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

namespace torch_ipc {

// What every block of a pool is: its shape and dtype (c10::ScalarType).
constexpr int kMaxBlockDims = 8;
struct BlockLayout {
  std::vector<int64_t> shape;
  int32_t dtype = 0;
  uint64_t block_bytes = 0;
};

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
class __attribute__((visibility("hidden"))) BlockAllocator {
 public:
  struct Header;  // the segment's layout (block_allocator.cpp)
  // Most processes attached at once, most chunks of one pool, and the room
  // for one chunk's descriptor.
  static constexpr uint32_t kMaxProcesses = 128;
  static constexpr uint32_t kMaxChunks = 64;
  static constexpr uint32_t kDescriptorBytes = 2048;
  static constexpr uint64_t kMaxBlocks = uint64_t(1) << 31;

  // A new segment with room for max_blocks blocks (none committed yet; see
  // add_chunk); this process is attached.
  static std::unique_ptr<BlockAllocator> create(const BlockLayout& layout, uint64_t max_blocks);
  // Attach to an existing segment. ProducerGone when the name is gone and
  // its creator exited, DescriptorError when it is not a pool's segment.
  static std::unique_ptr<BlockAllocator> attach(const std::string& name, const ProcessId& creator);
  // Detach: give back every block this process holds and free its process
  // slot. Idempotent; the destructor detaches if this was not called.
  void detach() noexcept;
  ~BlockAllocator();
  BlockAllocator(const BlockAllocator&) = delete;
  BlockAllocator& operator=(const BlockAllocator&) = delete;

  const std::string& name() const { return shm_->name(); }
  BlockLayout layout() const;
  uint64_t num_blocks() const;  // committed (grows with add_chunk)
  uint64_t max_blocks() const;
  uint64_t free_blocks() const;
  uint32_t slot() const { return slot_; }

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
  // Return the blocks of holders that exited; how many came back.
  uint64_t reclaim_dead();
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

 private:
  class Lock;
  BlockAllocator(std::unique_ptr<ShmMapping> shm);
  Header* header() const;
  void register_self();
  void check_attached() const;
  void rebuild_locked();
  uint64_t reclaim_dead_locked();
  void release_slot_locked(uint32_t slot);
  void check_ids_locked(const int64_t* ids, size_t n, uint32_t holder, const char* what) const;

  std::unique_ptr<ShmMapping> shm_;
  uint32_t slot_ = 0;
  bool detached_ = false;
  MadeHere made_here_;  // a forked child uses the pool through an attachment of its own
};

}  // namespace torch_ipc
