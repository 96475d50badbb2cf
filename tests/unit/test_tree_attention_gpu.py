"""The trainer's attention kernels on the GPU: prefix trees (tree training) through flash
varlen, and the optional FlashAttention-4 backend, against the sdpa reference in fp32.

Skips without CUDA; the FA4 tests also skip without ``flash_attn.cute`` (``pip install
flash-attn-4``) on a Hopper / Blackwell GPU. Shapes: Qwen2.5-1.5B's heads (12 query /
2 KV, head_dim 128), a GRPO-like tree (a long prompt, answers sharing their first
tokens, a second level).
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from tapioca.models.attention import (  # noqa: E402
    attention,
    kernel_error,
    packed_seqs,
    resolve_backend,
    sdpa_attention,
)
from tapioca.models.attention_fa4 import fa4_available  # noqa: E402
from tapioca.models.prefix_attention import check_tree_backend, tree_sdpa_attention, tree_seqs  # noqa: E402
from tapioca.trainers.prefix_packing import build_prefix_tree, tree_layout  # noqa: E402

HEADS, KV, DIM, BF16 = 12, 2, 128, torch.bfloat16
needs_fa4 = pytest.mark.skipif(not torch.cuda.is_available() or not fa4_available("cuda", BF16),
                               reason="needs flash-attn-4 (flash_attn.cute) on a Hopper / Blackwell GPU")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


def _tree():
    rng = random.Random(0)
    prompt = [rng.randrange(1000) for _ in range(300)]
    seqs = []
    for _ in range(6):
        head = [7, 8, 9] if len(seqs) % 2 else [7, 8]
        seqs.append(prompt + head + [rng.randrange(1000) for _ in range(rng.randint(1, 200))])
    seqs.append(seqs[0] + [rng.randrange(1000) for _ in range(150)])  # a later turn of sequence 0
    lay = tree_layout(build_prefix_tree(seqs))
    return tree_seqs(lay.q_lengths, lay.k_lengths, lay.kv_index_K, "cuda",
                     n_flat_tokens=sum(map(len, seqs)))


def _against_reference(kernel, reference, n: int, tol: float = 5e-2) -> None:
    """bf16 forward and input gradients within ``tol`` (max relative; bf16 rounding is ~1e-2,
    a misaligned mask O(1)) of fp32 sdpa."""
    assert kernel_error(kernel, reference, n, "cuda", BF16, HEADS, KV, DIM) < tol


@pytest.mark.parametrize("backend", ["varlen", "varlen-expand"])
def test_tree_attention_through_flash_varlen_matches_the_reference(backend):
    tree = _tree()
    check_tree_backend(backend, "cuda", BF16, HEADS, KV, DIM)
    _against_reference(lambda q, k, v, scale: tree.attend(backend, q, k, v, scale),
                       lambda q, k, v, scale: tree_sdpa_attention(q, k, v, tree, scale), tree.n_tokens)


def test_tree_training_step_on_gpu_matches_unshared_in_bf16():
    """A PPO step with bf16 weights and flash varlen: the same gradients with the prefix
    tree as without it, up to bf16 rounding."""
    from tapioca.config.schema import ActorConfig
    from tapioca.models.factory import build_tiny_model
    from tapioca.trainers.batching import SeqItem
    from tapioca.trainers.ppo_actor import PPOActor

    rng = random.Random(1)
    items = []
    for g in range(3):
        prompt = [rng.randrange(1, 500) for _ in range(rng.randint(40, 200))]
        for _ in range(4):
            n = rng.randint(5, 120)
            items.append(SeqItem(group_id=f"g{g}", input_ids=prompt + [rng.randrange(1, 500) for _ in range(n)],
                                 prompt_len=len(prompt), behav_logprobs=[-6.0] * n, versions=[0] * n,
                                 loss_mask=[1] * n, advantage=rng.choice((-1.0, 1.0)), reward=0.0))
    grads = {}
    for tree in (False, True):
        model = build_tiny_model(500, hidden_size=256, num_layers=2, num_heads=2, num_kv_heads=1,
                                 intermediate_size=512, head_dim=128, max_position_embeddings=512, seed=0,
                                 device="cuda").to(BF16)
        # Gradients are read after the step (both sides clip by their own, equal, norm).
        actor = PPOActor(model, ActorConfig(param_dtype="bfloat16", device="cuda", attention_backend="varlen",
                                            enable_tree_training=tree),
                         temperature=1.0, pad_token_id=0, device="cuda")
        actor.train_step(items, policy_version=0)
        grads[tree] = torch.cat([p.grad.float().flatten() for p in model.parameters()])
    assert rel_err(grads[True], grads[False]) < 5e-2  # bf16 rounding; a wrong mask is O(1)


# --------------------------------------------------------------------------- FA4

@needs_fa4
def test_fa4_packed_attention_matches_sdpa():
    seqs = packed_seqs([1000, 37, 1, 513, 2048], "cuda")
    _against_reference(lambda q, k, v, scale: attention("fa4", q, k, v, seqs, scale),
                       lambda q, k, v, scale: sdpa_attention(q, k, v, seqs, scale), seqs.n_tokens)


@needs_fa4
def test_auto_picks_fa4_when_installed_and_it_runs_trees():
    assert resolve_backend("auto", "cuda", BF16, HEADS, KV, DIM) == "fa4"
    assert resolve_backend("fa4", "cuda", BF16, HEADS, KV, DIM) == "fa4"
    tree = _tree()
    check_tree_backend("fa4", "cuda", BF16, HEADS, KV, DIM)
    _against_reference(lambda q, k, v, scale: tree.attend("fa4", q, k, v, scale),
                       lambda q, k, v, scale: tree_sdpa_attention(q, k, v, tree, scale), tree.n_tokens)


def test_fa4_refused_with_a_clear_error_where_it_cannot_run():
    from tapioca.schemas.errors import ConfigError

    with pytest.raises(ConfigError, match="fa4"):
        resolve_backend("fa4", "cuda", torch.float32, HEADS, KV, DIM)  # fp32: never FA4
