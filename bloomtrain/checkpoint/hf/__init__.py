"""HF Bloom directories, in and out, in one package: convert.py (the HF config's mapping to a
model shape and back, `import-hf` and `export-hf`), files.py (an HF directory's weight files:
safetensors or torch .bin, sharded or not, their names and the tied head), slices.py (a tensor
parallel rank's slices of them, read without loading the rest: the sharded loader's HF reader).

`import bloomtrain.checkpoint.hf` loads none of them: each name comes from its module when first
used (the CLI parses before torch is imported)."""
from bloomtrain.utils import lazy_exports

__getattr__ = lazy_exports(__name__, {
    **dict.fromkeys(["TOKENIZER_FILES", "collect_hf_state", "export_hf", "hf_config_from_shape",
                     "import_hf", "is_hf_dir", "read_hf_config", "shape_from_hf_config",
                     "special_token_ids"], "convert"),
    **dict.fromkeys(["BIN_FILE", "BIN_INDEX", "SAFETENSORS_FILE", "SAFETENSORS_INDEX",
                     "WEIGHT_FILES", "canonical_name", "check_tied_head", "iter_hf_tensors",
                     "load_state_dict", "weight_files"], "files"),
    **dict.fromkeys(["HFSliceReader", "sliceable"], "slices")})

__all__ = ["BIN_FILE", "BIN_INDEX", "HFSliceReader", "SAFETENSORS_FILE", "SAFETENSORS_INDEX",
           "TOKENIZER_FILES", "WEIGHT_FILES", "canonical_name", "check_tied_head",
           "collect_hf_state", "export_hf", "hf_config_from_shape", "import_hf",
           "is_hf_dir", "iter_hf_tensors", "load_state_dict", "read_hf_config",
           "shape_from_hf_config", "sliceable", "special_token_ids", "weight_files"]
