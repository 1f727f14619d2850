"""python -m snowcat.containers build NAME|DEF OUT.sif [--arch A] | inspect SIF | digest SIF | convert Dockerfile OUT.def"""

import argparse
import json
import sys

from snowcat.containers import images
from snowcat.pipeline.errors import UserError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m snowcat.containers", description="snowcat's Apptainer images")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build trainer/rollout/sandbox (or a .def) into a SIF")
    b.add_argument("definition")
    b.add_argument("image")
    b.add_argument("--arch", default=None, choices=images.ARCHES)
    sub.add_parser("inspect", help="labels of a SIF").add_argument("image")
    sub.add_parser("digest", help="sha256 of a SIF").add_argument("image")
    c = sub.add_parser("convert", help="Dockerfile -> Apptainer definition")
    c.add_argument("dockerfile")
    c.add_argument("out")
    args = p.parse_args(argv)
    try:
        if args.cmd == "build":
            print(images.build(args.definition, args.image, arch=args.arch))
        elif args.cmd == "inspect":
            print(json.dumps(images.inspect_labels(args.image), indent=2, sort_keys=True))
        elif args.cmd == "digest":
            print(images.image_digest(args.image))
        else:
            print(images.dockerfile_to_def(args.dockerfile, args.out))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
