"""The processes of the tests' launches, forked from their launcher instead of started as fresh interpreters.

A launcher starts a script's processes with ``Popen``: torch elastic's agent (a multi-process ``accelerate launch``,
``torchrun``) each rank as ``python -u script ...`` in a new session, Accelerate's 1-process launcher its one as
``python script ...`` with its stderr piped. Here the launcher forks itself instead, and the child becomes what that
command would have started: its environment, argv, ``sys.path``, standard streams, session, signal dispositions as
exec leaves them, open files closed, then the script as ``__main__``, ending as the interpreter ends. The launcher
has imported torch and Accelerate already (diffusers too, where the script imports it), so the process skips
seconds of imports. Everything else is the real launcher: rendezvous, the ranks' environment, monitoring, the kill
of the others when one fails, restarts, the exit code; the process is the launcher's own child, as with Popen.
Commands of another shape (``-m``, ``--no_python``) start as before. The launcher itself may be such a fork, of
the tests' pre-imported interpreter (tests/scripts/warm_start.py, :func:`become`), which has imported all of this
and DeepSpeed's modules once. tests/test_warm_ranks.py compares what a forked and a fresh process see;
``VIDSTAB_TEST_COLD_START=1`` (tests/conftest.py) turns this off.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import signal
import subprocess
import sys
import time

EVERY_RANK = ("torch", "torch.distributed", "torch.distributed.tensor", "accelerate", "accelerate.utils",
              "safetensors.torch")
# a diffusers model's first .to() imports its hooks (transformers, peft, scipy); Accelerate's unwrap_model, DeepSpeed
DIFFUSERS_RANK = ("diffusers", "diffusers.optimization", "diffusers.models.modeling_utils", "diffusers.hooks",
                  "deepspeed", "yaml", "tqdm.auto")
EMA_RANK = ("diffusers.training_utils",)  # seconds of imports (every diffusers model): only where the ranks need it
# what DeepSpeed's engine imports as it starts: Accelerate's plugin needs transformers; its optimizer check, the
# module of its Muon optimizer, which compiles a function at import (torch's compiler stack)
DEEPSPEED_RANK = ("deepspeed", "transformers", "deepspeed.runtime.zero.muon.muon_optimizer")
"""Only third-party modules: the rank imports vidstab and the script's own modules from its own ``sys.path``."""
AGENT_MODULE = "torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler"


def _accelerate_launcher() -> bool:
    """``python -m accelerate.commands.launch ...`` or ``accelerate launch ...``: a 1-process launch starts its
    script with ``psutil.Popen`` (the module runs as ``__main__``, so it is psutil that is patched)."""
    argv = getattr(sys, "orig_argv", [])
    module = argv[argv.index("-m") + 1:argv.index("-m") + 2] if "-m" in argv else []
    return module == ["accelerate.commands.launch"] or \
        (len(argv) > 2 and os.path.basename(argv[1]) == "accelerate" and argv[2] == "launch")


class PatchOnImport(importlib.abc.MetaPathFinder):
    """Patch how a launcher starts its processes once the module doing it is imported: torch elastic's agent
    (only launchers import it), and, in Accelerate's launcher, psutil (its 1-process launch)."""

    def __init__(self):
        self.waiting = {AGENT_MODULE: lambda module: _patch_agent(module.SubprocessHandler)}
        if _accelerate_launcher():
            self.waiting["psutil"] = _patch_psutil

    def find_spec(self, name, path, target=None):
        patch = self.waiting.pop(name, None)
        if patch is None:
            return None
        if not self.waiting:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


def install() -> None:
    """Patch this process's launcher, whichever its modules are already imported: now for those, on import for
    the others (a process forked from a pre-imported interpreter becomes a launcher after its imports)."""
    for finder in [f for f in sys.meta_path if type(f).__name__ == "PatchOnImport"]:
        sys.meta_path.remove(finder)
    finder = PatchOnImport()
    for name in [name for name in finder.waiting if name in sys.modules]:
        finder.waiting.pop(name)(sys.modules[name])
    if finder.waiting:
        sys.meta_path.insert(0, finder)


