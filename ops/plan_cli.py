"""`tapioca plan`: a run's memory on each GPU for a config, before renting the GPUs.

Reads ``--config X.yaml`` plus dotted overrides (``fsdp.world_size=8
fsdp.tensor_parallel_size=2``); the model's shape comes from ``model.path``'s
config.json, or ``--model PRESET`` (qwen2.5-7b, qwen2.5-32b, qwen2.5-72b, qwen3-30b-a3b,
...), or the tiny model's fields. Prints the trainer's step (weights, gradients,
optimizer state, activations: :mod:`tapioca.trainers.memory_plan`), then each GPU the
run uses with every process on it (the trainer and its weight buffers, reference,
critic; each in-process engine's weights, KV cache, graphs and workspace; a CUDA context
each: :mod:`tapioca.runtime.device_memory`), whether it fits, what sleep mode gives
back, what the trainer writes to disk at most at once (runtime/disk_plan.py), and when
it does not fit, the settings that make it fit (or, where only the
engines' auto-sized KV cache is in the way, the cache `tapioca train` will size instead). The card is this
machine's GPU when it has one (its total memory), else ``--gpu-gib``. ``--layouts``
compares the trainer's every (dp, tp, cp) of the same world size.
"""

from __future__ import annotations

from typing import Optional

import typer

from .cli_context import EXTRA_ARGS, OUTPUT_HELP, check_output, console, emit_json

app = typer.Typer()

DEFAULT_GPU_GIB = 80.0


@app.command("plan", context_settings=EXTRA_ARGS)
def plan_command(
    ctx: typer.Context,
    config: Optional[str] = typer.Option(None, "--config", "-c", help="YAML config file (a TrainConfig)."),
    gpu_gib: Optional[float] = typer.Option(
        None, "--gpu-gib", help="GPU memory to fit in, GiB (H100/A100 80, H200 141). Default: this "
        f"machine's GPU, else {DEFAULT_GPU_GIB:g}."),
    model: Optional[str] = typer.Option(None, "--model", help="A model preset instead of the config's model."),
    tokens: Optional[int] = typer.Option(None, "--tokens",
                                         help="Tokens of one micro-batch (default: actor.mb_max_tokens)."),
    micro_batches: Optional[int] = typer.Option(
        None, "--micro-batches", help="Micro-batches per optimizer step (> 1 keeps the gradients during "
        "the forward, as gradient accumulation does). Default: the step's outputs at their length limit "
        "over actor.mb_max_tokens."),
    all_layouts: bool = typer.Option(False, "--layouts", help="Every (dp, tp, cp) of fsdp.world_size."),
    output: str = typer.Option("table", "-o", "--output", help=OUTPUT_HELP),
) -> None:
    """Memory of the run on each GPU (trainer, engines, weight buffers) and whether it
    fits; the settings that make it fit when it does not."""
    from ..config.loader import load_config
    from ..config.schema import TrainConfig
    from ..runtime import device_memory as dm
    from ..runtime import disk_plan as dp
    from ..trainers import memory_plan as mp

    check_output(output)
    cfg = load_config(TrainConfig, config, list(ctx.args))
    shape = dm.run_shape(cfg, model)
    if all_layouts:
        train = mp.train_shape(cfg.actor, cfg.fsdp, tokens=tokens, micro_batches=micro_batches or 2,
                               model=shape, freeze_vision=cfg.vlm.freeze_vision_encoder)
        _layouts(cfg, shape, train, gpu_gib or DEFAULT_GPU_GIB, output)
        return
    devices = list(dm.plan_run(cfg, shape, card_bytes=(gpu_gib or DEFAULT_GPU_GIB) * dm.GIB).devices)
    budgets, card_bytes, against = _cards(devices, gpu_gib)
    fitted = dm.fit_kv_cache(cfg, shape, budgets, card_bytes=card_bytes) \
        if tokens is None and micro_batches is None else None
    kv_note = ""
    if fitted is not None:  # what `tapioca train` will run (ops/memory_check.py)
        cfg, kv_tokens = fitted
        kv_note = (f"the KV cache the rollout asks for does not fit beside the rest: `tapioca train` sizes "
                   f"it to {kv_tokens:,} tokens (planned above; rollout.kv_cache_tokens sets it yourself)")
    run = dm.plan_run(cfg, shape, card_bytes=card_bytes, tokens=tokens, micro_batches=micro_batches)
    advice = dm.advice_line(cfg, shape, budgets, card_bytes=card_bytes) if tokens is None \
        and micro_batches is None else ""
    step = run.trainer
    disk = dp.plan_disk(cfg, shape)
    if output == "json":
        emit_json([{"model": step.model.name, "params": step.model.params, "dp": step.train.dp,
                    "tp": step.train.tp, "cp": step.train.cp, "tokens": step.train.tokens,
                    "parts_gib": {k: v / mp.GIB for k, v in step.parts.items()},
                    "peak_gib": step.peak / mp.GIB, "peak_at": step.peak_at,
                    "fits": run.fits(budgets) if run.devices else step.fits(card_bytes / mp.GIB),
                    "gpu_gib": card_bytes / mp.GIB, "card": against,
                    "devices": run.as_json(budgets), "advice": advice, "not_planned": run.notes,
                    "kv_cache_tokens_fitted": fitted[1] if fitted else None,
                    "disk": {"checkpoint_gib": disk.checkpoint / mp.GIB, "total_gib": disk.total / mp.GIB,
                             "parts_gib": {k: v / mp.GIB for k, v in disk.parts.items()}}}])
        return
    # A run on the CPU has no device table: the trainer's step against --gpu-gib, as before.
    console.print(step.table(None if run.devices else card_bytes / mp.GIB), soft_wrap=True, highlight=False)
    if run.devices:
        console.print(run.table(budgets, against), soft_wrap=True, highlight=False)
    console.print(f"disk under run_dir at most {disk.total / mp.GIB:.1f} GiB ({disk.summary()}; a checkpoint "
                  f"is {disk.checkpoint / mp.GIB:.1f} GiB): `tapioca train` checks it against the free disk",
                  soft_wrap=True, highlight=False)
    for line in (kv_note, advice):
        if line:
            console.print(line, soft_wrap=True, highlight=False)


