"""Step time and peak memory per rank of the Megatron backend against torch (DDP) and DeepSpeed on the
same small MoE, side by side in one run: `snowcat bench trainer` is `snowcat bench trainer-memory`
with the megatron modes (benchmarks/trainer_memory.py says what is measured and how).

    snowcat bench trainer [trainer-memory's options] [--json FILE]
"""

from __future__ import annotations

import sys

from snowcat.benchmarks import trainer_memory

MODES = "ddp,zero2,megatron,megatron+ep2,megatron+tp2,megatron+pp2"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = " ".join(["snowcat", "bench", "trainer", *argv])
    return trainer_memory.main(argv if "--modes" in argv else ["--modes", MODES, *argv], command=command)


if __name__ == "__main__":
    sys.exit(main())
