"""`bloomtrain eval` against lm-evaluation-harness's own HF backend (`lm_eval --model hf`) on the
same model exported to HF: per-request loglikelihoods within 1e-4 in fp32 and the same metrics,
on the local tasks of tests/eval_tasks/ (last word, multiple choice, rolling perplexity,
generation); the same per-request numbers from tp=2, pp=2 and dp=2 as from one process;
generate_until equal to HF `generate`; the prefix-logits cache and batching by length; the
command's errors. During training: tests/eval/test_eval_training.py.

Model: hidden 64, 4 heads, 4 layers, vocab 512 (the session's tiny BPE has 500 tokens),
trained for a few seconds on the test tasks' texts, so that its scores and continuations depend
on their context and its accuracies are not all zero.

Nothing is downloaded: the tasks read jsonl files through `dataset_path: json` (relative to the
repository root, where these tests run them), the models are local directories, and the HF
libraries are told they are offline.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

# Offline before datasets / huggingface_hub are imported: they read these once, at import.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

lm_eval = pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from bloomtrain import cli  # noqa: E402
from bloomtrain.eval import cli as eval_cli  # noqa: E402
from bloomtrain.eval import protocol  # noqa: E402
from tests.dist import run_ranks  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "at_root")

ROOT = Path(__file__).resolve().parents[2]
TASKS_DIR = "tests/eval_tasks"
TASKS = ["lastword_tiny", "choice_tiny", "rolling_tiny", "greedy_tiny"]
# Below the longest requests: contexts are cut on the left, documents take several windows.
MAX_LENGTH = 64
COUNTED = ("acc", "acc_norm", "exact_match")  # metrics that count documents: equal exactly
PROMPTS = ["The quick brown fox", "def f(x):", "Привет, мир!", "数据并行",
           "The quick brown dog", "Emoji 🎉"]


@pytest.fixture
def at_root(monkeypatch):
    monkeypatch.chdir(ROOT)


@contextlib.contextmanager
def in_root():
    """For module fixtures, which run before a test's own fixtures."""
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        yield
    finally:
        os.chdir(cwd)


