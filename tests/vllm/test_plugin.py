"""smla.vllm inside the pinned vLLM, on the CPU (make test-vllm): the entry point loads through vLLM's plugin
loader; vLLM's own selector, given GLM-5's, DeepSeek-V3.2's and GLM-5.3-Flash's real config.json and a device
capability, picks SMLA exactly where no in-tree sparse-MLA backend is valid (and says why), the in-tree backend
where one is, and SMLA anywhere when asked by name; the impl, built with the arguments vLLM's MLA layer passes,
matches the float64 reference through smla's CPU backend. conftest.py lists what is stubbed."""

from __future__ import annotations

import logging
from importlib.metadata import entry_points

import numpy as np
import pytest
import torch
from vllm.config import AttentionConfig, ModelConfig, VllmConfig, set_current_vllm_config
from vllm.platforms import cuda as vllm_cuda
from vllm.plugins import load_general_plugins
from vllm.v1.attention import selector
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.registry import AttentionBackendEnum

import smla
from vllm_case import check, make_case, out_tolerance

load_general_plugins()  # as every vLLM process does: our entry point runs here

from smla.vllm import NAME  # noqa: E402
from smla.vllm.backend import SmlaSparseMLABackend, SmlaSparseMLAImpl  # noqa: E402

_configs = {}
# smla's reason when it was built without nvcc (then SMLA is valid nowhere, and the tests expect that).
NOT_BUILT = "not compiled into this build of smla"


def vllm_config(model_dirs, model, dtype, kv_cache_dtype="auto", backend=None):
    """A VllmConfig of the model's real config.json (vLLM parses it: transformers' config class, hf_text_config)."""
    key = (model, dtype)
    if key not in _configs:
        _configs[key] = ModelConfig(model=str(model_dirs[model]), skip_tokenizer_init=True, dtype=dtype)
    config = VllmConfig(model_config=_configs[key], attention_config=AttentionConfig(backend=backend))
    config.cache_config.cache_dtype = kv_cache_dtype
    return config


def select(config, kv_cache_dtype="auto"):
    """What vLLM's selector picks for the model's MLA layers (the call MLAAttention makes), by name."""
    selector._cached_get_attn_backend.cache_clear()
    vllm_cuda._get_backend_priorities.cache_clear()
    text = config.model_config.hf_text_config
    head_size = text.kv_lora_rank + text.qk_rope_head_dim
    with set_current_vllm_config(config):
        backend = selector.get_attn_backend(head_size, config.model_config.dtype, kv_cache_dtype, use_mla=True,
                                            use_sparse=True, num_heads=text.num_attention_heads)
    return backend.get_name()


def test_the_entry_point_registers_the_backend_and_the_fallback():
    (plugin,) = [p for p in entry_points(group="vllm.general_plugins") if p.name == "smla"]
    assert plugin.value == "smla.vllm:register"
    assert AttentionBackendEnum[NAME].get_class() is SmlaSparseMLABackend
    assert getattr(vllm_cuda.CudaPlatformBase.get_valid_backends, "_smla_fallback", False) is False  # vLLM's own
    from vllm.platforms import current_platform

    assert getattr(type(current_platform).get_valid_backends, "_smla_fallback", False)
    plugin.load()()  # a second load changes nothing
    assert AttentionBackendEnum[NAME].get_class() is SmlaSparseMLABackend


# (capability, query dtype, kv-cache dtype) -> what vLLM 0.33 picks for both models with the plugin installed.
SELECTIONS = [
    ((8, 0), "bfloat16", "auto", NAME),
    ((8, 6), "bfloat16", "auto", NAME),
    ((8, 9), "bfloat16", "auto", NAME),
    ((9, 0), "bfloat16", "auto", "FLASH_ATTN_MLA_SPARSE"),
    ((12, 0), "bfloat16", "auto", "FLASHINFER_MLA_SPARSE_SM120"),  # auto becomes fp8_ds_mla for it
    ((8, 6), "float16", "auto", NAME),
    ((9, 0), "float16", "auto", "FLASH_ATTN_MLA_SPARSE"),
    ((12, 0), "float16", "auto", NAME),  # SM120's in-tree backend is bf16 only
    ((12, 0), "bfloat16", "bfloat16", NAME),  # ... and reads fp8_ds_mla only
    ((8, 9), "bfloat16", "fp8_ds_mla", NAME),
]


