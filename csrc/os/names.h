// Names of what a process shares by name (its /dev/shm files and its fd
// server's abstract socket), their random parts, and reading them back.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/ids.h"

namespace torch_ipc {

// Note [names]
// Names that derive only from the pid and start time (both readable in /proc)
// can be taken first by another local user, blocking the process's exports,
// and collide with the process's own names after execv (same pid, same start
// time, names left behind by the image before). So every name has a random
// part from the OS (getrandom), and creation retries with a new one when the
// name exists:
//   /torch_ipc.<pid>.<start>.L<segment>          lease segment; <segment> is the
//                                                 lease record's random u32 (8 hex)
//   /torch_ipc.<pid>.<start>.H<anchor>.<random>  host segment; <anchor> names the
//                                                 lease segment that proves its
//                                                 owner alive (Note [sweep])
//   @torch_ipc.<pid>.<start>.<tag>.fd            fd server; <tag> is the high half
//                                                 of every id it publishes
//   /torch_ipc.life.<key>                         life file (Note [life files] in
//                                                 life.h); <key> is 31 random bits
//   <socket dir>/torch_ipc.<key>.<tag>.fd         fd server at a path (Note [fd
//                                                 server at a path] in fd_passing.cpp)
// A host name is at most 62 bytes, so it fits a descriptor's handle field.
// A forked child needs no renaming here: its pid and start time differ, and
// each name it creates draws new random parts.

// 64 random bits from the OS's random source (getrandom). Throws OsError when
// the kernel has none to give.
uint64_t os_random64();
// Tests only: the next values os_random64 returns, before the OS's (so that a
// test can take the name a process is about to use and see it retry).
void queue_random_for_testing(const std::vector<uint64_t>& values);

std::string lease_segment_name(const ProcessId& owner, uint32_t segment);
std::string host_segment_name(const ProcessId& owner, uint32_t anchor, uint64_t random);
std::string fd_socket_name(const ProcessId& owner, uint32_t tag);
std::string life_file_name(uint32_t key);
// The file name (no folder) of the fd server at a path of the process whose life key is `key`.
std::string fd_socket_file_name(uint32_t key, uint32_t tag);

// A /dev/shm file name (without the leading '/') that torch_ipc makes.
struct SharedFileName {
  uint32_t pid = 0;
  uint64_t start_time = 0;
  bool lease = false;   // a lease segment; else a host segment or a life file
  bool life = false;    // a life file (pid and start time 0): its own anchor
  uint32_t anchor = 0;  // the lease segment that proves its owner alive; a life file's key
};
// The name of the file whose lock proves the owner of `f` alive, without the leading '/'.
std::string anchor_file_name(const SharedFileName& f);
// The parts of `name`, or nothing when torch_ipc would not make that name.
std::optional<SharedFileName> parse_shared_file_name(std::string_view name);

// Create something under a fresh random name: try_create(random) returns what
// it made, or an empty value when the name exists (EEXIST, EADDRINUSE); then
// another random value is drawn. Throws OsError(EEXIST) naming `what` when
// kNameAttempts names in a row were taken (somebody floods the namespace).
constexpr int kNameAttempts = 16;
[[noreturn]] void throw_names_taken(const std::string& what);
template <typename F>
auto create_under_random_name(const std::string& what, F try_create) {
  for (int attempt = 0; attempt < kNameAttempts; ++attempt)
    if (auto made = try_create(os_random64())) return made;
  throw_names_taken(what);
}

}  // namespace torch_ipc
