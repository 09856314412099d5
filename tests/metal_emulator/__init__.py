"""A CPU stand-in for ``torch.mps.compile_shader``: compiles MSL source as C++ (shim header ``metal_stdlib``) with
g++ and runs its kernels over their grid on CPU tensors (``launcher.h``).

``compile_shader(source)`` returns an object used exactly like torch's shader library:
``lib.<kernel>(*args, threads=..., group_size=..., arg_casts=None)``. Tensors become buffers, Python ints int64
scalars and floats fp32 scalars (torch's defaults; ``arg_casts`` changes them), and the C++ launcher checks every
argument against the kernel's parameter list (buffer vs scalar, scalar width), so a wrong argument order or type
in the dispatch code fails here as it would misbehave on a Mac.

Each tensor is copied into a buffer with 0xFF guard bytes on both sides (NaN for every float dtype): a kernel
that reads past a buffer poisons its output and one that writes past it is reported. Every call is logged in
``lib.calls`` so tests can check grid and group sizes.
"""
from __future__ import annotations

import ctypes
import hashlib
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

HERE = Path(__file__).resolve().parent
GUARD = 256  # bytes of 0xFF on each side of every buffer

_SCALAR_CASTS = {
    "int64": ("q", 8), "long": ("q", 8), "int32": ("i", 4), "int": ("i", 4), "int16": ("h", 2),
    "uint32": ("I", 4), "fp32": ("f", 4), "float": ("f", 4), "fp16": (torch.float16, 2), "half": (torch.float16, 2),
    "bf16": (torch.bfloat16, 2), "bfloat": (torch.bfloat16, 2),
}


def compiler() -> Optional[str]:
    return shutil.which("g++")


class EmuArg(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_void_p), ("nbytes", ctypes.c_int64), ("is_scalar", ctypes.c_int32)]


@dataclass
class Call:
    kernel: str
    args: list          # ("tensor", dtype, shape) or ("scalar", python value, byte width)
    threads: tuple
    group_size: tuple


_INSTANCE = re.compile(r'template\s*\[\[\s*host_name\(\s*"(\w+)"\s*\)\s*\]\]\s*\[\[\s*kernel\s*\]\]\s*'
                       r'decltype\(\s*([^;]+?)\s*\)\s*[^;]+;')
_PLAIN = re.compile(r'(template\s*<[^>]*>\s*)?\[\[\s*kernel\s*\]\]\s*void\s+(\w+)\s*\(')


def kernel_names(preprocessed: str) -> dict[str, str]:
    """host name -> C++ expression of the function, for every kernel in preprocessed MSL."""
    names = {m.group(1): m.group(2) for m in _INSTANCE.finditer(preprocessed)}
    for m in _PLAIN.finditer(preprocessed):
        if m.group(1) is None:  # a non-template kernel is its own host name
            names[m.group(2)] = m.group(2)
    return names


class EmulatedLibrary:
    def __init__(self, so_path: Path, names: dict[str, str]):
        self._lib = ctypes.CDLL(str(so_path))
        self._lib.emu_launch.restype = ctypes.c_int
        self.kernel_names = sorted(names)
        self.calls: list[Call] = []

    def __getattr__(self, name: str) -> "EmulatedKernel":
        if name.startswith("_") or name not in self.kernel_names:
            raise AttributeError(f"no kernel named {name!r} in this library (have {self.kernel_names})")
        return EmulatedKernel(self, name)


