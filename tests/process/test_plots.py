"""The comparison figures: drawn from tiny real runs they are valid, non-blank PNGs whose
engine colours are the style's; the split of a step is checked on hand-written records."""

from __future__ import annotations

from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
from matplotlib.colors import to_hex

from experiments.engines import all_labels, label_info
from analysis import plots, style
from analysis.results import Run, load_run

pytestmark = [pytest.mark.timeout(600)]
multiprocess = pytest.mark.multiprocess  # only the tests on real runs; the unit tests need none

JOBS = {  # quickstart, 8 steps: enough for every figure, including an ideal-scaling line
    "local-w1": dict(engine="local", workers=1),
    "allreduce-w1": dict(engine="allreduce", workers=1),
    "allreduce-w2": dict(engine="allreduce", workers=2),
    "ps-sync-w2": dict(engine="ps-sync", workers=2),
    "ps-async-w2": dict(engine="ps-async", workers=2),
    "ps-ssp-w2": dict(engine="ps-ssp", workers=2),
}
FIGURES = {f.__name__: f for f in plots.FIGURES if f is not plots.links_through_a_step}
"""The figures these loopback runs have content for (the links' figure needs --net: tests/unit/test_links.py)."""


# -- hand-written runs ---------------------------------------------------------------------

def _run(engine: str, metrics: dict[int, list[dict]], workers: int = 2, servers: int = 1,
         algorithm: str = "library") -> Run:
    summary = dict(engine=engine, workers=workers, servers=servers, samples_per_sec=100.0)
    return Run(Path(f"/runs/{engine}"), {"allreduce": {"algorithm": algorithm}}, summary, metrics)


def _rec(step: int, compute_s: float, comm_s: float, **extra) -> dict:
    return dict(step=step, compute_s=compute_s, comm_s=comm_s, loss=1.0, time=float(step),
                step_s=compute_s + comm_s, **extra)


# Rank 1 computes 2x longer than rank 0. Step 0 (warm-up, left out) is huge. At step 1 rank 0
# waits the whole skew (1.0 of its comm_s 3.0); at step 2 the wait is capped by comm_s 0.25.
SKEWED = {
    0: [_rec(0, 100.0, 100.0), _rec(1, 1.0, 3.0), _rec(2, 1.0, 0.25)],
    1: [_rec(0, 100.0, 100.0), _rec(1, 2.0, 0.5), _rec(2, 2.0, 0.5)],
}


@pytest.mark.parametrize("engine, wait_s, comm_s", [
    ("allreduce", (1.0 + 0.0 + 0.25 + 0.0) / 4, (2.0 + 0.5 + 0.0 + 0.5) / 4),
    ("ddp", 0.3125, 0.75),
    ("ps-sync", 0.3125, 0.75),
    ("ps-async", 0.0, (3.0 + 0.5 + 0.25 + 0.5) / 4),
    ("ps-ssp", 0.0, 1.0625),
    ("local", 0.0, 1.0625),
])
def test_step_split_estimates_waiting_of_synchronous_engines_only(engine, wait_s, comm_s):
    split = plots.step_split(_run(engine, SKEWED))
    assert split == pytest.approx(dict(compute_s=1.5, comm_s=comm_s, wait_s=wait_s), rel=1e-12)


def test_step_split_takes_a_measured_wait_s_as_is():
    metrics = {rank: [_rec(r["step"], r["compute_s"], r["comm_s"], wait_s=0.125) for r in recs]
               for rank, recs in SKEWED.items()}
    split = plots.step_split(_run("allreduce", metrics))
    assert split["wait_s"] == pytest.approx(0.125)
    assert split["comm_s"] == pytest.approx((2.875 + 0.375 + 0.125 + 0.375) / 4)


def test_step_split_keeps_step_0_of_a_one_step_run():
    split = plots.step_split(_run("allreduce", {0: [_rec(0, 1.0, 0.5)], 1: [_rec(0, 1.5, 0.25)]}))
    assert split == pytest.approx(dict(compute_s=1.25, comm_s=(0.0 + 0.25) / 2, wait_s=0.25))


def test_step_split_of_a_run_without_records_names_it():
    with pytest.raises(ValueError, match="/runs/ddp"):
        plots.step_split(_run("ddp", {}))


