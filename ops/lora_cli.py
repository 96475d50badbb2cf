"""`tapioca lora-merge RUN_DIR OUT`: a LoRA run's adapter merged into its base, as one
Hugging Face model directory (vLLM, SGLang and ``from_pretrained`` load it as a full model;
another run warm-starts from it with ``model.path``).

Reads ``RUN_DIR/final/`` (the PEFT adapter a LoRA run leaves, trainers/final_model.py) or
any PEFT adapter directory given as RUN_DIR, and the base model it names
(``base_model_name_or_path``, else the run's ``config.yaml`` ``model.path``, or
``--base``); writes OUT. No broker.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .cli_context import console, quiet_hugging_face

# This module's commands; ops/cli.py adds them to `tapioca`.
app = typer.Typer()


def _adapter_and_base(run_dir: Path, base: Optional[str]) -> tuple[Path, Optional[str]]:
    from ..models.lora import ADAPTER_CONFIG_FILE
    from ..schemas.errors import ConfigError
    from ..trainers.final_model import FINAL_DIR

    if (run_dir / ADAPTER_CONFIG_FILE).is_file():
        return run_dir, base
    adapter = run_dir / FINAL_DIR
    if not (adapter / ADAPTER_CONFIG_FILE).is_file():
        hint = ("its final/ is a full model (not a LoRA run): use it as it is"
                if (adapter / "config.json").is_file() else
                "the run has not finished (final/ is written at its last step)")
        raise ConfigError(f"{adapter} is not a PEFT adapter: {hint}")
    if base is None and (run_dir / "config.yaml").is_file():
        import yaml

        path = ((yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("model") or {}).get("path")
        if path and (Path(path) / "config.json").is_file():
            base = path
    return adapter, base


@app.command("lora-merge")
def lora_merge(
    run_dir: str = typer.Argument(..., help="A LoRA run's directory (its final/ adapter is merged) "
                                  "or a PEFT adapter directory."),
    out: str = typer.Argument(..., help="Where to write the merged Hugging Face model."),
    base: Optional[str] = typer.Option(None, "--base", help="The base model directory (default: "
                                       "the one the adapter names, else the run's model.path)."),
    dtype: str = typer.Option("", "--dtype", help="The merged model's dtype (bfloat16, float16, "
                              "float32; default: the base's)."),
) -> None:
    """Merge a LoRA run's adapter into its base model (W + alpha/r * B A, with peft) and
    save the result with the base's tokenizer: a full Hugging Face model."""
    from ..schemas.errors import ConfigError
    from ..trainers.final_model import merge_lora

    if dtype not in ("", "bfloat16", "float16", "float32"):
        raise ConfigError(f"--dtype {dtype!r}: use bfloat16, float16 or float32")
    adapter, base_path = _adapter_and_base(Path(run_dir), base)
    with quiet_hugging_face():
        written = merge_lora(adapter, out, base_path=base_path, dtype=dtype)
    console.print(f"merged {adapter} into {written}")
