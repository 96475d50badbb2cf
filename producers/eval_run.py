"""One evaluation of one policy version: held-out prompts through an inference engine,
scored by their task, summed up by algorithms/eval_metrics.py.

Shared by `tapioca eval` (ops/eval_cli.py) and the evaluator role (producers/evaluator.py).
Consumes a dataset section (``valid_dataset``: any format the trainer reads) and an
engine built by runtime/builders.py (PagedEngine, TorchEngine or a vLLM / SGLang server);
emits per-sample rows and a summary, written as ``samples.jsonl`` (one row per
completion: prompt id, subset, sample index (-1: the greedy one), output text, reward,
correct, extracted answer, reference, finish reason, tokens) and ``summary.json`` (the
metrics, total and per subset, with the settings and throughput). Rows are keyed by
``prompt_id``: :func:`tapioca.algorithms.eval_metrics.prompts_from_rows` regroups them,
so anyone can recompute the numbers from the file.

Version proof (algorithms/eval_metrics.py): a completion counts for the evaluated version
only when every output token carries it (``GenResult.output_versions``); one that does
not (a weights switch mid-generation, another version) is kept in ``samples.jsonl`` with
``dropped`` (why) and its prompt is left out of the metrics; the summary names the
versions behind the scores (``versions``) and counts what was dropped
(``mixed_version_samples``, ``prompts_dropped``).

Nothing here blocks: :meth:`EvalRun.start` queues every completion (the engine batches
them), :meth:`EvalRun.poll` scores the finished ones, so a role can poll from its tick.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..algorithms.eval_metrics import (
    PromptSamples,
    attributed_version,
    dropped_prompts,
    prompts_from_rows,
    summarize,
)
from ..engines.base import GenRequest, GenResult, InferenceEngine, SamplingParams
from ..schemas.errors import ConfigError, EngineError, TapiocaError

log = logging.getLogger(__name__)

SAMPLES_FILE = "samples.jsonl"
SUMMARY_FILE = "summary.json"
GREEDY_INDEX = -1


@dataclass
class EvalPrompt:
    prompt_id: str
    prompt_ids: list[int]
    answer: str
    subset: str = ""


@dataclass
class EvalTask:
    """The held-out prompts with their task's reward and answer extraction."""

    name: str
    prompts: list[EvalPrompt]
    reward: Callable[[str, str], float]
    answer: Callable[[str], "str | None"]
    dataset: str  # what it was read from, for messages and summary.json
    # The task's keyword arguments (a scoring process rebuilds reward and answer from them).
    options: dict[str, Any] = field(default_factory=dict)


def describe_dataset(ds: Any) -> str:
    where = f" {ds.path}" if ds.path else ""
    split = f" (split {ds.split})" if ds.type in ("synthetic", "gsm8k", "hf_disk") else ""
    return f"{ds.type}{where}{split}"


def load_eval_task(ds: Any, encode: Callable[[dict], tuple[list[int], str]], *,
                   max_prompts: int = 0) -> EvalTask:
    """The prompts of dataset section ``ds`` in file order (the first ``max_prompts``;
    0: all), encoded like the feeder's (``encode``: models/tokenizer.py prompt_encoder),
    and the task's reward (tasks/base.py task_reward) and answer extraction."""
    from ..tasks.base import MATH_TASK, task_answer, task_reward
    from ..tasks.datasets import dataset_rows

    task, rows = dataset_rows(ds, None, section="valid_dataset")
    options = {} if task == MATH_TASK else dict(ds.task_options)
    prompts: list[EvalPrompt] = []
    seen: set[str] = set()
    for row in rows:
        if max_prompts and len(prompts) >= max_prompts:
            break
        pid = str(row["prompt_id"])
        if pid in seen:
            raise ConfigError(f"prompt id {pid!r} appears twice in {describe_dataset(ds)}; an "
                              "evaluation keys its samples by prompt id: give each row a unique "
                              "`id` column (a file's rows are otherwise numbered)")
        seen.add(pid)
        ids, _text = encode(row)
        prompts.append(EvalPrompt(pid, list(ids), str(row.get("answer", "")),
                                  str(row.get("subset") or "")))
    if not prompts:
        raise ConfigError(f"the evaluation dataset {describe_dataset(ds)} has no prompts: point "
                          "valid_dataset (or --data) at a file with rows, or pick a split that "
                          "has some")
    return EvalTask(task, prompts, task_reward(task, **options), task_answer(task, **options),
                    describe_dataset(ds), options)


