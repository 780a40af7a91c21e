#!/usr/bin/env bash
# Optional: build `--features cuda` on a Linux x86_64 machine that has no CUDA toolkit (and no
# GPU), from NVIDIA's CUDA 13.0 wheels on PyPI. With a regular toolkit installed you do not need
# this; see "GPU build" in README.md.
#
#   source scripts/cuda-env.sh                    # exports the build environment into this shell
#   cargo build --release --features cuda -p exactscore-server --bins
# or in one go:
#   bash scripts/cuda-env.sh build -p exactscore-server --bins
#
# Settings (environment):
#   CUDA_COMPUTE_CAP   GPU architecture the kernels are compiled for (default 90: H100/H200;
#                      80 = A100, 89 = L40S/RTX 4090, 120 = RTX 5090)
#   EXACTSCORE_CUDA_DIR  where the wheels' venv and the assembled toolkit folder go
#                      (default: target/cuda-env of this repository; ~1.3 GB)
#   PYTHON             python used to create the venv (default python3, 3.9 or newer)
#
# What it does, idempotently:
#   venv/  the pinned wheels below (pip, from PyPI);
#   root/  a folder shaped like a toolkit install: bin/ include/ nvvm/ link into the wheels,
#          lib64/ has the unversioned .so names the linker wants, and lib64/stubs/libcuda.so is a
#          link-time stand-in for the driver library, generated here from cuda.h (every driver
#          entry point returns CUDA_ERROR_STUB_LIBRARY; SONAME libcuda.so.1, so at run time the
#          real driver's libcuda.so.1 is loaded; the stub is never shipped);
#   then exports CUDA_ROOT/CUDA_HOME/CUDA_PATH, NVCC, PATH, LIBRARY_PATH, CUDARC_CUDA_VERSION,
#   CUDAFORGE_THREADS.
#
# The toolkit stays at 13.0 on purpose: the binary must run on driver 580 (CUDA 13.0). A newer
# nvcc writes PTX that an older driver cannot JIT, and cudarc chooses its driver-API bindings by
# the CUDA version (pinned by CUDARC_CUDA_VERSION=13000), so newer bindings would ask the driver
# for symbols it lacks. For a newer driver, change the pins together.
#
# At run time the binary needs the CUDA runtime libraries (cudart, cublas, cublasLt, curand,
# nvrtc) on LD_LIBRARY_PATH: the same wheels' nvidia/cu13/lib, or a toolkit's lib64.

_exactscore_cuda_env() {
    local pins=(
        nvidia-cuda-nvcc==13.0.88
        nvidia-cuda-crt==13.0.88
        nvidia-nvvm==13.0.88
        nvidia-cuda-cccl==13.0.85
        nvidia-cuda-runtime==13.0.96
        nvidia-cuda-nvrtc==13.0.88
        nvidia-cublas==13.1.0.3
        nvidia-curand==10.4.0.35
    )
    local here repo dir venv root py
    here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd) || return 1
    repo=$(dirname "$here")
    dir=${EXACTSCORE_CUDA_DIR:-$repo/target/cuda-env}
    venv=$dir/venv
    root=$dir/root
    py=${PYTHON:-python3}
    say() { printf '[cuda-env] %s\n' "$*" >&2; }

    case "$(uname -s)-$(uname -m)" in
        Linux-x86_64) ;;
        *) say "the CUDA wheels used here exist for Linux x86_64 only"; return 1 ;;
    esac

    mkdir -p "$dir" || return 1
    if [ ! -x "$venv/bin/python" ]; then
        say "creating $venv"
        "$py" -m venv "$venv" || { say "cannot create a venv with $py"; return 1; }
    fi
    # A stamp with the pin list: pip runs again only when the pins change.
    local stamp=$venv/.exactscore-pins want
    want=$(printf '%s\n' "${pins[@]}")
    if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
        say "installing ${#pins[@]} CUDA 13.0 wheels (about 1.2 GB) into $venv"
        "$venv/bin/python" -m pip install --disable-pip-version-check --quiet "${pins[@]}" ||
            { say "pip install failed"; return 1; }
        printf '%s\n' "$want" >"$stamp"
    fi

    # Folder layout and stub in Python: globbing and the cuda.h scan are simpler there.
    "$venv/bin/python" - "$venv" "$root" <<'PY' || { say "assembling $root failed"; return 1; }
import glob, os, re, subprocess, sys, tempfile

