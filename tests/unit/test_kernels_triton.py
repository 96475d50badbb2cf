"""Every Triton kernel of engines/kernels/ against its plain-PyTorch reference, fp32.

On a machine without CUDA the kernels run under Triton's interpreter
(``TRITON_INTERPRET=1``, CPU tensors, small shapes); with CUDA they run compiled on the
GPU (same shapes). Outputs and caches are poisoned with NaN before each run, inputs are
fresh random draws, and padding rows (context 0, slot -1) are checked. Skips when Triton
is not installed.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # tests/conftest.py sets it first; read at decoration

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

if not CUDA and not isinstance(tl.sum, InterpretedFunction):
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set (tests/conftest.py sets it): "
                "its library functions are compiled-only", allow_module_level=True)

from tapioca.engines import kernels as K  # noqa: E402
from tapioca.engines.kernels import reference as R  # noqa: E402
from tapioca.engines.kernels import (  # noqa: E402
    triton_attention,
    triton_moe,
    triton_norm_act,
    triton_rope,
    triton_sampling,
)
from tapioca.schemas.errors import ConfigError  # noqa: E402

DEV = torch.device("cuda" if CUDA else "cpu")
BLOCK, HEAD_DIM = 4, 16


@pytest.fixture(autouse=True)
def _interpreter_numpy24_fix(monkeypatch):
    """Triton 3.6's interpreter converts 1-element arrays with ``int()``, which numpy 2.4
    refuses (triton-lang/triton#9171): every ``range`` with a runtime bound fails. Index
    the element instead, for this test only."""
    if CUDA:
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patched)


def chi_square_bound(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """Pearson's statistic and a bound it exceeds with probability < ~1e-6 under the null
    (as in test_kernels_reference.py: mean k - 1 plus 7 sd sqrt(2 (k - 1)))."""
    expected = probs.double() * counts.sum().item()
    stat = ((counts.double() - expected) ** 2 / expected).sum().item()
    dof = probs.numel() - 1
    return stat, dof + 7 * math.sqrt(2 * dof)


def _nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


def _paged(lengths: list[int], kv_heads: int, num_blocks: int = 24):
    """NaN-poisoned caches holding random K/V only at each row's live positions, and a
    block table over shuffled blocks (padding entries 0): a kernel that reads past a
    row's context, or a block it does not own, returns NaN."""
    k_cache = torch.full((num_blocks, BLOCK, kv_heads, HEAD_DIM), float("nan"), device=DEV)
    v_cache = torch.full_like(k_cache, float("nan"))
    max_blocks = max(1, max(-(-n // BLOCK) for n in lengths))
    order = torch.randperm(num_blocks).tolist()
    table = torch.zeros(len(lengths), max_blocks, dtype=torch.int32)
    for row, n in enumerate(lengths):
        for j in range(-(-n // BLOCK)):
            block = order.pop()
            table[row, j] = block
            live = min(BLOCK, n - j * BLOCK)
            k_cache[block, :live] = torch.randn(live, kv_heads, HEAD_DIM, device=DEV)
            v_cache[block, :live] = torch.randn(live, kv_heads, HEAD_DIM, device=DEV)
    return k_cache, v_cache, table.to(DEV)


def _reference_caches(k_cache, v_cache):
    """The reference gathers whole blocks; give it zeros where the kernels see poison."""
    return k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)


# -- dispatcher ----------------------------------------------------------------------------

def test_dispatcher_routes_by_env_and_device(monkeypatch):
    x = torch.randn(2, 8)
    monkeypatch.setenv("TAPIOCA_KERNELS", "reference")
    assert K.backend("norm_act", x.to(DEV)) is R
    monkeypatch.setenv("TAPIOCA_KERNELS", "triton")
    assert K.backend("norm_act", x) is triton_norm_act
    monkeypatch.delenv("TAPIOCA_KERNELS")
    assert K.backend("sampling", x) is R  # auto: CPU tensors take the reference
    if CUDA:
        assert K.backend("sampling", x.cuda()) is triton_sampling
    monkeypatch.setenv("TAPIOCA_KERNELS", "cuda")
    with pytest.raises(ConfigError, match="reference"):
        K.rms_norm(x, torch.ones(8), 1e-6)


def test_dispatcher_forced_triton_runs_the_kernel(monkeypatch):
    monkeypatch.setenv("TAPIOCA_KERNELS", "triton")
    x = torch.randn(3, 40, device=DEV)
    out = K.silu_and_mul(x)
    torch.testing.assert_close(out, R.silu_and_mul(x), rtol=1e-5, atol=1e-6)


# -- rms_norm / silu_and_mul ---------------------------------------------------------------

@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_triton_matches_reference(with_residual):
    x = torch.randn(2, 3, 96, device=DEV)  # leading shape flattened; D not a power of two
    res = torch.randn(2, 3, 96, device=DEV) if with_residual else None
    w = torch.randn(96, device=DEV)
    out, r = triton_norm_act.rms_norm(x, w, 1e-6, res)
    ref_out, ref_r = R.rms_norm(x, w, 1e-6, res)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r, ref_r, rtol=0, atol=0)
    assert out.shape == x.shape


def test_rms_norm_triton_on_per_head_view():
    """Qwen3-style q_norm: ``[T * H, head_dim]`` rows of a strided view."""
    qkv = torch.randn(5, 3 * 4 * 16, device=DEV)
    q_rows = qkv[:, :64].reshape(5, 4, 16).reshape(20, 16)  # a copy: the view is not flat
    w = torch.randn(16, device=DEV)
    out, _ = triton_norm_act.rms_norm(qkv[:, :64].view(5, 4, 16), w, 1e-6)
    torch.testing.assert_close(out.reshape(20, 16), R.rms_norm(q_rows, w, 1e-6)[0], rtol=1e-5, atol=1e-5)


def test_silu_and_mul_triton_matches_reference():
    x = torch.randn(7, 2 * 50, device=DEV) * 4
    out = triton_norm_act.silu_and_mul(x, block=16)  # several column blocks, a ragged tail
    torch.testing.assert_close(out, R.silu_and_mul(x), rtol=1e-5, atol=1e-6)


# -- rope + cache write --------------------------------------------------------------------

def test_rope_and_store_kv_triton_matches_reference_and_skips_padding_slots():
    heads, kv_heads, tokens = 6, 2, 5
    table = torch.randn(64, HEAD_DIM, device=DEV)
    positions = torch.tensor([0, 9, 3, 63, 1], device=DEV)
    slots = torch.tensor([5, -1, 0, 18, -1], device=DEV)  # padding rows write nothing
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * HEAD_DIM, device=DEV)
    split = (heads * HEAD_DIM, kv_heads * HEAD_DIM, kv_heads * HEAD_DIM)
    results = []
    for impl in (triton_rope, R):
        qkv_i = qkv.clone()
        q, k, v = (t.view(tokens, -1, HEAD_DIM) for t in qkv_i.split(split, dim=-1))
        k_cache = torch.full((5, BLOCK, kv_heads, HEAD_DIM), float("nan"), device=DEV)
        v_cache = _nan_like(k_cache)
        impl.rope_and_store_kv(q, k, v, positions, table, k_cache, v_cache, slots)
        results.append((qkv_i, k_cache, v_cache))
    (qkv_t, k_t, v_t), (qkv_r, k_r, v_r) = results
    torch.testing.assert_close(qkv_t, qkv_r, rtol=1e-5, atol=1e-5)  # q, k rotated in place; v kept
    torch.testing.assert_close(k_t, k_r, rtol=1e-5, atol=1e-5, equal_nan=True)
    torch.testing.assert_close(v_t, v_r, rtol=0, atol=0, equal_nan=True)
    written = torch.zeros(5 * BLOCK, dtype=torch.bool)
    written[[5, 0, 18]] = True
    assert not k_t.view(-1, kv_heads, HEAD_DIM)[written.to(DEV)].isnan().any()
    assert k_t.view(-1, kv_heads, HEAD_DIM)[(~written).to(DEV)].isnan().all()


# -- decode attention ----------------------------------------------------------------------

@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (14, 2)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_decode_attention_triton_matches_reference(heads, kv_heads, num_splits):
    lengths = [1, 0, 9, 16, 37, 4]  # a padding row, a block boundary, a ragged tail
    k_cache, v_cache, table = _paged(lengths, kv_heads)
    ctx = torch.tensor(lengths, dtype=torch.int32, device=DEV)
    qkv = torch.randn(len(lengths), (heads + 2 * kv_heads) * HEAD_DIM, device=DEV)
    q = qkv[:, :heads * HEAD_DIM].view(len(lengths), heads, HEAD_DIM)  # a strided view, as the engine has
    out = triton_attention.paged_decode_attention(q, k_cache, v_cache, table, ctx, 0.3,
                                                  num_splits=num_splits, block_n=16)
    assert out.is_contiguous()
    ref = R.paged_decode_attention(q, *_reference_caches(k_cache, v_cache), table, ctx, 0.3)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # context 0: zeros, not NaN


def test_paged_decode_attention_default_splits_through_dispatcher(monkeypatch):
    monkeypatch.setenv("TAPIOCA_KERNELS", "triton")
    lengths = [300, 3]  # past 256 tokens: the interpreter's default takes 2 splits
    k_cache, v_cache, table = _paged(lengths, 2, num_blocks=80)
    assert triton_attention.decode_splits(2, 2, table.shape[1] * BLOCK, torch.device(DEV), 64) >= 2 or CUDA
    ctx = torch.tensor(lengths, dtype=torch.int32, device=DEV)
    q = torch.randn(2, 6, HEAD_DIM, device=DEV)
    out = K.paged_decode_attention(q, k_cache, v_cache, table, ctx, 0.25)
    ref = R.paged_decode_attention(q, *_reference_caches(k_cache, v_cache), table, ctx, 0.25)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


# -- prefill attention ---------------------------------------------------------------------

@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (14, 2)])
def test_paged_prefill_attention_triton_matches_reference_with_cached_prefix(heads, kv_heads):
    q_lens = [5, 1, 0, 12, 3]
    lengths = [5, 10, 7, 30, 3]  # seq 1 and 3 have a cached prefix, seq 2 prefills nothing
    k_cache, v_cache, table = _paged(lengths, kv_heads)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    ctx = torch.tensor(lengths, dtype=torch.int32, device=DEV)
    qkv = torch.randn(sum(q_lens), (heads + 2 * kv_heads) * HEAD_DIM, device=DEV)
    q = qkv[:, :heads * HEAD_DIM].view(sum(q_lens), heads, HEAD_DIM)
    # Small tiles: several query tiles per sequence, both the unmasked and the causal loop.
    out = triton_attention.paged_prefill_attention(q, k_cache, v_cache, table, cu, ctx, 0.25,
                                                   max(q_lens), block_m=16, block_n=16)
    ref = R.paged_prefill_attention(q, *_reference_caches(k_cache, v_cache), table, cu, ctx, 0.25, max(q_lens))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


# -- sampling ------------------------------------------------------------------------------

def test_sample_tokens_triton_greedy_exact_and_logprobs_given_token_exact():
    rows, vocab = 6, 300
    logits = torch.randn(rows, vocab, device=DEV) * 3
    logits[2, 17] = logits[2, 250] = logits[2].max() + 1  # a tie across tiles: the first wins
    temps = torch.tensor([0.0, 0.7, 0.0, 1.0, 1.5, 0.0], device=DEV)
    seed = torch.tensor([2024], dtype=torch.int64, device=DEV)
    tokens, logprobs = triton_sampling.sample_tokens(logits, temps, seed, 0, block_v=64)
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32
    greedy = temps == 0
    assert torch.equal(tokens[greedy], logits[greedy].argmax(-1))
    assert tokens[2] == 17
    t = torch.where(greedy, torch.ones_like(temps), temps)
    expected = torch.log_softmax(logits / t[:, None], -1).gather(1, tokens[:, None])[:, 0]
    assert (logprobs - expected).abs().max().item() < 1e-5
    again, _ = triton_sampling.sample_tokens(logits, temps, seed.clone(), 0, block_v=64)
    assert torch.equal(tokens, again)  # counter-based: same seed, same draw


def test_sample_tokens_triton_frequencies_match_softmax():
    # One program per sample, ~13 ms each in the interpreter: a small count there (a check
    # of the row / counter plumbing; the noise's distribution is tested on 4,096 draws below).
    vocab, rows = 6, 4000 if CUDA else 120
    base = torch.tensor([-1.0, 0.0, 0.4, 1.0, 1.5, -3.0], device=DEV)
    logits = base.expand(rows, vocab).contiguous()
    temps = torch.tensor([1.0, 0.6], device=DEV).repeat_interleave(rows // 2)
    tokens, _ = triton_sampling.sample_tokens(logits, temps, torch.tensor([77], dtype=torch.int64, device=DEV),
                                              0, block_v=16)
    for half, temp in enumerate((1.0, 0.6)):
        counts = torch.bincount(tokens[half * rows // 2:(half + 1) * rows // 2].cpu(), minlength=vocab)
        stat, bound = chi_square_bound(counts, torch.softmax(base.cpu() / temp, -1))
        assert stat < bound, (temp, counts.tolist(), stat, bound)


@triton.jit
def _noise_kernel(out_ptr, seed_ptr, row, offset, QUARTER: tl.constexpr):
    """The sampling kernel's noise for one tile of one row, entry ``4 i + j``."""
    lanes = tl.arange(0, QUARTER)
    zero = tl.zeros([QUARTER], tl.uint32)
    r0, r1, r2, r3 = tl.philox(tl.load(seed_ptr), lanes.to(tl.uint32), zero + row, zero + offset, zero)
    bits = tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), [QUARTER, 4])
    tile = 4 * lanes[:, None] + tl.arange(0, 4)[None, :]
    tl.store(out_ptr + tile, triton_sampling._gumbel(bits))


def test_sampling_noise_is_gumbel_distributed():
    n = 4096
    noise = torch.empty(n, device=DEV)
    _noise_kernel[(1,)](noise, torch.tensor([99], dtype=torch.int64, device=DEV), 3, 0, QUARTER=n // 4)
    noise = noise.double().cpu()
    assert torch.isfinite(noise).all()
    # Gumbel(0, 1): mean 0.5772 (sd of the mean 0.020), variance pi^2 / 6 (sd ~0.05 here).
    assert abs(noise.mean().item() - 0.5772) < 0.1
    assert abs(noise.var().item() - math.pi ** 2 / 6) < 0.3
    # Kolmogorov-Smirnov against the CDF exp(-exp(-g)): 1.95 / sqrt(n) is the 0.1 % level.
    cdf = torch.exp(-torch.exp(-noise.sort().values))
    grid = torch.arange(1, n + 1, dtype=torch.float64) / n
    assert max((grid - cdf).abs().max().item(), (cdf - (grid - 1 / n)).abs().max().item()) < 1.95 / math.sqrt(n)


def test_sample_tokens_triton_seed_and_offset_change_the_draw():
    rows, vocab = 8, 64
    logits = torch.zeros(rows, vocab, device=DEV)  # uniform: the draw is all noise
    temps = torch.ones(rows, device=DEV)
    seed = torch.tensor([5], dtype=torch.int64, device=DEV)
    a, logprobs = triton_sampling.sample_tokens(logits, temps, seed, 0, block_v=64)
    b, _ = triton_sampling.sample_tokens(logits, temps, seed + 1, 0, block_v=64)
    c, _ = triton_sampling.sample_tokens(logits, temps, seed, 1, block_v=64)
    assert not torch.equal(a, b) and not torch.equal(a, c)
    assert len(set(a.tolist())) > 1  # rows draw independently
    torch.testing.assert_close(logprobs, torch.full_like(logprobs, -math.log(vocab)), rtol=1e-5, atol=1e-6)


# -- MoE: routing, pairs by expert, grouped expert GEMMs -----------------------------------

@pytest.mark.parametrize("num_experts,top_k,norm", [(8, 2, True), (6, 3, False), (10, 3, True), (128, 8, True)])
def test_moe_route_triton_matches_reference(num_experts, top_k, norm):
    logits = torch.randn(9, num_experts, device=DEV) * 3  # E=6: not a power of two
    w, ids = triton_moe.moe_route(logits, top_k, norm)
    rw, rids = R.moe_route(logits, top_k, norm)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids, rids)  # same experts in the same (descending) order
    torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-6)
    if norm:
        torch.testing.assert_close(w.sum(-1), torch.ones(9, device=DEV), rtol=1e-5, atol=1e-6)


def test_moe_align_places_every_pair_once_in_blocks_of_one_expert():
    num_experts, block_m = 6, 16
    ids = torch.tensor([[0, 3], [3, 5], [0, 3], [5, 0], [3, 1]], dtype=torch.int32, device=DEV)
    sorted_s, block_expert, total = triton_moe.align(ids, num_experts, block_m)
    pairs = ids.numel()
    # Experts 0 (3 pairs), 1 (1), 3 (4), 5 (2) hit: one 16-slot block each; 2 and 4 none.
    assert int(total) == 4 * block_m
    live = sorted_s[: int(total)].view(-1, block_m).cpu()
    assert block_expert[:4].tolist() == [0, 1, 3, 5]
    flat = ids.reshape(-1).cpu()
    seen = []
    for b in range(4):
        real = live[b][live[b] < pairs]
        assert (flat[real.long()] == block_expert[b].item()).all()
        assert (live[b][len(real):] == pairs).all()  # padding slots after the real ones: the sentinel
        seen += real.tolist()
    assert sorted(seen) == list(range(pairs))
    # The static bound: T * k + E * (block_m - 1) slots, rounded up to whole blocks.
    assert sorted_s.numel() == -(-(pairs + num_experts * (block_m - 1)) // block_m) * block_m


@pytest.mark.parametrize("block_m", [16, 32])
def test_fused_moe_triton_matches_reference(block_m):
    """Ragged K and N (H = 40, I = 24 against 16-wide tiles), experts no token chose, an
    expert with more pairs than a block holds (block_m 16)."""
    tokens, num_experts, hidden, inter, top_k = 13, 6, 40, 24, 2
    x = torch.randn(tokens, hidden, device=DEV)
    w13 = torch.randn(num_experts, 2 * inter, hidden, device=DEV) * 0.2
    w2 = torch.randn(num_experts, hidden, inter, device=DEV) * 0.2
    logits = torch.randn(tokens, num_experts, device=DEV)
    logits[:, 1] += 6.0  # expert 1 is everyone's first choice: 13 pairs
    logits[:, 4] -= 20.0  # expert 4 nobody's
    weights, ids = R.moe_route(logits, top_k, True)
    out = triton_moe.fused_moe(x, w13, w2, weights, ids, block_m=block_m)
    ref = R.fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # The reference's two paths (sorted loop on CPU, gathered weights on CUDA) agree.
    torch.testing.assert_close(R.fused_moe(x, w13, w2, weights, ids, gather=True), ref, rtol=1e-5, atol=1e-5)
    # One pair by hand: token 0's output is the weighted sum of its experts' SwiGLUs.
    by_hand = sum(weights[0, j] * (w2[e] @ R.silu_and_mul(w13[e] @ x[0])) for j, e in enumerate(ids[0].tolist()))
    torch.testing.assert_close(out[0], by_hand, rtol=1e-5, atol=1e-5)


def test_sample_tokens_triton_per_row_keys_ignore_the_batch():
    # A key per row (the paged engine's request seed and token position): a row draws the
    # same token alone or among others, in any place; other keys draw otherwise.
    vocab = 64
    logits = torch.zeros(6, vocab, device=DEV)  # uniform: the draw is all noise
    temps = torch.ones(6, device=DEV)
    seeds = torch.tensor([11, 12, 13, 14, 15, 16], dtype=torch.int64, device=DEV)
    ctrs = torch.tensor([5, 5, 9, 1 << 40, 0, 7], dtype=torch.int64, device=DEV)
    batch, lp = triton_sampling.sample_tokens(logits, temps, seeds, ctrs, block_v=64)
    for i in range(6):
        alone, _ = triton_sampling.sample_tokens(logits[i:i + 1], temps[:1], seeds[i:i + 1], ctrs[i:i + 1],
                                                 block_v=64)
        assert alone.item() == batch[i].item()
    flipped, _ = triton_sampling.sample_tokens(logits, temps, seeds.flip(0), ctrs.flip(0), block_v=64)
    assert torch.equal(flipped, batch.flip(0))
    other, _ = triton_sampling.sample_tokens(logits, temps, seeds, ctrs + 1, block_v=64)
    assert not torch.equal(other, batch)
    torch.testing.assert_close(lp, torch.full_like(lp, -math.log(vocab)), rtol=1e-5, atol=1e-6)
