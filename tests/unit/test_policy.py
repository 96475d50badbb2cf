"""The policy spec (config/policy.py): resolved once from a dense, an MoE and a
vision-language model directory (config.json written by transformers' own config
classes; no hub access) and from the tiny model's arch, and carried in the sections of
the roles that run the policy."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tapioca.config.loader import load_config
from tapioca.config.lora import lora_spec
from tapioca.config.policy import PolicySpec, policy_of_dir, resolve_policy
from tapioca.config.schema import TrainConfig
from tapioca.config.sections import feeder_section, proxy_section, rollout_section, trainer_section
from tapioca.models.families import MoeShape, VisionSpec, moe_of


def _save(config, path: Path) -> Path:
    config.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from transformers import Qwen2_5_VLConfig, Qwen2Config, Qwen3MoeConfig

    root = tmp_path_factory.mktemp("policies")
    dense = _save(Qwen2Config(vocab_size=1000, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                              num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512),
                  root / "dense")
    # Layers 1 and 3 of 4 are sparse (decoder_sparse_step 2), layer 3 made dense again.
    moe = _save(Qwen3MoeConfig(vocab_size=2000, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                               num_key_value_heads=2, num_experts=16, num_experts_per_tok=4,
                               moe_intermediate_size=32, decoder_sparse_step=2, mlp_only_layers=[3],
                               max_position_embeddings=1024),
                root / "moe")
    vl = _save(Qwen2_5_VLConfig(text_config=dict(vocab_size=3000, hidden_size=64, num_hidden_layers=2,
                                                 num_attention_heads=4, num_key_value_heads=2,
                                                 max_position_embeddings=4096),
                                vision_config=dict(depth=1, hidden_size=32, out_hidden_size=64, patch_size=14,
                                                   spatial_merge_size=2, temporal_patch_size=2),
                                image_token_id=2990, video_token_id=2991, vision_start_token_id=2992,
                                vision_end_token_id=2993),
               root / "vl")
    return dense, moe, vl


def test_a_dense_model_directory(dirs):
    dense, _, _ = dirs
    p = policy_of_dir(str(dense))
    assert p == PolicySpec(known=True, model_type="qwen2", vision=None, moe=None, adapter=None,
                           vocab_size=1000, context_length=512, path=str(dense))


def test_an_moe_model_directory(dirs):
    _, moe, _ = dirs
    p = policy_of_dir(str(moe))
    assert p.model_type == "qwen3_moe" and p.vision is None
    # HF's rule: (i + 1) % decoder_sparse_step == 0 and i not in mlp_only_layers -> layer 1 only.
    assert p.moe == MoeShape(experts=16, top_k=4, layers=(1,), num_layers=4)
    assert (p.vocab_size, p.context_length) == (2000, 1024)


def test_a_vision_language_model_directory(dirs):
    _, _, vl = dirs
    p = policy_of_dir(str(vl))
    assert p.model_type == "qwen2_5_vl" and p.moe is None
    assert p.vision == VisionSpec(model_type="qwen2_5_vl", image_token_id=2990, video_token_id=2991,
                                  vision_start_token_id=2992, vision_end_token_id=2993, merge_size=2,
                                  patch_size=14, temporal_patch_size=2)
    # The decoder's vocabulary and context are its text_config's.
    assert (p.vocab_size, p.context_length) == (3000, 4096)


def test_a_live_config_reads_as_its_directory_does(dirs):
    """models/vision.py's vision_spec (a live model's config) and the directory's reading agree."""
    from transformers import AutoConfig

    from tapioca.models.vision import vision_spec

    for path in dirs:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        assert vision_spec(config) == policy_of_dir(str(path)).vision
        assert moe_of(config.to_dict()) == policy_of_dir(str(path)).moe


def test_the_tiny_arch_before_its_checkpoint():
    vl = resolve_policy(load_config(TrainConfig, None, ["model.arch=qwen3_vl", "train_dataset.type=visual"]))
    assert vl.known and vl.model_type == "qwen3_vl" and vl.moe is None and vl.path == ""
    # The tiny factory's patch sizes; the token ids and the vocabulary come with the tokenizer.
    assert (vl.vision.patch_size, vl.vision.merge_size, vl.vision.image_token_id) == (16, 2, None)
    assert vl.vocab_size is None
    moe = resolve_policy(load_config(TrainConfig, None, ["model.arch=qwen3_moe", "model.num_layers=3",
                                                         "model.num_experts=4", "model.num_experts_per_tok=2"]))
    assert moe.vision is None and moe.moe == MoeShape(experts=4, top_k=2, layers=(0, 1, 2), num_layers=3)
    # model.num_experts is set by default on every arch: a dense family has no experts.
    assert resolve_policy(TrainConfig()).moe is None


def test_the_tiny_arch_agrees_with_the_checkpoint_it_writes(tmp_path):
    """What the arch tells at load is what the written checkpoint says (its token ids aside)."""
    from tapioca.runtime.run import create_tiny_checkpoint

    for arch, extra in (("qwen3_moe", []), ("qwen2_5_vl", ["train_dataset.type=visual"])):
        cfg = load_config(TrainConfig, None, [f"model.arch={arch}", "model.num_experts=4", *extra])
        m = cfg.model
        path = create_tiny_checkpoint(tmp_path / arch, "visual" if extra else "synthetic", arch=arch,
                                      num_layers=m.num_layers, num_experts=m.num_experts,
                                      num_experts_per_tok=m.num_experts_per_tok)
        at_load, written = resolve_policy(cfg), policy_of_dir(str(path))
        assert written.moe == at_load.moe and written.model_type == at_load.model_type
        if at_load.vision is not None:
            assert replace(written.vision, image_token_id=None, video_token_id=None, vision_start_token_id=None,
                           vision_end_token_id=None) == at_load.vision
        else:
            assert written.vision is None


def test_a_model_path_is_read_at_start_not_at_load(dirs):
    _, moe, _ = dirs
    cfg = load_config(TrainConfig, None, [f"model.path={moe}", "actor.lora.enabled=true"])
    at_load = resolve_policy(cfg, read_dir=False)
    assert not at_load.known and at_load.moe is None and at_load.adapter == lora_spec(cfg)
    at_start = resolve_policy(cfg)
    assert at_start.known and at_start.moe is not None and at_start.adapter == lora_spec(cfg)
    assert not policy_of_dir(str(moe.parent / "missing")).known


def test_the_sections_carry_the_policy(dirs):
    _, _, vl = dirs
    cfg = load_config(TrainConfig, None, [f"model.path={vl}"])
    policy = resolve_policy(cfg)
    for cut in (feeder_section, rollout_section, trainer_section, proxy_section):
        assert cut(cfg, policy).policy is policy
    # Without one, what the config alone tells (a test, a direct caller).
    assert trainer_section(cfg).policy == resolve_policy(cfg, read_dir=False)
    assert trainer_section(cfg, policy).lora is None


def test_the_spec_imports_without_torch():
    import subprocess

    code = ("import sys; import tapioca.config.policy, tapioca.config.sections; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
