"""A run's memory on each GPU (runtime/device_memory.py) and what `tapioca train` does
with it (issue 37): the colocated plan against hand-computed bytes (the engine's weights
and KV cache by the engine's own rule, the ipc weight buffers, LoRA's frozen base, the
reference and the evaluator's engine), the settings the advice names really fit, the
refusal at start (the real `tapioca train`: exit 78, one line, no role started), and an
out-of-memory step: the trainer stops with EXIT_OOM and the planner's advice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tapioca.config.loader import load_config
from tapioca.config.schema import KV_PROMPT_ALLOWANCE_TOKENS, TrainConfig
from tapioca.runtime import device_memory as dm
from tapioca.schemas.errors import EXIT_CONFIG, EXIT_OOM, ConfigError, DeviceMemoryError, out_of_memory_error
from tapioca.trainers import memory_plan as mp

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "gsm8k_grpo.yaml"
LORA_EXAMPLE = ROOT / "examples" / "lora" / "gsm8k_grpo_lora.yaml"
TAPIOCA = str(Path(sys.executable).parent / "tapioca")
GIB = dm.GIB
Q05 = mp.PRESETS["qwen2-0.5b"]
Q7 = mp.PRESETS["qwen2.5-7b"]


# The hand-computed figures below are for the example's trainer without activation
# checkpointing, 16k-token micro-batches and two ipc buffers (its settings before the
# 3B shape asked for less): pinned here, so the arithmetic does not follow the example.
PINNED = ("actor.mb_max_tokens=16384", "actor.gradient_checkpointing=false", "weights.buffer_slots=2")


def example(*overrides: str, path: Path = EXAMPLE) -> TrainConfig:
    return load_config(TrainConfig, str(path), list(PINNED if path == EXAMPLE else ()) + list(overrides))


def parts(plan: dm.RunMemoryPlan, device: str = "cuda:0") -> dict[tuple[str, str], float]:
    return {(p.member, p.what): p.bytes for p in plan.devices[device].parts}


def test_a_shared_gpu_holds_the_trainer_and_the_engine_by_hand():
    cfg = example()  # cuda trainer + cuda rollout: bf16, ipc, sleep mode (device defaults)
    assert cfg.actor.weights_dtype == "bfloat16" and cfg.weights.transport == "ipc"
    assert cfg.rollout.enable_sleep_mode
    plan = dm.plan_run(cfg, Q05, card_bytes=80 * GIB)
    assert list(plan.devices) == ["cuda:0"]
    got = parts(plan)
    # Qwen2-0.5B: 494,032,768 parameters (24 layers x 14,912,384 + 151,936 x 896 + 896).
    assert Q05.params == 494_032_768
    assert got[("rollout-0", "weights (bfloat16)")] == 2 * 494_032_768
    # KV: 2 (k, v) x 24 layers x 2 kv heads x 64 x 2 B = 12,288 B a token. The rollout
    # needs 256 rows x 512 new tokens + 32 groups x 2,048 prompt tokens = 196,608 tokens:
    # 12,288 blocks of 16, + the engine's null block = 196,624 tokens (2.25 GiB, under
    # 0.25 x 80 GiB).
    assert dm.kv_bytes_per_token(Q05, 2) == 12_288
    assert 256 * 512 + 32 * KV_PROMPT_ALLOWANCE_TOKENS == 196_608
    assert got[("rollout-0", "KV cache (196,624 tokens)")] == 196_624 * 12_288
    # ipc: weights.buffer_slots (2) device buffers of one version in model.dtype.
    assert got[("trainer-0", "ipc weight slots (2 x 0.92 GiB)")] == 2 * 2 * 494_032_768
    # ... and the engine's receive buffer of one version (weights/receiver.py verifies a
    # copy before loading it; measured on the H100: the engine's 20.6 GiB at 3B).
    assert got[("rollout-0", "ipc receive buffer")] == 2 * 494_032_768
    # The trainer's step is trainers/memory_plan.py's, on the example's micro-batches
    # (32 prompts x 8 samples x 512 tokens / 16384 = 8: the gradients stay between them).
    assert plan.trainer.train.micro_batches == 8 and plan.trainer.train.tokens == 16384
    assert got[("trainer-0", "training step (start of backward)")] == plan.trainer.peak
    assert got[("trainer-0", "allocator reserve (5% of the step)")] == 0.05 * plan.trainer.peak
    assert got[("trainer-0", "CUDA context")] == got[("rollout-0", "CUDA context")] == 0.5 * GIB
    # A shared GPU is planned at the sum of every process's peak; sleep mode gives the
    # idle engine's KV cache back (reported, not subtracted).
    d = plan.devices["cuda:0"]
    assert d.total == sum(got.values()) and d.sleep_frees == 196_624 * 12_288
    assert d.members == ["trainer-0", "rollout-0"]


def test_the_kv_fraction_caps_the_cache_and_kv_cache_tokens_fixes_it():
    cfg = example("rollout.kv_cache_memory_fraction=0.01")
    got = parts(dm.plan_run(cfg, Q05, card_bytes=80 * GIB))
    # 1% of 80 GiB = 858,993,459 B // (12,288 x 16 B a block) = 4,369 blocks.
    assert got[("rollout-0", "KV cache (69,904 tokens)")] == 69_904 * 12_288
    fixed = parts(dm.plan_run(example("rollout.kv_cache_tokens=1000"), Q05, card_bytes=80 * GIB))
    assert ("rollout-0", "KV cache (1,024 tokens)") in fixed  # 63 blocks of 16 + the null block


def test_separate_gpus_and_the_evaluators_engine():
    cfg = example("rollout.device=cuda:1", "evaluator.freq_steps=10", "valid_dataset.type=gsm8k",
                  "valid_dataset.split=test", "eval.k=2")
    plan = dm.plan_run(cfg, Q05, card_bytes=80 * GIB)
    assert plan.devices["cuda:0"].members == ["trainer-0"]
    assert plan.devices["cuda:1"].members == ["rollout-0", "evaluator-0"]
    # GPUs of one host: the ipc buffers are the trainer's; not the same GPU: no sleep mode.
    assert any(p.what.startswith("ipc weight slots") for p in plan.devices["cuda:0"].parts)
    assert plan.devices["cuda:1"].sleep_frees == 0
    # The evaluator's need: 256 rows x 512 tokens + 128 groups of eval.k = 2 x 2,048.
    need = 256 * 512 + 128 * KV_PROMPT_ALLOWANCE_TOKENS
    assert ("evaluator-0", f"KV cache ({need + 16:,} tokens)") in parts(plan, "cuda:1")


def test_lora_plans_the_frozen_base_once_and_the_adapters_state():
    cfg = example(path=LORA_EXAMPLE)
    plan = dm.plan_run(cfg, Q7, card_bytes=80 * GIB)
    # Rank 16 on all 7 projections of each of 28 layers: 16 x (in + out) each, 90,112
    # features a layer -> 40,370,176 adapter parameters.
    assert plan.trainer.train.lora_params == 28 * 16 * 90_112 == 40_370_176
    step = plan.trainer.parts
    assert step["weights"] == 2 * (Q7.params + 40_370_176)  # the base in bf16 + the adapter
    assert step["gradients (adapter)"] == 2 * 40_370_176
    assert step["optimizer (moments + fp32 masters)"] == 12 * 40_370_176
    # Was 122.7 GiB when the base's gradients and Adam state were counted.
    assert plan.trainer.peak < 25 * GIB
    got = parts(plan)
    # The engine keeps a copy of every targeted weight to merge adapters: per layer q, o
    # 3584^2, k, v 3584 x 512, gate, up, down 3584 x 18944 -> 233,046,016, x 28, in bf16.
    assert got[("rollout-0", "LoRA: base copies of the targeted weights")] == 2 * 28 * 233_046_016
    assert got[("trainer-0", "ipc weight slots (2 x 0.08 GiB)")] == 2 * 2 * 40_370_176  # the adapter only
    assert plan.devices["cuda:0"].total < 80 * GIB


def test_auto_attention_is_flash_varlen_only_in_bf16_or_fp16_on_cuda():
    def attention(*overrides: str) -> str:
        c = example(*overrides)
        return mp.train_shape(c.actor, c.fsdp).attention

    assert attention() == "varlen"  # auto: bf16 weights on the GPU
    assert attention("actor.param_dtype=float32") == "sdpa"  # fp32: the padded sdpa path
    assert attention("actor.param_dtype=float32", "actor.autocast_dtype=bfloat16") == "varlen"
    assert attention("actor.device=cpu", "rollout.device=cpu") == "sdpa"


def test_reference_and_critic_are_planned_where_configured():
    kl = parts(dm.plan_run(example("actor.kl_ctl=0.01"), Q05, card_bytes=80 * GIB))
    assert kl[("trainer-0", "reference model (bfloat16)")] == 2 * Q05.params
    # A LoRA run's reference is its base with the adapter off: nothing copied.
    lora = parts(dm.plan_run(example("actor.kl_ctl=0.01", path=LORA_EXAMPLE), Q7, card_bytes=80 * GIB))
    assert not any("reference" in what for _, what in lora)
    gae = parts(dm.plan_run(example("advantage.estimator=gae"), Q05, card_bytes=80 * GIB))
    # bf16 weights and gradients, fp32 Adam moments: 12 B a parameter, at least.
    assert gae[("trainer-0", "critic (weights, gradients, AdamW)")] >= 12 * Q05.params


def test_every_setting_the_advice_names_fits_when_applied():
    cfg = example()
    budget = {"cuda:0": 20 * GIB}
    changes, _ = dm.fitting_changes(cfg, Q05, budget, card_bytes=80 * GIB)
    assert changes and changes[0] == "actor.mb_max_tokens=2048"
    for change in changes:
        applied = example(*change.split())
        assert dm.plan_run(applied, Q05, card_bytes=80 * GIB).fits(budget), change
    # An engine that takes a quarter of the card for its KV cache: a smaller fraction fits.
    big = example("rollout.max_batch_size=4096", "gconfig.max_new_tokens=2048")
    line = dm.advice_line(big, Q05, {"cuda:0": 42 * GIB}, card_bytes=80 * GIB)
    assert "rollout.kv_cache_memory_fraction=0." in line, line
    assert dm.advice_line(cfg, Q05, {"cuda:0": 80 * GIB}, card_bytes=80 * GIB) == ""  # fits as it is
    assert dm.advice_line(cfg, Q05, {"cuda:0": 2 * GIB}, card_bytes=80 * GIB).startswith("nothing tried fits")


def qwen05_dir(root: Path) -> Path:
    """A Qwen2-0.5B-shaped model directory: its config.json is all the planner reads."""
    model = root / "qwen2-0.5b"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936,
        "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
        "num_key_value_heads": 2, "intermediate_size": 4864, "tie_word_embeddings": True,
        "max_position_embeddings": 32768}))
    return model


def test_the_kv_cache_is_sized_from_what_the_plan_leaves_when_only_it_is_in_the_way(tmp_path):
    from tapioca.ops.memory_check import check_at_start

    # 4,096 rows of 2,048 tokens ask for 8.4M KV tokens, capped at a quarter of the card
    # (20 GiB); 42 GiB do not hold that beside the trainer, a smaller cache does.
    big = ("rollout.max_batch_size=4096", "gconfig.max_new_tokens=2048")
    cfg = example(*big, f"model.path={qwen05_dir(tmp_path)}", "launcher.device_memory_gib=42")
    budgets = {"cuda:0": 42 * GIB}
    assert not dm.plan_run(cfg, Q05, card_bytes=42 * GIB).fits(budgets)
    fitted, tokens = dm.fit_kv_cache(cfg, Q05, budgets, card_bytes=42 * GIB)
    assert fitted.rollout.kv_cache_tokens == tokens and tokens % 16 == 0
    # The largest that leaves KV_FIT_MARGIN of the card free: one more block would not.
    margin = dm.KV_FIT_MARGIN * 42 * GIB
    total = dm.plan_run(fitted, Q05, card_bytes=42 * GIB).devices["cuda:0"].total
    assert 42 * GIB - margin - 2 * 16 * 12_288 <= total <= 42 * GIB - margin
    # `tapioca train`'s check starts it with that cache instead of refusing it.
    started = check_at_start(cfg)
    assert started.rollout.kv_cache_tokens == tokens
    assert started.rollout.max_batch_size == 4096 and started.actor == cfg.actor  # nothing else
    # A fixed cache is the user's: the check refuses, naming a smaller one.
    fixed = example(*big, f"model.path={qwen05_dir(tmp_path)}", "launcher.device_memory_gib=42",
                    "rollout.kv_cache_tokens=4000000")
    assert dm.fit_kv_cache(fixed, Q05, budgets, card_bytes=42 * GIB) is None
    with pytest.raises(ConfigError, match="rollout.kv_cache_tokens="):
        check_at_start(fixed)
    # A run that fits keeps its config; one the KV cache alone cannot save is refused.
    small = example(f"model.path={qwen05_dir(tmp_path)}", "launcher.device_memory_gib=80")
    assert check_at_start(small) is small
    assert dm.fit_kv_cache(example(*big), Q05, {"cuda:0": 10 * GIB}, card_bytes=10 * GIB) is None


def test_tapioca_plan_shows_the_shared_gpu_and_what_sleep_gives_back():
    from tapioca.ops.cli import app

    result = CliRunner().invoke(app, ["plan", "--config", str(EXAMPLE), "--model", "qwen2.5-3b",
                                      "--gpu-gib", "80", *PINNED])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "cuda:0 (shared by trainer-0, rollout-0), checked against 80 GiB (--gpu-gib)" in out
    assert "does NOT fit in 80 GiB" in out and "sleep mode gives back" in out
    assert "fits with actor.gradient_checkpointing=true" in out
    js = CliRunner().invoke(app, ["plan", "--config", str(EXAMPLE), "--model", "qwen2-0.5b",
                                  "--gpu-gib", "80", "-o", "json", *PINNED])
    (row,) = json.loads(js.output)
    (dev,) = row["devices"]
    assert dev["device"] == "cuda:0" and dev["fits"] and row["fits"] and row["advice"] == ""
    assert {p["member"] for p in dev["parts"]} == {"trainer-0", "rollout-0"}


def test_tapioca_train_refuses_a_run_that_will_not_fit_before_any_role_starts(tmp_path):
    # A Qwen2-0.5B-shaped model directory (its config.json is all the check reads) and a
    # GPU that offers 20 GiB (launcher.device_memory_gib: the check runs on this CPU box).
    model = tmp_path / "qwen2-0.5b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936,
        "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
        "num_key_value_heads": 2, "intermediate_size": 4864, "tie_word_embeddings": True,
        "max_position_embeddings": 32768}))
    run_dir = tmp_path / "runs"
    env = {**os.environ, "TAPIOCA_HOME": str(tmp_path / "home")}  # no `tapioca broker up` of another test
    done = subprocess.run([TAPIOCA, "train", "--config", str(EXAMPLE), f"model.path={model}", *PINNED,
                           "launcher.device_memory_gib=20", f"run_dir={run_dir}", "trial_name=t0"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == EXIT_CONFIG, done.stdout + done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and done.stdout.strip() == "", done.stdout + done.stderr
    line = lines[0]
    assert line.startswith("error: the run will not fit: cuda:0 needs ") and "is given 20 GiB" in line
    assert "fits with actor.mb_max_tokens=2048, or actor.gradient_checkpointing=true" in line
    assert "launcher.check_memory=false" in line
    assert not (run_dir / "gsm8k-grpo" / "t0" / "logs").exists()  # no role, no broker started


def test_an_out_of_memory_error_is_recognised_through_its_causes():
    torch_oom = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.32 GiB. GPU 0 has a total capacity of 79.19 GiB "
        "of which 1.05 GiB is free. Process 7 has 22.69 GiB memory in use. Of the allocated memory ...")
    try:
        try:
            raise torch_oom
        except RuntimeError as exc:
            raise ValueError("wrapped") from exc
    except ValueError as wrapped:
        err = out_of_memory_error(wrapped, "step 2: ")
    assert isinstance(err, DeviceMemoryError) and err.exit_code == EXIT_OOM == 71
    assert str(err) == ("step 2: CUDA out of memory. Tried to allocate 2.32 GiB. GPU 0 has a total "
                        "capacity of 79.19 GiB of which 1.05 GiB is free.")
    assert out_of_memory_error(RuntimeError("CUDA error: out of memory")) is not None
    assert out_of_memory_error(RuntimeError("shape mismatch")) is None


def test_a_step_that_runs_out_of_memory_stops_the_trainer_with_exit_oom(tmp_path, monkeypatch):
    sys.path.insert(0, str(Path(__file__).parent))
    from test_role_trainer import make_trainer, sample, src, start

    t = make_trainer(tmp_path)
    try:
        state = start(t)

        def oom(*a, **k):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.32 GiB. GPU 0 has "
                                         "a total capacity of 79.19 GiB of which 1.05 GiB is free.")

        monkeypatch.setattr(t.actor, "train_step", oom)
        t.handle(sample("g0"), state, src(0))
        with pytest.raises(DeviceMemoryError) as err:
            t.handle(sample("g1"), state, src(1))
        assert err.value.exit_code == EXIT_OOM
        assert str(err.value).startswith("training step 1 ran out of memory: CUDA out of memory.")
        assert state.progress.version == 0 and len(state.buffer) == 2  # nothing committed
    finally:
        t.sink.close()


def test_the_role_process_adds_the_plans_advice_to_an_out_of_memory_line(tmp_path, monkeypatch):
    from tapioca.ops import role_main
    from tapioca.ops.launcher import REASON_FD_ENV

    def oom_role(role, cfg, member):
        raise DeviceMemoryError("training step 3 ran out of memory: CUDA out of memory. Tried to "
                                "allocate 2.32 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
                                "1.05 GiB is free.")

    model = tmp_path / "qwen2-0.5b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2, "intermediate_size": 4864,
        "tie_word_embeddings": True}))
    monkeypatch.setattr(role_main, "build_role", oom_role)
    # The trainer's GPU, as the role process sees it after the error (an 80 GB card).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=0: (1 * GIB, 80 * GIB))
    read_end, write_end = os.pipe()
    monkeypatch.setenv(REASON_FD_ENV, str(write_end))
    try:
        code = role_main.run_role_process("trainer", str(EXAMPLE), [
            *PINNED, "trial_name=oom", f"run_dir={tmp_path}", f"model.path={model}"])
    finally:
        os.close(write_end)
    assert code == EXIT_OOM
    with os.fdopen(read_end, "rb") as pipe:
        line = pipe.read().decode()
    assert line.count("\n") == 1 and line.startswith("training step 3 ran out of memory")
    # The plan of the example fits 80 GiB on paper: the advice lowers it by the 2.32 GiB
    # that failed.
    assert "The plan puts cuda:0 at " in line and "fits with actor.mb_max_tokens=8192" in line, line


def qwen25_vl_3b_dir(root: Path) -> Path:
    """A Qwen2.5-VL-3B-shaped model directory (config.json only: the planner counts the
    vision tower on an empty meta-device copy)."""
    from transformers import Qwen2_5_VLConfig

    text = dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=128000,
                tie_word_embeddings=True)
    vision = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                  fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu")
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=151655, video_token_id=151656,
                           vision_start_token_id=151652, vision_end_token_id=151653, tie_word_embeddings=True)
    cfg.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    model = root / "qwen2.5-vl-3b"
    cfg.save_pretrained(model)
    return model


def test_a_vision_language_plan_counts_the_tower_and_its_advice_names_no_refused_feature(tmp_path):
    from tapioca.runtime import disk_plan as dp

    model = qwen25_vl_3b_dir(tmp_path)
    shape = dm.shape_of_dir(model)
    decoder = mp.PRESETS["qwen2.5-3b"].params
    # Qwen2.5-VL-3B's tower: 32 blocks of 1280 and the merger, 0.67B (the published 3.75B in all).
    assert 0.6e9 < shape.vision_params < 0.7e9 and shape.params == decoder + shape.vision_params
    vl = ROOT / "examples" / "vlm" / "geometry3k.yaml"
    cfg = load_config(TrainConfig, str(vl), [f"model.path={model}"])
    assert cfg.vlm.freeze_vision_encoder
    card = 79.18 * GIB
    frozen = parts(dm.plan_run(cfg, shape, card_bytes=card))
    trained = parts(dm.plan_run(with_vlm(cfg, freeze=False), shape, card_bytes=card))
    step = dm.plan_run(cfg, shape, card_bytes=card).trainer.parts
    # Every weight in bf16 on both sides; gradients only of what trains (the frozen tower has none).
    assert step["weights"] == 2 * shape.params
    assert step["gradients"] == 2 * decoder
    assert frozen[("rollout-0", "weights (bfloat16)")] == 2 * shape.params
    at_backward = ("trainer-0", "training step (start of backward)")
    assert trained[at_backward] - frozen[at_backward] >= 14 * shape.vision_params  # grads, masters, moments
    # A checkpoint: every weight, masters and moments of the trained ones.
    assert dp.checkpoint_bytes(cfg, shape, mp.train_shape(cfg.actor, cfg.fsdp, model=shape, freeze_vision=True)) \
        == 2 * shape.params + 12 * decoder
    # The example as shipped fits an H100 (79.18 GiB); with ipc and no activation checkpointing
    # it does not, and the advice does not name LoRA, which the feature table refuses for a
    # vision-language model (vlm_x_lora).
    budget = {"cuda:0": card}
    assert dm.plan_run(cfg, shape, card_bytes=card).fits(budget)
    before = load_config(TrainConfig, str(vl), [f"model.path={model}", "actor.gradient_checkpointing=false",
                                                "weights.transport=ipc"])
    line = dm.advice_line(before, shape, budget, card_bytes=card)
    assert "actor.lora.enabled" not in line and "weights.transport=file" in line, line


def with_vlm(cfg: TrainConfig, *, freeze: bool) -> TrainConfig:
    return dm.with_settings(cfg, {"vlm.freeze_vision_encoder": freeze})
