"""A LoRA adapter trained by the sharded trainer (FSDP2, ``fsdp.world_size`` 2, gloo on the
CPU): the same step as one process (loss, the adapter's gradients, the published adapter),
the frozen base untouched on every shard, a sharded checkpoint of the adapter and its
Adam state only that restores the next step bit for bit, and a rollback of the adapter.

Tolerances as tests/unit/test_fsdp_trainer.py (fp32 both sides): the loss within 1e-6
relative, gradients within 1e-6 + 1e-4 x magnitude, the adapter after Adam within 1e-4.
Two processes run tests/unit/fsdp_lora_worker.py (torchrun's environment on 127.0.0.1).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import fsdp_lora_worker as worker  # noqa: E402
import fsdp_worker as base_worker  # noqa: E402

from tapioca.config.policy import PolicySpec  # noqa: E402
from tapioca.models.lora import adapter_parameter_names, adapter_state_dict  # noqa: E402
from tapioca.trainers.ppo_actor import PPOActor  # noqa: E402


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return base_worker.run_two_ranks(worker.__file__, tmp_path_factory.mktemp("fsdp-lora"))


def test_two_gloo_ranks_train_the_adapter_as_one_process(two_ranks):
    results, tensors = two_ranks
    torch.set_num_threads(1)
    actor = PPOActor(base_worker.make_model(), worker.make_cfg(), temperature=1.0, pad_token_id=0,
                     policy=PolicySpec(adapter=worker.SPEC))
    one = actor.train_step(base_worker.make_items(0), policy_version=0)
    assert results["metrics"]["actor/loss"] == pytest.approx(one.metrics["actor/loss"], rel=1e-6)
    assert results["applied"] == one.applied_minibatches >= 1
    params = dict(actor.model.named_parameters())
    grads = {k[5:] for k in tensors if k.startswith("grad.")}
    assert grads == {n for n, p in params.items() if p.requires_grad}  # the adapter only
    for name in grads:
        torch.testing.assert_close(tensors[f"grad.{name}"], params[name].grad, atol=1e-6, rtol=1e-4)
    own = adapter_state_dict(actor.model)
    assert {k[3:] for k in tensors if k.startswith("a1.")} == set(own)
    for name, value in own.items():
        torch.testing.assert_close(tensors[f"a1.{name}"], value, atol=1e-4, rtol=1e-4)
    assert set(adapter_parameter_names(actor.model).values()) == grads
    assert results["base_unchanged"] and results["base_names"]


def test_sharded_checkpoint_holds_the_adapter_only_and_restores_the_step(two_ranks):
    results, tensors = two_ranks
    for name in [k[3:] for k in tensors if k.startswith("a2.")]:
        assert torch.equal(tensors[f"a2again.{name}"], tensors[f"a2.{name}"]), name
    keys = results["shard_keys"]
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys), model_keys[:4]
    assert any(k.startswith("optim.") for k in keys)
    assert len([f for f in results["files"] if f.endswith(".safetensors")]) == 2  # one per rank


def test_rollback_loads_the_adapter_on_every_rank(two_ranks):
    results, _ = two_ranks
    assert results["rollback_equal"]
