"""The launch in a Megatron launch script or args file: the program's arguments, the world size the
launcher starts, and the files the script writes with heredocs (its ds_config). The shell
reading is lexer.py's; this module evaluates the commands in order."""
from __future__ import annotations

import ast
import os
import re
from itertools import takewhile
from dataclasses import dataclass, field
from typing import Mapping

from bloomtrain.errors import UserError
from bloomtrain.import_config.bash.flow import RUN, SKIP, Flow, test_status
from bloomtrain.import_config.bash.lexer import (ASSIGNMENT, Command, Lexer, Part, arith,
                                                 mark, show, unresolved_in)

_TORCHRUN = ("torchrun", "torch.distributed.run", "torch.distributed.launch")
# Launcher options that take no value (torchrun, torch.distributed.launch, deepspeed).
_LAUNCHER_FLAGS = {"--standalone", "--no_python", "--use_env", "--module", "-m", "--run_path",
                   "--force_multi", "--no_local_rank", "--no_ssh_check", "--save_pid",
                   "--elastic_training", "--bind_cores_to_rank", "--no_ssh", "-u"}
_STARTERS = ("srun", "mpirun", "mpiexec", "orterun")
# The task counts of srun and of MPI's launchers (Open MPI, MPICH): option -> what it sets.
_STARTER_COUNTS = {
    "srun": {"-n": "ntasks", "--ntasks": "ntasks", "-N": "nodes", "--nodes": "nodes",
             "--ntasks-per-node": "ntasks_per_node"},
    "mpi": {"-n": "ntasks", "-np": "ntasks", "--np": "ntasks", "--n": "ntasks", "-c": "ntasks"},
}
_NOT_LAUNCHES = {"echo", "printf", "cat", "tee", ":", "true", "test", "[", "[[", "eval"}
_MAX_DEPTH = 50


@dataclass
class Launch:
    argv: list[str]                 # the program's arguments
    program: str | None             # the script it runs (None for an args file)
    line: int | None
    world_size: int | None
    world_note: str                 # how the world size was found, or why it is unknown
    # path (normalised: written_file looks one up) -> text the script writes, or None where it
    # writes it under a condition this reader cannot decide
    files: dict[str, str | None] = field(default_factory=dict)
    # --var values that changed nothing: one line each (bloomtrain.import_config.cli prints them)
    unused_vars: list[str] = field(default_factory=list)

    def written_file(self, name: str) -> tuple[bool, str | None]:
        """(whether the script writes `name`, its text or None when undecided)."""
        key = os.path.normpath(name)
        return key in self.files, self.files.get(key)


@dataclass
class _Found:
    launcher: str | None
    options: dict[str, str]
    program: str
    argv: list[str]
    line: int
    # The program that starts the processes running python (srun, mpirun), with its options
    # (_starter_options), or None: python then runs one process.
    starter: tuple[str, dict[str, str]] | None


@dataclass
class _Slurm:
    nodes: int | None = None
    gpus_per_node: int | None = None
    ntasks_per_node: int | None = None
    ntasks: int | None = None

    def env(self) -> dict[str, str]:
        pairs = {"SLURM_NNODES": self.nodes, "SLURM_JOB_NUM_NODES": self.nodes,
                 "SLURM_GPUS_ON_NODE": self.gpus_per_node,
                 "SLURM_GPUS_PER_NODE": self.gpus_per_node,
                 "SLURM_NTASKS_PER_NODE": self.ntasks_per_node, "SLURM_NTASKS": self.ntasks}
        return {k: str(v) for k, v in pairs.items() if v is not None}


