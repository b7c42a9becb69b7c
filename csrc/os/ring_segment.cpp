#include "os/ring_segment.h"

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <new>
#include <string>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/errors.h"

namespace torch_ipc {

// Note [channel segment trust]
// The segment is a memfd: it never has a name, so nobody can open it by path
// and there is nothing to unlink; it is gone when the last fd and mapping are.
// Its creator makes it 0600 and seals its size (F_SEAL_SHRINK | F_SEAL_GROW |
// F_SEAL_SEAL): a peer that could shrink it would turn our next access into a
// SIGBUS. The end that receives the fds checks, before mapping: sealed, then
// a regular file owned by our effective uid, mode 0600, exactly the size the
// agreed ring size gives; a header of that ring size; pipes for bells (a bell
// that were a regular file would have bytes written into it). The seals are
// read first: once they are there the size cannot change, so the size read
// after them is the size for good; read the other way round, a peer could
// shrink and seal between the two reads. What the geometry is comes from the
// caller, never from the segment afterwards.
//
// Note [private bells]
// A bell wakes an fd waiter (select, asyncio) of the other end: the producer
// writes a byte into the consumer's pipe, the consumer empties it (Note [fd
// wake-ups] in channel.cpp). Neither may ever block in that read or write,
// and whether a read or write blocks is the O_NONBLOCK flag of the open file
// description, which every process holding that description shares and may
// change: an eventfd made by one end and passed to the other (as the first
// version did) let the peer clear O_NONBLOCK and hang us in read() or write()
// for good, with the GIL held. An eventfd cannot be opened again (its
// /proc/self/fd link gives ENXIO), and RWF_NOWAIT covers reads only (pwritev2
// on an eventfd: EOPNOTSUPP). A pipe can: each end opens /proc/self/fd/N of
// the pipe it received, read-write and non-blocking, and uses only that new
// description, which nobody else holds. Opening it read-write never blocks,
// and makes us a reader too, so a write never raises SIGPIPE or EPIPE; a full
// pipe (EAGAIN) is a bell rung already. The peer, which still holds its own
// descriptions of both pipes, can ring our bell needlessly or empty it (a
// select that wakes for nothing, or later): what it could do anyway by
// sending or not sending, never a hang.

size_t channel_segment_bytes(uint32_t ring_bytes) { return kChannelHeaderBytes + 2 * size_t(ring_bytes); }

namespace {

constexpr int kSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;

void check_ring_bytes(uint32_t ring_bytes) {
  bool power_of_two = ring_bytes != 0 && (ring_bytes & (ring_bytes - 1)) == 0;
  TORCH_IPC_CHECK_VALUE(power_of_two && ring_bytes >= kMinRingBytes && ring_bytes <= kMaxRingBytes,
                        "torch_ipc: a channel ring is a power of two from 4 KiB to 1 GiB, not ", ring_bytes, " bytes");
}

[[noreturn]] void refuse(const std::string& why) {
  throw OsError(EPERM, "torch_ipc: refusing the channel segment the peer sent: " + why);
}

std::string fd_link(int fd) {
  char link[256] = {};
  std::string path = "/proc/self/fd/" + std::to_string(fd);
  if (readlink(path.c_str(), link, sizeof(link) - 1) < 0) throw_os_error("readlink", path);
  return link;
}

}  // namespace

void check_channel_memory(int fd, uint32_t ring_bytes, const std::function<void()>& between_reads) {
  size_t size = channel_segment_bytes(ring_bytes);
  int seals = fcntl(fd, F_GET_SEALS);  // first: Note [channel segment trust]
  if (seals < 0 || (seals & kSeals) != kSeals) refuse("its size is not sealed");
  if (between_reads) between_reads();
  struct stat st{};
  if (fstat(fd, &st) != 0) throw_os_error("fstat", "the channel segment");
  if (!S_ISREG(st.st_mode)) refuse("not a memory file");
  if (st.st_uid != geteuid()) refuse(str("owned by uid ", st.st_uid, ", not ", geteuid()));
  if ((st.st_mode & 07777) != 0600)
    refuse(str("mode ", st.st_mode & 07777, " (octal ", (st.st_mode >> 6) & 7, (st.st_mode >> 3) & 7, st.st_mode & 7,
               "), not 0600"));
  if (size_t(st.st_size) != size) refuse(str(st.st_size, " bytes, not ", size));
}

UniqueFd open_private_bell(int fd) {
  std::string link = fd_link(fd);
  if (link.rfind("pipe:[", 0) != 0) refuse(str("a bell that is not a pipe (", link, ")"));
  std::string path = "/proc/self/fd/" + std::to_string(fd);
  UniqueFd own(open(path.c_str(), O_RDWR | O_NONBLOCK | O_CLOEXEC));  // Note [private bells]
  if (own.get() < 0) throw_os_error("open", str("a bell of our own (", path, ")"));
  if (fd_link(own.get()) != link) refuse("a bell that changed while it was opened");
  return own;
}

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
  for (auto& bell : fds.bell) {  // each end opens its own description of it: Note [private bells]
    int ends[2];
    if (pipe2(ends, O_CLOEXEC | O_NONBLOCK) != 0) throw_os_error("pipe2", "a channel bell");
    bell.reset(ends[0]);
    close(ends[1]);
  }
  return fds;
}

std::unique_ptr<ChannelSegment> ChannelSegment::map(int memory_fd, uint32_t ring_bytes) {
  check_ring_bytes(ring_bytes);
  size_t size = channel_segment_bytes(ring_bytes);
  check_channel_memory(memory_fd, ring_bytes);
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, memory_fd, 0);
  if (p == MAP_FAILED) throw_os_error("mmap", "the channel segment");
  std::unique_ptr<ChannelSegment> segment(new ChannelSegment(static_cast<uint8_t*>(p), ring_bytes));
  const ChannelHeader* h = segment->header();
  if (h->magic != kChannelMagic || h->version != kChannelVersion || h->ring_bytes != ring_bytes)
    throw OsError(EPROTO, str("torch_ipc: the channel segment's header is not a version ", kChannelVersion,
                              " header of ", ring_bytes, "-byte rings"));
  return segment;
}

ChannelSegment::~ChannelSegment() { munmap(base_, channel_segment_bytes(ring_bytes_)); }

}  // namespace torch_ipc
