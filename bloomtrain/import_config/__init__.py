"""`bloomtrain import-config`: a Megatron-DeepSpeed launch (a launch script or an args file) and its
DeepSpeed ds_config, converted into a bloomtrain config YAML, with the report of every argument
mapped, ignored or unsupported.

Modules, in reading order: `shell` and `launch` read the launch script (the program's arguments,
the world size, the files it writes); `megatron_args` knows Megatron's options; `mapping` (with
`conversion`, `sections` and `deepspeed`) converts them: `megatron_to_config`, no I/O, also used
for the `args` of an imported Megatron-DeepSpeed checkpoint; `cli` is the command.
"""
from bloomtrain.import_config.cli import register
from bloomtrain.import_config.conversion import ImportReport, Mapped, Skipped
from bloomtrain.import_config.mapping import megatron_to_config

__all__ = ["ImportReport", "Mapped", "Skipped", "megatron_to_config", "register"]
