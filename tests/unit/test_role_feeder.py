"""PromptFeeder as a plain function of events: head gate, numbering, recovery, epochs.

No broker: ``on_tick`` / ``handle`` / ``recover`` are called directly.
"""

from __future__ import annotations

from tapioca.bus.role import Source
from tapioca.config.schema import DatasetConfig
from tapioca.config.sections import FeederSection
from tapioca.producers.feeder import PromptFeeder, PromptRecord, head_gate_open
from tapioca.schemas.events import ProgressEvent, PromptEvent

P_SRC = Source(topic="t.progress.v1", partition=0, offset=0, broadcast=True)


def records(n: int) -> list[PromptRecord]:
    return [PromptRecord(prompt_id=f"p{i}", prompt_ids=[1, 2 + i % 20], prompt_text=f"q{i}",
                         task="synthetic", task_data={"answer": str(i)}) for i in range(n)]


def section(*, n_samples: int = 3, eta: int = 0, B: int = 4, max_epochs: int = 1,
            shuffle: bool = False, seed: int = 0, run_id: str = "r") -> FeederSection:
    ds = DatasetConfig(prompts_per_step=B, max_epochs=max_epochs, shuffle=shuffle)
    return FeederSection(train_dataset=ds, model_path="", n_samples=n_samples,
                         max_head_offpolicyness=eta, seed=seed, run_id=run_id)


def feeder(n_records: int = 100, *, eta: int = 0, B: int = 4, max_epochs: int = 1,
           shuffle: bool = False, seed: int = 0) -> PromptFeeder:
    return PromptFeeder(section(eta=eta, B=B, max_epochs=max_epochs, shuffle=shuffle, seed=seed),
                        records=records(n_records))


def progress(version: int, rejected: int = 0, rollbacks: int = 0,
             names: list[str] | None = None) -> ProgressEvent:
    return ProgressEvent(version=version, groups_rejected=rejected, rollbacks=rollbacks,
                         rejected_group_ids=list(names or []))


def psrc(offset: int) -> Source:
    return Source(topic="t.progress.v1", partition=0, offset=offset, broadcast=True)


def drain(f: PromptFeeder, state, ticks: int = 5) -> list[PromptEvent]:
    out: list[PromptEvent] = []
    for _ in range(ticks):
        out += list(f.on_tick(state, 0.0))
    return out


def test_head_gate_formula():
    # k - rejected < (eta + v + 1) * B
    assert head_gate_open(3, 0, 0, 4)
    assert not head_gate_open(4, 0, 0, 4)
    assert head_gate_open(4, 1, 0, 4)
    assert head_gate_open(4, 0, 0, 4, rejected=1)
    assert not head_gate_open(12, 0, 2, 4)
    assert head_gate_open(11, 0, 2, 4)


def test_head_gate_capacity_counts_trained_steps_not_rollback_versions():
    from tapioca.algorithms.head_gate import head_gate_capacity

    # (eta + (v - rollbacks) + 1) * B - (admitted - freed):
    # eta 1, v 5 with 1 rollback -> 4 trained steps -> (1 + 4 + 1) * 4 = 24 slots;
    # 26 admitted, 3 freed -> 23 held -> 1 left.
    assert head_gate_capacity(26, 5, 1, 4, freed=3, rollbacks=1) == 1
    # Without the rollback correction the same state would show 5 (one batch too many).
    assert head_gate_capacity(26, 5, 1, 4, freed=3) == 5
    assert head_gate_capacity(30, 0, 0, 4) == -26  # over: after a restart, say


def test_a_rollback_version_opens_no_batch():
    """Trainer at v2 (2 steps), then a rollback publishes v3 with rollbacks=1: the gate
    stays where it was at v2; the next trained step (v4, rollbacks 1) opens B more."""
    f = feeder(eta=0, B=4)
    state = f.init_state()
    f.handle(progress(2), state, P_SRC)
    assert len(drain(f, state)) == 12  # (0 + 2 + 1) * 4
    f.handle(progress(3, rollbacks=1), state, P_SRC)
    assert drain(f, state) == []
    f.handle(progress(4, rollbacks=1), state, P_SRC)
    assert len(drain(f, state)) == 4


def test_eta0_publishes_B_groups_then_waits_for_next_version():
    f = feeder(eta=0, B=4)
    state = f.init_state()
    first = drain(f, state)
    assert len(first) == 4
    assert drain(f, state) == []
    # The same version again (a re-announce) opens nothing.
    assert list(f.handle(progress(0), state, P_SRC)) == []
    assert drain(f, state) == []
    f.handle(progress(1), state, P_SRC)
    second = drain(f, state)
    assert len(second) == 4
    assert [e.group_index for e in second] == [4, 5, 6, 7]
    assert all(e.admitted_at_version == 1 for e in second)
    assert drain(f, state) == []


def test_eta2_publishes_three_steps_up_front():
    f = feeder(eta=2, B=4)
    state = f.init_state()
    assert len(drain(f, state)) == 12
    assert drain(f, state) == []


