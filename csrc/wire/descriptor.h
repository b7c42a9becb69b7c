// The wire format: a versioned, little-endian, fixed-layout byte string that
// describes a batch of tensors. Encode, decode and validate; no CUDA. This
// header includes no torch; descriptor.cpp asks c10's ScalarType table for
// the size of each dtype code (Note [view bounds]). decode() throws
// DescriptorError, encode() InvalidUse when the tables outgrow the format
// (base/errors.h).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include <c10/util/ArrayRef.h>

#include "base/ids.h"

namespace torch_ipc {

// Note [descriptor layout]
// header (80 B, the last 8 a checksum) | devices | events | leases | allocs | storages | tensors | payload
// A batch (a list, a dict, a state_dict) is ONE descriptor: a table of the
// distinct base allocations, one event per device, one lease per producer,
// then a small record per storage and per tensor. Each fact is written once:
// a storage's kind and device are its allocation's. Every count and index is
// checked against the buffer before use, and every tensor view against its
// storage with overflow-checked arithmetic; decode() throws DescriptorError
// on anything malformed, so nothing it returns can reach outside the memory
// it names. The payload is the pickled skeleton of the user's object
// (tensors replaced by their index) and is opaque here.
constexpr uint32_t kMagic = 0x43504954;  // "TIPC"
// Version 3: the producer and each lease owner carry a life key and a PID
// namespace (Note [life files] in os/life.h); the header is 80 bytes, a lease 40.
constexpr uint16_t kVersion = 3;
constexpr uint16_t kNone16 = 0xFFFF;
constexpr uint32_t kNoAlloc = 0xFFFFFFFF;
constexpr int kMaxDims = 64;

// kOpenEnded: an export of dumps(consumers=None) (Note [open-ended exports] in
// export.cpp): its forwarded leases carry no pending deliveries.
enum HeaderFlags : uint16_t { kHasCuda = 1, kHasCpu = 2, kOpenEnded = 4 };

enum class AllocKind : uint8_t {
  CudaIpc = 1,  // legacy cudaIpcMemHandle of a cudaMalloc segment
  CudaVmm = 2,  // cuMemCreate allocation exported as a POSIX fd
  CpuShm = 3,   // POSIX shared memory segment, handle holds its name
};

enum TensorFlags : uint16_t { kRequiresGrad = 1, kParameter = 2 };

struct EventRecord {
  uint16_t device = 0;  // index into devices
  Handle64 handle{};
};

// A slot of shared-memory counters in the segment `segment` of process `owner`.
struct LeaseRecord {
  ProcessId owner;
  uint32_t segment = 0;
  uint32_t slot = 0;
  uint64_t generation = 0;
};

struct AllocRecord {
  AllocKind kind = AllocKind::CudaIpc;
  uint16_t device = kNone16;  // index into devices; kNone16 for CPU
  uint16_t lease = 0;         // index into leases
  uint64_t size = 0;          // bytes of the base allocation
  Handle64 handle{};          // kind-specific: IPC handle, VMM handle field, shm name
};

struct StorageRecord {
  uint32_t alloc = kNoAlloc;  // kNoAlloc: an empty storage, no memory behind it
  // Only for a storage without memory: its device (index into devices), or
  // kNone16 for CPU. A storage with memory is where its allocation is, and
  // says kNone16 here.
  uint16_t empty_device = kNone16;
  uint64_t offset = 0;  // bytes from the base allocation's start
  uint64_t nbytes = 0;
};

// Note [shapes in one table]
// A tensor's sizes and strides live in the descriptor's `dims`, not in the
// record: at `dims` its ndim sizes, then its ndim strides, as on the wire. A
// message of a thousand small tensors then costs no allocation per tensor to
// build, encode, decode or free (tensor_sizes/tensor_strides read them).
struct TensorRecord {
  uint32_t storage = 0;
  uint8_t dtype = 0;  // c10::ScalarType, checked by decode() (Note [view bounds])
  uint8_t ndim = 0;
  uint16_t flags = 0;
  int64_t storage_offset = 0;  // elements
  size_t dims = 0;             // index into Descriptor::dims
};

struct Descriptor {
  uint16_t flags = 0;
  ProcessId producer;
  Uuid boot_id{};
  std::vector<Uuid> devices;
  std::vector<EventRecord> events;
  std::vector<LeaseRecord> leases;
  std::vector<AllocRecord> allocs;
  std::vector<StorageRecord> storages;
  std::vector<TensorRecord> tensors;
  std::vector<int64_t> dims;  // Note [shapes in one table]
  std::string payload;
};

// Tensor `t` of `d`'s sizes and strides.
inline c10::IntArrayRef tensor_sizes(const Descriptor& d, const TensorRecord& t) {
  return {d.dims.data() + t.dims, t.ndim};
}
inline c10::IntArrayRef tensor_strides(const Descriptor& d, const TensorRecord& t) {
  return {d.dims.data() + t.dims + t.ndim, t.ndim};
}

// Where storage `s` lives: CPU (kNone16) or an index into devices.
uint16_t storage_device(const Descriptor& d, const StorageRecord& s);

std::string encode(const Descriptor& d);
Descriptor decode(const void* data, size_t size);  // throws DescriptorError

}  // namespace torch_ipc
