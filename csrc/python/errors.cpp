// The C++ exception types of base/errors.h, raised in Python as the classes of
// torch_ipc/errors.py (and builtins where they are the right ones).
#include "base/errors.h"

#include "base/interrupt.h"

#include "python/bindings.h"

namespace torch_ipc::python {
namespace {

py::object error_class(const char* name) {
  static py::module_* errors = new py::module_(py::module_::import("torch_ipc.errors"));
  return errors->attr(name);
}

void raise(const char* cls, const std::string& what) { PyErr_SetString(error_class(cls).ptr(), what.c_str()); }

void translate(std::exception_ptr p) {
  try {
    if (p) std::rethrow_exception(p);
  } catch (const WaitInterrupted&) {
    // The signal handler's exception is set (Note [interruptible waits] in base/interrupt.h).
    if (!PyErr_Occurred()) PyErr_SetNone(PyExc_KeyboardInterrupt);
  } catch (const DescriptorError& e) {
    raise("DescriptorError", e.what());
  } catch (const CudaError& e) {
    py::object cls = error_class("CudaError");
    py::object exc = cls(e.what(), e.error_name, e.call);
    PyErr_SetObject(cls.ptr(), exc.ptr());
  } catch (const CudaUnavailable& e) {
    raise("CudaUnavailableError", e.what());
  } catch (const ProducerGone& e) {
    raise("ProducerGoneError", e.what());
  } catch (const Released& e) {
    raise("ReleasedError", e.what());
  } catch (const DeviceNotFound& e) {
    raise("DeviceNotFoundError", e.what());
  } catch (const HolderLimit& e) {
    raise("HolderLimitError", e.what());
  } catch (const PoolCorrupted& e) {
    raise("PoolCorruptedError", e.what());
  } catch (const OsError& e) {
    py::object exc =
        py::reinterpret_steal<py::object>(PyObject_CallFunction(PyExc_OSError, "is", e.error_number, e.what()));
    if (exc) PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
  } catch (const InvalidValue& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const InvalidIndex& e) {
    PyErr_SetString(PyExc_IndexError, e.what());
  } catch (const InvalidUse& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  } catch (const c10::OutOfMemoryError& e) {
    PyErr_SetString(py::module_::import("torch").attr("OutOfMemoryError").ptr(), e.what_without_backtrace());
  } catch (const c10::IndexError& e) {
    PyErr_SetString(PyExc_IndexError, e.what_without_backtrace());
  } catch (const c10::ValueError& e) {
    PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
  } catch (const c10::TypeError& e) {
    PyErr_SetString(PyExc_TypeError, e.what_without_backtrace());
  } catch (const c10::NotImplementedError& e) {
    PyErr_SetString(PyExc_NotImplementedError, e.what_without_backtrace());
  } catch (const c10::Error& e) {
    // Note [c10 errors without backtrace]
    // torch_ipc's own checks throw the types of errors.h (Note [no c10
    // errors]); a c10::Error can still come from torch calls made on the
    // caller's tensors. It reaches Python as the builtin class torch would
    // pick, with the message alone: what() would symbolize a C++ backtrace
    // through this library, slow and of no use to the caller.
    PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
  }
}

}  // namespace

void bind_errors(py::module_& m) {
  (void)m;
  // Local: only the functions of this module, before pybind11's own translators.
  py::register_local_exception_translator(&translate);
}

}  // namespace torch_ipc::python
