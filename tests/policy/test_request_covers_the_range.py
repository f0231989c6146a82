"""The request covers the estimate's range: the policy's margin on the point and the high end's
excess on top, so an exact estimate (a transformer's) pays only the margin and a convolution
network pays for the cuDNN workspaces its GPU may pick; the range rides the estimation pod's
termination message into the GPUMemoryEstimate, whose kubectl column and the release Event say
why the request is larger than the point's margin."""

from __future__ import annotations

import math

from tests.estimator.test_estimate_range import BACKWARD, MARK, a_transformer_step
from tests.estimator.trace_counts import traced
from tests.support.harness import make_policy
from xmem_admission.cluster.controller import records
from xmem_admission.cluster.kube.quantity import ceil_div
from xmem_admission.cluster.policy import sizing
from xmem_admission.cluster.policy.store import EstimateRecord
from xmem_admission.contract import gpus, termination
from xmem_admission.estimator.estimate import estimate_trace

MiB = 1 << 20
A100 = gpus.lookup("A100-40GB")


def recorded(trace) -> EstimateRecord:
    """The estimate of ``trace`` on the A100-40GB as the controller records it: through the
    estimation pod's termination message and the GPUMemoryEstimate's status."""
    [est] = estimate_trace(trace, [A100])
    message = termination.encode_ok("fake", 3, 1.0, [est.to_dict()])
    status = {"phase": records.SUCCEEDED, "completionTime": "2026-12-06T18:00:00Z",
              "estimates": records.estimates_from(termination.decode(message).gpus)}
    gme = {"metadata": {"name": "gme-x", "namespace": "ml"},
           "spec": {"fingerprint": "f" * 64, "workload": {"kind": "Job", "name": "train"}},
           "status": status}
    found = records.record(gme)
    assert found is not None
    return found


def test_an_exact_estimate_pays_only_the_margin():
    settings = make_policy(gpus=("A100-40GB",)).defaults
    rec = recorded(a_transformer_step())
    [g] = rec.gpus
    assert g.high_bytes == g.total_bytes
    plan = sizing.plan(rec, settings)
    assert plan is not None
    assert plan.request_bytes == sizing.size_request(g.total_bytes, settings, A100.capacity_bytes)
    assert plan.range_text() == ""


def test_a_cnns_request_is_its_high_end_plus_the_margin_on_the_point(deviceless_cudnn):
    settings = make_policy(gpus=("A100-40GB",)).defaults
    rec = recorded(traced(MARK, BACKWARD))
    [g] = rec.gpus
    assert g.high_bytes is not None and g.high_bytes > g.total_bytes
    plan = sizing.plan(rec, settings)
    assert plan is not None
    exact = g.total_bytes * (1 + settings.safety_margin_percent / 100) + g.high_bytes \
        - g.total_bytes
    granularity = settings.granularity_bytes
    expected = ceil_div(max(math.ceil(exact), settings.minimum_request_bytes), granularity) \
        * granularity
    assert plan.request_bytes == expected
    assert plan.request_bytes >= sizing.size_request(g.total_bytes, settings,
                                                     A100.capacity_bytes)
    assert "high end" in plan.range_text() and "cuDNN" in plan.range_text()


def test_the_gme_column_shows_a_cnns_range_and_a_transformers_narrow_one(deviceless_cudnn):
    def column(trace) -> str:
        [est] = estimate_trace(trace, [A100])
        decoded = termination.decode(termination.encode_ok("fake", 3, 1.0, [est.to_dict()]))
        return records.range_text(records.estimates_from(decoded.gpus), A100.key)

    # the transformer's range is the runtime figure's spread (16 MiB under the point)
    low, high = column(a_transformer_step()).removesuffix("Gi").split("-")
    assert low == high
    low, high = column(traced(MARK, BACKWARD)).removesuffix("Gi").split("-")
    assert float(low) < float(high)


def test_an_older_bundles_rows_carry_no_range_and_are_sized_as_before():
    [est] = estimate_trace(a_transformer_step(), [A100])
    row = {k: v for k, v in est.to_dict().items() if k not in ("high_bytes", "low_bytes")}
    decoded = termination.decode(termination.encode_ok("fake", 3, 1.0, [row]))
    assert len(decoded.gpus[0]) == len(termination.COLUMNS)
    entries = records.estimates_from(decoded.gpus)
    assert "highBytes" not in entries[0] and records.range_text(entries, A100.key) == ""
