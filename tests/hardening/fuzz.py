"""Hypothesis strategies that fill any kvwire request message field by field, from its descriptor.

Every field of every (nested) message is either left unset or given a value of its wire type: ints
over the type's whole range, unknown enum numbers, any unicode text, repeated fields, oneofs. A few
fields get a bias towards the cheap end (``max_tokens``), so thousands of cases fit in CI time
without losing the extremes.
"""
from __future__ import annotations

from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor as F
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

VOCAB = 4096  # the embedded model's vocabulary

_INT_RANGE = {F.TYPE_INT32: (-(2**31), 2**31 - 1), F.TYPE_SINT32: (-(2**31), 2**31 - 1),
              F.TYPE_UINT32: (0, 2**32 - 1), F.TYPE_INT64: (-(2**63), 2**63 - 1),
              F.TYPE_SINT64: (-(2**63), 2**63 - 1), F.TYPE_UINT64: (0, 2**64 - 1)}


def token_ids() -> st.SearchStrategy[int]:
    return st.one_of(st.integers(0, VOCAB - 1), st.integers(0, 2**32 - 1))


def sane_float(name: str) -> st.SearchStrategy[float]:
    """Finite floats, the edges included, but not the poison values (NaN, inf, tiny temperatures):
    ``poison_float`` covers those."""
    if name == "temperature":
        return st.one_of(st.just(0.0), st.floats(-1e30, -1e-30), st.floats(0.05, 1e6))
    return st.one_of(st.floats(0.0, 1.0), st.floats(-1e30, 1e30, allow_nan=False, allow_infinity=False))


def poison_float(name: str) -> st.SearchStrategy[float]:
    return st.one_of(st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e-45, 3e-38, 1e-30, 5e-324]),
                     st.floats(allow_nan=True, allow_infinity=True))


OVERRIDES = {
    # Valid-and-long generations cost seconds and teach nothing new; the extremes stay in.
    "max_tokens": st.one_of(st.integers(0, 4), st.integers(-(2**31), -1), st.integers(100_000, 2**31 - 1)),
    "prompt_token_ids": st.lists(token_ids(), max_size=64),
    "stop_token_ids": st.lists(token_ids(), max_size=8),
    "stops": st.one_of(st.lists(st.text(max_size=8), max_size=4), st.lists(st.text(max_size=300), max_size=20)),
    "request_id": st.one_of(st.just(""), st.text(max_size=64), st.just("same-id")),
    "num_speculative_tokens": st.one_of(st.integers(0, 20), st.integers(0, 2**32 - 1)),
    "logit_bias": st.dictionaries(token_ids(), st.one_of(st.floats(-200, 200), sane_float("logit_bias")), max_size=8),
    "min_tokens": st.one_of(st.integers(0, 4), st.integers(0, 2**32 - 1)),
}


# Unset, max_tokens means 128 tokens: seconds per case on a CPU, and the default path is tested elsewhere.
ALWAYS_SET = {"max_tokens"}


@st.composite
def message(draw, cls, poison: bool = False):
    msg = cls()
    desc = cls.DESCRIPTOR
    chosen = {}
    for oneof in desc.oneofs:
        if not oneof.name.startswith("_"):  # a real oneof (proto3 `optional` makes "_name" ones)
            chosen[oneof.name] = draw(st.sampled_from([None, *[f.name for f in oneof.fields]]))
    for f in desc.fields:
        real_oneof = f.containing_oneof is not None and not f.containing_oneof.name.startswith("_")
        if real_oneof and chosen[f.containing_oneof.name] != f.name:
            continue
        if not real_oneof and f.name not in ALWAYS_SET and draw(st.booleans()):
            continue  # unset
        value = draw(OVERRIDES[f.name] if f.name in OVERRIDES else field(f, poison))
        target = getattr(msg, f.name)
        if _is_map(f):
            target.update(value)
        elif f.type == F.TYPE_MESSAGE:
            if hasattr(target, "add"):
                for v in value:
                    target.add().CopyFrom(v)
            else:
                target.CopyFrom(value)
        elif hasattr(target, "extend") and not isinstance(target, (str, bytes)):
            target.extend(value)
        else:
            setattr(msg, f.name, value)
    return msg


def _is_map(f) -> bool:
    return f.type == F.TYPE_MESSAGE and f.message_type.GetOptions().map_entry


def field(f, poison: bool) -> st.SearchStrategy:
    if _is_map(f):  # map<K, V>: a dict of the entry's key and value types
        entry = f.message_type
        return st.dictionaries(scalar(entry.fields_by_name["key"], poison),
                               scalar(entry.fields_by_name["value"], poison), max_size=8)
    repeated = f.label == F.LABEL_REPEATED if hasattr(f, "label") else f.is_repeated
    one = scalar(f, poison)
    return st.lists(one, max_size=8) if repeated else one


def scalar(f, poison: bool) -> st.SearchStrategy:
    if f.type in _INT_RANGE:
        lo, hi = _INT_RANGE[f.type]
        return st.one_of(st.integers(-2, 64).filter(lambda v: lo <= v <= hi), st.integers(lo, hi))
    if f.type in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        s = (poison_float if poison else sane_float)(f.name)
        return s if f.type == F.TYPE_DOUBLE else s.map(_as_float32)
    if f.type == F.TYPE_BOOL:
        return st.booleans()
    if f.type == F.TYPE_STRING:
        return st.one_of(st.text(max_size=24), st.text(max_size=300))
    if f.type == F.TYPE_BYTES:
        return st.binary(max_size=300)
    if f.type == F.TYPE_ENUM:
        return st.one_of(st.sampled_from([v.number for v in f.enum_type.values]), st.integers(-5, 1000))
    if f.type == F.TYPE_MESSAGE:
        return message(message_factory.GetMessageClass(f.message_type), poison)  # nested types too
    raise NotImplementedError(f"field type {f.type} of {f.full_name}")


def _as_float32(v: float) -> float:
    import struct
    try:
        return struct.unpack("f", struct.pack("f", v))[0]
    except OverflowError:
        return float("inf") if v > 0 else float("-inf")


def fuzz(max_examples: int, **kw) -> settings:
    """Reproducible settings: derandomized, no example database, no deadline."""
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck), print_blob=True, **kw)

