#include "shm.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

#include <c10/util/Exception.h>

namespace torch_ipc {
namespace {

std::string os_error(const std::string& what, const std::string& name) {
  return what + "(" + name + ") failed: " + std::strerror(errno);
}

}  // namespace

std::unique_ptr<ShmMapping> ShmMapping::create(const std::string& name, size_t size) {
  int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) throw std::runtime_error(os_error("shm_open", name));
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    std::string err = os_error("ftruncate", name);
    close(fd);
    shm_unlink(name.c_str());
    throw std::runtime_error(err + " (is /dev/shm large enough?)");
  }
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    std::string err = os_error("mmap", name);
    shm_unlink(name.c_str());
    throw std::runtime_error(err);
  }
  return std::unique_ptr<ShmMapping>(new ShmMapping(name, p, size, true));
}

std::unique_ptr<ShmMapping> ShmMapping::open(const std::string& name, size_t min_size) {
  int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) {
    if (errno == ENOENT) return nullptr;
    throw std::runtime_error(os_error("shm_open", name));
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < min_size) {
    close(fd);
    throw std::runtime_error("shared memory object " + name + " is smaller than the descriptor says");
  }
  size_t size = static_cast<size_t>(st.st_size);
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) throw std::runtime_error(os_error("mmap", name));
  return std::unique_ptr<ShmMapping>(new ShmMapping(name, p, size, false));
}

void ShmMapping::unlink() {
  if (linked_) {
    shm_unlink(name_.c_str());
    linked_ = false;
  }
}

ShmMapping::~ShmMapping() {
  unlink();
  if (munmap(data_, size_) != 0) TORCH_WARN("torch_ipc: munmap(", name_, ") failed");
}

}  // namespace torch_ipc
