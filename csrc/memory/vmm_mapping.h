// What the driver says about a VMM (cuMemMap) mapping: the mapping and the
// physical allocation that hold an address. Used by the export side and SharedPool.
#pragma once

#include <cstddef>
#include <cuda.h>
#include <string>

namespace torch_ipc {

// The cuMemMap mapping that holds address p: its start, its size, and the
// driver's id of the physical allocation behind it (0 when the driver has none).
struct MappedChunk {
  CUdeviceptr base = 0;
  size_t size = 0;
  unsigned long long block = 0;
};
// Throws InvalidUse (RuntimeError) that says why when no VMM mapping holds p.
MappedChunk chunk_at(CUdeviceptr p);

// Let `device` read and write every VMM mapping that holds part of
// [p, p + size): a kernel on a peer GPU reads an imported snapshot in place
// (Note [peer reads of a snapshot] in torch_ipc/weights/_shard_local.py).
// The mappings' other devices keep their access.
void grant_device_access(CUdeviceptr p, size_t size, int device);

// The message for memory that neither legacy IPC nor VMM can share, ending
// with `why` (the driver's refusal).
std::string vmm_not_shareable(const std::string& why);

}  // namespace torch_ipc
