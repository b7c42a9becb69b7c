"""The exceptions torch_ipc raises. Each subclasses the builtin it resembles."""

import pickle

__all__ = [
    "DescriptorError",
    "CudaError",
    "CudaUnavailableError",
    "ProducerGoneError",
    "ReleasedError",
    "DeviceNotFoundError",
    "HolderLimitError",
    "InFlightLimitError",
    "PoolCorruptedError",
    "WeightsOnlyError",
]


class DescriptorError(ValueError):
    """The bytes are not a valid torch_ipc descriptor: truncated, corrupted, of
    another format version, or made on another machine or before a reboot."""


class CudaError(RuntimeError):
    """A CUDA driver call failed. ``error_name`` is the driver's name for the
    error, e.g. ``"CUDA_ERROR_INVALID_VALUE"``; ``call`` the driver function
    that returned it, e.g. ``"cuIpcOpenMemHandle"``."""

    def __init__(self, message: str, error_name: str = "", call: str = ""):
        super().__init__(message)
        self.error_name = error_name
        self.call = call

    def __reduce__(self):
        return (type(self), (str(self), self.error_name, self.call))


class CudaUnavailableError(RuntimeError):
    """The descriptor holds CUDA tensors but this process cannot use CUDA."""


class ProducerGoneError(RuntimeError):
    """The process that exported the memory has exited."""


class ReleasedError(RuntimeError):
    """The export was already reclaimed: every consumer it was meant for loaded
    and released it (see ``consumers=`` of :func:`torch_ipc.dumps`)."""


class DeviceNotFoundError(RuntimeError):
    """The tensor lives on a GPU (named by UUID) that this process cannot see."""


class HolderLimitError(RuntimeError):
    """One export is held by as many living processes as it has room for (14):
    load it in fewer processes at once, or export once per group of consumers.
    Processes that died holding it do not count."""


class InFlightLimitError(RuntimeError):
    """``Connection.send()`` would take the bytes of tensors sent on that
    connection and not yet released by the peer past its
    ``max_bytes_in_flight``: the peer does not read, or keeps what it read."""


class PoolCorruptedError(RuntimeError):
    """A KV pool's shared memory holds what no pool operation writes (a
    process attached to it wrote into it): the operation was refused. Raised by :mod:`torch_ipc.kv` as
    ``torch_ipc.kv.PoolCorruptedError``."""


class WeightsOnlyError(pickle.UnpicklingError):
    """``loads(data, weights_only=True)`` met something in the payload that is
    not a tensor, a container or a type ``torch.load(weights_only=True)``
    allows; nothing of it was run."""
