"""Golden numeric tests for the decoupled PPO surrogate of
tapioca.algorithms.policy_losses.policy_loss (its default).

Expected values are derived by hand in comments from
  r = exp(logp - prox), pg = max(-A r, -A clip(r, 1-eps, 1+eps_high)),
  dual clip pg = min(pg, -A c_clip) for A < 0, w = exp(prox - behav), loss_t = w pg.
"""

from __future__ import annotations

import math

import pytest
import torch

from tapioca.algorithms.policy_losses import policy_loss

LN2 = math.log(2.0)


def _t(values, requires_grad=False):
    return torch.tensor([values], dtype=torch.float64, requires_grad=requires_grad)


def _on_policy(ratios, advantages, mask=None):
    """prox = behav = 0 (so w = 1) and logp = log(ratio)."""
    logp = _t([math.log(r) for r in ratios], requires_grad=True)
    zeros = _t([0.0] * len(ratios))
    adv = _t(advantages)
    mask = torch.ones_like(zeros, dtype=torch.bool) if mask is None else mask
    return logp, zeros, zeros.clone(), adv, mask


def test_clip_positive_and_negative_advantages():
    # eps 0.2, w = 1:
    #  A=+1 r=1.5: max(-1.5, -1.2) = -1.2  clipped
    #  A=+1 r=0.5: max(-0.5, -0.8) = -0.5  not clipped (A>0 never clips below)
    #  A=-1 r=0.5: max( 0.5,  0.8) =  0.8  clipped
    #  A=-1 r=1.5: max( 1.5,  1.2) =  1.5  not clipped (A<0 never clips above)
    # token-mean = (-1.2 - 0.5 + 0.8 + 1.5) / 4 = 0.6 / 4 = 0.15
    logp, prox, behav, adv, mask = _on_policy([1.5, 0.5, 0.5, 1.5], [1.0, 1.0, -1.0, -1.0])
    loss, stats = policy_loss(logp, prox, behav, adv, mask, eps_clip=0.2)
    assert loss.item() == pytest.approx(0.15, abs=1e-12)
    assert stats["clip_ratio"] == pytest.approx(0.5)
    assert stats["dual_clip_ratio"] == 0.0
    # ratio mean (1.5+0.5+0.5+1.5)/4 = 1 ; approx_kl = (2 ln1.5 + 2 ln0.5)/4 = ln(0.75)/2 = -0.1438410
    assert stats["ratio_mean"] == pytest.approx(1.0)
    assert stats["approx_kl"] == pytest.approx(-0.1438410, abs=1e-7)
    assert stats["importance_weight_mean"] == pytest.approx(1.0)
    assert stats["importance_weight_max"] == pytest.approx(1.0)
    # Gradient wrt logp: clipped tokens 0; unclipped d(-A r)/dlogp = -A r, / 4 tokens:
    #   token 2: -(1)(0.5)/4 = -0.125 ; token 4: -(-1)(1.5)/4 = 0.375
    loss.backward()
    assert torch.allclose(logp.grad, _t([0.0, -0.125, 0.0, 0.375]))


def test_clip_higher():
    # A=+1, r in {1.25, 1.5}.
    #  eps_high=None (=0.2): both clipped at 1.2 -> [-1.2, -1.2], mean -1.2, clip_ratio 1
    #  eps_high=0.28: r=1.25 < 1.28 unclipped -> -1.25 ; r=1.5 -> -1.28
    #                 mean (-1.25 - 1.28)/2 = -1.265, clip_ratio 0.5
    logp, prox, behav, adv, mask = _on_policy([1.25, 1.5], [1.0, 1.0])
    loss, stats = policy_loss(logp, prox, behav, adv, mask, eps_clip=0.2)
    assert loss.item() == pytest.approx(-1.2, abs=1e-12)
    assert stats["clip_ratio"] == pytest.approx(1.0)
    loss, stats = policy_loss(logp, prox, behav, adv, mask, eps_clip=0.2, eps_clip_higher=0.28)
    assert loss.item() == pytest.approx(-1.265, abs=1e-12)
    assert stats["clip_ratio"] == pytest.approx(0.5)


