"""Shared pytest fixtures."""
from __future__ import annotations

import pytest
import torch

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
