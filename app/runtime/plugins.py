"""Your own agents and tools: `TURNSTILE_PLUGINS=package.module:register,...` names callables
that receive the registry at start and add to it (see docs/runtime.md)."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from app.runtime.executor import Registry

Plugin = Callable[[Registry], None]


class PluginError(RuntimeError):
    """A plugin named in the settings could not be loaded."""


def load_plugins(spec: str, registry: Registry) -> None:
    for entry in (part.strip() for part in spec.split(",")):
        if not entry:
            continue
        module_name, _, attribute = entry.partition(":")
        if not module_name or not attribute:
            raise PluginError(f"plugin {entry!r} must look like 'package.module:function'")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise PluginError(f"cannot import plugin module {module_name!r}: {exc}") from None
        register = getattr(module, attribute, None)
        if not callable(register):
            raise PluginError(f"plugin {entry!r}: {attribute!r} is not a function in the module")
        register(registry)
