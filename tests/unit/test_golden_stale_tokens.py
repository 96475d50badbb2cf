"""Stale-token masking (``actor.max_token_version_gap``, algorithms/stale_tokens.py):
golden masks derived by hand, a sequence that straddles the gap (a partial rollout across
weights switches), the counts behind ``stale_masked_ratio``, the token advantages that
ignore masked tokens (GAE / batch normalisation), and the trainer role end to end: the
metrics on its MetricsEvent and no update from an all-stale step."""

from __future__ import annotations

import math

import pytest
import torch

from tapioca.algorithms.errors import AlgorithmInputError
from tapioca.algorithms.stale_tokens import StaleCounts, stale_token_masks
from tapioca.config.schema import ActorConfig, AdvantageConfig, ModelConfig
from tapioca.config.sections import TrainerSection
from tapioca.schemas.errors import ConfigError
from tapioca.schemas.events import MetricsEvent, SampleEvent, SampleSequence
from tapioca.trainers.batching import SeqItem
from tapioca.trainers.token_advantages import TokenAdvantages


# Versions 0 1 2 3 trained at version 3. Token age = 3 - u: 3 2 1 0. Masked when age > gap.
@pytest.mark.parametrize("gap,expected", [(0, [0, 0, 0, 1]), (1, [0, 0, 1, 1]), (2, [0, 1, 1, 1]),
                                          (3, [1, 1, 1, 1]), (10, [1, 1, 1, 1])])
def test_the_gap_is_inclusive(gap, expected):
    masks, counts = stale_token_masks([[0, 1, 2, 3]], [[1, 1, 1, 1]], version=3, max_gap=gap)
    assert masks == [expected]
    assert counts.trainable == 4 and counts.masked == 4 - sum(expected)


def test_a_sequence_straddling_the_gap_keeps_its_fresh_tail_and_its_untrained_tokens_stay_out():
    # A partial rollout across two weights switches: tokens 0-2 by v4, 3-4 by v5, 5 by v6;
    # token 2 is a tool token (loss mask 0). Trained at v6 with gap 1: ages 2 2 2 1 1 0,
    # so tokens 0-2 are stale (2 > 1): 0 and 1 leave the mask, 2 was never in it.
    versions = [[4, 4, 4, 5, 5, 6],
                [6, 6],          # all fresh: untouched
                [3, 3, 4]]       # all stale (ages 3 3 2): emptied
    loss = [[1, 1, 0, 1, 1, 1], [1, 1], [1, 1, 1]]
    masks, counts = stale_token_masks(versions, loss, version=6, max_gap=1)
    assert masks == [[0, 0, 0, 1, 1, 1], [1, 1], [0, 0, 0]]
    # By hand: trainable 5 + 2 + 3 = 10; masked 2 + 0 + 3 = 5; one sequence partial, one emptied.
    assert counts == StaleCounts(active=True, trainable=10, masked=5, partial_seqs=1, emptied_seqs=1)
    assert counts.masked_ratio == 0.5
    m = counts.metrics(empty_minibatches=1, minibatches=4)
    assert m["actor/stale_masked_ratio"] == 0.5
    assert m["actor/stale_empty_minibatch_fraction"] == 0.25
    assert m["actor/stale_masked_tokens"] == 5.0
    assert m["actor/stale_partially_masked_seqs"] == 1.0 and m["actor/stale_emptied_seqs"] == 1.0


def test_off_by_default_returns_the_masks_untouched_and_reports_nothing():
    loss = [[1, 0, 1]]
    masks, counts = stale_token_masks([[0, 0, 0]], loss, version=99, max_gap=None)
    assert masks[0] is loss[0]
    assert counts.metrics(empty_minibatches=1, minibatches=1) == {}
    assert ActorConfig().max_token_version_gap is None


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_a_bad_gap_is_refused(bad):
    with pytest.raises(ConfigError, match="max_token_version_gap"):
        ActorConfig(max_token_version_gap=bad)
    with pytest.raises(AlgorithmInputError, match="max_token_version_gap"):
        stale_token_masks([[0]], [[1]], version=0, max_gap=bad)


def test_mismatched_lengths_are_refused():
    with pytest.raises(AlgorithmInputError, match="sequence 0 has 2 versions for 3"):
        stale_token_masks([[0, 0]], [[1, 1, 1]], version=0, max_gap=0)


def _item(adv: float, versions: list[int], mask: list[int]) -> SeqItem:
    n = len(versions)
    return SeqItem(group_id="g", input_ids=[1, 2] + [3] * n, prompt_len=2, behav_logprobs=[-1.0] * n,
                   versions=versions, loss_mask=mask, advantage=adv, reward=adv)


