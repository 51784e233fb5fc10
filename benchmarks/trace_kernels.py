"""The GPU kernels of a chrome trace (``end_to_end.py --profile-dir``), summed by name.

    python benchmarks/trace_kernels.py TRACE.json [--top 30] [--by-grid] [--gaps 15]
    python benchmarks/trace_kernels.py A.json --against B.json [--by-grid] [--top 30]

Prints each kernel name's total time, count and share of all kernel time, largest first,
then the totals by class (matmul, attention, communication, other): what a step spends
its GPU time on, to see what holds a layout back. ``--gaps N``: the N longest stretches with
no kernel running (the "idle" of the breakdown), each with the kernels on either side and
the CPU op running when the GPU went idle, to tell launch latency from a host wait.
``--against B``: each kernel's time and count in A and in B side by side, largest
difference first, and the difference by class: which kernels one layout runs longer. It also
prints how much longer the matmul and attention kernels that both traces launch alike (same
name, grid and count) ran in A: the same kernel on the same shapes takes the same time at the
same clocks, so a ratio far from 1 says the two steps ran at different clocks (power, heat),
and their milliseconds are not comparable kernel by kernel (their shares are).
"""
import argparse
import collections
import gzip
import json
import sys

CLASSES = (  # first match wins; lower-case substrings of kernel names
    ("communication", ("nccl",)),
    ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
    ("matmul", ("gemm", "nvjet", "cutlass", "cublas", "sm90_xmma", "wgmma")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),      # the gradient norm included
    ("generated (Triton)", ("triton",)),
)


def kernel_class(name: str) -> str:
    n = name.lower()
    return next((c for c, keys in CLASSES if any(k in n for k in keys)), "other (ATen)")


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--by-grid", action="store_true",
                    help="one line per kernel name and launch grid (tells apart the shapes of one matmul kernel)")
    ap.add_argument("--gaps", type=int, default=0, help="print the N longest idle stretches")
    ap.add_argument("--against", default="", help="a second trace: print both side by side")
    args = ap.parse_args()
    events = kernel_events(args.trace)
    if args.gaps:
        print_gaps(events, args.gaps)
    total, count = sum_kernels(events, args.by_grid)
    if args.against:
        other = kernel_events(args.against)
        print_against(total, count, *sum_kernels(other, args.by_grid), args.top)
        return print_clock_check(events, other)
    every = sum(total.values())
    if not every:
        sys.exit(f"{args.trace}: no kernel events")
    print(f"{'ms':>8s} {'share':>6s} {'count':>6s}  kernel")
    for name, us in total.most_common(args.top):
        print(f"{us / 1e3:8.2f} {us / every:6.1%} {count[name]:6d}  {name[:170]}")
    by_class = collections.Counter()
    for name, us in total.items():
        by_class[kernel_class(name)] += us
    print(f"\nall kernels {every / 1e3:.2f} ms: " +
          ", ".join(f"{k} {v / 1e3:.2f} ms ({v / every:.0%})" for k, v in by_class.most_common()))


def kernel_events(path):
    events = load(path)
    return events.get("traceEvents", events) if isinstance(events, dict) else events


def sum_kernels(events, by_grid):
    total, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "kernel":
            key = e["name"]
            if by_grid:
                key = f"{key} grid={e.get('args', {}).get('grid')}"
            total[key] += e.get("dur", 0.0)
            count[key] += 1
    return total, count


def print_against(total_a, count_a, total_b, count_b, top):
    names = set(total_a) | set(total_b)
    diff = sorted(names, key=lambda n: -abs(total_a[n] - total_b[n]))
    print(f"{'A ms':>8s} {'B ms':>8s} {'A-B':>7s} {'A n':>5s} {'B n':>5s}  kernel")
    for n in diff[:top]:
        print(f"{total_a[n] / 1e3:8.2f} {total_b[n] / 1e3:8.2f} {(total_a[n] - total_b[n]) / 1e3:7.2f} "
              f"{count_a[n]:5d} {count_b[n]:5d}  {n[:160]}")
    by_a, by_b = collections.Counter(), collections.Counter()
    for n in names:
        by_a[kernel_class(n)] += total_a[n]
        by_b[kernel_class(n)] += total_b[n]
    print("\nby class, A / B ms: " + ", ".join(
        f"{c} {by_a[c] / 1e3:.2f} / {by_b[c] / 1e3:.2f}" for c in sorted(set(by_a) | set(by_b))))
    print(f"all kernels: A {sum(total_a.values()) / 1e3:.2f} ms, B {sum(total_b.values()) / 1e3:.2f} ms")


def same_kernel_ratio(events_a, events_b):
    """(A's time / B's over the matmul and attention kernels both launch alike: same name, grid
    and count; how many such kernels), or (None, 0) when they share none."""
    (ta, ca), (tb, cb) = sum_kernels(events_a, True), sum_kernels(events_b, True)
    alike = [k for k in ta if k in tb and ca[k] == cb[k] and kernel_class(k) in ("matmul", "attention")]
    b = sum(tb[k] for k in alike)
    return (sum(ta[k] for k in alike) / b, len(alike)) if b else (None, 0)


def print_clock_check(events_a, events_b):
    ratio, n = same_kernel_ratio(events_a, events_b)
    if ratio is None:
        print("no matmul or attention kernel launched alike in both: no clock check")
        return
    print(f"the {n} matmul/attention kernels both launch alike (name, grid, count) ran {ratio:.3f}x as long in A"
          + ("" if abs(ratio - 1) < 0.03 else ": the steps ran at different clocks; compare shares, not ms"))


def print_gaps(events, top):
    kernels = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"),
                     key=lambda e: e["ts"])
    cpu = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "python_function")),
                 key=lambda e: e["ts"])
    gaps, end, last = [], None, None
    for k in kernels:
        if end is not None and k["ts"] > end:
            gaps.append((k["ts"] - end, end, last["name"], k["name"]))
        if end is None or k["ts"] + k.get("dur", 0) > end:
            end, last = k["ts"] + k.get("dur", 0), k
    total = sum(g[0] for g in gaps)
    print(f"idle: {total / 1e3:.2f} ms in {len(gaps)} gaps; the {top} longest:")
    for dur, at, before, after in sorted(gaps, reverse=True)[:top]:
        # the innermost CPU op running when the GPU went idle
        host = [c["name"] for c in cpu if c["ts"] <= at <= c["ts"] + c.get("dur", 0)]
        print(f"{dur / 1e3:8.3f} ms after {before[:60]!r} before {after[:60]!r}; host in {host[-1][:70] if host else '-'!r}")
    print()


if __name__ == "__main__":
    main()
