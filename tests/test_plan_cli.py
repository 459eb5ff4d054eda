"""``python -m splitsoftmax plan / simulate / calibrate`` (in process; calibrate's measuring on one CPU
rank, its launched form is run by hand: ``python -m splitsoftmax calibrate --nproc 2 --out FILE``)."""
from __future__ import annotations

import csv
import importlib.util
import json

import pytest
import torch

import splitsoftmax as ss
from splitsoftmax.planning import load_profile
from splitsoftmax.tools import calibrate, cli


def test_plan_prints_the_ranking(capsys, tmp_path):
    out = tmp_path / "plan.json"
    assert cli.main(["plan", "64", "--seq-len", "1048576", "--heads", "32", "--kv-heads", "8",
                     "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "predictions of the model" in text and "chosen" in text and "plan: schedule=" in text
    data = json.loads(out.read_text())
    assert data["prediction"] is True and data["world"] == 64
    assert data["candidates"][0]["why"] == "chosen"


def test_plan_reads_documents_from_a_file(capsys, tmp_path):
    lengths = tmp_path / "docs.txt"
    lengths.write_text("4096, 512 512\n32768\n1024")
    assert cli.main(["plan", "16", "--docs", str(lengths), "--heads", "16", "--profile", "h200"]) == 0
    assert "balanced" in capsys.readouterr().out


def test_plan_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        cli.main(["plan", "8", "--seq-len", "100", "--heads", "6", "--kv-heads", "4"])
    assert "must be a multiple of kv_heads" in capsys.readouterr().err


def test_simulate_writes_csv_json_and_a_plot(tmp_path, capsys):
    assert cli.main(["simulate", "--seq-len", "262144", "--heads", "32", "--kv-heads", "8",
                     "--gpus", "8,64,512", "--out", str(tmp_path), "--timeline", "64"]) == 0
    with open(tmp_path / "simulate.csv") as f:
        rows = list(csv.DictReader(f))
    assert {int(r["gpus"]) for r in rows} == {8, 64, 512}
    for g in (8, 64, 512):
        mine = [r for r in rows if int(r["gpus"]) == g]
        assert sum(r["chosen"] == "True" for r in mine) == 1
        chosen = next(r for r in mine if r["chosen"] == "True")
        assert all(float(chosen["fwd_ms"]) + float(chosen["bwd_ms"]) <= float(r["fwd_ms"]) + float(r["bwd_ms"]) + 1e-9
                   for r in mine)
        assert {"ring", "heads"} <= {r["schedule"] for r in mine}
    assert json.loads((tmp_path / "simulate.json").read_text())["prediction"] is True
    with open(tmp_path / "timeline.csv") as f:
        events = list(csv.DictReader(f))
    chosen = next(r for r in rows if int(r["gpus"]) == 64 and r["chosen"] == "True")
    total = float(chosen["fwd_ms"]) + float(chosen["bwd_ms"])
    assert max(float(e["end_ms"]) for e in events) == pytest.approx(total, rel=1e-9)
    assert {e["event"] for e in events} >= {"host", "compute"}
    has_mpl = importlib.util.find_spec("matplotlib") is not None
    assert (tmp_path / "simulate.png").exists() == has_mpl
    if not has_mpl:
        assert "matplotlib is not installed" in capsys.readouterr().err


def test_calibrate_measures_a_profile_the_planner_reads():
    sizes = dict(calibrate.CPU_SIZES, lengths=(32, 64), reps=1)
    measured = calibrate.measure(0, 1, torch.device("cpu"), sizes)
    for pas in ("fwd", "fwd_bwd"):
        assert [s for s, _ in measured["kernel"][pas]["full"]] == [32, 64]
        assert all(r > 0 for _, r in measured["kernel"][pas]["full"])
    prof = calibrate.profile_from(measured, "h100", torch.device("cpu"), 1)
    assert prof["kernel"]["source"].startswith("measured by calibrate")
    assert prof["links"]["inter"]["p2p"]["source"].startswith("vendor")
    loaded = load_profile(prof)
    plan = ss.plan_attention(4, seq_len=4096, heads=4, kv_heads=4, head_dim=32, profile=loaded)
    assert plan.best.total_s > 0


def test_calibrate_rates_from_link_measures():
    prof = calibrate.profile_from({"kernel": {}, "links": {"intra": {"p2p": (123.4, 5e-6)}}}, "h200",
                                  torch.device("cpu"), 2)
    assert prof["links"]["intra"]["p2p"]["gbs"] == 123.4 and prof["links"]["intra"]["p2p"]["latency_us"] == 5.0
    assert prof["links"]["intra"]["p2p"]["source"].startswith("measured")
    assert prof["links"]["intra"]["alltoall"] == load_profile("h200").data["links"]["intra"]["alltoall"]


def test_calibrate_pairs_ranks_by_host():
    hosts = ["a", "a", "b", "b", "a"]
    assert calibrate._pairs(hosts, same=True) == [(0, 1), (2, 3)]
    assert calibrate._pairs(hosts, same=False) == [(0, 2), (1, 3)]
    assert calibrate._pairs(["a"], same=True) == []
