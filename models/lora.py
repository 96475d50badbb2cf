"""LoRA adapters on a ``transformers`` causal LM, built with peft: the one place that knows
peft's module and tensor names.

Consumes a model (the trainer's policy, an in-process engine's model) and a LoRA spec
(rank, alpha, target modules); emits the model with peft's LoRA layers injected in place
(:func:`apply_lora`; the base frozen, the adapter trainable), and the adapter as tensors
named as in a PEFT adapter file (``adapter_model.safetensors``:
``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``), which is what every
weight event, checkpoint and ``final/`` carries. Keyed by those names.

The model stays the ``transformers`` model (peft's ``inject_adapter_in_model``, no
``PeftModel`` wrapper): the packed forward, FSDP2 and the HF forward all run it as they
run a full model, and its LoRA layers (``peft.tuners.lora.Linear``) add
``scale * B(A(x))`` to each targeted projection, ``scale = alpha / rank``, no dropout
(a deterministic forward, so the training forward's logprobs are pi_prox exactly).
:func:`adapter_disabled` turns every adapter off for a block (the KL reference: the base
model itself, no second copy).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

import torch

from ..schemas.errors import ConfigError

# PEFT's file names: a PeftModel saves its LoRA tensors as base_model.model.<HF module path>.
PEFT_PREFIX = "base_model.model."
ADAPTER_MODEL_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"
_ADAPTER = "default"  # peft's adapter name inside the model; never in a file name


@dataclass
class LoraAdapter:
    """A LoRA version for an engine (``InferenceEngine.update_adapter``, from a weights
    event's ``adapter``): the base weights stay, the adapter ``name``
    (``{lora_name}-v{version}``) of ``rank`` / ``alpha`` on the modules ``target_modules``
    (short names: q_proj, ...) is what the engine serves from then on. In-process engines
    get its ``tensors`` (PEFT file names); server adapters its PEFT directory ``path``."""

    name: str
    rank: int
    alpha: float
    target_modules: list[str]
    tensors: Mapping[str, torch.Tensor] | None = None
    path: str = ""

    @property
    def scale(self) -> float:
        """What LoRA adds to a projection: ``scale * B @ A`` (peft's alpha / r)."""
        return self.alpha / self.rank


def peft_targets(target_modules: Sequence[str]) -> str | list[str]:
    """``actor.lora.target_modules`` as peft takes them: ``[all-linear]`` is the string
    ``"all-linear"`` (peft resolves it to every linear layer but the output layer)."""
    mods = list(target_modules)
    return "all-linear" if mods == ["all-linear"] else mods


def lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The injected LoRA layers by module path (``model.layers.0.self_attn.q_proj``)."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def apply_lora(model: torch.nn.Module, *, rank: int, alpha: int,
               target_modules: Sequence[str], seed: int = 0) -> list[str]:
    """Inject LoRA layers into ``model`` in place (B = 0: the model computes what it did;
    A random, drawn from ``seed``, so every FSDP rank and a resumed or replayed run start
    from the same adapter; the caller's RNG is left as it was); only they stay trainable.
    Returns the short names of the modules they wrap (``["down_proj", "gate_proj", ...]``,
    sorted), what a weight event names."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.utils.other import ModulesToSaveWrapper

    if lora_layers(model):
        raise ConfigError("the model already has LoRA layers; load the base model again")
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=peft_targets(target_modules),
                     lora_dropout=0.0, bias="none")
    try:
        with torch.random.fork_rng(devices=[]):  # peft draws A on the CPU, then moves it
            torch.manual_seed(seed)
            inject_adapter_in_model(cfg, model)
    except ValueError as exc:  # peft's NoMatchingPeftModuleError is a ValueError
        raise ConfigError(f"actor.lora.target_modules={list(target_modules)}: {exc}; name linear "
                          "modules of the model (q_proj, v_proj, ...) or use [all-linear]") from None
    if any(isinstance(m, ModulesToSaveWrapper) for m in model.modules()):
        raise ConfigError("the adapter would train whole modules (modules_to_save), which weight "
                          "events do not carry: target linear layers only")
    return sorted({name.rsplit(".", 1)[-1] for name in lora_layers(model)})


def _meta_model(model_path: str) -> torch.nn.Module:
    """An empty (meta-device) copy of the causal LM at ``model_path``, built from its
    ``config.json`` alone."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def resolve_targets(model_path: str, target_modules: Sequence[str]) -> list[str]:
    """The short module names an adapter of ``target_modules`` has on the model at
    ``model_path``: peft's own resolution (``all-linear``), on an empty (meta-device) copy
    built from its ``config.json``, so a reader learns what the trainer will name."""
    return apply_lora(_meta_model(model_path), rank=1, alpha=1, target_modules=target_modules)


def module_names(model_path: str) -> tuple[set[str], set[str]]:
    """``(every module path, the short names of its linear layers)`` of the model at
    ``model_path`` (a meta-device copy): what ``actor.lora.target_modules`` may name, checked at
    start by the feature table (config/features.py)."""
    model = _meta_model(model_path)
    paths = {name for name, _ in model.named_modules() if name}
    linear = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    return paths, linear


def adapter_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors under their PEFT file names (the live parameters, no copy)."""
    out = {}
    for path, layer in lora_layers(model).items():
        out[f"{PEFT_PREFIX}{path}.lora_A.weight"] = layer.lora_A[_ADAPTER].weight
        out[f"{PEFT_PREFIX}{path}.lora_B.weight"] = layer.lora_B[_ADAPTER].weight
    return out


def adapter_parameter_names(model: torch.nn.Module) -> dict[str, str]:
    """PEFT file name -> the model's own parameter name (``...lora_A.default.weight``)."""
    return {f"{PEFT_PREFIX}{path}.lora_{ab}.weight": f"{path}.lora_{ab}.{_ADAPTER}.weight"
            for path in lora_layers(model) for ab in "AB"}


def load_adapter_state_dict(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy an adapter (PEFT file names) into ``model``'s LoRA layers in place; every name
    and shape is checked before anything is copied, and every adapter tensor must be there."""
    own = adapter_state_dict(model)
    missing = sorted(set(own) - set(tensors))
    unknown = sorted(set(tensors) - set(own))
    if missing or unknown:
        raise ConfigError(f"the adapter does not fit the model's LoRA layers (missing "
                          f"{missing[:2]}, unknown {unknown[:2]}): other target modules?")
    for name, t in tensors.items():
        if tuple(t.shape) != tuple(own[name].shape):
            raise ConfigError(f"adapter tensor {name} has shape {tuple(t.shape)}, the model's "
                              f"LoRA layer {tuple(own[name].shape)}: another rank?")
    with torch.no_grad():
        for name, t in tensors.items():
            own[name].copy_(t)


@contextlib.contextmanager
def adapter_disabled(model: torch.nn.Module) -> Iterator[None]:
    """Every LoRA layer computes its base layer only, inside the block (peft's own switch,
    as ``PeftModel.disable_adapter`` uses it)."""
    layers = list(lora_layers(model).values())
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def base_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base model's tensors under their ``transformers`` names (without the LoRA
    layers' ``base_layer.`` and adapter tensors): what ``model.path`` holds."""
    out = {}
    for name, t in model.state_dict().items():
        if ".lora_" in name:
            continue
        out[name.replace(".base_layer.", ".")] = t
    return out


def adapter_config(*, rank: int, alpha: int, targets: Sequence[str], base_model_path: str) -> dict:
    """``adapter_config.json`` of the adapter (peft's ``LoraConfig``, loadable by
    ``PeftModel.from_pretrained``, vLLM and SGLang)."""
    from peft import LoraConfig

    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=sorted(targets), lora_dropout=0.0,
                     bias="none", task_type="CAUSAL_LM", base_model_name_or_path=base_model_path)
    doc = cfg.to_dict()
    return json.loads(json.dumps(doc, default=lambda v: sorted(v) if isinstance(v, set) else str(v)))


def adapter_config_bytes(doc: dict) -> bytes:
    """The file's bytes: one canonical form, so a checksum of it is reproducible."""
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


def module_of(name: str) -> tuple[str, str]:
    """``(HF module path, "A" | "B")`` of a PEFT file name."""
    if not name.startswith(PEFT_PREFIX) or not name.endswith((".lora_A.weight", ".lora_B.weight")):
        raise ConfigError(f"{name!r} is not a LoRA tensor of a PEFT adapter file "
                          f"({PEFT_PREFIX}<module>.lora_A.weight / .lora_B.weight)")
    path = name[len(PEFT_PREFIX):-len(".lora_A.weight")]
    return path, name[-len("A.weight")]


def adapter_pairs(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Module path -> ``(A [r, in], B [out, r])`` of an adapter (PEFT file names)."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        path, ab = module_of(name)
        halves.setdefault(path, {})[ab] = t
    broken = [p for p, h in halves.items() if set(h) != {"A", "B"}]
    if broken:
        raise ConfigError(f"the adapter has only one of lora_A / lora_B for {broken[:2]}")
    return {p: (h["A"], h["B"]) for p, h in halves.items()}


def adapter_rank(tensors: Mapping[str, torch.Tensor]) -> int:
    """The rank of an adapter: the rows of its lora_A tensors (all equal)."""
    ranks = {int(a.shape[0]) for a, _ in adapter_pairs(tensors).values()}
    if len(ranks) != 1:
        raise ConfigError(f"the adapter mixes ranks {sorted(ranks)}; one rank per adapter")
    return ranks.pop()


def lora_delta(a_RI: torch.Tensor, b_OR: torch.Tensor, scale: float,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``scale * B @ A`` ``[out, in]`` in ``dtype`` (the merge of one projection)."""
    return (b_OR.to(dtype) @ a_RI.to(dtype)) * scale