def train_on_the_tasks(model, tok, steps: int = 400) -> None:
    """A few hundred AdamW steps on the test tasks' own texts (windows of 64 tokens), so that
    the model's continuations depend on their context: a random BLOOM, whose head is its
    embedding, mostly repeats its input's last token."""
    ids = []
    for path in sorted((ROOT / TASKS_DIR).glob("*.jsonl")):
        for line in open(path):
            doc = json.loads(line)
            text = doc.get("text") or (f"Question: {doc['question']}\nAnswer: "
                                       f"{doc['choices'][doc['label']]}" if "choices" in doc
                                       else f"{doc['question']} {doc['answer']}.")
            ids += tok.encode(text) + [tok.eod_id]
    data = torch.tensor(ids)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - 65, (8,), generator=g)
        batch = torch.stack([data[s:s + 65] for s in starts])
        loss = model(batch[:, :-1], labels=batch[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, tiny_tokenizer_dir):
    """(bloomtrain checkpoint, its HF export) of the tiny model trained on the tasks' texts,
    with the tokenizer."""
    from bloomtrain import checkpoint
    from bloomtrain.checkpoint import hf
    from bloomtrain.data.tokenizer import load_tokenizer
    from bloomtrain.model import BloomShape, build_model

    tok = load_tokenizer(tiny_tokenizer_dir)
    shape = BloomShape(vocab_size=512, hidden_size=64, num_layers=4, num_heads=4,
                       ffn_hidden_size=256)
    model = build_model(shape, seed=7)
    threads = torch.get_num_threads()
    # On one thread whatever ran before in the session: 400 steps round differently with one
    # thread and with two, and end in different models.
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            train_on_the_tasks(model, tok)
    finally:
        torch.set_num_threads(threads)
    root = tmp_path_factory.mktemp("eval_model")
    checkpoint.save_checkpoint(root / "ckpt", 1, model.state_dict(), shape, tokenizer=tok)
    hf.export_hf(root / "ckpt", root / "hf", log=lambda *_: None)
    return root / "ckpt", root / "hf"


def hf_backend(hf_dir, batch_size: int = 4):
    from lm_eval.models.huggingface import HFLM
    return HFLM(pretrained=str(hf_dir), backend="causal", device="cpu", dtype="float32",
                batch_size=batch_size, max_length=MAX_LENGTH)


@pytest.fixture(scope="module")
def hf_results(model_dirs):
    """The harness's HF backend on the export: `lm_eval --model hf --model_args
    pretrained=EXPORT,dtype=float32,max_length=64` on the four tasks, samples logged."""
    with in_root():
        return lm_eval.simple_evaluate(
            model="hf",
            model_args=f"pretrained={model_dirs[1]},dtype=float32,max_length={MAX_LENGTH}",
            tasks=TASKS, task_manager=TaskManager(include_path=TASKS_DIR, include_defaults=False),
            batch_size=4, device="cpu", bootstrap_iters=0, log_samples=True)


def eval_args(checkpoint, out: Path, *extra) -> list[str]:
    return ["eval", "--checkpoint", str(checkpoint), "--tasks", ",".join(TASKS),
            "--include-path", TASKS_DIR, "--max-length", str(MAX_LENGTH), "--batch-size", "4",
            "--bootstrap-iters", "0", "--output", str(out), "--log-samples", *extra]


def read_samples(out: Path) -> dict[str, list[dict]]:
    return {t: [json.loads(line) for line in open(out.with_name(f"{out.stem}_samples_{t}.jsonl"))]
            for t in TASKS}


def per_request(samples: dict[str, list[dict]]) -> dict[tuple, object]:
    """(task, doc, request) -> loglikelihood, (loglikelihood, greedy) or generated text."""
    out = {}
    for task, docs in samples.items():
        for doc in docs:
            for i, resp in enumerate(doc["resps"]):
                value = resp[0]
                if isinstance(value, (list, tuple)):
                    value = (float(value[0]), bool(value[1]))
                out[(task, doc["doc_id"], i)] = value
    return out


def max_differences(got: dict, want: dict, windows: dict | None = None
                    ) -> tuple[float, int]:
    """(largest |difference| of a loglikelihood, number of other values that differ). With
    `windows` (key -> the rolling windows a document took), a document's difference counts per
    window: its loglikelihood is a sum over every token of each."""
    assert got.keys() == want.keys()
    worst, unequal = 0.0, 0
    for key, w in want.items():
        g = got[key]
        if isinstance(w, str):
            unequal += g != w
            continue
        if isinstance(w, tuple):
            unequal += g[1] != w[1]
            g, w = g[0], w[0]
        worst = max(worst, abs(g - w) / (windows or {}).get(key, 1))
    return worst, unequal


def num_windows(tok, text: str) -> int:
    """The harness's rolling windows for `text` at MAX_LENGTH: each predicts up to MAX_LENGTH
    tokens (lm_eval.utils.get_rolling_token_windows with context_len 1)."""
    return max(1, math.ceil(len(tok.encode(text)) / MAX_LENGTH))


@pytest.fixture(scope="module")
def task_windows(tiny_tokenizer_dir) -> dict:
    """(rolling_tiny, doc, 0) -> its number of windows."""
    from bloomtrain.data.tokenizer import load_tokenizer
    tok = load_tokenizer(tiny_tokenizer_dir)
    docs = [json.loads(line) for line in open(ROOT / TASKS_DIR / "rolling_tiny.jsonl")]
    return {("rolling_tiny", i, 0): num_windows(tok, d["text"]) for i, d in enumerate(docs)}


def assert_same_metrics(got: dict, want: dict) -> None:
    """Counting metrics equal exactly; perplexities (exp of a mean of loglikelihoods equal
    within 1e-4) to 1e-4 relative."""
    assert got.keys() == want.keys()
    for task, metrics in want.items():
        for key, w in metrics.items():
            if not isinstance(w, float) or "stderr" in key:
                continue
            g = got[task][key]
            if key.split(",")[0] in COUNTED:
                assert g == w, (task, key, g, w)
            else:
                assert math.isclose(g, w, rel_tol=1e-4), (task, key, g, w)


@pytest.fixture(scope="module")
def one_process(model_dirs, tmp_path_factory):
    """`bloomtrain eval` in one process on the bloomtrain checkpoint: (results, samples)."""
    out = tmp_path_factory.mktemp("eval_out") / "results.json"
    with in_root():
        assert cli.main(eval_args(model_dirs[0], out)) == 0
    return json.loads(out.read_text()), per_request(read_samples(out))


# ---- agreement with the harness's HF backend ----------------------------------------------------

def assert_agrees_with_hf(got: dict, want: dict, windows: dict) -> None:
    """Per request: loglikelihoods within 1e-4, greedy flags and generations equal."""
    plain = [k for k in want if k[0] != "rolling_tiny"]
    worst, unequal = max_differences({k: got[k] for k in plain}, {k: want[k] for k in plain})
    # fp32 on both sides; the per-token log-probabilities differ in the last bits (HF's
    # log_softmax over the whole row, ours from the vocabulary-parallel max and sum): 5.7e-6
    # measured on continuations of up to 10 tokens.
    assert worst < 1e-4 and unequal == 0, (worst, unequal)
    for key, w in want.items():
        if key[0] == "rolling_tiny":
            # A document's loglikelihood (-590 to -670 here) is a sum over its windows, each
            # of which HF rounds to fp32 (spacing 3e-5 to 6e-5 at these sizes) where we add
            # in fp64 (1.4e-5 measured): 1e-4 beyond HF's own rounding, one fp32 spacing per
            # window.
            spacing = float(np.spacing(np.float32(abs(w))))
            assert abs(got[key] - w) < 1e-4 + windows[key] * spacing, (key, got[key], w)


def test_agrees_with_the_harness_hf_backend_request_by_request(one_process, hf_results,
                                                               task_windows):
    results, got = one_process
    assert_agrees_with_hf(got, per_request(hf_results["samples"]), task_windows)
    assert_same_metrics(results["results"], hf_results["results"])
    # Real, varied numbers: not every request alike, and continuations that depend on the
    # prompt.
    lls = [v[0] for v in got.values() if isinstance(v, tuple)]
    assert len({round(v, 2) for v in lls}) > len(lls) // 2
    texts = [v for k, v in got.items() if k[0] == "greedy_tiny"]
    assert len(set(texts)) > 1


@contextlib.contextmanager
def served(checkpoint):
    """`bloomtrain serve` on a free loopback port, in a subprocess: yields its base URL."""
    import re
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "bloomtrain", "serve", "--checkpoint",
                             str(checkpoint), "--port", "0", "--threads", "1",
                             "--served-model-name", "tiny", "--max-model-len", "512"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=ROOT)
    try:
        lines = []
        for line in proc.stdout:  # the server prints its address once it listens
            lines.append(line)
            m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
            if m:
                break
        else:
            raise AssertionError("bloomtrain serve did not start:\n" + "".join(lines))
        yield m.group(1)
    finally:
        proc.kill()
        proc.wait()


