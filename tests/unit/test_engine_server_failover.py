"""The server engines' shared machinery (engines/server_engine.py) with several servers:
load balancing, a server that dies mid-request (its request is retried on another, the
death is counted in ``describe`` for fleet.v1), a server that comes back (brought to the
current weights before it is used), all servers gone (requests wait, then fail so the
rollout worker leaves their prompts uncommitted). Stub servers (tests/conftest.py's
``stub_server``) speak vLLM 0.32's shapes; the real vLLM is tested in
tests/integration/test_engine_vllm.py."""

from __future__ import annotations

import threading
import time

import pytest

from tapioca.config.servers import InferenceServerConfig
from tapioca.engines.base import GenRequest, SamplingParams
from tapioca.engines.server_engine import versions_from_spans
from tapioca.engines.vllm_engine import VLLMEngine
from tapioca.schemas.errors import EngineError


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tapioca.runtime.run import create_tiny_checkpoint

    return str(create_tiny_checkpoint(tmp_path_factory.mktemp("m") / "model", num_heads=2,
                                      num_kv_heads=1, tie_word_embeddings=False))


def vllm_routes(name: str, block: threading.Event | None = None) -> dict:
    """vLLM's endpoints; generate answers 3 tokens labelled with the server's version."""
    state = {"version": "default"}

    def generate(body, query):
        if block is not None:
            block.wait(10)
        n = 3
        return 200, {"request_id": "generate-tokens-" + body["request_id"], "choices": [{
            "index": 0, "finish_reason": "length", "token_ids": [4, 5, 6][:n],
            "logprobs": {"content": [{"token_id": t, "logprob": -1.0} for t in (4, 5, 6)[:n]]},
            "weight_versions": [{"version": state["version"], "start": 0, "end": n}],
            "served_by": name}]}

    def set_version(body, query):
        state["version"] = body["new_version"]
        return 200, {"success": True, "new_version": body["new_version"]}

    info = {"vllm_config": {"model_config": {"logprobs_mode": "processed_logprobs",
                                             "max_model_len": 256},
                            "device_config": {"device": "cpu"}}}
    return {
        "GET /health": lambda b, q: (200, None),
        "GET /server_info": lambda b, q: (200, info),
        "GET /weight_info": lambda b, q: (200, {"weight_version": state["version"]}),
        "POST /inference/v1/generate": generate,
        "POST /update_weight_version": set_version,
        "POST /pause": lambda b, q: (200, {"status": "paused"}),
        "POST /resume": lambda b, q: (200, {"status": "resumed"}),
        "POST /collective_rpc": lambda b, q: (200, {"results": [None]}),
        "POST /reset_prefix_cache": lambda b, q: (200, {"success": True}),
        "POST /abort_requests": lambda b, q: (200, {"status": "aborted"}),
    }


def config(**kw) -> InferenceServerConfig:
    base = dict(health_interval_s=0.2, retry_backoff_s=0.05, admin_timeout_s=5.0,
                request_timeout_s=10.0, wait_for_server_s=30.0)
    return InferenceServerConfig(**{**base, **kw})


def req(i: int) -> GenRequest:
    return GenRequest(f"r{i}", [1, 2, 3], SamplingParams(max_new_tokens=3))


