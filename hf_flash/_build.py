"""The CUDA extension, built on first use against the installed torch for the local GPU only.

The package installs as pure Python; the kernels (``csrc/``, shipped as ``hf_flash/csrc``) are
compiled with ninja by ``torch.utils.cpp_extension.load`` the first time a CUDA tensor reaches an
op, or ahead of time by ``python -m hf_flash build``. Each build lives in its own cache directory,
``$HF_FLASH_CACHE`` or ``~/.cache/hf_flash``, named by torch version, CUDA version, Python version,
GPU arch(s) and a digest of the sources and flags; a later process only loads the library.

Environment:
  HF_FLASH_CACHE        cache root (default ~/.cache/hf_flash)
  HF_FLASH_CUDA_ARCHS   arch list such as "80;90a": build for these instead of the local GPU
                        (images, offline machines; ``python -m hf_flash build`` needs no GPU then)
  HF_FLASH_SKIP_CUDA=1  never build or load the extension (PyTorch reference path)
  HF_FLASH_DISABLE_FORWARD=1 / HF_FLASH_DISABLE_BACKWARD=1
                        leave a kernel family out (its op then raises)
  MAX_JOBS              parallel compile jobs, default min(cores, available RAM / 4 GB)

Nothing here raises to the caller of ``load_extension``: whatever stops the build (no GPU, a CPU
torch, no usable CUDA toolkit, a compile error) becomes the reason string, and the caller runs the
reference path.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

logger = logging.getLogger("hf_flash")

NAME = "hf_flash_C"  # the library file is <cache dir>/hf_flash_C.so
# Kernel families: HF_FLASH_DISABLE_<name>=1 leaves out csrc/<folder>/**/*.cu of its folders and
# defines HF_FLASH_DISABLE_<name>. csrc/*.cpp and csrc/*.cu are always compiled.
FAMILIES = {"FORWARD": ("fwd", "fwd_sm90", "decode"), "BACKWARD": ("bwd", "bwd_sm90")}
CXX_FLAGS = ("-O3",)  # no -std: torch passes the one its headers need (C++20 from torch 2.14)
NVCC_FLAGS = ("-O3", "-std=c++17", "--use_fast_math", "-lineinfo", "--expt-relaxed-constexpr",
              # torch's defaults define the __CUDA_NO_HALF/BFLOAT16_* macros; the kernels use those operators
              "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
              "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__")
HASHED_SUFFIXES = (".cpp", ".cu", ".cuh", ".h", ".hpp", ".py")  # .py: csrc/generate_kernels.py
OK_FILE = "ok"  # written after a build succeeded; a directory without it is never loaded


class BuildError(RuntimeError):
    """A failed build; ``log`` is its compiler output's file, when one was written."""

    def __init__(self, message: str, log: Optional[Path] = None):
        super().__init__(message)
        self.log = log


def compiler_errors(text: str, limit: int = 20) -> list[str]:
    """The lines of a build's output that say what failed (nvcc / gcc ``error``, ninja's ``FAILED:``), in order."""
    lines = [line.strip() for line in text.splitlines()
             if "error" in line or line.startswith("FAILED:")]
    return lines[:limit]


def csrc_dir() -> Path:
    """The kernel sources: hf_flash/csrc in an installed package, ../csrc in the checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "csrc", here.parent / "csrc"):
        if (candidate / "flash.h").is_file():
            return candidate
    raise BuildError(f"kernel sources not found (looked for {here / 'csrc'} and {here.parent / 'csrc'})")


def disabled_families(environ=os.environ) -> list[str]:
    return [name for name in FAMILIES if environ.get(f"HF_FLASH_DISABLE_{name}") == "1"]


def enabled_folders(disabled: Sequence[str] = ()) -> list[str]:
    return [folder for name, folders in FAMILIES.items() if name not in disabled for folder in folders]


def sources(root: Path, disabled: Sequence[str] = ()) -> list[Path]:
    """csrc/*.cpp and csrc/*.cu, plus csrc/<folder>/**/*.cu of every enabled family."""
    files = [p for pattern in ("*.cpp", "*.cu") for p in root.glob(pattern)]
    files += [p for folder in enabled_folders(disabled) for p in (root / folder).glob("**/*.cu")]
    return sorted(files)


def generator(root: Path):
    """csrc/generate_kernels.py as a module: the instantiation and dispatch files of each family, written into
    the build directory rather than kept in the source tree."""
    spec = importlib.util.spec_from_file_location("hf_flash_generate_kernels", root / "generate_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=1)
def head_dims() -> tuple:
    """The compiled head dims, csrc/flash.h's kHeadDims (the one list: kernels, binding, Python checks, tests)."""
    return generator(csrc_dir()).HEAD_DIMS