def _cards(devices: list[str], gpu_gib: float | None) -> tuple[dict[str, float], float, str]:
    """``(budget per device, the card's total, what that is)``: ``--gpu-gib`` when
    given, else this machine's GPUs (their total memory), else the default."""
    from ..runtime import device_memory as dm
    from .memory_check import query_cards

    if gpu_gib is None and devices:
        cards = query_cards(devices)
        if cards:
            first = next(iter(cards.values()))
            total = {d: c.total for d, c in cards.items()}
            missing = [d for d in devices if d not in total]
            return ({**total, **{d: first.total for d in missing}}, first.total,
                    f"{first.name}, {first.total / dm.GIB:.1f} GiB (this machine's)")
    gib = gpu_gib or DEFAULT_GPU_GIB
    return ({d: gib * dm.GIB for d in devices}, gib * dm.GIB,
            f"{gib:g} GiB (--gpu-gib{'' if gpu_gib else '; no GPU here'})")


def _layouts(cfg, shape, train, gpu_gib: float, output: str) -> None:
    from ..trainers import memory_plan as mp

    plans = [mp.plan(shape, mp.with_layout(train, dp, tp, cp))
             for dp, tp, cp in mp.layouts(cfg.fsdp.world_size) if mp.valid_layout(shape, tp, cp)]
    if output == "json":
        emit_json([{"model": p.model.name, "params": p.model.params, "dp": p.train.dp, "tp": p.train.tp,
                    "cp": p.train.cp, "tokens": p.train.tokens,
                    "parts_gib": {k: v / mp.GIB for k, v in p.parts.items()},
                    "peak_gib": p.peak / mp.GIB, "peak_at": p.peak_at, "fits": p.fits(gpu_gib),
                    "gpu_gib": gpu_gib} for p in plans])
        return
    console.print(f"{shape.name}: {shape.params / 1e9:.2f}B parameters, {train.tokens} tokens per micro-batch, "
                  f"{cfg.fsdp.world_size} GPUs of {gpu_gib:g} GiB", highlight=False)
    for p in plans:
        t = p.train
        console.print(f"  dp={t.dp} tp={t.tp} cp={t.cp}: {p.peak / mp.GIB:8.1f} GiB "
                      f"{'fits' if p.fits(gpu_gib) else 'does NOT fit'}", highlight=False)