def read_launch(text: str, variables: Mapping[str, str] | None = None) -> Launch:
    """The launch `text` describes. `variables` are the environment the script expects (--var):
    they define what the script does not, and replace an assignment the script makes from a
    command's output."""
    variables = dict(variables or {})
    commands = Lexer(text).commands()
    evaluator = _Evaluator(variables, variables)
    if _is_args_file(commands):
        argv = [f for c in commands for w in c.words for f in evaluator.fields(w)]
        return Launch(argv, None, None, None, "an args file names no launcher")
    slurm = _sbatch(text)
    evaluator.env = {**evaluator.env, **slurm.env(), **variables}
    for command in commands:
        evaluator.command(command, command.line)
    found = evaluator.launches
    if not found:
        undecided = ", ".join(f"{k} (line {v})" for k, v in evaluator.uncertain.items())
        raise UserError("found no launch: no command runs a program under torchrun, python -m "
                        "torch.distributed.run/launch or deepspeed, and python runs no "
                        "pretrain_*.py; pass the program's arguments as an args file instead" +
                        (f" (or, if the launch is built from variables set under an if, case, "
                         f"loop or &&/|| import-config cannot decide, give them with --var: "
                         f"{undecided})" if undecided else ""))
    if len(found) > 1:
        raise UserError(f"found {len(found)} launches (lines "
                        f"{', '.join(str(f.line) for f in found)}); keep the one to convert")
    world, note = _world(found[0], slurm)
    unused = [f"--var {name}: the script sets {name} itself (line {line}), and uses its own "
              f"value" for name, line in evaluator.superseded.items()]
    unused += [f"--var {name}: the script never reads {name}" for name in variables
               if not re.search(rf"(?<![\w-]){re.escape(name)}(?!\w)", text)]
    return Launch(found[0].argv, found[0].program, found[0].line, world, note, evaluator.files,
                  unused)


def _is_args_file(commands: list[Command]) -> bool:
    first = commands[0].words[0] if commands and commands[0].words else []
    return bool(first) and first[0].kind == "lit" and first[0].text.startswith("-")


def _sbatch(text: str) -> _Slurm:
    slurm = _Slurm()
    names = {"--nodes": "nodes", "-N": "nodes", "--ntasks-per-node": "ntasks_per_node",
             "--ntasks": "ntasks", "-n": "ntasks", "--gpus-per-node": "gpus_per_node"}
    for line in re.findall(r"^#SBATCH\s+(.*)$", text, flags=re.M):
        words = line.split("#")[0].split()
        for i, word in enumerate(words):
            name, eq, value = word.partition("=")
            if not eq and re.fullmatch(r"-[Nn]\d+", word):
                name, value = word[:2], word[2:]
            elif not eq:
                value = words[i + 1] if i + 1 < len(words) else ""
            if name == "--gres" and (m := re.fullmatch(r"gpu(?::[^:,]+)?:(\d+)", value)):
                slurm.gpus_per_node = int(m.group(1))
            elif name in names and value.isdigit():
                setattr(slurm, names[name], int(value))
    return slurm


