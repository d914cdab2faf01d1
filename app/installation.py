"""Whether the Turnstile installed in this environment is whole.

The server is a tool, installed in an environment of its own (docs/adr/0008). Its import
package is `app`, the name most web projects give their own: a project installed beside it
overwrites its `app/__init__.py` (and any file both have), and uninstalling the project then
deletes them. `problem()` names either case, so the CLI says so in one line before any command
runs, instead of failing later with an ImportError from deep inside a command.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

ADVICE = (
    'install Turnstile in an environment of its own (pipx install turnstile; README, "The '
    'server: a tool in an environment of its own")'
)


def _in_app(file: metadata.PackagePath) -> bool:
    return file.parts[:1] == ("app",) and "__pycache__" not in file.parts


def problem() -> str | None:
    """What is wrong with this environment's Turnstile, or None (also when it runs from a
    checkout, not installed or installed editable: then `app` is the checkout's)."""
    try:
        own = metadata.distribution("turnstile")
    except metadata.PackageNotFoundError:
        return None
    if own.read_text("RECORD") is None:
        return None  # not installed by pip from a wheel: a checkout's own egg-info, say
    # RECORD read as text: parsing every distribution's file list would cost a tenth of a second.
    others = sorted(
        {
            f"{dist.metadata['Name']} {dist.version}"
            for dist in metadata.distributions()
            if "\napp/" in "\n" + (dist.read_text("RECORD") or "")
            and str(dist.metadata["Name"]).lower() != "turnstile"
        }
    )
    if others:
        return (
            f"{', '.join(others)} also installed files into Turnstile's `app` package in this "
            f"environment, so Turnstile's own may have been overwritten: {ADVICE}"
        )
    missing = [
        str(file)
        for file in own.files or []
        if _in_app(file) and not Path(str(own.locate_file(file))).exists()
    ]
    if missing:
        shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        return (
            f"Turnstile's files are missing from this environment ({shown}; another "
            f"distribution's uninstall removes the files it shared): reinstall it, and {ADVICE}"
        )
    return None
