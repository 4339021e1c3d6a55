"""Request bytes -> message, with a precise INVALID_ARGUMENT for bytes that do not parse.

gRPC parses a request before the handler runs; a parse error there (a ``string`` field that is not
UTF-8, a truncated message) leaves as UNKNOWN "Unexpected DecodeError". ``GrpcServer`` therefore
receives requests as raw bytes and parses them in the handler with :func:`parse_request`, which
raises ``errors.InvalidRequest`` naming the offending field (``chat.messages[1].content``).
"""
from __future__ import annotations

from typing import Callable

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

from kvwire import errors

_MAX_DEPTH = 32  # nesting followed when naming the field; deeper input is reported as malformed


def message_class(deserializer: Callable | None) -> type[Message] | None:
    """The message class behind a generated ``request_deserializer`` (``Msg.FromString``)."""
    owner = getattr(deserializer, "__self__", None)
    return owner if isinstance(owner, type) and issubclass(owner, Message) else None


def parse_request(cls: type[Message], data: bytes) -> Message:
    try:
        return cls.FromString(data)
    except DecodeError:
        path = invalid_utf8_field(cls.DESCRIPTOR, data)
        if path is not None:
            raise errors.InvalidRequest(f"{path} is not valid UTF-8; string fields must be UTF-8 text") from None
        raise errors.InvalidRequest(f"the request is not a valid {cls.DESCRIPTOR.name} message "
                                    "(malformed protobuf bytes)") from None


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7


def invalid_utf8_field(desc: Descriptor, data: bytes, prefix: str = "", depth: int = 0) -> str | None:
    """The path of the first ``string`` field in ``data`` (wire bytes of ``desc``) that is not
    UTF-8, or None (none is, or the bytes are malformed some other way)."""
    counts: dict[str, int] = {}
    pos = 0
    try:
        while pos < len(data):
            key, pos = _varint(data, pos)
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:
                _, pos = _varint(data, pos)
            elif wire_type in (1, 5):
                pos += 8 if wire_type == 1 else 4
            elif wire_type == 2:
                size, pos = _varint(data, pos)
                payload, pos = data[pos:pos + size], pos + size
                f = desc.fields_by_number.get(number)
                if f is None or pos > len(data):
                    continue
                name = prefix + f.name
                if _repeated(f):
                    counts[f.name] = counts.get(f.name, 0) + 1
                    name += f"[{counts[f.name] - 1}]"
                if f.type == FieldDescriptor.TYPE_STRING:
                    try:
                        payload.decode("utf-8")
                    except UnicodeDecodeError:
                        return name
                elif f.type == FieldDescriptor.TYPE_MESSAGE and depth < _MAX_DEPTH:
                    found = invalid_utf8_field(f.message_type, payload, name + ".", depth + 1)
                    if found is not None:
                        return found
            else:
                return None  # groups (3, 4) and undefined wire types: malformed, not a UTF-8 problem
    except ValueError:
        return None
    return None


def _repeated(f: FieldDescriptor) -> bool:
    return f.label == FieldDescriptor.LABEL_REPEATED if hasattr(f, "label") else bool(getattr(f, "is_repeated"))
