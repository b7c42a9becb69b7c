// The KV pool's block ownership (features/kv/block_allocator.h); torch_ipc/kv is its Python face.
#include "base/errors.h"

#include "os/process.h"

#include "features/kv/block_allocator.h"

#include "python/bindings.h"

namespace torch_ipc::python {

namespace {

using Allocator = BlockAllocator;
using ReleaseGil = py::call_guard<py::gil_scoped_release>;

// Block ids cross as bytes of int64s (torch_ipc/kv packs them): no per-id
// conversion.
std::pair<const int64_t*, size_t> ids_of(const py::bytes& packed) {
  std::string_view v = packed;
  TORCH_IPC_CHECK_VALUE(v.size() % sizeof(int64_t) == 0, "torch_ipc: packed block ids must be int64s");
  return {reinterpret_cast<const int64_t*>(v.data()), v.size() / sizeof(int64_t)};
}

py::tuple process_tuple(const ProcessId& p) { return py::make_tuple(p.pid, p.start_time); }
// (pid, start time, life key, PID namespace): Note [pool slots across PID namespaces].
py::tuple identity_tuple(const ProcessId& p) { return py::make_tuple(p.pid, p.start_time, p.life, p.pidns); }

// [(process, blocks held)] for every attached process, the process as `as_tuple` makes it.
py::list holder_list(const Allocator& a, py::tuple (*as_tuple)(const ProcessId&)) {
  std::vector<PoolHolder> holders;
  {
    py::gil_scoped_release release;
    holders = a.holders();
  }
  py::list out;
  for (const auto& h : holders) out.append(py::make_tuple(as_tuple(h.process), h.blocks));
  return out;
}

// Who holds which block: hand-outs, hand-backs, hand-overs and the holders.
void bind_block_ownership(py::class_<Allocator>& c) {
  c.def("allocate", &Allocator::allocate, py::arg("n"), ReleaseGil())
      .def("free",
           [](Allocator& a, const py::bytes& ids) {
             auto [p, n] = ids_of(ids);
             py::gil_scoped_release release;
             a.free(p, n);
           })
      .def("check_held",
           [](const Allocator& a, const py::bytes& ids) {
             auto [p, n] = ids_of(ids);
             py::gil_scoped_release release;
             a.check_held(p, n);
           })
      .def("take_over",
           [](Allocator& a, const py::bytes& ids, uint32_t slot, uint32_t pid, uint64_t start_time, uint32_t life) {
             auto [p, n] = ids_of(ids);
             py::gil_scoped_release release;
             a.take_over(p, n, slot, ProcessId{pid, start_time, life});
           })
      .def("reclaim_dead", &Allocator::reclaim_dead, py::arg("wait") = true, ReleaseGil())
      .def("holder_of",
           [](const Allocator& a, int64_t id) {
             ProcessId p;
             {
               py::gil_scoped_release release;
               p = a.holder_of(id);
             }
             return process_tuple(p);
           })
      .def("holders", [](const Allocator& a) { return holder_list(a, process_tuple); })
      .def("holder_identities", [](const Allocator& a) { return holder_list(a, identity_tuple); })
      .def("held_by_self", &Allocator::held_by_self, ReleaseGil());
}

}  // namespace

// Every call that takes the pool's lock releases the GIL: the lock may be held
// by another process (Note [block ownership under a robust mutex]), and the
// collector thread calls reclaim_dead.
void bind_kv(py::module_& m) {
  py::class_<Allocator> c(m, "BlockAllocator", "who holds each block of a KV pool, in shared memory");
  c.def_static(
       "create",
       [](const std::vector<int64_t>& shape, at::ScalarType dtype, uint64_t max_blocks) {
         return Allocator::create(BlockLayout{shape, static_cast<int32_t>(dtype), 0}, max_blocks);
       },
       py::arg("shape"), py::arg("dtype"), py::arg("max_blocks"), ReleaseGil())
      .def_static(
          "attach",
          [](const std::string& name, uint32_t pid, uint64_t start_time, uint32_t life, uint32_t pidns) {
            return Allocator::attach(name, ProcessId{pid, start_time, life, pidns});
          },
          py::arg("name"), py::arg("pid"), py::arg("start_time"), py::arg("life") = 0, py::arg("pidns") = 0,
          ReleaseGil())
      .def_readonly_static("max_chunks", &Allocator::kMaxChunks)
      .def_property_readonly("name", &Allocator::name)
      .def_property_readonly("layout",
                             [](const Allocator& a) {
                               const BlockLayout& l = a.layout();
                               return py::make_tuple(l.shape, static_cast<at::ScalarType>(l.dtype), l.block_bytes);
                             })
      .def_property_readonly("num_blocks", &Allocator::num_blocks)
      .def_property_readonly("max_blocks", &Allocator::max_blocks)
      .def_property_readonly("free_blocks", &Allocator::free_blocks)
      .def_property("lock_timeout", &Allocator::lock_timeout, &Allocator::set_lock_timeout)
      .def_property_readonly("slot", &Allocator::slot);
  bind_block_ownership(c);
  c.def("add_chunk",
        [](Allocator& a, uint64_t count, const py::bytes& d) {
          std::string descriptor = d;
          py::gil_scoped_release release;
          a.add_chunk(count, descriptor);
        })
      .def("chunks",
           [](const Allocator& a, size_t from) {
             std::vector<PoolChunk> chunks;
             {
               py::gil_scoped_release release;
               chunks = a.chunks(from);
             }
             py::list out;
             for (const auto& c : chunks) out.append(py::make_tuple(c.first, c.count, py::bytes(c.descriptor)));
             return out;
           })
      .def("field_offsets",
           [](const Allocator& a) {
             py::dict out;  // tests only: name -> (offset in the segment's file, bytes)
             for (const auto& [name, where] : a.field_offsets())
               out[py::str(name)] = py::make_tuple(where.first, where.second);
             return out;
           })
      .def("detach", &Allocator::detach, ReleaseGil())
      .def("unlink", &Allocator::unlink);
}

}  // namespace torch_ipc::python
