"""A user's code named in the config: ``package.module:name`` or ``path/to/file.py:name``.

Rewards, environments and tools are loaded this way, before any rank starts (so that a typo is an
error that names it) and again inside the worker processes that run them.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any


def load_object(spec: str, what: str) -> Any:
    """The object ``spec`` names; ``what`` (e.g. "reward function") words the errors. Modules in
    the working directory are found."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} {spec!r} must look like 'module:name' or 'file.py:name'")
    if module_name.endswith(".py"):
        module = _module_from_file(module_name, spec, what)
    else:
        if os.getcwd() not in sys.path:
            sys.path.append(os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except Exception as e:  # any failure while importing the user's module is the user's error
            raise ValueError(f"{what} {spec!r}: cannot import module {module_name!r}: "
                             f"{type(e).__name__}: {e}") from e
    obj = getattr(module, attr, None)
    if obj is None:
        raise ValueError(f"{what} {spec!r}: module {module_name!r} has no attribute {attr!r}")
    return obj


def _module_from_file(file: str, spec: str, what: str):
    path = Path(file)
    if not path.is_file():
        raise ValueError(f"{what} {spec!r}: file {file!r} does not exist")
    name = f"shardflow_user_{path.stem}"
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(path.resolve()):
        return sys.modules[name]  # the same file, already loaded in this process
    module_spec = importlib.util.spec_from_file_location(name, path.resolve())
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # classes defined in it pickle by this name, and stay one class
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise ValueError(f"{what} {spec!r}: cannot import {file!r}: {type(e).__name__}: {e}") from e
    return module
