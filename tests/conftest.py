"""Suite-wide isolation: tests never read or write the user's planner calibration."""

import os
import tempfile

# Set at import so that subprocesses started by any test inherit it too.
os.environ.setdefault("DTORCH_CALIBRATION_DIR", tempfile.mkdtemp(prefix="dtorch-test-calibration-"))
