"""smla as a vLLM plugin: ``pip install "smla[vllm]"``.

The entry point ``smla`` in vLLM's ``vllm.general_plugins`` group runs
``register()`` in every vLLM process. It registers the sparse-MLA attention
backend ``SMLA`` (``smla.vllm.backend``) and, on vLLM's CUDA platform, a
fallback: with no ``--attention-backend``, vLLM picks ``SMLA`` exactly where
none of its own sparse-MLA backends is valid, and logs their reasons.
``--attention-backend SMLA`` picks it anywhere smla can run. On GPUs where
DeepGEMM cannot run (SM8x, SM12x) vLLM's DSA indexer runs through smla
(``smla.vllm.indexer``), and so does GLM-5.3-Flash's pooled indexer
(``smla.vllm.pooled_indexer``). See docs/vllm.md.
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

    from . import _selection, indexer

    if NAME not in AttentionBackendEnum.__members__:
        register_backend(NAME, _BACKEND_PATH)
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        _selection.install(type(current_platform))
        try:
            capability = current_platform.get_device_capability()
        except Exception:  # no device visible in this process (e.g. the API server): nothing runs the indexer here
            capability = None
        if capability is not None:
            indexer.install(capability.major)
            _install_pooled_indexer(capability.major)


def _install_pooled_indexer(major: int) -> None:
    from . import indexer

    if indexer.deep_gemm_runs(major):
        return  # vLLM's own pooled indexer runs there; no need to import GLM-5.3-Flash's model code
    try:
        from . import pooled_indexer
    except ImportError as e:  # a vLLM without (or with other) GLM-5.3-Flash model code
        logger.warning("smla: GLM-5.3-Flash's pooled indexer stays vLLM's with this vLLM (%s)", e)
        return
    pooled_indexer.install(major)