def test_the_served_model_gives_the_same_requests_and_metrics(model_dirs, one_process,
                                                              task_windows):
    """The README's route: lm-eval's `local-completions` model pointed at `bloomtrain serve`
    (token-id prompts scored with echo, logprobs 1, max_tokens 1; the server's /tokenize and
    /tokenizer_info). The harness's API models keep max_length - 1 tokens of input and score
    rolling windows of max_length - 2, so max_length=66 there is --max-length 64 here."""
    with served(model_dirs[0]) as base:
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=f"base_url={base}/v1/completions,model=tiny,max_length={MAX_LENGTH + 2},"
                       f"num_concurrent=1,max_retries=1",
            tasks=TASKS, task_manager=TaskManager(include_path=TASKS_DIR, include_defaults=False),
            batch_size=8, bootstrap_iters=0, log_samples=True)
    ours, want = one_process
    worst, unequal = max_differences(per_request(results["samples"]), want, task_windows)
    # The server's batched forward against ours (the harness adds the server's fp32 logprobs
    # in fp64, as we do): 4.8e-6 per request, 4.1e-6 per rolling window measured.
    assert worst < 1e-4 and unequal == 0, (worst, unequal)
    assert_same_metrics(results["results"], ours["results"])


# ---- layouts -------------------------------------------------------------------------------------

def _layout_rank(rank, world, opts, root):
    """One rank of `bloomtrain eval` (the command's own per-rank code) in a joined job."""
    import tqdm
    tqdm.tqdm.monitor_interval = 0  # no monitor thread left behind in the pool's worker
    os.chdir(root)
    eval_cli.run_rank(opts, torch.device("cpu"))


def layout_opts(checkpoint, out: Path, tp: int, pp: int, world: int) -> dict:
    """The options `bloomtrain eval ... parallel.tp=T parallel.pp=P` gives each rank of a job
    of `world` processes."""
    from bloomtrain.eval.cli import _options

    args = cli.build_parser().parse_args(eval_args(checkpoint, out, f"parallel.tp={tp}",
                                                   f"parallel.pp={pp}"))
    saved = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(world)  # as under a launcher: no processes started here
    try:
        return _options(args)
    finally:
        if saved is None:
            os.environ.pop("WORLD_SIZE")
        else:
            os.environ["WORLD_SIZE"] = saved


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_layouts_give_the_same_requests_as_one_process(tp, pp, model_dirs, one_process,
                                                        task_windows, tmp_path):
    """Each rank reads only its shards (tp: half of every split matrix; pp: its stage's
    blocks); the per-request numbers equal one process's within 1e-5, per window for a rolling
    document (tp reduces its partial sums over two ranks, rounding differently: 2.7e-6 on
    continuations, 1.1e-5 on a 4-window document; pp computes the same sums)."""
    out = tmp_path / "results.json"
    run_ranks(2, _layout_rank, layout_opts(model_dirs[0], out, tp, pp, 2), str(ROOT))
    results, want = one_process
    worst, unequal = max_differences(per_request(read_samples(out)), want, task_windows)
    assert worst < 1e-5 and unequal == 0, (worst, unequal)
    assert_same_metrics(json.loads(out.read_text())["results"], results["results"])


REQUESTS = {
    "loglikelihood": [("The quick brown", " fox jumps over"), ("Привет,", " мир!"),
                      ("def f(x):", "\n    return x + 1"), ("数据并行", "、张量并行"),
                      ("Emoji", " 🎉 party")],
    "loglikelihood_rolling": [("The quick brown fox jumps over the lazy dog. " * 6,),
                              ("Привет, мир! Съешь же ещё этих мягких французских булок.",)],
    "generate_until": [(p, {"until": ["\n", "."], "max_gen_toks": 10, "do_sample": False,
                            "repetition_penalty": 2.0}) for p in PROMPTS],
}


def run_requests(lm) -> dict:
    """REQUESTS answered, and continuations scored after their prompts: the generated ones
    (whose repetition penalty makes some not greedy) and plain greedy ones, whose is-greedy flag
    is true whenever their text tokenizes back to the generated tokens. So the flags go both ways
    whatever model the fixture's training made: 400 AdamW steps end in different models with
    one and two torch threads, and the penalized continuations alone were all not greedy under
    one of them."""
    out = {kind: getattr(lm, kind)([Instance(kind, {}, args, i)
                                    for i, args in enumerate(REQUESTS[kind])])
           for kind in REQUESTS}
    plain = lm.generate_until([Instance("generate_until", {}, (prompt, {
        "until": ["\n"], "max_gen_toks": 6, "do_sample": False}), i)
        for i, prompt in enumerate(PROMPTS)])
    pairs = [(prompt, text) for (prompt, _), text in zip(REQUESTS["generate_until"],
                                                          out["generate_until"]) if text]
    pairs += [(prompt, text) for prompt, text in zip(PROMPTS, plain) if text]
    out["greedy_scored"] = lm.loglikelihood([Instance("loglikelihood", {}, p, i)
                                             for i, p in enumerate(pairs)])
    return out


