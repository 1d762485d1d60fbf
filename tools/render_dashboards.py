"""Draw each Grafana dashboard of deploy/grafana from real Prometheus query results, with
matplotlib (Grafana itself cannot be had here): docs/dashboard-<name>.png.

It runs tests/deploy/test_observability.py's dashboard test with VGPU_DASHBOARD_DATA set, so that
a real Prometheus scrapes a node agent on simgpu with workloads for --seconds more, and the
test writes every panel's range query results; then each panel is drawn where its gridPos
puts it (Grafana's grid: 24 columns), its series named by their legendFormat, dashed where
a field override says so, in the panel's unit, with the dashboard's annotations as vertical
lines.  Needs matplotlib (pip install matplotlib):

    .venv/bin/python tools/render_dashboards.py                  # run, then draw
    .venv/bin/python tools/render_dashboards.py --data DIR       # draw what a run left in DIR
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS = ROOT / "deploy" / "grafana"
POD = ("namespace", "pod", "pod_container")
STYLES = ["-", "--", ":", "-."]


def run_test(data, seconds):
    python = ROOT / ".venv" / "bin" / "python"
    env = {**os.environ, "VGPU_DASHBOARD_DATA": str(data), "VGPU_DASHBOARD_SECONDS": str(seconds)}
    subprocess.run([str(python if python.exists() else sys.executable), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    "tests/deploy/test_observability.py", "-k", "every_query_of_a_dashboard"],
                   cwd=ROOT, env=env, check=True)


def legend(fmt, labels):
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt)


def dashes(panel, ref):
    for o in panel["fieldConfig"]["overrides"]:
        if o["matcher"] == {"id": "byFrameRefID", "options": ref}:
            for prop in o["properties"]:
                if prop["id"] == "custom.lineStyle":
                    return tuple(v / 2 for v in prop["value"]["dash"])
    return None


SCALE = {"bytes": (2**30, "GiB"), "percentunit": (0.01, "%"), "short": (1, "")}   # Grafana's unit ids


def regions(series, step=1.0):
    """Runs of consecutive samples: (first, last) times (Grafana merges an annotation query's
    consecutive points into one region)."""
    out = []
    for s in series:
        times = sorted(float(t) for t, _ in s["values"])
        first = prev = times[0]
        for t in times[1:]:
            if t - prev > 2 * step:
                out.append((first, prev))
                first = t
            prev = t
        out.append((first, prev))
    return out


def draw(dashboard, data, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    start = data["start"]
    panels = dashboard["panels"]
    unit_in, width_in, head_in = 0.42, 18.0, 0.5        # a grid row, the figure, the title
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    height_in = head_in + rows * unit_in
    fig = plt.figure(figsize=(width_in, height_in))
    fig.suptitle(f"{dashboard['title']}  (Grafana dashboard {dashboard['uid']}, drawn from Prometheus query results "
                 "of tests/deploy/test_observability.py)", fontsize=12, y=1 - 0.15 / height_in)
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colors = {}
    marks = [r for a in dashboard["annotations"]["list"] for r in regions(data["queries"][f"annotation {a['name']}"])]
    for p in panels:
        g = p["gridPos"]
        left, right = g["x"] / 24 * width_in + 0.7, (g["x"] + g["w"]) / 24 * width_in - 0.25
        top, bottom = head_in + g["y"] * unit_in + 0.3, head_in + (g["y"] + g["h"]) * unit_in - 1.05
        ax = fig.add_axes([left / width_in, 1 - bottom / height_in, (right - left) / width_in,
                           (bottom - top) / height_in])
        ax.set_title(p["title"], fontsize=10, loc="left")
        scale, suffix = SCALE[p["fieldConfig"]["defaults"]["unit"]]
        for i, t in enumerate(p["targets"]):
            for s in data["queries"][f"{p['title']} {t['refId']}"]:
                labels = s["metric"]
                name = legend(t["legendFormat"], labels)
                # a pod keeps its colour in every panel (its queries differ by line style); else a colour a series
                key = tuple(labels.get(k) for k in POD) if any(k in labels for k in POD) else name
                color = colors.setdefault(key, palette[len(colors) % len(palette)])
                xs = [float(v[0]) - start for v in s["values"]]
                ys = [float(v[1]) / scale for v in s["values"]]
                line, = ax.plot(xs, ys, color=color, linewidth=1.3, label=name, marker="o" if len(xs) < 3 else None,
                                markersize=3)
                d = dashes(p, t["refId"])
                if d:
                    line.set_dashes(d)
                elif not isinstance(key, tuple):
                    line.set_linestyle(STYLES[i % len(STYLES)])
        for first, last in marks:
            ax.axvline(first - start, color="orange", linewidth=1, alpha=0.8)
            if last > first:
                ax.axvspan(first - start, last - start, color="orange", alpha=0.08)
        ymax = max(1, ax.get_ylim()[1]) if scale == 1 else ax.get_ylim()[1]
        ax.set_ylim(-0.02 * ymax, ymax)       # a line at 0 shows above the axis
        ax.set_xlim(0, data["end"] - start)
        ax.set_ylabel(suffix, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.set_xlabel("seconds since the first scrape", fontsize=7, labelpad=1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6.5, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, frameon=False)
    fig.savefig(out, dpi=80)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, help="a directory a run of the test left (skip the run)")
    ap.add_argument("--seconds", type=float, default=120, help="how long the node runs on for the pictures")
    ap.add_argument("--out", type=Path, default=ROOT / "docs")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data
        if data is None:
            data = Path(tmp)
            run_test(data, args.seconds)
        for path in sorted(DASHBOARDS.glob("*.json")):
            out = args.out / f"dashboard-{path.stem}.png"
            draw(json.loads(path.read_text()), json.loads((data / f"{path.stem}.json").read_text()), out)
            print(out)


if __name__ == "__main__":
    main()
