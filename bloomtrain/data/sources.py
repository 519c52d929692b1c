"""Input readers shared by the tokenizer trainer and the preprocessor.

Both must read the same inputs the same way (a tokenizer is trained on the documents it will later
tokenize); keeping the readers here lets neither of the two import the other.

Inputs are files, globs or directories. By extension: JSON lines (`.jsonl`/`.json`/`.ndjson`,
optionally `.gz`/`.zst`, text under `json_key`), Parquet (column `json_key`), and plain text, one
document per file. Unusable documents (invalid JSON, a missing key, non-UTF-8 bytes, empty text)
get a reason from SKIP_REASONS, which `skip_message` words with the document's file:line.
"""
from __future__ import annotations

import contextlib
import glob
import gzip
import io
import json
import os
import stat
from pathlib import Path
from typing import Iterator

from bloomtrain.errors import UserError

# Record kinds yielded by iter_records. Records stay unparsed until parse_record so that the
# preprocessor can parse them in its worker processes rather than in the reading one.
_JSON, _TEXT, _BYTES = "json", "text", "bytes"

SKIP_REASONS = ("invalid_json", "missing_key", "not_utf8", "empty")

_REASON_TEXT = {
    "invalid_json": "invalid JSON",
    "missing_key": "missing key {key!r} or its value is not a string",
    "not_utf8": "not valid UTF-8 (invalid bytes, or a lone surrogate escape such as \\ud800)",
    "empty": "empty document",
}


def _walk(directory: Path) -> list[Path]:
    # Hidden entries are skipped: they hold editor swap files and bloomtrain's own temporaries.
    # Linked directories are followed, as a glob (`dir/**`) follows them, so that the two ways
    # of naming one corpus give one dataset; a link back to a directory already walked (a
    # loop) is not entered twice.
    found, seen = [], set()
    for root, dirs, files in os.walk(directory, followlinks=True):
        seen.add(os.path.realpath(root))
        dirs[:] = sorted(d for d in dirs if not d.startswith(".")
                         and os.path.realpath(os.path.join(root, d)) not in seen)
        found.extend(Path(root) / f for f in sorted(files) if not f.startswith("."))
    return sorted(found)


def expand_inputs(inputs: list[str | os.PathLike]) -> list[Path]:
    """Files, globs (`**` recurses) and directories (recursed), each expanded in sorted order so
    that the output never depends on the filesystem's listing order. Duplicates are dropped."""
    if not inputs:
        raise UserError("no input given; pass --input FILE [FILE ...] (files, globs or directories)")
    paths: list[Path] = []
    for item in inputs:
        item = os.fspath(item)
        _check_readable_kind(item)
        # A path that exists is taken as named, even when its name holds glob characters
        # (`shard[0].jsonl` would otherwise match `shard0.jsonl`).
        if glob.has_magic(item) and not os.path.exists(item):
            matches = sorted(glob.glob(item, recursive=True))
            if not matches:
                raise UserError(f"no files matched {item!r}")
            for match in matches:
                paths.extend(_walk(Path(match)) if os.path.isdir(match) else [Path(match)])
        elif os.path.isdir(item):
            files = _walk(Path(item))
            if not files:
                raise UserError(f"directory {item} contains no input files")
            paths.extend(files)
        elif os.path.isfile(item):
            paths.append(Path(item))
        else:
            raise UserError(f"input {item} does not exist")
    for path in paths:
        _check_compression(path)
    seen, unique = set(), []
    for path in paths:
        key = os.path.abspath(path)
        if key not in seen:
            seen.add(key)
            unique.append(path)
    return unique


# Compressions a corpus may come in that no reader here decodes: named, not read as text.
UNSUPPORTED_COMPRESSION = {".xz": "xz", ".lzma": "lzma", ".bz2": "bzip2", ".lz4": "lz4",
                           ".zip": "zip", ".7z": "7z", ".tgz": "tar.gz", ".tar": "tar"}


def _check_compression(path: Path) -> None:
    suffixes = [x.lower() for x in path.suffixes]
    kind = UNSUPPORTED_COMPRESSION.get(suffixes[-1] if suffixes else "")
    if kind is None and len(suffixes) > 1 and suffixes[-2] == ".tar" and \
            suffixes[-1] in (".gz", ".zst", ".zstd"):
        kind = "tar" + suffixes[-1]  # an archive of files: its tar headers read as text
    if kind is not None:
        raise UserError(f"{path}: {kind} files are not read here; decompress it, or recompress "
                        f"it as .gz or .zst")


