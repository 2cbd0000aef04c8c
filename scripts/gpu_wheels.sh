#!/usr/bin/env bash
# Download into .whl/ (git-ignored) the wheels the GPU machine lacks, for CPython 3.12 manylinux
# x86_64: megatron-core (0.19.2 by default; 0.16.1 with --megatron-core 0.16.1 or
# MEGAPACK_MEGATRON_CORE=0.16.1) and nvidia-cudnn-frontend 1.28.0 (the cudnn attention backend),
# and every non-extra requirement of them (METADATA Requires-Dist, recursively) except what that
# machine already has (torch, numpy, packaging). Idempotent: wheels already there are kept, wheels
# no longer wanted are removed (two versions of one package would stop the install). Fails loudly
# when the wheels, or the wheels plus the working tree that travels with a device call, pass 64 MiB.
#
#   bash scripts/gpu_wheels.sh [--megatron-core VERSION]
#
# Then the device call carries them: carry=[".whl"], command
# "bash scripts/gpu_check.sh --plan first-run --out $OUT/first-run" (docs/gpu.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
MEGATRON_CORE=${MEGAPACK_MEGATRON_CORE:-0.19.2}
while [ $# -gt 0 ]; do
  case "$1" in
    --megatron-core) [ $# -ge 2 ] || { echo "gpu_wheels: --megatron-core needs a version (0.19.2 or 0.16.1)" >&2; exit 2; }
      MEGATRON_CORE=$2; shift 2 ;;
    --megatron-core=*) MEGATRON_CORE=${1#*=}; shift ;;
    *) echo "usage: bash scripts/gpu_wheels.sh [--megatron-core VERSION]  (unknown argument: $1)" >&2; exit 2 ;;
  esac
done
case "$MEGATRON_CORE" in
  0.19.2|0.16.1) ;;
  *) echo "gpu_wheels: megatron-core $MEGATRON_CORE is not one megapack supports; use 0.19.2 (the default) or 0.16.1" >&2; exit 2 ;;
esac
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore MEGATRON_CORE
mkdir -p .whl
"$PY" - <<'EOF'
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

WANT = [f"megatron-core=={os.environ['MEGATRON_CORE']}", "nvidia-cudnn-frontend==1.28.0"]
PRESENT = {"torch", "numpy", "packaging"}  # already on the GPU machine (its image's package list)
TARGET = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
          "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
FLAGS = ["--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
         *[f for n in ("manylinux_2_28", "manylinux_2_27", "manylinux_2_24", "manylinux_2_17",
                       "manylinux2014", "manylinux1")
           for f in ("--platform", f"{n}_x86_64")],
         "-d", ".whl", "-q"]
LIMIT = 64 * 2**20
dest = Path(".whl")


def wheel_of(name: str) -> Path:
    found = [p for p in dest.glob("*.whl") if parse_wheel_filename(p.name)[0] == name]
    if len(found) != 1:
        sys.exit(f"gpu_wheels: expected one wheel of {name} in .whl/, found {[p.name for p in found]}")
    return found[0]


def requirements(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    reqs = [Requirement(line.split(":", 1)[1].strip()) for line in lines if line.startswith("Requires-Dist:")]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(TARGET)]


queue, done = [Requirement(w) for w in WANT], {}
while queue:
    req = queue.pop(0)
    name = canonicalize_name(req.name)
    if name in PRESENT or name in done:
        continue
    pin = str(req.specifier) or ""
    for other in dest.glob("*.whl"):  # another version of it (say 0.16.1 after 0.19.2): replaced
        other_name, version = parse_wheel_filename(other.name)[:2]
        if other_name == name and req.specifier and version not in req.specifier:
            print(f"gpu_wheels: removing {other.name} (not {req})")
            other.unlink()
    subprocess.run([sys.executable, "-m", "pip", "download", *FLAGS, f"{req.name}{pin}"], check=True)
    wheel = wheel_of(name)
    done[name] = wheel
    queue += requirements(wheel)
    print(f"gpu_wheels: {wheel.name} ({wheel.stat().st_size / 2**20:.1f} MiB)")

for stale in set(dest.glob("*.whl")) - set(done.values()):
    print(f"gpu_wheels: removing {stale.name} (not wanted any more)")
    stale.unlink()
total = sum(p.stat().st_size for p in done.values())
tree = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                      capture_output=True, check=True).stdout.split(b"\0")
tree_bytes = sum(Path(p.decode()).stat().st_size for p in tree if p and Path(p.decode()).is_file())
print(f"gpu_wheels: {len(done)} wheel(s), {total / 2**20:.1f} MiB in .whl/; with the working tree "
      f"that travels ({tree_bytes / 2**20:.1f} MiB): {(total + tree_bytes) / 2**20:.1f} MiB of 64")
if total > LIMIT:
    sys.exit(f"gpu_wheels: ERROR: .whl/ holds {total / 2**20:.1f} MiB, over the device's 64 MiB")
if total + tree_bytes > LIMIT:
    sys.exit(f"gpu_wheels: ERROR: .whl/ plus the working tree is {(total + tree_bytes) / 2**20:.1f} "
             "MiB, over the 64 MiB a device call carries")
EOF
