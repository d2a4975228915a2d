"""The subset of JSON Schema that gpufleet/apps/report/report.schema.json uses, for machines without
the jsonschema package (it is not a gpufleet dependency). Tests use jsonschema when present too."""
from __future__ import annotations

from typing import Any

_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def _is(value: Any, name: str) -> bool:
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[name])


def errors(value: Any, schema: dict, root: dict | None = None, path: str = "$") -> list[str]:
    root = root or schema
    if "$ref" in schema:
        node: Any = root
        for part in schema["$ref"].lstrip("#/").split("/"):
            node = node[part]
        out = errors(value, node, root, path)
        rest = {k: v for k, v in schema.items() if k not in ("$ref", "description")}
        return out + (errors(value, rest, root, path) if rest else [])
    out: list[str] = []
    if "oneOf" in schema:
        matches = sum(1 for sub in schema["oneOf"] if not errors(value, sub, root, path))
        if matches != 1:
            out.append(f"{path}: matches {matches} of oneOf")
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_is(value, t) for t in types):
            return out + [f"{path}: {value!r} is not {types}"]
    if "const" in schema and value != schema["const"]:
        out.append(f"{path}: {value!r} != {schema['const']!r}")
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{path}: {value!r} not in {schema['enum']}")
    if "minimum" in schema and _is(value, "number") and value < schema["minimum"]:
        out.append(f"{path}: {value} < {schema['minimum']}")
    if isinstance(value, dict):
        for key in schema.get("required", []):
            if key not in value:
                out.append(f"{path}: missing {key!r}")
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            if key in props:
                out += errors(item, props[key], root, f"{path}.{key}")
            elif extra is False:
                out.append(f"{path}: unexpected key {key!r}")
            elif isinstance(extra, dict):
                out += errors(item, extra, root, f"{path}.{key}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            out += errors(item, schema["items"], root, f"{path}[{i}]")
    return out


def validate(value: Any, schema: dict) -> None:
    problems = errors(value, schema)
    if problems:
        raise AssertionError("JSON does not match the schema:\n" + "\n".join(problems[:20]))
    try:
        import jsonschema
    except ImportError:
        return
    jsonschema.validate(value, schema)
