"""Evaluate the newest verified checkpoint on the held-out split; write metrics.json.

    python scripts/04_evaluate.py                                   # latest in checkpoint.dir
    python scripts/04_evaluate.py --checkpoint estados_local/step-00000010
    python scripts/04_evaluate.py --checkpoint best                 # the best evaluated (checkpoint.best_metric)
    python scripts/04_evaluate.py --checkpoint-dir runs/ft             # latest in 02's --checkpoint-dir
    python scripts/04_evaluate.py --output runs/metrics.json
    python scripts/04_evaluate.py --config examples/charlm/config.yaml   # -> runs/charlm/metrics.json

Every file of the checkpoint is verified against its meta.json and the data folder against
the fingerprint the checkpoint was trained on. The model is rebuilt from the config saved
in the checkpoint. metrics.json records the step and the SHA-256 of modelo.safetensors, so
scripts/05_stage.py only shows these metrics next to exactly these weights. A distributed
(torchrun) checkpoint is evaluated here too, in one process: its shards are consolidated
into the modelo.safetensors that 05 stages from them (docs/distributed.md).

Exit codes: 0 done; 2 no usable checkpoint or data (one line on stderr).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from ..cli import add_checkpoint_dir_argument, add_config_arguments, config_from_args
from ..evaluate import evaluate_checkpoint, write_metrics
from . import step_parser


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    parser = step_parser(__doc__, prog)
    add_config_arguments(parser)
    add_checkpoint_dir_argument(parser)
    parser.add_argument(
        "--checkpoint",
        default="latest",
        metavar="latest|best|PATH",
        help="checkpoint to evaluate (default: the newest committed one in checkpoint.dir; best: the one "
        "checkpoint.best_metric marked)",
    )
    parser.add_argument(
        "--output",
        type=Path,
        help="where to write the record (default: the config's outputs.metrics, metrics.json for "
        "config.yaml)",
    )
    args = parser.parse_args(argv)
    config = config_from_args(args, {"checkpoint.dir": args.checkpoint_dir})
    record = evaluate_checkpoint(config, args.checkpoint)
    path = write_metrics(record, config, args.output)
    print(f"evaluated {record['checkpoint']} (step {record['step']}) on the {record['split']} split")
    print(f"  modelo.safetensors sha256 {record['modelo_sha256']}")
    for name, value in sorted(record["metrics"].items()):
        print(f"  {name} = {value:.6g}")
    print(f"wrote {path}")
    return 0
