"""bloomtrain checkpoints: sharded, topology-independent, atomic (`writer`), read into any layout
(`reader`); `format` holds the on-disk layout, the manifest, verification and discovery.

    CKPT_ROOT/
      latest                         name of the newest complete checkpoint (updated last)
      step_00000100/
        manifest.json                format, step, model shape, topology, train state, optimizer
                                     scalars, loss scaler, per-rank RNG, config, tokenizer
                                     reference, sha256 + size of every file, fragment index
        manifest.sha256              manifest.json's own sha256 (sha256sum's format)
        model-00000.safetensors      fp32 master weights (or imported weights, in their dtype)
        optim-00000.safetensors      AdamW moments: exp_avg, exp_avg_sq
        ...                          one model-/optim- pair per rank that holds unique data
        tokenizer/                   the run's tokenizer files, when it had one

Every rank writes only what it holds (`fragments`): `tensors[NAME].fragments` lists `{files,
keys, dtypes, tp_dim, tp_rank, tp_size, offset, numel}`, elements [offset, offset + numel) of the
flattened tp chunk `tp_rank` of `tp_size` along `tp_dim` of the full parameter. That rebuilds any
other layout's shards, with no conversion step. Nothing is unpickled on load: tensors come from
safetensors and everything else from JSON.
"""
from bloomtrain.checkpoint.format import (FORMAT, FORMAT_VERSION, MODEL_KINDS, OPTIM_KINDS,
                                          TIED_ALIAS, CheckpointError, SharedCheck,
                                          find_latest_valid,
                                          list_checkpoints, prune, read_manifest, resolve,
                                          residual_kind, residual_kinds, sha256_file,
                                          step_dir_name, verify, verify_shared)
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
    "SharedCheck", "find_latest_valid",
    "full_fragments", "list_checkpoints", "load_model_state", "open_model", "prune",
    "read_manifest", "residual_kind", "residual_kinds", "resolve",
    "save_checkpoint", "sha256_file", "step_dir_name", "verify",
    "verify_shared",
]
