// Producer side: turn tensors into a descriptor. An Export is one sent
// message: its bytes, and what it asked of leases (an own export that keeps
// storages alive, and holds taken at other owners for forwarded tensors).
#pragma once

#include <ATen/core/Tensor.h>
#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "wire/descriptor.h"

#include "os/process.h"

namespace torch_ipc {

// Hidden, like the pybind11 types that bind it (csrc/python/).
class __attribute__((visibility("hidden"))) Export {
 public:
  Export(std::string data, std::optional<LeaseRecord> own, std::vector<LeaseRecord> forwarded, uint32_t consumers);
  Export(const Export&) = delete;
  Export& operator=(const Export&) = delete;

  // The descriptor.
  const std::string& data() const { return data_; }
  // True while the message can still be loaded or is still held: our own
  // export is not reclaimed, or deliveries of forwarded tensors were not
  // given back yet.
  bool live() const;
  // Nobody will load this message any more (its channel closed unread):
  // give back the loads our own export still expects, so it is reclaimed
  // once its holders released it, and the pending deliveries held at the
  // owners of forwarded tensors (Note [forwarding]). Loads that already
  // happened keep their holds. Idempotent.
  void revoke();
  // revoke(), and no load may start any more, forwarded ones included (Note
  // [revoked exports] in os/refcount.cpp): torch_ipc.Export.revoke().
  void forbid_loads();

 private:
  std::string data_;
  std::optional<LeaseRecord> own_;
  std::vector<LeaseRecord> forwarded_;
  uint32_t consumers_;
  std::atomic<bool> revoked_{false};
  MadeHere made_;  // in a forked child, revoke() leaves the parent's message alone
};

// Whether export_tensors shares `t` itself: strided, with memory (not meta).
// Note [one shareability rule] in export.cpp.
bool shared_natively(const at::Tensor& t);
// When `t`'s memory is torch's own CPU shared memory (share_memory_(): a
// MapAllocator), which forked children may map too (Note [torch's shared memory
// through multiprocessing] in torch_ipc/_serialize.py): the pid of the process
// that made it, as its name says, or -1 when the name says none; else 0.
int64_t torch_shared_memory_maker(const at::Tensor& t);

// The tensors of a message, by reference: their holder (Python's list) keeps
// them. A copy of an at::Tensor that has a Python object would take a
// reference to that object, GIL and all (c10's Note [PyObject preservation
// for Tensor and Storages]), and drop it again, for every tensor.
using TensorRefs = std::vector<std::reference_wrapper<const at::Tensor>>;

// `is_parameter[i]`: rebuild tensor i as an nn.Parameter (Python knows, C++ does not).
// `consumers`: loads to wait for; 0 for an open-ended export (Note [open-ended exports]).
// `while_referenced`: also keep it while this process references the storages.
std::shared_ptr<Export> export_tensors(const TensorRefs& tensors, const std::vector<bool>& is_parameter,
                                       const std::string& payload, uint32_t consumers, bool while_referenced = false);

// Reclaim exports whose tokens are spent and whose holders released or died,
// and drop the VMM exports and cached locations of storages that died.
// Returns how many exports were reclaimed.
int collect_exports();

// One live export, as stats() shows the oldest ones: an export that stays
// long is pinned by a load that never came or a holder that never released.
struct PinnedExport {
  double age_s;
  int64_t bytes, tokens_pending, holders, dead_holders;
};
constexpr size_t kOldestExportsShown = 16;

struct ExportStats {
  int64_t exports, exported_bytes, tokens_pending, holders, dead_holders;
  // Bytes of exports that a living consumer holds, and how many of them are
  // legacy CUDA IPC memory (gone for those consumers when this process exits).
  int64_t held_bytes, held_cuda_ipc_bytes;
  std::vector<PinnedExport> oldest;  // at most kOldestExportsShown, oldest first
};
ExportStats export_stats();

}  // namespace torch_ipc
