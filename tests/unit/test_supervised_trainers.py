"""Supervised trainers (SFT, DPO, reward model, distillation): data sources, configs, the
shared loop (weights + sha256, checkpoints, resume, metrics), the CLI, and short CPU
learning checks on the tiny model and the synthetic task (no broker: see
tests/integration/test_supervised_from_logs.py for the topic and archive sources)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tapioca.config.loader import load_config
from tapioca.config.supervised import (
    DistillConfig,
    DPOConfig,
    RewardModelConfig,
    SFTConfig,
    SupervisedDatasetConfig,
)
from tapioca.models.factory import load_model_and_tokenizer
from tapioca.runtime.run import create_tiny_checkpoint, resolve_run
from tapioca.schemas.errors import ConfigError, TapiocaError
from tapioca.schemas.events import RewardEvent, TrajectoryEvent
from tapioca.trainers.supervised.data import (
    ChatEncoder,
    DataStats,
    load_pair_examples,
    load_sft_examples,
    logged_groups,
    pair_examples_from_groups,
    sft_examples_from_groups,
)
from tapioca.trainers.supervised.loop import setup_supervised
from tapioca.weights.files import sha256_file

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return create_tiny_checkpoint(tmp_path_factory.mktemp("supervised") / "model")


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return load_model_and_tokenizer(tiny)[1]


@pytest.fixture(autouse=True)
def _no_broker(monkeypatch):
    # BusConfig falls back to $TAPIOCA_BOOTSTRAP: these tests must not publish.
    monkeypatch.delenv("TAPIOCA_BOOTSTRAP", raising=False)


def _cfg(cls, tiny, tmp_path, *overrides):
    """A resolved supervised run (as the CLI resolves it before training)."""
    return resolve_run(load_config(cls, None, [f"model.path={tiny}", f"run_dir={tmp_path}",
                                               "trial_name=t", "actor.torch_threads=1",
                                               *overrides]), prepare=True)


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ----------------------------------------------------------------------------- data


def test_chat_rows_train_only_the_assistant_turn(tokenizer, tmp_path):
    # The char tokenizer's template: <bos> + user text, then the answer + <eos>.
    rows = tmp_path / "sft.jsonl"
    rows.write_text(json.dumps({"messages": [{"role": "user", "content": "max(2,3)="},
                                             {"role": "assistant", "content": "3"}]}) + "\n"
                    + json.dumps({"prompt": "min(4,1)=", "answer": "1"}) + "\n")
    ds = SupervisedDatasetConfig(source="file", path=str(rows))
    examples, stats = load_sft_examples(ds, tokenizer)
    assert examples[0].prompt_ids == [tokenizer.bos_token_id] + _ids(tokenizer, "max(2,3)=")
    assert examples[0].response_ids == _ids(tokenizer, "3") + [tokenizer.eos_token_id]
    assert examples[0].response_mask == [1, 1]
    assert examples[1].response_ids == _ids(tokenizer, "1") + [tokenizer.eos_token_id]
    assert stats.counts["examples"] == 2


def test_plain_join_without_chat_template(tokenizer):
    template = tokenizer.chat_template
    tokenizer.chat_template = None
    try:
        prompt, response = ChatEncoder(tokenizer).encode(
            [{"role": "user", "content": "1+2="}, {"role": "user", "content": "3"}],
            [{"role": "assistant", "content": "4"}])
    finally:
        tokenizer.chat_template = template
    assert prompt == _ids(tokenizer, "1+2=\n3")
    assert response == _ids(tokenizer, "4") + [tokenizer.eos_token_id]


def test_generation_prompt_stays_in_the_prompt(tokenizer):
    # A ChatML-like template whose generation prompt is text (here one space, standing in
    # for "<|im_start|>assistant\n"): it belongs to the prompt, not to the trained response.
    template = tokenizer.chat_template
    tokenizer.chat_template = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %} {{ m['content'] }}"
        "{{ eos_token }}{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %} {% endif %}")
    try:
        prompt, response = ChatEncoder(tokenizer).encode([{"role": "user", "content": "max(2,3)="}],
                                                         [{"role": "assistant", "content": "3"}])
        tokenizer.chat_template += "x"  # a prompt that is not a prefix of the conversation
        with pytest.raises(TapiocaError, match="prefix"):
            ChatEncoder(tokenizer).encode([{"role": "user", "content": "1"}],
                                          [{"role": "assistant", "content": "2"}])
    finally:
        tokenizer.chat_template = template
    assert prompt == [tokenizer.bos_token_id] + _ids(tokenizer, "max(2,3)= ")
    assert response == _ids(tokenizer, "3") + [tokenizer.eos_token_id]


def test_bad_rows_name_the_row_and_the_fix(tokenizer, tmp_path):
    rows = tmp_path / "bad.jsonl"
    rows.write_text(json.dumps({"question": "x"}) + "\n")
    with pytest.raises(ConfigError, match="row 0.*prompt_key"):
        load_sft_examples(SupervisedDatasetConfig(source="file", path=str(rows)), tokenizer)
    with pytest.raises(ConfigError, match="preference row 0 lacks"):
        load_pair_examples(SupervisedDatasetConfig(source="file", path=str(rows)), tokenizer)
    rows.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ConfigError, match="assistant"):
        load_sft_examples(SupervisedDatasetConfig(source="file", path=str(rows)), tokenizer)


def test_max_length_and_identical_pairs_are_skipped_and_counted(tokenizer, tmp_path):
    rows = tmp_path / "pairs.jsonl"
    rows.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "max(1,2)=", "chosen": "2", "rejected": "1"},
        {"prompt": "max(1,2)=", "chosen": "2", "rejected": "2"},
        {"prompt": "max(1,2)=" * 20, "chosen": "2", "rejected": "1"},
    ]))
    pairs, stats = load_pair_examples(SupervisedDatasetConfig(source="file", path=str(rows), max_length=40),
                                      tokenizer)
    assert len(pairs) == 1
    assert stats.counts["skipped_identical_pair"] == 1 and stats.counts["skipped_too_long"] == 1


def test_example_data_files_load(tokenizer):
    sft, _ = load_sft_examples(
        SupervisedDatasetConfig(source="file", path=str(EXAMPLES / "data/synthetic_sft.jsonl")), tokenizer)
    pairs, _ = load_pair_examples(
        SupervisedDatasetConfig(source="file", path=str(EXAMPLES / "data/synthetic_pairs.jsonl")), tokenizer)
    assert len(sft) == 100 and len(pairs) == 100
    for kind, cls in (("sft", SFTConfig), ("dpo", DPOConfig), ("reward_model", RewardModelConfig),
                      ("distill", DistillConfig)):
        load_config(cls, EXAMPLES / f"{kind}.yaml")  # every example config validates


def _traj(traj_id, group, sample, output, *, run="r1", mask=None, finish="stop"):
    return TrajectoryEvent(traj_id=traj_id, group_id=group, prompt_id=group, sample_index=sample,
                           group_size=3, prompt_ids=[1, 7, 8], output_ids=output,
                           output_logprobs=[-1.0] * len(output), output_versions=[0] * len(output),
                           loss_mask=mask or [], finish_reason=finish, run_id=run)


def test_logged_groups_give_rft_examples_and_best_vs_worst_pairs():
    events = [
        _traj("a0", "g1", 0, [5, 2]), _traj("a1", "g1", 1, [6, 2], mask=[1, 0]), _traj("a2", "g1", 2, [9, 2]),
        _traj("b0", "g2", 0, [5, 2]), _traj("b1", "g2", 1, [6, 2]),         # tied group
        _traj("c0", "g3", 0, [5, 2], finish="abort"), _traj("c1", "g3", 1, [6, 2]),
        _traj("x0", "gx", 0, [5, 2], run="other"),                           # another run
        _traj("n0", "g4", 0, [5, 2]),                                        # no reward
        RewardEvent(traj_id="a0", group_id="g1", reward=0.0, run_id="r1"),
        RewardEvent(traj_id="a1", group_id="g1", reward=1.0, run_id="r1"),
        RewardEvent(traj_id="a1", group_id="g1", reward=0.0, run_id="r1"),   # later duplicate: ignored
        RewardEvent(traj_id="a2", group_id="g1", reward=0.5, run_id="r1"),
        RewardEvent(traj_id="b0", group_id="g2", reward=1.0, run_id="r1"),
        RewardEvent(traj_id="b1", group_id="g2", reward=1.0, run_id="r1"),
        RewardEvent(traj_id="c0", group_id="g3", reward=1.0, run_id="r1"),
        RewardEvent(traj_id="c1", group_id="g3", reward=0.0, run_id="r1"),
        RewardEvent(traj_id="x0", group_id="gx", reward=1.0, run_id="other"),
    ]
    stats = DataStats()
    groups = logged_groups(events, "r1", stats)
    assert [g.group_id for g in groups] == ["g1", "g2", "g3"]
    assert stats.counts["trajectories_without_reward"] == 1
    sft = list(sft_examples_from_groups(groups, 1.0, stats))
    # a1 (reward 1, loss mask kept), b0, b1; c0 reached 1.0 but was aborted
    assert [(e.response_ids, e.response_mask) for e in sft] == [([6, 2], [1, 0]), ([5, 2], [1, 1]),
                                                                ([6, 2], [1, 1])]
    assert stats.counts["skipped_aborted"] == 1
    pairs = list(pair_examples_from_groups(groups, stats))
    # g1: best a1 (1.0) vs worst a0 (0.0); g2 tied -> none; g3: only c1 usable -> none
    assert [(p.chosen_ids, p.rejected_ids, p.chosen_mask) for p in pairs] == [([6, 2], [5, 2], [1, 0])]
    assert stats.counts["skipped_tied_groups"] == 1 and stats.counts["skipped_groups_too_small"] == 1


def test_logged_rewards_key_by_trajectory_and_scorer():
    def reward(traj, value, scorer):
        return RewardEvent(traj_id=traj, group_id="g1", reward=value, scorer=scorer, run_id="r1")

    events = [
        _traj("a0", "g1", 0, [5, 2]), _traj("a1", "g1", 1, [6, 2]), _traj("a2", "g1", 2, [9, 2]),
        reward("a0", 1.0, "math"), reward("a0", 0.2, "judge"),
        reward("a1", 0.0, "judge"), reward("a1", 1.0, "math"), reward("a1", 0.9, "judge"),  # dup
        reward("a2", 1.0, "math"), reward("a2", 0.7, "style"),  # no judge; style unweighted
    ]
    # Without weights: the first reward of each trajectory, from any scorer, in log order.
    stats = DataStats()
    (g,) = logged_groups(events, "r1", stats)
    assert [(t.traj_id, r) for t, r in g.trajectories] == [("a0", 1.0), ("a1", 0.0), ("a2", 1.0)]
    assert stats.counts["duplicate_rewards"] == 1
    # Weighted: 0.5 * math + 2 * judge; a2 lacks the judge and is skipped (counted).
    stats = DataStats()
    (g,) = logged_groups(events, "r1", stats, {"math": 0.5, "judge": 2.0})
    assert [(t.traj_id, r) for t, r in g.trajectories] == [("a0", 0.5 * 1.0 + 2 * 0.2),
                                                          ("a1", 0.5 * 1.0 + 2 * 0.0)]
    assert stats.counts["trajectories_missing_reward_source"] == 1
    # The weighted sum does not depend on the order the scorers' rewards were logged in.
    no_dup = [e for e in events if not (isinstance(e, RewardEvent) and e.reward == 0.9)]
    (g2,) = logged_groups(no_dup[:3] + no_dup[3:][::-1], "r1", DataStats(), {"math": 0.5, "judge": 2.0})
    assert [r for _, r in g2.trajectories] == [r for _, r in g.trajectories]
    with pytest.raises(ConfigError, match="reward_weights.math=0"):
        logged_groups(events, "r1", DataStats(), {"math": 0})


# ----------------------------------------------------------------------------- configs


def test_config_validation_says_what_to_fix(tiny, tmp_path):
    with pytest.raises(ConfigError, match="loss_type"):
        _cfg(DPOConfig, tiny, tmp_path, "loss_type=hinge")
    with pytest.raises(ConfigError, match="label_smoothing"):
        _cfg(DPOConfig, tiny, tmp_path, "loss_type=ipo", "label_smoothing=0.1")
    with pytest.raises(ConfigError, match="teacher_path"):
        _cfg(DistillConfig, tiny, tmp_path)
    with pytest.raises(ConfigError, match="eps_clip"):
        _cfg(SFTConfig, tiny, tmp_path, "actor.eps_clip=0.2")  # a PPO knob means nothing here
    with pytest.raises(ConfigError, match="train_dataset.path"):
        _cfg(SFTConfig, tiny, tmp_path, "train_dataset.source=file")


# ----------------------------------------------------------------------------- batching


def test_pad_batch_marks_only_response_tokens():
    from tapioca.trainers.supervised.loop import pad_batch

    # ids [1, 5, 6, 7, 2], prompt 2 tokens, response [6, 7, 2] with mask [1, 0, 1]:
    # position t predicts token t+1, so positions 1, 2, 3 predict 6, 7, 2; 7 is masked out.
    ids_BT, attn_BT, labels_BT, mask_BT = pad_batch([([1, 5, 6, 7, 2], 2, [1, 0, 1]), ([1, 9, 4], 2, [1])],
                                                    pad_token_id=0, device=torch.device("cpu"))
    assert ids_BT.tolist() == [[1, 5, 6, 7, 2], [1, 9, 4, 0, 0]]
    assert attn_BT.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert labels_BT.tolist() == [[-100, 6, -100, 2], [-100, 4, -100, -100]]
    assert mask_BT.tolist() == [[False, True, False, True], [False, True, False, False]]


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_micro_batching_does_not_change_the_loss_or_gradient(tiny, tmp_path, kind):
    # SFT is a token mean over the step, DPO a mean over its pairs, however the step is cut.
    from tapioca.trainers.supervised.dpo import DPOTrainer
    from tapioca.trainers.supervised.sft import SFTTrainer

    grads, losses = [], []
    for mb_tokens in (16, 100000):  # one sequence (pair) per micro-batch vs all in one
        cls, trainer_cls, load = ((SFTConfig, SFTTrainer, load_sft_examples) if kind == "sft"
                                  else (DPOConfig, DPOTrainer, load_pair_examples))
        cfg = _cfg(cls, tiny, tmp_path / str(mb_tokens), f"actor.mb_max_tokens={mb_tokens}")
        model, tok = setup_supervised(cfg)
        examples, _ = load(cfg.train_dataset, tok, seed=cfg.seed)
        trainer = trainer_cls(cfg, model, tok, examples[:6])
        if kind == "dpo":  # move the policy off the reference so the DPO gradient is not trivial
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
        metrics = trainer.accumulate(examples[:6])
        losses.append(metrics[f"{kind}/loss"])
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------- learning checks


def _greedy_accuracy(model, examples) -> float:
    right = 0
    for ex in examples:
        ids = torch.tensor([ex.prompt_ids])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
                             max_new_tokens=len(ex.response_ids))
        right += out[0, len(ex.prompt_ids):].tolist() == ex.response_ids
    return right / len(examples)


def test_sft_loss_falls_and_the_model_learns_the_task(tiny, tmp_path):
    from tapioca.trainers.supervised.sft import SFTTrainer

    cfg = _cfg(SFTConfig, tiny, tmp_path, "total_train_steps=80", "actor.optimizer.lr=2e-3",
               "train_dataset.batch_size=16", "save_every_steps=40")
    model, tok = setup_supervised(cfg)
    examples, stats = load_sft_examples(cfg.train_dataset, tok, seed=cfg.seed)
    trainer = SFTTrainer(cfg, model, tok, examples, data_metrics=stats.metrics())
    before = _greedy_accuracy(model, examples[:50])
    summary = trainer.fit()
    losses = [h["sft/loss"] for h in summary.history]
    # Measured: 3.47 -> 0.03 over 80 steps; greedy answers 0.00 -> 0.99 of the table.
    assert losses[0] > 3.0 and sum(losses[-10:]) / 10 < 0.3 * losses[0]
    after = _greedy_accuracy(model, examples[:50])
    assert before < 0.2 and after >= 0.8
    # The shared backbone: weights with their sha256, a checkpoint, metrics, final/.
    run = Path(cfg.run_path)
    assert sorted(p.name for p in (run / "weights").iterdir()) == ["v000040.safetensors",
                                                                   "v000080.safetensors"]
    assert sha256_file(run / "weights" / "v000080.safetensors") == trainer.progress.weights_sha256
    rows = [json.loads(line) for line in (run / "metrics" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 81)) and rows[0]["data/examples"] == 100
    assert (run / "checkpoints" / "sft.safetensors").is_file() and (run / "final" / "config.json").is_file()
    reloaded, _ = load_model_and_tokenizer(run / "final")
    assert _greedy_accuracy(reloaded, examples[:20]) == _greedy_accuracy(model, examples[:20])


def test_sft_resume_continues_exactly(tiny, tmp_path):
    from tapioca.trainers.supervised.sft import train_sft

    common = ["train_dataset.batch_size=8", "save_every_steps=3", "actor.optimizer.lr=1e-3"]
    straight = train_sft(_cfg(SFTConfig, tiny, tmp_path / "a", "total_train_steps=6", *common))
    train_sft(_cfg(SFTConfig, tiny, tmp_path / "b", "total_train_steps=3", *common))
    resumed = train_sft(_cfg(SFTConfig, tiny, tmp_path / "b", "total_train_steps=6", *common))
    # The second process trained steps 4-6 only, on the same examples as the straight run.
    assert [h["step"] for h in resumed.history] == [4.0, 5.0, 6.0]
    assert [h["sft/loss"] for h in resumed.history] == pytest.approx(
        [h["sft/loss"] for h in straight.history[3:]], rel=1e-5)
    a = load_model_and_tokenizer(straight.final_model_dir)[0].state_dict()
    b = load_model_and_tokenizer(resumed.final_model_dir)[0].state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_raises_the_chosen_vs_rejected_margin(tiny, tmp_path, loss_type):
    from tapioca.trainers.supervised.dpo import DPOTrainer

    cfg = _cfg(DPOConfig, tiny, tmp_path, f"loss_type={loss_type}", "total_train_steps=40",
               "actor.optimizer.lr=1e-3", "train_dataset.batch_size=16", "save_every_steps=40")
    model, tok = setup_supervised(cfg)
    pairs, _ = load_pair_examples(cfg.train_dataset, tok, seed=cfg.seed)
    trainer = DPOTrainer(cfg, model, tok, pairs)
    before = trainer.evaluate(pairs)
    assert before["margin"] == pytest.approx(0.0, abs=1e-6)  # policy == reference at start
    summary = trainer.fit()
    after = trainer.evaluate(pairs)
    # Measured (sigmoid): margin 0 -> ~0.5, accuracy -> ~0.95 over 40 steps.
    assert after["margin"] > 0.1 and after["accuracy"] >= 0.8
    assert after["logp_chosen_minus_rejected"] > before["logp_chosen_minus_rejected"] + 1.0
    losses = [h["dpo/loss"] for h in summary.history]
    assert sum(losses[-5:]) / 5 < losses[0]
    # The reference is the initial policy, frozen: it did not move.
    initial = load_model_and_tokenizer(tiny)[0].state_dict()
    for k, v in trainer.ref_model.state_dict().items():
        assert torch.equal(v, initial[k]), k


def test_reward_model_accuracy_rises_above_chance(tiny, tmp_path):
    from tapioca.trainers.supervised.reward_model import RewardModelTrainer, load_reward_model

    cfg = _cfg(RewardModelConfig, tiny, tmp_path, "total_train_steps=100", "actor.optimizer.lr=1e-3",
               "train_dataset.batch_size=16", "save_every_steps=100")
    setup_supervised(cfg, load_policy=False)
    model, tok = load_reward_model(cfg.model.path)
    assert type(model).__name__ == "Qwen2ForSequenceClassification" and model.config.num_labels == 1
    pairs, _ = load_pair_examples(cfg.train_dataset, tok, seed=cfg.seed)
    trainer = RewardModelTrainer(cfg, model, tok, pairs)
    before = trainer.evaluate(pairs)
    summary = trainer.fit()
    after = trainer.evaluate(pairs)
    # Measured: accuracy 0.57 -> 0.89 over 100 steps (chance: 0.5).
    assert after["accuracy"] >= 0.8 and after["accuracy"] > before["accuracy"] + 0.15
    losses = [h["rm/loss"] for h in summary.history]
    assert sum(losses[-10:]) / 10 < 0.7 * sum(losses[:10]) / 10
    final = Path(cfg.run_path) / "final"
    architectures = json.loads((final / "config.json").read_text())["architectures"]
    assert architectures == ["Qwen2ForSequenceClassification"]


def test_distillation_lowers_the_students_kl_to_the_teacher(tiny, tmp_path):
    from tapioca.trainers.supervised.distill import DistillTrainer

    teacher_dir = create_tiny_checkpoint(tmp_path / "teacher", seed=7, hidden_size=48, num_heads=4)
    cfg = _cfg(DistillConfig, tiny, tmp_path, f"teacher_path={teacher_dir}", "total_train_steps=60",
               "actor.optimizer.lr=2e-3", "train_dataset.batch_size=16", "save_every_steps=60", "nll_coef=0.0",
               "actor.logprob_chunk_tokens=16")
    model, tok = setup_supervised(cfg)
    teacher, _ = load_model_and_tokenizer(teacher_dir)
    examples, _ = load_sft_examples(cfg.train_dataset, tok, seed=cfg.seed)
    trainer = DistillTrainer(cfg, model, tok, examples, teacher=teacher)
    before = trainer.evaluate(examples)
    summary = trainer.fit()
    after = trainer.evaluate(examples)
    assert after["kl"] < 0.5 * before["kl"]
    kls = [h["distill/kl"] for h in summary.history]
    assert sum(kls[-5:]) / 5 < kls[0]


def test_distillation_with_nll_weight_also_fits_the_data(tiny, tmp_path):
    from tapioca.trainers.supervised.distill import train_distill

    teacher_dir = create_tiny_checkpoint(tmp_path / "teacher", seed=7)
    summary = train_distill(_cfg(DistillConfig, tiny, tmp_path, f"teacher_path={teacher_dir}",
                                 "total_train_steps=20", "actor.optimizer.lr=2e-3", "kd_coef=0.5", "nll_coef=1.0"))
    first, last = summary.history[0], summary.history[-1]
    assert first["distill/loss"] == pytest.approx(0.5 * first["distill/kl"] + first["distill/nll"], rel=1e-6)
    assert last["distill/nll"] < first["distill/nll"]


def test_distillation_nll_uses_the_students_full_head(tiny, tmp_path):
    # A student padded with extra vocabulary rows (as model families pad to a multiple):
    # the KL compares the shared rows only, but the NLL is the student's own full softmax.
    from tapioca.trainers.supervised.distill import DistillTrainer

    cfg = _cfg(DistillConfig, tiny, tmp_path, f"teacher_path={tiny}", "nll_coef=1.0")
    model, tok = setup_supervised(cfg)
    teacher, _ = load_model_and_tokenizer(tiny)
    V = teacher.get_output_embeddings().weight.shape[0]
    model.resize_token_embeddings(V + 8, mean_resizing=False)
    with torch.no_grad():  # the padded rows carry real probability mass
        model.get_output_embeddings().weight[V:] = 2.0 * model.get_output_embeddings().weight[:8]
    examples, _ = load_sft_examples(cfg.train_dataset, tok, seed=cfg.seed)
    ex = examples[0]
    trainer = DistillTrainer(cfg, model, tok, examples, teacher=teacher)
    got = trainer.evaluate([ex])
    ids = torch.tensor([ex.prompt_ids + ex.response_ids])
    P, n = len(ex.prompt_ids), len(ex.response_ids)
    with torch.no_grad():
        s_logits = model(input_ids=ids).logits[0, P - 1:P - 1 + n].double()
        t_logits = teacher(input_ids=ids).logits[0, P - 1:P - 1 + n].double()
    targets = torch.tensor(ex.response_ids)
    full_nll = -torch.log_softmax(s_logits, -1).gather(-1, targets[:, None]).mean()
    cut_nll = -torch.log_softmax(s_logits[:, :V], -1).gather(-1, targets[:, None]).mean()
    log_p_t = torch.log_softmax(t_logits[:, :V], -1)
    kl = (log_p_t.exp() * (log_p_t - torch.log_softmax(s_logits[:, :V], -1))).sum(-1).mean()
    assert got["nll"] == pytest.approx(float(full_nll), rel=1e-4)
    assert abs(float(full_nll) - float(cut_nll)) > 0.05  # the two definitions differ here
    assert got["kl"] == pytest.approx(float(kl), rel=1e-4, abs=1e-6)


def test_distillation_refuses_a_teacher_with_another_vocabulary(tiny, tmp_path):
    from tapioca.trainers.supervised.distill import DistillTrainer

    cfg = _cfg(DistillConfig, tiny, tmp_path, f"teacher_path={tiny}")
    model, tok = setup_supervised(cfg)
    small_teacher, _ = load_model_and_tokenizer(tiny)
    small_teacher.resize_token_embeddings(10)
    with pytest.raises(ConfigError, match="vocabulary"):
        DistillTrainer(cfg, model, tok, [], teacher=small_teacher)


# ----------------------------------------------------------------------------- CLI


def test_cli_sft_runs_and_reports_json(tiny, tmp_path):
    from typer.testing import CliRunner

    from tapioca.ops.cli import app

    result = CliRunner().invoke(app, ["sft", "--config", str(EXAMPLES / "sft.yaml"), "-o", "json",
                                      f"model.path={tiny}", f"run_dir={tmp_path}", "total_train_steps=3",
                                      f"train_dataset.path={EXAMPLES / 'data/synthetic_sft.jsonl'}"])
    assert result.exit_code == 0, result.output
    meta = json.loads(result.output.strip().splitlines()[-1])
    assert meta["kind"] == "sft" and meta["steps"] == 3
    assert Path(meta["final_model"], "config.json").is_file()
    bad = CliRunner().invoke(app, ["dpo", f"run_dir={tmp_path}", "loss_type=hinge"])
    assert bad.exit_code != 0 and isinstance(bad.exception, ConfigError)


def test_cli_sft_shows_progress_off_a_terminal_and_says_a_finished_run_is_complete(tiny, tmp_path):
    from typer.testing import CliRunner

    from tapioca.ops.cli import app

    args = ["sft", "--config", str(EXAMPLES / "sft.yaml"), f"model.path={tiny}",
            f"run_dir={tmp_path}", "total_train_steps=3", "trial_name=again",
            f"train_dataset.path={EXAMPLES / 'data/synthetic_sft.jsonl'}"]
    # CliRunner's stdout is no terminal: lines, here one per step.
    env = {"TAPIOCA_PROGRESS_EVERY_S": "0.000001"}
    result = CliRunner().invoke(app, args, env=env)
    assert result.exit_code == 0, (result.output, result.exception)
    steps = [line for line in result.output.splitlines() if line.startswith("sft: ")
             and "/3 steps" in line]
    assert [line.split()[1] for line in steps] == ["1/3", "2/3", "3/3"], result.output
    assert "sft/loss" in steps[-1]
    final = tmp_path / "sft" / "again" / "final"
    stamp = (final / "config.json").stat().st_mtime_ns
    # The same command again: nothing to train, and it says so (final/ is left as it is).
    again = CliRunner().invoke(app, args, env=env)
    assert again.exit_code == 0, (again.output, again.exception)
    assert f"sft: already complete: {tmp_path / 'sft' / 'again'} has 3 steps" in again.output
    assert "nothing to train" in again.output and f"final model: {final}" in again.output
    assert (final / "config.json").stat().st_mtime_ns == stamp


def test_no_usable_examples_is_a_clear_error(tiny, tokenizer, tmp_path):
    rows = tmp_path / "long.jsonl"
    rows.write_text(json.dumps({"prompt": "max(1,2)=" * 30, "response": "2"}) + "\n")
    with pytest.raises(TapiocaError, match="no usable examples.*max_length"):
        load_sft_examples(SupervisedDatasetConfig(source="file", path=str(rows), max_length=16), tokenizer)


# ------------------------------------------------------------- held-out evaluation (SFT)

def test_sft_stops_at_a_held_out_target_and_records_each_evaluation(tiny, tmp_path):
    """valid_dataset + evaluator.freq_steps: the trainer's weights are scored in this
    process at v0 and every 10 steps; stop_at_eval ends training at the first evaluation
    reaching it (total_train_steps is then a cap), saving that version and final/."""
    from tapioca.runtime.sft_eval import SFTHeldOut
    from tapioca.trainers.supervised.sft import train_sft

    cfg = _cfg(SFTConfig, tiny, tmp_path, "total_train_steps=80", "actor.optimizer.lr=2e-3",
               "train_dataset.batch_size=16", "save_every_steps=1000",
               "valid_dataset.type=synthetic", "valid_dataset.split=train", "eval.k=1",
               "eval.max_prompts=20", "eval_gconfig.max_new_tokens=4", "evaluator.freq_steps=10",
               "evaluator.eval_before_train=true", "stop_at_eval=0.6")
    held_out = SFTHeldOut(cfg)
    try:
        summary = train_sft(cfg, hook=held_out)
    finally:
        held_out.close()
    steps = [r.step for r in held_out.results]
    # Measured (the same 80-step run without the stop): greedy 0.00 -> 0.99 of the table.
    assert summary.stopped == "hook" and held_out.stopped_at == summary.steps == steps[-1] < 80
    assert steps == list(range(0, summary.steps + 1, 10))
    greedy = [r.metrics["eval/greedy"] for r in held_out.results]
    assert greedy[0] < 0.3 and greedy[-1] >= 0.6 and all(g < 0.6 for g in greedy[:-1])
    run = Path(cfg.run_path)
    rows = [json.loads(line) for line in (run / "eval" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == steps and rows[-1]["eval/greedy"] == greedy[-1]
    assert len((run / "eval" / "v000000" / "samples.jsonl").read_text().splitlines()) == 20 * 2
    # the version it stopped at is saved (a rerun resumes there) and is the final model
    assert (run / "weights" / f"v{summary.steps:06d}.safetensors").is_file()
    assert (run / "final" / "config.json").is_file() and held_out.summary()["stopped_at_step"] == summary.steps


def test_sft_time_limit_and_held_out_config_errors(tiny, tmp_path):
    from tapioca.trainers.supervised.sft import train_sft

    summary = train_sft(_cfg(SFTConfig, tiny, tmp_path, "total_train_steps=100000", "time_limit_s=0.5",
                             "train_dataset.batch_size=4"))
    assert summary.stopped == "time_limit_s" and 0 < summary.steps < 100000
    assert (Path(summary.run_dir) / "final" / "config.json").is_file()
    with pytest.raises(ConfigError, match="stop_at_eval needs held-out evaluations"):
        _cfg(SFTConfig, tiny, tmp_path, "stop_at_eval=0.5")
    with pytest.raises(ConfigError, match="valid_dataset is not set"):
        _cfg(SFTConfig, tiny, tmp_path, "evaluator.freq_steps=5")
    with pytest.raises(ConfigError, match="rollout.device=cuda"):
        _cfg(SFTConfig, tiny, tmp_path, "actor.device=cuda", "valid_dataset.type=synthetic")
    with pytest.raises(ConfigError, match="eval.k >= 4"):
        _cfg(SFTConfig, tiny, tmp_path, "valid_dataset.type=synthetic", "evaluator.freq_steps=5",
             "stop_at_eval=0.5", "stop_at_eval_metric=pass@4", "eval.k=2")
