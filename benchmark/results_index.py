"""The results table of each benchmark folder, generated from its result JSON.

    python benchmark/results_index.py          # rewrite benchmark/<feature>/README.md tables
    python benchmark/results_index.py --check  # fail when a table is stale

Every run is one folder, ``benchmark/<feature>/results/<YYYYMMDDTHHMMZ>-<what>/``
(UTC start; ``bench_meta.run_dir`` names it), holding its JSON and PNG files.
One row per run folder: the date from its name, the folder, git revision,
series label, machine, key figures and the command. Key figures: the median
load-back time of each load file over both ranks (the first load of each rank
dropped), the ratio of ``sharded<suffix>.json`` to ``replicated<suffix>.json``,
the forward gate, the ``ratio_vs_*`` figures of probes and the exchange probes'
host time and bit-exact cases. The table sits between two markers in the
folder's README.md; a tooling test keeps it current. Which run is current for
each measurement the README says by hand, above the table.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
START, END = "<!-- results-table -->", "<!-- /results-table -->"
_STAMP = re.compile(r"^(\d{4})(\d{2})(\d{2})T(\d{2})(\d{2})(?:\d{2})?Z-")


def _date(name: str) -> str:
    m = _STAMP.search(name)
    return f"{m[1]}-{m[2]}-{m[3]} {m[4]}:{m[5]}Z" if m else "–"


def _machine(data: dict) -> str:
    m = data.get("machine") or {}
    cpus = m.get("cpus")
    gpus = sorted({r.get("gpu") for r in data.get("gpu", []) if r.get("gpu")})
    parts = [f"{cpus} CPUs" if cpus else "", ", ".join(gpus)]
    return ", ".join(p for p in parts if p) or m.get("processor", "–")


def _cell(text) -> str:
    return str(text).replace("|", "\\|") if text not in (None, "") else "–"


def _distinct(values) -> list:
    return list(dict.fromkeys(v for v in values if v))


def _load_ms(data: dict) -> float | None:
    """Median load-back time over all ranks, the first load of each dropped."""
    if data.get("status") != "ok":
        return None
    loads = [x for r in data.get("results", []) for x in r.get("load_event_ms", [])[1:]]
    return statistics.median(loads) if loads else None


def _probe_ratios(data: dict) -> list[str]:
    """``ratio_vs_*`` of a probe: each variant's range over ranks (the baseline,
    exactly 1 everywhere, left out)."""
    out = []
    for key, table in data.items():
        if not key.startswith("ratio_vs_") or not isinstance(table, dict):
            continue
        leaves: dict[str, list[float]] = {}
        for name, value in table.items():
            pairs = value.items() if isinstance(value, dict) else [(name, value)]
            for leaf, x in pairs:
                leaves.setdefault(leaf, []).append(x)
        for leaf, xs in leaves.items():
            if any(x != 1.0 for x in xs):
                lo, hi = f"{min(xs):.3f}", f"{max(xs):.3f}"
                out.append(f"{leaf} ×{lo}" + (f"–{hi}" if hi != lo else ""))
    return out


def _exchange_probe(stem: str, data: dict) -> list[str]:
    """The exchange probes: host time per layer (median over the ranks' roles)
    and broadcasts per layer; the loopback's bit-exact cases."""
    us = data.get("host_us_per_layer")
    if isinstance(us, dict) and us:
        per_layer = data.get("broadcasts_per_layer", 0)
        return [
            f"{stem} {statistics.median(us.values()):.1f} µs/layer host, "
            f"{per_layer:.0f} broadcast(s)/layer"
        ]
    cases = data.get("cases")
    if isinstance(cases, list) and cases and "ok" in cases[0]:
        return [f"{stem}: {sum(c['ok'] for c in cases)}/{len(cases)} bit-exact"]
    return []


def _figures(loaded: dict[str, dict]) -> str:
    parts, gate = [], []
    for name, data in loaded.items():
        stem = name.removesuffix(".json")
        ms = _load_ms(data)
        first = (data.get("results") or [{}])[0]
        if first.get("mode") == "gate":
            if data.get("status") == "ok":
                bad = sum(r.get("gate_bad_allreduce", 0) for r in data["results"])
                gate.append(f"{stem} {first.get('gate_iters')} iterations, {bad} bad")
        elif ms is not None and first.get("tokens", 0) >= 50_000:  # not a smoke run
            parts.append(f"{stem} {ms:.1f} ms")
        elif isinstance(data.get("status"), str) and data["status"] != "ok":
            gate.append(f"{stem}: {data['status'].split(':')[0]}")
        ratios = _probe_ratios(data)
        if ratios:
            parts.append(f"{stem}: " + ", ".join(ratios))
        parts += _exchange_probe(stem, data)
    for name in loaded:  # sharded<suffix>.json against replicated<suffix>.json
        if name.startswith("replicated"):
            pair = "sharded" + name.removeprefix("replicated")
            rep, sh = _load_ms(loaded[name]), _load_ms(loaded.get(pair, {}))
            if rep and sh:
                what = pair.removesuffix(".json") + " / " + name.removesuffix(".json")
                parts.append(f"{what} **{sh / rep:.3f}**")
    return "; ".join(parts + gate)


def _folder_machine(loaded: dict[str, dict]) -> str:
    names = []
    for data in loaded.values():
        gpus = data.get("gpus") or []
        if gpus:
            names.append(
                f"{len(gpus)}× {gpus[0]}" if len(set(gpus)) == 1 else ", ".join(gpus)
            )
        elif isinstance(data.get("gpu"), str) and data.get("results"):
            names.append(f"{data['results'][0].get('world', 1)}× {data['gpu']}")
    return ", ".join(_distinct(names))


def _command(loaded: dict[str, dict]) -> str:
    """The run's command, or its scripts where the files come from several."""
    commands = _distinct(
        re.sub(r"^\S*python\S*\s+", "", str(d.get("command", "")))
        for d in loaded.values()
    )
    if len(commands) == 1:
        return f"`{commands[0]}`"
    scripts = _distinct(Path(c.split()[0]).name for c in commands)
    return ", ".join(
        f"`{s}` ×{sum(c.split()[0].endswith(s) for c in commands)}" for s in scripts
    )


def folder_rows(results: Path) -> list[str]:
    folders = sorted(p for p in results.iterdir() if p.is_dir())
    out = [
        "Load figures: median load-back over both ranks, the first load of each "
        "dropped.",
        "",
        "| Date | Run | Revision | Series label | Machine | Key figures | Command |",
        "|---|---|---|---|---|---|---|",
    ]
    for folder in folders:
        loaded = {
            f.name: json.loads(f.read_text()) for f in sorted(folder.glob("*.json"))
        }
        revs = _distinct(str(d.get("git_revision", "")) for d in loaded.values())
        labels = _distinct(d.get("series_label") for d in loaded.values())
        machine = _folder_machine(loaded) or ", ".join(
            _distinct(_machine(d) for d in loaded.values())
        )
        cells = (
            _date(folder.name),
            f"[`{folder.name}`](results/{folder.name}/)",
            ", ".join(r[:8] for r in revs),
            ", ".join(labels),
            machine,
            _figures(loaded),
            _command(loaded),
        )
        out.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return out


def rows(feature: Path) -> list[str]:
    return folder_rows(feature / "results")


def readme_text(feature: Path) -> str:
    readme = feature / "README.md"
    table = "\n".join(rows(feature)) + "\n"
    text = (
        readme.read_text()
        if readme.is_file()
        else f"# {feature.name} benchmarks\n\n## Results\n\n{START}\n{END}\n"
    )
    if START not in text or END not in text:
        raise SystemExit(f"{readme} has no {START} ... {END} markers")
    head, rest = text.split(START, 1)
    return f"{head}{START}\n{table}{END}{rest.split(END, 1)[1]}"


def features() -> list[Path]:
    return sorted(p.parent for p in HERE.glob("*/results") if p.is_dir())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    stale = []
    for feature in features():
        readme = feature / "README.md"
        new = readme_text(feature)
        if readme.is_file() and readme.read_text() == new:
            continue
        if args.check:
            stale.append(str(readme.relative_to(HERE.parent)))
        else:
            readme.write_text(new)
            print(f"updated {readme.relative_to(HERE.parent)}")
    if stale:
        print(
            "stale results tables: " + ", ".join(stale) + " (run "
            "`python benchmark/results_index.py`)",
            file=sys.stderr,
        )
        sys.exit(1)


if __name__ == "__main__":
    main()
