"""CPU seconds per process group between two ``ps -eo pid,times,args`` snapshots (run.sh), and
the machine's idle share from two ``/proc/stat`` first lines. Prints ``shares.txt``."""

import re
from pathlib import Path

HERE = Path(__file__).parent
CLOCK_TICKS_PER_S = 100
LABELS = [(r"Engine", "Engine replica (model)"), (r"Ingress", "Ingress replica"), (r"ProxyActor", "Serve proxy"),
          (r"ServeController", "Serve controller"), (r"raylet", "raylet"), (r"gcs_server", "GCS"),
          (r"dashboard", "dashboard"), (r"serve run", "serve run CLI"), (r"log_monitor", "log monitor"),
          (r"monitor\.py", "autoscaler monitor"), (r"runtime_env", "runtime env agent")]


def load(path: Path) -> dict[str, tuple[int, str]]:
    out = {}
    for line in path.read_text().splitlines():
        parts = line.split(None, 2)
        if len(parts) == 3:
            out[parts[0]] = (int(parts[1]), parts[2].strip())
    return out


def label(args: str) -> str:
    return next((name for pat, name in LABELS if re.search(pat, args)), "other: " + args[:60])


def cpu_ticks(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()[1:]]


def main() -> None:
    before, after = load(HERE / "before.txt"), load(HERE / "after.txt")
    rows: dict[str, int] = {}
    for pid, (seconds, args) in after.items():
        used = seconds - before.get(pid, (0, ""))[0]
        if used > 0:
            rows[label(args)] = rows.get(label(args), 0) + used
    delta = [b - a for a, b in zip(cpu_ticks(HERE / "stat-before.txt"), cpu_ticks(HERE / "stat-after.txt"),
                                   strict=True)]
    total = sum(delta) / CLOCK_TICKS_PER_S
    idle = (delta[3] + delta[4]) / CLOCK_TICKS_PER_S
    print(f"window CPU capacity {total:.0f} s, idle {idle:.0f} s ({idle / total:.0%})")
    for name, used in sorted(rows.items(), key=lambda kv: -kv[1]):
        print(f"{name:40s} {used:5d} s  {used / total:6.1%}")


if __name__ == "__main__":
    main()
