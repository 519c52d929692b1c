"""KV-cache generation: token parity with HF `generate`, sampling semantics, CLI."""
from __future__ import annotations

import pytest
import torch

import bloomtrain
from bloomtrain import checkpoint
from bloomtrain.cli import main
from bloomtrain.generate import generate
from bloomtrain.serve.sampling import warp

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

VOCAB = 256


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory, device):
    """(HF reference, bloomtrain model loaded from its save_pretrained directory, that dir), both
    on `device`."""
    # No special token ids: HF would otherwise stop at id 2, which a random model may emit.
    cfg = transformers.BloomConfig(hidden_size=64, n_head=4, n_layer=3, vocab_size=VOCAB,
                                   bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    ref = transformers.BloomForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            # Wider weights than HF's 0.02 init give peaked, varied next-token distributions, so
            # greedy paths are not decided by 1e-6 differences between near-equal logits.
            p.mul_(5.0) if p.dim() == 2 else p.add_(0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("hf") / "model"
    ref.save_pretrained(path)
    return ref.to(device), bloomtrain.load_model(path, device=device), path


def hf_greedy(ref, ids, n):
    with torch.no_grad():
        return ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                            do_sample=False)


@pytest.mark.parametrize("batch,length,seed", [(1, 5, 1), (1, 11, 2), (2, 8, 3), (1, 64, 4)])
def test_greedy_matches_hf(models, batch, length, seed, device):
    ref, ours, _ = models
    ids = torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
    ids = ids.to(device)
    want = hf_greedy(ref, ids, 20)
    got = generate(ours, ids, 20)
    assert got.shape == (batch, length + 20)
    assert torch.equal(got.cpu(), want.cpu())


def test_cache_matches_recomputation(models, device):
    _, ours, _ = models
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(5)).to(device)
    cached = generate(ours, ids, 12)
    assert torch.equal(cached, generate(ours, ids, 12, use_cache=False))
    # Logits step by step through the paged cache vs one full forward over the same tokens.
    # 1e-5: the same math in fp32, only the attention's summation length differs.
    from tests.helpers import paged_logits

    with torch.no_grad():
        full = ours(cached).cpu()
    assert (paged_logits(ours, cached, 9) - full[:, 9:]).abs().max().item() < 1e-5


def test_sampling_reproducible_and_top_k_1_is_greedy(models, device):
    _, ours, _ = models
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(6)).to(device)

    def sample(seed, **kw):
        # torch.multinomial wants a generator on the device it samples on.
        return generate(ours, ids, 15, do_sample=True,
                        generator=torch.Generator(device).manual_seed(seed), **kw).cpu()

    a = sample(0, temperature=1.5, top_p=0.9)
    assert torch.equal(a, sample(0, temperature=1.5, top_p=0.9))
    assert not torch.equal(a, sample(1, temperature=1.5, top_p=0.9))
    assert torch.equal(sample(3, top_k=1, temperature=0.7), generate(ours, ids, 15).cpu())


def test_warpers_match_hf():
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    scores = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    scores[0, :5] = 2.0  # ties at the top-k boundary
    for temperature, top_k, top_p in ((0.7, 0, 1.0), (1.0, 5, 1.0), (1.0, 0, 0.8),
                                      (1.3, 10, 0.5), (1.0, 0, 1e-6), (1.0, 3, 0.99)):
        want = scores.clone()
        if temperature != 1.0:
            want = TemperatureLogitsWarper(temperature)(None, want)
        if top_k:
            want = TopKLogitsWarper(top_k)(None, want)
        if top_p < 1.0:
            want = TopPLogitsWarper(top_p)(None, want)
        got = warp(scores, temperature, top_k, top_p)  # the sampler's per-row reference
        assert torch.equal(torch.isinf(got), torch.isinf(want)), (temperature, top_k, top_p)
        assert torch.allclose(got[~torch.isinf(got)], want[~torch.isinf(want)])
        assert torch.isfinite(got).any(dim=-1).all()  # at least one token always survives


def test_vocab_limit_and_eos(models, device):
    _, ours, _ = models
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(7)).to(device)
    out = generate(ours, ids % 40, 30, do_sample=True, temperature=5.0, vocab_limit=40,
                   generator=torch.Generator(device).manual_seed(0))
    assert out[:, 6:].max().item() < 40
    with pytest.raises(ValueError, match="outside the vocabulary"):  # a prompt of non-tokens
        generate(ours, ids, 3, vocab_limit=40)

    free = generate(ours, ids[:1], 10)
    eos = int(free[0, 6 + 3])
    stopped = generate(ours, ids[:1], 10, eos_token_id=eos)
    first = (free[0, 6:] == eos).nonzero()[0].item()
    assert torch.equal(stopped, free[:, :6 + first + 1])  # stops right after the first eos

    batch = generate(ours, ids, 10, eos_token_id=eos)
    for row in batch[:, 6:]:
        hits = (row == eos).nonzero()
        if len(hits):  # once finished, a row is filled with eos
            assert (row[hits[0].item():] == eos).all()