# GLM-5.3-Flash (glm5_next: heads of 512, no rope part): another in-tree backend on SM90.
GLM53_SELECTIONS = [
    ((8, 6), "bfloat16", "auto", NAME),
    ((8, 9), "float16", "fp8_ds_mla", NAME),
    ((9, 0), "bfloat16", "auto", "FLASHINFER_MLA_SPARSE_SM90"),
    ((12, 0), "bfloat16", "auto", "FLASHINFER_MLA_SPARSE_SM120"),
    ((12, 0), "bfloat16", "bfloat16", NAME),
]


@pytest.mark.parametrize("model,cap,dtype,kv_cache_dtype,expected",
                         [(m, *s) for m in ("glm-5", "deepseek-v3.2") for s in SELECTIONS]
                         + [("glm-5.3-flash", *s) for s in GLM53_SELECTIONS])
def test_vllm_picks_smla_exactly_where_nothing_in_tree_is_valid(model_dirs, capability, caplog, model, cap, dtype,
                                                                 kv_cache_dtype, expected):
    capability(*cap)
    config = vllm_config(model_dirs, model, dtype, kv_cache_dtype)
    if expected == NAME and not smla.with_cuda:
        # An smla built without nvcc has no GPU kernels: vLLM then finds nothing and lists smla's reason.
        with pytest.raises(ValueError, match=r"No valid attention backend found.*SMLA: \[.*" + NOT_BUILT):
            select(config, kv_cache_dtype)
        return
    with caplog.at_level(logging.WARNING, logger="smla.vllm"):
        chosen = select(config, kv_cache_dtype)
    assert chosen == expected
    # vLLM's own selection, without the plugin's fallback, finds nothing valid exactly where SMLA is chosen.
    original = vllm_cuda.CudaPlatformBase.get_valid_backends
    with set_current_vllm_config(config):
        in_tree, reasons = original(cap_of(cap), selector_config(config, kv_cache_dtype))
    assert (not in_tree) == (chosen == NAME)
    warnings = [r.getMessage() for r in caplog.records if r.name == "smla.vllm"]
    if chosen == NAME:
        assert len(warnings) == 1 and "no in-tree sparse MLA backend is valid" in warnings[0]
        for backend, (_, why) in reasons.items():  # vLLM's reasons, each named
            assert f"{backend.name}: {', '.join(why)}" in warnings[0]
    else:
        assert not warnings


def cap_of(cap):
    from vllm.platforms.interface import DeviceCapability

    return DeviceCapability(*cap)


def selector_config(config, kv_cache_dtype):
    text = config.model_config.hf_text_config
    return selector.AttentionSelectorConfig(head_size=text.kv_lora_rank + text.qk_rope_head_dim,
                                            dtype=config.model_config.dtype, kv_cache_dtype=kv_cache_dtype,
                                            block_size=None, use_mla=True, use_sparse=True)


@pytest.mark.parametrize("model", ["glm-5", "deepseek-v3.2", "glm-5.3-flash"])
@pytest.mark.parametrize("cap", [(8, 0), (8, 6), (8, 9), (9, 0), (12, 0), (7, 5), (10, 0)])
@pytest.mark.parametrize("dtype,kv_cache_dtype", [("bfloat16", "auto"), ("float16", "fp8_ds_mla"),
                                                  ("bfloat16", "fp8"), ("bfloat16", "fp8_e5m2")])
