"""The beside-compute benchmarks' JSON document (benchmarks/beside_cli.py)."""

from __future__ import annotations

import os
import types

import torch

from benchmarks import beside_cli


def test_the_document_records_the_kvcore_variables_the_run_had(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "a test GPU")
    for name in [k for k in os.environ if k.startswith("KVCORE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("KVCORE_STAGE_REGIONS", "all")
    monkeypatch.setenv("KVCORE_RING_SCATTER_CTAS", "32")
    monkeypatch.setenv("NOT_KVCORE_STAGE_REGIONS", "off")
    engine = types.SimpleNamespace(__version__="9.9")
    doc = beside_cli.document("vllm", torch.device("cpu"), engine, [], [], forward_span=1.0)
    assert doc["kvcore_variables"] == {
        "KVCORE_RING_SCATTER_CTAS": "32",
        "KVCORE_STAGE_REGIONS": "all",
    }
    assert (doc["device"], doc["version"], doc["forward_span"]) == ("a test GPU", "9.9", 1.0)