class _Evaluator:
    """Runs the commands' assignments in order and finds the launch among them."""

    def __init__(self, env: dict[str, str], overrides: dict[str, str]):
        # "$@" and "$*": a launch script is read as run without arguments.
        self.env, self.overrides = {"@": "", "*": "", **env}, overrides
        self.files: dict[str, str | None] = {}
        self.piped: str | None = None   # a heredoc piped on, for `cat <<EOF | tee FILE`
        self.launches: list[_Found] = []
        self.depth = 0
        self.flow = Flow()
        self.starter: tuple[str, dict[str, str]] | None = None   # of the enclosing `sh -c`
        self.uncertain: dict[str, int] = {}   # variables set under undecided conditions: line
        self.arrays: dict[str, list[str] | None] = {}   # NAME=( ... ): elements, None unknown
        self.superseded: dict[str, int] = {}   # --var names the script sets itself: line
        self.line = 0

    def command(self, cmd: Command, line: int) -> None:
        self.line = line
        chained = self.flow.chained(cmd.sep)
        words, negate = self._keywords(cmd.words)
        mode = min(chained, self.flow.mode())
        if mode == SKIP or not words:
            return  # a skipped command leaves the status as it was
        assignments = list(takewhile(bool, map(_assignment, words)))
        rest = words[len(assignments):]
        # `NAME=v cmd` sets NAME for cmd alone.
        scoped = {a[0]: self.env.get(a[0]) for a in assignments} if rest else {}
        for assignment in assignments:
            self._assign(*assignment, certain=mode == RUN)
        try:
            status = self._run(cmd, rest, line, mode)
        finally:
            for name, old in scoped.items():
                self.env.pop(name, None) if old is None else self.env.__setitem__(name, old)
        self.flow.status = status if status is None or not negate else not status

    def _keywords(self, words: list[list[Part]]) -> tuple[list[list[Part]], bool]:
        """`words` past the leading keywords (if, then, fi, do, ...), which open and close the
        flow's blocks, and whether a `!` negates the command's status."""
        negate = False
        while words and len(words[0]) == 1 and words[0][0].kind == "lit" and \
                not words[0][0].quoted:
            if words[0][0].text == "!":
                negate = not negate
            elif not self.flow.keyword(words[0][0].text):
                break
            words = words[1:]
        return words, negate

    def _run(self, cmd: Command, words: list[list[Part]], line: int, mode: int) -> bool | None:
        if words and self.string(words[0]) in ("export", "declare", "typeset", "local",
                                               "readonly"):
            for word in words[1:]:
                if assignment := _assignment(word):
                    self._assign(*assignment, certain=mode == RUN)
            return True
        if words and (name := self.string(words[0])) in _CHANGERS:
            for var in _changed(name, [f for w in words[1:] for f in self.fields(w)]):
                self._change(var, forget=name == "unset" and mode == RUN)
            return True
        piped, self.piped = self.piped, None
        fields = [f for w in words for f in self.fields(w)]
        if cmd.heredoc is not None and cmd.output is not None:
            self._write(self.string(cmd.output), self.string(cmd.heredoc), mode)
        elif cmd.heredoc is not None:
            self.piped = self.string(cmd.heredoc)
        if piped is not None and cmd.sep == "|" and fields and fields[0] == "tee":
            for name in fields[1:]:
                if not name.startswith("-"):
                    self._write(name, piped, mode)
        if not fields:
            return True
        if os.path.basename(fields[0]) not in _NOT_LAUNCHES:
            self._find_launch(fields, line)
        return test_status(fields[0], fields[1:])

    def _assign(self, name: str, append: bool, parts: list[Part], certain: bool = True) -> None:
        if len(parts) == 1 and parts[0].kind == "array":
            return self._assign_array(name, append, parts[0].items, certain)
        self.arrays.pop(name, None)
        value = self.string(parts)
        if unresolved_in(value) is not None and name in self.overrides:
            value = self.overrides[name]
        elif name in self.overrides and certain and not append:
            self.superseded.setdefault(name, self.line)
        value = self.env.get(name, "") + value if append else value
        if not certain and value != self.env.get(name):
            # Set only under a condition this reader cannot decide: not known afterwards.
            if name not in self.overrides:
                self.uncertain.setdefault(name, self.line)
            value = self.overrides.get(name, mark("$" + name))
        self.env[name] = value

    def _write(self, name: str, text: str, mode: int) -> None:
        """A file the script writes; under a condition this reader cannot decide, its text is
        not known afterwards (unless the same text was written before)."""
        key = os.path.normpath(name)
        self.files[key] = text if mode == RUN or self.files.get(key) == text else None

    def _change(self, name: str, forget: bool) -> None:
        """A variable a command changes other than by NAME=VALUE (_CHANGERS): undefined after
        `unset`, otherwise set to what this reader does not compute (a --var gives it)."""
        if forget:
            self.env.pop(name, None)
        elif name in self.overrides:
            self.env[name] = self.overrides[name]
        else:
            self.uncertain.setdefault(name, self.line)
            self.env[name] = mark("$" + name)

    def _assign_array(self, name: str, append: bool, words: list[list[Part]],
                      certain: bool) -> None:
        elements = [f for w in words for f in self.fields(w)]
        old = _array(self.arrays, self.env, name)
        if append:
            elements = None if old is None else old + elements
        if elements is None or not certain and elements != old:
            # Set under a condition this reader cannot decide (or appended to an unknown
            # array): not known afterwards, unless --var gives it (its words the elements).
            if name not in self.overrides:
                self.uncertain.setdefault(name, self.line)
                self.arrays[name], self.env[name] = None, mark("$" + name)
                return
            elements = self._split(self.overrides[name])
        self.arrays[name] = elements
        self.env[name] = elements[0] if elements else ""   # $NAME is its first element

    def string(self, parts: list[Part]) -> str:
        return "".join(self._single(p) for p in parts)

    def _single(self, part: Part) -> str:
        if part.kind == "lit":
            return part.text
        if part.kind == "var":
            return self._lookup(part)
        if part.kind == "arith":
            return _arith(part.text, self.env)
        return mark(part.text)

    def _lookup(self, part: Part) -> str:
        if part.op in ("[@]", "[*]"):
            elements = _array(self.arrays, self.env, part.text)
            return mark("$" + part.text) if elements is None else " ".join(elements)
        value = self.env.get(part.text)
        if part.default is not None and (value is None or not value and ":" in part.op):
            value = self.string(part.default)
            if "=" in part.op:  # ${NAME:=default} assigns it too
                self.env[part.text] = value
            return value
        return mark("$" + part.text) if value is None else value

    def fields(self, parts: list[Part]) -> list[str]:
        """A word after expansion: unquoted variables split into several (and their quotes
        honoured), everything else joined."""
        out: list[str] = []
        cur: str | None = None
        if len(parts) == 1 and parts[0].kind == "var" and parts[0].text in "@*" and \
                not self._lookup(parts[0]):
            return out  # "$@" without arguments is no word at all
        for part in parts:
            # ${A[@]}, and an unquoted ${A[*]}: each element its own word ("${A[*]}": one).
            if part.kind == "var" and (part.op == "[@]" or part.op == "[*]" and
                                       not part.quoted) and \
                    (elements := _array(self.arrays, self.env, part.text)) is not None:
                for k, element in enumerate(elements):
                    if k:
                        out.append(cur)
                        cur = None
                    cur = (cur or "") + element
                continue
            if part.kind != "var" or part.quoted:
                cur = (cur or "") + self._single(part)
                continue
            value = self._lookup(part)
            sub = self._split(value)
            lead, trail = value[:1].isspace(), value[-1:].isspace()
            if (lead or not sub and trail) and cur is not None:
                out.append(cur)
                cur = None
            for k, word in enumerate(sub):
                if k:
                    out.append(cur)
                    cur = None
                cur = (cur or "") + word
            if trail and cur is not None:
                out.append(cur)
                cur = None
        if cur is not None:
            out.append(cur)
        return out

    def _split(self, value: str) -> list[str]:
        if not value.strip():
            return []
        self.depth += 1
        if self.depth > _MAX_DEPTH:
            raise UserError(f"variables expand into themselves without end (at {value[:60]!r})")
        try:
            words = Lexer(value, words_only=True).commands()
            return [f for c in words for w in c.words for f in self.fields(w)]
        finally:
            self.depth -= 1

    def _find_launch(self, fields: list[str], line: int) -> None:
        for k, word in enumerate(fields):
            base = os.path.basename(show(word))
            if base in ("bash", "sh"):
                options = fields[k + 1:]
                at = next((j for j, f in enumerate(options) if f == "-c"), None)
                if at is not None and at + 1 < len(options) and \
                        all(f.startswith("-") for f in options[:at]):
                    return self._nested(options[at + 1], line, _starter(fields[:k]))
            if base in ("torchrun", "deepspeed"):
                return self.launches.append(_launcher(base, fields, k + 1, line))
            if base.startswith("python") and k + 1 < len(fields):
                return self._python(fields, k, line)

    def _nested(self, script: str, line: int, starter) -> None:
        self.depth += 1
        if self.depth > _MAX_DEPTH:
            raise UserError(f"line {line}: bash -c nests too deep")
        # `srun sh -c "python pretrain_gpt.py ..."`: srun starts its tasks, each one a shell.
        outer, self.starter = self.starter, self.starter or starter
        try:
            for command in Lexer(script, first_line=line).commands():
                self.command(command, line)
        finally:
            self.depth -= 1
            self.starter = outer

    def _python(self, fields: list[str], k: int, line: int) -> None:
        j = k + 1
        while j < len(fields) and fields[j].startswith("-") and fields[j] != "-m":
            j += 2 if fields[j] in ("-X", "-W") else 1
        if j + 1 < len(fields) and fields[j] == "-m":
            module = fields[j + 1]
            if module in _TORCHRUN:
                self.launches.append(_launcher(module, fields, j + 2, line))
            elif module == "deepspeed.launcher.runner":
                self.launches.append(_launcher("deepspeed", fields, j + 2, line))
            return
        name = os.path.basename(show(fields[j])) if j < len(fields) else ""
        if name.endswith(".py") and name.startswith(("pretrain", "finetune")):
            starter = self.starter or _starter(fields[:k])
            self.launches.append(_Found(None, {}, fields[j], fields[j + 1:], line, starter))



