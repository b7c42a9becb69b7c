#include "wire/descriptor.h"

#include <cstring>
#include <limits>

#include <c10/core/ScalarType.h>

#include "base/errors.h"

namespace torch_ipc {
namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the descriptor is little-endian and written with memcpy");

constexpr size_t kHeaderBytes = 80;
constexpr size_t kChecksumOffset = 72;
constexpr size_t kEventBytes = 72;
constexpr size_t kLeaseBytes = 40;
constexpr size_t kAllocBytes = 80;
constexpr size_t kStorageBytes = 24;
constexpr size_t kTensorHeadBytes = 16;

class Writer {
 public:
  explicit Writer(size_t reserve) { out_.reserve(reserve); }
  template <typename T>
  void put(T value) {
    out_.append(reinterpret_cast<const char*>(&value), sizeof(T));
  }
  void bytes(const void* p, size_t n) { out_.append(static_cast<const char*>(p), n); }
  void zeros(size_t n) { out_.append(n, '\0'); }
  std::string& str() { return out_; }

 private:
  std::string out_;
};

class Reader {
 public:
  Reader(const uint8_t* p, size_t n) : p_(p), n_(n) {}
  template <typename T>
  T get(const char* what) {
    T value;
    need(sizeof(T), what);
    std::memcpy(&value, p_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return value;
  }
  void bytes(void* dst, size_t n, const char* what) {
    need(n, what);
    std::memcpy(dst, p_ + pos_, n);
    pos_ += n;
  }
  void skip(size_t n, const char* what) {
    need(n, what);
    pos_ += n;
  }
  // Padding and reserved bytes must be zero, so a later format can use them.
  void zeros(size_t n, const char* what) {
    need(n, what);
    for (size_t i = 0; i < n; ++i)
      if (p_[pos_ + i] != 0)
        throw DescriptorError("malformed torch_ipc descriptor: " + std::string(what) + " is not zero");
    pos_ += n;
  }
  size_t pos() const { return pos_; }
  size_t left() const { return n_ - pos_; }

 private:
  void need(size_t n, const char* what) {
    if (n > n_ - pos_)
      throw DescriptorError("torch_ipc descriptor is truncated: " + std::string(what) + " needs " + std::to_string(n) +
                            " bytes at offset " + std::to_string(pos_) + ", " + std::to_string(n_ - pos_) + " left");
  }
  const uint8_t* p_;
  size_t n_;
  size_t pos_ = 0;
};

// Note [descriptor checksum]
// Bounds checks catch a corrupted count or offset, but not a flipped bit in a
// handle or a shared memory name that happens to name other live memory: that
// would be a silently wrong tensor. So the descriptor carries a 64-bit hash of
// all its other bytes. It detects accidents, not forgery: a peer that can send
// you bytes is trusted (authkey) as with pickle.
uint64_t checksum(const uint8_t* p, size_t n) {
  uint64_t h = 0x9E3779B97F4A7C15ull ^ n;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    if (i == kChecksumOffset) w = 0;
    h = (h ^ w) * 0xFF51AFD7ED558CCDull;
    h ^= h >> 32;
  }
  for (; i < n; ++i) h = (h ^ p[i]) * 0xC4CEB9FE1A85EC53ull;
  h ^= h >> 29;
  return h;
}

[[noreturn]] void bad(const std::string& why) { throw DescriptorError("malformed torch_ipc descriptor: " + why); }

void check_index(uint64_t index, size_t count, const char* what) {
  if (index >= count)
    bad(std::string(what) + " index " + std::to_string(index) + " out of range (" + std::to_string(count) +
        " entries)");
}

bool valid_kind(uint8_t k) { return k >= 1 && k <= 3; }

// Bytes per element of a dtype code (c10::ScalarType); 0 for codes a
// descriptor may not carry (unknown, undefined, quantized).
size_t dtype_itemsize(uint8_t code) {
  if (code >= static_cast<uint8_t>(c10::ScalarType::NumOptions) ||
      code == static_cast<uint8_t>(c10::ScalarType::Undefined))
    return 0;
  const auto dtype = static_cast<c10::ScalarType>(code);
  if (c10::isQIntType(dtype)) return 0;
  try {
    return c10::elementSize(dtype);
  } catch (const c10::Error&) {  // a code this torch names but cannot size
    return 0;
  }
}

// Note [view bounds]
// A tensor record is a view (sizes, strides, storage offset, dtype) of one
// storage, and the importer builds it without copying: a view that reaches
// past its storage would let a crafted descriptor read and write anywhere in
// the consumer. So every record is checked here, where the storage sizes are
// known, and every product and sum is overflow-checked (in 64 bits, unsigned
// for byte extents): the element count must fit an int64 (torch computes
// it), and the last byte the view can touch, (offset + sum((size-1)*stride)
// + 1) * itemsize, must lie inside the storage. An empty view touches no
// memory, but its storage offset must still lie inside the storage.
void check_tensor(const TensorRecord& t, c10::IntArrayRef sizes, c10::IntArrayRef strides, uint64_t storage_bytes) {
  const size_t itemsize = dtype_itemsize(t.dtype);
  if (itemsize == 0) bad("unknown or unsupported dtype code " + std::to_string(t.dtype));
  if ((t.flags & kRequiresGrad) && !c10::isFloatingType(static_cast<c10::ScalarType>(t.dtype)) &&
      !c10::isComplexType(static_cast<c10::ScalarType>(t.dtype)))
    bad("requires_grad on a tensor that is neither floating point nor complex");
  int64_t numel = 1;
  for (int64_t size : sizes)
    if (__builtin_mul_overflow(numel, size, &numel)) bad("a tensor's element count overflows");
  uint64_t end;  // one past the last byte the view can touch
  if (numel == 0) {
    if (__builtin_mul_overflow(static_cast<uint64_t>(t.storage_offset), itemsize, &end))
      bad("a tensor's storage offset overflows");
  } else {
    uint64_t last = static_cast<uint64_t>(t.storage_offset);  // element index
    for (size_t i = 0; i < sizes.size(); ++i) {
      uint64_t reach;
      if (__builtin_mul_overflow(static_cast<uint64_t>(sizes[i] - 1), static_cast<uint64_t>(strides[i]), &reach) ||
          __builtin_add_overflow(last, reach, &last))
        bad("a tensor view's extent overflows");
    }
    if (__builtin_add_overflow(last, uint64_t{1}, &last) ||
        __builtin_mul_overflow(last, static_cast<uint64_t>(itemsize), &end))
      bad("a tensor view's extent overflows");
  }
  if (end > storage_bytes) bad("a tensor view runs past its storage (" + std::to_string(storage_bytes) + " bytes)");
}

// decode() in steps: the header, then each table in the order of Note
// [descriptor layout], each record checked against the tables before it.
struct Counts {
  uint16_t devices, events, leases;
  uint32_t allocs, storages, tensors, payload;
};

// The header: magic, version, flags, length, counts, producer, boot id; the
// checksum over the whole buffer; and whether the fixed-size tables fit.
Counts read_header(Reader& r, const uint8_t* data, size_t size, Descriptor& d) {
  if (size < 4 || r.get<uint32_t>("magic") != kMagic) bad("bad magic number (this is not a torch_ipc descriptor)");
  uint16_t version = r.get<uint16_t>("version");
  if (version != kVersion)
    throw DescriptorError("torch_ipc descriptor has format version " + std::to_string(version) +
                          "; this build reads version " + std::to_string(kVersion));
  d.flags = r.get<uint16_t>("flags");
  if (d.flags & ~(kHasCuda | kHasCpu | kOpenEnded)) bad("unknown header flags");
  uint32_t total = r.get<uint32_t>("length");
  if (total != size)
    bad("length field says " + std::to_string(total) + " bytes but " + std::to_string(size) +
        " were given (truncated or padded)");
  Counts n;
  n.devices = r.get<uint16_t>("device count");
  n.events = r.get<uint16_t>("event count");
  n.leases = r.get<uint16_t>("lease count");
  if (r.get<uint16_t>("reserved") != 0) bad("reserved header field is not zero");
  n.allocs = r.get<uint32_t>("alloc count");
  n.storages = r.get<uint32_t>("storage count");
  n.tensors = r.get<uint32_t>("tensor count");
  n.payload = r.get<uint32_t>("payload length");
  d.producer.pid = r.get<uint32_t>("producer pid");
  d.producer.start_time = r.get<uint64_t>("producer start time");
  d.producer.life = r.get<uint32_t>("producer life key");
  d.producer.pidns = r.get<uint32_t>("producer PID namespace");
  r.bytes(d.boot_id.data(), 16, "boot id");
  uint64_t sum = r.get<uint64_t>("checksum");
  if (sum != checksum(data, size)) bad("checksum mismatch (the bytes were corrupted or changed)");

  // Fixed-size tables: check they fit before allocating anything for them.
  uint64_t fixed = 16ull * n.devices + uint64_t(kEventBytes) * n.events + uint64_t(kLeaseBytes) * n.leases +
                   uint64_t(kAllocBytes) * n.allocs + uint64_t(kStorageBytes) * n.storages +
                   uint64_t(kTensorHeadBytes) * n.tensors + n.payload;
  if (fixed > r.left()) bad("tables and payload need more bytes than the descriptor holds");
  return n;
}

EventRecord read_event(Reader& r, const Counts& n) {
  EventRecord e;
  e.device = r.get<uint16_t>("event device");
  check_index(e.device, n.devices, "event device");
  r.zeros(6, "event padding");
  r.bytes(e.handle.data(), 64, "event handle");
  return e;
}

LeaseRecord read_lease(Reader& r) {
  LeaseRecord l;
  l.owner.pid = r.get<uint32_t>("lease pid");
  l.segment = r.get<uint32_t>("lease segment");
  l.owner.start_time = r.get<uint64_t>("lease start time");
  l.slot = r.get<uint32_t>("lease slot");
  l.owner.life = r.get<uint32_t>("lease life key");
  l.generation = r.get<uint64_t>("lease generation");
  l.owner.pidns = r.get<uint32_t>("lease PID namespace");
  r.zeros(4, "lease padding");
  if (l.owner.pid == 0 || l.generation == 0) bad("lease names no process or generation");
  return l;
}

AllocRecord read_alloc(Reader& r, const Counts& n) {
  AllocRecord a;
  uint8_t kind = r.get<uint8_t>("alloc kind");
  if (!valid_kind(kind)) bad("unknown allocation kind " + std::to_string(kind));
  a.kind = static_cast<AllocKind>(kind);
  r.zeros(1, "alloc padding");
  a.device = r.get<uint16_t>("alloc device");
  if (a.kind == AllocKind::CpuShm) {
    if (a.device != kNone16) bad("a host allocation names a GPU");
  } else {
    check_index(a.device, n.devices, "alloc device");
  }
  a.lease = r.get<uint16_t>("alloc lease");
  check_index(a.lease, n.leases, "alloc lease");
  r.zeros(2, "alloc padding");
  a.size = r.get<uint64_t>("alloc size");
  r.bytes(a.handle.data(), 64, "alloc handle");
  if (a.size == 0) bad("an allocation of zero bytes");
  return a;
}

StorageRecord read_storage(Reader& r, const Counts& n, const std::vector<AllocRecord>& allocs) {
  StorageRecord s;
  s.alloc = r.get<uint32_t>("storage alloc");
  s.empty_device = r.get<uint16_t>("storage device");
  r.zeros(2, "storage padding");
  s.offset = r.get<uint64_t>("storage offset");
  s.nbytes = r.get<uint64_t>("storage size");
  if (s.alloc == kNoAlloc) {
    if (s.nbytes != 0 || s.offset != 0) bad("a storage without memory has a size");
    if (s.empty_device != kNone16) check_index(s.empty_device, n.devices, "storage device");
    return s;
  }
  check_index(s.alloc, n.allocs, "storage alloc");
  if (s.empty_device != kNone16) bad("a storage with memory names a device of its own");
  const AllocRecord& a = allocs[s.alloc];
  if (s.offset > a.size || s.nbytes > a.size - s.offset)
    bad("storage [" + std::to_string(s.offset) + ", +" + std::to_string(s.nbytes) +
        ") lies outside its allocation of " + std::to_string(a.size) + " bytes");
  return s;
}

// Its sizes and strides go to the end of `dims` (Note [shapes in one table]).
TensorRecord read_tensor(Reader& r, const Counts& n, const std::vector<StorageRecord>& storages,
                         std::vector<int64_t>& dims) {
  TensorRecord t;
  t.storage = r.get<uint32_t>("tensor storage");
  check_index(t.storage, n.storages, "tensor storage");
  t.dtype = r.get<uint8_t>("tensor dtype");
  const uint8_t ndim = t.ndim = r.get<uint8_t>("tensor ndim");
  if (ndim > kMaxDims) bad("tensor has " + std::to_string(ndim) + " dimensions");
  t.flags = r.get<uint16_t>("tensor flags");
  if (t.flags & ~(kRequiresGrad | kParameter)) bad("unknown tensor flags");
  t.storage_offset = r.get<int64_t>("tensor storage offset");
  if (t.storage_offset < 0) bad("negative storage offset");
  if (16ull * ndim > r.left() - n.payload) bad("tensor shape runs past the tables");
  t.dims = dims.size();
  dims.resize(t.dims + 2 * ndim);
  r.bytes(dims.data() + t.dims, 16 * ndim, "tensor sizes and strides");
  const c10::IntArrayRef sizes(dims.data() + t.dims, ndim), strides(dims.data() + t.dims + ndim, ndim);
  for (int i = 0; i < ndim; ++i)
    if (sizes[i] < 0 || strides[i] < 0) bad("negative size or stride");
  check_tensor(t, sizes, strides, storages[t.storage].nbytes);
  return t;
}

}  // namespace

