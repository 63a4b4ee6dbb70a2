"""Backend selection, explained: ``smla.explain`` returns the same information
as ``smla explain --json`` (schema in docs/explain-json.md) as dataclasses,
and prints like the command-line tool."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from . import _smla

AttentionSpec = _smla.AttentionSpec
Model = Union[str, "os.PathLike[str]", Dict[str, Any], AttentionSpec]


@dataclasses.dataclass(frozen=True)
class Yarn:
    """YaRN context extension of the model's RoPE."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    mscale: float
    mscale_all_dim: float


@dataclasses.dataclass(frozen=True)
class Rope:
    """The model's MLA RoPE."""

    theta: float
    style: str  # "interleaved" or "half-split"
    yarn: Optional[Yarn]


@dataclasses.dataclass(frozen=True)
class Indexer:
    """The DSA lightning indexer; None for dense models."""

    heads: int
    head_dim: int
    topk: int
    rope_style: Optional[str]  # None when the model has no rope part
    kpool: int = 1  # tokens per pooled index key (GLM-5.3-Flash: 4)
    always_select_tail: bool = False


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """The model's attention geometry (all heads, before tensor parallelism)."""

    name: str
    model_type: str
    hidden_size: int
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    num_layers: int
    num_attention_layers: int  # layers that run MLA; hybrid models run linear attention in the rest
    absorbed_qk_dim: int
    absorbed_v_dim: int
    shared_kv: bool  # no latent (kv_lora_rank 0, DeepSeek-V4): the value is the whole cached head, rope included
    sliding_window: int  # DeepSeek-V4's window cache (0: none)
    compress_ratios: Tuple[int, ...]  # per layer, DeepSeek-V4's compressed caches (0: the window only); () for others
    softmax_scale: float
    rope: Optional[Rope]  # None when the model has no rope part (qk_rope_head_dim 0)
    indexer: Optional[Indexer]


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """How the model is run, resolved (e.g. kv_cache_dtype 'auto' -> a dtype)."""

    device: str
    compute_capability: int
    dtype: str
    kv_cache_dtype: str
    kv_cache_dtype_auto: bool
    block_size: int
    tp: int
    heads_per_rank: int
    ops: Tuple[str, ...]
    attn_sink: bool
    query_tokens: Tuple[int, ...] = ()  # the query rows per call the kernel notes name; (): 1 and 4096


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """The kernel a chosen backend runs for ``query_tokens`` query rows a call (the CUDA backend: its attention
    kernel on the run's arch), and why each other kernel was not chosen."""

    query_tokens: int
    phase: Optional[str]  # 'decode' (1 row) or 'prefill' (4096) where explain picked the rows; None where given
    kernel: str           # e.g. 'wgmma kernel'; 'none' where no kernel can run
    arch: str             # e.g. 'sm_90a'
    heads_per_cta: int = 0
    warps: int = 0
    stages: int = 0
    smem_bytes: int = 0
    ctas_per_sm: int = 0
    shape: str = ""       # the kernel's shape in words, as explain prints it
    others: Tuple[Tuple[str, str], ...] = ()  # (kernel, why it was not chosen)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One backend and why it can or cannot run the model (no reasons: valid)."""

    name: str
    description: str
    valid: bool
    chosen: bool
    reasons: Tuple[str, ...]
    kernel_notes: Tuple[str, ...] = ()  # the chosen backend's kernel lines (the CUDA backend: its attention kernels)
    kernels: Tuple[KernelChoice, ...] = ()  # the same as data


@dataclasses.dataclass(frozen=True)
class Explanation:
    """Which backend runs a model on a device and why every other one was
    rejected. ``str()`` gives the text ``smla explain`` prints;
    ``to_dict()`` / ``to_json()`` the JSON of ``smla explain --json``."""

    schema: str
    model: ModelInfo
    run: RunInfo
    candidates: Tuple[Candidate, ...]
    chosen: Optional[str]
    forced: bool
    suggestion: Optional[str]
    text: str = dataclasses.field(repr=False)
    raw: Dict[str, Any] = dataclasses.field(repr=False, compare=False)

    def __str__(self) -> str:
        return self.text

    def __bool__(self) -> bool:
        """True when a backend was chosen."""
        return self.chosen is not None

    def to_dict(self) -> Dict[str, Any]:
        """The JSON object, exactly as the C++ side wrote it (fields added in later schema versions included)."""
        return json.loads(json.dumps(self.raw))

    def to_json(self, indent: Optional[int] = 2) -> str:
        """The JSON text (schema ``smla.explain/1``)."""
        return json.dumps(self.raw, indent=indent)


@dataclasses.dataclass(frozen=True)
class BackendInfo:
    """What a backend declares it can run (the README's support matrix)."""

    name: str
    description: str
    device: str  # "cpu" or "cuda"
    compute_capability: Optional[Tuple[int, int]]  # inclusive, major*10+minor; None on the CPU
    q_dtypes: Tuple[str, ...]
    kv_cache_dtypes: Tuple[str, ...]
    heads: Tuple[int, int]
    head_counts: Tuple[int, ...]  # when non-empty, only these head counts
    qk_head_dims: Tuple[int, ...]
    v_head_dims: Tuple[int, ...]
    block_size: Tuple[int, int]
    block_size_multiple: int
    topk: Tuple[int, int]
    topk_multiple: int
    ops: Tuple[str, ...]
    extra_cache: bool  # sparse attention over a second cache under one softmax (DeepSeek-V4's compressed cache)
    attn_sink: bool


