// The VMM statistics of torch_ipc.stats(): what the producer side, the consumer
// side and SharedPool each count, in one struct.
#include "memory/vmm.h"

namespace torch_ipc {

VmmStats vmm_stats() {
  const VmmExportStats e = vmm_export_stats();
  const PoolStats p = vmm_pool_stats();
  const VmmImportStats i = vmm_import_stats();
  VmmStats s{};
  s.export_groups = e.groups;
  s.exported_chunks = e.chunks;
  s.exported_bytes = e.bytes;
  s.pool_allocations = p.allocations;
  s.pool_bytes = p.bytes;
  s.mappings = i.mappings;
  s.mapped_bytes = i.bytes;
  return s;
}

}  // namespace torch_ipc
