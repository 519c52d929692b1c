"""Lazy imports for bloomtrain's packages: `lazy_exports` gives a package a module __getattr__
that imports a submodule when one of its names is first used, so that importing a package for
a torch-free part of it (the CLI's parsers, config validation) does not import torch."""
from __future__ import annotations

import importlib


def lazy_exports(package: str, where: dict[str, str]):
    """A package's module `__getattr__` (PEP 562) that imports `package.MODULE` when one of its
    names (`where`: name -> MODULE) is first used. `from bloomtrain.model import BloomForCausalLM`
    works as before, while importing the package for a torch-free module of it (the CLI's
    parsers, config validation) does not import torch."""

    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{where[name]}"), name)

    return __getattr__
