"""Jobs for an offload handler on host tensors, and what they must leave behind.

vLLM's copy op is compiled CUDA code; :func:`memmove_batch` keeps its contract on host
memory, and :func:`reference` writes a job's expected result from vLLM's documented
layout, page by page.
"""

from __future__ import annotations

import ctypes

import torch
from vllm.v1.kv_offload.base import GPULoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec


def memmove_batch(log: list[int]):
    """vLLM's swap_blocks_batch contract on host memory: one memmove per descriptor."""

    def swap(src, dst, sizes, is_src_access_order_any=False):
        log.append(len(sizes))
        for source, target, size in zip(src.tolist(), dst.tolist(), sizes.tolist(), strict=True):
            ctypes.memmove(target, source, size)

    return swap


def make_job(groups, gpu_to_cpu):
    """(src_spec, dst_spec) for [(gpu_ids, cpu_ids, block_index), ...], one entry a group."""
    gpu = GPULoadStoreSpec(
        [b for ids, _, _ in groups for b in ids],
        group_sizes=[len(ids) for ids, _, _ in groups],
        block_indices=[first for _, _, first in groups],
    )
    cpu = CPULoadStoreSpec([c for _, chunks, _ in groups for c in chunks])
    return (gpu, cpu) if gpu_to_cpu else (cpu, gpu)


def reference(gpu, host, layout, groups, gpu_to_cpu):
    """Expected tensors after the job, page by page: GPU block ids[k] <-> the k-th
    sub-block of the group's chunks, counted from block_index % blocks_per_chunk."""
    bpc, page = layout.blocks_per_chunk, layout.page_bytes
    copied = page if layout.ref_page_bytes is None else layout.ref_page_bytes
    gpu_out = [t.clone() for t in gpu]
    host_out = [t.clone() for t in host]
    for ids, chunks, first in groups:
        subs = [c * bpc + j for c in chunks for j in range(bpc)][first % bpc :]
        for block, sub in zip(ids, subs, strict=False):
            chunk, j = divmod(sub, bpc)
            for t in range(layout.tensors):
                host_bytes = slice(j * page, j * page + copied)
                if gpu_to_cpu:
                    host_out[t][chunk, host_bytes] = gpu[t][block, :copied]
                else:
                    gpu_out[t][block, :copied] = host[t][chunk, host_bytes]
    return gpu_out, host_out


def assert_tensors_are(gpu, host, expected):
    """Every GPU and host tensor holds exactly the bytes of ``reference``'s result."""
    assert all(
        torch.equal(a, b) for a, b in zip(gpu + host, expected[0] + expected[1], strict=True)
    )
