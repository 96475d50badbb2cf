"""Training examples for the supervised trainers, from datasets or from a run's logs.

Consumes one of (``train_dataset.source``):

* ``file``: JSONL / Parquet / ``save_to_disk`` rows (:func:`tapioca.tasks.datasets.read_records`):
  SFT rows with ``messages`` (the last message is the assistant's response, earlier ones
  the context) or ``prompt`` + ``response`` (falling back to ``answer``); preference rows
  with ``prompt`` + ``chosen`` + ``rejected`` (strings, or message lists as in TRL's
  conversational format);
* ``synthetic``: the built-in task; the reference answer is the response, and for pairs
  a wrong digit is the rejected response;
* ``topics``: ``trajectories.v1`` + ``rewards.v1`` of a run, read with
  :class:`tapioca.bus.reader.TopicReader` (no consumer group, nothing committed);
* ``archive``: the same events from a Parquet archive, through
  ``tapioca.bus.archive.iter_events``.

Emits :class:`SeqExample` (SFT, distillation) and :class:`PairExample` (DPO, reward
model) lists of token ids. Text is encoded the way the rollout encodes prompts
(``tapioca.models.tokenizer.prompt_encoder``): the tokenizer's chat template with a generation
prompt when it has one, else the contents joined by newlines; so a model fine-tuned here
sees the same prompt layout in RL.

From logs, trajectories join their rewards by ``traj_id`` and group by ``group_id``.
Rewards are keyed by ``(traj_id, scorer)``, the first event of each pair counting
(later ones are duplicates), and combined as the advantage processor does with
``advantage.reward_weights``: with ``reward_weights`` (``{scorer: weight}``) the
reward is ``sum_s weight_s * reward_s`` (sorted scorer order, ``math.fsum``) and a
trajectory missing a weighted scorer is skipped and counted; scorers without a weight
are ignored. Without weights, the first reward of the trajectory from any scorer in
log order (the rewards topic is keyed by ``group_id``, so one partition holds all
of a trajectory's rewards and that order is the log's). SFT keeps
trajectories with ``reward >= min_reward`` (rejection-sampling fine-tuning, aborted ones
skipped); a pair is the best vs the worst trajectory of a group, and a group whose
rewards are all equal gives none.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping

from ...algorithms.reward_shaping import weighted_reward
from ...bus.settings import BusConfig
from ...config.supervised import SupervisedDatasetConfig
from ...schemas.errors import ConfigError, TapiocaError
from ...schemas.events import RewardEvent, TrajectoryEvent


@dataclass
class SeqExample:
    """``prompt_ids + response_ids``; the loss covers response tokens whose mask is 1."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass
class PairExample:
    """One prompt with a preferred (chosen) and a dispreferred (rejected) response."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    chosen_mask: list[int]
    rejected_mask: list[int]

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + max(len(self.chosen_ids), len(self.rejected_ids))

    def side(self, chosen: bool) -> SeqExample:
        if chosen:
            return SeqExample(self.prompt_ids, self.chosen_ids, self.chosen_mask)
        return SeqExample(self.prompt_ids, self.rejected_ids, self.rejected_mask)


@dataclass
class DataStats:
    """How many rows / trajectories became examples, and why the rest did not."""

    counts: Counter = field(default_factory=Counter)

    def metrics(self) -> dict[str, float]:
        return {f"data/{k}": float(v) for k, v in sorted(self.counts.items())}


# --------------------------------------------------------------------- text -> ids


class ChatEncoder:
    """Context messages + response messages -> (prompt ids, response ids)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.has_template = bool(getattr(tokenizer, "chat_template", None))

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode(self, context: list[dict[str, Any]],
               response: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
        if self.has_template:
            prompt_text = self.tokenizer.apply_chat_template(context, add_generation_prompt=True,
                                                             tokenize=False)
            full_text = self.tokenizer.apply_chat_template(context + response, tokenize=False)
            if not full_text.startswith(prompt_text):
                raise TapiocaError(
                    "the tokenizer's chat template renders the conversation differently from its "
                    "prompt (with a generation prompt), so the response cannot be cut out; use a "
                    "template whose prompt is a prefix of the full conversation")
            return self._ids(prompt_text), self._ids(full_text[len(prompt_text):])
        # No template: the rollout's plain join; the response ends with eos so the model
        # learns to stop.
        prompt_text = "\n".join(str(m["content"]) for m in context)
        response_ids = self._ids("\n".join(str(m["content"]) for m in response))
        eos = self.tokenizer.eos_token_id
        return self._ids(prompt_text), response_ids + ([eos] if eos is not None else [])


def _as_messages(value: Any, role: str, what: str) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list) and value and all(isinstance(m, dict) and "content" in m for m in value):
        return [{"role": m.get("role", role), "content": m["content"]} for m in value]
    raise ConfigError(f"{what} must be a string or a non-empty list of {{role, content}} messages, "
                      f"got {type(value).__name__}")


