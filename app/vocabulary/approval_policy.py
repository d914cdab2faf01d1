"""Approval before a tool call (docs/approvals.md): the words every layer shares.

- A **policy** says which tool calls wait for a user's approval: `{"tools": [...],
  "classes": [...]}` (tool names, idempotency classes); a call needs approval when its tool is
  named or its class is listed. `{}` (both empty) is an explicit "none", which overrides a
  session's or the process default. The process default is read from
  `TURNSTILE_APPROVAL_REQUIRED` (`parse_default`: comma-separated tool names and
  `class:<safe|keyed|unsafe>` items).
- A **request** is what a waiting run shows (`approval_request`): the call's id, tool,
  arguments, idempotency class, step and the tool's JSON schema (to edit against).
- A **decision** answers it: approve, reject (with a reason the model is told) or edit (with
  arguments checked against that schema: `schema_errors`).

The schema check covers the JSON Schema keywords tools use (type, properties, required,
additionalProperties, enum, const, minimum, maximum, exclusiveMinimum, exclusiveMaximum,
minLength, maxLength, pattern, items, minItems, maxItems); other keywords are not checked here
(the tool still refuses arguments it cannot use, which fails the run as a tool error).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from app.vocabulary.records import JSON

CLASSES = ("safe", "keyed", "unsafe")
DECISIONS = ("approve", "reject", "edit")
MAX_REASON_CHARS = 2000
REJECTED_MESSAGE = "The user refused this tool call; it was not made."


@dataclass(frozen=True)
class ApprovalPolicy:
    tools: frozenset[str] = frozenset()
    classes: frozenset[str] = frozenset()

    def needs(self, tool: str, idempotency_class: str) -> bool:
        return tool in self.tools or idempotency_class in self.classes

    def to_json(self) -> dict[str, JSON]:
        return {"tools": sorted(self.tools), "classes": sorted(self.classes)}

    @classmethod
    def of(cls, value: JSON) -> ApprovalPolicy | None:
        """The policy stored as JSON (a run's or a session's column), None for NULL."""
        if not isinstance(value, dict):
            return None
        tools = value.get("tools") or []
        classes = value.get("classes") or []
        return cls(
            tools=frozenset(str(t) for t in tools if isinstance(tools, list)),
            classes=frozenset(str(c) for c in classes if isinstance(classes, list)),
        )


NONE = ApprovalPolicy()


def parse_default(text: str) -> ApprovalPolicy:
    """TURNSTILE_APPROVAL_REQUIRED: comma-separated tool names and `class:<class>` items, e.g.
    `http_request,class:unsafe`; empty: no call needs approval. ValueError names a bad item."""
    tools: set[str] = set()
    classes: set[str] = set()
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        if item.startswith("class:"):
            klass = item.removeprefix("class:").strip()
            if klass not in CLASSES:
                raise ValueError(f"{item!r}: an idempotency class is one of {', '.join(CLASSES)}")
            classes.add(klass)
        elif re.fullmatch(r"[A-Za-z0-9_.\-]{1,128}", item):
            tools.add(item)
        else:
            raise ValueError(f"{item!r} is not a tool name (letters, digits, _ . -)")
    return ApprovalPolicy(frozenset(tools), frozenset(classes))


def call_id_of(run_id: UUID | str, step: int) -> str:
    """A call's id in an approval request: unique across runs (an approval meant for one run's
    call can never answer another's), stable across recoveries (the run and its step)."""
    return f"{run_id}.{step}"


def effective(own: JSON, session: JSON, default: ApprovalPolicy | None) -> ApprovalPolicy:
    """The run's own policy overrides its session's, which overrides the process default."""
    for value in (own, session):
        policy = ApprovalPolicy.of(value)
        if policy is not None:
            return policy
    return default or NONE


# --- the schema check -----------------------------------------------------------------------
_TYPES: dict[str, Any] = {
    "object": dict,
    "array": list,
    "string": str,
    "boolean": bool,
    "null": type(None),
}


def _is(value: JSON, kind: str) -> bool:
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer()
        )
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    expected = _TYPES.get(kind)
    return expected is not None and isinstance(value, expected)


def schema_errors(
    value: JSON, schema: JSON, where: tuple[str | int, ...] = ()
) -> list[dict[str, Any]]:
    """Where `value` breaks `schema` (the keywords listed in the module's docstring), as
    problem+json `errors` items (`loc`, `msg`, `type`); [] when it conforms."""
    if not isinstance(schema, dict):
        return []
    errors: list[dict[str, Any]] = []

    def fail(msg: str, kind: str, at: Iterable[str | int] = where) -> None:
        errors.append({"loc": ["body", "approval", "args", *at], "msg": msg, "type": kind})

    kinds = schema.get("type")
    if isinstance(kinds, str):
        kinds = [kinds]
    if isinstance(kinds, list) and kinds and not any(_is(value, str(k)) for k in kinds):
        fail(f"must be of type {' or '.join(str(k) for k in kinds)}", "type")
        return errors
    if "enum" in schema and isinstance(schema["enum"], list) and value not in schema["enum"]:
        fail(f"must be one of {schema['enum']!r}", "enum")
    if "const" in schema and value != schema["const"]:
        fail(f"must be {schema['const']!r}", "const")
    if isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value)
        for keyword in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            limit = schema.get(keyword)
            if not isinstance(limit, int | float) or isinstance(limit, bool):
                continue
            broken = {
                "minimum": number < limit,
                "maximum": number > limit,
                "exclusiveMinimum": number <= limit,
                "exclusiveMaximum": number >= limit,
            }[keyword]
            if broken:
                fail(f"{keyword} is {limit}", keyword)
    if isinstance(value, str):
        if isinstance(schema.get("minLength"), int) and len(value) < schema["minLength"]:
            fail(f"must have at least {schema['minLength']} characters", "minLength")
        if isinstance(schema.get("maxLength"), int) and len(value) > schema["maxLength"]:
            fail(f"must have at most {schema['maxLength']} characters", "maxLength")
        pattern = schema.get("pattern")
        if isinstance(pattern, str):
            try:
                if re.search(pattern, value) is None:
                    fail(f"must match {pattern!r}", "pattern")
            except re.error:
                pass  # a pattern Python cannot read is not the user's mistake
    if isinstance(value, list):
        if isinstance(schema.get("minItems"), int) and len(value) < schema["minItems"]:
            fail(f"must have at least {schema['minItems']} items", "minItems")
        if isinstance(schema.get("maxItems"), int) and len(value) > schema["maxItems"]:
            fail(f"must have at most {schema['maxItems']} items", "maxItems")
        items = schema.get("items")
        if isinstance(items, dict):
            for index, item in enumerate(value):
                errors.extend(schema_errors(item, items, (*where, index)))
    if isinstance(value, dict):
        properties = schema.get("properties")
        properties = properties if isinstance(properties, dict) else {}
        required = schema.get("required")
        for name in required if isinstance(required, list) else []:
            if name not in value:
                fail("field required", "missing", (*where, str(name)))
        extra = schema.get("additionalProperties", True)
        for name, item in value.items():
            if name in properties:
                errors.extend(schema_errors(item, properties[name], (*where, name)))
            elif extra is False:
                fail("no such field in the tool's arguments", "extra_forbidden", (*where, name))
            elif isinstance(extra, dict):
                errors.extend(schema_errors(item, extra, (*where, name)))
    return errors
