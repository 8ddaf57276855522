"""tests/compile_profile.py (``make test-profile``) adds up what each process recorded."""

import json

import compile_profile


def _write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_the_summary_adds_up_each_process_and_ranks_files_by_time(tmp_path):
    fast, slow = "tests/test_fast.py::test_a", "tests/test_slow.py::test_b"
    _write(tmp_path / "1.jsonl", [
        {"kind": "trace", "test": slow, "seconds": 0.5, "name": "run_to_completion"},
        {"kind": "lower", "test": slow, "seconds": 0.25, "name": "jit(run_to_completion)"},
        {"kind": "cache_misses", "test": slow},
        {"kind": "backend", "test": slow, "seconds": 2.0, "name": "jit(run_to_completion)"},
        {"kind": "test", "test": slow, "wall": 4.0, "cpu": 3.0, "children": 0.0}])
    _write(tmp_path / "2.jsonl", [
        {"kind": "cache_hits", "test": fast},
        {"kind": "backend", "test": fast, "seconds": 0.125, "name": "jit(multiply)"},
        {"kind": "test", "test": fast, "wall": 1.0, "cpu": 0.5, "children": 2.5}])
    summary = compile_profile.summarize(tmp_path)
    totals = summary["totals"]
    assert totals["tests"] == 2 and totals["wall"] == 5.0 and totals["children"] == 2.5
    assert totals["compiles"] == 2 and totals["cache_hits"] == 1 and totals["cache_misses"] == 1
    assert totals["backend_seconds"] == 2.1  # rounded to 0.1 s
    # decode.compiled's programs are generation programs, under either name JAX reports.
    assert totals["generation_programs"] == 1 and totals["generation_backend_seconds"] == 2.0
    assert totals["generation_trace_seconds"] == 0.5
    assert [row["file"] for row in summary["files"]] == ["tests/test_slow.py",
                                                          "tests/test_fast.py"]
    assert summary["files"][0]["compile"] == 2.8
    assert json.loads((tmp_path / "summary.json").read_text())["totals"] == totals
    lines = compile_profile.report_lines(summary)
    assert lines[0].startswith("2 tests: 5 worker-seconds")
    assert "1 persistent-cache hits" in lines[1] and "generation programs: 1" in lines[1]
