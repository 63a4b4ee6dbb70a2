"""Array plumbing shared by the ops: which framework a tensor comes from,
outputs of the same kind on the same device, streams, and handing tensors to
the C++ layer through DLPack without copying them."""

from __future__ import annotations

import sys
from typing import Any, Optional, Sequence, Union

from . import _smla

Shape = Sequence[int]
# What the C++ layer takes for one tensor: the object itself, or
# (object, "dtype") to read its raw bytes as that smla dtype.
Exported = Union[Any, tuple]


def framework(x: Any) -> str:
    """'numpy', 'torch', 'cupy' or 'other', from the type's top-level module."""
    root = type(x).__module__.split(".", 1)[0]
    return root if root in ("numpy", "torch", "cupy") else "other"


# The torch module once it is imported (by anyone): is_torch runs on every argument. The functions below that
# only run for torch tensors use it too, not sys.modules: torch.compile traces them, and Dynamo reading
# sys.modules walks the whole dict, which raised "dictionary changed size during iteration" on the H200.
_torch: Any = None


def is_torch(x: Any) -> bool:
    """True for a torch.Tensor (without importing torch)."""
    global _torch
    if _torch is None:
        _torch = sys.modules.get("torch")
        if _torch is None:
            return False
    return isinstance(x, _torch.Tensor)


def dtype_name(x: Any) -> str:
    """The tensor's dtype as a plain name: 'bfloat16', 'float8_e4m3fn', 'uint8', ..."""
    dtype = getattr(x, "dtype", None)  # a non-tensor is reported by the C++ layer
    return "" if dtype is None else str(dtype).rsplit(".", 1)[-1]


def is_8bit(x: Any) -> bool:
    """True for byte-sized elements (uint8, int8, float8_*): how fp8 data arrives."""
    if is_torch(x):
        dtype = x.dtype  # its size first: a 16-bit cache, the common case, is decided by it alone
        return dtype.itemsize == 1 and (dtype.is_floating_point or dtype in (_torch.uint8, _torch.int8))
    name = dtype_name(x)
    return name in ("uint8", "int8") or name.startswith("float8")


def is_cuda(x: Any) -> bool:
    """True when the tensor lives on a CUDA device."""
    if is_torch(x):
        return x.is_cuda
    if framework(x) == "cupy":
        return True
    dev = getattr(x, "__dlpack_device__", None)
    return dev is not None and dev()[0] in (2, 13)  # kDLCUDA, kDLCUDAManaged


def export(x: Any, as_dtype: Optional[str] = None) -> Exported:
    """`x` as the C++ layer takes it, never copied. `as_dtype` reads 8-bit data
    as an fp8 format ('fp8_ds_mla', 'fp8_e4m3') or checks a float tensor's dtype."""
    if x is None:
        return None
    if is_torch(x):
        return _export_torch(x, as_dtype)
    kind = framework(x)
    name = dtype_name(x)
    if kind == "numpy":
        # numpy cannot export ml_dtypes' bfloat16 / float8 through DLPack: pass their bits.
        if name == "bfloat16":
            import numpy as np

            if as_dtype and as_dtype.lower() not in ("bfloat16", "bf16"):
                raise _smla.InvalidArgumentError(f"a bfloat16 array was given where {as_dtype} was asked for")
            return (x.view(np.uint16), "bfloat16")
        if name.startswith("float8"):
            import numpy as np

            return (x.view(np.uint8), as_dtype or "fp8_e4m3")
    return (x, as_dtype) if as_dtype else x


def _export_torch(x: Any, as_dtype: Optional[str]) -> Exported:
    """A torch tensor as a DLPack capsule of the legacy exporter: torch's __dlpack__() would make the legacy
    default stream wait on the current one (breaking CUDA-graph capture; the op runs on torch's current stream,
    so an exporter that never synchronises is right), and costs several times more host time."""
    torch = _torch  # x is a torch tensor
    dtype = x.dtype
    if dtype.itemsize == 1 and dtype.is_floating_point:
        # Older torch cannot export fp8 through DLPack; bytes always work.
        x = x.view(torch.uint8)
        as_dtype = as_dtype or "fp8_e4m3"
    if x.requires_grad:
        x = x.detach()
    capsule = torch.utils.dlpack.to_dlpack(x)
    return (capsule, as_dtype) if as_dtype else capsule


