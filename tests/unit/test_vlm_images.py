"""Images on the log by content address (media/, schemas/events.py ImageRef): the image
store (directory, URL schemes, S3 through boto3 when installed), the checks every image
passes (corrupt or truncated bytes, the pixel limit read from the header, formats, data
URLs only), the inline limit, and the wire: ImageRef's checks on decode and events
written before ``images`` existed decoding with none."""

from __future__ import annotations

import base64
import io

import orjson
import pytest

from tapioca.media.images import (
    ImageError,
    ImageRule,
    data_url,
    inspect_image,
    parse_image_url,
    read_image_source,
    ref_bytes,
    store_image,
)
from tapioca.media.store import FileImageStore, MissingImageError, open_image_store, sha256_hex
from tapioca.schemas.envelope import decode_event, encode_event
from tapioca.schemas.errors import ConfigError, SchemaError
from tapioca.schemas.events import ImageRef, PromptEvent, SampleEvent, SampleSequence, TrajectoryEvent


def png(width: int = 8, height: int = 6, colour=(200, 10, 10), fmt: str = "PNG") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buf, format=fmt)
    return buf.getvalue()


def test_file_store_is_content_addressed_idempotent_and_checked(tmp_path):
    store = FileImageStore(tmp_path / "images")
    data = png()
    name = store.put(data)
    assert name == sha256_hex(data) and len(name) == 64
    assert (tmp_path / "images" / name[:2] / name).read_bytes() == data
    assert store.put(data) == name  # a second put writes nothing new
    assert sorted(p.name for p in (tmp_path / "images").rglob("*") if p.is_file()) == [name]
    assert store.get(name) == data and store.has(name)
    missing = sha256_hex(b"never stored")
    assert not store.has(missing)
    with pytest.raises(MissingImageError, match="not in the image store"):
        store.get(missing)
    (tmp_path / "images" / name[:2] / name).write_bytes(b"tampered")
    with pytest.raises(MissingImageError, match="corrupted"):
        store.get(name)
    with pytest.raises(MissingImageError, match="not an image name"):
        store.get("../../etc/passwd")


def test_open_image_store_by_path_and_url(tmp_path):
    assert isinstance(open_image_store(str(tmp_path)), FileImageStore)
    by_url = open_image_store((tmp_path / "x").as_uri())
    assert isinstance(by_url, FileImageStore) and by_url.root == tmp_path / "x"
    with pytest.raises(ConfigError, match="unknown scheme"):
        open_image_store("ftp://host/images")
    with pytest.raises(ConfigError, match="no image store"):
        open_image_store("")


def test_s3_store_through_boto3(monkeypatch):
    boto3 = pytest.importorskip("boto3")
    moto = pytest.importorskip("moto")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with moto.mock_aws():
        boto3.client("s3").create_bucket(Bucket="runs")
        store = open_image_store("s3://runs/demo/images")
        data = png()
        name = store.put(data)
        key = f"demo/images/{name[:2]}/{name}"
        assert boto3.client("s3").get_object(Bucket="runs", Key=key)["Body"].read() == data
        assert store.has(name) and store.get(name) == data
        assert not store.has(sha256_hex(b"other"))
        with pytest.raises(MissingImageError):
            store.get(sha256_hex(b"other"))


