"""`python -m dtorch.train.job` with its steps paced while a file exists, for a drill that acts while
the real trainer runs (tests/elastic/test_resize.py).

Usage: paced_job.py PACE_FILE SECONDS [the flags of dtorch.train.job]

While PACE_FILE exists, every rank sleeps SECONDS after each optimizer step (all ranks alike, so no
rank looks like a straggler); the test removes the file once what it checks in order has happened,
and the rest of the run goes at full speed.
"""

import os
import sys
import time

from dtorch.process_group import leave
from dtorch.train import job
from dtorch.train.callbacks import Callback


class Pace(Callback):
    def __init__(self, path: str, seconds: float) -> None:
        self.path, self.seconds = path, seconds

    def after_step(self, tr, run, rec) -> None:
        if os.path.exists(self.path):
            time.sleep(self.seconds)


if __name__ == "__main__":
    pace_file, seconds, argv = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
    sinks = job.JobConfig.sinks
    job.JobConfig.sinks = lambda self: [*sinks(self), Pace(pace_file, seconds)]
    leave(job.main(argv))
