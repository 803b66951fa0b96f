"""What this CPU has, from /proc/cpuinfo: psutil reports cores and
frequencies, not the model or instruction flags, so this file is read by
hand (Linux only, as GraphBolt is)."""
import platform


def cpuinfo_lines(path="/proc/cpuinfo"):
    """The lines of /proc/cpuinfo ([] where it cannot be read)."""
    try:
        with open(path) as f:
            return f.read().splitlines()
    except OSError:
        return []


def has_bf16(lines=None):
    """True if the CPU has bfloat16 instructions (AVX512-BF16, AMX). Without
    them torch computes bf16 with scalar code: a SAGE step under autocast
    took 25x longer than in fp32 on an AVX2 machine."""
    flags = set()
    for line in cpuinfo_lines() if lines is None else lines:
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[-1].split())
    return "avx512_bf16" in flags or "amx_bf16" in flags


def description(lines=None):
    """What -march=native compiles for: the architecture and the CPU's
    model and flags (one string, for a build cache's key)."""
    wanted = ("model name", "flags", "Features", "CPU part")
    lines = cpuinfo_lines() if lines is None else lines
    return platform.machine() + "".join(
        sorted({line for line in lines if line.startswith(wanted)}))
