"""Wire contract (``kvwire/v1/kvwire.proto``) and its generated stubs:
``from protos.kvwire.v1 import kvwire_pb2``.

Importing this package regenerates the stubs when they are missing or older than the .proto (a
cheap mtime check), so a fresh checkout and the test suite need no separate build step.
"""
from protos._codegen import ensure_generated as _ensure_generated

_ensure_generated()