def _live_parts_rank(rank, world, checkpoint, tokenizer_dir, parallel):
    """Parts cut by `parallelize` from the model, as a training run holds them (with
    sequence parallelism, or two model chunks per pipeline rank), evaluated in place."""
    from bloomtrain import load_model
    from bloomtrain.data.tokenizer import load_tokenizer
    from bloomtrain.eval.lm import BloomtrainLM
    from bloomtrain.eval.model import EvalModel
    from bloomtrain.parallel.parallelize import parallelize
    from tests.helpers import config, topology

    full = load_model(checkpoint)
    cfg = config(full.shape, parallel=parallel, precision="fp32", attention="sdpa")
    parts = parallelize(full, topology(cfg), cfg, attention="sdpa", device="cpu",
                        engine=False)
    model = EvalModel.from_parts(parts, torch.float32, "cpu")
    if rank != 0:
        protocol.worker_loop(model)
        return None
    executor = protocol.Executor(model)
    try:
        return run_requests(BloomtrainLM(executor, load_tokenizer(tokenizer_dir),
                                         max_length=MAX_LENGTH, batch_size=3, progress=False))
    finally:
        executor.close()


@pytest.mark.parametrize("parallel", [
    {"tp": 2, "sequence_parallel": True},
    {"pp": 2, "pp_schedule": "interleaved", "num_virtual_stages": 2,
     "pp_partition": "uniform"}],
    ids=["tp2-sequence-parallel", "pp2-interleaved"])
def test_training_layouts_give_the_same_answers(parallel, model_dirs, tiny_tokenizer_dir):
    """Sequence parallelism (hidden states in sequence shards: the LM head over every
    position, generation without a KV cache, the sequence padded to a multiple of tp) and
    interleaved pipelines (two chunks per rank, activations round the ring twice) answer
    loglikelihood, rolling and generate_until requests as one process does (continuations
    within 1e-5, rolling documents within 2e-5 per window)."""
    from bloomtrain.data.tokenizer import load_tokenizer

    got = run_ranks(2, _live_parts_rank, str(model_dirs[0]), str(tiny_tokenizer_dir),
                    parallel)[0]
    want = run_requests(local_lm(model_dirs[0], batch_size=3))
    assert sum(flag for _, flag in want["greedy_scored"]) >= 2  # greedy flags both ways
    for kind in ("loglikelihood", "greedy_scored"):
        for (g, g_greedy), (w, w_greedy) in zip(got[kind], want[kind], strict=True):
            assert abs(g - w) < 1e-5 and g_greedy == w_greedy
    tok = load_tokenizer(tiny_tokenizer_dir)
    for (text,), g, w in zip(REQUESTS["loglikelihood_rolling"], got["loglikelihood_rolling"],
                             want["loglikelihood_rolling"]):
        # Sequence parallelism also reorders the LayerNorms' and the reduce-scatters' sums:
        # 1.0e-5 per window measured on a 2-window document.
        assert abs(g - w) < 2e-5 * num_windows(tok, text), (g, w)
    assert got["generate_until"] == want["generate_until"]


def test_requests_on_the_device(device, model_dirs):
    """The model on `--device` (CUDA in bench/gpu.sh's `-m device` run): every tensor a step
    makes follows it (the KV cache's kept rows, the queries' indices), and the answers equal the
    CPU's (1e-4: another device's fp32 kernels)."""
    from bloomtrain.data.tokenizer import load_tokenizer
    from bloomtrain.eval.lm import BloomtrainLM
    from bloomtrain.eval.model import load_eval_model
    from bloomtrain.topology import Topology

    model = load_eval_model(model_dirs[0], Topology.single(), device)
    lm = BloomtrainLM(protocol.Executor(model), load_tokenizer(_tokenizer_dir(model_dirs[0])),
                      max_length=MAX_LENGTH, batch_size=3, progress=False)
    got, want = run_requests(lm), run_requests(local_lm(model_dirs[0], batch_size=3))
    for kind in ("loglikelihood", "greedy_scored"):
        for (g, g_greedy), (w, w_greedy) in zip(got[kind], want[kind], strict=True):
            assert abs(g - w) < 1e-4 and g_greedy == w_greedy
    for g, w in zip(got["loglikelihood_rolling"], want["loglikelihood_rolling"]):
        assert abs(g - w) < 1e-3  # documents of ~-600: 1e-4 per window, for fp32 on CUDA
    assert got["generate_until"] == want["generate_until"]


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,world", [(1, 1, 2), (2, 2, 4)], ids=["dp2", "tp2pp2"])
def test_data_parallel_and_3d_layouts(tp, pp, world, model_dirs, one_process, task_windows,
                                      tmp_path):
    """dp=2: each replica scores its half of every batch; tp2 x pp2 from the HF export (its
    safetensors read by slices)."""
    out = tmp_path / "results.json"
    source = model_dirs[1] if world == 4 else model_dirs[0]
    run_ranks(world, _layout_rank, layout_opts(source, out, tp, pp, world), str(ROOT))
    results, want = one_process
    worst, unequal = max_differences(per_request(read_samples(out)), want, task_windows)
    assert worst < 1e-5 and unequal == 0, (worst, unequal)