def unique_stems(names: Sequence[str]) -> None:
    stems = [Path(n).stem for n in names]  # torch's ninja build names each object after its file's stem
    clashes = sorted({s for s in stems if stems.count(s) > 1})
    if clashes:
        raise RuntimeError(f"kernel sources must have unique file names, these repeat: {clashes}")


def parse_archs(text: str) -> tuple[str, ...]:
    """'80;90a' (or '8.0, 9.0a') -> ('80', '90a')."""
    archs = []
    for item in re.split(r"[;,\s]+", text.strip()):
        if not item:
            continue
        match = re.fullmatch(r"(\d+)\.?(\d)(a?)", item)
        if match is None:
            raise ValueError(f"HF_FLASH_CUDA_ARCHS: {item!r} is not an arch such as 80, 86 or 90a")
        archs.append("".join(match.groups()))
    if not archs:
        raise ValueError("HF_FLASH_CUDA_ARCHS is set but lists no arch")
    return tuple(dict.fromkeys(archs))


def arch_for(capability: tuple[int, int]) -> str:
    """The arch to compile for a GPU: 90a on Hopper (the wgmma/TMA kernels need it), else sm_<major><minor>."""
    major, minor = capability
    return f"{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")


def runs_on(arch: str, capability: tuple[int, int]) -> bool:
    """Whether code built for ``arch`` runs on a GPU of ``capability`` (cubins run on later minors
    of the same major; 'a' archs only on that exact GPU)."""
    major, minor = capability
    if arch.endswith("a"):
        return arch == arch_for(capability)
    number = int(arch)
    return number // 10 == major and number % 10 <= minor and (major, minor) != (9, 0)


def gencode_flags(archs: Sequence[str]) -> list[str]:
    return [f"-gencode=arch=compute_{arch},code=sm_{arch}" for arch in archs]


def flags(disabled: Sequence[str]) -> tuple[list[str], list[str]]:
    """(cxx flags, nvcc flags) without the arch flags, which the cache key names separately."""
    defines = [f"-DHF_FLASH_DISABLE_{name}" for name in disabled]
    return [*CXX_FLAGS, *defines], [*NVCC_FLAGS, *defines]


def source_digest(root: Path, files: Sequence[Path], build_flags: Sequence[str], generated_names=()) -> str:
    """Hash of every source, header and the generator under csrc, the compiled file list and the flags."""
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in HASHED_SUFFIXES and p.is_file()):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    names = [p.relative_to(root).as_posix() for p in files] + [f"generated/{n}" for n in generated_names]
    h.update("\0".join(names).encode() + b"\1")
    h.update("\0".join(build_flags).encode())
    return h.hexdigest()[:16]


def key_prefix(torch_version: str, cuda_version: str, python: tuple[int, int] = sys.version_info[:2]) -> str:
    return f"torch{torch_version}-cu{cuda_version}-py{python[0]}{python[1]}"


def build_key(torch_version: str, cuda_version: str, archs: Sequence[str], digest: str,
              python: tuple[int, int] = sys.version_info[:2]) -> str:
    """Cache directory name, e.g. torch2.14.1+cu130-cu13.0-py311-sm90a-0123456789abcdef."""
    return f"{key_prefix(torch_version, cuda_version, python)}-sm{'_'.join(archs)}-{digest}"


def cache_root() -> Path:
    return Path(os.environ.get("HF_FLASH_CACHE") or Path.home() / ".cache" / "hf_flash")


