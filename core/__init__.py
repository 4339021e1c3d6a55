"""Shared core of kvwire: config, model, KV pages, sampling, serving, telemetry."""
