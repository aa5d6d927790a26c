"""`cats.bench.cgroup`: a process in a `MemoryCgroup` is held to the limit by the kernel and measured as the kernel
charges it (skipped where no writable memory cgroup is mounted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cats.bench.cgroup import CgroupUnavailableError, MemoryCgroup, find_hierarchy
from tests.conftest import SMOLLM2, needs

ROOT = Path(__file__).resolve().parents[1]
SPEC_BENCH = ROOT.parent / "shared" / "data" / "spec_bench" / "question.jsonl"

MIB = 1 << 20

try:
    find_hierarchy()
    NO_CGROUP = None
except CgroupUnavailableError as error:
    NO_CGROUP = str(error)

pytestmark = pytest.mark.skipif(NO_CGROUP is not None, reason=f"no writable memory cgroup: {NO_CGROUP}")


def allocate(mib: int, cgroup: MemoryCgroup) -> subprocess.CompletedProcess:
    """A child that touches ``mib`` MiB of anonymous memory, in ``cgroup`` from its first instruction."""
    code = f"b = bytearray({mib} * {MIB}); b[::4096] = b'x' * len(b[::4096]); print('done')"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, preexec_fn=cgroup.enter)


def test_a_process_within_the_limit_is_charged_what_it_touched():
    with MemoryCgroup("test-fits", 200 * MIB) as cgroup:
        done = allocate(64, cgroup)
        usage = cgroup.usage()
    assert done.returncode == 0 and done.stdout.strip() == "done"
    assert 64 * MIB < usage.peak_bytes <= 200 * MIB and usage.oom_kills == 0
    assert usage.to_dict()["memory_limit_mb"] == 200.0
    assert not cgroup.path.exists()  # removed at the end


def test_a_process_over_the_limit_is_killed_and_counted():
    with MemoryCgroup("test-over", 64 * MIB) as cgroup:
        done = allocate(160, cgroup)
        usage = cgroup.usage()
    assert done.returncode == -9 and "done" not in done.stdout  # SIGKILL from the OOM killer
    assert usage.oom_kills >= 1 and usage.peak_bytes <= 64 * MIB


@needs(SMOLLM2)
def test_bench_runs_each_method_in_a_memory_cgroup(tmp_path):
    """`cats bench --memory-limit`: the method's worker runs in its own cgroup; the summary carries the limit, the
    kernel's peak count (within the limit), major faults, reads and OOM kills, and the report a table of them."""
    out = tmp_path / "bench"
    command = [sys.executable, "-m", "cats.cli", "bench", "--model", str(SMOLLM2), "--questions", str(SPEC_BENCH),
               "--limit", "1", "--max-new-tokens", "4", "--threads", "1", "--warmup", "0", "--no-progress",
               "--methods", "ar,hf-ar", "--memory-limit", "100%+1GiB", "--out", str(out)]
    environment = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=environment)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    limit_mb = summary["memory_limit_mb"]
    assert summary["memory_limit"] == "100%+1GiB" and limit_mb > 1024
    assert set(summary["methods"]) == {"ar"} and "hf-ar" in summary["skipped"]
    ar = summary["methods"]["ar"]
    usage = ar["memory"]["cgroup"]
    assert 100 < ar["peak_memory_mb"] == usage["peak_memory_mb"] <= limit_mb
    assert usage["oom_kills"] == 0 and usage["major_faults"] >= 0 and ar["exact_match"] == 1.0
    assert ar["memory"]["cached_at_start_mb"] < 16  # it started cold
    assert ar["memory"]["plan"]["parts_mb"]["runtime (measured before loading weights)"] > 50
    assert "## Under the memory limit" in (out / "report.md").read_text()


def test_several_limits_make_a_curve(tmp_path, monkeypatch):
    """One run per limit in its own folder, then tokens/s against the limit: curve.json, curve.md, the plot."""
    from cats.bench import curve as curve_module
    from cats.bench.runner import BenchConfig, NothingRanError

    def fake_run(config):
        if config.memory_limit == "25%":
            raise NothingRanError({"ar": "below the minimum", "pld": "below the minimum"}, 250.0)
        limit_mb = {"50%": 500.0, "100%": 1000.0}[config.memory_limit]
        methods = {"ar": {"tokens_per_s": limit_mb / 100, "exact_match": 1.0, "peak_memory_mb": limit_mb - 1}}
        skipped = {} if limit_mb > 600 else {"pld": "killed by the kernel's OOM killer"}
        if limit_mb > 600:
            methods["pld"] = {"tokens_per_s": 20.0, "exact_match": 1.0, "peak_memory_mb": 900.0}
        return {"model": "m.gguf", "threads": 2, "questions": 1, "max_new_tokens": 4, "memory_limit_mb": limit_mb,
                "methods": methods, "skipped": skipped}

    monkeypatch.setattr(curve_module, "run_bench", fake_run)
    config = BenchConfig(model="m.gguf", questions=tmp_path / "q.jsonl", out=tmp_path / "out", methods=["ar", "pld"])
    result = curve_module.run_curve(config, ["25%", "50%", "100%"])  # nothing runs at 25 %: the curve goes on
    assert [p["limit_mb"] for p in result["points"]] == [250.0, 500.0, 1000.0]
    assert result["points"][0]["methods"] == {} and result["points"][0]["skipped"]["ar"] == "below the minimum"
    assert result["points"][1]["methods"] == {"ar": 5.0} and result["points"][2]["methods"]["pld"] == 20.0
    table = (tmp_path / "out" / "curve.md").read_text()
    assert "| 25% | 250 | – | – |" in table and "- 25%: `ar` did not run: below the minimum" in table
    assert "| [50%](limit-50pct/report.md) | 500 | 5.00 | – |" in table and "OOM killer" in table
    assert json.loads((tmp_path / "out" / "curve.json").read_text()) == result
    assert (tmp_path / "out" / "memory_curve.png").stat().st_size > 0
