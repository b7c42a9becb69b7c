#include "features/kv/pool_segment.h"

#include <algorithm>
#include <cstddef>

#include <c10/core/ScalarType.h>

#include "base/errors.h"

#include "os/shm.h"

namespace torch_ipc {
namespace {

// Version 3: slots carry the life key and PID namespace (Note [pool slots
// across PID namespaces] in pool_segment.h). The magic names the version too,
// so an older torch_ipc refuses a newer segment by its magic alone.
constexpr uint64_t kMagicBase = 0x3030564b43504954ull;  // "TIPCKV00"
constexpr uint32_t kSegmentVersion = 3;
constexpr uint64_t kSegmentMagic = kMagicBase + (uint64_t(kSegmentVersion) << 56);  // "TIPCKV03"
// "TIPCKV0<digit>": a pool segment of some version.
bool is_pool_magic(uint64_t magic) {
  return (magic & 0x00FFFFFFFFFFFFFFull) == (kMagicBase & 0x00FFFFFFFFFFFFFFull) && (magic >> 56) >= '1' &&
         (magic >> 56) <= '9';
}

}  // namespace

size_t pool_segment_bytes(uint64_t max_blocks) {
  return sizeof(PoolHeader) + 2 * sizeof(uint32_t) * max_blocks;  // max_blocks <= 2^31
}

uint64_t checked_block_bytes(uint32_t ndim, const int64_t* shape, int32_t dtype) {
  if (ndim > kMaxBlockDims || dtype < 0 || dtype >= static_cast<int32_t>(c10::ScalarType::NumOptions) ||
      dtype == static_cast<int32_t>(c10::ScalarType::Undefined))
    return 0;
  uint64_t bytes = c10::elementSize(static_cast<c10::ScalarType>(dtype));
  for (uint32_t i = 0; i < ndim; ++i) {
    if (shape[i] <= 0 || bytes > UINT64_MAX / static_cast<uint64_t>(shape[i])) return 0;
    bytes *= static_cast<uint64_t>(shape[i]);
  }
  return bytes;
}

void init_pool_header(PoolHeader* h, const PoolGeometry& geometry) {
  h->version = kSegmentVersion;
  h->max_processes = kPoolMaxProcesses;
  h->max_chunks = kPoolMaxChunks;
  h->descriptor_bytes = kPoolDescriptorBytes;
  h->max_blocks = geometry.max_blocks;
  h->ndim = static_cast<uint32_t>(geometry.layout.shape.size());
  h->dtype = geometry.layout.dtype;
  std::copy(geometry.layout.shape.begin(), geometry.layout.shape.end(), h->shape);
  h->block_bytes = geometry.layout.block_bytes;
}

void publish_pool_header(PoolHeader* h) {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  reinterpret_cast<std::atomic<uint64_t>*>(&h->magic)->store(kSegmentMagic);
}

PoolGeometry read_pool_geometry(const PoolHeader* h, size_t segment_bytes, const std::string& name) {
  const auto bad = [&](const std::string& why) {
    return DescriptorError("torch_ipc: " + name + " is not a KV pool segment of this version: " + why);
  };
  const uint64_t magic = reinterpret_cast<const std::atomic<uint64_t>*>(&h->magic)->load();
  if (magic != kSegmentMagic && is_pool_magic(magic))
    throw bad(str("it is a pool of layout version ", char(magic >> 56), ", made by another torch_ipc version (this ",
                  "one reads version ", kSegmentVersion, "); use one torch_ipc version in every process of a pool"));
  if (magic != kSegmentMagic || h->version != kSegmentVersion) throw bad("wrong magic or version");
  if (h->max_processes != kPoolMaxProcesses || h->max_chunks != kPoolMaxChunks ||
      h->descriptor_bytes != kPoolDescriptorBytes)
    throw bad("other table sizes");
  PoolGeometry g;
  g.max_blocks = h->max_blocks;
  // Exactly the segment's size: a max_blocks that is smaller would put the
  // free stack inside the holder table.
  if (g.max_blocks < 1 || g.max_blocks > kPoolMaxBlocks || pool_segment_bytes(g.max_blocks) != segment_bytes)
    throw_pool_corrupted(
        name, str("its max_blocks (", g.max_blocks, ") does not match its size (", segment_bytes, " bytes)"));
  const uint32_t ndim = h->ndim;
  int64_t shape[kMaxBlockDims] = {};
  std::copy(h->shape, h->shape + std::min<uint32_t>(ndim, kMaxBlockDims), shape);
  g.layout.dtype = h->dtype;
  g.layout.block_bytes = h->block_bytes;
  if (ndim == 0 || checked_block_bytes(ndim, shape, g.layout.dtype) != g.layout.block_bytes)
    throw_pool_corrupted(name, "its block layout is inconsistent");
  g.layout.shape.assign(shape, shape + ndim);
  return g;
}

void throw_pool_corrupted(const std::string& name, const std::string& what) {
  throw PoolCorrupted(str("torch_ipc: KV pool ", name, " is corrupted: ", what,
                          ". Some process attached to it wrote into its shared memory what no pool "
                          "operation writes; the operation was refused"));
}

std::vector<std::pair<std::string, std::pair<size_t, size_t>>> pool_field_offsets(uint64_t max_blocks) {
  const size_t base = ShmMapping::kIdentityBytes;
  const size_t holders = base + sizeof(PoolHeader);
#define TORCH_IPC_FIELD(name, field)                                        \
  {                                                                         \
    name, { base + offsetof(PoolHeader, field), sizeof(PoolHeader::field) } \
  }
  std::vector<std::pair<std::string, std::pair<size_t, size_t>>> out = {
      TORCH_IPC_FIELD("magic", magic),
      TORCH_IPC_FIELD("version", version),
      TORCH_IPC_FIELD("max_processes", max_processes),
      TORCH_IPC_FIELD("max_blocks", max_blocks),
      TORCH_IPC_FIELD("ndim", ndim),
      TORCH_IPC_FIELD("dtype", dtype),
      TORCH_IPC_FIELD("shape", shape),
      TORCH_IPC_FIELD("block_bytes", block_bytes),
      TORCH_IPC_FIELD("mutex", mutex),
      TORCH_IPC_FIELD("locker_pid", locker_pid),
      TORCH_IPC_FIELD("num_blocks", num_blocks),
      TORCH_IPC_FIELD("free_count", free_count),
      TORCH_IPC_FIELD("num_chunks", num_chunks),
      TORCH_IPC_FIELD("processes", processes),
      TORCH_IPC_FIELD("chunks", chunks),
      {"slot", {sizeof(PoolProcessSlot), 0}},
      {"slot.in_use", {offsetof(PoolProcessSlot, in_use), 4}},
      {"slot.pid", {offsetof(PoolProcessSlot, pid), 4}},
      {"slot.start_time", {offsetof(PoolProcessSlot, start_time), 8}},
      {"slot.life", {offsetof(PoolProcessSlot, life), 4}},
      {"slot.pidns", {offsetof(PoolProcessSlot, pidns), 4}},
      {"slot.held", {offsetof(PoolProcessSlot, held), 8}},
      {"chunk", {sizeof(PoolChunkEntry), 0}},
      {"chunk.first", {offsetof(PoolChunkEntry, first), 8}},
      {"chunk.count", {offsetof(PoolChunkEntry, count), 8}},
      {"chunk.descriptor_bytes", {offsetof(PoolChunkEntry, descriptor_bytes), 4}},
      {"chunk.descriptor", {offsetof(PoolChunkEntry, descriptor), kPoolDescriptorBytes}},
      {"holder", {holders, 4 * max_blocks}},
      {"free_stack", {holders + 4 * max_blocks, 4 * max_blocks}},
  };
#undef TORCH_IPC_FIELD
#ifdef __GLIBC__
  const size_t mutex = base + offsetof(PoolHeader, mutex);
  out.push_back({"mutex.lock_word", {mutex + offsetof(pthread_mutex_t, __data.__lock), 4}});
  out.push_back({"mutex.kind", {mutex + offsetof(pthread_mutex_t, __data.__kind), 4}});
  out.push_back({"mutex.owner", {mutex + offsetof(pthread_mutex_t, __data.__owner), 4}});
  out.push_back({"mutex.robust_list", {mutex + offsetof(pthread_mutex_t, __data.__list), sizeof(__pthread_list_t)}});
#endif
  return out;
}

}  // namespace torch_ipc
