"""Suite-wide settings."""
import os

# Services started by tests stop at once on SIGTERM: the production drain delay (NOT_SERVING while
# load balancers notice) would only slow every teardown. Tests of the delay pass the flag themselves.
os.environ.setdefault("KVWIRE_DRAIN_DELAY_S", "0")