def test_dual_clip():
    # eps 0.2, c_clip 3:
    #  A=-1 r=5  : max(5, 1.2) = 5 ; dual min(5, 3) = 3   dual-clipped (not "clipped")
    #  A=-1 r=2  : max(2, 1.2) = 2 ; min(2, 3) = 2         untouched
    #  A=+1 r=5  : max(-5, -1.2) = -1.2 ; A>0: no dual     clipped
    #  A=-2 r=0.5: max(1, 1.6) = 1.6 ; min(1.6, 6) = 1.6   clipped
    # with c_clip: (3 + 2 - 1.2 + 1.6)/4 = 5.4/4 = 1.35
    # without    : (5 + 2 - 1.2 + 1.6)/4 = 7.4/4 = 1.85
    logp, prox, behav, adv, mask = _on_policy([5.0, 2.0, 5.0, 0.5], [-1.0, -1.0, 1.0, -2.0])
    loss, stats = policy_loss(logp, prox, behav, adv, mask, eps_clip=0.2, c_clip=3.0)
    assert loss.item() == pytest.approx(1.35, abs=1e-12)
    assert stats["dual_clip_ratio"] == pytest.approx(0.25)
    assert stats["clip_ratio"] == pytest.approx(0.5)
    # Only token 2 has a gradient: -A r / 4 = 2/4 = 0.5 ; the dual-clipped constant has none.
    loss.backward()
    assert torch.allclose(logp.grad, _t([0.0, 0.5, 0.0, 0.0]))

    loss, stats = policy_loss(logp.detach(), prox, behav, adv, mask, eps_clip=0.2)
    assert loss.item() == pytest.approx(1.85, abs=1e-12)
    assert stats["dual_clip_ratio"] == 0.0


def _behav_inputs():
    # logp = prox = 0 -> r = 1, no clipping; pg = -A = [-1, -1, 1, -2].
    # behav = [-ln2, ln2, -ln4, 0] -> log w = prox - behav = [ln2, -ln2, ln4, 0], w = [2, 0.5, 4, 1]
    logp = _t([0.0, 0.0, 0.0, 0.0], requires_grad=True)
    prox = _t([0.0, 0.0, 0.0, 0.0], requires_grad=True)
    behav = _t([-LN2, LN2, -2 * LN2, 0.0], requires_grad=True)
    adv = _t([1.0, 1.0, -1.0, 2.0])
    mask = torch.ones(1, 4, dtype=torch.bool)
    return logp, prox, behav, adv, mask


def test_behaviour_weight_multiplies_loss():
    # loss_t = w * pg = [-2, -0.5, 4, -2] ; mean = -0.5/4 = -0.125
    logp, prox, behav, adv, mask = _behav_inputs()
    loss, stats = policy_loss(logp, prox, behav, adv, mask)
    assert loss.item() == pytest.approx(-0.125, abs=1e-12)
    # w stats: mean (2 + 0.5 + 4 + 1)/4 = 1.875, max 4 ; nothing capped.
    assert stats["importance_weight_mean"] == pytest.approx(1.875)
    assert stats["importance_weight_max"] == pytest.approx(4.0)
    assert stats["behav_capped_ratio"] == 0.0
    # grad = w * (-A r) / 4 = [2*-1, 0.5*-1, 4*1, 1*-2]/4 = [-0.5, -0.125, 1, -0.5]
    loss.backward()
    assert torch.allclose(logp.grad, _t([-0.5, -0.125, 1.0, -0.5]))
    # w is detached: no gradient reaches prox or behav.
    assert prox.grad is None and behav.grad is None