def test_groups_rejected_free_their_slots():
    f = feeder(eta=0, B=4)
    state = f.init_state()
    out = drain(f, state)
    assert len(out) == 4
    f.handle(progress(0, rejected=3, names=[e.group_id for e in out[:3]]), state, P_SRC)
    freed = drain(f, state)
    assert len(freed) == 3
    assert drain(f, state) == []
    # Named again (a trainer restart re-announces its last rejections): nothing more.
    f.handle(progress(0, rejected=3, names=[e.group_id for e in out[:3]]), state, P_SRC)
    assert drain(f, state) == []


def test_group_index_consecutive_and_group_id_unique():
    f = feeder(n_records=50, eta=1, B=5)
    state = f.init_state()
    out = drain(f, state)
    for v in range(1, 4):
        f.handle(progress(v), state, P_SRC)
        out += drain(f, state)
    assert [e.group_index for e in out] == list(range(len(out)))
    assert len(out) == (1 + 3 + 1) * 5
    assert len({e.group_id for e in out}) == len(out)
    assert all(e.n_samples == 3 for e in out)


def test_recover_resumes_k_epoch_and_position():
    f = feeder(n_records=10, eta=0, B=4, max_epochs=3, shuffle=True, seed=7)
    state = f.init_state()
    published = drain(f, state)
    for v in range(1, 4):  # 16 groups: into the second epoch
        f.handle(progress(v), state, P_SRC)
        published += drain(f, state)
    assert len(published) == 16
    last = published[-1]
    assert last.epoch == 1

    # What a continuous feeder would publish next.
    f.handle(progress(4), state, P_SRC)
    expected_next = drain(f, state)

    g = feeder(n_records=10, eta=0, B=4, max_epochs=3, shuffle=True, seed=7)
    s2 = g.init_state()
    # The recover list holds latest events, oldest first; any order must give the max k.
    g.recover(s2, [published[-2], last, published[0]])
    assert s2.next_group_index == last.group_index + 1
    assert s2.epoch == last.epoch
    assert s2.position == last.dataset_position + 1
    g.handle(progress(4), s2, P_SRC)
    resumed = drain(g, s2)
    assert [(e.group_index, e.prompt_id, e.epoch, e.dataset_position) for e in resumed] == [
        (e.group_index, e.prompt_id, e.epoch, e.dataset_position) for e in expected_next]
    assert resumed[0].group_id not in {e.group_id for e in published}


def test_recover_without_prompts_starts_at_zero():
    f = feeder()
    state = f.init_state()
    f.recover(state, [])
    assert (state.next_group_index, state.epoch, state.position) == (0, 0, 0)
    assert drain(f, state)[0].group_index == 0


def test_epochs_wrap_and_stop_at_max_epochs():
    f = feeder(n_records=3, eta=100, B=4, max_epochs=2)
    state = f.init_state()
    out = drain(f, state)
    assert [(e.epoch, e.dataset_position, e.prompt_id) for e in out] == [
        (0, 0, "p0"), (0, 1, "p1"), (0, 2, "p2"), (1, 0, "p0"), (1, 1, "p1"), (1, 2, "p2")]
    assert state.exhausted
    f.handle(progress(50), state, P_SRC)
    assert drain(f, state) == []


def test_shuffle_order_deterministic_by_seed():
    def order(seed: int) -> list[list[str]]:
        f = feeder(n_records=20, eta=100, B=4, max_epochs=2, shuffle=True, seed=seed)
        state = f.init_state()
        out = drain(f, state)
        return [[e.prompt_id for e in out if e.epoch == ep] for ep in (0, 1)]

    a, b, c = order(3), order(3), order(4)
    assert a == b
    assert a != c
    # A permutation of the dataset each epoch, and epochs shuffled differently.
    assert sorted(a[0]) == sorted(f"p{i}" for i in range(20)) == sorted(a[1])
    assert a[0] != a[1]
    assert a[0] != [f"p{i}" for i in range(20)]


def test_max_groups_per_tick_bounds_one_tick():
    f = PromptFeeder(section(n_samples=2, B=10, eta=0, run_id="run"),
                     records=records(100), max_groups_per_tick=3)
    state = f.init_state()
    assert len(list(f.on_tick(state, 0.0))) == 3
    assert len(drain(f, state, ticks=10)) == 7


# ---------------------------------------------------------------------------
# Bookkeeping only from facts the feeder can trust (issue 10).


def test_rejections_of_groups_never_admitted_free_nothing():
    """300 fake "dropped" samples (or a reward service keyed wrongly) made the trainer
    count rejections that freed head-gate slots: 58% of generation was wasted. Only
    groups this feeder admitted free a slot now."""
    f = feeder(eta=0, B=4)
    state = f.init_state()
    out = drain(f, state)
    fake = [f"fake-{i}" for i in range(300)] + ["r-g00000099", "r-g1", "other-g00000001"]
    f.handle(progress(0, rejected=303, names=fake), state, P_SRC)
    assert drain(f, state) == []
    assert state.freed == 0 and state.ignored_rejections == 303
    assert f.describe(state)["trainer_rejected"] == 303
    # A real one still frees its slot.
    f.handle(progress(0, rejected=304, names=[out[0].group_id]), state, P_SRC)
    assert len(drain(f, state)) == 1