def test_batch_normalisation_and_returns_see_only_the_fresh_tokens():
    # REINFORCE++ (batch mean and std over trained tokens, discount 1, no KL): each trained
    # token's return is its sequence's scalar. Trained at v1 with gap 0:
    #   A: scalar 1, versions 0 0 1 -> only its last token trains;
    #   B: scalar 0, versions 1 1   -> both train.
    # Tokens normalised: 1, 0, 0. mean 1/3; population std sqrt(((2/3)^2 + 2 (1/3)^2) / 3)
    # = sqrt(2/9) = sqrt(2)/3; so A's token (2/3) / (sqrt(2)/3) = sqrt(2), B's -1/sqrt(2).
    # Without the mask the tokens would be 1 1 1 0 0 (mean 3/5): other numbers.
    items = [_item(1.0, [0, 0, 1], [1, 1, 1]), _item(0.0, [1, 1], [1, 1])]
    masks, _ = stale_token_masks([it.versions for it in items], [it.loss_mask for it in items],
                                 version=1, max_gap=0)
    for it, m in zip(items, masks):
        it.loss_mask = m
    section = TrainerSection(actor=ActorConfig(), advantage=AdvantageConfig(estimator="reinforce_pp", eps=0.0),
                             model=ModelConfig(), max_head_offpolicyness=1, prompts_per_step=1,
                             total_train_steps=1, temperature=1.0, run_dir="unused", seed=0,
                             stop_at_reward=None)
    adv = TokenAdvantages(section, pad_token_id=0, device="cpu")
    assert adv.active
    adv.compute(items)
    a, b = items
    assert a.token_advantages[:2] == [0.0, 0.0]  # stale: no advantage at all
    assert a.token_advantages[2] == pytest.approx(math.sqrt(2), abs=1e-6)
    assert b.token_advantages == pytest.approx([-1 / math.sqrt(2)] * 2, abs=1e-6)


def _sample(gid: str, versions: list[int]) -> SampleEvent:
    seqs = [SampleSequence(traj_id=f"{gid}:{i}", output_ids=[3 + i, 4, 5], behav_logprobs=[-2.7] * 3,
                           output_versions=list(versions), reward=float(i == 0),
                           advantage=1.0 if i == 0 else -1.0) for i in range(2)]
    return SampleEvent(group_id=gid, prompt_id=f"p-{gid}", prompt_ids=[1, 2, 4], sequences=seqs,
                       min_version=min(versions), max_version=max(versions), estimator="grpo")


def test_the_trainer_masks_reports_and_skips_the_update_of_an_all_stale_step(tmp_path):
    from test_role_trainer import make_trainer, params, src, start

    t = make_trainer(tmp_path, max_token_version_gap=0)
    try:
        state = start(t)
        # Step 1 at v0: fresh tokens, nothing masked.
        list(t.handle(_sample("a", [0, 0, 0]), state, src(0)))
        out = list(t.handle(_sample("b", [0, 0, 0]), state, src(1)))
        (m1,) = [e.metrics for e in out if isinstance(e, MetricsEvent)]
        assert m1["actor/stale_masked_ratio"] == 0.0 and state.progress.version == 1
        # Step 2 at v1: the groups straddle the gap (0 1 1): one token of three is masked.
        list(t.handle(_sample("c", [0, 1, 1]), state, src(2)))
        out = list(t.handle(_sample("d", [0, 1, 1]), state, src(3)))
        (m2,) = [e.metrics for e in out if isinstance(e, MetricsEvent)]
        assert m2["actor/stale_masked_ratio"] == pytest.approx(1 / 3)
        assert m2["actor/stale_partially_masked_seqs"] == 4.0
        assert m2["actor/stale_empty_minibatch_fraction"] == 0.0
        assert m2["actor/trained_tokens"] == 8.0  # 4 sequences x 2 fresh tokens
        # Step 3 at v2: groups made by v1 (staleness 1, within eta 1) are all stale at gap 0.
        before = params(t)
        list(t.handle(_sample("e", [1, 1, 1]), state, src(4)))
        out = list(t.handle(_sample("f", [1, 1, 1]), state, src(5)))
        (m3,) = [e.metrics for e in out if isinstance(e, MetricsEvent)]
        assert m3["actor/stale_masked_ratio"] == 1.0
        assert m3["actor/stale_emptied_seqs"] == 4.0
        assert m3["actor/stale_empty_minibatch_fraction"] == 1.0
        assert m3["actor/trained_tokens"] == 0.0
        assert all(torch.equal(before[k], v) for k, v in params(t).items())  # no gradient, no change
    finally:
        t.sink.close()
