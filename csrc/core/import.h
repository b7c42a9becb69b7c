// Consumer side: rebuild tensors from a descriptor on the producer's memory,
// in steps (import.cpp), on the mappings of mapping_cache.h and the holds of
// release.h; and the collection and statistics of both.
#pragma once

#include <ATen/core/Tensor.h>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "wire/descriptor.h"

namespace torch_ipc {

// What a load spends at the producers once it has fully succeeded (Note [a
// load spends last] in import.cpp): one token of each lease it was meant for,
// and one pending delivery of each forwarder it came through. Hidden, like
// the pybind11 type that binds it.
class __attribute__((visibility("hidden"))) PendingLoad {
 public:
  struct Spend {
    LeaseRecord lease;
    bool forwarded;          // remove a delivery of the forwarder, take no token
    uint32_t forwarder_key;  // the descriptor's producer's life key
  };
  explicit PendingLoad(std::vector<Spend> spends) : spends_(std::move(spends)) {}
  // Spend what the load was given. Idempotent. Call it while the tensors of
  // the load are alive (their holds keep the leases from being reclaimed).
  void commit();

 private:
  std::vector<Spend> spends_;
  std::atomic<bool> committed_{false};
};

struct __attribute__((visibility("hidden"))) ImportResult {
  std::vector<at::Tensor> tensors;
  std::vector<bool> is_parameter;
  std::string payload;
  std::shared_ptr<PendingLoad> pending;  // committed by the caller once the load succeeded
};
// Decode `data` (DescriptorError), call `before_cuda` when it holds CUDA
// tensors (the caller's chance to raise CudaUnavailableError, or to set up
// CUDA, before anything is opened), then take holds, map and build.
ImportResult import_tensors(std::string_view data, const std::function<void()>& before_cuda = {});

// Finish releases whose GPU work is done, close idle mappings (all of them when
// close_idle), and drop what belongs to producers that exited.
void collect_imports(bool close_idle);
// Wait for every deferred release and finish it (at exit).
void flush_imports();

struct ImportStats {
  int64_t holds, pending_releases, mappings_open, mappings_idle, events_open;
};
ImportStats import_stats();

}  // namespace torch_ipc