def _launcher(launcher: str, fields: list[str], j: int, line: int) -> _Found:
    """The launch `launcher` (torchrun, deepspeed) makes of `fields`, its options from `j`."""
    options: dict[str, str] = {}
    while j < len(fields) and fields[j].startswith("-"):
        name, eq, value = fields[j].partition("=")
        name = "--" + name.lstrip("-").replace("-", "_") if name.startswith("--") else name
        if eq or name in _LAUNCHER_FLAGS:
            options[name], j = value, j + 1
        else:
            options[name], j = (fields[j + 1] if j + 1 < len(fields) else ""), j + 2
    if j >= len(fields):
        raise UserError(f"line {line}: {launcher} runs no program")
    return _Found(launcher, options, fields[j], fields[j + 1:], line, None)


def _arith(text: str, env: dict[str, str]) -> str:
    """`$(( text ))` over `env`, or a marker naming what it cannot compute."""
    missing = []

    def value(m: re.Match) -> str:
        name = next(g for g in m.groups() if g)
        v = env.get(name, "")
        if name in env and not v.strip():
            v = "0"  # set and empty: bash's arithmetic reads it as 0 (an unset one is unknown)
        if not v.strip().lstrip("-").isdigit():
            missing.append(name)
        return f"({v.strip() or 0})"

    expr = re.sub(r"\$\{(\w+)\}|\$(\w+)|\b([A-Za-z_]\w*)\b", value, text)
    if missing:
        return mark("$" + missing[0])
    try:
        return str(arith(ast.parse(expr.strip(), mode="eval")))
    except (SyntaxError, ValueError, ZeroDivisionError):
        return mark(f"$(({text}))")


