"""The trainer's optimizer: AdamW, fused on CUDA, with fp32 master weights for bf16 models.

Consumes a model's parameters and :class:`~tapioca.config.schema.ActorConfig` (its
``optimizer`` section, AReaL's names); emits an optimizer with the ``torch.optim``
surface the trainer uses (``zero_grad``, ``step``, ``state_dict`` / ``load_state_dict``,
``state.clear()``) plus ``clip_grad_norm_``, and the learning-rate schedule
(:func:`lr_factor`, :func:`set_lr`).

* ``param_dtype: float32``: ``torch.optim.AdamW`` on the model's own parameters
  (``fused=True`` on CUDA with ``fused_optimizer``). This is also what an FSDP2 trainer
  uses: FSDP2 keeps sharded fp32 parameters and casts to bf16 itself
  (``MixedPrecisionPolicy``), so the masters below are a single-GPU device.
* ``param_dtype: bfloat16`` with ``fp32_master_weights`` (default): :class:`MasterAdamW`.
  Forward and backward run on bf16 weights and produce bf16 gradients (half the memory
  and traffic of fp32 weights under autocast, and no per-step weight casts); AdamW runs
  on fp32 master copies, and the updated masters are copied back into the bf16 weights.
  16 bytes per parameter (bf16 weight + bf16 grad + fp32 master + two fp32 moments)
  instead of 18 (fp32 weight + grad + moments + autocast's bf16 copies).
  ``offload_optimizer`` keeps masters and moments in pinned CPU memory and steps there
  (4 bytes per parameter stay on the GPU; the step costs host time and two PCIe copies).

Gradients accumulate across micro-batches in the parameters' dtype (bf16 for a bf16
model); the masters receive them once per optimizer step, after clipping in fp32.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

from ..config.optimizer import OptimizerConfig
from ..config.schema import ActorConfig

# Master-weight updates run in buckets of this many elements, so the fp32 copies of
# the gradients exist for one bucket at a time (512 MiB), not for the whole model.
BUCKET_ELEMS = 1 << 27


def build_optimizer(model: torch.nn.Module, cfg: ActorConfig, device: torch.device | str):
    """The optimizer ``cfg`` asks for over ``model``'s trainable parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    cuda = torch.device(device).type == "cuda"
    opt = cfg.optimizer
    kw = dict(lr=opt.lr, weight_decay=opt.weight_decay, betas=opt.betas, eps=opt.eps)
    low_precision = any(p.dtype in (torch.bfloat16, torch.float16) for p in params)
    if low_precision and cfg.fp32_master_weights:
        return MasterAdamW(params, fused=cfg.fused_optimizer and (cuda or cfg.offload_optimizer),
                           offload=cfg.offload_optimizer, **kw)
    if cuda and cfg.fused_optimizer:
        kw["fused"] = True
    return torch.optim.AdamW(params, **kw)


def lr_factor(step: int, total_steps: int, opt: OptimizerConfig) -> float:
    """The multiple of ``opt.lr`` for the optimizer step taken after ``step`` steps (0-based)
    of ``total_steps``: AReaL's schedules (Hugging Face's ``get_*_schedule_with_warmup``).

    Warm-up: the first ``int(warmup_steps_proportion * total_steps)`` steps rise linearly
    from 0 (``step / warmup``). Then ``constant``: 1; ``linear``: from 1 down to
    ``min_lr_ratio`` at ``total_steps``; ``cosine``: ``min + (1 - min) * (1 + cos(pi * p)) / 2``
    with p the fraction of the post-warm-up steps done. E.g. cosine, 10 steps, warm-up
    0.2, min 0.1: steps 0, 1 give 0, 0.5; step 2 gives 1; step 6 (p = 0.5) gives 0.55.
    A function of the step count alone, so a resumed run continues the same curve."""
    warmup = int(opt.warmup_steps_proportion * total_steps)
    if step < warmup:
        return step / max(1, warmup)
    if opt.lr_scheduler_type == "constant":
        return 1.0
    done = min(max(step - warmup, 0) / max(1, total_steps - warmup), 1.0)
    decay = 1.0 - done if opt.lr_scheduler_type == "linear" else 0.5 * (1.0 + math.cos(math.pi * done))
    return opt.min_lr_ratio + (1.0 - opt.min_lr_ratio) * decay


def set_lr(optimizer, lr: float) -> None:
    """Set every parameter group's learning rate (``torch.optim`` or :class:`MasterAdamW`)."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_grad_norm_(optimizer, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the gradients the next ``optimizer.step()`` applies; returns the total norm
    before clipping (a device tensor: reading it is the caller's one host sync)."""
    if isinstance(optimizer, MasterAdamW):
        return optimizer.clip_grad_norm_(max_norm)
    params = [p for p in model.parameters() if p.grad is not None]
    if len({_mesh_of(p.grad) for p in params}) <= 1:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    total = total_grad_norm([p.grad for p in params])
    for group in _by_mesh(params, lambda p: p.grad).values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def _by_mesh(items: list, grad=lambda g: g) -> dict[int, list]:
    out: dict[int, list] = {}
    for x in items:
        out.setdefault(id(_mesh_of(grad(x))), []).append(x)
    return out


def _mesh_of(t: torch.Tensor):
    return getattr(t, "device_mesh", None)


