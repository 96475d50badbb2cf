"""The loop shared by the supervised trainers (SFT, DPO, reward model, distillation).

Consumes a list of examples (:mod:`tapioca.trainers.supervised.data`) and a model; each
step takes ``train_dataset.batch_size`` examples from a seeded per-epoch order, lets the
trainer accumulate gradients over token-budgeted micro-batches, clips and steps AdamW.

Emits, on the same backbone as the RL trainer: per-step metrics to the
:class:`MetricsSink` (``metrics/metrics.jsonl`` + TensorBoard) and, when a broker is
configured (``bus.bootstrap_servers``), a ``MetricsEvent`` on ``metrics.v1``; every
``save_every_steps`` steps and at the end a safetensors weights file with its sha256
(``weights/vNNNNNN.safetensors``, :func:`save_weights`), a checkpoint
(``checkpoints/<kind>.safetensors``, :func:`save_checkpoint`; version = steps done) and a
``WeightsEvent`` on ``weights.v1`` keyed by ``run_id``. The finished model is written to
``final/`` with its tokenizer (``save_pretrained``), usable as ``model.path`` of an RL run.

A restart with the same run directory resumes from the checkpoint: the data order is a
function of (seed, epoch), so step s always trains the same examples.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generic, Sequence, TypeVar

import torch

from ...config.loader import to_yaml
from ...config.supervised import SupervisedTrainConfig
from ...models.forward import autocast_context, causal_token_logprobs
from ...schemas.envelope import names_a_run
from ...schemas.errors import ConfigError, FatalRoleError
from ...schemas.events import MetricsEvent, WeightsEvent
from ...weights.files import WEIGHTS_DIR, save_weights, saved_versions, weights_file
from ..checkpoint import SUFFIX, TrainerProgress, load_checkpoint, save_checkpoint
from ..metrics_sink import MetricsSink
from ..optim import lr_factor, set_lr

E = TypeVar("E")
# ``progress(step, total_steps, metrics)``, called after each step (a CLI's progress bar).
StepProgress = Callable[[int, int, dict[str, float]], None]
# ``hook(version, model, last) -> stop``: once before the first step of a fresh run
# (version 0) and after each step, ``last`` when training ends there anyway (step budget
# or ``time_limit_s``); True stops training at that version (runtime/sft_eval.py: the
# held-out evaluation and ``stop_at_eval``).
StepHook = Callable[[int, torch.nn.Module, bool], bool]


def write_supervised_run(cfg: SupervisedTrainConfig) -> Path:
    """Write the run's config to its directory (the RL trainer's layout). ``cfg`` must be
    resolved (:func:`tapioca.runtime.run.resolve_run` with ``prepare=True``: an absolute
    run directory that exists, the model, the run's bus run id), as `tapioca sft|dpo|rm|
    distill` do before they train."""
    run_dir = Path(cfg.run_path)
    if not (Path(cfg.run_dir).is_absolute() and cfg.model.path and names_a_run(cfg.bus.run_id)
            and run_dir.is_dir()):
        raise ConfigError(f"the supervised run {cfg.run_id} is not resolved (run_dir={cfg.run_dir!r}, "
                          f"model.path={cfg.model.path!r}, bus.run_id={cfg.bus.run_id!r}): call "
                          "tapioca.runtime.run.resolve_run(cfg, prepare=True) first, as the "
                          "`tapioca sft|dpo|rm|distill` commands do")
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    return run_dir


def pad_batch(seqs: Sequence[tuple[list[int], int, list[int]]], pad_token_id: int,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids, prompt_len, response_mask)`` sequences -> right-padded ``input_ids_BT``,
    ``attention_mask_BT`` and, over the ``T-1`` predicting positions, ``labels_BT``
    (-100 where not trained) and ``mask_BT``. Position t predicts token t+1."""
    B, T = len(seqs), max(len(ids) for ids, _, _ in seqs)
    input_ids = torch.full((B, T), pad_token_id, dtype=torch.long)
    attn = torch.zeros((B, T), dtype=torch.long)
    labels = torch.full((B, T - 1), -100, dtype=torch.long)
    mask = torch.zeros((B, T - 1), dtype=torch.bool)
    for b, (ids, p, resp_mask) in enumerate(seqs):
        input_ids[b, :len(ids)] = torch.tensor(ids)
        attn[b, :len(ids)] = 1
        n = len(ids) - p
        if n > 0:
            m = torch.tensor(resp_mask, dtype=torch.bool)
            sl = slice(p - 1, p - 1 + n)
            mask[b, sl] = m
            labels[b, sl] = torch.where(m, torch.tensor(ids[p:]), torch.tensor(-100))
    return input_ids.to(device), attn.to(device), labels.to(device), mask.to(device)


def token_logprobs(model: torch.nn.Module, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor,
                   labels_BT: torch.Tensor, *, chunk_tokens: int) -> torch.Tensor:
    """``logprobs_BT`` of ``labels_BT`` (0 where -100) at temperature 1, as the supervised
    losses use them: :func:`tapioca.models.forward.causal_token_logprobs`."""
    logprobs_BT, _ = causal_token_logprobs(model, input_ids_BT, attention_mask_BT, labels_BT,
                                           temperature=1.0, chunk_tokens=chunk_tokens)
    return logprobs_BT


def setup_supervised(cfg: SupervisedTrainConfig, *, load_policy: bool = True):
    """The run's config written to its directory (``cfg`` resolved, see
    :func:`write_supervised_run`), threads, seed; then ``(model, tokenizer)`` of ``model.path``."""
    from transformers.utils import logging as hf_logging

    from ...models.factory import load_model_and_tokenizer

    hf_logging.disable_progress_bar()
    write_supervised_run(cfg)
    torch.set_num_threads(cfg.actor.torch_threads)
    torch.manual_seed(cfg.seed)
    if not load_policy:
        return None, None
    return load_model_and_tokenizer(cfg.model.path, dtype=cfg.actor.param_dtype, device=cfg.actor.device)


@dataclass
class SupervisedSummary:
    kind: str
    run_dir: Path
    steps: int
    wall_s: float
    history: list[dict[str, float]] = field(default_factory=list)
    final_model_dir: Path | None = None
    data: dict[str, float] = field(default_factory=dict)
    # The checkpoint had reached the step budget already: nothing was trained.
    already_complete: bool = False
    checkpoint: Path | None = None
    # Why training ended before total_train_steps: "hook" (the step hook asked, e.g.
    # stop_at_eval), "time_limit_s"; "" when it ran to the budget.
    stopped: str = ""


class SupervisedTrainerBase(Generic[E]):
    """Subclasses set ``kind`` and implement :meth:`accumulate` (forward + backward of
    one step's examples, returning metrics) and may override :meth:`save_final`."""

    kind = "supervised"

    def __init__(self, cfg: SupervisedTrainConfig, model: torch.nn.Module, tokenizer,
                 examples: list[E], *, data_metrics: dict[str, float] | None = None) -> None:
        self.cfg = cfg
        self.device = torch.device(cfg.actor.device)
        self.model = model.to(self.device)
        self.tokenizer = tokenizer
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (
            tokenizer.eos_token_id or 0)
        self.examples = examples
        self._order_cache: tuple[int, list[int]] | None = None
        self.data_metrics = dict(data_metrics or {})
        self.run_dir = Path(cfg.run_path)
        opt = cfg.actor.optimizer
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=opt.lr,
                                           weight_decay=opt.weight_decay, betas=opt.betas, eps=opt.eps)
        self.ckpt_path = self.run_dir / "checkpoints" / f"{self.kind}{SUFFIX}"
        self.progress = load_checkpoint(self.ckpt_path, self.model, self.optimizer) or TrainerProgress()
        self.producer = None
        if cfg.bus.bootstrap_servers:
            from ...bus.producer import EventProducer

            self.producer = EventProducer(cfg.bus, f"{self.kind}-trainer")
        n, B = len(examples), cfg.train_dataset.batch_size
        self.total_steps = cfg.total_train_steps
        if cfg.total_train_epochs:
            self.total_steps = min(self.total_steps, math.ceil(cfg.total_train_epochs * n / B))

    # ---------------------------------------------------------------- helpers

    def autocast(self):
        return autocast_context(self.device, self.cfg.actor.autocast_dtype)

    def batch_for_step(self, step: int) -> tuple[list[E], int]:
        """The examples of 0-based ``step`` and the epoch they come from."""
        n, B = len(self.examples), self.cfg.train_dataset.batch_size
        out, epoch = [], 0
        for pos in range(step * B, (step + 1) * B):
            epoch, i = divmod(pos, n)
            out.append(self.examples[self._order(epoch)[i]])
        return out, epoch

    def _order(self, epoch: int) -> list[int]:
        if self._order_cache is not None and self._order_cache[0] == epoch:
            return self._order_cache[1]
        order = list(range(len(self.examples)))
        if self.cfg.train_dataset.shuffle:
            random.Random(self.cfg.seed * 1_000_003 + epoch).shuffle(order)
        self._order_cache = (epoch, order)
        return order

    def accumulate(self, batch: list[E]) -> dict[str, float]:
        raise NotImplementedError


    def save_final(self, directory: Path) -> None:
        self.model.save_pretrained(directory)
        self.tokenizer.save_pretrained(directory)

    # ---------------------------------------------------------------- loop

    def fit(self, progress: StepProgress | None = None, hook: StepHook | None = None) -> SupervisedSummary:
        """Train to the step budget (or ``time_limit_s``, or until ``hook`` says stop);
        ``progress(step, total, metrics)`` after each step (a CLI's progress bar). A run
        whose checkpoint is at the budget already trains nothing and says so
        (``already_complete``). Stopped early, the version reached is saved (weights,
        checkpoint) and ``final/`` written, as at the end."""
        t_start = time.perf_counter()
        final = self.run_dir / "final"
        complete = self.progress.version >= self.total_steps
        limit = self.cfg.time_limit_s
        sink = MetricsSink(self.run_dir / "metrics", self.cfg.stats_logger,
                           config=dataclasses.asdict(self.cfg))
        history: list[dict[str, float]] = []
        stopped = ""
        try:
            if hook is not None and not complete and self.progress.version == 0 and hook(0, self.model, False):
                stopped = "hook"
            while self.progress.version < self.total_steps and not stopped:
                history.append(self._step(sink))
                if progress is not None:
                    progress(self.progress.version, self.total_steps, history[-1])
                out_of_time = bool(limit) and time.perf_counter() - t_start >= limit
                last = out_of_time or self.progress.version >= self.total_steps
                if hook is not None and hook(self.progress.version, self.model, last):
                    stopped = "hook"
                elif out_of_time and self.progress.version < self.total_steps:
                    stopped = "time_limit_s"
            if stopped and self.progress.weights_path != str(
                    weights_file(self.run_dir / WEIGHTS_DIR, self.progress.version).resolve()):
                self._save_version()  # the version it stopped at (a rerun resumes from it)
            if not (complete and final.is_dir()):
                self.save_final(final)
        finally:
            sink.close()
            if self.producer is not None:
                self.producer.close()
        return SupervisedSummary(self.kind, self.run_dir, self.progress.version,
                                 time.perf_counter() - t_start, history, final, self.data_metrics,
                                 already_complete=complete, checkpoint=self.ckpt_path, stopped=stopped)

    def _step(self, sink: MetricsSink) -> dict[str, float]:
        step = self.progress.version  # 0-based index of the step being taken
        batch, epoch = self.batch_for_step(step)
        t0 = time.perf_counter()
        opt = self.cfg.actor.optimizer
        lr = opt.lr * lr_factor(step, self.total_steps, opt)  # actor.optimizer's schedule
        set_lr(self.optimizer, lr)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        try:
            metrics = self.accumulate(batch)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), opt.gradient_clipping)
            self.optimizer.step()
        except Exception as exc:
            raise FatalRoleError(f"{self.kind} step {step + 1} failed: {type(exc).__name__}: {exc}") from exc
        self.model.eval()
        self.progress.version += 1
        v = self.progress.version
        elapsed = time.perf_counter() - t0
        metrics.update({"actor/grad_norm": float(grad_norm), "actor/lr": lr,
                        f"{self.kind}/epoch": float(epoch), f"{self.kind}/step_time_s": elapsed})
        if step == 0:
            metrics.update(self.data_metrics)
        sink.write(v, metrics)
        if self.producer is not None:
            self.producer.publish(MetricsEvent(source=self.kind, step=v, policy_version=v, metrics=metrics))
            self.producer.poll()
        if v % self.cfg.save_every_steps == 0 or v >= self.total_steps:
            self._save_version()
        return {"step": float(v), **metrics}

    def _save_version(self) -> None:
        p = self.progress
        path = weights_file(self.run_dir / WEIGHTS_DIR, p.version)
        sha, size = save_weights(self.model.state_dict(), path,
                                 dtype=getattr(torch, self.cfg.model.dtype))
        p.weights_path, p.weights_sha256 = str(path.resolve()), sha
        keep = self.cfg.keep_weight_versions
        if keep:  # the newest `keep` files stay (a reader may still be loading one)
            for _, old in saved_versions(self.run_dir / WEIGHTS_DIR)[:-keep]:
                old.unlink(missing_ok=True)
        save_checkpoint(self.ckpt_path, self.model, self.optimizer, p)
        if self.producer is not None:
            self.producer.publish(WeightsEvent(version=p.version, path=p.weights_path, sha256=sha,
                                               num_bytes=size))
            self.producer.flush()


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def run_metadata(summary: SupervisedSummary) -> dict[str, Any]:
    """A short, printable account of a finished run (for the CLI)."""
    first = summary.history[0] if summary.history else {}
    last = summary.history[-1] if summary.history else {}
    return {"kind": summary.kind, "steps": summary.steps, "wall_s": round(summary.wall_s, 2),
            "run_dir": str(summary.run_dir), "final_model": str(summary.final_model_dir),
            "first": first, "last": last, "stopped": summary.stopped}
