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


# ------------------------------------------------------------- tensor-parallel servers


@pytest.mark.parametrize("overrides, message", [
    (["rollout.server.tensor_parallel_size=2"], "set rollout.engine=vllm or sglang"),
    (["rollout.engine=sglang", "model.path=/m", "rollout.server.tensor_parallel_size=2",
      "rollout.server.urls=[http://a:1]"], "applies to servers Tapioca launches"),
    (["rollout.engine=sglang", "model.path=/m", "rollout.server.tensor_parallel_size=2",
      "rollout.server.extra_args=[--tp-size,4]"], "set one of them"),
    (["rollout.server.tensor_parallel_size=0"], "must be >= 1"),
])
def test_server_tensor_parallel_size_refusals_say_how_to_fix_them(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TrainConfig, None, overrides)


def test_the_launch_commands_carry_the_tensor_parallel_size():
    from tapioca.engines.sglang_engine import sglang_command
    from tapioca.engines.vllm_engine import vllm_command

    v = vllm_command("py", "/m", port=1, dtype="bfloat16", max_num_seqs=8, extra_args=["--x"],
                     tensor_parallel_size=4)
    assert v[v.index("--tensor-parallel-size") + 1] == "4" and v[-1] == "--x"
    s = sglang_command("py", "/m", port=1, dtype="bfloat16", max_num_seqs=8, device="cuda", version=0,
                       extra_args=[], tensor_parallel_size=2)
    assert s[s.index("--tp-size") + 1] == "2"
    assert "--tensor-parallel-size" not in vllm_command("py", "/m", port=1, dtype="bfloat16", max_num_seqs=8,
                                                        extra_args=[])


@pytest.mark.parametrize("device, visible, expected", [
    ("cuda:2", None, "2,3"),  # GPUs K .. K+tp-1
    ("cuda", None, "0,1"),
    ("cuda", "5,6", "5,6"),  # the GPUs the role was given (Ray, the user) stay
])
def test_a_tensor_parallel_server_sees_its_gpus(monkeypatch, device, visible, expected):
    from tapioca.config.servers import InferenceServerConfig
    from tapioca.engines.server_launch import server_env

    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    env = server_env("vllm", device, InferenceServerConfig(tensor_parallel_size=2), threads=1)
    assert env["CUDA_VISIBLE_DEVICES"] == expected


def test_launch_server_starts_the_server_with_the_tensor_parallel_flags(tmp_path):
    """The whole plumbing, config to process: a stand-in for the server's python records
    the command line and the GPUs it was given, then exits (the launch fails, saying so)."""
    from tapioca.config.servers import InferenceServerConfig
    from tapioca.engines.server_launch import launch_server
    from tapioca.schemas.errors import EngineError

    record = tmp_path / "argv.txt"
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\necho "$@" > {record}\necho "gpus=$CUDA_VISIBLE_DEVICES" >> {record}\nexit 3\n')
    fake.chmod(0o755)
    cfg = load_config(TrainConfig, None, ["rollout.engine=vllm", "model.path=/m", "rollout.device=cuda:4",
                                          "rollout.server.tensor_parallel_size=2",
                                          f"rollout.server.python={fake}"]).rollout.server
    assert isinstance(cfg, InferenceServerConfig)
    with pytest.raises(EngineError, match="exited with code 3"):
        launch_server("vllm", cfg, model_path="/m", device="cuda:4", dtype="bfloat16", max_num_seqs=4,
                      log_path=tmp_path / "server.log")
    argv, gpus = record.read_text().splitlines()
    assert "--tensor-parallel-size 2" in argv and "--model /m" in argv
    assert gpus == "gpus=4,5"
