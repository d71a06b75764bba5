"""Reading a topology file: YAML (a key given twice is an error) into the typed `Topology`, checked
(cluster/topology_checks.py); msgspec's errors are told as the field path and a reason."""

from __future__ import annotations

import difflib
import re
import sys
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import msgspec
import yaml

from cluster.topology import Topology, TopologyError
from cluster.topology_checks import validate


def parse_topology(
    data: str | dict[str, Any], source: str = "<topology>", *, allow_empty: bool = True
) -> Topology:
    """Parse YAML text (or an already loaded mapping) into a validated Topology. Empty text means every
    default unless `allow_empty` is false (a file: an empty one is more likely a mistake than a choice;
    `{}` says "all defaults" on purpose)."""
    try:
        raw = yaml.load(data, Loader=_UniqueKeyLoader) if isinstance(data, str) else data
        if raw is None:
            if not allow_empty:
                raise TopologyError("", "the file is empty (`{}` means every default; see deploy/local.yaml)")
            raw = {}
        topo = msgspec.convert(raw, Topology)
        validate(topo)
    except TopologyError as e:
        raise TopologyError(e.path, e.reason, source) from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise TopologyError("", f"invalid YAML{where}: {e.problem or e.context}", source) from None
    except yaml.YAMLError as e:
        raise TopologyError("", f"invalid YAML: {e}", source) from None
    except RecursionError:  # PyYAML's loader recurses once per nesting level
        raise TopologyError("", "the document is nested too deeply to be a topology", source) from None
    except msgspec.ValidationError as e:
        path, reason = _describe_validation_error(str(e), raw)
        raise TopologyError(path, reason, source) from None
    return topo


def load_topology(path: str | Path) -> Topology:
    """A topology file; `-` reads standard input."""
    if str(path) == "-":
        return parse_topology(sys.stdin.read(), source="<stdin>", allow_empty=False)
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise TopologyError("", f"cannot read topology file: {e.strerror}", str(path)) from None
    return parse_topology(text, source=str(path), allow_empty=False)


class _UniqueKeyLoader(yaml.SafeLoader):
    """A safe YAML loader that rejects a key given twice in one mapping (plain YAML keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


# --- msgspec errors -> (field path, reason) -----------------------------------------------------------------

_AT = re.compile(r"^(?P<reason>.*?) - at `(?P<where>.*)`$")
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<field>[^`]*)`$")
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]*)`$")
_ENUM = re.compile(r"^Invalid enum value (?P<value>.*)$")


def _describe_validation_error(message: str, raw: Any) -> tuple[str, str]:
    match = _AT.match(message)
    reason, where = (match["reason"], match["where"]) if match else (message, "$")  # no "at": the root
    if " in `$" in where:  # e.g. "key` in `$.pools.decode.node_labels": a mapping key of the wrong type
        where = where.split("`")[-1]
        reason = f"keys must be strings: {reason}"
    path = where.removeprefix("$").removeprefix(".")
    if path.endswith("[...]"):  # msgspec does not name the mapping key whose value is wrong: find it
        path = _name_mapping_key(path.removesuffix("[...]"), reason, raw)
    if unknown := _UNKNOWN.match(reason):
        field = unknown["field"]
        allowed = _field_names_at(path)
        reason = "unknown key"
        close = difflib.get_close_matches(field, allowed, n=1)
        moved = _RETIRED.get(f"{path}.{field}" if path else field)
        if moved:
            reason += f" ({moved})"
        elif close:
            reason += f" (did you mean {close[0]!r}?)"
        elif allowed:
            reason += f" (allowed: {', '.join(allowed)})"
        path = f"{path}.{field}" if path else field
    elif missing := _MISSING.match(reason):
        path = f"{path}.{missing['field']}" if path else missing["field"]
        reason = "required key is missing"
    elif bad := _ENUM.match(reason):
        values = _literal_values(_hint_at(path))
        reason = f"invalid value {bad['value']}"
        if values:
            reason += f" (allowed: {', '.join(str(v) for v in values)})"
    return path, reason


# Keys earlier versions accepted, and what says the same now.
_RETIRED = {
    "router.long_stall_weight": "removed: router.tpot_slo_ms (a prefill on a decode replica is charged by "
    "the inter-token latency it gives the running sequences)",
    "router.long_local_prefill": "removed: router.mode auto (the default) offers long local prefills, "
    "router.mode disaggregate never prefills on decode while a prefill replica can",
    "router.kv_readback_ttl_s": "moved to pools.kv_readback_ttl_s: the decode engines keep the pins",
}

_MSGSPEC_TYPE_NAMES = {bool: "bool", int: "int", float: "float", str: "str", list: "array", dict: "object"}


def _name_mapping_key(path: str, reason: str, raw: Any) -> str:
    """'pools.decode.node_labels' + "got `bool`" -> 'pools.decode.node_labels.gpu' (the first such value)."""
    node = raw
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", path):
        try:
            node = node[int(part[1:-1])] if part.startswith("[") else node[part]
        except (KeyError, IndexError, TypeError, ValueError):
            return f"{path}[...]"
    got = re.search(r"got `(\w+)`", reason)
    if isinstance(node, dict) and got:
        for key, value in node.items():
            if _MSGSPEC_TYPE_NAMES.get(type(value), "null") == got[1]:
                return f"{path}.{key}"
    return f"{path}[...]"


def _hint_at(path: str) -> Any:
    """The type hint of the field at a msgspec path like 'pools.decode' or 'nodes[0]' (None if unknown)."""
    hint: Any = Topology
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", path):
        if part.startswith("["):
            hint = _unwrap(hint, list)
            continue
        cls = _unwrap(hint, msgspec.Struct)
        hints = typing.get_type_hints(cls, include_extras=True) if isinstance(cls, type) else {}
        if part not in hints:
            return None
        hint = hints[part]
    return hint


def _field_names_at(path: str) -> list[str]:
    """Field names of the Struct at a msgspec path (empty if unknown)."""
    cls = _unwrap(_hint_at(path), msgspec.Struct)
    if isinstance(cls, type) and issubclass(cls, msgspec.Struct):
        return list(cls.__struct_fields__)
    return []


def _literal_values(hint: Any) -> tuple[Any, ...]:
    inner = _unwrap(hint, object)  # strips Annotated and Optional
    return typing.get_args(inner) if typing.get_origin(inner) is Literal else ()


def _unwrap(hint: Any, want: type) -> Any:
    """Strip Optional/Annotated (and list[...] when `want` is list) down to the inner type."""
    origin = typing.get_origin(hint)
    if origin is Annotated:
        return _unwrap(typing.get_args(hint)[0], want)
    if origin in (Union, types.UnionType):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        return _unwrap(inner[0], want) if len(inner) == 1 else hint
    if want is list and origin is list:
        return typing.get_args(hint)[0]
    return hint


# --- semantic checks ----------------------------------------------------------------------------------------
