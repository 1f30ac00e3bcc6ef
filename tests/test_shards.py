"""An image folder converted to litdata shards (``python -m runner.shards``) and trained from: the oracle is
the folder itself, read by torchvision's ImageFolder and by the runner's folder DataModule. The shards must
hold its files' bytes and labels, and give its batches bit for bit (both decode paths, CPU tensors), its
unreadable files' reports and its exact resume."""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import shlex
import shutil
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra.utils import instantiate
from image_helpers import SIZE
from PIL import Image
from torchvision.datasets import ImageFolder

pytest.importorskip("litdata", reason="the shards extra: pip install -e '.[shards]'")

from lightning_helpers import ROOT, compose_train  # noqa: E402

from lightning_fusedsgd.lightning import ConfigError  # noqa: E402
from runner import shards  # noqa: E402
from runner.data import ImageFolderDataModule  # noqa: E402
from runner.files import EncodedFolder, UnreadableImage, jpeg_size  # noqa: E402
from runner.jpeg_folder import make_jpeg_folder  # noqa: E402
from runner.shard_files import ImageShardsDataModule, ShardedFiles  # noqa: E402

CHUNK = "150KB"  # about two of the generated JPEGs a chunk: several chunks from each of two workers


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """3 classes of 4 training and 2 validation JPEGs, with a grayscale and a PNG named .JPEG (decoded by
    the workers either way), an empty file (no decoder reads it) and a link to a missing file (not read; its
    name not ASCII, stored in UTF-8 before the reason)."""
    root = make_jpeg_folder(tmp_path_factory.mktemp("folder"), classes=3, train=4, val=2)
    source = Image.open(root / "train" / "class_000" / "00000.JPEG")
    source.convert("L").save(root / "train" / "class_001" / "gray.JPEG", "JPEG")
    source.save(root / "train" / "class_001" / "png.JPEG", "PNG")
    (root / "train" / "class_002" / "empty.JPEG").write_bytes(b"")
    (root / "train" / "class_002" / "lié.JPEG").symlink_to(root / "moved.JPEG")
    return root


@pytest.fixture(scope="module")
def converted(folder, tmp_path_factory):
    """Converted from inside the folder (``--from .``), where each sample's relative path names a file."""
    out = tmp_path_factory.mktemp("shards") / "out"
    here = os.getcwd()
    os.chdir(folder)
    try:
        counts = shards.convert(out, ".", workers=2, chunk_bytes=CHUNK)
    finally:
        os.chdir(here)
    return out, counts


def test_the_conversions_hint_composes_a_run_on_the_shards_from_any_directory(
    folder, converted, tmp_path, monkeypatch
):
    """The command the conversion ends with: train.py by its path, the shards' absolute root and their class
    count (ImageFolder's), so that the run it composes, from another directory, sets up on them."""
    monkeypatch.chdir(tmp_path)
    python, script, *overrides = shlex.split(shards.train_command(os.path.relpath(converted[0]), folder))
    assert (python, script) == ("python", str(ROOT / "train.py"))
    assert f"data.num_classes={len(ImageFolder(folder / 'train').classes)}" in overrides
    module = instantiate(compose_train([*overrides, "debug=tiny"], tmp_path / "run").data)
    module.setup("fit")
    assert len(module.train_dataloader().dataset) == len(ImageFolder(folder / "train"))


def test_the_shards_hold_the_folders_files_labels_and_unreadable_reasons(folder, converted):
    out, counts = converted
    assert counts == {"train": 16, "val": 6}
    for split in ("train", "val"):
        files = EncodedFolder(folder / split)
        sharded = ShardedFiles(str(out), split)
        assert len(sharded) == len(files)
        assert [sharded.label(index) for index in range(len(files))] == ImageFolder(folder / split).targets
        for index, (path, _) in enumerate(files.samples):
            expected = Path(path).relative_to(folder)
            try:
                image = sharded[index]
            except Exception as unreadable:  # a file the folder's reader cannot read either
                with pytest.raises(type(unreadable)) as folder_reason:
                    files[index]
                assert unreadable.reason == folder_reason.value.reason
                assert unreadable.path == str(out / expected)
                continue
            assert image.path == str(out / expected)
            assert image.data.numpy().tobytes() == Path(path).read_bytes()
    assert len(list((out / "train").glob("chunk-1-*.bin"))) > 1  # both workers wrote several chunks


