"""The Hugging Face directory an RL run leaves when it finishes, ``<run dir>/final/``, as
the supervised trainers leave theirs (trainers/supervised/loop.py): the files of the model
directory the run started from (``config.json``, ``generation_config.json``, the tokenizer
and chat template) with the trained weights as ``model.safetensors`` in ``model.dtype``.
``AutoModelForCausalLM.from_pretrained``, vLLM and SGLang load it as it is, and it is a
warm start (``model.path``) for another run.

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