def default_max_jobs() -> int:
    # Each nvcc job of these kernels peaks around 4 GB of RAM.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        free_gb = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (ValueError, OSError):
        free_gb = 8
    return max(1, min(cores, int(free_gb // 4)))


def toolkit_problem(cuda_home: Optional[str], torch_cuda: str) -> Optional[str]:
    """Why the CUDA toolkit at ``cuda_home`` cannot build against a torch built with CUDA ``torch_cuda``."""
    if cuda_home is None:
        return "no CUDA toolkit found (install one and set CUDA_HOME, or put its nvcc on PATH)"
    home = Path(cuda_home)
    nvcc = home / "bin" / "nvcc"
    if not nvcc.is_file():
        return f"CUDA_HOME={cuda_home} has no bin/nvcc (set CUDA_HOME to the CUDA toolkit)"
    if not (home / "include" / "cuda_runtime_api.h").is_file():
        return f"CUDA_HOME={cuda_home} has no include/cuda_runtime_api.h (set CUDA_HOME to the CUDA toolkit)"
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"{nvcc} --version failed: {e}"
    match = re.search(r"release (\d+)\.(\d+)", out)
    if match is None:
        return f"{nvcc} --version printed no release number"
    if match.group(1) != torch_cuda.split(".")[0]:
        return (f"nvcc {match.group(1)}.{match.group(2)} at {cuda_home} does not match torch's CUDA {torch_cuda} "
                f"(set CUDA_HOME to a CUDA {torch_cuda.split('.')[0]}.x toolkit)")
    return None


class Spec:
    """What one build compiles: sources, flags, their digest, and the cache directory for ``archs``."""

    def __init__(self, environ=os.environ):
        self.root = csrc_dir()
        self.disabled = disabled_families(environ)
        self.sources = sources(self.root, self.disabled)
        self.generator = generator(self.root)
        self.kinds = [f for f in enabled_folders(self.disabled) if f in self.generator.FAMILIES]
        generated = sorted(self.generator.files(self.kinds))
        unique_stems([p.name for p in self.sources] + generated)
        self.cxx_flags, self.nvcc_flags = flags(self.disabled)
        self.digest = source_digest(self.root, self.sources, self.cxx_flags + ["|"] + self.nvcc_flags, generated)
        self.prefix = key_prefix(torch.__version__, torch.version.cuda or "none")

    def directory(self, archs: Sequence[str]) -> Path:
        return cache_root() / build_key(torch.__version__, torch.version.cuda or "none", archs, self.digest)

    def cached_for(self, capability: tuple[int, int]) -> Optional[Path]:
        """A finished build (any arch list, e.g. one made ahead of time) whose code runs on this GPU."""
        for directory in sorted(cache_root().glob(f"{self.prefix}-sm*-{self.digest}")):
            archs = directory.name[len(self.prefix) + 3:-len(self.digest) - 1].split("_")
            if (directory / OK_FILE).is_file() and any(runs_on(a, capability) for a in archs):
                return directory / f"{NAME}.so"
        return None


def _ninja_times(directory: Path) -> list[tuple[float, str]]:
    """(seconds, output) per compiled file from ninja's log, slowest first."""
    times = {}
    with contextlib.suppress(OSError):
        for line in (directory / ".ninja_log").read_text().splitlines()[1:]:
            start, end, _, output, *_ = line.split("\t")
            times[output] = (int(end) - int(start)) / 1000
    return sorted(((s, out) for out, s in times.items()), reverse=True)


def build(spec: Spec, archs: Sequence[str]) -> Path:
    """Compiles the extension for ``archs`` into its cache directory (once: a file lock makes other
    processes wait and then reuse it) and loads it. Returns the library's path; raises BuildError."""
    from filelock import FileLock  # a dependency of torch
    from torch.utils import cpp_extension

    directory = spec.directory(archs)
    directory.mkdir(parents=True, exist_ok=True)
    library = directory / f"{NAME}.so"
    with FileLock(str(directory / "build.lock")):
        if (directory / OK_FILE).is_file():
            return library
        # torch's own lock file, left behind if a build was killed; the lock above is the real one
        (directory / "lock").unlink(missing_ok=True)
        jobs = os.environ.get("MAX_JOBS") or str(default_max_jobs())
        files = spec.sources + spec.generator.write(directory / "generated", spec.kinds)
        print(f"hf_flash: building the CUDA kernels for sm_{'+sm_'.join(archs)} ({len(files)} files, "
              f"{jobs} jobs) into {directory}; once per torch, CUDA, GPU arch and source version",
              file=sys.stderr, flush=True)
        start = time.monotonic()
        saved = os.environ.get("MAX_JOBS")
        os.environ["MAX_JOBS"] = jobs
        try:
            cpp_extension.load(name=NAME, sources=[str(p) for p in files], extra_cflags=spec.cxx_flags,
                               extra_cuda_cflags=spec.nvcc_flags + gencode_flags(archs),
                               extra_include_paths=[str(spec.root)], build_directory=str(directory),
                               with_cuda=True, is_python_module=False, verbose=False)
        except Exception as e:  # ninja's output is in the message
            (directory / "build.log").write_text(str(e))
            raise BuildError(f"CUDA extension build failed ({type(e).__name__}); log: {directory / 'build.log'}",
                             directory / "build.log") from e
        finally:
            if saved is None:
                os.environ.pop("MAX_JOBS", None)
            else:
                os.environ["MAX_JOBS"] = saved
        seconds = time.monotonic() - start
        (directory / OK_FILE).write_text(f"{seconds:.1f} s\n")
        print(f"hf_flash: CUDA kernels built in {seconds:.0f} s", file=sys.stderr, flush=True)
    return library


def _load(environ=os.environ) -> tuple[bool, str]:
    if environ.get("HF_FLASH_SKIP_CUDA") == "1":
        return False, "HF_FLASH_SKIP_CUDA=1"
    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} is a CPU build (install a CUDA build of torch for the kernels)"
    if not torch.cuda.is_available():
        return False, "no CUDA GPU visible"
    capability = torch.cuda.get_device_capability()
    if capability < (8, 0):
        return False, f"compute capability {capability[0]}.{capability[1]} (kernels need 8.0+)"
    spec = Spec(environ)
    library = spec.cached_for(capability)
    if library is None:
        requested = environ.get("HF_FLASH_CUDA_ARCHS")
        archs = parse_archs(requested) if requested else (arch_for(capability),)
        if not any(runs_on(a, capability) for a in archs):
            return False, f"HF_FLASH_CUDA_ARCHS={requested} has no code for this GPU (sm_{arch_for(capability)})"
        from torch.utils.cpp_extension import CUDA_HOME

        problem = toolkit_problem(CUDA_HOME, torch.version.cuda)
        if problem is not None:
            return False, problem
        library = build(spec, archs)
    torch.ops.load_library(str(library))  # registers the hf_flash::_cuda_* ops
    return True, f"CUDA extension loaded from {library.parent}"


def load_extension(environ=os.environ) -> tuple[bool, str]:
    """(loaded, detail): loads the cached extension, building it first if needed. Never raises;
    when the kernels are unavailable, logs one line saying why (a warning when a GPU is idle for it)."""
    try:
        loaded, detail = _load(environ)
    except Exception as e:
        loaded, detail = False, str(e) if isinstance(e, BuildError) else f"CUDA extension unavailable: {e}"
    if not loaded:
        log = logger.warning if detail != "HF_FLASH_SKIP_CUDA=1" and torch.cuda.is_available() else logger.info
        log("hf_flash: CUDA kernels not used (%s); running the PyTorch reference path", detail)
    return loaded, detail


def build_main(argv: Sequence[str] = ()) -> int:
    """``python -m hf_flash build``: build ahead of time (for HF_FLASH_CUDA_ARCHS, else the local GPU)."""
    if argv:
        print("usage: [HF_FLASH_CUDA_ARCHS=80;90a] [HF_FLASH_CACHE=DIR] python -m hf_flash build", file=sys.stderr)
        return 2
    if torch.version.cuda is None:
        print(f"hf_flash build: torch {torch.__version__} is a CPU build", file=sys.stderr)
        return 1
    requested = os.environ.get("HF_FLASH_CUDA_ARCHS")
    if requested:
        archs = parse_archs(requested)
    elif torch.cuda.is_available():
        archs = (arch_for(torch.cuda.get_device_capability()),)
    else:
        print("hf_flash build: no CUDA GPU visible; set HF_FLASH_CUDA_ARCHS (e.g. '80;90a')", file=sys.stderr)
        return 1
    from torch.utils.cpp_extension import CUDA_HOME

    problem = toolkit_problem(CUDA_HOME, torch.version.cuda)
    if problem is not None:
        print(f"hf_flash build: {problem}", file=sys.stderr)
        return 1
    spec = Spec()
    try:
        library = build(spec, archs)
    except BuildError as e:
        print(f"hf_flash build: {e}", file=sys.stderr)
        if e.log is not None and e.log.is_file():  # what failed, so a remote build's caller sees it
            print("\n".join(compiler_errors(e.log.read_text(errors="replace"))), file=sys.stderr)
        return 1
    slowest = _ninja_times(library.parent)[:5]
    if slowest:
        print("slowest files: " + ", ".join(f"{Path(out).name} {s:.0f} s" for s, out in slowest))
    print(library)
    return 0
