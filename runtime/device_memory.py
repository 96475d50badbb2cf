"""What every GPU of a run holds, and whether it fits (`tapioca plan`, the check `tapioca
train` makes before any role starts, the advice an out-of-memory step ends with).

Consumes a resolved :class:`~tapioca.config.schema.TrainConfig` (its ``auto`` device
defaults applied) and the model's shape (:class:`~tapioca.trainers.memory_plan.
ModelShape`); emits a :class:`RunMemoryPlan`: per device (``cuda:0``, ...), the bytes of
each process placed there, by part. Pure arithmetic: no torch, no GPU.

Per process (the local launcher's placement, ops/run_setup.py ``role_counts``):

* **trainer**: the peak of a training step (trainers/memory_plan.py, on
  ``actor.mb_max_tokens`` tokens, LoRA's frozen base counted once) and the caching
  allocator's slack beside it (:data:`TRAINER_RESERVE`); the ``weights.buffer_slots``
  device buffers of the ``ipc`` transport (a version in ``model.dtype``, a LoRA run's
  adapter only); a frozen reference (``actor.kl_ctl`` > 0; a LoRA run's is its base, free),
  a teacher (``distill.kd_weight`` > 0), a critic (``advantage.estimator: gae``: its
  weights, gradients and AdamW state stay; its activations come after the policy's).
  Under FSDP (``fsdp.world_size`` > 1) rank r is on ``cuda:r``.
* **each in-process engine** (rollout workers, the agent proxy, the evaluator): the
  weights in ``model.dtype`` (+ a LoRA run's base copies of the targeted weights, which
  the paged engine keeps to merge adapters), the KV cache by the engine's own rule
  (``rollout.kv_cache_tokens``, else what the rollout needs, config/schema.py
  ``kv_tokens_needed``, at most ``rollout.kv_cache_memory_fraction`` of the card; 2 x
  layers x kv heads x head dim x dtype bytes per token), the decode graphs' pool and the
  prefill workspace (:func:`engine_workspace_bytes`).
* **a CUDA context** per process and device (:data:`CUDA_CONTEXT_BYTES`).

Sleep mode (``rollout.enable_sleep_mode``) gives an idle engine's KV cache back while the
trainer steps, but only while the engine idles (at eta > 0 it rarely does), so a shared
device is planned at the sum of every process's peak; what sleep gives back is reported
beside it (:attr:`DevicePlan.sleep_frees`). Not planned: a vLLM / SGLang server's memory
(its own ``gpu_memory_utilization``), NCCL's buffers, the CPU.

:func:`fitting_changes` tries, in the planner, the settings that lower a device's total
(``actor.mb_max_tokens`` halved, ``actor.gradient_checkpointing``, the KV cache's
fraction, ``weights.buffer_slots=1``, ``weights.transport=file``, ``actor.lora.enabled``, then
combinations) and names
those that fit.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..config.schema import kv_tokens_needed
from ..models.families import read_config_json, text_part, vision_of
from ..schemas.errors import ConfigError
from ..trainers import memory_plan as mp
from .run import replace_path

log = logging.getLogger(__name__)

GIB = mp.GIB
# A process's CUDA context and library workspaces (cuBLAS, NCCL off): what
# torch.cuda.max_memory_allocated never counts but the card does.
# <!-- measured: CUDA context per process on the H100 (TODO, lead) -->
CUDA_CONTEXT_BYTES = 0.5 * GIB
# The trainer's caching allocator holds freed blocks it cannot reuse for the next shape
# (micro-batches differ in length): this fraction of its step's peak beside it.
# <!-- measured: reserved / allocated of the example's trainer on the H100 (TODO, lead) -->
TRAINER_RESERVE = 0.05
# The micro-batch size the advice halves down to at most: below a sequence's own length
# a sequence still gets a micro-batch of its own.
MIN_MB_TOKENS = 1024
# What an auto-sized KV cache leaves free on its card beside the plan when the engine
# sizes it from what the other processes' planned peaks leave (:func:`fit_kv_cache`): the
# plan came within 0.1-8 % of the measured peaks on the H100 (benchmarks/RESULTS.md, issue
# 37; the 3B example with its fitted cache: 76.97 GiB measured, 77.08 planned), and a
# trainer's allocation in a step is up to ~0.6 GiB at 3B.
KV_FIT_MARGIN = 0.02


def gib(n: float) -> str:
    """``141``, ``79.2``: GiB with one decimal, none when whole."""
    return f"{n / GIB:.1f}".removesuffix(".0")


@dataclass(frozen=True)
class Part:
    member: str  # "trainer-0", "rollout-0", "evaluator-0", "proxy-0"
    what: str
    bytes: float
    sleeps: bool = False  # given back by sleep mode while the trainer steps


@dataclass
class DevicePlan:
    device: str  # "cuda:0"
    parts: list[Part] = field(default_factory=list)

    @property
    def total(self) -> float:
        return sum(p.bytes for p in self.parts)

    @property
    def sleep_frees(self) -> float:
        return sum(p.bytes for p in self.parts if p.sleeps)

    @property
    def members(self) -> list[str]:
        return list(dict.fromkeys(p.member for p in self.parts))

    def member_total(self, member: str) -> float:
        return sum(p.bytes for p in self.parts if p.member == member)

    def summary(self) -> str:
        """``trainer-0 31.2 + rollout-0 15.3 GiB``."""
        return " + ".join(f"{m} {self.member_total(m) / GIB:.1f}" for m in self.members) + " GiB"


@dataclass
class RunMemoryPlan:
    trainer: mp.MemoryPlan  # one rank's training step
    devices: dict[str, DevicePlan]
    card_bytes: float  # the card the KV fraction is of
    notes: list[str] = field(default_factory=list)

    def over(self, budgets: dict[str, float]) -> list[tuple[DevicePlan, float]]:
        """The devices whose total exceeds their budget (bytes), with the budget."""
        return [(d, budgets[name]) for name, d in self.devices.items()
                if name in budgets and d.total > budgets[name]]

    def fits(self, budgets: dict[str, float]) -> bool:
        return not self.over(budgets)

    def table(self, budgets: dict[str, float], against: str) -> str:
        """One block per device: each process's parts, the total and the verdict against
        ``budgets`` (``against`` says what the budget is: the card, --gpu-gib)."""
        rows: list[str] = []
        for name, d in self.devices.items():
            members = d.members
            shared = f"shared by {', '.join(members)}" if len(members) > 1 else members[0]
            rows.append(f"{name} ({shared}), checked against {against}:")
            for p in d.parts:
                rows.append(f"  {p.member:<12s} {p.what:<44s} {p.bytes / GIB:8.2f} GiB")
            total = f"  {'total':<57s} {d.total / GIB:8.2f} GiB"
            budget = budgets.get(name)
            if budget is not None:
                verdict = "fits" if d.total <= budget else "does NOT fit"
                total += f": {verdict} in {gib(budget)} GiB ({100 * d.total / budget:.0f}%)"
            rows.append(total)
            if d.sleep_frees:
                rows.append(f"  sleep mode gives back {d.sleep_frees / GIB:.2f} GiB (the idle engines' KV "
                            "cache) while the trainer steps; planned without it")
        rows += [f"not planned: {n}" for n in self.notes]
        return "\n".join(rows)

    def as_json(self, budgets: dict[str, float]) -> list[dict[str, Any]]:
        out = []
        for name, d in self.devices.items():
            budget = budgets.get(name)
            out.append({"device": name, "members": d.members, "total_gib": d.total / GIB,
                        "budget_gib": None if budget is None else budget / GIB,
                        "fits": None if budget is None else d.total <= budget,
                        "sleep_frees_gib": d.sleep_frees / GIB,
                        "parts": [{"member": p.member, "what": p.what, "gib": p.bytes / GIB,
                                   "sleeps": p.sleeps} for p in d.parts]})
        return out


# ------------------------------------------------------------------ shapes


def shape_of_dir(path: str | Path) -> mp.ModelShape:
    """The decoder's shape from a model directory's config.json (a vision-language
    model's text part, with its vision tower's parameters)."""
    doc = read_config_json(path)
    shape = mp.ModelShape.from_hf_config(text_part(doc), name=Path(path).name)
    if vision_of(doc) is None:
        return shape
    from ..models.vision import vision_tower_params

    try:
        tower = vision_tower_params(str(path))
    except Exception as exc:  # noqa: BLE001 - a plan without the tower beats no start; the load says more
        log.warning("the vision tower of %s could not be counted (%s: %s): planned without it",
                    path, type(exc).__name__, exc)
        tower = 0
    return dataclasses.replace(shape, vision_params=tower)


def run_shape(cfg: Any, model: str | None = None) -> mp.ModelShape:
    """The policy's shape: a preset (``model``), ``model.path``'s config.json, else the
    tiny model's fields."""
    if model:
        if model not in mp.PRESETS:
            raise ConfigError(f"--model {model!r}: use one of {', '.join(mp.PRESETS)}")
        return mp.PRESETS[model]
    if cfg.model.path:
        try:
            return shape_of_dir(cfg.model.path)
        except (OSError, KeyError, ValueError) as exc:
            raise ConfigError(f"cannot read the model's shape from {cfg.model.path}/config.json "
                              f"({type(exc).__name__}: {exc}); pass --model PRESET") from None
    return mp.tiny_shape(cfg.model)


