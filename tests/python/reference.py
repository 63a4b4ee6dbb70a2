"""float64 numpy references of the smla ops (docs/ops.md) and test data helpers."""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

ml_dtypes = None
try:
    import ml_dtypes  # numpy bfloat16 / float8
except ImportError:
    pass

LATENT, ROPE, QK, V = 512, 64, 576, 512
FP8_ROW = 656
INDEX_DIM, INDEX_FP8_ROW = 128, 132
E4M3_MAX = 448.0
# What FlashMLA's tests feed as invalid indices, besides -1 and s_kv.
INVALID_INDICES = (-(2**31), -123456, -1, 2**31 - 1, 2147480000)


def dtype(name: str):
    """numpy dtype for 'float16' / 'bfloat16' / 'float32'."""
    if name == "bfloat16":
        return ml_dtypes.bfloat16
    return np.dtype(name)


def rounded(x: np.ndarray, name: str) -> np.ndarray:
    """x rounded to the named dtype (nearest even), as float64."""
    return np.asarray(x, np.float32).astype(dtype(name)).astype(np.float64)


def e4m3(x: np.ndarray) -> np.ndarray:
    """x as float8_e4m3fn bytes: nearest even, saturating at +-448."""
    y = np.clip(np.asarray(x, np.float32), -E4M3_MAX, E4M3_MAX)
    return y.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def e4m3_values(b: np.ndarray) -> np.ndarray:
    return np.asarray(b, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def ceil_pow2(x: np.ndarray) -> np.ndarray:
    return np.exp2(np.ceil(np.log2(x)))


# --- the MLA cache -------------------------------------------------------------


def quantize_ds_mla(latent: np.ndarray, k_pe: np.ndarray) -> np.ndarray:
    """[N, 512] + [N, 64] -> [N, 656] bytes of fp8_ds_mla (docs/ops.md)."""
    n = latent.shape[0]
    lat = np.asarray(latent, np.float32).reshape(n, 4, 128)
    amax = np.nanmax(np.abs(lat), axis=-1)  # NaN inputs do not count
    scale = ceil_pow2(np.maximum(amax.astype(np.float64) / E4M3_MAX, 1e-4)).astype(np.float32)
    rows = np.empty((n, FP8_ROW), np.uint8)
    rows[:, :LATENT] = e4m3(lat / scale[:, :, None]).reshape(n, LATENT)
    rows[:, LATENT:LATENT + 16] = scale.view(np.uint8).reshape(n, 16)
    rows[:, LATENT + 16:] = np.asarray(k_pe, np.float32).astype(ml_dtypes.bfloat16).view(np.uint8).reshape(n, 128)
    return rows


def dequantize_ds_mla(rows: np.ndarray) -> np.ndarray:
    """[..., 656] fp8_ds_mla bytes -> [..., 576] float64."""
    rows = np.ascontiguousarray(rows)
    lead = rows.shape[:-1]
    r = rows.reshape(-1, FP8_ROW)
    scale = r[:, LATENT:LATENT + 16].copy().view(np.float32).astype(np.float64)
    lat = e4m3_values(r[:, :LATENT]).reshape(-1, 4, 128) * scale[:, :, None]
    rope = r[:, LATENT + 16:].copy().view(ml_dtypes.bfloat16).astype(np.float64)
    return np.concatenate([lat.reshape(-1, LATENT), rope], axis=1).reshape(*lead, QK)


MODEL1_ROW, MODEL1_NOPE, MODEL1_VALUE = 584, 448, 576  # DeepSeek-V4's fp8 cache (fp8_ds_mla_v4), docs/ops.md


def model1_block_bytes(block_size: int) -> int:
    """A block of FlashMLA's fp8 MODEL1 cache: block_size * 584 bytes rounded up to a multiple of 576."""
    return -(-block_size * MODEL1_ROW // 576) * 576


def quantize_model1(rows: np.ndarray, block_size: int) -> np.ndarray:
    """[num_blocks * block_size, 512] -> [num_blocks, model1_block_bytes] bytes as FlashMLA's quantize_k_cache
    (MODEL1) lays them out: per block all tokens' 448 e4m3 + 64 bf16, then all tokens' 7 ue8m0 scales + a pad byte
    (poisoned here: 0xff, a NaN scale, so that a kernel reading it shows up), then the padding (0x7f)."""
    x = np.asarray(rows, np.float32)
    n = x.shape[0]
    num_blocks = n // block_size
    amax = np.abs(x[:, :MODEL1_NOPE]).reshape(n, 7, 64).max(axis=-1).astype(np.float64)
    exponent = np.ceil(np.log2(np.maximum(amax / E4M3_MAX, 1e-4))).astype(np.int64)
    nope = e4m3(x[:, :MODEL1_NOPE].reshape(n, 7, 64) / np.exp2(exponent)[:, :, None]).reshape(n, MODEL1_NOPE)
    rope = x[:, MODEL1_NOPE:].astype(ml_dtypes.bfloat16).view(np.uint8)
    scales = np.full((n, 8), 0xFF, np.uint8)  # the pad byte: a NaN ue8m0 scale, never to be read
    scales[:, :7] = exponent + 127
    out = np.full((num_blocks, model1_block_bytes(block_size)), 0x7F, np.uint8)
    out[:, :block_size * MODEL1_VALUE] = np.concatenate([nope, rope], axis=1).reshape(num_blocks, -1)
    out[:, block_size * MODEL1_VALUE:block_size * MODEL1_ROW] = scales.reshape(num_blocks, -1)
    return out


def model1_view(blocks: np.ndarray, block_size: int) -> np.ndarray:
    """FlashMLA's k_cache view (num_blocks, block_size, 1, 584) of the padded blocks (a view: writes land in them)."""
    return blocks[:, :block_size * MODEL1_ROW].reshape(blocks.shape[0], block_size, 1, MODEL1_ROW)


def dequantize_model1(blocks: np.ndarray, block_size: int) -> np.ndarray:
    """The padded blocks -> [num_blocks * block_size, 512] float64: e4m3 * 2^(e - 127) (e = 255: NaN), bf16 rope."""
    num_blocks = blocks.shape[0]
    values = blocks[:, :block_size * MODEL1_VALUE].reshape(-1, MODEL1_VALUE)
    e = blocks[:, block_size * MODEL1_VALUE:block_size * MODEL1_ROW].reshape(-1, 8)[:, :7].astype(np.float64)
    scale = np.where(e == 255, np.nan, np.exp2(e - 127))
    nope = e4m3_values(values[:, :MODEL1_NOPE]).reshape(-1, 7, 64) * scale[:, :, None]
    rope = np.ascontiguousarray(values[:, MODEL1_NOPE:]).view(ml_dtypes.bfloat16).astype(np.float64)
    return np.concatenate([nope.reshape(-1, MODEL1_NOPE), rope], axis=1).reshape(num_blocks * block_size, LATENT)


def cache_rows(cache: np.ndarray) -> np.ndarray:
    """Every slot of an MLA cache [num_blocks, block_size, 576 | 656] as [num_slots, 576] float64."""
    if cache.dtype == np.uint8:
        return dequantize_ds_mla(cache).reshape(-1, QK)
    return np.asarray(cache, np.float64).reshape(-1, QK)


def make_mla_cache(rng: np.random.Generator, num_blocks: int, block_size: int, kind: str,
                   pad_rows: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    """A cache filled with NaN (so that reading a slot nobody wrote shows up)
    and, when pad_rows > 0, a view of a larger buffer with padded blocks.
    Returns (cache view, the whole buffer)."""
    width = FP8_ROW if kind == "fp8_ds_mla" else QK
    if kind == "fp8_ds_mla":
        buf = np.full((num_blocks, block_size + pad_rows, width), 0x7F, np.uint8)  # e4m3 0x7f is NaN
    else:
        buf = np.full((num_blocks, block_size + pad_rows, width), np.nan, dtype(kind))
    return buf[:, :block_size, :], buf


# --- attention -----------------------------------------------------------------


def attention(q: np.ndarray, rows: np.ndarray, indices: np.ndarray, scale: float,
              topk_length: Optional[np.ndarray] = None,
              attn_sink: Optional[np.ndarray] = None) -> Tuple[np.ndarray, np.ndarray]:
    """Sparse MLA in float64. q [T, H, 576], rows [S, 576], indices [T, K].
    Returns (out [T, H, 512], lse [T, H]; -inf and 0 for a row with nothing valid)."""
    t, h, _ = q.shape
    num_slots = rows.shape[0]
    idx = np.asarray(indices, np.int64)
    valid = (idx >= 0) & (idx < num_slots)
    if topk_length is not None:
        valid &= np.arange(idx.shape[1])[None, :] < np.asarray(topk_length)[:, None]
    out = np.zeros((t, h, V))
    lse = np.full((t, h), -np.inf)
    for i in range(t):
        sel = rows[idx[i][valid[i]]]  # [n, 576]
        if sel.shape[0] == 0:
            continue
        s = scale * (q[i] @ sel.T)  # [H, n]
        m = s.max(axis=1, keepdims=True)
        p = np.exp(s - m)
        total = p.sum(axis=1, keepdims=True)
        lse[i] = (m + np.log(total))[:, 0]
        out[i] = (p / total) @ sel[:, :V]
    if attn_sink is not None:
        sink = np.asarray(attn_sink, np.float64)[None, :]
        with np.errstate(over="ignore", invalid="ignore"):
            factor = 1.0 / (1.0 + np.exp(sink - lse))
        factor = np.where(np.isneginf(lse), 0.0, factor)
        out = out * factor[:, :, None]
    return out, lse


def paged_slots(block_table: np.ndarray, seq_lens: np.ndarray, s_q: int, block_size: int,
                causal: bool) -> np.ndarray:
    """The slots each token of paged decode attends, -1 padded: [B, s_q, max_len]."""
    b = block_table.shape[0]
    max_len = block_table.shape[1] * block_size
    slots = np.full((b, s_q, max_len), -1, np.int64)
    for i in range(b):
        for j in range(s_q):
            n = int(seq_lens[i]) - s_q + j + 1 if causal else int(seq_lens[i])
            p = np.arange(max(n, 0))
            slots[i, j, :len(p)] = block_table[i, p // block_size].astype(np.int64) * block_size + p % block_size
    return slots


# --- the indexer ---------------------------------------------------------------


def index_key_scale(amax: np.ndarray) -> np.ndarray:
    return ceil_pow2(np.maximum(amax, 1e-4) / E4M3_MAX)


def index_cache_keys(cache: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """An index cache -> (keys [num_slots, 128] float64 as stored, scales [num_slots])."""
    nb, bs, width = cache.shape
    if width == INDEX_DIM:
        return np.asarray(cache, np.float64).reshape(-1, INDEX_DIM), np.ones(nb * bs)
    blocks = np.ascontiguousarray(cache).reshape(nb, bs * INDEX_FP8_ROW)
    keys = e4m3_values(blocks[:, :bs * INDEX_DIM]).reshape(nb * bs, INDEX_DIM)
    scales = blocks[:, bs * INDEX_DIM:].copy().view(np.float32).astype(np.float64).reshape(nb * bs)
    return keys, scales


def indexer_scores(q: np.ndarray, weights: np.ndarray, keys: np.ndarray, scales: np.ndarray,
                   slots: np.ndarray, q_scale: Optional[np.ndarray] = None) -> np.ndarray:
    """score[s] = k_scale[s] * sum_h w[h] * q_scale[h] * relu(q[h] . k[s]) for one token."""
    w = np.asarray(weights, np.float64) * (1.0 if q_scale is None else np.asarray(q_scale, np.float64))
    dots = np.maximum(np.asarray(q, np.float64) @ keys[slots].T, 0.0)  # [H, n]
    return scales[slots] * (w @ dots)


def hadamard128() -> np.ndarray:
    """128^-0.5 H_128, the Walsh-Hadamard rotation of GLM-5.3-Flash's indexer."""
    h = np.array([[1.0]])
    while h.shape[0] < INDEX_DIM:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(INDEX_DIM)


def pooled(k: np.ndarray, gate: np.ndarray, ape: np.ndarray, rotate: bool = True) -> np.ndarray:
    """GLM-5.3-Flash's pooled index keys: [P, kpool, 128] keys and gates, [kpool, 128] ape -> [P, 128], float64."""
    score = gate.astype(np.float64) + ape.astype(np.float64)
    w = np.exp(score - score.max(axis=1, keepdims=True))
    x = (w * k.astype(np.float64)).sum(axis=1) / w.sum(axis=1)
    return x @ hadamard128().T if rotate else x
