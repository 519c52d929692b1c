"""The README runs as written. Every shell block of README.md and of each docs/ page (```bash,
```console, or lines starting with `$ `) is extracted; its commands run with bash in a fresh
temporary directory that holds a tiny corpus and the files the block reads (the README's own
my.yaml, BLOOM's launch script and DeepSpeed checkpoints from tests/fixtures/, a tokenizer and
dataset, a finished tiny run). A block fails when a command fails or a file a command names as
its output does not appear: the value of `--output`, `--output-prefix` or `--run-dir`, or a
path after `->` in the command's comment.

- OVERRIDES: the small overrides (`train.train_iters=20`, a tiny model) appended to the commands
  that train, which the CLI takes after any option. A block with one is in the slow tier.
- NOT_RUN: each command CI cannot run, with the reason (SLURM, a second node, a download, a
  server that runs until stopped). Its bloomtrain part is still parsed by the CLI, so a renamed
  option breaks the test there too.
- Every unquoted `[` or `]` fails the block: zsh, macOS's shell, answers `no matches found`.

Each block's commands are printed as it runs: `-s` is not needed to see them.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

# A tiny training in place of each block's real one: the CLI takes these after any option.
TINY = ("model.preset=tiny data.seq_length=32 train.train_samples=null train.train_iters=20 "
        "train.rampup_batch_size=null train.global_batch_size=8 train.micro_batch_size=2 "
        "optim.warmup_samples=16 train.precision=fp32 train.activation_checkpointing=none "
        "train.log_interval=5")
# command prefix -> what the test appends to it.
OVERRIDES = {
    "bloomtrain demo": "train.train_iters=20 train.log_interval=5",
    "bloomtrain train --config my.yaml --nproc 4 'data.paths": TINY,
    # The CPU-sized example: 20 of its 300 steps (the README gives the whole run's time).
    "bloomtrain train --config cpu.yaml --nproc 2": "train.train_iters=20",
    "bloomtrain train --config my.yaml --nproc 4 train.eval_harness_tasks":
        TINY + " train.eval_harness_limit=5",
    # BLOOM's run from its step 3 to its step 8, on 4 processes where the README says 8.
    "bloomtrain train --config ckpt/bloomtrain.yaml": "--nproc 4 train.train_samples=64",
    # The DeepSpeed run from its step 3 to its step 5, on sequences of 16 tokens.
    "bloomtrain train --config ds_ckpt/bloomtrain.yaml": "train.train_iters=5 data.seq_length=16",
    "bloomtrain eval --checkpoint bloomtrain_demo/checkpoints --include-path": "--limit 5",
}

# command prefix -> why CI does not run it.
NOT_RUN = {
    "pip install": "installs packages: .ci/run runs this very line in a fresh virtualenv",
    "python -m pytest": "the test suite, which runs this test",
    "torchrun --nnodes 2": "two nodes (tests/system/test_multinode.py runs bloomtrain's own two-node "
                           "launch on one machine)",
    "HEAD=$(scontrol": "SLURM", "srun ": "SLURM", "export MASTER_ADDR=$(scontrol": "SLURM",
    "bloomtrain train --config my.yaml --nnodes 2": "two nodes (tests/system/test_multinode.py runs "
                                                    "these commands as two nodes on one machine)",
    "tensorboard --logdir": "a server that runs until stopped",
    "bloomtrain eval --checkpoint bloomtrain_demo/checkpoints --tasks": "downloads the task's "
                                                                        "dataset (no network)",
    "bloomtrain eval --checkpoint bloomtrain_demo/hf --tasks piqa": "downloads the task's dataset "
                                                                    "(no network)",
    "bloomtrain serve": "a server that runs until stopped (tests/serve/test_serve.py runs it, with "
                        "--nproc 2 parallel.tp=2, int8 and the chat template)",
    "curl ": "requests to that server (tests/serve/test_serve.py, tests/serve/test_serve_clients.py)",
    "lm_eval --model local-completions --include_path": "a client of that server "
                                                        "(tests/eval/test_eval.py runs the served "
                                                        "route)",
    "lm_eval --model local-completions --tasks lambada_openai": "a client of that server, and "
                                                                "a download",
}

# first command of a block -> the fixtures it reads beyond the corpus, my.yaml and docs/.
SETUP = {
    "bloomtrain import-config --megatron-args tr11-176B-ml.slurm": ["megatron"],
    "bloomtrain import-deepspeed --input ds_run/": ["deepspeed_hf"],
    "bloomtrain status runs/mine": ["runs"],
    "bloomtrain eval --checkpoint bloomtrain_demo": ["demo"],
    "bloomtrain train --config my.yaml --nproc 4 train.eval_harness_tasks": ["mine"],
    "bloomtrain serve --checkpoint bloomtrain_demo": ["demo"],
}


@dataclass
class Command:
    text: str  # the logical line, continuations joined, comment removed
    line: int
    comment: str = ""

    def startswith(self, prefix: str) -> bool:
        return self.text.startswith(prefix)


@dataclass
class Block:
    page: str
    line: int
    commands: list[Command] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


# ---- reading the pages ---------------------------------------------------------------------------

def split_comment(line: str) -> tuple[str, str]:
    """(code, comment) of a shell line: `#` starts a comment at the start of a word outside
    quotes."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1:].strip()
    return line.rstrip(), ""


