"""Train with exact resume on local, atomic, hashed checkpoints. Nothing is uploaded.

    python scripts/02_train.py                          # fresh run to training.max_steps
    python scripts/02_train.py --stop-at 5              # stop after step 5 with a checkpoint
    python scripts/02_train.py --resume latest          # continue bitwise-identically
    python scripts/02_train.py --resume auto            # resume if a checkpoint exists, else start
    python scripts/02_train.py --resume latest --extend-to 40   # train a finished run on to step 40
    python scripts/02_train.py --init-from estados_local/step-00000010 --checkpoint-dir runs/ft
    python scripts/02_train.py --config examples/charlm/config.yaml
    torchrun --standalone --nproc-per-node 2 scripts/02_train.py   # DDP (training.parallel auto)
    torchrun --standalone --nproc-per-node 4 scripts/02_train.py --set training.parallel=fsdp2 --resume latest --reshard
    python scripts/02_train.py --resume latest --reshard  # a torchrun run continued in one process

Exit codes: 0 done; 2 bad input or unusable checkpoint (nothing deleted);
128+N stopped by signal N after writing a checkpoint.
"""

from __future__ import annotations

import sys
from typing import Sequence

from ..cli import add_checkpoint_dir_argument, add_config_arguments, config_from_args, resume_command
from ..train import train
from ..world import joins_launch
from . import step_parser


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    # The resume command printed on SIGTERM is rebuilt from sys.argv (no abbreviations).
    parser = step_parser(__doc__, prog)
    add_config_arguments(parser)
    parser.add_argument("--max-steps", type=int, help="total optimizer steps of the run (training.max_steps)")
    parser.add_argument(
        "--stop-at", type=int, metavar="K", help="end after step K with a checkpoint, as if interrupted"
    )
    parser.add_argument("--resume", metavar="latest|auto|PATH", help="continue from a checkpoint")
    parser.add_argument(
        "--extend-to",
        type=int,
        metavar="N",
        help="with --resume: continue the run to N steps (N above its step and max_steps); "
        "optimizer, data position and RNGs continue, the schedule keeps its first length",
    )
    parser.add_argument(
        "--init-from", metavar="PATH", help="warm-start weights only (shape-tolerant); a new run"
    )
    add_checkpoint_dir_argument(parser)
    parser.add_argument(
        "--checkpoint-every", type=int, metavar="K", help="save every K steps (checkpoint.every)"
    )
    parser.add_argument(
        "--keep-last", type=int, metavar="K", help="committed checkpoints to keep (checkpoint.keep_last)"
    )
    parser.add_argument(
        "--allow-environment-change",
        action="store_true",
        help="resume even where the checkpoint's thread counts, determinism switches, device type or "
        "torch/NumPy versions cannot be reproduced (recorded; no longer bitwise), or where the "
        "model's code or a factory file changed since the checkpoint",
    )
    parser.add_argument(
        "--reshard",
        action="store_true",
        help="with --resume: continue a checkpoint written by another launch (one process or "
        "torchrun, another number of processes, ddp or fsdp2); recorded in meta.json",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    args = parser.parse_args(argv)
    config = config_from_args(
        args,
        {
            "training.max_steps": args.max_steps,
            "checkpoint.dir": args.checkpoint_dir,
            "checkpoint.every": args.checkpoint_every,
            "checkpoint.keep_last": args.keep_last,
        },
    )
    options = dict(
        resume=args.resume,
        init_from=args.init_from,
        stop_at=args.stop_at,
        extend_to=args.extend_to,
        reshard=args.reshard,
        progress=not args.quiet,
        allow_environment_change=args.allow_environment_change,
    )
    # One process names this command to resume; a launch's rank names the torchrun launch.
    hint = None if joins_launch(config) else resume_command(sys.argv)
    result = train(config, resume_hint=hint, **options)
    if result.rank != 0:
        return 0
    final_loss = result.history["loss"][-1] if result.history["loss"] else float("nan")
    print(
        f"trained to step {result.step}/{result.max_steps}, loss {final_loss:.6g}; "
        f"checkpoint {result.checkpoint}"
    )
    return 0
