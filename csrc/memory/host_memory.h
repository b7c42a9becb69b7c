// Host (CPU) tensor storage in POSIX shared memory: moving a storage there in
// place (as torch's share_memory_() does) and mapping it in another process.
#pragma once

#include <memory>
#include <string>

#include <c10/core/Storage.h>

#include "os/shm.h"

namespace torch_ipc {

// The name and size of the shared memory object behind a CPU storage, moving
// the storage's bytes into a new object first when they are not there yet.
// Like share_memory_(), this swaps the storage's memory in place: every view
// of it sees the shared copy.
struct HostSegment {
  std::string name;
  size_t size;
};
HostSegment ensure_host_shared(const c10::Storage& storage);
// True when ensure_host_shared moved this storage already.
bool is_host_shared(const c10::Storage& storage);

// Map another process's object: the one its name names as its maker (Note
// [segment identity] in os/shm.h). Returns nullptr when the name is gone.
std::shared_ptr<ShmMapping> open_host_segment(const std::string& name, size_t min_size);

int host_segment_count();
// Remove the names of this process's segments (at exit); mappings stay valid.
void host_unlink_all();

}  // namespace torch_ipc
