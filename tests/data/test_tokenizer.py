import json

import pytest

from bloomtrain.data.tokenizer import SPECIAL_TOKENS, load_tokenizer, train_tokenizer
from bloomtrain.utils import UserError
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
