"""`tapioca plan`: the trainer's memory per GPU for a config, before renting the GPUs.

Reads ``--config X.yaml`` plus dotted overrides (``fsdp.world_size=8
fsdp.tensor_parallel_size=2``); the model's shape comes from ``model.path``'s
config.json, or ``--model PRESET`` (qwen2.5-7b, qwen2.5-32b, qwen2.5-72b, qwen3-30b-a3b,
...), or the tiny model's fields. Prints the per-GPU bytes of weights, gradients,
optimizer state and activations under the config's (dp, tp, cp) and whether the peak fits
``--gpu-gib``; ``--layouts`` compares every (dp, tp, cp) of the same world size. The
arithmetic is :mod:`tapioca.trainers.memory_plan` (what it counts and leaves out).
"""

from __future__ import annotations

from typing import Optional

import typer

from ..schemas.errors import ConfigError
from .cli_context import EXTRA_ARGS, OUTPUT_HELP, check_output, console, emit_json

app = typer.Typer()


@app.command("plan", context_settings=EXTRA_ARGS)
def plan_command(
    ctx: typer.Context,
    config: Optional[str] = typer.Option(None, "--config", "-c", help="YAML config file (a TrainConfig)."),
    gpu_gib: float = typer.Option(80.0, "--gpu-gib", help="GPU memory to fit in, GiB (H100/A100 80, H200 141)."),
    model: Optional[str] = typer.Option(None, "--model", help="A model preset instead of the config's model."),
    tokens: Optional[int] = typer.Option(None, "--tokens",
                                         help="Tokens of one micro-batch (default: actor.mb_max_tokens)."),
    micro_batches: int = typer.Option(2, "--micro-batches",
                                      help="Micro-batches per optimizer step (> 1 keeps the gradients "
                                           "during the forward, as gradient accumulation does)."),
    all_layouts: bool = typer.Option(False, "--layouts", help="Every (dp, tp, cp) of fsdp.world_size."),
    output: str = typer.Option("table", "-o", "--output", help=OUTPUT_HELP),
) -> None:
    """Per-GPU memory of the trainer (weights, gradients, optimizer, activations) and
    whether it fits a GPU."""
    from ..config.loader import load_config
    from ..config.schema import TrainConfig
    from ..trainers import memory_plan as mp

    check_output(output)
    cfg = load_config(TrainConfig, config, list(ctx.args))
    if model:
        if model not in mp.PRESETS:
            raise ConfigError(f"--model {model!r}: use one of {', '.join(mp.PRESETS)}")
        shape = mp.PRESETS[model]
    elif cfg.model.path:
        shape = mp.ModelShape.from_dir(cfg.model.path)
    else:
        shape = mp.tiny_shape(cfg.model)
    train = mp.train_shape(cfg.actor, cfg.fsdp, tokens=tokens, micro_batches=micro_batches)
    plans = [mp.plan(shape, train)]
    if all_layouts:
        plans = [mp.plan(shape, mp.with_layout(train, dp, tp, cp))
                 for dp, tp, cp in mp.layouts(cfg.fsdp.world_size) if mp.valid_layout(shape, tp, cp)]
    if output == "json":
        emit_json([{"model": p.model.name, "params": p.model.params, "dp": p.train.dp, "tp": p.train.tp,
                    "cp": p.train.cp, "tokens": p.train.tokens,
                    "parts_gib": {k: v / mp.GIB for k, v in p.parts.items()},
                    "peak_gib": p.peak / mp.GIB, "peak_at": p.peak_at, "fits": p.fits(gpu_gib),
                    "gpu_gib": gpu_gib} for p in plans])
        return
    if not all_layouts:
        console.print(plans[0].table(gpu_gib), soft_wrap=True, highlight=False)
        return
    console.print(f"{shape.name}: {shape.params / 1e9:.2f}B parameters, {train.tokens} tokens per micro-batch, "
                  f"{cfg.fsdp.world_size} GPUs of {gpu_gib:g} GiB", highlight=False)
    for p in plans:
        t = p.train
        console.print(f"  dp={t.dp} tp={t.tp} cp={t.cp}: {p.peak / mp.GIB:8.1f} GiB "
                      f"{'fits' if p.fits(gpu_gib) else 'does NOT fit'}", highlight=False)
