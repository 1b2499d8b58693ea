"""Peak memory of a piece of work, the same way on CPU and CUDA.

On CUDA this is ``torch.cuda.max_memory_allocated`` around the call. On CPU, where torch keeps
no allocator statistics, it is torch's dispatch-level ``MemTracker``: it sees every tensor
storage the call allocates and frees (and the tensors of the modules/optimizers passed in
``track``, which existed before the call), so the figure is tensor bytes, not process RSS.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


def peak_memory_bytes(fn: Callable[[], Any], *, device: torch.device | str = "cpu", track: tuple = ()) -> int:
    """Run ``fn()`` once and return the peak bytes of tensor memory on ``device`` during it.

    ``track``: modules and optimizers whose existing tensors (parameters, gradients, states)
    count towards the peak; on CUDA everything already allocated counts anyway.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device))
    if device.type != "cpu":
        raise ValueError(f"peak memory is measured on cpu or cuda, not {device.type}")
    from torch.distributed._tools.mem_tracker import MemTracker  # torch's own, private but stable since 2.4

    tracker = MemTracker()
    if track:
        tracker.track_external(*track)
    with tracker:
        fn()
    snapshot = tracker.get_tracker_snapshot("peak")
    return int(snapshot.get(device, {}).get("Total", 0))
