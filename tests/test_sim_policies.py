"""benchmarks/sim_policies.py: the policies under a simulated device clock. Its runner charges each
step the device model's time, and on the order-sensitive workload (more documents than the KV pool
holds, questions interleaved) the cache-aware order computes far less than arrival order."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory):
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import sim_policies
    finally:
        sys.path.remove(str(BENCHMARKS))
    return sim_policies, sim_policies.model_dir(str(tmp_path_factory.mktemp("sim")))


def test_lpm_beats_fcfs_where_the_order_matters(sim):
    sp, path = sim
    cost = sp.H200_LLAMA3_8B
    runs = {p: sp.simulate(path, "prefix_pressure", p, 32, cost, time_scale=0.0, size="tiny") for p in ("lpm", "fcfs")}
    for r in runs.values():
        # Every step is charged what the device model says for it.
        for s in r["steps"]:
            fixed = cost.decode_step_s + (s["tokens"] * cost.decode_s_per_row if s["decode"] else
                                          s["tokens"] * cost.prefill_s_per_token)
            assert s["device_s"] >= fixed - 1e-12
        assert r["device_s"] == pytest.approx(sum(s["device_s"] for s in r["steps"]))
        assert r["hit_rate"] <= r["optimal_hit_rate"] + 1e-9
    lpm, fcfs = runs["lpm"], runs["fcfs"]
    # The same requests (the optimal is a property of the requests alone), far fewer tokens computed.
    assert lpm["optimal_hit_rate"] == pytest.approx(fcfs["optimal_hit_rate"])
    assert lpm["prefill_tokens"] < 0.6 * fcfs["prefill_tokens"]
    assert lpm["hit_rate"] > fcfs["hit_rate"] + 0.3
    assert lpm["device_s"] < fcfs["device_s"]
