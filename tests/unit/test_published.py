"""`psar predict --published` (analysis/published.py): every encoded result beside psar's
prediction of its setting, the ring's by its closed form, and those not encoded with why."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from analysis.published import NOT_ENCODED, RESULTS, predicted_efficiency
from experiments.cli.predicting import predict_cmd


def test_the_ring_over_the_servers_links_takes_its_closed_form():
    for r in RESULTS:
        comm = 2 * (r.servers - 1) / r.servers * 4 * r.params / (r.rate_bits / 8)
        after, overlapped, played = predicted_efficiency(r)
        assert played == pytest.approx(comm, rel=1e-9)
        assert after == pytest.approx(r.compute_s / (r.compute_s + comm), rel=1e-9)
        assert after <= overlapped <= 1.0


def test_every_published_figure_is_printed_beside_its_prediction_and_the_rest_with_why():
    out = CliRunner().invoke(predict_cmd, ["--published"])
    assert out.exit_code == 0, out.output
    for r in RESULTS:
        line = next(line for line in out.output.splitlines() if line.startswith(r.name))
        assert f"{100 * r.figure:.0f}%" in line
    for n in NOT_ENCODED:
        assert f"{n.name} ({n.source}): {n.why}" in out.output
    rows = json.loads(CliRunner().invoke(predict_cmd, ["--published", "--json"]).output)
    assert [r["published"] for r in rows["encoded"]] == [r.figure for r in RESULTS]
    assert all(r["error"] == pytest.approx(r["predicted"] - r["published"]) for r in rows["encoded"])
