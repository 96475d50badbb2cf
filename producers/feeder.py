"""The prompt feeder: dataset records in, prompt groups out, under the head gate.

Consumes ``progress.v1`` (broadcast: the trainer's version, its rejected groups and
counts; the feeder reads nothing of ``weights.v1``). Emits ``PromptEvent`` on
``prompts.v1``, keyed by ``group_id``.

Head gate (docs/design.md#3-policy-versions-and-the-staleness-window,
algorithms/head_gate.py): group k is published only while
``k - freed < (eta + v + 1) * B`` (eta = ``rollout.max_head_offpolicyness``, B =
``train_dataset.prompts_per_step``, v = trained steps = ``version - rollbacks``).
``freed`` counts the groups *this feeder admitted* that the trainer named as rejected
(``rejected_group_ids`` on progress events): they free their slots — as rejected rollouts
do in AReaL — so over-stale groups cannot stall it. Rejections of groups it never
admitted (fake "dropped" samples, a reward service keyed wrongly) free nothing and are
counted (``ignored_rejections``); the trainer's own total (``groups_rejected``) is shown,
not trusted.

Everything comes from the log, nothing from in-process counters or broker watermarks:
k (with the epoch and dataset position, so a restart neither repeats nor skips prompts)
and ``freed`` (with the progress.v1 offset it was counted through) are recovered from
the feeder's own latest prompt event at start; v from the progress topic, whose versions
only go forward (an older progress event moves nothing but its rejection names). The
recovered k is bounded by what the feeder itself published: a prompt event counts only
if it carries the feeder's own group id for its index and its predecessor is there too,
so one forged prompt with group_index 10^9 cannot shut the gate.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from ..algorithms.head_gate import head_gate_capacity, log_counts
from ..bus.role import Role, Source
from ..config.sections import FeederSection
from ..schemas.envelope import Event
from ..schemas.errors import ConfigError, TapiocaError
from ..schemas.events import ImageRef, ProgressEvent, PromptEvent


def head_gate_open(next_group_index: int, version: int, eta: int, prompts_per_step: int,
                   rejected: int = 0, rollbacks: int = 0) -> bool:
    """AReaL's admission rule, k < (eta + v + 1) * B, where groups the trainer rejected
    (over-stale, filtered) free their slots and v counts trained steps
    (algorithms/head_gate.py)."""
    return head_gate_capacity(next_group_index, version, eta, prompts_per_step,
                              freed=rejected, rollbacks=rollbacks) > 0


@dataclass
class PromptRecord:
    """One dataset row, already turned into prompt tokens (and its images, stored, by
    reference: docs/vlm.md)."""

    prompt_id: str
    prompt_ids: list[int]
    prompt_text: str
    task: str
    task_data: dict[str, Any] = field(default_factory=dict)
    images: list[ImageRef] = field(default_factory=list)


@dataclass
class FeederState:
    next_group_index: int = 0  # k: groups published so far in this run
    epoch: int = 0
    position: int = 0  # next index into this epoch's order
    latest_version: int = 0
    rollbacks: int = 0  # versions that were rollbacks, not trained steps
    # Groups this feeder admitted that the trainer named as rejected: they free slots.
    freed: int = 0
    freed_ids: set[str] = field(default_factory=set)
    # progress.v1 offset whose rejections ``freed`` includes: recovered from the last
    # prompt event, so the progress history read again after a restart is not recounted.
    counted_through: int = -1
    progress_offset: int = -1  # the last progress.v1 offset handled
    ignored_rejections: int = 0  # named rejections of groups it never admitted
    trainer_rejected: int = 0  # the trainer's own total, shown only
    exhausted: bool = False
    order: list[int] = field(default_factory=list)
    order_epoch: int = -1


class PromptFeeder(Role[FeederState]):
    name = "feeder"
    broadcast_inputs = ("progress",)
    recover_from = ("prompts",)

    def __init__(
        self,
        section: FeederSection,
        *,
        records: list[PromptRecord],
        max_groups_per_tick: int = 64,
        sampling: dict[str, Any] | None = None,
    ) -> None:
        """``section``: the run's settings (group size, eta and B of the gate, epochs,
        order, seed; its run id tags the group ids). ``records``: the dataset, tokenized.
        ``max_groups_per_tick`` bounds one tick's burst; ``sampling`` overrides the
        rollout's sampling per prompt (PromptEvent.sampling)."""
        if not records:
            raise ValueError("the dataset has no records")
        ds = section.train_dataset
        self.records = records
        self.n_samples = section.n_samples
        self.B = ds.prompts_per_step
        self.eta = section.max_head_offpolicyness
        self.max_epochs = ds.max_epochs
        self.shuffle = ds.shuffle
        self.seed = section.seed
        self.run_tag = section.run_id
        self.max_groups_per_tick = max_groups_per_tick
        self.sampling = sampling or {}

    def init_state(self) -> FeederState:
        return FeederState()

    def group_id(self, k: int) -> str:
        return f"{self.run_tag}-g{k:08d}"

    def _admitted(self, gid: str, state: FeederState) -> bool:
        """Whether this feeder published ``gid`` (its ids name its own sequence numbers)."""
        prefix = f"{self.run_tag}-g"
        digits = gid[len(prefix):]
        return (gid.startswith(prefix) and digits.isdigit()
                and int(digits) < state.next_group_index and gid == self.group_id(int(digits)))

    def recover(self, state: FeederState, latest: list[Event]) -> None:
        # Only events this feeder could have published: its own id for the index, within
        # what its dataset allows, and (but for the first) with their predecessor there
        # too. A lone prompt with a far index (forged, or another feeder's) is ignored.
        limit = self.max_epochs * len(self.records)
        own = {e.group_index: e for e in latest if isinstance(e, PromptEvent)
               and 0 <= e.group_index < limit and e.group_id == self.group_id(e.group_index)}
        last = next((own[k] for k in sorted(own, reverse=True) if k == 0 or k - 1 in own), None)
        if last is None:
            return
        state.next_group_index = last.group_index + 1
        state.epoch = last.epoch
        state.position = last.dataset_position + 1
        state.freed = last.freed_groups
        # A prompt event of a feeder before progress.v1 counted through weights.v1 (its
        # weights_offset): nothing of progress.v1 is in its count.
        state.counted_through = last.progress_offset

    def handle(self, event: Event, state: FeederState, source: Source) -> Iterable[Event]:
        if not isinstance(event, ProgressEvent):
            return ()
        # Judged before a restart (its rejections are in the recovered count): read again
        # only to remember which ids were counted.
        replayed = source.offset <= state.counted_through
        # The version never goes back (an older event, re-published or not, moves
        # nothing); its rejection names still count: a rejection of one of this feeder's
        # groups is a fact whatever the version (after a forged newer version, the
        # trainer's progress events of its real one carry them).
        if event.version >= state.latest_version:
            state.latest_version = event.version
            # Only trained steps of this run id's log count (a run resumed on a new log:
            # base_steps); rejections are counted by name below, from this log only.
            state.rollbacks, _ = log_counts(event.rollbacks, event.groups_rejected,
                                            event.base_steps, event.base_rejected)
            state.trainer_rejected = event.groups_rejected
        for gid in event.rejected_group_ids:
            if gid in state.freed_ids:
                continue  # re-announced (a trainer restart names its last ones again)
            if not self._admitted(gid, state):
                state.ignored_rejections += not replayed
                continue
            state.freed_ids.add(gid)
            state.freed += not replayed
        state.progress_offset = max(state.progress_offset, source.offset)
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
                                  state.freed, state.rollbacks)):
            if state.position >= len(self.records):
                state.epoch += 1
                state.position = 0
            if state.epoch >= self.max_epochs:
                state.exhausted = True
                break
            record = self.records[self._order(state)[state.position]]
            k = state.next_group_index
            out.append(PromptEvent(
                group_id=self.group_id(k),
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
                freed_groups=state.freed,
                progress_offset=state.progress_offset,
                images=list(record.images),
            ))
            state.next_group_index += 1
            state.position += 1
        return out

    def describe(self, state: FeederState) -> dict[str, Any]:
        return {"groups": state.next_group_index, "epoch": state.epoch,
                "version": state.latest_version, "exhausted": state.exhausted,
                # The head gate's open slots now (groups it may still admit; ops/log_metrics.py).
                "open_slots": max(head_gate_capacity(state.next_group_index, state.latest_version, self.eta,
                                                     self.B, freed=state.freed, rollbacks=state.rollbacks), 0),
                "freed": state.freed, "ignored_rejections": state.ignored_rejections,
                "trainer_rejected": state.trainer_rejected}