def _other_shape(path: str, policy: mp.ModelShape) -> mp.ModelShape:
    try:
        return shape_of_dir(path) if path else policy
    except (OSError, KeyError, ValueError):
        return policy  # unreadable here (another host): planned as the policy's size


# ------------------------------------------------------------------ devices


def device_name(device: str) -> str:
    """``cuda`` is ``cuda:0`` (each process's current device is 0 unless it says)."""
    device = str(device)
    return "cuda:0" if device == "cuda" else device


def on_gpu(device: str) -> bool:
    return str(device).startswith("cuda")


def step_micro_batches(cfg: Any) -> int:
    """Micro-batches of one optimizer step, at most (every output at its length limit;
    > 1 keeps every gradient while the next forward runs)."""
    tokens = cfg.train_dataset.prompts_per_step * cfg.gconfig.n_samples * cfg.gconfig.max_new_tokens
    return max(1, math.ceil(tokens / cfg.actor.ppo_n_minibatches / cfg.actor.mb_max_tokens))


# <!-- measured: the paged engine's graph pool + prefill workspace on the H100 (TODO, lead) -->
def engine_workspace_bytes(m: mp.ModelShape, dtype_bytes: int, *, max_rows: int,
                           max_prefill_tokens: int, cuda_graphs: bool) -> float:
    """An engine's transient memory beside its weights and KV cache: one layer's forward
    in flight for a prefill of ``max_prefill_tokens`` (residual, norm, q/k/v, attention
    out, the MLP's gate, up and product) plus the rows' fp32 logits and probabilities;
    the decode graphs' private pool holds the same for ``max_rows`` rows."""
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    inter = m.experts_per_token * m.moe_intermediate if m.experts else m.intermediate
    per_token = dtype_bytes * (4 * m.hidden + q + 2 * kv + 3 * inter)
    logits = max_rows * m.vocab * 4 * 2
    prefill = max_prefill_tokens * per_token + logits
    graphs = max_rows * per_token + logits if cuda_graphs else 0.0
    return prefill + graphs


