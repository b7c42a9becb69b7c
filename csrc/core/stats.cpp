// The counters of torch_ipc.stats(), gathered from each layer.
#include "core/stats.h"

#include "os/fd_passing.h"
#include "os/refcount.h"
#include "os/sweep.h"

#include "memory/host_memory.h"
#include "memory/vmm.h"

#include "core/import.h"

namespace torch_ipc {

std::vector<StatField> process_stats(bool with_values) {
  ExportStats e{};
  ImportStats i{};
  VmmStats v{};
  FdStats f{};
  int64_t leases = 0, hosts = 0, swept = 0;
  if (with_values) {
    e = export_stats();
    i = import_stats();
    v = vmm_stats();
    f = fd_stats();
    leases = lease_segment_count();
    hosts = host_segment_count();
    swept = swept_file_count();
  }
  return {
      {"exports", e.exports, "live exports of this process"},
      {"exported_bytes", e.exported_bytes, "their bytes"},
      {"tokens_pending", e.tokens_pending, "loads still expected"},
      {"holders", e.holders, "processes holding our exports"},
      {"dead_holders", e.dead_holders, "of them, dead ones not yet reclaimed (until the next collect)"},
      {"held_bytes", e.held_bytes, "bytes of our exports that living consumers hold"},
      {"held_cuda_ipc_bytes", e.held_cuda_ipc_bytes,
       "of them, legacy CUDA IPC memory (lost to those consumers when we exit)"},
      {"imports", i.holds, "holds this process has on other processes' exports"},
      {"pending_releases", i.pending_releases, "releases waiting for GPU work"},
      {"mappings_open", i.mappings_open, "opened memory handles"},
      {"mappings_idle", i.mappings_idle, "of them, used by no tensor (closed by collect(close_idle=True))"},
      {"events_open", i.events_open, "opened IPC events"},
      {"lease_segments", leases, "this process's lease segments in /dev/shm"},
      {"host_segments", hosts, "this process's host (CPU tensor) segments in /dev/shm"},
      {"swept_files", swept, "stale /dev/shm files of dead processes this process removed"},
      {"vmm_export_groups", v.export_groups, "VMM chunk runs published by this process"},
      {"vmm_exported_chunks", v.exported_chunks, "physical allocations with an open shareable handle"},
      {"vmm_exported_bytes", v.exported_bytes, "their bytes"},
      {"vmm_pool_allocations", v.pool_allocations, "live SharedPool allocations"},
      {"vmm_pool_bytes", v.pool_bytes, "their bytes"},
      {"vmm_mappings", v.mappings, "imported VMM mappings"},
      {"vmm_mapped_bytes", v.mapped_bytes, "their bytes"},
      {"fd_published", f.published, "fd server: ids this process serves now"},
      {"fd_served", f.served, "fd server: requests answered with fds"},
      {"fd_refused", f.refused, "fd server: requests refused (unknown id, other uid, bad request)"},
      {"fd_via_socket", f.via_socket, "fds fetched over a socket (SCM_RIGHTS)"},
      {"fd_via_pidfd", f.via_pidfd, "fds fetched with pidfd_getfd"},
      {"fd_pidfd_refused", f.pidfd_refused, "pidfd_getfd refusals that fell back to the socket"},
      {"fd_server_running", f.server_running ? 1 : 0, "True while this process's fd server runs", true},
  };
}

const std::vector<PinnedField>& pinned_export_fields() {
  static const std::vector<PinnedField> fields = {
      {"age_s", "seconds since the export"},      {"bytes", "its bytes"},
      {"tokens_pending", "loads still expected"}, {"holders", "processes holding it"},
      {"dead_holders", "of them, dead ones"},
  };
  return fields;
}

std::vector<std::variant<int64_t, double>> pinned_export_values(const PinnedExport& p) {
  return {p.age_s, p.bytes, p.tokens_pending, p.holders, p.dead_holders};
}

}  // namespace torch_ipc
