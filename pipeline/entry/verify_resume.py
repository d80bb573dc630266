"""Prove that resuming from a checkpoint is exact, for your model and config, in one command.

    python -B scripts/03_verify_resume.py --output runs/proof
    python -B scripts/03_verify_resume.py --output runs/proof-20 --steps 20 --cut 7
    python -B scripts/03_verify_resume.py --output runs/proof-charlm --config examples/charlm/config.yaml
    python -B scripts/03_verify_resume.py --output runs/proof-gpu --set training.device=cuda --atol 1e-6
    python -B scripts/03_verify_resume.py --output runs/proof-ddp --nproc-per-node 2

Each in its own process, with this interpreter: N uninterrupted steps; the same run cut at
step K with a checkpoint; a resume from it to N; and one resume per saved component (RNG,
optimizer, scheduler, data) that leaves it unrestored and must diverge. Everything lands
in the new --output folder (never in checkpoint.dir); OUTPUT/verification.json holds every
check with its measured difference. The last stdout line is a one-line JSON summary.

With --nproc-per-node N (training.parallel auto, ddp or fsdp2) the proof runs at that world
size: two torchrun launches, the uninterrupted run (which also saves the cut checkpoint),
then the resume and the controls, which add a swap of the ranks' RNG streams; the
final checkpoints are compared bit for bit (pipeline/proof/distributed.py).

Exit codes: 0 proven; 1 a comparison failed (or an omission went undetected, or the swap
missed a rank); 2 the protocol could not complete (bad input, existing --output, unprepared
data, a failed leg).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from ..cli import add_config_arguments, config_from_args
from ..errors import PipelineError, ProofIncomplete
from ..proof import describe, summary_line, verify_resume, verify_resume_distributed
from . import step_parser


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    parser = step_parser(__doc__, prog)
    add_config_arguments(parser)
    parser.add_argument(
        "--output", type=Path, required=True, help="new folder for checkpoints and the report"
    )
    parser.add_argument(
        "--steps",
        type=int,
        metavar="N",
        help="steps of the continuous run (default 10, at most training.max_steps)",
    )
    parser.add_argument(
        "--cut",
        type=int,
        metavar="K",
        help="checkpoint and resume after step K (default: the "
        "last step inside an epoch with an epoch boundary still to come)",
    )
    parser.add_argument(
        "--atol",
        type=float,
        default=0.0,
        metavar="X",
        help="absolute tolerance for floating values, rtol 0 (default 0: bitwise)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        metavar="J",
        help="leg processes at once (default: one per leg, all "
        "of a phase at once, on CPU; 1 on CUDA); with fewer processes than legs each runs several "
        "in turn, the resume always first in a fresh one",
    )
    parser.add_argument(
        "--nproc-per-node",
        type=int,
        metavar="P",
        help="prove the resume of a torchrun run "
        "with P processes (training.parallel auto, ddp or fsdp2); each leg is a torchrun launch",
    )
    args = parser.parse_args(argv)
    if args.output.exists() or args.output.is_symlink():
        # Checked before anything else is read: an existing folder is left exactly as it is.
        raise PipelineError(
            f"{args.output} already exists: the proof writes only into a new folder "
            "(nothing was touched); pass another --output"
        )
    if args.jobs is not None and args.nproc_per_node is not None:
        raise PipelineError(
            "--jobs applies to single-process legs; with --nproc-per-node each leg is a torchrun launch"
        )
    if args.jobs is not None and args.jobs < 1:
        raise PipelineError(f"--jobs must be >= 1 (got {args.jobs})")
    config = config_from_args(args)
    try:
        if args.nproc_per_node is not None:
            report = verify_resume_distributed(
                config,
                output=args.output,
                nproc=args.nproc_per_node,
                steps=args.steps,
                cut=args.cut,
                atol=args.atol,
                echo=lambda line: print(line, flush=True),
            )
        else:
            report = verify_resume(
                config,
                output=args.output,
                steps=args.steps,
                cut=args.cut,
                atol=args.atol,
                config_path=args.config,
                jobs=args.jobs,
                echo=lambda line: print(line, flush=True),
            )
    except ProofIncomplete as exc:
        print(json.dumps(summary_line(exc.report, args.output)), flush=True)
        raise
    for line in describe(report):
        print(line)
    print(json.dumps(summary_line(report, args.output)), flush=True)
    return 0 if report["all_checks_passed"] else 1