def _check_readable_kind(item: str) -> None:
    """A pipe or a device (`<(cat x)`, /dev/stdin) is refused by name, not called missing: an
    input's format comes from its file name's extension, which a pipe does not have."""
    with contextlib.suppress(OSError):
        mode = os.stat(item).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise UserError(f"input {item} is a pipe or a device, not a file: write it to a "
                            f"file first (its extension names the format: .jsonl, .parquet, "
                            f"text otherwise) and pass that")


def input_format(path: str | os.PathLike) -> tuple[str, str | None]:
    """(`jsonl` | `parquet` | `text`, compression `gz` | `zst` | None), from the file name."""
    name = Path(path).name.lower()
    compression = None
    for ext, kind in (("gz", "gz"), ("zst", "zst"), ("zstd", "zst")):
        if name.endswith("." + ext):
            compression, name = kind, name[: -len(ext) - 1]
    if name.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl", compression
    if name.endswith(".parquet"):
        if compression is not None:  # was read as text: every document "not valid UTF-8"
            raise UserError(f"{path}: a Parquet file compresses its own columns; decompress "
                            f"it to {Path(path).name.rsplit('.', 1)[0]}")
        return "parquet", None
    return "text", compression


class _ZstdReader(io.RawIOBase):
    """The decompressed bytes of a .zst file, every frame of it, as a raw stream that raises
    EOFError (as gzip does) when the file ends inside a frame: zstandard's stream_reader ends
    there quietly, and a truncated corpus lost its last documents without a word."""

    def __init__(self, raw, zstandard):
        self._chunks = self._decompressed(raw, zstandard)
        self._pending, self._at = b"", 0

    @staticmethod
    def _decompressed(raw, zstandard):
        new = zstandard.ZstdDecompressor().decompressobj
        frame, inside = new(), False
        while chunk := raw.read(1 << 20):
            while chunk:
                out, inside = frame.decompress(chunk), True
                if out:
                    yield out
                chunk = frame.unused_data if frame.eof else b""
                if frame.eof:  # a frame ended: what follows is the next frame's
                    frame, inside = new(), False
        if inside:
            raise EOFError("the compressed file ends inside a zstd frame (truncated)")

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while self._at == len(self._pending):
            self._pending, self._at = next(self._chunks, b""), 0
            if not self._pending:
                return 0
        n = min(len(b), len(self._pending) - self._at)
        b[:n] = self._pending[self._at:self._at + n]
        self._at += n
        return n


@contextlib.contextmanager
def _open_binary(path: Path, compression: str | None) -> Iterator[io.BufferedIOBase]:
    if compression == "gz":
        with gzip.open(path, "rb") as f:
            yield f
    elif compression == "zst":
        try:
            import zstandard
        except ImportError:
            raise UserError(f"reading {path} needs zstandard: pip install 'bloomtrain[formats]'")
        with open(path, "rb") as raw, io.BufferedReader(_ZstdReader(raw, zstandard),
                                                        1 << 20) as f:
            yield f
    else:
        with open(path, "rb") as f:
            yield f


def iter_records(path: str | os.PathLike, json_key: str = "text") -> Iterator[tuple[int, str, object]]:
    """(line or row number from 1, kind, payload) for every document of one input file, streamed.
    Blank lines of JSON-lines files are not documents and are passed over silently."""
    path = Path(path)
    fmt, compression = input_format(path)
    try:
        if fmt == "jsonl":
            with _open_binary(path, compression) as f:
                for lineno, line in enumerate(_universal_lines(f), 1):
                    if line.strip():
                        yield lineno, _JSON, line
        elif fmt == "parquet":
            yield from _iter_parquet(path, json_key)
        else:
            with _open_binary(path, compression) as f:
                yield 1, _BYTES, _without_bom(f.read())
    except UserError:
        raise
    except Exception as e:
        # gzip, zstandard and the OS each raise their own types for a truncated or mislabeled file.
        raise UserError(f"cannot read {path} as {compression or fmt}: {e}") from e


_BOM = b"\xef\xbb\xbf"


def _without_bom(data: bytes) -> bytes:
    """A UTF-8 byte-order mark at a file's start marks the encoding; it is not text."""
    return data[len(_BOM):] if data.startswith(_BOM) else data


