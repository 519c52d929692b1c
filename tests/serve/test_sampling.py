"""The sampling edits a request can ask for, each against an independent reference, on the
processed logits and on the greedy tokens that result (the serving engine end to end against a
loop over HF transformers' model):
- `repetition_penalty`: HF's RepetitionPenaltyLogitsProcessor, and HF `generate`;
- `presence_penalty` / `frequency_penalty`: OpenAI's published formula, written out here;
- `logit_bias`: a plain edit of the logits;
- `min_tokens` and `ignore_eos` against the end-of-text token.
Models: tests/serve/test_serve.py's tiny HF Bloom (widened weights, so greedy paths are not decided
by 1e-6 differences between the engine's logits and HF's).
"""
from __future__ import annotations

import pytest
import torch
import transformers

from bloomtrain.serve.sampling import SamplingParams, request_scores
from tests.serving import VOCAB, make_engine, random_prompts

pytestmark = pytest.mark.usefixtures("one_thread")
N = 24  # tokens generated per check


def openai_penalized(logits: torch.Tensor, generated: list[int], frequency: float,
                     presence: float) -> torch.Tensor:
    """OpenAI's formula: mu[j] -> mu[j] - c[j] * alpha_frequency - float(c[j] > 0) *
    alpha_presence, c[j] being how often token j was sampled before this position."""
    mu = logits.clone()
    for j in set(generated):
        c = generated.count(j)
        mu[..., j] = mu[..., j] - c * frequency - float(c > 0) * presence
    return mu


def hf_logits(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[:, -1, :VOCAB].float()  # [1, V]


def reference_greedy(ref, prompt: list[int], edit) -> list[int]:
    """Greedy decoding over HF's model, `edit(logits [1, V], generated)` applied each step."""
    out: list[int] = []
    for _ in range(N):
        out.append(int(edit(hf_logits(ref, prompt + out), out).argmax(-1)))
    return out


def engine_greedy(path, prompt, **params) -> list[int]:
    p = SamplingParams(max_tokens=N, temperature=0, **params)
    return make_engine(path).generate([prompt], p)[0]["token_ids"]


@pytest.fixture(scope="module")
def prompt():
    # Repeats, so that the prompt's own tokens are penalized too.
    p = random_prompts([12], seed=11)[0]
    return p + p[:6]


def test_repetition_penalty_is_hfs(model_dir, prompt):
    ref, path = model_dir
    out = random_prompts([7], seed=12)[0]
    logits = hf_logits(ref, prompt + out)
    hf = transformers.RepetitionPenaltyLogitsProcessor(2.0)
    want = hf(torch.tensor([prompt + out]), logits.clone())
    got = request_scores(logits, SamplingParams(repetition_penalty=2.0), prompt, out, VOCAB,
                         None)
    assert torch.equal(got, want)  # the same float ops on the same numbers
    with torch.no_grad():
        ids = torch.tensor([prompt])
        hf_tokens = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N,
                                 do_sample=False, repetition_penalty=2.0)[0, len(prompt):]
    penalized = engine_greedy(path, prompt, repetition_penalty=2.0)
    assert penalized == hf_tokens.tolist()
    assert penalized != engine_greedy(path, prompt)  # the penalty changed the path


@pytest.mark.parametrize("frequency,presence", [(1.5, 0.0), (0.0, 2.0), (0.7, -0.4)])
def test_presence_and_frequency_penalties_are_openais_formula(model_dir, prompt, frequency,
                                                             presence):
    ref, path = model_dir
    out = [5, 9, 5, 5, 31, 9]  # counts 3, 2, 1
    logits = hf_logits(ref, prompt + out)
    params = SamplingParams(frequency_penalty=frequency, presence_penalty=presence)
    got = request_scores(logits, params, prompt, out, VOCAB, None)
    # 1e-5: the formula here runs in float64 Python scalars, the server in fp32 tensors.
    assert torch.allclose(got, openai_penalized(logits, out, frequency, presence), atol=1e-5)
    assert torch.equal(got[0, 6:9], logits[0, 6:9])  # unseen tokens keep their scores
    want = reference_greedy(ref, prompt, lambda lg, gen: openai_penalized(lg, gen, frequency,
                                                                          presence))
    penalized = engine_greedy(path, prompt, frequency_penalty=frequency,
                              presence_penalty=presence)
    assert penalized == want
    assert penalized != engine_greedy(path, prompt)


def test_logit_bias_is_a_plain_edit(model_dir, prompt):
    ref, path = model_dir
    plain = engine_greedy(path, prompt)
    bias = {plain[0]: -100.0, 7: 4.0, 300: 2.5}  # ban the first greedy token, favour others

    def edit(logits, generated):
        logits = logits.clone()
        for t, b in bias.items():
            logits[0, t] += b
        return logits

    logits = hf_logits(ref, prompt)
    got = request_scores(logits, SamplingParams(logit_bias=tuple(sorted(bias.items()))),
                         prompt, [], VOCAB, None)
    assert torch.equal(got, edit(logits, []))
    biased = engine_greedy(path, prompt, logit_bias=tuple(sorted(bias.items())))
    assert biased == reference_greedy(ref, prompt, edit)
    assert biased[0] != plain[0]


def test_min_tokens_and_ignore_eos(model_dir, tokenizer, prompt):
    """With the end-of-text token made the likeliest, a sequence stops at once; min_tokens
    masks it until that many tokens are out; ignore_eos generates through it."""
    _, path = model_dir
    eos = tokenizer.eod_id
    favour = ((eos, 100.0),)
    engine = make_engine(path, tokenizer=tokenizer)
    runs = engine.generate([prompt] * 3, [
        SamplingParams(max_tokens=10, temperature=0, logit_bias=favour),
        SamplingParams(max_tokens=10, temperature=0, logit_bias=favour, min_tokens=4),
        SamplingParams(max_tokens=10, temperature=0, logit_bias=favour, ignore_eos=True)])
    assert (len(runs[0]["token_ids"]), runs[0]["finish_reason"]) == (0, "stop")
    assert (len(runs[1]["token_ids"]), runs[1]["finish_reason"]) == (4, "stop")
    assert eos not in runs[1]["token_ids"]
    assert runs[2]["token_ids"] == [eos] * 10 and runs[2]["finish_reason"] == "length"
    logits = torch.zeros(1, VOCAB)
    masked = request_scores(logits, SamplingParams(min_tokens=2), prompt, [3], VOCAB, eos)
    assert masked[0, eos] == float("-inf") and torch.equal(masked[0, :eos], logits[0, :eos])
    assert request_scores(logits, SamplingParams(min_tokens=2), prompt, [3, 4], VOCAB,
                          eos)[0, eos] == 0
