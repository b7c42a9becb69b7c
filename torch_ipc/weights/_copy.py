"""BatchedCopy: a fixed list of (source, destination) tensor pairs, grouped
once into a few launches; ``run()`` is those launches and nothing else.

Same-dtype pairs on one GPU go through one launch of torch_ipc's copy kernel,
fp32 -> bf16 pairs through one launch of its conversion kernel (Note [batched
copy kernels] in csrc/cuda/batched_copy.cpp, torch_ipc/_batched_copy.py);
everything else (other conversions, non-contiguous destinations, CPU tensors,
two GPUs) through one ``torch._foreach_copy_``. ``path`` says which ran.
"""

import os
from typing import List, Sequence, Tuple

import torch

from .. import _batched_copy

__all__ = ["BatchedCopy", "kernels_available"]

_COPY = _batched_copy.COPY
_F32_TO_BF16 = _batched_copy.F32_TO_BF16


def kernels_available(device: torch.device) -> Tuple[bool, str]:
    """Whether torch_ipc's copy kernels load on `device`, and why not.
    ``TORCH_IPC_WEIGHTS_COPY=foreach`` turns them off."""
    if device.type == "cuda" and os.environ.get("TORCH_IPC_WEIGHTS_COPY", "") == "foreach":
        return False, "TORCH_IPC_WEIGHTS_COPY=foreach"
    return _batched_copy.kernels_available(device)


def item_table(pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]], kind: int, device: torch.device) -> torch.Tensor:
    """The [n, 4] int64 table {src, dst, count, 0} of one launch, on `device`:
    each pair cut into items of at most ITEM_BYTES of source (count in bytes
    for a copy, in elements for a conversion), built with tensor ops (no loop
    per item)."""
    if kind == _COPY:
        counts = torch.tensor([s.numel() * s.element_size() for s, _ in pairs], dtype=torch.int64)
        chunk, src_step, dst_step = _batched_copy.ITEM_BYTES, 1, 1
    else:
        counts = torch.tensor([s.numel() for s, _ in pairs], dtype=torch.int64)
        chunk, src_step, dst_step = _batched_copy.ITEM_BYTES // 4, 4, 2
    src = torch.tensor([s.data_ptr() for s, _ in pairs], dtype=torch.int64)
    dst = torch.tensor([d.data_ptr() for _, d in pairs], dtype=torch.int64)
    return _batched_copy.split_into_items(src, dst, counts, chunk, src_step, dst_step).to(device)


class BatchedCopy:
    """Copies ``pairs`` (source, destination), same number of elements each,
    source contiguous. Built once; keeps every tensor alive so the addresses in
    its tables stay valid."""

    def __init__(self, pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]]):
        self._pairs = [(s, d) for s, d in pairs if s.numel() > 0]
        self._launches: List[Tuple[torch.Tensor, int]] = []
        fallback = []
        groups = {}
        why = ""
        for src, dst in self._pairs:
            ok, why_not = self._kernel_fits(src, dst)
            if ok:
                kind = _COPY if src.dtype == dst.dtype else _F32_TO_BF16
                groups.setdefault((kind, dst.device), []).append((src, dst))
            else:
                why = why or why_not
                fallback.append((src, dst))
        for (kind, device), group in groups.items():
            self._launches.append((item_table(group, kind, device), kind))
        self._dst = [d for _, d in fallback]
        self._src = [s.view(d.shape) for s, d in fallback]
        self.bytes = sum(s.numel() * s.element_size() for s, _ in self._pairs)
        self.launches = len(self._launches) + (1 if fallback else 0)
        kinds = (["kernel"] if self._launches else []) + (["foreach"] if fallback else [])
        self.path = "+".join(kinds) or "empty"
        self.why_foreach = why

    @staticmethod
    def _kernel_fits(src: torch.Tensor, dst: torch.Tensor) -> Tuple[bool, str]:
        if src.device != dst.device:
            return False, f"{src.device} -> {dst.device}"
        ok, why = kernels_available(dst.device)
        if not ok:
            return False, why
        if not (src.is_contiguous() and dst.is_contiguous()):
            return False, "a non-contiguous tensor"
        if src.dtype == dst.dtype or (src.dtype == torch.float32 and dst.dtype == torch.bfloat16):
            return True, ""
        return False, f"{src.dtype} -> {dst.dtype}"

    def run(self) -> None:
        """Queue the copies on the current stream (CUDA); copy now (CPU)."""
        for table, kind in self._launches:
            _batched_copy.launch(table, kind)
        if self._dst:
            torch._foreach_copy_(self._dst, self._src)
