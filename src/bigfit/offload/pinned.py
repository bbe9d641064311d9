"""Page-locked host memory of exactly the size asked, for the offload engine's buffers.

torch's pinned-memory allocator (`pin_memory=True`) rounds every allocation up to a power of two to
reuse blocks: a 3.6B Llama block's fp32 master of 384 MiB takes 512 MiB, its bf16 gradient buffer
192 MiB takes 256, the embedding's master 1,503 MiB takes 2,048. The engine allocates each buffer
once and keeps it, so the rounding buys nothing and costs about 7 GiB of host RAM at 3.6B, the RAM
of several more layers at the largest sizes (docs/planning.md). Here plain memory is page-locked in
place with cudaHostRegister instead: the pages the tensor covers, no more. The registration ends
with the memory: a finalizer on the storage unregisters it before the storage is freed (a storage's
weak references are cleared before its memory goes), or with the process. `BIGFIT_PINNED=torch`
uses torch's allocator instead (benchmarks/pinned_rounding.py compares both).

A failed registration raises: it leaves CUDA's last-error state set, which the next kernel launch
would report as its own error, so falling back quietly is not an option.
"""
from __future__ import annotations

import mmap
import os
import weakref

import torch

PAGE = mmap.PAGESIZE
_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, not only the current one


def host_zeros(n: int, dtype: torch.dtype = torch.float32, pin: bool = False) -> torch.Tensor:
    """n zeros of `dtype` in host memory; with `pin`, page-locked (copies to and from a GPU run
    asynchronously at full speed) with no rounding beyond the page."""
    if not pin:
        return torch.zeros(n, dtype=dtype)
    if os.environ.get("BIGFIT_PINNED") == "torch":
        return torch.zeros(n, dtype=dtype, pin_memory=True)
    nbytes = n * dtype.itemsize
    span = max(PAGE, -(-nbytes // PAGE) * PAGE)
    raw = torch.zeros(span + PAGE, dtype=torch.uint8)  # one page spare, to start on a page of our own
    start = (-raw.data_ptr()) % PAGE
    region = raw[start:start + span]
    err = _register(region.data_ptr(), span)
    if err:
        raise RuntimeError(f"cudaHostRegister of {span / 2**20:.0f} MiB of host memory failed ({err}); "
                           "BIGFIT_PINNED=torch pins with torch's allocator instead")
    done = weakref.finalize(raw.untyped_storage(), _unregister, region.data_ptr())
    done.atexit = False  # the process's end releases it anyway, without a call per buffer
    return region[:nbytes].view(dtype)


def _register(ptr: int, nbytes: int) -> str | None:
    """None, or what CUDA said."""
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(ptr, nbytes, _PORTABLE)
    return None if err == cudart.cudaError.success else cudart.cudaGetErrorString(err)


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)
