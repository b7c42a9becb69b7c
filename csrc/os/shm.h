// POSIX shared memory mappings (shm_open + mmap), owned RAII-style. Used for
// the lease counters, host (CPU) tensor storage and KV pools.
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <string>

#include "base/ids.h"

namespace torch_ipc {

// Note [segment identity]
// /dev/shm is world-writable and its names are listable: once a segment's
// name is gone (its owner unlinked it, or exited and was swept), any local
// user can create a file of that name, and a process that opens it by name
// would map what that user wrote (a KV pool's chunk records, a tensor's
// bytes). So every segment is checked when opened: it must be a regular file
// (O_NOFOLLOW: never a symlink) of this process's euid with mode 0600 exactly
// (nobody else could have written it), and it starts with an identity page
// that its creator wrote: a magic word and the creator's pid and start time,
// which must be the process the opener expected (the one its name names,
// Note [names] in names.h). What the caller sees (data(), size()) starts
// after that page, so it stays page-aligned. A file that fails is not the
// producer's: Released ("the producer let go of it; this file is another's").

class ShmMapping {
 public:
  // Create a new object of `size` bytes, its memory reserved (Note [reserving
  // shared memory]). Returns nullptr when the name exists (pick another);
  // throws OsError with the failing call's errno otherwise (ENOSPC when
  // /dev/shm is too small, naming its size and free space; EMFILE, ...), and
  // leaves no file behind. An `anchor` keeps its file open with an OFD lock
  // for as long as it lives: the proof that its owner lives (Note [sweep]);
  // one of no bytes maps nothing (Note [an anchor maps nothing]).
  // `creator` (this process) is written into its identity page (Note
  // [segment identity]).
  static std::unique_ptr<ShmMapping> create(const std::string& name, size_t size, const ProcessId& creator,
                                            bool anchor = false);
  // Open an existing object made by `creator`; at least `min_size` bytes must
  // be there. Returns nullptr when no object has that name (its owner
  // unlinked it); throws Released when the file is not `creator`'s (Note
  // [segment identity]), DescriptorError when it is smaller (the size came
  // from a descriptor), and OsError when a call fails (EACCES, EMFILE, ...).
  static std::unique_ptr<ShmMapping> open(const std::string& name, size_t min_size, const ProcessId& creator);
  // Bytes before data() in every segment: the identity page.
  static constexpr size_t kIdentityBytes = 4096;
  ~ShmMapping();
  ShmMapping(const ShmMapping&) = delete;
  ShmMapping& operator=(const ShmMapping&) = delete;

  // The caller's bytes, after the identity page (an anchor of none: nullptr).
  void* data() const { return base_ == nullptr ? nullptr : static_cast<char*>(base_) + kIdentityBytes; }
  size_t size() const { return base_ == nullptr ? 0 : mapped_ - kIdentityBytes; }
  const std::string& name() const { return name_; }
  // Remove the name; existing mappings stay valid. Idempotent.
  void unlink();
  // Forget the name without removing it, and drop the lock of an anchor (a
  // forked child must not remove its parent's names nor keep them alive after
  // the parent, Note [fork]).
  void disown();

 private:
  ShmMapping(std::string name, void* base, size_t mapped, bool owner, int lock_fd = -1)
      : name_(std::move(name)), base_(base), mapped_(mapped), linked_(owner), lock_fd_(lock_fd) {}
  std::string name_;
  void* base_;     // the mapping, identity page first; nullptr: an anchor of no bytes
  size_t mapped_;  // its bytes
  bool linked_;
  int lock_fd_;  // an anchor's open file, holding its OFD lock; -1 otherwise
};

// Whether the segment open at `fd` has `creator`'s identity page (Note
// [segment identity]); nothing when it could not be read.
std::optional<bool> segment_made_by(int fd, const ProcessId& creator);

}  // namespace torch_ipc
