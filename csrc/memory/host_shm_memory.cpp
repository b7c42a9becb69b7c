// Host memory (AllocKind::CpuShm): another process's POSIX shared memory
// segment, named by the handle, mapped here and unmapped when dropped.
#include <memory>
#include <string>
#include <string_view>

#include "base/errors.h"

#include "os/names.h"
#include "os/process.h"
#include "os/shm.h"

#include "memory/host_memory.h"
#include "memory/memory_kind.h"

namespace torch_ipc {
namespace {

struct HostShmMemory : OpenedMemory {
  std::shared_ptr<ShmMapping> shm;  // unmaps when dropped (in a forked child too: its own copy)
};

// A host segment's name (Note [names]) and nothing else: a handle is never a path.
std::string_view host_name(const Handle64& h) {
  size_t n = 0;
  while (n < h.size() && h[n] != 0) ++n;
  for (size_t i = n; i < h.size(); ++i)
    if (h[i] != 0) throw DescriptorError("malformed torch_ipc descriptor: bytes after a shared memory name");
  std::string_view name(reinterpret_cast<const char*>(h.data()), n);
  auto parsed = n > 0 && name[0] == '/' ? parse_shared_file_name(name.substr(1)) : std::nullopt;
  if (!parsed || parsed->lease) throw DescriptorError("malformed torch_ipc descriptor: bad shared memory name");
  return name;
}

void check_host_name(const Handle64& h) { host_name(h); }

std::unique_ptr<OpenedMemory> open_host(const Allocation& where, const ProcessId& owner) {
  const std::string name(host_name(where.handle));
  std::shared_ptr<ShmMapping> shm = open_host_segment(name, where.size);
  if (!shm) {
    if (!process_alive(owner)) throw producer_gone(owner.pid, "its shared memory is gone");
    throw Released("torch_ipc: the shared memory " + name + " was already released by its producer");
  }
  auto m = std::make_unique<HostShmMemory>();
  m->base = static_cast<char*>(shm->data());
  m->shm = std::move(shm);
  return m;
}

}  // namespace

// Host memory closes with its last tensor: idle, it would keep memory its
// producer freed, and mapping it again costs microseconds.
const MemoryKind host_shm_memory{/*on_gpu=*/false, /*stays_open_idle=*/false, &check_host_name, &open_host};

}  // namespace torch_ipc