def test_inspect_image_refuses_corrupt_truncated_oversized_and_unknown_images():
    assert inspect_image(png(8, 6)) == ("image/png", 8, 6)
    assert inspect_image(png(8, 6, fmt="JPEG"))[0] == "image/jpeg"
    with pytest.raises(ImageError, match="cannot be decoded"):
        inspect_image(b"\x89PNG\r\n\x1a\n not really a png")
    whole = png(64, 64, colour=(1, 2, 3))
    with pytest.raises(ImageError, match="cannot be decoded"):
        inspect_image(whole[: len(whole) // 2])  # truncated: the header alone is not enough
    with pytest.raises(ImageError, match="empty"):
        inspect_image(b"")
    # 4000 x 4000 = 16,000,000 pixels > 1,000,000: refused from the header, before decoding.
    with pytest.raises(ImageError, match="16,000,000 pixels, over vlm.max_image_pixels=1,000,000"):
        inspect_image(png(4000, 4000), ImageRule(max_pixels=1_000_000))
    # Other formats: only the accepted formats' parsers ever see the bytes.
    with pytest.raises(ImageError, match="cannot be decoded as PNG, JPEG, WebP, GIF or BMP"):
        inspect_image(png(4, 4, fmt="TIFF"))


def test_store_image_inlines_only_small_images(tmp_path):
    store = FileImageStore(tmp_path)
    small = png(4, 4)
    ref = store_image(small, store, inline_max_bytes=len(small))
    assert (ref.sha256, ref.mime, ref.width, ref.height) == (sha256_hex(small), "image/png", 4, 4)
    assert base64.b64decode(ref.data_b64) == small
    assert store.has(ref.sha256)  # inline images are stored too
    big = store_image(small, store, inline_max_bytes=len(small) - 1)
    assert big.data_b64 == "" and ref_bytes(big, store) == small
    assert ref_bytes(ref, None) == small  # the inline copy needs no store
    with pytest.raises(MissingImageError, match="no image store"):
        ref_bytes(big, None)
    forged = ImageRef(sha256=sha256_hex(b"x"), data_b64=ref.data_b64)
    with pytest.raises(MissingImageError, match="hash to"):
        ref_bytes(forged, None)


def test_image_urls_are_data_urls_only():
    data = png()
    assert parse_image_url(data_url(data, "image/png")) == data
    for url in ("http://example.com/cat.png", "HTTPS://example.com/cat.png"):
        with pytest.raises(ImageError, match="not fetched: a run must not depend on a third party"):
            parse_image_url(url)
    with pytest.raises(ImageError, match="must be base64"):
        parse_image_url("data:image/png,rawbytes")
    with pytest.raises(ImageError, match="invalid base64"):
        parse_image_url("data:image/png;base64,!!!")
    with pytest.raises(ImageError, match="must be a data: URL"):
        parse_image_url("file:///etc/passwd")


def test_dataset_image_sources(tmp_path):
    data = png()
    (tmp_path / "a.png").write_bytes(data)
    assert read_image_source("a.png", base_dir=str(tmp_path)) == data
    assert read_image_source(data) == data
    assert read_image_source({"bytes": data, "path": None}) == data
    assert read_image_source({"bytes": None, "path": str(tmp_path / "a.png")}) == data
    with pytest.raises(ImageError, match="cannot read image"):
        read_image_source("missing.png", base_dir=str(tmp_path))


def _trajectory(**kw) -> TrajectoryEvent:
    return TrajectoryEvent(traj_id="g:0", group_id="g", prompt_id="p", sample_index=0, group_size=1,
                           prompt_ids=[1, 2], output_ids=[3], output_logprobs=[-0.5], output_versions=[0],
                           **kw)


def test_events_carry_image_refs_and_decode_checks_them():
    ref = ImageRef(sha256="a" * 64, mime="image/png", width=56, height=56)
    for event in (_trajectory(images=[ref]),
                  PromptEvent(group_id="g", prompt_id="p", group_index=0, n_samples=1, prompt_ids=[1],
                              images=[ref]),
                  SampleEvent(group_id="g", prompt_id="p", prompt_ids=[1], sequences=[SampleSequence(
                      traj_id="g:0", output_ids=[2], behav_logprobs=[-1.0], output_versions=[0], reward=1.0,
                      advantage=0.0, images=[ref])])):
        back = decode_event(encode_event(event))
        assert back == event
    raw = orjson.loads(encode_event(_trajectory(images=[ref])))
    raw["images"][0]["sha256"] = "not-a-hash"
    with pytest.raises(SchemaError, match="not 64 lowercase hex"):
        decode_event(orjson.dumps(raw))
    raw["images"][0]["sha256"] = "a" * 64
    raw["images"][0]["width"] = "wide"
    with pytest.raises(SchemaError, match="width"):
        decode_event(orjson.dumps(raw))


def test_events_written_before_images_existed_decode_with_none():
    # An archived trajectory / sample of the older schema: no "images" field at all.
    old = orjson.loads(encode_event(_trajectory()))
    del old["images"]
    assert decode_event(orjson.dumps(old)).images == []
    sample = orjson.loads(encode_event(SampleEvent(group_id="g", prompt_id="p", prompt_ids=[1], sequences=[
        SampleSequence(traj_id="g:0", output_ids=[2], behav_logprobs=[-1.0], output_versions=[0], reward=1.0,
                       advantage=0.0)])))
    del sample["sequences"][0]["images"]
    assert decode_event(orjson.dumps(sample)).sequences[0].images == []