def total_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of ``grads`` (fp32), also when they are DTensors on several device
    meshes (FSDP2's and the expert-parallel one), which one foreach norm cannot mix."""
    squares = []
    for group in _by_mesh(grads).values():
        norm = torch.nn.utils.get_total_norm(group, 2.0)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        squares.append(norm.float().square())
    return torch.stack(squares).sum().sqrt()


class _StateView:
    """``optimizer.state`` of :class:`MasterAdamW`: the per-parameter AdamW state, keyed
    by the model's parameters. ``clear()`` drops the moments (a rollback does)."""

    def __init__(self, opt: "MasterAdamW") -> None:
        self._opt = opt

    def _items(self):
        for i, master in enumerate(self._opt.masters):
            inner = self._opt._inner[self._opt._bucket_of[i]]
            if master in inner.state:
                yield self._opt.params[i], inner.state[master]

    def __len__(self) -> int:
        return sum(1 for _ in self._items())

    def __iter__(self):
        return (p for p, _ in self._items())

    def __getitem__(self, param: torch.Tensor) -> dict:
        for p, state in self._items():
            if p is param:
                return state
        raise KeyError("no optimizer state for this parameter (no step taken yet)")

    def clear(self) -> None:
        for inner in self._opt._inner:
            inner.state.clear()


class MasterAdamW:
    """AdamW on fp32 master copies of low-precision parameters (see the module docstring).

    A parameter changed in place outside the optimizer (``copy_`` of a rollback,
    ``model.load_state_dict``) is noticed through its version counter at the next step,
    and its master is re-read from it, so masters and weights never drift apart.
    """

    def __init__(self, params: Iterable[torch.Tensor], *, lr: float, weight_decay: float,
                 betas: tuple[float, float], eps: float = 1e-8, fused: bool = False,
                 offload: bool = False) -> None:
        seen: set[int] = set()
        self.params = [p for p in params if not (id(p) in seen or seen.add(id(p)))]
        self.offload = offload
        self.masters = [self._new_master(p) for p in self.params]
        buckets: list[list[int]] = []
        size = BUCKET_ELEMS
        for i, p in enumerate(self.params):
            if size + p.numel() > BUCKET_ELEMS and (not buckets or buckets[-1]):
                buckets.append([])
                size = 0
            buckets[-1].append(i)
            size += p.numel()
        self._buckets = buckets
        self._bucket_of = {i: b for b, ids in enumerate(buckets) for i in ids}
        self._inner = [torch.optim.AdamW([self.masters[i] for i in ids], lr=lr, betas=betas, eps=eps,
                                         weight_decay=weight_decay, fused=fused or None)
                       for ids in buckets]
        self._versions = [p._version for p in self.params]
        self._clip_coef: torch.Tensor | None = None
        self.state = _StateView(self)

    def _new_master(self, p: torch.Tensor) -> torch.Tensor:
        if self.offload:
            return p.detach().to("cpu", torch.float32).pin_memory() if torch.cuda.is_available() \
                else p.detach().to("cpu", torch.float32, copy=True)
        return p.detach().to(torch.float32, copy=True)

    @property
    def param_groups(self) -> list[dict]:
        """Every bucket's group: setting ``lr`` on each changes the learning rate."""
        return [g for inner in self._inner for g in inner.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Total gradient norm (fp32); the clip factor is applied to the fp32 master
        gradients in :meth:`step`."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return torch.zeros(())
        if len({_mesh_of(g) for g in grads}) > 1:
            total = total_grad_norm(grads)
        else:
            norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
            total = torch.linalg.vector_norm(torch.stack(norms))
        self._clip_coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        return total

    @torch.no_grad()
    def step(self) -> None:
        for i, p in enumerate(self.params):
            if p._version != self._versions[i]:  # changed outside the optimizer
                self.masters[i].copy_(p.detach())
        coef = self._clip_coef
        self._clip_coef = None
        for ids, inner in zip(self._buckets, self._inner):
            live = [i for i in ids if self.params[i].grad is not None]
            if not live:
                continue
            grads = [self.params[i].grad.to(self.masters[i].device, torch.float32) for i in live]
            if coef is not None:
                for group in _by_mesh(grads).values():  # one foreach per device mesh
                    torch._foreach_mul_(group, coef.to(group[0].device))
            for i, g in zip(live, grads):
                self.masters[i].grad = g
            inner.step()
            for i in live:
                self.masters[i].grad = None
                p = self.params[i]
                p.copy_(self.masters[i])
                self._versions[i] = p._version
            del grads

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """``torch.optim`` layout over the model's parameter order, each parameter's
        state also holding its fp32 ``master``."""
        state: dict[int, dict] = {}
        groups = []
        for ids, inner in zip(self._buckets, self._inner):
            sd = inner.state_dict()
            for local, i in enumerate(ids):
                state[i] = dict(sd["state"].get(local, {}), master=self.masters[i])
            groups.append({k: v for k, v in sd["param_groups"][0].items() if k != "params"})
        group = dict(groups[0], params=list(range(len(self.params))))
        return {"state": state, "param_groups": [group]}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        group = {k: v for k, v in state_dict["param_groups"][0].items() if k != "params"}
        for ids, inner in zip(self._buckets, self._inner):
            local_state = {}
            for local, i in enumerate(ids):
                entry = dict(state_dict["state"].get(i, state_dict["state"].get(str(i), {})))
                master = entry.pop("master", None)
                if master is not None:
                    self.masters[i].copy_(master)
                    self.params[i].copy_(self.masters[i])
                    self._versions[i] = self.params[i]._version
                if entry:
                    local_state[local] = entry
            inner.load_state_dict({"state": local_state,
                                   "param_groups": [dict(group, params=list(range(len(ids))))]})
