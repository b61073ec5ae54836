"""torch.profiler sessions inside the scheduler process (StartProfile / StopProfile).

Profiling is off unless the operator names a profile directory (``--profile-dir``, else
SGLang's ``SGLANG_TORCH_PROFILER_DIR``). A request's ``output_dir`` must lie inside it
(relative paths are taken from it; symlinks are resolved), and the directories made for
it are private (0700). Once a trace is written, only the newest ``profile_max_traces``
traces under the profile directory are kept. Filesystem errors go to the log; the client
gets a generic answer, so StartProfile tells nothing about paths outside the directory.

The scheduler loop calls :meth:`StepProfiler.on_step` after every engine step. A session
starts at once, or ``start_step`` steps later; it stops on StopProfile, by itself after
``num_steps`` profiled steps, or at the latest after ``MAX_PROFILE_STEPS`` (a fifth of
that with stacks, shapes or memory). Stopping writes a Chrome trace (``.json.gz``,
viewable in Perfetto or chrome://tracing) into the output directory. Every failure is an
(ok=False, message) answer, never an exception out of the scheduler loop.

Why two halves: ``profile.stop()`` builds the trace in C++ holding the GIL (heartbeats
stop too), so it runs on the loop; its cost, which grows with the profiled time and far
more with stacks, shapes and memory, is bounded by the step cap. Serialising and
compressing it (the longer part for a large trace, mostly without the GIL) runs in a
:class:`TraceWrite` thread while the loop keeps serving; StopProfile's reply waits for that
thread, not the loop.
"""

from __future__ import annotations

import gzip
import logging
import os
import shutil
import threading
import time

from kernels import envs, owned_cache

from .config import PROFILE_MAX_TRACES

logger = logging.getLogger("scheduler")

# A session stops by itself after this many steps: building its trace pauses the loop for
# a time that grows with the steps profiled (far more with stacks, shapes and memory).
MAX_PROFILE_STEPS = 1000  # SERVICER_PROFILE_MAX_STEPS overrides it (kernels/envs.py)
DETAIL_COST = 5  # stacks, shapes or memory: a fifth of the steps

TRACE_PREFIX, TRACE_SUFFIX = "servicer-", ".trace.json.gz"

PROFILING_OFF = (
    "profiling is off: start the daemon with --profile-dir DIR (or SGLANG_TORCH_PROFILER_DIR=DIR) to allow it"
)
OUTSIDE = "output_dir must be inside the profile directory"


def _inside(path: str, base: str) -> bool:
    return path == base or path.startswith(base.rstrip(os.sep) + os.sep)


def resolve_output_dir(profile_dir: str, output_dir: str | None) -> str | None:
    """The real path a request's ``output_dir`` names, or None unless it is inside ``profile_dir``.

    The path is first checked as written (``..`` folded), so the answer never depends on
    what exists outside the directory; then resolved, which catches symlinks inside it
    that point out."""
    base = os.path.abspath(profile_dir)
    real_base = os.path.realpath(base)
    if not output_dir:
        return real_base
    if "\x00" in output_dir:
        return None
    candidate = os.path.normpath(os.path.join(base, output_dir))
    if not (_inside(candidate, base) or _inside(candidate, real_base)):
        return None
    real = os.path.realpath(candidate)
    return real if _inside(real, real_base) else None


def make_private_dirs(base: str, path: str) -> None:
    """Create ``base`` and the directories of ``path`` below it, each mode 0700, and check
    each (new or found) is ours alone, below parents nobody else may change: a directory
    another user owns or may write could be swapped for a link before the trace is written."""
    current = owned_cache.owned_dir(base)
    for part in os.path.relpath(path, base).split(os.sep):
        if part not in ("", os.curdir):
            current = owned_cache.owned_dir(os.path.join(current, part))
    if os.path.realpath(path) != path:  # a symlink put there meanwhile
        raise NotADirectoryError(path)