def test_the_runners_reader_gives_litdatas_own_samples(converted):
    """The shards stay litdata's: its own reader (StreamingDataset) gives each sample as the runner's
    reader does, bytes, label, path and reason; the runner's pickled, as a loader worker started by spawn
    or forkserver (Python 3.14's default) receives it, its chunks not mapped."""
    out, _ = converted
    for split in ("train", "val"):
        theirs = shards.litdata().StreamingDataset(str(out / split))
        ours = pickle.loads(pickle.dumps(ShardedFiles(str(out), split)))
        assert len(theirs) == len(ours)
        for index in range(len(ours)):
            data, label, path, reason = theirs[index]
            assert (bytes(path).decode(), label, bytes(reason).decode()) == ours.record(index)
            assert bytes(data) == (_bytes(ours, index) or b"")


def _batches(module, epoch: int = 0, validation: bool = False):
    module.setup()
    loader = module.val_dataloader() if validation else module.train_dataloader()
    if not validation:
        loader.sampler.set_epoch(epoch)
    return [module.on_after_batch_transfer(batch, 0) for batch in loader]


def _assert_same_batches_and_reports(modules, passes) -> None:
    """Two DataModules give the same batches in each ``(epoch, validation)`` pass (4 training batches, 2
    validation ones) and report the same two unreadable files, by their paths under each module's root."""
    for epoch, validation in passes:
        expected, got = (_batches(module, epoch, validation) for module in modules)
        assert len(got) == len(expected) == (2 if validation else 4)
        for (images, labels), (other_images, other_labels) in zip(expected, got):
            assert torch.equal(images, other_images) and torch.equal(labels, other_labels)
    reports = [
        {os.path.relpath(path, module.root): why for path, why in module.unreadable.items()}
        for module in modules
    ]
    assert reports[0] == reports[1] and len(reports[0]) == 2


@pytest.mark.parametrize(("on_device", "num_workers"), [(False, 0), (True, 0), (False, 2)])
def test_shards_give_the_folders_batches_bit_for_bit(folder, converted, on_device, num_workers):
    """Both decode paths (the device's run on CPU tensors): the same images, labels and unreadable files left
    out, epoch by epoch, for training (seeded crops) and validation; with loader workers the shards reach
    them pickled."""
    options = dict(
        batch_size=5, image_size=SIZE, num_workers=num_workers, num_classes=3, skip_unreadable=True
    )
    modules = [
        ImageFolderDataModule(str(folder), **options),
        ImageShardsDataModule(str(converted[0]), **options),
    ]
    for module in modules:
        module.setup()
        for dataset in (module.train_set, module.val_set):
            dataset.decode_on_device = on_device
    _assert_same_batches_and_reports(modules, ((0, False), (1, False), (0, True)))


def test_the_shards_resume_at_a_saved_position_as_the_folder(converted):
    """The DataModule's own position (epoch, batches), the folder's contract: litdata's loader state is not
    used, so a resumed loader's remaining batches are the uninterrupted epoch's."""
    options = dict(batch_size=5, image_size=SIZE, num_workers=1, num_classes=3, skip_unreadable=True)
    straight = _batches(ImageShardsDataModule(str(converted[0]), **options), epoch=1)
    resumed = ImageShardsDataModule(str(converted[0]), **options)
    resumed.load_state_dict({"epoch": 1, "batches": 2})
    rest = _batches(resumed, epoch=1)
    assert len(rest) == len(straight) - 2
    for (images, labels), (expected_images, expected_labels) in zip(rest, straight[2:]):
        assert torch.equal(images, expected_images) and torch.equal(labels, expected_labels)


def _held(item) -> bytes:
    """A pending sample's bytes, or its pixels where the worker decoded it (no JPEG)."""
    return (item.image.data if item.pixels is None else item.pixels).numpy().tobytes()


