#include "os/sweep.h"

#include <atomic>
#include <cerrno>
#include <ctime>
#include <dirent.h>
#include <fcntl.h>
#include <map>
#include <memory>
#include <string>
#include <sys/stat.h>
#include <tuple>
#include <unistd.h>
#include <vector>

#include "os/names.h"

namespace torch_ipc {
namespace {

constexpr time_t kCreatingSeconds = 60;  // an anchor without bytes is being created
std::atomic<int64_t> swept{0};           // files this process's sweeps removed

bool owned_regular_file(int dir, const std::string& name) {
  struct stat st;
  return fstatat(dir, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode) && st.st_uid == geteuid();
}

}  // namespace

// Note [unknown is not dead]
// Only a positive proof of death may delete: the anchor's OFD lock free, or
// the anchor gone (ENOENT; or its name now holding a file that is not the
// regular file of our uid its owner made, which proves that one unlinked). Any
// other failure to look (EMFILE, ENFILE, ENOMEM, EACCES) says nothing about
// the owner: its files stay, and a later sweep judges them again. A process
// at its fd limit would otherwise delete every live producer's files.
Anchor judge_anchor(int dir, const std::string& name) {
  int fd = openat(dir, name.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return errno == ENOENT || errno == ELOOP ? Anchor::Dead : Anchor::Unknown;
  const Anchor verdict = judge_open_anchor(fd);
  close(fd);
  return verdict;
}

// It is ours and locked (or has no bytes yet, and is young). The size is
// read before the lock: its owner locked before it gave it bytes.
Anchor judge_open_anchor(int fd) {
  struct stat st;
  Anchor verdict = Anchor::Alive;
  if (fstat(fd, &st) != 0) {
    verdict = Anchor::Unknown;
  } else if (!S_ISREG(st.st_mode) || st.st_uid != geteuid()) {
    verdict = Anchor::Dead;  // not the file its owner made: that one was unlinked
  } else if (st.st_size == 0) {
    verdict = std::time(nullptr) - st.st_mtime < kCreatingSeconds ? Anchor::Alive : Anchor::Dead;
  } else {
    struct flock probe{};
    probe.l_type = F_WRLCK;
    probe.l_whence = SEEK_SET;
    if (fcntl(fd, F_OFD_GETLK, &probe) != 0)
      verdict = Anchor::Unknown;  // a failed probe proves nothing
    else if (probe.l_type == F_UNLCK)
      verdict = Anchor::Dead;
  }
  return verdict;
}

int sweep_stale_shm() noexcept {
  try {
    std::unique_ptr<DIR, int (*)(DIR*)> listing(opendir("/dev/shm"), &closedir);
    if (!listing) return 0;
    const int dir = dirfd(listing.get());
    std::vector<std::pair<std::string, std::string>> files;  // name, its anchor's name
    while (dirent* entry = readdir(listing.get())) {
      std::string name = entry->d_name;
      auto parsed = parse_shared_file_name(name);
      if (!parsed || !owned_regular_file(dir, name)) continue;
      files.emplace_back(name, anchor_file_name(*parsed));
    }
    std::map<std::string, bool> dead;  // Note [unknown is not dead]
    for (const auto& [name, anchor] : files)
      if (!dead.count(anchor)) dead[anchor] = judge_anchor(dir, anchor) == Anchor::Dead;
    // Anchors last: while one is there, its files are judged by it.
    int removed = 0;
    for (bool anchors : {false, true})
      for (const auto& [name, anchor] : files)
        if (dead[anchor] && (name == anchor) == anchors) removed += unlinkat(dir, name.c_str(), 0) == 0;
    swept += removed;
    return removed;
  } catch (...) {  // std::bad_alloc: sweeping is never worth failing an export
    return 0;
  }
}

int64_t swept_file_count() { return swept.load(); }

}  // namespace torch_ipc
