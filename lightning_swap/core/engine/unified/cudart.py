"""The few CUDA runtime calls unified memory needs, through ``ctypes``: no compiler, no
``cuda-python``.

The library is the ``libcudart`` torch itself loaded (read off ``/proc/self/maps``), so the
calls share torch's CUDA context and its ``cudaStream_t`` handles; failing that, the
``nvidia-cuda-runtime`` wheel's copy or one the dynamic linker finds.

Note [Prefetch and advice signatures]: CUDA 13 removed the forms of ``cudaMemPrefetchAsync``
and ``cudaMemAdvise`` that take a device ordinal; the names now take a ``cudaMemLocation``
struct (type, id) by value, and the prefetch gained a ``flags`` argument. CUDA 12.2-12.9
have both (the struct forms as ``..._v2``). We pick by :meth:`CudaRuntime.version`: the
ordinal forms below 13.0, the struct forms from 13.0 on.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import enum
import glob
import os
from typing import Any, Optional

import torch

__all__ = ["CPU_DEVICE", "Advice", "CudaRuntime", "CudaRuntimeError", "find_cudart"]

#: ``cudaCpuDeviceId``: the host, where a prefetch or an advice takes a device ordinal.
CPU_DEVICE = -1

_MEM_ATTACH_GLOBAL = 1
_LOCATION_DEVICE = 1  # cudaMemLocationTypeDevice
_LOCATION_HOST = 2  # cudaMemLocationTypeHost


class Advice(enum.IntEnum):
    """``cudaMemoryAdvise`` values used here."""

    SET_READ_MOSTLY = 1
    SET_PREFERRED_LOCATION = 3
    UNSET_PREFERRED_LOCATION = 4
    SET_ACCESSED_BY = 5


class CudaRuntimeError(RuntimeError):
    """A CUDA runtime call failed; ``code`` and ``name`` are CUDA's (``cudaError_t``)."""

    def __init__(self, call: str, code: int, name: str) -> None:
        super().__init__(f"{call} failed: {name} ({code})")
        self.call = call
        self.code = code
        self.name = name


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


def _location(device: int) -> _Location:
    return _Location(_LOCATION_HOST, 0) if device == CPU_DEVICE else _Location(_LOCATION_DEVICE, device)


def find_cudart() -> Optional[str]:
    """The path of the CUDA runtime library to use, or ``None``."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if line.strip() else ""
                if "/libcudart.so" in path and os.path.exists(path):
                    return path
    except OSError:  # not Linux
        pass
    roots = [os.path.dirname(os.path.dirname(torch.__file__))]
    for pattern in ("nvidia/cu*/lib/libcudart.so*", "nvidia/cuda_runtime/lib/libcudart.so*"):
        for root in roots:
            found = sorted(p for p in glob.glob(os.path.join(root, pattern)) if not p.endswith(".a"))
            if found:
                return found[-1]
    return ctypes.util.find_library("cudart")


class CudaRuntime:
    """``cudaMallocManaged`` / ``cudaFree`` / ``cudaMemPrefetchAsync`` / ``cudaMemAdvise``.

    Each method raises :class:`CudaRuntimeError` when CUDA reports an error. Streams are
    raw ``cudaStream_t`` values (``torch.cuda.Stream.cuda_stream``); 0 is the legacy stream.
    """

    def __init__(self, path: Optional[str] = None) -> None:
        path = path or find_cudart()
        if path is None:
            raise OSError("no CUDA runtime library (libcudart) found: is this torch a CUDA build?")
        self.path = path
        lib = ctypes.CDLL(path)
        lib.cudaGetErrorName.restype = ctypes.c_char_p
        lib.cudaGetErrorName.argtypes = [ctypes.c_int]
        lib.cudaMallocManaged.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]
        lib.cudaFree.argtypes = [ctypes.c_void_p]
        self._lib = lib
        self._version = self._query_version()
        if self._version >= 13000:
            prefetch, advise = lib.cudaMemPrefetchAsync, lib.cudaMemAdvise
            prefetch.argtypes = [ctypes.c_void_p, ctypes.c_size_t, _Location, ctypes.c_uint, ctypes.c_void_p]
            advise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, _Location]
        else:
            prefetch, advise = lib.cudaMemPrefetchAsync, lib.cudaMemAdvise
            prefetch.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
            advise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
        self._prefetch, self._advise = prefetch, advise

    def _query_version(self) -> int:
        version = ctypes.c_int()
        self._check("cudaRuntimeGetVersion", self._lib.cudaRuntimeGetVersion(ctypes.byref(version)))
        return version.value

    def _check(self, call: str, code: int) -> None:
        if code != 0:
            name = self._lib.cudaGetErrorName(code)
            raise CudaRuntimeError(call, code, name.decode() if name else "unknown")

    @property
    def version(self) -> int:
        """``cudaRuntimeGetVersion``: 1000 * major + 10 * minor (13020 for 13.2)."""
        return self._version

    def device_count(self) -> int:
        count = ctypes.c_int()
        self._check("cudaGetDeviceCount", self._lib.cudaGetDeviceCount(ctypes.byref(count)))
        return count.value

    def malloc_managed(self, nbytes: int) -> int:
        ptr = ctypes.c_void_p()
        self._check("cudaMallocManaged", self._lib.cudaMallocManaged(ctypes.byref(ptr), nbytes, _MEM_ATTACH_GLOBAL))
        return ptr.value or 0

    def free(self, ptr: int) -> None:
        self._check("cudaFree", self._lib.cudaFree(ptr))

    def prefetch(self, ptr: int, nbytes: int, device: int, stream: int) -> None:
        """Migrate ``[ptr, ptr + nbytes)`` to ``device`` (``CPU_DEVICE`` for the host),
        ordered on ``stream``."""
        if self._version >= 13000:
            code = self._prefetch(ptr, nbytes, _location(device), 0, stream)
        else:
            code = self._prefetch(ptr, nbytes, device, stream)
        self._check("cudaMemPrefetchAsync", code)

    def advise(self, ptr: int, nbytes: int, advice: Advice, device: int) -> None:
        if self._version >= 13000:
            code = self._advise(ptr, nbytes, int(advice), _location(device))
        else:
            code = self._advise(ptr, nbytes, int(advice), device)
        self._check("cudaMemAdvise", code)

    def as_tensor(self, block: Any, device: torch.device) -> torch.Tensor:
        """A uint8 CUDA tensor over managed memory, without a copy: ``block`` exposes
        ``__cuda_array_interface__`` and torch keeps it alive as long as the tensor (the memory
        is not torch's; the block frees it)."""
        return torch.as_tensor(block, device=device)
