"""bloomtrain checkpoints: sharded, topology-independent, atomic.

    CKPT_ROOT/
      latest                         name of the newest complete checkpoint (updated last)
      step_00000100/
        manifest.json                format, step, model shape, topology, train state, optimizer
                                     scalars, loss scaler, per-rank RNG, config, tokenizer
                                     reference, sha256 + size of every file, fragment index
        model-00000.safetensors      fp32 master weights (or imported weights, in their dtype)
        optim-00000.safetensors      AdamW moments: exp_avg, exp_avg_sq
        ...                          one model-/optim- pair per rank that holds unique data
        tokenizer/                   the run's tokenizer files, when it had one

**Logical coordinates.** Every rank writes only what it holds, without gathering anything: a list
of `Fragment`s, each a piece of a full (unsharded) parameter. The manifest's
`tensors[NAME].fragments` lists `{files, keys, dtypes, tp_dim, tp_rank, tp_size, offset, numel}`
for each: elements [offset, offset + numel) of the flattened tp chunk `tp_rank` of `tp_size`
along `tp_dim` of the full parameter (tp_size 1: the full parameter itself). That is enough to
rebuild any other layout's shards, whatever tp, pp, dp or ZeRO stage wrote it: there is no
"universal checkpoint" conversion step.

**Atomicity.** All ranks write into `.step_N.tmp/`; rank 0 gathers the file checksums and the
fragment index, writes the manifest, renames the directory into place and only then updates
`latest`. A crash, a kill or a full disk at any moment leaves the previous checkpoint valid, and
`find_latest_valid` skips anything incomplete or corrupt (missing files, wrong sizes, checksums).

**Async saving** (`checkpoint.async_save`, on by default): the state is copied to CPU memory on the
training thread, then a background thread writes the files and commits. The commit's gather and
broadcasts run on a separate gloo process group, so they never interleave with training collectives
on the main groups, which is why it is safe with both gloo and NCCL. A later save, or the end of
training, waits for the previous one and re-raises its error, if any.

**Nothing is unpickled on load**: tensors come from safetensors and everything else from JSON.

Modules: `format` (on-disk layout, manifest, verification, discovery), `fragments` (what a rank
hands the writer), `writer`, `reader`.
"""
from bloomtrain.checkpoint.format import (FORMAT, FORMAT_VERSION, MODEL_KINDS, OPTIM_KINDS,
                                          TIED_ALIAS, CheckpointError, find_latest_valid,
                                          list_checkpoints, prune, read_manifest, resolve,
                                          sha256_file, step_dir_name, verify)
from bloomtrain.utils import lazy_exports

# fragments, reader and writer import torch; the format (finding and checking checkpoints, for
# `bloomtrain status` and the CLI's parsers) must not wait for it.
__getattr__ = lazy_exports(__name__, {
    **dict.fromkeys(["Deferred", "Fragment", "full_fragments"], "fragments"),
    **dict.fromkeys(["CheckpointReader", "LazyState", "load_model_state", "open_model"],
                    "reader"),
    **dict.fromkeys(["CheckpointWriter", "save_checkpoint"], "writer")})

__all__ = [
    "FORMAT", "FORMAT_VERSION", "MODEL_KINDS", "OPTIM_KINDS", "TIED_ALIAS", "CheckpointError",
    "CheckpointReader", "CheckpointWriter", "Deferred", "Fragment", "LazyState",
    "find_latest_valid",
    "full_fragments", "list_checkpoints", "load_model_state", "open_model", "prune",
    "read_manifest", "resolve",
    "save_checkpoint", "sha256_file", "step_dir_name", "verify",
]
