"""The Triton kernels on the GPU at Qwen2-0.5B's shapes in bf16, against the fp32
reference (relative error), and the decode-path ops captured in one CUDA graph.

Skips without CUDA or Triton. Shapes: hidden 896, 14 query / 2 KV heads, head_dim 64,
intermediate 4864, vocab 151936, block_size 16, 256 decode rows.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("triton")

from tapioca.engines import kernels as K  # noqa: E402
from tapioca.engines.kernels import reference as R  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, BLOCK = 896, 14, 2, 64, 4864, 151936, 16
BF16 = torch.bfloat16


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


@pytest.fixture(autouse=True)
def _auto_backend(monkeypatch):
    monkeypatch.delenv("TAPIOCA_KERNELS", raising=False)  # auto: Triton on CUDA
    torch.manual_seed(0)


def _paged(lengths: list[int], dtype=BF16):
    """Caches with NaN in every slot no row owns; block tables over shuffled blocks."""
    blocks_per_row = [-(-n // BLOCK) for n in lengths]
    num_blocks = sum(blocks_per_row) + 1
    k_cache = torch.full((num_blocks, BLOCK, KV_HEADS, HEAD_DIM), float("nan"), dtype=dtype, device="cuda")
    v_cache = torch.full_like(k_cache, float("nan"))
    table = torch.zeros(len(lengths), max(blocks_per_row + [1]), dtype=torch.int32, device="cuda")
    order = torch.randperm(num_blocks - 1, device="cuda") + 1
    used = 0
    for row, (n, nb) in enumerate(zip(lengths, blocks_per_row)):
        table[row, :nb] = order[used:used + nb].int()
        used += nb
        flat_k = k_cache[table[row, :nb].long()].view(-1, KV_HEADS, HEAD_DIM)
        flat_k[:n] = torch.randn(n, KV_HEADS, HEAD_DIM, device="cuda").to(dtype)
        k_cache[table[row, :nb].long()] = flat_k.view(nb, BLOCK, KV_HEADS, HEAD_DIM)
        flat_v = v_cache[table[row, :nb].long()].view(-1, KV_HEADS, HEAD_DIM)
        flat_v[:n] = torch.randn(n, KV_HEADS, HEAD_DIM, device="cuda").to(dtype)
        v_cache[table[row, :nb].long()] = flat_v.view(nb, BLOCK, KV_HEADS, HEAD_DIM)
    return k_cache, v_cache, table


def _fp32(*caches):
    return [c.float().nan_to_num(0.0) for c in caches]


def test_rms_norm_bf16_matches_reference():
    x = torch.randn(256, HIDDEN, device="cuda").to(BF16)
    res = torch.randn(256, HIDDEN, device="cuda").to(BF16)
    w = (1 + 0.1 * torch.randn(HIDDEN, device="cuda")).to(BF16)
    out, r = K.rms_norm(x, w, 1e-6, res)
    ref_out, ref_r = R.rms_norm(x, w, 1e-6, res)
    assert torch.equal(r, ref_r)
    # Same rounding steps as HF: only the fp32 reduction order differs (a last-bit flip).
    assert (out.float() - ref_out.float()).abs().max().item() <= 2 ** -6 * ref_out.float().abs().max().item()
    assert rel_err(out, R.rms_norm(x.float(), w.float(), 1e-6, res.float())[0]) < 1e-2


def test_rope_and_store_kv_bf16_equals_reference_bitwise():
    tokens = 256
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device="cuda").to(BF16)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, HEAD_DIM, 2, device="cuda").float() / HEAD_DIM))
    angles = torch.arange(4096, device="cuda").float()[:, None] * inv_freq[None, :]
    table = torch.cat([angles.cos(), angles.sin()], dim=-1)
    positions = torch.randint(0, 4096, (tokens,), device="cuda")
    slots = torch.randperm(64 * BLOCK, device="cuda")[:tokens]
    slots[::17] = -1
    outs = []
    for impl in (K, R):
        qkv_i = qkv.clone()
        q, k, v = (t.view(tokens, -1, HEAD_DIM) for t in qkv_i.split(
            [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1))
        k_cache = torch.full((64, BLOCK, KV_HEADS, HEAD_DIM), float("nan"), dtype=BF16, device="cuda")
        v_cache = torch.full_like(k_cache, float("nan"))
        impl.rope_and_store_kv(q, k, v, positions, table, k_cache, v_cache, slots)
        outs.append((qkv_i, k_cache, v_cache))
    for a, b in zip(*outs):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


@pytest.mark.parametrize("rows,max_context", [(256, 384), (256, 2048), (8, 2048)])
def test_paged_decode_attention_bf16_matches_fp32_reference(rows, max_context):
    lengths = torch.randint(1, max_context + 1, (rows,)).tolist()
    lengths[0], lengths[-1] = 0, max_context  # a graph padding row and a full one
    k_cache, v_cache, table = _paged(lengths)
    ctx = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    q = torch.randn(rows, HEADS, HEAD_DIM, device="cuda").to(BF16)
    out = K.paged_decode_attention(q, k_cache, v_cache, table, ctx, HEAD_DIM ** -0.5)
    ref = R.paged_decode_attention(q.float(), *_fp32(k_cache, v_cache), table, ctx, HEAD_DIM ** -0.5)
    assert out.dtype == BF16 and not out.isnan().any()
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert rel_err(out, ref) < 1e-2


def test_paged_prefill_attention_bf16_matches_fp32_reference():
    q_lens = [128, 1, 300, 77, 16]
    lengths = [128, 40, 700, 77, 16 + 512]  # cached prefixes on seq 1, 2, 4
    k_cache, v_cache, table = _paged(lengths)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    ctx = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    q = torch.randn(sum(q_lens), HEADS, HEAD_DIM, device="cuda").to(BF16)
    out = K.paged_prefill_attention(q, k_cache, v_cache, table, cu, ctx, HEAD_DIM ** -0.5, max(q_lens))
    ref = R.paged_prefill_attention(q.float(), *_fp32(k_cache, v_cache), table, cu, ctx, HEAD_DIM ** -0.5,
                                    max(q_lens))
    assert not out.isnan().any()
    assert rel_err(out, ref) < 1e-2


def test_silu_and_mul_bf16_matches_reference():
    x = torch.randn(256, 2 * INTER, device="cuda").to(BF16)
    out = K.silu_and_mul(x)
    assert rel_err(out, R.silu_and_mul(x)) < 4e-3  # same rounding steps, exp differs by ulps
    assert rel_err(out, R.silu_and_mul(x.float())) < 1e-2


def test_sample_tokens_full_vocab_greedy_exact_and_logprobs():
    logits = (torch.randn(256, VOCAB, device="cuda") * 4).to(BF16)
    temps = torch.where(torch.arange(256, device="cuda") % 4 == 0, 0.0, 0.8)
    tokens, logprobs = K.sample_tokens(logits, temps, torch.tensor([3], dtype=torch.int64, device="cuda"))
    greedy = temps == 0
    assert torch.equal(tokens[greedy], logits[greedy].float().argmax(-1))
    t = torch.where(greedy, 1.0, temps)
    expected = torch.log_softmax(logits.float() / t[:, None], -1).gather(1, tokens[:, None])[:, 0]
    assert (logprobs - expected).abs().max().item() < 1e-4  # 150k-term fp32 sums, two orders


def test_decode_ops_capture_in_one_cuda_graph():
    """rms_norm, rope + cache write, decode attention, silu_and_mul and sampling with an
    in-graph seed advance: captured once, replayed on new inputs, equal to eager calls."""
    rows, live = 16, 12  # rows 12..15 are graph padding: context 0, slot -1
    lengths = [int(n) for n in torch.randint(1, 300, (live,))]
    k_cache, v_cache, table = _paged(lengths + [0] * (rows - live))
    k_cache, v_cache = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)
    ctx = torch.tensor(lengths + [0] * (rows - live), dtype=torch.int32, device="cuda")
    slots = torch.full((rows,), -1, dtype=torch.int64, device="cuda")
    for row, n in enumerate(lengths):  # the last token of each row is written this step
        slots[row] = table[row, (n - 1) // BLOCK].long() * BLOCK + (n - 1) % BLOCK
    positions = (ctx - 1).clamp_min(0).long()
    angles = torch.arange(4096, device="cuda").float()[:, None] * torch.rand(HEAD_DIM // 2, device="cuda")
    cos_sin = torch.cat([angles.cos(), angles.sin()], -1)
    w = torch.randn(HIDDEN, device="cuda").to(BF16)
    x = torch.randn(rows, HIDDEN, device="cuda").to(BF16)
    res = torch.randn(rows, HIDDEN, device="cuda").to(BF16)
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device="cuda").to(BF16)
    gate_up = torch.randn(rows, 2 * INTER, device="cuda").to(BF16)
    logits = torch.randn(rows, VOCAB, device="cuda").to(BF16)
    temps = torch.full((rows,), 1.0, device="cuda")
    seed = torch.tensor([11], dtype=torch.int64, device="cuda")

    def step():
        h, r = K.rms_norm(x, w, 1e-6, res)
        q, k, v = (t.view(rows, -1, HEAD_DIM) for t in qkv.split(
            [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1))
        K.rope_and_store_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slots)
        attn = K.paged_decode_attention(q, k_cache, v_cache, table, ctx, HEAD_DIM ** -0.5)
        act = K.silu_and_mul(gate_up)
        tokens, logprobs = K.sample_tokens(logits, temps, seed)
        seed.add_(1)
        return h, r, attn, act, tokens, logprobs

    qkv0, k0, v0 = qkv.clone(), k_cache.clone(), v_cache.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up: compile every kernel outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    qkv.copy_(qkv0), k_cache.copy_(k0), v_cache.copy_(v0)
    with torch.cuda.graph(graph):
        static_out = step()
    for _ in range(2):
        x.copy_(torch.randn_like(x)), logits.copy_(torch.randn_like(logits))
        qkv.copy_(qkv0), k_cache.copy_(k0), v_cache.copy_(v0)
        seed_before = seed.clone()
        graph.replay()
        graph_out = [t.clone() for t in static_out]
        graph_k = k_cache.clone()
        qkv.copy_(qkv0), k_cache.copy_(k0), v_cache.copy_(v0), seed.copy_(seed_before)
        eager_out = step()
        assert seed.item() == seed_before.item() + 1
        for a, b in zip(graph_out, eager_out):
            assert torch.equal(a, b)
        assert torch.equal(graph_k, k_cache)
        assert torch.equal(graph_out[2][live:], torch.zeros_like(graph_out[2][live:]))
