"""RolloutWorker as a plain function of events, on a real engine (TorchEngine and the
PagedEngine the role builder picks) with a tiny random model: trajectories per prompt,
the commit floor, redelivery, and weight updates. No broker."""

from __future__ import annotations

import time

import pytest
import torch

from tapioca.bus.role import Source
from tapioca.config.schema import GenerationConfig
from tapioca.config.sections import RolloutSection
from tapioca.engines.paged_engine import PagedEngine
from tapioca.engines.torch_engine import TorchEngine
from tapioca.models.factory import build_tiny_model
from tapioca.producers.rollout import RolloutWorker
from tapioca.schemas.events import PromptEvent, TrajectoryEvent, WeightsEvent

VOCAB = 16
PROMPTS = "t.prompts.v1"
WEIGHTS = "t.weights.v1"


def tiny(seed: int) -> torch.nn.Module:
    return build_tiny_model(VOCAB, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                            intermediate_size=64, max_position_embeddings=64, seed=seed)


def decode(ids: list[int]) -> str:
    return "".join(chr(ord("a") + i) for i in ids)


class Harness:
    def __init__(self, engine_cls=TorchEngine) -> None:
        self.engine = engine_cls(tiny(0), seed=0, max_batch_size=8)
        self.new_model = tiny(1)
        self.loads: list[WeightsEvent] = []
        self.submitted: list[str] = []
        real_submit_all = self.engine.submit_all

        def counting_submit_all(requests):
            self.submitted.extend(r.request_id for r in requests)
            return real_submit_all(requests)

        self.engine.submit_all = counting_submit_all  # type: ignore[method-assign]

        def load_weights(event: WeightsEvent) -> None:
            self.loads.append(event)
            self.engine.update_weights(self.new_model.state_dict(), event.version)

        section = RolloutSection(gconfig=GenerationConfig(temperature=1.0, max_new_tokens=4), seed=0)
        self.role = RolloutWorker(section, engine=self.engine, load_weights=load_weights,
                                  decode=decode)
        self.state = self.role.init_state()

    def collect(self, n: int, timeout_s: float = 10.0) -> list[TrajectoryEvent]:
        out: list[TrajectoryEvent] = []
        deadline = time.monotonic() + timeout_s
        while len(out) < n:
            assert time.monotonic() < deadline, f"only {len(out)} of {n} trajectories in {timeout_s} s"
            out += [e for e in self.role.on_tick(self.state, time.time())
                    if isinstance(e, TrajectoryEvent)]
            time.sleep(0.002)
        return out


@pytest.fixture(params=["torch", "paged"])
def h(request):
    harness = Harness({"torch": TorchEngine, "paged": PagedEngine}[request.param])
    yield harness
    harness.role.on_stop(harness.state)


def prompt(gid: str, n: int = 3, k: int = 0) -> PromptEvent:
    return PromptEvent(group_id=gid, prompt_id=f"p-{gid}", group_index=k, n_samples=n,
                       prompt_ids=[1, 5, 7], task="synthetic", task_data={"answer": "x"})


def psrc(offset: int, partition: int = 0) -> Source:
    return Source(topic=PROMPTS, partition=partition, offset=offset, key="g")


def wsrc(offset: int) -> Source:
    return Source(topic=WEIGHTS, partition=0, offset=offset, broadcast=True)


def weights(version: int) -> WeightsEvent:
    return WeightsEvent(version=version, path=f"/w/v{version}.safetensors", sha256="00" * 32)


def test_prompt_gives_n_trajectories(h):
    assert list(h.role.handle(prompt("g0"), h.state, psrc(0))) == []
    trajs = h.collect(3)
    assert sorted(t.traj_id for t in trajs) == ["g0:0", "g0:1", "g0:2"]
    for t in trajs:
        assert t.group_id == "g0" and t.group_size == 3 and t.prompt_id == "p-g0"
        assert t.traj_id == f"g0:{t.sample_index}"
        assert t.prompt_ids == [1, 5, 7]
        assert 1 <= len(t.output_ids) <= 4
        assert len(t.output_ids) == len(t.output_logprobs) == len(t.output_versions)
        assert all(v == 0 for v in t.output_versions)
        assert all(lp <= 0 for lp in t.output_logprobs)
        assert all(0 <= i < VOCAB for i in t.output_ids)
        assert t.output_text == decode(t.output_ids)
        assert t.task_data == {"answer": "x"}
    # Nothing more comes for this group.
    time.sleep(0.05)
    assert [e for e in h.role.on_tick(h.state, time.time()) if isinstance(e, TrajectoryEvent)] == []
    assert h.state.inflight == {}


