"""smla's MlaLayer against transformers' own attention modules (deepseek_v3, deepseek_v32, glm_moe_dsa, glm5_next).

Tiny random configurations with the real structure: the real head dims (kv_lora 512, rope 64, nope/v as the model),
small hidden size and few heads, top-k below the sequence length so that DSA selects. The same weights go into both
sides: the module's state dict is saved as a one-layer safetensors checkpoint next to its config.json, which the C++
driver (tests/layer/layer_driver.cpp) reads through smla::load_attention_weights. The driver runs a prefill and then
one decode step per token; transformers runs the whole sequence causally in float32, which gives every position the
output a decode step must give. Tolerance: smla's attention runs on bf16 queries and a bf16 cache. Its indexer
scores bf16 queries and keys, so a row whose k-th and (k+1)-th scores lie within 0.5% of its best score (or tie, as
ReLU makes common at 0) may choose differently from transformers' fp32 indexer: such rows are left out of the
comparison (at most a quarter of them). GLM-5.3-Flash (glm5_next) has no rope part and a pooled indexer: its index
scores are over pools of index_kpool tokens and top-k keeps index_topk / index_kpool of them, plus the tail.

Run with `make test-layer` (it installs torch and transformers: scripts/install-deps.sh --layer). SMLA_LAYER_DRIVER
names the driver binary (default build/tests/cpu/layer_driver); SMLA_LAYER_DEVICE=cuda runs the layer on the GPU
(bf16 weights: twice the tolerance; the unabsorbed path is CPU-only and skips).
"""

import json
import os
import pathlib
import subprocess

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

ROOT = pathlib.Path(__file__).resolve().parents[2]
DRIVER = pathlib.Path(os.environ.get("SMLA_LAYER_DRIVER", ROOT / "build" / "tests" / "cpu" / "layer_driver"))
DEVICE = os.environ.get("SMLA_LAYER_DEVICE", "cpu")
# On the GPU the weights and every product's input are bf16 (2^-9 relative each), where the CPU keeps fp32.
WEIGHTS_TOL = 2.0 if DEVICE == "cuda" else 1.0
TOKENS, PREFILL = 32, 20

# (model_type, module path, attention class, rotary class, config overrides)
COMMON = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512, qk_rope_head_dim=64,
              num_hidden_layers=1, vocab_size=32, max_position_embeddings=4096, rms_norm_eps=1e-6)
DSA = dict(index_n_heads=16, index_head_dim=128, index_topk=8)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
GLM5_NEXT = dict(q_lora_rank=96, qk_rope_head_dim=0, qk_nope_head_dim=256, v_head_dim=256, index_n_heads=16,
                 index_head_dim=128, index_topk=8, index_kpool=4, index_kpool_always_select_tail=True,
                 layer_types=["full_attention"], mlp_layer_types=["dense"], indexer_types=["full"])
