"""The compute-share rows of bench/gpu_check.py's JSON summaries, as the docs show them.

    python3 bench/gpu_results.py FILE [FILE ...]

First nvml_meaning's rows, one tenant alone (its kernels' count, NVML's per-process and
device utilization: what a GPU does with no neighbour).  Then for each duty-like check
(duty, duty_no_agent, duty_containers), a line per row: each tenant's share over the whole
window by the kernels it finished (count x the kernel's solo time) and by NVML's
per-process utilization, each set's sum, and how much more NVML gave the tenants than
their finished kernels account for ("NVML - kernels": GPU time the driver spent on them
that did no work counted at the solo rate, such as switching between their contexts, or
kernels that ran slower beside a neighbour's); and each tenant's part of the work their
kernels did (where the guarantees add up to 100%: how the work was divided, apart from that
loss).  Where the tenants' shims were traced (`shim`), also each one's last cost scale.
Standard library only, like gpu_check: it reads what a lent GPU machine wrote.
"""
import json
import sys

DUTY_CHECKS = ("duty", "duty_no_agent", "duty_containers")


def shares(values):
    return " / ".join(f"{v:.1f}" for v in values) + f" = {sum(values):.1f}"


def rows_of(check):
    """A duty-like check's rows by label: duty and duty_no_agent keep several, duty_containers is one."""
    if "rows" in check:
        return check["rows"]
    return {"30/70%, 1 block, a sync after each": check} if "nvml" in check else {}


def last_scales(row):
    """Each tenant's last cost scale, from its shim's trace: '-' where it made no correction."""
    traces = row.get("shim") or []
    return [f"{t['corrections'][-1][2]:.2f}" if t and t["corrections"] else "-" for t in traces]


def report(path):
    with open(path) as f:
        summary = json.load(f)
    if not isinstance(summary, dict):
        raise ValueError("its JSON is not an object")
    gpu = summary.get("gpu") or {}
    lines = [f"{path}: {gpu.get('name', 'no GPU')}, driver {gpu.get('driver', '?')}, {summary.get('date', '?')}"]
    checks = summary.get("checks", {})
    for name in ("nvml_meaning", *DUTY_CHECKS):
        check = checks.get(name)
        if check and ("error" in check or "skipped" in check):
            lines.append(f"  {name}: did not run: {check.get('error', check.get('skipped'))[:100]}")
            continue
        if name == "nvml_meaning" and check:
            lines += [f"  {name}: {label}, alone: kernels {row['counted']:.1f}, NVML {row['process_smUtil']:.1f}, "
                      f"device {row['device_gpu_util']}" for label, row in check.items() if isinstance(row, dict)]
            continue
        for label, row in rows_of(check or {}).items():
            line = f"  {name}: {label}: NVML {shares(row['nvml'])}"
            if row.get("counted"):
                done = row["counted"]
                line = (f"  {name}: {label}: kernels {shares(done)}, NVML {shares(row['nvml'])}, "
                        f"NVML - kernels {sum(row['nvml']) - sum(done):.1f}")
                if sum(done) > 0:
                    line += f", of the work done {' / '.join(f'{100 * c / sum(done):.1f}' for c in done)}"
            scales = last_scales(row)
            if scales:
                line += f"; cost scales {' / '.join(scales)}"
            lines.append(line)
    return "\n".join(lines)


def main(paths):
    if not paths:
        print("usage: " + __doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    for path in paths:
        try:
            print(report(path))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            print(f"Error: {path}: not a gpu_check summary ({type(e).__name__}: {e})", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
