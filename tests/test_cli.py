"""`bloomtrain`'s command line (bloomtrain/cli.py): `section.key=value` overrides before, between
and after a subcommand's options; a parse error shown with the subcommand's own usage; and the
cost of parsing: `--help`, parsing and a config's errors import neither torch._dynamo nor
torch.distributed (`import torch` brings the latter, so no torch at all)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from bloomtrain import cli

# Each subcommand that takes overrides, with options it accepts (required ones included).
OPTIONS = {
    "train": ["--config", "my.yaml", "--nproc", "3"],
    "plan": ["--gpus", "8", "--gpu", "a100-40g"],
    "eval": ["--checkpoint", "ckpt", "--tasks", "piqa"],
    "serve": ["--checkpoint", "ckpt", "--port", "8001"],
    "demo": ["--run-dir", "out"],
}


def _parse(argv):
    return cli.build_parser(argv).parse_args(argv)


def test_every_command_with_overrides_is_covered():
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    takes = {name for name, p in sub.choices.items()
             if any(a.dest == "overrides" for a in p._actions)}
    assert takes == set(OPTIONS)


@pytest.mark.parametrize("command", sorted(OPTIONS))
def test_overrides_before_between_and_after_options(command):
    a, b = OPTIONS[command][:2], OPTIONS[command][2:]
    for argv in ([command, "parallel.tp=2", *a, *b, "train.seed=3"],
                 [command, *a, "parallel.tp=2", *b, "train.seed=3"],
                 [command, *a, *b, "parallel.tp=2", "train.seed=3"],
                 [command, "parallel.tp=2", "train.seed=3", *a, *b]):
        args = _parse(argv)
        assert args.overrides == ["parallel.tp=2", "train.seed=3"], argv
        assert args.command == command


def test_the_issues_command_line_parses():
    args = _parse(["train", "--config", "my.yaml", "data.paths=[data/mine_text_document]",
                   "--nproc", "3", "parallel.tp=2"])
    assert args.nproc == 3 and args.config == "my.yaml"
    assert args.overrides == ["data.paths=[data/mine_text_document]", "parallel.tp=2"]


def _error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        _parse(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_an_unknown_option_is_the_subcommands_error_with_its_usage(capsys):
    err = _error(["train", "--config", "my.yaml", "parallel.tp=2", "--bogus"], capsys)
    assert err.startswith("usage: bloomtrain train [-h] [--config CONFIG]")
    assert err.endswith("bloomtrain train: error: unrecognized arguments: --bogus\n")
    err = _error(["tokenizer", "train", "--input", "a.jsonl", "--vocab-size", "300", "--output",
                  "tok", "--bogus-key", "text"], capsys)
    assert err.startswith("usage: bloomtrain tokenizer train [-h] --input FILE [FILE ...]")
    assert err.endswith("bloomtrain tokenizer train: error: unrecognized arguments: "
                        "--bogus-key text\n")
    err = _error(["tokenizer", "--bogus", "train", "--input", "a.jsonl", "--vocab-size", "300",
                  "--output", "tok"], capsys)  # before the action
    assert err.startswith("usage: bloomtrain tokenizer [-h] ACTION ...")
    assert err.endswith("bloomtrain tokenizer: error: unrecognized arguments: --bogus\n")
    err = _error(["plot", "runs/a", "--bogus"], capsys)
    assert err.startswith("usage: bloomtrain plot [-h]")
    assert "bloomtrain plot: error: unrecognized arguments: --bogus" in err


def test_a_bad_value_and_a_missing_option_name_the_subcommand(capsys):
    err = _error(["train", "--nproc", "parallel.tp=2"], capsys)
    assert err.startswith("usage: bloomtrain train")
    assert "bloomtrain train: error: argument --nproc: invalid int value: 'parallel.tp=2'" in err
    err = _error(["eval", "parallel.tp=2", "--tasks", "piqa"], capsys)
    assert err.startswith("usage: bloomtrain eval")
    assert "bloomtrain eval: error: the following arguments are required: --checkpoint" in err


def test_an_unknown_command_lists_the_commands(capsys):
    err = _error(["trian"], capsys)
    assert err.startswith("usage: bloomtrain [-h] COMMAND ...")
    assert "bloomtrain: error: argument COMMAND: invalid choice: 'trian' (choose from 'demo', " \
           "'train'," in err


def test_the_listing_shows_every_command_without_importing_it(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    for name, (_, help_line) in cli.COMMANDS.items():
        assert f"    {name}" in out
        assert help_line.split()[0] in out


# ---- the cost of parsing -------------------------------------------------------------------------

HEAVY = ("torch", "torch.distributed", "torch._dynamo")

# One process runs every case, each through bloomtrain.cli.main, and reports the heavy modules
# loaded after it: the first case to load one names the culprit.
PROBE = textwrap.dedent("""
    import contextlib, io, json, sys
    from bloomtrain.cli import main
    out = []
    for argv in json.loads(sys.argv[1]):
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as e:
                code = e.code
        out.append({"argv": argv, "code": code, "stderr": err.getvalue(),
                    "heavy": [m for m in %r if m in sys.modules]})
    print(json.dumps(out))
