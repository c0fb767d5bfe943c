"""llama.cpp's own `llama-server`, built once from the llama.cpp that llama-cpp-python vendors, as a peer.

The source is llama-cpp-python's source distribution at the version installed here (pinned in
constraints.txt): `pip download --no-binary :all: --no-deps` into the cache, its `vendor/llama.cpp`
configured with cmake (server and tools on, tests/examples/UI/OpenSSL off, static libraries, CPU only)
and only the `llama-server` target built (`-j2`, under `nice`). The binary is installed at
`${SMOLFORGE_LLAMA_SERVER_DIR:-$HOME/.cache/smolforge/llama-server}/bin/llama-server`; a second call
finds it and builds nothing. CI does not need it: the benchmark and the soak tests build it on demand.

API (used by bench/serve_load.py, tests/serve/test_vs_llama_server.py and the OpenAI-endpoint teacher):
    path = ensure_built()                      # Path of the binary (builds when absent; minutes)
    proc = start(gguf, port, threads=2, parallel=4, jinja=True)   # Popen, own process group
    wait_ready(proc, port, timeout_s=120)      # polls GET /health until 200; raises when it dies or times out
    stop(proc)                                 # SIGTERM to its PID, then SIGKILL after a grace period

    python bench/llama_server.py               # build (or find) and print the binary's path
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from importlib import metadata
from pathlib import Path

PACKAGE = "llama-cpp-python"
REPO = Path(__file__).resolve().parents[1]


def install_dir() -> Path:
    """Where the build lives: $SMOLFORGE_LLAMA_SERVER_DIR, else ~/.cache/smolforge/llama-server."""
    env = os.environ.get("SMOLFORGE_LLAMA_SERVER_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "smolforge" / "llama-server"


def binary_path() -> Path:
    """The installed binary's path (it may not exist yet: see `ensure_built`)."""
    return install_dir() / "bin" / "llama-server"


def pinned_version() -> str:
    """llama-cpp-python's version: the installed one, else the pin in constraints.txt.

    Raises RuntimeError when neither is known.
    """
    with contextlib.suppress(metadata.PackageNotFoundError):
        return metadata.version(PACKAGE)
    pins = REPO / "constraints.txt"
    if pins.exists():
        for line in pins.read_text().splitlines():
            if line.strip().lower().startswith(PACKAGE + "=="):
                return line.split("==", 1)[1].strip()
    raise RuntimeError(f"{PACKAGE} is neither installed nor pinned in {pins}")


def fetch_sdist(version: str, into: Path) -> Path:
    """llama-cpp-python's source distribution (.tar.gz) at `version`, downloaded by pip into `into`."""
    into.mkdir(parents=True, exist_ok=True)
    found = sorted(into.glob(f"llama_cpp_python-{version}.tar.gz"))
    if found:
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
           "-d", str(into), f"{PACKAGE}=={version}"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    found = sorted(into.glob(f"llama_cpp_python-{version}.tar.gz"))
    if not found:
        raise RuntimeError(f"pip download left no llama_cpp_python-{version}.tar.gz in {into}")
    return found[0]


def vendored_source(sdist: Path, into: Path) -> Path:
    """Extract only `vendor/llama.cpp` from the sdist into `into`; its root directory."""
    root = sdist.name.removesuffix(".tar.gz")
    src = into / root / "vendor" / "llama.cpp"
    if (src / "CMakeLists.txt").exists():
        return src
    prefix = f"{root}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        tar.extractall(into, members=members, filter="data")
    return src


CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_COMMON=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF",
    "-DGGML_CUDA=OFF", "-DGGML_METAL=OFF", "-DCMAKE_BUILD_RPATH=$ORIGIN/../lib",
)

# Injected at llama.cpp's project(): the ggml and llama libraries are llama-cpp-python's own (the same
# vendored source, built when it was installed), imported instead of compiled again. Why: they are
# ~70 of the ~200 objects and the slowest ones; on a shared 2-core box the full build took hours. And
# the peer then runs the very kernels the llamacpp engine calls. The server, common and mtmd build.
PREBUILT_CMAKE = """
set(_libs "@LIBS@")
set(_src "@SRC@")
foreach(_name ggml-base ggml-cpu ggml llama)
  add_library(${_name} SHARED IMPORTED GLOBAL)
  set_target_properties(${_name} PROPERTIES IMPORTED_LOCATION "${_libs}/lib${_name}.so"
                        IMPORTED_NO_SONAME FALSE)
endforeach()
set_target_properties(ggml-base PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${_src}/ggml/include")
set_target_properties(ggml PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${_src}/ggml/include"
                      INTERFACE_LINK_LIBRARIES "ggml-base;ggml-cpu")
set_target_properties(llama PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${_src}/include"
                      INTERFACE_LINK_LIBRARIES "ggml;ggml-base")
function(add_subdirectory dir)
  if(NOT "${dir}" STREQUAL "src")  # llama.cpp's own library: imported above
    _add_subdirectory(${ARGV})
  endif()
endfunction()
function(install)  # nothing is installed by cmake (the binary is copied out), and llama is imported
endfunction()
"""


def prebuilt_libs() -> Path | None:
    """llama-cpp-python's shared libraries (libllama.so, libggml*.so), None when it is not installed."""
    with contextlib.suppress(ImportError):
        import llama_cpp

        lib = Path(llama_cpp.__file__).parent / "lib"
        if all((lib / f"lib{n}.so").exists() for n in ("llama", "ggml", "ggml-base", "ggml-cpu")):
            return lib
    return None


