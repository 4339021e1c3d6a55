"""The in-process OTLP receiver now lives in ``tools.otlp_receiver`` (``python -m bench trace`` uses
it too); re-exported here for the tests that import it from this path."""
from tools.otlp_receiver import OtlpReceiver, ReceivedSpan, any_value  # noqa: F401