def _score(reward: Callable[[str, str], float], answer: Callable[[str], "str | None"],
           text: str, reference: str) -> tuple[float, "str | None", str]:
    """(reward, extracted answer, error): a reward that raises (e.g. a math-verify
    timeout) is 0 with its error named, counted by the caller, never hidden."""
    try:
        value, error = float(reward(text, reference)), ""
    except TapiocaError as exc:
        value, error = 0.0, f"{type(exc).__name__}: {exc}"
    return value, answer(text), error


_WORKER_TASK: tuple[Callable, Callable] | None = None


def _init_worker(task: str, options: dict[str, Any]) -> None:
    from ..tasks.base import task_answer, task_reward

    global _WORKER_TASK
    _WORKER_TASK = (task_reward(task, **options), task_answer(task, **options))


def _score_in_worker(text: str, reference: str) -> tuple[float, "str | None", str]:
    assert _WORKER_TASK is not None
    return _score(*_WORKER_TASK, text, reference)


class Scorer:
    """Scores completions: in this process (``workers`` 0), or in ``workers`` processes
    (``eval.scoring_workers``): math-verify is pure Python, so a pool scores in parallel
    and leaves this process's interpreter to the engine. Spawned, not forked: the engine
    runs threads (and CUDA) here."""

    def __init__(self, task: EvalTask, workers: int = 0) -> None:
        self.task = task
        self.pool = None
        if workers > 0:
            import multiprocessing

            self.pool = concurrent.futures.ProcessPoolExecutor(
                workers, mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker, initargs=(task.name, task.options))

    def submit(self, text: str, reference: str) -> concurrent.futures.Future:
        if self.pool is not None:
            return self.pool.submit(_score_in_worker, text, reference)
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result(_score(self.task.reward, self.task.answer, text, reference))
        return done

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None


def validate_prompts(task: EvalTask, engine: InferenceEngine, sampling: SamplingParams) -> None:
    """ConfigError naming the first prompt ``engine`` could never generate (too long for
    the model with ``sampling.max_new_tokens``, token ids outside its vocabulary)."""
    for p in task.prompts:
        try:
            engine.validate(GenRequest(f"{p.prompt_id}:check", p.prompt_ids, sampling))
        except TapiocaError as exc:
            raise ConfigError(f"prompt {p.prompt_id!r} of {task.dataset} cannot be generated: "
                              f"{exc}; remove it from the dataset or use a model with a longer "
                              "context") from exc


@dataclass
class _Pending:
    prompt: int  # index into the prompts
    sample_index: int
    future: concurrent.futures.Future  # the engine's
    result: GenResult | None = None
    text: str = ""
    score: concurrent.futures.Future | None = None  # the scorer's


