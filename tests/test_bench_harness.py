"""``benchmarks/harness.py``, what every benchmark shares: alternating timed blocks, the
environment, tables and results JSON."""

from __future__ import annotations

import json

from benchmarks import harness


def test_alternate_flips_the_order_every_block_and_times_each_call():
    calls: list[str] = []
    fns = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    timings = harness.alternate(fns, 4, warmup=1, block=2)
    # warm-up a b, then blocks of 2: a a b b, then flipped b b a a
    assert calls == ["a", "b", "a", "a", "b", "b", "b", "b", "a", "a"]
    assert {k: len(v) for k, v in timings.wall.items()} == {"a": 4, "b": 4}
    assert all(t >= 0 for v in (*timings.wall.values(), *timings.cpu.values()) for t in v)
    assert set(timings.medians()) == set(timings.cpu_medians()) == {"a", "b"}


def test_alternate_synchronises_inside_each_timed_call():
    order: list[str] = []
    harness.alternate({"f": lambda: order.append("f")}, 2, warmup=0, sync=lambda: order.append("sync"))
    assert order == ["sync", "f", "sync", "f", "sync"]


def test_environment_line_names_machine_versions_and_load():
    env = harness.environment(threads=3)
    assert env["threads"] == 3 and env["cpus"] >= 1 and "onnx" in env["versions"]
    line = harness.environment_line(env)
    assert line.startswith("machine: ") and "load average" in line
    assert f"onnx {env['versions']['onnx']}" in line


def test_write_results_is_atomic_json(tmp_path, capsys):
    path = tmp_path / "sub" / "x.json"
    harness.write_results(path, {"environment": {"cpus": 2}, "rows": [1.5]})
    assert json.loads(path.read_text()) == {"environment": {"cpus": 2}, "rows": [1.5]}
    assert [p.name for p in path.parent.iterdir()] == ["x.json"]
    assert f"wrote {path}" in capsys.readouterr().out


def test_table_and_median():
    table = harness.table("t", ["name", "ms"], [("a", 1.0)])
    assert [c.header for c in table.columns] == ["name", "ms"] and table.row_count == 1
    assert harness.median_ms([0.001, 0.003, 0.002]) == 2.0