def _rank_batches(module, rank: int, world_size: int, epoch: int) -> list[list[tuple]]:
    """Rank ``rank`` of ``world_size``'s training batches of ``epoch`` as its loader hands them to the device
    decode: each sample's path under the module's root, label, bytes and crop (an unreadable file's path and
    reason)."""
    module.trainer = SimpleNamespace(
        world_size=world_size, global_rank=rank, strategy=SimpleNamespace(root_device=torch.device("cpu"))
    )
    module.setup()
    module.train_set.decode_on_device = True  # the loader's batches stop before the decode
    loader = module.train_dataloader()
    loader.sampler.set_epoch(epoch)
    batches = []
    for batch in loader:
        readable = [
            (os.path.relpath(item.image.path, module.root), label, _held(item), item.crop)
            for item, label in zip(batch.pending, batch.labels.tolist())
        ]
        unreadable = [(os.path.relpath(image.path, module.root), image.reason) for image in batch.unreadable]
        batches.append(readable + unreadable)
    return batches


@pytest.mark.parametrize("world_size", [2, 3])
def test_each_rank_reads_the_folders_share_and_the_ranks_the_whole_split(folder, converted, world_size):
    """The ranks of a run, each as Lightning's DDP sets it up (the rank and world size the sampler takes from
    the trainer are all a rank's reading depends on: the shards' reader holds nothing per rank): the 16
    samples over 2 ranks, each once an epoch (8 a rank, a last batch of 3), their set the one-process epoch's;
    over 3 ranks each rank's share, padded as the folder's sampler pads it, with a last batch of 1. Each
    rank's batches are the folder's on that rank, sample by sample (path, label, bytes, crop)."""
    options = dict(batch_size=5, image_size=SIZE, num_workers=0, num_classes=3, skip_unreadable=True)
    epoch = 1
    one_process = [
        sample[0]
        for batch in _rank_batches(ImageShardsDataModule(str(converted[0]), **options), 0, 1, epoch)
        for sample in batch
    ]
    assert len(one_process) == len(set(one_process)) == 16
    seen = []
    for rank in range(world_size):
        got = _rank_batches(ImageShardsDataModule(str(converted[0]), **options), rank, world_size, epoch)
        expected = _rank_batches(ImageFolderDataModule(str(folder), **options), rank, world_size, epoch)
        assert got == expected
        assert [len(batch) for batch in got] == ([5, 3] if world_size == 2 else [5, 1])
        seen += [sample[0] for batch in got for sample in batch]
    assert set(seen) == set(one_process)
    assert len(seen) == (16 if world_size == 2 else 18)  # 3 ranks: 2 samples again, the sampler's padding


