"""cuobjdump (the nvidia-cuda-cuobjdump wheel) over compiled cubins, for the CPU compile tests:
SASS opcode counts, the entry's parameter table (resource usage: cuobjdump's own flag)."""

from __future__ import annotations

import pathlib
import re
import subprocess
from collections import Counter

import pytest

PARAM_BYTES = {"u64": 8, "u32": 4}  # an ABI parameter's type -> its size in the table


def cuobjdump(flag: str, cubin: pathlib.Path) -> str:
    """``cuobjdump flag cubin``'s output; skips the test where the tool is not installed."""
    import nvidia

    tools = [
        path for root in nvidia.__path__ for path in pathlib.Path(root).glob("*/bin/cuobjdump")
    ]
    if not tools:
        pytest.skip("cuobjdump (nvidia-cuda-cuobjdump) not installed")
    return subprocess.run(
        [str(tools[0]), flag, str(cubin)], capture_output=True, text=True, check=True
    ).stdout


def opcode_counts(sass: str) -> Counter[str]:
    """How often each opcode (without its modifiers) occurs in a SASS listing."""
    ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", sass, re.M)
    return Counter(ops)


def param_table(cubin: pathlib.Path, kernel_name: str) -> list[tuple[int, int]]:
    """The entry's parameters as (ordinal, size in bytes), from the cubin's EIATTR_KPARAM_INFO."""
    elf = cuobjdump("--dump-elf", cubin)
    assert f".nv.info.{kernel_name}" in elf
    return sorted(
        (int(ordinal, 16), int(size, 16))
        for ordinal, size in re.findall(
            r"Ordinal\s*:\s*0x([0-9a-f]+)\s+Offset\s*:\s*0x[0-9a-f]+\s+Size\s*:\s*0x([0-9a-f]+)",
            elf,
        )
    )


def abi_table(param_types) -> list[tuple[int, int]]:
    """The parameter table an ABI of ``param_types`` ("u64" / "u32") must have."""
    return [(i, PARAM_BYTES[kind]) for i, kind in enumerate(param_types)]
