"""The sharded trainer (FSDP2, trainers/fsdp_actor.py) on the CPU: two gloo ranks give
the same loss and gradients as one process on the same batch, and its sharded
checkpoint restores a step exactly.

Tolerances (stated): fp32 on both sides, the loss within 1e-6 relative and every
gradient element within 1e-6 + 1e-4 x its magnitude (only the summation order differs:
seen ~1e-8); bf16 compute (FSDP2 mixed precision) against the fp32 process: the loss
within 5% and the whole gradient's cosine similarity >= 0.99. The gathered weights after
the Adam step: within 1e-4 (Adam's normalisation amplifies the gradients' 1e-8).

The two ranks are two processes running tests/unit/fsdp_worker.py (torchrun's
environment on 127.0.0.1); one run serves every assertion here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import fsdp_worker as worker  # noqa: E402

from tapioca.trainers.fsdp_actor import plan_shards  # noqa: E402
from tapioca.trainers.ppo_actor import PPOActor, _split  # noqa: E402

# Per-minibatch maxima and counts depend on how the step is cut into micro-batches.
NOT_COMPARED = {"actor/importance_weight_max_mean", "actor/micro_batches", "actor/step_time_s",
                "actor/tokens_per_s", "actor/fsdp_dummy_micro_batches", "actor/fsdp_world_size"}


# ---------------------------------------------------------------------------- the plan


def test_plan_gives_every_rank_the_same_number_of_micro_batches_and_every_item_once():
    lengths = [5, 7, 3, 9, 2, 8, 4, 11, 6]
    for world in (1, 2, 3, 4):
        for n_mb in (1, 2, 3):
            plan = plan_shards(lengths, world, 16, n_mb)
            assert len({len(p) for p in plan}) == 1
            items = sorted(i for p in plan for g in p for i in g)
            assert items == list(range(len(lengths)))


def test_plan_keeps_one_process_minibatches():
    """Rank-local micro-batch j is in minibatch j % n (PPOActor's split), and minibatch m
    holds the sequences one process puts in it."""
    from tapioca.trainers.batching import pack

    lengths = [5, 7, 3, 9, 2, 8, 4, 11, 6, 3]
    groups = pack(lengths, 16)
    one = [sorted(i for g in groups[m::2] for i in g) for m in range(2)]
    plan = plan_shards(lengths, 2, 16, 2)
    for m in range(2):
        ranks = [sorted(i for r in plan for j in _split(list(range(len(r))), 2)[m] for i in r[j])]
        assert ranks[0] == one[m]


def test_fewer_sequences_than_ranks_get_dummies():
    plan = plan_shards([5], 3, 16, 1)
    assert plan == [[[0]], [[]], [[]]]


# ---------------------------------------------------------------------------- 2 ranks


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return worker.run_two_ranks(worker.__file__, tmp_path_factory.mktemp("fsdp"))


def _one_process(agg_mode: str):
    torch.set_num_threads(1)
    actor = PPOActor(worker.make_model(), worker.make_cfg(loss_agg_mode=agg_mode),
                     temperature=1.0, pad_token_id=0)
    result = actor.train_step(worker.make_items(0), policy_version=0)
    return actor, result


@pytest.mark.parametrize("scenario,agg_mode", [("fp32_token", "token-mean"),
                                               ("fp32_seq", "seq-mean-token-mean")])
def test_two_gloo_ranks_equal_one_process(two_ranks, scenario, agg_mode):
    results, tensors = two_ranks
    actor, one = _one_process(agg_mode)
    sharded = results[scenario]["metrics"]
    for key, value in one.metrics.items():
        if key in NOT_COMPARED:
            continue
        assert sharded[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
    assert sharded["actor/trained_tokens"] == one.metrics["actor/trained_tokens"]
    # The trainer role applies a step (a new version) only for applied minibatches.
    assert results[scenario]["applied"] == one.applied_minibatches >= 1
    assert results[scenario]["skipped"] == one.skipped_minibatches == 0
    for name, p in actor.model.named_parameters():
        torch.testing.assert_close(tensors[f"{scenario}.grad.{name}"], p.grad, atol=1e-6, rtol=1e-4)
    # The published (gathered) weights after the step: every key of a plain state dict.
    # Adam divides by sqrt(v): elements with a near-zero gradient turn its ~1e-8
    # differences into up to ~1e-5 of the step (lr 1e-2), hence 1e-4 here.
    own = actor.model.state_dict()
    assert {k.split(".w1.", 1)[1] for k in tensors if k.startswith(f"{scenario}.w1.")} == set(own)
    for name, value in own.items():
        torch.testing.assert_close(tensors[f"{scenario}.w1.{name}"], value, atol=1e-4, rtol=1e-4)


def test_bf16_compute_stays_close_to_fp32(two_ranks):
    results, tensors = two_ranks
    actor, one = _one_process("token-mean")
    loss = results["bf16_token"]["metrics"]["actor/loss"]
    assert loss == pytest.approx(one.metrics["actor/loss"], rel=0.05)
    names = [n for n, _ in actor.model.named_parameters()]
    ours = torch.cat([tensors[f"bf16_token.grad.{n}"].float().flatten() for n in names])
    ref = torch.cat([p.grad.flatten() for _, p in actor.model.named_parameters()])
    assert torch.nn.functional.cosine_similarity(ours, ref, dim=0) >= 0.99


def test_sharded_checkpoint_restores_the_step_exactly(two_ranks):
    results, tensors = two_ranks
    w2 = {k[3:]: v for k, v in tensors.items() if k.startswith("w2.")}
    assert w2
    for name, value in w2.items():
        assert torch.equal(tensors[f"w2again.{name}"], value), name
    assert results["restored"]["version"] == 1
    assert results["restored"]["offsets"] == {"t.samples.v1:0": 7}
    assert results["restored"]["trained_groups"] == ["g0"]
    files = results["files"]
    assert "trainer-sharded.json" in files
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) == 2, files  # one per rank
    # Nothing pickled: no DCP .metadata (pickle) file, no torch.save file.
    assert not [f for f in files if f.endswith((".metadata", ".pt", ".distcp"))], files


def test_rollback_loads_whole_weights_on_every_rank(two_ranks):
    results, _ = two_ranks
    assert results["rollback_equal"]
    assert results["adam_cleared"] == [True, True]
