import json

from bloomtrain.data.corpus import MAX_DOC_CHARS, build_demo_corpus


def test_demo_corpus_small_and_deterministic(tmp_path):
    first = build_demo_corpus(tmp_path / "a.jsonl", max_docs=25)
    second = build_demo_corpus(tmp_path / "b" / "a.jsonl", max_docs=25)
    assert first.read_bytes() == second.read_bytes()
    docs = [json.loads(line) for line in first.read_text(encoding="utf-8").splitlines()]
    assert len(docs) == 25
    assert all(isinstance(d["text"], str) and 0 < len(d["text"]) <= MAX_DOC_CHARS for d in docs)
    assert all(d["source"].endswith(".py") and "test" not in d["source"].split("/")[:-1] for d in docs)
    # Sources and their docstrings are both present.
    assert any("def " in d["text"] for d in docs) and any("def " not in d["text"] for d in docs)
