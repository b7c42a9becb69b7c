#include "os/socket_dir.h"

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <dirent.h>
#include <fcntl.h>
#include <memory>
#include <optional>
#include <sys/stat.h>
#include <unistd.h>

#include "base/env.h"
#include "base/str.h"

#include "os/life.h"

namespace torch_ipc {

std::string socket_dir() {
  if (std::optional<std::string> dir = env_string("TORCH_IPC_SOCKET_DIR")) return *dir;
  return "/dev/shm/torch_ipc-" + std::to_string(geteuid());
}

std::string usable_socket_dir(bool create, std::string* why) {
  const std::string dir = socket_dir();
  if (create && mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    *why = str("cannot create ", dir, ": ", std::strerror(errno));
    return "";
  }
  struct stat st;
  if (lstat(dir.c_str(), &st) != 0) {
    *why = str("cannot look at ", dir, ": ", std::strerror(errno));
    return "";
  }
  if (!S_ISDIR(st.st_mode)) {
    *why = str(dir, " is not a directory");
  } else if (st.st_uid != geteuid()) {
    *why = str(dir, " is owned by uid ", st.st_uid, ", not by this process's uid ", geteuid());
  } else if ((st.st_mode & 07777) != 0700) {
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(st.st_mode & 07777));
    *why = str(dir, " has mode ", mode, ", not 0700");
  } else {
    return dir;
  }
  return "";
}

namespace {
// The life key a socket name torch_ipc.<key>.<tag>.fd names, or 0.
uint32_t key_of_socket(const char* name) {
  unsigned key = 0, tag = 0;
  int end = 0;
  if (std::sscanf(name, "torch_ipc.%8x.%8x.fd%n", &key, &tag, &end) != 2 || name[end] != '\0' ||
      std::strlen(name) != 30)
    return 0;
  return key;
}
}  // namespace

int sweep_socket_dir(const std::string& dir) noexcept {
  try {
    std::unique_ptr<DIR, int (*)(DIR*)> listing(opendir(dir.c_str()), &closedir);
    if (!listing) return 0;
    int removed = 0;
    while (dirent* entry = readdir(listing.get())) {
      const uint32_t key = key_of_socket(entry->d_name);
      struct stat st;
      if (key == 0 || fstatat(dirfd(listing.get()), entry->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 ||
          !S_ISSOCK(st.st_mode) || st.st_uid != geteuid())
        continue;
      if (check_life_key(key).life == Life::Dead)  // Note [unknown is not dead] in sweep.cpp
        removed += unlinkat(dirfd(listing.get()), entry->d_name, 0) == 0;
    }
    return removed;
  } catch (...) {
    return 0;
  }
}

}  // namespace torch_ipc
