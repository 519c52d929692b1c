"""The `bloomtrain import-config` command: read the launch and the ds_config, convert, check the
result as `bloomtrain train` would, print the report and write the YAML.

Unsupported arguments make the command fail (exit status 2, nothing written): each describes a
run bloomtrain would not reproduce, and a config that silently trains something else is worse
than none. `--allow-unsupported` writes the YAML anyway, with the unsupported arguments listed
in its header.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

from bloomtrain.config import Config
from bloomtrain.errors import UserError
from bloomtrain.files import atomic_output, disk_full_as

_SECTIONS = ("model", "parallel", "data", "optim", "train", "checkpoint", "run")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "import-config",
        description="Read a Megatron-DeepSpeed launch (a bash/SLURM launch script running "
        "pretrain_gpt.py under torchrun, python -m torch.distributed.run/launch or deepspeed, or "
        "an args file) and its DeepSpeed ds_config, write the bloomtrain config YAML, and list "
        "every argument mapped (to which key), ignored (why) and unsupported. Unsupported "
        "arguments make it fail unless --allow-unsupported. The batch rules are checked at the "
        "launch's world size.")
    p.add_argument("--megatron-args", required=True, metavar="FILE",
                   help="a launch script, or an args file (arguments one per line or space "
                        "separated)")
    p.add_argument("--deepspeed-config", metavar="FILE",
                   help="the run's ds_config.json (default: the file --deepspeed_config names, "
                        "when the script writes it with a heredoc or it exists beside the script)")
    p.add_argument("--world-size", type=int, metavar="N",
                   help="the run's number of processes (default: from the launcher's --nnodes "
                        "and --nproc_per_node, or deepspeed's --num_nodes and --num_gpus)")
    p.add_argument("--var", action="append", default=[], metavar="NAME=VALUE",
                   help="a variable the script takes from its environment (or computes with a "
                        "command, which is not run); repeatable")
    p.add_argument("--allow-unsupported", action="store_true",
                   help="write the YAML even when arguments change training in ways bloomtrain "
                        "does not reproduce")
    p.add_argument("--output", required=True, metavar="YAML")
    p.set_defaults(func=_main)


def _main(args) -> int:
    from bloomtrain.import_config.bash import read_launch
    from bloomtrain.import_config.mapping import megatron_to_config
    from bloomtrain.import_config.megatron_args import parse_argv

    source = Path(args.megatron_args)
    variables = _variables(args.var)
    try:
        launch = read_launch(_read(source), variables)
        megatron = parse_argv(launch.argv)
    except UserError as e:
        raise UserError(f"{source}: {e}") from None
    world, world_note = launch.world_size, launch.world_note
    if args.world_size is not None:
        if args.world_size <= 0:
            raise UserError(f"--world-size must be positive, got {args.world_size}")
        world_note = "--world-size" + (f" (the script launches {world}: {world_note})"
                                       if world not in (None, args.world_size) else "")
        world = args.world_size
    ds, ds_source = _ds_config(args.deepspeed_config, megatron, launch, source)
    config, report = megatron_to_config(megatron, ds, world_size=world)
    _check(config, world, resumes=bool(megatron.get("load")))
    header = _header(source, launch, ds_source, world, world_note, report)
    _print_report(report, header)
    if report.unsupported and not args.allow_unsupported:
        print(f"bloomtrain import-config: {len(report.unsupported)} unsupported argument(s) "
              f"(listed above): bloomtrain would not train the run they describe. Nothing "
              f"written; pass --allow-unsupported to write {args.output} anyway",
              file=sys.stderr)
        return 2
    out = Path(args.output).resolve()
    inputs = [Path(p).resolve() for p in (args.megatron_args, args.deepspeed_config) if p]
    if out in inputs:  # the launch script or ds_config replaced by the YAML
        raise UserError(f"--output {args.output} is one of the inputs; write the config to a "
                        f"new file")
    with disk_full_as(f"writing {args.output}", out.parent,
                      "nothing was written; free disk space or choose another --output"), \
            atomic_output(args.output) as f:
        f.write(render_yaml(config, report, header).encode("utf-8"))
    print(f"wrote {args.output}")
    return 0


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {path}: {e}") from None


def _variables(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or not name.isidentifier():
            raise UserError(f"--var {item!r} must look like NAME=VALUE")
        out[name] = value
    return out


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise UserError(f"the key(s) {twice} appear twice in one object; DeepSpeed refuses that")
    return dict(pairs)


def _parse_ds(text: str, where: str) -> dict[str, Any]:
    from bloomtrain.import_config.bash import show, unresolved_in

    if (name := unresolved_in(text)) is not None:
        raise UserError(f"the ds_config {where} uses {name}, which the script does not define; "
                        f"pass --var {name.lstrip('$')}=VALUE")
    try:
        ds = json.loads(show(text), object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as e:
        raise UserError(f"the ds_config {where} is not valid JSON: {e}") from None
    except UserError as e:
        raise UserError(f"the ds_config {where}: {e}") from None
    if not isinstance(ds, dict):
        raise UserError(f"the ds_config {where} must hold a JSON object")
    return ds


def _ds_config(path: str | None, megatron: dict, launch, source: Path):
    """The ds_config and where it came from: --deepspeed-config, else the file the launch names
    when the script writes it or it exists beside the script."""
    from bloomtrain.import_config.bash import show

    if path is not None:
        return _parse_ds(_read(Path(path)), path), path
    name = megatron.get("deepspeed_config") or megatron.get("deepscale_config")
    if not isinstance(name, str):
        return None, None
    written, text = launch.written_file(name)
    if written and text is None:
        raise UserError(f"the script writes the ds_config {show(name)} under an if, case, loop "
                        f"or &&/|| import-config cannot decide; pass the file the run used "
                        f"with --deepspeed-config")
    if written:
        where = f"{show(name)} (written by the script)"
        return _parse_ds(text, where), where
    beside = source.parent / show(name)
    if beside.is_file():
        return _parse_ds(_read(beside), str(beside)), str(beside)
    return None, None


def _check(config: dict, world: int | None, resumes: bool = False) -> None:
    """The config as `bloomtrain train` will check it: each key, then (at the world size) every
    rule between them."""
    from bloomtrain.validate import validate

    try:
        cfg = Config.from_dict(config)
        if world is None:
            cfg.check()
        else:
            validate(cfg, world)
    except UserError as e:
        at = f" at {world} processes" if world else ""
        ramp = config.get("train", {}).get("rampup_batch_size")
        # A continuation script (--load) keeps the ramp-up its first run had, though Megatron
        # checks a ramp batch only at the samples it trains at, all past the ramp by now.
        hint = (f"; the script resumes (--load): if its checkpoint is past the ramp-up's "
                f"{ramp[2]} samples, Megatron never ran these batches, so drop "
                f"--rampup-batch-size from the script (or train.rampup_batch_size from the "
                f"config)") if resumes and ramp and "rampup_batch_size" in str(e) else ""
        raise UserError(f"the converted config does not pass bloomtrain's checks{at}: {e}"
                        f"{hint}") from None


def _header(source, launch, ds_source, world, world_note, report) -> list[str]:
    from bloomtrain.import_config.bash import show

    lines = [f"converted by `bloomtrain import-config` from {source}"]
    if launch.program is not None:
        lines.append(f"launch: {show(launch.program)} on line {launch.line}")
    lines.append(f"ds_config: {ds_source or 'none'}")
    lines.append(f"world size: {world if world is not None else 'unknown'} ({world_note})")
    lines += [f"note: {line}" for line in launch.unused_vars]
    return lines


def _print_report(report, header: list[str]) -> None:
    from bloomtrain.import_config.bash import show

    print("\n".join(header))
    print(f"\nmapped ({len(report.mapped)}):")
    for m in report.mapped:
        target = f"{m.key} = {json.dumps(m.value)}" if m.key else \
            f"(no key: {show(m.value)})"
        print(f"  {m.source} -> {target}" + (f"\n      note: {m.note}" if m.note else ""))
    print(f"\nignored ({len(report.ignored)}):")
    for s in report.ignored:
        print(f"  {show(s.source)}: {s.reason}")
    for what in report.unchecked:
        print(f"\nnot checked: {what}")
    for what in report.warnings:
        print(f"\nWARNING: {what}")
    if report.unsupported:
        sys.stdout.flush()
        print(f"\n!! UNSUPPORTED ({len(report.unsupported)}): the run used these and bloomtrain "
              f"does not reproduce them", file=sys.stderr)
        for s in report.unsupported:
            print(f"!!   {show(s.source)}: {s.reason}", file=sys.stderr)


def render_yaml(config: dict, report, header: list[str]) -> str:
    """The config as YAML, each key commented with the argument it came from; the header
    names the source and any unsupported arguments. Checked to load back to the same config."""
    from bloomtrain.import_config.bash import show

    sources: dict[str, str] = {}
    for m in report.mapped:
        if m.key:
            sources[m.key] = m.source if m.key not in sources else f"{sources[m.key]}; {m.source}"
    # An argument's value may span lines (a quoted value with newlines in the script): every
    # line of a comment starts with "#", or the rest would be read as YAML.
    lines = [_commented(line, "# ") for line in header]
    lines += [_commented(f"WARNING: {w}", "# ") for w in report.warnings]
    if report.unsupported:
        lines.append("# UNSUPPORTED in the source run (written anyway with --allow-unsupported):")
        lines += [_commented(f"{show(s.source)}: {s.reason}", "#   ") for s in report.unsupported]
    for section in _SECTIONS:
        if section not in config:
            continue
        lines.append(f"{section}:")
        for key, value in config[section].items():
            # Flow style keeps each key on one line, for its comment; a scalar document ends
            # with "...", which is dropped.
            text = yaml.safe_dump(value, default_flow_style=True, width=10 ** 6)
            text = text.removesuffix("\n...\n").rstrip("\n")
            comment = sources.get(f"{section}.{key}", "")
            comment = " ".join(show(comment).split())  # on the key's one line
            lines.append(f"  {key}: {text}" + (f"  # {comment}" if comment else ""))
    text = "\n".join(lines) + "\n"
    if Config.from_dict(yaml.safe_load(text)).to_dict() != Config.from_dict(config).to_dict():
        raise RuntimeError("the YAML written does not load back to the converted config")
    return text


def _commented(text: str, prefix: str) -> str:
    return "\n".join(prefix + line for line in text.splitlines() or [""])
