"""End to end with a REAL vLLM server: `tapioca train` (every role its own process, the
embedded broker) whose rollout worker generates through the session's vLLM server
(``rollout.engine=vllm``, ``rollout.server.urls``), loading each new version from the
trainer's weights files. Checked from the events: every trajectory carries vLLM's
tokens, logprobs and per-token versions; later versions were generated after reloads;
with eta = 0 the trainer's importance weight pi_prox / pi_behav is 1 (vLLM's behaviour
logprobs equal the trainer's own forward); the rollout member reports its server on
fleet.v1."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tapioca.bus import read_events
from tapioca.config.loader import load_config
from tapioca.config.schema import TrainConfig
from tapioca.ops.launcher import Launcher
from tapioca.schemas import FleetEvent, TrajectoryEvent
from tapioca.trainers.trainer import read_metrics

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

STEPS = 3


def test_tapioca_train_rollout_through_vllm(broker, vllm_server, tmp_path):
    cfg = load_config(TrainConfig, None, [
        f"run_dir={tmp_path}", "experiment_name=vllm", "trial_name=t0",
        f"total_train_steps={STEPS}", f"bus.bootstrap_servers={broker.bootstrap}",
        f"bus.topic_prefix=v{uuid.uuid4().hex[:8]}",
        f"model.path={vllm_server.model_dir}",
        "train_dataset.prompts_per_step=4", "gconfig.n_samples=4", "gconfig.max_new_tokens=6",
        "rollout.max_head_offpolicyness=0", "actor.optimizer.lr=1e-3",
        "rollout.engine=vllm", f"rollout.server.urls=[{vllm_server.url}]",
        "rollout.server.health_interval_s=1.0",
    ])
    launcher = Launcher(cfg)
    launcher.start()
    cfg = launcher.cfg  # resolved (runtime/run.py): the run's bus run id
    try:
        summary = launcher.wait(timeout_s=240)
    finally:
        launcher.stop()
    assert summary.steps == STEPS

    trajs = [e for e in read_events(cfg.bus, "trajectories") if isinstance(e, TrajectoryEvent)]
    assert len({t.group_id for t in trajs}) >= STEPS * 4
    for t in trajs:
        assert 1 <= len(t.output_ids) <= 6
        assert len(t.output_logprobs) == len(t.output_ids) == len(t.output_versions)
        assert all(math.isfinite(x) and x <= 0 for x in t.output_logprobs)
    versions = {v for t in trajs for v in t.output_versions}
    assert versions >= set(range(STEPS)), f"versions on tokens: {sorted(versions)}"

    rows = [r for r in read_metrics(cfg.run_path) if "actor/importance_weight_mean" in r]
    assert len(rows) == STEPS
    for r in rows:  # eta = 0: behaviour (vLLM) and proximal (trainer) policies are one
        assert r["trainer/staleness_max"] == 0
        assert abs(r["actor/importance_weight_mean"] - 1.0) < 1e-3, r

    beats = [e for e in read_events(cfg.bus, "fleet") if isinstance(e, FleetEvent)
             and e.role == "rollout" and "servers_up" in e.detail.get("describe", {})]
    assert beats and beats[-1].detail["describe"]["servers_up"] == 1


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] not in ("Z", "X") and int(fields[2]) == pgid:
                found.append(int(name))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux")
def test_ctrl_c_of_tapioca_train_leaves_no_vllm_server(tmp_path):
    """`tapioca train rollout.engine=vllm` (the role launches the server) interrupted
    while the server starts -- the launcher's SIGTERM reaches the rollout role before
    its handlers are installed, so the role cannot stop the server itself: the server's
    process group (API server and engine process) is gone soon after the launcher."""
    root = Path(__file__).resolve().parents[2]
    python = os.environ.get("TAPIOCA_VLLM_PYTHON") or str(root / ".venv-vllm" / "bin" / "python")
    if not Path(python).is_file():
        pytest.skip(f"no vLLM venv at {python}")
    env = {**os.environ, "TAPIOCA_HOME": str(tmp_path / "home")}
    env.pop("TAPIOCA_BOOTSTRAP", None)
    run = tmp_path / "runs" / "demo" / "sigint"
    launcher = subprocess.Popen(
        [str(Path(sys.executable).parent / "tapioca"), "train", "--config",
         str(root / "examples" / "demo_cpu.yaml"), f"run_dir={tmp_path / 'runs'}",
         "trial_name=sigint", "rollout.engine=vllm", "model.num_heads=2", "model.num_kv_heads=1",
         "model.tie_word_embeddings=false", f"rollout.server.python={python}",
         "rollout.server.extra_args=[--enforce-eager,--max-model-len,256]"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    server_pid = None
    try:
        deadline = time.monotonic() + 300
        while server_pid is None and time.monotonic() < deadline:
            assert launcher.poll() is None, "tapioca train exited before starting the server"
            log = run / "logs" / "rollout-0.log"
            found = re.search(r"started vllm server pid (\d+)", log.read_text()) \
                if log.exists() else None
            server_pid = int(found.group(1)) if found else None
            time.sleep(0.2)
        assert server_pid is not None, "the rollout role never started its vLLM server"
        assert _group_members(server_pid)
        launcher.send_signal(signal.SIGINT)  # Ctrl-C
        assert launcher.wait(120) == 130
        # Before the watchdog the server stayed up, listening, reparented to init.
        deadline = time.monotonic() + 90
        while _group_members(server_pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _group_members(server_pid), "the vLLM server outlived `tapioca train`"
    finally:
        if launcher.poll() is None:
            launcher.kill()
        if server_pid is not None:
            for pid in _group_members(server_pid):
                os.kill(pid, signal.SIGKILL)
