"""EleutherAI's lm-evaluation-harness model interface (`lm_eval.api.model.TemplateLM`) over a
bloomtrain model of any layout: this object lives on rank 0 and sends its batches through an
Executor (bloomtrain.eval.protocol) to every rank. It does what the harness's own HF backend
does, so that the numbers are the same (BloomtrainLM says what that is), except that a batch's
rows run packed into one padding-free row of tokens (bloomtrain.eval.forward.score), the LM
head runs only at the scored positions and log-probabilities are computed in fp32 whatever the
model's dtype. The results go through the harness's request cache hook like any backend's.
"""
from __future__ import annotations

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import Collator
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from bloomtrain.errors import UserValueError
from bloomtrain.eval.generation import GenerationSettings, Generator
from bloomtrain.serve.detokenize import special_token_ids

# lm_eval.models.utils' DEFAULT_MAX_LENGTH and HFLM's max_gen_toks: what the HF backend uses
# for a BLOOM (its config names no context length) whose tokenizer names none either.
DEFAULT_MAX_LENGTH = 2048
DEFAULT_MAX_GEN_TOKS = 256
_NO_LOGITS = torch.empty(1, 0, 0)  # Collator.get_cache wants logits to expand; we keep none


def default_max_length(tokenizer) -> int:
    """tokenizer_config.json's model_max_length when it gives a real one, else 2048: the HF
    backend's rule for BLOOM (transformers marks "no limit" with a huge number)."""
    value = tokenizer.config.get("model_max_length")
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 10 ** 12:
        return value
    return DEFAULT_MAX_LENGTH


def named_token_id(tokenizer, key: str) -> int | None:
    """The id of the special token the tokenizer names under `key` (bos_token, ...; see
    Tokenizer.special_tokens)."""
    name = tokenizer.special_tokens().get(key)
    if not name:
        return None
    ids = tokenizer.encode(name)
    return ids[0] if len(ids) == 1 else None


