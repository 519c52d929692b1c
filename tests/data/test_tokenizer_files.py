"""Megatron's GPT-2 tokenizer files (vocab.json + merges.txt, `--tokenizer-type GPT2BPETokenizer`)
wherever bloomtrain takes a tokenizer.

Nothing can be downloaded, so the files are a byte-level BPE trained here with `tokenizers` and
saved in GPT-2's two-file format. Two references: transformers' GPT2TokenizerFast built from the
same files, and `megatron_encode` below, which follows Megatron's own reader
(megatron/tokenizer/gpt2_tokenization.py) step by step in plain Python: its regex, its byte
table, its merge ranks, its `[1:-1]` line handling and no special tokens.
"""
from __future__ import annotations

import json
import shutil
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from bloomtrain.data.tokenizer import GPT2BPETokenizer, Tokenizer, load_tokenizer
from bloomtrain.errors import UserError
from tests.conftest import MULTILINGUAL_TEXT

TEXTS = [
    MULTILINGUAL_TEXT,
    "",
    " ",
    "hello world",
    " leading space, two  spaces,   three, trailing ",
    "don't we'll they're I've she's it'd you'll I'm DON'T",
    "numbers 1234567 3.14159 -42 1e-9 ٣٤٥ 四五六",
    "tabs\tand\nnewlines\n\n\r\n  \n\t\t",
    "mixed数据and latin",
    "emoji👩‍👩‍👧‍👦at👍🏽word",
    "\x00\x7f\ufeff\U0010ffff lone controls",
    "def f(x):\n    return {'a': [1, 2]}  # comment\n",
    "Combining e\u0301 and Devanagari \u0915\u094d\u0937",
]
EOT = "<|endoftext|>"


