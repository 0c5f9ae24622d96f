"""Link check of each HF_FLASH_DISABLE_* build without a linker or torch (run by tools/check_kernels.sh).

    python3 tools/check_symbols.py OBJ_DIR

OBJ_DIR holds the objects check_kernels.sh compiled: <family>__<name>.o for the files of csrc/<family>/ and
top__<name>.<none|FORWARD|BACKWARD>.o for the always-compiled csrc/*.cu. For each combination, the set is
the always-compiled objects of that combination plus the enabled families' objects (the split setup.py
uses: forward = fwd, fwd_sm90, decode; backward = bwd, bwd_sm90). Fails when an object of the set, or
csrc/binding.cpp as preprocessed for the combination, needs an hf_flash function the set does not define.
"""
import re
import subprocess
import sys
from pathlib import Path

FAMILIES = {"FORWARD": ("fwd", "fwd_sm90", "decode"), "BACKWARD": ("bwd", "bwd_sm90")}
ROOT = Path(__file__).resolve().parent.parent


def symbols(obj: Path, flags: str) -> set:
    out = subprocess.run(["nm", "-C", flags, str(obj)], check=True, capture_output=True, text=True).stdout
    names = (re.match(r"\s*(?:[0-9a-f]+\s+)?\w\s+(.*)", line).group(1) for line in out.splitlines() if line.strip())
    return {name for name in names if name.startswith("hf_flash::")}


def binding_calls(disabled: str) -> set:
    """hf_flash functions (declared in flash.h) that binding.cpp names once its HF_FLASH_DISABLE_* blocks
    are resolved for this combination."""
    declared = set(re.findall(r"^\s*(?:cudaError_t|bool|int|size_t)\s+(\w+)\(", (ROOT / "csrc/flash.h").read_text(),
                              re.M))
    kept, stack = [], []
    for line in (ROOT / "csrc/binding.cpp").read_text().splitlines():
        m = re.match(r"\s*#\s*(ifdef|ifndef)\s+HF_FLASH_DISABLE_(\w+)", line)
        if m:
            stack.append((m.group(2) == disabled) == (m.group(1) == "ifdef"))
        elif re.match(r"\s*#\s*if", line):
            stack.append(True)
        elif re.match(r"\s*#\s*else", line):
            stack[-1] = not stack[-1]
        elif re.match(r"\s*#\s*endif", line):
            stack.pop()
        elif all(stack):
            kept.append(line)
    text = "\n".join(kept)
    return {name for name in declared if re.search(rf"\b{name}\s*\(", text)}


def main(obj_dir: Path) -> int:
    objects = sorted(obj_dir.glob("*.o"))
    failed = False
    for disabled in ("none", "FORWARD", "BACKWARD"):
        folders = {f for name, fs in FAMILIES.items() if name != disabled for f in fs}
        chosen = [o for o in objects if o.name.startswith("top__") and o.name.endswith(f".{disabled}.o")]
        chosen += [o for o in objects if o.name.split("__")[0] in folders]
        unknown = {o.name.split("__")[0] for o in objects} - {"top"} - {f for fs in FAMILIES.values() for f in fs}
        if unknown:
            print(f"check_symbols: .cu files in folders that are no kernel family: {sorted(unknown)}")
            return 1
        defined, undefined = set(), set()
        for o in chosen:
            defined |= symbols(o, "--defined-only")
            undefined |= symbols(o, "--undefined-only")
        missing = sorted(undefined - defined)
        defined_names = {name.split("(")[0].split("<")[0] for name in defined}
        missing += sorted(f"hf_flash::{name} (called by csrc/binding.cpp)" for name in binding_calls(disabled)
                          if f"hf_flash::{name}" not in defined_names)
        label = "all families" if disabled == "none" else f"HF_FLASH_DISABLE_{disabled}"
        if missing:
            failed = True
            print(f"check_symbols: {label}: {len(missing)} undefined hf_flash symbols:")
            print("".join(f"  {name}\n" for name in missing), end="")
        else:
            print(f"check_symbols: {label}: {len(chosen)} objects, every hf_flash symbol defined")
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(Path(sys.argv[1])))
