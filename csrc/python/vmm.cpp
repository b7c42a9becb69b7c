// SharedPool memory (memory/shared_pool.h); torch_ipc/pool.py is its Python face.
#include "memory/shared_pool.h"
#include "memory/vmm_mapping.h"

#include "python/bindings.h"

namespace torch_ipc::python {

void bind_vmm(py::module_& m) {
  m.def(
      "vmm_pool_empty",
      [](const std::vector<int64_t>& sizes, at::ScalarType dtype, int device, int handle_type) {
        return vmm_pool_empty(sizes, dtype, device, static_cast<CUmemAllocationHandleType>(handle_type));
      },
      py::arg("sizes"), py::arg("dtype"), py::arg("device"), py::arg("handle_type") = 1);
  m.def(
      "vmm_granularity",
      [](int device, int handle_type) {
        return vmm_granularity(device, static_cast<CUmemAllocationHandleType>(handle_type));
      },
      py::arg("device"), py::arg("handle_type") = 1);
  m.def(
      "vmm_grant_device_access",
      [](const at::Tensor& t, int device) {
        TORCH_CHECK(t.is_cuda() && t.is_contiguous(), "vmm_grant_device_access: a contiguous CUDA tensor");
        TORCH_CHECK(device >= 0, "vmm_grant_device_access: device ", device);
        if (t.nbytes() == 0) return;
        grant_device_access(reinterpret_cast<CUdeviceptr>(t.data_ptr()), t.nbytes(), device);
      },
      py::arg("tensor"), py::arg("device"));
  m.def("vmm_is_pool_tensor",
        [](const at::Tensor& t) { return t.defined() && t.is_cuda() && vmm_is_pool_storage(t.storage()); });
}

}  // namespace torch_ipc::python
