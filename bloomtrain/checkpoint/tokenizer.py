"""Which tokenizer a model source carries: `generate`, `serve` and `eval` take it from the
checkpoint or HF directory they load, unless one is named."""
from __future__ import annotations

from pathlib import Path

from bloomtrain.errors import UserError


def checkpoint_tokenizer(checkpoint, explicit: str | None):
    """`explicit`, else the tokenizer an HF directory or a bloomtrain checkpoint carries (used by
    `generate`, `serve` and `eval`)."""
    from bloomtrain import checkpoint as ckpt_mod
    from bloomtrain.checkpoint import hf

    if explicit:
        return Path(explicit)
    path = Path(checkpoint)
    if hf.is_hf_dir(path):
        if has_tokenizer(path):
            return path
    else:
        step_dir = ckpt_mod.resolve(path)
        ref = ckpt_mod.read_manifest(step_dir).get("tokenizer")
        if ref and (step_dir / ref / "tokenizer.json").is_file():
            return step_dir / ref
    raise UserError(f"{checkpoint} has no tokenizer; pass --tokenizer PATH")


def has_tokenizer(directory: Path) -> bool:
    """Whether `directory` holds a tokenizer load_tokenizer reads: a tokenizer.json, or
    Megatron's vocab.json + merges.txt (a GPT-2 model directory may ship only those)."""
    from bloomtrain.data import gpt2_bpe

    return (directory / "tokenizer.json").is_file() or \
        gpt2_bpe.find_pair(directory, required=False) is not None
