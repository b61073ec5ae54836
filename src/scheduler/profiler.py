"""torch.profiler sessions inside the scheduler process (StartProfile / StopProfile).

The scheduler loop calls :meth:`StepProfiler.on_step` after every engine step. A session
starts at once, or ``start_step`` steps later; it stops on StopProfile, or by itself after
``num_steps`` profiled steps. Stopping writes a Chrome trace (``.json.gz``, viewable in
Perfetto or chrome://tracing) into the output directory. Every failure is an (ok=False,
message) answer, never an exception out of the scheduler loop.
"""

from __future__ import annotations

import logging
import os
import time

logger = logging.getLogger("scheduler")

DEFAULT_OUTPUT_DIR = os.environ.get("SERVICER_PROFILE_DIR", "/tmp/servicer-profiles")

# Activity names as the router / SGLang send them -> what we record.
_CPU = {"CPU"}
_CUDA = {"GPU", "CUDA"}
_MEM = {"MEM", "MEMORY"}


class StepProfiler:
    def __init__(self, device: str = "cpu"):
        self.device = str(device)
        self.profiler = None  # the running torch.profiler.profile
        self.pending: dict | None = None  # a session waiting for its start step
        self.countdown = 0  # steps left before a pending session starts
        self.steps_left: int | None = None  # profiled steps left before an automatic stop
        self.output_dir = DEFAULT_OUTPUT_DIR
        self.steps = 0  # steps profiled in the current session
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
        if self.active:
            state = "waiting for its start step" if self.pending is not None else "running"
            return False, f"a profile is already {state}; stop it first (StopProfile)"
        if start_step is not None and start_step < 0:
            return False, f"start_step must be >= 0, got {start_step}"
        if num_steps is not None and num_steps <= 0:
            return False, f"num_steps must be > 0, got {num_steps}"
        names = [a.strip().upper() for a in (activities or []) if a.strip()]
        unknown = [a for a in names if a not in _CPU | _CUDA | _MEM]
        if unknown:
            return False, f"unknown profiler activities {unknown}; use CPU, GPU (or CUDA), MEM"
        output_dir = output_dir or DEFAULT_OUTPUT_DIR
        try:
            os.makedirs(output_dir, exist_ok=True)
        except (OSError, ValueError) as e:  # ValueError: a NUL in the path
            return False, f"cannot create output_dir {output_dir!r}: {e}"
        if not os.access(output_dir, os.W_OK):
            return False, f"output_dir {output_dir!r} is not writable"

        on_cuda = self.device.startswith("cuda")
        want_cuda = (not names or bool(_CUDA & set(names))) and on_cuda
        notes = []
        if _CUDA & set(names) and not on_cuda:
            notes.append(f"GPU activity ignored (device is {self.device})")
        self.output_dir = output_dir
        self.steps_left = num_steps
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
            except Exception as e:
                logger.exception("cannot start the profiler")
                return False, f"cannot start the profiler: {type(e).__name__}: {e}"
            when = "now"
        length = f"for {num_steps} step(s)" if num_steps else "until StopProfile"
        msg = f"profiling {what} {when}, {length}; traces go to {output_dir}"
        if notes:
            msg += " (" + "; ".join(notes) + ")"
        logger.info(msg)
        return True, msg

    def stop(self) -> tuple[bool, str]:
        if self.pending is not None:
            self.pending = None
            return True, "the pending profile was cancelled before its start step; no trace written"
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
        if self.steps_left is not None:
            self.steps_left -= 1
            if self.steps_left <= 0:
                ok, msg = self._finish(f"stopped after {self.steps} step(s)")
                (logger.info if ok else logger.error)(msg)

    # -- internals ------------------------------------------------------------------------
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

    def _finish(self, how: str) -> tuple[bool, str]:
        prof, self.profiler = self.profiler, None
        self.steps_left = None
        name = f"servicer-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{time.time_ns() % 10**6}.trace.json.gz"
        path = os.path.join(self.output_dir, name)
        try:
            prof.stop()
            prof.export_chrome_trace(path)
        except Exception as e:
            logger.exception("cannot write the profiler trace")
            return False, f"profile {how}, but writing the trace failed: {type(e).__name__}: {e}"
        self.last_trace = path
        return True, f"profile {how} ({self.steps} step(s)); trace written to {path}"
