"""`bloomtrain demo`: the whole path on built-in data, no download.

built-in corpus (the Python standard library's sources and docstrings) -> byte-level BPE tokenizer
-> Megatron .bin/.idx -> train a small BLOOM -> eval -> export to HF -> greedy continuation.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import yaml

from bloomtrain import jsonl
from bloomtrain.errors import UserError

# The embedded default run. Sized so that a 2-core CPU finishes in a few minutes with the loss
# falling visibly; every key can be overridden on the command line (section.key=value).
DEMO_CONFIG = """
parallel:
  zero_stage: 1
  pp_schedule: 1f1b
  pp_partition: uniform
model:
  preset: null
  hidden_size: 128
  num_layers: 4
  num_heads: 4
  init_method_std: 0.02
data:
  seq_length: 128
  split: "98,2,0"
  seed: 1234
optim:
  lr: 1.0e-3
  min_lr: 1.0e-4
  warmup_samples: 640
  decay_style: cosine
  clip_grad: 1.0
train:
  micro_batch_size: 2
  global_batch_size: 16
  train_iters: 500
  precision: bf16
  log_interval: 20
  eval_interval: 100
  eval_iters: 4
checkpoint:
  save_interval: 250
  keep_last: 2
"""

DEMO_VOCAB = 4096


def demo_layout() -> tuple[int, dict]:
    """(processes, parallel settings) for the demo: the full 3D layout BLOOM used, fitted to
    this machine. Without GPUs: tp=2, pp=2, dp=2 on 8 CPU processes (gloo). With GPUs: tp=2 and
    pp=2 when there are at least 4, dp over the rest; fewer GPUs drop pp, then tp."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        return 8, {"tp": 2, "pp": 2}
    if gpus >= 4:
        return gpus - gpus % 4, {"tp": 2, "pp": 2}
    if gpus >= 2:
        return 2, {"tp": 2, "pp": 1}
    return 1, {"tp": 1, "pp": 1}


DEMO_PROMPT = "for i in range("


def demo_precision() -> tuple[str, str | None]:
    """(train.precision, why when it is not BLOOM's bf16). On GPUs and on CPUs with bf16 matmul
    instructions (AVX512-BF16 or AMX) the demo trains in bf16 as BLOOM did. A CPU without them
    (AVX2 only) emulates every bf16 matmul, measured ~3.5x slower per step than fp32 on the demo's
    8 processes (3.5 vs 0.9-1.2 s/step on a 2-core AVX2 EPYC), which would turn the few-minute
    demo into half an hour; there the demo trains in fp32 and says so."""
    import torch

    if torch.cuda.is_available():
        return "bf16", None
    cpu = getattr(torch, "cpu", None)
    try:
        native = cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported()
    except AttributeError:  # a torch without the probes: trust bf16
        return "bf16", None
    if native:
        return "bf16", None
    return "fp32", ("this CPU has no bf16 matmul instructions (AVX512-BF16 or AMX), so bf16 would "
                    "run ~3.5x slower; train.precision=bf16 to use it anyway")


def _prepare_data(data_dir: Path, max_docs: int | None, log) -> tuple[Path, Path, Path]:
    """Steps 1-3: corpus, tokenizer, .bin/.idx (each skipped when already there)."""
    from bloomtrain.data.corpus import build_demo_corpus
    from bloomtrain.data.preprocess import preprocess
    from bloomtrain.data.tokenizer import train_tokenizer

    corpus = data_dir / "stdlib.jsonl"
    if not corpus.exists():
        log(f"[demo] 1/6 building the built-in corpus from the Python standard library -> {corpus}")
        build_demo_corpus(corpus, max_docs=max_docs)
    else:
        log(f"[demo] 1/6 corpus exists: {corpus}")
    tok_dir = data_dir / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        log(f"[demo] 2/6 training a byte-level BPE tokenizer (vocab {DEMO_VOCAB}) -> {tok_dir}")
        train_tokenizer([str(corpus)], DEMO_VOCAB, str(tok_dir))
    prefix = data_dir / "stdlib"
    dataset = Path(f"{prefix}_text_document")
    if not Path(f"{dataset}.idx").exists():
        log(f"[demo] 3/6 preprocessing to Megatron .bin/.idx -> {dataset}.bin/.idx")
        preprocess([str(corpus)], str(tok_dir), str(prefix), append_eod=True, workers=2,
                   progress=False, log=log)
    return corpus, tok_dir, dataset


def demo_data_paths(root: Path) -> tuple[Path, Path]:
    """Where _prepare_data puts the demo's dataset (its prefix) and tokenizer."""
    return root / "data" / "stdlib_text_document", root / "data" / "tokenizer"


def _demo_config(root: Path, overrides):
    """The demo config with the layout fitted to this machine and the user's overrides,
    validated: before the corpus, the tokenizer and the dataset are built, so that a mistyped
    override is said at once, not after minutes of data preparation. Returns (config, the
    processes to run, validate's run, why the precision is fp32 if it is)."""
    from bloomtrain.config import Config, apply_override
    from bloomtrain.validate import validate

    dataset, tok_dir = demo_data_paths(root)
    data = yaml.safe_load(DEMO_CONFIG)
    data["run_dir"] = str(root / "run")
    data["data"]["paths"] = [str(dataset)]
    data["data"]["tokenizer"] = str(tok_dir)
    data["checkpoint"]["dir"] = str(root / "checkpoints")
    nproc, layout = demo_layout()
    data["parallel"].update(layout)
    data["train"]["precision"], why = demo_precision()
    for ov in overrides or []:
        apply_override(data, ov)
    cfg = Config.from_dict(data)
    if int(os.environ.get("WORLD_SIZE") or 1) > 1:
        # Every rank would build the same data and export into the same files at once.
        raise UserError("bloomtrain demo launches its own processes; run it without torchrun "
                        "or srun (`bloomtrain train` is the one to run under them)")
    # Under a launcher of one process the demo trains in it; else it launches the layout's.
    nproc = nproc if "WORLD_SIZE" not in os.environ else 1
    try:
        run = validate(cfg, nproc)
    except UserError as e:  # the demo has no --nproc to change
        raise UserError(str(e).replace(
            "change --nproc or the tp/pp sizes",
            f"the demo runs {nproc} processes: give tp and pp whose product divides {nproc}")
        ) from None
    return cfg, nproc, run, why


