"""The topology file, fuzzed: any YAML text or document either parses into a Topology or is refused with a
TopologyError that names what is wrong; never another exception, never a hang."""

from __future__ import annotations

import typing

import msgspec
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.topology import Topology, TopologyError
from cluster.topology_file import parse_topology


def _field_names(cls: type = Topology, seen: set[str] | None = None) -> set[str]:
    """Every field name of the topology's structs: keys the fuzzer uses so documents get past the top."""
    seen = set() if seen is None else seen
    for name, hint in typing.get_type_hints(cls).items():
        seen.add(name)
        for inner in (hint, *typing.get_args(hint)):
            if isinstance(inner, type) and issubclass(inner, msgspec.Struct) and inner is not cls:
                _field_names(inner, seen)
    return seen


KEYS = [*sorted(_field_names()), "prefill", "decode", "role", "gpu"]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30),
    st.sampled_from(["auto", "0", "0-3", "bfloat16", "float32", "builtin:tiny-llama", "127.0.0.1:6379"]),
)
documents = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=10)), children, max_size=6),
    ),
    max_leaves=40,
)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def parses_or_names_the_problem(data: str | dict) -> None:
    try:
        topo = parse_topology(data)
    except TopologyError as exc:
        assert str(exc) and "Traceback" not in str(exc)
        return
    assert isinstance(topo, Topology)


@FUZZ
@given(doc=documents)
def test_any_document(doc: object) -> None:
    parses_or_names_the_problem(
        yaml.safe_dump({"pools": doc}) if not isinstance(doc, dict) else yaml.safe_dump(doc)
    )


@FUZZ
@given(text=st.text(max_size=300))
def test_any_text(text: str) -> None:
    parses_or_names_the_problem(text)


def test_a_deeply_nested_document_is_refused_not_crashed() -> None:
    parses_or_names_the_problem("a: " + "[" * 5000 + "]" * 5000)
    parses_or_names_the_problem(
        "pools: {decode: {engine: {extra: " + "{x: " * 2000 + "1" + "}" * 2000 + "}}}"
    )
