"""The serving engine's settings (bloomtrain serve's flags), checked before anything starts.
Torch-free, so that building the CLI parser stays cheap."""
from __future__ import annotations

from dataclasses import dataclass

from bloomtrain.errors import UserError


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(frozen=True)
class EngineConfig:
    max_model_len: int = 2048        # prompt + generated tokens of one sequence
    block_size: int = 16             # tokens per KV-cache block
    kv_cache_tokens: int = 16384     # pool size, in tokens (rounded down to whole blocks)
    max_num_seqs: int = 32           # running batch limit
    max_batched_tokens: int = 256    # tokens per step (prefill chunks + decodes)
    prefill_chunk: int = 64          # prompt tokens per chunk
    max_queue: int = 256             # waiting sequences before new requests get 503
    # Decode steps without a CUDA graph (bloomtrain.serve.graphs), as vLLM's --enforce-eager:
    # graphs are only ever used on CUDA, by a single-rank runner.
    enforce_eager: bool = False

    @property
    def num_blocks(self) -> int:
        return self.kv_cache_tokens // self.block_size

    def check(self) -> None:
        for name in ("max_model_len", "block_size", "kv_cache_tokens", "max_num_seqs",
                     "max_batched_tokens", "prefill_chunk", "max_queue"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                flag = "--" + name.replace("_", "-")
                raise UserError(f"{flag} must be a positive integer, got {v!r}")
        if not isinstance(self.enforce_eager, bool):
            raise UserError(f"enforce_eager must be true or false, got {self.enforce_eager!r}")
        if self.max_batched_tokens < self.prefill_chunk + self.max_num_seqs:
            raise UserError(
                f"--max-batched-tokens ({self.max_batched_tokens}) must be at least "
                f"--prefill-chunk + --max-num-seqs ({self.prefill_chunk} + {self.max_num_seqs})"
                f", so that a prompt chunk always fits beside a full batch of decodes")
        if self.num_blocks < blocks_for(self.max_model_len, self.block_size):
            need = blocks_for(self.max_model_len, self.block_size)
            raise UserError(
                f"--kv-cache-tokens ({self.kv_cache_tokens}) must hold one sequence of "
                f"--max-model-len ({self.max_model_len}) tokens in whole blocks of "
                f"--block-size {self.block_size}: {need} blocks ({need * self.block_size} "
                f"tokens), but it makes {self.num_blocks}; raise it, or lower "
                f"--max-model-len or --block-size")
