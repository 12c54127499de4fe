#!/usr/bin/env python3
"""Sums an `ncu --csv --page raw --metrics gpu__time_duration.sum` log by kernel name, and by
coarse kind (GEMM, attention, norms, ...), largest first.

  ncu --profile-from-start off --metrics gpu__time_duration.sum --csv --page raw \\
      --cache-control none --clock-control none iris bench --train ... --profile > ncu.csv
  python3 tools/ncu_kernel_summary.py ncu.csv
"""
import csv, re, sys
from collections import defaultdict


def main():
    lines = [l for l in open(sys.argv[1]) if l.startswith('"')]
    rows = list(csv.reader(lines))
    head = rows[0]
    name_col, time_col = head.index("Kernel Name"), head.index("gpu__time_duration.sum")
    unit = rows[1][time_col] if not rows[1][time_col].replace(".", "").isdigit() else "ns"
    scale = {"ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0, "nsecond": 1e-6}.get(unit, 1e-6)
    by_name, by_kind = defaultdict(lambda: [0.0, 0]), defaultdict(float)
    for r in rows[1:]:
        try:
            t = float(r[time_col].replace(",", "")) * scale
        except ValueError:
            continue
        name = re.sub(r"\(.*", "", r[name_col].replace("<unnamed>", "anon"))[:110]
        by_name[name][0] += t
        by_name[name][1] += 1
        low = r[name_col].lower()
        kind = ("gemm" if any(k in low for k in ("gemm", "cutlass", "sm90_xmma", "nvjet")) else
                "attention" if "attention" in low or "flash" in low else
                "norm" if "norm" in low else "other")
        by_kind[kind] += t
    total = sum(v[0] for v in by_name.values())
    print(f"kernel time {total:.1f} ms over {sum(v[1] for v in by_name.values())} launches")
    for k, t in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {k:10s} {t:8.2f} ms {100 * t / total:5.1f}%")
    for name, (t, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:30]:
        print(f"{100 * t / total:5.1f}% {t:8.2f} ms x{n:5d} {name}")


if __name__ == "__main__":
    main()
