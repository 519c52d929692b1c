"""Readers of other systems' checkpoints, for `bloomtrain import-deepspeed`: HF models trained under
DeepSpeed ZeRO 1/2/3 (the BF16_Optimizer included), Megatron-DeepSpeed pipeline checkpoints
(BLOOM's own format) at any tp x pp x dp, and DeepSpeed universal checkpoints (BLOOM's published
optimizer states). deepspeed is never imported: their pickles are read by safe_load.

Modules, in reading order: `safe_load` (torch.load(weights_only=True) and the allow-listed
stand-ins), `files` (where a DeepSpeed step's files are, by rank), `zero` (a rank's optimizer
shards, per parameter), `megatron` (GPTModelPipe's names, tp merges, args), then one reader per
format, each giving a `source.Source`: `hf_zero`, `pipeline`, `universal`; `config` (the config
that continues the run) and `importer` (the command: check everything, then write one parameter
at a time).
"""
from bloomtrain.checkpoint.interop.importer import import_deepspeed, read_source
from bloomtrain.checkpoint.interop.safe_load import InteropError

__all__ = ["InteropError", "import_deepspeed", "read_source"]
