"""KV content the live HiCache run writes and checks: a pure function of where it belongs.

Token ``t`` at position ``p`` gets one random-looking row of 16-bit words, ``row(t, p)``
(``heads * head_dim`` of them); layer ``l``'s K (``kv = 0``) or V (``kv = 1``) holds that
row XORed with a salt of its own, ``salt(l, kv)``. A row copied to the wrong slot, from
the wrong layer, into K instead of V, or left stale, differs from what belongs there in
about every byte; one flipped byte is one mismatched byte. The words are made so every
element is a normal, finite, non-zero bf16 (exponent's top bit clear, its lowest bit and
the mantissa's lowest bit set), so no copy can normalise or drop one and no zero-filled
row passes.

The hash works in 32-bit words held in int64 tensors, every product below 2**63, so it
gives the same words on any device. Nothing here imports SGLang: the layer buffers come
in as a function ``layer -> (K, V)``, each ``[slots, heads, head_dim]`` of a 16-bit dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

LayerBuffers = Callable[[int], tuple[torch.Tensor, torch.Tensor]]

_MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31: a 32-bit value times one stays below 2**63.
_MUL_A = 0x7FEB352D
_MUL_B = 0x68E31DA5
_GOLDEN = 0x1E3779B9
_POSITION_SALT = 0x2545F491
_LAYER_SALT = 0x3C6EF372
# Bits of a bf16 word: the exponent's top bit (clear: finite), the exponent's lowest bit and
# the mantissa's lowest bit (set in rows, clear in salts, so set after the XOR: normal,
# non-zero).
_EXPONENT_TOP = 0x4000
_ALWAYS_SET = 0x0081


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche of ``x`` (int64 holding values below 2**32)."""
    x = x ^ (x >> 16)
    x = (x * _MUL_A) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL_B) & _MASK32
    return x ^ (x >> 16)


def _words(seeds: torch.Tensor, width: int) -> torch.Tensor:
    """``width`` 16-bit words (int64, 0..65535) per seed: shape ``[len(seeds), width]``."""
    lanes = torch.arange(width, dtype=torch.int64, device=seeds.device) * _GOLDEN
    return (_mix((seeds[:, None] + lanes[None, :]) & _MASK32) >> 8) & 0xFFFF


def _as_int16(words: torch.Tensor) -> torch.Tensor:
    """16-bit words (0..65535, int64) as int16 with the same bits."""
    return (words - ((words >> 15) & 1) * 65536).to(torch.int16)


@dataclass
class KVContent:
    layers: int
    heads: int
    head_dim: int
    device: torch.device
    seed: int = 0
    salts: torch.Tensor = field(init=False)
    """``[layers, 2, width]`` int16: what each layer's K and V row is XORed with."""

    def __post_init__(self) -> None:
        index = torch.arange(2 * self.layers, dtype=torch.int64, device=self.device)
        seeds = _mix((index * _LAYER_SALT + self.seed * _GOLDEN) & _MASK32)
        words = _words(seeds, self.width) & ~(_EXPONENT_TOP | _ALWAYS_SET)
        self.salts = _as_int16(words).view(self.layers, 2, self.width)

    @property
    def width(self) -> int:
        return self.heads * self.head_dim

    def rows(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``[n, width]`` int16: the row of each (token id, position)."""
        tokens = token_ids.to(self.device, torch.int64) & _MASK32
        places = positions.to(self.device, torch.int64) & _MASK32
        seeds = _mix(tokens ^ _mix((places * _POSITION_SALT + self.seed) & _MASK32))
        words = (_words(seeds, self.width) & ~_EXPONENT_TOP) | _ALWAYS_SET
        return _as_int16(words)

    def layer_rows(self, rows: torch.Tensor, layer: int, kv: int) -> torch.Tensor:
        """``rows`` as layer ``layer``'s K (``kv = 0``) or V (``kv = 1``) holds them."""
        return rows ^ self.salts[layer, kv]

    def fill(
        self,
        buffers: LayerBuffers,
        slots: torch.Tensor,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:
        """Write every layer's K and V of the tokens at ``slots``."""
        slots = slots.to(self.device, torch.int64)
        rows = self.rows(token_ids, positions)
        for layer in range(self.layers):
            for kv, buffer in enumerate(buffers(layer)):
                words = self.layer_rows(rows, layer, kv)
                buffer[slots] = words.view(buffer.dtype).view(-1, *buffer.shape[1:])

    def mismatched_bytes(
        self,
        buffers: LayerBuffers,
        slots: torch.Tensor,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
    ) -> int:
        """Bytes of every layer's K and V at ``slots`` that differ from what belongs there."""
        if slots.numel() == 0:
            return 0
        slots = slots.to(self.device, torch.int64)
        rows = self.rows(token_ids, positions)
        wrong = torch.zeros((), dtype=torch.int64, device=self.device)
        for layer in range(self.layers):
            for kv, buffer in enumerate(buffers(layer)):
                held = buffer[slots].reshape(len(slots), -1).view(torch.uint8)
                expected = self.layer_rows(rows, layer, kv).view(torch.uint8)
                wrong += (held != expected).sum()
        # One read back per check, not one per layer.
        return int(wrong.item())
