"""The state of a conversion (bloomtrain.import_config.mapping): the config being built, the report
of where each key came from, and the arguments, read typed with Megatron's defaults."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from bloomtrain.errors import UserError
from bloomtrain.import_config.megatron_args import BY_DEST, flag_of
from bloomtrain.import_config.bash import show, unresolved_in


@dataclass
class Mapped:
    source: str        # "--lr", "--hidden-dropout (not given: Megatron's default)", "ds_config ..."
    key: str | None    # "optim.lr"; None where bloomtrain has no key (built into its BLOOM)
    value: Any
    note: str = ""


@dataclass
class Skipped:
    source: str        # the argument as given, "--distributed-backend nccl"
    reason: str


@dataclass
class ImportReport:
    mapped: list[Mapped] = field(default_factory=list)
    ignored: list[Skipped] = field(default_factory=list)
    unsupported: list[Skipped] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    world_size: int | None = None


class Conversion:
    """The config being built, the report of where each key came from, and typed access to the
    arguments (given, else Megatron's default) that names the option in every error."""

    def __init__(self, args: Mapping[str, Any], ds_config: Mapping[str, Any] | None,
                 world_size: int | None, saved: bool = False,
                 labels: Mapping[str, str] | None = None):
        self.given = {k: v for k, v in dict(args).items() if v is not None}
        # The args are a checkpoint's Namespace: Megatron has filled in what it derives
        # (train_iters from train_samples, ...), which a launch script never gives.
        self.saved = saved
        # Where an argument came from when it is no command-line flag (an HF import's
        # `config.json n_layer`): the report and the YAML's comments name that instead.
        self.labels = dict(labels or {})
        self.ds = ds_config
        self.config: dict[str, Any] = {}
        self.report = ImportReport()
        self.accounted: set[str] = set()
        self.world = world_size
        self.tp = self.pp = 1
        self.dp: int | None = None
        self.micro = self.gbs = 0   # the batch, once sections.batch has read it

    # ---- reading arguments -----------------------------------------------------------------
    def has(self, dest: str) -> bool:
        return dest in self.given

    def raw(self, dest: str) -> Any:
        if dest in self.given:
            return self.given[dest]
        option = BY_DEST.get(dest)
        return option.default if option else None

    def _checked(self, dest: str) -> Any:
        value = self.raw(dest)
        if (name := unresolved_in(value)) is not None:
            how = f"pass --var {name[1:]}=VALUE" if name[1:].isidentifier() else \
                "write its value into the script"
            raise UserError(f"{self.label(dest)} is {show(value)}, and {name} is not known "
                            f"without running the script (it comes from the environment, from a "
                            f"command import-config does not run, or from an if, case, loop or "
                            f"&&/|| it cannot decide); {how}")
        return value

    def flag(self, dest: str) -> bool:
        value = self._checked(dest)
        return value in (True, "True", "true", "1") if isinstance(value, str) else bool(value)

    def int(self, dest: str, required: bool = False) -> int | None:
        value = self._checked(dest)
        if value is None:
            if required:
                raise UserError(f"the arguments lack {self.label(dest)}, which Megatron requires")
            return None
        if isinstance(value, float) and value.is_integer():
            return int(value)
        try:
            if isinstance(value, bool):
                raise ValueError
            return int(value) if isinstance(value, int) else int(str(value).strip())
        except ValueError:
            raise UserError(f"{self.label(dest)} must be an integer, got {show(value)!r}") from None

    def float(self, dest: str, required: bool = False) -> float | None:
        value = self._checked(dest)
        if value is None:
            if required:
                raise UserError(f"the arguments lack {self.label(dest)}, which Megatron requires")
            return None
        try:
            number = float(value) if not isinstance(value, bool) else math.nan
        except (TypeError, ValueError):
            number = math.nan
        if not math.isfinite(number):
            raise UserError(f"{self.label(dest)} must be a number, got {show(value)!r}")
        return number

    def str(self, dest: str) -> str | None:
        value = self._checked(dest)
        if isinstance(value, (list, tuple)):
            value = " ".join(map(str, value))
        # An enum member from a checkpoint's Namespace (PositionEmbeddingType.alibi) by name.
        return None if value is None else getattr(value, "name", str(value))

    def list(self, dest: str) -> list[str] | None:
        value = self._checked(dest)
        if value is None:
            return None
        items = value if isinstance(value, (list, tuple)) else [value]
        return [str(v) for v in items]

    def label(self, dest: str) -> str:
        return self.labels.get(dest) or flag_of(dest)

    def source(self, dests: str | list[str]) -> str:
        dests = [dests] if isinstance(dests, str) else dests
        if self.labels:  # no launch behind the arguments: name only where values came from
            named = list(dict.fromkeys(self.labels[d] for d in dests if d in self.labels))
            return " + ".join(named) if named else \
                "not in the checkpoint: Megatron-DeepSpeed's default"
        text = " + ".join(flag_of(d) for d in dests)
        if not any(self.has(d) for d in dests):
            text += " (not given: Megatron's default)"
        return text

    # ---- building the config and the report ------------------------------------------------
    def set(self, key: str, value: Any, dests: str | list[str] | None, note: str = "",
            source: str | None = None) -> None:
        for d in [dests] if isinstance(dests, str) else dests or []:
            self.accounted.add(d)
        self.put(key, value)
        self.report.mapped.append(Mapped(source or self.source(dests), key, value, note))

    def put(self, key: str, value: Any) -> None:
        """A config key no argument stands for (model.preset: null under an explicit shape)."""
        section, _, name = key.partition(".")
        if name:
            self.config.setdefault(section, {})[name] = value
        else:
            self.config[section] = value

    def builtin(self, dest: str, note: str) -> None:
        self.accounted.add(dest)
        self.report.mapped.append(Mapped(self.source(dest), None, self.raw(dest), note))

    def given_text(self, dest: str) -> str:
        value = self.raw(dest)
        if value is True or value is False or value is None:
            return self.label(dest)
        return f"{self.label(dest)} {show(value)}"

    def ignore(self, dest: str, reason: str) -> None:
        self.accounted.add(dest)
        if self.has(dest):
            self.report.ignored.append(Skipped(self.given_text(dest), reason))

    def unsupported(self, dest: str, reason: str) -> None:
        self.accounted.add(dest)
        self.report.unsupported.append(Skipped(self.given_text(dest), reason))

    def unchecked(self, what: str) -> None:
        self.report.unchecked.append(what)

    def warn(self, what: str) -> None:
        self.report.warnings.append(what)