def _sft_messages(row: dict[str, Any], i: int, ds: SupervisedDatasetConfig):
    messages = row.get(ds.messages_key)
    if messages:
        msgs = _as_messages(messages, "user", f"row {i}: {ds.messages_key!r}")
        if msgs[-1]["role"] != "assistant" or len(msgs) < 2:
            raise ConfigError(f"row {i}: the last of {ds.messages_key!r} must be the assistant's "
                              "response, after at least one context message")
        return msgs[:-1], msgs[-1:]
    if ds.prompt_key in row:
        key = ds.response_key if ds.response_key in row else "answer"
        if key in row:
            return (_as_messages(row[ds.prompt_key], "user", f"row {i}: {ds.prompt_key!r}"),
                    _as_messages(row[key], "assistant", f"row {i}: {key!r}"))
    raise ConfigError(
        f"row {i} has neither {ds.messages_key!r} nor {ds.prompt_key!r} + {ds.response_key!r} "
        f"(or 'answer'); its keys are {sorted(row)}. Set train_dataset.messages_key / prompt_key / "
        "response_key to your columns")


def sft_examples_from_rows(rows: Iterable[dict[str, Any]], encoder: ChatEncoder,
                           ds: SupervisedDatasetConfig, stats: DataStats) -> Iterator[SeqExample]:
    for i, row in enumerate(rows):
        stats.counts["rows"] += 1
        context, response = _sft_messages(row, i, ds)
        prompt_ids, response_ids = encoder.encode(context, response)
        yield SeqExample(prompt_ids, response_ids, [1] * len(response_ids))


def pair_examples_from_rows(rows: Iterable[dict[str, Any]], encoder: ChatEncoder,
                            ds: SupervisedDatasetConfig, stats: DataStats) -> Iterator[PairExample]:
    for i, row in enumerate(rows):
        stats.counts["rows"] += 1
        missing = [k for k in (ds.prompt_key, ds.chosen_key, ds.rejected_key) if k not in row]
        if missing:
            raise ConfigError(f"preference row {i} lacks {missing}; its keys are {sorted(row)}. Set "
                              "train_dataset.prompt_key / chosen_key / rejected_key to your columns")
        context = _as_messages(row[ds.prompt_key], "user", f"row {i}: {ds.prompt_key!r}")
        prompt_ids, chosen_ids = encoder.encode(
            context, _as_messages(row[ds.chosen_key], "assistant", f"row {i}: {ds.chosen_key!r}"))
        prompt_r, rejected_ids = encoder.encode(
            context, _as_messages(row[ds.rejected_key], "assistant", f"row {i}: {ds.rejected_key!r}"))
        if prompt_r != prompt_ids:  # only a message-list 'rejected' with extra context could do this
            raise ConfigError(f"preference row {i}: chosen and rejected must continue the same prompt")
        if chosen_ids == rejected_ids:
            stats.counts["skipped_identical_pair"] += 1
            continue
        yield PairExample(prompt_ids, chosen_ids, rejected_ids, [1] * len(chosen_ids),
                          [1] * len(rejected_ids))


# --------------------------------------------------------------------- synthetic


def synthetic_rows(ds: SupervisedDatasetConfig, seed: int, *, pairs: bool) -> Iterator[dict[str, Any]]:
    """The synthetic task as SFT rows (prompt, response = the answer) or preference rows
    (chosen = the answer, rejected = a different digit, chosen by ``seed``)."""
    from ...tasks.base import get_task

    rng = random.Random(seed)
    for rec in get_task("synthetic", **ds.task_options).iter_records(ds.split, seed):
        if not pairs:
            yield {"prompt": rec["prompt"], "response": rec["answer"]}
            continue
        wrong = rng.choice([str(d) for d in range(10) if str(d) != rec["answer"]])
        yield {"prompt": rec["prompt"], "chosen": rec["answer"], "rejected": wrong}


# --------------------------------------------------------------------- logs


@dataclass
class LoggedGroup:
    group_id: str
    trajectories: list[tuple[TrajectoryEvent, float]] = field(default_factory=list)


def _topic_events(bus: BusConfig, ds: SupervisedDatasetConfig) -> Iterator[Any]:
    from dataclasses import replace

    from ...bus.reader import TopicReader

    cfg = replace(bus, topic_prefix=ds.topic_prefix or bus.topic_prefix)
    cfg.require_bootstrap()
    # Rewards after trajectories: the join below needs both sets complete anyway.
    for name in ("trajectories", "rewards"):
        with TopicReader(cfg, name) as reader:
            for record in reader.records(idle_s=ds.read_idle_s):
                if record.event is not None:
                    yield record.event


