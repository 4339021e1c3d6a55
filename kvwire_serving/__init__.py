"""What every kvwire service shares and the engine does not need: the gRPC server and channels, the
one mapping of ``kvwire.errors`` to gRPC status codes, TLS and bearer tokens, tracing and the
/metrics server, command-line plumbing and core lending between co-located services.

The library (``kvwire``) never imports this package or gRPC; the services (tokenizer_svc,
prefill_svc, decode_svc) build on both.
"""