def test_the_backend_says_what_smla_explain_says(model_dirs, model, cap, dtype, kv_cache_dtype):
    """One source of truth: SMLA is valid for vLLM exactly where smla's selector chooses cuda_mma for the model's
    sparse attention (the indexer stays vLLM's), and its reasons are smla's."""
    config = vllm_config(model_dirs, model, dtype, kv_cache_dtype)
    with set_current_vllm_config(config):
        reasons = SmlaSparseMLABackend.validate_configuration(device_capability=cap_of(cap),
                                                              **selector_config(config, kv_cache_dtype)._asdict())
    smla_kv = kv_cache_dtype if kv_cache_dtype in ("auto", "fp8_ds_mla") else None
    if smla_kv is None:
        assert any(f"kv_cache_dtype {kv_cache_dtype} not supported" in r and "fp8_ds_mla" in r for r in reasons)
        return
    e = smla.explain(config.model_config.hf_text_config.to_dict(), device=f"sm_{cap[0] * 10 + cap[1]}", dtype=dtype,
                     kv_cache_dtype=smla_kv, ops=("sparse attention",))
    (cuda_mma,) = [c for c in e.candidates if c.name == "cuda_mma"]
    assert (not reasons) == cuda_mma.valid, (reasons, cuda_mma.reasons)
    for why in cuda_mma.reasons:
        assert any(why in r for r in reasons), (why, reasons)
    if cap == (7, 5):
        assert "compute capability not supported" in reasons


def test_attention_backend_smla_picks_it_where_an_in_tree_one_is_valid(model_dirs, capability):
    capability(9, 0)
    assert select(vllm_config(model_dirs, "glm-5", "bfloat16")) == "FLASH_ATTN_MLA_SPARSE"
    asked = vllm_config(model_dirs, "glm-5", "bfloat16", backend=NAME.lower())  # --attention-backend smla
    if not smla.with_cuda:
        with pytest.raises(ValueError, match=r"Selected backend .*SMLA.* is not valid.*" + NOT_BUILT):
            select(asked)
        return
    assert select(asked) == NAME


def test_where_smla_cannot_run_either_vllm_lists_its_reasons(model_dirs, capability):
    capability(8, 6)
    with pytest.raises(ValueError, match=r"No valid attention backend found.*SMLA: \[.*smla: kv_cache_dtype fp8 "):
        select(vllm_config(model_dirs, "deepseek-v3.2", "bfloat16", "fp8"), "fp8")
    with pytest.raises(ValueError, match=r"Selected backend .*SMLA.* is not valid.*compute capability not supported"):
        capability(7, 5)
        select(vllm_config(model_dirs, "deepseek-v3.2", "bfloat16", backend=NAME))


def test_hisparse_offloading_is_refused_with_the_reason(model_dirs, capability):
    from vllm.config.attention import HiSparseConfig

    capability(8, 6)
    config = vllm_config(model_dirs, "glm-5", "bfloat16")
    config.attention_config.hisparse_config = HiSparseConfig()
    with set_current_vllm_config(config):
        reasons = SmlaSparseMLABackend.validate_configuration(device_capability=cap_of((8, 6)),
                                                              **selector_config(config, "auto")._asdict())
    assert reasons == [f"{NAME} does not support HiSparse KV offloading (its hot-buffer rows)"]


def test_cuda_graph_support_is_declared_uniform_batch(model_dirs):
    builder = SmlaSparseMLABackend.get_builder_cls()
    assert builder.get_cudagraph_support(vllm_config(model_dirs, "glm-5", "bfloat16"), None) \
        == AttentionCGSupport.UNIFORM_BATCH
    assert SmlaSparseMLAImpl.supports_dense_mha_prefill is False  # every token through smla's sparse attention


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """vLLM's process groups for one rank on gloo (a file rendezvous, no network), as a TP 1 worker has them."""
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    init = tmp_path_factory.mktemp("dist") / "init"
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"file://{init}", local_rank=0,
                                     backend="gloo")
        initialize_model_parallel(1, 1)


def make_impl(model_dirs, model, kind, heads, topk):
    """The impl, constructed with the arguments vLLM's MLAAttention passes (vllm/model_executor/layers/attention/
    mla_attention.py), under the model's VllmConfig."""
    config = vllm_config(model_dirs, model, "bfloat16", kind if kind == "fp8_ds_mla" else "auto")
    text = config.model_config.hf_text_config
    with set_current_vllm_config(config):
        return SmlaSparseMLAImpl(
            num_heads=heads, head_size=text.kv_lora_rank + text.qk_rope_head_dim,
            scale=(text.qk_nope_head_dim + text.qk_rope_head_dim) ** -0.5, num_kv_heads=1, alibi_slopes=None,
            sliding_window=None, kv_cache_dtype=kind if kind == "fp8_ds_mla" else "auto", logits_soft_cap=None,
            attn_type="decoder", kv_sharing_target_layer_name=None, q_lora_rank=text.q_lora_rank,
            kv_lora_rank=text.kv_lora_rank, qk_nope_head_dim=text.qk_nope_head_dim,
            qk_rope_head_dim=text.qk_rope_head_dim, qk_head_dim=text.qk_nope_head_dim + text.qk_rope_head_dim,
            v_head_dim=text.v_head_dim, kv_b_proj=None, indexer=None,
            topk_indices_buffer=torch.full((256, topk), -1, dtype=torch.int32))


