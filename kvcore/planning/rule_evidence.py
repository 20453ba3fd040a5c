"""The SGLang benchmark files (under docs/bench/) that the serve-or-pass rule's beside-compute
rows were decided from (:data:`kvcore.planning.serve_rule.SGLANG_RULES`); a test holds each
row that cites them to their cells."""

BESIDE_COMPUTE_EVIDENCE = "docs/bench/h200-beside-compute-sglang-2026-12-05.json"
"""The beside-compute rows (SGLang 0.5.23 through its L2TransferEngine, H200) that the load
rows are judged from: kvcore serves where its reload beside the model's forward is
faster than stock's and neither forward beside it is slower."""
RING_EVIDENCE = (
    "docs/bench/h200-beside-compute-sglang-2026-12-05-ring-a.json",
    "docs/bench/h200-beside-compute-sglang-2026-12-05-ring-b.json",
    "docs/bench/h200-beside-compute-sglang-2026-12-05-ring-4k-8k.json",
)
"""The same runs with the layer ring's host time halved (one scatter launch a layer):
MHA and MLA page 64 at 8k and 32k twice, pages 64 and 1 at 4k and 8k."""
RING_EVIDENCE_H100 = (
    "docs/bench/h100-beside-compute-sglang-2026-12-05-small.json",
    "docs/bench/h100-beside-compute-sglang-2026-12-05-p16.json",
)
"""The same ring on an H100 (the H200 was not lent): MHA at 1k and 2k, pages 64 and 1, and
page 16 at 8k and 32k."""
BACKUP_EVIDENCE = (
    "docs/bench/h100-beside-compute-sglang-2026-12-05-backups.json",
    "docs/bench/h100-beside-compute-sglang-2026-12-06-backups-span4.json",
)
"""Backups beside another batch's forward (H100), the second with the forward spanning four
times stock's copy, as an engine running forwards back to back does. Nothing waits for a
backup, so a backup row serves where the forward beside kvcore's is no slower than beside
stock's and the backup itself takes at most a quarter longer than stock's (its pages stay
locked that long)."""
