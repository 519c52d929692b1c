import gzip
import io
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from bloomtrain.data.indexed import IndexedDatasetBuilder, MMapIndexedDataset
from bloomtrain.data.preprocess import preprocess
from bloomtrain.data.sources import expand_inputs
from bloomtrain.data.tokenizer import load_tokenizer
from bloomtrain.errors import UserError

TEXTS = ["hello world", "数据并行", "Привет 👩‍👩‍👧", "def f():\n\treturn 1  \n", "مرحبا"]


def _jsonl(texts):
    return "".join(json.dumps({"text": t, "id": i}, ensure_ascii=False) + "\n"
                   for i, t in enumerate(texts)).encode("utf-8")


def _read(prefix):
    ds = MMapIndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))], ds


def _files(directory):
    return sorted(p for p in os.listdir(directory))


def _quiet(**kw):
    return dict(progress=False, log=lambda _: None, **kw)


def test_all_formats_and_input_kinds(tiny_tokenizer_dir, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    src = tmp_path / "in"
    (src / "sub").mkdir(parents=True)
    (src / "a.jsonl").write_bytes(_jsonl(TEXTS[:2]))
    (src / "b.jsonl.gz").write_bytes(gzip.compress(_jsonl(TEXTS[2:3])))
    (src / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_jsonl(TEXTS[3:4])))
    pq.write_table(pa.table({"text": TEXTS[4:], "n": [1]}), src / "sub" / "d.parquet")
    (src / "sub" / "e.txt").write_text("a whole\n\nplain text file\n", encoding="utf-8")
    (src / ".hidden.jsonl").write_bytes(_jsonl(["never read"]))
    tok = load_tokenizer(tiny_tokenizer_dir)
    expected = [tok.encode(t) for t in TEXTS] + [tok.encode("a whole\n\nplain text file\n")]

    stats = preprocess([src], tiny_tokenizer_dir, tmp_path / "dir", **_quiet())
    seqs, ds = _read(tmp_path / "dir_text_document")
    assert seqs == expected and ds.doc_idx.tolist() == list(range(len(expected) + 1))
    assert ds.dtype == np.uint16 and stats.docs == len(expected) and stats.num_skipped == 0
    assert stats.tokens == sum(map(len, expected)) and stats.files == 5

    preprocess([str(src / "*.jsonl*"), str(src / "sub" / "*.txt")], tok, tmp_path / "glob",
               append_eod=True, **_quiet())
    seqs, _ = _read(tmp_path / "glob_text_document")
    assert seqs == [e + [tok.eod_id] for e in expected[:4] + expected[5:]]


