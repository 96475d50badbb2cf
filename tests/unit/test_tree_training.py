"""Prefix-shared packing (tree training, ``actor.enable_tree_training``) on CPU.

Each shared prefix (a GRPO group's prompt, an agent session's history, a duplicate
sample) is computed once; logprobs and gradients must equal the unshared packed
computation (fp32 to 1e-5, a real ``transformers`` Qwen2 model; fp64 tighter).
The GPU kernels (varlen, fa4) are held to the same reference in
tests/unit/test_tree_attention_gpu.py.
"""

from __future__ import annotations

import random

import pytest
import torch

from tapioca.config.moe import MoeConfig
from tapioca.config.schema import ActorConfig
from tapioca.models.attention import packed_seqs, sdpa_attention
from tapioca.models.factory import build_tiny_model
from tapioca.models.forward import packed_token_logprobs
from tapioca.models.packed import PackedCausalLM
from tapioca.models.prefix_attention import TreeSeqs, check_tree_backend, tree_sdpa_attention, tree_seqs
from tapioca.schemas.errors import ConfigError
from tapioca.trainers.batching import SeqItem, to_tensors
from tapioca.trainers.packing import to_packed
from tapioca.trainers.ppo_actor import PPOActor
from tapioca.trainers.prefix_packing import (
    build_prefix_tree,
    to_tree_packed,
    tree_layout,
    tree_micro_batches,
    tree_tokens,
)

VOCAB = 40


def _item(group: str, prompt: list[int], out: list[int], rng: random.Random) -> SeqItem:
    n = len(out)
    mask = [1] * n
    if n > 3:
        mask[2] = 0  # a tool token inside the answer
    return SeqItem(group_id=group, input_ids=prompt + out, prompt_len=len(prompt),
                   behav_logprobs=[-rng.uniform(2.0, 4.0) for _ in range(n)], versions=[0] * n,
                   loss_mask=mask, advantage=rng.uniform(-1, 1), reward=0.0)


def _items(seed: int = 0) -> list[SeqItem]:
    """Two GRPO groups (a shared prompt each; answers that share their first tokens, one
    duplicate answer, a one-token answer), both prompts starting with the same 4-token
    "system prompt"; and an agent group whose second turn extends the first turn's whole
    sequence (the first turn's answer is in the second's prompt)."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(1, VOCAB) for _ in range(n)]  # noqa: E731
    system = tok(4)
    items = []
    for g, plen in (("g0", 13), ("g1", 7)):
        prompt = system + tok(plen)
        answers = [tok(rng.randint(5, 20)) for _ in range(3)]
        answers.append(answers[0][:3] + tok(6))  # shares its first 3 tokens with answer 0
        answers.append(list(answers[1]))  # the same sample twice
        answers.append(tok(1))
        items += [_item(g, prompt, a, rng) for a in answers]
    turn1 = _item("agent", tok(9), tok(8), rng)
    items.append(turn1)
    items.append(_item("agent", turn1.input_ids + tok(3), tok(10), rng))  # history + user + answer
    rng.shuffle(items)
    return items


def _model(dtype=torch.float32):
    return build_tiny_model(VOCAB, arch="qwen2", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                            intermediate_size=64, max_position_embeddings=128, seed=0).to(dtype)


# ------------------------------------------------------------------ the tree itself

def test_prefix_tree_holds_each_distinct_prefix_once():
    rng = random.Random(3)
    for trial in range(20):
        base = [rng.randrange(1, 5) for _ in range(rng.randint(1, 12))]
        seqs = []
        for _ in range(rng.randint(1, 9)):  # small vocab: many shared runs, duplicates, prefixes
            cut = rng.randint(0, len(base))
            seqs.append(base[:cut] + [rng.randrange(1, 5) for _ in range(rng.randint(0 if cut else 1, 6))])
        distinct = {tuple(s[:i + 1]) for s in seqs for i in range(len(s))}
        tree = build_prefix_tree(seqs)
        assert tree.n_tokens == len(distinct) == tree_tokens(seqs), (trial, seqs)
        lay = tree_layout(tree)
        flat = torch.tensor([t for s in seqs for t in s])
        depth = torch.tensor([i for s in seqs for i in range(len(s))])
        # Every token of every sequence maps to a tree row holding that token at that depth.
        assert torch.equal(lay.ids_N[lay.flat_to_tree_F], flat)
        assert torch.equal(lay.positions_N[lay.flat_to_tree_F], depth)
        # A segment's keys are its path: depths 0 .. end-1 in order.
        assert torch.equal(lay.positions_N[lay.kv_index_K],
                           torch.cat([torch.arange(k) for k in lay.k_lengths]))


def test_tree_attention_equals_each_sequence_attending_alone():
    """fp64: the tree's bottom-right causal segments give every token of every sequence
    exactly the block-diagonal causal attention of the unshared packing."""
    seqs = [it.input_ids for it in _items()]
    lay = tree_layout(build_prefix_tree(seqs))
    tree = tree_seqs(lay.q_lengths, lay.k_lengths, lay.kv_index_K, "cpu", n_flat_tokens=sum(map(len, seqs)))
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(tree.n_tokens, 4, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(tree.n_tokens, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    f = lay.flat_to_tree_F  # the unshared stream: each tree row copied into every sequence holding it
    ref = sdpa_attention(q[f], k[f], v[f], packed_seqs([len(s) for s in seqs], "cpu"), scale=0.3)
    out = tree_sdpa_attention(q, k, v, tree, scale=0.3)
    assert torch.allclose(out[f], ref, atol=1e-12)


def test_tree_batch_keeps_the_loss_tensors_and_scores_the_same_tokens():
    items = _items()
    flat, tree = to_packed(items, "cpu"), to_tree_packed(items, "cpu")
    assert isinstance(tree.seqs, TreeSeqs)
    for name in ("labels_BT", "mask_BT", "behav_logprobs_BT", "advantages_BT", "versions_BT",
                 "labels_M", "padded_index_M"):
        assert torch.equal(getattr(tree, name), getattr(flat, name)), name
    # Each scored tree row holds the token the flat row holds (same context, same depth).
    assert torch.equal(tree.input_ids_N[tree.rows_M], flat.input_ids_N[flat.rows_M])
    assert torch.equal(tree.position_ids_N[tree.rows_M], flat.position_ids_N[flat.rows_M])
    # Fewer tokens: two prompts once each (their shared system prompt once), the agent's
    # first turn once, the duplicate answer once.
    assert tree.seqs.n_tokens < 0.7 * flat.seqs.n_tokens
    assert tree.seqs.n_flat_tokens == flat.seqs.n_tokens


# --------------------------------------------- equal to the unshared computation

def _close(a: torch.Tensor, b: torch.Tensor, rel: float) -> bool:
    """Max abs difference within ``rel`` of the tensor's max abs value."""
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max()) <= rel * float(b.abs().max())


