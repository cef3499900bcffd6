"""Published sources kept for testing first (benchmarks/published/testing/*.yaml): provenance, never
fitted, and reported before fitting and after. Their error is reported, not gated: a new source is a
test of the structure, and tuning the gate to it would defeat that. About 1 s."""

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root holds benchmarks/

from benchmarks import bench_calibration as B  # noqa: E402
from dtorch.plan import calibration as C  # noqa: E402


def test_testing_sources_have_provenance_and_are_never_fitted():
    srcs = C.sources(B.TESTING)
    assert srcs, "benchmarks/published/testing/ holds no source"
    fitted = {s.id for s in C.sources()}
    for s in srcs:
        assert s.url.startswith("https://") and s.table and s.date and s.hardware and s.assumed, s.id
        assert s.id not in fitted, f"{s.id} is both fitted and kept for testing"
    assert not {r.source for r in C.ROWS} & {s.id for s in srcs}


def test_each_testing_source_is_reported_before_fitting_and_after():
    res = B.testing()
    full = C.fit()
    assert {h.source for h in res} == {s.id for s in C.sources(B.TESTING)}
    for h in res:
        # the fit that predicts them is the one on every fitted source: it never saw these rows
        assert h.fit.efficiencies == full.efficiencies
        assert [r.name for r, _, _ in h.before] == [r.name for r, _, _ in h.rows]
        for _, pred, err in [*h.rows, *h.before]:
            assert pred > 0 and math.isfinite(err)
        # before fitting every device runs at the prior efficiency; fitting moves the prediction
        assert h.before_mean_abs != h.mean_abs
    table = C.loso_table(res)
    assert all(f"| {h.source} |" in table for h in res)