def to_torch(a):
    import ml_dtypes

    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(a)


@pytest.mark.parametrize("model", ["glm-5", "deepseek-v3.2", "glm-5.3-flash"])
@pytest.mark.parametrize("kind", ["bfloat16", "fp8_ds_mla"])
@pytest.mark.parametrize("batch", ["decode", "mixed"])
def test_the_impl_called_as_vllm_calls_it_matches_float64(model_dirs, one_rank, rng, model, kind, batch):
    """_forward_mqa_kernel with q as vLLM's (ql_nope, q_pe) pair, the padded paged cache, physical top-k rows and
    valid_counts (vllm_case.py: vLLM's conversion is a Triton kernel, so the CPU test builds the same tensors from
    its documented formula), for a decode batch and for decodes followed by prefills of mixed lengths."""
    requests = [(37, 1), (5, 1), (300, 1)] + ([(20, 6), (90, 9), (3, 3)] if batch == "mixed" else [])
    impl = make_impl(model_dirs, model, kind, heads=16, topk=128)
    case = make_case(rng, kind=kind, heads=16, topk=128, block_size=64, pad_rows=0 if kind == "fp8_ds_mla" else 5,
                     requests=requests, rope=impl.qk_rope_head_dim > 0)
    case.scale = impl.scale
    q = to_torch(case.q)
    buffer = to_torch(case.buffer)
    out, lse = impl._forward_mqa_kernel((q[..., :512].contiguous(), q[..., 512:].contiguous()),
                                        buffer[:, :case.block_size], to_torch(case.topk_indices),
                                        to_torch(case.valid_counts), layer=None, block_size=case.block_size,
                                        is_decode=batch == "decode")
    ref_out, ref_lse = case.reference()
    check("out", out.float().numpy(), ref_out, *out_tolerance(ref_out))
    check("lse", lse.numpy(), ref_lse, 1e-5, 8.01 / 65536)


@pytest.fixture
def rng():
    return np.random.default_rng(18)


@pytest.mark.parametrize("kv_cache_dtype,row_bytes", [("auto", 512 * 2), ("fp8_ds_mla", 656)])
def test_what_vllm_allocates_for_glm53_flash_is_what_the_kernel_entry_reads(model_dirs, kv_cache_dtype, row_bytes):
    """GLM-5.3-Flash's MLA layer (heads of 512, no rope part): vLLM's cache spec, built with the arguments
    MLAAttention.get_kv_cache_spec passes, gives bf16 rows of 512 or the 656-byte fp8_ds_mla envelope (its rope part
    unused), the two rows smla's kernel entry reads (test_the_impl_called_as_vllm_calls_it_matches_float64)."""
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    from smla.vllm import _kernel

    config = vllm_config(model_dirs, "glm-5.3-flash", "bfloat16", kv_cache_dtype)
    text = config.model_config.hf_text_config
    head_size = text.kv_lora_rank + text.qk_rope_head_dim
    assert head_size == 512
    dtype = kv_cache_dtype_str_to_dtype(kv_cache_dtype, config.model_config)
    spec = MLAAttentionSpec(block_size=64, num_kv_heads=1, max_tp_shards=1, head_size=head_size, dtype=dtype,
                            cache_dtype_str=kv_cache_dtype,
                            state_content_bytes={"fp8_ds_mla": 656}.get(kv_cache_dtype))
    assert spec.page_size_bytes == 64 * row_bytes
    cache = torch.empty(2, 64, row_bytes // dtype.itemsize, dtype=dtype)
    assert _kernel._cache_dtype(cache) == ("fp8_ds_mla" if kv_cache_dtype == "fp8_ds_mla" else "auto")
