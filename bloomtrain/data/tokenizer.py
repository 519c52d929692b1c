"""Byte-level BPE tokenizers in the HF `tokenizers` JSON format (`tokenizer.json`), as BLOOM uses.

Training starts from the 256-symbol byte alphabet, so every UTF-8 string encodes without an
unknown token and decodes back exactly. Special tokens `<unk>`, `<s>`, `</s>`, `<pad>` take ids 0-3
as in BLOOM's tokenizer. Any local HF tokenizer directory with a `tokenizer.json` loads too, and
so does Megatron's GPT-2 pair vocab.json + merges.txt (bloomtrain.data.gpt2_bpe).
"""
from __future__ import annotations

import contextlib
import functools
import json
import operator
import os
import re
import shutil
from pathlib import Path

from bloomtrain.data import gpt2_bpe
from bloomtrain.data.sources import SkipReport, expand_inputs, iter_texts
from bloomtrain.errors import UserError
from bloomtrain.files import atomic_output, disk_full_as, unwritable

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]
# The HF side files a tokenizer carries with it (chat_template.jinja: where transformers 4.43+
# saves the chat template).
_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def train_tokenizer(files, vocab_size: int, output_dir: str | os.PathLike,
                    min_frequency: int = 2, json_key: str = "text", log=print) -> Path:
    """Train on the documents of `files` (any input preprocess accepts, streamed; the text under
    `json_key`) and write `output_dir/tokenizer.json` plus the HF side files. Unusable documents
    are skipped and logged by file and line, as preprocess does. Returns the tokenizer.json
    path."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    _check_train_args(vocab_size, min_frequency, len(SPECIAL_TOKENS) + len(alphabet))
    output_dir = _new_output(Path(output_dir))
    paths = expand_inputs(list(files))

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    skipped = SkipReport(json_key)
    docs = 0

    def texts():
        nonlocal docs
        # Lone surrogates ("\ud800" in JSON), on which the trainer would stop, are skipped as
        # not_utf8 like other unusable documents.
        for text in iter_texts(paths, json_key, skipped):
            docs += 1
            yield text

    _train_interruptible(tok, texts(), trainer)
    if docs == 0:
        raise UserError(f"no usable documents in {len(paths)} input file(s) to train a tokenizer "
                        f"on; nothing written{skipped.first_problem()}")
    for line in skipped.lines():
        log(line)
    if [tok.token_to_id(t) for t in SPECIAL_TOKENS] != list(range(len(SPECIAL_TOKENS))):
        landed = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
        raise RuntimeError(f"special tokens landed at {landed}")

    if tok.get_vocab_size() < vocab_size:
        log(f"warning: the vocabulary has {tok.get_vocab_size():,} tokens, not the "
            f"{vocab_size:,} asked for: BPE merges pairs of adjacent tokens within words, and "
            f"the corpus ({docs:,} document(s)) ran out of pairs seen at least --min-frequency "
            f"{min_frequency} times; train on more text for a larger vocabulary")

    with disk_full_as(f"writing the tokenizer to {output_dir}", output_dir,
                      "free disk space or choose another --output"):
        _write_tokenizer_dir(tok, output_dir)
    return output_dir / "tokenizer.json"


def _train_interruptible(tok, texts, trainer) -> None:
    """`tok.train_from_iterator` on a thread of its own, the main thread waiting: Ctrl-C and
    SIGTERM are handled on the main thread only, and the trainer holds it in Rust (reading the
    corpus on its own threads, then merging) until it is done, so a stop came only after the
    whole corpus was read and every merge made. The trainer leaves the GIL while it works."""
    import threading

    failed: list[BaseException] = []

    def train():
        try:
            tok.train_from_iterator(texts, trainer=trainer)
        except BaseException as e:  # the corpus's errors (a truncated .gz) are the caller's
            failed.append(e)
    worker = threading.Thread(target=train, name="bloomtrain-tokenizer-train", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.2)  # a signal's exception is raised here, between waits
    if failed:
        raise failed[0]


def _check_train_args(vocab_size: int, min_frequency: int, minimum: int) -> None:
    """What the trainer would stop on with a bare OverflowError, or after training."""
    if vocab_size < minimum:
        raise UserError(f"--vocab-size {vocab_size} is too small: the byte alphabet and special "
                        f"tokens alone take {minimum}")
    if vocab_size > MAX_VOCAB:
        raise UserError(f"--vocab-size {vocab_size} is over {MAX_VOCAB:,}: token ids are "
                        f"stored as 32-bit integers")
    if not 0 <= min_frequency < 2 ** 64:  # the trainer counts in 64 bits
        raise UserError(f"--min-frequency {min_frequency} must be 0 or more, and below 2**64")


# Any tokenizer's files (ours, a GPT-2 style pair, sentencepiece, WordPiece): a directory
# holding one is not ours to mix a new tokenizer into.
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json",
                   "chat_template.jinja",
                   "special_tokens_map.json", "tokenizer.model", "spiece.model", "vocab.txt")
MAX_VOCAB = 2 ** 31 - 1


def _new_output(output_dir: Path) -> Path:
    """`output_dir`, refused when it already holds a tokenizer: the one datasets were built with
    would be replaced without a word."""
    if output_dir.exists() and not output_dir.is_dir():
        raise UserError(f"--output {output_dir} is a file; give a directory to write the "
                        f"tokenizer into")
    held = [n for n in TOKENIZER_FILES if (output_dir / n).exists()]
    if held and not _unfinished_run(output_dir, held):
        raise UserError(f"--output {output_dir} already holds a tokenizer ({', '.join(held)}); "
                        f"choose a new directory, or remove it first")
    if why := unwritable(output_dir):  # found before the corpus is read and trained on
        raise UserError(f"cannot write the tokenizer to --output {output_dir}: {why}")
    return output_dir


def _unfinished_run(output_dir: Path, held: list[str]) -> bool:
    """Whether `held` are only the side files an earlier run of ours wrote before it failed
    (a full disk, a kill) without its tokenizer.json, which marks a finished directory: a
    retry replaces them."""
    if set(held) - {"special_tokens_map.json", "tokenizer_config.json"}:
        return False
    with contextlib.suppress(UserError):
        config = _json_object(output_dir / "tokenizer_config.json")
        specials = _json_object(output_dir / "special_tokens_map.json")
        return (specials, config) == _side_files()
    return False


def _write_tokenizer_dir(tok, output_dir: Path) -> None:
    """tokenizer.json and the side files transformers' AutoTokenizer reads."""
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create output directory {output_dir}: {e}") from e
    specials, config = _side_files()
    _write_json(output_dir / "special_tokens_map.json", specials)
    _write_json(output_dir / "tokenizer_config.json", config)
    # tokenizer.json last: its presence marks a finished directory.
    with atomic_output(output_dir / "tokenizer.json") as f:
        f.write(tok.to_str(pretty=True).encode("utf-8"))