@pytest.mark.parametrize("dtype, rel", [(torch.float64, 1e-6), (torch.float32, 1e-5)])
def test_tree_forward_and_gradients_equal_unshared(dtype, rel):
    """A real Qwen2 model through the packed forward: logprobs, entropy and the gradients
    of a loss on them are the same with the prefix tree as without it. (fp64 to 1e-6
    only: HF's RMSNorm computes in fp32 whatever the model's dtype, and a shared row's
    norm backward sums its readers' gradients before that fp32 step, the unshared one
    after it.)"""
    model = _model(dtype)
    packed = PackedCausalLM(model)
    items = _items(seed=1)
    params = list(model.parameters())

    def run(batch):
        lp_M, ent_M = packed_token_logprobs(packed, batch.input_ids_N, batch.position_ids_N, batch.seqs,
                                            batch.rows_M, batch.labels_M, temperature=0.9, chunk_tokens=16,
                                            compute_entropy=True)
        lp, ent = batch.to_padded(lp_M), batch.to_padded(ent_M)
        coef = torch.linspace(-1, 1, lp.numel(), dtype=dtype).view_as(lp)
        return lp, ent, torch.autograd.grad(((lp + 0.1 * ent) * coef).sum(), params)

    lp_t, ent_t, g_t = run(to_tree_packed(items, "cpu"))
    lp_f, ent_f, g_f = run(to_packed(items, "cpu"))
    assert _close(lp_t, lp_f, rel) and _close(ent_t, ent_f, rel)
    for a, b in zip(g_t, g_f, strict=True):
        assert _close(a, b, rel)


def _actor(**cfg) -> PPOActor:
    # Gradients are compared after the step's clipping: both sides clip by their own
    # norm, equal to ~1e-7, so the clipped gradients agree as the raw ones do.
    return PPOActor(_model(), ActorConfig(**cfg), temperature=0.9, pad_token_id=0)


@pytest.mark.parametrize("prox_forward", [True, False])
def test_actor_step_with_tree_training_equals_without(monkeypatch, prox_forward):
    """The whole PPO step (fp32): same loss, entropy and gradients.
    ``prox_forward=False`` runs the no-grad pi_prox recompute on the trees too."""
    monkeypatch.setattr(PPOActor, "prox_from_training_forward", prox_forward)
    kw = dict(mb_max_tokens=96, loss_agg_mode="seq-mean-token-mean", entropy_coeff=0.01, eps_clip=0.1)
    tree, flat = _actor(enable_tree_training=True, **kw), _actor(**kw)
    r_t, r_f = tree.train_step(_items(seed=2)), flat.train_step(_items(seed=2))
    assert r_t.metrics["actor/tree_tokens_frac"] < 0.8
    assert "actor/tree_tokens_frac" not in r_f.metrics
    for key in ("actor/loss", "actor/entropy", "actor/grad_norm", "actor/clip_ratio"):
        if key in r_f.metrics:
            assert r_t.metrics[key] == pytest.approx(r_f.metrics[key], rel=1e-5, abs=1e-7), key
    for a, b in zip(tree.model.parameters(), flat.model.parameters(), strict=True):
        assert _close(a.grad, b.grad, 1e-5)


