#!/usr/bin/env python3
"""Writes the model files the GGUF / safetensors tests and the fuzzers read, into OUT (nothing binary is committed).

  specs/NAME.gguf       metadata only, as llama.cpp's converter writes it for tests/data/configs/NAME.json
  tiny/ARCH/            a tiny model of each architecture (and glm-dsa-layer, glm-dsa with the sizes MlaLayer
                        needs): model.gguf (mixed F32/F16/BF16/Q8_0/Q4_K/Q6_K), split/ARCH-0000N-of-00003.gguf (the
                        same, in three parts), hf/ (config.json and bf16/f16/f32 safetensors shards) and expected/
                        (raw little-endian float32 of every attention tensor, as gguf-py dequantises it and as the
                        safetensors hold it)
  quants.gguf           one tensor per type, expected values in quants/
  bad/                  damaged files, one fault each (tests/cpu/test_gguf.cpp lists what each must say)
  manifest.json         what is where, with the shapes of the expected tensors

Usage: make_fixtures.py OUT [--configs DIR]
"""
import argparse
import json
import shutil
import struct
import sys
from pathlib import Path

try:
    import gguf
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file
except ImportError as error:
    sys.exit(f"make_fixtures.py: needs the Python packages gguf, safetensors, numpy and ml_dtypes ({error}); "
             "install them with: bash scripts/install-deps.sh --python")

Q = gguf.GGMLQuantizationType
QK_K = 256


# --- GGUF metadata, as convert_hf_to_gguf.py derives it from a config.json --------------------------------------

ARCH = {"deepseek_v3": "deepseek2", "kimi_k2": "deepseek2", "glm4_moe_lite": "deepseek2",
        "deepseek_v32": "deepseek32", "glm_moe_dsa": "glm-dsa"}
TOKENIZER_PRE = {"kimi_k2": "kimi-k2", "glm4_moe_lite": "glm4"}


def rope_settings(cfg):
    params = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", params.get("rope_theta"))
    scaling = cfg.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type"))
    return theta, (scaling if kind == "yarn" else None)


def write_metadata(writer, cfg, legacy=False):
    """The keys the converter writes for an MLA model; legacy: as files converted before MLA was stored as MQA."""
    model_type = cfg["model_type"]
    nextn = cfg.get("num_nextn_predict_layers", 0) if ARCH[model_type] != "deepseek2" else 0
    kv, rope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    nope, v = cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    writer.add_tokenizer_pre(TOKENIZER_PRE.get(model_type, "deepseek-v3"))
    writer.add_block_count(cfg.get("num_hidden_layers", 0) + nextn)
    if nextn:
        writer.add_nextn_predict_layers(nextn)
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
    if cfg.get("q_lora_rank"):
        writer.add_q_lora_rank(cfg["q_lora_rank"])
    writer.add_kv_lora_rank(kv)
    if legacy:
        writer.add_head_count_kv(cfg["num_attention_heads"])
        writer.add_key_length(nope + rope)
        writer.add_value_length(v)
    else:
        writer.add_head_count_kv(1)
        writer.add_key_length(kv + rope)
        writer.add_value_length(kv)
        writer.add_key_length_mla(nope + rope)
        writer.add_value_length_mla(v)
    writer.add_rope_dimension_count(rope)
    theta, yarn = rope_settings(cfg)
    if theta is not None:
        writer.add_rope_freq_base(theta)
    if yarn:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(yarn["factor"])
        writer.add_rope_scaling_orig_ctx_len(yarn["original_max_position_embeddings"])
        if "beta_fast" in yarn:
            writer.add_rope_scaling_yarn_beta_fast(yarn["beta_fast"])
        if "beta_slow" in yarn:
            writer.add_rope_scaling_yarn_beta_slow(yarn["beta_slow"])
        if "mscale_all_dim" in yarn:
            writer.add_rope_scaling_yarn_log_mul(0.1 * yarn["mscale_all_dim"])
    if ARCH[model_type] != "deepseek2":
        writer.add_indexer_head_count(cfg["index_n_heads"])
        writer.add_indexer_key_length(cfg["index_head_dim"])
        writer.add_indexer_top_k(cfg["index_topk"])


