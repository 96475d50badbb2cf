"""Data with images (tasks/visual.py, tasks/datasets.py, producers/feeder.py): the
synthetic visual task's images and verifiable answers, dataset rows with an ``images``
column in JSONL (paths) and Parquet (bytes), the Geometry3K row format (``<image>`` in the
text), and prompt records carrying stored references with expanded placeholders."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from tapioca.config.schema import DatasetConfig
from tapioca.media.store import FileImageStore, sha256_hex
from tapioca.models.factory import load_model_and_tokenizer, save_tiny_checkpoint
from tapioca.models.tokenizer import prompt_encoder
from tapioca.models.vision import VisionPrompts
from tapioca.producers.feeder import tokenize_records
from tapioca.schemas.errors import ConfigError
from tapioca.tasks.base import get_task, task_reward
from tapioca.tasks.datasets import dataset_rows
from tapioca.tasks.visual import COLOURS, VISUAL_ALPHABET


def _pixels(data: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def _png(colour=(10, 20, 30), size=(16, 12)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


def test_visual_color_task_answers_are_what_the_image_shows():
    task = get_task("visual", n_images=30)
    records = list(task.iter_records("train", seed=0))
    assert len(records) == 30 and len({r["prompt_id"] for r in records}) == 30
    answers = set()
    for r in records:
        (png,) = r["images"]
        px = _pixels(png).reshape(-1, 3)
        coloured = px[(px != 255).any(-1)]
        # Every non-white pixel is the colour the answer names (1 red, 2 green, 3 blue).
        assert (coloured == COLOURS[int(r["answer"]) - 1]).all()
        assert r["messages"][0]["content"][0] == {"type": "image"}
        answers.add(r["answer"])
        assert task.reward(r["answer"] + "<eos>", r) == 1.0
        assert task.reward("0<eos>", r) == 0.0
    assert answers == {"1", "2", "3"}
    again = list(get_task("visual", n_images=30).iter_records("train", seed=0))
    assert [r["images"] for r in again] == [r["images"] for r in records]  # deterministic
    assert task_reward("visual")("2<eos>", "2") == 1.0


def test_visual_count_task_counts_squares():
    for r in get_task("visual", op="count", n_images=12).iter_records("train", seed=1):
        px = _pixels(r["images"][0])
        cells = [px[y:y + 28, x:x + 28] for y in (0, 28) for x in (0, 28)]
        filled = sum((c != 255).any(-1).any() for c in cells)
        assert str(filled) == r["answer"]


def test_jsonl_rows_with_image_paths_and_geometry3k_placeholders(tmp_path):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(_png((1, 2, 3)))
    (tmp_path / "imgs" / "b.png").write_bytes(_png((4, 5, 6)))
    rows = [{"problem": "<image>Find x in the triangle.", "answer": "3", "images": ["imgs/a.png"]},
            {"problem": "Compare <image> and <image>.", "answer": "left", "images": ["imgs/a.png", "imgs/b.png"]},
            {"problem": "No placeholder here.", "answer": "1", "images": ["imgs/b.png"]},
            {"problem": "Text only", "answer": "2"}]
    path = tmp_path / "geo.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    ds = DatasetConfig(type="jsonl", path=str(path), prompt_key="problem")
    task, out = dataset_rows(ds, 0)
    out = list(out)
    assert task == "math" and len(out) == 4
    assert out[0]["messages"][0]["content"] == [{"type": "image"}, {"type": "text", "text": "Find x in the triangle."}]
    assert out[1]["messages"][0]["content"] == [
        {"type": "text", "text": "Compare "}, {"type": "image"}, {"type": "text", "text": " and "},
        {"type": "image"}, {"type": "text", "text": "."}]
    assert out[1]["images"] == [_png((1, 2, 3)), _png((4, 5, 6))]
    assert out[2]["messages"][0]["content"][0] == {"type": "image"}  # images before the text
    assert "images" not in out[3] and out[3]["prompt"] == "Text only"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"problem": "<image> <image>", "answer": "1", "images": ["imgs/a.png"]}))
    with pytest.raises(ConfigError, match="2 <image> placeholder"):
        list(dataset_rows(DatasetConfig(type="jsonl", path=str(bad), prompt_key="problem"), 0)[1])


def test_parquet_rows_with_image_bytes_as_datasets_writes_them(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    table = pa.table({"problem": ["<image>What is the angle?"], "answer": ["60"],
                      "images": pa.array([[{"bytes": _png(), "path": None}]], type=pa.list_(image))})
    path = tmp_path / "geometry3k.parquet"
    pq.write_table(table, path)
    _, rows = dataset_rows(DatasetConfig(type="parquet", path=str(path), prompt_key="problem"), 0)
    (row,) = list(rows)
    assert row["images"] == [_png()] and row["prompt"] == "What is the angle?"


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("vl") / "m", arch="qwen2_5_vl", alphabet=VISUAL_ALPHABET)


def test_prompt_records_carry_stored_references_and_expanded_placeholders(vl_dir, tmp_path):
    _, tokenizer = load_model_and_tokenizer(vl_dir)
    store = FileImageStore(tmp_path / "images")
    vp = VisionPrompts(vl_dir, tokenizer, store, max_pixels=10**6, inline_max_bytes=4096)
    rows = list(get_task("visual", n_images=4).iter_records("train", 0))
    records = tokenize_records(rows, vp.encode, "visual")
    image_pad = vp.spec.image_token_id
    for row, rec in zip(rows, records):
        (ref,) = rec.images
        assert ref.sha256 == sha256_hex(row["images"][0]) and store.get(ref.sha256) == row["images"][0]
        assert (ref.width, ref.height, ref.mime) == (56, 56, "image/png") and ref.data_b64
        # 56 x 56 -> a 4 x 4 grid of 14-pixel patches -> 4 merged tokens.
        assert rec.prompt_ids.count(image_pad) == 4
        assert "images" not in rec.task_data and rec.task_data["answer"] == row["answer"]
    # A text model cannot read a row with images: refused at start, naming the row.
    text_dir = save_tiny_checkpoint(tmp_path / "text", alphabet=VISUAL_ALPHABET)
    with pytest.raises(ConfigError, match="has images but the model reads none"):
        tokenize_records(rows[:1], prompt_encoder(load_model_and_tokenizer(text_dir)[1]), "visual")
    # An image over vlm.max_image_pixels: refused with the row named.
    small = VisionPrompts(vl_dir, tokenizer, store, max_pixels=100, inline_max_bytes=0)
    with pytest.raises(ConfigError, match=r"row visual-color-\d+: .*over vlm.max_image_pixels=100"):
        tokenize_records(rows[:1], small.encode, "visual")


def test_a_vision_language_policy_refuses_what_would_train_its_tokens_without_images():
    """The vlm_* rows of config/features.py: each combination is refused at load with its way out."""
    import pytest

    from tapioca.config.loader import load_config
    from tapioca.config.schema import TrainConfig
    from tapioca.schemas.errors import ConfigError

    vl = ["model.arch=qwen2_5_vl", "train_dataset.type=visual"]
    load_config(TrainConfig, None, vl)  # the tiny VL run itself loads
    for extra, way_out in (
        (["actor.enable_tree_training=true"], "enable_tree_training=false"),
        (["fsdp.world_size=2", "fsdp.tensor_parallel_size=2"], "tensor_parallel_size=1"),
        (["fsdp.world_size=2"], "fsdp.world_size=1"),
        (["rollout.return_routed_experts=true"], "router_replay=disabled"),
    ):
        with pytest.raises(ConfigError, match=way_out):
            load_config(TrainConfig, None, vl + extra)
