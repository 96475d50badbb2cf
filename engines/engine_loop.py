"""The engine thread and its control protocol: queue, steps, pause, weight updates, shutdown.

Consumes calls from any thread (``submit``, ``pause``, ``update_weights``, ...) and
drives a subclass's steps on one background thread; emits each request's
:class:`~tapioca.engines.base.GenResult` through its future, keyed by ``request_id``.
The subclass (:class:`~tapioca.engines.torch_engine.TorchEngine`,
:class:`~tapioca.engines.paged_engine.PagedEngine`) supplies admission
(``_admit_locked``), one step (``_step``), failure and abort handling, and the weight
copy; this class owns the semantics every caller relies on:

- a step is the unit of work; ``pause``, ``update_weights`` and admission happen only
  between steps, and tokens of a step carry the version its step started with;
- ``update_weights`` (interruptible) parks the thread at the next step boundary, copies
  the weights, and the in-flight rows continue with the new version (their KV cache is
  kept); with ``interruptible=False`` it stops admitting, lets the running rows finish,
  then loads, so every sequence has a single version;
- ``shutdown`` aborts queued and in-flight requests (finish_reason "abort").
"""

from __future__ import annotations

import abc
import concurrent.futures
import logging
import os
import threading
import time
from collections import deque
from typing import Any, Callable, Sequence

import torch

from ..models.lora import LoraAdapter
from ..schemas.errors import EngineError
from .base import Decode, GenRequest, GenResult, InferenceEngine, WeightsSource
from .scheduler import Pending

Delivered = list[tuple[concurrent.futures.Future, Any]]

log = logging.getLogger(__name__)