class BloomtrainLM(TemplateLM):
    """`batch_size`: rows per command (spread over the data-parallel replicas); `info`: what
    the harness's results JSON records about the model (config.model_*). As the harness's HF
    backend does:
    - tokenization is the harness's (TemplateLM splits context and continuation; an empty
      context is the prefix token: BOS when the tokenizer names one, else end-of-text);
    - inputs longer than `max_length` lose tokens on the left, and rolling loglikelihoods use
      its windows (lm_eval.utils.get_rolling_token_windows) of `max_length`;
    - log-probabilities are over the model's whole (padded) output, and is-greedy is
      torch.argmax's first maximum;
    - requests are sorted longest first and batched by length (lm_eval's Collator), with its
      cache of prefix logits: requests whose context plus all but the last continuation token
      are the same (choices that differ only in their last token) share one row, each scored
      at the last position by its own token."""

    def __init__(self, executor, tokenizer, *, max_length: int, batch_size: int,
                 info: dict | None = None, progress: bool = True):
        super().__init__()
        self.executor, self.tok = executor, tokenizer
        self._max_length, self._batch_size = max_length, batch_size
        self.info, self.progress = dict(info or {}), progress
        self._eot = tokenizer.eod_id
        self._prefix = named_token_id(tokenizer, "bos_token")
        self.special_ids = special_token_ids(tokenizer)
        self.generator = Generator(executor, tokenizer, batch_size=batch_size,
                                   eos_id=self._eot, skip_ids=self.special_ids)

    # ---- what the harness asks of a model --------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self._eot

    @property
    def prefix_token_id(self) -> int:
        return self._eot if self._prefix is None else self._prefix

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return DEFAULT_MAX_GEN_TOKS

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def tokenizer_name(self) -> str:
        return str(self.tok.path.parent).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens=None, left_truncate_len=None,
                   **kwargs) -> list[int]:
        ids = self.tok.encode(string)  # never adds special tokens, as BLOOM's tokenizer
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens) -> str:
        return self.tok.decode([t for t in tokens if t not in self.special_ids])

    def get_model_info(self) -> dict:
        return self.info

    def _bar(self, total: int, what: str, disable: bool):
        return tqdm(total=total, desc=what, disable=disable or not self.progress)

    # ---- scoring ---------------------------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self.progress)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs
                              ) -> list[tuple[float, bool]]:
        """(log-probability of the continuation, whether it is the greedy one) for each
        (request strings or None, context ids, continuation ids)."""
        collator = Collator(requests, sort_fn=_longest_first, group_by="contexts",
                            group_fn=lambda r: r[1] + r[2][:-1])
        representatives = [r for chunk in collator.get_batched(n=0) for r in chunk]
        results: list[tuple[float, bool]] = []
        bar = self._bar(len(requests), "Running loglikelihood requests", disable_tqdm)
        for lo in range(0, len(representatives), self._batch_size):
            rows, queries, plans = [], {}, []
            for req_str, ctx, cont in representatives[lo:lo + self._batch_size]:
                if len(cont) > self._max_length:
                    # Its first tokens would have no position in the window: their scores
                    # came from other requests' rows. The harness's HF backend refuses too.
                    raise UserValueError(f"a loglikelihood continuation of {len(cont)} tokens is "
                                     f"longer than max_length {self._max_length}; raise "
                                     f"max_length or shorten the task's targets")
                whole = (ctx + cont)[-(self._max_length + 1):]
                row = len(rows)
                rows.append(whole[:-1])
                # The representative has the longest continuation of its group; each member
                # is scored on its own last len(continuation) positions.
                for member_str, member_cont, _ in collator.get_cache(
                        req_str=req_str, cxt_toks=ctx, cont_toks=cont, logits=_NO_LOGITS):
                    if not member_cont:
                        # Nothing to score: it summed to 0.0 and greedy, a choice certain
                        # to win. The harness's HF backend asserts a continuation too.
                        raise UserValueError(f"a loglikelihood continuation encodes to no tokens "
                                         f"(request {member_str!r}): an empty target, or one "
                                         f"the context's last token absorbs; fix the task's "
                                         f"targets (or target_delimiter)")
                    first = len(whole) - 1 - len(member_cont)
                    plans.append((member_str, [queries.setdefault((row, first + j, t), len(queries))
                                               for j, t in enumerate(member_cont)]))
            stats = self.executor.score(rows, list(queries))
            for member_str, where in plans:
                answer = (float(stats[0, where].double().sum()),
                          bool((stats[1, where] > 0.5).all()))
                results.append(answer)
                if member_str is not None:
                    self.cache_hook.add_partial("loglikelihood", member_str, answer)
            bar.update(len(plans))
        bar.close()
        return collator.get_original(results)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each document's log-probability, every token predicted once: the harness's
        disjoint windows of max_length, all of them batched by length together."""
        windows, counts = [], []
        for (text,) in [r.args for r in requests]:
            pairs = get_rolling_token_windows(token_list=self.tok_encode(text),
                                              prefix_token=self.prefix_token_id,
                                              max_seq_len=self._max_length, context_len=1)
            mine = [(None, *make_disjoint_window(p)) for p in pairs]
            windows += mine
            counts.append(len(mine))
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        out, at = [], 0
        for req, n in zip(requests, counts):
            total = sum(s for s, _ in scores[at:at + n])
            at += n
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return out

    # ---- generation ------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy or sampled continuations (bloomtrain.eval.generation), requests grouped by
        their generation kwargs, prompts left-truncated to leave room for max_gen_toks."""
        collator = Collator([r.args for r in requests],
                            sort_fn=lambda a: (-len(self.tok_encode(a[0])), a[0]),
                            group_by="gen_kwargs", group_fn=lambda a: a[1])
        eos_text = self.tok.decode([self._eot])
        results: list[str] = []
        bar = self._bar(len(requests), "Running generate_until requests", disable_tqdm)
        for group in collator.get_batched(n=0):
            settings = GenerationSettings.from_gen_kwargs(group[0][1], self.max_gen_toks,
                                                          eos_text)
            room = self._max_length - settings.max_new_tokens
            if room < 1:
                raise UserValueError(f"max_gen_toks ({settings.max_new_tokens}) must be below the "
                                 f"model's max length ({self._max_length})")
            prompts = [self.tok_encode(ctx, left_truncate_len=room) or [self.prefix_token_id]
                       for ctx, _ in group]
            texts = self.generator.generate(prompts, settings, done=bar.update)
            for (ctx, kwargs), text in zip(group, texts):
                self.cache_hook.add_partial("generate_until", (ctx, kwargs), text)
            results += texts
        bar.close()
        return collator.get_original(results)


def _longest_first(req) -> tuple:
    """The harness's order: longest first (padding is then only what the first row of a batch
    sets), ties by the tokens."""
    toks = req[1] + req[2]
    return -len(toks), tuple(toks)