def test_the_check_names_a_missing_chunk_and_other_class_counts(folder, converted, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(converted[0], out)
    files = EncodedFolder(folder / "train")
    chunk = sorted((out / "train").glob("chunk-*.bin"))[0]
    chunk.unlink()
    with pytest.raises(shards.ShardsMismatchError, match=f"chunk {chunk.name} is missing"):
        shards.check_shards(out, "train", files, folder)
    more = tmp_path / "more"
    shutil.copytree(folder, more, symlinks=True)
    shutil.copy(more / "train" / "class_000" / "00000.JPEG", more / "train" / "class_000" / "00009.JPEG")
    with pytest.raises(shards.ShardsMismatchError, match="class 0 has 4 samples, the folder 5"):
        shards.check_shards(converted[0], "train", EncodedFolder(more / "train"), more)


def test_reading_every_chunk_keeps_no_file_open(converted):
    """A loader worker reads from every chunk of a split in an epoch (ImageNet's: about 2,300 of 64 MB);
    each stays mapped, and a mapping must hold no file open (Python's mmap does: to the open-file limit)."""
    sharded = ShardedFiles(str(converted[0]), "train")
    chunks = len(json.loads((converted[0] / "train" / "index.json").read_text())["chunks"])
    open_files = len(os.listdir("/proc/self/fd"))
    for index in range(len(sharded)):
        try:
            sharded[index]
        except UnreadableImage:
            pass
    assert chunks > 1 and len(os.listdir("/proc/self/fd")) == open_files


def test_shards_of_other_samples_and_a_damaged_chunk_are_refused_by_name(converted, tmp_path):
    """litdata shards of dicts (litdata's own writer; so the first conversions stored an image folder, and
    litdata 0.2.76 keeps such rows as an Arrow table, not as items) are refused when opened; a chunk that is
    not the one index.json lists, when it is read."""
    from litdata.streaming.writer import BinaryWriter

    writer = BinaryWriter(str(tmp_path / "dicts" / "train"), chunk_bytes="1MB")
    for index in range(3):
        writer[index] = {"data": b"bytes", "label": index, "path": f"train/{index}", "unreadable": ""}
    writer.done()
    writer.merge()
    with pytest.raises(
        ConfigError, match=r"dicts/train holds litdata shards of other samples or in another "
    ):
        ShardedFiles(str(tmp_path / "dicts"), "train")
    out = tmp_path / "out"
    shutil.copytree(converted[0], out)
    sharded = ShardedFiles(str(out), "val")  # maps the last chunk (its class count): not the first
    first = out / "val" / json.loads((out / "val" / "index.json").read_text())["chunks"][0]["filename"]
    damaged = bytearray(first.read_bytes())
    damaged[0] += 1  # one sample more than index.json says
    first.write_bytes(damaged)
    with pytest.raises(
        ConfigError, match=f"val/{first.name} is missing or not the chunk its index.json lists"
    ):
        sharded[0]


def test_the_benchmarks_read_row_hands_on_the_files_bytes_from_both(folder, converted, monkeypatch):
    """bench/recipe_throughput.py's read row, folder against shards (its code, at the smallest size): both
    hand on the 13 JPEGs' bytes (the 12 generated and the grayscale one), as many as the files hold."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    from recipe_throughput import read_row

    files = EncodedFolder(folder / "train")
    jpegs = [
        index
        for index, (path, _) in enumerate(files.samples)
        if os.path.exists(path) and jpeg_size(Path(path).read_bytes()) is not None
    ]
    row = read_row(files, ShardedFiles(str(converted[0]), "train"), jpegs[::-1], repeats=1)
    assert row["bytes"] == sum(os.path.getsize(files.samples[index][0]) for index in jpegs) > 0
    assert row["images"] == len(jpegs) == 13 and set(row["bytes_per_s"]) == {"folder", "shards"}


@pytest.mark.slow  # a local S3 server: about 5 s
def test_shards_on_a_local_s3_server_give_the_local_shards_batches(converted, tmp_path, monkeypatch):
    """An ``s3://`` root, the shards uploaded to moto's S3 server (HTTPS, its authority trusted through
    SSL_CERT_FILE and AWS_CA_BUNDLE): litdata's downloaders fetch the chunks into data.cache_dir, and the
    runner's shards module gives the local shards' batches bit for bit (training, validation, unreadable
    files). A missing index and a missing chunk are named."""
    pytest.importorskip(
        "moto.moto_server.werkzeug_app", reason="moto's S3 server: pip install 'moto[server]'"
    )
    import boto3
    from s3_server import https_s3_server

    with https_s3_server(tmp_path) as (endpoint, authority):
        for name, value in {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_CA_BUNDLE": str(authority),
            "SSL_CERT_FILE": str(authority),
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }.items():
            monkeypatch.setenv(name, value)
        client = boto3.client("s3")
        client.create_bucket(Bucket="data")
        for path in converted[0].rglob("*"):
            if path.is_file():
                client.upload_file(str(path), "data", f"shards/{path.relative_to(converted[0])}")
        options = dict(batch_size=5, image_size=SIZE, num_classes=3, skip_unreadable=True)
        modules = [
            ImageShardsDataModule(str(converted[0]), num_workers=0, **options),
            # Two loader workers fetch chunks beside each other, and after the main process has.
            ImageShardsDataModule(
                "s3://data/shards", cache_dir=str(tmp_path / "cache"), num_workers=2, **options
            ),
        ]
        _assert_same_batches_and_reports(modules, ((0, False), (0, True)))
        assert sorted(path.name for path in (tmp_path / "cache").rglob("chunk-*.bin")) == sorted(
            path.name for path in converted[0].rglob("chunk-*.bin")
        )  # whole chunks, each fetched
        with pytest.raises(
            ConfigError, match=r"cannot read s3://data/elsewhere/val/index.json \(ClientError"
        ):
            ShardedFiles("s3://data/elsewhere", "val", cache_dir=str(tmp_path / "cache"))
        first = json.loads((converted[0] / "val" / "index.json").read_text())["chunks"][0]["filename"]
        client.delete_object(Bucket="data", Key=f"shards/val/{first}")
        incomplete = ShardedFiles("s3://data/shards", "val", cache_dir=str(tmp_path / "other cache"))
        with pytest.raises(ConfigError, match=f"cannot fetch s3://data/shards/val/{first} to .*missing from"):
            incomplete[0]  # litdata's downloader returns, the chunk not fetched: not a wait without end


def _interrupted_conversion(out: Path, folder: Path) -> None:
    """A conversion slowed down, in a session of its own (killed with its workers)."""
    os.setsid()
    record = shards._Record.__call__

    def slow(self, index):
        time.sleep(0.3)
        return record(self, index)

    shards._Record.__call__ = slow
    shards.convert(out, folder, workers=2, chunk_bytes=CHUNK)


@pytest.mark.slow
@pytest.mark.heavy  # two more conversions, one killed: about 15 s on 2 cores
def test_an_interrupted_conversion_resumes_to_the_same_shards(folder, converted, tmp_path, capfd):
    out = tmp_path / "out"
    child = multiprocessing.get_context("fork").Process(target=_interrupted_conversion, args=(out, folder))
    child.start()
    checkpoints = out / "train" / ".checkpoints"
    deadline = time.monotonic() + 60
    while not list(checkpoints.glob("checkpoint-*.json")) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(child.pid, signal.SIGKILL)
    child.join()
    assert not (out / "train" / "index.json").exists()  # killed before the end
    done = sum(json.loads(path.read_text())["inputs_done"] for path in checkpoints.glob("checkpoint-*.json"))
    assert 0 < done < 16
    with pytest.raises(ConfigError, match="interrupted with 2 workers: resume it with --workers 2"):
        shards.convert(out, folder, workers=3, chunk_bytes=CHUNK)
    capfd.readouterr()
    assert shards.convert(out, folder, workers=2, chunk_bytes=CHUNK) == converted[1]
    assert "Checkpoints loaded successfully" in capfd.readouterr().out
    # Chunk boundaries may differ (a chunk cut short by the kill is written again whole): the samples may not.
    for split in ("train", "val"):
        assert _samples(ShardedFiles(str(out), split)) == _samples(ShardedFiles(str(converted[0]), split))


def _samples(sharded: ShardedFiles) -> list[tuple]:
    """Each sample's path, label, reason and bytes (None where unreadable)."""
    return [(*sharded.record(index), _bytes(sharded, index)) for index in range(len(sharded))]


