"""The prompt feeder: dataset records in, prompt groups out, under the head gate.

Consumes ``weights.v1`` (broadcast: the latest policy version and its counts).
Emits ``PromptEvent`` on ``prompts.v1``, keyed by ``group_id``.

Head gate (DESIGN.md §3, algorithms/head_gate.py): group k is published only while
``k < (eta + v + 1) * B`` (eta = ``rollout.max_head_offpolicyness``, B =
``train_dataset.prompts_per_step``, v = trained steps = ``version - rollbacks``),
where groups the trainer rejected (``groups_rejected`` on the weights event) free
their slots — as rejected rollouts do in AReaL — so over-stale groups cannot stall it.
Both k and v come from the log: k is recovered from the feeder's own latest prompt
event at start (with the epoch and dataset position, so a restart neither repeats nor
skips prompts), v from the weights topic. Nothing depends on in-process counters or
broker watermarks.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from tapioca.algorithms.head_gate import head_gate_capacity, log_counts
from tapioca.bus.role import Role, Source
from tapioca.schemas.envelope import Event
from tapioca.schemas.events import PromptEvent, WeightsEvent


def head_gate_open(next_group_index: int, version: int, eta: int, prompts_per_step: int,
                   rejected: int = 0, rollbacks: int = 0) -> bool:
    """AReaL's admission rule, k < (eta + v + 1) * B, where groups the trainer rejected
    (over-stale, filtered) free their slots and v counts trained steps
    (algorithms/head_gate.py)."""
    return head_gate_capacity(next_group_index, version, eta, prompts_per_step,
                              freed=rejected, rollbacks=rollbacks) > 0


@dataclass
class PromptRecord:
    """One dataset row, already turned into prompt tokens."""

    prompt_id: str
    prompt_ids: list[int]
    prompt_text: str
    task: str
    task_data: dict[str, Any] = field(default_factory=dict)


@dataclass
class FeederState:
    next_group_index: int = 0  # k: groups published so far in this run
    epoch: int = 0
    position: int = 0  # next index into this epoch's order
    latest_version: int = 0
    rejected: int = 0
    rollbacks: int = 0  # versions that were rollbacks, not trained steps
    exhausted: bool = False
    order: list[int] = field(default_factory=list)
    order_epoch: int = -1


class PromptFeeder(Role[FeederState]):
    name = "feeder"
    broadcast_inputs = ("weights",)
    recover_from = ("prompts",)

    def __init__(
        self,
        records: list[PromptRecord],
        *,
        n_samples: int,
        prompts_per_step: int,
        max_head_offpolicyness: int,
        max_epochs: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        run_tag: str = "run",
        max_groups_per_tick: int = 64,
        sampling: dict[str, Any] | None = None,
    ) -> None:
        if not records:
            raise ValueError("the dataset has no records")
        self.records = records
        self.n_samples = n_samples
        self.B = prompts_per_step
        self.eta = max_head_offpolicyness
        self.max_epochs = max_epochs
        self.shuffle = shuffle
        self.seed = seed
        self.run_tag = run_tag
        self.max_groups_per_tick = max_groups_per_tick
        self.sampling = sampling or {}

    def init_state(self) -> FeederState:
        return FeederState()

    def recover(self, state: FeederState, latest: list[Event]) -> None:
        prompts = [e for e in latest if isinstance(e, PromptEvent)]
        if not prompts:
            return
        last = max(prompts, key=lambda e: e.group_index)
        state.next_group_index = last.group_index + 1
        state.epoch = last.epoch
        state.position = last.dataset_position + 1

    def handle(self, event: Event, state: FeederState, source: Source) -> Iterable[Event]:
        if isinstance(event, WeightsEvent):
            state.latest_version = event.version
            # Only what happened on this run id's log counts (a resumed run's new log).
            state.rollbacks, state.rejected = log_counts(
                event.rollbacks, event.groups_rejected, event.base_steps, event.base_rejected)
        return ()

    def _order(self, state: FeederState) -> list[int]:
        if state.order_epoch != state.epoch:
            order = list(range(len(self.records)))
            if self.shuffle:
                random.Random(self.seed * 100003 + state.epoch).shuffle(order)
            state.order, state.order_epoch = order, state.epoch
        return state.order

    def on_tick(self, state: FeederState, now: float) -> Iterable[Event]:
        out: list[Event] = []
        while (len(out) < self.max_groups_per_tick and not state.exhausted
               and head_gate_open(state.next_group_index, state.latest_version, self.eta, self.B,
                                  state.rejected, state.rollbacks)):
            if state.position >= len(self.records):
                state.epoch += 1
                state.position = 0
            if state.epoch >= self.max_epochs:
                state.exhausted = True
                break
            record = self.records[self._order(state)[state.position]]
            k = state.next_group_index
            out.append(PromptEvent(
                group_id=f"{self.run_tag}-g{k:08d}",
                prompt_id=record.prompt_id,
                group_index=k,
                n_samples=self.n_samples,
                prompt_ids=list(record.prompt_ids),
                prompt_text=record.prompt_text,
                epoch=state.epoch,
                dataset_position=state.position,
                task=record.task,
                task_data=record.task_data,
                sampling=self.sampling,
                admitted_at_version=state.latest_version,
            ))
            state.next_group_index += 1
            state.position += 1
        return out

    def describe(self, state: FeederState) -> dict[str, Any]:
        return {"groups": state.next_group_index, "epoch": state.epoch,
                "version": state.latest_version, "exhausted": state.exhausted}


def tokenize_records(
    rows: Iterable[dict[str, Any]], encode_prompt: Callable[[dict[str, Any]], tuple[list[int], str]],
    task: str,
) -> list[PromptRecord]:
    """Turn task rows (``prompt_id``, ``messages`` or ``prompt``, ``answer``) into records."""
    records = []
    for row in rows:
        ids, text = encode_prompt(row)
        task_data = {k: v for k, v in row.items() if k not in ("messages", "prompt", "prompt_id")}
        records.append(PromptRecord(str(row["prompt_id"]), ids, text, task, task_data))
    return records
