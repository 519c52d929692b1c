"""Shared pytest fixtures, and the `--device` option.

`python -m pytest -m device --device cuda tests/` runs the single-process tests that take the
`device` fixture (models, optimizer, generation, HF parity) on a GPU. A test that takes the
fixture is marked `device` automatically, so `-m device` selects exactly the tests that honour
the option; the other tests (multi-rank gloo, data, CLI) stay on the CPU whatever it says.

`--device cuda` on a machine without CUDA is a usage error, not a skip: a run asked to check the
GPU that skipped every test would pass while checking nothing.
"""
from __future__ import annotations

import pytest
import torch


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu",
                     help="torch device for the tests marked `device` (cpu or cuda[:N]); "
                          "default cpu")


def pytest_configure(config):
    config.addinivalue_line("markers", "device: a single-process test that runs on --device "
                                       "(applied to every test that takes the device fixture)")
    name = config.getoption("--device")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise pytest.UsageError(f"--device {name}: {e}") from None
    if device.type not in ("cpu", "cuda"):
        raise pytest.UsageError(f"--device {name}: choose cpu or cuda[:N]")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(f"--device {name}: torch.cuda.is_available() is False here "
                                f"(torch {torch.__version__}); run without --device to test on "
                                f"the CPU")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise pytest.UsageError(f"--device {name}: this machine has "
                                f"{torch.cuda.device_count()} CUDA device(s)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "device" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.device)


@pytest.fixture(scope="session")
def device(request) -> torch.device:
    """The device single-process tests build their models on. They bring results back with
    `.cpu()` to compare them, so a reference (HF, torch's AdamW, a constant) can stay on the
    CPU and check the device's kernels against it."""
    return torch.device(request.config.getoption("--device"))


# Scripts from the languages and symbol ranges byte-level BPE must round-trip exactly.
MULTILINGUAL_TEXT = (
    "The quick brown fox jumps over the lazy dog.\n"
    "数据并行、张量并行和流水线并行。你好，世界！\n"
    "Привет, мир! Съешь же ещё этих мягких французских булок.\n"
    "مرحبا بالعالم، هذا نص عربي للاختبار.\n"
    "Emoji 👩‍👩‍👧‍👦 🏳️‍🌈 👍🏽 🎉\n"
    "def f(x):\n\treturn x * 2   \n\n"
    "Combining: e\u0301 a\u0308 n\u0303\n"
)


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory):
    """A byte-level BPE trained once per session on a few multilingual lines (vocab <= 500)."""
    from bloomtrain.data.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("tokenizer")
    corpus = root / "corpus.txt"
    corpus.write_text(MULTILINGUAL_TEXT * 20, encoding="utf-8")
    train_tokenizer([corpus], vocab_size=500, output_dir=root / "tok")
    return root / "tok"


@pytest.fixture(scope="module")
def one_thread():
    """Pin torch to one intra-op thread for a module of tiny-tensor tests. With two threads on a
    shared 2-core machine, OpenMP's spin-waiting made single tiny calls 30-300x slower."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
