// POSIX shared memory mappings (shm_open + mmap), owned RAII-style. Used for
// the lease counters and for host (CPU) tensor storage.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

namespace torch_ipc {

class ShmMapping {
 public:
  // Create a new object of `size` bytes, its memory reserved (Note [reserving
  // shared memory]). Returns nullptr when the name exists (pick another);
  // throws OsError with the failing call's errno otherwise (ENOSPC when
  // /dev/shm is too small, naming its size and free space; EMFILE, ...), and
  // leaves no file behind. An `anchor` keeps its file open with an OFD lock
  // for as long as it lives: the proof that its owner lives (Note [sweep]).
  static std::unique_ptr<ShmMapping> create(const std::string& name, size_t size,
                                            bool anchor = false);
  // Open an existing object; at least `min_size` bytes must be there. Returns
  // nullptr when no object has that name (its owner unlinked it); throws
  // DescriptorError when it is smaller (the size came from a descriptor), and
  // OsError when a call fails (EACCES, EMFILE, ...).
  static std::unique_ptr<ShmMapping> open(const std::string& name, size_t min_size);
  ~ShmMapping();
  ShmMapping(const ShmMapping&) = delete;
  ShmMapping& operator=(const ShmMapping&) = delete;

  void* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }
  // Remove the name; existing mappings stay valid. Idempotent.
  void unlink();
  // Forget the name without removing it, and drop the lock of an anchor (a
  // forked child must not remove its parent's names nor keep them alive after
  // the parent, Note [fork]).
  void disown();

 private:
  ShmMapping(std::string name, void* data, size_t size, bool owner, int lock_fd = -1)
      : name_(std::move(name)), data_(data), size_(size), linked_(owner), lock_fd_(lock_fd) {}
  std::string name_;
  void* data_;
  size_t size_;
  bool linked_;
  int lock_fd_;  // an anchor's open file, holding its OFD lock; -1 otherwise
};

}  // namespace torch_ipc
