"""What is live on the GPU at a run's peak, by the code that allocated it, from a CUDA memory snapshot.

`python scripts/memory_snapshot_peak.py SNAPSHOT.pickle [--top N]` reads a snapshot written by
`pickle.dump(torch.cuda.memory._snapshot(), f)` while `torch.cuda.memory._record_memory_history()`
recorded (torchtitan writes them with `--profiling.enable_memory_snapshot --profiling.profile_freq K`
into DUMP_FOLDER/memory_snapshot/iteration_K/rank0_memory_snapshot.pickle) and prints a markdown
report:

- the allocator's state at the snapshot: reserved (segments) and allocated (active blocks) GiB;
- the recorded trace replayed: allocations add their size, frees (`free_requested`) take it back;
  the peak of that sum and the event at which it is reached;
- what is live at that peak, grouped by the first stack frame outside torch's own files (the model's
  or a library's line that asked for the memory), largest first, with the count of blocks;
- memory allocated before recording began (still allocated at the snapshot, hence live at the peak
  too): active blocks of the snapshot that the trace never saw allocated.

Only device 0's trace is read (one process, one GPU, as each torchtitan rank writes its own file).
"""

from __future__ import annotations

import argparse
import pickle
import sys
from collections import defaultdict
from pathlib import Path

GIB = 2**30
# frames in these folders are torch's own machinery, not the code that asked for the memory
INTERNAL = ("/torch/", "<frozen", "/threading.py", "/contextlib.py", "??", "aten/src/", "c10/", ".so")


def owner(frames: list[dict]) -> str:
    """`file:line function` of the first frame outside torch's own files (`(torch)` when none)."""
    for f in frames or ():
        name = str(f.get("filename", "??"))
        if not any(s in name for s in INTERNAL):
            parts = Path(name).parts
            short = "/".join(parts[-4:]) if len(parts) > 4 else name
            return f"{short}:{f.get('line', '?')} {f.get('name', '?')}"
    return "(torch)"


def peak_report(snapshot: dict, top: int = 20) -> str:
    """The markdown report of the module docstring for one snapshot dict."""
    if not isinstance(snapshot, dict) or "segments" not in snapshot:
        raise ValueError("snapshot: expected the dict of torch.cuda.memory._snapshot() (keys 'segments', 'device_traces')")
    segments = snapshot["segments"]
    reserved = sum(s.get("total_size", 0) for s in segments)
    active = {b["address"]: b["size"] for s in segments for b in s.get("blocks", ())
              if b.get("state") == "active_allocated"}
    traces = snapshot.get("device_traces") or [[]]
    trace = traces[0] if traces else []
    if not trace:
        raise ValueError("snapshot: it holds no allocation trace (device_traces empty): it was taken while "
                         "torch.cuda.memory._record_memory_history() was off; record, then snapshot")

    # pass 1: the running sum of what the trace allocated, and where it peaks
    live: dict[int, tuple[int, str]] = {}
    seen: set[int] = set()
    cur = peak = 0
    peak_at = -1
    for i, e in enumerate(trace):
        act, addr, size = e.get("action"), e.get("addr"), int(e.get("size", 0))
        if act == "alloc":
            live[addr] = (size, "")
            seen.add(addr)
            cur += size
            if cur > peak:
                peak, peak_at = cur, i
        elif act == "free_requested" and addr in live:
            cur -= live.pop(addr)[0]
    # pass 2: replay to the peak, keeping who allocated each live block
    live.clear()
    for e in trace[: peak_at + 1]:
        act, addr = e.get("action"), e.get("addr")
        if act == "alloc":
            live[addr] = (int(e.get("size", 0)), owner(e.get("frames", ())))
        elif act == "free_requested":
            live.pop(addr, None)
    before = sum(size for addr, size in active.items() if addr not in seen)

    by: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, who in live.values():
        by[who][0] += size
        by[who][1] += 1
    rows = sorted(by.items(), key=lambda kv: -kv[1][0])
    out = [
        f"- reserved at the snapshot: {reserved / GIB:.2f} GiB; allocated: {sum(active.values()) / GIB:.2f} GiB",
        f"- trace: {len(trace)} events; peak of what it allocated: {peak / GIB:.2f} GiB at event {peak_at}",
        f"- allocated before recording began (still live at the snapshot): {before / GIB:.2f} GiB",
        f"- peak estimate (trace peak + allocated before): {(peak + before) / GIB:.2f} GiB",
        "",
        "| live at the trace's peak, allocated by | GiB | blocks |",
        "|---|---|---|",
    ]
    out += [f"| `{who}` | {size / GIB:.3f} | {n} |" for who, (size, n) in rows[:top]]
    rest = rows[top:]
    if rest:
        out.append(f"| {len(rest)} other lines | {sum(s for _, (s, _) in rest) / GIB:.3f} | "
                   f"{sum(n for _, (_, n) in rest)} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("snapshot", type=Path, help="a pickled torch.cuda.memory._snapshot()")
    p.add_argument("--top", type=int, default=20, help="how many allocating lines to list (default 20)")
    a = p.parse_args(argv)
    if a.top < 1:
        p.error(f"--top {a.top}: expected a number of lines >= 1")
    try:
        with open(a.snapshot, "rb") as f:
            snap = pickle.load(f)
    except (OSError, pickle.UnpicklingError, EOFError) as e:
        raise SystemExit(f"snapshot {a.snapshot}: cannot read a pickled memory snapshot ({e})")
    try:
        print(f"## {a.snapshot}\n\n{peak_report(snap, a.top)}")
    except ValueError as e:
        raise SystemExit(f"{a.snapshot}: {e}")


if __name__ == "__main__":
    main(sys.argv[1:])
