"""`psar predict --map` (analysis/predict_map.py): each cell's winner is the engine predict()
gives the shortest step there, and the figure is written."""

from __future__ import annotations

from click.testing import CliRunner

from analysis.predict import Target, predict
from analysis.predict_map import winners
from experiments.cli.predicting import predict_cmd
from test_labels import fake_run


def test_each_cell_is_won_by_the_engine_with_the_shortest_predicted_step(tmp_path):
    runs = [fake_run(tmp_path / "ar", "allreduce", compute_s=0.1, step_s=0.5),
            fake_run(tmp_path / "ps", "ps-sync", compute_s=0.1, step_s=0.4)]
    labels = ["allreduce/library", "ps-sync"]
    workers, rates = (2, 16), (1e8, 1e10)
    like = Target(2, 1.0, servers=2, placement="separate")
    grid, _ = winners(runs, labels, workers, rates, like)
    for i, rate in enumerate(rates):
        for j, n in enumerate(workers):
            rows = predict(runs, labels, [Target(n, rate / 8, 2, "separate")])
            assert labels[grid[i, j]] == min(rows, key=lambda r: r["step_s"])["engine"]
    assert {labels[k] for k in grid.flat} == set(labels)  # 2 shards: the ring wins at 16 workers
    out = CliRunner().invoke(predict_cmd, [str(tmp_path / "ar"), str(tmp_path / "ps"), "--map", str(tmp_path / "m.png"),
                                           "--workers", "2,4", "--servers", "2", "--set", "net.placement=separate"])
    assert out.exit_code == 0, out.output
    assert (tmp_path / "m.png").stat().st_size > 10_000