def _archive_events(ds: SupervisedDatasetConfig) -> Iterator[Any]:
    try:
        from ...bus.archive import iter_events
    except ImportError as exc:
        raise ConfigError(
            "train_dataset.source=archive needs the Parquet archive reader "
            f"(tapioca.bus.archive.iter_events), which is not installed here ({exc}); "
            "read the run from its topics instead (train_dataset.source=topics)") from None
    names = ["trajectories", "rewards"]
    if ds.topic_prefix:  # an archive may hold several prefixes: pick one
        names = [f"{ds.topic_prefix}.{n}.v1" for n in names]
    for _source, event in iter_events(ds.path, topic=names):
        yield event


def _check_reward_weights(weights: Mapping[str, float]) -> None:
    for scorer, w in weights.items():
        if not (isinstance(w, (int, float)) and w == w and abs(w) != float("inf") and w != 0):
            raise ConfigError(f"reward_weights.{scorer}={w!r}: weights must be finite and "
                              "non-zero (leave a scorer out instead of weighting it 0)")


def _combined_reward(by_scorer: dict[str, float], weights: Mapping[str, float],
                     stats: DataStats) -> float | None:
    """The trajectory's reward (None: a weighted scorer is missing)."""
    if not weights:
        return next(iter(by_scorer.values()))  # dicts keep log order: the first reward
    if any(s not in by_scorer for s in weights):
        stats.counts["trajectories_missing_reward_source"] += 1
        return None
    ignored = sum(1 for s in by_scorer if s not in weights)
    if ignored:
        stats.counts["ignored_rewards"] += ignored
    return weighted_reward(by_scorer, weights)


def logged_groups(events: Iterable[Any], run_id: str, stats: DataStats,
                  reward_weights: Mapping[str, float] | None = None) -> list[LoggedGroup]:
    """Join trajectories and rewards of ``run_id`` ("" = all runs) into groups, ordered
    by (feeder group number, group id): the order partitions are read in varies, and a
    resumed run needs the same example list to continue the same data order.
    ``reward_weights`` combines several scorers (see the module docstring)."""
    weights = dict(reward_weights or {})
    _check_reward_weights(weights)
    trajs: dict[str, TrajectoryEvent] = {}
    rewards: dict[str, dict[str, float]] = {}  # traj_id -> scorer -> first reward
    for ev in events:
        if run_id and ev.run_id != run_id:
            continue
        if isinstance(ev, TrajectoryEvent):
            if ev.traj_id in trajs:
                stats.counts["duplicate_trajectories"] += 1
            else:
                trajs[ev.traj_id] = ev
        elif isinstance(ev, RewardEvent):
            by_scorer = rewards.setdefault(ev.traj_id, {})
            if ev.scorer in by_scorer:
                stats.counts["duplicate_rewards"] += 1
            else:
                by_scorer[ev.scorer] = ev.reward
    groups: dict[str, LoggedGroup] = {}
    for traj in trajs.values():
        if traj.traj_id not in rewards:
            stats.counts["trajectories_without_reward"] += 1
            continue
        reward = _combined_reward(rewards[traj.traj_id], weights, stats)
        if reward is None:
            continue
        stats.counts["trajectories"] += 1
        groups.setdefault(traj.group_id, LoggedGroup(traj.group_id)).trajectories.append(
            (traj, reward))
    for g in groups.values():
        g.trajectories.sort(key=lambda tr: tr[0].sample_index)
    return sorted(groups.values(), key=lambda g: (g.trajectories[0][0].group_index, g.group_id))


def _mask(traj: TrajectoryEvent) -> list[int]:
    return list(traj.loss_mask) if traj.loss_mask else [1] * len(traj.output_ids)


def sft_examples_from_groups(groups: list[LoggedGroup], min_reward: float,
                             stats: DataStats) -> Iterator[SeqExample]:
    for g in groups:
        for traj, reward in g.trajectories:
            if traj.finish_reason == "abort" or not traj.output_ids:
                stats.counts["skipped_aborted"] += 1
            elif reward < min_reward:
                stats.counts["skipped_below_min_reward"] += 1
            else:
                yield _seq_example(traj)


def _seq_example(traj: TrajectoryEvent) -> SeqExample:
    """A trajectory as an SFT example. An agent group published without a shared prompt
    (its completions share no first token: ``prompt_ids == []``, each context in the
    output with loss mask 0) gives its first output token as the prompt, as the RL
    trainer's ``flatten_groups`` does: position 0 predicts nothing."""
    prompt, out, mask = list(traj.prompt_ids), list(traj.output_ids), _mask(traj)
    if not prompt:
        prompt, out, mask = out[:1], out[1:], mask[1:]
    return SeqExample(prompt, out, mask)


