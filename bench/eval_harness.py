"""`bloomtrain eval` against lm-evaluation-harness's own HF backend (`lm_eval --model hf`) on the
same model, the same task, the same requests, fp32 on both sides and the same torch threads.

The task is a local multiple-choice one written here: 125 questions of 4 answers each, 500
loglikelihood requests, the questions' lengths spread by a preamble of 0-60 words (so batching
by length matters as it does on real tasks). The model is the demo's shape (hidden 128, 4
layers, 4 heads, vocabulary 4096, BLOOM's tied head), random weights, with a BPE trained here
on the built-in corpus; `--checkpoint DIR` evaluates a real one instead (a bloomtrain
checkpoint holding its tokenizer; it is exported to HF for the other side).

Each side is built once (model loading is not timed), then `lm_eval.simple_evaluate` on the task
is timed: --rounds (3) rounds alternating the order of the sides, medians reported. Both sides
run --batch-size (16) requests per forward; the HF backend's own default, batch size 1, is
timed in the same rounds as a third side. Where the difference comes from: both sort requests longest first and batch
them; bloomtrain packs a batch's rows into one padding-free row of tokens, each request attending
only to itself, with no KV cache (bloomtrain.eval.forward.score: the serving engine's way with
prompts), where HF's backend right-pads them; and it runs the LM head and its log-softmax only at
the positions it scores (the answer's tokens), where HF's backend takes the log-softmax of every
position's logits. The
per-request agreement of the two (max |difference| of the loglikelihoods)
is printed as a check that both did the same work. Measures; asserts nothing. Prints a table,
then one JSON line.

    python bench/eval_harness.py
    python bench/eval_harness.py --threads 2 --batch-size 32 --rounds 5
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import alternate_rounds  # noqa: E402

QUESTIONS = 125
WORDS = ("the model reads a long context before the question and must keep it all in mind while "
         "it weighs each answer in turn as the harness asks about every choice").split()


def write_task(root: Path) -> str:
    """The task YAML and its jsonl in `root`; returns the task name."""
    rng = random.Random(0)
    with open(root / "sums.jsonl", "w") as f:
        for _ in range(QUESTIONS):
            a, b = rng.randint(2, 99), rng.randint(2, 99)
            preamble = " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 60)))
            wrong = rng.sample([n for n in range(4, 199) if n != a + b], 3)
            choices = [str(a + b)] + [str(n) for n in wrong]
            rng.shuffle(choices)
            f.write(json.dumps({"question": f"{preamble}\nWhat is {a} plus {b}?",
                                "choices": choices, "label": choices.index(str(a + b))}) + "\n")
    (root / "sums.yaml").write_text(
        "task: bench_sums\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {root / 'sums.jsonl'}\noutput_type: multiple_choice\ntest_split: test\n"
        'doc_to_text: "{{question}}\\nAnswer:"\ndoc_to_choice: "{{choices}}"\n'
        "doc_to_target: label\nmetric_list:\n  - metric: acc\n    aggregation: mean\n"
        "    higher_is_better: true\n")
    return "bench_sums"


def build_model(root: Path) -> Path:
    """A demo-shaped checkpoint with random weights and a tokenizer trained on the built-in
    corpus."""
    from bloomtrain import checkpoint
    from bloomtrain.data.corpus import build_demo_corpus
    from bloomtrain.data.tokenizer import load_tokenizer, train_tokenizer
    from bloomtrain.model import BloomShape
    from bloomtrain.model import build_model as build

    build_demo_corpus(root / "corpus.jsonl", max_docs=400)
    train_tokenizer([root / "corpus.jsonl"], vocab_size=4096, output_dir=root / "tok")
    shape = BloomShape(vocab_size=4096, hidden_size=128, num_layers=4, num_heads=4,
                       ffn_hidden_size=512, init_method_std=0.02)
    model = build(shape, seed=1)
    checkpoint.save_checkpoint(root / "ckpt", 1, model.state_dict(), shape,
                               tokenizer=load_tokenizer(root / "tok"))
    return root / "ckpt"


def sides(checkpoint: Path, export: Path, batch_size: int) -> dict:
    """name -> an lm_eval LM, built once."""
    from lm_eval.models.huggingface import HFLM

    from bloomtrain.data.tokenizer import load_tokenizer
    from bloomtrain.eval.lm import BloomtrainLM, default_max_length
    from bloomtrain.eval.model import load_eval_model
    from bloomtrain.eval.protocol import Executor
    from bloomtrain.checkpoint.tokenizer import checkpoint_tokenizer
    from bloomtrain.topology import Topology

    tok = load_tokenizer(checkpoint_tokenizer(checkpoint, None))
    model = load_eval_model(checkpoint, Topology.single(), "cpu", "fp32")
    ours = BloomtrainLM(Executor(model), tok, max_length=default_max_length(tok),
                        batch_size=batch_size, progress=False)

    def hf(bs):
        return HFLM(pretrained=str(export), backend="causal", device="cpu", dtype="float32",
                    batch_size=bs)
    return {"bloomtrain": ours, "hf": hf(batch_size), "hf_bs1": hf(1)}


def evaluate(lm, task: str, manager) -> dict:
    import lm_eval
    return lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=manager,
                                   bootstrap_iters=0, log_samples=True)


def loglikelihoods(results: dict, task: str) -> list[float]:
    return [r[0][0] for doc in sorted(results["samples"][task], key=lambda d: d["doc_id"])
            for r in doc["resps"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default=None, help="a bloomtrain checkpoint to evaluate")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from lm_eval.tasks import TaskManager

    from bloomtrain.checkpoint.hf.convert import export_hf

    load_start = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    with tempfile.TemporaryDirectory(prefix="bench-eval-") as tmp:
        root = Path(tmp)
        task = write_task(root)
        checkpoint = Path(args.checkpoint) if args.checkpoint else build_model(root)
        export_hf(checkpoint, root / "hf", log=lambda *_: None)
        manager = TaskManager(include_path=str(root), include_defaults=False)
        lms = sides(checkpoint, root / "hf", args.batch_size)
        last: dict = {}

        def step(name):
            return lambda: last.__setitem__(name, evaluate(lms[name], task, manager))

        # HF at batch size 1 (lm-eval's default) in the same rounds, warmed alike: a single
        # cold run of it, after the others, was not a like-for-like figure.
        times = alternate_rounds({n: step(n) for n in ("bloomtrain", "hf", "hf_bs1")},
                                 timer=_timed, warmup=1, rounds=args.rounds, steps_per_round=1)
    requests = 4 * QUESTIONS
    med = {n: statistics.median(t) for n, t in times.items()}
    hf_bs1 = med["hf_bs1"]
    ours, ref = loglikelihoods(last["bloomtrain"], task), loglikelihoods(last["hf"], task)
    agreement = max(abs(a - b) for a, b in zip(ours, ref))
    out = {
        "bench": "eval_harness", "requests": requests, "batch_size": args.batch_size,
        "threads": args.threads, "rounds": args.rounds,
        "bloomtrain_s": med["bloomtrain"], "hf_s": med["hf"], "hf_batch1_s": hf_bs1,
        "bloomtrain_requests_per_s": requests / med["bloomtrain"],
        "hf_requests_per_s": requests / med["hf"],
        "speedup_vs_hf": med["hf"] / med["bloomtrain"],
        "speedup_vs_hf_batch1": hf_bs1 / med["bloomtrain"],
        "max_abs_loglikelihood_diff": agreement,
        "acc": {n: last[n]["results"][task]["acc,none"] for n in ("bloomtrain", "hf")},
        "all_times_s": times, "started": started, "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(), "cpus": os.cpu_count(), "torch": torch.__version__,
    }
    print(f"{'side':<22}{'median s':>10}{'requests/s':>12}")
    print(f"{'bloomtrain eval':<22}{med['bloomtrain']:>10.2f}{requests / med['bloomtrain']:>12.1f}")
    print(f"{'lm_eval --model hf':<22}{med['hf']:>10.2f}{requests / med['hf']:>12.1f}")
    print(f"{'  (its batch size 1)':<22}{hf_bs1:>10.2f}{requests / hf_bs1:>12.1f}")
    print(f"speedup {out['speedup_vs_hf']:.2f}x at batch size {args.batch_size} "
          f"({out['speedup_vs_hf_batch1']:.2f}x against the HF backend's default batch size "
          f"1); max |loglikelihood difference| {agreement:.2e}; load average "
          f"{load_start[0]:.2f} -> {out['loadavg_end'][0]:.2f} on {out['cpus']} CPUs, "
          f"{started}")
    print(json.dumps(out))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
