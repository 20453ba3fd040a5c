"""InternalErrors: a failure inside kvcore becomes a counted reason, logged once a kind,
its first message kept for reports; a CUDA error is raised, never passed."""

from __future__ import annotations

import logging

import pytest

from kvcore.internal_errors import InternalErrors


def test_each_kind_is_logged_once_and_its_first_message_kept(caplog):
    errors = InternalErrors("Engine", logging.getLogger("kvcore.test"))
    with caplog.at_level(logging.WARNING, logger="kvcore.test"):
        assert errors.reason(ValueError("first\nsecond line")) == "internal_error:ValueError"
        assert errors.reason(ValueError("later")) == "internal_error:ValueError"
        assert errors.reason(KeyError("k")) == "internal_error:KeyError"
    assert len(caplog.records) == 2
    assert errors.seen() == {"internal_error:ValueError": "first", "internal_error:KeyError": "'k'"}
    errors.forget()
    assert errors.seen() == {}


def test_a_cuda_error_is_raised_not_passed():
    errors = InternalErrors("Engine", logging.getLogger("kvcore.test"))
    with pytest.raises(RuntimeError, match="CUDA error"):
        errors.reason(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert errors.seen() == {}
