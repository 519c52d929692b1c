"""The bash reader of `bloomtrain import-config`: a Megatron launch script, SLURM script or args
file read as bash would read it, for the part of bash such scripts use, without running anything
(lexer.py: words, quotes, variables, `$(( ))`, heredocs, `bash -c`; launch.py: the commands
evaluated in order, the launch and its world size found). shlex has neither `${X:-d}`, `$(( ))`
nor heredocs, hence a reader of our own.

One entry, `read_launch(text, variables) -> Launch`; `show` and `unresolved_in` display and find
the markers it leaves where a value could not be known without running the script."""
from bloomtrain.import_config.bash.launch import Launch, read_launch
from bloomtrain.import_config.bash.lexer import show, unresolved_in

__all__ = ["Launch", "read_launch", "show", "unresolved_in"]