@pytest.mark.slow
def test_command_with_nproc_against_the_harness_command(model_dirs, task_windows, tmp_path):
    """The commands as users type them: `bloomtrain eval --nproc 2 parallel.pp=2` and
    `lm_eval run --model hf` (separate processes, the harness's own CLI)."""
    import glob
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "bt" / "results.json"
    subprocess.run([sys.executable, "-m", "bloomtrain", *eval_args(model_dirs[0], out),
                    "--nproc", "2", "parallel.pp=2"], cwd=ROOT, env=env, check=True,
                   capture_output=True, timeout=600)
    ref = tmp_path / "hf"
    subprocess.run([sys.executable, "-m", "lm_eval", "run", "--model", "hf", "--model_args",
                    f"pretrained={model_dirs[1]},dtype=float32,max_length={MAX_LENGTH}",
                    "--tasks", *TASKS, "--include_path", TASKS_DIR, "--batch_size", "4",
                    "--device", "cpu", "--output_path", str(ref), "--log_samples"],
                   cwd=ROOT, env=env, check=True, capture_output=True, timeout=900)
    want = {}
    for task in TASKS:  # the harness writes every value of a sample as a string
        path, = glob.glob(f"{ref}/*/samples_{task}_*.jsonl")
        for line in open(path):
            doc = json.loads(line)
            for i, resp in enumerate(doc["resps"]):
                v = resp[0]
                want[(task, doc["doc_id"], i)] = (
                    v if task == "greedy_tiny" else float(v) if not isinstance(v, list)
                    else (float(v[0]), v[1] == "True"))
    assert_agrees_with_hf(per_request(read_samples(out)), want, task_windows)
    results, = glob.glob(f"{ref}/*/results_*.json")
    assert_same_metrics(json.loads(out.read_text())["results"],
                        json.loads(Path(results).read_text())["results"])


# ---- generate_until ------------------------------------------------------------------------------

def local_lm(checkpoint, batch_size: int = 4):
    """A BloomtrainLM on one process (the executor's broadcasts are no-ops)."""
    from bloomtrain.data.tokenizer import load_tokenizer
    from bloomtrain.eval.lm import BloomtrainLM
    from bloomtrain.eval.model import load_eval_model
    from bloomtrain.topology import Topology

    model = load_eval_model(checkpoint, Topology.single(), "cpu")
    return BloomtrainLM(protocol.Executor(model), load_tokenizer(_tokenizer_dir(checkpoint)),
                        max_length=MAX_LENGTH, batch_size=batch_size, progress=False)


def _tokenizer_dir(checkpoint):
    from bloomtrain.checkpoint.tokenizer import checkpoint_tokenizer
    return checkpoint_tokenizer(checkpoint, None)