def _array(arrays: dict, env: dict, name: str) -> list[str] | None:
    """The elements of array `name` (a plain variable is one), or None when unknown."""
    if name in arrays:
        return arrays[name]
    value = env.get(name)
    return None if value is None or unresolved_in(value) is not None else [value]


def _starter(fields: list[str]) -> tuple[str, dict[str, str]] | None:
    """The srun or MPI launcher among the words before python, with the task counts its options
    give (`-n 16`, `-n16`, `--ntasks=16`, `-np 16`, ...: the names of _STARTER_COUNTS)."""
    for k, word in enumerate(fields):
        name = os.path.basename(show(word))
        if name not in _STARTERS:
            continue
        counts = _STARTER_COUNTS["srun" if name == "srun" else "mpi"]
        options: dict[str, str] = {}
        rest = fields[k + 1:]
        for i, f in enumerate(rest):
            opt, eq, value = f.partition("=")
            if not eq and f[:2] in counts and f[2:].isdigit():
                opt, value = f[:2], f[2:]      # -n16, -N4
            elif not eq:
                value = rest[i + 1] if i + 1 < len(rest) else ""
            if opt in counts:
                options[counts[opt]] = value
        return name, options
    return None


# Commands that set or unset variables without NAME=VALUE, and their options that take a value.
_CHANGERS = {"unset": "", "let": "", "((": "", "printf": "", "read": "adinNptu",
             "readarray": "dnOsuCc", "mapfile": "dnOsuCc"}
_ARITH_ASSIGN = re.compile(r"([A-Za-z_]\w*)\s*(?:<<|>>|[-+*/%&|^])?=(?!=)|"
                           r"([A-Za-z_]\w*)\s*(?:\+\+|--)|(?:\+\+|--)\s*([A-Za-z_]\w*)")


def _changed(command: str, args: list[str]) -> list[str]:
    """The variables `command args` (one of _CHANGERS) sets or unsets."""
    if command in ("let", "(("):
        return [next(g for g in m.groups() if g) for m in _ARITH_ASSIGN.finditer(" ".join(args))]
    if command == "printf":
        return [args[i + 1] for i, a in enumerate(args[:-1]) if a == "-v"][:1]
    if command == "unset":
        return [] if "-f" in args else [a for a in args if not a.startswith("-")]
    names, takes, i = [], _CHANGERS[command], 0
    while i < len(args):
        a = args[i]
        if a.startswith("-") and len(a) > 1:
            if a[-1] in takes and len(a) == 2:
                if a == "-a" and i + 1 < len(args):   # read -a NAME: an array
                    names.append(args[i + 1])
                i += 1
        else:
            names.append(a)
        i += 1
    if command != "read":   # readarray/mapfile: one array, MAPFILE by default
        names = names[-1:] or ["MAPFILE"]
    return [n for n in names if re.fullmatch(r"[A-Za-z_]\w*", n)]


