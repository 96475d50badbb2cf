"""Expert parallelism in the FSDP2 trainer (``fsdp.expert_parallel_size``, issue 23 item 2):
two gloo ranks on CPU (tests/unit/fsdp_ep_worker.py) against one plain process, fp32.

* EP 2: each rank holds 3 of each MoE layer's 6 experts and the tokens reach them by
  all-to-all; the step's loss and metrics, every gradient (experts, routers, the rest)
  and the weights after the step equal one process's (1e-5). The sharded checkpoint
  restores the step exactly and a rollback loads whole weights into the expert shards.
* DP (EP 1) with the z-loss on equals one process too: the router losses are scaled to
  the step's tokens over all ranks (the sharded actor's ``_aux_weight``).
* EP 2 with routing replay (R3, routes other than the router's own): the tokens go to
  the replayed experts and the step equals one process's R3 step.

The load-balancing loss is off here on purpose. Megatron's (and so Tapioca's)
``E * sum_e f_e * P_e`` is computed per micro-batch from that micro-batch's expert
shares ``f_e`` and mean probabilities ``P_e``: a product of two per-micro-batch
statistics, not a sum over tokens. N ranks cut a step into other micro-batches than one
process does (fsdp_actor.plan_shards), so the loss itself (not its implementation)
differs with the cut, by ~2e-4 of the gradient norm at these sizes (i23m's measure);
the z-loss is a token mean, which no cut changes, and is the router loss tested here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import fsdp_ep_worker as worker  # noqa: E402

from tapioca.config.distributed import FSDPConfig  # noqa: E402
from tapioca.schemas.errors import ConfigError  # noqa: E402
from tapioca.trainers.ppo_actor import PPOActor  # noqa: E402

NOT_COMPARED = {"actor/importance_weight_max_mean", "actor/micro_batches", "actor/step_time_s",
                "actor/tokens_per_s", "actor/fsdp_dummy_micro_batches", "actor/fsdp_world_size",
                # a mean over micro-batches of per-micro-batch losses (see the docstring)
                "actor/moe_aux_loss", "actor/moe_z_loss"}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    from fsdp_worker import run_two_ranks

    return run_two_ranks(worker.__file__, tmp_path_factory.mktemp("ep"))


def one_process(scenario: str):
    torch.set_num_threads(1)
    _, _, overrides = next(s for s in worker.SCENARIOS if s[0] == scenario)
    actor = PPOActor(worker.make_model(), worker.make_cfg(**overrides), temperature=1.0, pad_token_id=0)
    items = worker.make_items(0)
    if overrides.get("router_replay") == "R3":
        items = worker.with_routes(items)
    result = actor.train_step(items, policy_version=0)
    return actor, result


@pytest.mark.parametrize("scenario", ["ep2", "dp", "ep2_r3"])
def test_two_ranks_equal_one_process(two_ranks, scenario):
    results, tensors = two_ranks
    actor, one = one_process(scenario)
    sharded = results[scenario]["metrics"]
    for key, value in one.metrics.items():
        if key not in NOT_COMPARED:
            assert sharded[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    # Each rank holds 3 of each MoE layer's 6 experts: sharded over the expert group (EP 2,
    # replicated over the 1-rank edp dimension), or by FSDP2 (DP).
    assert results[scenario]["local_experts"][0] == 3
    assert results[scenario]["expert_mesh"] == (["edp", "ep"] if scenario.startswith("ep2") else [])
    if scenario == "ep2_r3":  # each replayed id is the router's own + 1: never the same set
        assert sharded["actor/router_replay_agreement"] == 0.0 and sharded["actor/router_replay_tokens"] > 0
    for name, p in actor.model.named_parameters():
        torch.testing.assert_close(tensors[f"{scenario}.grad.{name}"], p.grad, atol=1e-6, rtol=1e-5, msg=name)
    for name, value in actor.model.state_dict().items():
        # Adam divides by sqrt(v): near-zero gradients turn ~1e-8 into ~1e-5 of the step.
        torch.testing.assert_close(tensors[f"{scenario}.w1.{name}"], value, atol=1e-4, rtol=1e-4, msg=name)


def test_expert_parallel_checkpoint_and_rollback(two_ranks):
    results, _ = two_ranks
    assert results["restored_equal"] and results["rollback_equal"]


def test_expert_parallel_size_must_divide_the_ranks_and_the_experts():
    with pytest.raises(ConfigError, match="must be >= 1 and divide fsdp.world_size=4"):
        FSDPConfig(world_size=4, expert_parallel_size=3)
    FSDPConfig(world_size=4, expert_parallel_size=2)