def _make(cls: Any, data: Dict[str, Any], **nested: Any) -> Any:
    # Unknown keys are skipped: a schema version may gain fields.
    fields = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in data.items() if k in fields}
    for key, convert in nested.items():
        if key in values:  # else the field's default (a JSON of an older schema)
            values[key] = convert(values[key])
    return cls(**values)


def _kernel_choices(kernels: List[Dict[str, Any]]) -> Tuple[KernelChoice, ...]:
    return tuple(_make(KernelChoice, k, others=lambda others: tuple((o["kernel"], o["reason"]) for o in others))
                 for k in kernels)


def _model_info(m: Dict[str, Any]) -> ModelInfo:
    def rope(r: Optional[Dict[str, Any]]) -> Optional[Rope]:
        return None if r is None else _make(Rope, r, yarn=lambda y: None if y is None else _make(Yarn, y))

    return _make(ModelInfo, m, rope=rope, indexer=lambda i: None if i is None else _make(Indexer, i),
                 compress_ratios=tuple)


def _from_json(text: str, json_text: str) -> Explanation:
    d = json.loads(json_text)
    return Explanation(
        schema=d["schema"],
        model=_model_info(d["model"]),
        run=_make(RunInfo, d["run"], ops=tuple, query_tokens=tuple),
        candidates=tuple(_make(Candidate, c, reasons=tuple, kernel_notes=tuple, kernels=_kernel_choices)
                         for c in d["candidates"]),
        chosen=d["chosen"],
        forced=d["forced"],
        suggestion=d["suggestion"],
        text=text,
        raw=d,
    )


def load_model_spec(model: Model) -> AttentionSpec:
    """A model's attention geometry: a preset name (see ``preset_names()``), a
    Hugging Face config.json path (or a directory holding one), the config as
    a dict, or an AttentionSpec (returned as is)."""
    if isinstance(model, AttentionSpec):
        return model
    if isinstance(model, dict):
        return _smla.spec_from_config_json(json.dumps(model), "config dict")
    return _smla.load_model_spec(os.fspath(model))


def _device_name(device: Any) -> str:
    """'auto', 'cpu', 'sm_90', ... from a string or a torch.device."""
    if isinstance(device, str):
        return device
    kind = getattr(device, "type", None)
    if kind == "cpu":
        return "cpu"
    if kind == "cuda":
        import torch

        major, minor = torch.cuda.get_device_capability(device)
        return f"sm_{major * 10 + minor}"
    raise _smla.InvalidArgumentError(f"device: expected a string or a torch.device, got {device!r}")


def explain(model: Model, device: Any = "auto", dtype: str = "bfloat16", kv_cache_dtype: str = "auto",
            block_size: int = 64, tp: int = 1, backend: Optional[str] = None,
            attn_sink: bool = False, ops: Optional[Sequence[str]] = None,
            tokens: Optional[Sequence[int]] = None) -> Explanation:
    """Which backend runs ``model`` and why every other one cannot, as
    ``smla explain`` tells it.

    device: 'auto' (the first CUDA GPU, else the CPU), 'cpu', 'sm_80' ...
    'sm_120', 'cuda:N', or a torch.device. dtype: the query dtype (bfloat16
    or float16). kv_cache_dtype: 'auto' (= dtype), bfloat16, float16,
    fp8_ds_mla, fp8_ds_mla_nope (heads with no rope part only) or fp8_ds_mla_v4 (DeepSeek-V4 only). tp: tensor-parallel size. backend: force one by name (else
    $SMLA_BACKEND, else choose); forcing one that cannot run raises
    UnsupportedError listing its reasons. No valid backend is not an error:
    the Explanation's ``chosen`` is None and ``suggestion`` names a change.
    ops: the ops the run needs, by the names explain prints ("sparse
    attention", "dense paged decode", "indexer"); default: what the model
    needs (e.g. an engine with its own indexer asks for sparse attention only).
    tokens: query rows per call to name the CUDA attention kernel for (its
    choice follows them: a decode batch's tokens, a prefill's length);
    default: 1 and 4096."""
    spec = load_model_spec(model)
    text, json_text = _smla.explain(spec, _device_name(device), dtype, kv_cache_dtype or "auto", int(block_size),
                                    int(tp), backend or "", bool(attn_sink), list(ops or ()),
                                    [int(t) for t in tokens or ()])
    return _from_json(text, json_text)


def backends() -> List[BackendInfo]:
    """Every backend compiled into this build and what it declares it can run."""
    result = []
    for b in _smla.backends():
        b = dict(b)
        for key in ("q_dtypes", "kv_cache_dtypes", "head_counts", "qk_head_dims", "v_head_dims", "ops"):
            b[key] = tuple(b[key])
        result.append(BackendInfo(**b))
    return result