def test_committable_holds_prompt_until_all_published(h):
    h.engine.pause()  # nothing finishes until resume: the hold is observable
    h.role.handle(prompt("g0"), h.state, psrc(5))
    h.role.handle(prompt("g1"), h.state, psrc(6))
    assert h.role.on_tick(h.state, time.time()) == []
    assert h.role.committable(h.state, PROMPTS, 0, 7) == 5
    assert h.role.committable(h.state, PROMPTS, 1, 3) == 3  # other partition: not held
    h.engine.resume()
    seen: list[TrajectoryEvent] = []
    deadline = time.monotonic() + 10
    while len(seen) < 6:
        assert time.monotonic() < deadline
        before = {t.traj_id for t in seen}
        g0_done = sum(t.group_id == "g0" for t in seen) == 3
        if not g0_done:
            assert h.role.committable(h.state, PROMPTS, 0, 7) == 5
        elif len(seen) < 6:
            assert h.role.committable(h.state, PROMPTS, 0, 7) == 6
        seen += [e for e in h.role.on_tick(h.state, time.time())
                 if isinstance(e, TrajectoryEvent) and e.traj_id not in before]
        time.sleep(0.002)
    assert len({t.traj_id for t in seen}) == 6
    assert h.role.committable(h.state, PROMPTS, 0, 7) == 7


def test_redelivered_prompt_submits_nothing(h):
    h.role.handle(prompt("g0"), h.state, psrc(0))
    assert h.submitted == ["g0:0", "g0:1", "g0:2"]
    # Redelivered while in flight and after completion: no new requests.
    assert list(h.role.handle(prompt("g0"), h.state, psrc(0))) == []
    trajs = h.collect(3)
    assert list(h.role.handle(prompt("g0"), h.state, psrc(1))) == []
    time.sleep(0.05)
    more = [e for e in h.role.on_tick(h.state, time.time()) if isinstance(e, TrajectoryEvent)]
    assert h.submitted == ["g0:0", "g0:1", "g0:2"]
    assert len(trajs) == 3 and more == []
    assert h.role.committable(h.state, PROMPTS, 0, 2) == 2


def test_new_weights_load_on_next_tick_and_later_tokens_carry_version(h):
    assert list(h.role.handle(weights(0), h.state, wsrc(0))) == []  # the version it has
    assert h.state.pending_weights is None
    assert list(h.role.handle(weights(1), h.state, wsrc(1))) == []
    assert h.loads == [] and h.engine.version == 0
    h.role.on_tick(h.state, time.time())
    assert [e.version for e in h.loads] == [1]
    assert h.engine.version == 1 and h.state.loaded_version == 1
    # The weights really are the new model's.
    new = h.new_model.state_dict()
    paged = getattr(h.engine, "decoder", None)
    eng = paged.hf_state_dict() if paged is not None else h.engine.model.state_dict()
    assert all(torch.equal(eng[k], new[k]) for k in new)
    # A re-announce of the loaded version loads nothing.
    h.role.handle(weights(1), h.state, wsrc(2))
    h.role.on_tick(h.state, time.time())
    assert len(h.loads) == 1
    h.role.handle(prompt("g1"), h.state, psrc(0))
    trajs = h.collect(3)
    assert all(v == 1 for t in trajs for v in t.output_versions)


def test_only_newest_of_several_versions_is_loaded(h):
    for v in (1, 2, 3):
        h.role.handle(weights(v), h.state, wsrc(v))
    h.role.on_tick(h.state, time.time())
    assert [e.version for e in h.loads] == [3]
    assert h.engine.version == 3