def _universal_lines(f) -> Iterator[bytes]:
    """A binary file's lines as Megatron's `open(input, encoding="utf-8")` splits them: at
    "\n", "\r\n" and a lone "\r" (universal newlines; a CR-only file is many lines, not one),
    the file's leading byte-order mark dropped."""
    first = True
    for line in f:
        if first:
            line, first = _without_bom(line), False
        if b"\r" not in line:
            yield line
            continue
        body, end = (line[:-2], b"\n") if line.endswith(b"\r\n") else (
            (line[:-1], b"\n") if line.endswith(b"\n") else (line, b""))
        parts = body.split(b"\r")
        for part in parts[:-1]:
            yield part + b"\n"
        if parts[-1] or end:
            yield parts[-1] + end


def _iter_parquet(path: Path, json_key: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"reading {path} needs pyarrow: pip install 'bloomtrain[formats]'")
    try:
        parquet = pq.ParquetFile(path)
    except Exception as e:
        raise UserError(f"cannot read {path} as Parquet: {e}") from e
    names = parquet.schema_arrow.names
    if json_key not in names:
        raise UserError(f"{path} has no column {json_key!r} (columns: {', '.join(names)}); "
                        f"pass --json-key")
    row = 0
    for batch in parquet.iter_batches(batch_size=1024, columns=[json_key]):
        for value in batch.column(0).to_pylist():
            row += 1
            yield row, _TEXT, value


def iter_texts(inputs: list[str | os.PathLike], json_key: str = "text",
               skipped: SkipReport | None = None) -> Iterator[str]:
    """The usable documents of all inputs in order; unusable ones are skipped, as preprocess
    (non-strict) skips them, and counted in `skipped`. Used for tokenizer training."""
    for path in expand_inputs(inputs):
        for lineno, kind, payload in iter_records(path, json_key):
            text, reason = parse_record(kind, payload, json_key)
            if reason is None:
                yield text
            elif skipped is not None:
                skipped.add(path, lineno, reason)


def parse_record(kind: str, payload, json_key: str) -> tuple[str | None, str | None]:
    """(text, None) or (None, reason) with reason in SKIP_REASONS."""
    if kind == _TEXT:
        text = payload
    else:
        try:
            decoded = payload.decode("utf-8")
        except UnicodeDecodeError:
            return None, "not_utf8"
        if kind == _BYTES:
            text = decoded
        else:
            try:
                obj = json.loads(decoded)
            except (ValueError, RecursionError):  # RecursionError: valid but nested too deep
                return None, "invalid_json"
            if not isinstance(obj, dict) or json_key not in obj:
                return None, "missing_key"
            text = obj[json_key]
    if not isinstance(text, str):
        return None, "missing_key"
    if not text:
        return None, "empty"
    if not text.isascii():
        # JSON may spell a lone surrogate ("\\ud800"): a str that no UTF-8 encoder (the
        # tokenizer's included) accepts. Such a document is as unusable as invalid bytes, and is
        # skipped like them rather than stopping the whole run at encode time.
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return None, "not_utf8"
    return text, None


def skip_message(path: str | os.PathLike, lineno: int, reason: str, json_key: str = "text") -> str:
    """`file:line: what is wrong` for a document that parse_record (or an encoder) rejected."""
    return f"{path}:{lineno}: {_REASON_TEXT[reason].format(key=json_key)}"


class SkipReport:
    """The unusable documents of a run, as preprocess and the tokenizer trainer report them:
    counts by reason, and the first `limit` described by file:line."""

    def __init__(self, json_key: str = "text", limit: int = 20):
        self.json_key, self.limit = json_key, limit
        self.counts = dict.fromkeys(SKIP_REASONS, 0)
        self.reports: list[str] = []

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def add(self, path: str | os.PathLike, lineno: int, reason: str) -> str:
        """Count a skipped document; returns its `file:line: reason`."""
        message = skip_message(path, lineno, reason, self.json_key)
        self.counts[reason] += 1
        if len(self.reports) < self.limit:
            self.reports.append(message)
        return message

    def lines(self) -> list[str]:
        """What to log: each described document, then how many more there were."""
        more = self.total - len(self.reports)
        return ([f"skipped {m}" for m in self.reports]
                + ([f"... {more} more skipped documents not listed"] if more else []))

    def summary(self) -> str:
        return ", ".join(f"{n} {r}" for r, n in self.counts.items() if n) or "none"

    def first_problem(self) -> str:
        return f" (first problem: {self.reports[0]})" if self.reports else ""
