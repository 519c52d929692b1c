"""Megatron's GPT-2 tokenizer files: `--tokenizer-type GPT2BPETokenizer --vocab-file vocab.json
--merge-file merges.txt` (megatron/tokenizer/gpt2_tokenization.py in Megatron-LM and
Megatron-DeepSpeed; the files are often named gpt2-vocab.json and gpt2-merges.txt).

The pair is read into the `tokenizers` library's byte-level BPE (bloomtrain.data.tokenizer's
GPT2BPETokenizer is the Tokenizer built from it) so that it encodes as Megatron's GPT2Tokenizer
does: GPT-2's pre-tokenization regex, no prefix space, no special tokens (Megatron
passes `special_tokens=[]`, so a literal "<|endoftext|>" in a text is encoded as ordinary text),
and `<|endoftext|>` as the end-of-document id. Decoding replaces invalid UTF-8, as Megatron's
`errors='replace'` does.

Where the two readers of these files could differ, the file is refused instead: Megatron drops
the first and the last line of merges.txt unread (`split('\\n')[1:-1]`), which is right only for a
file that starts with its `#version` header and ends with a newline. A merge whose tokens are not
in the vocabulary, which Megatron would silently map to id 0, is refused too.
"""
from __future__ import annotations

import json
from pathlib import Path

from bloomtrain.errors import UserError

EOD_TOKEN = "<|endoftext|>"
# Looked for, in this order, in a directory given as a tokenizer.
VOCAB_NAMES = ("vocab.json", "gpt2-vocab.json")


def is_vocab_file(path: Path) -> bool:
    """A file given as a tokenizer is a GPT-2 vocabulary (not a tokenizer.json) by its name:
    `vocab.json`, `gpt2-vocab.json`, `my_vocab_50k.json`, ..."""
    return path.suffix == ".json" and "vocab" in path.name


def merges_beside(vocab_file: Path) -> Path:
    """The merges file that goes with `vocab_file`: the same name with its last "vocab" read as
    "merges" and .txt for .json (vocab.json -> merges.txt, gpt2-vocab.json -> gpt2-merges.txt)."""
    name = vocab_file.name
    at = name.rfind("vocab")
    stem = (name[:at] + "merges" + name[at + len("vocab"):]).removesuffix(".json")
    return vocab_file.with_name(stem + ".txt")


def find_pair(path: Path, required: bool = True) -> tuple[Path, Path] | None:
    """(vocab file, merges file) when `path` is a GPT-2 vocab file or a directory holding one;
    None when it is neither. A vocabulary without its merges file is an error when `required`
    (the pair is the tokenizer), else None (a tokenizer.json beside it is)."""
    if path.is_dir():
        vocab = next((path / n for n in VOCAB_NAMES if (path / n).is_file()), None)
        if vocab is None:
            return None
    elif path.is_file() and is_vocab_file(path):
        vocab = path
    else:
        return None
    merges = merges_beside(vocab)
    if not merges.is_file():
        if not required:
            return None
        raise UserError(f"{vocab} is a GPT-2 vocabulary (Megatron's --vocab-file) but the merges "
                        f"file that goes with it, {merges}, is missing; put Megatron's "
                        f"--merge-file there under that name")
    return vocab, merges