def finish(writer):
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_specs(configs, out):
    for path in sorted(configs.glob("*.json")):
        config = json.loads(path.read_text())
        cfg = config.get("text_config", config)
        if cfg["model_type"] not in ARCH:  # no GGUF architecture for it (glm5_next_text): no spec fixture
            continue
        writer = gguf.GGUFWriter(out / f"{path.stem}.gguf", ARCH[cfg["model_type"]])
        write_metadata(writer, cfg)
        finish(writer)


# --- Tensors ---------------------------------------------------------------------------------------------------

def random_blocks(rng, qtype, rows, cols):
    """Valid Q4_K / Q6_K data (gguf-py can dequantise these but not quantise to them): random bits, finite scales."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // block_size, type_size), dtype=np.uint8)

    def scale():
        return rng.uniform(1e-3, 2e-2, size=len(blocks)).astype(np.float16).view(np.uint8).reshape(-1, 2)

    if qtype == Q.Q4_K:
        blocks[:, 0:2], blocks[:, 2:4] = scale(), scale()
    else:
        blocks[:, -2:] = scale()
    return blocks.reshape(rows, cols // block_size * type_size)


def encode(qtype, values):
    """(bytes or array to store, what gguf-py dequantises them to) for float32 `values`."""
    if qtype == Q.F32:
        return values, values
    if qtype == Q.F16:
        half = values.astype(np.float16)
        return half, half.astype(np.float32)
    data = gguf.quants.quantize(values, qtype)
    return data, gguf.quants.dequantize(data, qtype)


def stored_like(qtype, rng, shape):
    """Master float32 values for a tensor; for K-quants they come from random blocks, so GGUF holds them exactly."""
    if qtype in (Q.Q4_K, Q.Q6_K):
        rows = int(np.prod(shape[:-1]))
        blocks = random_blocks(rng, qtype, rows, shape[-1])
        return gguf.quants.dequantize(blocks, qtype).reshape(shape), blocks
    return (rng.standard_normal(shape) * 0.05).astype(np.float32), None


class Layer:
    """One attention layer's tensors, in Hugging Face orientation, with the GGUF type each is stored as."""
    FIELDS = [  # field, GGUF name, HF name, GGUF type, HF dtype
        ("q", "attn_q.weight", "q_proj.weight", Q.Q8_0, "bf16"),
        ("q_a", "attn_q_a.weight", "q_a_proj.weight", Q.Q4_K, "bf16"),
        ("q_a_norm", "attn_q_a_norm.weight", "q_a_layernorm.weight", Q.F32, "f32"),
        ("q_b", "attn_q_b.weight", "q_b_proj.weight", Q.Q8_0, "bf16"),
        ("kv_a_mqa", "attn_kv_a_mqa.weight", "kv_a_proj_with_mqa.weight", Q.Q6_K, "bf16"),
        ("kv_a_norm", "attn_kv_a_norm.weight", "kv_a_layernorm.weight", Q.F32, "f32"),
        ("kv_b", "attn_kv_b.weight", "kv_b_proj.weight", Q.F16, "bf16"),
        ("o", "attn_output.weight", "o_proj.weight", Q.Q8_0, "f16"),
        ("indexer.wq_b", "indexer.attn_q_b.weight", "indexer.wq_b.weight", Q.BF16, "bf16"),
        ("indexer.wk", "indexer.attn_k.weight", "indexer.wk.weight", Q.Q6_K, "bf16"),
        ("indexer.k_norm", "indexer.k_norm.weight", "indexer.k_norm.weight", Q.F32, "f32"),
        ("indexer.k_norm_bias", "indexer.k_norm.bias", "indexer.k_norm.bias", Q.F32, "f32"),
        ("indexer.weights_proj", "indexer.proj.weight", "indexer.weights_proj.weight", Q.Q4_K, "bf16"),
    ]

    def __init__(self, cfg, rng):
        h, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
        q_lora, kv = cfg.get("q_lora_rank") or 0, cfg["kv_lora_rank"]
        nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        shapes = {"kv_a_mqa": (kv + rope, hidden), "kv_a_norm": (kv,), "kv_b": (h * (nope + v), kv),
                  "o": (hidden, h * v)}
        if q_lora:
            shapes |= {"q_a": (q_lora, hidden), "q_a_norm": (q_lora,), "q_b": (h * (nope + rope), q_lora)}
        else:
            shapes["q"] = (h * (nope + rope), hidden)
        if "index_n_heads" in cfg:
            ih, idim = cfg["index_n_heads"], cfg["index_head_dim"]
            shapes |= {"indexer.wq_b": (ih * idim, q_lora), "indexer.wk": (idim, hidden), "indexer.k_norm": (idim,),
                       "indexer.k_norm_bias": (idim,), "indexer.weights_proj": (ih, hidden)}
        self.heads, self.nope, self.v = h, nope, v
        self.master, self.blocks = {}, {}
        for field, _, _, qtype, _ in self.FIELDS:
            if field in shapes:
                self.master[field], self.blocks[field] = stored_like(qtype, rng, shapes[field])

    def gguf_tensors(self, split_kv_b):
        """(GGUF name suffix, data, raw type or None) and the float32 values gguf-py reads back, per field."""
        tensors, expected = [], {}
        for field, name, _, qtype, _ in self.FIELDS:
            if field not in self.master:
                continue
            if field == "kv_b" and split_kv_b:
                # The converter's split for the absorbed form: k_b [H, kv_lora, nope], v_b [H, v, kv_lora].
                kv_b = self.master["kv_b"].reshape(self.heads, self.nope + self.v, -1)
                k_b = np.ascontiguousarray(kv_b[:, :self.nope, :].transpose(0, 2, 1))
                v_b = np.ascontiguousarray(kv_b[:, self.nope:, :])
                k_data, k_read = encode(Q.F16, k_b)
                v_data, v_read = encode(Q.BF16, v_b)
                tensors += [("attn_k_b.weight", k_data, None), ("attn_v_b.weight", v_data, Q.BF16)]
                merged = np.concatenate([k_read.transpose(0, 2, 1), v_read], axis=1)
                expected[field] = merged.reshape(self.master["kv_b"].shape)
                continue
            if self.blocks[field] is not None:
                data, read = self.blocks[field], self.master[field]
            else:
                data, read = encode(qtype, self.master[field])
            tensors.append((name, data, qtype if data.dtype == np.uint8 else None))
            expected[field] = read
        return tensors, expected

    def hf_tensors(self):
        tensors, expected = {}, {}
        for field, _, name, _, dtype in self.FIELDS:
            if field not in self.master:
                continue
            stored = self.master[field].astype(HF_DTYPES[dtype])
            tensors[name] = stored
            expected[field] = stored.astype(np.float32)
        return tensors, expected


