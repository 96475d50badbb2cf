"""A dataset whose rows name image files that do not exist is refused at start (issue 38
item 2): tasks/datasets.py ``check_image_paths`` (the first IMAGE_CHECK_ROWS rows, paths
stat'ed, nothing opened), called by runtime/run.py before the run directory or the model
is made; `tapioca train` exits 78 with one line before any role or broker starts."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from tapioca.config.loader import load_config
from tapioca.config.schema import DatasetConfig, TrainConfig
from tapioca.media.images import image_source_path
from tapioca.runtime.run import check_dataset_files, check_datasets, resolve_run
from tapioca.schemas.errors import ConfigError
from tapioca.tasks.datasets import check_dataset_file, check_image_paths

TAPIOCA = str(Path(sys.executable).parent / "tapioca")
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PNG = bytes.fromhex("89504e470d0a1a0a")  # only stat'ed: the bytes are never decoded here


def dataset(tmp_path: Path, images: list, *, name: str = "ds.jsonl") -> Path:
    (tmp_path / "img").mkdir(exist_ok=True)
    (tmp_path / "img" / "ok.png").write_bytes(PNG)
    path = tmp_path / name
    path.write_bytes(b"".join(orjson.dumps({"question": f"q{i} <image>", "answer": "1", "images": im}) + b"\n"
                              for i, im in enumerate(images)))
    return path


def test_the_path_an_images_entry_names():
    assert image_source_path("a.png", base_dir="/d") == "/d/a.png"
    assert image_source_path("/abs/a.png", base_dir="/d") == "/abs/a.png"
    assert image_source_path({"bytes": None, "path": "a.png"}, base_dir="/d") == "/d/a.png"
    # Entries that carry their bytes name no file to look for.
    for item in (b"\x89PNG", {"bytes": b"\x89PNG", "path": "a.png"}, "data:image/png;base64,AAAA", "", None, 3):
        assert image_source_path(item, base_dir="/d") is None


def test_a_missing_image_is_refused_naming_the_row_the_path_and_the_fix(tmp_path):
    path = dataset(tmp_path, [["img/ok.png"], [{"bytes": None, "path": "img/ok.png"}], None,
                              [{"bytes": "eA==", "path": "img/not-needed.png"}, "img/ok.png"],
                              ["img/ok.png", "img/gone.png"]])
    ds = DatasetConfig(type="jsonl", path=str(path), prompt_key="question")
    with pytest.raises(ConfigError) as err:
        check_image_paths(ds)
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(f"train_dataset: row 4 of {path} names image {tmp_path / 'img' / 'gone.png'}, "
                          "which does not exist: fix the row's 'images' entry")
    assert "first 10000 rows" in msg
    with pytest.raises(ConfigError, match="^valid_dataset: row 4"):
        check_image_paths(ds, section="valid_dataset")
    # Only the first `limit` rows are looked at (the feeder reads the rest as it goes).
    assert check_image_paths(ds, limit=4) == 3


def test_datasets_without_image_files_pass(tmp_path):
    assert check_image_paths(DatasetConfig(type="visual")) == 0  # built-in: drawn, not read
    assert check_image_paths(DatasetConfig(type="jsonl", path=str(tmp_path / "nowhere.jsonl"))) == 0
    text = tmp_path / "text.jsonl"
    text.write_text('{"question": "1+1", "answer": "2"}\n')
    assert check_image_paths(DatasetConfig(type="jsonl", path=str(text))) == 0


def test_a_parquet_dataset_reads_its_images_column_only(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "ok.png").write_bytes(PNG)
    struct = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    table = pa.table({"problem": ["a", "b", "c"], "images": pa.array(
        [[{"bytes": PNG, "path": "img/inline.png"}], [{"bytes": None, "path": "img/ok.png"}],
         [{"bytes": None, "path": "img/gone.png"}]], type=struct)})
    pq.write_table(table, tmp_path / "geo.parquet")
    ds = DatasetConfig(type="parquet", path=str(tmp_path / "geo.parquet"), prompt_key="problem")
    with pytest.raises(ConfigError, match=r"row 2 of .*geo\.parquet names image .*img/gone\.png"):
        check_image_paths(ds)
    assert check_image_paths(ds, limit=2) == 1
    pq.write_table(table.drop_columns(["images"]), tmp_path / "text.parquet")
    assert check_image_paths(DatasetConfig(type="parquet", path=str(tmp_path / "text.parquet"))) == 0


def _vl_config(tmp_path: Path, path: Path, *extra: str) -> TrainConfig:
    return load_config(TrainConfig, EXAMPLES / "vlm" / "color_cpu.yaml", [
        f"run_dir={tmp_path / 'runs'}", "trial_name=t", "train_dataset.type=jsonl",
        f"train_dataset.path={path}", "train_dataset.prompt_key=question", *extra])


def test_resolve_run_refuses_before_it_makes_the_run_directory_or_the_model(tmp_path):
    path = dataset(tmp_path, [["img/ok.png"], ["img/gone.png"]])
    with pytest.raises(ConfigError, match="row 1 of .* names image .*gone.png"):
        resolve_run(_vl_config(tmp_path, path), prepare=True)
    assert not (tmp_path / "runs").exists()
    # The valid dataset only when the evaluator reads it.
    good = dataset(tmp_path, [["img/ok.png"]], name="good.jsonl")
    valid = ["valid_dataset.type=jsonl", f"valid_dataset.path={path}", "valid_dataset.prompt_key=question"]
    check_datasets(_vl_config(tmp_path, good, *valid))
    with pytest.raises(ConfigError, match="^valid_dataset: row 1"):
        check_datasets(_vl_config(tmp_path, good, *valid, "evaluator.freq_steps=10"))


def test_tapioca_train_with_a_missing_image_exits_78_at_once_with_one_line(tmp_path):
    path = dataset(tmp_path, [["img/ok.png"], ["img/gone.png"]])
    env = {**os.environ, "TAPIOCA_HOME": str(tmp_path / "home"), "COLUMNS": "200"}
    env.pop("TAPIOCA_BOOTSTRAP", None)
    t0 = time.monotonic()
    done = subprocess.run(
        [TAPIOCA, "train", "--config", str(EXAMPLES / "vlm" / "color_cpu.yaml"), f"run_dir={tmp_path / 'runs'}",
         "trial_name=t", "train_dataset.type=jsonl", f"train_dataset.path={path}",
         "train_dataset.prompt_key=question"], env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - t0
    assert done.returncode == 78, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    assert errors[0].startswith(f"error: train_dataset: row 1 of {path} names image "), errors[0]
    assert not (tmp_path / "runs").exists()  # no run directory, no model, no broker, no role
    assert elapsed < 60, elapsed  # the interpreter's start and imports; before: 30-67 s, then exit 1


def test_a_dataset_file_that_is_not_there_is_refused_at_start_naming_the_section(tmp_path):
    gone = tmp_path / "nope.jsonl"
    with pytest.raises(ConfigError, match=r"^train_dataset\.path: dataset .*nope\.jsonl does not exist") as err:
        check_dataset_files(_vl_config(tmp_path, gone))
    assert "\n" not in str(err.value) and "examples/data/gsm8k" in str(err.value)
    good = dataset(tmp_path, [["img/ok.png"]], name="good.jsonl")
    valid = ["valid_dataset.type=jsonl", f"valid_dataset.path={gone}", "valid_dataset.prompt_key=question"]
    check_dataset_files(_vl_config(tmp_path, good, *valid))  # the evaluator is off: not read, not checked
    with pytest.raises(ConfigError, match=r"^valid_dataset\.path: dataset .*nope\.jsonl does not exist"):
        check_dataset_files(_vl_config(tmp_path, good, *valid, "evaluator.freq_steps=10"))
    # A Ray cluster's roles read the data on its nodes: not checked here.
    check_dataset_files(_vl_config(tmp_path, gone, "scheduler.type=ray", "scheduler.ray_address=10.0.0.1:6379"))
    # `tapioca train-offline` reads the archive: resolving its run does not check the file.
    resolve_run(_vl_config(tmp_path, gone), prepare=True)
    # gsm8k with a path is a file too; without one it is the copy in examples/data.
    with pytest.raises(ConfigError, match=r"^train_dataset\.path: dataset .*nope\.jsonl does not exist"):
        check_dataset_file(DatasetConfig(type="gsm8k", path=str(gone)))
    check_dataset_file(DatasetConfig(type="gsm8k"))
    check_dataset_file(DatasetConfig(type="synthetic"))


def test_tapioca_train_with_a_dataset_file_that_is_not_there_exits_78_at_once_with_one_line(tmp_path):
    env = {**os.environ, "TAPIOCA_HOME": str(tmp_path / "home"), "COLUMNS": "200"}
    env.pop("TAPIOCA_BOOTSTRAP", None)
    done = subprocess.run(
        [TAPIOCA, "train", "--config", str(EXAMPLES / "demo_cpu.yaml"), f"run_dir={tmp_path / 'runs'}",
         "trial_name=t", "train_dataset.type=jsonl", f"train_dataset.path={tmp_path / 'nope.jsonl'}",
         "train_dataset.prompt_key=question"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 78, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    assert errors[0].startswith("error: train_dataset.path: dataset "), errors[0]
    assert not (tmp_path / "runs").exists()  # no run directory, no model, no broker, no role
