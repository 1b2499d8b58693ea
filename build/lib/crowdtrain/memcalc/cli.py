"""`crowdtrain memcalc`: how much GPU memory and RAM a model needs to train, and where it fits."""

from __future__ import annotations

import json


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "memcalc", help="estimate training memory (GPU and CPU) under memory-saving options",
        description="Peak GPU memory and CPU RAM of one training step, broken down into weights, gradients, "
                    "optimizer states, activations and buffers. Formulas: docs/memcalc.md.")
    p.add_argument("--model", default="gpt2-large", help="model name (see --list), e.g. gpt2-large, crowdtrain-paper")
    p.add_argument("--list", action="store_true", help="list the known models and exit")
    p.add_argument("--optimizer", default="fp32", choices=["fp32", "16bit", "8bit", "factorized"],
                   help="optimizer states: fp32 (Adam/LAMB), 16bit, 8bit (blockwise, bitsandbytes), factorized (Adafactor)")
    p.add_argument("--precision", default="fp32", choices=["fp32", "mixed", "pure16"],
                   help="fp32; mixed: 16-bit model with fp32 master weights; pure16: everything 16-bit")
    p.add_argument("--offload", action="store_true", help="optimizer (states, master weights, update) on the CPU")
    p.add_argument("--checkpointing", action="store_true", help="gradient checkpointing (one input kept per layer)")
    p.add_argument("--reversible", action="store_true", help="reversible layers (activations independent of depth)")
    p.add_argument("--shared-groups", type=int, default=None, help="distinct layers when sharing parameters")
    p.add_argument("--batch-size", type=int, default=1, help="micro-batch size (sequences per step)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the model's)")
    p.add_argument("--pcie-gb-per-s", type=float, default=16.0, help="host-device bandwidth for offload traffic")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--serve", action="store_true", help="serve the interactive calculator page instead")
    p.add_argument("--host", default="127.0.0.1", help="address for --serve")
    p.add_argument("--port", type=int, default=8081, help="port for --serve")
    p.set_defaults(handler=_memcalc)


def _memcalc(args) -> int:
    from crowdtrain.memcalc import Options, estimate, format_estimate, names

    if args.list:
        print("\n".join(names()))
        return 0
    if args.serve:
        import uvicorn

        from crowdtrain.memcalc.web import create_app

        print(f"memory calculator on http://{args.host}:{args.port}/memcalc/")
        uvicorn.run(create_app(), host=args.host, port=args.port, log_level="warning")
        return 0
    options = Options(optimizer=args.optimizer, precision=args.precision, offload=args.offload,
                      checkpointing=args.checkpointing, reversible=args.reversible, shared_groups=args.shared_groups,
                      batch_size=args.batch_size, seq_len=args.seq_len, pcie_gb_per_s=args.pcie_gb_per_s)
    est = estimate(args.model, options)
    print(json.dumps(est.to_dict(), indent=2) if args.json else format_estimate(est))
    return 0
