"""smla.explain, backends, model specs: the same answers as the C++ API and the CLI."""

from __future__ import annotations

import json
import pathlib
import re

import pytest

import smla

ROOT = pathlib.Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden"
CONFIGS = ROOT / "tests" / "data" / "configs"

# The golden cases of tests/cpu/test_explain.cpp: (file, model, device, dtype, kv_cache_dtype, tp).
GOLDEN_CASES = [
    ("glm5_sm120_fp16", "glm-5", "sm_120", "float16", "auto", 1),
    ("glm5_cpu_tp8", "glm-5", "cpu", "bfloat16", "auto", 8),
    ("deepseek_v32_cpu_fp8", "deepseek-v3.2", "cpu", "bfloat16", "fp8_ds_mla", 8),
    ("deepseek_v3_sm80", "deepseek-v3", "sm_80", "bfloat16", "auto", 1),
    ("kimi_k2_cpu", "kimi-k2", "cpu", "float16", "float16", 1),
]


@pytest.mark.parametrize("golden,model,device,dtype,kv,tp", GOLDEN_CASES)
def test_explain_matches_the_golden_text_and_json(golden, model, device, dtype, kv, tp):
    e = smla.explain(model, device=device, dtype=dtype, kv_cache_dtype=kv, tp=tp)
    name = golden if smla.with_cuda else golden + ".nocuda"
    assert str(e) == (GOLDEN / f"{name}.txt").read_text()
    assert e.to_dict() == json.loads((GOLDEN / f"{name}.json").read_text())
    # The dataclasses say what the JSON says.
    d = e.to_dict()
    assert e.schema == "smla.explain/1"
    assert e.chosen == d["chosen"] and bool(e) == (d["chosen"] is not None)
    assert e.run.heads_per_rank == e.model.num_heads // tp
    assert e.model.absorbed_qk_dim == 576 and e.model.absorbed_v_dim == 512
    assert [c.name for c in e.candidates] == [c["name"] for c in d["candidates"]]
    assert all(c.valid == (not c.reasons) for c in e.candidates)
    assert [c.kernel_notes for c in e.candidates] == [tuple(c["kernel_notes"]) for c in d["candidates"]]
    assert [[k.kernel for k in c.kernels] for c in e.candidates] == [[k["kernel"] for k in c["kernels"]]
                                                                     for c in d["candidates"]]
    assert json.loads(e.to_json()) == d


def test_explain_fields():
    e = smla.explain("deepseek-v3.2", device="cpu", kv_cache_dtype="fp8_ds_mla", block_size=16, tp=8)
    assert e.chosen == "cpu" and not e.forced and e.suggestion is None
    assert e.model.indexer is not None and e.model.indexer.topk == 2048 and e.model.indexer.rope_style == "half-split"
    assert e.model.rope.yarn is not None and e.model.rope.yarn.factor == 40.0
    assert e.run.kv_cache_dtype == "fp8_ds_mla" and not e.run.kv_cache_dtype_auto
    assert e.run.block_size == 16 and e.run.ops == ("sparse attention", "indexer")
    assert "CHOSEN" in str(e)


def test_explain_no_valid_backend_is_not_an_error():
    # GLM-5 in fp16 on an RTX 5090: cuda_mma runs it where the package holds the CUDA kernels; without them no
    # backend can, which explain reports (with every candidate's reasons and a suggestion) instead of raising.
    e = smla.explain("glm-5", device="sm_120", dtype="float16")
    if smla.with_cuda:
        assert e.chosen == "cuda_mma" and e.suggestion is None
    else:
        assert e.chosen is None
        assert e.suggestion and "cpu" in e.suggestion
        assert e.candidates and all(c.reasons for c in e.candidates)


def test_explain_names_the_kernel_for_the_query_rows_given():
    # GLM-5 under TP 8 on an RTX 5090: one decode token takes the 16-head tile, 32 the small-heads kernel.
    e = smla.explain("glm-5", device="sm_120", tp=8, kv_cache_dtype="fp8_ds_mla", tokens=[1, 32])
    assert e.run.query_tokens == (1, 32)
    assert "8 heads per rank, 1 and 32 query rows per call" in str(e)
    if smla.with_cuda:
        notes = [line for c in e.candidates if c.chosen for line in c.kernel_notes if line.startswith("kernel")]
        assert [n.split(":")[0] for n in notes] == ["kernel (1 query row)", "kernel (32 query rows)"]
        assert notes[0].startswith("kernel (1 query row): 16-head tile")
        assert notes[1].startswith("kernel (32 query rows): small-heads kernel")
        # The same as data.
        (chosen,) = [c for c in e.candidates if c.chosen]
        assert [(k.query_tokens, k.phase, k.kernel, k.heads_per_cta, k.arch) for k in chosen.kernels] == [
            (1, None, "16-head tile", 16, "sm_120"), (32, None, "small-heads kernel", 8, "sm_120")]
        assert all(k.smem_bytes > 0 and k.ctas_per_sm >= 1 and k.others for k in chosen.kernels)
    assert smla.explain("glm-5", device="cpu").run.query_tokens == ()


