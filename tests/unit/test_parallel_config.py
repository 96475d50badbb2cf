"""The trainer's device mesh in the config (config/distributed.py): fsdp.tensor_parallel_size
/ context_parallel_size, AReaL's allocation string (actor.backend), the refusals with their
fix; and the packing of a micro-batch for tp x cp ranks (trainers/packing.py). No ranks."""

from __future__ import annotations

import pytest
import torch

from tapioca.config.distributed import FSDPConfig, parse_allocation
from tapioca.config.loader import load_config
from tapioca.config.schema import TrainConfig
from tapioca.schemas.errors import ConfigError
from tapioca.trainers.batching import SeqItem
from tapioca.trainers.packing import to_packed


@pytest.mark.parametrize("spec, dims", [
    ("fsdp:d2t2c2", (2, 2, 2)),
    ("fsdp:d4", (4, 1, 1)),
    ("fsdp:t2d2", (2, 2, 1)),  # any order
    ("fsdp[actor]:d2 c4", (2, 1, 4)),  # a name and spaces, as AReaL's grammar allows
    ("fsdp:d1p1e1t8", (1, 8, 1)),  # p1 / e1: no pipeline or expert parallelism
])
def test_allocation_strings_parse_as_areal_does(spec, dims):
    a = parse_allocation(spec)
    assert (a.dp, a.tp, a.cp) == dims
    assert a.world_size == dims[0] * dims[1] * dims[2]


@pytest.mark.parametrize("spec, message", [
    ("megatron:d2t2", "FSDP2 only"),
    ("fsdp:d2p2", "no pipeline parallelism"),
    ("fsdp:d2e2", "no expert parallelism"),
    ("fsdp:d0", "bad dimensions"),
    ("fsdp:x2", "unknown dimension"),
    ("d2t2", "not an allocation string"),
    ("sglang:d4t2+fsdp:d8", "rollout.server.tensor_parallel_size"),
])
def test_bad_allocation_strings_say_what_to_write(spec, message):
    with pytest.raises(ConfigError, match=message):
        parse_allocation(spec)


def test_actor_backend_fills_the_fsdp_section():
    cfg = load_config(TrainConfig, None, ["actor.backend=fsdp:d2t2c2"])
    assert (cfg.fsdp.world_size, cfg.fsdp.tp, cfg.fsdp.cp, cfg.fsdp.dp) == (8, 2, 2, 2)
    # The same mesh spelt both ways is fine; a different one is refused.
    same = load_config(TrainConfig, None, ["actor.backend=fsdp:d2t2", "fsdp.world_size=4"])
    assert same.fsdp.tp == 2
    with pytest.raises(ConfigError, match="fsdp.world_size=4 is set too"):
        load_config(TrainConfig, None, ["actor.backend=fsdp:d2t2c2", "fsdp.world_size=4"])


def test_a_written_config_loads_back_to_the_same_mesh(tmp_path):
    from tapioca.config.loader import to_yaml

    cfg = load_config(TrainConfig, None, ["actor.backend=fsdp:d1t2c2"])
    path = tmp_path / "c.yaml"
    path.write_text(to_yaml(cfg))
    again = load_config(TrainConfig, path)
    assert again.fsdp == cfg.fsdp


@pytest.mark.parametrize("overrides, message", [
    (["fsdp.world_size=6", "fsdp.tensor_parallel_size=4"], "not dp x tp x cp"),
    (["fsdp.world_size=2", "fsdp.context_parallel_size=2", "actor.packed_sequences=false"],
     "set actor.packed_sequences=true"),
    (["fsdp.world_size=2", "fsdp.tensor_parallel_size=2", "actor.liger_kernels=true"],
     "actor.liger_kernels does not apply"),
    (["fsdp.world_size=2", "fsdp.tensor_parallel_size=2", "actor.logprob_kernel=triton"],
     "set actor.logprob_kernel=auto"),
    (["fsdp.world_size=2", "fsdp.tensor_parallel_size=2", "actor.recompute_swiglu=true"],
     "actor.recompute_swiglu=false"),
    (["fsdp.world_size=2", "fsdp.context_parallel_size=2", "actor.compile_layers=true"],
     "set compile_layers=false"),
    # The tiny model: 4 heads, 2 kv heads, intermediate 256.
    (["fsdp.world_size=4", "fsdp.tensor_parallel_size=4"], "2 key/value heads, not divisible"),
    (["fsdp.world_size=8", "fsdp.tensor_parallel_size=2", "fsdp.context_parallel_size=4"],
     "4 attention heads, not divisible by tensor_parallel_size x context_parallel_size = 8"),
    (["fsdp.world_size=2", "fsdp.tensor_parallel_size=2", "model.intermediate_size=255"],
     "255 intermediate_size"),
])
def test_meshes_the_model_or_the_switches_cannot_take_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TrainConfig, None, overrides)


