"""Qwen3-MoE on the packed trainer (models/moe.py, models/packed.py) on CPU: routing and
router losses against hand-derived numbers, the MoE block against HF's (outputs and
gradients), one PPO step against the padded HF forward, the router switches
(actor.moe: router_dtype, the aux / z losses, freeze_router), routing replay, the load
metrics, and the fallback of the families the packed forward does not run.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import transformers

from tapioca.config.moe import MoeConfig
from tapioca.config.optimizer import OptimizerConfig
from tapioca.config.schema import ActorConfig
from tapioca.models.attention import packed_seqs, position_ids
from tapioca.models.factory import build_tiny_model
from tapioca.models.moe import (
    expert_aliases,
    fuse_expert_tensors,
    load_balancing_loss,
    moe_forward,
    route,
    router_metrics,
    router_parameters,
    z_loss,
)
from tapioca.models.packed import PackedCausalLM, unsupported_reason
from tapioca.schemas.errors import ConfigError
from tapioca.trainers.batching import SeqItem
from tapioca.trainers.ppo_actor import PPOActor

VOCAB = 40


def moe_model(dtype=torch.float32, seed: int = 0, eager_experts: bool = False) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=48, moe_intermediate_size=16, num_experts=6, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[1], max_position_embeddings=128)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)
    if eager_experts:  # HF's grouped_mm has no fp64 kernel on CPU; its loop does
        model.config._experts_implementation = "eager"
    return model


def items(seed: int = 0, n: int = 6) -> list[SeqItem]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        pl, ol = rng.randint(1, 5), rng.randint(2, 14)
        out.append(SeqItem(group_id=f"g{i // 2}", input_ids=[rng.randrange(1, VOCAB) for _ in range(pl + ol)],
                           prompt_len=pl, behav_logprobs=[-rng.uniform(2, 4) for _ in range(ol)],
                           versions=[0] * ol, loss_mask=[1] * ol, advantage=rng.uniform(-1, 1), reward=0.0))
    return out


def actor(model=None, *, lr: float = 1e-2, max_grad_norm: float = 1.0, **cfg) -> PPOActor:
    cfg["optimizer"] = OptimizerConfig(lr=lr, gradient_clipping=max_grad_norm)
    return PPOActor(model if model is not None else moe_model(), ActorConfig(**cfg), temperature=1.0,
                    pad_token_id=0)


# ---------------------------------------------------------------- routing and losses


def test_route_golden():
    # softmax([ln 4, ln 2, 0, ln 2]) = [4, 2, 1, 2] / 9: top-2 = experts 0 (4/9) and 1 (2/9;
    # expert 3 ties at 2/9 and torch.topk keeps the lower index); renormalised [2/3, 1/3].
    logits = torch.tensor([[math.log(4), math.log(2), 0.0, math.log(2)]])
    w, ids, probs = route(logits, 2, norm_topk_prob=True)
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(w, torch.tensor([[2 / 3, 1 / 3]]))
    w, _, _ = route(logits, 2, norm_topk_prob=False)
    torch.testing.assert_close(w, torch.tensor([[4 / 9, 2 / 9]]))
    # Replay experts 2 and 3: their live probabilities 1/9, 2/9 -> renormalised [1/3, 2/3].
    w, ids, _ = route(logits, 2, True, replay_ids_NK=torch.tensor([[2, 3]]))
    assert ids.tolist() == [[2, 3]]
    torch.testing.assert_close(w, torch.tensor([[1 / 3, 2 / 3]]))


def test_router_losses_golden():
    # Balanced: two tokens, k=1, each to its own expert -> f = [1/2, 1/2], P = [1/2, 1/2]:
    # E * sum f P = 2 * (1/4 + 1/4) = 1.
    probs = torch.tensor([[0.75, 0.25], [0.25, 0.75]])
    assert load_balancing_loss(probs, torch.tensor([1, 1]), 1).item() == pytest.approx(1.0)
    # Collapsed: both to expert 0 -> f = [1, 0], P = [0.85, 0.15]: 2 * 0.85 = 1.7.
    probs = torch.tensor([[0.9, 0.1], [0.8, 0.2]])
    assert load_balancing_loss(probs, torch.tensor([2, 0]), 1).item() == pytest.approx(1.7)
    # z-loss of all-zero logits over 4 experts: logsumexp = ln 4 -> (ln 4)^2 = 1.9218.
    assert z_loss(torch.zeros(3, 4)).item() == pytest.approx(math.log(4) ** 2)


def test_router_metrics_golden():
    # Layer 0 balanced over 4 experts (entropy ln 4 -> 1.0); layer 1 all on one (entropy 0).
    # Mean normalised entropy 0.5; the largest share 1.0; 4 tokens x k=2 x 2 layers = 16
    # assignments, 16 counted: 0 dropped.
    counts = torch.tensor([[2, 2, 2, 2], [8, 0, 0, 0]])
    m = router_metrics(counts, tokens=4, top_k=2)
    assert m == {"actor/moe_load_entropy": pytest.approx(0.5), "actor/moe_max_expert_share": 1.0,
                 "actor/moe_dropped_tokens": 0.0}


def test_expert_names_round_trip():
    sd = moe_model().state_dict()
    aliases = expert_aliases(sd)
    assert len(aliases) == 2 * 6 * 3  # two MoE layers, six experts, gate / up / down
    gate_up = sd["model.layers.0.mlp.experts.gate_up_proj"]
    assert aliases["model.layers.0.mlp.experts.4.up_proj.weight"].data_ptr() == gate_up[4, 16:].data_ptr()
    fused = fuse_expert_tensors(aliases, "model.layers.2.mlp.")
    assert torch.equal(fused["gate_up_proj"], sd["model.layers.2.mlp.experts.gate_up_proj"])
    assert torch.equal(fused["down_proj"], sd["model.layers.2.mlp.experts.down_proj"])


# ---------------------------------------------------------------- the MoE block


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_moe_block_matches_hf_outputs_and_gradients(dtype):
    model = moe_model(dtype, eager_experts=True)
    block = model.model.layers[0].mlp
    x = torch.randn(23, 32, dtype=dtype, requires_grad=True)
    ref = block(x[None])[0]
    out, router = moe_forward(block, x, router_dtype=dtype)
    tol = dict(rtol=1e-6, atol=1e-8) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    # HF's router softmax is fp32 whatever the model's dtype: fp64 agrees to fp32 rounding.
    torch.testing.assert_close(out, ref, **(tol if dtype == torch.float32 else dict(rtol=1e-6, atol=1e-6)))
    params = [x, block.experts.gate_up_proj, block.experts.down_proj, block.gate.weight]
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, params, g), torch.autograd.grad(ref, params, g)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert router.ids_NK.shape == (23, 2) and int(router.counts_E.sum()) == 46


def test_replayed_routes_reproduce_the_forward_and_train_the_router_through_live_scores():
    model = moe_model()
    block = model.model.layers[0].mlp
    x = torch.randn(11, 32)
    out, router = moe_forward(block, x, router_dtype=torch.float32)
    again, _ = moe_forward(block, x, router_dtype=torch.float32, replay_ids_NK=router.ids_NK)
    assert torch.equal(out, again)
    other_NK = (router.ids_NK + 1) % 6  # other experts: another output, and router gradients
    replayed, r2 = moe_forward(block, x, router_dtype=torch.float32, replay_ids_NK=other_NK)
    assert torch.equal(r2.ids_NK, other_NK) and not torch.allclose(replayed, out)
    (grad,) = torch.autograd.grad(replayed.square().sum(), block.gate.weight)
    assert grad.abs().sum() > 0


# ---------------------------------------------------------------- the packed trainer


def test_packed_ppo_step_equals_the_padded_hf_forward():
    """One step each way from the same weights: same loss, same updated weights (fp32;
    HF's experts through its grouped_mm, ours through the per-expert loop)."""
    results = {}
    for packed in (True, False):
        a = actor(moe_model(), packed_sequences=packed)
        assert (a.packed is not None) == packed
        r = a.train_step(items(), policy_version=0)
        results[packed] = (r.metrics["actor/loss"], a.model.state_dict())
    assert results[True][0] == pytest.approx(results[False][0], rel=1e-5)
    for k, v in results[True][1].items():
        torch.testing.assert_close(v, results[False][1][k], rtol=1e-4, atol=1e-5, msg=k)


def test_router_metrics_of_a_step():
    a = actor()
    m = a.train_step(items(), policy_version=0).metrics
    assert m["actor/moe_dropped_tokens"] == 0.0
    assert 0 < m["actor/moe_load_entropy"] <= 1 and 1 / 6 <= m["actor/moe_max_expert_share"] <= 1
    assert m["actor/moe_aux_loss"] > 0 and m["actor/moe_z_loss"] > 0
    assert "actor/moe_load_entropy" not in actor(build_tiny_model(VOCAB)).train_step(items()).metrics


def test_router_losses_are_read_with_the_minibatch_not_per_micro_batch(count_host_reads):
    def step(mb_max_tokens: int) -> tuple[int, int, dict, int]:
        a = actor(mb_max_tokens=mb_max_tokens)
        mbs = a.micro_batches(items(n=12))
        with count_host_reads() as count:
            m = a.train_micro_batches(mbs).metrics
        return count.reads, len(mbs), m, len(a.packed.moe_layers)

    few, n_few, _, moe_layers = step(400)
    many, n_many, m_many, _ = step(20)
    assert n_many >= n_few + 4
    # The only reads a micro-batch adds are the CPU expert loop's, one per MoE layer and
    # forward (a GPU's grouped_mm reads none); the router losses wait for the minibatch's.
    assert many - few == (n_many - n_few) * moe_layers
    assert m_many["actor/moe_aux_loss"] > 0 and m_many["actor/moe_z_loss"] > 0


def test_aux_and_z_losses_add_their_coefficients_times_the_losses_gradient():
    """With coefficients a, z the step's gradient is the plain one plus the gradient of
    ``a * sum_l aux_l + z * sum_l z_l``, micro-batches weighted by their token share."""
    batch = items()
    grads = {}
    for coeffs in ((0.0, 0.0), (0.5, 0.1)):
        a = actor(moe=MoeConfig(aux_loss_coeff=coeffs[0], z_loss_coeff=coeffs[1]), mb_max_tokens=32, max_grad_norm=1e9)
        a.optimizer.step = lambda: None  # keep the gradients, not the update
        a.train_step(batch, policy_version=0)
        grads[coeffs] = {n: p.grad.clone() for n, p in a.model.named_parameters() if p.grad is not None}
    # The router-loss gradient on its own, per micro-batch, weighted by token share.
    a = actor(mb_max_tokens=32)
    mbs = a.micro_batches(batch)
    total = sum(mb.seqs.n_tokens for mb in mbs)
    a.model.zero_grad()
    for mb in mbs:
        a.packed(mb.input_ids_N, mb.position_ids_N, mb.seqs)
        (a.packed.router_loss(0.5, 0.1) * (mb.seqs.n_tokens / total)).backward()
    gate = "model.layers.0.mlp.gate.weight"
    expected = grads[(0.0, 0.0)][gate] + a.model.get_parameter(gate).grad
    torch.testing.assert_close(grads[(0.5, 0.1)][gate], expected, rtol=1e-4, atol=1e-7)
    assert len(mbs) > 1  # the weighting was exercised


def test_router_dtype_switch_runs_the_router_in_that_dtype():
    """``actor.moe.router_dtype`` on a bf16 model: fp32 logits by default, bf16 with none (HF's)."""
    seen = {}
    for name in ("fp32", "none"):
        a = actor(moe_model(torch.bfloat16), param_dtype="bfloat16", moe=MoeConfig(router_dtype=name))
        mb = a.micro_batches(items())[0]
        with torch.no_grad():
            a.packed(mb.input_ids_N, mb.position_ids_N, mb.seqs)
        seen[name] = a.packed.routers[0].z_loss  # from the logits: fp32 either way (promoted)
        seen[name + "_layer"] = a.packed.layers[0].moe_router_dtype
    assert seen["fp32_layer"] == torch.float32 and seen["none_layer"] is None
    assert not torch.equal(seen["fp32"], seen["none"])  # bf16 logits round differently
    with pytest.raises(ConfigError, match="actor.moe.router_dtype"):
        ActorConfig(moe=MoeConfig(router_dtype="bf16"))


def test_freeze_router_keeps_router_weights_and_trains_the_rest():
    a = actor(moe=MoeConfig(freeze_router=True))
    before = {n: p.detach().clone() for n, p in a.model.named_parameters()}
    a.train_step(items(), policy_version=0)
    routers = {n for n, _ in a.model.named_parameters() if n.endswith("mlp.gate.weight")}
    assert routers == {"model.layers.0.mlp.gate.weight", "model.layers.2.mlp.gate.weight"}
    for n, p in a.model.named_parameters():
        changed = not torch.equal(p, before[n])
        assert changed != (n in routers), n
    with pytest.raises(ConfigError, match="no MoE router"):
        actor(build_tiny_model(VOCAB), moe=MoeConfig(freeze_router=True))
    # Other families' routers (gpt-oss: mlp.router) are found too.
    gpt_oss = build_tiny_model(VOCAB, arch="gpt_oss", hidden_size=32, intermediate_size=32, num_experts=4,
                               moe_intermediate_size=16)
    frozen = {id(p) for p in router_parameters(gpt_oss)}
    names = {n for n, p in gpt_oss.named_parameters() if id(p) in frozen}
    assert names == {f"model.layers.{i}.mlp.router.{w}" for i in (0, 1) for w in ("weight", "bias")}


def test_gradient_checkpointing_gives_the_same_step():
    results = []
    for ckpt in (False, True):
        a = actor(gradient_checkpointing=ckpt, moe=MoeConfig(aux_loss_coeff=0.01, z_loss_coeff=0.001))
        m = a.train_step(items(), policy_version=0).metrics
        results.append((m, a.model.state_dict()))
    assert results[0][0]["actor/moe_load_entropy"] == results[1][0]["actor/moe_load_entropy"]
    for k, v in results[0][1].items():
        torch.testing.assert_close(v, results[1][1][k], rtol=1e-5, atol=1e-7, msg=k)


def test_packed_forward_replays_given_routes():
    model = moe_model()
    packed = PackedCausalLM(model)
    lengths = [5, 9]
    ids = torch.randint(1, VOCAB, (14,))
    seqs, pos = packed_seqs(lengths, "cpu"), position_ids(lengths)
    with torch.no_grad():
        h = packed(ids, pos, seqs)
        recorded_LNK = torch.stack([r.ids_NK for r in packed.routers])
        assert recorded_LNK.shape == (2, 14, 2)
        assert torch.equal(packed(ids, pos, seqs, replay_topk_LNK=recorded_LNK), h)
        assert not torch.equal(packed(ids, pos, seqs, replay_topk_LNK=(recorded_LNK + 3) % 6), h)


# ---------------------------------------------------------------- other families


def test_families_the_packed_forward_does_not_run_fall_back_to_the_padded_forward():
    model = build_tiny_model(VOCAB, arch="qwen2_moe", hidden_size=32, intermediate_size=32, num_experts=4,
                             moe_intermediate_size=16)
    assert "not 'qwen2_moe'" in unsupported_reason(model)
    a = actor(model)
    assert a.packed is None
    assert math.isfinite(a.train_step(items(), policy_version=0).metrics["actor/loss"])
    with pytest.raises(ConfigError, match=r"'qwen2_moe'.*padded HF forward.*actor.gradient_checkpointing"):
        actor(build_tiny_model(VOCAB, arch="qwen2_moe", hidden_size=32, intermediate_size=32, num_experts=4,
                               moe_intermediate_size=16), gradient_checkpointing=True)
    with pytest.raises(ConfigError, match="no MoE layer"):
        actor(build_tiny_model(VOCAB), moe=MoeConfig(aux_loss_coeff=0.01))