@pytest.fixture(scope="module")
def trained_checkpoint(tmp_path_factory, tiny_tokenizer_dir):
    from bloomtrain.data.tokenizer import load_tokenizer
    from bloomtrain.model import BloomShape, build_model

    tok = load_tokenizer(tiny_tokenizer_dir)
    shape = BloomShape(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4,
                       ffn_hidden_size=256)
    root = tmp_path_factory.mktemp("run")
    checkpoint.save_checkpoint(root, 10, build_model(shape, seed=3).state_dict(), shape,
                               tokenizer=tok)
    return root, tok


def test_cli_generate(trained_checkpoint, capsys, tmp_path, device):
    root, tok = trained_checkpoint
    prompt = "The quick brown fox"
    # The CLI picks CUDA when it sees one; pinned so that it runs where the reference does.
    on = ["--device", str(device)]
    assert main(["generate", "--checkpoint", str(root), "--prompt", prompt,
                 "--max-new-tokens", "8", *on]) == 0
    greedy = capsys.readouterr().out
    assert greedy.startswith(prompt) and len(greedy) > len(prompt) + 1
    model = bloomtrain.load_model(root, device=device)
    ids = torch.tensor([tok.encode(prompt)], device=device)
    out = generate(model, ids, 8, eos_token_id=tok.eod_id, vocab_limit=tok.vocab_size)
    new = out[0, ids.shape[1]:].tolist()
    new = new[:new.index(tok.eod_id)] if tok.eod_id in new else new
    assert greedy == tok.decode(ids[0].tolist() + new) + "\n"

    sampled = ["generate", "--checkpoint", str(root), "--prompt", prompt, "--max-new-tokens",
               "8", "--temperature", "2.0", "--top-p", "0.95", "--seed", "4", *on]
    assert main(sampled) == 0
    first = capsys.readouterr().out
    assert main(sampled) == 0
    assert capsys.readouterr().out == first

    # An HF directory with its tokenizer, exported from the same checkpoint, gives the same text.
    from bloomtrain.checkpoint import hf
    hf.export_hf(root, tmp_path / "export", log=lambda *_: None)
    assert main(["generate", "--checkpoint", str(tmp_path / "export"), "--prompt", prompt,
                 "--max-new-tokens", "8", "--greedy", *on]) == 0
    assert capsys.readouterr().out == greedy


def test_cli_generate_errors(trained_checkpoint, capsys, tmp_path, models):
    root, _ = trained_checkpoint
    assert main(["generate", "--checkpoint", str(root), "--prompt", "x", "--greedy",
                 "--top-k", "5"]) == 2
    assert "--greedy conflicts with --top-k" in capsys.readouterr().err
    assert main(["generate", "--checkpoint", str(tmp_path / "none"), "--prompt", "x"]) == 2
    assert "does not exist" in capsys.readouterr().err
    _, _, hf_dir = models  # saved without a tokenizer
    assert main(["generate", "--checkpoint", str(hf_dir), "--prompt", "x"]) == 2
    assert "--tokenizer" in capsys.readouterr().err
    # inf and nan were taken: junk (every score 0 or nan) or a silent greedy run.
    for bad in ("inf", "nan"):
        assert main(["generate", "--checkpoint", str(root), "--prompt", "x",
                     "--temperature", bad]) == 2
        assert f"--temperature must be a positive number, got {bad}" in capsys.readouterr().err
    # A seed past torch's range was a traceback, after the model had loaded.
    for bad in (str(2 ** 64), str(-2 ** 63 - 1)):
        assert main(["generate", "--checkpoint", str(root), "--prompt", "x",
                     "--temperature", "1", "--seed", bad]) == 2
        assert f"--seed must be in [-2**63, 2**64), got {bad}" in capsys.readouterr().err
    # The KV cache is allocated for the longest run asked for: refused when it cannot fit,
    # in one line, not an allocator's traceback (500 GB asked for here).
    assert main(["generate", "--checkpoint", str(root), "--prompt", "x",
                 "--max-new-tokens", "1000000000"]) == 2
    err = capsys.readouterr().err
    assert "the KV cache for 1 sequence(s) of up to 1,000,000,00" in err
    assert "ask for fewer new tokens (--max-new-tokens)" in err and "Traceback" not in err