HF_DTYPES = {"bf16": ml_dtypes.bfloat16, "f16": np.float16, "f32": np.float32}

TINY = {
    "deepseek2": {"model_type": "deepseek_v3", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "q_lora_rank": 64, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                  "v_head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                  "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                   "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}},
    # No query compression, one attn_kv_b, per-head key/value lengths: a file from before the MLA-as-MQA change.
    "deepseek2-legacy": {"model_type": "deepseek_v3", "hidden_size": 256, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "q_lora_rank": None, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
                         "qk_rope_head_dim": 8, "v_head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0},
    "deepseek32": {"model_type": "deepseek_v32", "hidden_size": 256, "num_hidden_layers": 2,
                   "num_nextn_predict_layers": 1, "num_attention_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 32,
                   "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "rms_norm_eps": 1e-6,
                   "rope_theta": 10000, "index_n_heads": 4, "index_head_dim": 32, "index_topk": 64,
                   "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                    "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}},
    "glm-dsa": {"model_type": "glm_moe_dsa", "hidden_size": 256, "num_hidden_layers": 2, "num_nextn_predict_layers": 1,
                "num_attention_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 32, "qk_nope_head_dim": 24,
                "qk_rope_head_dim": 8, "v_head_dim": 32, "rms_norm_eps": 1e-5, "rope_interleave": True,
                "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"}, "index_n_heads": 2,
                "index_head_dim": 32, "index_topk": 64, "indexer_rope_interleave": True},
    # The sizes MlaLayer's kernels fix (kv_lora 512, rope 64, indexer heads of 128), the rest tiny: `smla run --layer`.
    "glm-dsa-layer": {"model_type": "glm_moe_dsa", "hidden_size": 256, "num_hidden_layers": 2,
                      "num_nextn_predict_layers": 1, "num_attention_heads": 4, "q_lora_rank": 64,
                      "kv_lora_rank": 512, "qk_nope_head_dim": 32, "qk_rope_head_dim": 64, "v_head_dim": 32,
                      "rms_norm_eps": 1e-5, "rope_interleave": True,
                      "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"}, "index_n_heads": 2,
                      "index_head_dim": 128, "index_topk": 64, "indexer_rope_interleave": True},
}
SPLIT_PARTS = 3