@dataclass
class EvalRun:
    """The completions of one version: ``k`` sampled (``sampling``) plus one greedy
    (``greedy``) per prompt of ``task``, generated by ``engine`` and scored as they end.
    A completion is correct when its reward reaches ``correct_min_reward``."""

    task: EvalTask
    engine: InferenceEngine
    sampling: SamplingParams
    k: int
    greedy: bool
    decode: Callable[[list[int]], str]
    version: int = 0
    correct_min_reward: float = 1.0
    # None: scored in this process, one completion at a time.
    scorer: Scorer | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)
    started_at: float = 0.0
    finished_at: float = 0.0
    output_tokens: int = 0
    scoring_errors: int = 0
    # Completions whose tokens do not all carry ``version`` (the version proof).
    mixed_version_samples: int = 0
    _pending: list[_Pending] = field(default_factory=list)
    _left: list[int] = field(default_factory=list)  # completions still running, per prompt

    def __post_init__(self) -> None:
        if self.scorer is None:
            self.scorer = Scorer(self.task)

    @property
    def completions(self) -> int:
        return len(self.task.prompts) * (self.k + int(self.greedy))

    @property
    def done(self) -> bool:
        return self.started_at > 0 and not self._pending

    @property
    def prompts_done(self) -> int:
        return sum(1 for n in self._left if n == 0)

    def start(self) -> None:
        """Queue every completion (each prompt's k samples together: the engine prefills
        their shared prompt once). A prompt the engine can never generate (too long,
        unknown tokens) is an error naming it."""
        greedy = dataclasses.replace(self.sampling, temperature=0.0)
        validate_prompts(self.task, self.engine, self.sampling)
        self.started_at = time.monotonic()
        for i, p in enumerate(self.task.prompts):
            reqs = [GenRequest(f"{p.prompt_id}:{j}", p.prompt_ids, self.sampling) for j in range(self.k)]
            if self.greedy:
                reqs.append(GenRequest(f"{p.prompt_id}:greedy", p.prompt_ids, greedy))
            futures = self.engine.submit_all(reqs)
            self._left.append(len(futures))
            self._pending += [_Pending(i, j if j < self.k else GREEDY_INDEX, f)
                              for j, f in enumerate(futures)]

    def poll(self) -> int:
        """Hand the completions that finished to the scorer, and turn the scored ones into
        rows; returns how many rows were added."""
        scorer = self.scorer
        assert scorer is not None
        added, still = 0, []
        for x in self._pending:
            if x.score is None and x.future.done():
                x.result = x.future.result()
                if x.result.finish_reason == "abort":
                    raise EngineError(
                        f"the engine aborted a completion of prompt "
                        f"{self.task.prompts[x.prompt].prompt_id!r} (version {self.version}): it "
                        "was shut down or lost its server; evaluate again")
                x.text = self.decode(x.result.output_ids)
                x.score = scorer.submit(x.text, self.task.prompts[x.prompt].answer)
            if x.score is not None and x.score.done():
                self._row(x, *x.score.result())
                added += 1
            else:
                still.append(x)
        self._pending = still
        if added and not still:
            self.finished_at = time.monotonic()
        return added

    def _row(self, pending: _Pending, reward: float, answer: str | None, error: str) -> None:
        prompt, result = self.task.prompts[pending.prompt], pending.result
        assert result is not None
        if error:
            self.scoring_errors += 1
            log.warning("scoring prompt %s sample %d failed (counted as wrong, see the row's "
                        "score_error): %s", prompt.prompt_id, pending.sample_index, error)
        row = {"version": self.version, "prompt_id": prompt.prompt_id, "subset": prompt.subset,
               "sample_index": pending.sample_index, "output_text": pending.text, "reward": reward,
               "correct": reward >= self.correct_min_reward, "extracted_answer": answer,
               "reference_answer": prompt.answer, "finish_reason": result.finish_reason,
               "output_tokens": len(result.output_ids),
               "token_versions": sorted(set(result.output_versions))}
        if error:
            row["score_error"] = error
        if attributed_version(result.output_versions) != self.version:
            # Not the evaluated version's alone: not its score (AReaL #1479's rule).
            self.mixed_version_samples += 1
            row["dropped"] = (f"its tokens carry versions {row['token_versions']}, not all "
                              f"{self.version}: its prompt's score is not attributed")
            log.warning("prompt %s sample %d: %s", prompt.prompt_id, pending.sample_index, row["dropped"])
        self.rows.append(row)
        self.output_tokens += len(result.output_ids)
        self._left[pending.prompt] -= 1

    def sorted_rows(self) -> list[dict[str, Any]]:
        """Rows in dataset order, each prompt's samples by index, its greedy one last."""
        order = {p.prompt_id: i for i, p in enumerate(self.task.prompts)}
        return sorted(self.rows, key=lambda r: (order[r["prompt_id"]],
                                                r["sample_index"] if r["sample_index"] >= 0 else 1 << 30))

    def metrics(self) -> dict[str, Any]:
        """``{"total": ..., "subsets": ...}`` of algorithms/eval_metrics.summarize, from
        the rows exactly as they are written (prompts with a dropped completion left out;
        when that is every prompt, counts of 0 and no score)."""
        prompts = prompts_from_rows(self.sorted_rows())
        if not prompts:
            return {"total": {"prompts": 0.0, "samples": 0.0}, "subsets": {}}
        return summarize(prompts, self.k)

    def version_proof(self) -> dict[str, Any]:
        """The versions behind the scores (of every scored completion's tokens) and what
        the proof dropped."""
        out = dropped_prompts(self.rows)
        kept = [r for r in self.rows if r["prompt_id"] not in out]
        return {"versions": sorted({v for r in kept for v in r["token_versions"]}),
                "mixed_version_samples": self.mixed_version_samples, "prompts_dropped": len(out)}

    def summary(self, **extra: Any) -> dict[str, Any]:
        wall = max(self.finished_at - self.started_at, 1e-9)
        return {"version": self.version, "task": self.task.name, "dataset": self.task.dataset,
                "k": self.k, "greedy": self.greedy, "correct_min_reward": self.correct_min_reward,
                "sampling": {k: getattr(self.sampling, k)
                             for k in ("temperature", "top_p", "top_k", "max_new_tokens")},
                **extra, "metrics": self.metrics(), **self.version_proof(), "wall_s": wall,
                "prompts_per_s": len(self.task.prompts) / wall,
                "output_tokens_per_s": self.output_tokens / wall,
                "scoring_errors": self.scoring_errors, "samples_file": SAMPLES_FILE}

    def write(self, out_dir: str | Path, **extra: Any) -> dict[str, Any]:
        """``samples.jsonl`` and ``summary.json`` in ``out_dir`` (created); returns the summary."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / SAMPLES_FILE, "w") as f:
            for row in self.sorted_rows():
                f.write(json.dumps(row) + "\n")
        summary = self.summary(**extra)
        (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
        return summary


def flat_metrics(metrics: dict[str, Any], prefix: str = "eval/") -> dict[str, float]:
    """``{"total": {...}, "subsets": {name: {...}}}`` as flat scalars: ``eval/pass@1``,
    ``eval/<subset>/pass@1`` (what goes to metrics.v1, TensorBoard and the JSONL)."""
    out = {f"{prefix}{k}": float(v) for k, v in metrics["total"].items()}
    for name, values in metrics["subsets"].items():
        out.update({f"{prefix}{name or '-'}/{k}": float(v) for k, v in values.items()})
    return out


def read_samples(path: str | Path) -> list[PromptSamples]:
    """The prompts of an evaluation's ``samples.jsonl`` (or of the directory holding it)."""
    path = Path(path)
    if path.is_dir():
        path = path / SAMPLES_FILE
    if not path.is_file():
        raise ConfigError(f"no samples file at {path}; pass an evaluation's samples.jsonl (or "
                          "its directory)")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                raise ConfigError(f"{path}:{n} is not JSON; is this an evaluation's "
                                  f"{SAMPLES_FILE}?") from None
    try:
        return prompts_from_rows(rows)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{path}: a row lacks {exc} (rows need prompt_id, sample_index, "
                          "reward, correct); is this an evaluation's samples.jsonl?") from None
