"""`bloomtrain plot` and report.html: PNG panels from a real tiny run and from synthesized
records (every optional field, several runs overlaid), panels without data left out, labels,
bad input, and the report opened in headless Chromium with every image loading."""
import html.parser
import json
import math
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from bloomtrain.cli import main
from bloomtrain.config import UserError
from bloomtrain.report import load_run, run_labels, write_report
from bloomtrain.report.plot import write_plots
from bloomtrain.train import train
from tests.synthetic import write_synthetic_dataset
from tests.helpers import make_cfg
from tests.runs import full_records, step_record, write_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# An fp32 run scales no loss and skipped no step: no loss_scale.png.
REAL_PANELS = {"loss.png", "lr.png", "grad_norm.png", "throughput.png"}
ALL_PANELS = REAL_PANELS | {"memory.png", "loss_scale.png"}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A finished 6-step run (fp32, CPU) with evals at steps 3 and 6 and two checkpoints."""
    root = tmp_path_factory.mktemp("tiny")
    dataset = write_synthetic_dataset(root / "data" / "synth_text_document")
    cfg = make_cfg(dataset, root, train__eval_interval=3, train__eval_iters=1,
                   checkpoint={"dir": str(root / "ckpt"), "save_interval": 3})
    train(cfg, log=lambda *a: None)
    return root / "run"


CONFIG = {"train": {"train_iters": 30, "global_batch_size": 8, "micro_batch_size": 4},
          "checkpoint": {"dir": None}, "run_dir": "runs/x"}


def assert_png(path: Path) -> tuple[int, int]:
    """A complete, decodable, non-blank PNG; returns (width, height)."""
    from matplotlib.image import imread
    data = path.read_bytes()
    assert len(data) > 0 and data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR" and data[-12:-4] == b"\x00\x00\x00\x00IEND", \
        f"{path} is truncated"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 0 and height > 0
    pixels = imread(path)
    assert pixels.shape[:2] == (height, width)
    assert pixels.std() > 0, f"{path} is blank"
    return width, height


# ---- headless Chromium -------------------------------------------------------------------------
def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    msg = ("headless Chromium is needed to check that report.html's images load, and none was "
           "found on PATH (chromium, chromium-browser, google-chrome). Install it: apt-get "
           "install -y chromium (.ci/run does this before the tests).")
    # CI installs chromium and sets BLOOMTRAIN_REQUIRE_CHROMIUM (.ci/run): there a missing one is
    # a broken CI that a skip would hide. On a user's fresh machine it is a skip that says why.
    if os.environ.get("BLOOMTRAIN_REQUIRE_CHROMIUM"):
        pytest.fail(msg)
    pytest.skip(msg)


class DomImages(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.images, self.body = [], {}

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.images.append(dict(attrs))
        elif tag == "body":
            self.body = dict(attrs)


def load_in_chromium(page: Path, profile: Path) -> DomImages:
    """The DOM of `page` after Chromium has loaded it and the report's script has run."""
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--no-first-run", f"--user-data-dir={profile}", "--virtual-time-budget=5000",
           "--dump-dom", page.resolve().as_uri()]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, f"chromium failed ({out.returncode}): {out.stderr[-3000:]}"
    dom = DomImages()
    dom.feed(out.stdout)
    return dom


# ---- tests -------------------------------------------------------------------------------------
def test_plot_cli_on_a_real_run(tiny_run, capsys):
    assert main(["plot", str(tiny_run)]) == 0
    out_dir = tiny_run / "plots"  # the default
    assert str(out_dir / "report.html") in capsys.readouterr().out
    recs = [json.loads(line) for line in (tiny_run / "metrics.jsonl").read_text().splitlines()]
    # Memory comes from records that may or may not carry mem_peak_bytes yet: its panel is there
    # exactly when they do.
    expected = REAL_PANELS | ({"memory.png"} if any("mem_peak_bytes" in r for r in recs)
                              else set())
    assert {p.name for p in out_dir.glob("*.png")} == expected
    for png in out_dir.glob("*.png"):
        assert_png(png)
    page = (out_dir / "report.html").read_text()
    assert "train_iters: 6" in page  # the resolved config
    assert "6 / 6 (100.0%) finished" in page
    last_loss = [r for r in recs if "loss" in r][-1]["loss"]
    assert f"{last_loss:.4f}" in page
    assert not [p for p in out_dir.iterdir() if p.name.startswith(".")]  # no temporaries left
    # A file where the plots' directory would go: one line, not a FileExistsError traceback.
    assert main(["plot", str(tiny_run), "--output", str(tiny_run / "metrics.jsonl")]) == 2
    assert "is a file; the plots go into a directory" in capsys.readouterr().err


