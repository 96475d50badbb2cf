"""The trainer of a LoRA run (``actor.lora.enabled``) as a plain function of events, on a real tiny
model saved to disk (its ``model.path``, the base every reader must share): only the
adapter trains (the base's checksums are equal at the end); each version's weights event
names a PEFT adapter directory whose sha256 covers its two files, and the base's identity;
the packed path (with gradient checkpointing) trains the adapter as the padded HF forward
does; checkpoints hold the adapter and its optimizer state only and resume exactly; a
rollback restores an earlier adapter; the KL reference is the base with the adapter off;
``final/`` is a PEFT adapter that peft loads and ``merge_lora`` merges into a model with
the same logits. The bytes an adapter version carries at real shapes are <= 2% of the
model's. No broker."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).parent))
from test_role_trainer import B, sample, src  # noqa: E402

from tapioca.config.loader import load_config  # noqa: E402
from tapioca.config.lora import LoraConfig, LoraSpec  # noqa: E402
from tapioca.config.optimizer import OptimizerConfig  # noqa: E402
from tapioca.config.policy import PolicySpec  # noqa: E402
from tapioca.config.schema import ActorConfig, ModelConfig, TrainConfig  # noqa: E402
from tapioca.config.sections import TrainerSection  # noqa: E402
from tapioca.models.factory import load_model_and_tokenizer, save_tiny_checkpoint  # noqa: E402
from tapioca.models.lora import (  # noqa: E402
    ADAPTER_CONFIG_FILE,
    ADAPTER_MODEL_FILE,
    adapter_state_dict,
    apply_lora,
    base_state_dict,
)
from tapioca.runtime.builders import build_token_models  # noqa: E402
from tapioca.schemas.errors import ConfigError  # noqa: E402
from tapioca.schemas.events import ControlEvent, WeightsEvent  # noqa: E402
from tapioca.trainers.batching import flatten_groups  # noqa: E402
from tapioca.trainers.checkpoint import CheckpointFormatError  # noqa: E402
from tapioca.trainers.ppo_actor import PPOActor  # noqa: E402
from tapioca.trainers.trainer import Trainer  # noqa: E402
from tapioca.weights.adapter_files import adapter_sha256  # noqa: E402
from tapioca.weights.base_id import base_identity  # noqa: E402

RANK, ALPHA = 4, 8
SPEC = LoraSpec(peft_type="lora", rank=RANK, alpha=ALPHA, target_modules=("all-linear",), name="lora",
                max_rank=64, max_loaded=3)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("base") / "model"
    return str(save_tiny_checkpoint(d, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                    intermediate_size=64, tie_word_embeddings=False))


def actor_cfg(**kw) -> ActorConfig:
    return ActorConfig(optimizer=OptimizerConfig(lr=1e-2), lora=LoraConfig(enabled=True, rank=RANK, alpha=ALPHA), **kw)


def make_actor(model_path: str, **kw) -> PPOActor:
    model, _ = load_model_and_tokenizer(model_path)
    return PPOActor(model, actor_cfg(**kw), temperature=1.0, pad_token_id=0,
                    policy=PolicySpec(adapter=SPEC))


def make_trainer(model_path: str, run_dir: Path, *, steps: int = 100, **kw) -> Trainer:
    actor = make_actor(model_path, **kw)
    sec = TrainerSection(actor=actor.cfg, model=ModelConfig(path=model_path), max_head_offpolicyness=1,
                         prompts_per_step=B, total_train_steps=steps, temperature=1.0,
                         run_dir=str(run_dir), seed=0, stop_at_reward=None,
                         policy=PolicySpec(adapter=SPEC))
    return Trainer(sec, actor=actor, **build_token_models(sec, actor))


def run_steps(t: Trainer, state, n: int, start: int = 0) -> list:
    """``n`` steps of B fresh groups (min_version = the trainer's version: never stale)."""
    out = []
    for i in range(start, start + n * B):
        out += list(t.handle(sample(f"g{i}", min_version=state.progress.version), state, src(i)))
    return out


def clone(sd: dict) -> dict:
    return {k: v.detach().clone() for k, v in sd.items()}


def test_only_the_adapter_trains_and_the_base_stays_bit_for_bit(model_path, tmp_path):
    t = make_trainer(model_path, tmp_path)
    state = t.init_state()
    base0, adapter0 = clone(base_state_dict(t.actor.model)), clone(adapter_state_dict(t.actor.model))
    trainable = [p for group in t.actor.optimizer.param_groups for p in group["params"]]
    assert len(trainable) == len(adapter0) == 2 * 7  # A and B of q/k/v/o/gate/up/down
    run_steps(t, state, 3)
    assert state.progress.version == 3
    base3, adapter3 = base_state_dict(t.actor.model), adapter_state_dict(t.actor.model)
    assert set(base3) == set(base0) and all(torch.equal(base0[k], v) for k, v in base3.items())
    assert any(not torch.equal(adapter0[k], v) for k, v in adapter3.items())
    t.sink.close()


def test_weights_events_name_a_peft_adapter_directory_and_the_base(model_path, tmp_path):
    t = make_trainer(model_path, tmp_path)
    state = t.init_state()
    (hello,) = [e for e in t.on_tick(state, 0.0) if isinstance(e, WeightsEvent)]
    (w,) = [e for e in run_steps(t, state, 1) if isinstance(e, WeightsEvent)]
    for event, v in ((hello, 0), (w, 1)):
        d = Path(event.path)
        assert d.name == f"lora-v{v}" and d.is_dir() and event.version == v
        assert sorted(p.name for p in d.iterdir()) == [ADAPTER_CONFIG_FILE, ADAPTER_MODEL_FILE]
        assert adapter_sha256(d) == event.sha256
        a = event.adapter
        assert (a.name, a.rank, a.alpha, a.peft_type) == (f"lora-v{v}", RANK, ALPHA, "lora")
        assert a.target_modules == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
        assert a.base_id == base_identity(model_path)
    doc = json.loads((Path(w.path) / ADAPTER_CONFIG_FILE).read_text())
    assert (doc["r"], doc["lora_alpha"], doc["peft_type"], doc["base_model_name_or_path"]) == (
        RANK, ALPHA, "LORA", model_path)
    with safe_open(str(Path(w.path) / ADAPTER_MODEL_FILE), framework="pt") as f:
        names = set(f.keys())
        own = adapter_state_dict(t.actor.model)
        assert names == set(own)  # the adapter only: no base tensor
        assert all(torch.equal(f.get_tensor(k), own[k]) for k in names)
    t.sink.close()


def test_packed_path_with_gradient_checkpointing_trains_the_adapter_as_the_hf_forward(model_path):
    items = flatten_groups([sample(f"g{i}") for i in range(3)])
    after = {}
    for name, kw in (("packed", {}), ("ckpt", {"gradient_checkpointing": True}),
                     ("padded", {"packed_sequences": False})):
        torch.manual_seed(0)
        actor = make_actor(model_path, **kw)
        actor.train_step(items, policy_version=0)
        after[name] = clone(adapter_state_dict(actor.model))
    for name in ("ckpt", "padded"):
        for k, v in after["packed"].items():
            torch.testing.assert_close(after[name][k], v, atol=1e-5, rtol=1e-4, msg=f"{name} {k}")
    assert any(v.abs().sum() > 0 for k, v in after["packed"].items() if "lora_B" in k)


def test_recompute_swiglu_is_refused_with_lora():
    with pytest.raises(ConfigError, match="recompute_swiglu"):
        actor_cfg(recompute_swiglu=True)


def test_checkpoint_holds_the_adapter_and_its_optimizer_only_and_resumes(model_path, tmp_path):
    t = make_trainer(model_path, tmp_path)
    state = t.init_state()
    run_steps(t, state, 2)
    with safe_open(str(t.checkpoints.path), framework="pt") as f:
        keys = list(f.keys())
    model_keys = [k for k in keys if k.startswith("model/")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys)
    assert len(model_keys) == 14 and any(k.startswith("optimizer/") for k in keys)
    adapter, opt = clone(adapter_state_dict(t.actor.model)), t.actor.optimizer.state_dict()
    t2 = make_trainer(model_path, tmp_path)
    state2 = t2.init_state()
    assert state2.progress.version == 2
    assert all(torch.equal(adapter[k], v) for k, v in adapter_state_dict(t2.actor.model).items())
    opt2 = t2.actor.optimizer.state_dict()
    for i, st in opt["state"].items():
        assert torch.equal(st["exp_avg"], opt2["state"][i]["exp_avg"])
    # The next step of the resumed trainer equals the next step of the first one.
    run_steps(t, state, 1, start=100)
    run_steps(t2, state2, 1, start=100)
    for k, v in adapter_state_dict(t.actor.model).items():
        assert torch.equal(adapter_state_dict(t2.actor.model)[k], v), k
    t.sink.close()
    t2.sink.close()


def test_a_full_weights_checkpoint_is_refused_by_a_lora_run(model_path, tmp_path):
    from tapioca.trainers.checkpoint import TrainerProgress

    model, _ = load_model_and_tokenizer(model_path)
    full = PPOActor(model, ActorConfig(), temperature=1.0, pad_token_id=0)
    full.save_checkpoint(tmp_path / "ckpt.safetensors", TrainerProgress(version=3))
    with pytest.raises(CheckpointFormatError, match="actor.lora.enabled"):
        make_actor(model_path).load_checkpoint(tmp_path / "ckpt.safetensors")


def test_rollback_restores_an_earlier_adapter_as_a_new_version(model_path, tmp_path):
    t = make_trainer(model_path, tmp_path)
    state = t.init_state()
    list(t.on_tick(state, 0.0))
    (w1,) = [e for e in run_steps(t, state, 1) if isinstance(e, WeightsEvent)]
    v1 = clone(adapter_state_dict(t.actor.model))
    run_steps(t, state, 2, start=10)
    cmd = ControlEvent(command_id="c1", command="rollback", target="trainer",
                       args={"version": 1, "sha256": w1.sha256})
    ok, message, out = t.on_control(cmd, state)
    assert ok, message
    (w,) = [e for e in out if isinstance(e, WeightsEvent)]
    assert w.version == 4 and w.rollback_of == 1 and w.adapter.name == "lora-v4"
    assert all(torch.equal(v1[k], v) for k, v in adapter_state_dict(t.actor.model).items())
    assert not t.actor.optimizer.state  # Adam restarted
    t.sink.close()


def test_kl_reference_is_the_base_with_the_adapter_off(model_path, tmp_path):
    t = make_trainer(model_path, tmp_path, kl_ctl=0.1)
    state = t.init_state()
    run_steps(t, state, 2)  # the adapter is no longer zero
    ref = t.token_adv.reference
    assert type(ref).__name__ == "AdapterOffReference" and ref.model is t.actor.model
    base_bytes = sum(v.numel() * v.element_size() for v in base_state_dict(t.actor.model).values())
    assert ref.saved_bytes == base_bytes  # what a copy would have cost
    from tapioca.trainers.batching import to_tensors

    batch = to_tensors(flatten_groups([sample("r0"), sample("r1")]), 0, "cpu")
    base, _ = load_model_and_tokenizer(model_path)
    from tapioca.models.forward import causal_token_logprobs

    with torch.no_grad():
        want, _ = causal_token_logprobs(base.eval(), batch.input_ids_BT, batch.attention_mask_BT,
                                        batch.labels_BT, temperature=1.0, chunk_tokens=4096)
        with_adapter, _ = causal_token_logprobs(t.actor.model, batch.input_ids_BT, batch.attention_mask_BT,
                                                batch.labels_BT, temperature=1.0, chunk_tokens=4096)
    got = ref.logprobs(batch)
    torch.testing.assert_close(got, want.float(), atol=1e-6, rtol=0)
    assert (with_adapter - want).abs().max() > 1e-4  # the policy itself is not the base
    assert all(p.requires_grad for k, p in t.actor.model.named_parameters() if "lora_" in k)
    t.sink.close()


def test_final_is_a_peft_adapter_and_lora_merge_gives_the_same_logits(model_path, tmp_path):
    from peft import PeftModel

    from tapioca.trainers.final_model import merge_lora

    t = make_trainer(model_path, tmp_path, steps=2)
    state = t.init_state()
    run_steps(t, state, 2)
    assert state.done
    t.on_stop(state)
    final = tmp_path / "final"
    assert sorted(p.name for p in final.iterdir()) == [ADAPTER_CONFIG_FILE, ADAPTER_MODEL_FILE]
    ids = torch.tensor([[1, 2, 4, 3, 8, 13]])
    with torch.no_grad():
        want = t.actor.model.eval()(input_ids=ids).logits
        base, _ = load_model_and_tokenizer(model_path)
        peft_logits = PeftModel.from_pretrained(base, final).eval()(input_ids=ids).logits
    torch.testing.assert_close(peft_logits, want, atol=1e-5, rtol=0)
    merged_dir = merge_lora(final, tmp_path / "merged")
    merged, tok = load_model_and_tokenizer(merged_dir)
    assert tok is not None and not any("lora" in k for k in merged.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(merged.eval()(input_ids=ids).logits, want, atol=1e-5, rtol=0)


def _ratio(config, rank: int) -> float:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    full = sum(p.numel() for p in model.state_dict().values()) - (
        model.lm_head.weight.numel() if config.tie_word_embeddings else 0)
    apply_lora(model, rank=rank, alpha=rank, target_modules=["all-linear"])
    return sum(v.numel() for v in adapter_state_dict(model).values()) / full


def test_an_adapter_version_is_at_most_2_percent_of_the_model_at_real_shapes():
    from transformers import Qwen2Config

    # Qwen2-7B, r 16 on every linear layer: 40.4M of 7.6B parameters (0.53%; the issue's
    # 77 MiB in bf16). Qwen2-0.5B, r 16: 8.8M of 494M (1.78%, the embedding dominates).
    q7 = Qwen2Config(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                     num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)
    q05 = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                      num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
    r7, r05 = _ratio(q7, 16), _ratio(q05, 16)
    assert r7 == pytest.approx(40_370_176 / 7_615_616_512, rel=1e-6) and r7 < 0.02
    assert r05 < 0.02


def test_config_refuses_what_a_lora_run_cannot_do():
    base = ["actor.lora.enabled=true"]
    with pytest.raises(ConfigError, match="actor.lora.rank=128 is above rollout.server.max_lora_rank"):
        load_config(TrainConfig, None, base + ["actor.lora.rank=128"])
    with pytest.raises(ConfigError, match="gae"):
        load_config(TrainConfig, None, base + ["advantage.estimator=gae"])
    with pytest.raises(ConfigError, match="max_loaded_loras"):
        load_config(TrainConfig, None, base + ["rollout.server.max_loaded_loras=2",
                                               "rollout.max_head_offpolicyness=2"])
    with pytest.raises(ConfigError, match="lora_name"):
        load_config(TrainConfig, None, base + ["gconfig.lora_name=a/b"])
    # Combinations not built for adapters yet: each refused at load, with the way out.
    with pytest.raises(ConfigError, match="tensor_parallel_size=1"):
        load_config(TrainConfig, None, base + ["fsdp.world_size=2", "fsdp.tensor_parallel_size=2"])
    with pytest.raises(ConfigError, match="enable_tree_training=false"):
        load_config(TrainConfig, None, base + ["actor.enable_tree_training=true"])
    with pytest.raises(ConfigError, match="vision-language"):
        load_config(TrainConfig, None, base + ["model.arch=qwen2_5_vl"])
    cfg = load_config(TrainConfig, None, base)
    from tapioca.config.sections import rollout_section, trainer_section

    assert trainer_section(cfg).lora == rollout_section(cfg).lora == LoraSpec(
        peft_type="lora", rank=32, alpha=16, target_modules=("all-linear",), name="lora", max_rank=64,
        max_loaded=cfg.rollout.max_head_offpolicyness + 2)
    assert trainer_section(replace(cfg, actor=replace(cfg.actor, lora=LoraConfig()))).lora is None


def test_tapioca_lora_merge_writes_the_merged_model_of_a_run(model_path, tmp_path):
    from typer.testing import CliRunner

    from tapioca.ops.cli import app

    run = tmp_path / "run"
    t = make_trainer(model_path, run, steps=1)
    state = t.init_state()
    run_steps(t, state, 1)
    t.on_stop(state)
    (run / "config.yaml").write_text(f"model:\n  path: {model_path}\n")
    out = tmp_path / "merged"
    result = CliRunner().invoke(app, ["lora-merge", str(run), str(out), "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    merged, _ = load_model_and_tokenizer(out)
    ids = torch.tensor([[1, 2, 4, 3]])
    with torch.no_grad():
        torch.testing.assert_close(merged.eval()(input_ids=ids).logits, t.actor.model.eval()(input_ids=ids).logits,
                                   atol=1e-5, rtol=0)
    # A run without a LoRA final/ is refused with what to do.
    result = CliRunner().invoke(app, ["lora-merge", str(tmp_path / "nothing"), str(tmp_path / "x")])
    assert result.exit_code != 0 and "not a PEFT adapter" in str(result.exception)


@pytest.mark.parametrize("name", ["demo_cpu_lora.yaml", "gsm8k_grpo_lora.yaml"])
def test_the_lora_examples_are_valid_configs(name):
    cfg = load_config(TrainConfig, Path(__file__).resolve().parents[2] / "examples" / "lora" / name, [])
    assert cfg.actor.lora.enabled and cfg.actor.lora.target_modules == ["all-linear"]
    if name.startswith("demo"):  # the CPU demo's base: an untied head the adapter can steer
        assert not cfg.model.tie_word_embeddings and cfg.model.lm_head_init_std == 0.1 and not cfg.model.path
    else:
        assert cfg.model.path and cfg.gconfig.lora_name == "lora-gsm8k"
