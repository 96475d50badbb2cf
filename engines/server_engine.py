"""Inference servers (vLLM, SGLang) behind :class:`~tapioca.engines.base.InferenceEngine`.

Consumes :class:`~tapioca.engines.base.GenRequest` (``submit``) and weight updates (a
safetensors file + its policy version); emits one
:class:`~tapioca.engines.base.GenResult` per request, keyed by ``request_id``. The
backend subclasses (:mod:`tapioca.engines.vllm_engine`,
:mod:`tapioca.engines.sglang_engine`) only say how to speak to their server; this
module holds what both share:

- one asyncio loop in a background thread and one pooled HTTP client
  (``httpx2.AsyncClient``, keep-alive connections to every server);
- load balancing: a request goes to the live server with the fewest requests in flight
  (at most ``max_inflight_per_server`` each; the server batches them);
- failures: a transport error or a 5xx marks the server down and the request is sent
  again, to another live server when there is one, with exponential backoff, up to
  ``max_attempts`` times; with no live server it waits ``wait_for_server_s`` for one to
  come back, then fails (the rollout worker then stops without committing the prompt,
  so a restart or another member generates it: nothing is lost). A 4xx is the
  request's fault and fails it at once;
- health: every server is probed every ``health_interval_s``; one that comes back is
  first brought to the current weights and version, then used again; a launched one that
  died or hangs is started again. Which servers are up and when one is restarted is
  :mod:`tapioca.engines.server_fleet`'s (this module gives it the probe and the
  bring-up). ``describe()`` reports ``servers_up`` / ``servers_down`` (the rollout
  worker's ``describe`` carries them to ``fleet.v1``);
- weight updates (interruptible): new dispatches wait, every live server is paused with
  its requests kept, reloads the weights file from disk, labels its weights with the new
  version and resumes; in-flight requests continue, and the server's per-token version
  spans say which tokens came from which weights;
- shutdown: every in-flight request is aborted on its server and resolves with the
  tokens it has (``finish_reason="abort"``); queued ones resolve empty.

Weights files: the trainer writes ``weights/vNNNNNN.safetensors`` beside older versions,
and both servers reload a *directory*; each version gets a staging directory holding one
link to its file (``<weights dir>/.server-stage/vNNNNNN/model.safetensors``), removed once
a newer version is loaded. The server must see the same path (one machine, or a shared
file system).
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import logging
import os
import shutil
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..config.policy import PolicySpec, policy_of_dir
from ..config.servers import InferenceServerConfig
from ..models.lora import LoraAdapter
from ..schemas.errors import EngineError
from .base import GenRequest, GenResult, InferenceEngine, WeightsSource
from .server_fleet import Server, ServerDown, ServerFleet

log = logging.getLogger(__name__)
# httpx2 logs every request at INFO: with health probes every few seconds that buries a
# role's log.
logging.getLogger("httpx2").setLevel(logging.WARNING)

STAGE_DIR = ".server-stage"
KEEPALIVE_EXPIRY_S = 2.0
# A probe slower than this counts as a failed one (a busy 2-core box answers in < 5 s).
HEALTH_TIMEOUT_S = 30.0


class RequestRejected(EngineError):
    """A server answered 4xx: the request (or admin call) itself is wrong."""


@dataclass
class RawOutput:
    """What a backend parsed from one generate response."""

    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: str
    # [(version label, start, end)] over output indices, when the server reports them.
    spans: list[tuple[str, int, int]] | None = None
    # The server's routed experts [tokens, layers, top_k] (prompt + output - 1 tokens;
    # its layers may be all hidden layers), when asked for and returned.
    routed_experts: Any = None


@dataclass
class _Stats:
    retried: int = 0
    reloads: int = 0
    routes_malformed: int = 0


def request_seed(seed: int | None, request_id: str) -> int | None:
    """A per-request sampling seed: reproducible for a fixed engine seed, different per
    request id (the samples of one group differ), the same when a request is retried."""
    if seed is None:
        return None
    return zlib.crc32(f"{seed}:{request_id}".encode()) & 0x7FFFFFFF


def versions_from_spans(spans: list[tuple[str, int, int]] | None, n: int, fallback: int,
                        parse) -> list[int]:
    """Per-token versions from a server's ``[(label, start, end)]`` spans. Tokens before
    the first span get ``fallback`` (the version when the request was sent: the oldest
    that can have produced them, so staleness is never under-counted); tokens after the
    last span get the last span's version."""
    out = [fallback] * n
    last, end = fallback, 0
    for label, start, end in spans or ():
        last = parse(label, fallback)
        for i in range(max(0, start), min(end, n)):
            out[i] = last
    for i in range(max(0, min(end, n)), n):
        out[i] = last
    return out


