"""What the serving tests share: a tiny random HF Bloom saved as an HF directory (the engine's
input and the reference it is checked against; the `serve_model_dir` fixture of
tests/conftest.py holds one with the session's tokenizer), random prompts, the small engine
config and an engine over such a directory, a chat template, and `bloomtrain serve` in a
subprocess."""
from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from bloomtrain.serve.config import EngineConfig
from bloomtrain.serve.engine import Engine
from bloomtrain.serve.tp import build_runner

ROOT = Path(__file__).resolve().parents[1]

VOCAB = 512


def save_tiny_hf(path, vocab: int = VOCAB):
    """A 2-layer, hidden-64 BloomForCausalLM with random weights scaled up (matrices x5, the
    rest shifted), so that its logits are far from uniform and greedy choices are clear; saved
    with save_pretrained at `path`. Returns the model (eval mode)."""
    import transformers

    cfg = transformers.BloomConfig(hidden_size=64, n_head=4, n_layer=2, vocab_size=vocab,
                                   bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    ref = transformers.BloomForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(5.0) if p.dim() == 2 else p.add_(0.1 * torch.randn_like(p))
    ref.save_pretrained(path)
    return ref


def random_prompts(lengths, seed=1, high=VOCAB):
    """Prompts of `lengths` tokens below `high`, the same for a seed."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, high, (n,), generator=g).tolist() for n in lengths]


# A ChatML-style template of the kind HF tokenizers carry in tokenizer_config.json.
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


# Small on purpose: prompts span several chunks and blocks, and a step's token budget is
# smaller than the prompts, so chunked prefill and decodes share steps.
CFG = EngineConfig(max_model_len=128, block_size=8, kv_cache_tokens=2048, max_num_seqs=8,
                   max_batched_tokens=40, prefill_chunk=16, max_queue=64)


def make_engine(path, cfg=CFG, wrap=None, tokenizer=None, metrics=None, quantize=None):
    runner = build_runner(path, cfg, quantize=quantize)
    execute = runner.forward if wrap is None else wrap(runner.forward)
    eos = tokenizer.eod_id if tokenizer is not None else None
    return Engine(execute, cfg, vocab_size=VOCAB, tokenizer=tokenizer, metrics=metrics,
                  vocab_limit=tokenizer.vocab_size if tokenizer is not None else None,
                  eos_token_id=eos)


class ServerProcess:
    """`bloomtrain serve` in a subprocess; its output lines are read on a thread."""

    def __init__(self, args):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bloomtrain", "serve", "--port", "0", "--threads", "1",
             *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
            cwd=ROOT)
        self.lines: queue.Queue = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line)

    def wait_line(self, pattern, timeout=120.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            self.log.append(line)
            m = re.search(pattern, line)
            if m:
                return m
        raise AssertionError(f"no line matching {pattern!r}; output:\n{''.join(self.log)}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
