"""Offload a frozen model (reference, reward) to host memory between its calls.

The parameters keep their identity (modules, views and anything else holding them stay valid):
offloading copies each one into a pinned host buffer and frees its device storage; restoring
regrows the storage and copies back. The host copy is kept, so offloading again after an
unchanged call costs no copy at all; a parameter changed in place since the last copy (its
version counter moved, e.g. a reallocation into it) is copied again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True, kw_only=True)
class OffloadStats:
    bytes_copied: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.bytes_copied / self.seconds / 1e9 if self.seconds > 0 else 0.0


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def release_storage(tensors) -> None:
    """Free the memory of these tensors (and of every view of their storage). The tensor objects
    stay valid, without storage, until ``regrow_storage``."""
    for t in tensors:
        t.untyped_storage().resize_(0)


def regrow_storage(t: torch.Tensor) -> None:
    """Give a released tensor storage again (contents undefined); a no-op for one that has it."""
    need = (t.storage_offset() + t.numel()) * t.element_size()
    storage = t.untyped_storage()
    if storage.nbytes() < need:
        storage.resize_(need)


def has_storage(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() >= (t.storage_offset() + t.numel()) * t.element_size()


class HostOffload:
    """Moves one model's parameters between its device and pinned host buffers."""

    def __init__(self, model: nn.Module):
        self.params = dict(model.named_parameters())
        self.device = next(iter(self.params.values())).device
        self.host: dict[str, torch.Tensor] = {}
        self.versions: dict[str, int] = {}  # parameter version when its host copy was made
        self.offloaded = False

    @torch.no_grad()
    def offload(self) -> OffloadStats:
        """Copy changed parameters to the host and free their device memory."""
        if self.offloaded:
            raise RuntimeError("the model is already offloaded")
        start, copied = time.perf_counter(), 0
        pin = self.device.type == "cuda"
        for name, p in self.params.items():
            if name not in self.host:
                self.host[name] = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin)
            if self.versions.get(name) != p._version:
                self.host[name].copy_(p, non_blocking=pin)
                copied += _nbytes(p)
        if pin:
            torch.cuda.synchronize(self.device)  # copies must land before the storage is freed
        release_storage(self.params.values())
        for name, p in self.params.items():
            self.versions[name] = p._version
        self.offloaded = True
        return OffloadStats(bytes_copied=copied, seconds=time.perf_counter() - start)

    @torch.no_grad()
    def restore(self) -> OffloadStats:
        """Bring the parameters back onto their device."""
        if not self.offloaded:
            raise RuntimeError("the model is not offloaded")
        start, copied = time.perf_counter(), 0
        pin = self.device.type == "cuda"
        for name, p in self.params.items():
            regrow_storage(p)
            p.copy_(self.host[name], non_blocking=pin)
            copied += _nbytes(p)
        if pin:
            torch.cuda.synchronize(self.device)
        for name, p in self.params.items():
            self.versions[name] = p._version  # the restore's own copy is not a change
        self.offloaded = False
        return OffloadStats(bytes_copied=copied, seconds=time.perf_counter() - start)
