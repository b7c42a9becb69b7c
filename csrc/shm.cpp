#include "shm.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <c10/util/Exception.h>

#include "errors.h"

namespace torch_ipc {

std::unique_ptr<ShmMapping> ShmMapping::create(const std::string& name, size_t size) {
  int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) throw_os_error("shm_open", name);
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    const int err = errno;
    close(fd);
    shm_unlink(name.c_str());
    throw os_error(err, "ftruncate", name + " to " + std::to_string(size) + " bytes",
                   "(is /dev/shm large enough?)");
  }
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);
  if (p == MAP_FAILED) {
    shm_unlink(name.c_str());
    throw os_error(err, "mmap", name);
  }
  return std::unique_ptr<ShmMapping>(new ShmMapping(name, p, size, true));
}

std::unique_ptr<ShmMapping> ShmMapping::open(const std::string& name, size_t min_size) {
  int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) {
    if (errno == ENOENT) return nullptr;
    throw_os_error("shm_open", name);
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    close(fd);
    throw os_error(err, "fstat", name);
  }
  if (static_cast<size_t>(st.st_size) < min_size) {
    close(fd);
    // The object is there but smaller than the caller was told: the claim is
    // wrong, not the system (mapping it would SIGBUS past its end).
    throw DescriptorError("malformed torch_ipc descriptor: shared memory object " + name + " has " +
                          std::to_string(st.st_size) + " bytes, fewer than the " +
                          std::to_string(min_size) + " it names");
  }
  size_t size = static_cast<size_t>(st.st_size);
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);
  if (p == MAP_FAILED) throw os_error(err, "mmap", name);
  return std::unique_ptr<ShmMapping>(new ShmMapping(name, p, size, false));
}

void ShmMapping::unlink() {
  if (linked_) {
    // ENOENT: the name is gone already; nothing is lost.
    if (shm_unlink(name_.c_str()) != 0 && errno != ENOENT)
      TORCH_WARN("torch_ipc: shm_unlink(", name_, ") failed: ", std::strerror(errno));
    linked_ = false;
  }
}

ShmMapping::~ShmMapping() {
  unlink();
  if (munmap(data_, size_) != 0)
    TORCH_WARN("torch_ipc: munmap(", name_, ") failed: ", std::strerror(errno));
}

}  // namespace torch_ipc
