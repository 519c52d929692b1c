"""A disk that fills up while bloomtrain writes: checkpoint saves (one process and two ranks),
`bloomtrain preprocess` and `bloomtrain export-hf`.

The full disk is real where it can be: a small tmpfs mounted for the test when it runs as root
and may mount. Elsewhere, and always as well, the same tests run on an injected one: `open` and
`os.fdopen` of files under the disk's directory return files whose write() stops at the disk's
capacity with OSError(ENOSPC), writing what fits first as the kernel does, and
shutil.disk_usage reports that capacity. The code under test meets the same exception either
way; only `bloomtrain`'s own Python writes are seen by the injected disk (sendfile, used by
shutil.copyfile, is not), which covers every file the tests fill the disk with.
"""
from __future__ import annotations

import builtins
import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bloomtrain import checkpoint as ckpt
from bloomtrain.checkpoint.writer import CheckpointSaveError
from bloomtrain.cli import main as cli_main
from bloomtrain.train.runlock import LOCK_NAME
from bloomtrain.train import train
from tests.dist import run_ranks
from tests.helpers import make_cfg

pytestmark = pytest.mark.usefixtures("one_thread")

DISK_BYTES = 16 << 20  # two tiny-model checkpoints (2.6 MiB each) and room to fill


def du(root: Path) -> int:
    """Apparent size of everything under `root`: what the injected disk counts as used."""
    total = 0
    for d, _, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(d, name)).st_size
            except FileNotFoundError:  # removed while we walked
                pass
    return total


class _LimitedFile:
    """A file opened for writing on the injected disk: write() takes what fits in `left` bytes,
    then raises ENOSPC."""

    def __init__(self, f, path: str, left: int):
        self._f, self._path, self._left = f, path, left

    def write(self, data):
        size = len(data.encode()) if isinstance(data, str) else memoryview(data).nbytes
        if size > self._left:
            if not isinstance(data, str) and self._left > 0:
                self._f.write(memoryview(data).cast("B")[:self._left])
                self._f.flush()
            self._left = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._left -= size
        return self._f.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()

    def __iter__(self):
        return iter(self._f)

    def __getattr__(self, name):
        return getattr(self._f, name)


class InjectedDisk:
    """Files written under `root` get at most `budget(path)` bytes each (None: no limit)."""

    def __init__(self, root: Path, budget):
        self.root, self.budget = str(Path(root).absolute()), budget
        self._saved = None

    def _limit(self, f, path):
        path = os.path.abspath(path)
        if path.startswith(self.root + os.sep):
            left = self.budget(path)
            if left is not None:
                return _LimitedFile(f, path, left)
        return f

    def install(self) -> "InjectedDisk":
        real_open, real_fdopen = builtins.open, os.fdopen

        def fake_open(file, mode="r", *args, **kwargs):
            f = real_open(file, mode, *args, **kwargs)
            if isinstance(file, (str, os.PathLike)) and any(c in mode for c in "wax+"):
                return self._limit(f, os.fspath(file))
            return f

        def fake_fdopen(fd, mode="r", *args, **kwargs):
            f = real_fdopen(fd, mode, *args, **kwargs)
            if any(c in mode for c in "wax+"):
                return self._limit(f, os.readlink(f"/proc/self/fd/{fd}"))
            return f

        self._saved = (real_open, real_fdopen)
        builtins.open, os.fdopen = fake_open, fake_fdopen
        return self

    def uninstall(self) -> None:
        if self._saved is not None:
            builtins.open, os.fdopen = self._saved
            self._saved = None


class Disk:
    """A DISK_BYTES filesystem at `root`: `fill(leave)` leaves `leave` bytes free, `free_up()`
    gives the rest back (an operator deleting something)."""

    def __init__(self, root: Path, kind: str):
        self.root, self.kind = root, kind
        self.ballast = root / "ballast"

    def fill(self, leave: int) -> None:
        n = shutil.disk_usage(self.root).free - leave
        with open(self.ballast, "wb") as f:
            if self.kind == "tmpfs":
                f.write(b"\0" * n)  # real pages
            else:
                f.truncate(n)  # the injected disk counts apparent sizes
        assert abs(shutil.disk_usage(self.root).free - leave) < 8192

    def free_up(self) -> None:
        self.ballast.unlink()


