"""The data commands' parsers: `bloomtrain tokenizer train` (data/tokenizer.py), `bloomtrain
preprocess` (data/preprocess.py), `bloomtrain data inspect|merge` (data/inspect.py). Each command
imports its library module when it runs, so that parsing and `--help` load none of them."""
from __future__ import annotations


def register_tokenizer(subparsers) -> None:
    p = subparsers.add_parser("tokenizer")
    sub = p.add_subparsers(dest="tokenizer_command", metavar="ACTION")
    sub.required = True
    t = sub.add_parser(
        "train",
        help="train a byte-level BPE tokenizer",
        description="Train a BLOOM-style byte-level BPE (specials <unk> <s> </s> <pad> = ids 0-3) "
        "and write DIR/tokenizer.json plus tokenizer_config.json and special_tokens_map.json. "
        "Inputs are read like `bloomtrain preprocess` reads them (jsonl/gz/zst with the text "
        "under --json-key, parquet, or plain text files as one document each); unusable "
        "documents are skipped and named by file and line.",
    )
    t.add_argument("--input", nargs="+", required=True, metavar="FILE",
                   help="input files, globs or directories")
    t.add_argument("--vocab-size", type=int, required=True, metavar="N")
    t.add_argument("--json-key", default="text",
                   help="JSON key / Parquet column of the text, as for preprocess (default: text)")
    t.add_argument("--output", required=True, metavar="DIR")
    t.add_argument("--min-frequency", type=int, default=2,
                   help="pairs seen fewer times are not merged (default: 2)")
    t.set_defaults(func=_tokenizer_train)



def _tokenizer_train(args) -> int:
    from bloomtrain.data.tokenizer import load_tokenizer, train_tokenizer

    path = train_tokenizer(args.input, args.vocab_size, args.output, args.min_frequency,
                           args.json_key)
    tok = load_tokenizer(path)
    print(f"wrote {path} (vocab size {tok.vocab_size})")
    return 0



def register_preprocess(subparsers) -> None:
    p = subparsers.add_parser(
        "preprocess",
        description="Tokenize documents into PREFIX_<json-key>_document.bin/.idx (Megatron MMIDIDX). "
        "Inputs are files, globs or directories (recursed, sorted). By extension: .jsonl/.json "
        "(optionally .gz or .zst) hold one JSON object per line with the text under --json-key; "
        ".parquet holds it in column --json-key; any other file is plain text and is ONE "
        "document (held in memory whole, so use jsonl for big corpora). Each document becomes "
        "one sequence. Invalid JSON, a missing key, non-UTF-8 bytes and empty documents are "
        "skipped and reported with file:line.",
    )
    p.add_argument("--input", nargs="+", required=True, metavar="FILE",
                   help="input files, globs or directories")
    p.add_argument("--tokenizer", required=True, metavar="PATH",
                   help="tokenizer.json or a directory holding one (any local HF tokenizer), "
                        "or Megatron's GPT-2 vocab.json with its merges.txt beside it")
    p.add_argument("--output-prefix", required=True, metavar="P",
                   help="writes P_<json-key>_document.bin and .idx")
    p.add_argument("--json-key", default="text",
                   help="JSON key / Parquet column of the text (default: text)")
    p.add_argument("--append-eod", action="store_true",
                   help="append the end-of-document token (</s>) to every document")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes (default: 1)")
    p.add_argument("--strict", action="store_true",
                   help="fail on the first unusable document instead of skipping it")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress line (drawn on stderr when it is a terminal)")
    p.set_defaults(func=_preprocess)



def _preprocess(args) -> int:
    from bloomtrain.data.preprocess import preprocess

    preprocess(args.input, args.tokenizer, args.output_prefix, json_key=args.json_key,
               append_eod=args.append_eod, workers=args.workers, strict=args.strict,
               progress=not args.no_progress)
    return 0



def register_data(subparsers) -> None:
    p = subparsers.add_parser("data")
    sub = p.add_subparsers(dest="data_command", metavar="ACTION")
    sub.required = True
    i = sub.add_parser("inspect", help="print counts, a length histogram and decoded samples",
                       description="Print a dataset's documents, sequences, tokens, dtype, document "
                       "length statistics and histogram, and decoded samples with --tokenizer.")
    i.add_argument("prefix", metavar="PREFIX", help="dataset prefix (without .bin/.idx)")
    i.add_argument("--tokenizer", metavar="PATH", help="tokenizer to decode samples with")
    i.add_argument("--samples", type=int, default=3, metavar="K",
                   help="decoded documents to show, evenly spaced (default: 3)")
    i.set_defaults(func=_data_inspect)
    m = sub.add_parser("merge", help="concatenate datasets that share a dtype",
                       description="Concatenate datasets in the given order into one, like "
                       "Megatron's tools/merge_datasets.py.")
    m.add_argument("--inputs", nargs="+", required=True, metavar="PREFIX")
    m.add_argument("--output-prefix", required=True, metavar="OUT")
    m.set_defaults(func=_data_merge)



def _data_inspect(args) -> int:
    from bloomtrain.data.inspect import inspect_dataset

    inspect_dataset(args.prefix, args.tokenizer, args.samples)
    return 0



def _data_merge(args) -> int:
    from bloomtrain.data.inspect import merge_datasets

    ds = merge_datasets(args.inputs, args.output_prefix)
    print(f"wrote {ds.prefix}.bin/.idx: {ds.num_docs:,} documents, {len(ds):,} sequences, "
          f"{ds.num_tokens:,} tokens ({ds.dtype.name})")
    return 0