class ForkedRank:
    """The forked rank, read by the agent as it reads a ``subprocess.Popen``."""

    def __init__(self, pid: int, args: list[str]):
        self.pid, self.args, self.returncode = pid, args, None

    def poll(self):
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig):
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)


@functools.lru_cache(maxsize=None)
def _forked_process_class():
    import psutil

    class ForkedProcess(psutil.Process):
        """The forked script, read by Accelerate's launcher as it reads a ``psutil.Popen``."""

        def __init__(self, pid: int, args: list[str], stderr):
            super().__init__(pid)
            self.args, self.stderr, self.returncode = args, stderr, None

        def wait(self, timeout=None):
            if self.returncode is None:
                self.returncode = super().wait(timeout)
            return self.returncode

        def poll(self):
            try:
                return self.wait(0)
            except psutil.TimeoutExpired:
                return None

    return ForkedProcess


def ForkedProcess(pid: int, args: list[str], stderr):  # noqa: N802 (a class, made when psutil is first needed)
    return _forked_process_class()(pid, args, stderr)


def _preload(argv: list[str], env: dict) -> dict:
    """What every rank imports anyway, once in the launcher: diffusers where a script in the command imports it
    (the script, or the one a harness runs), its EMA's module where the script imports it at the top or is asked
    for an EMA, DeepSpeed's where the ranks run its engine. Returns the variables those imports set in the
    environment (a rank importing them itself would have set them in its own)."""
    import importlib
    import re

    names = list(EVERY_RANK)
    if env.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        names += DEEPSPEED_RANK
    scripts = [path for path in argv if path.endswith(".py") and os.path.isfile(path)]
    for path in scripts:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        if re.search(r"^\s*(from|import) diffusers\b", text, re.MULTILINE):
            names += DIFFUSERS_RANK
        if re.search(r"^(from|import) diffusers\.training_utils\b", text, re.MULTILINE) or "--use_ema" in argv:
            names += EMA_RANK
    before = dict(os.environ)
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:
            pass  # the rank imports it, or fails to, as a fresh interpreter would
    _set_by_imports.update({k: v for k, v in os.environ.items() if before.get(k) != v})
    return dict(_set_by_imports)


_set_by_imports: dict = {}
"""Variables the launcher's preloads set in its environment, given to each rank where its environment lacks them
(DeepSpeed sets a default at import); kept over the launches of one launcher, which imports a module once."""


def _python_script(args: list[str]) -> list[str] | None:
    """``[script, *args]`` of ``python [-u] script.py ...``; None for any other command (``-m``, ``--no_python``)."""
    args = [str(a) for a in args]
    rest = args[1:][1:] if args[1:2] == ["-u"] else args[1:]
    if args[0] != sys.executable or not rest or rest[0].startswith("-"):
        return None
    return rest


def _fork(argv: list[str], env: dict, out_fd, err_fd, new_session: bool, unbuffered: bool) -> int:
    set_by_imports = _preload(argv, env)
    import gc

    gc.collect()  # nothing of the launcher's is left to be finalised in the child
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        become(argv, {**set_by_imports, **env}, out_fd, err_fd, new_session, unbuffered)
    return pid


def _patch_agent(handler_class) -> None:
    popen = handler_class._popen

    def fork_popen(self, args, env):
        argv = _python_script(args)
        if argv is None or args[1] != "-u":
            return popen(self, args, env)
        fds = [None if stream is None else stream.fileno() for stream in (self._stdout, self._stderr)]
        return ForkedRank(_fork(argv, env, *fds, new_session=True, unbuffered=True), list(args))

    handler_class._popen = fork_popen


def _patch_psutil(psutil) -> None:
    """Accelerate's 1-process launcher: ``psutil.Popen(cmd, env=..., stderr=PIPE)``, its stderr teed."""
    popen = psutil.Popen

    def fork_popen(cmd, env=None, stderr=None, **kwargs):
        argv = _python_script(cmd)
        if argv is None or kwargs or stderr != subprocess.PIPE:
            return popen(cmd, env=env, stderr=stderr, **kwargs)
        env = dict(os.environ if env is None else env)
        read, write = os.pipe()
        pid = _fork(argv, env, None, write, new_session=False, unbuffered=bool(env.get("PYTHONUNBUFFERED")))
        os.close(write)
        return ForkedProcess(pid, list(cmd), os.fdopen(read, "rb"))

    psutil.Popen = fork_popen