class EmulatedKernel:
    max_threads_per_threadgroup = 1024
    thread_execution_width = 32
    static_thread_group_memory_length = 0

    def __init__(self, lib: EmulatedLibrary, name: str):
        self.lib = lib
        self.name = name

    def __call__(self, *args, threads=None, group_size=None, arg_casts=None):
        if threads is None or group_size is None:
            raise TypeError(f"{self.name}: pass threads= and group_size= explicitly (the project always does)")
        grid, group = _dims(threads), _dims(group_size)
        casts = dict(arg_casts or {})
        keep, c_args, copies, log = [], (EmuArg * len(args))(), [], []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                if a.device.type != "cpu":
                    raise ValueError(f"{self.name}: argument {i} is on {a.device}; the emulator runs CPU tensors")
                if not a.is_contiguous():
                    raise ValueError(f"{self.name}: argument {i} is not contiguous; Metal would read it as if it were")
                raw = a.reshape(-1).view(torch.uint8) if a.numel() else torch.empty(0, dtype=torch.uint8)
                padded = torch.full((raw.numel() + 2 * GUARD,), 0xFF, dtype=torch.uint8)
                padded[GUARD:GUARD + raw.numel()] = raw
                keep.append(padded)
                copies.append((i, a, padded, raw.numel()))
                c_args[i] = EmuArg(padded.data_ptr() + GUARD, raw.numel(), 0)
                log.append(("tensor", a.dtype, tuple(a.shape)))
            elif isinstance(a, (bool,)) or not isinstance(a, (int, float)):
                raise TypeError(f"{self.name}: argument {i} has unsupported type {type(a).__name__}")
            else:
                kind = casts.get(i, "int64" if isinstance(a, int) else "fp32")
                fmt, width = _SCALAR_CASTS[kind]
                if isinstance(fmt, str):
                    ctype = {"q": ctypes.c_int64, "i": ctypes.c_int32, "h": ctypes.c_int16,
                             "I": ctypes.c_uint32, "f": ctypes.c_float}[fmt]
                    box = ctype(a)
                else:
                    box = (ctypes.c_uint16)(int(torch.tensor([a], dtype=fmt).view(torch.int16).item()) & 0xFFFF)
                keep.append(box)
                c_args[i] = EmuArg(ctypes.addressof(box), width, 1)
                log.append(("scalar", a, width))
        self.lib.calls.append(Call(self.name, log, grid, group))
        err = ctypes.create_string_buffer(1024)
        rc = self.lib._lib.emu_launch(self.name.encode(), c_args, len(args), (ctypes.c_uint32 * 3)(*grid),
                                      (ctypes.c_uint32 * 3)(*group), err, 1024)
        if rc != 0:
            raise RuntimeError(f"{self.name}: {err.value.decode() or 'launch failed'}")
        for i, a, padded, n in copies:
            if bool((padded[:GUARD] != 0xFF).any()) or bool((padded[GUARD + n:] != 0xFF).any()):
                raise RuntimeError(f"{self.name}: the kernel wrote outside argument {i} ({tuple(a.shape)})")
            if n:
                a.reshape(-1).view(torch.uint8).copy_(padded[GUARD:GUARD + n])


def _dims(value) -> tuple[int, int, int]:
    dims = [int(value)] if isinstance(value, int) else [int(v) for v in value]
    if not 1 <= len(dims) <= 3 or any(d < 0 for d in dims):
        raise ValueError(f"grid/group sizes must be 1-3 non-negative ints, got {value}")
    return tuple(dims + [1] * (3 - len(dims)))


_BUILT: dict[str, EmulatedLibrary] = {}


def compile_shader(source: str, workdir: Optional[Path] = None) -> EmulatedLibrary:
    """Compile MSL ``source`` for the CPU (cached per source text within the process)."""
    key = hashlib.sha256(source.encode()).hexdigest()[:16]
    if key in _BUILT:
        return _BUILT[key]
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++) found")
    work = Path(workdir or tempfile.mkdtemp(prefix="metal_emu_")) / key
    work.mkdir(parents=True, exist_ok=True)
    (work / "kernels.metal").write_text(source)
    flags = ["-std=c++20", "-Wno-attributes", "-pthread", f"-I{HERE}", f"-I{work}"]
    pre = subprocess.run([cxx, *flags, "-E", "-P", "-x", "c++", str(work / "kernels.metal")],
                         capture_output=True, text=True)
    if pre.returncode != 0:
        raise RuntimeError(f"preprocessing failed:\n{pre.stderr[-4000:]}")
    # Macros are expanded, so macro-generated instantiations are found too; the standard headers the shim
    # pulls in contain no [[kernel]] declarations.
    names = kernel_names(pre.stdout)
    if not names:
        raise RuntimeError("no [[kernel]] functions found in the source")
    lines = ['#include "kernels.metal"', '#include "launcher.h"',
             'extern "C" int emu_launch(const char* name, EmuArg* args, int nargs, const uint32_t* grid,',
             '                          const uint32_t* group, char* err, int errlen) {',
             '    const std::string n(name);']
    for host, fn in sorted(names.items()):
        lines.append(f'    if (n == "{host}") return emu::launch(&{fn}, args, nargs, grid, group, err, errlen);')
    lines += ['    snprintf(err, errlen, "no kernel named %s", name);', '    return 1;', '}']
    (work / "glue.cpp").write_text("\n".join(lines) + "\n")
    so = work / "kernels.so"
    build = subprocess.run([cxx, *flags, "-O1", "-shared", "-fPIC", str(work / "glue.cpp"), "-o", str(so)],
                           capture_output=True, text=True)
    if build.returncode != 0:
        raise RuntimeError(f"compiling the kernels as C++ failed:\n{build.stderr[-6000:]}")
    lib = EmulatedLibrary(so, names)
    _BUILT[key] = lib
    return lib