def test_report_images_load_in_chromium(tiny_run, tmp_path):
    a = write_run(tmp_path / "a" / "run", full_records(), CONFIG)
    b = write_run(tmp_path / "b" / "run", full_records(24, mem_gib=5.0), CONFIG)
    out = tmp_path / "out"
    page = write_report([tiny_run, a, b], out)
    assert page == out / "report.html"
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert set(pngs) == ALL_PANELS
    for png in pngs:
        assert_png(out / png)

    dom = load_in_chromium(page, tmp_path / "profile")
    assert sorted(img["src"] for img in dom.images) == pngs  # every image, by relative path
    for img in dom.images:
        assert int(img.get("data-natural-width", 0)) > 0, f"{img['src']} did not load"
    assert dom.body.get("data-images-checked") == str(len(pngs))
    assert dom.body.get("data-images-broken") == "0"

    # The check can fail: a copy of the report without one of its images shows it as broken.
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    (broken / "lr.png").unlink()
    dom = load_in_chromium(broken / "report.html", tmp_path / "profile2")
    assert dom.body.get("data-images-broken") == "1"
    bad = [img for img in dom.images if "broken" in img.get("class", "")]
    assert [img["src"] for img in bad] == ["lr.png"] and "data-natural-width" not in bad[0]


def test_overlaid_runs_with_every_optional_field(tmp_path):
    a = write_run(tmp_path / "a" / "run", full_records(), CONFIG)
    b = write_run(tmp_path / "b" / "run", full_records(24, mem_gib=5.0), CONFIG)
    runs = [load_run(a, "a/run"), load_run(b, "b/run")]
    panels = {p.file: p.axes for p in write_plots(runs, tmp_path / "out")}
    assert panels == {
        "loss.png": ["loss"], "lr.png": ["learning rate"], "grad_norm.png": ["grad norm"],
        "throughput.png": ["tokens/s", "TFLOP/s per device", "MFU (%)"],
        "memory.png": ["GiB"], "loss_scale.png": ["loss scale", "skipped steps (total)"]}
    page = write_report([a, b], tmp_path / "out").read_text()
    for text in ("a/run", "b/run", "30 / 30 (100.0%) finished", "24 / 30 (80.0%)",
                 "3.0 GiB (rank 1, CUDA allocated), reserved 4.0 GiB",
                 "5.0 GiB (rank 1, CUDA allocated)", "MFU",
                 "1 (last: step 20 z=8.5 log)", "straggler: rank 3 at 1.50x",
                 "loss spike at step 20", "rank 3 x1.50 (step 25)"):
        assert text in page, text


# What each panel must show, by the metrics.jsonl field it plots: file -> sub-plot (ylabel) ->
# [(records, field, legend suffix, scale)]. Written from the record format, not from plot.PANELS.
SHOWN = {
    "loss.png": {"loss": [("steps", "loss", "", 1.0), ("evals", "eval_loss", " eval", 1.0)]},
    "lr.png": {"learning rate": [("steps", "lr", "", 1.0)]},
    "grad_norm.png": {"grad norm": [("steps", "grad_norm", "", 1.0)]},
    "throughput.png": {"tokens/s": [("steps", "tokens_per_s", "", 1.0)],
                       "TFLOP/s per device": [("steps", "tflops_per_device", "", 1.0)],
                       "MFU (%)": [("steps", "mfu", "", 100.0)]},
    "memory.png": {"GiB": [("steps", "mem_peak_bytes", " peak", 2.0 ** -30),
                           ("steps", "mem_reserved_bytes", " reserved", 2.0 ** -30)]},
    "loss_scale.png": {"loss scale": [("steps", "loss_scale", "", 1.0)],
                       "skipped steps (total)": [("steps", "skipped_steps", "", 1.0)]},
}


