"""What an RL run leaves on disk, and what `tapioca runs` says of it: a finished run
leaves ``final/``, a Hugging Face directory of the trained policy (trainers/final_model.py),
as the supervised trainers do; `tapioca runs` lists trials with their state, step and last
reward. The trainer role on the tiny model `tapioca train` makes (a real model directory
with its tokenizer), one step of two groups, then its clean stop. No broker."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import torch
from transformers import AutoModelForCausalLM

from tapioca.bus.role import Source
from tapioca.config.loader import load_config, to_yaml
from tapioca.config.optimizer import OptimizerConfig
from tapioca.config.schema import ActorConfig, ModelConfig, TrainConfig
from tapioca.config.sections import TrainerSection
from tapioca.models.factory import load_model_and_tokenizer
from tapioca.models.tokenizer import load_tokenizer
from tapioca.ops import run_record
from tapioca.runtime.run import create_tiny_checkpoint
from tapioca.schemas.events import SampleEvent, SampleSequence
from tapioca.trainers.ppo_actor import PPOActor
from tapioca.trainers.trainer import Trainer


def _sample(gid: str) -> SampleEvent:
    seqs = [SampleSequence(traj_id=f"{gid}:{i}", output_ids=[5 + i, 6, 7],
                           behav_logprobs=[-3.0] * 3, output_versions=[0, 0, 0],
                           reward=float(i == 0), advantage=1.0 if i == 0 else -1.0)
            for i in range(2)]
    return SampleEvent(group_id=gid, prompt_id=f"p-{gid}", prompt_ids=[1, 2, 4], sequences=seqs)


def _trainer(tmp_path: Path, total_steps: int, run_dir: Path | None = None) -> Trainer:
    model_dir = create_tiny_checkpoint(tmp_path / "model", "synthetic")
    model, _ = load_model_and_tokenizer(model_dir)
    actor_cfg = ActorConfig(optimizer=OptimizerConfig(lr=1e-2))
    section = TrainerSection(actor=actor_cfg, model=ModelConfig(path=str(model_dir)),
                             max_head_offpolicyness=1, prompts_per_step=2,
                             total_train_steps=total_steps, temperature=1.0,
                             run_dir=str(run_dir or tmp_path / "run"), seed=0,
                             stop_at_reward=None)
    return Trainer(section, actor=PPOActor(model, actor_cfg, temperature=1.0, pad_token_id=0))


def _one_step(t: Trainer):
    state = t.init_state()
    list(t.on_tick(state, 0.0))
    for offset, gid in enumerate(("g0", "g1")):
        list(t.handle(_sample(gid), state, Source(topic="s", partition=0, offset=offset)))
    assert state.progress.version == 1
    return state


def test_a_finished_run_leaves_a_hugging_face_final_directory(tmp_path):
    t = _trainer(tmp_path, total_steps=1)
    state = _one_step(t)
    assert t.finished(state)
    t.on_stop(state)
    final = tmp_path / "run" / "final"
    loaded = AutoModelForCausalLM.from_pretrained(final, local_files_only=True)
    trained = t.actor.model.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, trained[name]), name
    # Trained, not the start weights (lr 1e-2: every step moves them).
    start, _ = load_model_and_tokenizer(tmp_path / "model")
    assert any(not torch.equal(v, trained[k]) for k, v in start.state_dict().items())
    tokenizer = load_tokenizer(final)
    assert tokenizer.decode(tokenizer.encode("3+4=")) == "3+4="
    assert not (tmp_path / "run" / "final.tmp").exists()


def test_a_run_stopped_before_its_last_step_leaves_none(tmp_path):
    t = _trainer(tmp_path, total_steps=5)
    state = _one_step(t)
    assert not t.finished(state)
    t.on_stop(state)  # e.g. Ctrl-C: its checkpoint, no final model
    assert not (tmp_path / "run" / "final").exists()


def _run(root: Path, trial: str, total: int) -> Path:
    """A trial as `tapioca train` leaves it: its config.yaml, and what the trainer role
    wrote for one real step (metrics, checkpoint; final/ once finished)."""
    run = root / "demo" / trial
    t = _trainer(root / f"{trial}-model", total_steps=total, run_dir=run)
    t.on_stop(_one_step(t))
    cfg = load_config(TrainConfig, None, [f"run_dir={root}", f"trial_name={trial}",
                                          f"total_train_steps={total}"])
    (run / "config.yaml").write_text(to_yaml(cfg))
    return run


def test_runs_lists_each_trial_with_its_state_step_and_last_reward(tmp_path):
    _run(tmp_path, "done", total=1)
    cut = _run(tmp_path, "cut", total=4)
    run_record.write_start(cut, bootstrap="127.0.0.1:1", own_broker=True, bus_run_id="demo.cut")
    run_record.write_end(cut, "interrupted")  # as a launcher stopped by Ctrl-C records it
    tapioca = [str(Path(sys.executable).parent / "tapioca"), "runs", str(tmp_path)]
    env = {**os.environ, "COLUMNS": "200"}
    done = subprocess.run([*tapioca, "-o", "json"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    rows = {r["run"]: r for r in orjson.loads(done.stdout)}
    assert set(rows) == {"demo/done", "demo/cut"}
    # reward/mean of the step: 2 groups x 2 samples, rewards 1 and 0 in each: 0.5.
    assert {k: rows["demo/done"][k] for k in ("kind", "state", "step", "total_steps",
                                               "last_reward", "final")} == {
        "kind": "rl", "state": "finished", "step": 1, "total_steps": 1, "last_reward": 0.5,
        "final": True}
    assert {k: rows["demo/cut"][k] for k in ("state", "step", "total_steps", "final")} == {
        "state": "interrupted", "step": 1, "total_steps": 4, "final": False}
    table = subprocess.run(tapioca, capture_output=True, text=True, env=env, timeout=120).stdout
    assert "demo/done" in table and "finished" in table and "1/1" in table and "0.500" in table