def test_behaviour_weight_cap():
    # cap 3 drops token 3 (w = 4 > 3): losses [-2, -0.5, 0, -2], sum -4.5;
    # the denominator stays 4 (AReaL's choice): -4.5/4 = -1.125
    logp, prox, behav, adv, mask = _behav_inputs()
    loss, stats = policy_loss(logp, prox, behav, adv, mask, behav_imp_weight_cap=3.0)
    assert loss.item() == pytest.approx(-1.125, abs=1e-12)
    assert stats["behav_capped_ratio"] == pytest.approx(0.25)
    # Stats describe w before the cap.
    assert stats["importance_weight_max"] == pytest.approx(4.0)
    loss.backward()
    assert torch.allclose(logp.grad, _t([-0.5, -0.125, 0.0, -0.5]))
    # w == cap is kept (strictly greater is dropped): cap 4 keeps everything -> -0.125.
    loss, _ = policy_loss(logp.detach(), prox, behav, adv, mask, behav_imp_weight_cap=4.0)
    assert loss.item() == pytest.approx(-0.125, abs=1e-12)


def test_masked_garbage_does_not_leak():
    # Row 0 is the clip test (loss 0.15); row 1 is fully masked garbage.
    logp, prox, behav, adv, _ = _on_policy([1.5, 0.5, 0.5, 1.5], [1.0, 1.0, -1.0, -1.0])
    garbage = torch.tensor([[math.nan, math.inf, -math.inf, 1e30]], dtype=torch.float64)
    logp2 = torch.cat([logp.detach(), garbage]).requires_grad_(True)
    prox2 = torch.cat([prox, garbage.flip(-1)])
    behav2 = torch.cat([behav, -garbage])
    adv2 = torch.cat([adv, garbage])
    mask2 = torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    for mode in ("token-mean", "seq-mean-token-mean"):
        # seq-mean-token-mean: row 0 mean 0.15, row 1 excluded -> 0.15 too.
        loss, stats = policy_loss(logp2, prox2, behav2, adv2, mask2, agg_mode=mode)
        assert loss.item() == pytest.approx(0.15, abs=1e-12)
        assert all(math.isfinite(v) for v in stats.values())
        assert stats["clip_ratio"] == pytest.approx(0.5)
        logp2.grad = None
        loss.backward()
        assert torch.isfinite(logp2.grad).all()
        assert (logp2.grad[1] == 0).all()


def test_extreme_log_ratios_are_finite():
    # |logp - prox| = 1000 and |prox - behav| = 1000, fp32: exp would overflow
    # without the [-20, 20] clamp.
    logp = torch.tensor([[1000.0, -1000.0, 1000.0, -1000.0, 0.0]], requires_grad=True)
    prox = torch.zeros(1, 5)
    behav = torch.tensor([[0.0, 0.0, -1000.0, 1000.0, 0.0]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0]])
    mask = torch.ones(1, 5, dtype=torch.bool)
    for kwargs in ({}, {"c_clip": 3.0}, {"behav_imp_weight_cap": 5.0}):
        loss, stats = policy_loss(logp, prox, behav, adv, mask, **kwargs)
        assert torch.isfinite(loss), kwargs
        assert all(math.isfinite(v) for v in stats.values()), (kwargs, stats)
        logp.grad = None
        loss.backward()
        assert torch.isfinite(logp.grad).all(), kwargs
    # With the cap, token 3 (log w = 1000) is dropped: 1 of 5.
    assert stats["behav_capped_ratio"] == pytest.approx(0.2)