def engine_device(device: str | torch.device) -> torch.device:
    """``device`` with a CUDA index filled in (the engine thread makes it current)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


# Stop strings are matched in the decoded text of the last few tokens only: a string of
# n characters spans at most n tokens that each decode to >= 1 character; the margin
# covers tokens that decode to nothing (partial UTF-8 bytes, skipped specials).
STOP_STRING_MARGIN_TOKENS = 8


def stop_string_in_tail(decode: Callable[[list[int]], str], tokens: Sequence[int], start: int,
                        end: int, stops: Sequence[str]) -> bool:
    """Whether the output ``tokens[start:end]`` ends with text containing one of ``stops``."""
    window = max(len(s) for s in stops) + STOP_STRING_MARGIN_TOKENS
    text = decode(list(tokens[max(start, end - window):end]))
    return any(s in text for s in stops)


class EngineLoop(InferenceEngine):
    """Threaded engine skeleton; see the module docstring."""

    # The model's vision tokens (models/vision.py VisionSpec); None: a text-only model.
    _vision = None

    def __init__(self, *, device: torch.device, max_batch_size: int, interruptible: bool,
                 decode: Decode | None, eos_token_id: int | Sequence[int] | None, version: int,
                 vocab_size: int | None, max_positions: int | None, name: str) -> None:
        if max_batch_size < 1:
            raise EngineError(f"max_batch_size={max_batch_size}: use an integer >= 1")
        self.device = device
        self.max_batch_size = int(max_batch_size)
        self.interruptible = bool(interruptible)
        self.decode = decode
        if eos_token_id is None:
            self._eos: tuple[int, ...] = ()
        elif isinstance(eos_token_id, int):
            self._eos = (eos_token_id,)
        else:
            self._eos = tuple(int(t) for t in eos_token_id)
        self._vocab_size = vocab_size
        self._max_positions = max_positions
        self._name = name
        self._version = int(version)
        self._cv = threading.Condition()
        self._queue: deque[Pending] = deque()
        self._live = 0  # running rows (mirror for other threads)
        self._paused = False
        self._in_step = False
        self._updating = False
        self._update_waiters = 0
        self._update_lock = threading.Lock()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=f"tapioca-{name}", daemon=True)

    def _start(self) -> None:
        self._thread.start()

    # Sleep mode (rollout.enable_sleep_mode): an engine idle this long gives its memory
    # back (the trainer steps in the meantime); the next admission takes it again.
    SLEEP_AFTER_IDLE_S = 0.05

    def _can_sleep(self) -> bool:
        """Whether this engine has memory to give back while idle (sleep mode on)."""
        return False

    def _sleep(self) -> None:
        """Give the memory back (engine thread; nothing runs or is in flight)."""

    def _wake(self) -> None:
        """Take the memory again before the next admission (engine thread)."""

    # ------------------------------------------------------------------ subclass hooks

    @abc.abstractmethod
    def _admit_locked(self, now: float) -> list:
        """Pop what joins this step from ``self._queue`` (the lock is held)."""

    @abc.abstractmethod
    def _step(self, admitted: list, version: int) -> Delivered:
        """One decode step of the running rows plus the prefill of ``admitted``."""

    @abc.abstractmethod
    def _fail_step(self, admitted: list, exc: BaseException) -> Delivered:
        """Fail every running and admitted request after ``_step`` raised."""

    @abc.abstractmethod
    def _abort_running(self, now: float) -> Delivered:
        """"abort" results for every running request (at shutdown)."""

    @abc.abstractmethod
    def _running_rows(self) -> int:
        """Admitted requests whose results are not delivered yet."""

    def _admitted_futures(self) -> list:
        """Every admitted request's future whose result is not delivered yet (the last
        resort of :meth:`_die` when :meth:`_fail_step` itself raised)."""
        return []

    def _has_inflight(self) -> bool:
        """Whether a launched step's results are still to be processed (overlap)."""
        return False

    def _flush(self) -> Delivered:
        """Wait for the launched step and process its results (before the thread parks)."""
        return []

    @abc.abstractmethod
    def _load_state_dict(self, state_dict) -> None:
        """Copy the weights in (the engine thread is parked at a step boundary)."""

    def _validate_more(self, request: GenRequest) -> None:
        """Engine-specific checks (e.g. the KV cache's capacity)."""

    def _read_weights_file(self, path: str) -> dict[str, torch.Tensor]:
        """A safetensors file's tensors, read on the caller's thread before the update waits."""
        from safetensors.torch import load_file

        # To host memory: this thread must not touch the GPU while the engine thread may be
        # capturing a CUDA graph; the copy into the weights happens at the step boundary.
        return load_file(path)

    def _admission_room_locked(self) -> int:
        """How many queued requests may join the next step: the free rows, or 0 while fewer
        rows are free than a group of >= 1/8 of the batch (or the whole queue, if smaller).
        Each admission costs a prefill forward, so admitting one row per finished row would
        double the step cost."""
        free = self.max_batch_size - self._live
        group = min(len(self._queue), max(1, self.max_batch_size // 8))
        return free if free >= group else 0

    # ------------------------------------------------------------------ public API

    @property
    def version(self) -> int:
        return self._version

    def submit(self, request: GenRequest) -> concurrent.futures.Future[GenResult]:
        return self._enqueue([request])[0]

    def submit_all(self, requests: Sequence[GenRequest]) -> list[concurrent.futures.Future[GenResult]]:
        return self._enqueue(list(requests))

    def generate(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        # Enqueued in one go, so an idle engine batches them identically every time
        # (what makes ``seed`` reproducible).
        return [f.result() for f in self._enqueue(list(requests))]

    def _enqueue(self, requests: list[GenRequest]) -> list[concurrent.futures.Future]:
        for request in requests:
            self.validate(request)
        now = time.monotonic()
        pendings = [Pending(r, concurrent.futures.Future(), now) for r in requests]
        for p in pendings:
            p.future.set_running_or_notify_cancel()
        with self._cv:
            if self._closing:
                raise EngineError(f"the engine is shut down; create a new {type(self).__name__}")
            self._queue.extend(pendings)
            self._cv.notify_all()
        return [p.future for p in pendings]

    def pause(self) -> None:
        with self._cv:
            self._paused = True
            if threading.current_thread() is not self._thread:
                # ... and until a launched step's results are in (the thread flushes it now).
                while (self._in_step or self._has_inflight()) and not self._closing:
                    self._cv.wait()

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    def update_weights(self, weights: WeightsSource, version: int) -> None:
        if isinstance(weights, (str, os.PathLike)):
            weights = self._read_weights_file(os.fspath(weights))
        self._at_step_boundary(lambda: self._load_state_dict(weights), version)

    def update_adapter(self, adapter: LoraAdapter, version: int) -> None:
        if adapter.tensors is None:
            raise EngineError(f"{type(self).__name__} loads an adapter from its tensors; got a "
                              f"directory only ({adapter.path})")
        self._check_adapter(adapter)  # a bad adapter is refused before the engine parks
        self._at_step_boundary(lambda: self._load_adapter(adapter), version)

    def _check_adapter(self, adapter: LoraAdapter) -> None:
        """Raise EngineError if this engine cannot serve ``adapter`` (any thread)."""
        raise EngineError(f"{type(self).__name__} does not serve LoRA adapters")

    def _load_adapter(self, adapter: LoraAdapter) -> None:
        """Put ``adapter`` in place (the engine thread is parked at a step boundary)."""
        raise EngineError(f"{type(self).__name__} does not serve LoRA adapters")

    def _at_step_boundary(self, load: Callable[[], None], version: int) -> None:
        """Park the engine thread at the next step boundary (interruptible), or once the
        running rows finished (not), run ``load``, and label what follows ``version``."""
        if threading.current_thread() is self._thread:
            raise EngineError(
                "update_weights was called from the engine thread (a future callback); "
                "call it from another thread")
        with self._update_lock:
            with self._cv:
                if self._closing:
                    raise EngineError(f"the engine is shut down; create a new {type(self).__name__}")
                self._update_waiters += 1
                self._cv.notify_all()
                try:
                    while (self._in_step or self._has_inflight()
                           or (not self.interruptible and self._live > 0)):
                        if not self.interruptible and self._paused and self._live > 0 and not self._in_step:
                            raise EngineError(
                                "interruptible=False waits for the running batch to finish, but the "
                                "engine is paused; call resume() first (or build the engine with "
                                "interruptible=True)")
                        if self._closing:
                            raise EngineError("the engine shut down while a weight update was waiting")
                        self._cv.wait()
                    self._updating = True
                finally:
                    self._update_waiters -= 1
            try:
                load()
                self._version = int(version)
            finally:
                with self._cv:
                    self._updating = False
                    self._cv.notify_all()

    def shutdown(self) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        if threading.current_thread() is not self._thread and self._thread.is_alive():
            self._thread.join()

    def validate(self, request: GenRequest) -> None:
        if not request.prompt_ids:
            raise EngineError(f"request {request.request_id!r} has an empty prompt; give at least one token")
        if request.sampling.stop_strings and self.decode is None:
            raise EngineError(
                f"request {request.request_id!r} uses stop_strings but the engine has no decode function; "
                f"pass {type(self).__name__}(..., decode=tokenizer.decode)")
        # One bad id would fail the whole batch's forward, so reject it here.
        if self._vocab_size is not None and not all(0 <= t < self._vocab_size for t in request.prompt_ids):
            raise EngineError(
                f"request {request.request_id!r} has token ids outside [0, {self._vocab_size}); "
                "check the tokenizer matches the model")
        total = len(request.prompt_ids) + request.sampling.max_new_tokens
        if self._max_positions is not None and total > self._max_positions:
            raise EngineError(
                f"request {request.request_id!r}: prompt ({len(request.prompt_ids)}) + max_new_tokens "
                f"({request.sampling.max_new_tokens}) exceeds the model's max_position_embeddings "
                f"({self._max_positions}); shorten the prompt or lower max_new_tokens")
        self._validate_images(request)
        self._validate_more(request)

    def _validate_images(self, request: GenRequest) -> None:
        """Images only for a VL model, each with its one run of placeholders, in order."""
        images = request.images
        if self._vision is None:
            if images:
                raise EngineError(f"request {request.request_id!r} has {len(images)} image(s) but the "
                                  "model has no vision tower; use a vision-language model (Qwen2.5-VL, "
                                  "Qwen3-VL) or send text only")
            return
        from ..media.images import ImageError
        from ..models.vision import image_runs, placeholder_mask

        grids = list(images.grid_thw) if images else []
        if images and images.pixel_values is None:
            raise EngineError(f"request {request.request_id!r}: its images have no pixel values "
                              "(an in-process engine runs the vision tower on them)")
        try:
            image_runs(placeholder_mask(request.prompt_ids, self._vision), grids, self._vision)
        except ImageError as exc:
            raise EngineError(f"request {request.request_id!r}: {exc}") from None

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:
            # Outside a step (admission, bookkeeping): the thread cannot go on, but no
            # caller may wait forever. Every request gets this error; new ones are refused.
            log.error("the %s thread stopped", self._name, exc_info=exc)
            self._die(exc)

    def _die(self, exc: BaseException) -> None:
        err = EngineError(
            f"the {self._name} thread stopped on an internal error ({type(exc).__name__}: {exc}); "
            f"every pending request fails with this error. Create a new {type(self).__name__} "
            "and retry them, and please report it with the traceback logged with it "
            "(an engine bug)")
        err.__cause__ = exc
        with self._cv:
            self._closing = True
            try:
                delivered = self._fail_step([], exc)  # results already computed, or errors
            except BaseException:  # the books may be what broke: every known request still
                try:                # gets the error, so no caller waits forever
                    delivered = [(f, err) for f in self._admitted_futures()]
                except BaseException:
                    delivered = []
            delivered += [(p.future, err) for p in self._queue]
            self._queue.clear()
            self._live = 0
            self._in_step = False
            self._cv.notify_all()
        self._deliver([(f, outcome) for f, outcome in delivered if not f.done()])

    def _loop(self) -> None:
        if self.device.type == "cuda":  # graphs and streams of this thread on the engine's GPU
            torch.cuda.set_device(self.device)
        delivered: Delivered = []
        while True:
            with self._cv:
                admitted: list = []
                flush = False
                while True:
                    if self._closing:
                        break
                    waiting_update = self.interruptible and self._update_waiters > 0
                    blocked = self._paused or self._updating or waiting_update
                    # interruptible=False: a waiting update lets the running rows finish first.
                    draining = not self.interruptible and self._update_waiters > 0
                    if not blocked:
                        if self._queue and not draining:
                            self._wake()
                            admitted = self._admit_locked(time.monotonic())
                        if self._live > 0 or admitted:
                            break
                    if self._has_inflight():  # finish the launched step before parking
                        flush = True
                        break
                    if self._live == 0 and self._can_sleep():
                        # Idle: after a short grace (the next request is often a moment
                        # away), give the memory back until work comes.
                        if not self._cv.wait(timeout=self.SLEEP_AFTER_IDLE_S) and self._live == 0 \
                                and not self._closing and not self._has_inflight():
                            self._sleep()
                        continue
                    self._cv.wait()
                closing = self._closing
                version = self._version
                self._in_step = True
            try:
                if closing or flush:
                    delivered = self._flush()
                else:
                    delivered = self._step(admitted, version)
            except BaseException as exc:  # a failed step fails its requests, not the engine
                delivered = self._fail_step(admitted, exc)
            with self._cv:
                if closing:
                    delivered += self._abort_all_locked()
                self._in_step = False
                self._live = self._running_rows()
                self._cv.notify_all()
            self._deliver(delivered)
            if closing:
                break

    @staticmethod
    def _deliver(delivered: Delivered) -> None:
        for future, outcome in delivered:
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)

    def _abort_all_locked(self) -> Delivered:
        now = time.monotonic()
        delivered = self._abort_running(now)
        for p in self._queue:
            result = GenResult(p.request.request_id, list(p.request.prompt_ids), [], [], [], "abort",
                               {"queued_s": now - p.t_submit, "generate_s": 0.0})
            delivered.append((p.future, result))
        self._queue.clear()
        self._live = 0
        return delivered