def test_a_label_has_one_colour_in_every_figure():
    first = [_run("allreduce", {}, algorithm="ring"), _run("ps-async", {}), _run("my-engine", {})]
    second = [_run("ps-async", {}, workers=4), _run("my-engine", {}),
              _run("allreduce", {}, algorithm="ring"), _run("local", {})]
    a, b = style.colours(first), style.colours(second)
    assert a == {label: b[label] for label in a}
    assert a["allreduce/ring"] == label_info("allreduce/ring")[1].colour == style.colour("allreduce/ring")
    assert a["my-engine"] in style.FALLBACK
    known = [style.colour(label) for label in all_labels()]
    assert len(set(known)) == len(known) and not set(known) & set(style.FALLBACK)  # all differ


def test_label_of_names_workers_and_shards():
    ring = _run("allreduce", {}, algorithm="ring")
    sharded = _run("ps-sync", {}, workers=4, servers=2)
    assert style.label_of(ring, workers=True) == "allreduce/ring x2"
    assert style.label_of(sharded, workers=True) == "ps-sync x4 (2 shards)"
    assert style.label_of(_run("ps-sync", {}, servers=2)) == "ps-sync (2 shards)"
    assert style.label_of(_run("ps-async", {})) == "ps-async"


def test_figures_without_content_are_not_written(tmp_path):
    assert plots.plot_all([], tmp_path) == []
    assert plots.staleness_histogram([_run("ps-sync", {0: [_rec(1, 1.0, 1.0, staleness=[0])]})],
                                     tmp_path) is None
    assert list(tmp_path.iterdir()) == []


# -- real runs -----------------------------------------------------------------------------

def POOL_JOBS() -> dict[str, dict]:
    return {name: dict(job, experiment="quickstart", steps=8) for name, job in JOBS.items()}


@pytest.fixture(scope="module")
def runs(pool) -> list[Run]:
    return [load_run(pool.folder(__name__) / name) for name in JOBS]


@pytest.fixture(scope="module")
def figures(runs, tmp_path_factory) -> dict[str, Path]:
    paths = plots.plot_all(runs, tmp_path_factory.mktemp("figures"))
    return {path.stem: path for path in paths}


@multiprocess
@pytest.mark.parametrize("name", FIGURES)
def test_every_figure_is_a_non_blank_png(figures, name):
    path = figures[name]
    assert path.suffix == ".png" and path.stat().st_size > 8_000
    image = matplotlib.image.imread(path)  # raises unless a valid PNG
    rgb = image[..., :3].reshape(-1, 3)
    assert (rgb < 0.95).any(axis=1).mean() > 0.02, "almost all white"
    assert len(np.unique(rgb, axis=0)) > 50, "too few distinct pixel values"


@multiprocess
def test_step_split_of_real_runs_fits_in_the_step(runs):
    for run in runs:
        split = plots.step_split(run)
        assert split["compute_s"] > 0 and split["comm_s"] >= 0 and split["wait_s"] >= 0
        steady = [r for r in run.records() if r["step"] >= 1]
        assert sum(split.values()) <= sum(r["step_s"] for r in steady) / len(steady) + 1e-9
        if all("wait_s" in r for r in steady):  # measured by the engine: taken as is
            held = [min(r["wait_s"], r["comm_s"]) for r in steady]  # the part inside the step
            assert split["wait_s"] == pytest.approx(sum(held) / len(held))
        elif not run.spec.synchronous:
            assert split["wait_s"] == 0


@pytest.fixture
def drawn(monkeypatch) -> list:
    """The figures that the plot functions close, in order."""
    figures = []
    close = plots.plt.close
    monkeypatch.setattr(plots.plt, "close", lambda fig: (figures.append(fig), close(fig)))
    return figures


