"""The wire contract follows buf's STANDARD lint rules that matter to its users (no buf binary needed).

Checked on the compiled descriptors, so a rule broken by a later edit of kvwire.proto fails here.
"""
from __future__ import annotations

import re

from protos.kvwire.v1 import kvwire_pb2 as pb

FILE = pb.DESCRIPTOR


def _upper_snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).upper()


def _all_enums():
    yield from FILE.enum_types_by_name.values()
    todo = list(FILE.message_types_by_name.values())
    while todo:
        m = todo.pop()
        yield from m.enum_types
        todo.extend(m.nested_types)


def _all_messages():
    todo = list(FILE.message_types_by_name.values())
    while todo:
        m = todo.pop()
        yield m
        todo.extend(m.nested_types)


def test_package_and_path_are_versioned():
    assert FILE.package == "kvwire.v1"
    assert FILE.name == "protos/kvwire/v1/kvwire.proto"


def test_enum_values_are_prefixed_and_zero_is_unspecified():
    enums = list(_all_enums())
    assert {e.name for e in enums} >= {"SpeculativeMode", "KVDtype", "ScaleGranularity", "FinishReason",
                                       "WeightsMode", "KVSource"}
    for e in enums:
        prefix = _upper_snake(e.name) + "_"
        assert e.values[0].number == 0 and e.values[0].name == prefix + "UNSPECIFIED", e.name
        for v in e.values:
            assert v.name.startswith(prefix), f"{e.name}.{v.name} lacks the prefix {prefix}"


def test_every_rpc_has_its_own_request_and_response():
    seen: set[str] = set()
    for service in FILE.services_by_name.values():
        assert service.name.endswith("Service")
        for method in service.methods:
            assert method.input_type.name == f"{method.name}Request", method.full_name
            assert method.output_type.name == f"{method.name}Response", method.full_name
            for t in (method.input_type.full_name, method.output_type.full_name):
                assert t not in seen, f"{t} is used by more than one RPC"
                seen.add(t)
    assert {m.name for m in FILE.services_by_name["DecodeService"].methods} == {"GenerateTokens", "GetPoolStats"}
    assert {m.name for m in FILE.services_by_name["PrefillService"].methods} == {"Prefill", "GetPrefillPoolStats"}
    assert {m.name for m in FILE.services_by_name["TokenizerService"].methods} == \
        {"GenerateText", "Tokenize", "Detokenize"}


def test_repeated_fields_are_plural_and_names_lower_snake():
    for m in _all_messages():
        for f in m.fields:
            assert re.fullmatch(r"[a-z][a-z0-9_]*", f.name), f"{m.name}.{f.name}"
            if f.is_repeated:
                assert f.name.endswith("s"), f"repeated field {m.name}.{f.name} should be plural"


def test_stable_field_numbers_of_the_kv_messages():
    # Peers built from older stubs read these by number; renumbering one corrupts KV silently.
    spec = {f.name: f.number for f in pb.KVPageSpec.DESCRIPTOR.fields}
    assert {k: spec[k] for k in ("block_size", "num_layers", "num_kv_heads", "head_dim", "dtype",
                                 "scale_granularity")} == dict(block_size=1, num_layers=2, num_kv_heads=3,
                                                               head_dim=4, dtype=5, scale_granularity=6)
    chunk = {f.name: f.number for f in pb.KVChunk.DESCRIPTOR.fields}
    assert chunk == dict(layer=1, first_page=2, num_pages=3, k_values=4, v_values=5, k_scales=6,
                         v_scales=7, crc32=8) | {k: v for k, v in chunk.items() if v > 8}
    fp = {f.name: f.number for f in pb.ModelFingerprint.DESCRIPTOR.fields}
    assert 6 not in fp.values()  # was `string quantization`; reserved, never reused
    assert fp["weights_mode"] == 8 and fp["weights_dtype"] == 7 and fp["tokenizer_sha256"] == 5


def test_every_weights_mode_crosses_the_wire_in_the_fingerprint():
    from kvwire.config import WeightsMode
    from kvwire.fingerprint import Fingerprint
    from protos.convert import fingerprint_from_pb, fingerprint_to_pb
    for mode in WeightsMode:
        f = Fingerprint("m", "LlamaForCausalLM", "a" * 64, "b" * 64, "c" * 64, mode.value, "fp32")
        m = fingerprint_to_pb(f)
        assert m.weights_mode != pb.WEIGHTS_MODE_UNSPECIFIED and fingerprint_from_pb(m) == f
    assert pb.WEIGHTS_MODE_INT4 == 6 and pb.WEIGHTS_MODE_INT4_AWQ == 7 and pb.WEIGHTS_MODE_INT4_GPTQ == 8
