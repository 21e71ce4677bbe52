"""A model directory with the shape of SOURCE and random weights: SOURCE's
config.json and tokenizer files (no weights needed) in, a directory that
``mesh-package build`` takes out. For measuring the work per token of a model
whose weights are not on the machine (the text it writes means nothing).

    python scripts/random_model.py SOURCE TARGET [--std 0.05] [--seed 0]

``--std`` sets the weights' standard deviation: at the usual 0.02 the greedy text of
a random model repeats one token, so comparing texts (alone and batched) would say
little; 0.05 gives varied tokens.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("target", type=Path)
    parser.add_argument("--std", type=float, default=0.05, help="weights' standard deviation")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    config = AutoConfig.from_pretrained(args.source)
    config.initializer_range = args.std
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config)
    model.to(torch.float32).save_pretrained(args.target)
    for path in args.source.iterdir():
        if path.is_file() and path.name != "config.json":
            shutil.copy(path, args.target / path.name)
    count = sum(p.numel() for p in model.parameters())
    print(f"random model: {count} parameters at {args.target}")  # noqa: T201 - a CLI
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