def instances(kwargs: dict, prompts=PROMPTS) -> list[Instance]:
    return [Instance("generate_until", {}, (p, dict(kwargs)), i) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("kwargs", [
    {"until": ["\n", "."], "max_gen_toks": 12, "do_sample": False, "repetition_penalty": 2.0},
    {"until": ["ер", "x"], "max_gen_toks": 10, "do_sample": False, "repetition_penalty": 1.5},
    {"max_gen_toks": 8, "do_sample": False}], ids=["stops", "more-stops", "no-stop"])
def test_generate_until_equals_hf_generate(kwargs, model_dirs):
    """Greedy continuations with the harness's stop sequences equal its HF backend's, which
    runs HF `generate` with the harness's stopping criteria (prompts batched there with left
    padding, here by equal length); the first two also stop before the token limit."""
    ours = local_lm(model_dirs[0]).generate_until(instances(kwargs))
    want = hf_backend(model_dirs[1], batch_size=3).generate_until(instances(kwargs))
    assert ours == want
    assert len(set(ours)) >= 4  # continuations that depend on the prompt


PAD = 3  # the tokenizer's <pad>, HF generate's padding after a row's end


def test_greedy_generation_equals_hf_generate_step_by_step(model_dirs, tiny_tokenizer_dir):
    """Prompts of one length generated in one batch over the KV cache, each leaving the batch
    when it ends (end of text): every step's logits equal HF's forward over the whole sequence
    so far (1e-4, fp32), and the texts equal `BloomForCausalLM.generate`'s."""
    from bloomtrain.data.tokenizer import load_tokenizer
    from bloomtrain.eval.generation import GenerationSettings

    tok = load_tokenizer(tiny_tokenizer_dir)
    candidates = ["The quick brown fox", "The quick brown dog", "The lazy brown fox",
                  "A quick brown fox", "The cat sat by", "Bees make honey"]
    length = len(tok.encode(candidates[0]))
    prompts = [tok.encode(c) for c in candidates if len(tok.encode(c)) == length]
    assert len(prompts) >= 3
    ref = transformers.BloomForCausalLM.from_pretrained(model_dirs[1]).eval()

    def hf_generate(eos: int) -> list[list[int]]:
        with torch.no_grad():
            return ref.generate(torch.tensor(prompts), attention_mask=torch.ones(
                len(prompts), length, dtype=torch.long), max_new_tokens=16, do_sample=False,
                eos_token_id=eos, pad_token_id=PAD)[:, length:].tolist()

    # The end of text: the tokenizer's own when it ends rows at different steps, else a token
    # that does (first generated at different steps, or in some rows only, by HF's generate
    # with no end): whether the fixture's model emits its end of text within 16 tokens depends
    # on how its training rounded (one torch thread or two gave different models).
    free = hf_generate(PAD)  # the padding token is never generated: 16 tokens each

    def ends(t: int) -> set[int]:
        return {row.index(t) if t in row else len(row) for row in free}

    eos = next(t for t in [tok.eod_id] + [t for row in free for t in row]
               if t != PAD and len(ends(t)) > 1)
    lm = local_lm(model_dirs[0])
    lm.generator.eos_id = eos
    settings = GenerationSettings.from_gen_kwargs({"max_gen_toks": 16, "do_sample": False},
                                                  256, None)
    lm.generator.executor = recording = _Recording(lm.executor)
    texts = lm.generator.generate(prompts, settings)
    with torch.no_grad():
        for seqs, logits in recording.steps:
            want = torch.stack([ref(torch.tensor([seq])).logits[0, -1] for seq in seqs])
            assert (logits - want).abs().max() < 1e-4
    assert texts == [tok.decode([t for t in row if t not in (eos, PAD)])
                     for row in hf_generate(eos)]
    # Some rows left the batch before others: the cache kept the right ones.
    assert len({len(seqs) for seqs, _ in recording.steps}) > 1


class _Recording:
    """An Executor that records every step's sequences (in the batch's row order) and logits."""

    def __init__(self, executor):
        self.executor, self.steps = executor, []

    def prefill(self, rows, max_len):
        self.rows, self.active = [list(r) for r in rows], list(range(len(rows)))
        logits = self.executor.prefill(rows, max_len)
        self.steps.append(([list(r) for r in self.rows], logits))
        return logits

    def decode(self, tokens, keep):
        self.active = [self.active[j] for j in keep]
        for i, t in zip(self.active, tokens):
            self.rows[i].append(t)
        logits = self.executor.decode(tokens, keep)
        self.steps.append(([list(self.rows[i]) for i in self.active], logits))
        return logits


def test_sampled_generation_follows_the_harness_seed(model_dirs):
    """Sampling draws from torch's global generator, which the harness seeds: the same seed
    gives the same texts, another seed others; top_k=1 is greedy."""
    lm = local_lm(model_dirs[0])
    sampled = {"until": ["\n"], "max_gen_toks": 10, "do_sample": True, "temperature": 1.0}

    def run(seed, kwargs):
        torch.manual_seed(seed)
        return lm.generate_until(instances(kwargs))

    first = run(1234, sampled)
    assert first == run(1234, sampled)
    assert first != run(4321, sampled)
    greedy = run(0, {"until": ["\n"], "max_gen_toks": 10, "do_sample": False})
    assert run(7, {**sampled, "top_k": 1}) == greedy != first


def test_unsupported_generation_kwargs_are_refused(model_dirs):
    with pytest.raises(ValueError, match="num_beams"):
        local_lm(model_dirs[0]).generate_until(instances({"num_beams": 4, "max_gen_toks": 4}))


def test_sampling_takes_transformers_defaults_and_needs_a_temperature(model_dirs):
    """The harness's HF backend calls transformers' generate without top_k, which then keeps the
    50 most likely tokens (GenerationConfig's default); bloomtrain drew from the whole
    vocabulary (103 of 300 draws outside the top 50 at temperature 3). do_sample without a
    temperature is refused, as the backend's temperature 0.0 is by transformers."""
    from transformers import GenerationConfig

    from bloomtrain.eval.generation import GenerationSettings

    # transformers 5 applies its defaults at generate time (unset in the config); 4.x sets
    # them on the config.
    defaults = getattr(GenerationConfig, "_get_default_generation_params", None)
    hf = defaults() if defaults else vars(GenerationConfig())
    hot = {"do_sample": True, "temperature": 3.0, "max_gen_toks": 8, "until": ["\n"]}
    s = GenerationSettings.from_gen_kwargs(hot, 16, None).sampling
    assert (s.top_k, s.top_p) == (hf["top_k"], hf["top_p"]) == (50, 1.0)
    assert GenerationSettings.from_gen_kwargs({**hot, "top_k": 0}, 16, None).sampling.top_k == 0
    with pytest.raises(ValueError, match="do_sample needs a temperature"):
        GenerationSettings.from_gen_kwargs({"do_sample": True}, 16, None)
    lm = local_lm(model_dirs[0])

    def run(kwargs):
        torch.manual_seed(99)
        return lm.generate_until(instances(kwargs))
    assert run(hot) == run({**hot, "top_k": 50}) != run({**hot, "top_k": 0})


def test_a_continuation_of_no_tokens_is_refused(model_dirs):
    """An empty target (or one the context's last token absorbs) was scored 0.0 and greedy: a
    multiple-choice option certain to win. The harness's HF backend asserts a continuation."""
    lm = local_lm(model_dirs[0])
    with pytest.raises(ValueError, match="continuation encodes to no tokens"):
        lm.loglikelihood([Instance("loglikelihood", {}, ("The quick brown", ""), 0)])


# ---- batching ----------------------------------------------------------------------------------

class _Spy:
    """Records each scoring command's rows."""

    def __init__(self, executor):
        self.executor, self.calls = executor, []

    def score(self, rows, queries):
        self.calls.append([len(r) for r in rows])
        return self.executor.score(rows, queries)


def test_batches_by_length_and_shares_prefix_logits(model_dirs, tiny_tokenizer_dir):
    """Requests go longest first in batches of at most batch_size rows; requests whose context
    and all but the last continuation token are the same share one row (the harness's
    prefix-logits cache): the one-token choices of a question, and a continuation that is
    another request's shorter by its context's last word. Every answer equals the request
    scored alone (batch of one, no other request) and the HF backend's."""
    from bloomtrain.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_tokenizer_dir)
    contexts = ["The quick brown fox jumps over the", "Привет, мир", "def f(x):\n\treturn",
                "数据并行、张量并行和流水线", "Emoji"]
    one_token = [c for c in (" the", ".", "!", ",", " x", "?", "\n", " мир")
                 if len(tok.encode("Emoji" + c)) == len(tok.encode("Emoji")) + 1][:3]
    assert len(one_token) == 3
    requests = [(ctx, c) for ctx in contexts for c in one_token]
    # Same row: "...brown" + " fox" + "!" and "...brown fox" + "?" (continuations of 2 and 1
    # tokens, each scored over its own last positions).
    assert tok.encode("The quick brown fox!") == tok.encode("The quick brown fox") + \
        tok.encode("!") and len(tok.encode("?")) == 1
    requests += [("The quick brown", " fox!"), ("The quick brown fox", "?"),
                 ("The quick brown", " fox jumps over"), ("def", " f(x):\n\treturn x * 2")]
    lm = local_lm(model_dirs[0], batch_size=2)
    spy = lm.executor = _Spy(lm.executor)
    got = lm.loglikelihood([Instance("loglikelihood", {}, r, i) for i, r in
                            enumerate(requests)])
    assert sum(len(c) for c in spy.calls) == len(contexts) + 3  # one row per shared prefix
    assert all(len(c) <= 2 for c in spy.calls)
    lengths = [n for c in spy.calls for n in c]
    assert lengths == sorted(lengths, reverse=True)
    alone = local_lm(model_dirs[0], batch_size=1)
    for i, r in enumerate(requests):
        want = alone.loglikelihood([Instance("loglikelihood", {}, r, 0)])[0]
        assert abs(got[i][0] - want[0]) < 1e-5 and got[i][1] == want[1], (r, got[i], want)
    # The HF backend one request at a time: with others, lm-eval 0.4.13's own prefix cache
    # scores the shorter member of such a group at the first positions of the longer one's
    # logits (torch.gather over a shorter index), -2.944 for "?" where alone it is -2.855.
    hf = hf_backend(model_dirs[1], batch_size=1)
    for r, mine in zip(requests, got):
        want = hf.loglikelihood([Instance("loglikelihood", {}, r, 0)])[0]
        assert abs(mine[0] - want[0]) < 1e-4 and mine[1] == want[1], (r, mine, want)


