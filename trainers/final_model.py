"""The Hugging Face directory an RL run leaves when it finishes, ``<run dir>/final/``, as
the supervised trainers leave theirs (trainers/supervised/loop.py): the files of the model
directory the run started from (``config.json``, ``generation_config.json``, the tokenizer
and chat template) with the trained weights as ``model.safetensors`` in ``model.dtype``.
``AutoModelForCausalLM.from_pretrained``, vLLM and SGLang load it as it is, and it is a
warm start (``model.path``) for another run.

A LoRA run (``actor.lora.enabled``) leaves its adapter instead: ``final/`` is a PEFT adapter
directory (``adapter_config.json``, whose ``base_model_name_or_path`` is the base
``model.path``, and ``adapter_model.safetensors``), which
``PeftModel.from_pretrained(base, "final")`` and vLLM / SGLang's LoRA endpoints load;
``tapioca lora-merge RUN_DIR OUT`` writes the merged Hugging Face model
(:func:`merge_lora`).

Written by the trainer role once its last step is done (``total_train_steps`` or
``stop_at_reward``); a resumed run that trains further replaces it. Consumes and emits
nothing on the bus.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from ..weights.files import save_weights

FINAL_DIR = "final"
# Files of the start model that its trained weights replace (a sharded checkpoint's index
# included: the final weights are one file).
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".safetensors.index.json",
                 ".bin.index.json")


def write_final_adapter(tensors: dict[str, torch.Tensor], adapter_doc: dict,
                        directory: str | Path, *, dtype: torch.dtype) -> Path:
    """Write a LoRA run's ``final/``: the adapter (PEFT file names) and its config, as one
    directory renamed into place."""
    from ..models.lora import adapter_config_bytes
    from ..weights.adapter_files import write_adapter_tensors

    directory = Path(directory)
    old = directory.with_name(directory.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if directory.exists():
        directory.rename(old)
    write_adapter_tensors(directory, adapter_config_bytes(adapter_doc), tensors, dtype=dtype)
    shutil.rmtree(old, ignore_errors=True)
    return directory


def merge_lora(adapter_dir: str | Path, out: str | Path, *, base_path: str | Path | None = None,
               dtype: str = "") -> Path:
    """The Hugging Face model of base + adapter: the base (``base_path``, else the
    adapter's ``base_model_name_or_path``) loaded with ``transformers``, the adapter with
    ``peft.PeftModel.from_pretrained``, merged (``merge_and_unload``: W + alpha/r * B A)
    and saved with ``save_pretrained`` beside the base's tokenizer and generation files.
    ``dtype``: the merged model's (empty: the base's). Written to a temporary sibling
    renamed into place."""
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ..models.lora import ADAPTER_CONFIG_FILE
    from ..schemas.errors import ConfigError

    adapter_dir, out = Path(adapter_dir), Path(out)
    cfg_file = adapter_dir / ADAPTER_CONFIG_FILE
    if not cfg_file.is_file():
        raise ConfigError(f"{adapter_dir} is not a PEFT adapter (no {ADAPTER_CONFIG_FILE}): give a "
                          "LoRA run's directory (its final/ adapter) or an adapter directory")
    base = Path(base_path or json.loads(cfg_file.read_text()).get("base_model_name_or_path") or "")
    if not (base / "config.json").is_file():
        raise ConfigError(f"the adapter's base model {str(base) or '(none named)'} is not a local "
                          "Hugging Face directory here: pass --base PATH")
    model = AutoModelForCausalLM.from_pretrained(base, local_files_only=True,
                                                 **({"dtype": getattr(torch, dtype)} if dtype else {}))
    merged = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in base.iterdir():
        if f.is_file() and not f.name.endswith(_WEIGHT_FILES) and f.name != "config.json":
            shutil.copy2(f, tmp / f.name)
    merged.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def write_final_model(model_dir: str | Path, state_dict: dict[str, torch.Tensor],
                      directory: str | Path, *, dtype: torch.dtype) -> Path:
    """Write ``directory`` (a temporary sibling renamed into place, so a reader never
    sees half of one); returns it."""
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in Path(model_dir).iterdir():
        if f.is_file() and not f.name.endswith(_WEIGHT_FILES):
            shutil.copy2(f, tmp / f.name)
    # Tied tensors are stored once (save_weights); from_pretrained ties them again.
    save_weights(state_dict, tmp / "model.safetensors", dtype=dtype)
    old = directory.with_name(directory.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if directory.exists():
        directory.rename(old)
    tmp.rename(directory)
    shutil.rmtree(old, ignore_errors=True)
    return directory