""" % (HEAVY,))


def _probe(cases, tmp_path) -> list[dict]:
    r = subprocess.run([sys.executable, "-c", PROBE, json.dumps(cases)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_help_and_parsing_import_no_torch(tmp_path):
    cases = [["--help"]]
    for name in cli.COMMANDS:
        action = {"tokenizer": ["train"], "data": ["inspect"]}.get(name, [])
        cases.append([name, *action, "--help"])
    cases.append(["train", "--config", "my.yaml", "--bogus"])  # a parse error
    for case in _probe(cases, tmp_path):
        assert case["heavy"] == [], f"`bloomtrain {' '.join(case['argv'])}` imported " \
                                    f"{case['heavy']}"
        assert case["code"] in (0, 2)


def test_config_errors_come_before_torch(tmp_path):
    (tmp_path / "typo.yaml").write_text("train: {train_iters: 5, micro_batch_sise: 2}\n")
    (tmp_path / "ok.yaml").write_text("model: {preset: tiny}\ntrain: {train_iters: 5}\n")
    cases = [["train", "--config", "typo.yaml"],
             ["train", "--config", "ok.yaml", "parallel.tp=3"],
             ["train", "--config", "ok.yaml", "--nproc", "3", "parallel.tp=2"],
             ["train", "--config", "ok.yaml", "optim.lr=-1"]]
    got = _probe(cases, tmp_path)
    assert [c["heavy"] for c in got] == [[]] * len(cases)
    assert [c["code"] for c in got] == [2] * len(cases)
    typo, heads, nproc, lr = (c["stderr"] for c in got)
    assert typo.startswith("bloomtrain train: error: unknown key(s) ['train.micro_batch_sise'] "
                           "(did you mean train.micro_batch_size?); valid keys in 'train' are "
                           "['activation_checkpointing', ")
    # Every rule tp=3 breaks on the tiny preset at once, not one per attempt.
    assert heads == ("bloomtrain train: error: 4 problems; change each of these:\n"
                     "  - the number of processes (1) is not divisible by parallel.tp * "
                     "parallel.pp (3 * 1 = 3); change --nproc or the tp/pp sizes\n"
                     "  - model.make_vocab_size_divisible_by (128) must be divisible by "
                     "parallel.tp (3) so the padded vocabulary splits evenly\n"
                     "  - model.num_heads (4) must be divisible by parallel.tp (3)\n"
                     "  - model.ffn_hidden_size (256) must be divisible by parallel.tp (3)\n")
    assert nproc == ("bloomtrain train: error: the number of processes (3) is not divisible by "
                     "parallel.tp * parallel.pp (2 * 1 = 2); change --nproc or the tp/pp "
                     "sizes\n")
    assert lr.startswith("bloomtrain train: error: optim.lr must be ")


def test_a_demo_run_dir_that_is_a_file_is_one_line(tmp_path, capsys):
    """It was a NotADirectoryError traceback."""
    (tmp_path / "f").write_text("x")
    assert cli.main(["demo", "--run-dir", str(tmp_path / "f")]) == 2
    assert "is a file; give a directory" in capsys.readouterr().err


def test_a_demo_override_is_checked_before_its_data_is_built(tmp_path, capsys):
    """A mistyped or impossible override was said only after the demo had built its corpus,
    trained its tokenizer and preprocessed (minutes on the full corpus)."""
    for bad, said in (("train.micro_batch_sise=2", "did you mean train.micro_batch_size?"),
                      ("parallel.tp=3", "must be divisible by parallel.tp (3)")):
        run_dir = tmp_path / bad.partition("=")[0]
        assert cli.main(["demo", "--run-dir", str(run_dir), bad]) == 2
        out = capsys.readouterr()
        assert said in out.err and "[demo] 1/6" not in out.out
        assert not (run_dir / "data").exists()


def test_bloomtrains_warnings_are_one_line_and_others_keep_pythons_form(tmp_path):
    """A layout warning printed as Python's `/path/bloomtrain/layout.py:256: UserWarning: ...`
    and the source line that warned, unlike every other message of the command."""
    import warnings

    (tmp_path / "w.yaml").write_text("model: {preset: tiny}\nparallel: {pp: 2}\n"
                                     "data: {paths: [nope]}\ntrain: {train_iters: 1, "
                                     "global_batch_size: 2, micro_batch_size: 2}\n")
    out = subprocess.run([sys.executable, "-m", "bloomtrain", "train", "--config",
                          str(tmp_path / "w.yaml"), "--nproc", "2"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2
    err = out.stderr.splitlines()
    assert err[0] == ("bloomtrain train: warning: 1 micro-batches for 2 pipeline stages: most "
                      "of each step is pipeline bubble ((p-1)/m = 1.00); raise "
                      "train.global_batch_size or lower train.micro_batch_size")
    assert err[1].startswith("bloomtrain train: error: data.paths: no dataset at nope")
    line = cli._warning_line("bloomtrain x", warnings.formatwarning, "m", UserWarning,
                             "/elsewhere/mod.py", 3)
    assert line.startswith("/elsewhere/mod.py:3: UserWarning: m")


def test_sigterm_to_a_forked_pool_worker_ends_it_quietly(tmp_path):
    """A command's SIGTERM handler (Terminated, for its cleanup) was inherited by the workers of
    a forked multiprocessing pool: leaving `with Pool()` SIGTERMs them (pool.terminate), and
    each raised Terminated wherever it was, printing its traceback on the command's stderr
    (`bloomtrain eval`'s bootstrap pool, rc 0). The process that took the signal still gets
    Terminated."""
    script = textwrap.dedent("""
        import multiprocessing, os, signal, sys, time
        from bloomtrain import cli

        cli.take_signal()
        for _ in range(6):  # each round leaves workers that pool.terminate() SIGTERMs
            with multiprocessing.get_context("fork").Pool(2) as pool:
                pool.map(abs, range(2000))
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except cli.Terminated:
            print("owner: Terminated")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "owner: Terminated"
    assert "Terminated" not in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_a_demo_whose_training_a_signal_or_the_kill_switch_stops_ends_there(dataset, tmp_path):
    """SIGTERM (a `kill`, `timeout`, a pod's stop) stopped the demo's training, which saved;
    the demo then exported the cut run, generated from it, said "done" and exited 0. It now
    ends after the save, as `bloomtrain train` does. The kill switch stands in for the signal:
    both end the run with a `stopped` record."""
    from bloomtrain import demo
    from bloomtrain.validate import validate
    from tests.helpers import make_cfg

    switch = tmp_path / "KILL"
    switch.touch()
    cfg = make_cfg(dataset, tmp_path, train__train_iters=4, train__kill_switch_path=str(switch))
    lines = []
    with pytest.raises(SystemExit) as e:
        demo._train(tmp_path, cfg, 1, validate(cfg, 1), None, lines.append)
    assert e.value.code == 0
    assert lines[-1] == ("[demo] training stopped at step 0 (kill switch) and saved; the same "
                         "command resumes it")


def test_the_demo_names_its_own_knobs_and_refuses_a_launchers_world(tmp_path, capsys,
                                                                     monkeypatch):
    """Its layout error said "change --nproc", an option the demo does not have; under
    torchrun every rank built the same data and exported into the same files at once."""
    from bloomtrain.demo import demo_layout
    nproc, _ = demo_layout()
    assert cli.main(["demo", "--run-dir", str(tmp_path / "a"), "parallel.tp=3",
                     "parallel.pp=2", "model.num_heads=6", "model.hidden_size=192",
                     "model.ffn_hidden_size=768", "model.make_vocab_size_divisible_by=3"]) == 2
    err = capsys.readouterr().err
    assert f"the demo runs {nproc} processes: give tp and pp whose product divides {nproc}" \
        in err and "--nproc" not in err, err
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cli.main(["demo", "--run-dir", str(tmp_path / "b")]) == 2
    assert "run it without torchrun" in capsys.readouterr().err
    assert not (tmp_path / "b" / "data").exists()
