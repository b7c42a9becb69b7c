#include "os/ring_segment.h"

#include <fcntl.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <new>
#include <string>

#include "base/errors.h"

namespace torch_ipc {

// Note [channel segment trust]
// The segment is a memfd: it never has a name, so nobody can open it by path
// and there is nothing to unlink; it is gone when the last fd and mapping are.
// Its creator makes it 0600 and seals its size (F_SEAL_SHRINK | F_SEAL_GROW |
// F_SEAL_SEAL): a peer that could shrink it would turn our next access into a
// SIGBUS. The end that receives the fds checks, before mapping: a regular file
// owned by our effective uid, mode 0600, exactly the size the agreed ring size
// gives, sealed; a header of that ring size; eventfds for bells (a bell that
// were a regular file would have its 8 bytes written into it). What the
// geometry is comes from the caller, never from the segment afterwards.

size_t channel_segment_bytes(uint32_t ring_bytes) {
  return kChannelHeaderBytes + 2 * size_t(ring_bytes);
}

namespace {

constexpr int kSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;

void check_ring_bytes(uint32_t ring_bytes) {
  bool power_of_two = ring_bytes != 0 && (ring_bytes & (ring_bytes - 1)) == 0;
  TORCH_IPC_CHECK_VALUE(power_of_two && ring_bytes >= kMinRingBytes && ring_bytes <= kMaxRingBytes,
                        "torch_ipc: a channel ring is a power of two from 4 KiB to 1 GiB, not ", ring_bytes,
                        " bytes");
}

[[noreturn]] void refuse(const std::string& why) {
  throw OsError(EPERM, "torch_ipc: refusing the channel segment the peer sent: " + why);
}

void check_memory_fd(int fd, size_t size) {
  struct stat st {};
  if (fstat(fd, &st) != 0) throw_os_error("fstat", "the channel segment");
  if (!S_ISREG(st.st_mode)) refuse("not a memory file");
  if (st.st_uid != geteuid()) refuse(str("owned by uid ", st.st_uid, ", not ", geteuid()));
  if ((st.st_mode & 07777) != 0600) refuse(str("mode ", st.st_mode & 07777, " (octal ", (st.st_mode >> 6) & 7,
                                               (st.st_mode >> 3) & 7, st.st_mode & 7, "), not 0600"));
  if (size_t(st.st_size) != size) refuse(str(st.st_size, " bytes, not ", size));
  int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (seals & kSeals) != kSeals) refuse("its size is not sealed");
}

void check_bell_fd(int fd) {
  char link[64] = {};
  std::string path = "/proc/self/fd/" + std::to_string(fd);
  ssize_t n = readlink(path.c_str(), link, sizeof(link) - 1);
  if (n < 0) throw_os_error("readlink", path);
  if (std::strcmp(link, "anon_inode:[eventfd]") != 0) refuse(str("a bell that is not an eventfd (", link, ")"));
}

}  // namespace

ChannelFds ChannelSegment::create(uint32_t ring_bytes) {
  check_ring_bytes(ring_bytes);
  size_t size = channel_segment_bytes(ring_bytes);
  ChannelFds fds;
  fds.memory.reset(memfd_create("torch_ipc-channel", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (fds.memory.get() < 0) throw_os_error("memfd_create", "a channel segment");
  int fd = fds.memory.get();
  if (fchmod(fd, 0600) != 0) throw_os_error("fchmod", "the channel segment");
  if (ftruncate(fd, off_t(size)) != 0) throw_os_error("ftruncate", "the channel segment");
  if (fcntl(fd, F_ADD_SEALS, kSeals) != 0) throw_os_error("fcntl(F_ADD_SEALS)", "the channel segment");
  void* p = mmap(nullptr, kChannelHeaderBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) throw_os_error("mmap", "the channel segment");
  auto* h = new (p) ChannelHeader{};  // zero indices and words
  h->magic = kChannelMagic;
  h->version = kChannelVersion;
  h->ring_bytes = ring_bytes;
  munmap(p, kChannelHeaderBytes);
  for (auto& bell : fds.bell) {
    bell.reset(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (bell.get() < 0) throw_os_error("eventfd", "a channel bell");
  }
  return fds;
}

std::unique_ptr<ChannelSegment> ChannelSegment::map(int memory_fd, const int bell_fds[2], uint32_t ring_bytes) {
  check_ring_bytes(ring_bytes);
  size_t size = channel_segment_bytes(ring_bytes);
  check_memory_fd(memory_fd, size);
  check_bell_fd(bell_fds[0]);
  check_bell_fd(bell_fds[1]);
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, memory_fd, 0);
  if (p == MAP_FAILED) throw_os_error("mmap", "the channel segment");
  std::unique_ptr<ChannelSegment> segment(new ChannelSegment(static_cast<uint8_t*>(p), ring_bytes));
  const ChannelHeader* h = segment->header();
  if (h->magic != kChannelMagic || h->version != kChannelVersion || h->ring_bytes != ring_bytes)
    throw OsError(EPROTO, str("torch_ipc: the channel segment's header is not a version ", kChannelVersion,
                              " header of ", ring_bytes, "-byte rings"));
  return segment;
}

ChannelSegment::~ChannelSegment() {
  munmap(base_, channel_segment_bytes(ring_bytes_));
}

}  // namespace torch_ipc