ZERO_IS_EMPTY = {"skipped steps (total)"}


def expected_panels(runs: dict[str, Path]) -> dict[str, dict]:
    """file -> ylabel -> legend label -> (steps, values), from each run's metrics.jsonl read
    line by line here: what the plots must show. A non-finite value is a gap (NaN); a sub-plot
    or panel no run has a finite value for is left out; the loss spikes are red markers."""
    records = {label: [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
               for label, d in runs.items()}
    out = {}
    for file, subplots in SHOWN.items():
        panel = {}
        for ylabel, lines in subplots.items():
            shown = {}
            for label, recs in records.items():
                kinds = {"steps": [r for r in recs if "loss" in r],
                         "evals": [r for r in recs if "eval_loss" in r]}
                for kind, key, suffix, scale in lines:
                    pts = [(float(r["step"]), float(r[key]) * scale) for r in kinds[kind]
                           if isinstance(r.get(key), (int, float))]
                    if any(math.isfinite(y) for _, y in pts):
                        shown[label + suffix] = ([x for x, _ in pts],
                                                 [y if math.isfinite(y) else math.nan
                                                  for _, y in pts])
            if ylabel == "loss":
                # Marked at the spike's own loss, not the interval's mean.
                spikes = [(float(r["step"]), float(r["loss_spike"]["loss"]))
                          for recs in records.values()
                          for r in recs if isinstance(r.get("loss_spike"), dict)]
                if spikes:
                    shown["loss spike"] = ([x for x, _ in spikes], [y for _, y in spikes])
            if ylabel in ZERO_IS_EMPTY and not any(y for _, ys in shown.values() for y in ys):
                shown = {}  # a count that stayed 0 in every run
            if shown:
                panel[ylabel] = shown
        if panel:
            out[file] = panel
    return out


def assert_panels_show(panels, runs: dict[str, Path]) -> None:
    want = expected_panels(runs)
    got = {p.file: p.shown for p in panels}
    assert got.keys() == want.keys()
    for file, subplots in want.items():
        assert got[file].keys() == subplots.keys(), file
        for ylabel, lines in subplots.items():
            assert got[file][ylabel].keys() == lines.keys(), (file, ylabel)
            for label, (xs, ys) in lines.items():
                gx, gy = got[file][ylabel][label]
                assert gx == xs, (file, ylabel, label)
                # NaN marks a gap on both sides; values compare to float rounding.
                assert gy == pytest.approx(ys, rel=1e-12, nan_ok=True), (file, ylabel, label)


def test_each_panel_shows_the_metrics_of_each_run(tiny_run, tmp_path):
    # The real run, and two synthesized runs carrying every optional field, overlaid.
    a = write_run(tmp_path / "a" / "run", full_records(), CONFIG)
    b = write_run(tmp_path / "b" / "run", full_records(24, mem_gib=5.0), CONFIG)
    assert_panels_show(write_plots([load_run(tiny_run, "tiny")], tmp_path / "real"),
                       {"tiny": tiny_run})
    assert_panels_show(write_plots([load_run(a, "a/run"), load_run(b, "b/run")],
                                   tmp_path / "out"), {"a/run": a, "b/run": b})


def test_panels_without_data_are_left_out(tmp_path):
    # Only losses (no lr, grad norm, throughput, memory, loss scale or skipped count), and a
    # grad norm that is never finite: nothing but the loss panel can be drawn.
    recs = [{"step": s, "loss": 3.0 - 0.1 * s, "grad_norm": float("nan")} for s in range(1, 6)]
    recs.append({"step": 5, "eval_loss": 2.9, "eval_ppl": 18.2})
    run = write_run(tmp_path / "run", recs)
    page = write_report([run], tmp_path / "out")
    assert {p.name for p in (tmp_path / "out").glob("*.png")} == {"loss.png"}
    assert_png(tmp_path / "out" / "loss.png")
    assert page.read_text().count("<img ") == 1
    assert "has no config.yaml" in page.read_text()


def test_run_names_are_shown_literally_in_the_legend(tmp_path):
    # Directory names as labels: `$` would start matplotlib's mathtext (a bad expression failed
    # the whole report) and a leading `_` hid the run from the legend.
    names = ["_under", "a$b$c", r"x$\frac$y"]
    runs = [load_run(write_run(tmp_path / "runs" / n, [step_record(s) for s in range(1, 4)]))
            for n in names]
    for run, name in zip(runs, names):
        run.label = name
    panels = write_plots(runs, tmp_path / "out")
    loss = {p.file: p for p in panels}["loss.png"]
    legend = [t for t in loss.shown["loss"]]
    assert [t.replace("\u200b", "").replace("\\$", "$") for t in legend] == names
    assert_png(tmp_path / "out" / "loss.png")


def test_run_labels():
    assert run_labels(["/x/runs/a", "/x/runs/b"]) == ["a", "b"]
    assert run_labels(["/x/a/run", "/x/b/run"]) == ["a/run", "b/run"]
    assert run_labels(["/x/a/run", "/y/a/run", "/x/c"]) == ["x/a/run", "y/a/run", "c"]
    assert run_labels(["/x/run", "/x/run/"]) == ["run", "run (2)"]


def test_bad_input_says_what_to_change(tmp_path, capsys, monkeypatch):
    assert main(["plot", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "nope does not exist" in err and "run_dir" in err

    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(UserError, match="has no metrics.jsonl"):
        write_report([tmp_path / "empty_dir"], tmp_path / "o1")

    started = write_run(tmp_path / "started", [])
    with pytest.raises(UserError, match="nothing to plot"):
        write_report([started], tmp_path / "o2")

    good = json.dumps(step_record(1))
    for name, text, match in [
            ("corrupt", good + "\n{\"step\": 2, \"lo\n" + good + "\n", "line 2 is not valid JSON"),
            ("blank", good + "\n\n" + good + "\n", "line 2 is empty"),
            ("nostep", good + "\n{\"loss\": 1.0}\n", "line 2 is not a metrics record"),
            ("list", "[1, 2]\n", "line 1 is not a metrics record")]:
        d = tmp_path / name
        d.mkdir()
        (d / "metrics.jsonl").write_text(text)
        with pytest.raises(UserError, match=match):
            write_report([d], tmp_path / "o3")
    assert not (tmp_path / "o3").exists()  # nothing written on bad input

    # matplotlib is an optional extra: without it the message says how to get it.
    run = write_run(tmp_path / "run", [step_record(1)])
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    with pytest.raises(UserError, match=r"pip install 'bloomtrain\[plot\]'"):
        write_report([run], tmp_path / "o4")


def test_plot_help_names_the_default_output(capsys):
    with pytest.raises(SystemExit):
        main(["plot", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "default: the first RUN_DIR's plots/ directory" in out


def test_loss_scale_panel_only_with_loss_scaling_or_skipped_steps(tiny_run, tmp_path):
    # fp32 (the real run): neither, so no panel (it was a flat line at 0). bf16 with a skipped
    # step: that count alone, titled for it. fp16: both.
    assert "loss_scale.png" not in {p.file for p in write_plots([load_run(tiny_run)],
                                                                tmp_path / "fp32")}
    bf16 = write_run(tmp_path / "bf16", [step_record(s, skipped_steps=int(s > 3))
                                         for s in range(1, 6)])
    (panel,) = [p for p in write_plots([load_run(bf16)], tmp_path / "o") if
                p.file == "loss_scale.png"]
    assert (panel.title, panel.axes) == ("Skipped steps", ["skipped steps (total)"])
    fp16 = write_run(tmp_path / "fp16", full_records())
    (panel,) = [p for p in write_plots([load_run(fp16)], tmp_path / "o2") if
                p.file == "loss_scale.png"]
    assert (panel.title, panel.axes) == ("Loss scale and skipped steps",
                                         ["loss scale", "skipped steps (total)"])


def test_memory_from_zero_captions_add_facts_and_several_runs_get_a_config_diff(tmp_path):
    a = write_run(tmp_path / "a" / "run", full_records(), CONFIG)
    b = write_run(tmp_path / "b" / "run", full_records(24, mem_gib=5.0),
                  {**CONFIG, "train": {**CONFIG["train"], "train_iters": 24}, "run_dir": "runs/y"})
    out = tmp_path / "out"
    page = write_report([a, b], out).read_text()
    panels = {p.file: p for p in write_plots([load_run(a, "a/run"), load_run(b, "b/run")], out)}
    assert panels["memory.png"].ylims["GiB"][0] == 0  # peaks of 3-5 GiB, the axis from 0
    assert panels["loss.png"].ylims["loss"][0] > 0  # other axes fit their data
    captions = [c.split("</figcaption>")[0] for c in page.split("<figcaption>")[1:]]
    assert len(captions) == len(panels)
    assert not set(captions) & {p.title for p in panels.values()}  # no title repeated
    assert ("learning rate: a/run 0.001 at step 1 -&gt; 0.001 at step 30; b/run 0.001 at step 1 "
            "-&gt; 0.001 at step 24.") in captions
    assert ("loss: a/run 4.98 at step 1 -&gt; 4.4 at step 30 (max 6 at step 20); a/run eval 4.8 "
            "at step 10 -&gt; 4.6 at step 30; b/run 4.98 at step 1 -&gt; 4.52 at step 24 (max 6 "
            "at step 20); b/run eval 4.8 at step 10 -&gt; 4.7 at step 20; 2 loss spike(s), at "
            "step(s) 20, 20.") in captions
    (memory,) = [c for c in captions if c.startswith("GiB:")]
    assert memory.endswith(". peak a/run 3.0 GiB (rank 1, CUDA allocated), reserved 4.0 GiB; "
                           "b/run 5.0 GiB (rank 1, CUDA allocated), reserved 6.0 GiB.")
    # The configs: the keys that differ, one column per run, not each whole config.
    assert "2 of 5 keys differ between the runs' config.yaml" in page
    assert "<tr><th>run_dir</th><td>&quot;runs/x&quot;</td><td>&quot;runs/y&quot;</td></tr>" in page
    assert "<tr><th>train.train_iters</th><td>30</td><td>24</td></tr>" in page
    assert "micro_batch_size" not in page and "<pre>" not in page


def test_an_output_path_through_a_file_is_one_line_not_a_traceback(tmp_path, capsys):
    # plot --output FILE/p: NotADirectoryError's traceback before; any command's OSError on a
    # path the user gave is now one line naming it, exit 2.
    run = write_run(tmp_path / "run", [step_record(s) for s in range(1, 4)])
    (tmp_path / "f").write_text("")
    assert main(["plot", str(run), "--output", str(tmp_path / "f" / "p")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("bloomtrain plot: error: ") \
        and str(tmp_path / "f") in err[0], err


def test_eleven_runs_get_eleven_colours_and_dates_in_configs_are_compared(tmp_path):
    """Colour C10 is C0 again: run 11 was run 1's double on every panel. An unquoted date in
    config.yaml (YAML reads it as a date) made the config diff raise TypeError, after the
    images were written."""
    from matplotlib.colors import to_hex
    from bloomtrain.report.plot import run_colour
    colours = [to_hex(run_colour(i)) for i in range(50)]
    assert len(set(colours)) == 50, colours
    runs = [write_run(tmp_path / f"r{i:02d}", [step_record(1), step_record(2)], CONFIG)
            for i in range(11)]
    for i, r in enumerate(runs):  # as a user writes it: unquoted, a YAML date
        with open(r / "config.yaml", "a") as f:
            f.write(f"note: 2024-01-{i + 1:02d}\n")
    assert type(load_run(runs[0]).config["note"]).__name__ == "date"
    page = write_report(runs, tmp_path / "out").read_text()
    assert "<tr><th>note</th><td>&quot;2024-01-01&quot;</td>" in page
