"""The one-process commands that load and save models say their own progress and nothing
of Hugging Face's (issue 38): no "Loading weights" / "Writing model shards" bars and no
notices of one library about another's deprecated method, from `tapioca lora-merge` and
`tapioca train-offline` on a model directory. Run as the installed console script, each
in a fresh process (a process-wide switch set by an earlier command in the same process
would hide the noise)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tapioca.bus.archive import ArchiveWriter
from tapioca.bus.role import Source
from tapioca.runtime.run import create_tiny_checkpoint
from tapioca.schemas import SampleEvent, SampleSequence
from tapioca.schemas.envelope import encode_event

TAPIOCA = str(Path(sys.executable).parent / "tapioca")


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TAPIOCA_BOOTSTRAP": "", "COLUMNS": "200"}
    return subprocess.run([TAPIOCA, *args], capture_output=True, text=True, timeout=300, env=env)


def hugging_face_noise(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "it/s]" in line or "Warning" in line]


def test_lora_merge_and_train_offline_print_no_hugging_face_bars_or_warnings(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = create_tiny_checkpoint(tmp_path / "m", "synthetic", seed=0)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(model),
                                LoraConfig(r=2, lora_alpha=4, target_modules="all-linear"))
    peft_model.save_pretrained(tmp_path / "adapter")
    merged = cli("lora-merge", str(tmp_path / "adapter"), str(tmp_path / "merged"))
    assert merged.returncode == 0, merged.stderr
    assert (tmp_path / "merged" / "config.json").is_file()
    assert not hugging_face_noise(merged.stderr), merged.stderr

    writer = ArchiveWriter(tmp_path / "archive", roll_bytes=1 << 30, roll_interval_s=3600)
    for i in range(2):
        seqs = [SampleSequence(traj_id=f"g{i}:{k}", output_ids=[5, 6], behav_logprobs=[-3.0, -3.0],
                               output_versions=[0, 0], reward=float(k), advantage=2.0 * k - 1.0)
                for k in range(2)]
        event = SampleEvent(group_id=f"g{i}", prompt_id=f"p{i}", prompt_ids=[3, 4, 5],
                            sequences=seqs, min_version=0, max_version=0, run_id="arch.run")
        writer.add(Source("p.samples.v1", 0, i, key=f"g{i}", timestamp_ms=1000 + i), event,
                   encode_event(event))
    writer.flush_all()
    offline = cli("--prefix", "p", "train-offline", "--from-archive", str(tmp_path / "archive"),
                  "--no-publish", "--trial", "off", f"run_dir={tmp_path / 'runs'}", f"model.path={model}",
                  "total_train_steps=2", "train_dataset.prompts_per_step=1", "actor.torch_threads=1")
    assert offline.returncode == 0, offline.stderr
    assert "offline: 2 steps" in offline.stdout
    assert not hugging_face_noise(offline.stderr), offline.stderr
