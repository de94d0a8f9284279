"""What the machine that runs a model offers: its CPU's instruction sets and its GPU, found at run time.

The project's machines vary (AVX-512 with or without BF16, with or without AMX), so nothing here is assumed:
the CPU's flags are read from ``/proc/cpuinfo`` where there is one. An execution plan is chosen for, and
recorded with, the :class:`Hardware` it was measured on. torch is imported only to ask for a GPU, when asked.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")

# the instruction sets that decide a plan, in the order they are named
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@dataclass(frozen=True)
class Hardware:
    """One node's compute: its CPU model and the plan-relevant instruction sets, and its GPU if any."""

    cpu_model: str
    isa: tuple[str, ...]
    gpu: str | None = None
    gpu_bf16: bool = False

    @property
    def cpu_bf16(self) -> bool:
        """The CPU computes bf16 natively (AVX-512-BF16 or AMX): reduced precision can pay on it."""
        return bool(BF16_FLAGS & set(self.isa))

    @property
    def amx(self) -> bool:
        return "amx_bf16" in self.isa

    def describe(self) -> str:
        """One line for logs and records, e.g. ``Intel Xeon … (avx2, avx512f, avx512_bf16)``."""
        isa = ", ".join(self.isa) or "no AVX2"
        gpu = f"; GPU {self.gpu}" if self.gpu else ""
        return f"{self.cpu_model} ({isa}){gpu}"

    def as_record(self) -> dict[str, object]:
        return {"cpu_model": self.cpu_model, "isa": list(self.isa), "gpu": self.gpu, "gpu_bf16": self.gpu_bf16}

    @classmethod
    def from_record(cls, record: dict[str, object]) -> Hardware:
        isa = record["isa"]
        if not isinstance(isa, list):
            raise TypeError(f"isa must be a list, got {isa!r}")
        gpu = record.get("gpu")
        flags = tuple(str(flag) for flag in isa)
        return cls(str(record["cpu_model"]), flags, str(gpu) if gpu else None, bool(record.get("gpu_bf16", False)))


def parse_cpuinfo(text: str) -> tuple[str, tuple[str, ...]]:
    """The CPU's model name and its plan-relevant flags from ``/proc/cpuinfo``'s text (first processor)."""
    model, flags = "", set[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return model, tuple(flag for flag in ISA_FLAGS if flag in flags)


def cpu() -> tuple[str, tuple[str, ...]]:
    """This machine's CPU model and flags; the platform's processor name and none where there is no cpuinfo."""
    try:
        model, isa = parse_cpuinfo(CPUINFO.read_text())
    except OSError:
        model, isa = "", ()
    return model or platform.processor() or platform.machine(), isa


def detect(*, with_gpu: bool = True) -> Hardware:
    """The calling process's node: the CPU, and (``with_gpu``) the first CUDA device torch sees."""
    model, isa = cpu()
    if not with_gpu:
        return Hardware(model, isa)
    import torch

    if not torch.cuda.is_available():
        return Hardware(model, isa)
    return Hardware(model, isa, torch.cuda.get_device_name(0), bool(torch.cuda.is_bf16_supported()))