def wait_for(cond, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_requests_are_spread_over_the_servers(stub_server, model_dir):
    a, b = stub_server(vllm_routes("a")), stub_server(vllm_routes("b"))
    engine = VLLMEngine([a.url, b.url], config=config(), model_path=model_dir,
                        max_inflight_per_server=2)
    try:
        results = engine.generate([req(i) for i in range(12)])
    finally:
        engine.shutdown()
    assert all(r.output_ids == [4, 5, 6] and r.output_versions == [0, 0, 0] for r in results)
    n_a = a.paths().count("POST /inference/v1/generate")
    n_b = b.paths().count("POST /inference/v1/generate")
    assert n_a + n_b == 12 and n_a >= 3 and n_b >= 3


def test_a_dead_server_is_reported_and_its_request_retried_on_another(stub_server, model_dir):
    block = threading.Event()
    a = stub_server(vllm_routes("a", block=block))
    b = stub_server(vllm_routes("b"))
    engine = VLLMEngine([a.url, b.url], config=config(), model_path=model_dir,
                        max_inflight_per_server=1)
    try:
        first = engine.submit(req(0))  # goes to a (least loaded, first), which hangs
        wait_for(lambda: a.paths().count("POST /inference/v1/generate") == 1)
        a.kill()  # crashes with the request in flight
        block.set()
        result = first.result(timeout=30)
        assert result.output_ids == [4, 5, 6]
        assert b.paths().count("POST /inference/v1/generate") >= 1
        d = engine.describe()
        assert d["servers_up"] == 1 and d["servers_down"] == 1 and d["server0_up"] == 0
        assert d["requests_retried"] >= 1 and d["server_failures"] >= 1
    finally:
        engine.shutdown()


def test_a_server_that_comes_back_gets_the_current_weights_first(stub_server, model_dir, tmp_path):
    a, b = stub_server(vllm_routes("a")), stub_server(vllm_routes("b"))
    engine = VLLMEngine([a.url, b.url], config=config(), model_path=model_dir)
    try:
        port = a.port
        a.kill()
        wait_for(lambda: engine.describe()["servers_down"] == 1)
        weights = tmp_path / "v000001.safetensors"
        weights.write_bytes(b"x")
        engine.update_weights(str(weights), 1)  # only b takes it now
        back = stub_server(vllm_routes("a"), port=port)
        wait_for(lambda: engine.describe()["servers_up"] == 2)
        reloads = [body for key, body in back.calls if key == "POST /collective_rpc"]
        assert reloads and reloads[0]["kwargs"]["weights_path"].endswith("v000001")
        assert [body for key, body in back.calls
                if key == "POST /update_weight_version"][-1] == {"new_version": "1"}
        assert engine.describe()["server_recoveries"] == 1
        assert all(r.output_versions == [1, 1, 1] for r in engine.generate([req(i) for i in range(4)]))
    finally:
        engine.shutdown()


def test_with_every_server_gone_requests_wait_then_fail(stub_server, model_dir):
    a = stub_server(vllm_routes("a"))
    engine = VLLMEngine([a.url], config=config(wait_for_server_s=1.0, max_attempts=2),
                        model_path=model_dir)
    try:
        a.kill()
        wait_for(lambda: engine.describe()["servers_up"] == 0)
        with pytest.raises(EngineError, match="wait_for_server_s"):
            engine.submit(req(0)).result(timeout=30)
    finally:
        engine.shutdown()


def test_a_misconfigured_server_is_refused_with_the_fix(stub_server, model_dir):
    routes = vllm_routes("a")
    routes["GET /server_info"] = lambda b, q: (200, {"vllm_config": {
        "model_config": {"logprobs_mode": "raw_logprobs"}, "device_config": {"device": "cpu"}}})
    a = stub_server(routes)
    with pytest.raises(EngineError, match="--logprobs-mode processed_logprobs"):
        VLLMEngine([a.url], config=config(), model_path=model_dir)


def test_versions_from_spans():
    parse = lambda label, fb: int(label) if label.isdigit() else fb  # noqa: E731
    assert versions_from_spans([("3", 0, 2), ("4", 2, 5)], 5, 0, parse) == [3, 3, 4, 4, 4]
    assert versions_from_spans(None, 3, 7, parse) == [7, 7, 7]
    # vLLM labels weights "default" until the first label: the fallback (send-time) version.
    assert versions_from_spans([("default", 0, 1), ("2", 1, 2)], 4, 1, parse) == [1, 2, 2, 2]


def test_a_launched_server_whose_process_died_is_started_again(stub_server, model_dir):
    a = stub_server(vllm_routes("a"))

    class Process:
        """Stands for the LaunchedServer of engines/server_launch.py: its process is the
        stub, which restart() brings back on the same port."""

        url, restarts = a.url, 0

        def alive(self) -> bool:
            return a._httpd is not None

        def restart(self) -> None:
            self.restarts += 1
            a.start()

        def stop(self) -> None:
            a.kill()

    proc = Process()
    engine = VLLMEngine([a.url], config=config(), model_path=model_dir, launched=[proc])
    try:
        a.kill()
        wait_for(lambda: engine.describe()["server_restarts"] == 1)
        wait_for(lambda: engine.describe()["servers_up"] == 1)
        assert engine.generate([req(0)])[0].output_ids == [4, 5, 6]
    finally:
        engine.shutdown()


def test_a_server_that_answers_later_is_checked_and_then_used(stub_server, model_dir):
    a = stub_server(vllm_routes("a"))
    late = stub_server(vllm_routes("late"))
    port = late.port
    late.kill()
    engine = VLLMEngine([a.url, f"http://127.0.0.1:{port}"], config=config(),
                        model_path=model_dir, max_inflight_per_server=1)
    try:
        assert engine.describe()["servers_up"] == 1  # started without waiting for it
        back = stub_server(vllm_routes("late"), port=port)
        wait_for(lambda: engine.describe()["servers_up"] == 2)
        assert "GET /server_info" in back.paths()  # its settings were checked first
        engine.generate([req(i) for i in range(6)])
        assert back.paths().count("POST /inference/v1/generate") >= 1
    finally:
        engine.shutdown()