@multiprocess
def test_figures_draw_each_run_in_its_label_colour(runs, tmp_path, drawn):
    label = {style.label_of(run, workers=w): run.label for run in runs for w in (False, True)}
    for figure in FIGURES.values():
        figure(runs, tmp_path)
    by_name = {fig.axes[0].get_title(): fig.axes[0] for fig in drawn}
    assert len(by_name) == len(FIGURES)

    seen = set()
    for ax in by_name.values():
        legend = ax.get_legend()
        for handle, text in zip(legend.legend_handles, legend.get_texts()):
            if text.get_text() in label:  # engine entries; step parts and "ideal" are not
                line = hasattr(handle, "get_color")  # else a bar's patch
                colour = handle.get_color() if line else handle.get_facecolor()
                assert to_hex(colour) == style.colour(label[text.get_text()]), text.get_text()
                seen.add((ax.get_title(), label[text.get_text()]))
    # every label in both loss plots; in the throughput plot every label with a measured
    # samples/s (an 8-step async run may have none: its workers' steady stretches need not
    # overlap); ps-async and ps-ssp by staleness
    measured = {run.label for run in runs if run.summary.get("samples_per_sec")}
    assert len(seen) == 2 * len({run.label for run in runs}) + len(measured) + 2

    ticks = by_name["Where a step's time goes (warm-up step left out)"].get_xticklabels()
    assert {t.get_text(): to_hex(t.get_color()) for t in ticks} == {
        style.label_of(run, workers=True): style.colour(run.label) for run in runs}


@multiprocess
def test_throughput_ideal_line_scales_the_fewest_workers_linearly(runs, tmp_path, drawn):
    plots.throughput_vs_workers(runs, tmp_path)
    blue = style.colour("allreduce/library")
    ideal = [line for line in drawn[0].axes[0].get_lines()
             if line.get_linestyle() == "--" and to_hex(line.get_color()) == blue]
    one = next(r for r in runs if r.label == "allreduce/library" and r.summary["workers"] == 1)
    assert len(ideal) == 1
    assert list(ideal[0].get_xdata()) == [1, 2]
    base = one.summary["samples_per_sec"]
    assert list(ideal[0].get_ydata()) == pytest.approx([base, 2 * base])


@multiprocess
def test_plot_takes_a_compare_folder_and_keeps_experiments_apart(runs, tmp_path):
    import json
    import shutil

    from click.testing import CliRunner

    from experiments.cli import main

    folder = tmp_path / "cmp" / "runs"
    for run in runs[:2]:
        shutil.copytree(run.path, folder / run.path.name)
    other = folder / "other"
    shutil.copytree(runs[2].path, other)
    summary = json.loads((other / "summary.json").read_text())
    (other / "summary.json").write_text(json.dumps({**summary, "experiment": "cnn"}))
    result = CliRunner().invoke(main, ["plot", str(tmp_path / "cmp"), "--out", str(tmp_path / "fig")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "fig/quickstart/summary.md").read_text().count("\n| ") == 2  # header excluded
    assert (tmp_path / "fig/cnn/summary.md").read_text().count("\n| ") == 1
    assert (tmp_path / "fig/quickstart/loss_vs_step.png").exists()
    result = CliRunner().invoke(main, ["plot", str(tmp_path), "--out", str(tmp_path / "x")])
    assert result.exit_code != 0 and "neither a finished run directory" in result.output


def test_runs_that_differ_only_in_how_the_shards_answer_are_two_cells():
    net = {"rate": "200mbit", "placement": "colocated"}
    a, b = (Run(Path(f"/runs/{n}"), config, dict(engine="ps-sync", workers=4, servers=4, network=net), {})
            for n, config in (("a", {}), ("b", {"ps": {"exchange": "phased"}})))
    assert plots._order(a) != plots._order(b)
    assert {plots._variant(r, [a, b]) for r in (a, b)} == {0, 1}


def test_the_ideal_line_is_in_the_legend_only_where_one_is_drawn(tmp_path, monkeypatch):
    """Runs of one worker count: no ideal line, so no legend entry for one; with two worker
    counts both."""
    import matplotlib.axes

    labels = []
    plot = matplotlib.axes.Axes.plot

    def recording(self, *args, **kwargs):
        labels.append(kwargs.get("label"))
        return plot(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", recording)
    one = [_run("allreduce", SKEWED, workers=2), _run("ps-sync", SKEWED, workers=2)]
    plots.throughput_vs_workers(one, tmp_path)
    assert not any(label and label.startswith("ideal") for label in labels)
    labels.clear()
    two = one + [Run(Path("/runs/allreduce-1"), one[0].config, {**one[0].summary, "workers": 1}, SKEWED)]
    plots.throughput_vs_workers(two, tmp_path)
    assert "ideal: linear from fewest workers" in labels
