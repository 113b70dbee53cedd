"""`ringfeed train` on photos (issue 45): each split gets its augmentation (data.augment for
train, data.val_augment or torchvision's eval preset for val) and the run's seed; a real photo
folder (RGB, grey and CMYK JPEGs, a PNG under a .JPEG name) trains in both frameworks, every
image converted to the channel count of the train split's first image; a run with random
crops and flips resumes to the weights of the uninterrupted run, bit for bit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from fault_util import assert_same_torch_state, torch_final
from helpers import BIN, horovodrun, ringfeed
from test_augment import jpeg, photo, png
from train_util import write_config

from ringfeed.pipeline import ShardPipeline
from ringfeed.pipeline.augment import default_val_augment
from ringfeed.train.cli import main
from ringfeed.train.config import load_config, template
from ringfeed.train.data import make_pipeline, run_channels

TRAIN = ["random_resized_crop", "horizontal_flip"]
# per class, in file order: the first image is colour; images 4-7 are grey, so with 2 ranks,
# batches of 2 and no shuffle, the last two batches of each rank hold grey images only
LAYOUT = ["RGB", "L", "CMYK", "PNG", "L", "L", "L", "L"]


def photo_folder(root: Path, layout: list[str]) -> Path:
    """SRC/{train,val}/{a,b}/<i>.JPEG, tiny photos of 20-27 x 17-24 pixels in `layout`'s
    modes ("PNG": an RGB PNG under the .JPEG name, as ImageNet has one)."""
    for split in ("train", "val"):
        for c, cls in enumerate("ab"):
            folder = root / split / cls
            folder.mkdir(parents=True)
            for i, mode in enumerate(layout):
                pixels = photo(20 + i, 24 - i, seed=10 * c + i)
                data = png(pixels) if mode == "PNG" else jpeg(pixels, None if mode == "RGB"
                                                              else mode)
                (folder / f"{i}.JPEG").write_bytes(data)
    return root


def shard(src: Path, out: Path) -> Path:
    assert main(["shard", str(src), str(out), "--format", "imagefolder", "--no-progress"]) == 0
    return out


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    """The photo folder, sharded with `ringfeed shard --format imagefolder`."""
    root = tmp_path_factory.mktemp("photos")
    return shard(photo_folder(root / "src", LAYOUT), root / "shards")


def run_config(tmp_path: Path, shards: Path, name: str, **sections) -> Path:
    cfg = {"model": {"name": "cnn", "args": {"width": 4, "hidden": 8}},
           "data": {"train": str(shards), "batch_size": 2, "image_size": 16},
           "train": {"epochs": 1, "log_every": 1},
           "output": {"dir": str(tmp_path / name), "loggers": []}}
    for section, values in sections.items():
        cfg[section] = {**cfg.get(section, {}), **values} if isinstance(values, dict) else values
    return write_config(tmp_path / f"{name}.yaml", **cfg)


# -- the config: each split's stages, one line for a bad one -------------------------------
def test_each_split_gets_its_augmentation_and_the_runs_seed(photos, tmp_path):
    cfg_file = run_config(tmp_path, photos, "c", data={"augment": TRAIN},
                          train={"seed": 7})
    cfg = load_config(cfg_file)
    train, val = cfg.to_pipeline_config("train"), cfg.to_pipeline_config("val")
    assert (train.augment, train.seed, train.shuffle) == (TRAIN, 7, True)
    eval_preset = default_val_augment(TRAIN, 16)
    assert val.augment == eval_preset == [{"resize": {"shorter": 18}}, "center_crop"]
    assert val.seed == 7 and not val.shuffle
    own = load_config(cfg_file, ["data.val_augment=[center_crop]"]).to_pipeline_config("val")
    assert own.augment == ["center_crop"]
    plain = load_config(cfg_file, ["data.augment=null"])
    assert plain.to_pipeline_config("val").augment is None  # no crop: nothing to undo
    assert plain.to_pipeline_config("train").seed == 7  # the order's seed, as before


def test_print_config_shows_the_augmentation_keys_with_their_defaults():
    data = yaml.safe_load(template())["data"]
    assert {k: data[k] for k in ("augment", "val_augment", "channels", "cache_short_side")} \
        == dict.fromkeys(("augment", "val_augment", "channels", "cache_short_side"))


@pytest.mark.parametrize("item, says", [
    ("[random_resized_crop, {horizontal_flop: {}}]",
     "data.augment: augment[1]: 'horizontal_flop' is not a stage"),
    ("[{random_resized_crop: {scale: [0.9, 0.1]}}]", "data.augment: augment[0]"),
])
def test_a_bad_augment_item_is_one_line_naming_data_augment(photos, tmp_path, capsys, item,
                                                             says):
    code = main(["train", str(run_config(tmp_path, photos, "bad")), "--set",
                 f"data.augment={item}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and says in err, err


# -- the channel count: 3 unless the train split's first images are all grey, for both splits --
@pytest.mark.integration
def test_every_batch_has_the_first_images_channel_count(photos, tmp_path):
    cfg = load_config(run_config(tmp_path, photos, "c", data={"shuffle": False}))
    assert run_channels(cfg) == 3
    as_decoded = []
    for split in ("train", "val"):
        for rank in (0, 1):
            pipe = make_pipeline(cfg, split, rank, 2)
            assert {b["jpg"].shape[1:] for b in pipe} == {(16, 16, 3)}, (split, rank)
            raw = ShardPipeline(str(photos), pipe.config, rank=rank, world_size=2,
                                channels=None)
            as_decoded += [b["jpg"].shape[-1] for b in raw]
    assert 1 in as_decoded and 3 in as_decoded  # the folder does have grey-only batches
    for sets, expected in [(["data.channels=1"], 1), (["data.augment=[horizontal_flip]"], 3),
                           (["data.val_augment=[center_crop]"], 3)]:
        assert run_channels(load_config(run_config(tmp_path, photos, "c"), sets)) == expected


@pytest.mark.integration
def test_a_grey_first_image_keeps_a_colour_set_in_colour_and_a_grey_set_stays_grey(tmp_path):
    shards = shard(photo_folder(tmp_path / "src", ["L", *LAYOUT[1:]]), tmp_path / "shards")
    cfg = load_config(run_config(tmp_path, shards, "first-grey"))
    assert run_channels(cfg) == 3
    assert {b["jpg"].shape[-1] for b in make_pipeline(cfg, "train", 0, 1)} == {3}
    shards = shard(photo_folder(tmp_path / "grey", ["L"] * 8), tmp_path / "grey-shards")
    cfg = load_config(run_config(tmp_path, shards, "grey"))
    assert run_channels(cfg) == 1
    assert {b["jpg"].shape[-1] for b in make_pipeline(cfg, "train", 0, 1)} == {1}


# -- the photo folder in both frameworks, 2 ranks -------------------------------------------
@pytest.mark.system
@pytest.mark.timeout(300)
@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_a_photo_folder_trains_on_two_ranks(photos, tmp_path, framework):
    """Grey-only batches at steps 3 and 4 of each rank, in training and validation: today's
    crash was torch's conv on a 1-channel batch and TF's fixed batch shape."""
    cfg = run_config(tmp_path, photos, "run", framework=framework, data={"shuffle": False})
    res = horovodrun(2, [BIN / "ringfeed", "train", cfg], timeout=240)
    assert res.returncode == 0, res.output[-4000:]
    assert "classify on jpg (16, 16, 3)" in res.output, res.output[-4000:]
    done = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert done["status"] == "finished" and done["step"] == 4 and "accuracy" in done["val"]


# -- resume with random crops and flips ------------------------------------------------------
@pytest.mark.system
@pytest.mark.timeout(300)
def test_an_augmented_run_resumes_to_the_uninterrupted_weights(photos, tmp_path):
    """A sample's crop and flip come from (train.seed, epoch, key): the run resumed at step 6
    (mid-epoch) trains steps 7-10 (into the next epoch, new crops) on exactly the pixels of
    the uninterrupted run. (A random crop in a user transform moved the weights by 1.62.)

    Promise: What is lost on a crash (train/RECOVERY.md)."""
    def cfg(name: str) -> Path:
        return run_config(tmp_path, photos, name, data={"augment": TRAIN, "val_split": None},
                          train={"epochs": None, "max_steps": 10},
                          checkpoint={"every_steps": 6, "keep": 5})

    # (processes of their own: a fork would hang where an earlier test of this worker
    # initialised Horovod in-process)
    full = ringfeed("train", str(cfg("full")), timeout=240)
    assert full.returncode == 0, full.output[-3000:]
    again = cfg("again")
    shutil.copytree(tmp_path / "full" / "checkpoints" / "ckpt-000000006",
                    tmp_path / "again" / "checkpoints" / "ckpt-000000006")
    res = ringfeed("train", str(again), "--resume", "auto", timeout=240)
    assert res.returncode == 0 and "at step 6" in res.output, res.output[-3000:]
    assert_same_torch_state(torch_final(tmp_path / "full", 10),
                            torch_final(tmp_path / "again", 10))
