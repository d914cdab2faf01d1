"""The TypeScript client's API types (src/openapi.ts), generated from the server's OpenAPI
document by openapi-typescript: `python clients/typescript/scripts/generate_types.py` (after
`npm ci` in clients/typescript; `make openapi-types` does both), or `--check` to fail when the
committed file is not what the current server's document gives
(tests/clients/test_typescript_client.py).

The document is the shapes only: descriptions, summaries and examples are left out, so the file
changes when a route or a field does, not when a sentence of the API docs does.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent
TARGET = HERE / "src" / "openapi.ts"
GENERATOR = HERE / "node_modules" / ".bin" / "openapi-typescript"
PROSE = {"description", "summary", "examples", "example"}
HEADER = (
    "// Generated from the Turnstile server's OpenAPI document by scripts/generate_types.py\n"
    "// (openapi-typescript): do not edit; run `make openapi-types` after changing the API.\n"
)


def shapes(node: Any, *, names: bool = False) -> Any:
    """The document without its prose. `names`: `node` maps property names to schemas (a
    property *called* `description` is kept)."""
    if isinstance(node, list):
        return [shapes(item) for item in node]
    if not isinstance(node, dict):
        return node
    if names:
        return {name: shapes(schema) for name, schema in node.items()}
    return {
        key: shapes(value, names=key == "properties")
        for key, value in node.items()
        if key not in PROSE
    }


def document() -> dict[str, Any]:
    sys.path.insert(0, str(HERE.parent.parent))
    from app.config import Settings
    from app.main import create_app

    app = create_app(Settings(database_url="postgresql://nobody@127.0.0.1:1/none"))
    return shapes(app.openapi())  # type: ignore[no-any-return]


def generated() -> str:
    if not GENERATOR.exists():
        raise SystemExit(f"{GENERATOR} is missing: run `npm ci` in {HERE}")
    with tempfile.TemporaryDirectory() as folder:
        source, output = Path(folder) / "openapi.json", Path(folder) / "openapi.ts"
        source.write_text(json.dumps(document(), indent=1, sort_keys=True), encoding="utf-8")
        subprocess.run(
            [str(GENERATOR), str(source), "--output", str(output)],
            check=True,
            capture_output=True,
        )
        return HEADER + output.read_text(encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if src/openapi.ts is stale")
    args = parser.parse_args()
    text = generated()
    if args.check:
        if not TARGET.exists() or TARGET.read_text(encoding="utf-8") != text:
            raise SystemExit(
                f"{TARGET.relative_to(HERE.parent.parent)} is not what the server's OpenAPI "
                "document gives: run `make openapi-types` and commit it"
            )
        return
    TARGET.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