def unquoted(text: str) -> str:
    """`text` with quoted parts blanked."""
    out, quote = [], None
    for ch in text:
        if quote:
            out.append(" ")
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
            out.append(" ")
        else:
            out.append(ch)
    return "".join(out)


def parse_commands(lines: list[str], first_line: int, console: bool) -> list[Command]:
    commands, current, start, comments = [], "", 0, []
    for offset, raw in enumerate(lines):
        if not current:
            if console:
                if not raw.startswith("$ "):
                    continue  # output
                raw = raw[2:]
            if not raw.strip() or raw.lstrip().startswith("#"):
                continue
            start = first_line + offset
        code, comment = split_comment(raw)
        comments.append(comment)
        if code.endswith("\\"):
            current += code[:-1].strip() + " "
            continue
        commands.append(Command((current + code.strip()).strip(), start,
                                " ".join(c for c in comments if c)))
        current, comments = "", []
    return commands


def read_blocks(page: Path) -> tuple[list[Block], dict[str, str]]:
    """The shell blocks of a page, and its yaml blocks named by the file the text before them
    names (`A minimal `my.yaml`:`)."""
    lines = page.read_text().splitlines()
    blocks, yamls, i = [], {}, 0
    while i < len(lines):
        m = re.match(r"^```(\S*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        body, lang = lines[i + 1:end], m.group(1)
        console = lang == "console" or (lang == "" and bool(body) and body[0].startswith("$ "))
        if lang in ("bash", "sh", "shell") or console:
            block = Block(page.relative_to(ROOT).as_posix(), i + 1)
            block.commands = parse_commands(body, i + 2, console)
            blocks.append(block)
        elif lang == "yaml":
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            named = re.search(r"`([\w.-]+\.ya?ml)`", before)
            if named:
                yamls[named.group(1)] = "\n".join(body) + "\n"
        i = end + 1
    return blocks, yamls


BLOCKS, YAMLS = [], {}
for _page in PAGES:
    _blocks, _yamls = read_blocks(_page)
    BLOCKS += _blocks
    YAMLS.update(_yamls)


def entry(table: dict, command: Command):
    keys = [k for k in table if command.startswith(k)]
    assert len(keys) <= 1, f"{command.text!r} matches several entries: {keys}"
    return keys[0] if keys else None


def slow(block: Block) -> bool:
    """A block that trains, or reads a run the test trains first (tens of seconds to minutes
    on 2 cores)."""
    run = [c for c in block.commands if entry(NOT_RUN, c) is None]
    needs = SETUP.get(entry(SETUP, block.commands[0]), []) if run else []
    return any(entry(OVERRIDES, c) for c in run) or bool({"demo", "runs", "mine"} & set(needs))


def test_the_tables_name_commands_that_exist():
    commands = [c for b in BLOCKS for c in b.commands]
    for table in (OVERRIDES, NOT_RUN):
        for key in table:
            assert any(c.startswith(key) for c in commands), f"no README command starts with {key!r}"
    for key in SETUP:
        assert any(b.commands and b.commands[0].startswith(key) for b in BLOCKS), key
    for c in commands:
        assert not (entry(OVERRIDES, c) and entry(NOT_RUN, c)), c.text
    assert {"my.yaml", "cpu.yaml"} <= set(YAMLS)


# ---- what a command names --------------------------------------------------------------------

def bloomtrain_argv(text: str) -> list[str] | None:
    """The arguments of the bloomtrain command in `text` (directly, `python -m bloomtrain`,
    `torchrun ... -m bloomtrain`), else None."""
    words = shlex.split(text.rstrip("&").strip())
    for i, w in enumerate(words):
        if w == "bloomtrain" and (i == 0 or words[i - 1] == "-m"):
            return words[i + 1:]
    return None


def outputs(command: Command) -> list[str]:
    """The files a command says it writes."""
    argv = bloomtrain_argv(command.text) or []
    named = [argv[i + 1] for i, w in enumerate(argv[:-1])
             if w in ("--output", "--run-dir")]
    named += [argv[i + 1] + "*" for i, w in enumerate(argv[:-1]) if w == "--output-prefix"]
    if "->" in command.comment:
        for word in command.comment.split("->", 1)[1].replace(",", " ").split():
            m = re.fullmatch(r"(\S+)\.(\w+)/\.(\w+)", word)  # P.bin/.idx: both files
            named += [f"{m[1]}.{m[2]}", f"{m[1]}.{m[3]}"] if m else \
                [word] if "/" in word or "." in word else []
    return named


# ---- fixtures ------------------------------------------------------------------------------------

WORDS = ("the data flows one way from the config to the layout and the parts then the loop "
         "every rank keeps only its own shards of the model and a checkpoint resumes on any "
         "layout while the loss falls step by step").split()


def write_corpus(directory: Path) -> None:
    import random
    rng = random.Random(0)
    directory.mkdir(parents=True)
    for f in range(3):
        with open(directory / f"part{f}.jsonl", "w") as out:
            for _ in range(120):
                words = [rng.choice(WORDS) for _ in range(rng.randint(20, 80))]
                out.write(json.dumps({"text": " ".join(words)}) + "\n")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Files some blocks read, made once: a tokenizer and dataset (tok/, data/), and a
    finished tiny run with its checkpoints and HF export (bloomtrain_demo/, runs/)."""
    root = tmp_path_factory.mktemp("readme_made")
    cache = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = MAKERS[name](root, get)
        return cache[name]
    return get


def _make_mine(root: Path, get) -> Path:
    from bloomtrain.data.preprocess import preprocess
    from bloomtrain.data.tokenizer import train_tokenizer
    out = root / "mine"
    write_corpus(out / "corpus")
    train_tokenizer([out / "corpus"], 512, out / "tok", log=lambda _: None)
    preprocess([out / "corpus"], out / "tok", out / "data" / "mine", append_eod=True,
               progress=False, log=lambda _: None)
    shutil.rmtree(out / "corpus")
    return out


def _make_demo(root: Path, get) -> Path:
    """A run of 6 steps on the tiny model, as bloomtrain_demo/ and runs/{mine,other}/."""
    from bloomtrain.config import Config
    from bloomtrain.checkpoint.hf.convert import export_hf
    from bloomtrain.train import train
    mine = get("mine")
    out = root / "demo"
    cfg = Config.load(None, [
        *TINY.split(), "train.train_iters=6", "train.log_interval=2", "train.eval_interval=3",
        "train.eval_iters=1", f"data.paths=[{mine / 'data' / 'mine_text_document'}]",
        f"data.tokenizer={mine / 'tok'}", f"checkpoint.dir={out / 'bloomtrain_demo' / 'checkpoints'}",
        "checkpoint.save_interval=3", f"run_dir={out / 'runs' / 'mine'}"])
    train(cfg, log=lambda *a: None)
    export_hf(out / "bloomtrain_demo" / "checkpoints", out / "bloomtrain_demo" / "hf",
              log=lambda *a: None)
    shutil.copytree(out / "runs" / "mine", out / "runs" / "other")
    return out


def _make_megatron(root: Path, get) -> Path:
    """BLOOM's launch script and ds_config, the Megatron-DeepSpeed checkpoint DeepSpeed wrote
    (vocab 100), and a dataset of ids below 100 to continue it on."""
    import numpy as np

    from bloomtrain.data.indexed import write_dataset
    out = root / "megatron"
    args = ROOT / "tests" / "fixtures" / "megatron_args"
    out.mkdir()
    shutil.copy(args / "tr11-176B-ml.slurm", out / "tr11-176B-ml.slurm")
    shutil.copy(args / "tr11-176B-ml.ds_config.json", out / "ds_config.json")
    shutil.copytree(ROOT / "tests" / "fixtures" / "deepspeed" / "megatron_pp2_tp2_dp2_bf16" /
                    "checkpoint", out / "checkpoints" / "tr11-176B-ml")
    rng = np.random.default_rng(0)
    write_dataset(out / "data" / "mine_text_document",
                  [[list(rng.integers(0, 100, size=int(rng.integers(20, 60))))]
                   for _ in range(200)], dtype=np.uint16)
    return out


def _make_deepspeed_hf(root: Path, get) -> Path:
    """An HF BloomForCausalLM checkpoint DeepSpeed wrote (ZeRO-2, vocab 120) as a plain script
    leaves it, its config.json kept elsewhere, and the dataset of ids below 100."""
    out = root / "deepspeed_hf"
    shutil.copytree(ROOT / "tests" / "fixtures" / "deepspeed" / "hf_zero2_fp32" / "checkpoint",
                    out / "ds_run")
    shutil.move(out / "ds_run" / "config.json", out / "bloom-config.json")
    shutil.copytree(get("megatron") / "data", out / "data")
    return out


MAKERS = {"mine": _make_mine, "demo": _make_demo, "megatron": _make_megatron,
          "deepspeed_hf": _make_deepspeed_hf}
# fixture name -> what a block's directory gets from it
LAYOUT = {"mine": ["tok", "data"], "demo": ["bloomtrain_demo"], "runs": ["runs"],
          "megatron": ["tr11-176B-ml.slurm", "ds_config.json", "checkpoints", "data"],
          "deepspeed_hf": ["ds_run", "bloom-config.json", "data"]}


def lay_out(block: Block, directory: Path, made) -> None:
    write_corpus(directory / "corpus")
    for name, text in YAMLS.items():  # my.yaml, cpu.yaml
        (directory / name).write_text(text)
    (directory / "docs").symlink_to(ROOT / "docs")
    first = block.commands[0] if block.commands else None
    for name in (SETUP[entry(SETUP, first)] if first and entry(SETUP, first) else []):
        source = made("demo" if name == "runs" else name)
        for item in LAYOUT[name]:
            if (source / item).is_dir():
                shutil.copytree(source / item, directory / item)
            else:
                shutil.copy(source / item, directory / item)


# ---- the test ------------------------------------------------------------------------------------

def show(capsys, text: str) -> None:
    with capsys.disabled():
        print(text, flush=True)


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id, marks=[pytest.mark.slow] * slow(b))
                                   for b in BLOCKS])
def test_block_runs_as_written(block, tmp_path, made, capsys):
    run_block(block, tmp_path, made, capsys)


def test_a_broken_block_fails(tmp_path, made, capsys):
    # The checks above can fail: a command that fails, an output that does not appear, an
    # unquoted bracket, an option the CLI does not know.
    def block(*texts):
        return Block("broken.md", 1, [Command(*split_comment(t)[:1], 1, split_comment(t)[1])
                                      for t in texts])

    run_block(block("touch out.txt  # -> out.txt"), tmp_path / "ok", made, capsys)
    for texts, says in [(["false"], "failed (exit 1)"),
                        (["echo hi  # -> out.txt"], "names out.txt as its output"),
                        (["bloomtrain plan --gpus 8 data.paths=[x]"], "unquoted [ or ]"),
                        (["bloomtrain plan --gpus 8 --bogus"], "does not parse")]:
        with pytest.raises((AssertionError, pytest.fail.Exception), match=re.escape(says)):
            run_block(block(*texts), tmp_path / texts[0].split()[0], made, capsys)


def run_block(block: Block, tmp_path: Path, made, capsys) -> None:
    from bloomtrain import cli
    tmp_path.mkdir(parents=True, exist_ok=True)
    lines, script = [f"\n{block.id}:"], ["set -euo pipefail"]
    for c in block.commands:
        bare = unquoted(c.text)
        assert "[" not in bare and "]" not in bare, (
            f"{block.id}: line {c.line} has an unquoted [ or ], which zsh (macOS's shell) "
            f"answers with `no matches found`; quote the word: {c.text}")
        argv = bloomtrain_argv(c.text)
        if argv is not None:  # every bloomtrain command parses, run or not
            try:
                cli.build_parser(argv).parse_args(argv)
            except SystemExit as e:
                pytest.fail(f"{block.id}: line {c.line}: `bloomtrain {shlex.join(argv)}` does "
                            f"not parse (exit {e.code}): {capsys.readouterr().err}")
        reason = NOT_RUN.get(entry(NOT_RUN, c))
        if reason is not None:
            lines.append(f"  [not run: {reason}] {c.text}")
            continue
        extra = OVERRIDES.get(entry(OVERRIDES, c))
        text = c.text + (f" {extra}" if extra else "")
        lines.append(f"  $ {text}")
        script += [f"echo {shlex.quote('$ ' + text)}", text]
    show(capsys, "\n".join(lines))
    if len(script) == 1:
        return
    lay_out(block, tmp_path, made)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MPLBACKEND="Agg",
               HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    proc = subprocess.Popen(["bash", "-c", "\n".join(script)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=1500 if slow(block) else 300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{block.id} timed out:\n{out[-6000:]}")
    assert proc.returncode == 0, f"{block.id} failed (exit {proc.returncode}):\n{out[-6000:]}"
    for c in block.commands:
        if entry(NOT_RUN, c) is None:
            for name in outputs(c):
                assert list(tmp_path.glob(name)), (
                    f"{block.id}: line {c.line} names {name} as its output, which did not "
                    f"appear:\n{out[-3000:]}")