def test_impossible_prompt_is_refused_again_on_redelivery(h):
    # prompt (61) + max_new_tokens (4) > max_position_embeddings (64): the engine refuses.
    # No retry can fix it: BadEventError, dead-lettered at once by the bus (it used to be
    # retried with 0.6 s of sleep per bad prompt). A redelivery must be refused again, not
    # be taken for a group already in flight.
    from tapioca.schemas.errors import BadEventError

    too_long = PromptEvent(group_id="big", prompt_id="p", group_index=0, n_samples=2,
                           prompt_ids=[1] * 61)
    for _ in range(2):
        with pytest.raises(BadEventError, match="prompt big cannot be generated: .*"
                           "max_position_embeddings"):
            h.role.handle(too_long, h.state, psrc(0))
    assert h.state.inflight == {}
    assert h.role.committable(h.state, PROMPTS, 0, 1) == 1


@pytest.mark.parametrize("changes, message", [
    ({"prompt_ids": [1, VOCAB + 3]}, "outside"),
    ({"prompt_ids": []}, "empty prompt"),
    ({"n_samples": 0}, "n_samples is 0"),
])
def test_bad_prompt_is_refused_at_once(h, changes, message):
    from tapioca.schemas.errors import BadEventError

    bad = prompt("bad")
    for key, value in changes.items():
        setattr(bad, key, value)
    with pytest.raises(BadEventError, match=message):
        h.role.handle(bad, h.state, psrc(0))
    assert h.state.inflight == {} and h.submitted == []
    # The worker goes on.
    h.role.handle(prompt("g1", n=1), h.state, psrc(1))
    assert len(h.collect(1)) == 1


def test_prompt_waits_for_the_version_it_was_admitted_under(h):
    # The feeder admitted this group after seeing version 1; the worker still has v0.
    early = prompt("g-early", n=2)
    early.admitted_at_version = 1
    assert list(h.role.handle(early, h.state, psrc(3))) == []
    assert h.submitted == [] and h.loads == []
    assert list(h.role.on_tick(h.state, time.time())) == []
    assert h.submitted == [], "generation must not start on weights older than the admission"
    assert h.role.committable(h.state, PROMPTS, 0, 4) == 3
    # The weights event arrives: loaded on the next tick, then the prompt starts.
    h.role.handle(WeightsEvent(version=1, path="/w", sha256="x"), h.state,
                  Source(WEIGHTS, 0, 0, broadcast=True))
    trajs = h.collect(2)
    assert [e.version for e in h.loads] == [1]
    assert all(v == 1 for t in trajs for v in t.output_versions)
    assert h.role.committable(h.state, PROMPTS, 0, 4) == 4


def test_trajectories_carry_the_wall_clock_facts_of_their_submit_and_weights_switch(h):
    """What the step timeline (ops/timeline.py) reads: when the group was submitted, and
    the weights it waited for: when their event arrived and when they were loaded."""
    t_before = time.time()
    first = prompt("g-v0", n=1)
    h.role.handle(first, h.state, psrc(0))
    (t0,) = h.collect(1)
    assert t_before <= t0.timings["submitted_at"] <= time.time()
    assert "weights_version" not in t0.timings  # no switch yet
    late = prompt("g-v1", n=2)
    late.admitted_at_version = 1
    h.role.handle(late, h.state, psrc(1))
    arrived = time.time()
    h.role.handle(weights(1), h.state, wsrc(0))
    trajs = h.collect(2)
    for t in trajs:
        tm = t.timings
        assert tm["weights_version"] == 1.0
        assert arrived <= tm["weights_received_at"] <= tm["weights_loaded_at"] <= tm["submitted_at"]
        assert 0 <= tm["weights_switch_s"] <= tm["weights_loaded_at"] - tm["weights_received_at"] + 1e-6
        assert tm["queued_s"] >= 0 and tm["generate_s"] >= 0  # the engine's own, kept


def test_pending_weights_are_loaded_before_a_prompt_that_needs_them(h):
    h.role.handle(WeightsEvent(version=1, path="/w", sha256="x"), h.state,
                  Source(WEIGHTS, 0, 0, broadcast=True))
    p = prompt("g-now", n=2)
    p.admitted_at_version = 1
    h.role.handle(p, h.state, psrc(0))
    # Loaded on the tick (the runner ticks right after handling), never inside handle:
    # a load that fails is the weights event's fault, not this prompt's.
    assert h.loads == [] and h.submitted == []
    h.role.on_tick(h.state, time.time())
    assert [e.version for e in h.loads] == [1] and len(h.submitted) == 2
    trajs = h.collect(2)
    assert all(v == 1 for t in trajs for v in t.output_versions)


