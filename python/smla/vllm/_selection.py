"""smla where vLLM has nothing else: a fallback after vLLM's own selection.

vLLM's CUDA platform walks its priority list (``get_valid_backends``) and
fails with "No valid attention backend found" when no backend is valid. For
sparse MLA this hook then offers ``SMLA``, if smla's checks pass, as the one
valid candidate (ranked after every in-tree one) and logs why each in-tree
backend was rejected; vLLM's ``get_attn_backend_cls`` goes on as usual. When
any in-tree backend is valid nothing changes, and ``--attention-backend``
never reaches this path.
"""

import functools
import logging
from typing import Any

from . import NAME

logger = logging.getLogger("smla.vllm")

_MARK = "_smla_fallback"


def install(platform_cls: Any) -> bool:
    """Wraps ``platform_cls.get_valid_backends`` (vLLM's CUDA platform); False if this vLLM lacks what it needs."""
    try:
        from vllm.platforms.cuda import _BackendCandidate
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
    except ImportError as e:
        logger.warning("smla: no fallback selection with this vLLM (%s); use --attention-backend SMLA", e)
        return False
    original = platform_cls.get_valid_backends
    if getattr(original, _MARK, False):
        return True
    original = original.__func__

    @functools.wraps(original)
    def get_valid_backends(cls: Any, device_capability: Any, attn_selector_config: Any, num_heads: Any = None):
        valid, invalid = original(cls, device_capability, attn_selector_config, num_heads)
        if valid or not (attn_selector_config.use_mla and attn_selector_config.use_sparse):
            return valid, invalid
        backend = AttentionBackendEnum[NAME]
        backend_class = backend.get_class()
        reasons = backend_class.validate_configuration(device_capability=device_capability,
                                                       **attn_selector_config._asdict())
        rank = len(invalid)  # after every in-tree candidate
        if reasons:
            invalid[backend] = (rank, reasons)
            return valid, invalid
        logger.warning(
            "smla: no in-tree sparse MLA backend is valid on %s (compute capability %d.%d), so vLLM uses %s. "
            "vLLM's reasons: %s", cls.device_name, device_capability.major, device_capability.minor, NAME,
            "; ".join(f"{b.name}: {', '.join(r)}" for b, (_, r) in invalid.items()))
        return [_BackendCandidate(backend_class, backend, rank)], invalid

    setattr(get_valid_backends, _MARK, True)
    platform_cls.get_valid_backends = classmethod(get_valid_backends)
    return True