std::string encode(const Descriptor& d) {
  size_t tensor_bytes = 0;
  for (const auto& t : d.tensors) tensor_bytes += kTensorHeadBytes + 16 * t.ndim;
  size_t total = kHeaderBytes + 16 * d.devices.size() + kEventBytes * d.events.size() + kLeaseBytes * d.leases.size() +
                 kAllocBytes * d.allocs.size() + kStorageBytes * d.storages.size() + tensor_bytes + d.payload.size();
  if (total > std::numeric_limits<uint32_t>::max() || d.devices.size() >= kNone16 || d.events.size() >= kNone16 ||
      d.leases.size() >= kNone16)
    throw InvalidUse("torch_ipc: too many tensors for one descriptor");

  Writer w(total);
  w.put<uint32_t>(kMagic);
  w.put<uint16_t>(kVersion);
  w.put<uint16_t>(d.flags);
  w.put<uint32_t>(static_cast<uint32_t>(total));
  w.put<uint16_t>(static_cast<uint16_t>(d.devices.size()));
  w.put<uint16_t>(static_cast<uint16_t>(d.events.size()));
  w.put<uint16_t>(static_cast<uint16_t>(d.leases.size()));
  w.put<uint16_t>(0);
  w.put<uint32_t>(static_cast<uint32_t>(d.allocs.size()));
  w.put<uint32_t>(static_cast<uint32_t>(d.storages.size()));
  w.put<uint32_t>(static_cast<uint32_t>(d.tensors.size()));
  w.put<uint32_t>(static_cast<uint32_t>(d.payload.size()));
  w.put<uint32_t>(d.producer.pid);
  w.put<uint64_t>(d.producer.start_time);
  w.put<uint32_t>(d.producer.life);
  w.put<uint32_t>(d.producer.pidns);
  w.bytes(d.boot_id.data(), 16);
  w.put<uint64_t>(0);  // checksum, filled in last

  for (const auto& u : d.devices) w.bytes(u.data(), 16);
  for (const auto& e : d.events) {
    w.put<uint16_t>(e.device);
    w.zeros(6);
    w.bytes(e.handle.data(), 64);
  }
  for (const auto& l : d.leases) {
    w.put<uint32_t>(l.owner.pid);
    w.put<uint32_t>(l.segment);
    w.put<uint64_t>(l.owner.start_time);
    w.put<uint32_t>(l.slot);
    w.put<uint32_t>(l.owner.life);
    w.put<uint64_t>(l.generation);
    w.put<uint32_t>(l.owner.pidns);
    w.zeros(4);
  }
  for (const auto& a : d.allocs) {
    w.put<uint8_t>(static_cast<uint8_t>(a.kind));
    w.zeros(1);
    w.put<uint16_t>(a.device);
    w.put<uint16_t>(a.lease);
    w.zeros(2);
    w.put<uint64_t>(a.size);
    w.bytes(a.handle.data(), 64);
  }
  for (const auto& s : d.storages) {
    w.put<uint32_t>(s.alloc);
    w.put<uint16_t>(s.empty_device);
    w.zeros(2);
    w.put<uint64_t>(s.offset);
    w.put<uint64_t>(s.nbytes);
  }
  for (const auto& t : d.tensors) {
    w.put<uint32_t>(t.storage);
    w.put<uint8_t>(t.dtype);
    w.put<uint8_t>(t.ndim);
    w.put<uint16_t>(t.flags);
    w.put<int64_t>(t.storage_offset);
    w.bytes(d.dims.data() + t.dims, 16 * t.ndim);  // sizes, then strides (Note [shapes in one table])
  }
  w.bytes(d.payload.data(), d.payload.size());
  std::string& out = w.str();
  uint64_t sum = checksum(reinterpret_cast<const uint8_t*>(out.data()), out.size());
  std::memcpy(&out[kChecksumOffset], &sum, 8);
  return std::move(out);
}

