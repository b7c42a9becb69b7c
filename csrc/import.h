// Consumer side: rebuild tensors from a descriptor on the producer's memory.
// Owns the per-process caches (each base allocation and event opened once),
// the holds on producers' leases, and the deferred release of those holds.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "descriptor.h"

namespace torch_ipc {

// One base allocation of another process, opened in this one.
struct Mapping {
  AllocKind kind;
  int device;  // local CUDA index; -1 for host memory
  char* base;
  uint64_t size;
  Handle64 handle;
  ProcessId producer;
  std::shared_ptr<void> host;  // the ShmMapping for host memory
  std::shared_ptr<void> vmm;   // the VmmMapping for CudaVmm (unmaps when dropped)
  int64_t idle_since_ns = 0;   // set by collect() when no tensor uses it
  ~Mapping();
};

// The holds one import took on one lease, and the mappings its tensors use.
// Dropped when the last storage built by that import dies; the lease is then
// released once the GPU work queued on the memory has finished.
struct Hold {
  LeaseRecord lease;
  std::vector<std::shared_ptr<Mapping>> mappings;
  ~Hold();
};

// DataPtr context of every storage built by import_tensors.
struct ImportedStorage {
  std::shared_ptr<Hold> hold;
  Mapping* mapping;
  uint64_t offset;  // bytes from mapping->base
};
void delete_imported_storage(void* ctx);

struct ImportResult {
  std::vector<at::Tensor> tensors;
  std::vector<bool> is_parameter;
  std::string payload;
};
ImportResult import_tensors(const std::string& data);

// Finish releases whose GPU work is done, close idle mappings (all of them when
// close_idle), and drop what belongs to producers that exited.
void collect_imports(bool close_idle);
// Wait for every deferred release and finish it (at exit).
void flush_imports();

struct ImportStats {
  int64_t holds, pending_releases, mappings_open, mappings_idle, events_open;
};
ImportStats import_stats();

}  // namespace torch_ipc
