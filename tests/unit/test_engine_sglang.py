"""SGLangEngine against SGLang 0.5.23's DOCUMENTED request/response shapes, not a live
server: SGLang's CPU engine cannot run on this project's CPU-only machines. The shapes
are in tests/fixtures/sglang/shapes.json, written by hand from SGLang's source (see its
``_about``); a stub HTTP server (tests/conftest.py's ``stub_server``) answers with them
and records what the adapter sends."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tapioca.config.servers import InferenceServerConfig
from tapioca.engines.base import GenRequest, SamplingParams
from tapioca.engines.sglang_engine import SGLangEngine, parse_generate
from tapioca.schemas.errors import EngineError

SHAPES = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "sglang" / "shapes.json")
                    .read_text())


def ok(payload):
    return lambda body, query: (200, payload)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tapioca.runtime.run import create_tiny_checkpoint

    return str(create_tiny_checkpoint(tmp_path_factory.mktemp("m") / "model", num_heads=2,
                                      num_kv_heads=1, tie_word_embeddings=False))


def sglang_routes(responses: dict[str, dict]) -> dict:
    def generate(body, query):
        return 200, responses[body["rid"]]

    return {
        "GET /health": lambda b, q: (200, None),
        "POST /generate": generate,
        "POST /update_weight_version": ok(SHAPES["update_weight_version_response"]),
        "POST /pause_generation": ok(SHAPES["pause_generation_response"]),
        "POST /continue_generation": ok(SHAPES["continue_generation_response"]),
        "POST /update_weights_from_disk": ok(SHAPES["update_weights_from_disk_response"]),
        "POST /abort_request": lambda b, q: (200, None),
    }


@pytest.fixture
def sglang(stub_server, model_dir):
    responses = {"g0:0": SHAPES["generate_response_version_change"],
                 "g0:1": SHAPES["generate_response_stop"],
                 "g0:2": SHAPES["generate_response_abort"]}
    server = stub_server(sglang_routes(responses))
    engine = SGLangEngine([server.url], config=InferenceServerConfig(health_interval_s=0.2),
                          model_path=model_dir, eos_token_ids=[2])
    yield server, engine
    engine.shutdown()


def test_start_labels_the_server_with_the_engine_version(sglang):
    server, _ = sglang
    calls = [body for key, body in server.calls if key == "POST /update_weight_version"]
    assert calls == [SHAPES["update_weight_version_request"]]


def test_generate_request_has_the_documented_shape(sglang):
    server, engine = sglang
    engine.generate([GenRequest("g0:0", [1, 5, 6], SamplingParams(max_new_tokens=5))])
    sent = [body for key, body in server.calls if key == "POST /generate"][0]
    assert sent == SHAPES["generate_request"]


def test_generate_response_versions_from_spans_and_finish_reasons(sglang):
    _, engine = sglang
    spans, stop, abort = engine.generate([
        GenRequest(rid, [1, 5, 6], SamplingParams(max_new_tokens=5)) for rid in ("g0:0", "g0:1", "g0:2")])
    assert spans.output_ids == [11, 12, 13, 14, 15]
    assert spans.output_logprobs == [-1.5, -0.5, -2.0, -0.25, -3.0]
    assert spans.output_versions == [3, 3, 4, 4, 4]  # the server's weight_versions spans
    assert spans.finish_reason == "length"
    assert (stop.output_ids, stop.output_versions, stop.finish_reason) == ([11, 2], [0, 0], "stop")
    assert (abort.output_ids, abort.finish_reason) == ([11], "abort")


def test_weight_update_pauses_reloads_from_disk_and_continues(sglang, tmp_path):
    server, engine = sglang
    weights = tmp_path / "weights" / "v000001.safetensors"
    weights.parent.mkdir()
    weights.write_bytes(b"not read by the stub")
    engine.update_weights(str(weights), 1)
    admin = [(k, b) for k, b in server.calls if k not in ("GET /health", "POST /update_weight_version")]
    assert [k for k, _ in admin] == ["POST /pause_generation", "POST /update_weights_from_disk",
                                     "POST /continue_generation"]
    assert admin[0][1] == SHAPES["pause_generation_request"]
    sent = admin[1][1]
    expected = dict(SHAPES["update_weights_from_disk_request"], model_path=sent["model_path"])
    assert sent == expected
    stage = Path(sent["model_path"])
    assert [p.name for p in stage.iterdir()] == ["model.safetensors"]
    assert (stage / "model.safetensors").resolve() == weights.resolve()
    assert engine.version == 1


def test_failed_reload_is_an_error_with_the_server_message(stub_server, model_dir, tmp_path):
    routes = sglang_routes({})
    routes["POST /update_weights_from_disk"] = lambda b, q: (
        400, {"success": False, "message": "shape mismatch", "num_paused_requests": 0})
    server = stub_server(routes)
    engine = SGLangEngine([server.url], config=InferenceServerConfig(), model_path=model_dir)
    try:
        weights = tmp_path / "v000001.safetensors"
        weights.write_bytes(b"x")
        with pytest.raises(EngineError, match="shape mismatch"):
            engine.update_weights(str(weights), 1)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("ignored_aborts", [0, 1])
def test_shutdown_aborts_its_requests_by_id_until_the_server_ends_them(stub_server, model_dir, ignored_aborts):
    """Every abort has the documented body. One that reaches the server before the
    generate call it names is a no-op there (seen with vLLM on a loaded box: the request
    ran to its length), so shutdown sends it again until the request ends."""
    import threading

    release, aborts = threading.Event(), []

    def slow_generate(body, query):
        release.wait(30)
        return 200, SHAPES["generate_response_abort"]

    def abort(body, query):
        aborts.append(body)
        if len(aborts) > ignored_aborts:
            release.set()
        return 200, None

    routes = sglang_routes({})
    routes["POST /generate"] = slow_generate
    routes["POST /abort_request"] = abort
    server = stub_server(routes)
    engine = SGLangEngine([server.url], config=InferenceServerConfig(), model_path=model_dir)
    fut = engine.submit(GenRequest("g0:2", [1, 5], SamplingParams(max_new_tokens=5)))
    deadline = time.monotonic() + 20
    while engine.describe()["inflight"] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    start = time.monotonic()
    engine.shutdown()
    assert len(aborts) > ignored_aborts and all(b == SHAPES["abort_request_one"] for b in aborts)
    assert fut.result(timeout=10).finish_reason == "abort"
    assert time.monotonic() - start < 12  # not the 15 s the shutdown waits at most


def test_parse_rejects_an_unknown_shape():
    with pytest.raises(EngineError, match="unexpected shape"):
        parse_generate({"choices": []}, "http://x")
