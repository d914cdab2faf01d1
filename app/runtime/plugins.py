"""Your own agents and tools: `TURNSTILE_PLUGINS=package.module:register,...` names callables
that receive the registry at start and add to it (see docs/runtime.md).

A plugin module is looked for where Python looks (an installed package) and then in the
folder the server was started from, so `TURNSTILE_PLUGINS=my_agent:register turnstile serve`
finds ./my_agent.py with no PYTHONPATH. That folder comes last on the path, never first: a file
there cannot shadow an installed module (the server's own `app` among them)."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI catches PluginError without loading the runtime
    from app.runtime.executor import Registry

Plugin = Callable[["Registry"], None]


class PluginError(RuntimeError):
    """A plugin named in the settings could not be loaded."""


def load_plugins(spec: str, registry: Registry) -> None:
    if spec.strip():
        here = os.getcwd()
        if here not in sys.path and "" not in sys.path:
            sys.path.append(here)
    for entry in (part.strip() for part in spec.split(",")):
        if not entry:
            continue
        module_name, _, attribute = entry.partition(":")
        if not module_name or not attribute:
            raise PluginError(f"plugin {entry!r} must look like 'package.module:function'")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise PluginError(
                f"cannot import plugin module {module_name!r} of TURNSTILE_PLUGINS: {exc} "
                f"(looked in the installed packages and in {os.getcwd()})"
            ) from None
        register = getattr(module, attribute, None)
        if not callable(register):
            raise PluginError(f"plugin {entry!r}: {attribute!r} is not a function in the module")
        register(registry)
