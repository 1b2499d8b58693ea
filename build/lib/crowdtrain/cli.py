"""The `crowdtrain` command line.

Each subsystem contributes its subcommands through a ``register(subparsers)`` function in its
own ``cli.py``; heavy imports (torch, hivemind) happen inside the handlers, so `--help` is fast
and the coordinator's commands never import torch.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# Modules that add subcommands, in the order they appear in `crowdtrain --help`.
SUBCOMMAND_MODULES = [
    "crowdtrain.model.cli",
    "crowdtrain.data.cli",
    "crowdtrain.memcalc.cli",
    "crowdtrain.train.cli",
    "crowdtrain.coordinator.cli",
    "crowdtrain.swarm.cli",
    "crowdtrain.testbed.cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="crowdtrain",
        description="Train one DALL-E-like transformer together: organizers start a run, "
                    "volunteers join with one command.")
    parser.add_argument("--verbose", "-v", action="store_true", help="log at DEBUG level")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBCOMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname).1s %(name)s: %(message)s", datefmt="%H:%M:%S")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    setup_logging(args.verbose)
    try:
        return int(args.handler(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        # Errors a user can fix: say what and how, without a traceback.
        print(f"crowdtrain {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