def tokenize_records(
    rows: Iterable[dict[str, Any]], encode_prompt: Callable[[dict[str, Any]], tuple],
    task: str,
) -> list[PromptRecord]:
    """Turn task rows (``prompt_id``, ``messages`` or ``prompt``, ``answer``, and ``images``
    for a VL model) into records. ``encode_prompt(row)`` returns ``(ids, text)``, or
    ``(ids, text, image refs)`` (models/vision.py ``VisionPrompts.encode``); a row with
    images needs the latter."""
    records = []
    for row in rows:
        try:
            encoded = encode_prompt(row)
        except ConfigError:
            raise
        except TapiocaError as exc:  # an image the run cannot use (media/images.py)
            raise ConfigError(f"dataset row {row.get('prompt_id')}: {exc}") from None
        ids, text = encoded[0], encoded[1]
        images = list(encoded[2]) if len(encoded) > 2 else []
        if row.get("images") and not images:
            raise ConfigError(f"dataset row {row['prompt_id']} has images but the model reads none: "
                             "use a vision-language model (docs/vlm.md) or a text dataset")
        task_data = {k: v for k, v in row.items() if k not in ("messages", "prompt", "prompt_id", "images")}
        records.append(PromptRecord(str(row["prompt_id"]), ids, text, task, task_data, images))
    return records