def pair_examples_from_groups(groups: list[LoggedGroup], stats: DataStats) -> Iterator[PairExample]:
    for g in groups:
        usable = [(t, r) for t, r in g.trajectories if t.output_ids and t.finish_reason != "abort"]
        if len(usable) < 2:
            stats.counts["skipped_groups_too_small"] += 1
            continue
        # max/min keep the first of equal rewards, i.e. the lowest sample_index.
        best = max(usable, key=lambda tr: tr[1])
        worst = min(usable, key=lambda tr: tr[1])
        if best[1] == worst[1]:
            stats.counts["skipped_tied_groups"] += 1
            continue
        yield PairExample(list(best[0].prompt_ids), list(best[0].output_ids), list(worst[0].output_ids),
                          _mask(best[0]), _mask(worst[0]))


# --------------------------------------------------------------------- entry points


def _log_groups(ds: SupervisedDatasetConfig, bus: BusConfig, stats: DataStats,
                reward_weights: Mapping[str, float] | None = None) -> list[LoggedGroup]:
    events = _topic_events(bus, ds) if ds.source == "topics" else _archive_events(ds)
    weights = reward_weights if reward_weights is not None else ds.reward_weights
    groups = logged_groups(events, ds.run_id, stats, weights)
    if not groups:
        where = (f"topics {ds.topic_prefix or bus.topic_prefix}.trajectories.v1 / rewards.v1"
                 if ds.source == "topics" else f"archive {ds.path}")
        raise TapiocaError(f"no rewarded trajectories{' of run ' + ds.run_id if ds.run_id else ''} "
                           f"in {where}; check train_dataset.run_id / topic_prefix / path")
    return groups


def _finish(examples: Iterable[Any], ds: SupervisedDatasetConfig, stats: DataStats) -> list[Any]:
    out = []
    for ex in examples:
        if not ex.prompt_ids:  # position 0 predicts nothing: a response needs a prompt
            stats.counts["skipped_empty_prompt"] += 1
            continue
        masks = [ex.response_mask] if isinstance(ex, SeqExample) else [ex.chosen_mask, ex.rejected_mask]
        if not all(any(m) for m in masks):
            stats.counts["skipped_empty_response"] += 1
            continue
        if ex.length > ds.max_length:
            stats.counts["skipped_too_long"] += 1
            continue
        out.append(ex)
        if ds.max_examples and len(out) >= ds.max_examples:
            break
    stats.counts["examples"] = len(out)
    if not out:
        raise TapiocaError(f"train_dataset ({ds.source}) yielded no usable examples: "
                           f"{dict(stats.counts)}; check the data, min_reward and max_length")
    return out


def _file_rows(ds: SupervisedDatasetConfig) -> Iterator[dict[str, Any]]:
    from ...tasks.datasets import read_records

    return read_records(ds.path, split=ds.split)


def load_sft_examples(ds: SupervisedDatasetConfig, tokenizer, *, bus: BusConfig | None = None,
                      seed: int = 0, reward_weights: Mapping[str, float] | None = None,
                      ) -> tuple[list[SeqExample], DataStats]:
    """Examples for SFT and distillation from ``ds.source`` (``reward_weights``: logs
    only, how several scorers' rewards combine; empty = the first from any scorer)."""
    stats = DataStats()
    if ds.source in ("topics", "archive"):
        groups = _log_groups(ds, bus or BusConfig(), stats, reward_weights)
        examples = sft_examples_from_groups(groups, ds.min_reward, stats)
    else:
        rows = synthetic_rows(ds, seed, pairs=False) if ds.source == "synthetic" else _file_rows(ds)
        examples = sft_examples_from_rows(rows, ChatEncoder(tokenizer), ds, stats)
    return _finish(examples, ds, stats), stats


def load_pair_examples(ds: SupervisedDatasetConfig, tokenizer, *, bus: BusConfig | None = None,
                       seed: int = 0, reward_weights: Mapping[str, float] | None = None,
                       ) -> tuple[list[PairExample], DataStats]:
    """Preference pairs for DPO and the reward model from ``ds.source``
    (``reward_weights`` as in :func:`load_sft_examples`)."""
    stats = DataStats()
    if ds.source in ("topics", "archive"):
        examples = pair_examples_from_groups(_log_groups(ds, bus or BusConfig(), stats, reward_weights),
                                             stats)
    else:
        rows = synthetic_rows(ds, seed, pairs=True) if ds.source == "synthetic" else _file_rows(ds)
        examples = pair_examples_from_rows(rows, ChatEncoder(tokenizer), ds, stats)
    return _finish(examples, ds, stats), stats
