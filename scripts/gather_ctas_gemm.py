"""What kvcore's gather costs a concurrent GEMM at a given CTA count (issue 17, goal 4).

Runs the SGLang engine-shaped sweep's GEMM cells where kvcore serves by its gather
(token-granular `layer_first` / `kernel`, scattered host slots), in this process, with the
CTA counts kvcore reads from ``KVCORE_GATHER_CTAS`` (gathers into device rows: loads) and
``KVCORE_GATHER_CTAS_TO_HOST`` (into host rows: backups). Run it once per count, e.g. on
the GPU machine (carry .whl-sglang):

    source scripts/sglang_device_env.sh
    for ctas in 2 4 8; do
        KVCORE_GATHER_CTAS=$ctas KVCORE_GATHER_CTAS_TO_HOST=$ctas \
            python3 scripts/gather_ctas_gemm.py --json $OUT/ctas-$ctas.json
    done
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

# The engine benches are in the checkout's benchmarks/ package, not in the wheel.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import sweep_report
from benchmarks.sglang import sweep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="32768", help="comma list of request sizes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    opts = sweep.SweepOptions(
        tokens=tuple(int(t) for t in args.tokens.split(",")),
        layouts=(("layer_first", "kernel", (1,)),),
        host_levels=("100%",),
        repeats=args.repeats,
        device=torch.device("cuda"),
        gemm=True,
    )
    result = sweep.run(opts)
    ctas = "/".join(
        os.environ.get(name, "default")
        for name in ("KVCORE_GATHER_CTAS", "KVCORE_GATHER_CTAS_TO_HOST")
    )
    for line in sweep.gemm_summary(result["rows"]):
        print(f"ctas {ctas}: {line}")
    for row in result["rows"]:
        own = row.extra.get("own_ms", float("nan"))
        print(f"ctas {ctas}: {row.case} {row.tokens}: stock {row.stock_ms:.2f}, own {own:.2f} ms")
    sweep_report.write_json(args.json, {"gather_ctas": ctas, **result["document"]})


if __name__ == "__main__":
    main()
