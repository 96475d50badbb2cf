"""Version-proof evaluation (AReaL #1479's rule): a score counts for version v only when
every scored token carries v. The pure rule (algorithms/eval_metrics.py) on hand-made
cases, an evaluation whose engine hands back a completion of mixed versions (dropped,
counted, its prompt left out, the summary naming the versions behind the scores, and a
recomputation from samples.jsonl agreeing), and the per-version score of live traffic."""

from __future__ import annotations

import concurrent.futures
import json

import pytest

from tapioca.algorithms.eval_metrics import (
    attributed_version,
    live_scores,
    prompts_from_rows,
    summarize,
)
from tapioca.engines.base import GenResult, SamplingParams
from tapioca.producers.eval_run import EvalPrompt, EvalRun, EvalTask, read_samples


def test_a_version_is_attributed_only_when_every_scored_token_carries_it():
    assert attributed_version([7, 7, 7]) == 7
    assert attributed_version([6, 7, 7]) is None          # a weights switch mid-generation
    assert attributed_version([]) is None                 # nothing scored proves anything
    # With a loss mask only the policy's tokens count: the tool output (mask 0) made
    # under another version is context, not the policy's.
    assert attributed_version([6, 6, 7, 7], [0, 0, 1, 1]) == 7
    assert attributed_version([6, 7, 7, 7], [1, 0, 1, 1]) is None
    assert attributed_version([6, 7], [0, 0]) is None


def row(pid: str, j: int, correct: bool, dropped: str = "") -> dict:
    r = {"prompt_id": pid, "sample_index": j, "reward": float(correct), "correct": correct,
         "extracted_answer": None}
    return {**r, "dropped": dropped} if dropped else r


def test_a_prompt_with_a_dropped_completion_is_left_out_whole():
    rows = [row("a", 0, True), row("a", 1, False), row("b", 0, True), row("b", 1, True, "mixed")]
    prompts = prompts_from_rows(rows)
    assert [p.prompt_id for p in prompts] == ["a"]
    # pass@1 over prompt a alone: 1 of 2 correct -> 0.5 (with b it would be 0.75).
    assert summarize(prompts, 2)["total"]["pass@1"] == 0.5


def test_live_scores_per_version_by_hand():
    items = [([3, 3], [1, 1], 1.0),            # v3
             ([3, 3, 4], [1, 0, 1], 0.0),      # tokens 3 (trained) and 4: spans a switch: dropped
             ([2, 4, 4], [0, 1, 1], 0.5),      # context of v2, the policy's tokens all v4
             ([3], [1], 0.0),                  # v3
             ([4, 4], [1, 1], -1.0)]           # v4
    scores, dropped = live_scores(items)
    assert dropped == 1
    assert list(scores) == [3, 4]
    assert (scores[3].trajectories, scores[3].mean_reward) == (2, 0.5)   # (1 + 0) / 2
    assert (scores[4].trajectories, scores[4].mean_reward) == (2, -0.25)  # (0.5 - 1) / 2


class CannedEngine:
    """Hands back prepared results by request id (the evaluation only submits and validates)."""

    def __init__(self, versions: dict[str, list[int]]) -> None:
        self.versions = versions

    def validate(self, request) -> None:
        pass

    def submit_all(self, requests):
        futures = []
        for r in requests:
            f: concurrent.futures.Future = concurrent.futures.Future()
            v = self.versions.get(r.request_id, [5, 5])
            f.set_result(GenResult(r.request_id, r.prompt_ids, [1] * len(v), [-0.1] * len(v), v, "stop"))
            futures.append(f)
        return futures


def test_an_evaluation_drops_and_counts_a_completion_of_mixed_versions(tmp_path):
    task = EvalTask("canned", [EvalPrompt("p0", [1, 2], "x"), EvalPrompt("p1", [1, 3], "x")],
                    reward=lambda text, ref: 1.0, answer=lambda text: None, dataset="canned")
    engine = CannedEngine({"p1:1": [5, 6]})  # p1's second sample straddles a switch to v6
    run = EvalRun(task, engine, SamplingParams(max_new_tokens=2), k=2, greedy=True,
                  decode=lambda ids: "t", version=5)
    run.start()
    while not run.done:
        run.poll()
    summary = run.write(tmp_path)
    assert summary["mixed_version_samples"] == 1 and summary["prompts_dropped"] == 1
    assert summary["versions"] == [5]
    assert summary["metrics"]["total"]["prompts"] == 1.0  # p0 only
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    (bad,) = [r for r in rows if r.get("dropped")]
    assert (bad["prompt_id"], bad["sample_index"], bad["token_versions"]) == ("p1", 1, [5, 6])
    # Anyone recomputing from the file leaves the same prompt out.
    assert summarize(read_samples(tmp_path), 2) == summary["metrics"]


def test_an_evaluation_of_another_versions_tokens_scores_nothing(tmp_path):
    task = EvalTask("canned", [EvalPrompt("p0", [1, 2], "x")], reward=lambda text, ref: 1.0,
                    answer=lambda text: None, dataset="canned")
    run = EvalRun(task, CannedEngine({}), SamplingParams(max_new_tokens=2), k=1, greedy=False,
                  decode=lambda ids: "t", version=4)  # the engine's tokens are all v5
    run.start()
    while not run.done:
        run.poll()
    summary = run.summary()
    assert summary["metrics"]["total"] == {"prompts": 0.0, "samples": 0.0}
    assert (summary["versions"], summary["mixed_version_samples"]) == ([], 1)


@pytest.mark.parametrize("dropped,expected", [(0, "every completion's tokens are of the evaluated version"),
                                              (2, "2 completion(s) not all of version 9 dropped")])
def test_the_eval_command_says_which_versions_are_behind_the_scores(dropped, expected):
    from tapioca.ops.eval_cli import proof_line

    line = proof_line({"version": 9, "versions": [9], "mixed_version_samples": dropped,
                       "prompts_dropped": 1})
    assert line.startswith("scores from tokens of v9") and expected in line
