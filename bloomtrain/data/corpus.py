"""A real-text demo corpus with no download: the Python standard library's own `.py` sources and
their docstrings, written as JSON lines (`{"text": ..., "source": ...}`), the input format of
`bloomtrain tokenizer train` and `bloomtrain preprocess`.

Every Python install ships the same files for a given version, so the corpus is deterministic
there: files are visited in sorted order, and each file yields its source (cut at a line boundary
to `MAX_DOC_CHARS`) followed by its module, class and function docstrings as separate documents.
"""
from __future__ import annotations

import ast
import json
import os
import sysconfig
import tokenize
import warnings
from pathlib import Path
from typing import Iterator

from bloomtrain.errors import UserError
from bloomtrain.files import atomic_output

MAX_DOC_CHARS = 20_000
MIN_DOCSTRING_CHARS = 40
# Test suites are huge and repetitive, and site-packages differs between installs.
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
_MAX_FILE_BYTES = 1 << 20


def stdlib_sources(root: str | os.PathLike | None = None) -> list[Path]:
    root = Path(root or sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if name.endswith(".py") and path.is_file() and path.stat().st_size <= _MAX_FILE_BYTES:
                found.append(path)
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _cap(text: str) -> str:
    if len(text) <= MAX_DOC_CHARS:
        return text
    cut = text.rfind("\n", 0, MAX_DOC_CHARS)
    return text[: cut + 1 if cut > 0 else MAX_DOC_CHARS]


def _docstrings(tree: ast.AST) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) >= MIN_DOCSTRING_CHARS:
                yield doc


def iter_demo_documents(root: str | os.PathLike | None = None) -> Iterator[dict]:
    root = Path(root or sysconfig.get_paths()["stdlib"])
    for path in stdlib_sources(root):
        source_name = path.relative_to(root).as_posix()
        try:
            # tokenize.open honours PEP 263 encoding cookies.
            with tokenize.open(path) as f:
                source = f.read()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # invalid escapes in old modules warn on parse
                tree = ast.parse(source, filename=str(path))
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        if source.strip():
            yield {"text": _cap(source), "source": source_name}
        for doc in _docstrings(tree):
            yield {"text": _cap(doc), "source": source_name}


def build_demo_corpus(output_path: str | os.PathLike, max_docs: int | None = None) -> Path:
    """Write the corpus (about 10 MB of text on CPython 3.11) to `output_path` atomically."""
    output_path = Path(output_path)
    count = 0
    with atomic_output(output_path, "wb") as f:
        for doc in iter_demo_documents():
            if max_docs is not None and count >= max_docs:
                break
            f.write((json.dumps(doc, ensure_ascii=False) + "\n").encode("utf-8"))
            count += 1
    if count == 0:
        output_path.unlink()
        raise UserError(f"found no Python sources under {sysconfig.get_paths()['stdlib']} to "
                        f"build the demo corpus from")
    return output_path
