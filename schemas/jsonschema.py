"""JSON Schema export of every event, and the backward-compatibility check.

The Python classes are the source; ``tapioca schemas export`` writes one JSON Schema
per event into ``schemas/json/`` so services in any language can validate events.
A change is backward compatible when every old property keeps its type and no new
property is required (new fields come with defaults). Field descriptions come from
:mod:`tapioca.schemas.descriptions`.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

from .descriptions import deprecated_fields, field_descriptions
from .envelope import Event, event_types, field_types
from .registry import topic_for

JSON_DIR = Path(__file__).parent / "json"
DIALECT = "https://json-schema.org/draft/2020-12/schema"


def _type_schema(tp: Any, defs: dict[str, Any]) -> dict[str, Any]:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is int:
        return {"type": "integer"}
    if tp is float:
        return {"type": "number"}
    if tp is str:
        return {"type": "string"}
    if tp is bool:
        return {"type": "boolean"}
    if tp is Any:
        return {}
    if origin is list:
        return {"type": "array", "items": _type_schema(args[0], defs)}
    if origin is dict:
        return {"type": "object", "additionalProperties": _type_schema(args[1], defs)}
    if origin is Literal:
        return {"enum": list(args)}
    if origin in (Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        return {"anyOf": [_type_schema(non_none[0], defs), {"type": "null"}]}
    if dataclasses.is_dataclass(tp):
        if tp.__name__ not in defs:
            defs[tp.__name__] = {}  # placeholder against recursion
            defs[tp.__name__] = _object_schema(tp, defs)
        return {"$ref": f"#/$defs/{tp.__name__}"}
    raise TypeError(f"no JSON Schema mapping for {tp}")


def _object_schema(cls: type, defs: dict[str, Any]) -> dict[str, Any]:
    hints = field_types(cls)
    props: dict[str, Any] = {}
    required: list[str] = []
    for f in dataclasses.fields(cls):
        props[f.name] = _type_schema(hints[f.name], defs)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            required.append(f.name)
    out: dict[str, Any] = {"type": "object", "properties": props, "required": required}
    # Readers must tolerate fields added later.
    out["additionalProperties"] = True
    return out


def event_json_schema(cls: type[Event]) -> dict[str, Any]:
    defs: dict[str, Any] = {}
    body = _object_schema(cls, defs)
    body["properties"]["type"] = {"const": cls.TYPE}
    body["properties"]["schema_version"] = {
        "type": "integer", "minimum": 1, "maximum": cls.SCHEMA_VERSION,
    }
    body["required"] = sorted(set(body["required"]) | {"type", "schema_version", "event_id"})
    for name, text in field_descriptions(cls.TYPE).items():
        body["properties"][name]["description"] = text
    for name in deprecated_fields(cls.TYPE):
        body["properties"][name]["deprecated"] = True
    spec = topic_for(cls)
    schema: dict[str, Any] = {
        "$schema": DIALECT,
        "$id": f"https://tapioca.dev/schemas/{cls.TYPE}.json",
        "title": cls.__name__,
        "description": (cls.__doc__ or "").strip().split("\n\n")[0].replace("\n", " "),
        "x-topic": spec.full_name(),
        "x-key": spec.key_field,
        **body,
    }
    if defs:
        schema["$defs"] = defs
    return schema


def all_schemas() -> dict[str, dict[str, Any]]:
    """Every event's schema by wire type name."""
    return {name: event_json_schema(cls) for name, cls in sorted(event_types().items())}


def schema_file(type_name: str, directory: Path = JSON_DIR) -> Path:
    return directory / f"{type_name}.schema.json"


def export(directory: Path = JSON_DIR) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, schema in all_schemas().items():
        path = schema_file(name, directory)
        path.write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n")
        written.append(path)
    return written


def load_exported(directory: Path = JSON_DIR) -> dict[str, dict[str, Any]]:
    out = {}
    for path in sorted(directory.glob("*.schema.json")):
        out[path.name.removesuffix(".schema.json")] = json.loads(path.read_text())
    return out


def _resolve(schema: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    ref = schema.get("$ref")
    if ref:
        return root.get("$defs", {}).get(ref.rsplit("/", 1)[-1], {})
    return schema


def compatibility_problems(
    old: dict[str, Any], new: dict[str, Any], path: str = "", *, old_root=None, new_root=None,
) -> list[str]:
    """Ways in which ``new`` would break a reader or writer of ``old`` events."""
    old_root = old_root or old
    new_root = new_root or new
    old = _resolve(old, old_root)
    new = _resolve(new, new_root)
    problems: list[str] = []
    for key in ("type", "const"):
        if key in old and old.get(key) != new.get(key):
            problems.append(f"{path or '<root>'}: {key} changed from {old.get(key)!r} to {new.get(key)!r}")
    if "enum" in old:
        removed = set(map(str, old["enum"])) - set(map(str, new.get("enum", [])))
        if "enum" not in new or removed:
            problems.append(f"{path}: enum values removed: {sorted(removed)}")
    if "anyOf" in old:
        if "anyOf" not in new:
            problems.append(f"{path}: no longer accepts null")
        else:
            problems += compatibility_problems(
                old["anyOf"][0], new["anyOf"][0], path, old_root=old_root, new_root=new_root)
    if "items" in old:
        problems += compatibility_problems(
            old["items"], new.get("items", {}), f"{path}[]", old_root=old_root, new_root=new_root)
    if isinstance(old.get("additionalProperties"), dict):
        new_ap = new.get("additionalProperties")
        problems += compatibility_problems(
            old["additionalProperties"], new_ap if isinstance(new_ap, dict) else {},
            f"{path}{{}}", old_root=old_root, new_root=new_root)
    if "properties" in old:
        new_props = new.get("properties", {})
        for name, sub in old["properties"].items():
            where = f"{path}.{name}" if path else name
            if name not in new_props:
                problems.append(f"{where}: field removed")
                continue
            problems += compatibility_problems(
                sub, new_props[name], where, old_root=old_root, new_root=new_root)
        added_required = set(new.get("required", [])) - set(old.get("required", []))
        for name in sorted(added_required):
            problems.append(f"{path + '.' if path else ''}{name}: new field is required "
                            "(give it a default)")
    return problems