class ServerEngine(InferenceEngine):
    """Shared machinery of the HTTP backends; see the module docstring.

    ``urls`` are the servers (launched ones included); ``model_path`` the model they
    serve; ``policy`` what it is (config/policy.py: its vocabulary and context length,
    which the requests are checked against, its vision tokens and MoE layers; None: read
    from ``model_path``'s config.json); ``eos_token_ids`` stop every
    request besides its own ``stop_token_ids``; ``launched`` are server processes this
    engine owns and stops on ``shutdown``. ``return_routed_experts``: ask the servers for
    each request's routed experts (MoE models; the backend says how) and put them, cut to
    the model's MoE layers, on the results.
    """

    backend = "server"

    def __init__(self, urls: Sequence[str], *, config: InferenceServerConfig, model_path: str,
                 max_inflight_per_server: int = 64, eos_token_ids: Sequence[int] = (),
                 seed: int | None = None, version: int = 0, launched: Sequence[Any] = (),
                 return_routed_experts: bool = False, max_loaded_adapters: int = 0,
                 policy: PolicySpec | None = None) -> None:
        """``max_loaded_adapters``: a LoRA run's adapter versions kept loaded on each server
        (eta + 2: a request still running with the oldest a trainer step may train on);
        0: the policy adapter's ``max_loaded``, else 2."""
        if not urls:
            raise EngineError(f"{self.backend}: no server URL; set rollout.server.urls or let the "
                              "role launch one (rollout.server.urls: [])")
        self.cfg = config
        self.model_path = model_path
        self.max_inflight = max(1, int(max_inflight_per_server))
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.seed = seed
        self._closing = False
        # Which servers are up, and restarting the launched ones (engines/server_fleet.py).
        self.fleet = ServerFleet(urls, config=config, backend=self.backend, probe=self._health,
                                 launched=launched, is_closing=lambda: self._closing)
        self.servers = self.fleet.servers  # the same list: requests pick from it
        self._version = int(version)
        self._initial_version = int(version)
        self._stage: Path | None = None  # the staged weights of self._version, if any
        # A LoRA run: the adapter every new request is sent with (None: the base weights).
        self._adapter: LoraAdapter | None = None
        self.policy = policy if policy is not None else policy_of_dir(model_path)
        adapter = self.policy.adapter
        self._max_adapters = max(1, int(max_loaded_adapters or (adapter.max_loaded if adapter else 0) or 2))
        self._stats = _Stats()
        self._user_paused = False
        self._vocab_size, self._max_len = self.policy.vocab_size, self.policy.context_length
        self._vision = self.policy.vision  # a VL model's placeholders (models/vision.py)
        self.return_routed_experts = bool(return_routed_experts)
        moe = self.policy.moe  # the servers report every hidden layer; the MoE ones are kept
        self._moe_layers = list(moe.layers) if moe else []
        self._num_layers, self._top_k = (moe.num_layers, moe.top_k) if moe else (0, 0)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"tapioca-{self.backend}",
                                        daemon=True)
        self._thread.start()
        try:
            self._call(self._start(), timeout=self.cfg.startup_timeout_s + 30)
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ backend hooks

    @abc.abstractmethod
    async def _check(self, server: Server) -> None:
        """Refuse a server whose settings break Tapioca's contract (raise EngineError)."""

    @abc.abstractmethod
    async def _generate(self, server: Server, request: GenRequest, lora: str | None = None) -> RawOutput:
        """One generate call (raises ServerDown / RequestRejected); ``lora``: with the loaded
        adapter of that name instead of the base weights."""

    async def _load_lora(self, server: Server, name: str, path: str) -> None:
        """Load the PEFT adapter directory ``path`` as ``name`` (raise RequestRejected)."""
        raise EngineError(f"the {self.backend} adapter does not serve LoRA adapters")

    async def _unload_lora(self, server: Server, name: str) -> None:
        """Unload adapter ``name`` (in-flight requests that use it finish with it)."""
        raise EngineError(f"the {self.backend} adapter does not serve LoRA adapters")

    @abc.abstractmethod
    async def _pause(self, server: Server) -> None:
        """Stop the server's scheduler, keeping its requests."""

    @abc.abstractmethod
    async def _resume(self, server: Server) -> None: ...

    @abc.abstractmethod
    async def _reload(self, server: Server, stage: Path, version: int) -> None:
        """Load the weights in directory ``stage`` (paused) and label them ``version``."""

    @abc.abstractmethod
    async def _set_version(self, server: Server, version: int) -> None:
        """Label the weights the server holds (used at start and after a restart)."""

    @abc.abstractmethod
    async def _abort(self, server: Server, request_ids: list[str]) -> None:
        """Abort these requests (this engine's own: the server may serve other workers)."""

    async def _restore_initial(self, server: Server) -> None:
        """At first contact: make a server that already served updates (another run's
        weights) hold the model directory's weights again; no-op by default."""

    async def _health(self, server: Server) -> bool:
        """``GET /health`` answered 200 in time: the fleet's probe (engines/server_fleet.py)."""
        try:
            r = await self._client.get(f"{server.url}/health",
                                       timeout=min(self.cfg.admin_timeout_s, HEALTH_TIMEOUT_S))
            return r.status_code == 200
        except Exception:
            return False

    # ------------------------------------------------------------------ HTTP

    async def _post(self, server: Server, path: str, *, json: Any = None,
                    params: dict | None = None, timeout: float | None = None) -> Any:
        """POST and decode JSON; ServerDown on transport errors and 5xx, RequestRejected
        on 4xx (with the server's message)."""
        import httpx2

        try:
            r = await self._client.post(f"{server.url}{path}", json=json, params=params,
                                        timeout=timeout or self.cfg.admin_timeout_s)
        except httpx2.HTTPError as exc:
            raise ServerDown(f"{server.url}{path}: {type(exc).__name__}: {exc}") from None
        if r.status_code >= 500:
            raise ServerDown(f"{server.url}{path}: HTTP {r.status_code}: {r.text[:300]}")
        if r.status_code >= 400:
            raise RequestRejected(f"{self.backend} server {server.url} refused {path} "
                                  f"(HTTP {r.status_code}): {r.text[:500]}")
        if not r.content:
            return None
        try:
            return r.json()
        except ValueError:
            return r.text

    # ------------------------------------------------------------------ start / health

    async def _start(self) -> None:
        import httpx2

        per_server = self.max_inflight + 8  # + admin calls and probes
        self._client = httpx2.AsyncClient(limits=httpx2.Limits(
            max_connections=per_server * len(self.servers),
            max_keepalive_connections=per_server * len(self.servers),
            # Below uvicorn's 5 s keep-alive (both servers' HTTP layer): a pooled connection
            # the server is closing would fail the next request sent on it.
            keepalive_expiry=KEEPALIVE_EXPIRY_S))
        self._open = asyncio.Event()  # set = requests may be dispatched
        self._open.set()
        self._capacity = asyncio.Condition()
        self._update_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()
        # Wait for the first server; the others join when they answer (the monitor).
        await self.fleet.wait_for_first(self._first_contact)
        self._monitor = self._loop.create_task(self.fleet.monitor(self._join))

    async def _first_contact(self, server: Server) -> None:
        """A server answering for the first time: refuse it if misconfigured (an error,
        not a down server), give it the model's weights if it served another run, then
        the current weights and version."""
        await self._check(server)
        await self._restore_initial(server)
        server.checked = True
        await self._bring_up(server)

    async def _bring_up(self, server: Server) -> None:
        """Give a (re)started server the current weights and version, then use it."""
        if self._adapter is not None:  # a LoRA run: the base is the server's own, the adapter ours
            server.adapters = []
            await self._load_adapter_on(server, self._adapter, fresh=True)
            await self._set_version(server, self._version)
            if self._user_paused:
                await self._pause(server)
        elif self._stage is not None and server.version != self._version:
            await self._pause(server)
            await self._reload(server, self._stage, self._version)
            if not self._user_paused:
                await self._resume(server)
        else:
            if self._stage is None and self._version != self._initial_version:
                raise EngineError(f"{server.url} holds unknown weights and no weights file of "
                                  f"version {self._version} is known")
            await self._set_version(server, self._version)
            if self._user_paused:
                await self._pause(server)
        server.version = self._version
        server.up = True
        server.last_error = ""
        async with self._capacity:
            self._capacity.notify_all()

    async def _join(self, server: Server, joining: bool) -> None:
        """The fleet's bring-up of a server that answers again: a first contact when it
        never passed one (``joining``), else the current weights and version."""
        async with self._update_lock:  # not in the middle of an update
            if joining:
                await self._first_contact(server)
            else:
                await self._bring_up(server)

    # ------------------------------------------------------------------ requests

    def submit(self, request: GenRequest) -> concurrent.futures.Future[GenResult]:
        self.validate(request)
        if self._closing:
            raise EngineError(f"the {self.backend} engine is shut down; create a new one")
        return asyncio.run_coroutine_threadsafe(self._run(request), self._loop)

    def validate(self, request: GenRequest) -> None:
        rid = request.request_id
        if not request.prompt_ids:
            raise EngineError(f"request {rid!r} has an empty prompt; give at least one token")
        if self._vocab_size and not all(0 <= t < self._vocab_size for t in request.prompt_ids):
            raise EngineError(f"request {rid!r} has token ids outside [0, {self._vocab_size}); "
                              "check the tokenizer matches the model")
        total = len(request.prompt_ids) + request.sampling.max_new_tokens
        if self._max_len and total > self._max_len:
            raise EngineError(
                f"request {rid!r}: prompt ({len(request.prompt_ids)}) + max_new_tokens "
                f"({request.sampling.max_new_tokens}) exceeds the model's context "
                f"({self._max_len}); shorten the prompt or lower max_new_tokens")
        self._validate_images(request)

    def _validate_images(self, request: GenRequest) -> None:
        """Images only for a VL model, with their bytes, one placeholder run each."""
        images, rid = request.images, request.request_id
        if self._vision is None:
            if images:
                raise EngineError(f"request {rid!r} has {len(images)} image(s) but {self.model_path} has "
                                  "no vision tower; serve a vision-language model or send text only")
            return
        from ..media.images import ImageError
        from ..models.vision import image_runs, placeholder_mask

        if images and len(images.blobs) != len(images):
            raise EngineError(f"request {rid!r}: a server engine sends the images' bytes, which "
                              "this request does not carry")
        try:
            image_runs(placeholder_mask(request.prompt_ids, self._vision),
                       list(images.grid_thw) if images else [], self._vision)
        except ImageError as exc:
            raise EngineError(f"request {rid!r}: {exc}") from None

    async def _run(self, request: GenRequest) -> GenResult:
        task = asyncio.current_task()
        self._tasks.add(task)
        t_submit = time.monotonic()
        try:
            for attempt in range(1, self.cfg.max_attempts + 1):
                await self._open.wait()
                if self._closing:
                    return self._aborted(request, t_submit)
                server = await self._pick(request)
                if server is None:  # shutting down
                    return self._aborted(request, t_submit)
                version, adapter = self._version, self._adapter  # together: no await between
                server.inflight += 1
                server.requests.add(request.request_id)
                t_admit = time.monotonic()
                try:
                    raw = await self._generate(server, request, adapter.name if adapter else None)
                except ServerDown as exc:
                    # One dropped connection is not a dead server: ask it before saying so.
                    if not await self._health(server):
                        self.fleet.mark_down(server, str(exc))
                    if self._closing:
                        return self._aborted(request, t_submit)
                    if attempt == self.cfg.max_attempts:
                        raise EngineError(
                            f"request {request.request_id!r} failed on {attempt} attempts; last: "
                            f"{exc}") from None
                    self._stats.retried += 1
                    await asyncio.sleep(self.cfg.retry_backoff_s * 2 ** (attempt - 1))
                    continue
                finally:
                    server.inflight -= 1
                    server.requests.discard(request.request_id)
                    async with self._capacity:
                        self._capacity.notify_all()
                if adapter is not None:
                    # The request ran with its adapter to the end, whatever the server's
                    # version label says: every token is the adapter's version.
                    raw.spans = None
                return self._result(request, raw, version, t_submit, t_admit)
            raise AssertionError("unreachable")
        except asyncio.CancelledError:  # shutdown with the server gone: resolve, not cancel
            return self._aborted(request, t_submit)
        finally:
            self._tasks.discard(task)

    async def _pick(self, request: GenRequest) -> Server | None:
        """The live server with the fewest requests in flight, waiting for capacity or
        (with every server down) up to wait_for_server_s for one to come back; None once
        the engine shuts down."""
        deadline = time.monotonic() + self.cfg.wait_for_server_s
        async with self._capacity:
            while True:
                live = [s for s in self.servers if s.up and s.inflight < self.max_inflight]
                if live:
                    return min(live, key=lambda s: s.inflight)
                if self._closing:
                    return None
                if not self.fleet.any_up() and time.monotonic() > deadline:
                    down = self.fleet.errors()
                    raise EngineError(
                        f"request {request.request_id!r}: no {self.backend} server came back "
                        f"within rollout.server.wait_for_server_s={self.cfg.wait_for_server_s:.0f}"
                        f" s ({down})")
                try:
                    await asyncio.wait_for(self._capacity.wait(), timeout=1.0)
                except asyncio.TimeoutError:
                    pass

    def _result(self, request: GenRequest, raw: RawOutput, version: int, t_submit: float,
                t_admit: float) -> GenResult:
        n = len(raw.output_ids)
        if len(raw.output_logprobs) != n:
            raise EngineError(f"{self.backend} returned {n} tokens but {len(raw.output_logprobs)} "
                              f"logprobs for {request.request_id!r}; is logprobs enabled?")
        versions = versions_from_spans(raw.spans, n, version, self._parse_version)
        finish = raw.finish_reason if raw.finish_reason in ("stop", "length", "abort") else "abort"
        now = time.monotonic()
        return GenResult(request.request_id, list(request.prompt_ids), list(raw.output_ids),
                         [float(x) for x in raw.output_logprobs], versions, finish,
                         {"queued_s": t_admit - t_submit, "generate_s": now - t_admit},
                         routed_experts=self._routes_of(request, raw, n))

    def _routes_of(self, request: GenRequest, raw: RawOutput, n_out: int):
        """The server's routes of one request on the MoE layers, or None (not asked for,
        not returned, or of the wrong shape: counted as ``routes_malformed`` and logged;
        the generation is kept and the trainer's actor.moe.router_replay_missing decides)."""
        import numpy as np

        if not self.return_routed_experts or raw.routed_experts is None:
            return None
        ids = np.asarray(raw.routed_experts)
        want = len(request.prompt_ids) + n_out - 1
        layers = self._moe_layers
        if ids.ndim == 3 and layers and ids.shape[1] == self._num_layers != len(layers):
            ids = ids[:, layers]  # the servers report every hidden layer; the dense ones are noise
        if ids.ndim != 3 or ids.shape[0] != want or (layers and ids.shape[1] != len(layers)):
            self._stats.routes_malformed += 1
            log.warning("%s returned routed experts of shape %s for %r; want [%d tokens, %s MoE "
                        "layers, top_k]: dropped (routes_malformed %d)", self.backend, ids.shape,
                        request.request_id, want, len(layers) if layers else "?",
                        self._stats.routes_malformed)
            return None
        return ids

    def _parse_version(self, label: str, fallback: int) -> int:
        try:
            return int(label)
        except (TypeError, ValueError):
            return fallback  # e.g. vLLM's "default" before the first label

    @staticmethod
    def _aborted(request: GenRequest, t_submit: float) -> GenResult:
        return GenResult(request.request_id, list(request.prompt_ids), [], [], [], "abort",
                         {"queued_s": time.monotonic() - t_submit, "generate_s": 0.0})

    # ------------------------------------------------------------------ control

    @property
    def version(self) -> int:
        return self._version

    @property
    def max_context_tokens(self) -> int | None:
        """Prompt + generated tokens one request may have (the server's, else the model's)."""
        return self._max_len

    def pause(self) -> None:
        self._call(self._set_paused(True), timeout=self.cfg.admin_timeout_s * 2)

    def resume(self) -> None:
        self._call(self._set_paused(False), timeout=self.cfg.admin_timeout_s * 2)

    async def _set_paused(self, paused: bool) -> None:
        async with self._update_lock:
            self._user_paused = paused
            if paused:
                self._open.clear()
            await self._each_live(self._pause if paused else self._resume)
            if not paused:
                self._open.set()

    async def _each_live(self, op) -> list[Server]:
        """Run ``op(server)`` on every live server at once; a server that fails is marked
        down (the monitor brings it back later). Returns the servers that succeeded."""
        live = self.fleet.live()
        results = await asyncio.gather(*(op(s) for s in live), return_exceptions=True)
        ok = []
        for server, res in zip(live, results):
            if isinstance(res, ServerDown):
                self.fleet.mark_down(server, str(res))
            elif isinstance(res, BaseException):
                raise res
            else:
                ok.append(server)
        return ok

    def update_weights(self, weights: WeightsSource, version: int) -> None:
        if not isinstance(weights, (str, os.PathLike)):
            raise EngineError(f"the {self.backend} engine reloads weights from disk: pass the "
                              "safetensors file's path (the weights event's path), not tensors")
        path = Path(weights).resolve()
        if not path.is_file():
            raise EngineError(f"weights file {path} does not exist")
        self._call(self._update(path, int(version)), timeout=self.cfg.admin_timeout_s * 4)

    async def _update(self, path: Path, version: int) -> None:
        stage = _stage(path, version)
        async with self._update_lock:
            self._open.clear()
            try:
                async def one(server: Server) -> None:
                    await self._pause(server)
                    try:
                        await self._reload(server, stage, version)
                        server.version = version
                    finally:  # a failed reload must not leave the server paused
                        if not self._user_paused:
                            await self._resume(server)

                ok = await self._each_live(one)
                if not ok:
                    log.warning("no live %s server took version %d; each gets it when it comes "
                                "back", self.backend, version)
                old, self._stage, self._version = self._stage, stage, version
                self._stats.reloads += 1
                if old is not None and old != stage:
                    shutil.rmtree(old, ignore_errors=True)
            finally:
                if not self._user_paused:
                    self._open.set()

    def update_adapter(self, adapter: LoraAdapter, version: int) -> None:
        """Load the adapter directory on every live server under its versioned name and send
        new requests with it; requests in flight finish with the adapter they started with.
        Each server keeps the newest ``max_loaded_adapters`` versions loaded, unloading the
        older ones (vLLM and SGLang keep an adapter until told otherwise)."""
        if not adapter.path or not Path(adapter.path).is_dir():
            raise EngineError(f"adapter {adapter.name}: {adapter.path or '(no path)'} is not an adapter "
                              "directory the server can read")
        self._call(self._update_adapter(adapter, int(version)), timeout=self.cfg.admin_timeout_s * 4)

    async def _update_adapter(self, adapter: LoraAdapter, version: int) -> None:
        async with self._update_lock:
            ok = await self._each_live(lambda server: self._load_adapter_on(server, adapter))
            if not ok:
                log.warning("no live %s server took adapter %s; each gets it when it comes back",
                            self.backend, adapter.name)
            for server in ok:
                server.version = version
            self._adapter, self._version = adapter, version
            self._stats.reloads += 1

    async def _load_adapter_on(self, server: Server, adapter: LoraAdapter, fresh: bool = False) -> None:
        """Load ``adapter`` on one server, then unload its versions beyond the newest
        ``max_loaded_adapters``. ``fresh``: the server may hold an adapter of that name from
        before (a restart, another run): unload it first."""
        if fresh or adapter.name in server.adapters:
            try:
                await self._unload_lora(server, adapter.name)
            except RequestRejected:
                pass  # not loaded: nothing to unload
            if adapter.name in server.adapters:
                server.adapters.remove(adapter.name)
        try:
            try:
                await self._load_lora(server, adapter.name, adapter.path)
            except RequestRejected:
                # Most often the name is taken: an earlier engine (this worker before a
                # restart, another run) loaded it there. Free it and load once more.
                try:
                    await self._unload_lora(server, adapter.name)
                except RequestRejected:
                    pass
                await self._load_lora(server, adapter.name, adapter.path)
        except RequestRejected as exc:
            raise EngineError(f"{self.backend} server {server.url} refused adapter {adapter.name} "
                              f"({adapter.path}): {exc}") from None
        except ServerDown as exc:
            if await self._health(server):  # a healthy server that failed the load: the adapter's fault
                raise EngineError(f"{self.backend} server {server.url} could not load adapter "
                                  f"{adapter.name}: {exc}") from None
            raise
        server.adapters.append(adapter.name)
        while len(server.adapters) > self._max_adapters:
            old = server.adapters.pop(0)
            try:
                await self._unload_lora(server, old)
            except RequestRejected as exc:  # gone already (a restarted server): nothing to free
                log.warning("%s server %s: unloading adapter %s: %s", self.backend, server.url, old, exc)

    def describe(self) -> dict[str, float]:
        out = {**self.fleet.describe(), "requests_retried": self._stats.retried,
               "inflight": sum(s.inflight for s in self.servers),
               "routes_malformed": self._stats.routes_malformed}
        if self._adapter is not None:  # a LoRA run: the adapter versions each server holds
            out["lora_adapters_loaded_max"] = max((len(s.adapters) for s in self.servers), default=0)
        return out

    def shutdown(self) -> None:
        """Abort in-flight requests on their servers (their results carry the tokens so
        far), resolve queued ones empty, close the client, stop launched servers."""
        if self._closing or not self._thread.is_alive():
            self.fleet.stop_launched()
            return
        self._closing = True
        try:
            self._call(self._shutdown(), timeout=self.cfg.admin_timeout_s + 30)
        except Exception as exc:  # a dead server must not block the role's exit
            log.warning("%s engine shutdown: %s", self.backend, exc)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self.fleet.stop_launched()

    async def _shutdown(self) -> None:
        monitor = getattr(self, "_monitor", None)
        if monitor is not None:
            monitor.cancel()
        if hasattr(self, "_open"):
            self._open.set()  # waiting requests see _closing and resolve as aborted
            async with self._capacity:
                self._capacity.notify_all()
            deadline = time.monotonic() + 15
            next_abort, warned = 0.0, set()
            while self._tasks and time.monotonic() < deadline:
                if time.monotonic() >= next_abort:
                    # Sent again until the requests end: an abort that reaches a server before
                    # the request it names (its generate call still in the server's HTTP
                    # handler, seen on a loaded box) is a no-op there, and the request would
                    # run to its length while shutdown waits for it.
                    await self._abort_inflight(warned)
                    next_abort = time.monotonic() + 0.5
                await asyncio.sleep(0.05)
            for task in list(self._tasks):
                task.cancel()
            await asyncio.sleep(0)
            await self._client.aclose()

    async def _abort_inflight(self, warned: set[str]) -> None:
        for server in [s for s in self.servers if s.up and s.requests]:
            try:
                await asyncio.wait_for(self._abort(server, sorted(server.requests)), timeout=10)
            except Exception as exc:
                if server.url not in warned:  # once: the abort is sent every 0.5 s
                    warned.add(server.url)
                    log.warning("abort on %s failed: %s", server.url, exc)

    # ------------------------------------------------------------------ helpers

    def _call(self, coro, timeout: float):
        """Run ``coro`` on the engine's loop from another thread and wait for it."""
        if threading.current_thread() is self._thread:
            raise EngineError(f"{self.backend} engine: a blocking call from its own loop thread")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)


def _stage(path: Path, version: int) -> Path:
    """A directory whose only weights file is ``path`` (servers reload a directory; the
    trainer's directory holds several versions)."""
    stage = path.parent / STAGE_DIR / f"v{version:06d}"
    stage.mkdir(parents=True, exist_ok=True)
    link = stage / "model.safetensors"
    if link.is_symlink() or link.exists():
        link.unlink()
    os.symlink(path, link)
    return stage


def is_tied(model_path: str) -> bool:
    """Whether the model's config ties the LM head to the input embeddings (read with
    transformers, whose per-architecture default applies when the key is absent)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_path, local_files_only=True)
    text = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    return bool(getattr(text, "tie_word_embeddings", getattr(cfg, "tie_word_embeddings", False)))
