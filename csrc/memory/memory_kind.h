// One table of functions per kind of memory (AllocKind): how the import side
// checks a handle of that kind, opens it, and treats it once opened.
#pragma once

#include <memory>

#include "base/ids.h"

#include "memory/location.h"

namespace torch_ipc {

// Note [one table per kind of memory]
// Each kind of memory a descriptor can name has one table, defined in its own
// file (memory/legacy_ipc_memory.cpp, host_shm_memory.cpp, vmm_memory.cpp),
// and memory_kind() below is the one place that maps AllocKind to it, as NCCL
// gives each transport one table of functions. The import side (core/) asks
// the table and never branches on the kind: a new kind of handle is its wire
// format, one file here, and one line in memory_kind.cpp.

// One allocation of another process, opened in this one. Its destructor
// closes or unmaps it (it warns, never throws); in a forked child it leaves
// what the parent opened to the parent (Note [fork]).
struct OpenedMemory {
  char* base = nullptr;
  OpenedMemory() = default;
  OpenedMemory(const OpenedMemory&) = delete;
  OpenedMemory& operator=(const OpenedMemory&) = delete;
  virtual ~OpenedMemory() = default;
};

struct MemoryKind {
  // A GPU's memory: the allocation names one of the descriptor's devices, and
  // a release waits for the GPU work queued on it (Note [deferred release] in
  // core/release.cpp). Host memory does neither.
  bool on_gpu;
  // Whether an opened allocation stays open, idle, once no tensor uses it
  // (Note [idle mappings] in core/mapping_cache.cpp).
  bool stays_open_idle;
  // Refuse, before a load takes anything, a handle that could never be opened
  // (DescriptorError). Null when only opening can tell.
  void (*check_handle)(const Handle64& handle);
  // Open `where` (device: a local CUDA index, -1 for host memory), exported by
  // `owner`. Throws ProducerGone, Released, DescriptorError or CudaError.
  std::unique_ptr<OpenedMemory> (*open)(const Allocation& where, const ProcessId& owner);
};

// The table of `kind` (a value the decoder accepted).
const MemoryKind& memory_kind(AllocKind kind);

// The tables, one file each.
extern const MemoryKind legacy_ipc_memory;  // AllocKind::CudaIpc
extern const MemoryKind host_shm_memory;    // AllocKind::CpuShm
extern const MemoryKind vmm_memory;         // AllocKind::CudaVmm

}  // namespace torch_ipc