Descriptor decode(const void* data, size_t size) {
  const auto* bytes = static_cast<const uint8_t*>(data);
  Reader r(bytes, size);
  Descriptor d;
  const Counts n = read_header(r, bytes, size, d);
  d.devices.resize(n.devices);
  for (auto& u : d.devices) r.bytes(u.data(), 16, "device uuid");
  d.events.resize(n.events);
  for (auto& e : d.events) e = read_event(r, n);
  d.leases.resize(n.leases);
  for (auto& l : d.leases) l = read_lease(r);
  d.allocs.resize(n.allocs);
  for (auto& a : d.allocs) a = read_alloc(r, n);
  d.storages.resize(n.storages);
  for (auto& s : d.storages) s = read_storage(r, n, d.allocs);
  d.tensors.resize(n.tensors);
  // What is left before the payload bounds the shapes (each dim 8 bytes twice).
  d.dims.reserve((r.left() - n.payload - uint64_t(kTensorHeadBytes) * n.tensors) / 8);
  for (auto& t : d.tensors) t = read_tensor(r, n, d.storages, d.dims);
  if (r.left() != n.payload) bad("bytes left after the tables do not match the payload length");
  d.payload.resize(n.payload);
  r.bytes(d.payload.data(), n.payload, "payload");
  return d;
}

uint16_t storage_device(const Descriptor& d, const StorageRecord& s) {
  return s.alloc == kNoAlloc ? s.empty_device : d.allocs[s.alloc].device;
}

}  // namespace torch_ipc
