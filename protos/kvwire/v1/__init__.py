"""The ``kvwire.v1`` wire contract: ``kvwire.proto`` and its generated stubs."""