def _write_pair(model, directory: Path, prefix: str = "") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    model.save(str(directory))  # vocab.json + merges.txt, GPT-2's format
    if prefix:
        for name in ("vocab.json", "merges.txt"):
            (directory / name).rename(directory / f"{prefix}{name}")
    return directory


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory) -> Path:
    """A GPT-2-style byte-level BPE (<= 700 tokens, <|endoftext|> one of them) as
    vocab.json + merges.txt."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, min_frequency=2, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    corpus = [MULTILINGUAL_TEXT, *TEXTS[3:8], "the of and to in is that for it as with was on"]
    tok.train_from_iterator(corpus * 30, trainer=trainer)
    return _write_pair(tok.model, tmp_path_factory.mktemp("gpt2") / "tok")


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's reversible byte table: printable bytes map to themselves, the rest to 256+.
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def megatron_encode(directory: Path, text: str) -> list[int]:
    """Megatron's GPT2Tokenizer.encode, written out: the regex, bytes to symbols, then the
    lowest-ranked adjacent pair merged until none is ranked; unknown symbols would be id 0."""
    import regex

    vocab, ranks = _megatron_tables(directory)
    pattern = regex.compile(
        r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
    table = _bytes_to_unicode()
    ids = []
    for piece in pattern.findall(text):
        word = [table[b] for b in piece.encode("utf-8")]
        while len(word) > 1:
            pairs = [(ranks.get((a, b), float("inf")), i) for i, (a, b) in
                     enumerate(zip(word, word[1:]))]
            rank, _ = min(pairs)
            if rank == float("inf"):
                break
            best = next(p for r, p in pairs if r == rank)
            first, second = word[best], word[best + 1]
            merged, i = [], 0
            while i < len(word):  # every occurrence of the pair, left to right
                if i < len(word) - 1 and (word[i], word[i + 1]) == (first, second):
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        ids += [vocab.get(sym, 0) for sym in word]
    return ids


@lru_cache(maxsize=None)
def _megatron_tables(directory: Path):
    vocab = json.loads((directory / "vocab.json").read_text(encoding="utf-8"))
    lines = (directory / "merges.txt").read_text(encoding="utf-8").split("\n")[1:-1]
    ranks = {tuple(line.split()): r for r, line in enumerate(lines)}
    return vocab, ranks


def _hf(directory: Path):
    from transformers import GPT2TokenizerFast

    # transformers 5 takes the files as vocab=/merges= (vocab_file= is no longer read).
    return GPT2TokenizerFast(vocab=str(directory / "vocab.json"),
                             merges=str(directory / "merges.txt"))


def test_encodes_as_megatron_and_transformers(gpt2_files):
    tok = load_tokenizer(gpt2_files)
    hf = _hf(gpt2_files)
    assert isinstance(tok, GPT2BPETokenizer) and tok.vocab_size == len(hf) > 500
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False), text
        assert ids == megatron_encode(gpt2_files, text), text
        assert tok.decode(ids) == text
    assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]
    assert max(len(tok.encode(t)) / max(len(t), 1) for t in TEXTS[3:6]) < 0.6  # merges apply
    assert tok.eod_id == hf.convert_tokens_to_ids(EOT) == 0 and tok.pad_id is None
    # Megatron has no special tokens: a literal <|endoftext|> in a text is text, never the eod
    # id (transformers splits it as a special token unless told not to).
    text = f"a{EOT}b"
    ids = tok.encode(text)
    assert tok.eod_id not in ids and ids == megatron_encode(gpt2_files, text)
    assert ids == hf.encode(text, add_special_tokens=False, split_special_tokens=True)
    assert tok.decode(ids + [tok.eod_id]) == text + EOT
    # Invalid UTF-8 from a cut multi-byte character decodes with U+FFFD, as errors='replace'.
    assert tok.decode(tok.encode("数")[:1]) == "\ufffd"


def test_every_way_to_name_the_files(gpt2_files, tmp_path):
    named = _write_pair_copy(gpt2_files, tmp_path / "named", "gpt2-")
    reference = load_tokenizer(gpt2_files).encode(MULTILINGUAL_TEXT)
    for path in (gpt2_files / "vocab.json", named, named / "gpt2-vocab.json"):
        tok = load_tokenizer(path)
        assert isinstance(tok, GPT2BPETokenizer) and tok.encode(MULTILINGUAL_TEXT) == reference
    with pytest.raises(UserError, match="is a merges file; pass the vocab.json"):
        load_tokenizer(named / "gpt2-merges.txt")


def _write_pair_copy(src: Path, dst: Path, prefix: str = "") -> Path:
    dst.mkdir(parents=True)
    for name in ("vocab.json", "merges.txt"):
        shutil.copyfile(src / name, dst / f"{prefix}{name}")
    return dst


def test_save_round_trip_and_directory_with_both(gpt2_files, tmp_path):
    tok = load_tokenizer(gpt2_files)
    tok.save(tmp_path / "saved")
    saved = tmp_path / "saved"
    assert sorted(p.name for p in saved.iterdir()) == ["merges.txt", "tokenizer.json",
                                                       "tokenizer_config.json", "vocab.json"]
    for name in ("vocab.json", "merges.txt"):
        assert (saved / name).read_bytes() == (gpt2_files / name).read_bytes()
    again = load_tokenizer(saved)  # read from its tokenizer.json, checked against the pair
    assert type(again) is Tokenizer and again.megatron_files is not None
    assert again.eod_id == tok.eod_id and again.vocab_size == tok.vocab_size
    for text in TEXTS + [f"x{EOT}y"]:
        assert again.encode(text) == tok.encode(text)
    # Saving what was loaded keeps Megatron's files too.
    again.save(tmp_path / "twice")
    twice = (tmp_path / "twice" / "merges.txt").read_bytes()
    assert twice == (gpt2_files / "merges.txt").read_bytes()
    # transformers reads the saved directory as the same tokenizer.
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(saved))
    assert hf.encode(MULTILINGUAL_TEXT, add_special_tokens=False) == tok.encode(MULTILINGUAL_TEXT)
    assert hf.eos_token_id == tok.eod_id
    # A directory whose tokenizer.json and pair disagree is refused, naming both.
    lines = (saved / "merges.txt").read_text(encoding="utf-8").split("\n")
    lines[1], lines[2] = lines[2], lines[1]
    (saved / "merges.txt").write_text("\n".join(lines), encoding="utf-8")
    with pytest.raises(UserError, match="describe different tokenizers"):
        load_tokenizer(saved)


def test_checkpoint_keeps_it(gpt2_files, tmp_path):
    from bloomtrain import checkpoint as ckpt
    from bloomtrain.model import BloomShape, build_model

    tok = load_tokenizer(gpt2_files)
    shape = BloomShape(vocab_size=768, hidden_size=8, num_layers=1, num_heads=2,
                       ffn_hidden_size=32)
    step = ckpt.save_checkpoint(tmp_path / "run", 1, build_model(shape, seed=0).state_dict(),
                                shape, tokenizer=tok)
    ckpt.verify(step)
    # Where generate, serve and export-hf look: the tokenizer directory the manifest names.
    ref = ckpt.read_manifest(step)["tokenizer"]
    assert (step / ref / "tokenizer.json").is_file()
    back = load_tokenizer(step / ref)
    assert back.eod_id == tok.eod_id
    assert [back.encode(t) for t in TEXTS] == [tok.encode(t) for t in TEXTS]
    kept = (step / "tokenizer" / "vocab.json").read_bytes()
    assert kept == (gpt2_files / "vocab.json").read_bytes()


def test_preprocess_with_the_files(gpt2_files, tmp_path):
    from bloomtrain.cli import main
    from bloomtrain.data.indexed import MMapIndexedDataset

    docs = [t for t in TEXTS if t.strip()]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs), encoding="utf-8")
    assert main(["preprocess", "--input", str(src), "--tokenizer", str(gpt2_files / "vocab.json"),
                 "--output-prefix", str(tmp_path / "out"), "--append-eod"]) == 0
    ds = MMapIndexedDataset(tmp_path / "out_text_document")
    hf = _hf(gpt2_files)
    assert len(ds) == len(docs)
    for i, text in enumerate(docs):
        expected = hf.encode(text, add_special_tokens=False) + [hf.convert_tokens_to_ids(EOT)]
        assert np.asarray(ds[i]).tolist() == expected


def _broken(gpt2_files: Path, tmp_path: Path, name: str, edit) -> Path:
    directory = _write_pair_copy(gpt2_files, tmp_path / "broken")
    path = directory / name
    path.write_text(edit(path.read_text(encoding="utf-8")), encoding="utf-8")
    return directory


def _drop_token(text: str, token: str) -> str:
    vocab = json.loads(text)
    gone = vocab.pop(token)
    return json.dumps({t: i - (i > gone) for t, i in vocab.items()})


@pytest.mark.parametrize("name, edit, message", [
    ("vocab.json", lambda t: t[:-10], r"vocab.json is not valid JSON \(.* at line 1 column"),
    ("vocab.json", lambda t: "[1, 2]", "must hold a JSON object mapping each token to its id"),
    ("vocab.json", lambda t: t.replace('"<|endoftext|>":0', '"<|endoftext|>":"0"'),
     "has id '0'; ids must be integers"),
    ("vocab.json", lambda t: t.replace('"<|endoftext|>":0', '"<|endoftext|>":9999'),
     r"ids must be 0\.\.\d+, each once; the first id out of place is 1"),
    ("vocab.json", lambda t: _drop_token(t, EOT), "has no '<\\|endoftext\\|>'"),
    ("merges.txt", lambda t: t.split("\n", 1)[1], "must start with a '#version: 0.2' header"),
    ("merges.txt", lambda t: t.rstrip("\n"), "does not end with a newline"),
    ("merges.txt", lambda t: t.replace("\n", "\nĠ t h\n", 1), r"line 2: 'Ġ t h' is not a merge"),
    ("merges.txt", lambda t: t + "Ġ zzz\n", "needs 'zzz', which .*vocab.json does not have"),
])
def test_bad_files_say_what_to_change(gpt2_files, tmp_path, name, edit, message):
    directory = _broken(gpt2_files, tmp_path, name, edit)
    with pytest.raises(UserError, match=message) as e:
        load_tokenizer(directory)
    assert str(directory / name) in str(e.value)


def test_vocab_without_merges(gpt2_files, tmp_path):
    directory = tmp_path / "alone"
    directory.mkdir()
    shutil.copyfile(gpt2_files / "vocab.json", directory / "gpt2-vocab.json")
    with pytest.raises(UserError, match="gpt2-merges.txt, is missing; put Megatron's --merge-file"):
        load_tokenizer(directory)
    with pytest.raises(UserError, match="no tokenizer.json \\(nor Megatron's vocab.json"):
        load_tokenizer(tmp_path)
    # Beside a tokenizer.json, a lone vocab.json is not the tokenizer and is not an error.
    shutil.copyfile(load_tokenizer(gpt2_files).save(tmp_path / "s"), directory / "tokenizer.json")
    assert type(load_tokenizer(directory)) is Tokenizer


def test_the_special_tokens_and_chat_prompts_are_transformers(gpt2_files, tmp_path):
    """GPT2TokenizerFast over the same files is the reference. A Megatron pair's <|endoftext|>
    is bos, eos and unk to a chat template (it rendered none of them but eos), and a rendered
    chat's `{{ eos_token }}` is its id (it was spelled out in text tokens). The Hub's GPT-2
    layout (a tokenizer.json whose tokenizer_config.json names no eos) has <|endoftext|> as its
    end of document, and a directory with only the pair is a model directory's tokenizer."""
    from transformers import GPT2TokenizerFast

    from bloomtrain.checkpoint.hf.convert import special_token_ids
    from bloomtrain.checkpoint.tokenizer import has_tokenizer
    from bloomtrain.serve.chat import ChatTemplate

    tok = load_tokenizer(gpt2_files)
    hf = GPT2TokenizerFast(vocab=str(gpt2_files / "vocab.json"),
                           merges=str(gpt2_files / "merges.txt"))
    assert hf.encode("hello world") == tok.encode("hello world")  # the same files read
    template = ("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ eos_token }}"
                "{% endfor %}{{ unk_token }}")
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]
    rendered = ChatTemplate(template, tok).render(messages, False)
    assert rendered == hf.apply_chat_template(messages, chat_template=template, tokenize=False)
    want = hf.apply_chat_template(messages, chat_template=template, tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert tok.encode_with_specials(rendered) == list(want)
    assert tok.encode_with_specials(rendered).count(tok.eod_id) == 4
    assert tok.special_ids() == frozenset(hf.all_special_ids)
    # The Hub's gpt2: tokenizer.json (with <|endoftext|> added), tokenizer_config.json naming
    # nothing, no special_tokens_map.json.
    hub = tmp_path / "hub"
    hf.save_pretrained(str(hub))
    (hub / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 1024}))
    (hub / "special_tokens_map.json").unlink(missing_ok=True)
    assert load_tokenizer(hub).eod_id == hf.eos_token_id
    assert special_token_ids(hub)["eos_token_id"] == hf.eos_token_id
    pair_only = tmp_path / "model"
    shutil.copytree(gpt2_files, pair_only)
    assert has_tokenizer(pair_only)


def test_a_tokenizer_json_that_encodes_otherwise_than_its_pair_is_refused(gpt2_files, tmp_path):
    """The directory is read from its tokenizer.json, and its pair goes with checkpoints for
    Megatron's --vocab-file: the same vocabulary and merges under a normalizer or another
    pre-tokenizer encode otherwise (NFKC: "ﬁne" as "fine"), which was let in."""
    from tokenizers import normalizers

    tok = load_tokenizer(gpt2_files)
    tok.save(tmp_path / "saved")
    doc = json.loads((tmp_path / "saved" / "tokenizer.json").read_text())
    for name, edit in (("normalizer", lambda d: d.update(normalizer={"type": "NFKC"})),
                       ("pre-tokenizer", lambda d: d["pre_tokenizer"].update(
                           add_prefix_space=True))):
        bad = tmp_path / name
        shutil.copytree(tmp_path / "saved", bad)
        changed = json.loads(json.dumps(doc))
        edit(changed)
        (bad / "tokenizer.json").write_text(json.dumps(changed))
        with pytest.raises(UserError, match=f"describe different tokenizers \\(its {name}"):
            load_tokenizer(bad)
    assert normalizers.NFKC().normalize_str("ﬁne") == "fine"  # what the first one would do