def test_tree_micro_batches_keep_groups_together_within_the_budget():
    items = _items()
    for budget in (40, 64, 128, 1000):
        mbs = tree_micro_batches(items, budget)
        assert sorted(id(it) for mb in mbs for it in mb) == sorted(id(it) for it in items)
        for mb in mbs:
            # Within the budget in tree tokens, unless one sequence is longer than it.
            assert tree_tokens([it.input_ids for it in mb]) <= budget or len(mb) == 1
        if budget >= 128:  # each group fits: never split across micro-batches
            homes = {}
            for i, mb in enumerate(mbs):
                for it in mb:
                    homes.setdefault(it.group_id, set()).add(i)
            assert all(len(h) == 1 for h in homes.values())
    assert len(tree_micro_batches(items, 1000)) == 1


def test_reference_scores_trees_as_the_padded_forward():
    """The frozen reference / teacher forward on a prefix tree equals its padded HF one."""
    from tapioca.trainers.reference import FrozenLogprobModel

    ref = FrozenLogprobModel(_model(), temperature=0.9, tree_training=True)
    assert ref.packed is not None
    items = _items(seed=4)
    tree = ref.logprobs(to_tree_packed(items, "cpu"))
    padded = ref.logprobs(to_tensors(items, 0, "cpu"))
    assert _close(tree, padded, 1e-5)


def test_token_advantages_kl_reward_equal_with_tree_training():
    """actor.kl_ctl > 0: the KL reward's reference logprobs come from trees, same numbers."""
    from tapioca.config.schema import TrainConfig
    from tapioca.config.sections import trainer_section
    from tapioca.trainers.reference import FrozenLogprobModel
    from tapioca.trainers.token_advantages import TokenAdvantages

    out = []
    for tree in (False, True):
        cfg = TrainConfig(actor=ActorConfig(kl_ctl=0.1, enable_tree_training=tree, mb_max_tokens=96))
        ref = FrozenLogprobModel(_model(), temperature=0.9, tree_training=tree)
        adv = TokenAdvantages(trainer_section(cfg), pad_token_id=0, device="cpu", reference=ref)
        assert adv.tree_training is tree
        items = _items(seed=5)
        metrics = adv.compute(items)
        out.append((metrics["actor/kl_ref"], [a for it in items for a in it.token_advantages]))
    assert out[1][0] == pytest.approx(out[0][0], rel=1e-5)
    assert out[1][1] == pytest.approx(out[0][1], rel=1e-5, abs=1e-6)


# ------------------------------------------------------------------------- guards

def test_config_refuses_tree_training_where_it_cannot_hold():
    with pytest.raises(ConfigError, match="packed_sequences"):
        ActorConfig(enable_tree_training=True, packed_sequences=False)
    with pytest.raises(ConfigError, match="router losses"):
        ActorConfig(enable_tree_training=True, moe=MoeConfig(aux_loss_coeff=0.01))
    assert ActorConfig().enable_tree_training is False  # off until measured on the GPU


def test_a_kernel_that_aligns_the_mask_top_left_is_refused(monkeypatch):
    """The kernel check catches a varlen kernel whose causal mask starts at the segment's
    first key (top-left) instead of its own depth: a suffix would not see its prompt."""
    import tapioca.models.prefix_attention as pa

    def top_left(q_NHD, k_KKD, v_KKD, seqs, scale, *, expand_kv):
        out, qs, ks = [], seqs.cu_seqlens_S1.tolist(), seqs.cu_seqlens_k_S1.tolist()
        for s in range(seqs.n_seqs):
            q = q_NHD[qs[s]:qs[s + 1]].transpose(0, 1)
            k = k_KKD[ks[s]:ks[s + 1]].repeat_interleave(2, 1).transpose(0, 1)
            v = v_KKD[ks[s]:ks[s + 1]].repeat_interleave(2, 1).transpose(0, 1)
            mask = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).tril()
            out.append(torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale).transpose(0, 1))
        return torch.cat(out)

    monkeypatch.setattr(pa, "_tree_varlen", top_left)
    pa._tree_kernel_error.cache_clear()
    try:
        with pytest.raises(ConfigError, match="bottom-right"):
            check_tree_backend("varlen", "cpu", torch.float32, 4, 2, 8)
    finally:
        pa._tree_kernel_error.cache_clear()
    check_tree_backend("sdpa", "cpu", torch.float32, 4, 2, 8)  # the reference itself: nothing to check


def test_fa4_backend_is_optional_and_refused_clearly_where_it_cannot_run():
    """attention_backend fa4 is a config value; on the CPU (or without flash-attn-4) it
    is refused naming what to do, and auto never tries to import it off CUDA."""
    from tapioca.models import attention_fa4
    from tapioca.models.attention import resolve_backend

    assert ActorConfig(attention_backend="fa4").attention_backend == "fa4"
    attention_fa4.fa4_import_error.cache_clear()
    assert resolve_backend("auto", "cpu", torch.float32, 4, 2, 8) == "sdpa"
    assert attention_fa4.fa4_import_error.cache_info().misses == 0  # no import attempted on CPU
    with pytest.raises(ConfigError, match="attention_backend=fa4 does not run here"):
        resolve_backend("fa4", "cpu", torch.bfloat16, 4, 2, 8)
