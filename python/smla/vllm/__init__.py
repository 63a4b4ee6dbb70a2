"""smla as a vLLM plugin: ``pip install "smla[vllm]"``.

The entry point ``smla`` in vLLM's ``vllm.general_plugins`` group runs
``register()`` in every vLLM process. It registers the sparse-MLA attention
backend ``SMLA`` (``smla.vllm.backend``) and, on vLLM's CUDA platform, a
fallback: with no ``--attention-backend``, vLLM picks ``SMLA`` exactly where
none of its own sparse-MLA backends is valid, and logs their reasons.
``--attention-backend SMLA`` picks it anywhere smla can run. See docs/vllm.md.
"""

import logging

logger = logging.getLogger("smla.vllm")

#: The vLLM release this plugin was tested with; the oldest it supports (register_backend by name, the
#: SparseMLACommonImpl._forward_mqa_kernel hook) is the same.
TESTED_VLLM = "0.33.0"
MINIMUM_VLLM = "0.33.0"

#: The name vLLM knows the backend by (``--attention-backend SMLA``).
NAME = "SMLA"
_BACKEND_PATH = "smla.vllm.backend.SmlaSparseMLABackend"


def register() -> None:
    """vLLM's plugin hook (safe to call more than once)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from . import _selection

    if NAME not in AttentionBackendEnum.__members__:
        register_backend(NAME, _BACKEND_PATH)
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        _selection.install(type(current_platform))
