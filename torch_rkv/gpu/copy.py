"""paged_copy on the GPU (semantics: reference.paged_copy; rules: csrc/paged_copy.cpp).

Whole pages and side slots move with torch's own gather and scatter (index_select, index_copy_), which
run on any device: there is nothing for a Triton kernel to add, and the op keeps working on CUDA tensors
without the C++ CUDA build.
"""

from __future__ import annotations

import torch

from ..ops.paged import _paged_copy_fake
from .spec import CompileSpec


def _check_ids(src_name: str, src: torch.Tensor, dst_name: str, dst: torch.Tensor, limit: int, what: str) -> None:
    """paged_copy.cpp check_ids' data checks, on CPU ids only: each id in [0, limit), no destination twice.
    On a GPU they would cost a host sync; there index_select asserts on the device, as the C++ op does."""
    if src.device.type != "cpu":
        return
    seen = set()
    for i, (a, b) in enumerate(zip(src.tolist(), dst.tolist())):
        if not (0 <= a < limit and 0 <= b < limit):
            raise ValueError(f"rkv.paged_copy: {src_name}[{i}] = {a} or {dst_name}[{i}] = {b} is outside the "
                             f"{limit} {what}")
        if b in seen:
            raise ValueError(f"rkv.paged_copy: {dst_name} names {what} {b} twice")
        seen.add(b)


def _copy_rows(t: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    if src.shape[0] == 0:
        return
    s, d = src.to(t.device, torch.long), dst.to(t.device, torch.long)
    t.index_copy_(0, d, t.index_select(0, s))  # the gather first: a source that is also a destination stays right


def paged_copy(k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_window, v_window, k_sink, v_sink, page_fill,
               src_pages, dst_pages, src_slots, dst_slots, k_outliers=None, v_outliers=None, k_refine=None) -> None:
    _paged_copy_fake(k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_window, v_window, k_sink, v_sink,
                     page_fill, src_pages, dst_pages, src_slots, dst_slots, k_outliers, v_outliers, k_refine)
    _check_ids("src_pages", src_pages, "dst_pages", dst_pages, k_codes.shape[0], "pages")
    _check_ids("src_slots", src_slots, "dst_slots", dst_slots, k_window.shape[0], "side slots")
    for t in (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, page_fill, k_outliers, v_outliers, k_refine):
        if t is not None:
            _copy_rows(t, src_pages, dst_pages)
    for t in (k_window, v_window, k_sink, v_sink):
        _copy_rows(t, src_slots, dst_slots)


KERNELS = {"paged_copy": paged_copy}


def compile_specs(full: bool) -> list[CompileSpec]:
    """No Triton kernel: nothing to compile."""
    return []