def configure_flags(src: Path, base: Path) -> list[str]:
    """cmake's flags: CMAKE_FLAGS, plus the injected imports of llama-cpp-python's libraries when present."""
    lib = prebuilt_libs()
    if lib is None:
        return list(CMAKE_FLAGS)
    inject = base / "prebuilt.cmake"
    inject.write_text(PREBUILT_CMAKE.replace("@LIBS@", str(base / "lib")).replace("@SRC@", str(src)))
    (base / "lib").mkdir(parents=True, exist_ok=True)
    for so in lib.glob("lib*.so*"):  # the binary's rpath is $ORIGIN/../lib: the install does not follow the venv
        shutil.copy2(so, base / "lib" / so.name, follow_symlinks=True)
    # only the server's HTTP/JSON side compiles here (the kernels are the imported libraries, as built at install): -O1
    # compiles its template-heavy C++ (nlohmann json, httplib) in less time on a loaded box
    return [*CMAKE_FLAGS, f"-DCMAKE_PROJECT_INCLUDE={inject}", "-DLLAMA_USE_SYSTEM_GGML=OFF",
            "-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG", "-DCMAKE_C_FLAGS_RELEASE=-O1 -DNDEBUG"]


def ensure_built(jobs: int = 2, log: Path | None = None) -> Path:
    """The llama-server binary, built when absent (idempotent: a second call only finds it).

    jobs: parallel compile jobs (the build runs under `nice -n 10`). log: cmake's output goes here
    (default `<install_dir>/build.log`). Raises subprocess.CalledProcessError when a step fails
    (read the log) and RuntimeError when the source cannot be found.
    """
    binary = binary_path()
    if binary.exists() and os.access(binary, os.X_OK):
        return binary
    base = install_dir()
    version = pinned_version()
    src = vendored_source(fetch_sdist(version, base / "sdist"), base / "src")
    build = base / "build"
    log = log or base / "build.log"
    nice = ["nice", "-n", "10"] if shutil.which("nice") else []
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    with open(log, "a") as out:
        subprocess.run([*nice, "cmake", "-S", str(src), "-B", str(build), *gen, *configure_flags(src, base)],
                       check=True, stdout=out, stderr=subprocess.STDOUT)
        subprocess.run([*nice, "cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)],
                       check=True, stdout=out, stderr=subprocess.STDOUT)
    built = next((p for p in (build / "bin" / "llama-server", build / "tools" / "server" / "llama-server")
                  if p.exists()), None)
    if built is None:
        raise RuntimeError(f"the build left no llama-server under {build} (see {log})")
    binary.parent.mkdir(parents=True, exist_ok=True)
    tmp = binary.with_suffix(".tmp")
    shutil.copy2(built, tmp)
    tmp.replace(binary)  # atomic: a concurrent caller sees no half-copied binary
    return binary


def command(gguf: str | os.PathLike[str], port: int, *, threads: int | None = None, parallel: int = 1,
            ctx_size: int | None = None, cont_batching: bool = True, jinja: bool = False,
            host: str = "127.0.0.1", alias: str | None = None, extra: Sequence[str] = ()) -> list[str]:
    """The argv that `start` runs. ctx_size is the total over all `parallel` slots (llama-server divides it)."""
    argv = [str(binary_path()), "-m", str(gguf), "--host", host, "--port", str(port), "-np", str(parallel),
            "--no-warmup"]
    if threads:
        argv += ["-t", str(threads), "-tb", str(threads)]
    if ctx_size:
        argv += ["-c", str(ctx_size)]
    argv.append("-cb" if cont_batching else "-nocb")
    if jinja:
        argv.append("--jinja")
    if alias:
        argv += ["--alias", alias]
    return argv + list(extra)


def start(gguf: str | os.PathLike[str], port: int, *, log: Path | None = None, **opts) -> subprocess.Popen:
    """Start llama-server on `gguf` at 127.0.0.1:`port` (builds it first if needed); returns the Popen.

    opts: threads, parallel (slots, -np), ctx_size (total tokens), cont_batching (-cb, default on),
    jinja (chat template with tools), host, alias, extra (more argv). Output goes to `log` (default
    discarded). The process gets its own session, so `stop` signals only it. Call `wait_ready` next.
    """
    ensure_built()
    out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 - owned by the child
    return subprocess.Popen(command(gguf, port, **opts), stdout=out, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def wait_ready(proc: subprocess.Popen, port: int, timeout_s: float = 120.0, host: str = "127.0.0.1") -> None:
    """Poll GET /health every 0.1 s until 200 (model loaded). Bounded by timeout_s.

    Raises RuntimeError when the process exits first (with its exit code) and TimeoutError after timeout_s.
    """
    deadline = time.monotonic() + timeout_s
    url = f"http://{host}:{port}/health"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with code {proc.returncode} before it was ready")
        with contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        time.sleep(0.1)
    raise TimeoutError(f"llama-server on port {port} not ready after {timeout_s} s")


def stop(proc: subprocess.Popen, grace_s: float = 10.0) -> int | None:
    """Stop the server by its PID: SIGTERM, then SIGKILL after grace_s. Returns its exit code."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


@contextlib.contextmanager
def serving(gguf: str | os.PathLike[str], port: int, timeout_s: float = 120.0, **opts) -> Iterator[str]:
    """`start` + `wait_ready`, yields the base URL (`http://127.0.0.1:PORT`), `stop` on exit."""
    proc = start(gguf, port, **opts)
    try:
        wait_ready(proc, port, timeout_s=timeout_s, host=opts.get("host", "127.0.0.1"))
        yield f"http://{opts.get('host', '127.0.0.1')}:{port}"
    finally:
        stop(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    print(ensure_built(jobs=args.jobs))


if __name__ == "__main__":
    main()