def _mount_tmpfs(path: Path) -> bool:
    if sys.platform != "linux" or os.geteuid() != 0 or not shutil.which("mount"):
        return False
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(path)],
                       capture_output=True)
    return r.returncode == 0


@pytest.fixture(params=["tmpfs", "injected"])
def disk(request, tmp_path, monkeypatch):
    root = tmp_path / "disk"
    root.mkdir()
    if request.param == "tmpfs":
        if not _mount_tmpfs(root):
            pytest.skip("cannot mount a tmpfs here (needs root); the injected disk covers it")
        request.addfinalizer(lambda: subprocess.run(["umount", str(root)], check=True))
    else:
        fake = InjectedDisk(root, lambda path: DISK_BYTES - du(root)).install()
        request.addfinalizer(fake.uninstall)
        real = shutil.disk_usage

        def disk_usage(path):
            if not os.path.abspath(path).startswith(str(root.absolute())):
                return real(path)
            used = du(root)
            return type(real(root))(DISK_BYTES, used, DISK_BYTES - used)
        monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    return Disk(root, request.param)


def _free_text(path) -> str:
    return f"({shutil.disk_usage(path).free:,} bytes)"


def _steps(run_dir: Path) -> list[int]:
    """The steps that trained, from metrics.jsonl's step records (not its eval records)."""
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return [r["step"] for r in records if "loss" in r]


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(".")
                  and p.name != LOCK_NAME)


def _entries(directory: Path) -> list[str]:
    """What a directory holds, but the run lock's file (train/runlock.py), which stays."""
    return sorted(n for n in os.listdir(directory) if n != LOCK_NAME)


# ---- training ------------------------------------------------------------------------------------

