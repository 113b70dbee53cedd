"""`ringfeed shard --format imagefolder` (shards/sources/imagefolder.py): classes from folders,
split folders, which files are images and under which member extension, what is skipped (or
fatal with --strict), keys from paths, and each sample's planned tar bytes."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from tar_util import member_bytes

from ringfeed.errors import UserError
from ringfeed.shards.options import ShardOptions
from ringfeed.shards.sources.imagefolder import ImageFolder


def image(path: Path, fmt: str = "PNG", side: int = 6) -> Path:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    Image.new("RGB", (side, side), (side, 0, 0)).save(buf, format=fmt)
    path.write_bytes(buf.getvalue())
    return path


def scan(src: Path, strict: bool = False) -> ImageFolder:
    return ImageFolder(ShardOptions(src=src, out=src.parent / "out", format="imagefolder",
                                    strict=strict))


def test_class_folders_become_ids_in_name_order_and_files_samples(tmp_path):
    src = tmp_path / "src"
    image(src / "dog" / "b.png")
    image(src / "cat" / "sub" / "x.jpg", "JPEG")
    image(src / "dog" / "a.png", side=9)
    source = scan(src)
    assert source.class_names == ["cat", "dog"]
    part = source.parts["train"]
    assert list(part.keys) == ["cat_sub_x", "dog_a", "dog_b"] and part.labels.tolist() == [0, 1, 1]
    assert source.fields == {"jpg": "image", "png": "image", "cls": "int"}
    sample = source.sample("train", 1)
    assert sample["png"] == (src / "dog" / "a.png").read_bytes() and sample["cls"] == b"1"
    assert [member_bytes(source.sample("train", i)) for i in range(3)] == part.sizes.tolist()


def test_split_folders_holding_class_folders_are_splits_sharing_the_class_ids(tmp_path):
    src = tmp_path / "src"
    image(src / "train" / "cat" / "a.png")
    image(src / "train" / "dog" / "a.png")
    image(src / "val" / "dog" / "v.png")
    source = scan(src)
    assert list(source.parts) == ["train", "val"] and source.class_names == ["cat", "dog"]
    assert source.parts["val"].labels.tolist() == [1]


@pytest.mark.parametrize("name, fmt, ext", [
    ("a.jpeg", "JPEG", "jpg"), ("a.JPG", "JPEG", "jpg"), ("a.tif", "TIFF", "tiff"),
    ("a.png", "JPEG", "png"),  # a misnamed file keeps its own name: decoders sniff the bytes
    ("a.image", "PNG", "png"), ("noext", "GIF", "gif"), ("a.bmp", "BMP", "bmp"),
])
def test_the_member_extension_is_the_files_own_else_its_formats(tmp_path, name, fmt, ext):
    image(tmp_path / "src" / "c" / name, fmt)
    source = scan(tmp_path / "src")
    assert list(source.fields) == [ext, "cls"]
    assert ext in source.sample("train", 0)


def test_files_that_are_not_images_or_not_in_a_class_folder_are_skipped_and_listed(tmp_path):
    src = tmp_path / "src"
    image(src / "cat" / "a.png")
    (src / "cat" / "notes.txt").write_text("hello")
    (src / "cat" / ".hidden.png").write_bytes(b"x")
    (src / "stray.png").write_bytes(b"x")
    source = scan(src)
    assert sorted((Path(s["path"]).name, s["reason"]) for s in source.skipped) == [
        ("notes.txt", "not an image (PIL cannot identify it)"),
        ("stray.png", "not inside a class folder")]
    assert len(source.parts["train"]) == 1
    with pytest.raises(UserError, match=r"stray.png: not inside a class folder; 2 file\(s\) "
                                        r"cannot be used \(remove them, or drop --strict"):
        scan(src, strict=True)


def test_two_files_that_become_one_key_are_named_both(tmp_path):
    src = tmp_path / "src"
    image(src / "cat" / "a b.png")
    image(src / "cat" / "a_b.jpg", "JPEG")
    with pytest.raises(UserError, match=r"cat/a b.png and cat/a_b.jpg both become sample key "
                                        r"'cat_a_b'"):
        scan(src)


@pytest.mark.parametrize("layout, message", [
    ("file", r"a.png: not a folder \(imagefolder expects SRC/<class>/<image files>\)"),
    ("empty classes", "no image files found"),
    ("only junk", "no usable image files"),
])
def test_a_source_without_images_is_one_line(tmp_path, layout, message):
    src = tmp_path / "src"
    if layout == "file":
        src = image(tmp_path / "a.png")
    else:
        (src / "cat").mkdir(parents=True)
        if layout == "only junk":
            (src / "cat" / "x.txt").write_text("x")
    with pytest.raises(UserError, match=message):
        scan(src)


def test_an_image_changed_since_the_scan_stops_the_write(tmp_path):
    path = image(tmp_path / "src" / "cat" / "a.png")
    source = scan(tmp_path / "src")
    image(path, side=40)
    with pytest.raises(UserError, match="changed while sharding .*run the same command again"):
        source.sample("train", 0)
