"""smla: Multi-head Latent Attention and DeepSeek Sparse Attention on CPUs and
NVIDIA GPUs (SM80-SM120), with an explainable backend selector.

Ops (``write_mla_cache``, ``sparse_mla``, ``paged_mla_decode``,
``write_index_cache``, ``indexer_topk``, ``positions_to_slots``,
``dsa_decode_step``, and GLM-5.3-Flash's ``write_pooled_index_cache``,
``pools_to_positions`` and ``rotate_index_q``) take any DLPack-capable tensors without copying them and
return outputs of the same kind. ``explain`` tells which backend runs a model
on a device and why. ``smla.flash_mla`` is a drop-in for FlashMLA's API.
See docs/python.md.
"""

from . import _smla
from ._smla import (
    AttentionSpec,
    Error,
    FileError,
    IndexerSpec,
    InternalError,
    InvalidArgumentError,
    RopeSpec,
    UnsupportedError,
    detect_device,
    preset_names,
    support_matrix,
)
from ._explain import BackendInfo, Candidate, Explanation, KernelChoice, backends, explain, load_model_spec
from .ops import (
    dsa_decode_step,
    indexer_topk,
    paged_mla_decode,
    pools_to_positions,
    positions_to_slots,
    rotate_index_q,
    sparse_mla,
    write_index_cache,
    write_mla_cache,
    write_pooled_index_cache,
)

try:
    from importlib.metadata import version as _version

    __version__ = _version("smla")
except Exception:  # running from a build tree, not installed
    __version__ = "0.0.0+unknown"

#: True when this build has the CUDA backends (it was built with nvcc).
with_cuda: bool = _smla.with_cuda

__all__ = [
    "AttentionSpec",
    "BackendInfo",
    "Candidate",
    "Error",
    "Explanation",
    "FileError",
    "IndexerSpec",
    "InternalError",
    "InvalidArgumentError",
    "KernelChoice",
    "RopeSpec",
    "UnsupportedError",
    "backends",
    "detect_device",
    "dsa_decode_step",
    "explain",
    "indexer_topk",
    "load_model_spec",
    "paged_mla_decode",
    "pools_to_positions",
    "positions_to_slots",
    "preset_names",
    "rotate_index_q",
    "sparse_mla",
    "support_matrix",
    "with_cuda",
    "write_index_cache",
    "write_mla_cache",
    "write_pooled_index_cache",
]
