"""The first-use build of the CUDA extension (hf_flash/_build.py), on CPU: which reason each machine
gets instead of kernels (never an exception), the cache key, the source convention, and that
importing hf_flash builds nothing."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.utils.cpp_extension

from hf_flash import _build


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """A CUDA torch on an H100 with an empty cache; tests change one thing each."""
    monkeypatch.setenv("HF_FLASH_CACHE", str(tmp_path / "cache"))
    for name in ("HF_FLASH_SKIP_CUDA", "HF_FLASH_CUDA_ARCHS", "HF_FLASH_DISABLE_FORWARD", "HF_FLASH_DISABLE_BACKWARD"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.utils.cpp_extension, "CUDA_HOME", None)

    def no_build(*args, **kwargs):
        raise AssertionError("no build expected")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_build)
    return tmp_path


def fake_toolkit(root: Path, release: str = "13.0", header: bool = True) -> str:
    (root / "bin").mkdir(parents=True)
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.1'\n")
    nvcc.chmod(0o755)
    (root / "include").mkdir()
    if header:
        (root / "include" / "cuda_runtime_api.h").write_text("")
    return str(root)


def test_skip_env(machine, monkeypatch):
    monkeypatch.setenv("HF_FLASH_SKIP_CUDA", "1")
    assert _build.load_extension() == (False, "HF_FLASH_SKIP_CUDA=1")


def test_cpu_torch(machine, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    loaded, reason = _build.load_extension()
    assert not loaded and "is a CPU build" in reason


def test_no_gpu_never_builds(machine, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("HF_FLASH_CUDA_ARCHS", "90a")  # an arch list alone does not build at first use
    assert _build.load_extension() == (False, "no CUDA GPU visible")
    assert not (machine / "cache").exists()


def test_old_gpu(machine, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    assert _build.load_extension() == (False, "compute capability 7.5 (kernels need 8.0+)")


def test_no_toolkit(machine):
    loaded, reason = _build.load_extension()
    assert not loaded and "no CUDA toolkit found" in reason


def test_cuda_home_without_nvcc(machine, monkeypatch):
    (machine / "usr" / "bin").mkdir(parents=True)
    monkeypatch.setattr(torch.utils.cpp_extension, "CUDA_HOME", str(machine / "usr"))
    loaded, reason = _build.load_extension()
    assert not loaded and "has no bin/nvcc" in reason


def test_cuda_home_without_headers(machine, monkeypatch):
    # the machine: an nvcc on PATH whose parent (the guessed CUDA_HOME) has no CUDA headers
    monkeypatch.setattr(torch.utils.cpp_extension, "CUDA_HOME", fake_toolkit(machine / "usr", header=False))
    loaded, reason = _build.load_extension()
    assert not loaded and "has no include/cuda_runtime_api.h" in reason


def test_toolkit_of_another_cuda_major(machine, monkeypatch):
    monkeypatch.setattr(torch.utils.cpp_extension, "CUDA_HOME", fake_toolkit(machine / "cuda", release="12.8"))
    loaded, reason = _build.load_extension()
    assert not loaded and "nvcc 12.8" in reason and "CUDA 13.0" in reason


def test_compile_error_is_a_reason_with_a_log(machine, monkeypatch, caplog):
    monkeypatch.setattr(torch.utils.cpp_extension, "CUDA_HOME", fake_toolkit(machine / "cuda"))
    calls = []

    def failing_load(**kwargs):
        calls.append(kwargs)
        raise RuntimeError("Error building extension 'hf_flash_C': ninja: build stopped")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", failing_load)
    with caplog.at_level(logging.INFO, logger="hf_flash"):
        loaded, reason = _build.load_extension()
    assert not loaded and "build failed" in reason
    records = [r for r in caplog.records if r.name == "hf_flash"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING  # one line (a GPU goes without kernels)
    (kwargs,) = calls
    assert "-gencode=arch=compute_90a,code=sm_90a" in kwargs["extra_cuda_cflags"]
    assert not any("sm_80" in f for f in kwargs["extra_cuda_cflags"])  # the local GPU's arch only
    log = Path(reason.split("log: ")[1])
    assert "ninja: build stopped" in log.read_text()
    assert not (log.parent / _build.OK_FILE).exists()  # a failed build is never loaded later


def test_unexpected_error_never_raises(machine, monkeypatch):
    def broken():
        raise OSError("disk on fire")

    monkeypatch.setattr(_build, "csrc_dir", broken)
    loaded, reason = _build.load_extension()
    assert not loaded and "disk on fire" in reason


def test_bad_arch_list(machine, monkeypatch):
    monkeypatch.setenv("HF_FLASH_CUDA_ARCHS", "80;hopper")
    loaded, reason = _build.load_extension()
    assert not loaded and "HF_FLASH_CUDA_ARCHS" in reason and "'hopper'" in reason
    monkeypatch.setenv("HF_FLASH_CUDA_ARCHS", "80")
    loaded, reason = _build.load_extension()
    assert not loaded and "has no code for this GPU (sm_90a)" in reason


def cached_build(archs) -> Path:
    directory = _build.Spec().directory(archs)
    directory.mkdir(parents=True)
    (directory / f"{_build.NAME}.so").write_bytes(b"")
    (directory / _build.OK_FILE).write_text("1 s\n")
    return directory


@pytest.mark.parametrize("capability, used", [((9, 0), True), ((8, 0), True), ((8, 6), True), ((8, 9), True),
                                              ((12, 0), False)])
def test_cached_build_is_loaded_without_a_toolkit(machine, monkeypatch, capability, used):
    directory = cached_build(("80", "90a"))  # e.g. made ahead of time for an image
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    loaded_paths = []
    monkeypatch.setattr(torch.ops, "load_library", loaded_paths.append)
    loaded, reason = _build.load_extension()
    if used:
        assert (loaded, reason) == (True, f"CUDA extension loaded from {directory}")
        assert loaded_paths == [str(directory / f"{_build.NAME}.so")]
    else:
        assert not loaded and "no CUDA toolkit" in reason and not loaded_paths


def test_unfinished_build_is_not_loaded(machine):
    directory = cached_build(("90a",))
    (directory / _build.OK_FILE).unlink()
    loaded, reason = _build.load_extension()
    assert not loaded and "no CUDA toolkit" in reason


@pytest.mark.parametrize("arch, capability, runs", [
    ("80", (8, 0), True), ("80", (8, 6), True), ("86", (8, 0), False), ("90a", (9, 0), True),
    ("80", (9, 0), False), ("90", (9, 0), False), ("90a", (10, 0), False), ("100", (10, 3), True), ("120", (12, 0), True)])
def test_runs_on(arch, capability, runs):
    assert _build.runs_on(arch, capability) is runs


def test_arch_names():
    assert _build.arch_for((9, 0)) == "90a" and _build.arch_for((8, 6)) == "86" and _build.arch_for((12, 0)) == "120"
    assert _build.parse_archs("80;90a") == _build.parse_archs(" 8.0, 9.0a ") == ("80", "90a")
    assert _build.gencode_flags(["90a"]) == ["-gencode=arch=compute_90a,code=sm_90a"]
    with pytest.raises(ValueError, match="HF_FLASH_CUDA_ARCHS"):
        _build.parse_archs(";")


def test_cache_key():
    key = _build.build_key("2.14.1+cu130", "13.0", ("90a",), "abc", python=(3, 11))
    assert key == "torch2.14.1+cu130-cu13.0-py311-sm90a-abc"
    others = [_build.build_key("2.14.2+cu130", "13.0", ("90a",), "abc", python=(3, 11)),
              _build.build_key("2.14.1+cu130", "12.8", ("90a",), "abc", python=(3, 11)),
              _build.build_key("2.14.1+cu130", "13.0", ("80",), "abc", python=(3, 11)),
              _build.build_key("2.14.1+cu130", "13.0", ("90a",), "abd", python=(3, 11)),
              _build.build_key("2.14.1+cu130", "13.0", ("90a",), "abc", python=(3, 12))]
    assert len({key, *others}) == 6


def source_tree(root: Path) -> Path:
    for name in ("flash.h", "binding.cpp", "extra.cu", "fwd/generated/fwd_a.cu", "fwd_sm90/b.cu", "decode/c.cu",
                 "bwd/generated/bwd_a.cu", "bwd/common.cuh", "bwd_sm90/d.cu", "tools/not_compiled.cu"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(f"// {name}\n")
    return root


def test_sources_by_convention(tmp_path):
    root = source_tree(tmp_path)
    names = lambda files: [p.relative_to(root).as_posix() for p in files]  # noqa: E731
    assert names(_build.sources(root)) == ["binding.cpp", "bwd/generated/bwd_a.cu", "bwd_sm90/d.cu", "decode/c.cu",
                                           "extra.cu", "fwd/generated/fwd_a.cu", "fwd_sm90/b.cu"]
    assert names(_build.sources(root, ["BACKWARD"])) == ["binding.cpp", "decode/c.cu", "extra.cu",
                                                         "fwd/generated/fwd_a.cu", "fwd_sm90/b.cu"]
    assert names(_build.sources(root, ["FORWARD"])) == ["binding.cpp", "bwd/generated/bwd_a.cu", "bwd_sm90/d.cu",
                                                        "extra.cu"]
    assert _build.disabled_families({"HF_FLASH_DISABLE_BACKWARD": "1"}) == ["BACKWARD"]
    cxx, nvcc = _build.flags(["BACKWARD"])
    assert "-DHF_FLASH_DISABLE_BACKWARD" in cxx and "-DHF_FLASH_DISABLE_BACKWARD" in nvcc
    assert not any("arch" in f for f in nvcc)  # the arch is in the cache key, not the digest


def test_source_digest(tmp_path):
    root = source_tree(tmp_path)
    files = _build.sources(root)
    digest = _build.source_digest(root, files, ["-O3"])
    assert _build.source_digest(root, files, ["-O3"]) == digest
    assert _build.source_digest(root, files, ["-O2"]) != digest
    assert _build.source_digest(root, files[1:], ["-O3"]) != digest
    (root / "bwd" / "common.cuh").write_text("// changed header\n")  # headers count too
    assert _build.source_digest(root, files, ["-O3"]) != digest
    digest = _build.source_digest(root, files, ["-O3"])
    assert _build.source_digest(root, files, ["-O3"], ["fwd/fwd_hdim64_bf16.cu"]) != digest
    (root / "generate_kernels.py").write_text("# changed generator\n")  # so does the generator
    assert _build.source_digest(root, files, ["-O3"]) != digest


def test_generated_instantiations(tmp_path):
    """Every family gets its dispatch and one file per (head dim, dtype), unique names, written at build time;
    a disabled family gets none."""
    spec = _build.Spec({})
    gen = spec.generator
    names = sorted(gen.files(spec.kinds))
    assert len(names) == sum(1 + 2 * len(f[2]) for f in gen.FAMILIES.values())
    assert len({Path(n).stem for n in names}) == len(names)
    written = gen.write(tmp_path, spec.kinds)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in written) == names
    text = (tmp_path / "bwd_sm90" / "bwd_sm90_hdim128_bf16.cu").read_text()
    assert "run_bwd_sm90_hdim<true, 128>" in text and '#include "bwd_sm90/launch.cuh"' in text
    assert "case 256:" in (tmp_path / "fwd" / "fwd_dispatch.cu").read_text()
    forward_only = _build.Spec({"HF_FLASH_DISABLE_BACKWARD": "1"})
    assert forward_only.kinds == ["fwd", "fwd_sm90", "decode"] and forward_only.digest != spec.digest


def test_shipped_sources_are_found():
    root = _build.csrc_dir()
    assert (root / "binding.cpp") in _build.sources(root)


def test_import_builds_nothing(tmp_path):
    """Importing hf_flash, its env report and a CPU call never build (nor look for) the extension."""
    code = ("import hf_flash, torch\n"
            "assert hf_flash.ops.extension_status.cache_info().misses == 0\n"
            "q = torch.randn(1, 4, 2, 32)\n"
            "hf_flash.flash_attn_func(q, q, q)\n"
            "assert hf_flash.ops.extension_status.cache_info().misses == 0\n"
            "print(hf_flash.env_report())\n")
    env = {**os.environ, "HF_FLASH_CACHE": str(tmp_path / "cache"), "CUDA_VISIBLE_DEVICES": ""}
    root = Path(__file__).resolve().parent.parent  # the same hf_flash as this process (python -m pytest from the root)
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "extension: " in proc.stdout and "building" not in proc.stderr
    assert not (tmp_path / "cache").exists()


def test_build_command_without_gpu_or_arch_list(machine, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _build.build_main([]) == 1
    assert "set HF_FLASH_CUDA_ARCHS" in capsys.readouterr().err
    monkeypatch.setattr(torch.version, "cuda", None)
    assert _build.build_main([]) == 1
    assert "CPU build" in capsys.readouterr().err


def test_failed_build_prints_the_compiler_errors(machine, monkeypatch, capsys):
    """`python -m hf_flash build` whose compile fails names the log and prints the lines that say what failed (a
    build on a remote machine is often all its caller sees), not the rest of ninja's output."""
    def failing_load(*args, **kwargs):
        raise RuntimeError("Error building extension 'hf_flash':\n[1/3] nvcc -c a.cu -o a.cuda.o\n"
                           "FAILED: fwd_sm90_hdim256_bf16.cuda.o\n"
                           "csrc/sm90/wgmma.cuh(136): error: static assertion failed with \"instantiated widths\"\n"
                           "          detected during instantiation of a template\n"
                           "1 error detected in the compilation of \"fwd_sm90_hdim256_bf16.cu\".\nninja: build stopped\n")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", failing_load)
    monkeypatch.setattr(_build, "toolkit_problem", lambda *a: None)
    monkeypatch.setenv("HF_FLASH_CUDA_ARCHS", "90a")
    assert _build.build_main([]) == 1
    err = capsys.readouterr().err
    assert "CUDA extension build failed" in err and "build.log" in err
    assert "FAILED: fwd_sm90_hdim256_bf16.cuda.o" in err and 'error: static assertion failed' in err
    assert "1 error detected" in err and "detected during instantiation" not in err and "[1/3]" not in err
