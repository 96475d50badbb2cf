"""The plain-PyTorch references of the paged engine's ops (engines/kernels/reference.py)
against independent naive computations (fp64 loops) and against Hugging Face's own Qwen2
modules where HF is the contract (RMSNorm, rotary, eager attention)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Qwen2Config
from transformers.models.qwen2 import modeling_qwen2 as hf

from tapioca.engines.kernels import reference as R

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 16, 4


def _cos_sin_table(max_positions: int, head_dim: int = HEAD_DIM, theta: float = 10000.0) -> torch.Tensor:
    """The table the engine builds: HF's own rotary module at every position (fp32)."""
    config = Qwen2Config(hidden_size=head_dim * HEADS, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, rope_theta=theta)
    rotary = hf.Qwen2RotaryEmbedding(config)
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), torch.arange(max_positions)[None])
    half = head_dim // 2
    return torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=-1).contiguous()


def _paged_cache(lengths: list[int], num_blocks: int = 40, seed: int = 0, dtype=torch.float32):
    """Random K/V caches and a block table that scatters each row over shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    max_blocks = max(1, max(-(-n // BLOCK) for n in lengths))
    order = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.zeros(len(lengths), max_blocks, dtype=torch.int32)
    for row, n in enumerate(lengths):
        for j in range(-(-n // BLOCK)):
            table[row, j] = order.pop()
    return k_cache, v_cache, table


def _row_kv(cache: torch.Tensor, table_row: torch.Tensor, n: int) -> torch.Tensor:
    """``[n, K, D]`` of one row, token by token (the naive gather)."""
    return torch.stack([cache[int(table_row[t // BLOCK]), t % BLOCK] for t in range(n)]) if n else \
        cache.new_zeros(0, KV_HEADS, HEAD_DIM)


def _naive_attention(q_HD: torch.Tensor, k_LKD: torch.Tensor, v_LKD: torch.Tensor, scale: float) -> torch.Tensor:
    """fp64 softmax attention of one query over L keys, head h using KV head h // group."""
    group = q_HD.shape[0] // k_LKD.shape[1]
    out = torch.zeros(q_HD.shape, dtype=torch.float64)
    for h in range(q_HD.shape[0]):
        if k_LKD.shape[0] == 0:
            continue
        scores = [float(q_HD[h].double() @ k_LKD[j, h // group].double()) * scale for j in range(k_LKD.shape[0])]
        top = max(scores)
        weights = [math.exp(s - top) for s in scores]
        total = sum(weights)
        for j, w in enumerate(weights):
            out[h] += w / total * v_LKD[j, h // group].double()
    return out


# -- rms_norm ------------------------------------------------------------------------------

def test_rms_norm_matches_naive_fp64_with_and_without_residual():
    x = torch.randn(3, 5, 32)
    res = torch.randn(3, 5, 32)
    w = torch.randn(32)
    for residual in (None, res):
        out, r = R.rms_norm(x, w, 1e-5, residual)
        total = x.double() + (0 if residual is None else residual.double())
        rms = (total.pow(2).sum(-1, keepdim=True) / 32 + 1e-5).sqrt()
        assert out.shape == x.shape and out.dtype == x.dtype
        torch.testing.assert_close(out.double(), total / rms * w.double(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r.double(), total, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_hf_qwen2_rmsnorm_bitwise(dtype):
    norm = hf.Qwen2RMSNorm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
    x = torch.randn(7, 64).to(dtype)
    res = torch.randn(7, 64).to(dtype)
    with torch.no_grad():
        expected = norm(res + x)  # HF decoder layer: residual + hidden_states, then the norm
    out, r = R.rms_norm(x, norm.weight.detach(), 1e-6, res)
    assert torch.equal(r, res + x)
    assert torch.equal(out, expected)


# -- rope + cache write --------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_equals_hf_apply_rotary_pos_emb_bitwise(dtype):
    tokens = 9
    positions = torch.tensor([0, 1, 2, 3, 7, 31, 100, 5, 63])
    table = _cos_sin_table(128)
    config = Qwen2Config(hidden_size=HEAD_DIM * HEADS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS)
    cos, sin = hf.Qwen2RotaryEmbedding(config)(torch.zeros(1, dtype=dtype), positions[None])
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM).to(dtype)
    q = qkv[:, :HEADS * HEAD_DIM].view(tokens, HEADS, HEAD_DIM)  # strided views, as the engine passes
    k = qkv[:, HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM].view(tokens, KV_HEADS, HEAD_DIM)
    v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:].view(tokens, KV_HEADS, HEAD_DIM)
    q_hf, k_hf = hf.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    k_cache = torch.zeros(8, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    v_before = v.clone()
    R.rope_and_store_kv(q, k, v, positions, table, k_cache, v_cache, torch.arange(tokens))
    assert torch.equal(q, q_hf[0].transpose(0, 1))
    assert torch.equal(k, k_hf[0].transpose(0, 1))
    assert torch.equal(v, v_before)


def test_rope_matches_naive_rotation_fp64():
    positions = torch.tensor([0, 3, 17])
    table = _cos_sin_table(32)
    q = torch.randn(3, HEADS, HEAD_DIM)
    k = torch.randn(3, KV_HEADS, HEAD_DIM)
    q0, k0 = q.clone().double(), k.clone().double()
    cache = torch.zeros(4, BLOCK, KV_HEADS, HEAD_DIM)
    R.rope_and_store_kv(q, k, torch.randn(3, KV_HEADS, HEAD_DIM), positions, table, cache,
                        torch.zeros_like(cache), torch.tensor([-1, -1, -1]))
    half = HEAD_DIM // 2
    for t, p in enumerate(positions.tolist()):
        for i in range(half):
            angle = p / 10000.0 ** (2 * i / HEAD_DIM)
            c, s = math.cos(angle), math.sin(angle)
            for x0, x in ((q0, q), (k0, k)):
                a, b = x0[t, :, i], x0[t, :, i + half]
                torch.testing.assert_close(x[t, :, i].double(), a * c - b * s, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(x[t, :, i + half].double(), b * c + a * s, rtol=1e-5, atol=1e-5)
    assert torch.equal(cache, torch.zeros_like(cache))  # slot -1: nothing written


def test_store_kv_writes_slots_and_skips_minus_one():
    k_cache = torch.full((3, BLOCK, KV_HEADS, HEAD_DIM), 7.0)
    v_cache = torch.full_like(k_cache, 7.0)
    k = torch.randn(4, KV_HEADS, HEAD_DIM)
    v = torch.randn(4, KV_HEADS, HEAD_DIM)
    slots = torch.tensor([-1, 5, -1, 11])  # block 1 offset 1, block 2 offset 3
    R.store_kv(k, v, k_cache, v_cache, slots)
    expected_k = torch.full_like(k_cache, 7.0)
    expected_v = torch.full_like(v_cache, 7.0)
    expected_k[1, 1], expected_k[2, 3] = k[1], k[3]
    expected_v[1, 1], expected_v[2, 3] = v[1], v[3]
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    R.store_kv(k, v, k_cache, v_cache, torch.full((4,), -1))  # no valid row: nothing changes
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


# -- decode attention ----------------------------------------------------------------------

def test_paged_decode_attention_matches_naive_fp64_and_padding_rows_are_zero():
    lengths = [1, 5, 13, 0, 16]
    k_cache, v_cache, table = _paged_cache(lengths)
    q = torch.randn(len(lengths), HEADS, HEAD_DIM)
    scale = HEAD_DIM ** -0.5
    out = R.paged_decode_attention(q, k_cache, v_cache, table, torch.tensor(lengths, dtype=torch.int32), scale)
    for row, n in enumerate(lengths):
        expected = _naive_attention(q[row], _row_kv(k_cache, table[row], n), _row_kv(v_cache, table[row], n), scale)
        torch.testing.assert_close(out[row].double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[3], torch.zeros_like(out[3]))


def test_paged_decode_attention_equals_hf_eager_attention_on_contiguous_kv():
    lengths = [9, 12]
    k_cache, v_cache, table = _paged_cache(lengths, seed=3)
    q = torch.randn(2, HEADS, HEAD_DIM)
    out = R.paged_decode_attention(q, k_cache, v_cache, table, torch.tensor(lengths, dtype=torch.int32), 0.3)
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = HEADS // KV_HEADS, False
    for row, n in enumerate(lengths):
        k = _row_kv(k_cache, table[row], n).transpose(0, 1)[None]  # [1, K, n, D]
        v = _row_kv(v_cache, table[row], n).transpose(0, 1)[None]
        hf_out, _ = hf.eager_attention_forward(module, q[row][None, :, None], k, v, None, scaling=0.3)
        torch.testing.assert_close(out[row], hf_out[0, 0], rtol=1e-5, atol=1e-5)


# -- prefill attention ---------------------------------------------------------------------

def test_paged_prefill_attention_matches_naive_with_cached_prefix():
    q_lens, lengths = [3, 1, 6, 0], [3, 9, 14, 4]  # seq 1 and 2 have a cached prefix
    k_cache, v_cache, table = _paged_cache(lengths, seed=1)
    cu = torch.tensor([0, 3, 4, 10, 10], dtype=torch.int32)
    q = torch.randn(10, HEADS, HEAD_DIM)
    out = R.paged_prefill_attention(q, k_cache, v_cache, table, cu, torch.tensor(lengths, dtype=torch.int32),
                                    0.25, max(q_lens))
    for s, (q_len, n) in enumerate(zip(q_lens, lengths)):
        k_all, v_all = _row_kv(k_cache, table[s], n), _row_kv(v_cache, table[s], n)
        for i in range(q_len):
            pos = n - q_len + i
            expected = _naive_attention(q[int(cu[s]) + i], k_all[:pos + 1], v_all[:pos + 1], 0.25)
            torch.testing.assert_close(out[int(cu[s]) + i].double(), expected, rtol=1e-5, atol=1e-5)


def test_paged_prefill_attention_equals_hf_eager_causal_attention():
    n = 11
    k_cache, v_cache, table = _paged_cache([n], seed=2)
    q = torch.randn(n, HEADS, HEAD_DIM)
    cu = torch.tensor([0, n], dtype=torch.int32)
    out = R.paged_prefill_attention(q, k_cache, v_cache, table, cu, torch.tensor([n], dtype=torch.int32), 0.25, n)
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = HEADS // KV_HEADS, False
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    k = _row_kv(k_cache, table[0], n).transpose(0, 1)[None]
    v = _row_kv(v_cache, table[0], n).transpose(0, 1)[None]
    hf_out, _ = hf.eager_attention_forward(module, q.transpose(0, 1)[None], k, v, mask, scaling=0.25)
    torch.testing.assert_close(out, hf_out[0], rtol=1e-5, atol=1e-5)


# -- silu_and_mul --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_naive_and_hf_mlp_order(dtype):
    x = torch.randn(4, 2 * 24).to(dtype)
    out = R.silu_and_mul(x)
    gate, up = x[:, :24].double(), x[:, 24:].double()
    torch.testing.assert_close(out.double(), gate / (1 + torch.exp(-gate)) * up,
                               rtol=1e-5 if dtype == torch.float32 else 2e-2, atol=1e-5)
    act = hf.ACT2FN["silu"]
    assert torch.equal(out, act(x[:, :24]) * x[:, 24:])  # Qwen2MLP: act_fn(gate) * up


# -- sampling ------------------------------------------------------------------------------

def test_gumbel_noise_is_reproducible_per_seed_offset_and_gumbel_distributed():
    seed = torch.tensor([1234], dtype=torch.int64)
    g = R.gumbel_noise(seed, 0, 8, 5000)
    assert torch.equal(g, R.gumbel_noise(seed.clone(), 0, 8, 5000))
    assert not torch.equal(g, R.gumbel_noise(seed + 1, 0, 8, 5000))
    assert not torch.equal(g, R.gumbel_noise(seed, 1, 8, 5000))
    assert not torch.equal(g[0], g[1])
    assert torch.isfinite(g).all()
    # Gumbel(0, 1): mean = Euler-Mascheroni 0.5772, variance = pi^2 / 6 = 1.645 (40k draws:
    # standard errors 0.0064 and ~0.02).
    assert abs(g.mean().item() - 0.5772) < 0.04
    assert abs(g.var().item() - math.pi ** 2 / 6) < 0.1
    # P(g <= 0) = exp(-1) = 0.3679
    assert abs((g <= 0).float().mean().item() - math.exp(-1)) < 0.01


def test_sample_tokens_greedy_rows_and_logprobs_exact():
    logits = torch.randn(5, 300) * 3
    logits[2, 17] = logits[2, 40] = logits[2].max() + 1  # a tie: the first index wins
    temps = torch.tensor([0.0, 0.7, 0.0, 1.0, 1.5])
    tokens, logprobs = R.sample_tokens(logits, temps, torch.tensor([9], dtype=torch.int64))
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert tokens[0] == logits[0].argmax() and tokens[2] == 17
    for row in range(5):
        t = temps[row].item() or 1.0
        expected = torch.log_softmax(logits[row].double() / t, -1)[tokens[row]]
        assert abs(logprobs[row].item() - expected.item()) < 1e-5


def chi_square_bound(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """Pearson's statistic of ``counts`` against ``probs`` and a bound it exceeds with
    probability < ~1e-6 under the null (mean k - 1, sd sqrt(2 (k - 1)): mean + 7 sd)."""
    n = counts.sum().item()
    expected = probs.double() * n
    stat = ((counts.double() - expected) ** 2 / expected).sum().item()
    dof = probs.numel() - 1
    return stat, dof + 7 * math.sqrt(2 * dof)


def test_sample_tokens_frequencies_match_softmax():
    vocab, rows = 12, 4000
    base = torch.linspace(-2.0, 1.5, vocab)
    logits = base.expand(rows, vocab).contiguous()
    for temp in (1.0, 0.6):
        tokens, _ = R.sample_tokens(logits, torch.full((rows,), temp), torch.tensor([77], dtype=torch.int64))
        counts = torch.bincount(tokens, minlength=vocab)
        stat, bound = chi_square_bound(counts, torch.softmax(base / temp, -1))
        assert stat < bound, (temp, stat, bound)