def test_failed_save_keeps_previous_checkpoint_and_training_retries(dataset, tmp_path, disk):
    # Saves at steps 2, 4 and 6 (async, the default). After step 2's commit the disk is left
    # with half a checkpoint free, so step 4's save fails; when the failure is logged, space is
    # freed, and step 6's save (the next interval) commits.
    ck = disk.root / "ck"
    seen, lines = {}, []

    def log(*args):
        line = " ".join(map(str, args))
        lines.append(line)
        if line == f"[checkpoint] saved {ck / 'step_00000002'}":
            disk.fill(leave=du(ck / "step_00000002") // 2)
        if "WARNING saving checkpoint" in line:
            seen.update(entries=_entries(ck), latest=(ck / "latest").read_text(),
                        valid=ckpt.find_latest_valid(ck, log=lambda *_: None),
                        free=_free_text(ck))
            disk.free_up()

    cfg = make_cfg(dataset, tmp_path, checkpoint={"dir": str(ck), "save_interval": 2})
    assert cfg.checkpoint.async_save and cfg.checkpoint.on_save_error == "continue"
    result = train(cfg, log=log)

    warnings = [line for line in lines if "WARNING saving checkpoint" in line]
    assert len(warnings) == 1
    w = warnings[0]
    assert f"saving checkpoint {ck / 'step_00000004'} failed" in w
    assert "No space left on device" in w and seen["free"] in w
    assert f"latest checkpoint is still {ck / 'step_00000002'}" in w
    assert "checkpoint.on_save_error=continue" in w
    # At the failure: nothing of step 4 (no temporary directory), step 2 still the latest.
    assert seen["entries"] == ["latest", "step_00000002"]
    assert seen["latest"] == "step_00000002\n" and seen["valid"] == ck / "step_00000002"
    # Training went on, and the next interval saved.
    assert result.state.step == 6 and len(result.losses) == 6
    assert [s for s, _ in ckpt.list_checkpoints(ck)] == [2, 6]
    assert (ck / "latest").read_text() == "step_00000006\n"
    assert ckpt.find_latest_valid(ck, log=lambda *_: None) == ck / "step_00000006"
    assert result.checkpoint == str(ck / "step_00000006") and _leftovers(ck) == []


def test_on_save_error_stop_exits_nonzero(dataset, tmp_path, disk, capsys):
    # A first run saves step 2. The disk is then filled, and `bloomtrain train` resumes with
    # checkpoint.on_save_error=stop (synchronous saves): the save at step 4 fails and the
    # command exits non-zero, naming the checkpoint and the free space.
    ck = disk.root / "ck"
    cfg = make_cfg(dataset, tmp_path, train__train_iters=2,
                   checkpoint={"dir": str(ck), "save_interval": 2, "async_save": False,
                               "on_save_error": "stop"})
    train(cfg, log=lambda *_: None)
    disk.fill(leave=64 << 10)
    config = tmp_path / "config.yaml"
    config.write_text(cfg.to_yaml())
    capsys.readouterr()
    assert cli_main(["train", "--config", str(config), "train.train_iters=6"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bloomtrain train: error: saving checkpoint "
                          f"{ck / 'step_00000004'} failed")
    assert "No space left on device" in err and _free_text(ck) in err
    assert "checkpoint.on_save_error=stop" in err
    # It stopped at the failed save, and step 2 is still the latest and valid.
    assert _steps(tmp_path / "run") == [1, 2, 3, 4]
    assert _entries(ck) == ["latest", "step_00000002"]
    assert ckpt.find_latest_valid(ck, log=lambda *_: None) == ck / "step_00000002"


def test_latest_marker_that_cannot_be_written_takes_the_step_back_out(tmp_path):
    # The data fit, but the disk is full by the time `latest` is written (it is written last,
    # after the step directory is renamed into place). The step must go again, or
    # find_latest_valid would take up a save that was reported as failed; a re-saved step gets
    # its previous copy back.
    from bloomtrain.model import BloomShape, build_model
    shape = BloomShape(vocab_size=256, hidden_size=32, num_layers=1, num_heads=2,
                       ffn_hidden_size=128)
    first, second = (build_model(shape, seed=s).state_dict() for s in (1, 2))
    ckpt.save_checkpoint(tmp_path, 1, first, shape)
    before = {p.name: p.read_bytes() for p in (tmp_path / "step_00000001").iterdir()}
    fake = InjectedDisk(tmp_path, lambda path: 0 if Path(path).name.startswith(".latest.")
                        else None).install()
    try:
        for step in (2, 1):
            with pytest.raises(CheckpointSaveError, match=f"saving checkpoint "
                               f"{tmp_path / f'step_0000000{step}'} failed .*No space left"):
                ckpt.save_checkpoint(tmp_path, step, second, shape)
    finally:
        fake.uninstall()
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_00000001"]
    assert (tmp_path / "latest").read_text() == "step_00000001\n"
    assert {p.name: p.read_bytes() for p in (tmp_path / "step_00000001").iterdir()} == before
    assert ckpt.find_latest_valid(tmp_path, log=lambda *_: None) == tmp_path / "step_00000001"


def test_config_rejects_unknown_on_save_error():
    from bloomtrain.config import Config
    from bloomtrain.errors import UserError
    with pytest.raises(UserError, match="checkpoint.on_save_error must be continue or stop, "
                                        "got 'retry'"):
        Config.from_dict({"train": {"train_iters": 1},
                          "checkpoint": {"on_save_error": "retry"}}).check()


def _two_rank_worker(rank, world, data, tmp):
    # Rank 1 alone runs out of space writing step 4 (a real full disk fails whichever rank
    # writes last; the injection makes exactly one rank fail, the case to prove). Rank 0's own
    # files are complete: it must still not commit, and must report the same failure.
    tmp = Path(tmp)
    out = {}
    for policy in ("stop", "continue"):
        ck = tmp / policy / "ck"
        injected = None
        if rank == 1:
            injected = InjectedDisk(
                ck, lambda path: 1000 if "/.step_00000004.tmp/" in path else None).install()
        lines = []
        # stop: synchronous saves, so the run stops at step 4 itself; continue: async.
        cfg = make_cfg(data, tmp / policy, train__micro_batch_size=2,
                       checkpoint={"dir": str(ck), "save_interval": 2, "on_save_error": policy,
                                   "async_save": policy == "continue"})
        try:
            result = train(cfg, log=lambda *a: lines.append(" ".join(map(str, a))))
            out[policy] = {"step": result.state.step, "checkpoint": result.checkpoint,
                           "lines": lines}
        except CheckpointSaveError as e:
            out[policy] = {"error": str(e), "lines": lines}
        finally:
            if injected is not None:
                injected.uninstall()
    return out


def test_two_ranks_agree_on_a_failed_save(dataset, tmp_path):
    outs = run_ranks(2, _two_rank_worker, dataset, str(tmp_path))

    ck = tmp_path / "stop" / "ck"
    errors = [o["stop"].get("error") for o in outs]
    assert errors[0] is not None and errors[0] == errors[1]  # both ranks stopped, alike
    e = errors[0]
    assert f"saving checkpoint {ck / 'step_00000004'} failed (rank 1: " in e
    assert "No space left on device writing" in e and ".step_00000004.tmp" in e
    assert "rank 0:" not in e and "free (" in e
    assert _steps(tmp_path / "stop" / "run") == [1, 2, 3, 4]
    assert _entries(ck) == ["latest", "step_00000002"]  # no commit, no leftovers
    assert (ck / "latest").read_text() == "step_00000002\n"

    ck = tmp_path / "continue" / "ck"
    for o in outs:
        assert o["continue"]["step"] == 6
        assert o["continue"]["checkpoint"] == str(ck / "step_00000006")
    warnings = [line for line in outs[0]["continue"]["lines"] if "WARNING saving" in line]
    assert len(warnings) == 1 and "(rank 1: " in warnings[0]
    assert [s for s, _ in ckpt.list_checkpoints(ck)] == [2, 6] and _leftovers(ck) == []
    assert ckpt.find_latest_valid(ck, log=lambda *_: None) == ck / "step_00000006"


# ---- preprocess and export-hf -------------------------------------------------------------------

def test_preprocess_disk_full_keeps_previous_dataset(tiny_tokenizer_dir, tmp_path, disk, capsys):
    small, big = tmp_path / "small.jsonl", tmp_path / "big.jsonl"
    small.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(5)))
    text = "the quick brown fox jumps over the lazy dog, 数据并行 " * 20
    big.write_text("".join(json.dumps({"text": f"{i} {text}"}) + "\n" for i in range(400)))
    prefix = disk.root / "ds"
    args = ["preprocess", "--tokenizer", str(tiny_tokenizer_dir), "--output-prefix", str(prefix),
            "--no-progress"]
    assert cli_main([*args, "--input", str(small)]) == 0
    before = {p.name: p.read_bytes() for p in disk.root.iterdir()}
    disk.fill(leave=16 << 10)
    capsys.readouterr()

    assert cli_main([*args, "--input", str(big)]) == 2
    err = capsys.readouterr().err
    assert f"writing dataset {prefix}_text_document.bin/.idx failed: No space left on device (" \
        in err
    assert _free_text(disk.root) in err and "--output-prefix" in err
    # The previous dataset is untouched, and no temporary file is left.
    assert sorted(os.listdir(disk.root)) == sorted([*before, "ballast"])
    assert {n: (disk.root / n).read_bytes() for n in before} == before


def test_export_disk_full_keeps_previous_export(tmp_path, disk, capsys):
    from bloomtrain.model import BloomShape, build_model
    shape = BloomShape(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4,
                       ffn_hidden_size=256)
    for seed in (1, 2):
        ckpt.save_checkpoint(tmp_path / f"ck{seed}", 0, build_model(shape, seed=seed).state_dict(),
                             shape)
    out = disk.root / "hf"
    assert cli_main(["export-hf", "--checkpoint", str(tmp_path / "ck1"), "--output",
                     str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    disk.fill(leave=64 << 10)
    capsys.readouterr()

    # A different checkpoint: a partly replaced export would show.
    assert cli_main(["export-hf", "--checkpoint", str(tmp_path / "ck2"), "--output",
                     str(out)]) == 2
    err = capsys.readouterr().err
    source = tmp_path / "ck2" / "step_00000000"
    assert f"exporting {source} to {out} failed: No space left on device (" in err
    assert _free_text(disk.root) in err and "--output" in err
    assert sorted(os.listdir(disk.root)) == ["ballast", "hf"]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