def test_explain_forced_backend():
    e = smla.explain("glm-5", device="cpu", backend="cpu")
    assert e.chosen == "cpu" and e.forced
    with pytest.raises(smla.UnsupportedError, match="backend 'cpu' was forced"):
        smla.explain("glm-5", device="sm_90", backend="cpu")


def test_explain_reads_smla_backend(monkeypatch):
    monkeypatch.setenv("SMLA_BACKEND", "cpu")
    assert smla.explain("kimi-k2", device="cpu").forced


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(dtype="float32"), "dtype: expected bfloat16 or float16"),
    (dict(kv_cache_dtype="fp4"), "kv_cache_dtype"),
    (dict(device="tpu"), "device"),
    (dict(block_size=0), "block_size"),
    (dict(tp=3), "tp: 3 does not divide"),
    (dict(backend="flashmla"), "backend: unknown backend 'flashmla'"),
    (dict(tokens=[8, 0]), "tokens: expected query rows per call from 1 to"),
])
def test_explain_bad_input_raises_value_errors(kwargs, pattern):
    with pytest.raises(smla.InvalidArgumentError, match=pattern) as e:
        smla.explain("glm-5", **{"device": "cpu", **kwargs})
    assert isinstance(e.value, ValueError)


def test_models():
    assert smla.preset_names() == ["glm-5", "deepseek-v3.2", "deepseek-v3", "kimi-k2", "glm-4.7-flash",
                                   "glm-5.3-flash", "deepseek-v4-flash"]
    spec = smla.load_model_spec("glm-5")
    assert (spec.num_heads, spec.qk_nope_head_dim, spec.v_head_dim, spec.softmax_scale) == (64, 192, 256, 0.0625)
    assert spec.is_sparse and spec.indexer.heads == 32 and spec.rope_style == "interleaved"
    from_file = smla.load_model_spec(CONFIGS / "deepseek-v3.2.json")
    assert from_file.model_type == "deepseek_v32" and from_file.indexer.rope_style == "half-split"
    as_dict = smla.load_model_spec(json.loads((CONFIGS / "kimi-k2.5-nested.json").read_text()))
    assert as_dict.model_type == "kimi_k2"
    # An adjusted spec explains as adjusted.
    spec.num_heads = 96
    assert smla.explain(spec, device="cpu", tp=8).run.heads_per_rank == 12
    with pytest.raises(smla.InvalidArgumentError, match="llama-3"):
        smla.load_model_spec("llama-3")
    with pytest.raises(smla.InvalidArgumentError, match="num_attention_heads"):
        smla.load_model_spec(ROOT / "tests" / "cli" / "bad" / "missing-heads.json")
    bad = smla.AttentionSpec()
    with pytest.raises(smla.InvalidArgumentError, match="^AttentionSpec: num_attention_heads must be a positive"):
        bad.validate()
    with pytest.raises(smla.InvalidArgumentError, match="rope_style"):
        spec.rope_style = "sideways"


