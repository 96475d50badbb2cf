"""The trainer's memory planner (trainers/memory_plan.py) and `tapioca plan`.

Golden parameter counts derived by hand from the published config.json values; the
per-GPU state of a sharded and a single-process run from those counts; the activation
bytes against what autograd saves in the packed forward on the CPU, tensor by tensor
(benchmarks/plan_vs_measured.py --smoke: within 5%, seen within 2%)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tapioca.trainers import memory_plan as mp

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "plan_vs_measured.py"


def test_parameter_counts_of_the_presets():
    # Qwen2.5-7B, per layer: q 3584^2 + k, v 2 x 3584 x 512 + o 3584^2 + biases 3584 + 1024
    # = 29,364,736; MLP 3 x 3584 x 18944 = 203,685,888; norms 2 x 3584; layer 233,057,792;
    # 28 layers 6,525,618,176 + untied embedding and head 2 x 152064 x 3584 = 1,089,994,752
    # + final norm 3584 = 7,615,616,512 (the published count).
    assert mp.PRESETS["qwen2.5-7b"].params == 7_615_616_512
    # Qwen3-30B-A3B, per layer: q 2048 x 4096 + k, v 2 x 2048 x 512 + o 4096 x 2048 + q/k
    # norms 2 x 128 = 18,874,624; 128 experts x 3 x 2048 x 768 + router 2048 x 128 =
    # 604,241,920; norms 4096; layer 623,120,640; 48 layers 29,909,790,720 + 2 x 151936 x
    # 2048 = 622,329,856 + 2048 = 30,532,122,624 (the published 30.5B).
    assert mp.PRESETS["qwen3-30b-a3b"].params == 30_532_122_624


def test_sharded_state_is_split_over_every_rank():
    m = mp.PRESETS["qwen2.5-7b"]
    p = mp.plan(m, mp.TrainShape(tokens=8192, dp=8))
    # fp32 masters and gradients 4 B, Adam's two moments 8 B per parameter, over 8 ranks.
    assert p.parts["weights (fp32 shard)"] == 4 * m.params / 8
    assert p.parts["gradients (fp32 shard)"] == 4 * m.params / 8
    assert p.parts["optimizer (Adam moments)"] == 8 * m.params / 8
    # tp 2 splits the matrices (norms stay whole on each tp rank), dp x cp shards the rest.
    q = mp.plan(m, mp.TrainShape(tokens=8192, dp=2, tp=2, cp=2))
    norms = m.layers * 2 * m.hidden + m.hidden
    assert q.parts["weights (fp32 shard)"] == pytest.approx(4 * ((m.params - norms) / 2 + norms) / 4)


def test_lora_under_fsdp_keeps_state_for_the_adapter_only():
    m = mp.PRESETS["qwen2.5-7b"]
    full = mp.plan(m, mp.TrainShape(tokens=8192, dp=4))
    lora = mp.plan(m, mp.TrainShape(tokens=8192, dp=4, lora_params=40_000_000))
    # The frozen base is sharded as before; gradients and Adam's moments are the adapter's.
    assert lora.parts["weights (fp32 shard)"] == 4 * (m.params + 40_000_000) / 4
    assert lora.parts["gradients (fp32 shard)"] == 4 * 40_000_000 / 4
    assert lora.parts["optimizer (Adam moments)"] == 8 * 40_000_000 / 4
    assert lora.peak < full.peak - 11 * m.params / 4


def test_bf16_shards_and_weights_without_masters_keep_moments_in_their_dtype():
    m = mp.PRESETS["qwen2.5-7b"]
    fp32 = mp.plan(m, mp.TrainShape(tokens=8192, dp=4))
    # actor.param_dtype=bfloat16 under FSDP: bf16 shards and gradients; with fp32 masters
    # (MasterAdamW) 2 + 2 + 12 = 16 B a parameter, as fp32 shards' 4 + 4 + 8.
    bf16 = mp.plan(m, mp.TrainShape(tokens=8192, dp=4, param_dtype="bfloat16"))
    assert bf16.parts["weights (bf16 shard)"] == bf16.parts["gradients (bf16 shard)"] == 2 * m.params / 4
    assert bf16.parts["optimizer (Adam moments + fp32 masters)"] == 12 * m.params / 4
    assert bf16.peak == pytest.approx(fp32.peak, rel=0.01)
    # Without masters torch's AdamW keeps its two moments zeros_like the bf16 shards: 8 B.
    plain = mp.plan(m, mp.TrainShape(tokens=8192, dp=4, param_dtype="bfloat16", fp32_master_weights=False))
    assert plain.parts["optimizer (Adam moments)"] == 4 * m.params / 4
    assert plain.peak < fp32.peak - 7.9 * m.params / 4
    # One process, likewise.
    one = mp.plan(mp.PRESETS["qwen2-0.5b"], mp.TrainShape(tokens=4096, param_dtype="bfloat16",
                                                          fp32_master_weights=False))
    assert one.parts["optimizer (moments)"] == 4 * mp.PRESETS["qwen2-0.5b"].params


def test_one_process_bf16_weights_with_fp32_masters():
    m = mp.PRESETS["qwen2-0.5b"]
    p = mp.plan(m, mp.TrainShape(tokens=16384, param_dtype="bfloat16"))
    # bf16 weights and gradients; MasterAdamW: fp32 masters + 2 moments = 12 B / parameter.
    assert p.parts["weights"] == 2 * m.params and p.parts["gradients"] == 2 * m.params
    assert p.parts["optimizer (moments + fp32 masters)"] == 12 * m.params
    off = mp.plan(m, mp.TrainShape(tokens=16384, param_dtype="bfloat16", offload_optimizer=True))
    assert off.parts["optimizer (moments + fp32 masters)"] == 0


def test_context_and_tensor_parallelism_divide_the_activations():
    m = mp.PRESETS["qwen2.5-7b"]
    one = mp.activation_bytes(m, mp.TrainShape(tokens=32768, dp=1, tp=1, cp=2, fsdp_param_dtype="bfloat16"))
    two = mp.activation_bytes(m, mp.TrainShape(tokens=32768, dp=1, tp=1, cp=4, fsdp_param_dtype="bfloat16"))
    assert two == pytest.approx(one / 2)  # cp: every per-token tensor by cp
    tp1 = mp.layer_activation_bytes(m, mp.TrainShape(tokens=1, dp=2, fsdp_param_dtype="bfloat16"))
    tp2 = mp.activation_bytes(m, mp.TrainShape(tokens=1, dp=1, tp=2, fsdp_param_dtype="bfloat16"))
    seq, gathered, split = tp1
    # tp: the all-gathered projection inputs stay whole on every tp rank.
    assert tp2 == pytest.approx(m.layers * (seq / 2 + gathered + split / 2))


def test_the_layouts_the_trainer_refuses_are_not_planned():
    moe, dense = mp.PRESETS["qwen3-30b-a3b"], mp.PRESETS["qwen2.5-7b"]
    assert not mp.valid_layout(moe, 2, 1) and not mp.valid_layout(moe, 1, 2)  # dense MLPs only
    assert mp.valid_layout(moe, 1, 1)
    assert mp.valid_layout(mp.PRESETS["qwen2.5-72b"], 1, 16)  # 8 kv heads, repeated for cp 16
    assert not mp.valid_layout(dense, 8, 1)  # 28 heads
    assert mp.valid_layout(dense, 4, 1) and not mp.valid_layout(dense, 4, 2)  # 28 heads / 8
    assert (2, 2, 2) in mp.layouts(8) and (1, 8, 1) in mp.layouts(8)


def test_saved_activations_match_the_packed_forward():
    spec = importlib.util.spec_from_file_location("plan_vs_measured", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.smoke_activations()
    assert [r["case"] for r in rows] == [c[0] for c in bench.SMOKE_CASES]
    for r in rows:
        assert r["ok"], r


def test_tapioca_plan_says_whether_it_fits():
    from tapioca.ops.cli import app

    runner = CliRunner()
    fits = runner.invoke(app, ["plan", "--model", "qwen2.5-7b", "--gpu-gib", "141", "--tokens", "8192",
                               "fsdp.world_size=8", "actor.device=cuda", "actor.gradient_checkpointing=true"])
    assert fits.exit_code == 0, fits.output
    assert "fits in 141 GiB" in fits.output and "optimizer (Adam moments)" in fits.output
    # 72B in fp32 Adam state on 8 GPUs: 16 B x 72.7B / 8 = 145 GB of state alone per GPU.
    big = runner.invoke(app, ["plan", "--model", "qwen2.5-72b", "--gpu-gib", "141", "--layouts", "-o", "json",
                              "fsdp.world_size=8", "actor.device=cuda"])
    assert big.exit_code == 0, big.output
    rows = json.loads(big.output)
    assert {(r["dp"], r["tp"], r["cp"]) for r in rows} >= {(8, 1, 1), (1, 8, 1), (2, 2, 2)}
    assert not any(r["fits"] for r in rows)
    tiny = runner.invoke(app, ["plan", "--config", "examples/demo_cpu.yaml", "--gpu-gib", "1"])
    assert tiny.exit_code == 0 and "fits in 1 GiB" in tiny.output, tiny.output


# Peaks measured on one H200 (torch.cuda.max_memory_allocated over the timed steps) by
# benchmarks/trainer_step.py, recorded in benchmarks/RESULTS.md ("Fixed lengths"): the fast
# path (bf16 weights + fp32 masters, fused AdamW, liger, flash varlen, Triton logprobs
# keeping the logits, chunks of 8192; FAST_BIG adds recompute_swiglu), 128-token prompts.
_FAST = dict(param_dtype="bfloat16", liger=True, logprob_kernel="triton", keep_logits=True, chunk_tokens=8192,
             attention="varlen")


@pytest.mark.parametrize("shape, train, measured_gib", [
    ("qwen2-0.5b", dict(_FAST, tokens=16384, scored_tokens=16 * 896), 26.28),  # 0.5B fast 16 x 1024
    ("qwen2.5-1.5b", dict(_FAST, recompute_swiglu=True, tokens=16384, scored_tokens=8 * 1920), 49.75),
    ("qwen2.5-3b", dict(_FAST, recompute_swiglu=True, tokens=4096, scored_tokens=2 * 1920, micro_batches=4),
     57.47),  # 3B fast mb4k: 4 micro-batches of 2 x 2048
    ("qwen2.5-3b", dict(_FAST, recompute_swiglu=True, tokens=2048, scored_tokens=1920, micro_batches=8), 52.22),
    ("qwen2.5-3b", dict(_FAST, checkpoint_every=1, tokens=16384, scored_tokens=8 * 1920), 49.03),  # 3B fast + AC
])
def test_the_planner_is_within_15_percent_of_peaks_measured_on_an_h200(shape, train, measured_gib):
    p = mp.plan(mp.PRESETS[shape], mp.TrainShape(**train))
    assert p.peak / mp.GIB == pytest.approx(measured_gib, rel=0.15)
