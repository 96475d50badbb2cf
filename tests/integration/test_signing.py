"""Signed control commands and weights events against the real embedded broker: a
command or a weights event without the run's HMAC signature (bus/signing.py) is
dead-lettered and never reaches a role; signed ones work; the CLI signs with the
run's key (--run-dir / --key-file) and refuses to send without it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from tapioca.bus import EventProducer, Role, read_events
from tapioca.bus.fleet import send_command
from tapioca.bus.reader import TopicReader
from tapioca.bus.signing import SignatureError, create_key_file
from tapioca.schemas import ControlEvent, DlqRecord, FleetEvent, WeightsEvent
from tapioca.schemas.errors import ConfigError

pytestmark = pytest.mark.integration

TAPIOCA = str(Path(sys.executable).parent / "tapioca")


@pytest.fixture
def key_path(tmp_path):
    path = tmp_path / "run" / "secrets" / "bus.key"
    create_key_file(path)
    return path


@pytest.fixture
def cfg(make_cfg, key_path):
    return make_cfg(fleet_heartbeat_interval_s=0.5, signing_key_path=str(key_path))


def unsigned(cfg):
    """The same bus without the key: what any other client on the bus can do."""
    from dataclasses import replace

    return replace(cfg, signing_key_path="")


def other_key(cfg, tmp_path):
    from dataclasses import replace

    path = tmp_path / "other" / "bus.key"
    create_key_file(path)
    return replace(cfg, signing_key_path=str(path))


class Follower(Role):
    """Follows weights.v1 (as the rollout workers and the proxy do)."""

    name = "follower"
    broadcast_inputs = ("weights",)

    def init_state(self):
        return {"versions": [], "paused": []}

    def handle(self, event, state, source):
        state["versions"].append(event.version)
        return ()

    def on_pause(self, state, paused):
        state["paused"].append(paused)


def dead_letters(cfg):
    return [e for e in read_events(cfg, "dlq", idle_s=0.2) if isinstance(e, DlqRecord)]


def weights(version, path="/tmp/w.safetensors"):
    return WeightsEvent(version=version, path=path, sha256="0" * 64)


def test_key_file_is_owner_only_and_a_missing_key_is_a_clear_error(tmp_path, key_path):
    assert key_path.stat().st_mode & 0o777 == 0o600
    assert key_path.parent.stat().st_mode & 0o777 == 0o700
    from tapioca.bus.settings import BusConfig

    missing = BusConfig(bootstrap_servers="127.0.0.1:1", signing_key_path=str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="does not exist.*tapioca train"):
        missing.signing_key()
    key_path.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        BusConfig(bootstrap_servers="127.0.0.1:1", signing_key_path=str(key_path)).signing_key()


def test_forged_weights_events_are_dead_lettered_and_never_reach_the_role(
        cfg, tmp_path, start_runner, wait_until):
    rt = start_runner(Follower(), cfg, member_id="follower-0")
    with EventProducer(unsigned(cfg), "forger") as forger:
        forger.publish(weights(10**9))                      # no signature at all
        forger.publish(weights(7, path="/etc/passwd"))
    with EventProducer(other_key(cfg, tmp_path), "other-run") as other:
        other.publish(weights(8))                           # another run's key
    with EventProducer(cfg, "trainer") as trainer:
        trainer.publish(weights(1))                         # the run's trainer
    wait_until(lambda: rt.state["versions"] == [1] and rt.runner.stats.dead_lettered == 3,
               what="the signed version handled and three forgeries dead-lettered")
    letters = dead_letters(cfg)
    assert sorted(d.error_type for d in letters) == ["SignatureError"] * 3
    assert any("another run" in d.error for d in letters)
    assert rt.state["versions"] == [1]
    # Readers (recovery, the CLI) with the key see forgeries as errors, not events.
    with TopicReader(cfg, "weights") as reader:
        records = list(reader.records(idle_s=0.3))
    assert [r.event.version for r in records if r.event is not None] == [1]
    assert sum(isinstance(r.error, SignatureError) for r in records) == 3


def test_unsigned_control_commands_are_dead_lettered_and_ignored(cfg, start_runner, wait_until):
    rt = start_runner(Follower(), cfg, member_id="follower-1")
    wait_until(lambda: any(isinstance(e, FleetEvent) and e.member_id == "follower-1"
                           and e.status == "running" for e in read_events(cfg, "fleet", idle_s=0.2)),
               what="a running heartbeat")
    _cmd, acks = send_command(unsigned(cfg), "pause", "follower", ["follower-1"], timeout_s=3)
    assert acks == {}
    wait_until(lambda: rt.runner.stats.dead_lettered == 1, what="the forged pause dead-lettered")
    assert rt.state["paused"] == [] and not rt.runner.control.paused
    [letter] = dead_letters(cfg)
    assert letter.error_type == "SignatureError" and letter.source_topic.endswith("control.v1")
    assert orjson.loads(__import__("base64").b64decode(letter.payload_b64))["command"] == "pause"
    # Signed with the run's key, the same command is obeyed and acknowledged.
    _cmd, acks = send_command(cfg, "pause", "follower", ["follower-1"], timeout_s=10)
    assert acks["follower-1"].ok and rt.state["paused"] == [True]


def test_cli_signs_with_the_run_dir_key_and_refuses_without_it(cfg, key_path, tmp_path,
                                                             start_runner, wait_until):
    rt = start_runner(Follower(), cfg, member_id="follower-2")
    env = {**os.environ, "TAPIOCA_HOME": str(tmp_path / "home"), "COLUMNS": "120"}
    env.pop("TAPIOCA_BOOTSTRAP", None)
    env.pop("TAPIOCA_SIGNING_KEY_FILE", None)

    def cli(*args):
        return subprocess.run([TAPIOCA, "--bootstrap-server", cfg.bootstrap_servers,
                               "--prefix", cfg.topic_prefix, *args], env=env,
                              capture_output=True, text=True, timeout=60)

    wait_until(lambda: any(isinstance(e, FleetEvent) and e.member_id == "follower-2"
                           for e in read_events(cfg, "fleet", idle_s=0.2)), what="a heartbeat")
    refused = cli("pause", "follower")
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert "--run-dir" in refused.stderr and rt.state["paused"] == []
    run_dir = key_path.parent.parent
    ok = cli("--run-dir", str(run_dir), "pause", "follower", "-o", "json")
    assert ok.returncode == 0, ok.stderr
    assert [a["ok"] for a in orjson.loads(ok.stdout)["acks"]] == [True]
    assert rt.state["paused"] == [True]
    ok = cli("--key-file", str(key_path), "resume", "follower")
    assert ok.returncode == 0, ok.stderr
    assert rt.state["paused"] == [True, False]


def test_control_events_carry_no_secret(cfg, key_path):
    """The signature header names the key by id; the key itself never goes on the bus."""
    with EventProducer(cfg, "cli") as producer:
        producer.publish(ControlEvent(command_id="c1", command="pause", target="nobody"))
    with TopicReader(cfg, "control") as reader:
        [record] = list(reader.records(idle_s=0.3))
    secret = key_path.read_text().strip().encode()
    header = dict(record.headers)["tapioca.sig"]
    assert header.startswith(b"hmac-sha256:") and secret not in header and secret not in record.raw


def test_a_second_run_on_the_same_prefix_skips_the_first_runs_events(make_cfg, tmp_path,
                                                                     start_runner, wait_until):
    """Issue 29: run B on the broker and prefix of run A (each with its own key) dead-
    lettered A's signed weights and commands as forgeries ("published by another run"),
    and `tapioca --run-dir B status` listed A's members. Now A's events are skipped,
    counted as foreign, by B's members (and B's by A's); a record that claims B's run id
    under A's key is still a forgery; status and commands with --run-dir B see B only."""
    from dataclasses import replace

    import yaml

    base = make_cfg(fleet_heartbeat_interval_s=0.5)
    runs = {}
    for name in ("a", "b"):
        run_dir = tmp_path / name
        create_key_file(run_dir / "secrets" / "bus.key")
        runs[name] = replace(base, run_id=f"two.{name}",
                             signing_key_path=str(run_dir / "secrets" / "bus.key"))
        (run_dir / "config.yaml").write_text(yaml.safe_dump({"bus": {
            "bootstrap_servers": base.bootstrap_servers, "topic_prefix": base.topic_prefix,
            "run_id": f"two.{name}"}}))
    a, b = runs["a"], runs["b"]
    with EventProducer(a, "trainer") as trainer:  # run A's history: weights v0..v2
        for v in range(3):
            trainer.publish(weights(v))
    old = start_runner(Follower(), a, member_id="follower-0")
    only_a = start_runner(Follower(), a, member_id="archiver-0")  # a role B does not run
    new = start_runner(Follower(), b, member_id="follower-0")
    with EventProducer(b, "trainer") as trainer:
        trainer.publish(weights(0))
        trainer.publish(weights(1))
    wait_until(lambda: new.state["versions"] == [0, 1] and new.runner.stats.foreign >= 3
               and old.runner.stats.foreign >= 2, timeout_s=60,
               what="each run's follower handling its own versions, skipping the other's")
    assert old.state["versions"] == [0, 1, 2] and new.state["versions"] == [0, 1]
    assert [r.runner.stats.dead_lettered for r in (old, only_a, new)] == [0, 0, 0]
    assert dead_letters(base) == []
    # A record that claims B's run id but is signed with A's key is a forgery still.
    with EventProducer(a, "forger") as forger:
        forger.publish(WeightsEvent(version=9, path="/tmp/w.safetensors", sha256="0" * 64,
                                    run_id="two.b"))
    wait_until(lambda: new.runner.stats.dead_lettered == 1, what="the forgery dead-lettered")
    [letter] = dead_letters(base)
    assert letter.error_type == "SignatureError" and "another run" in letter.error
    assert new.state["versions"] == [0, 1]

    env = {**os.environ, "TAPIOCA_HOME": str(tmp_path / "home"), "COLUMNS": "200"}
    env.pop("TAPIOCA_BOOTSTRAP", None)
    env.pop("TAPIOCA_SIGNING_KEY_FILE", None)

    def cli(*args):
        return subprocess.run([TAPIOCA, "--bootstrap-server", base.bootstrap_servers,
                               "--run-dir", str(tmp_path / "b"), *args], env=env,
                              capture_output=True, text=True, timeout=90)

    def b_status():
        out = cli("status", "-o", "json")
        assert out.returncode == 0, out.stderr
        return orjson.loads(out.stdout)

    wait_until(lambda: any(m["foreign"] >= 3 for m in b_status()), timeout_s=60,
               interval_s=1.0, what="B's heartbeat counting A's skipped events")
    members = b_status()
    assert [(m["member_id"], m["run_id"]) for m in members] == [("follower-0", "two.b")]
    table = cli("status")
    assert "archiver-0" not in table.stdout and "events of other runs skipped" in table.stdout
    # A command with --run-dir B: B's member obeys; A's members (one has the same member
    # id) skip it as another run's instead of dead-lettering a forgery.
    paused = cli("pause", "follower", "-o", "json")
    assert paused.returncode == 0, paused.stderr
    assert [x["member_id"] for x in orjson.loads(paused.stdout)["acks"]] == ["follower-0"]
    wait_until(lambda: new.state["paused"] == [True] and old.runner.stats.foreign >= 3
               and only_a.runner.stats.foreign >= 1,
               what="B paused, A's followers skipping B's command")
    assert old.state["paused"] == [] == only_a.state["paused"]
    assert [r.runner.stats.dead_lettered for r in (old, only_a)] == [0, 0]
    assert len(dead_letters(base)) == 1  # the forgery's, and nothing else