venv, root = sys.argv[1], sys.argv[2]
found = glob.glob(os.path.join(venv, "lib", "python3*", "site-packages", "nvidia", "cu13"))
if not found or not os.path.isfile(os.path.join(found[0], "bin", "nvcc")):
    sys.exit(f"no nvidia/cu13/bin/nvcc under {venv}")
cu = found[0]


def link(target, name):
    if os.path.islink(name) or os.path.exists(name):
        if os.path.islink(name) and os.readlink(name) == target:
            return
        os.remove(name)
    os.symlink(target, name)


os.makedirs(os.path.join(root, "lib64", "stubs"), exist_ok=True)
for sub in ("bin", "include", "nvvm"):
    link(os.path.join(cu, sub), os.path.join(root, sub))
for lib in ("cudart", "cublas", "cublasLt", "curand", "nvrtc"):
    # libX.so.<major> is what the wheels ship; the linker looks for libX.so.
    versions = [p for p in glob.glob(os.path.join(cu, "lib", f"lib{lib}.so.*"))
                if re.fullmatch(rf"lib{lib}\.so\.\d+", os.path.basename(p))]
    if not versions:
        sys.exit(f"lib{lib}.so.N missing in {cu}/lib")
    real = sorted(versions)[0]
    link(real, os.path.join(root, "lib64", os.path.basename(real)))
    link(real, os.path.join(root, "lib64", f"lib{lib}.so"))

header = os.path.join(cu, "include", "cuda.h")
stub = os.path.join(root, "lib64", "stubs", "libcuda.so")
if os.path.exists(stub) and os.path.getmtime(stub) >= os.path.getmtime(header):
    sys.exit(0)
raw = open(header, encoding="utf-8", errors="replace").read()
# The header as the compiler sees it names the versioned entry points (cuMemAlloc_v2 ...);
# the raw text names the plain ones and the '#define cuX cuX_vN' aliases. Export all of them.
pre = subprocess.run(["gcc", "-E", "-P", "-x", "c", header], check=True,
                     capture_output=True, text=True).stdout
call = re.compile(r"\b(cu[A-Z]\w*)\s*\(")
names = set(call.findall(raw)) | set(call.findall(pre))
names |= set(re.findall(r"^#define\s+cu[A-Z]\w*\s+(cu[A-Z]\w*)\s*$", raw, re.M))
with tempfile.TemporaryDirectory() as tmp:
    src = os.path.join(tmp, "stub.c")
    with open(src, "w") as f:
        f.write("/* generated link-time stub; 34 = CUDA_ERROR_STUB_LIBRARY */\n")
        for n in sorted(names):
            f.write(f"int {n}(void) {{ return 34; }}\n")
    out = os.path.join(tmp, "libcuda.so")
    subprocess.run(["gcc", "-shared", "-fPIC", "-O0", "-Wl,-soname,libcuda.so.1",
                    "-o", out, src], check=True)
    os.replace(out, stub)
print(f"[cuda-env] generated {stub} ({len(names)} driver entry points)", file=sys.stderr)
PY

    export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
    export CUDA_ROOT=$root CUDA_HOME=$root CUDA_PATH=$root
    export NVCC=$root/bin/nvcc
    export CUDARC_CUDA_VERSION=13000
    # candle-kernels compiles its .cu files in parallel through cudaforge: one job per core.
    : "${CUDAFORGE_THREADS:=$(nproc)}"
    export CUDAFORGE_THREADS
    case ":$PATH:" in *":$root/bin:"*) ;; *) export PATH=$root/bin:$PATH ;; esac
    case ":${LIBRARY_PATH:-}:" in
        *":$root/lib64:"*) ;;
        *) export LIBRARY_PATH=$root/lib64:$root/lib64/stubs${LIBRARY_PATH:+:$LIBRARY_PATH} ;;
    esac
    say "ready: $("$NVCC" --version | tail -n 2 | head -n 1), CUDA_ROOT=$root, CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP"
}

if (return 0 2>/dev/null); then
    _exactscore_cuda_env
    _rc=$?
    unset -f _exactscore_cuda_env say
    return $_rc
fi

set -euo pipefail
_exactscore_cuda_env
unset -f _exactscore_cuda_env say
if [ "${1:-}" = build ]; then
    shift
    cd "$(dirname "$0")/.."
    exec cargo build --release --features cuda "$@"
elif [ $# -gt 0 ]; then
    echo "usage: source scripts/cuda-env.sh | bash scripts/cuda-env.sh build [cargo args]" >&2
    exit 2
fi
echo "[cuda-env] run as a script, the environment ends with it: 'source' it instead" >&2