def test_switches_that_apply_under_parallelism_are_accepted():
    cfg = load_config(TrainConfig, None, [
        "fsdp.world_size=4", "fsdp.tensor_parallel_size=2", "fsdp.context_parallel_size=2",
        "actor.gradient_checkpointing=true", "actor.logprob_kernel=auto"])
    assert cfg.fsdp.dp == 1
    # liger and the Triton logprob kernel apply under cp alone (tp 1).
    load_config(TrainConfig, None, ["fsdp.world_size=2", "fsdp.context_parallel_size=2",
                                    "actor.liger_kernels=true", "actor.logprob_kernel=triton"])


def test_the_model_of_a_directory_is_checked_when_the_trainer_loads_it():
    from tapioca.models.factory import build_tiny_model
    from tapioca.models.parallel_check import check_parallel_model

    model = build_tiny_model(15, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64)
    with pytest.raises(ConfigError, match="15 vocabulary, not divisible by fsdp.tensor_parallel_size=2"):
        check_parallel_model(model, FSDPConfig(world_size=2, tensor_parallel_size=2))
    check_parallel_model(model, FSDPConfig(world_size=2, context_parallel_size=2))  # cp: any vocabulary


def _items(lengths: list[int], prompt: int = 2) -> list[SeqItem]:
    out = []
    for i, n in enumerate(lengths):
        k = n - prompt
        out.append(SeqItem(group_id=f"g{i}", input_ids=list(range(1, n + 1)), prompt_len=prompt,
                           behav_logprobs=[-1.0] * k, versions=[0] * k, loss_mask=[1] * k,
                           advantage=1.0, reward=0.0))
    return out


def test_packing_for_tp_x_cp_pads_the_stream_and_splits_it_evenly():
    """7 + 5 + 6 = 18 tokens for tp 2 x cp 4: padded to 24 with one pad sequence of 6, so
    each cp rank holds 6 tokens (each tp rank 3 of them). Scored rows (packed position
    predicting an output token): seq 0 at 1..5, seq 1 at 8..10, seq 2 at 13..16; cp
    slices [0,6) [6,12) [12,18) [18,24) hold 5, 3, 4 and 0 of them: cp_rows 0,5,8,12,12."""
    items = _items([7, 5, 6])
    plain = to_packed(items, "cpu")
    batch = to_packed(items, "cpu", pad_to=8, cp=4)
    assert batch.input_ids_N.numel() == 24
    assert batch.seqs.lengths == (7, 5, 6, 6)
    assert batch.position_ids_N[18:].tolist() == list(range(6))
    assert batch.input_ids_N[:18].tolist() == plain.input_ids_N.tolist()
    assert batch.rows_M.tolist() == plain.rows_M.tolist() == [1, 2, 3, 4, 5, 8, 9, 10, 13, 14, 15, 16]
    assert batch.cp_rows == (0, 5, 8, 12, 12)
    # The loss's [B, T-1] tensors are those of the unpadded batch.
    for name in ("labels_BT", "mask_BT", "advantages_BT", "behav_logprobs_BT"):
        assert torch.equal(getattr(batch, name), getattr(plain, name)), name


def test_packing_a_stream_that_already_splits_adds_nothing():
    batch = to_packed(_items([6, 6]), "cpu", pad_to=4, cp=2)
    assert batch.seqs.lengths == (6, 6)
    assert batch.cp_rows == (0, 4, 8)


def test_a_mixture_of_experts_model_is_refused_under_tp_and_cp():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tapioca.models.parallel_check import check_parallel_model

    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=16, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2))
    for fsdp in (FSDPConfig(world_size=2, tensor_parallel_size=2), FSDPConfig(world_size=2, context_parallel_size=2)):
        with pytest.raises(ConfigError, match="mixture of experts.*train it data parallel"):
            check_parallel_model(model, fsdp)