def _train(root: Path, cfg, nproc: int, run, why: str | None, log):
    """Step 4: the demo config trained on as many processes as its layout needs. Returns
    (config, metrics records)."""
    from bloomtrain.train import launch_local, train
    from bloomtrain.train.cli import worker_entry
    from bloomtrain.files import atomic_output

    if why and cfg.train.precision == "fp32":  # not overridden
        log(f"[demo] precision fp32: {why}")
    config_path = root / "demo_config.yaml"
    with atomic_output(config_path, "w") as f:
        f.write(cfg.to_yaml())
    p = cfg.parallel
    log(f"[demo] 4/6 training {cfg.train.train_iters} steps (precision {cfg.train.precision}) on "
        f"{nproc} process(es): tp={p.tp} pp={p.pp} dp={run.layout.dp} "
        f"zero={p.zero_stage} schedule={p.pp_schedule}; config {config_path}")
    from bloomtrain.train.control import exit_after_sigint, stopped_text, summary
    if nproc > 1:
        stopped = launch_local(nproc, worker_entry, str(config_path), [], run,
                               checkpoint_dir=cfg.checkpoint.dir)
    else:
        result = train(cfg, log=log, run=run)
        stopped = (stopped_text(summary(result), cfg.checkpoint.dir)
                   if result.exit_reason == "SIGINT" else None)
    if stopped:  # Ctrl-C stops the demo too, once the run has saved
        raise SystemExit(exit_after_sigint(stopped))
    records = [jsonl.loads(line) for line in open(Path(cfg.run_dir) / "metrics.jsonl")]
    if records and records[-1].get("stopped") in ("signal", "kill switch"):
        # SIGTERM or SIGUSR1 (a `kill`, `timeout`, a pod's stop) or the kill switch: the run
        # saved and stopped, as `bloomtrain train` does (exit 0); exporting and generating
        # from a cut run is not what was asked for.
        log(f"[demo] training stopped at step {records[-1]['step']} "
            f"({records[-1]['stopped']}) and saved; the same command resumes it")
        raise SystemExit(0)
    return cfg, records


def run_demo(run_dir: str = "bloomtrain_demo", overrides: list[str] | None = None,
             max_docs: int | None = None, log=print) -> dict:
    import torch

    from bloomtrain import checkpoint as ckpt
    from bloomtrain import load_model
    from bloomtrain.data.tokenizer import load_tokenizer
    from bloomtrain.generate import generate
    from bloomtrain.checkpoint.hf.convert import export_hf
    from bloomtrain.report.closing import closing_lines

    t_start = time.time()
    root = Path(run_dir).resolve()
    if root.exists() and not root.is_dir():
        raise UserError(f"--run-dir {run_dir} is a file; give a directory (new, or a demo's "
                        f"earlier run)")
    cfg, nproc, run, why = _demo_config(root, overrides)
    data_dir = root / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    corpus, tok_dir, dataset = _prepare_data(data_dir, max_docs, log)
    tokenizer = load_tokenizer(tok_dir)
    cfg, records = _train(root, cfg, nproc, run, why, log)
    losses = [r["loss"] for r in records if "loss" in r]
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    checkpoint = str(ckpt.resolve(cfg.checkpoint.dir))
    report = _report(cfg.run_dir, log)

    export_dir = root / "hf"
    log(f"[demo] 5/6 exporting to HF transformers format -> {export_dir}")
    export_hf(checkpoint, str(export_dir))

    log(f"[demo] 6/6 greedy continuation of {DEMO_PROMPT!r}")
    model = load_model(checkpoint)
    ids = torch.tensor([tokenizer.encode(DEMO_PROMPT)])
    out = generate(model, ids, max_new_tokens=40, vocab_limit=tokenizer.vocab_size)
    text = tokenizer.decode(out[0].tolist())
    log("-" * 60)
    log(text)
    log("-" * 60)
    log(f"[demo] done in {(time.time() - t_start) / 60:.1f} min. Written:")
    log(f"  corpus        {corpus}")
    log(f"  tokenizer     {tok_dir}/tokenizer.json")
    log(f"  dataset       {dataset}.bin / .idx")
    # The run itself: what `bloomtrain train` ends with.
    for line in closing_lines(cfg.run_dir, cfg.checkpoint.dir, prefix="[demo] training",
                              report=report, exported=export_dir):
        log(line)
    return {"losses": losses, "eval_losses": evals, "checkpoint": checkpoint,
            "export": str(export_dir), "sample": text, "layout": records[0].get("layout")}


def _report(run_dir: str, log) -> Path | None:
    """The run's plots and report.html (bloomtrain plot), when matplotlib is installed."""
    from bloomtrain.report import write_report
    try:
        html = write_report([run_dir])
    except UserError as e:  # matplotlib missing: the demo itself has succeeded
        log(f"[demo] no plots: {e}")
        return None
    log(f"[demo] plots and report -> {html}")
    return html
