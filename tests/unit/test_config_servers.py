"""rollout.engine and rollout.server (config/servers.py): defaults, validation, and the
vLLM-specific refusals said up front with their fix."""

from __future__ import annotations

import pytest

from tapioca.config.loader import load_config
from tapioca.config.schema import TrainConfig
from tapioca.schemas.errors import ConfigError

VLLM_TINY = ["rollout.engine=vllm", "model.num_heads=2", "model.num_kv_heads=1",
             "model.tie_word_embeddings=false"]


def test_defaults_are_the_in_process_engine():
    cfg = load_config(TrainConfig)
    assert cfg.rollout.engine == "torch"
    assert cfg.rollout.server.urls == [] and cfg.rollout.server.python == ""


def test_server_urls_and_timeouts_load_from_dotted_overrides():
    cfg = load_config(TrainConfig, None, [
        "rollout.engine=sglang", "rollout.server.urls=[http://a:1,http://b:2]",
        "rollout.server.request_timeout_s=30", "model.path=/m"])
    assert cfg.rollout.server.urls == ["http://a:1", "http://b:2"]
    assert cfg.rollout.server.request_timeout_s == 30.0


@pytest.mark.parametrize("overrides, message", [
    (["rollout.engine=trt"], "use one of torch, vllm, sglang"),
    (["rollout.server.urls=[localhost:8000]"], "give full URLs"),
    (["rollout.server.max_attempts=0"], "max_attempts must be >= 1"),
    (["rollout.server.wait_for_server_s=0"], "wait_for_server_s must be > 0"),
    (["rollout.engine=vllm"], "model.num_heads=2"),
    (["rollout.engine=vllm", "model.num_heads=2", "model.num_kv_heads=1"],
     "model.tie_word_embeddings=false"),
    ([*VLLM_TINY, "gconfig.top_p=0.9"], "set gconfig.top_p=1"),
    ([*VLLM_TINY, "gconfig.top_k=5"], "gconfig.top_k=0"),
])
def test_bad_values_say_how_to_fix_them(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        load_config(TrainConfig, None, overrides)


def test_the_vllm_cpu_demo_overrides_are_accepted():
    cfg = load_config(TrainConfig, "examples/demo_cpu.yaml", VLLM_TINY)
    assert cfg.rollout.engine == "vllm" and not cfg.model.tie_word_embeddings
