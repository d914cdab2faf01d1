"""Run one Python block of the docs, read from standard input, as `python3 file.py` would run
it (`__name__ == "__main__"`, Ctrl-C raising KeyboardInterrupt as in a terminal), and fail it
when it defines a top-level function that nothing calls: an example that is never called proves
nothing. Usage: `python3 tests/docs/run_python.py PAGE:LINE < block`."""

from __future__ import annotations

import ast
import signal
import sys


def main() -> None:
    # A background job of a non-interactive shell starts with SIGINT ignored; a reader's
    # terminal does not, and Ctrl-C is what the blocks are tried with.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    where = sys.argv[1]
    source = sys.stdin.read()
    tree = ast.parse(source, where)
    defined = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            defined.append(node.name)
            # Each top-level function notes its first call (no tracing: the block runs at speed).
            node.body.insert(0, ast.parse(f"__doctest_called__.add({node.name!r})").body[0])
    ast.fix_missing_locations(tree)
    called: set[str] = set()
    namespace = {"__name__": "__main__", "__doctest_called__": called}
    exec(compile(tree, where, "exec"), namespace)  # noqa: S102 (the repository's own docs)
    never = [name for name in defined if name not in called]
    if never:
        sys.exit(f"{where}: defines {', '.join(never)}() but never calls it")


if __name__ == "__main__":
    main()