# ---- the command ---------------------------------------------------------------------------------

def run_cli(args: list[str], capsys) -> tuple[int, str]:
    rc = cli.main(args)
    return rc, capsys.readouterr().err


def test_a_continuation_longer_than_the_window_is_refused(model_dirs):
    """Its first tokens have no position in the max_length window: they were scored at
    negative positions, read from other requests' rows (a different score batched with each,
    and alone), without a word. The harness's HF backend refuses it (an assertion)."""
    lm = local_lm(model_dirs[0])
    long = list(range(5, 5 + MAX_LENGTH + 2))
    with pytest.raises(ValueError, match=f"continuation of {MAX_LENGTH + 2} tokens is longer "
                                         f"than max_length {MAX_LENGTH}"):
        lm._loglikelihood_tokens([(None, [1, 2, 3], long), (None, [1], [4, 5, 6])])
    # One that just fits (max_length tokens, the window's every position) is scored.
    (score, _), = lm._loglikelihood_tokens([(None, [1, 2, 3], long[:MAX_LENGTH])])
    assert math.isfinite(score)


def test_command_errors_say_what_to_change(model_dirs, tmp_path, capsys, monkeypatch):
    ckpt = str(model_dirs[0])
    rc, err = run_cli(["eval", "--checkpoint", ckpt, "--tasks", "choice_tny",
                       "--include-path", TASKS_DIR], capsys)
    assert rc == 2 and "unknown task choice_tny" in err and "choice_tiny" in err
    rc, err = run_cli(["eval", "--checkpoint", ckpt, "--tasks", "choice_tiny", "--log-samples"],
                      capsys)
    assert rc == 2 and "--output" in err
    rc, err = run_cli(["eval", "--checkpoint", ckpt, "--tasks", "choice_tiny",
                       "parallel.dp=2"], capsys)
    assert rc == 2 and "parallel.tp=N and parallel.pp=N" in err
    rc, err = run_cli(["eval", "--checkpoint", ckpt, "--tasks", "choice_tiny", "--nproc", "3",
                       "parallel.tp=2"], capsys)
    assert rc == 2 and "multiple of 2" in err
    rc, err = run_cli(["eval", "--checkpoint", ckpt, "--tasks", "choice_tiny",
                       "--include-path", str(tmp_path / "none")], capsys)
    assert rc == 2 and "not a directory" in err
    rc, err = run_cli(["eval", "--checkpoint", str(tmp_path / "missing"), "--tasks", "x"],
                      capsys)
    assert rc == 2 and "does not exist" in err
    # Refused before the model loads: a directory failed after the whole evaluation.
    rc, err = run_cli(["eval", "--checkpoint", ckpt, "--tasks", "choice_tiny", "--output",
                       str(tmp_path)], capsys)
    assert rc == 2 and "is a directory; give the results file" in err
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "lm_eval" else real(name, *a))
    rc, err = run_cli(["eval", "--checkpoint", ckpt, "--tasks", "choice_tiny"], capsys)
    assert rc == 2 and "pip install 'bloomtrain[eval]'" in err