def test_recovered_count_ignores_a_forged_far_group_index():
    """A forged prompt with group_index 10^9 plus a feeder restart shut the gate for
    good. The restarted feeder recovers k only from its own, contiguous prompt events."""
    f = feeder(n_records=10, eta=0, B=4)
    state = f.init_state()
    published = drain(f, state)
    forged = [PromptEvent(group_id="x", prompt_id="p", group_index=10**9, n_samples=3,
                          prompt_ids=[1, 2]),
              PromptEvent(group_id=f.group_id(10**9), prompt_id="p", group_index=10**9,
                          n_samples=3, prompt_ids=[1, 2]),  # its id, but nothing before it
              PromptEvent(group_id=f.group_id(9), prompt_id="p", group_index=9,
                          n_samples=3, prompt_ids=[1, 2])]  # within the dataset, still alone
    g = feeder(n_records=10, eta=0, B=4)
    s2 = g.init_state()
    g.recover(s2, published + forged)
    assert s2.next_group_index == 4
    g.handle(progress(1), s2, P_SRC)
    assert [e.group_index for e in drain(g, s2)] == [4, 5, 6, 7]


def test_freed_count_survives_a_restart_without_recounting():
    """The feeder's freed count is in its own prompt events; after a restart it reads
    the progress history again (a topic may have lost part of it) and counts
    only what came after the offset its count covers."""
    f = feeder(n_records=50, eta=0, B=4)
    state = f.init_state()
    out = drain(f, state)  # 0..3
    f.handle(progress(0, names=[out[0].group_id, out[1].group_id]), state, psrc(0))
    out += drain(f, state)  # 4, 5: stamped with freed 2, through offset 0
    assert out[-1].freed_groups == 2 and out[-1].progress_offset == 0
    f.handle(progress(1, names=[out[4].group_id]), state, psrc(1))  # after the last prompt
    assert state.freed == 3

    g = feeder(n_records=50, eta=0, B=4)
    s2 = g.init_state()
    g.recover(s2, out)
    assert (s2.next_group_index, s2.freed, s2.counted_through) == (6, 2, 0)
    # The broadcast topic from the start: offset 0 is in the recovered count, 1 is not.
    g.handle(progress(0, names=[out[0].group_id, out[1].group_id]), s2, psrc(0))
    g.handle(progress(1, names=[out[4].group_id]), s2, psrc(1))
    assert s2.freed == 3 and s2.latest_version == 1
    assert g.describe(s2)["freed"] == f.describe(state)["freed"]


def test_versions_only_go_forward_for_the_feeder():
    """An older progress event (re-published, or the trainer's own after a forged newer
    version) does not move the version back; its rejection names count."""
    f = feeder(eta=0, B=4)
    state = f.init_state()
    out = drain(f, state)
    f.handle(progress(5, rollbacks=1), state, psrc(0))
    f.handle(progress(3, names=[out[0].group_id]), state, psrc(1))
    assert (state.latest_version, state.rollbacks) == (5, 1) and state.freed == 1
    f.handle(progress(5), state, psrc(2))  # another progress event of version 5
    f.handle(progress(6, rollbacks=2), state, psrc(3))  # a rollback: a new, higher version
    assert (state.latest_version, state.rollbacks) == (6, 2)


def test_the_feeder_reads_progress_only():
    """The head gate's counts come from progress.v1; a weights event (one of an archive
    from before progress.v1 included, with its deprecated counts) moves nothing."""
    from tapioca.schemas.events import WeightsEvent

    assert PromptFeeder.broadcast_inputs == ("progress",)
    f = feeder(eta=0, B=4)
    state = f.init_state()
    out = drain(f, state)
    old = WeightsEvent(version=3, path="/w/v3", sha256="00" * 32, groups_rejected=1,
                       rejected_group_ids=[out[0].group_id])
    assert list(f.handle(old, state, psrc(0))) == []
    assert (state.latest_version, state.freed, state.progress_offset) == (0, 0, -1)
    assert drain(f, state) == []


def test_a_prompt_event_of_a_feeder_before_progress_v1_recovers_nothing_of_progress():
    # Its weights_offset counted weights.v1: no progress.v1 offset is in its freed count.
    f = feeder(eta=0, B=4)
    state = f.init_state()
    out = drain(f, state)
    old = [PromptEvent(**{**e.__dict__, "progress_offset": -1, "weights_offset": 7,
                          "freed_groups": 1}) for e in out]
    g = feeder(eta=0, B=4)
    s2 = g.init_state()
    g.recover(s2, old)
    assert (s2.next_group_index, s2.freed, s2.counted_through) == (4, 1, -1)