def _assignment(word: list[Part]):
    if not word or word[0].kind != "lit" or word[0].quoted:
        return None
    m = ASSIGNMENT.match(word[0].text)
    if not m:
        return None
    rest = word[0].text[m.end():]
    return m.group(1), bool(m.group(2)), ([Part("lit", rest, False)] if rest else []) + word[1:]


def _count(value: str | None, what: str, default: int | None) -> tuple[int | None, str]:
    if value is None:
        return default, ""
    if (name := unresolved_in(value)) is not None:
        return None, f"{what} is {show(value)}, and {name} is not defined (pass --var)"
    if re.fullmatch(r"\d+(:\d+)?", value) and len(set(value.split(":"))) == 1:
        return int(value.split(":")[0]), ""
    return None, f"{what} is {value!r}, not a fixed number"


def _started(name: str, options: dict[str, str], slurm: _Slurm, where: str
             ) -> tuple[int | None, str]:
    """The processes srun or an MPI launcher starts: its own counts (-n, or -N times
    --ntasks-per-node, either from srun or from #SBATCH), over the allocation's."""
    counts = {}
    for what, value in options.items():
        counts[what], why = _count(value, f"{name} {what}", None)
        if counts[what] is None:
            return None, f"{why} ({where})"
    if name != "srun":
        if "ntasks" in counts:
            return counts["ntasks"], f"{name} -n {counts['ntasks']} ({where})"
        return None, f"{name} without -n/-np starts as many processes as its hosts give ({where})"
    if "ntasks" in counts:
        return counts["ntasks"], f"srun -n {counts['ntasks']} ({where})"
    if counts:  # srun's -N or --ntasks-per-node, the rest from the allocation
        nodes = counts.get("nodes", slurm.nodes)
        per_node = counts.get("ntasks_per_node", slurm.ntasks_per_node)
        if nodes and per_node:
            return nodes * per_node, f"srun: {nodes} node(s) x {per_node} task(s) per node, " \
                                     f"srun's options over #SBATCH ({where})"
        return None, f"srun starts as many processes as SLURM gives it ({where})"
    tasks = slurm.ntasks or (slurm.nodes and slurm.ntasks_per_node and
                             slurm.nodes * slurm.ntasks_per_node)
    if not tasks:
        return None, f"srun starts as many processes as SLURM gives it ({where})"
    return tasks, f"srun tasks from #SBATCH ({where})"


def _world(found: _Found, slurm: _Slurm) -> tuple[int | None, str]:
    o, where = found.options, f"line {found.line}"
    if found.launcher in _TORCHRUN:
        nodes, why_nodes = _count(o.get("--nnodes"), "--nnodes", 1)
        procs, why_procs = _count(o.get("--nproc_per_node"), "--nproc_per_node", 1)
        how = f"{found.launcher} --nnodes {show(o.get('--nnodes', 1))} --nproc_per_node " \
              f"{show(o.get('--nproc_per_node', 1))}, {where}"
    elif found.launcher == "deepspeed":
        if any(k in o for k in ("--hostfile", "--include", "--exclude")):
            return None, f"deepspeed with a hostfile, --include or --exclude ({where})"
        nodes, why_nodes = _count(o.get("--num_nodes"), "--num_nodes", None)
        gpus = o.get("--num_gpus", o.get("--num_accelerators"))
        procs, why_procs = _count(gpus, "--num_gpus", None)
        if nodes is None and not why_nodes or procs is None and not why_procs:
            return None, f"deepspeed without --num_nodes and --num_gpus uses every GPU it " \
                         f"finds ({where})"
        how = f"deepspeed --num_nodes {nodes} --num_gpus {procs}, {where}"
    elif found.starter is None:
        return 1, f"python runs one process ({where})"
    else:
        return _started(*found.starter, slurm, where)
    if nodes is None or procs is None:
        return None, why_nodes or why_procs
    return nodes * procs, f"{nodes} node(s) x {procs} process(es) per node ({how})"