def test_restart_loads_only_the_newest_weights_and_skips_the_replayed_history(h):
    history = [WeightsEvent(version=v, path=f"/w{v}", sha256="x") for v in (1, 2, 3)]
    h.role.recover(h.state, history)
    # The broadcast topic is replayed from the start: older versions must not load
    # (their files may be gone), the recovered newest one loads once.
    for i, ev in enumerate(history):
        assert list(h.role.handle(ev, h.state, Source(WEIGHTS, 0, i, broadcast=True))) == []
    h.role.on_tick(h.state, time.time())
    assert [e.version for e in h.loads] == [3]
    newer = WeightsEvent(version=4, path="/w4", sha256="x")
    h.role.handle(newer, h.state, Source(WEIGHTS, 0, 3, broadcast=True))
    h.role.on_tick(h.state, time.time())
    assert [e.version for e in h.loads] == [3, 4]


# ---------------------------------------------------------------------------
# Weights faults and versions (issue 10).


def test_weights_that_cannot_load_are_named_for_the_bus_and_the_worker_goes_on(h):
    """A weights event whose file is missing (or fails its checksum) killed the worker
    from on_tick. Now the tick raises BadEventError naming that event (the bus retries,
    then dead-letters it and calls on_dead_letter); the worker keeps its version."""
    from tapioca.schemas.errors import BadEventError

    real = h.role.load_weights

    def missing(event):
        raise FileNotFoundError(f"no such file: {event.path}")

    h.role.load_weights = missing
    bad = weights(1)
    src = wsrc(7)
    h.role.handle(bad, h.state, src)
    for _ in range(2):  # every retry names the same event, with where it was read
        with pytest.raises(BadEventError, match="weights version 1 .* cannot be loaded: "
                           "FileNotFoundError.*stays on version 0") as info:
            h.role.on_tick(h.state, time.time())
        assert info.value.event is bad and info.value.source == src and info.value.retryable
    h.role.on_dead_letter(h.state, bad, info.value)
    assert h.state.pending_weights is None and h.state.loaded_version == 0
    assert h.role.describe(h.state)["weights_dead_lettered"] == 1
    # It goes on: generates on version 0, and loads the next good version.
    h.role.handle(prompt("g0", n=1), h.state, psrc(0))
    (t,) = h.collect(1)
    assert set(t.output_versions) == {0}
    h.role.load_weights = real
    h.role.handle(weights(2), h.state, wsrc(8))
    h.role.on_tick(h.state, time.time())
    assert h.state.loaded_version == 2 and [e.version for e in h.loads] == [2]


def test_versions_only_go_forward(h):
    """A re-published old weights event rolled the fleet back (26 -> 23). Now an older
    version is refused (dead-lettered), the same one is a no-op, and a rollback, which
    is a new higher version with rollback_of set, loads."""
    from tapioca.schemas.errors import BadEventError

    h.role.handle(weights(3), h.state, wsrc(0))
    h.role.on_tick(h.state, time.time())
    assert h.state.loaded_version == 3
    with pytest.raises(BadEventError, match="weights version 2 is older than version 3"):
        h.role.handle(weights(2), h.state, wsrc(1))
    assert list(h.role.handle(weights(3), h.state, wsrc(2))) == []  # a re-announcement
    assert h.state.pending_weights is None
    # Between the loaded and a pending version: a fallback, superseded once 5 loads.
    h.role.handle(weights(5), h.state, wsrc(3))
    assert list(h.role.handle(weights(4), h.state, wsrc(4))) == []
    assert h.state.pending_weights.version == 5
    h.role.on_tick(h.state, time.time())
    assert [e.version for e in h.loads] == [3, 5] and h.state.candidates == []
    rollback = WeightsEvent(version=6, path="/w/v6", sha256="00" * 32, rollback_of=1)
    h.role.handle(rollback, h.state, wsrc(5))
    h.role.on_tick(h.state, time.time())
    assert [e.version for e in h.loads] == [3, 5, 6] and h.state.loaded_version == 6


