#!/usr/bin/env bash
# Download into .whl/ (git-ignored) the wheels the GPU machine lacks, for CPython 3.12 manylinux
# x86_64: megatron-core 0.16.1 and nvidia-cudnn-frontend 1.28.0 (the cudnn attention backend), and
# every non-extra requirement of them (METADATA Requires-Dist, recursively) except what that
# machine already has (torch, numpy, packaging). Idempotent: wheels
# already there are kept, wheels no longer wanted are removed (two versions of one package would
# stop the install). Fails loudly when the wheels, or the wheels plus the working tree that travels
# with a device call, pass 64 MiB.
#
#   bash scripts/gpu_wheels.sh
#
# Then the device call carries them: carry=[".whl"], command "bash scripts/gpu_check.sh --out $OUT".
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
mkdir -p .whl
"$PY" - <<'EOF'
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

WANT = ["megatron-core==0.16.1", "nvidia-cudnn-frontend==1.28.0"]
PRESENT = {"torch", "numpy", "packaging"}  # already on the GPU machine (device KINDS.md)
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