def test_seq_mode_passthrough_and_no_tokens():
    # Two rows: [A=+1 r=1.5 -> -1.2, A=+1 r=0.5 -> -0.5] and [A=-1 r=0.5 -> 0.8, masked].
    # seq-mean-token-sum: row sums [-1.7, 0.8] -> mean -0.45
    logp = torch.tensor([[math.log(1.5), math.log(0.5)], [math.log(0.5), 0.0]], dtype=torch.float64)
    zeros = torch.zeros_like(logp)
    adv = torch.tensor([[1.0, 1.0], [-1.0, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    loss, _ = policy_loss(logp, zeros, zeros, adv, mask, agg_mode="seq-mean-token-sum")
    assert loss.item() == pytest.approx(-0.45, abs=1e-12)
    # No unmasked token at all: loss 0, all stats 0.
    loss, stats = policy_loss(logp, zeros, zeros, adv, torch.zeros_like(mask))
    assert loss.item() == 0.0
    assert all(v == 0.0 for v in stats.values())


def test_bad_arguments():
    logp, prox, behav, adv, mask = _on_policy([1.0, 1.0], [1.0, -1.0])
    with pytest.raises(ValueError):
        policy_loss(logp, prox, behav, adv, mask, c_clip=1.0)
    with pytest.raises(ValueError):
        policy_loss(logp, prox, behav, adv, mask, eps_clip=0.0)
    with pytest.raises(ValueError):
        policy_loss(logp, prox, behav, adv, mask, behav_imp_weight_cap=0.0)
    with pytest.raises(ValueError):
        policy_loss(logp, prox, behav[:, :1], adv, mask)


# ----------------------------------------------------------------------------------
# PPOActor wiring: config-selected losses, micro-batch scaling, prox_logp_method
# ----------------------------------------------------------------------------------

import random  # noqa: E402

from tapioca.algorithms.errors import AlgorithmInputError  # noqa: E402
from tapioca.config.optimizer import OptimizerConfig  # noqa: E402
from tapioca.config.schema import ActorConfig, RejectionSamplingConfig  # noqa: E402
from tapioca.models.factory import build_tiny_model  # noqa: E402
from tapioca.schemas.errors import ConfigError  # noqa: E402
from tapioca.trainers.batching import SeqItem, to_tensors  # noqa: E402
from tapioca.trainers.ppo_actor import PPOActor  # noqa: E402

VOCAB = 16


def _items(seed: int = 0, n: int = 6, version: int = 3) -> list[SeqItem]:
    """Sequences of different lengths, off-policy behaviour logprobs, a masked token."""
    rng = random.Random(seed)
    items = []
    for i in range(n):
        out_len = 2 + i % 5
        prompt = [rng.randrange(1, VOCAB) for _ in range(3)]
        out = [rng.randrange(1, VOCAB) for _ in range(out_len)]
        mask = [1] * out_len
        if i == 2:
            mask[0] = 0
        items.append(SeqItem(
            group_id=f"g{i // 2}", input_ids=prompt + out, prompt_len=3,
            behav_logprobs=[-rng.uniform(1.5, 4.0) for _ in range(out_len)],
            versions=[version - (j % 2) for j in range(out_len)], loss_mask=mask,
            advantage=1.0 if i % 2 == 0 else -0.7, reward=float(i % 2 == 0)))
    return items


def _actor(**cfg) -> PPOActor:
    model = build_tiny_model(VOCAB, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                             intermediate_size=32, max_position_embeddings=32, seed=0).double()
    cfg.setdefault("optimizer", OptimizerConfig(gradient_clipping=1e9))  # no clipping: compare raw gradients
    return PPOActor(model, ActorConfig(**cfg), temperature=1.0, pad_token_id=0)


def _grads(actor: PPOActor) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in actor.model.parameters() if p.grad is not None]


LOSS_CONFIGS = [
    {},
    {"importance_sampling_level": "sequence", "entropy_coeff": 0.01},
    {"m2_threshold": 0.5, "use_sapo_loss": True},
    {"use_cispo_loss": True, "eps_clip": 1.0, "eps_clip_higher": 4.0,
     "rejection_sampling": RejectionSamplingConfig(level="sequence", upper=3.0)},
]


@pytest.mark.parametrize("extra", LOSS_CONFIGS, ids=["ppo", "gspo+entropy", "sapo+m2po", "cispo+rs"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
def test_micro_batches_give_full_batch_gradient(mode, extra):
    # One micro-batch holding every sequence computes the full-batch aggregated loss;
    # mb_max_tokens=16 splits the same sequences into several micro-batches. The
    # accumulated gradients must be the same (float64 model: up to rounding).
    kw = dict(extra, loss_agg_mode=mode, loss_agg_max_tokens=8)
    one, many = _actor(mb_max_tokens=4096, **kw), _actor(mb_max_tokens=16, **kw)
    r_one = one.train_step(_items())
    r_many = many.train_step(_items())
    assert r_one.metrics["actor/micro_batches"] == 1 and r_many.metrics["actor/micro_batches"] >= 3
    for g1, g2 in zip(_grads(one), _grads(many), strict=True):
        assert torch.allclose(g1, g2, rtol=1e-9, atol=1e-12)
    assert r_one.metrics["actor/loss"] == pytest.approx(r_many.metrics["actor/loss"], rel=1e-9)


def test_seq_mode_scaling_differs_from_token_scaling():
    # Guard that the equivalence above is not vacuous: the seq-mean-token-mean gradient is
    # not the token-mean one on these (different-length) sequences.
    a, b = _actor(loss_agg_mode="seq-mean-token-mean"), _actor()
    a.train_step(_items())
    b.train_step(_items())
    assert not all(torch.allclose(g1, g2) for g1, g2 in zip(_grads(a), _grads(b)))


def _exact_behaviour(actor: PPOActor, items: list[SeqItem]) -> None:
    """Set each item's behaviour logprobs to the actor's own (pi_behav = pi_prox)."""
    with torch.no_grad():
        for it in items:
            lp, _ = actor.logprobs(to_tensors([it], 0, "cpu"))
            n = it.length - it.prompt_len
            it.behav_logprobs = lp[0, it.prompt_len - 1:it.prompt_len - 1 + n].tolist()


def test_loglinear_needs_policy_version():
    actor = _actor(prox_logp_method="loglinear")
    with pytest.raises(AlgorithmInputError, match="policy_version"):
        actor.train_step(_items())


def test_loglinear_matches_recompute_when_tokens_are_fresh():
    # All tokens from version 3 = policy_version: alpha = 0, loglinear's prox = behav,
    # and behav is the model's own logprobs, which is what recompute computes. Two
    # minibatches, so the second one really uses the approximation.
    items = _items(version=3)
    for it in items:
        it.versions = [3] * len(it.versions)
    kw = dict(mb_max_tokens=16, ppo_n_minibatches=2)
    rec, ll = _actor(**kw), _actor(prox_logp_method="loglinear", **kw)
    _exact_behaviour(rec, items)
    rec.train_step(items)
    r_ll = ll.train_step(items, policy_version=3)
    for g1, g2 in zip(_grads(rec), _grads(ll), strict=True):
        assert torch.allclose(g1, g2, rtol=1e-5, atol=1e-9)  # behav is stored as float32
    assert r_ll.metrics["actor/entropy"] > 0


def _params(actor: PPOActor) -> list[torch.Tensor]:
    return [p.detach().clone() for p in actor.model.parameters()]


def _same_step(a: dict[str, float], b: dict[str, float], rel: float = 1e-9) -> None:
    timing = {"actor/step_time_s", "actor/tokens_per_s"}
    assert a.keys() == b.keys()
    for k in a.keys() - timing:
        assert a[k] == pytest.approx(b[k], rel=rel, abs=1e-12), k


@pytest.mark.parametrize("extra", LOSS_CONFIGS + [{"prox_logp_method": "metrics"}],
                         ids=["ppo", "gspo+entropy", "sapo+m2po", "cispo+rs", "metrics"])
@pytest.mark.parametrize("n_minibatches", [1, 2])
def test_first_minibatch_prox_from_training_forward_equals_recompute(extra, n_minibatches):
    # The first minibatch's training forward runs on the pre-update weights, so its
    # detached logprobs are pi_prox: the step (metrics and updated weights) must equal
    # the one with a separate no-grad pi_prox forward for every micro-batch.
    kw = dict(extra, mb_max_tokens=16, ppo_n_minibatches=n_minibatches)
    fast, forced = _actor(**kw), _actor(**kw)
    forced.prox_from_training_forward = False
    r_fast = fast.train_step(_items(), policy_version=3)
    r_forced = forced.train_step(_items(), policy_version=3)
    assert r_fast.metrics["actor/micro_batches"] >= 3
    _same_step(r_fast.metrics, r_forced.metrics)
    for p1, p2 in zip(_params(fast), _params(forced), strict=True):
        assert torch.allclose(p1, p2, rtol=1e-9, atol=1e-12)


def _count_forwards(actor: PPOActor) -> list[int]:
    calls = [0]
    actor.forward_module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("cfg, per_mb", [
    ({}, 1),  # one forward per micro-batch: no separate pi_prox pass
    ({"prox_logp_method": "loglinear"}, 1),
    ({"recompute_logprob": False}, 1),
    ({"m2_threshold": 0.5}, 2),  # step-wide M2PO mask needs every pi_prox up front
])
def test_forward_passes_per_step(cfg, per_mb):
    actor = _actor(mb_max_tokens=16, **cfg)
    calls = _count_forwards(actor)
    m = actor.train_step(_items(), policy_version=3).metrics
    assert calls[0] == per_mb * m["actor/micro_batches"]
    assert m["actor/entropy"] > 0  # reported from the training forward when no pi_prox pass
    # Two minibatches under recompute: the second one's pi_prox needs its own forward.
    actor = _actor(mb_max_tokens=16, ppo_n_minibatches=2)
    calls = _count_forwards(actor)
    m = actor.train_step(_items()).metrics
    n_mbs = int(m["actor/micro_batches"])
    assert calls[0] == n_mbs + n_mbs // 2


def test_loglinear_is_exact_in_the_first_minibatch():
    # Stale tokens and random behaviour logprobs: the loglinear formula would be far off,
    # but with one minibatch every pi_prox comes from the pre-update training forward.
    items = _items(version=3)
    rec, ll = _actor(mb_max_tokens=16), _actor(mb_max_tokens=16, prox_logp_method="loglinear")
    r_rec, r_ll = rec.train_step(items), ll.train_step(items, policy_version=5)
    _same_step(r_rec.metrics, r_ll.metrics)
    for p1, p2 in zip(_params(rec), _params(ll), strict=True):
        assert torch.allclose(p1, p2, rtol=1e-9, atol=1e-12)
    # With two minibatches the second one uses the approximation: the results differ.
    kw = dict(mb_max_tokens=16, ppo_n_minibatches=2)
    rec, ll = _actor(**kw), _actor(prox_logp_method="loglinear", **kw)
    rec.train_step(items)
    ll.train_step(items, policy_version=5)
    assert not all(torch.allclose(p1, p2) for p1, p2 in zip(_params(rec), _params(ll)))


def test_metrics_method_reports_loglinear_error():
    items = _items(version=3)
    for it in items:
        it.versions = [3] * len(it.versions)
    actor = _actor(prox_logp_method="metrics")
    _exact_behaviour(actor, items)
    m = actor.train_step(items, policy_version=3).metrics
    assert m["actor/prox_loglinear_abs_err"] < 1e-6  # float32 rounding of behav only
    # Random behaviour logprobs: alpha = 0 -> approx = behav, error = mean |behav - prox| > 0
    m = _actor(prox_logp_method="metrics").train_step(_items(version=3), policy_version=3).metrics
    assert m["actor/prox_loglinear_abs_err"] > 0.1


@pytest.mark.parametrize("cfg, key", [
    ({"importance_sampling_level": "sequence"}, "actor/clip_ratio"),
    ({"use_sapo_loss": True}, "actor/sapo_gate_mean"),
    ({"use_cispo_loss": True, "eps_clip_higher": 0.28}, "actor/clip_ratio"),
    ({"m2_threshold": 0.04}, "actor/m2po_masked_ratio"),
    ({"rejection_sampling": RejectionSamplingConfig(lower=0.5, upper=2.0)}, "actor/rejection_ratio"),
    ({"rejection_sampling": RejectionSamplingConfig(metric="binary_kl", upper=0.1)}, "actor/rejection_ratio"),
    ({"rejection_sampling": RejectionSamplingConfig(action="clamp", upper=2.0)}, "actor/rejection_ratio"),
    ({"entropy_coeff": 0.01}, "actor/policy_entropy"),
    ({"prox_logp_method": "loglinear", "m2_threshold": 0.04}, "actor/m2po_masked_ratio"),
    ({"eps_clip_higher": 0.28, "c_clip": 3.0, "ppo_n_minibatches": 2}, "actor/dual_clip_ratio"),
])
def test_every_loss_config_trains(cfg, key):
    actor = _actor(mb_max_tokens=16, **cfg)
    before = [p.detach().clone() for p in actor.model.parameters()]
    m = actor.train_step(_items(), policy_version=3).metrics
    assert key in m
    assert all(math.isfinite(v) for v in m.values()), m
    assert any(not torch.equal(a, p) for a, p in zip(before, actor.model.parameters()))


@pytest.mark.parametrize("cfg, message", [
    ({"loss_agg_mode": "seq-mean"}, "loss_agg_mode"),
    ({"loss_agg_mode": "seq-mean-token-sum-norm"}, "loss_agg_max_tokens"),
    ({"importance_sampling_level": "group"}, "importance_sampling_level"),
    ({"use_sapo_loss": True, "use_cispo_loss": True, "eps_clip_higher": 4.0}, "exclude"),
    ({"use_cispo_loss": True}, "eps_clip_higher"),
    ({"use_cispo_loss": True, "eps_clip_higher": 4.0, "importance_sampling_level": "sequence"},
     "token level"),
    ({"eps_clip": 1.0}, "eps_clip"),
    ({"sapo_tau_neg": 0.0}, "sapo_tau"),
    ({"m2_threshold": 0.0}, "m2_threshold"),
    ({"behav_imp_weight_cap": 5.0, "rejection_sampling": RejectionSamplingConfig()}, "set one"),
    ({"prox_logp_method": "guess"}, "prox_logp_method"),
    ({"prox_logp_method": "loglinear", "recompute_logprob": False}, "recompute_logprob"),
    ({"recompute_logprob": False, "m2_threshold": 0.04}, "m2_threshold .*could never fire"),
    ({"recompute_logprob": False, "behav_imp_weight_cap": 5.0}, "behav_imp_weight_cap .*never"),
    ({"recompute_logprob": False, "rejection_sampling": RejectionSamplingConfig()},
     "rejection_sampling .*never"),
    ({"entropy_coeff": -0.1}, "entropy_coeff"),
])
def test_actor_config_validation(cfg, message):
    with pytest.raises(ConfigError, match=message):
        ActorConfig(**cfg)


@pytest.mark.parametrize("cfg, message", [
    ({"level": "batch"}, "level"),
    ({"action": "drop"}, "action"),
    ({"metric": "kl"}, "metric"),
    ({"agg": "median"}, "agg"),
    ({"upper": 1.0}, "upper"),
    ({"lower": 3.0, "upper": 2.0}, "lower"),
    ({"metric": "kl_k3", "action": "clamp"}, "clamp"),
    ({"metric": "kl_k2", "upper": 0.0}, "upper"),
])
def test_rejection_sampling_config_validation(cfg, message):
    with pytest.raises(ConfigError, match=message):
        RejectionSamplingConfig(**cfg)