def save_expected(out, prefix, layer, expected, manifest):
    for field, values in expected.items():
        name = f"{prefix}.{layer}.{field}"
        values.astype("<f4").tofile(out / f"{name}.f32")
        manifest[name] = list(values.shape)


def write_gguf_model(path, cfg, layer_tensors, legacy, split_max_tensors=0):
    writer = gguf.GGUFWriter(path, ARCH[cfg["model_type"]], split_max_tensors=split_max_tensors)
    write_metadata(writer, cfg, legacy)
    writer.add_tensor("output_norm.weight", np.ones(cfg["hidden_size"], np.float32))
    for index, tensors in enumerate(layer_tensors):
        for name, data, raw in tensors:
            writer.add_tensor(f"blk.{index}.{name}", data, raw_dtype=raw)
    finish(writer)


def write_tiny(name, cfg, out, manifest):
    rng = np.random.default_rng(sum(map(ord, name)))
    legacy = name.endswith("legacy")
    blocks = cfg["num_hidden_layers"] + cfg.get("num_nextn_predict_layers", 0)
    layers = [Layer(cfg, rng) for _ in range(blocks)]
    model = out / "tiny" / name
    (model / "split").mkdir(parents=True)
    (model / "hf").mkdir()
    (model / "expected").mkdir()

    layer_tensors, gguf_expected = zip(*(layer.gguf_tensors(split_kv_b=not legacy) for layer in layers))
    write_gguf_model(model / "model.gguf", cfg, layer_tensors, legacy)
    tensor_count = 1 + sum(map(len, layer_tensors))
    write_gguf_model(model / "split" / f"{name}.gguf", cfg, layer_tensors, legacy,
                     split_max_tensors=-(-tensor_count // SPLIT_PARTS))

    (model / "hf" / "config.json").write_text(json.dumps(cfg, indent=2))
    shards, weight_map = [{}, {}], {}
    expected_shapes = {}
    for index, (layer, read) in enumerate(zip(layers, gguf_expected)):
        save_expected(model / "expected", "gguf", index, read, expected_shapes)
        tensors, hf_read = layer.hf_tensors()
        save_expected(model / "expected", "hf", index, hf_read, expected_shapes)
        for suffix, data in tensors.items():
            full = f"model.layers.{index}.self_attn.{suffix}"
            shards[index % 2][full] = data
            weight_map[full] = f"model-{index % 2 + 1:05d}-of-00002.safetensors"
    if legacy:  # a single model.safetensors, no index
        save_file(shards[0] | shards[1], model / "hf" / "model.safetensors")
    else:
        for number, shard in enumerate(shards, 1):
            save_file(shard, model / "hf" / f"model-{number:05d}-of-00002.safetensors", metadata={"format": "pt"})
        index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
        (model / "hf" / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    manifest[name] = {"layers": blocks, "expected": expected_shapes,
                      "split": f"tiny/{name}/split/{name}-00001-of-{SPLIT_PARTS:05d}.gguf"}


def write_quants(out, manifest):
    """One tensor per type gguf-py reads, special values included where the type has them."""
    rng = np.random.default_rng(7)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 6.0e-8, -6.0e-8, 1.0e-40, 65504.0, 3.0e38],
                        dtype=np.float32)
    values = np.concatenate([specials, rng.standard_normal(54).astype(np.float32)]).reshape(2, 32)
    writer = gguf.GGUFWriter(out / "quants.gguf", "deepseek2")
    (out / "quants").mkdir()
    shapes = {}

    def add(name, data, raw, read):
        writer.add_tensor(name, data, raw_dtype=raw)
        read.astype("<f4").tofile(out / "quants" / f"{name}.f32")
        shapes[name] = list(read.shape)

    add("f32", values, None, values)
    with np.errstate(over="ignore"):
        half = values.astype(np.float16)  # also f16 subnormals (6e-8), overflow to inf (3e38) and -0
    add("f16", half, None, half.astype(np.float32))
    for name, qtype in (("bf16", Q.BF16), ("q8_0", Q.Q8_0)):
        source = values if qtype == Q.BF16 else rng.standard_normal((4, 64)).astype(np.float32)
        data = gguf.quants.quantize(source, qtype)
        add(name, data, qtype, gguf.quants.dequantize(data, qtype))
    for name, qtype, shape in (("q4_k", Q.Q4_K, (3, 256)), ("q6_k", Q.Q6_K, (2, 512))):
        blocks = random_blocks(rng, qtype, *shape)
        add(name, blocks, qtype, gguf.quants.dequantize(blocks, qtype))
    q4_0 = gguf.quants.quantize(rng.standard_normal((1, 32)).astype(np.float32), Q.Q4_0)
    writer.add_tensor("q4_0", q4_0, raw_dtype=Q.Q4_0)  # a type smla does not read
    finish(writer)
    manifest["quants"] = shapes


# --- Damaged files ---------------------------------------------------------------------------------------------

def base_file(path):
    """A small valid file whose pieces the damaged copies patch: keys of each kind, three tensors, alignment 64."""
    writer = gguf.GGUFWriter(path, "glm-dsa")
    writer.add_custom_alignment(64)
    writer.add_uint32("test.aaaa", 1)
    writer.add_uint32("test.aaab", 2)
    writer.add_bool("test.flag", True)
    writer.add_array("test.array", [1, 2, 3])
    writer.add_array("test.strings", ["a", "bc"])
    writer.add_tensor("tensor.a", np.arange(16, dtype=np.float32))
    writer.add_tensor("tensor.b", np.ones((8, 32), np.float16))
    writer.add_tensor("tensor.c", gguf.quants.quantize(np.ones((2, 32), np.float32), Q.Q8_0), raw_dtype=Q.Q8_0)
    finish(writer)
    return path.read_bytes()


def value_offset(reader, key):
    field = reader.fields[key]
    return field.offset + 8 + len(key) + 4  # key length, key, value type


def tensor_info_offsets(reader, name):
    """Byte offsets of the n_dims, dims, type and offset fields of a tensor info."""
    tensor = next(t for t in reader.tensors if t.name == name)
    n_dims = tensor.field.offset + 8 + len(name)
    dims = n_dims + 4
    kind = dims + 8 * len(tensor.shape)
    return {"n_dims": n_dims, "dims": dims, "type": kind, "offset": kind + 4, "name": tensor.field.offset + 8}


def patched(data, offset, fmt, value):
    data = bytearray(data)
    struct.pack_into(fmt, data, offset, value)
    return bytes(data)


def write_bad(out):
    bad = out / "bad"
    bad.mkdir()
    base_path = bad / "base.gguf"
    base = base_file(base_path)
    reader = gguf.GGUFReader(base_path)
    infos = {name: tensor_info_offsets(reader, name) for name in ("tensor.a", "tensor.b", "tensor.c")}
    first_key = 24  # magic, version, tensor count, metadata count
    info_start = infos["tensor.a"]["name"] - 8
    data_start = reader.data_offset
    files = {
        "base-version-2.gguf": patched(base, 4, "<I", 2),  # valid: version 2 differs from 3 only in byte order
        "empty.gguf": b"",
        "bad-magic.gguf": b"GGML" + base[4:],
        "version-1.gguf": patched(base, 4, "<I", 1),
        "version-4.gguf": patched(base, 4, "<I", 4),
        "big-endian.gguf": patched(base, 4, ">I", 3),
        "truncated-header.gguf": base[:20],
        "truncated-metadata.gguf": base[:value_offset(reader, "test.strings") + 6],
        "truncated-tensor-infos.gguf": base[:info_start + 30],
        "truncated-data.gguf": base[:data_start + 40],
        "absurd-metadata-count.gguf": patched(base, 16, "<Q", 1 << 60),
        "absurd-tensor-count.gguf": patched(base, 8, "<Q", 1 << 62),
        "absurd-string-length.gguf": patched(base, first_key, "<Q", 1 << 62),
        "absurd-array-length.gguf": patched(base, value_offset(reader, "test.array") + 4, "<Q", 1 << 61),
        "unknown-value-type.gguf": patched(base, value_offset(reader, "test.aaaa") - 4, "<I", 13),
        "bad-bool.gguf": patched(base, value_offset(reader, "test.flag"), "<B", 2),
        "duplicate-key.gguf": base.replace(b"test.aaab", b"test.aaaa"),
        "duplicate-tensor.gguf": base.replace(b"tensor.b", b"tensor.a"),
        "bad-alignment.gguf": patched(base, value_offset(reader, "general.alignment"), "<I", 48),
        "overlapping-tensors.gguf": patched(base, infos["tensor.b"]["offset"], "<Q",
                                            reader.tensors[0].data_offset - data_start),
        "tensor-out-of-file.gguf": patched(base, infos["tensor.c"]["offset"], "<Q", 1 << 40),
        "misaligned-tensor.gguf": patched(base, infos["tensor.c"]["offset"], "<Q",
                                          reader.tensors[2].data_offset - data_start + 32),
        "too-many-dims.gguf": patched(base, infos["tensor.b"]["n_dims"], "<I", 9),
        "unknown-tensor-type.gguf": patched(base, infos["tensor.b"]["type"], "<I", 99),
        "partial-block.gguf": patched(base, infos["tensor.c"]["dims"], "<Q", 33),
        "size-overflow.gguf": patched(patched(base, infos["tensor.b"]["dims"], "<Q", 1 << 62),
                                      infos["tensor.b"]["dims"] + 8, "<Q", 8),
        "row-size-overflow.gguf": patched(base, infos["tensor.a"]["dims"], "<Q", 1 << 62),
    }
    for name, data in files.items():
        (bad / name).write_bytes(data)

    # Metadata that parses but does not describe a supported model.
    writer = gguf.GGUFWriter(bad / "wrong-architecture.gguf", "llama")
    writer.add_block_count(2)
    finish(writer)
    writer = gguf.GGUFWriter(bad / "missing-key.gguf", "glm-dsa")
    write_metadata(writer, TINY["glm-dsa"])
    del writer.kv_data[0]["glm-dsa.attention.indexer.top_k"]
    finish(writer)
    writer = gguf.GGUFWriter(bad / "linear-rope.gguf", "deepseek2")
    write_metadata(writer, {k: v for k, v in TINY["deepseek2"].items() if k != "rope_scaling"})
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    finish(writer)


def write_bad_splits(out):
    """Damaged copies of tiny/glm-dsa/split: a part missing, disagreeing split keys, a part of another model."""
    source = out / "tiny" / "glm-dsa" / "split"
    parts = sorted(source.glob("*.gguf"))
    for case in ("missing-part", "split-count", "split-no", "tensors-count", "other-architecture", "renamed"):
        shutil.copytree(source, out / "bad" / case)
    (out / "bad" / "missing-part" / parts[1].name).unlink()
    third = out / "bad" / "split-count" / parts[2].name
    reader = gguf.GGUFReader(third)
    third.write_bytes(patched(third.read_bytes(), value_offset(reader, "split.count"), "<H", 4))
    third = out / "bad" / "split-no" / parts[2].name
    reader = gguf.GGUFReader(third)
    third.write_bytes(patched(third.read_bytes(), value_offset(reader, "split.no"), "<H", 1))
    first = out / "bad" / "tensors-count" / parts[0].name
    reader = gguf.GGUFReader(first)
    first.write_bytes(patched(first.read_bytes(), value_offset(reader, "split.tensors.count"), "<i", 39))
    # Part 2 rewritten with general.architecture "llama" (the Python writer names it in the first part only).
    second = out / "bad" / "other-architecture" / parts[1].name
    reader = gguf.GGUFReader(second)
    rewritten = second.with_suffix(".tmp")
    writer = gguf.GGUFWriter(rewritten, "llama")
    for key in ("split.no", "split.count"):
        writer.add_uint16(key, int(reader.fields[key].parts[-1][0]))
    writer.add_int32("split.tensors.count", int(reader.fields["split.tensors.count"].parts[-1][0]))
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    finish(writer)
    rewritten.replace(second)
    renamed = out / "bad" / "renamed"
    (renamed / parts[0].name).rename(renamed / "glm-dsa.gguf")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--configs", type=Path, default=Path(__file__).resolve().parents[1] / "data" / "configs")
    args = parser.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    (args.out / "specs").mkdir(parents=True)
    manifest = {}
    write_specs(args.configs, args.out / "specs")
    for name, cfg in TINY.items():
        write_tiny(name, cfg, args.out, manifest)
    write_quants(args.out, manifest)
    write_bad(args.out)
    write_bad_splits(args.out)
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1))


if __name__ == "__main__":
    main()
