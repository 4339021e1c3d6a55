"""kvwire benchmarks: never part of the test suite; each compares side by side in one run."""
