#include "base/errors.h"

#include <cerrno>
#include <cstring>

namespace torch_ipc {

OsError os_error(int err, const std::string& call, const std::string& subject, const std::string& hint) {
  return OsError(err, "torch_ipc: " + call + (subject.empty() ? "" : " " + subject) + " failed: " + std::strerror(err) +
                          (hint.empty() ? "" : " " + hint));
}

void throw_os_error(const std::string& call, const std::string& subject) {
  const int err = errno;  // before anything below can change it
  throw os_error(err, call, subject);
}

ProducerGone producer_gone(uint32_t pid, const std::string& consequence) {
  return ProducerGone("torch_ipc: the producer (pid " + std::to_string(pid) + ") has exited" +
                      (consequence.empty() ? "" : "; " + consequence));
}

}  // namespace torch_ipc
