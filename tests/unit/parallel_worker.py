"""One rank of the tensor / context-parallel tests (tests/unit/test_parallel_trainer.py),
run as a script with torchrun's environment; arguments: the output directory and the
run (``w2``: 2 ranks, ``w4``: 4 ranks, ``memory``: 1 or 2 ranks under a memory cap).
Not a test module: the test imports its builders to run the same steps in one process.

w2 (2 ranks): the vocabulary-parallel logprobs against the full computation; one step at
tp 2 and one at cp 2 (activation checkpointing on); then checkpoints across layouts: a
tp-2 actor steps, saves, steps again; a dp-2 actor (tp 1) loads that checkpoint and takes
the same second step; it saves, steps; a tp-2 actor loads that one and takes the same
step; a rollback (whole weights in) at tp 2.
w4 (4 ranks): one step at dp 2 x tp 2, and one at tp 2 x cp 2 (key/value heads repeated
for Ulysses), on a Qwen3 model (q/k norms) with an untied LM head.
memory: one 32k-token micro-batch under RLIMIT_DATA = (data size after set-up) + the cap:
at WORLD_SIZE 1 the plain actor (cp 1), at 2 the cp-2 actor; writes the peak figures.

Rank 0 writes ``<run>.json`` and ``<run>.safetensors`` to the output directory.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import fsdp_worker  # noqa: E402

VOCAB = 16  # divisible by tp 2
PAD = 11  # in tp rank 1's half of the vocabulary: its embedding row's gradient is dropped


def make_model(arch: str = "qwen2", tie: bool = True) -> torch.nn.Module:
    from tapioca.models.factory import build_tiny_model

    return build_tiny_model(VOCAB, arch=arch, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                            intermediate_size=64, seed=3, tie_word_embeddings=tie, pad_token_id=PAD)


def make_items(step: int = 0):
    """fsdp_worker's batch over this vocabulary, with the pad token in some inputs."""
    items = fsdp_worker.make_items(step)
    g = torch.Generator().manual_seed(200 + step)
    for it in items:
        it.input_ids = [int(x) % VOCAB for x in it.input_ids]
        if int(torch.randint(0, 3, (1,), generator=g)) == 0:
            it.input_ids[0] = PAD
    return items


def make_cfg(**overrides):
    return fsdp_worker.make_cfg(**overrides)


W4_MODEL = dict(arch="qwen3", tie=False)
# 16 sequences of 2048 tokens in one micro-batch (attention's memory is per token either
# way; longer sequences only cost CPU time here); widths where activations dominate.
MEMORY_LENGTHS = (2048,) * 16
# Above the start of the step: cp 2 peaks at ~435 MiB per rank, cp 1 needs ~835 (measured
# with big allocations mmapped, MALLOC_MMAP_THRESHOLD_ in the test, so the data segment is
# what is live).
MEMORY_CAP_MIB = int(os.environ.get("TAPIOCA_MEMORY_CAP_MIB", "620"))


def memory_model() -> torch.nn.Module:
    from tapioca.models.factory import build_tiny_model

    return build_tiny_model(64, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=4,
                            intermediate_size=256, seed=5, max_position_embeddings=8192)


def memory_items():
    from tapioca.trainers.batching import SeqItem

    g = torch.Generator().manual_seed(7)
    items = []
    for i, n in enumerate(MEMORY_LENGTHS):
        ids = torch.randint(1, 64, (n,), generator=g).tolist()
        out = n - 16
        items.append(SeqItem(group_id=f"m{i}", input_ids=ids, prompt_len=16, behav_logprobs=[-4.0] * out,
                             versions=[0] * out, loss_mask=[1] * out, advantage=1.0 if i % 2 else -1.0,
                             reward=0.0))
    return items


def memory_cfg():
    return make_cfg(mb_max_tokens=sum(MEMORY_LENGTHS), logprob_chunk_tokens=2048, attention_backend="sdpa")


