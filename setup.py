"""Build hf_flash: pure Python everywhere, plus the CUDA extension hf_flash._C
when torch has CUDA and nvcc is found.

Environment:
  HF_FLASH_CUDA_ARCHS   semicolon list of targets, default "80;90a"
  HF_FLASH_SKIP_CUDA=1  never build the extension
  HF_FLASH_DISABLE_FORWARD=1 / HF_FLASH_DISABLE_BACKWARD=1
                        leave a kernel family out (its op then raises)
  MAX_JOBS              parallel compile jobs (ninja), default from cores and RAM
"""
import glob
import os
import shutil

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _cuda_unavailable_reason():
    if os.environ.get("HF_FLASH_SKIP_CUDA") == "1":
        return "HF_FLASH_SKIP_CUDA=1"
    try:
        import torch
    except ImportError:
        return "torch is not installed in the build environment (use --no-build-isolation)"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build"
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None or shutil.which("nvcc", path=os.path.join(CUDA_HOME, "bin")) is None:
        return "nvcc not found (set CUDA_HOME)"
    return None


def _gencode_flags():
    flags = []
    for arch in os.environ.get("HF_FLASH_CUDA_ARCHS", "80;90a").split(";"):
        arch = arch.strip()
        if arch:
            flags.append(f"-gencode=arch=compute_{arch},code=sm_{arch}")
    return flags


def _default_max_jobs():
    # Each nvcc job of these kernels peaks around 4 GB of RAM.
    cores = os.cpu_count() or 1
    try:
        free_gb = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (ValueError, OSError):
        free_gb = 8
    return max(1, min(cores, int(free_gb // 4)))


def extension_kwargs():
    reason = _cuda_unavailable_reason()
    if reason is not None:
        print(f"hf_flash: CUDA extension skipped ({reason}); the PyTorch reference path will be used.")
        return {}
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    os.environ.setdefault("MAX_JOBS", str(_default_max_jobs()))
    families = {"FORWARD": ("fwd", "fwd_sm90", "decode"), "BACKWARD": ("bwd",)}  # HF_FLASH_DISABLE_<name> -> csrc/<folders>
    disabled = [name for name in families if os.environ.get(f"HF_FLASH_DISABLE_{name}") == "1"]
    defines = [f"-DHF_FLASH_DISABLE_{name}" for name in disabled]
    sources = ["csrc/binding.cpp"] + sorted(
        path for name, folders in families.items() if name not in disabled for folder in folders
        for path in glob.glob(f"csrc/{folder}/**/*.cu", recursive=True))
    print(f"hf_flash: building the CUDA extension from {len(sources)} files, MAX_JOBS={os.environ['MAX_JOBS']}")
    ext = CUDAExtension(
        name="hf_flash._C",
        sources=sources,
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_compile_args={
            "cxx": ["-O3", "-std=c++20", *defines],
            "nvcc": ["-O3", "-std=c++17", *defines, "--use_fast_math", "-lineinfo", "--expt-relaxed-constexpr",
                     "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
                     "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
                     *_gencode_flags()],
        },
    )
    return {"ext_modules": [ext], "cmdclass": {"build_ext": BuildExtension}}


setup(**extension_kwargs())