def test_deepseek_v4_flash():
    """DeepSeek-V4-Flash: a 512-wide shared-KV head (rope inside, the value the whole head), window + compressed
    caches; the CPU and CUDA backends attend both caches, and neither fp8_ds_mla form holds its head."""
    spec = smla.load_model_spec(CONFIGS / "deepseek-v4-flash.json")
    assert (spec.kv_lora_rank, spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim) == (0, 448, 64, 512)
    assert (spec.absorbed_qk_dim, spec.absorbed_v_dim) == (512, 512)
    e = smla.explain("deepseek-v4-flash", device="cpu")
    assert e.model.shared_kv and e.model.sliding_window == 128 and e.model.absorbed_v_dim == 512
    assert len(e.model.compress_ratios) == 43 and e.model.compress_ratios[:4] == (0, 0, 4, 128)
    assert e.chosen == "cpu"
    cuda = smla.explain("deepseek-v4-flash", device="sm_90")
    assert not any("two caches" in r for c in cuda.candidates if c.name == "cuda_mma" for r in c.reasons)
    assert cuda.chosen == ("cuda_mma" if smla.with_cuda else None)
    assert "value 512 (the whole cached head, rope dims included)" in e.text
    fp8 = smla.explain("deepseek-v4-flash", device="cpu", kv_cache_dtype="fp8_ds_mla")
    assert fp8.chosen is None and any("584-byte MODEL1 layout" in r for r in fp8.candidates[0].reasons)
    v4_fp8 = smla.explain("deepseek-v4-flash", device="cpu", kv_cache_dtype="fp8_ds_mla_v4")
    assert v4_fp8.chosen == "cpu"
    for sm in ("sm_80", "sm_120"):  # the CUDA backend reads it on every arch
        v4_fp8_cuda = smla.explain("deepseek-v4-flash", device=sm, kv_cache_dtype="fp8_ds_mla_v4")
        assert v4_fp8_cuda.chosen == ("cuda_mma" if smla.with_cuda else None), v4_fp8_cuda.text
    glm5_v4_fp8 = smla.explain("glm-5", device="cpu", kv_cache_dtype="fp8_ds_mla_v4")
    assert glm5_v4_fp8.chosen is None and any("fp8_ds_mla_v4 is DeepSeek-V4's cache" in r
                                              for r in glm5_v4_fp8.candidates[0].reasons)
    glm5 = smla.explain("glm-5", device="cpu")
    assert not glm5.model.shared_kv and glm5.model.compress_ratios == () and glm5.model.sliding_window == 0


def test_glm53_flash():
    """GLM-5.3-Flash: 512-wide heads, a pooled indexer, 11 MLA layers of 45; both backends pool."""
    spec = smla.load_model_spec("glm-5.3-flash")
    assert (spec.qk_rope_head_dim, spec.absorbed_qk_dim, spec.absorbed_v_dim) == (0, 512, 512)
    assert (spec.num_layers, spec.num_attention_layers, spec.indexer.kpool) == (45, 11, 4)
    nested = smla.load_model_spec(CONFIGS / "glm-5.3-flash.json")
    assert nested.model_type == "glm5_next_text" and nested.indexer.kpool == 4
    for tp in (2, 4, 8):
        e = smla.explain("glm-5.3-flash", device="cpu", tp=tp, kv_cache_dtype="fp8_ds_mla_nope")
        assert e.run.heads_per_rank == 64 // tp and e.model.absorbed_qk_dim == 512
        assert e.model.num_attention_layers == 11 and e.model.indexer.kpool == 4
        assert e.model.rope is None and e.model.indexer.rope_style is None  # no rope part, as the text says
        assert e.chosen == "cpu"
        assert not any("pooled indexer" in r for c in e.candidates for r in c.reasons)
    e = smla.explain("glm-5", device="cpu", kv_cache_dtype="fp8_ds_mla_nope")
    assert any("fp8_ds_mla_nope has no rope part" in r for c in e.candidates for r in c.reasons)


def test_explain_asks_for_the_ops_given():
    """ops= replaces what the model needs (an engine with its own indexer asks for sparse attention only)."""
    e = smla.explain("glm-5", device="cpu", ops=("sparse attention",))
    assert e.run.ops == ("sparse attention",) and "needs      sparse attention\n" in str(e)
    assert smla.explain("glm-5", device="cpu").run.ops == ("sparse attention", "indexer")
    with pytest.raises(smla.InvalidArgumentError, match="ops: expected op names among 'sparse attention'.*got 'topk'"):
        smla.explain("glm-5", device="cpu", ops=("topk",))


def test_backends_match_the_readme_support_matrix():
    names = [b.name for b in smla.backends()]
    assert "cpu" in names and "cuda_mma" in names
    cpu = next(b for b in smla.backends() if b.name == "cpu")
    assert cpu.device == "cpu" and cpu.compute_capability is None and "fp8_ds_mla" in cpu.kv_cache_dtypes
    cuda = next(b for b in smla.backends() if b.name == "cuda_mma")
    assert cpu.extra_cache and cuda.extra_cache  # DeepSeek-V4's two caches
    readme = (ROOT / "README.md").read_text()
    table = re.search(r"<!-- support-matrix:begin.*?-->\n(.*?)<!-- support-matrix:end -->", readme, re.S).group(1)
    assert smla.support_matrix() == table


def test_detect_device():
    device = smla.detect_device()
    assert device == "cpu" or device.startswith("sm_")
    if not smla.with_cuda:
        assert device == "cpu"