def _vm(field: str) -> int:
    """A /proc/self/status figure in bytes (VmData: the data segment RLIMIT_DATA caps)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def vocab_parallel_check(channel, tp_rank: int, tp: int) -> dict:
    """The vocabulary-parallel logprobs / entropy and their gradients against the full
    computation (the tree's chunked logprobs) on the same inputs, fp32 and fp64."""
    from tapioca.algorithms.logprobs import gather_logprobs_entropy
    from tapioca.models.vocab_parallel import vocab_parallel_logprobs_entropy

    out = {}
    for dtype, scale in ((torch.float32, 1.0), (torch.float32, 12.0), (torch.float64, 1.0)):
        g = torch.Generator().manual_seed(11)
        h = (torch.randn(13, 32, generator=g, dtype=dtype) * scale)
        w = torch.randn(VOCAB, 32, generator=g, dtype=dtype) * 0.3
        labels = torch.randint(0, VOCAB, (13,), generator=g)
        labels[3] = -100
        g_lp, g_ent = torch.randn(13, generator=g, dtype=dtype), torch.randn(13, generator=g, dtype=dtype)
        hf, wf = h.clone().requires_grad_(), w.clone().requires_grad_()
        lp_ref, ent_ref = gather_logprobs_entropy(hf, wf, labels, temperature=0.7, chunk_tokens=5,
                                                  compute_entropy=True, kernel="torch")
        torch.autograd.backward([lp_ref, ent_ref], [g_lp, g_ent])
        rows = VOCAB // tp
        hp = h.clone().requires_grad_()
        wp = w[tp_rank * rows:(tp_rank + 1) * rows].clone().requires_grad_()
        lp, ent = vocab_parallel_logprobs_entropy(hp, wp, labels, vocab_start=tp_rank * rows,
                                                  group=channel.group, temperature=0.7, chunk_tokens=5)
        torch.autograd.backward([lp, ent], [g_lp, g_ent])
        grad_h = hp.grad.clone()
        torch.distributed.all_reduce(grad_h, group=channel.group)  # the partial sums over tp

        def rel(a, b):
            return float((a - b).norm() / b.norm())

        out[f"{dtype}".split(".")[1] + f"_x{scale:g}"] = {
            "logprobs": rel(lp, lp_ref), "entropy": rel(ent, ent_ref), "grad_hidden": rel(grad_h, hf.grad),
            "grad_weight": rel(wp.grad, wf.grad[tp_rank * rows:(tp_rank + 1) * rows]),
            "ignored_zero": float(lp[3]) == 0.0}
    return out


def plan_check(tp: int, cp: int, world: int) -> dict:
    """Activations autograd saves in one bf16 forward of the parallel packed model on this
    rank, and what the memory planner says for it (trainers/memory_plan.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from plan_vs_measured import planned_forward_saved, saved_bytes, shape_of

    from tapioca.config.distributed import FSDPConfig
    from tapioca.models.factory import build_tiny_model
    from tapioca.models.parallel import MeshDims, ParallelPackedCausalLM, parallel_token_logprobs
    from tapioca.trainers.fsdp_actor import build_mesh
    from tapioca.trainers.memory_plan import TrainShape
    from tapioca.trainers.packing import to_packed

    fsdp = FSDPConfig(world_size=world, tensor_parallel_size=tp, context_parallel_size=cp)
    dims = MeshDims(build_mesh(fsdp, torch.device("cpu")), tp=tp, cp=cp)
    model = build_tiny_model(96, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, intermediate_size=160,
                             seed=0, dtype=torch.bfloat16)
    packed = ParallelPackedCausalLM(model, dims, torch.device("cpu"), attention_backend="sdpa")
    items = make_items(0)
    for it in items:  # longer sequences (random tokens of this vocabulary)
        it.input_ids = (it.input_ids * 20)[:len(it.input_ids) * 20]
        n = len(it.input_ids) - it.prompt_len
        it.behav_logprobs, it.versions, it.loss_mask = [-1.0] * n, [0] * n, [1] * n
    b = to_packed(items, "cpu", pad_to=tp * cp, cp=cp)
    got = saved_bytes(lambda: parallel_token_logprobs(
        packed, b.input_ids_N, b.position_ids_N, b.seqs, b.rows_M, b.labels_M, b.cp_rows or (0, b.rows_M.numel()),
        temperature=1.0, chunk_tokens=4096)[0], model)
    t = TrainShape(tokens=b.input_ids_N.numel(), scored_tokens=b.rows_M.numel(), dp=world // (tp * cp), tp=tp,
                   cp=cp, attention="sdpa", padded_tokens=b.seqs.n_seqs * b.seqs.max_len)
    return {"saved": got, "planned": planned_forward_saved(shape_of(model, "tiny"), t)}


def main(out_dir: str, run: str) -> None:
    from safetensors.torch import save_file

    from tapioca.config.distributed import FSDPConfig
    from tapioca.trainers.checkpoint import TrainerProgress
    from tapioca.trainers.fsdp_actor import ShardedActor
    from tapioca.trainers.fsdp_ranks import Channel, init_process_groups, rank_from_env
    from tapioca.trainers.ppo_actor import PPOActor

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    out = Path(out_dir)
    results: dict = {}
    tensors: dict[str, torch.Tensor] = {}
    if run == "memory" and world == 1:
        actor = PPOActor(memory_model(), memory_cfg(), temperature=1.0, pad_token_id=0)
        results["cp1"] = capped_step(lambda: actor.train_step(memory_items(), policy_version=0))
        (out / "memory-cp1.json").write_text(json.dumps(results))
        return
    info = rank_from_env(FSDPConfig(world_size=world))
    channel = Channel(init_process_groups(FSDPConfig(world_size=world, timeout_s=600), info,
                                          torch.device("cpu")), info)

    def actor_for(model, tp=1, cp=1, **cfg):
        fsdp = FSDPConfig(world_size=world, param_dtype="float32", tensor_parallel_size=tp,
                          context_parallel_size=cp)
        return ShardedActor(model, make_cfg(**cfg), fsdp, channel=channel, temperature=1.0, pad_token_id=0,
                            device=torch.device("cpu"))

    def command(actor, method, *args, **kwargs):
        # Rank 0 calls the actor's API; the others run the one command it broadcasts.
        if info.leader:
            return method(*args, **kwargs)
        actor._run(channel.broadcast())
        return None

    def record(name, actor, result):
        grads = fsdp_worker.full_grads(actor.model)
        if info.leader:
            results[name] = {"metrics": result.metrics, "applied": result.applied_minibatches}
            tensors.update({f"{name}.grad.{k}": v for k, v in grads.items()})

    def weights(name, actor):
        full = command(actor, actor.full_state_dict)
        if info.leader:
            tensors.update({f"{name}.{k}": v.clone() for k, v in full.items()})
        return full

    if run == "memory":
        actor = actor_for(memory_model(), cp=2, **{k: getattr(memory_cfg(), k) for k in
                                                   ("mb_max_tokens", "logprob_chunk_tokens", "attention_backend")})
        figures = capped_step(lambda: command(actor, actor.train_step, memory_items(), policy_version=0))
        rows = channel.gather(figures)
        if info.leader:
            (out / "memory-cp2.json").write_text(json.dumps({"cp2": rows}))
            channel.broadcast({"op": "stop"})
        else:
            actor.serve()
        return
    if run == "w2":
        results["vocab_parallel"] = vocab_parallel_check(channel, info.rank, world)
        results["plan"] = {f"tp{tp}cp{cp}": plan_check(tp, cp, world) for tp, cp in ((2, 1), (1, 2))}
        ckpt = out / "checkpoints" / "trainer.pt"
        a = actor_for(make_model(), tp=2)
        record("tp2", a, command(a, a.train_step, make_items(0), policy_version=0))
        weights("tp2.w1", a)
        command(a, a.save_checkpoint, ckpt, TrainerProgress(version=1, trained_groups=["g0"]))
        command(a, a.train_step, make_items(1), policy_version=1)
        weights("tp2.w2", a)
        c = actor_for(make_model(), cp=2, gradient_checkpointing=True)
        record("cp2", c, command(c, c.train_step, make_items(0), policy_version=0))
        b = actor_for(make_model())  # dp 2, tp 1
        restored = command(b, b.load_checkpoint, ckpt)
        command(b, b.train_step, make_items(1), policy_version=1)
        weights("dp2.w2", b)
        command(b, b.save_checkpoint, ckpt, TrainerProgress(version=2, trained_groups=["g0", "g1"]))
        command(b, b.train_step, make_items(2), policy_version=2)
        weights("dp2.w3", b)
        a2 = actor_for(make_model(), tp=2)
        restored2 = command(a2, a2.load_checkpoint, ckpt)
        command(a2, a2.train_step, make_items(2), policy_version=2)
        w3 = weights("tp2again.w3", a2)
        command(a2, a2.load_full_state_dict, w3 if info.leader else None)
        rolled = weights("tp2.rolled", a2)
        if info.leader:
            results["restored"] = [restored.__dict__, restored2.__dict__]
            results["rollback_equal"] = all(torch.equal(rolled[k], v) for k, v in w3.items())
    elif run == "w4":
        d = actor_for(make_model(**W4_MODEL), tp=2)  # dp 2 x tp 2
        record("dp2tp2", d, command(d, d.train_step, make_items(0), policy_version=0))
        weights("dp2tp2.w1", d)
        e = actor_for(make_model(**W4_MODEL), tp=2, cp=2)
        record("tp2cp2", e, command(e, e.train_step, make_items(0), policy_version=0))
    if info.leader:
        channel.broadcast({"op": "stop"})
        save_file(tensors, str(out / f"{run}.safetensors"))
        (out / f"{run}.json").write_text(json.dumps(results))
    else:
        ShardedActor.serve(a if run == "w2" else d)  # until the stop above
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def capped_step(step) -> dict:
    """Run ``step`` with this process's data segment capped at its size now plus
    MEMORY_CAP_MIB; the figures of the step, or the error that stopped it."""
    import threading

    base_data, base_rss = _vm("VmData"), _vm("VmRSS")
    peak = {"data": base_data}
    done = threading.Event()

    def poll() -> None:  # the data segment's high-water mark (the kernel keeps none)
        while not done.wait(0.02):
            peak["data"] = max(peak["data"], _vm("VmData"))

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (base_data + MEMORY_CAP_MIB * 2**20, hard))
    t0 = time.perf_counter()
    tokens = None
    try:
        result = step()
        tokens = result.metrics["actor/trained_tokens"] if result is not None else None
        error = None
    except (RuntimeError, MemoryError) as exc:  # the allocator's "can't allocate memory"
        error = f"{type(exc).__name__}: {str(exc)[:200]}"
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
        done.set()
        watcher.join()
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"cap_mib": MEMORY_CAP_MIB, "error": error, "trained_tokens": tokens,
            "seconds": round(time.perf_counter() - t0, 1),
            "peak_rss_over_start_mib": round((peak_rss - base_rss) / 2**20, 1),
            "peak_data_over_start_mib": round((peak["data"] - base_data) / 2**20, 1)}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)  # past gloo's teardown at exit: see fsdp_worker.exit_now
