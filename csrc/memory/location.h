// Where a storage's bytes live: the one description of a base allocation that
// the producer's lookups, the consumer's mappings and the descriptor share.
#pragma once

#include <cstdint>

#include "base/ids.h"

#include "wire/descriptor.h"

namespace torch_ipc {

// A base allocation: its kind, device, handle and size.
struct Allocation {
  AllocKind kind = AllocKind::CudaIpc;
  int device = -1;  // local CUDA index; -1 for host memory
  Handle64 handle{};
  uint64_t size = 0;  // bytes
};

// A storage's place: its allocation and its byte offset inside it.
struct Location {
  Allocation alloc;
  uint64_t offset = 0;
};

}  // namespace torch_ipc
