// POSIX shared memory mappings (shm_open + mmap), owned RAII-style. Used for
// the lease counters and for host (CPU) tensor storage.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

namespace torch_ipc {

class ShmMapping {
 public:
  // Create a new object of `size` bytes. Throws OsError with the failing
  // call's errno (EEXIST when the name exists, EMFILE, ENOMEM, ...).
  static std::unique_ptr<ShmMapping> create(const std::string& name, size_t size);
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
  // Forget the name without removing it (a forked child must not remove its
  // parent's names, Note [fork]).
  void disown() { linked_ = false; }

 private:
  ShmMapping(std::string name, void* data, size_t size, bool owner)
      : name_(std::move(name)), data_(data), size_(size), linked_(owner) {}
  std::string name_;
  void* data_;
  size_t size_;
  bool linked_;
};

}  // namespace torch_ipc
