"""Tensor, sequence and context parallelism of the sharded trainer (models/parallel.py,
trainers/fsdp_actor.py) on gloo ranks on the CPU, against one plain process.

Tolerances (fp32 on both sides; only the order of sums differs): the loss and every
metric within 1e-5 relative, every gradient tensor within 1e-5 relative in norm
(||g - g_1|| / ||g_1||; seen ~1e-7), the vocabulary-parallel logprobs, entropy and their
gradients within 1e-6 of the tree's chunked logprobs in fp32 (1e-5 for the entropy of a
peaked distribution, logits x 12) and 1e-12 in fp64. Weights after an Adam step (lr
1e-2): within 1e-4, as in test_fsdp_trainer.py (Adam divides by sqrt(v): an element with
a near-zero gradient turns a 1e-8 difference of it into up to ~1e-5 of the step).

Two launches (each a few interpreters importing torch and transformers: generous
timeouts on this loaded box): 2 ranks (tp 2, cp 2, the vocabulary-parallel check,
checkpoints across layouts, a rollback) and 4 ranks (dp 2 x tp 2, tp 2 x cp 2). One
more pair of processes runs the long-sequence memory check
(test_32k_tokens_fit_at_cp2_under_a_cap_where_cp1_fails).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import parallel_worker as worker  # noqa: E402

from tapioca.trainers.fsdp_ranks import free_port  # noqa: E402
from tapioca.trainers.ppo_actor import PPOActor  # noqa: E402

NOT_COMPARED = {"actor/importance_weight_max_mean", "actor/micro_batches", "actor/step_time_s",
                "actor/tokens_per_s", "actor/fsdp_dummy_micro_batches", "actor/fsdp_world_size"}


def launch(out: Path, run: str, world: int, env: dict | None = None) -> None:
    """``world`` ranks of parallel_worker.py (world 1: one plain process)."""
    port = free_port("127.0.0.1")
    procs = []
    for rank in range(world):
        rank_env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)} if world > 1 else {"WORLD_SIZE": "1"}
        full = {**os.environ, **rank_env, "OMP_NUM_THREADS": "1", **(env or {})}
        log = open(out / f"{run}-{world}-rank{rank}.log", "wb")
        procs.append(subprocess.Popen([sys.executable, worker.__file__, str(out), run], env=full,
                                      stdout=log, stderr=subprocess.STDOUT))
    try:
        for p in procs:
            p.wait(timeout=900)  # generous: interpreters importing torch on a loaded 2-core box
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = "\n".join((out / f"{run}-{world}-rank{r}.log").read_text()[-3000:] for r in range(world))
    assert all(p.returncode == 0 for p in procs), logs


def _results(out: Path, run: str):
    from safetensors.torch import load_file

    return json.loads((out / f"{run}.json").read_text()), load_file(str(out / f"{run}.safetensors"))


@pytest.fixture(scope="module")
def w2(tmp_path_factory):
    out = tmp_path_factory.mktemp("parallel_w2")
    launch(out, "w2", 2)
    return _results(out, "w2")


@pytest.fixture(scope="module")
def w4(tmp_path_factory):
    out = tmp_path_factory.mktemp("parallel_w4")
    launch(out, "w4", 4)
    return _results(out, "w4")


def one_process(model_kw: dict | None = None, **cfg):
    torch.set_num_threads(1)
    actor = PPOActor(worker.make_model(**(model_kw or {})), worker.make_cfg(**cfg), temperature=1.0,
                     pad_token_id=0)
    return actor, actor.train_step(worker.make_items(0), policy_version=0)


def assert_same_step(results, tensors, name, actor, one) -> None:
    ours = results[name]["metrics"]
    for key, value in one.metrics.items():
        if key not in NOT_COMPARED:
            assert ours[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert ours["actor/trained_tokens"] == one.metrics["actor/trained_tokens"]
    assert results[name]["applied"] == one.applied_minibatches == 1
    for pname, p in actor.model.named_parameters():
        g = tensors[f"{name}.grad.{pname}"]
        rel = float((g - p.grad).norm() / p.grad.norm())
        assert rel <= 1e-5, (name, pname, rel)


def test_vocab_parallel_logprobs_and_entropy_equal_the_full_computation(w2):
    results, _ = w2
    checks = results["vocab_parallel"]
    for case, errs in checks.items():
        limit = 1e-12 if case.startswith("float64") else 1e-6
        assert errs["ignored_zero"], case
        for what in ("logprobs", "grad_hidden", "grad_weight"):
            assert errs[what] <= limit * (10 if case.endswith("x12") else 1), (case, what, errs[what])
        assert errs["entropy"] <= (1e-5 if case.endswith("x12") else limit), (case, errs["entropy"])


def test_tp2_equals_one_process(w2):
    results, tensors = w2
    actor, one = one_process()
    assert_same_step(results, tensors, "tp2", actor, one)


def test_cp2_equals_one_process(w2):
    """With activation checkpointing (the recompute runs the all-to-alls again)."""
    results, tensors = w2
    actor, one = one_process(gradient_checkpointing=True)
    assert_same_step(results, tensors, "cp2", actor, one)


def test_dp2_x_tp2_equals_one_process(w4):
    results, tensors = w4
    actor, one = one_process(worker.W4_MODEL)
    assert_same_step(results, tensors, "dp2tp2", actor, one)
    # The published weights after the step: every key of the plain state dict.
    own = actor.model.state_dict()
    assert {k.split(".w1.", 1)[1] for k in tensors if k.startswith("dp2tp2.w1.")} == set(own)
    for name, value in own.items():
        torch.testing.assert_close(tensors[f"dp2tp2.w1.{name}"], value, atol=1e-4, rtol=1e-4)


def test_tp2_x_cp2_equals_one_process(w4):
    """2 key/value heads per model, 1 per tp rank: Ulysses repeats it for cp 2."""
    results, tensors = w4
    actor, one = one_process(worker.W4_MODEL)
    assert_same_step(results, tensors, "tp2cp2", actor, one)


def test_published_weights_at_tp2_are_the_one_process_weights(w2):
    results, tensors = w2
    actor, _ = one_process()
    own = actor.model.state_dict()
    assert {k.split(".w1.", 1)[1] for k in tensors if k.startswith("tp2.w1.")} == set(own)
    for name, value in own.items():
        torch.testing.assert_close(tensors[f"tp2.w1.{name}"], value, atol=1e-4, rtol=1e-4)


def test_checkpoints_restore_across_layouts(w2):
    """tp 2 -> dp 2 (tp 1) -> tp 2: each resumed step equals the step of the layout that
    saved it (same weights and Adam moments; only the sums' order differs)."""
    results, tensors = w2
    for ours, theirs in (("dp2.w2", "tp2.w2"), ("tp2again.w3", "dp2.w3")):
        names = [k[len(theirs) + 1:] for k in tensors if k.startswith(theirs + ".")]
        assert names
        for name in names:
            torch.testing.assert_close(tensors[f"{ours}.{name}"], tensors[f"{theirs}.{name}"],
                                       atol=1e-4, rtol=1e-4, msg=f"{ours} vs {theirs}: {name}")
    assert [r["version"] for r in results["restored"]] == [1, 2]
    assert results["restored"][1]["trained_groups"] == ["g0", "g1"]


def test_rollback_at_tp2_loads_whole_weights(w2):
    assert w2[0]["rollback_equal"]


def test_32k_tokens_fit_at_cp2_under_a_cap_where_cp1_fails(tmp_path):
    """One 32,768-token micro-batch (16 x 2048; hidden 128, 2 layers, vocab 64, fp32).
    Each process's data segment is capped at its size before the step + 620 MiB
    (RLIMIT_DATA; big allocations mmapped and unmapped on free, so the segment is what
    is live). Measured here: cp 1 needs ~835 MiB and fails; cp 2 peaks at ~435 MiB per
    rank (the saved activations halve: 764 -> 383 MiB) and trains the step."""
    env = {"MALLOC_MMAP_THRESHOLD_": "1048576", "MALLOC_ARENA_MAX": "2"}
    launch(tmp_path, "memory", 1, env)
    launch(tmp_path, "memory", 2, env)
    cp1 = json.loads((tmp_path / "memory-cp1.json").read_text())["cp1"]
    cp2 = json.loads((tmp_path / "memory-cp2.json").read_text())["cp2"]
    assert cp1["error"] and "can't allocate memory" in cp1["error"], cp1
    n_out = sum(n - 16 for n in worker.MEMORY_LENGTHS)
    for rank in cp2:
        assert rank["error"] is None, cp2
        assert rank["peak_data_over_start_mib"] < rank["cap_mib"], cp2
    assert cp2[0]["trained_tokens"] == n_out, cp2


def test_memory_plan_counts_the_activations_of_a_tp_or_cp_rank(w2):
    """`tapioca plan`'s per-rank activation bytes (trainers/memory_plan.py: sequence-split
    norms, whole all-gathered projection inputs, heads split by tp x cp) against the bytes
    autograd saved on each rank in one bf16 forward at tp 2 and at cp 2 (seen: within 0.4%)."""
    for layout, figures in w2[0]["plan"].items():
        assert figures["planned"] == pytest.approx(figures["saved"], rel=0.03), layout