def _bytes(files, index: int) -> bytes | None:
    try:
        return files[index].data.numpy().tobytes()
    except UnreadableImage:
        return None


@pytest.mark.slow
@pytest.mark.heavy  # three tiny ResNet-18 runs: about 55 s on 2 busy cores
def test_a_run_killed_mid_epoch_resumes_from_last_ckpt_as_the_run_made_in_one_go(converted, tmp_path):
    """train.py's config (data=imagenet_shards): stopped in epoch 1 after a step checkpoint, resumed from
    last.ckpt, the run equals the uninterrupted one bit for bit (its position is the DataModule's)."""
    from lightning_helpers import Interrupted, assert_identical, compose_train, final_state, last_checkpoint

    from lightning_fusedsgd.checkpoint import read_checkpoint_file
    from runner.run import train

    def run(run_dir: Path, *overrides: str) -> None:
        shards_run = ["recipe=resnet50", "model.arch=resnet18", "debug=tiny", "data=imagenet_shards"]
        data = [f"data.root={converted[0]}", "data.num_classes=3", "data.batch_size=5", "data.decode=cpu"]
        every_two = ["data.skip_unreadable=true", "callbacks.step_checkpoint.every_n_train_steps=2"]
        train(compose_train([*shards_run, *data, *every_two, "schedule.warmup=0", *overrides], run_dir))

    run(tmp_path / "straight")
    stop = ["+callbacks.stop._target_=lightning_helpers.StopAt", "+callbacks.stop.step=5"]
    with pytest.raises(Interrupted):
        run(tmp_path / "first", *stop)
    assert read_checkpoint_file(last_checkpoint(tmp_path / "first"))["ImageShardsDataModule"] == {
        "epoch": 1,
        "batches": 1,
    }
    run(tmp_path / "second", f"ckpt_path={last_checkpoint(tmp_path / 'first')}")
    assert_identical(final_state(tmp_path / "second"), final_state(tmp_path / "straight"))