def test_a_task_the_model_cannot_run_is_one_line(model_dirs, tmp_path, capsys):
    # Each ended in a traceback (a ValueError the harness raised through, exit 1).
    ckpt = str(model_dirs[0])
    docs = ["--include-path", str(ROOT / "docs" / "eval_tasks")]
    rc, err = run_cli(["eval", "--checkpoint", ckpt, *docs, "--tasks", "greedy_example",
                       "--max-length", "2", "--limit", "1"], capsys)
    assert rc == 2 and "Traceback" not in err and "error: max_gen_toks" in err
    rc, err = run_cli(["eval", "--checkpoint", ckpt, *docs, "--tasks", "choice_example",
                       "--max-length", "2", "--limit", "1"], capsys)
    assert rc == 2 and "Traceback" not in err and "longer than max_length 2" in err
    rc, err = run_cli(["eval", "--checkpoint", ckpt, *docs, "--tasks", "choice_example",
                       "--limit", "inf"], capsys)
    assert rc == 2 and "--limit must be a positive finite number" in err


DOCS_TASKS = ROOT / "docs" / "eval_tasks"
DOCS_TASK_NAMES = ["lastword_example", "choice_example", "rolling_example", "greedy_example"]


def test_the_docs_tasks_run_from_any_directory(model_dirs, tmp_path, capsys, monkeypatch):
    # Their data files are found beside their YAMLs, not in the directory the command runs in.
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "results.json"
    rc = cli.main(["eval", "--checkpoint", str(model_dirs[0]), "--include-path", str(DOCS_TASKS),
                   "--tasks", ",".join(DOCS_TASK_NAMES), "--limit", "2", "--bootstrap-iters", "0",
                   "--max-length", str(MAX_LENGTH), "--output", str(out)])
    assert rc == 0
    results = json.loads(out.read_text())["results"]
    assert sorted(results) == sorted(DOCS_TASK_NAMES)
    # A task directory copied elsewhere with its data, named by a relative --include-path.
    (tmp_path / "mine").mkdir()
    for suffix in (".yaml", ".jsonl"):
        (tmp_path / "mine" / f"choice_example{suffix}").write_bytes(
            (DOCS_TASKS / f"choice_example{suffix}").read_bytes())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    rc = cli.main(["eval", "--checkpoint", str(model_dirs[0]), "--include-path", "../mine",
                   "--tasks", "choice_example", "--limit", "2", "--bootstrap-iters", "0"])
    assert rc == 0 and "choice_example" in capsys.readouterr().out


def _no_model_load(*a, **k):
    raise AssertionError("the model loaded before the task files were checked")


def test_task_data_errors_are_one_line(model_dirs, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpt = str(model_dirs[0])
    # The include path of the README, from a directory that does not have it.
    rc, err = run_cli(["eval", "--checkpoint", ckpt, "--include-path", "docs/eval_tasks",
                       "--tasks", "choice_example"], capsys)
    assert rc == 2 and err.count("\n") == 1
    assert f"include path docs/eval_tasks is not a directory of task YAMLs (relative to " \
           f"{tmp_path})" in err
    # A data file in neither the task file's directory nor the current one.
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "choice_example.yaml").write_text(
        (DOCS_TASKS / "choice_example.yaml").read_text().replace("test: choice_example.jsonl",
                                                                 "test: nowhere.jsonl"))
    rc, err = run_cli(["eval", "--checkpoint", ckpt, "--include-path", str(tasks),
                       "--tasks", "choice_example"], capsys)
    assert rc == 2 and err.count("\n") == 1
    assert (f"task choice_example: data file nowhere.jsonl not found: data_files are relative "
            f"to the task file's directory {tasks}") in err
    # A task file given by path that does not parse, an output_type the harness has not, an
    # empty data file: tracebacks (rc 1) after the model had loaded.
    import yaml
    choice = yaml.safe_load((DOCS_TASKS / "choice_example.yaml").read_text())
    bad = tmp_path / "bad.yaml"
    bad.write_text("task: bad\noutput_type: {loglikelihood\n")
    typo = tmp_path / "typo.yaml"
    typo.write_text(yaml.safe_dump({**choice, "task": "typo", "output_type": "loglikelihod"}))
    (tmp_path / "empty.jsonl").write_text("\n")
    empty = tmp_path / "empty.yaml"
    empty.write_text(yaml.safe_dump({**choice, "task": "empty",
                                     "dataset_kwargs": {"data_files": {"test": "empty.jsonl"}}}))
    for task, said in ((bad, f"task file {bad} cannot be read: "),
                       (typo, f"task file {typo}: output_type 'loglikelihod' is not one of "
                              f"loglikelihood, loglikelihood_rolling, generate_until, "
                              f"multiple_choice"),
                       (empty, f"task empty: data file {tmp_path / 'empty.jsonl'} is empty")):
        with monkeypatch.context() as m:
            m.setattr("bloomtrain.eval.model.load_eval_model", _no_model_load)
            rc, err = run_cli(["eval", "--checkpoint", ckpt, "--tasks", str(task)], capsys)
        assert rc == 2 and err.count("\n") == 1 and said in err, err
    # A dataset the harness cannot fetch (offline): its error, on one line.
    (tasks / "choice_example.yaml").unlink()
    (tasks / "hub_task.yaml").write_text(
        "task: hub_task\ndataset_path: no_such_org/no_such_dataset\noutput_type: loglikelihood\n"
        "test_split: test\ndoc_to_text: '{{text}}'\ndoc_to_target: ' x'\n"
        "metric_list:\n  - metric: acc\n")
    rc, err = run_cli(["eval", "--checkpoint", ckpt, "--include-path", str(tasks),
                       "--tasks", "hub_task"], capsys)
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("bloomtrain eval: error: the harness could "
                                                   "not load a task's data: "), err
