"""Math answer checking: ``math_reward(completion, reference) -> 1.0 | 0.0`` via math-verify.

Used by the GSM8K / math reward scorers (consumers/), on whatever thread they run.

What the completion's answer is, in order:
1. the last ``\\boxed{...}`` (math-verify's LaTeX extraction, boxed first);
2. the text after the last ``####`` (GSM8K's own format);
3. math-verify's plain extraction ("the answer is 7", "$18", "18 dollars", "1,234",
   else the last expression);
4. only if math-verify finds nothing: the last number in the text (commas dropped,
   ``3/4`` and ``-2.5`` kept).
One answer is extracted per completion; a completion is never scored on two.
The reference is parsed the same way (GSM8K references are plain numbers, possibly
with commas). Equality is math-verify's: numeric within 1e-6, so ``0.5`` == ``1/2``.

Timeouts: math-verify guards parse/verify with ``signal.alarm``, which only works on the
main thread; on any other thread its default arguments raise ``ValueError``. So on the
main thread we let math-verify use its alarm, and on other threads we pass
``parsing_timeout=None`` / ``timeout_seconds=None`` and enforce the limit ourselves by
running the check in a daemon thread joined with a timeout. A timeout raises
:class:`MathRewardTimeout` (a ``RewardError``): the scorer retries or dead-letters it, it
never becomes a silent reward of 0. An answer that cannot be found or parsed is a
legitimate 0.
"""

from __future__ import annotations

import math
import re
import threading

from ..schemas.errors import RewardError

DEFAULT_TIMEOUT_S = 5

# A number as people write it: optional sign, digits with optional thousands commas,
# optional decimals, optional "/denominator".
_NUMBER_RE = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?|-?\.\d+")
_PLAIN_NUMBER_RE = re.compile(r"^\s*-?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?\s*$")


class MathRewardTimeout(RewardError):
    """Checking one answer took longer than its timeout; retry it or dead-letter it."""


def last_number(text: str) -> str | None:
    """The last number written in ``text``, commas removed (``"$1,234.5 total"`` -> ``"1234.5"``)."""
    found = _NUMBER_RE.findall(text)
    if not found:
        return None
    return re.sub(r"[,\s]", "", found[-1])


def _plain_float(text: str) -> float | None:
    if not _PLAIN_NUMBER_RE.match(text) or not re.search(r"\d", text):
        return None
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def _extract_boxed(text: str) -> str | None:
    """Contents of the last ``\\boxed{...}`` / ``\\fbox{...}``, braces balanced."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def _candidate(completion: str) -> str:
    """The part of the completion that holds the final answer (see the module doc)."""
    boxed = _extract_boxed(completion)
    if boxed is not None:
        return boxed
    if "####" in completion:
        return completion.rsplit("####", 1)[1]
    return completion


def _check(completion: str, reference: str, mv_timeout: int | None) -> float:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    pred_text = _candidate(completion)
    gold_text = _candidate(reference)

    # Fast path, no sympy: both sides are plain numbers (the GSM8K common case).
    gold_f = _plain_float(gold_text)
    pred_num = last_number(pred_text)
    if gold_f is not None and _plain_float(pred_text) is not None:
        return float(math.isclose(_plain_float(pred_text), gold_f, rel_tol=1e-6, abs_tol=1e-9))

    configs = [LatexExtractionConfig(), ExprExtractionConfig()]

    def mv_parse(text: str):
        # A bare expression like "\frac{1}{2}" is only seen as LaTeX inside $...$.
        if "\\" in text and "$" not in text:
            text = f"${text}$"
        return parse(text, extraction_config=configs, parsing_timeout=mv_timeout, raise_on_error=False)

    gold = mv_parse(gold_text)
    if not gold:
        raise RewardError(f"math_reward: cannot parse the reference answer {reference!r}; fix the dataset record")
    pred = mv_parse(pred_text)
    if not pred and pred_num is not None:
        # Only when math-verify found nothing: one extracted answer per completion, so
        # a policy cannot hedge ("the answer is 5 ... 8") and be paid for either.
        pred = parse(pred_num, extraction_config=[ExprExtractionConfig()], parsing_timeout=mv_timeout)
    return 1.0 if pred and verify(gold, pred, timeout_seconds=mv_timeout) else 0.0


def _number_text(value: float) -> str:
    """One spelling per number: ``18.0`` and ``18`` -> ``"18"``, ``0.50`` -> ``"0.5"``."""
    return str(int(value)) if value.is_integer() and abs(value) < 1e15 else format(value, ".10g")


def math_answer(completion: str) -> str | None:
    """The final answer of ``completion`` that :func:`math_reward` checks (the module doc's
    order: boxed, ``####``, math-verify's plain extraction, the last number), spelled so
    that equal answers are equal strings (for majority votes, `tapioca eval`'s maj@k):
    numbers as :func:`_number_text`, other expressions as sympy prints them. None: no
    answer found. Off the main thread math-verify runs without its alarm (see above)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    text = _candidate(completion)
    plain = _plain_float(text)
    if plain is not None:
        return _number_text(plain)
    timeout = DEFAULT_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    if "\\" in text and "$" not in text:
        text = f"${text}$"
    try:
        found = parse(text, extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
                      parsing_timeout=timeout, raise_on_error=False)
    except Exception:  # a timeout: fall back to the last number, as the reward does
        found = []
    if found:
        expr = found[0]
        try:
            return _number_text(float(expr))
        except (TypeError, ValueError):
            return str(expr)
    number = last_number(text)
    if number is None:
        return None
    value = _plain_float(number)
    return _number_text(value) if value is not None else number


def math_reward(completion: str, reference: str, *, timeout_s: int = DEFAULT_TIMEOUT_S) -> float:
    """1.0 if ``completion``'s final answer equals ``reference`` mathematically, else 0.0.

    Safe on any thread; raises :class:`MathRewardTimeout` after ``timeout_s`` seconds.
    """
    if threading.current_thread() is threading.main_thread():
        from math_verify.errors import TimeoutException

        try:
            return _check(completion, reference, mv_timeout=max(1, int(math.ceil(timeout_s))))
        except TimeoutException as e:  # only raised where math-verify lets it through
            raise MathRewardTimeout(f"math_reward timed out after {timeout_s}s on {completion[-200:]!r}") from e

    import math_verify.grader
    import math_verify.parser

    # We do provide the timeout (below); silence math-verify's once-per-process warning.
    math_verify.parser.TIMEOUT_WARNING_SHOWN = True
    math_verify.grader.TIMEOUT_WARNING_SHOWN = True

    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = _check(completion, reference, mv_timeout=None)
        except BaseException as e:  # handed to the caller's thread below
            box["error"] = e

    worker = threading.Thread(target=run, name="math-reward", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        # A Python thread cannot be killed; it is a daemon, so it never blocks exit.
        raise MathRewardTimeout(
            f"math_reward timed out after {timeout_s}s on {completion[-200:]!r}; "
            "run scorers in processes (main thread) so math-verify's alarm can interrupt it"
        )
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return float(box["value"])  # type: ignore[arg-type]
