"""The fuzzer of benchmarks/fuzz_loop.py without a broker: it forges as a client of the
bus that does not hold the run's key, and its rounds end by half the run.

It used to publish with the run's own config, into which the Launcher had written the
key path: its forged "next version" weights events were signed with the run's key, so
they verified, and one sent after the trainer's last version moved the feeder's head
gate one batch past the bound (tests/e2e/test_fuzz_loop.py). Its rounds were paced in
seconds, so on a fast box the last ones went out after the trainer had stopped reading."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tapioca.bus.reader import Record
from tapioca.bus.role import Source
from tapioca.bus.settings import BusConfig
from tapioca.bus.signing import SIGNATURE_HEADER, SignatureError, create_key_file
from tapioca.config.schema import DatasetConfig
from tapioca.config.sections import FeederSection
from tapioca.producers.feeder import PromptFeeder, PromptRecord
from tapioca.schemas import encode_event, topic
from tapioca.schemas.events import ProgressEvent, WeightsEvent

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "fuzz_loop.py"


@pytest.fixture(scope="module")
def fl():
    spec = importlib.util.spec_from_file_location("fuzz_loop_unit", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["fuzz_loop_unit"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def run_bus(tmp_path, monkeypatch):
    """The bus section as the Launcher leaves it: the run's key path written into it."""
    monkeypatch.delenv("TAPIOCA_SIGNING_KEY_FILE", raising=False)
    key = tmp_path / "run" / "secrets" / "bus.key"
    create_key_file(key)
    return BusConfig(bootstrap_servers="127.0.0.1:9", topic_prefix="fz", run_id="fuzz.t0",
                     signing_key_path=str(key))


def genuine_weights(bus: BusConfig, versions: int) -> list[Record]:
    """The trainer's signed weights records for versions 0..versions-1."""
    spec = topic("weights")
    out = []
    for v in range(versions):
        ev = WeightsEvent(version=v, path=f"/run/weights/v{v:06d}.safetensors",
                          sha256=f"{v:064x}", producer_id="trainer-0", run_id=bus.run_id)
        raw = encode_event(ev)
        headers = [(SIGNATURE_HEADER, bus.signing_key().sign(raw))]
        out.append(Record(Source(bus.topic(spec), 0, v, bus.run_id), raw, ev, None, headers))
    return out


def genuine_progress(bus: BusConfig, versions: int) -> list[ProgressEvent]:
    """The trainer's progress events for versions 0..versions-1."""
    return [ProgressEvent(version=v, group_ids=[f"fuzz.t0-g{v:08d}"] if v else [],
                          producer_id="trainer-0", run_id=bus.run_id) for v in range(versions)]


def fuzzer(fl, bus: BusConfig):
    return fl.Fuzzer(bus, vocab_size=32, max_positions=64, schedule=[3, 6])


def test_the_fuzzer_publishes_without_the_run_key(fl, run_bus):
    fz = fuzzer(fl, run_bus)
    assert run_bus.signing_key() is not None  # it still reads (verifies) with it
    assert fz.bus.signing_key() is None
    assert fz.bus.bootstrap_servers == run_bus.bootstrap_servers
    assert fz.bus.run_id == run_bus.run_id


def test_forged_weights_and_commands_fail_the_run_key_and_leave_the_head_gate(fl, run_bus):
    fz = fuzzer(fl, run_bus)
    genuine = genuine_weights(run_bus, 8)
    out = fz.build_round(0, genuine)
    assert {o.kind for o in out} == set(fl.KINDS) - {"weights_next_bad_sha256"}  # round 1's
    signed = [o for o in out if topic(o.topic).signed and o.kind != "garbage"]
    verdict = {}
    for o in signed:
        try:
            run_bus.verify(topic(o.topic), o.value, o.headers)
            verdict[o.kind] = "verifies"
        except SignatureError:
            verdict[o.kind] = "refused"
    assert verdict == {
        "weights_replayed_old": "verifies",  # a byte-for-byte copy; the version is old
        "weights_next_unsigned": "refused",
        "weights_next_other_key": "refused",
        "weights_next_missing_file": "verifies",  # a key holder's broken event
        "progress_next_unsigned": "refused",
        "progress_next_other_key": "refused",
        "control_unsigned_pause": "refused",
    }
    replay = next(o for o in out if o.kind == "weights_replayed_old")
    assert replay.value == genuine[0].raw and replay.original == (replay.topic, 0, 0)

    # What a feeder reads of the outsider's progress and weights (the runner drops what
    # fails the signature; weights it ignores): its version, so its head gate, stays the
    # trainer's.
    feeder = PromptFeeder(FeederSection(train_dataset=DatasetConfig(prompts_per_step=4, max_epochs=1),
                                        model_path="", n_samples=2, max_head_offpolicyness=1,
                                        seed=0, run_id="fuzz.t0"),
                          records=[PromptRecord("p0", [1, 2], "q", "synthetic")])
    state = feeder.init_state()
    from tapioca.schemas import decode_event

    for offset, o in enumerate(o for o in signed if o.kind in (
            "weights_replayed_old", "weights_next_unsigned", "weights_next_other_key",
            "progress_next_unsigned", "progress_next_other_key")):
        try:
            run_bus.verify(topic(o.topic), o.value, o.headers)
        except SignatureError:
            continue
        feeder.handle(decode_event(o.value), state, Source(o.topic, 0, 100 + offset,
                                                           broadcast=True))
    for offset, ev in enumerate(genuine_progress(run_bus, 8)):
        feeder.handle(ev, state, Source(run_bus.topic(topic("progress")), 0, offset, broadcast=True))
    assert state.latest_version == 7


def test_rounds_end_by_half_the_run_and_replay_a_version_every_worker_has_passed(fl):
    for steps, rounds, eta in [(60, 8, 1), (60, 8, 0), (40, 8, 4), (16, 4, 1)]:
        plan = fl.plan_rounds(steps, rounds, eta)
        assert len(plan) == rounds and plan == sorted(set(plan))
        assert plan[-1] <= steps // 2
        # Round r replays version r; a worker has loaded >= V - 1 - eta at trainer version V.
        assert all(r < v - 1 - eta for r, v in enumerate(plan))
    with pytest.raises(ValueError, match="more steps or fewer rounds"):
        fl.plan_rounds(10, 8, 1)