def prune_traces(profile_dir: str, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` of our traces under ``profile_dir``; the paths deleted."""
    traces = []
    for root, _, files in os.walk(profile_dir):  # (symlinked directories are not followed)
        for name in files:  # (a write's scratch files have other names)
            if name.startswith(TRACE_PREFIX) and name.endswith(TRACE_SUFFIX):
                path = os.path.join(root, name)
                try:
                    traces.append((os.lstat(path).st_mtime_ns, name, path))
                except OSError:
                    continue
    traces.sort(reverse=True)
    removed = []
    for _, _, path in traces[keep:]:
        try:
            os.unlink(path)
            removed.append(path)
        except OSError as e:
            logger.warning("cannot delete the old trace %s: %s", path, e)
    return removed


# Activity names as the router / SGLang send them -> what we record.
_CPU = {"CPU"}
_CUDA = {"GPU", "CUDA"}
_MEM = {"MEM", "MEMORY"}


class TraceWrite:
    """A stopped session's trace, serialised and gzipped by a background thread.

    The thread lowers its own CPU priority so the step loop keeps the cores. It writes in
    a hidden scratch directory beside the trace and renames the finished file into place:
    the output directory never shows half a trace, and :meth:`discard` removes whatever a
    write cut short (at shutdown) left. ``waiters`` are the StopProfile calls to answer
    with ``result``, which is set last, once the scratch directory is gone and ``prune`` (if
    given) has deleted the traces beyond the cap.
    """

    def __init__(self, prof, path: str, summary: str, prune=None):
        self.path = path
        self._prune = prune
        self.summary = summary  # e.g. "profile stopped after 12 step(s)"
        self.waiters: list[int] = []  # call ids of the StopProfile calls waiting for it
        self.result: tuple[bool, str] | None = None
        stem = os.path.basename(path).split(".", 1)[0]  # (no ".json" in it: globs of traces skip it)
        self._scratch = os.path.join(os.path.dirname(path), f".{stem}.partial")
        self._thread = threading.Thread(target=self._write, args=(prof,), name="profile-trace-writer", daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return self.result is not None

    def wait(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return self.done()

    def discard(self) -> None:
        """Remove the scratch files of a write that will not finish (the process is exiting)."""
        shutil.rmtree(self._scratch, ignore_errors=True)

    def _write(self, prof) -> None:
        try:  # Linux: a thread id is a process id to setpriority; best effort elsewhere
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (AttributeError, OSError):
            pass
        try:
            os.mkdir(self._scratch, 0o700)
            raw, part = os.path.join(self._scratch, "trace.json"), os.path.join(self._scratch, "trace.json.gz")
            # Plain JSON (kineto's save, which holds the GIL, is quick), then gzip in 1 MiB
            # chunks at level 1: torch's own .gz export compresses line by line at level 9,
            # holding the GIL most of the time (tens of seconds for a profile with stacks).
            prof.export_chrome_trace(raw)
            with open(raw, "rb") as src, gzip.open(part, "wb", compresslevel=1) as dst:
                shutil.copyfileobj(src, dst, 1 << 20)  # zlib drops the GIL for each chunk
            os.chmod(part, 0o600)
            os.replace(part, self.path)
            result = (True, f"{self.summary}; trace written to {self.path}")
        except Exception:
            logger.exception("cannot write the profiler trace %s", self.path)
            result = (False, f"{self.summary}, but writing the trace failed (the daemon log says why)")
        self.discard()
        if result[0] and self._prune is not None:
            try:
                self._prune()
            except Exception:
                logger.exception("cannot prune the old profiler traces")
        self.result = result


class StepProfiler:
    def __init__(self, device: str = "cpu", profile_dir: str | None = None, max_traces: int = PROFILE_MAX_TRACES):
        """``profile_dir``: where StartProfile may write; None: profiling is off."""
        self.device = str(device)
        self.profile_dir = os.path.abspath(profile_dir) if profile_dir else None
        self.max_traces = max_traces
        self.profiler = None  # the running torch.profiler.profile
        self.pending: dict | None = None  # a session waiting for its start step
        self.countdown = 0  # steps left before a pending session starts
        self.steps_left = 0  # profiled steps left before an automatic stop
        self.output_dir = self.profile_dir
        self.steps = 0  # steps profiled in the current session
        self.writing: TraceWrite | None = None  # the last stopped session's trace
        self.last_trace: str | None = None

    @property
    def active(self) -> bool:
        return self.profiler is not None or self.pending is not None

    # -- control calls ------------------------------------------------------------------
    def start(
        self,
        output_dir: str | None = None,
        start_step: int | None = None,
        num_steps: int | None = None,
        activities: list[str] | None = None,
        with_stack: bool | None = None,
        record_shapes: bool | None = None,
        **_ignored,
    ) -> tuple[bool, str]:
        if self.profile_dir is None:
            return False, PROFILING_OFF
        if self.active:
            state = "waiting for its start step" if self.pending is not None else "running"
            return False, f"a profile is already {state}; stop it first (StopProfile)"
        if self.writing is not None:  # (the loop collects a finished one before each control call)
            return (
                False,
                f"the last profile's trace is still being written to {self.writing.path}; try again when it is",
            )
        if start_step is not None and start_step < 0:
            return False, f"start_step must be >= 0, got {start_step}"
        names = [a.strip().upper() for a in (activities or []) if a.strip()]
        unknown = [a for a in names if a not in _CPU | _CUDA | _MEM]
        if unknown:
            return False, f"unknown profiler activities {unknown}; use CPU, GPU (or CUDA), MEM"
        detailed = bool(with_stack or record_shapes or _MEM & set(names))
        cap = envs.profile_max_steps(MAX_PROFILE_STEPS)
        max_steps = max(cap // DETAIL_COST, 1) if detailed else cap
        if num_steps is not None and not 0 < num_steps <= max_steps:
            return False, (
                f"num_steps must be in [1, {max_steps}], got {num_steps}: building a trace pauses the scheduler, "
                "longer for longer profiles"
                + (" with stacks, shapes or memory" if detailed else "")
                + " (SERVICER_PROFILE_MAX_STEPS raises the cap)"
            )
        requested = output_dir
        output_dir = resolve_output_dir(self.profile_dir, requested)
        if output_dir is None:
            logger.warning("StartProfile refused: output_dir %r is outside %s", requested, self.profile_dir)
            return False, OUTSIDE
        try:
            make_private_dirs(os.path.realpath(self.profile_dir), output_dir)
            if not os.access(output_dir, os.W_OK):
                raise PermissionError(f"{output_dir} is not writable")
        except OSError as e:
            logger.error("StartProfile refused: cannot use the output directory %s: %s", output_dir, e)
            return False, f"cannot write traces to {output_dir} (the daemon log says why)"

        on_cuda = self.device.startswith("cuda")
        want_cuda = (not names or bool(_CUDA & set(names))) and on_cuda
        notes = []
        if _CUDA & set(names) and not on_cuda:
            notes.append(f"GPU activity ignored (device is {self.device})")
        self.output_dir = output_dir
        self.steps_left = num_steps or max_steps
        self.steps = 0
        config = {
            "cuda": want_cuda,
            "memory": bool(_MEM & set(names)),
            "with_stack": bool(with_stack),
            "record_shapes": bool(record_shapes),
        }
        what = "CPU" + ("+CUDA" if want_cuda else "") + ("+memory" if config["memory"] else "")
        if start_step:
            self.pending = config
            self.countdown = start_step
            when = f"in {start_step} step(s)"
        else:
            try:
                self._begin(config)
            except Exception:
                logger.exception("cannot start the profiler")
                return False, "cannot start the profiler (the daemon log says why)"
            when = "now"
        length = f"for {num_steps} step(s)" if num_steps else f"until StopProfile (at most {max_steps} steps)"
        msg = f"profiling {what} {when}, {length}; traces go to {output_dir}"
        if notes:
            msg += " (" + "; ".join(notes) + ")"
        logger.info(msg)
        return True, msg

    def stop(self) -> tuple[bool, str] | TraceWrite:
        """An answer now, or the trace being written (this session's, or the last one's if it
        stopped by itself): answer when ``done()``."""
        if self.profile_dir is None:
            return False, PROFILING_OFF
        if self.pending is not None:
            self.pending = None
            return True, "the pending profile was cancelled before its start step; no trace written"
        if self.profiler is None and self.writing is not None:
            return self.writing  # it stopped by itself: answer with its trace once written
        if self.profiler is None:
            msg = "no profile is running (StartProfile first)"
            if self.last_trace:
                msg += f"; the last trace was written to {self.last_trace}"
            return False, msg
        return self._finish("stopped")

    # -- scheduler loop hook ------------------------------------------------------------
    def on_step(self) -> None:
        """After every engine step: start a pending session, count steps, auto-stop."""
        if self.pending is not None:
            self.countdown -= 1
            if self.countdown <= 0:
                config, self.pending = self.pending, None
                try:
                    self._begin(config)
                except Exception:
                    logger.exception("cannot start the scheduled profiler")
            return
        if self.profiler is None:
            return
        try:
            self.profiler.step()
        except Exception:  # a marker failing must never stop the scheduler
            logger.debug("profiler.step() failed", exc_info=True)
        self.steps += 1
        self.steps_left -= 1
        if self.steps_left <= 0:
            result = self._finish("stopped by itself")
            if isinstance(result, tuple):
                logger.error(result[1])
            # else: take_finished_write() logs it once written

    def take_finished_write(self) -> TraceWrite | None:
        """The last session's trace once written (logged here), else None; once each."""
        write = self.writing
        if write is None or not write.done():
            return None
        self.writing = None
        ok, message = write.result
        if ok:
            self.last_trace = write.path
        (logger.info if ok else logger.error)(message)
        return write

    # -- internals ------------------------------------------------------------------------
    def _prune(self) -> None:
        removed = prune_traces(self.profile_dir, self.max_traces)
        if removed:
            logger.info("deleted %d old trace(s) beyond the newest %d", len(removed), self.max_traces)

    def _begin(self, config: dict) -> None:
        import torch.profiler as tp

        activities = [tp.ProfilerActivity.CPU]
        if config["cuda"]:
            activities.append(tp.ProfilerActivity.CUDA)
        prof = tp.profile(
            activities=activities,
            record_shapes=config["record_shapes"],
            with_stack=config["with_stack"],
            profile_memory=config["memory"],
        )
        prof.start()
        self.profiler = prof
        self.steps = 0

    def _finish(self, how: str) -> tuple[bool, str] | TraceWrite:
        prof, self.profiler = self.profiler, None
        self.steps_left = 0
        summary = f"profile {how} after {self.steps} step(s)"
        stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{time.time_ns() % 10**6}"
        name = f"{TRACE_PREFIX}{stamp}{TRACE_SUFFIX}"
        try:
            started = time.monotonic()
            prof.stop()  # builds the trace, holding the GIL: the one part the loop must wait for
            logger.info("%s; trace built in %.1f s, writing it in the background", summary, time.monotonic() - started)
        except Exception:
            logger.exception("cannot stop the profiler")
            return False, f"{summary}, but building the trace failed (the daemon log says why)"
        self.writing = TraceWrite(prof, os.path.join(self.output_dir, name), summary, self._prune)
        return self.writing
