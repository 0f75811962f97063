"""Strict overrides and the saved config (validation errors get their own tests)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from experiments.settings import config as config_mod
from experiments.settings.presets import build_config
from experiments.settings.overrides import OverrideError, apply_overrides
from experiments.settings.presets import PRESETS, get_preset


def test_override_nested_keys_and_types():
    cfg = build_config("quickstart", ["allreduce.algorithm=ring", "allreduce.bucket_cap_mb=0.5",
                                      "optim.lr=0.2", "dtype=float64", "model.hidden=(32,16)",
                                      "steps=7"])
    assert cfg.allreduce.algorithm == "ring" and cfg.allreduce.bucket_cap_mb == 0.5
    assert cfg.optim.lr == 0.2 and cfg.dtype == "float64" and cfg.steps == 7
    assert cfg.model.hidden == (32, 16)


@pytest.mark.parametrize("assignment,message", [
    ("nope=1", "unknown key 'nope'"),
    ("allreduce.nope=1", "unknown key 'allreduce.nope'"),
    ("steps=abc", "expected an integer"),
    ("optim.lr=fast", "expected a number"),
    ("allreduce.algorithm=star", "expected one of library, ring, halving-doubling, tree"),
    ("allreduce.compression=int8", "expected one of none, fp16, bf16"),
    ("dtype=float16", "--set dtype=float16: expected one of float32, float64$"),
    ("allreduce=ring", "is a section"),
    ("steps", "not of the form key=value"),
    ("workers=0", "workers=0"),
    ("steps.x=1", "cannot set a field inside"),
])
def test_bad_overrides_name_the_problem(assignment, message):
    with pytest.raises(OverrideError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_config("quickstart", [assignment])


def test_unknown_key_lists_the_known_ones():
    with pytest.raises(OverrideError) as err:
        apply_overrides(get_preset("quickstart"), ["optim.learning_rate=1"])
    assert "lr" in str(err.value) and "momentum" in str(err.value)


@pytest.mark.parametrize("name", list(PRESETS))
def test_saved_config_round_trips(tmp_path, name):
    cfg = build_config(name, ["seed=3", "allreduce.algorithm=ring"])
    config_mod.save(cfg, tmp_path / "config.json")
    loaded = config_mod.load(tmp_path / "config.json")
    assert loaded == cfg
    assert dataclasses.asdict(loaded) == dataclasses.asdict(cfg)


@pytest.mark.parametrize("text,message", [
    ("{not json", "cannot read config"),
    ("[1, 2]", "not a JSON object"),
    ('{"experiment": "x", "model": {"_type": "Nope"}}', "unknown section type"),
    ('{"experiment": "x", "bogus": 1}', "unknown key 'bogus'"),
])
def test_bad_config_files_are_clear_errors(tmp_path, text, message):
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(OverrideError, match=message):
        config_mod.load(path)


def test_configs_are_frozen():
    cfg = get_preset("quickstart")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.steps = 3


def _records(walls, samples=32):
    return [{"wall": w, "step_s": 1.0, "samples": samples} for w in walls]


@pytest.mark.parametrize("per_rank,expected", [
    # one rank: steps end at 1..5; warm-up ends at 1; 4 steps of 32 in 4 s
    ({0: _records([1, 2, 3, 4, 5])}, 32.0),
    # two ranks in lock-step: twice that
    ({0: _records([1, 2, 3, 4, 5]), 1: _records([1, 2, 3, 4, 5])}, 64.0),
    # a fast rank (every 0.5 s) next to a slow one (every 2 s): only steps inside the window
    # (from 2, the slow rank's warm-up end, to 6.0, the fast one's last step) count
    ({0: _records([0.5 * k for k in range(1, 13)]), 1: _records([2, 4, 6, 8])}, (8 + 2) * 32 / 4.0),
])
def test_throughput_counts_steps_while_every_rank_trains(per_rank, expected):
    from experiments.rundir.metrics import throughput

    assert throughput(per_rank) == pytest.approx(expected)


@pytest.mark.parametrize("engine,overrides,workers,expected", [
    ("ps-ssp", ["allreduce.compression=fp16"], 2, ["allreduce.compression has no effect on --engine ps-ssp"]),
    ("ddp", ["allreduce.compression=fp16"], 2, []),
    ("ddp", ["allreduce.algorithm=ring"], 2, ["allreduce.algorithm has no effect on --engine ddp; only allreduce"]),
    ("allreduce", ["ps.staleness=3"], 2, ["ps.staleness has no effect on --engine allreduce; only ps-ssp"]),
    ("ps-sync", ["ps.staleness=3"], 2, ["ps.staleness has no effect on --engine ps-sync"]),
    ("ps-ssp", ["ps.staleness=3", "optim.lr=0.2"], 2, []),
    ("local", ["fault.slow_rank=5", "fault.slow_factor=2"], 2, ["fault.slow_rank=5 has no effect: there are 2 workers"]),
    ("allreduce", ["fault.slow_rank=1"], 2, ["fault.slow_rank=1 has no effect with fault.slow_factor=1"]),
])
def test_settings_the_engine_never_reads_are_named(engine, overrides, workers, expected):
    from experiments.settings.readers import unused

    lines = unused(build_config("quickstart", overrides, engine=engine, workers=workers), overrides)
    assert len(lines) == len(expected) and all(e in line for e, line in zip(expected, lines)), lines


def test_servers_with_an_engine_without_servers_is_named():
    from experiments.settings.readers import unused

    assert unused(build_config("quickstart", engine="allreduce", servers=2), servers_given=True) == [
        "servers has no effect on --engine allreduce; only ps-sync, ps-async, ps-ssp, ps-easgd read it"]


def test_compress_method_sets_both_families_casts_and_refuses_what_they_do_not_carry(tmp_path):
    cfg = build_config("quickstart", ["compress.method=bf16"], engine="ps-sync")
    assert (cfg.compress.method, cfg.allreduce.compression, cfg.ps.compression) == ("bf16",) * 3
    config_mod.save(cfg, tmp_path / "config.json")
    assert config_mod.load(tmp_path / "config.json") == cfg
    for overrides, message in [

        (["compress.method=fp16", "ps.compression=bf16"], "compress.method=fp16 and ps.compression=bf16 disagree"),
        (["compress.method=fp16", "compress.error_feedback=true"], "send compress.method=fp16 without error feedback"),
        (["compress.ratio=0.5"], "compress.ratio=0.5: compress.method=none does not read it"),
        (["compress.method=zip"], "compress.method='zip': expected one of none, fp16"),
    ]:
        with pytest.raises(OverrideError, match=re.escape(message)):
            build_config("quickstart", overrides)
    with pytest.raises(OverrideError, match="compress.method=topk: engine ddp carries none, fp16, bf16, powersgd; "
                                            "topk runs on allreduce, ps-sync, ps-async, ps-ssp"):
        build_config("quickstart", ["compress.method=topk"], engine="ddp")
    with pytest.raises(OverrideError, match="compress.method=powersgd: engine ps-async carries none, fp16, bf16, "
                                            "topk, randomk, sign, qsgd; powersgd runs on ddp, allreduce"):
        build_config("quickstart", ["compress.method=powersgd"], engine="ps-async")
    with pytest.raises(OverrideError, match=re.escape("compress.method=topk and ps.compression=fp16: give one")):
        build_config("quickstart", ["compress.method=topk", "ps.compression=fp16"], engine="ps-sync")
    with pytest.raises(OverrideError, match=re.escape("compress.pull=False: compress.method=fp16 does not read it")):
        build_config("quickstart", ["compress.method=fp16", "compress.pull=false"], engine="ps-sync")
    with pytest.raises(OverrideError, match=re.escape("compress.method=topk with ps.reconnect_s=5: under compressed pulls")):
        build_config("quickstart", ["compress.method=topk", "ps.reconnect_s=5"], engine="ps-sync")
    assert build_config("quickstart", ["compress.method=topk", "ps.reconnect_s=5", "compress.pull=false"],
                        engine="ps-sync").ps.reconnect_s == 5
    # Overrides come one at a time, in any order: a setting may come before its method.
    assert build_config("quickstart", ["compress.ratio=0.05", "compress.method=topk"]).compress.ratio == 0.05
    powersgd = build_config("quickstart", ["compress.method=powersgd", "compress.rank=2"], engine="ddp")
    assert powersgd.compress.rank == 2 and powersgd.allreduce.compression == "none"
    with pytest.raises(OverrideError, match=re.escape("compress.start_step=1: PowerSGD with error feedback")):
        build_config("quickstart", ["compress.method=powersgd", "compress.start_step=1"], engine="ddp")


def test_local_sgd_settings_are_checked_once_every_override_is_in():
    cfg = build_config("quickstart", ["allreduce.period_warmup=3", "allreduce.period=4"], engine="allreduce")
    assert (cfg.allreduce.period, cfg.allreduce.period_warmup) == (4, 3)
    assert build_config("quickstart", ["allreduce.period=16"], engine="ddp").allreduce.period == 16
    for overrides, message in [
        (["allreduce.period=0"], "allreduce.period=0: must be an int >= 1"),
        (["allreduce.period_warmup=-1"], "allreduce.period_warmup=-1: must be an int >= 0"),
        (["allreduce.period_warmup=3"], "allreduce.period_warmup=3: a warm-up before local SGD needs allreduce.period > 1"),
        (["allreduce.period=4", "allreduce.period_warmup=150"], "allreduce.period_warmup=150 is not shorter than the run (150 steps)"),
        (["allreduce.period=4", "compress.method=topk"], "allreduce.period=4 with compression"),
        (["allreduce.period=4", "checkpoint.every=10"], "allreduce.period=4 with checkpoint.every"),
    ]:
        with pytest.raises(OverrideError, match=re.escape(message)):
            build_config("quickstart", overrides, engine="allreduce")


def test_downpour_settings_are_checked_once_every_override_is_in():
    cfg = build_config("quickstart", ["ps.fetch_every=4", "ps.push_every=4"], engine="ps-sync")
    assert (cfg.ps.push_every, cfg.ps.fetch_every) == (4, 4)
    assert build_config("quickstart", ["ps.push_every=2", "ps.fetch_every=5"], engine="ps-async").ps.fetch_every == 5
    for overrides, engine, message in [
        (["ps.push_every=0"], "ps-async", "ps.push_every=0: must be an int >= 1"),
        (["ps.push_every=2", "ps.fetch_every=4"], "ps-sync", "ps.push_every=2 and ps.fetch_every=4 under ps-sync"),
        (["ps.push_every=2", "checkpoint.every=5"], "ps-async", "ps.push_every/ps.fetch_every above 1 with checkpoint"),
    ]:
        with pytest.raises(OverrideError, match=re.escape(message)):
            build_config("quickstart", overrides, engine=engine)


def test_easgd_settings_and_the_settings_other_engines_do_not_read():
    from experiments.settings.readers import unused

    cfg = build_config("quickstart", ["ps.easgd_alpha=0.2", "ps.easgd_tau=8"], engine="ps-easgd")
    assert (cfg.ps.easgd_alpha, cfg.ps.easgd_tau) == (0.2, 8)
    for value, message in [("0", "ps.easgd_alpha=0.0: must be in (0, 1)"), ("1", "ps.easgd_alpha=1.0: must be in (0, 1)")]:
        with pytest.raises(OverrideError, match=re.escape(message)):
            build_config("quickstart", [f"ps.easgd_alpha={value}"], engine="ps-easgd")
    with pytest.raises(OverrideError, match=re.escape("ps.easgd_tau=0: must be an int >= 1")):
        build_config("quickstart", ["ps.easgd_tau=0"], engine="ps-easgd")
    said = unused(build_config("quickstart", [], engine="allreduce"),
                  ["ps.push_every=4", "ps.easgd_tau=4", "allreduce.period=4"])
    assert said == ["ps.push_every has no effect on --engine allreduce; only ps-sync, ps-async, ps-ssp read it",
                    "ps.easgd_tau has no effect on --engine allreduce; only ps-easgd read it"]
    said = unused(build_config("quickstart", [], engine="ps-easgd"), ["ps.push_every=4", "allreduce.period=4"])
    assert [line.split(";")[0] for line in said] == ["ps.push_every has no effect on --engine ps-easgd",
                                                     "allreduce.period has no effect on --engine ps-easgd"]
