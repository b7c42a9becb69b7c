// The strict codec of the 64-byte VMM handle field (Note [VMM handle field] in
// vmm_handle.h): every value is checked before the consumer acts on it.
#include "wire/vmm_handle.h"

#include <cstring>
#include <cuda.h>
#include <limits>
#include <string>

#include "base/errors.h"

namespace torch_ipc {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "the VMM handle field is little-endian and written with memcpy");
static_assert(kVmmPosixFd == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, "cuda.h disagrees");
static_assert(kVmmFabric == CU_MEM_HANDLE_TYPE_FABRIC, "cuda.h disagrees");

namespace {

// Byte offsets of the values (Note [VMM handle field]).
constexpr size_t kVersionAt = 0, kTypeAt = 1, kFdCountAt = 2, kChunksAt = 4, kIdAt = 8, kChunkBytesAt = 16, kPidAt = 24,
                 kFdsAt = 28;
static_assert(kFdsAt + sizeof(int32_t) * kVmmMaxFdNumbers == sizeof(Handle64), "the fd numbers fill the field");
constexpr int32_t kNoFd = -1;

template <typename T>
void put(Handle64& h, size_t at, T value) {
  std::memcpy(h.data() + at, &value, sizeof(T));
}

template <typename T>
T get(const Handle64& h, size_t at) {
  T value;
  std::memcpy(&value, h.data() + at, sizeof(T));
  return value;
}

std::string str(uint64_t v) { return std::to_string(v); }

// Why `f` is not a field a producer writes; empty when it is one. `alloc_size`:
// the AllocRecord's size, or null when not known.
std::string invalid(const VmmHandleField& f, const uint64_t* alloc_size) {
  if (!vmm_known_handle_type(f.type)) return "unknown handle type " + str(f.type);
  if (f.n_chunks == 0) return "no allocations";
  if (f.id == 0) return "no export id";
  if (f.pid == 0 || f.pid > static_cast<uint32_t>(std::numeric_limits<int32_t>::max()))
    return "pid " + str(f.pid) + " out of range";
  if (!f.fds.empty()) {
    if (f.type != kVmmPosixFd) return "inconsistent fd numbers: fabric handles carry none";
    if (f.fds.size() > static_cast<size_t>(kVmmMaxFdNumbers))
      return "inconsistent fd numbers: " + str(f.fds.size()) + " (at most " + str(kVmmMaxFdNumbers) + ")";
    if (f.fds.size() != f.n_chunks)
      return "inconsistent fd numbers: " + str(f.fds.size()) + " for " + str(f.n_chunks) + " chunks";
    if (f.chunk_bytes == 0) return "inconsistent fd numbers: chunks of different sizes";
    for (int32_t fd : f.fds)
      if (fd < 0) return "inconsistent fd numbers: fd " + std::to_string(fd);
  }
  if (f.chunk_bytes != 0) {
    if (f.chunk_bytes > std::numeric_limits<uint64_t>::max() / f.n_chunks)
      return str(f.n_chunks) + " chunks of " + str(f.chunk_bytes) + " bytes overflow 64 bits";
    if (alloc_size && *alloc_size != f.chunk_bytes * f.n_chunks)
      return "allocation size " + str(*alloc_size) + " is not " + str(f.n_chunks) + " chunks of " + str(f.chunk_bytes) +
             " bytes";
  } else {
    // No common size means at least two chunks of different (nonzero) sizes.
    if (f.n_chunks < 2) return "one chunk and no chunk size";
    if (alloc_size && *alloc_size < f.n_chunks)
      return "allocation size " + str(*alloc_size) + " cannot hold " + str(f.n_chunks) + " chunks";
  }
  return {};
}

VmmHandleField decode(const Handle64& h, const uint64_t* alloc_size) {
  auto bad = [](const std::string& why) {
    return DescriptorError("malformed torch_ipc descriptor: VMM handle field: " + why);
  };
  const uint8_t version = h[kVersionAt];
  if (version != kVmmHandleVersion) throw bad("unknown version " + str(version));
  VmmHandleField f;
  f.type = h[kTypeAt];
  const uint16_t n_fds = get<uint16_t>(h, kFdCountAt);
  if (n_fds > kVmmMaxFdNumbers)
    throw bad("inconsistent fd numbers: " + str(n_fds) + " (at most " + str(kVmmMaxFdNumbers) + ")");
  f.n_chunks = get<uint32_t>(h, kChunksAt);
  f.id = get<uint64_t>(h, kIdAt);
  f.chunk_bytes = get<uint64_t>(h, kChunkBytesAt);
  f.pid = get<uint32_t>(h, kPidAt);
  for (int i = 0; i < kVmmMaxFdNumbers; ++i) {
    const int32_t fd = get<int32_t>(h, kFdsAt + sizeof(int32_t) * i);
    if (i < n_fds)
      f.fds.push_back(fd);
    else if (fd != kNoFd)
      throw bad("unused fd slot " + str(i) + " holds " + std::to_string(fd) + ", not -1");
  }
  std::string why = invalid(f, alloc_size);
  if (!why.empty()) throw bad(why);
  return f;
}

}  // namespace

bool vmm_known_handle_type(int64_t type) { return type == kVmmPosixFd || type == kVmmFabric; }

Handle64 encode_vmm_handle(const VmmHandleField& f) {
  std::string why = invalid(f, nullptr);
  if (!why.empty()) throw DescriptorError("torch_ipc: cannot encode a VMM handle field: " + why);
  Handle64 h{};
  h[kVersionAt] = kVmmHandleVersion;
  h[kTypeAt] = f.type;
  put<uint16_t>(h, kFdCountAt, static_cast<uint16_t>(f.fds.size()));
  put<uint32_t>(h, kChunksAt, f.n_chunks);
  put<uint64_t>(h, kIdAt, f.id);
  put<uint64_t>(h, kChunkBytesAt, f.chunk_bytes);
  put<uint32_t>(h, kPidAt, f.pid);
  for (size_t i = 0; i < static_cast<size_t>(kVmmMaxFdNumbers); ++i)
    put<int32_t>(h, kFdsAt + sizeof(int32_t) * i, i < f.fds.size() ? f.fds[i] : kNoFd);
  return h;
}

VmmHandleField decode_vmm_handle(const Handle64& field) { return decode(field, nullptr); }

VmmHandleField decode_vmm_handle(const Handle64& field, uint64_t alloc_size) { return decode(field, &alloc_size); }

}  // namespace torch_ipc
