import json
import os

import pytest

from bloomtrain.data.tokenizer import SPECIAL_TOKENS, load_tokenizer, train_tokenizer
from bloomtrain.errors import UserError
from tests.conftest import MULTILINGUAL_TEXT

ROUND_TRIP = [
    "",
    "数据并行和流水线并行",
    "Съешь же ещё этих мягких французских булок",
    "مرحبا بالعالم",
    "👩‍👩‍👧‍👦 🏳️‍🌈 👍🏽 family ZWJ",
    "def f(x):\n\treturn x  \n\n\t\t  \r\n",
    "e\u0301 a\u0308 n\u0303 \u0915\u094d\u0937",
    "  leading and trailing spaces  ",
    "literal </s> and <pad> tokens",
    "\x00\x7f\ufeff\U0010ffff",
]


def test_specials_and_round_trip(tiny_tokenizer_dir):
    tok = load_tokenizer(tiny_tokenizer_dir)
    assert [tok._tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert tok.eod_id == 2 and tok.pad_id == 3
    assert 260 <= tok.vocab_size <= 500
    for s in ROUND_TRIP:
        assert tok.decode(tok.encode(s)) == s
    assert tok.encode_batch(ROUND_TRIP) == [tok.encode(s) for s in ROUND_TRIP]
    assert load_tokenizer(tiny_tokenizer_dir / "tokenizer.json").encode("数据") == tok.encode("数据")


def test_loads_in_tokenizers_and_transformers(tiny_tokenizer_dir):
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = tokenizers.Tokenizer.from_file(str(tiny_tokenizer_dir / "tokenizer.json"))
    tok = load_tokenizer(tiny_tokenizer_dir)
    text = ROUND_TRIP[4] + ROUND_TRIP[1]
    assert raw.encode(text).ids == tok.encode(text)

    hf = PreTrainedTokenizerFast.from_pretrained(str(tiny_tokenizer_dir))
    assert (hf.unk_token_id, hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (0, 1, 2, 3)
    assert hf.encode(text, add_special_tokens=False) == tok.encode(text)
    assert hf.decode(tok.encode(ROUND_TRIP[5])) == ROUND_TRIP[5]
    # A bare tokenizer.json has no roles for its specials; the caller names them.
    bare = PreTrainedTokenizerFast(tokenizer_file=str(tiny_tokenizer_dir / "tokenizer.json"),
                                   eos_token="</s>")
    assert bare.eos_token_id == 2 and bare.encode(text) == tok.encode(text)


def test_save_copies_side_files(tiny_tokenizer_dir, tmp_path):
    load_tokenizer(tiny_tokenizer_dir).save(tmp_path / "out")
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    assert json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())["eos_token"] == "</s>"
    assert load_tokenizer(tmp_path / "out").encode("x y") == load_tokenizer(tiny_tokenizer_dir).encode("x y")


def test_errors(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_tokenizer(tmp_path / "nope")
    with pytest.raises(UserError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(UserError, match="cannot load"):
        load_tokenizer(tmp_path)
    corpus = tmp_path / "c.txt"
    corpus.write_text("abc")
    with pytest.raises(UserError, match="too small"):
        train_tokenizer([corpus], 100, tmp_path / "t")
    # Arguments the trainer would stop on with a bare OverflowError, refused in one line.
    with pytest.raises(UserError, match="--min-frequency -1 must be 0 or more"):
        train_tokenizer([corpus], 300, tmp_path / "t", min_frequency=-1)
    with pytest.raises(UserError, match="is over 2,147,483,647"):
        train_tokenizer([corpus], 10 ** 20, tmp_path / "t")
    with pytest.raises(UserError, match="c.txt is a file; give a directory"):
        train_tokenizer([corpus], 300, corpus)
    # Another tokenizer's directory (sentencepiece here) is not mixed into.
    other = tmp_path / "llama"
    other.mkdir()
    config = '{"tokenizer_class": "LlamaTokenizer"}'
    (other / "tokenizer_config.json").write_text(config)
    (other / "tokenizer.model").write_bytes(b"spm")
    with pytest.raises(UserError, match="already holds a tokenizer .*tokenizer_config.json"):
        train_tokenizer([corpus], 300, other)
    assert (other / "tokenizer_config.json").read_text() == config


def test_a_failed_run_is_retried_and_a_bad_output_refused_before_training(tmp_path,
                                                                          monkeypatch):
    import errno

    import bloomtrain.data.tokenizer as tokenizer
    corpus = tmp_path / "c.txt"
    corpus.write_text(MULTILINGUAL_TEXT * 3, encoding="utf-8")
    real = tokenizer.atomic_output

    def full_at_tokenizer_json(path, *a, **k):
        if str(path).endswith("tokenizer.json"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, *a, **k)
    monkeypatch.setattr(tokenizer, "atomic_output", full_at_tokenizer_json)
    with pytest.raises(UserError, match="free disk space"):
        train_tokenizer([corpus], 300, tmp_path / "tok", min_frequency=1)
    monkeypatch.setattr(tokenizer, "atomic_output", real)
    assert sorted(p.name for p in (tmp_path / "tok").iterdir()) == \
        ["special_tokens_map.json", "tokenizer_config.json"]
    # The retry the error asks for: the side files the failed run left are its own, and it
    # was refused as "already holds a tokenizer" (the demo stuck at its step 2).
    train_tokenizer([corpus], 300, tmp_path / "tok", min_frequency=1)
    assert load_tokenizer(tmp_path / "tok").vocab_size == 300
    # An output that cannot be written is refused before the corpus is read.
    read = []
    monkeypatch.setattr(tokenizer, "iter_texts", lambda *a: read.append(1) or iter(()))
    with pytest.raises(UserError, match="c.txt is a file, not a directory"):
        train_tokenizer([corpus], 300, corpus / "tok")
    assert read == []
    with pytest.raises(UserError, match="below 2\\*\\*64"):
        train_tokenizer([corpus], 300, tmp_path / "t2", min_frequency=2 ** 64)


def test_ctrl_c_stops_a_tokenizer_training_at_once(tmp_path, monkeypatch):
    # The trainer held the main thread in Rust until the corpus was read and every merge made:
    # a Ctrl-C came through only then (seconds to hours later).
    import signal
    import threading
    import time

    import bloomtrain.data.tokenizer as tokenizer
    release = threading.Event()

    def slow_corpus(*args):
        yield from MULTILINGUAL_TEXT.splitlines()
        release.wait(60)  # a corpus still being read
    monkeypatch.setattr(tokenizer, "iter_texts", slow_corpus)
    corpus = tmp_path / "c.txt"
    corpus.write_text("x")
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    start = time.monotonic()
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            train_tokenizer([corpus], 300, tmp_path / "tok", min_frequency=1)
        assert time.monotonic() - start < 20
    finally:
        timer.cancel()
        release.set()
    assert not (tmp_path / "tok").exists()


def test_train_from_jsonl_and_cli(tmp_path):
    from bloomtrain.cli import main

    data = tmp_path / "d.jsonl"
    lines = [json.dumps({"text": line}, ensure_ascii=False) for line in MULTILINGUAL_TEXT.splitlines()]
    data.write_text("\n".join(lines * 5) + "\n{bad json\n", encoding="utf-8")
    assert main(["tokenizer", "train", "--input", str(data), "--vocab-size", "300",
                 "--output", str(tmp_path / "tok"), "--min-frequency", "1"]) == 0
    tok = load_tokenizer(tmp_path / "tok")
    assert tok.vocab_size == 300
    assert tok.decode(tok.encode(MULTILINGUAL_TEXT)) == MULTILINGUAL_TEXT
    # Again into the same directory: the tokenizer datasets were built with stays.
    before = (tmp_path / "tok" / "tokenizer.json").read_bytes()
    assert main(["tokenizer", "train", "--input", str(data), "--vocab-size", "400",
                 "--output", str(tmp_path / "tok"), "--min-frequency", "1"]) == 2
    assert (tmp_path / "tok" / "tokenizer.json").read_bytes() == before


def test_json_key_and_failures_named_by_file_line_and_key(tmp_path, capsys):
    from bloomtrain.cli import main

    data = tmp_path / "d.jsonl"
    lines = [json.dumps({"content": line}, ensure_ascii=False)
             for line in MULTILINGUAL_TEXT.splitlines()]
    data.write_text("\n".join(lines) + "\n{bad json\n", encoding="utf-8")
    argv = ["tokenizer", "train", "--input", str(data), "--vocab-size", "300", "--output",
            str(tmp_path / "tok"), "--min-frequency", "1"]
    assert main(argv) == 2  # the default key, text, is in no record
    err = capsys.readouterr().err
    assert err == (f"bloomtrain tokenizer train: error: no usable documents in 1 input file(s) to "
                   f"train a tokenizer on; nothing written (first problem: {data}:1: missing key "
                   f"'text' or its value is not a string)\n")
    assert not (tmp_path / "tok").exists()
    assert main(argv + ["--json-key", "content"]) == 0
    out = capsys.readouterr().out
    assert f"skipped {data}:{len(lines) + 1}: invalid JSON\n" in out
    tok = load_tokenizer(tmp_path / "tok")
    assert tok.decode(tok.encode(MULTILINGUAL_TEXT)) == MULTILINGUAL_TEXT


def test_a_vocabulary_smaller_than_asked_is_a_warning_with_the_reason(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("the cat sat on the mat " * 20)
    logged = []
    path = train_tokenizer([corpus], 32000, tmp_path / "tok", log=logged.append)
    got = load_tokenizer(path).vocab_size
    assert got < 32000
    assert logged == [f"warning: the vocabulary has {got:,} tokens, not the 32,000 asked for: BPE "
                      f"merges pairs of adjacent tokens within words, and the corpus (1 "
                      f"document(s)) ran out of pairs seen at least --min-frequency 2 times; train on more text "
                      f"for a larger vocabulary"]
    logged.clear()
    train_tokenizer([corpus], got, tmp_path / "tok2", log=logged.append)
    assert logged == []  # exactly what it asks for: nothing to warn about


def test_a_tokens_bytes_are_its_own_even_where_it_splits_a_character(tiny_tokenizer_dir):
    """OpenAI's logprobs `bytes` let a client join a character split over byte-level tokens:
    each token's bytes are its own (a token's text alone decodes a partial character to
    U+FFFD, whose bytes they were)."""
    tok = load_tokenizer(tiny_tokenizer_dir)
    for text in ("😀", "数据并行", "Привет, мир", "plain ascii"):
        ids = tok.encode(text)
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8"), text
    split = [i for i in tok.encode("😀") if tok.decode([i]) == "\ufffd"]
    assert split and all(tok.token_bytes(i) != "\ufffd".encode() for i in split)


def test_a_stream_skips_every_special_token_transformers_skips(tiny_tokenizer_dir, tmp_path):
    """transformers' decode(skip_special_tokens=True) is the reference: ChatML markers added as
    special tokens (transformers 5 writes them as extra_special_tokens, and marks them special
    in tokenizer.json), and the roles named only in special_tokens_map.json (transformers 4's
    layout). The stream printed '<|im_start|>assistant\\nhello<|im_end|>' and '<s>hi<pad><unk>'."""
    import shutil

    from transformers import AutoTokenizer

    from bloomtrain.serve.detokenize import TextStream, special_token_ids

    chatml = tmp_path / "chatml"
    hf = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    hf.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    hf.save_pretrained(str(chatml))
    legacy = tmp_path / "legacy"
    shutil.copytree(tiny_tokenizer_dir, legacy)
    (legacy / "tokenizer_config.json").write_text("{}")
    for directory, text in ((chatml, "<|im_start|>assistant\nhello<|im_end|>"),
                            (legacy, "<s>hi<pad><unk>")):
        tok, ref = load_tokenizer(directory), AutoTokenizer.from_pretrained(str(directory))
        ids = tok.encode(text)
        assert special_token_ids(tok) >= set(ref.all_special_ids)
        stream = TextStream(tok, (), special_token_ids(tok))
        out = "".join(stream.push(i) for i in ids) + stream.finish()
        assert out == ref.decode(ids, skip_special_tokens=True) != text


def test_chat_templates_render_in_transformers_environment(tiny_tokenizer_dir):
    """transformers' apply_chat_template is the reference: its tojson takes sort_keys (and
    the rest of json.dumps' options), strftime_now is a global (Llama 3's templates), a
    {% generation %} block renders its body, and tools/documents are None, not undefined
    (`tools is not none` rendered an empty tools section)."""
    from transformers import AutoTokenizer

    from bloomtrain.serve.chat import ChatTemplate

    tok, hf = load_tokenizer(tiny_tokenizer_dir), AutoTokenizer.from_pretrained(
        str(tiny_tokenizer_dir))
    messages = [{"role": "user", "content": "hi", "meta": {"b": 1, "a": 2}}]
    for template in (
            "{{ messages[0]['meta'] | tojson(sort_keys=True, indent=1) }}",
            "{{ strftime_now('%Y') }}:{{ messages[0]['content'] }}",
            "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}"
            "{% endfor %}",
            "{% if tools is not none %}[TOOLS]{% endif %}{% if documents is not none %}[DOCS]"
            "{% endif %}{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}"):
        ours = ChatTemplate(template, tok).render(messages, False)
        assert ours == hf.apply_chat_template(messages, chat_template=template, tokenize=False)
