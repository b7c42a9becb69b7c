#include "os/shm.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <c10/util/Exception.h>

#include "base/errors.h"

namespace torch_ipc {

namespace {

// "/dev/shm has 60.0 MiB free of 64.0 MiB", or nothing when statvfs fails.
std::string shm_space() {
  struct statvfs fs;
  if (statvfs("/dev/shm", &fs) != 0) return "";
  auto mib = [](double bytes) {
    char text[32];
    std::snprintf(text, sizeof(text), "%.1f MiB", bytes / (1 << 20));
    return std::string(text);
  };
  return "/dev/shm has " + mib(double(fs.f_bavail) * fs.f_frsize) + " free of " +
         mib(double(fs.f_blocks) * fs.f_frsize);
}

// The error of a failed reservation, saying what to do about it.
OsError reserve_error(int err, const std::string& name, size_t size) {
  std::string hint;
  if (err == ENOSPC)
    hint = "(" + shm_space() + "; make it larger, e.g. docker run --shm-size=8g, or a bigger tmpfs on /dev/shm)";
  else if (err == EFBIG)
    hint = "(larger than this process's file size limit, RLIMIT_FSIZE: ulimit -f)";
  return os_error(err, "reserving", std::to_string(size) + " bytes of /dev/shm for " + name, hint);
}

// Note [reserving shared memory]
// ftruncate on tmpfs succeeds whatever the free space; the first write to a
// page that does not fit then kills the process with SIGBUS. posix_fallocate
// reserves every page up front, so a full /dev/shm (Docker's default is 64
// MiB) is an ENOSPC here, with the file removed, instead of a crash later.
int reserve(int fd, size_t size) {
  int err;
  do err = posix_fallocate(fd, 0, static_cast<off_t>(size));
  while (err == EINTR);
  return err;
}

// An OFD lock on the whole file, held while the file description is open.
int lock_whole_file(int fd) {
  struct flock lock{};
  lock.l_type = F_WRLCK;
  lock.l_whence = SEEK_SET;
  return fcntl(fd, F_OFD_SETLK, &lock) == 0 ? 0 : errno;
}

// The identity page (Note [segment identity]): its first bytes.
constexpr uint64_t kIdentityMagic = 0x3147455343504954ull;  // "TIPCSEG1"
struct Identity {
  uint64_t magic;
  uint32_t pid;
  uint32_t reserved;
  uint64_t start_time;
};

void write_identity(void* page, const ProcessId& creator) {
  auto* id = static_cast<Identity*>(page);
  id->pid = creator.pid;
  id->start_time = creator.start_time;
  id->magic = kIdentityMagic;
}

// Why the file of `st` cannot be one this process's uid made for sharing, or "".
std::string foreign_file(const struct stat& st) {
  if (!S_ISREG(st.st_mode)) return "it is not a regular file";
  if (st.st_uid != geteuid()) return str("it is owned by uid ", st.st_uid, ", not by this process's uid ", geteuid());
  if ((st.st_mode & 07777) != 0600) {
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(st.st_mode & 07777));
    return str("its mode is ", mode, ", not 0600");
  }
  return "";
}

// Why the identity page does not name `creator`, or "".
std::string identity_mismatch(const void* page, const ProcessId& creator) {
  const auto* id = static_cast<const Identity*>(page);
  if (id->magic != kIdentityMagic) return "it has no torch_ipc identity page";
  if (id->pid != creator.pid || id->start_time != creator.start_time)
    return str("it was made by pid ", id->pid, " (start time ", id->start_time, ")");
  return "";
}

Released not_the_creators(const std::string& name, const ProcessId& creator, const std::string& why) {
  return Released(str("torch_ipc: the shared memory object ", name, " is not the one pid ", creator.pid,
                      " (start time ", creator.start_time, ") made: ", why,
                      ". Its maker let go of it and another process created a file of that name, or "
                      "planted one; refusing to map it"));
}

}  // namespace

