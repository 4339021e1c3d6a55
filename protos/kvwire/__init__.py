"""Versioned wire packages (``kvwire.v1``)."""
