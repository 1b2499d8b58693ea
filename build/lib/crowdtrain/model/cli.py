"""`crowdtrain model-info`: parameter counts, patterns, layout, FLOPs and weight memory."""

from __future__ import annotations

import json


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "model-info", help="describe a model preset (parameters, patterns, FLOPs, memory)",
        description="Print unique and unshared parameter counts, the per-layer attention patterns "
                    "and sharing groups, the sequence layout, FLOPs per token and weight memory.")
    p.add_argument("--preset", default="demo", help="model preset: tiny, demo or paper (default: demo)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(handler=_model_info)


def _model_info(args) -> int:
    from crowdtrain.model.config import get_preset
    from crowdtrain.model.info import format_info, model_info

    info = model_info(get_preset(args.preset))
    print(json.dumps(info, indent=2) if args.json else format_info(info))
    return 0