def _side_files() -> tuple[dict, dict]:
    """special_tokens_map.json and tokenizer_config.json of a tokenizer trained here."""
    unk, bos, eos, pad = SPECIAL_TOKENS
    specials = {"unk_token": unk, "bos_token": bos, "eos_token": eos, "pad_token": pad}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "add_prefix_space": False,
        # transformers would otherwise strip spaces before punctuation when decoding.
        "clean_up_tokenization_spaces": False,
    }
    return specials, config


def _json_object(path: Path) -> dict:
    """A tokenizer directory's side file as a dict ({} where there is none)."""
    if not path.is_file():
        return {}
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise UserError(f"cannot read {path}: {e}") from e
    if not isinstance(obj, dict):
        raise UserError(f"{path} must hold a JSON object, got {type(obj).__name__}")
    return obj


def _write_json(path: Path, obj) -> None:
    with atomic_output(path) as f:
        f.write((json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8"))


def _invalid_unicode_at(text: str) -> int | None:
    """Index of the first code point UTF-8 cannot encode (a lone surrogate), else None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def _check_text(text, what: str) -> None:
    """Why `text` cannot be encoded, as a UserError; called once the tokenizer has refused it,
    so valid text pays nothing for the diagnosis."""
    if not isinstance(text, str):
        raise UserError(f"{what} must be a str, got {type(text).__name__}")
    at = _invalid_unicode_at(text)
    if at is not None:
        raise UserError(f"{what} holds a lone surrogate U+{ord(text[at]):04X} at character "
                        f"{at}, which is not valid Unicode and has no UTF-8 bytes to tokenize; "
                        f"fix or drop that text")


def _token_content(value) -> str | None:
    # HF configs store a special token either as a string or as an AddedToken dict.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """A loaded tokenizer.json with the ids the data pipeline needs. Encoding never adds special
    tokens (any BOS/EOS template is ignored); the pipeline appends the end-of-document id itself.

    Loading runs no code from the directory: tokenizer.json is parsed by the `tokenizers`
    library (Rust, data only) and tokenizer_config.json is read as plain JSON for the special
    token names. Its `auto_map` and any tokenization_*.py beside it are never imported, and
    transformers' AutoTokenizer (with its trust_remote_code) is never used."""

    def __init__(self, path: str | os.PathLike):
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        if not path.exists():
            raise UserError(f"tokenizer {path} not found; pass a tokenizer.json, Megatron's "
                            f"vocab.json (with merges.txt beside it) or a directory holding "
                            f"either (train one with `bloomtrain tokenizer train`)")
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise UserError(f"{path} has no tokenizer.json (nor Megatron's vocab.json + "
                            f"merges.txt); only fast (tokenizers-format) HF tokenizers and "
                            f"Megatron's GPT-2 files are supported")
        try:
            self._tok = HFTokenizer.from_file(str(file))
        except Exception as e:
            raise UserError(f"cannot load tokenizer {file}: {e}") from e
        # A tokenizer.json saved with truncation or padding on keeps them, and the raw
        # `tokenizers` encode applies them: every document cut to max_length and padded, into
        # the .bin without a word. transformers' encode (Megatron's path) turns both off.
        self._tok.no_truncation()
        self._tok.no_padding()
        self.path = file
        # Megatron's vocab.json + merges.txt found beside the tokenizer.json and checked to be
        # the same tokenizer (load_tokenizer); save() keeps them.
        self.megatron_files: tuple[Path, Path] | None = None
        self.config = _json_object(file.parent / "tokenizer_config.json")
        self.special_map = _json_object(file.parent / "special_tokens_map.json")

    def role_id(self, config_key: str, default: str) -> int | None:
        """The id of a special token by its role (`eos_token`, ...), as transformers resolves
        it (Megatron's PretrainedFromHF reads the ids through it): special_tokens_map.json's
        token over tokenizer_config.json's (a GPT-2 directory names <|endoftext|>); the
        conventional name when neither names one the vocabulary has."""
        for source in (self.special_map, self.config):
            token = _token_content(source.get(config_key))
            token_id = self._tok.token_to_id(token) if token else None
            if token_id is not None:
                return token_id
        return self._tok.token_to_id(default)

    def special_tokens(self) -> dict[str, str]:
        """bos/eos/unk/pad tokens by role, for a chat template: special_tokens_map.json's over
        tokenizer_config.json's, as transformers reads them."""
        out = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            for source in (self.special_map, self.config):
                if token := _token_content(source.get(key)):
                    out[key] = token
                    break
        return out

    def special_ids(self) -> frozenset[int]:
        """The ids transformers' decode(skip_special_tokens=True) leaves out: the added tokens
        tokenizer.json marks special, the tokens by role, the additional (transformers 4) and
        extra (5) special tokens of either side file, and the end-of-document token."""
        names = list(self.special_tokens().values())
        for source in (self.special_map, self.config):
            for key in ("additional_special_tokens", "extra_special_tokens"):
                extra = source.get(key)
                extra = list(extra.values()) if isinstance(extra, dict) else extra
                names += [_token_content(t) for t in extra] if isinstance(extra, list) else []
        ids = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        ids |= {i for name in names if name and (i := self._tok.token_to_id(name)) is not None}
        with contextlib.suppress(UserError):
            ids.add(self.eod_id)
        return frozenset(ids)

    @functools.cached_property
    def vocab_size(self) -> int:
        """The bound of the ids, not their count: a tokenizer.json may leave gaps between ids
        (its count then picked a dataset dtype its largest id overflowed), and every id must
        fit the embedding. Computed once: decode asks at every call."""
        return max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    @property
    def eod_id(self) -> int:
        token_id = self.role_id("eos_token", "</s>")
        if token_id is None:  # GPT-2's class default (the Hub's gpt2 names no eos_token)
            token_id = self._tok.token_to_id(gpt2_bpe.EOD_TOKEN)
        if token_id is None:
            raise UserError(f"tokenizer {self.path} has no end-of-document token: neither '</s>', "
                            f"'{gpt2_bpe.EOD_TOKEN}' nor an eos_token in special_tokens_map.json "
                            f"or tokenizer_config.json")
        return token_id

    @property
    def pad_id(self) -> int | None:
        return self.role_id("pad_token", "<pad>")

    def encode(self, text: str) -> list[int]:
        try:
            return self._tok.encode(text, add_special_tokens=False).ids
        except TypeError:
            _check_text(text, "text to encode")
            raise

    def encode_with_specials(self, text: str) -> list[int]:
        """`text` with its special tokens' strings as their ids (what a chat template writes:
        `{{ eos_token }}`), the rest encoded as text: transformers' encode of a rendered chat.
        A tokenizer.json matches its added tokens itself; Megatron's GPT-2 pair has none, and
        spelled <|endoftext|> out in 12 text tokens."""
        specials = {}
        for name in self.special_tokens().values():
            ids = self.encode(name)
            if len(ids) > 1 and (token_id := self._tok.token_to_id(name)) is not None:
                specials[name] = token_id
        if not specials:
            return self.encode(text)
        ids, pos = [], 0
        pattern = "|".join(map(re.escape, sorted(specials, key=len, reverse=True)))
        for m in re.finditer(pattern, text):
            ids += self.encode(text[pos:m.start()]) + [specials[m.group()]]
            pos = m.end()
        return ids + self.encode(text[pos:])

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        texts = list(texts)
        try:
            return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]
        except TypeError:
            for i, text in enumerate(texts):
                _check_text(text, f"text {i} of the batch")
            raise

    def decode(self, ids) -> str:
        vocab_size = self.vocab_size
        checked = []
        for i in ids:
            try:
                token_id = operator.index(i)
            except TypeError:
                raise UserError(f"token ids must be integers, got {i!r}") from None
            # The Rust side would overflow on negative ids and silently drop ids past the end.
            if not 0 <= token_id < vocab_size:
                raise UserError(f"token id {token_id} is outside the vocabulary of {self.path} "
                                f"(ids 0-{vocab_size - 1}); were these ids made with another "
                                f"tokenizer?")
            checked.append(token_id)
        # Special tokens are kept so that decode(encode(s)) == s even when s contains "</s>".
        return self._tok.decode(checked, skip_special_tokens=False)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(int(token_id))

    @functools.cached_property
    def _byte_level(self) -> dict[str, int] | None:
        """The byte-level alphabet (gpt2_bpe.byte_of_char) when this tokenizer decodes bytes
        (BLOOM's, GPT-2's), else None."""
        return gpt2_bpe.byte_of_char() if type(self._tok.decoder).__name__ == "ByteLevel" \
            else None

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for. A byte-level token may hold part of a character, whose
        text alone decodes to U+FFFD; OpenAI's logprobs `bytes` are the token's own, so that
        a client can join a character split over tokens."""
        piece, table = self.id_to_token(token_id), self._byte_level
        if table is not None and piece and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return self.decode([token_id]).encode("utf-8")

    def save(self, directory: str | os.PathLike) -> Path:
        """Copy tokenizer.json and its HF side files (and Megatron's vocab.json + merges.txt when
        they came with it) into `directory` (for checkpoints and exports)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        sources = [(self.path.parent / name, name) for name in _SIDE_FILES]
        if self.megatron_files is not None:
            sources += zip(self.megatron_files, ("vocab.json", "merges.txt"))
        for source, name in sources:
            if source.is_file():
                with atomic_output(directory / name) as f, open(source, "rb") as src:
                    shutil.copyfileobj(src, f)
        with atomic_output(directory / "tokenizer.json") as f, open(self.path, "rb") as src:
            shutil.copyfileobj(src, f)
        return directory / "tokenizer.json"

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


class GPT2BPETokenizer(Tokenizer):
    """Megatron's GPT2BPETokenizer from its vocab.json + merges.txt. Everything but loading and
    saving is the Tokenizer's: the `tokenizers` pipeline is built here instead of read from a
    tokenizer.json, so Tokenizer.__init__ (which reads one) is not called."""

    def __init__(self, vocab_file: str | os.PathLike, merges_file: str | os.PathLike):
        vocab_file, merges_file = Path(vocab_file), Path(merges_file)
        vocab = gpt2_bpe.read_vocab(vocab_file)
        self._tok = gpt2_bpe.build(vocab, gpt2_bpe.read_merges(merges_file, vocab, vocab_file))
        self.path, self.merges_path = vocab_file, merges_file
        self.megatron_files = (vocab_file, merges_file)
        # What save() writes, and GPT2Tokenizer's defaults: <|endoftext|> is bos, eos and unk.
        self.config: dict = dict.fromkeys(("bos_token", "eos_token", "unk_token"),
                                          gpt2_bpe.EOD_TOKEN)
        self.special_map: dict = {}
        self._eod_id = vocab[gpt2_bpe.EOD_TOKEN]

    @property
    def eod_id(self) -> int:
        return self._eod_id

    @property
    def pad_id(self) -> int | None:
        return None  # GPT-2 has no padding token; the pipeline never needs one

    def save(self, directory: str | os.PathLike) -> Path:
        """Write vocab.json and merges.txt (copied byte for byte, for Megatron's --vocab-file and
        --merge-file), the same tokenizer as a tokenizer.json (for transformers and everything
        that looks for one) and a tokenizer_config.json naming `<|endoftext|>` as the
        end-of-document token. Loaded again, the directory encodes as this tokenizer."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for source, name in ((self.path, "vocab.json"), (self.merges_path, "merges.txt")):
            with atomic_output(directory / name) as f, open(source, "rb") as src:
                shutil.copyfileobj(src, f)
        _write_json(directory / "tokenizer_config.json", {
            "tokenizer_class": "GPT2Tokenizer",
            **dict.fromkeys(("bos_token", "eos_token", "unk_token"), gpt2_bpe.EOD_TOKEN),
            "add_prefix_space": False,
            # transformers would otherwise strip spaces before punctuation when decoding.
            "clean_up_tokenization_spaces": False,
        })
        # tokenizer.json last: its presence marks a finished directory.
        with atomic_output(directory / "tokenizer.json") as f:
            f.write(self._tok.to_str(pretty=True).encode("utf-8"))
        return directory / "tokenizer.json"

    def __repr__(self) -> str:
        return (f"GPT2BPETokenizer({str(self.path)!r}, {str(self.merges_path)!r}, "
                f"vocab_size={self.vocab_size})")


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer at `path`: a tokenizer.json, Megatron's GPT-2 vocab.json (its merges.txt
    beside it, see gpt2_bpe.merges_beside), or a directory holding either. A directory with both
    is read from its tokenizer.json, as transformers reads it, and its vocab.json + merges.txt
    must describe the same tokenizer."""
    path = Path(path)
    has_json = (path / "tokenizer.json").is_file()
    pair = gpt2_bpe.find_pair(path, required=not has_json) if path.exists() else None
    if pair is not None and not has_json:
        return GPT2BPETokenizer(*pair)
    if path.is_file() and "merges" in path.name and path.suffix == ".txt":
        raise UserError(f"{path} is a merges file; pass the vocab.json beside it, or the "
                        f"directory holding both")
    tok = Tokenizer(path)
    if pair is not None:
        gpt2_bpe.check_same(tok.path, tok._tok, *pair)
        tok.megatron_files = pair
    return tok