def test_restart_follows_the_highest_version_not_a_replayed_old_one(h):
    history = [weights(v) for v in (1, 2, 3)]
    replay = weights(1)
    replay.produced_at = history[-1].produced_at + 10  # re-published later
    h.role.recover(h.state, history + [replay])
    h.role.on_tick(h.state, time.time())
    assert [e.version for e in h.loads] == [3]


def _failing_on_missing(h):
    real = h.role.load_weights

    def load(event):
        if "missing" in event.path:
            raise FileNotFoundError(event.path)
        real(event)

    h.role.load_weights = load


def _claim(version: int, sha: str, path: str = "") -> WeightsEvent:
    return WeightsEvent(version=version, path=path or f"/w/v{version}-{sha}", sha256=sha * 64)


def test_a_forged_claim_of_the_pending_version_does_not_hide_the_genuine_one(h):
    """Two events claim version 1: a forged one (missing file) first, then the genuine
    one. The forged one fails, is dead-lettered, and the genuine one is loaded instead
    of being ignored as a re-announcement (with eta 0 that lost version deadlocks)."""
    from tapioca.bus.role import DeadLetter
    from tapioca.schemas.errors import BadEventError

    _failing_on_missing(h)
    forged, genuine = _claim(1, "a", "/missing/v1"), _claim(1, "b")
    h.role.handle(forged, h.state, wsrc(0))
    with pytest.raises(BadEventError) as info:
        h.role.on_tick(h.state, time.time())
    assert list(h.role.handle(genuine, h.state, wsrc(1))) == []
    h.role.on_dead_letter(h.state, forged, info.value)
    h.role.on_tick(h.state, time.time())
    assert h.state.loaded_version == 1 and [e.path for e in h.loads] == [genuine.path]
    # A claim that arrives after the genuine one is loaded conflicts: refused.
    with pytest.raises(BadEventError, match="conflicts with the loaded weights"):
        h.role.handle(_claim(1, "c"), h.state, wsrc(2))
    # The genuine one again (a re-announcement): nothing.
    assert list(h.role.handle(genuine, h.state, wsrc(3))) == []
    # Genuine first and still pending, then a forged claim: the genuine one loads and the
    # forged one is dead-lettered as a conflict.
    h.role.handle(_claim(2, "d"), h.state, wsrc(4))
    h.role.handle(_claim(2, "e", "/missing/v2"), h.state, wsrc(5))
    (dead,) = [e for e in h.role.on_tick(h.state, time.time()) if isinstance(e, DeadLetter)]
    assert dead.event.path == "/missing/v2" and dead.source == wsrc(5)
    assert h.state.loaded_version == 2


def test_a_version_that_failed_to_load_and_is_superseded_is_dead_lettered(h):
    from tapioca.bus.role import DeadLetter
    from tapioca.schemas.errors import BadEventError

    _failing_on_missing(h)
    bad = _claim(1, "a", "/missing/v1")
    h.role.handle(bad, h.state, wsrc(0))
    with pytest.raises(BadEventError):
        h.role.on_tick(h.state, time.time())
    (dead,) = h.role.handle(_claim(2, "b"), h.state, wsrc(1))
    assert isinstance(dead, DeadLetter) and dead.event is bad and "superseded" in str(dead.error)
    h.role.on_tick(h.state, time.time())
    assert h.state.loaded_version == 2


def test_a_forged_newer_version_neither_hides_a_lower_genuine_one_nor_its_reannouncements(h):
    """A forged version v+1 that cannot load must not make the genuine re-announcements
    of v "older" (they were dead-lettered), nor make the worker skip the genuine v+1."""
    from tapioca.schemas.errors import BadEventError

    _failing_on_missing(h)
    h.role.handle(_claim(1, "a"), h.state, wsrc(0))
    h.role.on_tick(h.state, time.time())
    forged = _claim(3, "f", "/missing/v3")
    h.role.handle(forged, h.state, wsrc(1))
    with pytest.raises(BadEventError) as info:
        h.role.on_tick(h.state, time.time())
    assert list(h.role.handle(_claim(1, "a"), h.state, wsrc(2))) == []  # re-announcement
    assert list(h.role.handle(_claim(2, "b"), h.state, wsrc(3))) == []  # genuine, lower
    h.role.on_dead_letter(h.state, forged, info.value)
    h.role.on_tick(h.state, time.time())
    assert h.state.loaded_version == 2 and h.state.candidates == []