def test_workers_are_byte_identical(tiny_tokenizer_dir, tmp_path):
    lines = [json.dumps({"body": f"{TEXTS[i % 5]} {i}"}, ensure_ascii=False) for i in range(600)]
    lines[7] = "{broken"
    (tmp_path / "x.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = {}
    for n in (1, 2):
        stats = preprocess([tmp_path / "x.jsonl"], tiny_tokenizer_dir, tmp_path / f"w{n}",
                           json_key="body", workers=n, **_quiet())
        assert stats.docs == 599 and stats.skipped["invalid_json"] == 1
        out[n] = [(tmp_path / f"w{n}_body_document{s}").read_bytes() for s in (".bin", ".idx")]
    assert out[1] == out[2]


def test_bad_inputs_are_counted_reported_and_skipped(tiny_tokenizer_dir, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_bytes(b"\n".join([
        b'{"text": "good one"}',
        b'{"text": "unterminated',
        b'{"other": "no text key"}',
        b'{"text": 5}',
        b'{"text": "caf\xe9"}',
        b'{"text": "half a pair \\ud83d here"}',
        b'',
        b'{"text": ""}',
        b'{"text": "good two"}',
    ]) + b"\n")
    logged = []
    stats = preprocess([data], tiny_tokenizer_dir, tmp_path / "o", progress=False, log=logged.append)
    assert stats.docs == 2
    assert stats.skipped == {"invalid_json": 1, "missing_key": 2, "not_utf8": 2, "empty": 1}
    utf8 = "not valid UTF-8 (invalid bytes, or a lone surrogate escape such as \\ud800)"
    assert stats.reports == [
        f"{data}:2: invalid JSON",
        f"{data}:3: missing key 'text' or its value is not a string",
        f"{data}:4: missing key 'text' or its value is not a string",
        f"{data}:5: {utf8}",
        f"{data}:6: {utf8}",
        f"{data}:8: empty document",
    ]
    assert any(f"{data}:5" in line for line in logged)
    assert any("1 invalid_json" in line and "2 missing_key" in line for line in logged)
    seqs, _ = _read(tmp_path / "o_text_document")
    tok = load_tokenizer(tiny_tokenizer_dir)
    assert seqs == [tok.encode("good one"), tok.encode("good two")]


def test_strict_fails_and_keeps_existing_dataset(tiny_tokenizer_dir, tmp_path):
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_bytes(_jsonl(TEXTS))
    bad.write_bytes(_jsonl(TEXTS[:3]) + b'{"text": "x"\n')
    preprocess([good], tiny_tokenizer_dir, tmp_path / "out" / "p", **_quiet())
    before = {p: (tmp_path / "out" / p).read_bytes() for p in _files(tmp_path / "out")}
    with pytest.raises(UserError, match=f"{bad}:4"):
        preprocess([bad], tiny_tokenizer_dir, tmp_path / "out" / "p", strict=True, **_quiet())
    assert {p: (tmp_path / "out" / p).read_bytes() for p in _files(tmp_path / "out")} == before
    with pytest.raises(UserError, match=f"{bad}:4"):
        preprocess([bad], tiny_tokenizer_dir, tmp_path / "fresh" / "p", strict=True, workers=2, **_quiet())
    assert _files(tmp_path / "fresh") == []


def test_failure_mid_run_leaves_no_dataset(tiny_tokenizer_dir, tmp_path, monkeypatch):
    (tmp_path / "d.jsonl").write_bytes(_jsonl(TEXTS * 3))
    calls = []
    real_add_item = IndexedDatasetBuilder.add_item

    def dying_add_item(self, tokens):
        calls.append(1)
        if len(calls) == 6:
            raise OSError("disk full")
        real_add_item(self, tokens)

    monkeypatch.setattr(IndexedDatasetBuilder, "add_item", dying_add_item)
    with pytest.raises(OSError, match="disk full"):
        preprocess([tmp_path / "d.jsonl"], tiny_tokenizer_dir, tmp_path / "out" / "p", **_quiet())
    assert _files(tmp_path / "out") == []


def test_user_errors(tiny_tokenizer_dir, tmp_path):
    (tmp_path / "d.jsonl").write_bytes(_jsonl(TEXTS))
    with pytest.raises(UserError, match="does not exist"):
        preprocess([tmp_path / "missing.jsonl"], tiny_tokenizer_dir, tmp_path / "o", **_quiet())
    with pytest.raises(UserError, match="no files matched"):
        expand_inputs([str(tmp_path / "*.parquet")])
    with pytest.raises(UserError, match="tokenizer"):
        preprocess([tmp_path / "d.jsonl"], tmp_path / "no_tok", tmp_path / "o", **_quiet())
    (tmp_path / "empty.jsonl").write_bytes(b'{"text": ""}\n')
    with pytest.raises(UserError, match="no usable documents"):
        preprocess([tmp_path / "empty.jsonl"], tiny_tokenizer_dir, tmp_path / "o", **_quiet())
    (tmp_path / "blocker").write_text("a file where a directory is needed")
    with pytest.raises(UserError, match="output directory"):
        preprocess([tmp_path / "d.jsonl"], tiny_tokenizer_dir, tmp_path / "blocker" / "o", **_quiet())
    (tmp_path / "trunc.jsonl.gz").write_bytes(gzip.compress(_jsonl(TEXTS))[:-10])
    with pytest.raises(UserError, match="trunc.jsonl.gz"):
        preprocess([tmp_path / "trunc.jsonl.gz"], tiny_tokenizer_dir, tmp_path / "o", **_quiet())
    assert not list(tmp_path.glob("o_*"))


def test_sigterm_cleans_up_as_ctrl_c_does(tiny_tokenizer_dir, tmp_path, monkeypatch, capsys):
    # SIGTERM (a scheduler's, `kill`) mid-write: the command ends as at Ctrl-C, its temporaries
    # removed, one line, exit 143. The default action killed it and left `.bin.tmp.PID` files
    # (named per process, so no later run removed them) and, with --workers, orphaned workers.
    import signal
    from bloomtrain.cli import main
    (tmp_path / "a.jsonl").write_bytes(_jsonl(TEXTS))
    real = IndexedDatasetBuilder.add_item

    def add_then_sigterm(self, *a, **k):
        real(self, *a, **k)
        os.kill(os.getpid(), signal.SIGTERM)  # while the .bin is being written
    monkeypatch.setattr(IndexedDatasetBuilder, "add_item", add_then_sigterm)
    before = signal.getsignal(signal.SIGTERM)
    assert main(["preprocess", "--input", str(tmp_path / "a.jsonl"), "--tokenizer",
                 str(tiny_tokenizer_dir), "--output-prefix", str(tmp_path / "a"),
                 "--no-progress"]) == 143
    assert capsys.readouterr().err.strip().splitlines()[-1] == "terminated"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl"]  # no output, no temporary
    assert signal.getsignal(signal.SIGTERM) is before


def test_cli_preprocess_inspect_merge(tiny_tokenizer_dir, tmp_path, capsys):
    from bloomtrain.cli import main

    (tmp_path / "a.jsonl").write_bytes(_jsonl(TEXTS))
    (tmp_path / "b.jsonl").write_bytes(_jsonl(TEXTS[::-1]))
    for name in ("a", "b"):
        assert main(["preprocess", "--input", str(tmp_path / f"{name}.jsonl"), "--tokenizer",
                     str(tiny_tokenizer_dir), "--output-prefix", str(tmp_path / name),
                     "--append-eod", "--no-progress"]) == 0
    assert main(["data", "merge", "--inputs", str(tmp_path / "a_text_document"),
                 str(tmp_path / "b_text_document.bin"), "--output-prefix", str(tmp_path / "m")]) == 0
    merged, ds = _read(tmp_path / "m")
    assert merged == _read(tmp_path / "a_text_document")[0] + _read(tmp_path / "b_text_document")[0]
    assert ds.num_docs == 10
    capsys.readouterr()
    assert main(["data", "inspect", str(tmp_path / "m"), "--tokenizer", str(tiny_tokenizer_dir),
                 "--samples", "2"]) == 0
    out = capsys.readouterr().out
    assert "documents  10" in out and "dtype      uint16" in out and "histogram" in out
    assert repr(TEXTS[0] + "</s>") in out
    assert main(["preprocess", "--input", str(tmp_path / "nope"), "--tokenizer",
                 str(tiny_tokenizer_dir), "--output-prefix", str(tmp_path / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_merge_rejects_mixed_dtypes(tmp_path):
    from bloomtrain.data.indexed import write_dataset
    from bloomtrain.data.inspect import merge_datasets

    write_dataset(tmp_path / "n", [[[1, 2]]], np.uint16)
    write_dataset(tmp_path / "w", [[[1, 2]]], np.int32)
    with pytest.raises(UserError, match="different dtypes"):
        merge_datasets([str(tmp_path / "n"), str(tmp_path / "w")], str(tmp_path / "m"))
    assert not list(tmp_path.glob("m*"))


def test_merge_refuses_an_input_through_a_symlink_and_a_bare_directory(tmp_path):
    """The output compared by real path: an input reached through a symlinked directory was
    replaced by the merge. `outdir/` wrote the hidden outdir/.bin and .idx."""
    from bloomtrain.data.indexed import write_dataset
    from bloomtrain.data.inspect import merge_datasets

    (tmp_path / "d").mkdir()
    write_dataset(tmp_path / "d" / "a", [[[1, 2]]], np.uint16)
    write_dataset(tmp_path / "d" / "b", [[[3]]], np.uint16)
    (tmp_path / "link").symlink_to(tmp_path / "d")
    before = (tmp_path / "d" / "a.bin").read_bytes()
    with pytest.raises(UserError, match="is also an input"):
        merge_datasets([str(tmp_path / "d" / "a"), str(tmp_path / "d" / "b")],
                       str(tmp_path / "link" / "a"))
    assert (tmp_path / "d" / "a.bin").read_bytes() == before
    with pytest.raises(UserError, match="names a directory"):
        merge_datasets([str(tmp_path / "d" / "a")], str(tmp_path / "out") + os.sep)


def test_worker_start_failure_raises_instead_of_hanging(tiny_tokenizer_dir, tmp_path):
    from concurrent.futures.process import BrokenProcessPool

    # The main process holds a loaded tokenizer whose files then disappear, so every worker's
    # initializer fails to load it, whatever the start method (fork or spawn).
    shutil.copytree(tiny_tokenizer_dir, tmp_path / "tok")
    tok = load_tokenizer(tmp_path / "tok")
    shutil.rmtree(tmp_path / "tok")
    (tmp_path / "d.jsonl").write_bytes(_jsonl(TEXTS))
    with pytest.raises(UserError, match="a tokenizer worker died .*; nothing was written to "
                                        ".*p_text_document.bin/.idx. A worker killed for memory "
                                        r".*wants fewer --workers \(now 2\)") as e:
        preprocess([tmp_path / "d.jsonl"], tok, tmp_path / "out" / "p", workers=2, **_quiet())
    assert isinstance(e.value.__cause__, BrokenProcessPool)
    assert _files(tmp_path / "out") == []


def test_a_worker_killed_mid_run_is_one_line_and_writes_nothing(tiny_tokenizer_dir, tmp_path):
    """A worker the OOM killer takes was a BrokenProcessPool traceback; now it is one line
    that says what to change, and the dataset already there is kept."""
    tok = load_tokenizer(tiny_tokenizer_dir)
    (tmp_path / "d.jsonl").write_bytes(_jsonl(TEXTS))
    preprocess([tmp_path / "d.jsonl"], tok, tmp_path / "out" / "p", **_quiet())
    before = {n: (tmp_path / "out" / n).read_bytes() for n in _files(tmp_path / "out")}
    (tmp_path / "kill.jsonl").write_bytes(_jsonl(TEXTS))
    # In a process of its own, whose forked workers SIGKILL themselves at their first batch
    # (the patched function is the one they inherit).
    script = f"""
import os, signal, sys
sys.path.insert(0, {str(Path(__file__).parents[2])!r})
import bloomtrain.data.preprocess as pre
from bloomtrain.data.tokenizer import load_tokenizer
from bloomtrain.errors import UserError
PARENT = os.getpid()
def dying(*args):
    if os.getpid() != PARENT:
        os.kill(os.getpid(), signal.SIGKILL)
pre._encode_batch = dying
try:
    pre.preprocess([{str(tmp_path / "kill.jsonl")!r}], load_tokenizer({str(tiny_tokenizer_dir)!r}),
                   {str(tmp_path / "out" / "p")!r}, workers=2, progress=False, log=print)
except UserError as e:
    print("ERROR", e)
"""
    import subprocess
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300)
    assert "ERROR a tokenizer worker died" in out.stdout, (out.stdout, out.stderr)
    assert "wants fewer --workers (now 2)" in out.stdout
    assert {n: (tmp_path / "out" / n).read_bytes() for n in _files(tmp_path / "out")} == before


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("terminal", [True, False], ids=["tty", "pipe"])
def test_progress_on_a_terminal_only(tiny_tokenizer_dir, tmp_path, monkeypatch, terminal):
    # Redrawn in place on stderr, fields joined by " | " as training's progress line, ended by a
    # newline before the summary; a pipe or a log file gets the summary alone.
    for i in range(2):
        (tmp_path / f"{i}.jsonl").write_bytes(_jsonl(TEXTS))
    stream = _Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    monkeypatch.setenv("COLUMNS", "300")
    preprocess([tmp_path / "0.jsonl", tmp_path / "1.jsonl"], tiny_tokenizer_dir, tmp_path / "o",
               log=lambda _: None)
    if not terminal:
        assert stream.getvalue() == ""
        return
    draws = stream.getvalue().split("\r\x1b[2K")[1:]
    assert draws and draws[-1].endswith("\n")
    fields = draws[-1].rstrip("\n").split(" | ")
    assert fields[:3] == ["preprocess", "file 2 of 2", "10 docs"]
    assert fields[3].endswith(" tokens") and fields[4].endswith(" docs/s")
    assert fields[5].endswith(" tok/s") and fields[6] == "0:00:00"


def _word_level(tmp_path, vocab, **settings):
    """A word-level tokenizer.json over `vocab`, saved with `settings` (truncation, padding)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if "truncation" in settings:
        tok.enable_truncation(max_length=settings["truncation"])
    if "padding" in settings:
        tok.enable_padding(pad_id=settings["padding"], pad_token="<pad>")
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path / "tokenizer.json"


def test_a_tokenizer_saved_with_truncation_and_padding_tokenizes_documents_whole(tmp_path):
    """`tokenizers` keeps truncation and padding in tokenizer.json (Hub files often have them),
    and its raw encode applies them: every document was cut to max_length and the shorter ones
    of a batch padded, silently, into the .bin. transformers' encode, Megatron's path, turns
    both off: the reference here."""
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, "a": 4, "b": 5, "c": 6}
    file = _word_level(tmp_path, vocab, truncation=4, padding=3)
    docs = ["a b c a b c a b", "c", "b a"]
    with open(tmp_path / "in.jsonl", "w") as f:
        for text in docs:
            f.write(json.dumps({"text": text}) + "\n")
    preprocess([str(tmp_path / "in.jsonl")], str(file), str(tmp_path / "out"), progress=False,
               log=lambda *_: None, append_eod=False)
    ds = MMapIndexedDataset(str(tmp_path / "out_text_document"))
    hf = PreTrainedTokenizerFast(tokenizer_file=str(file))
    assert [ds[i].tolist() for i in range(len(ds))] == \
        [hf.encode(t, add_special_tokens=False) for t in docs]


def test_a_vocabulary_with_gaps_between_ids_sizes_the_dtype_by_its_largest_id(tmp_path):
    """The dataset's dtype (and the embedding) must hold the largest id, not the number of
    tokens: 4 tokens with an id of 70,000 picked uint16 and failed with a bare OverflowError."""
    file = _word_level(tmp_path, {"<unk>": 0, "<s>": 1, "</s>": 2, "b": 70000})
    assert load_tokenizer(str(file)).vocab_size == 70001
    (tmp_path / "in.jsonl").write_text(json.dumps({"text": "b b"}) + "\n")
    preprocess([str(tmp_path / "in.jsonl")], str(file), str(tmp_path / "out"), progress=False,
               log=lambda *_: None, append_eod=True)
    ds = MMapIndexedDataset(str(tmp_path / "out_text_document"))
    assert ds[0].tolist() == [70000, 70000, 2]
    assert ds[0].dtype.itemsize >= 4


def test_merge_and_tokenizer_train_on_a_full_disk_say_so_in_one_line(tmp_path, monkeypatch):
    """Out of space: one line that says so and what to do (an OSError traceback before), and
    nothing left under the output's name. Other errors pass as they are."""
    import errno

    from bloomtrain.data import indexed
    from bloomtrain.data.indexed import write_dataset
    from bloomtrain.data.inspect import merge_datasets
    from bloomtrain.data.tokenizer import train_tokenizer

    write_dataset(tmp_path / "a", [[[1, 2]]], np.uint16)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(indexed.IndexedDatasetBuilder, "add_index", full)
    with pytest.raises(UserError, match=r"merging into .*m\.bin/\.idx failed: No space left on "
                                        r"device .*choose another --output-prefix"):
        merge_datasets([str(tmp_path / "a")], str(tmp_path / "m"))
    assert not list(tmp_path.glob("m*"))
    monkeypatch.setattr(indexed.IndexedDatasetBuilder, "add_index",
                        lambda *a: (_ for _ in ()).throw(OSError(errno.EACCES, "denied")))
    with pytest.raises(PermissionError):
        merge_datasets([str(tmp_path / "a")], str(tmp_path / "m"))

    from bloomtrain.data import tokenizer as tok_module
    (tmp_path / "c.txt").write_text("hello world " * 50)
    monkeypatch.setattr(tok_module, "_write_tokenizer_dir", full)
    with pytest.raises(UserError, match="writing the tokenizer to .* failed: No space left"):
        train_tokenizer([tmp_path / "c.txt"], 300, tmp_path / "tok", log=lambda *a: None)


# ---- inputs named, linked, encoded and compressed as users have them ---------------------------
def test_a_path_with_glob_characters_is_read_as_named(tiny_tokenizer_dir, tmp_path):
    # `shard[0].jsonl` exists: it is that file, not the pattern (which matches shard0.jsonl).
    (tmp_path / "shard[0].jsonl").write_bytes(_jsonl(["the named one"]))
    (tmp_path / "shard0.jsonl").write_bytes(_jsonl(["another file"]))
    tok = load_tokenizer(tiny_tokenizer_dir)
    preprocess([tmp_path / "shard[0].jsonl"], tok, tmp_path / "o", **_quiet())
    assert _read(tmp_path / "o_text_document")[0] == [tok.encode("the named one")]


def test_a_linked_directory_is_walked_as_a_glob_walks_it(tiny_tokenizer_dir, tmp_path):
    corpus, shards = tmp_path / "corpus", tmp_path / "elsewhere"
    corpus.mkdir()
    shards.mkdir()
    (corpus / "a.jsonl").write_bytes(_jsonl(["here"]))
    (shards / "b.jsonl").write_bytes(_jsonl(["linked"]))
    (corpus / "more").symlink_to(shards)
    by_dir = [p.name for p in expand_inputs([corpus])]
    by_glob = [p.name for p in expand_inputs([str(corpus / "**")])]
    assert by_dir == by_glob == ["a.jsonl", "b.jsonl"]
    (shards / "loop").symlink_to(corpus)  # a cycle: each directory walked once
    assert [p.name for p in expand_inputs([corpus])] == ["a.jsonl", "b.jsonl"]


def test_byte_order_marks_and_cr_line_ends_split_as_megatron_reads_them(tiny_tokenizer_dir,
                                                                         tmp_path):
    # Megatron's preprocess_data.py reads lines with open(..., encoding="utf-8"): universal
    # newlines. A BOM is the encoding's mark, not the first record's text.
    tok = load_tokenizer(tiny_tokenizer_dir)
    rows = _jsonl(["one", "two", "three"])
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + rows)
    (tmp_path / "cr.jsonl").write_bytes(rows.replace(b"\n", b"\r"))
    (tmp_path / "crlf.jsonl").write_bytes(rows.replace(b"\n", b"\r\n"))
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfplain text")
    for name in ("bom.jsonl", "cr.jsonl", "crlf.jsonl"):
        stats = preprocess([tmp_path / name], tok, tmp_path / name, **_quiet())
        assert stats.num_skipped == 0, name
        assert _read(f"{tmp_path / name}_text_document")[0] == [tok.encode(t) for t in
                                                                ("one", "two", "three")], name
    preprocess([tmp_path / "bom.txt"], tok, tmp_path / "t", **_quiet())
    assert _read(tmp_path / "t_text_document")[0] == [tok.encode("plain text")]


def test_inputs_that_cannot_be_text_are_refused_by_name(tiny_tokenizer_dir, tmp_path):
    tok = load_tokenizer(tiny_tokenizer_dir)
    src = tmp_path / "in"
    src.mkdir()
    (src / "a.jsonl").write_bytes(_jsonl(TEXTS))
    # A second run whose output went into its input directory: the dataset is not text, and
    # the run's own output is not its input.
    preprocess([src], tok, src / "out", **_quiet())
    with pytest.raises(UserError, match="out_text_document.(bin|idx) is also this run's output"):
        preprocess([src], tok, src / "out", **_quiet())
    with pytest.raises(UserError, match="is a tokenized dataset .*not text"):
        preprocess([src], tok, tmp_path / "elsewhere", **_quiet())
    assert _read(src / "out_text_document")[0] == [tok.encode(t) for t in TEXTS]  # kept whole
    (tmp_path / "b.jsonl.xz").write_bytes(b"\xfd7zXZ\x00")
    with pytest.raises(UserError, match="xz files are not read here; decompress it"):
        preprocess([tmp_path / "b.jsonl.xz"], tok, tmp_path / "x", **_quiet())
    # A tarball of shards: read as one text document of tar headers and bytes, as .tgz is not.
    import io
    import tarfile
    for name, mode in (("corpus.tar.gz", "w:gz"), ("CORPUS.TAR.GZ", "w:gz"), ("c.tgz", "w:gz")):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode=mode) as tar:
            info = tarfile.TarInfo("shard.jsonl")
            info.size = len(_jsonl(TEXTS))
            tar.addfile(info, io.BytesIO(_jsonl(TEXTS)))
        (tmp_path / name).write_bytes(buf.getvalue())
        with pytest.raises(UserError, match=r"tar\.gz files are not read here"):
            preprocess([tmp_path / name], tok, tmp_path / "t", **_quiet())
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(UserError, match="is a pipe or a device, not a file"):
        preprocess([fifo], tok, tmp_path / "p", **_quiet())
    # Valid JSON nested past the parser's depth: skipped as invalid, like any line it cannot read.
    (tmp_path / "deep.jsonl").write_bytes(b"[" * 100000 + b"]" * 100000 + b"\n" + _jsonl(["ok"]))
    stats = preprocess([tmp_path / "deep.jsonl"], tok, tmp_path / "d", **_quiet())
    assert stats.docs == 1 and stats.num_skipped == 1


def test_a_truncated_zst_is_refused_and_every_frame_of_a_whole_one_is_read(tiny_tokenizer_dir,
                                                                          tmp_path):
    """zstandard's stream reader ends quietly where a truncated file ends inside a frame: the
    documents after the cut were dropped, "skipped: none", even with --strict (a truncated .gz
    was already an error). `.zstd` was read as text (every document "not valid UTF-8"), and
    so was a `.parquet.gz`."""
    import zstandard

    tok = load_tokenizer(tiny_tokenizer_dir)
    texts = [f"document {i}: " + TEXTS[i % len(TEXTS)] * 20 for i in range(40)]
    lines = _jsonl(texts).splitlines(keepends=True)
    frames = [zstandard.ZstdCompressor().compress(b"".join(lines[:25])),
              zstandard.ZstdCompressor().compress(b"".join(lines[25:]))]
    (tmp_path / "whole.jsonl.zstd").write_bytes(b"".join(frames))  # two frames, .zstd named
    stats = preprocess([tmp_path / "whole.jsonl.zstd"], tok, tmp_path / "w", **_quiet())
    assert stats.docs == 40 and _read(tmp_path / "w_text_document")[0] == [
        tok.encode(t) for t in texts]
    # Cut inside the second frame, at a block boundary: the reader found no error there.
    one = zstandard.ZstdCompressor().compressobj()
    blocks = [one.compress(line) + one.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK) for line in lines]
    cut = b"".join(blocks[:30])
    assert zstandard.ZstdDecompressor().stream_reader(io.BytesIO(cut)).read().count(b"\n") == 30
    (tmp_path / "cut.jsonl.zst").write_bytes(cut)
    with pytest.raises(UserError, match=r"cannot read .*cut.jsonl.zst as zst: the compressed "
                                        r"file ends inside a zstd frame \(truncated\)"):
        preprocess([tmp_path / "cut.jsonl.zst"], tok, tmp_path / "c", strict=True, **_quiet())
    assert not any(n.startswith("c_") for n in _files(tmp_path))
    (tmp_path / "t.parquet.gz").write_bytes(gzip.compress(b"PAR1"))
    with pytest.raises(UserError, match="a Parquet file compresses its own columns; decompress "
                                        "it to t.parquet"):
        preprocess([tmp_path / "t.parquet.gz"], tok, tmp_path / "q", **_quiet())


def test_append_eod_takes_the_eos_transformers_takes(tiny_tokenizer_dir, tmp_path):
    # Megatron's PretrainedFromHF appends tokenizer.eos_token_id, which transformers resolves
    # from special_tokens_map.json over tokenizer_config.json.
    transformers = pytest.importorskip("transformers")
    d = tmp_path / "tok"
    shutil.copytree(tiny_tokenizer_dir, d)
    from tokenizers import Tokenizer as HFTokenizer
    raw = HFTokenizer.from_file(str(d / "tokenizer.json"))
    raw.add_special_tokens(["<|endoftext|>"])
    raw.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>"}))
    (d / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    ours = load_tokenizer(d)
    assert ours.eod_id == hf.eos_token_id == raw.token_to_id("<|endoftext|>")


def test_inspect_reads_only_the_tokens_it_shows_of_a_long_document(tmp_path, monkeypatch):
    """A plain-text file is one document; its sample was joined whole (4 GB for 2**30 tokens)
    before 800 tokens of it were kept."""
    from bloomtrain.data import inspect as data_inspect
    from bloomtrain.data.indexed import write_dataset
    write_dataset(tmp_path / "d", [[list(range(1, 600)), list(range(600, 1200)), [5] * 3000]],
                  np.uint16)
    ds = MMapIndexedDataset(tmp_path / "d")
    asked = []
    get = ds.get
    monkeypatch.setattr(ds, "get", lambda i, o=0, n=None: asked.append(n) or get(i, o, n))
    ids = data_inspect._first_tokens(ds, 0, 3, 800)
    assert ids.tolist() == list(range(1, 801))
    assert asked == [599, 201]
    assert data_inspect._first_tokens(ds, 0, 0, 800).tolist() == []
