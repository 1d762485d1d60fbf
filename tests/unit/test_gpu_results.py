"""bench/gpu_results.py: the compute-share lines the docs show of a gpu_check summary."""
import json
import subprocess
import sys

from tests.helpers.paths import ROOT

SCRIPT = ROOT / "bench" / "gpu_results.py"


def results(*paths):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, paths)], capture_output=True, text=True, timeout=30)


def trace(*scales):
    return {"samples": 9, "sample_ms_min_q1_median_q3": [20.0] * 4, "estimate_ms_last": 20.0,
            "corrections": [[30.0, 31.0, s] for s in scales]}


SUMMARY = {
    "gpu": {"name": "NVIDIA H200", "driver": "580.159.04"}, "date": "2026-12-06",
    "checks": {
        "nvml_meaning": {"1 block, back to back": {"counted": 99.3, "process_smUtil": 99.0, "device_gpu_util": 99},
                         "seconds": 66.0},
        "duty": {"rows": {
            "30/70%, 1 block, back to back": {"nvml": [40.1, 56.3], "shim": [None, None]},
            "30/70%, 1 block, a sync after each": {"nvml": [27.0, 71.9], "counted": [26.9, 68.3],
                                                   "shim": [trace(1.0, 0.93), trace(1.2)]}}},
        "duty_no_agent": {"skipped": "needs pid namespaces (unshare --pid: root)"},
        "duty_containers": {"nvml": [29.0, 70.0], "counted": [28.5, 69.0], "shim": [trace(), trace()]},
    }}


def test_each_row_shows_both_referees_their_sums_and_what_nvml_gave_beyond_the_kernels(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps(SUMMARY))
    got = results(path)
    assert got.returncode == 0, got.stderr
    assert got.stdout.splitlines() == [
        f"{path}: NVIDIA H200, driver 580.159.04, 2026-12-06",
        "  nvml_meaning: 1 block, back to back, alone: kernels 99.3, NVML 99.0, device 99",
        "  duty: 30/70%, 1 block, back to back: NVML 40.1 / 56.3 = 96.4; cost scales - / -",
        "  duty: 30/70%, 1 block, a sync after each: kernels 26.9 / 68.3 = 95.2, NVML 27.0 / 71.9 = 98.9, "
        "NVML - kernels 3.7, of the work done 28.3 / 71.7; cost scales 0.93 / 1.20",
        "  duty_no_agent: did not run: needs pid namespaces (unshare --pid: root)",
        "  duty_containers: 30/70%, 1 block, a sync after each: kernels 28.5 / 69.0 = 97.5, NVML 29.0 / 70.0 = 99.0, "
        "NVML - kernels 1.5, of the work done 29.2 / 70.8; cost scales - / -",
    ]


def test_what_is_not_a_summary_is_one_error_line_and_no_traceback(tmp_path):
    for name, text in (("not-json", "{"), ("a-list", "[1, 2]"), ("bad-row", json.dumps(
            {"checks": {"duty": {"rows": {"x": {"nvml": "high"}}}}}))):
        path = tmp_path / name
        path.write_text(text)
        got = results(path)
        assert got.returncode == 1 and got.stdout == "", got
        assert got.stderr.startswith(f"Error: {path}: not a gpu_check summary") and got.stderr.count("\n") == 1, got
    got = results(tmp_path / "absent.json")
    assert got.returncode == 1 and "No such file" in got.stderr
    assert results().returncode == 2


def test_a_row_whose_kernels_did_no_work_has_no_division_of_it(tmp_path):
    path = tmp_path / "idle.json"
    path.write_text(json.dumps({"checks": {"duty": {"rows": {"30/70%": {"nvml": [0.0, 0.0], "counted": [0.0, 0.0]}}}}}))
    got = results(path)
    assert got.returncode == 0, got.stderr
    assert got.stdout.splitlines()[1] == "  duty: 30/70%: kernels 0.0 / 0.0 = 0.0, NVML 0.0 / 0.0 = 0.0, NVML - kernels 0.0"
