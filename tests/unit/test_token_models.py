"""The models behind the trainer's token-level parts, on real tiny transformers models:
the value model (built from the policy or a directory, zero head), the frozen
reference / teacher log-probs, and the critic's step."""

from __future__ import annotations

import pytest
import torch

from tapioca.config.schema import CriticConfig
from tapioca.models.factory import build_tiny_model
from tapioca.schemas.errors import ConfigError
from tapioca.trainers.batching import SeqItem, to_tensors
from tapioca.trainers.critic import Critic, build_value_model
from tapioca.trainers.reference import FrozenLogprobModel

VOCAB = 16
TINY = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
            max_position_embeddings=64)


def item(out: list[int], mask: list[int] | None = None, prompt=(1, 2, 4)) -> SeqItem:
    n = len(out)
    return SeqItem("g", list(prompt) + out, 3, [-2.0] * n, [0] * n, mask or [1] * n, 0.0, 0.0)


def test_value_model_from_policy_copies_the_backbone_and_starts_at_zero():
    policy = build_tiny_model(VOCAB, seed=3, **TINY)
    rng = torch.get_rng_state()
    vm = build_value_model(policy)
    assert torch.equal(rng, torch.get_rng_state())  # the caller's RNG is untouched
    assert type(vm).__name__ == "Qwen2ForTokenClassification" and vm.config.num_labels == 1
    own = vm.base_model.state_dict()
    for k, v in policy.get_decoder().state_dict().items():
        assert torch.equal(own[k], v)
    assert torch.count_nonzero(vm.score.weight) == 0
    out = vm(input_ids=torch.tensor([[1, 2, 3, 4]])).logits
    assert out.shape == (1, 4, 1) and torch.count_nonzero(out) == 0
    # init_critic_from_actor=False: a random backbone of the same shape.
    fresh = build_value_model(policy, init_from_policy=False)
    assert any(not torch.equal(fresh.base_model.state_dict()[k], v) for k, v in own.items())


def test_value_model_from_a_directory(tmp_path):
    src = build_tiny_model(VOCAB, seed=5, **TINY)
    src.save_pretrained(tmp_path / "m")
    vm = build_value_model(path=str(tmp_path / "m"))
    for k, v in src.get_decoder().state_dict().items():
        assert torch.equal(vm.base_model.state_dict()[k], v)
    assert torch.count_nonzero(vm.score.weight) == 0
    with pytest.raises(ConfigError, match="config.json"):
        build_value_model(path=str(tmp_path / "missing"))


def test_frozen_logprobs_match_full_logits_and_ignore_gradients(tmp_path):
    policy = build_tiny_model(VOCAB, seed=1, **TINY)
    ref = FrozenLogprobModel.copy_of(policy, temperature=0.7)
    # A copy: training the policy later must not move it.
    assert ref.model is not policy and all(not p.requires_grad for p in ref.model.parameters())
    items = [item([5, 6, 7]), item([8, 9], mask=[1, 0])]
    batch = to_tensors(items, 0, "cpu")
    lp = ref.logprobs(batch)
    assert lp.shape == batch.labels_BT.shape and not lp.requires_grad
    with torch.no_grad():
        logits = policy(input_ids=batch.input_ids_BT, attention_mask=batch.attention_mask_BT).logits
    full = torch.log_softmax(logits[:, :-1].float() / 0.7, dim=-1)
    for b, it in enumerate(items):
        for j, tok in enumerate(it.input_ids[3:]):
            assert lp[b, 2 + j].item() == pytest.approx(full[b, 2 + j, tok].item(), abs=1e-5)
    # From a directory, with a vocabulary check.
    policy.save_pretrained(tmp_path / "p")
    same = FrozenLogprobModel.from_path(tmp_path / "p", vocab_size=VOCAB, temperature=0.7)
    assert torch.allclose(same.logprobs(batch), lp, atol=1e-6)
    with pytest.raises(ConfigError, match="vocab_size"):
        FrozenLogprobModel.from_path(tmp_path / "p", vocab_size=VOCAB + 1, temperature=1.0)


def test_critic_step_needs_values_and_returns_and_fits_them():
    critic = Critic(build_value_model(build_tiny_model(VOCAB, seed=2, **TINY)),
                    CriticConfig(lr=1e-2, eps_clip=10.0), pad_token_id=0)
    # Different prompts: with a shared prefix the first states would be the same state
    # with targets +1 and -1, a floor of 0.5 on those tokens.
    items = [item([5, 6, 7]), item([8, 9, 10], prompt=(3, 11, 12))]
    with pytest.raises(ValueError, match="no values/returns"):
        critic.train_step(items)
    for it, target in zip(items, (1.0, -1.0)):
        it.token_values = [0.0] * 3
        it.token_returns = [target] * 3
    losses = []
    for _ in range(15):
        m = critic.train_step(items)
        losses.append(m["critic/value_loss"])
        for it in items:  # the targets stay, the "old" values follow the critic
            it.token_values = critic.values(to_tensors([it], 0, "cpu"))[0, 2:5].tolist()
    # First loss: V = 0, targets +-1: 0.5 * 1 = 0.5.
    assert losses[0] == pytest.approx(0.5, abs=1e-6)
    assert losses[-1] < 0.1 * losses[0], losses
    assert m["critic/trained_tokens"] == 6.0
