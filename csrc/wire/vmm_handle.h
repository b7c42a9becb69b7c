// The 64-byte VMM handle field of a descriptor's AllocRecord: its layout, and a
// strict encode/decode of it. Pure C++: no CUDA calls, no torch.
#pragma once

#include <cstdint>
#include <vector>

#include "wire/descriptor.h"

namespace torch_ipc {

// Note [VMM handle field]
// A storage in VMM memory may span several physical allocations: torch's
// expandable segments map many cuMemCreate chunks (2 MiB in the small pool,
// 20 MiB in the large one) back to back in one reserved range. The
// descriptor's AllocRecord then stands for the run of chunks the storage
// touches (size = their total bytes, offset = where the storage starts in the
// first), and its 64-byte handle field says how to get them:
//   u8  version (1)          u8  handle type (CU_MEM_HANDLE_TYPE_*)
//   u16 fd numbers present   u32 chunks in the run
//   u64 export id            the producer's random id for the run (fd_publish)
//   u64 chunk bytes          when all chunks have one size, else 0
//   u32 producer pid         i32 x 9: the producer's fd numbers, for pidfd_getfd
// The consumer asks the producer (named by the lease owner) for the run by
// id, gets one shareable handle per chunk, reserves one range and maps each
// chunk in order: a consumer maps whole allocations, never part of one.
// Little-endian, like the rest of the descriptor. fd numbers are sent only
// for POSIX handles, all chunks of one size, and at most 9 chunks; the slots
// not used hold -1.
constexpr uint8_t kVmmHandleVersion = 1;
constexpr int kVmmMaxFdNumbers = 9;
// CUmemAllocationHandleType values (vmm_handle.cpp checks them against cuda.h).
constexpr uint8_t kVmmPosixFd = 1;  // CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
constexpr uint8_t kVmmFabric = 8;   // CU_MEM_HANDLE_TYPE_FABRIC

// The field's values; the version is implied (kVmmHandleVersion).
struct VmmHandleField {
  uint8_t type = kVmmPosixFd;
  uint32_t n_chunks = 0;
  uint64_t id = 0;           // never 0
  uint64_t chunk_bytes = 0;  // 0: the chunks differ in size
  uint32_t pid = 0;
  std::vector<int32_t> fds;  // one per chunk, or none (ask the producer's socket)
};

// POSIX fd or fabric: the handle types a field may carry and SharedPool makes.
bool vmm_known_handle_type(int64_t type);

// Throws DescriptorError when `f` is not a field decode would accept.
Handle64 encode_vmm_handle(const VmmHandleField& f);

// Throws DescriptorError on anything malformed: another version, an unknown
// handle type, no chunks or no id, a pid out of range, fd numbers that do not
// fit the type, the chunk count or the size, unused fd slots not -1, and (given
// the AllocRecord's size) chunks that cannot add up to `alloc_size` bytes.
VmmHandleField decode_vmm_handle(const Handle64& field);
VmmHandleField decode_vmm_handle(const Handle64& field, uint64_t alloc_size);

}  // namespace torch_ipc
