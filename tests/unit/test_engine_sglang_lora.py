"""SGLangEngine serving LoRA adapters against SGLang 0.5.23's DOCUMENTED shapes (tests/fixtures/
sglang/shapes.json, its ``_about_lora``; a stub server, not SGLang: its CPU engine does not run
here): every version is loaded with ``/load_lora_adapter`` under its versioned name,
``/generate`` names it in ``lora_path``, versions beyond the newest N are unloaded with
``/unload_lora_adapter``, a refused load (HTTP 400, success false) keeps the previous adapter
serving, and a launched LoRA server gets its flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tapioca.config.lora import LoraSpec
from tapioca.config.servers import InferenceServerConfig
from tapioca.engines.base import GenRequest, SamplingParams
from tapioca.engines.server_launch import lora_args
from tapioca.engines.sglang_engine import SGLangEngine
from tapioca.models.lora import LoraAdapter
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


def routes(loaded: dict, refuse: set[str]) -> dict:
    """A stub that keeps the set of loaded adapters as SGLang's registry would."""
    def load(body, query):
        if body["lora_name"] in refuse:
            return 400, SHAPES["load_lora_adapter_response_rank"]
        if body["lora_name"] in loaded:  # SGLang refuses a name that is taken
            return 400, {"success": False, "error_message": f"{body['lora_name']} is already loaded",
                         "loaded_adapters": dict(loaded)}
        loaded[body["lora_name"]] = body["lora_path"]
        return 200, dict(SHAPES["load_lora_adapter_response"], loaded_adapters=dict(loaded))

    def unload(body, query):
        if loaded.pop(body["lora_name"], None) is None:
            return 400, {"success": False, "error_message": f"{body['lora_name']} is not loaded",
                         "loaded_adapters": dict(loaded)}
        return 200, dict(SHAPES["unload_lora_adapter_response"], loaded_adapters=dict(loaded))

    def generate(body, query):
        return 200, SHAPES["generate_response_stop"]

    return {"GET /health": lambda b, q: (200, None), "POST /generate": generate,
            "POST /update_weight_version": ok(SHAPES["update_weight_version_response"]),
            "POST /load_lora_adapter": load, "POST /unload_lora_adapter": unload,
            "POST /abort_request": lambda b, q: (200, None)}


def adapter(tmp_path, v: int) -> LoraAdapter:
    path = tmp_path / f"lora-v{v}"
    path.mkdir(exist_ok=True)
    return LoraAdapter(name=path.name, rank=8, alpha=16.0, target_modules=["q_proj"], path=str(path))


@pytest.fixture
def served(stub_server, model_dir):
    loaded: dict = {}
    refuse: set = set()
    server = stub_server(routes(loaded, refuse))
    engine = SGLangEngine([server.url], config=InferenceServerConfig(health_interval_s=0.2),
                          model_path=model_dir, eos_token_ids=[2], max_loaded_adapters=3)
    yield server, engine, loaded, refuse
    engine.shutdown()


def test_each_version_is_loaded_by_name_and_named_by_requests(served, tmp_path):
    server, engine, loaded, _ = served
    engine.update_adapter(adapter(tmp_path, 3), 3)
    (load,) = [b for k, b in server.calls if k == "POST /load_lora_adapter"]
    assert load == dict(SHAPES["load_lora_adapter_request"], lora_path=str(tmp_path / "lora-v3"))
    (r,) = engine.generate([GenRequest("g0:0", [1, 5, 6], SamplingParams(max_new_tokens=5))])
    sent = [b for k, b in server.calls if k == "POST /generate"][-1]
    assert sent == dict(SHAPES["generate_request"], lora_path=SHAPES["generate_request_lora_path"])
    # Every token is the adapter's version, whatever the server's weight_version label says.
    assert r.output_versions == [3, 3] and engine.version == 3


def test_versions_beyond_the_newest_n_are_unloaded(served, tmp_path):
    server, engine, loaded, _ = served
    for v in range(1, 11):
        engine.update_adapter(adapter(tmp_path, v), v)
        assert len(loaded) <= 3
    assert sorted(loaded) == ["lora-v10", "lora-v8", "lora-v9"]
    unloads = [b for k, b in server.calls if k == "POST /unload_lora_adapter"]
    assert unloads[0] == SHAPES["unload_lora_adapter_request"]  # lora-v1 went first
    assert [u["lora_name"] for u in unloads] == [f"lora-v{v}" for v in range(1, 8)]


def test_a_refused_adapter_keeps_the_previous_one_serving(served, tmp_path):
    server, engine, loaded, refuse = served
    engine.update_adapter(adapter(tmp_path, 1), 1)
    refuse.add("lora-v2")
    with pytest.raises(EngineError, match="lora-v2"):
        engine.update_adapter(adapter(tmp_path, 2), 2)
    assert engine.version == 1 and sorted(loaded) == ["lora-v1"]
    (r,) = engine.generate([GenRequest("g0:1", [1, 5, 6], SamplingParams(max_new_tokens=5))])
    assert [b for k, b in server.calls if k == "POST /generate"][-1]["lora_path"] == "lora-v1"
    assert r.output_versions == [1, 1] and engine.describe()["servers_up"] == 1


def test_a_name_taken_on_the_server_is_freed_and_loaded_again(served, tmp_path):
    # A worker restarted against a server its previous self loaded lora-v5 on (or another run).
    server, engine, loaded, _ = served
    loaded["lora-v5"] = "/an/older/run/lora-v5"
    engine.update_adapter(adapter(tmp_path, 5), 5)
    assert loaded == {"lora-v5": str(tmp_path / "lora-v5")} and engine.version == 5


def test_launch_flags_of_a_lora_server():
    spec = LoraSpec(peft_type="lora", rank=16, alpha=32, target_modules=("all-linear",), name="lora",
                    max_rank=64, max_loaded=6)
    assert lora_args("sglang", spec) == ["--enable-lora", "--max-lora-rank", "64", "--max-loras-per-batch",
                                         "6", "--max-loaded-loras", "6", "--lora-target-modules", "all"]
    assert lora_args("vllm", spec) == ["--enable-lora", "--max-lora-rank", "64", "--max-loras", "6",
                                       "--max-cpu-loras", "6"]
