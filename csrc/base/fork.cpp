// The pthread_atfork child handler and the resets registered with it.
#include "base/fork.h"

#include <cstdlib>
#include <mutex>
#include <pthread.h>

namespace torch_ipc {
namespace {

// Plain arrays, zero-initialised before any constructor runs: registration
// from other files' static initialisers needs no guard (Note [no first use at fork]).
constexpr int kMaxResets = 32;
void (*resets[2][kMaxResets])() = {};
int reset_count[2] = {};

void after_fork_in_child() {
  for (int stage = 0; stage < 2; ++stage)
    for (int i = 0; i < reset_count[stage]; ++i) resets[stage][i]();
}

}  // namespace

AfterForkInChild::AfterForkInChild(void (*reset)(), ForkStage stage) {
  const int s = static_cast<int>(stage);
  if (reset_count[s] == kMaxResets) std::abort();  // a build error in all but name: raise kMaxResets
  resets[s][reset_count[s]++] = reset;
}

void install_fork_handler() {
  static std::once_flag once;
  std::call_once(once, [] { pthread_atfork(nullptr, nullptr, &after_fork_in_child); });
}

}  // namespace torch_ipc
