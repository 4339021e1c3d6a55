"""kvwire, the shared library: config, model, KV pages, sampling, serving, telemetry."""