std::unique_ptr<ShmMapping> ShmMapping::create(const std::string& name, size_t size, const ProcessId& creator,
                                               bool anchor) {
  int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) {
    if (errno == EEXIST) return nullptr;
    throw_os_error("shm_open", name);
  }
  auto fail = [&](const OsError& e) {
    close(fd);
    shm_unlink(name.c_str());
    throw e;
  };
  // 0600 whatever the umask: what openers demand (Note [segment identity]).
  if (fchmod(fd, 0600) != 0) fail(os_error(errno, "fchmod", name));
  // The lock comes before the size: a file with bytes and no lock is one
  // whose owner is gone (Note [sweep]).
  if (anchor)
    if (int err = lock_whole_file(fd)) fail(os_error(err, "fcntl(F_OFD_SETLK)", name));
  const size_t mapped = kIdentityBytes + size;
  if (int err = reserve(fd, mapped)) fail(reserve_error(err, name, mapped));
  if (anchor && size == 0) {  // Note [an anchor maps nothing]
    Identity id{};
    write_identity(&id, creator);
    ssize_t put;
    do put = pwrite(fd, &id, sizeof(id), 0);
    while (put < 0 && errno == EINTR);
    if (put != static_cast<ssize_t>(sizeof(id))) fail(os_error(put < 0 ? errno : EIO, "pwrite", name));
    return std::unique_ptr<ShmMapping>(new ShmMapping(name, nullptr, 0, true, fd));
  }
  void* p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) fail(os_error(errno, "mmap", name));
  write_identity(p, creator);
  if (!anchor) {
    close(fd);
    fd = -1;
  }
  return std::unique_ptr<ShmMapping>(new ShmMapping(name, p, mapped, true, fd));
}

// Note [an anchor maps nothing]
// An anchor without bytes (a life file: Note [life files] in life.h) has its
// identity page written through its fd and is never mapped. A
// mapping holds the open file as the fd does, and with it the OFD lock, and
// a process's memory map can outlive the process: on the H100 machine a
// relay that was killed and reaped (waitpid() had returned) still looked
// alive to its subscriber right after, and dead a moment later. A forked
// child would also keep an inherited mapping, and with it the lock, after
// its parent died. The fd is closed before the process can be reaped
// (close-on-exec, and closed in a forked child: Note [fork]), so the lock
// goes when the process does.

std::unique_ptr<ShmMapping> ShmMapping::open(const std::string& name, size_t min_size, const ProcessId& creator) {
  int fd = shm_open(name.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC, 0);
  if (fd < 0) {
    if (errno == ENOENT) return nullptr;
    if (errno == ELOOP) throw not_the_creators(name, creator, "it is a symbolic link");
    throw_os_error("shm_open", name);
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    close(fd);
    throw os_error(err, "fstat", name);
  }
  const std::string foreign = foreign_file(st);
  if (!foreign.empty()) {
    close(fd);
    throw not_the_creators(name, creator, foreign);
  }
  if (static_cast<size_t>(st.st_size) < kIdentityBytes || static_cast<size_t>(st.st_size) - kIdentityBytes < min_size) {
    close(fd);
    // The object is there but smaller than the caller was told: the claim is
    // wrong, not the system (mapping it would SIGBUS past its end).
    throw DescriptorError("malformed torch_ipc descriptor: shared memory object " + name + " has " +
                          std::to_string(st.st_size) + " bytes, fewer than the " +
                          std::to_string(min_size + kIdentityBytes) + " it names");
  }
  const size_t mapped = static_cast<size_t>(st.st_size);
  void* p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);
  if (p == MAP_FAILED) throw os_error(err, "mmap", name);
  const std::string impostor = identity_mismatch(p, creator);
  if (!impostor.empty()) {
    munmap(p, mapped);
    throw not_the_creators(name, creator, impostor);
  }
  return std::unique_ptr<ShmMapping>(new ShmMapping(name, p, mapped, false));
}

std::optional<bool> segment_made_by(int fd, const ProcessId& creator) {
  Identity id{};
  ssize_t got;
  do got = pread(fd, &id, sizeof(id), 0);
  while (got < 0 && errno == EINTR);
  if (got < 0) return std::nullopt;
  return got == static_cast<ssize_t>(sizeof(id)) && identity_mismatch(&id, creator).empty();
}

void ShmMapping::unlink() {
  if (linked_) {
    // ENOENT: the name is gone already; nothing is lost.
    if (shm_unlink(name_.c_str()) != 0 && errno != ENOENT)
      TORCH_WARN("torch_ipc: shm_unlink(", name_, ") failed: ", std::strerror(errno));
    linked_ = false;
  }
}

void ShmMapping::disown() {
  linked_ = false;
  if (lock_fd_ >= 0) close(lock_fd_);
  lock_fd_ = -1;
}

ShmMapping::~ShmMapping() {
  unlink();  // before the lock goes: a sweeper never sees this file unlocked
  if (base_ != nullptr && munmap(base_, mapped_) != 0)
    TORCH_WARN("torch_ipc: munmap(", name_, ") failed: ", std::strerror(errno));
  if (lock_fd_ >= 0) close(lock_fd_);
}

}  // namespace torch_ipc