CASES = {
    "deepseek_v3_yarn": ("deepseek_v3", "DeepseekV3",
                         dict(q_lora_rank=96, qk_nope_head_dim=128, v_head_dim=128, rope_parameters=YARN)),
    "deepseek_v3_no_q_lora": ("deepseek_v3", "DeepseekV3",
                              dict(q_lora_rank=None, qk_nope_head_dim=128, v_head_dim=128,
                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "deepseek_v32": ("deepseek_v32", "DeepseekV32",
                     dict(q_lora_rank=96, qk_nope_head_dim=128, v_head_dim=128, rope_parameters=YARN, **DSA)),
    # GLM-5's real config says so; smla's config reader defaults a missing key to DeepSeek's half-split indexer RoPE.
    "glm_moe_dsa": ("glm_moe_dsa", "GlmMoeDsa",
                    dict(q_lora_rank=96, qk_nope_head_dim=192, v_head_dim=256, indexer_rope_interleave=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, **DSA)),
    # GLM-5.3-Flash: 512-wide heads with no rope part, pools of 4 tokens (2 of them chosen, plus the tail), no RoPE
    # anywhere. Its attention module takes no position embeddings and a boolean padding mask.
    "glm5_next": ("glm5_next", "Glm5NextText", GLM5_NEXT),
    # Top-k over every pool of the prompt: the unabsorbed (dense) path gives the same attention.
    "glm5_next_all_pools": ("glm5_next", "Glm5NextText", dict(GLM5_NEXT, index_topk=TOKENS)),
}


def hf_classes(model_type, prefix):
    try:
        modeling = __import__(f"transformers.models.{model_type}.modeling_{model_type}", fromlist=["x"])
        configuration = __import__(f"transformers.models.{model_type}.configuration_{model_type}", fromlist=["x"])
    except ImportError:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    # No rotary class: a model without RoPE (glm5_next).
    return (getattr(configuration, f"{prefix}Config"), getattr(modeling, f"{prefix}Attention"),
            getattr(modeling, f"{prefix}RotaryEmbedding", None))


def randomize(module, generator):
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1:  # norm weights (and the indexer's LayerNorm bias) away from their 1 / 0 init
                base = 0.0 if name.endswith("bias") else 1.0
                p.copy_(base + 0.2 * (torch.rand(p.shape, generator=generator) - 0.5))
            else:
                bound = (3.0 / p.shape[1]) ** 0.5
                p.copy_((torch.rand(p.shape, generator=generator) * 2 - 1) * bound)


def run_case(name, tmp_path, path="absorbed", kv_cache_dtype="bfloat16"):
    model_type, prefix, overrides = CASES[name]
    config_cls, attention_cls, rotary_cls = hf_classes(model_type, prefix)
    config = config_cls(**{**COMMON, **overrides})
    config._attn_implementation = "eager"
    attention = attention_cls(config, layer_idx=0).eval()
    generator = torch.Generator().manual_seed(1234)
    randomize(attention, generator)
    hidden = torch.rand((1, TOKENS, config.hidden_size), generator=generator) * 2 - 1

    positions = torch.arange(TOKENS)[None]
    if rotary_cls is None:  # glm5_next: the mask marks real tokens (no padding); the indexer makes it causal
        inputs = dict(attention_mask=torch.ones((1, TOKENS), dtype=torch.bool))
    else:
        inputs = dict(position_embeddings=rotary_cls(config)(hidden, positions), position_ids=positions,
                      attention_mask=torch.full((TOKENS, TOKENS), float("-inf")).triu(1)[None, None])
    index_scores = []  # the indexer's scores: its only topk call is on them
    topk = torch.Tensor.topk

    def recording_topk(tensor, *args, **kwargs):
        index_scores.append(tensor.detach().clone())
        return topk(tensor, *args, **kwargs)

    torch.Tensor.topk = recording_topk
    try:
        with torch.no_grad():
            expected = attention(hidden_states=hidden, **inputs)[0][0].numpy()
    finally:
        torch.Tensor.topk = topk

    config_dict = config.to_dict()
    config_dict.update(indexer_rope_interleave=overrides.get("indexer_rope_interleave", False))
    (tmp_path / "config.json").write_text(json.dumps(config_dict))
    # GLM-5.3-Flash's checkpoint is multimodal: its text model's layers are under model.language_model.
    prefix = "model.language_model.layers.0.self_attn." if model_type == "glm5_next" else "model.layers.0.self_attn."
    tensors = {prefix + k: v.contiguous() for k, v in attention.state_dict().items()}
    safetensors_torch.save_file(tensors, str(tmp_path / "model.safetensors"))
    hidden[0].numpy().astype(np.float32).tofile(tmp_path / "hidden.f32")
    prefill = PREFILL if path == "absorbed" else TOKENS
    result = subprocess.run([str(DRIVER), str(tmp_path), str(prefill), path, kv_cache_dtype, DEVICE],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    actual = np.fromfile(tmp_path / "out.f32", dtype=np.float32).reshape(expected.shape)
    if index_scores:
        chosen = config.index_topk // getattr(config, "index_kpool", 1)  # tokens, or pools of a pooled indexer
        keep = [not near_tie(index_scores[0][0, t].numpy(), chosen) for t in range(TOKENS)]
        assert sum(keep) >= 0.75 * TOKENS, f"too many near-ties in the top-k choice: kept {keep}"
        expected, actual = expected[keep], actual[keep]
    return expected, actual


def near_tie(scores, k, margin=5e-3):
    """Whether the k-th and (k+1)-th best scores are so close (relative to the row's largest) that smla's bf16
    indexer may order them differently; ReLU makes exact ties at 0 common, which either side may break its way."""
    visible = np.sort(scores[np.isfinite(scores) & (scores > np.finfo(np.float32).min)])[::-1]  # masked: -inf or min
    return len(visible) > k and visible[k - 1] - visible[k] <= margin * np.abs(visible).max()


def assert_close(expected, actual, tol, min_cos=0.9999):
    scale = np.abs(expected).max()
    err = np.abs(actual - expected).max() / scale
    cos = float((expected * actual).sum() / np.linalg.norm(expected) / np.linalg.norm(actual))
    assert err <= tol and cos >= min_cos, f"max error {err:.2e} of max |out| {scale:.3g}, cosine {cos:.8f}"


@pytest.fixture(scope="module", autouse=True)
def driver():
    if not DRIVER.exists():
        pytest.fail(f"no layer driver at {DRIVER}: build the tests or set SMLA_LAYER_DRIVER")


@pytest.mark.parametrize("name", list(CASES))
def test_prefill_then_decode_matches_transformers(name, tmp_path):
    assert_close(*run_case(name, tmp_path), tol=1e-2 * WEIGHTS_TOL)


@pytest.mark.parametrize("name", ["deepseek_v3_yarn", "deepseek_v3_no_q_lora", "glm5_next_all_pools"])
def test_unabsorbed_prefill_matches_transformers(name, tmp_path):
    if DEVICE != "cpu":
        pytest.skip("the unabsorbed path runs on the CPU only")
    # fp32 throughout: only summation order differs.
    assert_close(*run_case(name, tmp_path, path="unabsorbed"), tol=1e-4)


@pytest.mark.parametrize("name, kv_cache_dtype",
                         [("glm_moe_dsa", "fp8_ds_mla"), ("glm5_next", "fp8_ds_mla"), ("glm5_next", "fp8_ds_mla_nope")])
def test_fp8_cache_matches_transformers(name, kv_cache_dtype, tmp_path):
    # fp8 latents (e4m3 with per-128 power-of-two scales): about 2^-4 relative per latent value. The index cache
    # stays bf16: fp8 keys move the top-k boundary past what the near-tie rule leaves out. glm5_next's head has no
    # rope part: the 656-byte envelope (its rope part unused) and the compact 528-byte rows.
    assert_close(*run_case(name, tmp_path, kv_cache_dtype=kv_cache_dtype), tol=5e-2 * WEIGHTS_TOL, min_cos=0.999)