class NotATensorError(_smla.InvalidArgumentError, TypeError):
    """An argument that is no tensor at all (a list, None, a memoryview): bad input of the wrong type, so both an
    InvalidArgumentError and a TypeError."""


def shape(x: Any, name: str) -> tuple:
    """x.shape as a tuple of ints; anything without a shape and a dtype (a list, None, a memoryview) is
    NotATensorError naming the argument, as the C++ layer would name it."""
    if is_torch(x):
        return tuple(x.shape)  # ints already: the hot path of smla.flash_mla on torch tensors
    s = getattr(x, "shape", None)
    if s is None or not hasattr(x, "dtype"):
        raise NotATensorError(
            f"{name}: expected a DLPack-capable tensor (numpy, torch, cupy, ...), got {type(x).__name__}")
    return tuple(int(d) for d in s)


def resolve_stream(ref: Any, stream: Any = None) -> int:
    """The CUDA stream to run on, as an integer: `stream` if given (an int, a
    torch.cuda.Stream or a cupy Stream), else the current stream of `ref`'s
    framework; 0 (the default stream, ignored on the CPU) otherwise."""
    if stream is not None:
        for attr in ("cuda_stream", "ptr"):
            if hasattr(stream, attr):
                return int(getattr(stream, attr))
        return int(stream)
    if is_torch(ref):
        if not ref.is_cuda:
            return 0
        import torch

        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what torch's own compiled code calls
        if raw is not None:
            return raw(ref.get_device())
        return torch.cuda.current_stream(ref.device).cuda_stream
    if not is_cuda(ref):
        return 0
    if framework(ref) == "cupy":
        import cupy

        with cupy.cuda.Device(ref.device.id):
            return cupy.cuda.get_current_stream().ptr
    return 0


def empty(ref: Any, shape: Shape, dtype: Optional[str] = None) -> Any:
    """An uninitialised array of `ref`'s kind on `ref`'s device; `dtype` is a
    name ('float32', 'int32', ...) or None for `ref`'s own dtype."""
    shape = tuple(int(s) for s in shape)
    kind = framework(ref)
    if kind == "torch":
        import torch

        return torch.empty(shape, dtype=getattr(torch, dtype) if dtype else ref.dtype, device=ref.device)
    if kind == "cupy":
        import cupy

        with cupy.cuda.Device(ref.device.id):
            return cupy.empty(shape, dtype=dtype or ref.dtype)
    if is_cuda(ref):
        raise _smla.UnsupportedError(
            f"cannot allocate outputs for a {type(ref).__name__} on a GPU: pass out= (and lse=) arrays you allocated"
        )
    import numpy as np

    return np.empty(shape, dtype=_numpy_dtype(dtype) if dtype else ref.dtype)


def _numpy_dtype(name: str) -> Any:
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError as e:  # numpy has no bfloat16 of its own
            raise _smla.UnsupportedError("bfloat16 numpy arrays need the ml_dtypes package") from e
        return ml_dtypes.bfloat16
    import numpy as np

    return np.dtype(name)


_torch_allocators: dict = {}  # by CUDA device index: workspace_allocator runs on every call


def workspace_allocator(ref: Any) -> Any:
    """A callable giving `n` bytes of scratch on `ref`'s GPU from its framework's allocator (torch's caching
    allocator, which CUDA-graph capture handles; cupy's pool), or None for other arrays. The C++ layer calls it
    only when an op needs scratch (see workspace_size in include/smla/ops.h)."""
    if is_torch(ref):
        if not ref.is_cuda:
            return None
        index = ref.get_device()
        allocate = _torch_allocators.get(index)
        if allocate is None:
            torch = _torch
            device = torch.device("cuda", index)
            allocate = _torch_allocators[index] = lambda n: torch.utils.dlpack.to_dlpack(
                torch.empty(n, dtype=torch.uint8, device=device))
        return allocate
    if framework(ref) == "cupy":
        import cupy

        device = ref.device.id

        def allocate(n: int) -> Any:
            with cupy.cuda.Device(device):
                return cupy.empty(n, dtype=cupy.uint8)

        return allocate
    return None
