"""Reading dataset files into plain dicts: JSONL, Parquet, and HF ``datasets`` directories.

Consumed by the tasks (``gsm8k`` ...) and by the prompt feeder for user datasets. Yields
one dict per row, in file order, lazily (a large Parquet file is read batch by batch).
Local paths only: nothing here downloads. :func:`dataset_rows` is the rows of a run's
``train_dataset`` section (the feeder's and the agent runners' prompts);
:func:`check_image_paths` refuses, before a run starts, a file whose rows name image
files that do not exist (runtime/run.py).

A relative path is read from the working directory, else from the repository root
(:func:`data_path`): the examples name their data as ``examples/data/...`` (GSM8K ships
there), which works from the root of a clone and from any other directory.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from ..schemas.errors import ConfigError, TapiocaError

if TYPE_CHECKING:
    from ..config.schema import DatasetConfig

# The repository root: the package's own directory (examples/ sits beside tasks/ there).
REPO_ROOT = Path(__file__).resolve().parent.parent
_JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")


def data_path(path: str | os.PathLike) -> Path:
    """``path`` as given when it is absolute or there from the working directory; else
    the same relative path in the repository root, when there (``examples/data/gsm8k/
    train.jsonl`` from any directory of a clone, and in a role whose working directory
    is another, e.g. a Ray worker's)."""
    p = Path(path)
    if p.is_absolute() or p.exists():
        return p
    in_repo = REPO_ROOT / p
    return in_repo if in_repo.exists() else p
_PARQUET_SUFFIXES = (".parquet", ".pq")


def _read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    with path.open("r", encoding="utf-8") as f:
        head = f.read(1024).lstrip()
        f.seek(0)
        if head.startswith("["):  # a .json file holding one array of objects
            yield from json.load(f)
            return
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise TapiocaError(f"{path}:{lineno}: not valid JSON ({e}); fix or remove that line") from e
            if not isinstance(row, dict):
                raise TapiocaError(f"{path}:{lineno}: expected a JSON object per line, got {type(row).__name__}")
            yield row


def _read_parquet(path: Path) -> Iterator[dict[str, Any]]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    for batch in parquet.iter_batches(batch_size=1024):
        yield from batch.to_pylist()


def _is_hf_datasets_dir(path: Path) -> bool:
    # save_to_disk writes dataset_info.json + state.json (a Dataset) or
    # dataset_dict.json (a DatasetDict with one folder per split).
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def _read_hf_datasets_dir(path: Path, split: str | None) -> Iterator[dict[str, Any]]:
    try:
        import datasets
    except ImportError as e:
        raise TapiocaError(
            f"{path} is a Hugging Face `datasets` directory (save_to_disk); reading it needs "
            "`pip install datasets`, or export it to JSONL/Parquet first"
        ) from e
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if split is None:
            if len(loaded) != 1:
                raise ConfigError(f"{path} holds splits {sorted(loaded)}; pass split=... to pick one")
            split = next(iter(loaded))
        if split not in loaded:
            raise ConfigError(f"{path} has no split {split!r}; it has {sorted(loaded)}")
        loaded = loaded[split]
    yield from iter(loaded)


def missing_dataset_message(path: Path) -> str:
    """What to say of a dataset path that is not there (the feeder and the check at start)."""
    where = "" if path.is_absolute() else f" (from {Path.cwd()}, nor in the repository {REPO_ROOT})"
    return (f"dataset {path} does not exist{where}; check the path (datasets are read locally only; "
            "examples/data/gsm8k/{train,test}.jsonl ship with the repository)")


def check_dataset_file(ds: "DatasetConfig", *, section: str = "train_dataset") -> None:
    """Refuse (ConfigError, one line) a dataset file (``jsonl``, ``parquet``, ``hf_disk``,
    ``gsm8k`` with a path) that is not there, before any role starts: the feeder would otherwise stop on it in its
    log after the model is built and every role started. Built-in tasks have no file."""
    has_file = ds.type in _FILE_TYPES or (ds.type == "gsm8k" and bool(ds.path))
    if has_file and not data_path(ds.path).exists():
        raise ConfigError(f"{section}.path: " + missing_dataset_message(data_path(ds.path)))


def read_records(path: str | os.PathLike, *, split: str | None = None) -> Iterator[dict[str, Any]]:
    """Yield each row of a JSONL / Parquet file or a ``save_to_disk`` directory as a dict.

    ``split`` only matters for a ``DatasetDict`` directory. The format is chosen by
    suffix (``.jsonl``/``.json``/``.ndjson``, ``.parquet``/``.pq``) or, for a directory,
    by the files ``save_to_disk`` writes.
    """
    path = data_path(path)
    if not path.exists():
        raise TapiocaError(missing_dataset_message(path))
    if path.is_dir():
        if _is_hf_datasets_dir(path):
            return _read_hf_datasets_dir(path, split)
        raise TapiocaError(
            f"{path} is a directory but not a `datasets.save_to_disk` output "
            "(no state.json / dataset_dict.json); pass a .jsonl or .parquet file instead"
        )
    suffix = path.suffix.lower()
    if suffix in _JSONL_SUFFIXES:
        return _read_jsonl(path)
    if suffix in _PARQUET_SUFFIXES:
        return _read_parquet(path)
    raise TapiocaError(
        f"cannot read {path}: unknown format {suffix!r}; use .jsonl, .parquet or a save_to_disk directory"
    )


def dataset_rows(ds: "DatasetConfig", seed: int | None, *,
                 section: str = "train_dataset") -> tuple[str, Iterable[dict[str, Any]]]:
    """(task name, rows with prompt_id, messages|prompt, answer, and a file's subset) of a
    ``train_dataset`` / ``valid_dataset`` section: a built-in task's records, or a file's
    rows as math problems (``math``). ``seed`` None: file order (evaluation). ``section``:
    the config section ``ds`` is, named by the errors that tell which key to set."""
    from .base import get_task

    if ds.type == "synthetic":
        return "synthetic", get_task("synthetic", **ds.task_options).iter_records(ds.split, seed)
    if ds.type == "gsm8k":
        return "gsm8k", get_task("gsm8k", path=ds.path or None, **ds.task_options).iter_records(ds.split, seed)
    if ds.type == "visual":
        return "visual", get_task("visual", **ds.task_options).iter_records(ds.split, seed)
    if ds.type == "arith":  # chain arithmetic with shown work (tasks/arith.py)
        return "arith", get_task("arith", **ds.task_options).iter_records(ds.split, seed)
    if ds.type == "longchain":  # long chains with shown work, long-tailed (tasks/longchain.py)
        return "longchain", get_task("longchain", **ds.task_options).iter_records(ds.split, seed)
    base_dir = os.path.dirname(os.path.abspath(data_path(ds.path)))

    def rows():
        for i, row in enumerate(read_records(ds.path)):
            if ds.prompt_key not in row:
                raise ConfigError(f"dataset row {i} of {ds.path} has no {ds.prompt_key!r}; set "
                                  f"{section}.prompt_key to the prompt column (its keys: "
                                  f"{', '.join(sorted(row))})")
            out = {"prompt_id": str(row.get("id", i)), "prompt": str(row[ds.prompt_key]),
                   "answer": str(row.get(ds.answer_key, ""))}
            if row.get(ds.subset_key) is not None:  # `tapioca eval` reports per subset
                out["subset"] = str(row[ds.subset_key])
            images = row.get(ds.image_key)
            if images is not None and not (hasattr(images, "__len__") and len(images) == 0):
                out.update(image_row(out["prompt"], images, base_dir=base_dir, where=f"row {i} of {ds.path}"))
            yield out

    return "math", rows()


# The rows whose image paths :func:`check_image_paths` looks at before a run starts: the
# whole of every vision-language dataset the examples name (Geometry3K's train split has
# 2,101 rows); 0.3 s for a JSONL of 10,000 rows of two paths each on the loaded 2-core
# box (os.stat only). A longer dataset's later rows are read by the feeder as it goes,
# which refuses a missing file in its own log.
IMAGE_CHECK_ROWS = 10_000
_FILE_TYPES = ("jsonl", "parquet", "hf_disk")


def _image_column(ds: "DatasetConfig", limit: int) -> Iterator[Any]:
    """The images column of a dataset file's first ``limit`` rows (None where a row has
    none). Parquet: that column only (prompts and answers are not read)."""
    path = data_path(ds.path)
    if path.is_file() and path.suffix.lower() in _PARQUET_SUFFIXES:
        import pyarrow.parquet as pq

        parquet = pq.ParquetFile(path)
        if ds.image_key not in parquet.schema_arrow.names:
            return
        n = 0
        for batch in parquet.iter_batches(batch_size=1024, columns=[ds.image_key]):
            for images in batch.column(0).to_pylist():
                if n >= limit:
                    return
                n += 1
                yield images
        return
    for i, row in enumerate(read_records(ds.path)):
        if i >= limit:
            return
        yield row.get(ds.image_key)


def check_image_paths(ds: "DatasetConfig", *, section: str = "train_dataset",
                      limit: int = IMAGE_CHECK_ROWS) -> int:
    """Refuse (ConfigError, one line: the row, the path, what to do) a dataset file whose
    images column names an image file that does not exist, before any role starts (the
    feeder would otherwise stop on it in its log, 30-60 s into the run). Only the first
    ``limit`` rows are looked at, and only whether each path is a file (``os.stat``):
    nothing is opened or decoded (the feeder admits each image as it reads the row:
    media/images.py). Entries that carry their bytes are not looked at. A built-in task,
    a dataset that does not exist (the feeder says so) and one without an images column
    pass. Returns the number of paths looked at."""
    from ..media.images import image_source_path

    if ds.type not in _FILE_TYPES or not data_path(ds.path).exists():
        return 0
    base_dir = os.path.dirname(os.path.abspath(data_path(ds.path)))
    seen = 0
    for i, images in enumerate(_image_column(ds, limit)):
        if images is None or isinstance(images, (bytes, bytearray)):
            continue
        for item in images if isinstance(images, (list, tuple)) else [images]:
            path = image_source_path(item, base_dir=base_dir)
            if path is None:
                continue
            seen += 1
            if not os.path.isfile(path):
                raise ConfigError(
                    f"{section}: row {i} of {ds.path} names image {path}, which does not exist: "
                    f"fix the row's {ds.image_key!r} entry (a path is relative to the dataset file's "
                    f"folder) or remove the row (checked at start: the image paths of the first "
                    f"{limit} rows)")
    return seen


# Geometry3K's (and AReaL's / verl's) placeholder for where an image goes in the text.
IMAGE_PLACEHOLDER = "<image>"


def image_row(text: str, images: Any, *, base_dir: str | None, where: str) -> dict[str, Any]:
    """``{"messages", "images"}`` of a row with an images column: ``images`` the bytes
    (from bytes, paths relative to ``base_dir``, or ``{bytes, path}`` dicts), ``messages``
    one user turn whose parts put each image where the text says ``<image>`` (the
    Geometry3K format), or all images before the text when it names none."""
    from ..media.images import ImageError, read_image_source

    if isinstance(images, (bytes, str, dict)):
        images = [images]
    try:
        blobs = [read_image_source(item, base_dir=base_dir) for item in images]
    except ImageError as exc:
        raise ConfigError(f"dataset {where}: {exc}") from None
    pieces = text.split(IMAGE_PLACEHOLDER)
    if len(pieces) == 1:
        parts: list[dict[str, Any]] = [{"type": "image"} for _ in blobs]
        parts += [{"type": "text", "text": text}] if text else []
    elif len(pieces) - 1 != len(blobs):
        raise ConfigError(f"dataset {where}: the text has {len(pieces) - 1} {IMAGE_PLACEHOLDER} "
                          f"placeholder(s) but {len(blobs)} image(s); give one image per placeholder")
    else:
        parts = []
        for k, piece in enumerate(pieces):
            if piece:
                parts.append({"type": "text", "text": piece})
            if k < len(blobs):
                parts.append({"type": "image"})
    return {"messages": [{"role": "user", "content": parts}], "images": blobs,
            "prompt": text.replace(IMAGE_PLACEHOLDER, "")}