def become(argv: list[str], env: dict, out_fd, err_fd, new_session: bool, unbuffered: bool) -> None:
    """In the forked child: become ``python [-u] argv...`` (``argv``: a script and its arguments, or ``-m``, a
    module and its arguments) with this environment, then exit with its code."""
    code = 1
    try:
        import atexit
        import gc
        import importlib
        import io
        import logging
        import warnings

        gc.freeze()  # the launcher's objects stay as they are
        atexit._clear()  # the launcher's exit handlers are not the script's
        if new_session:
            os.setsid()  # start_new_session=True: the agent ends a rank with killpg
        for fd, target in ((out_fd, 1), (err_fd, 2)):
            if fd is not None:
                os.dup2(fd, target)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # Popen's close_fds: the launcher's store and pipes stay its own
        # as exec leaves them: an ignored signal stays ignored, a handled one is back to its default
        for sig in signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}:
            try:
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    signal.signal(sig, signal.SIG_DFL)
            except (OSError, ValueError):
                pass  # not settable here (the C library's real-time signals)
        # then what a fresh interpreter installs: SIGINT's handler unless it is ignored, SIGPIPE and SIGXFSZ ignored
        if signal.getsignal(signal.SIGINT) is signal.SIG_DFL:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        try:
            import faulthandler

            faulthandler.disable()
        except Exception:
            pass
        os.environ.clear()
        os.environ.update(env)
        # as a fresh `python script.py`: the script's folder, the rank's PYTHONPATH, then the installation's paths
        rank_pythonpath = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        installed = [p for p in sys.path[1:] if os.path.abspath(p) not in _launcher_pythonpath]
        module = argv[0] == "-m"  # `python -m`: the current folder first; a script: its own folder
        first = os.getcwd() if module else os.path.dirname(os.path.abspath(argv[0]))
        sys.path[:] = [first, *rank_pythonpath, *installed]
        importlib.invalidate_caches()
        sys.argv = list(argv[1:] if module else argv)  # runpy puts the module's file first
        sys.orig_argv = [sys.executable, *argv]  # Accelerate's launcher is told by it (_accelerate_launcher)

        def stream(fd: int, errors: str, line_buffering: bool):  # as the interpreter opens its standard streams
            raw = io.FileIO(fd, "w", closefd=False)
            if unbuffered:
                return io.TextIOWrapper(raw, encoding=sys.stdout.encoding, errors=errors, write_through=True)
            return io.TextIOWrapper(io.BufferedWriter(raw), encoding=sys.stdout.encoding, errors=errors,
                                    line_buffering=line_buffering)

        sys.stdout = stream(1, sys.stdout.errors, os.isatty(1))
        sys.stderr = stream(2, "backslashreplace", True)
        logging.root.handlers.clear()
        logging.root.setLevel(logging.WARNING)
        warnings._filters_mutated()  # warnings the launcher showed once are shown again
        sys.excepthook = sys.__excepthook__
        if "OMP_NUM_THREADS" in os.environ:
            import torch

            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        if module:
            install()  # a launcher's processes fork from it in turn
        code = run_as_main(argv[1] if module else argv[0], module=module)
    except BaseException:
        import traceback

        traceback.print_exc()  # the fork itself failed: said on the rank's stderr, exit 1
    finally:
        os._exit(code)


_launcher_pythonpath = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}


def run_as_main(script: str, module: bool = False) -> int:
    """Run ``script`` (a module's name where ``module``: ``python -m``) as ``__main__`` and end as the interpreter
    ends: the exit code of ``sys.exit``, an uncaught exception through ``sys.excepthook`` (torch.distributed's
    prefixes each line with the rank), then the exit handlers. Returns the exit code; the caller leaves with
    ``os._exit``, so nothing of its own runs at exit."""
    import atexit
    import runpy

    code, interrupted = 0, False
    try:
        if module:
            runpy.run_module(script, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException as exc:
        sys.excepthook(type(exc), exc, exc.__traceback__)
        code, interrupted = 1, isinstance(exc, KeyboardInterrupt)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if interrupted:  # as the interpreter: an uncaught KeyboardInterrupt ends the process by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code
