#!/usr/bin/env python3
"""Compares the training losses of two runs' metrics.jsonl files, step by step.

Default: two backends (CPU fp32 and CUDA bf16). The measure is the relative difference of the
logged interval losses (each the mean over that interval's labelled tokens): its median and
maximum, with the early steps (the first 10% of the run, where the loss falls fastest) reported
apart. --exact: the runs must be bit-identical (a resumed run against an uninterrupted one);
the last entry per iteration counts, since a resumed run re-logs the steps after its checkpoint.
"""
import json
import statistics
import sys


def losses(path):
    by_step = {}
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if "loss" in rec and rec.get("kind", "train") == "train" and "iteration" in rec:
                by_step[rec["iteration"]] = rec["loss"]
    return by_step


def main():
    args = sys.argv[1:]
    exact = "--exact" in args
    args = [a for a in args if a != "--exact"]
    a, b = losses(args[0]), losses(args[1])
    steps = sorted(set(a) & set(b))
    if not steps:
        print("no common steps")
        return 1
    if exact:
        diff = [s for s in steps if a[s] != b[s]]
        print(f"{len(steps)} common steps, {len(diff)} differ" +
              (f" (first at {diff[0]}: {a[diff[0]]!r} vs {b[diff[0]]!r})" if diff else
               ": bit-identical"))
        return 1 if diff else 0
    rel = {s: abs(a[s] - b[s]) / abs(a[s]) for s in steps}
    cut = steps[-1] // 10
    late = [rel[s] for s in steps if s > cut] or list(rel.values())
    print(f"{len(steps)} logged steps; loss at step {steps[0]}: {a[steps[0]]:.5f} vs "
          f"{b[steps[0]]:.5f}; at step {steps[-1]}: {a[steps[-1]]:.5f} vs {b[steps[-1]]:.5f}")
    print(f"relative difference |cpu - cuda| / cpu: median {statistics.median(late):.4f}, "
          f"max {max(late):.4f} after step {cut}; max {max(rel.values()):.4f} overall")
    return 0


if __name__ == "__main__":
    sys.exit(main())