def byte_of_char() -> dict[str, int]:
    """The byte-level alphabet, character -> the byte it stands for (GPT-2's bytes_to_unicode,
    which BLOOM's tokenizer and `tokenizers`' ByteLevel share): printable bytes stand for
    themselves, the other 68 for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    out = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in out.values()]
    out.update({chr(256 + n): b for n, b in enumerate(others)})
    return out


def read_vocab(file: Path, megatron: bool = True) -> dict[str, int]:
    """vocab.json as {token: id}, checked: ids 0..n-1 each once and, for Megatron's tokenizer
    (`megatron`), the 256 byte-level symbols and `<|endoftext|>` present."""
    from tokenizers import pre_tokenizers

    try:
        vocab = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise UserError(f"{file} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                        f"a GPT-2 vocab.json maps each token to its id, like "
                        f'{{"!": 0, "\\"": 1, ...}}') from None
    except (OSError, UnicodeDecodeError, RecursionError) as e:
        raise UserError(f"cannot read {file}: {e}") from None
    if not isinstance(vocab, dict) or not vocab:
        raise UserError(f"{file} must hold a JSON object mapping each token to its id, got "
                        f"{type(vocab).__name__ if vocab else 'an empty one'}")
    bad = next(((t, i) for t, i in vocab.items() if type(i) is not int), None)
    if bad is not None:
        raise UserError(f"{file}: token {bad[0]!r} has id {bad[1]!r}; ids must be integers")
    ids = sorted(vocab.values())
    if ids != list(range(len(ids))):
        gap = next(n for n, i in enumerate(ids) if i != n)
        raise UserError(f"{file}: the {len(ids)} ids must be 0..{len(ids) - 1}, each once; the "
                        f"first id out of place is {ids[gap]} (expected {gap})")
    if not megatron:
        return vocab
    missing = [c for c in pre_tokenizers.ByteLevel.alphabet() if c not in vocab]
    if missing:
        raise UserError(f"{file} lacks {len(missing)} of the 256 byte-level symbols (e.g. "
                        f"{sorted(missing)[:5]}), so it is not a GPT-2 byte-level vocabulary")
    if EOD_TOKEN not in vocab:
        raise UserError(f"{file} has no {EOD_TOKEN!r}, the end-of-document token of Megatron's "
                        f"GPT2BPETokenizer; add it to the vocabulary")
    return vocab


def read_merges(file: Path, vocab: dict[str, int], vocab_file: Path) -> list[tuple[str, str]]:
    """merges.txt as Megatron reads it: every line between the `#version` header and the final
    newline, each two tokens; blank lines, which merge nothing, are skipped."""
    try:
        lines = file.read_text(encoding="utf-8").split("\n")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {file}: {e}") from None
    if not lines[0].startswith("#version"):
        raise UserError(f"{file} must start with a '#version: 0.2' header line: Megatron skips "
                        f"line 1 unread, so its first merge {lines[0]!r} would be lost there but "
                        f"not elsewhere; add the header as line 1")
    if lines[-1] != "":
        raise UserError(f"{file} does not end with a newline: Megatron drops its last line "
                        f"({lines[-1]!r}) unread; end the file with a newline")
    merges = []
    for number, line in enumerate(lines[1:-1], start=2):
        pair = line.split()
        if not pair:
            continue
        if len(pair) != 2:
            raise UserError(f"{file} line {number}: {line!r} is not a merge; each line after "
                            f"the header names two tokens separated by a space, like 'Ġ t'")
        for token in (*pair, "".join(pair)):
            if token not in vocab:
                raise UserError(f"{file} line {number}: the merge {line.strip()!r} needs "
                                f"{token!r}, which {vocab_file} does not have; these two files "
                                f"do not belong together")
        merges.append((pair[0], pair[1]))
    return merges


def build(vocab: dict[str, int], merges: list[tuple[str, str]]):
    """The `tokenizers` pipeline of GPT-2's byte-level BPE."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def check_same(tokenizer_json: Path, loaded, vocab_file: Path, merges_file: Path) -> None:
    """A directory holding both a tokenizer.json (`loaded` by `tokenizers`) and a vocab/merges
    pair is read from its tokenizer.json, as transformers reads it; the pair must then describe
    the same BPE, so that neither reader of the directory gets another tokenizer than the
    other."""
    vocab = read_vocab(vocab_file, megatron=False)
    merges = read_merges(merges_file, vocab, vocab_file)
    try:
        doc = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise UserError(f"cannot read {tokenizer_json}: {e}") from None
    model = doc.get("model") or {} if isinstance(doc, dict) else {}
    theirs = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m)
              for m in model.get("merges") or []]
    differ = _pipeline_differences(doc if isinstance(doc, dict) else {}, model)
    if model.get("type") != "BPE" or loaded.get_vocab(with_added_tokens=False) != vocab \
            or theirs != merges:
        differ.insert(0, "its vocabulary or merges")
    if differ:
        raise UserError(f"{tokenizer_json.parent} holds a tokenizer.json and {vocab_file.name} + "
                        f"{merges_file.name} that describe different tokenizers "
                        f"({'; '.join(differ)} differ from Megatron's GPT-2 BPE over the pair); "
                        f"remove the one that "
                        f"is not the run's tokenizer (a directory with a tokenizer.json is read "
                        f"from it)")


def _pipeline_differences(doc: dict, model: dict) -> list[str]:
    """What in a tokenizer.json would encode otherwise than GPT-2's byte-level BPE (`build`)
    over the same vocabulary and merges: a normalizer, the pre-tokenizer's options, the BPE
    model's options. (Its added tokens, such as HF GPT-2's special <|endoftext|>, matter only
    to the literal string in a text, as between HF's and Megatron's own GPT-2.)"""
    out = []
    if doc.get("normalizer") is not None:
        out.append(f"its normalizer ({(doc['normalizer'] or {}).get('type')})")
    pre = doc.get("pre_tokenizer") or {}
    if pre.get("type") != "ByteLevel" or pre.get("add_prefix_space") or \
            not pre.get("use_regex", True):
        out.append("its pre-tokenizer (not ByteLevel without add_prefix_space)")
    options = [k for k in ("dropout", "byte_fallback", "continuing_subword_prefix",
                           "end_of_word_suffix", "ignore_merges") if model.get(k)]
    if options:
        out.append(f"its BPE options ({', '.join(options)})")
    return out