def kv_bytes_per_token(m: mp.ModelShape, dtype_bytes: int) -> int:
    return 2 * m.layers * m.kv_heads * m.head_dim * dtype_bytes


def kv_cache_tokens(m: mp.ModelShape, rollout: Any, dtype_bytes: int, *, need_tokens: int,
                    card_bytes: float) -> int:
    """The paged engine's KV-cache size in tokens (engines/block_manager.py
    ``plan_num_blocks``, less its 90%-of-free cap, which depends on who started first):
    ``kv_cache_tokens`` if set, else the need (0: unknown) capped by the fraction."""
    bs = rollout.kv_block_size_tokens
    block = kv_bytes_per_token(m, dtype_bytes) * bs
    if rollout.kv_cache_tokens > 0:
        return (-(-rollout.kv_cache_tokens // bs) + 1) * bs
    blocks = int(card_bytes * rollout.kv_cache_memory_fraction // block)
    if need_tokens > 0:
        blocks = min(blocks, -(-need_tokens // bs) + 1)
    return blocks * bs


def _engine_parts(member: str, m: mp.ModelShape, cfg: Any, *, need_tokens: int,
                  card_bytes: float) -> list[Part]:
    r = cfg.rollout
    b = mp.dtype_bytes(cfg.model.dtype)
    parts = [Part(member, f"weights ({cfg.model.dtype})", b * m.params)]
    if cfg.actor.lora.enabled:
        base = m.layers * sum(i * o for i, o in mp.lora_targets(m, cfg.actor.lora.target_modules).values())
        parts.append(Part(member, "LoRA: base copies of the targeted weights", b * base))
    tokens = kv_cache_tokens(m, r, b, need_tokens=need_tokens, card_bytes=card_bytes)
    sleeps = bool(r.enable_sleep_mode) and r.paged
    parts.append(Part(member, f"KV cache ({tokens:,} tokens)", tokens * kv_bytes_per_token(m, b), sleeps))
    if cfg.weights.transport in ("ipc", "nccl") and not cfg.actor.lora.enabled:
        # weights/receiver.py copies each version into a buffer of its own, verifies its
        # checksums there, then loads it (measured on the H100 at 3B: the engine held 20.6
        # GiB where weights + KV + workspace + context plan 14.9; this is the rest).
        parts.append(Part(member, f"{cfg.weights.transport} receive buffer", b * m.params))
    parts.append(Part(member, "decode graphs + prefill workspace", engine_workspace_bytes(
        m, b, max_rows=r.max_batch_size, max_prefill_tokens=r.max_prefill_tokens,
        cuda_graphs=r.cuda_graphs)))
    parts.append(Part(member, "CUDA context", CUDA_CONTEXT_BYTES))
    return parts


def _engines(cfg: Any) -> list[tuple[str, int]]:
    """``(member, KV tokens it needs)`` of every in-process engine the run starts."""
    g, r = cfg.gconfig, cfg.rollout
    out: list[tuple[str, int]] = []
    if cfg.agent.enabled:
        out.append(("proxy-0", 0))  # sized by the fraction alone (runtime/builders.py)
    else:
        need = kv_tokens_needed(r.max_batch_size, g.max_new_tokens, g.n_samples)
        out += [(f"rollout-{i}", need) for i in range(r.workers)]
    if cfg.evaluator.enabled and cfg.valid_dataset is not None:
        sampling = cfg.eval_gconfig.resolve(g)
        out.append(("evaluator-0", kv_tokens_needed(r.max_batch_size, sampling["max_new_tokens"],
                                                    cfg.eval.k)))
    return out


# ------------------------------------------------------------------ the plan


def plan_run(cfg: Any, shape: mp.ModelShape, *, card_bytes: float, tokens: int | None = None,
             micro_batches: int | None = None) -> RunMemoryPlan:
    """Every GPU's memory for ``cfg`` (see the module docstring). ``card_bytes``: the
    card's total memory (the KV-cache fraction is of it); ``tokens`` / ``micro_batches``
    override the trainer's micro-batch size and count."""
    a = cfg.actor
    micro = micro_batches if micro_batches is not None else step_micro_batches(cfg)
    train = mp.train_shape(a, cfg.fsdp, tokens=tokens, micro_batches=micro, model=shape,
                           freeze_vision=cfg.vlm.freeze_vision_encoder)
    step = mp.plan(shape, train)
    devices: dict[str, DevicePlan] = {}
    notes: list[str] = []

    def add(device: str, parts: list[Part]) -> None:
        devices.setdefault(device, DevicePlan(device)).parts.extend(parts)

    if on_gpu(a.device):
        trainer = "trainer-0"
        ranks = ([device_name(a.device)] if cfg.fsdp.world_size == 1
                 else [f"cuda:{r}" for r in range(cfg.fsdp.world_size)])
        for rank, device in enumerate(ranks):
            member = trainer if len(ranks) == 1 else f"{trainer} rank {rank}"
            add(device, _trainer_parts(member, cfg, shape, step, rank=rank))
    for member, need in _engines(cfg):
        if cfg.rollout.engine != "torch":
            notes.append(f"{member}'s {cfg.rollout.engine} server (its own gpu_memory_utilization)")
            continue
        if on_gpu(cfg.rollout.device):
            add(device_name(cfg.rollout.device),
                _engine_parts(member, shape, cfg, need_tokens=need, card_bytes=card_bytes))
    return RunMemoryPlan(step, devices, card_bytes, notes)


def _trainer_parts(member: str, cfg: Any, shape: mp.ModelShape, step: mp.MemoryPlan, *,
                   rank: int) -> list[Part]:
    a, w = cfg.actor, mp.dtype_bytes(cfg.actor.weights_dtype)
    parts = [Part(member, f"training step ({step.peak_at})", step.peak),
             Part(member, f"allocator reserve ({100 * TRAINER_RESERVE:.0f}% of the step)",
                  TRAINER_RESERVE * step.peak)]
    wt = cfg.weights
    if rank == 0 and (wt.transport == "ipc" or (wt.transport == "nccl" and wt.nccl_backend != "gloo")):
        published = step.train.lora_params or shape.params  # an adapter, or every weight
        slot = mp.dtype_bytes(cfg.model.dtype) * published
        parts.append(Part(member, f"{wt.transport} weight slots ({wt.buffer_slots} x {slot / GIB:.2f} GiB)",
                          wt.buffer_slots * slot))
    if a.kl_ctl > 0 and not (a.lora.enabled and not cfg.ref.path):
        ref = _other_shape(cfg.ref.path, shape)
        parts.append(Part(member, f"reference model ({a.weights_dtype})", w * ref.params / cfg.fsdp.world_size))
    if cfg.distill.kd_weight > 0:
        teacher = _other_shape(cfg.distill.teacher_path, shape)
        parts.append(Part(member, f"teacher model ({a.weights_dtype})", w * teacher.params / cfg.fsdp.world_size))
    if cfg.advantage.estimator == "gae":
        critic = _other_shape(cfg.critic.path, shape)
        c_train = mp.TrainShape(tokens=cfg.critic.mb_max_tokens, param_dtype=a.weights_dtype,
                                autocast_dtype=a.autocast_dtype, fp32_master_weights=False,
                                attention=step.train.attention)
        # fp32 Adam moments and gradients in the weights' dtype; its activations (no LM
        # head) replace the policy's after the policy's step.
        state = (2 * w + 8) * critic.params
        extra = max(0.0, mp.activation_bytes(critic, c_train) - step.parts["activations (one micro-batch)"])
        parts.append(Part(member, "critic (weights, gradients, AdamW)", state + extra))
    parts.append(Part(member, "CUDA context", CUDA_CONTEXT_BYTES))
    return parts


# ------------------------------------------------------------------ what makes it fit


def with_settings(cfg: Any, settings: dict[str, Any]) -> Any:
    """``cfg`` with dotted ``settings`` applied (each section validated again)."""
    for dotted, value in settings.items():
        cfg = replace_path(cfg, dotted, value)
    return cfg


def _render(settings: dict[str, Any]) -> str:
    def value(v: Any) -> str:
        return str(v).lower() if isinstance(v, bool) else (f"{v:g}" if isinstance(v, float) else str(v))
    return " ".join(f"{k}={value(v)}" for k, v in settings.items())


def fitting_changes(cfg: Any, shape: mp.ModelShape, budgets: dict[str, float], *, card_bytes: float,
                    limit: int = 3) -> tuple[list[str], RunMemoryPlan | None]:
    """Settings that make ``cfg`` fit ``budgets`` (bytes per device), each tried in the
    planner: ``actor.mb_max_tokens`` halved until it fits, activation checkpointing, a
    smaller KV cache (``rollout.kv_cache_memory_fraction``, or ``kv_cache_tokens`` when
    fixed), one weight buffer instead of two, weights by file, LoRA; then activation
    checkpointing with the micro-batch halved, one buffer, weights by file, or LoRA (a
    combination the feature table refuses is not tried). Returns up to ``limit`` alternatives (each a
    ``key=value ...`` string) and, when none fits, the smallest plan tried."""
    from ..config.features import check_features
    from ..config.lora import lora_spec
    from ..config.policy import resolve_policy

    if plan_run(cfg, shape, card_bytes=card_bytes).fits(budgets):
        return [], None
    tried: list[tuple[dict[str, Any], RunMemoryPlan]] = []
    policy = resolve_policy(cfg)  # the model's facts, read once; each attempt's adapter below

    def attempt(settings: dict[str, Any]) -> RunMemoryPlan | None:
        try:
            changed = with_settings(cfg, settings)
            # A combination the config or the feature table refuses (LoRA with a critic,
            # LoRA on a vision-language model, ...) is no advice.
            check_features(changed, dataclasses.replace(policy, adapter=lora_spec(changed)))
            p = plan_run(changed, shape, card_bytes=card_bytes)
        except ConfigError:
            return None
        tried.append((settings, p))
        return p

    def halve(base: dict[str, Any]) -> dict[str, Any] | None:
        mb = cfg.actor.mb_max_tokens // 2
        while mb >= MIN_MB_TOKENS:
            settings = {**base, "actor.mb_max_tokens": mb}
            p = attempt(settings)
            if p is not None and p.fits(budgets):
                return settings
            mb //= 2
        return None

    a = cfg.actor
    found: list[dict[str, Any]] = []
    single: list[Callable[[], dict[str, Any] | None]] = [lambda: halve({})]
    ac = {} if a.gradient_checkpointing else {"actor.gradient_checkpointing": True}
    if ac:
        single.append(lambda: ac if _fits(attempt(ac), budgets) else None)
    single.append(lambda: _smaller_kv(cfg, shape, budgets, card_bytes, attempt))
    # ipc / nccl: one device buffer instead of two (a reader's torn copy is retried).
    slots = {"weights.buffer_slots": 1} if cfg.weights.transport in ("ipc", "nccl") \
        and cfg.weights.buffer_slots > 1 else {}
    if slots:
        single.append(lambda: slots if _fits(attempt(slots), budgets) else None)
    # file: no device buffer on either side (the trainer's slots, the engine's receive
    # buffer), for a file written and read per version.
    files = {"weights.transport": "file"} if cfg.weights.transport in ("ipc", "nccl") else {}
    if files:
        single.append(lambda: files if _fits(attempt(files), budgets) else None)
    lora = {} if a.lora.enabled else {"actor.lora.enabled": True}
    if lora:
        single.append(lambda: lora if _fits(attempt(lora), budgets) else None)
    for fn in single:
        settings = fn()
        if settings:
            found.append(settings)
    if not found:
        for combo in ({**ac}, {**ac, **slots}, {**ac, **files}, {**ac, **lora}):
            if not combo:
                continue
            settings = combo if _fits(attempt(combo), budgets) else halve(combo)
            if settings and settings not in found:
                found.append(settings)
    if found:
        return [_render(s) for s in found[:limit]], None
    smallest = min(tried, key=lambda t: max(d.total for d in t[1].devices.values()), default=None)
    return [], smallest[1] if smallest else None


def _fits(p: RunMemoryPlan | None, budgets: dict[str, float]) -> bool:
    return p is not None and p.fits(budgets)


def kv_tokens_that_fit(cfg: Any, shape: mp.ModelShape, budgets: dict[str, float],
                       card_bytes: float) -> int | None:
    """The largest KV cache (tokens per in-process engine) with which the rollout's device
    fits ``budgets``, if that is smaller than the cache the engines size for themselves
    and still holds one group's rows (``n_samples`` outputs and their prompt); else None."""
    r, g = cfg.rollout, cfg.gconfig
    if r.engine != "torch" or not on_gpu(r.device):
        return None
    base = plan_run(cfg, shape, card_bytes=card_bytes)
    device = base.devices.get(device_name(r.device))
    if device is None or device_name(r.device) not in budgets:
        return None
    kv = sum(p.bytes for p in device.parts if p.what.startswith("KV cache"))
    engines = sum(1 for p in device.parts if p.what.startswith("KV cache"))
    room = budgets[device.device] - (device.total - kv)
    per_token = kv_bytes_per_token(shape, mp.dtype_bytes(cfg.model.dtype))
    tokens = int(room / max(engines, 1) // per_token) // r.kv_block_size_tokens * r.kv_block_size_tokens \
        - r.kv_block_size_tokens
    now = kv // max(engines, 1) // per_token
    if tokens >= now or tokens < kv_tokens_needed(g.n_samples, g.max_new_tokens, g.n_samples):
        return None  # no smaller than it is, or too small for one group's rows
    return tokens


def _smaller_kv(cfg: Any, shape: mp.ModelShape, budgets: dict[str, float], card_bytes: float,
                attempt: Callable[[dict[str, Any]], RunMemoryPlan | None]) -> dict[str, Any] | None:
    """The advice's KV setting: :func:`kv_tokens_that_fit` as the key the user sized it by."""
    tokens = kv_tokens_that_fit(cfg, shape, budgets, card_bytes)
    if tokens is None:
        return None
    if cfg.rollout.kv_cache_tokens > 0:
        settings: dict[str, Any] = {"rollout.kv_cache_tokens": tokens}
    else:
        per_token = kv_bytes_per_token(shape, mp.dtype_bytes(cfg.model.dtype))
        fraction = math.floor(100 * tokens * per_token / card_bytes) / 100
        if fraction <= 0:
            return None
        settings = {"rollout.kv_cache_memory_fraction": fraction}
    return settings if _fits(attempt(settings), budgets) else None


def fit_kv_cache(cfg: Any, shape: mp.ModelShape, budgets: dict[str, float], *,
                 card_bytes: float) -> tuple[Any, int] | None:
    """``(cfg with rollout.kv_cache_tokens set, its tokens)`` when the run does not fit
    ``budgets`` as planned but does with a smaller KV cache, and the cache is the engine's
    own to size (``rollout.kv_cache_tokens`` 0): the largest that leaves
    :data:`KV_FIT_MARGIN` of the card free beside the plan. None when the cache is fixed,
    when the run fits as it is, or when a smaller cache is not enough (the refusal's advice
    then names other settings). The KV cache is the one part sized from what is left:
    fewer rows decode at once (the rest wait for room), nothing else changes."""
    if cfg.rollout.kv_cache_tokens > 0 or plan_run(cfg, shape, card_bytes=card_bytes).fits(budgets):
        return None
    margin = KV_FIT_MARGIN * card_bytes
    tight = {d: b - margin for d, b in budgets.items()}
    tokens = kv_tokens_that_fit(cfg, shape, tight, card_bytes)
    if tokens is None:
        return None
    fitted = with_settings(cfg, {"rollout.kv_cache_tokens": tokens})
    return (fitted, tokens) if plan_run(fitted, shape, card_bytes=card_bytes).fits(tight) else None


def advice_line(cfg: Any, shape: mp.ModelShape, budgets: dict[str, float], *, card_bytes: float) -> str:
    """``fits with A, or B`` / ``nothing tried fits (...)``: what to set ("" when it
    fits as it is)."""
    if plan_run(cfg, shape, card_bytes=card_bytes).fits(budgets):
        return ""
    changes, smallest = fitting_changes(cfg, shape, budgets, card_bytes=card_bytes)
    if changes:
        return "fits with " + ", or ".join(changes)
    least = ""
    if smallest is not None:
        worst = max(smallest.devices.values(), key=lambda d: d.total)
        least = f" (the least tried still needs {worst.total / GIB:.1f} GiB on {worst.device})"
    from ..config.policy import resolve_policy

    # A vision-language policy does not run with the FSDP2 trainer (feature table: vlm_x_fsdp).
    shard = "" if resolve_policy(cfg).vision is not None else ", or shard the trainer (fsdp.world_size)"
    return ("nothing tried fits" + least + ": use a larger GPU, put the engine on another one "
            f"(rollout.device=cuda:1){shard}")
