"""The `migrator` / `MigratableVariable` API of pytorchjob-migration, kept name for name.

A script written for that project switches by changing one import:

    from criuctl.migration import migrator, MigratableVariable

Its protocol is kept: a signal file (`MIGRATION_SIGNAL_PATH`, default ./ckpts/signal) goes
init -> save -> resume -> init beside the checkpoint (`MIGRATION_CKPT_PATH`, default
./ckpts/migration.pth) on a volume that outlives the pod; a preStop command (`criuctl prestop`)
writes `save` and waits for `resume`; the next run sees `resume`, loads, and writes `init`.

What that design lacked, and criuctl does instead:
- it saved from a thread in the middle of a step; here the save waits for a step boundary
  (`criuctl_hook.boundary`): the first training forward after an optimizer step at which the
  registered dicts (the script's own record of where it stands) have moved on, so the weights,
  the optimizer, the scheduler, the RNG and the recorded position all describe one instant;
- it wrote the file in place (a pod killed mid-write left half a checkpoint); here it is written
  to a temporary name and renamed, and the signal too;
- nothing checked what was loaded; here the file's SHA-256 is signed with HMAC-SHA256 (key:
  `MIGRATION_KEY_PATH`, default a 0600 file beside the checkpoint; mount a Secret there to make
  the signature mean "written by this job") and `load_ckpt` refuses a file that does not match;
- it did not carry the RNG; here python, numpy, torch and CUDA RNG states travel too, so a
  resumed run draws the same shuffle and the same dropout masks as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import threading
import time
import warnings
from pathlib import Path
from typing import Any

from criuctl.core import env, migsignal
from criuctl.core.errors import CriuctlError
from criuctl.core.migsignal import INIT, RESUME, SAVE
from criuctl_hook import durable


class MigrationCheckpointError(CriuctlError):
    """The migration checkpoint is missing, altered, or signed with another key."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


class Migrator:
    """One per process (`migrator`): what to carry, and the signal that says when."""

    def __init__(self) -> None:
        self.ckpt_path = env.MIGRATION_CKPT_PATH.get()
        self.signal_path = migsignal.default_path()
        self.key_path = env.MIGRATION_KEY_PATH.get() or self.ckpt_path.parent / ".migration.key"
        self.ckpt_path.parent.mkdir(parents=True, exist_ok=True)
        self.signal_path.parent.mkdir(parents=True, exist_ok=True)
        if not self.signal_path.exists():
            self.write_signal(INIT)  # only the first run of the job starts the protocol
        self.migrations: dict[str, Any] = {}
        self._listener: threading.Thread | None = None
        self._saving = threading.Event()
        self._from_criuctl = self._criuctl_state()  # a state bundle criuctl restarts us from

    def _criuctl_state(self) -> Path | None:
        """The state file of this rank in the bundle criuctl restarted the job from, if it is ours."""
        directory = env.RESUME_STATE.get()
        if not directory:
            return None
        from criuctl_hook import contract, resume
        from criuctl_hook.boundary import rank

        if resume.index(directory).get("kind") != "migrator":
            return None
        return Path(directory) / contract.STATE_FILE.format(rank=rank())

    # -- the signal --------------------------------------------------------------------------
    @property
    def signal(self) -> str:
        return self.read_signal()

    @property
    def resume(self) -> bool:
        """True when the previous run of this job saved a migration checkpoint for this one."""
        return self._from_criuctl is not None or self.signal == RESUME

    def write_signal(self, signal: str) -> None:
        migsignal.write(self.signal_path, signal)

    def read_signal(self) -> str:
        return migsignal.read(self.signal_path)

    # -- what travels ------------------------------------------------------------------------
    def register(self, key: str, val: Any) -> Any:
        """Carry `val`: an object with state_dict/load_state_dict, or a dict updated in place."""
        if not (hasattr(val, "state_dict") and hasattr(val, "load_state_dict")) and not isinstance(val, dict):
            warnings.warn(
                f"migrator: {key!r} is a {type(val).__name__}; only objects with state_dict and dicts "
                "are restored in place (keep ints and floats in a dict)",
                stacklevel=2,
            )
        self.migrations[key] = val
        b = self._boundary()
        if b is not None:
            if isinstance(val, dict) and not any(d is val for d in b.positions):
                b.positions.append(val)  # the script's record of where it stands
            b.saver = self._save_for_criuctl  # `criuctl dump --state` saves what is registered
        return val

    def _boundary(self) -> Any:
        import sys

        if "torch" not in sys.modules:
            return None
        from criuctl_hook import boundary

        b = boundary.installed_with_torch()
        b.track_epochs()
        return b

    # -- saving ------------------------------------------------------------------------------
    def listening(self, interval: float = 1) -> None:
        """Watch the signal; on `save`, save at the next step boundary and answer `resume`."""
        if self._listener is not None:
            return
        self._boundary()  # the step hooks are in place before the first step
        self._listener = threading.Thread(target=self._listen, args=(interval,), daemon=True, name="migrator")
        self._listener.start()

    def _listen(self, interval: float) -> None:
        while True:
            if self.signal == SAVE and not self._saving.is_set():
                self._saving.set()
                b = self._boundary()
                if b is None:  # no torch: nothing steps, save now
                    self.save_ckpt()
                else:
                    from criuctl_hook.boundary import Capture

                    b.request_capture(Capture(lambda bd: self._save_at(bd)))
            time.sleep(interval)

    def _save_at(self, b: Any) -> None:
        self.save_ckpt(epoch_rng=b.epoch_rng, step=b.steps)

    def _saved(self, epoch_rng: dict | None, step: int | None) -> Any:
        """What is registered, now, with the RNG: a `criuctl_hook.state.Saved`."""
        from criuctl_hook import state

        objects = {k: (v.state_dict() if hasattr(v, "state_dict") else v) for k, v in self.migrations.items()}
        return state.Saved(step, objects, state.rng_state(), {"epoch_rng": epoch_rng})

    def _save_for_criuctl(self, b: Any, req: dict) -> None:
        """`criuctl dump --state`: the registered objects into criuctl's bundle; criuctl signs it."""
        objects = [
            {"key": k, "kind": "registered", "class": type(v).__name__} for k, v in self.migrations.items()
        ]
        b.save_and_hold(req, self._saved(b.epoch_rng, b.steps), "migrator", objects)

    def save_ckpt(self, epoch_rng: dict | None = None, step: int | None = None) -> None:
        """Save every registered object now (whole or not at all), sign it, and answer `resume`."""
        from criuctl_hook import state

        state.write(self._saved(epoch_rng, step), str(self.ckpt_path))
        self._sign()
        self.write_signal(RESUME)
        print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} criuctl migrator: saved {self.ckpt_path}", flush=True)
        self._saving.clear()

    # -- signature ---------------------------------------------------------------------------
    def _key(self) -> bytes:
        try:
            return self.key_path.read_bytes()
        except FileNotFoundError:
            key = secrets.token_bytes(32)
            durable.create(self.key_path, key, 0o600)
            return self.key_path.read_bytes()

    def _sig_path(self) -> Path:
        return self.ckpt_path.with_name(self.ckpt_path.name + ".sig")

    def _sign(self) -> None:
        body = {"file": self.ckpt_path.name, "sha256": _sha256(self.ckpt_path), "created": time.time()}
        raw = json.dumps(body, sort_keys=True)
        mac = hmac.new(self._key(), raw.encode(), hashlib.sha256).hexdigest()
        durable.replace(self._sig_path(), json.dumps({"body": raw, "hmac": mac}).encode(), 0o644)

    def verify(self) -> None:
        """Refuse a checkpoint that is missing, altered, or signed with another key."""
        fix = "delete it and the signal file to start the job over, or restore the right key"
        try:
            sig = json.loads(self._sig_path().read_text())
            body = json.loads(sig["body"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise MigrationCheckpointError(
                f"{self.ckpt_path} has no readable signature ({exc})", fix
            ) from exc
        try:
            key = self.key_path.read_bytes()
        except OSError as exc:
            raise MigrationCheckpointError(
                f"no key at {self.key_path} to check {self.ckpt_path}", fix
            ) from exc
        mac = hmac.new(key, sig["body"].encode(), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(mac, str(sig.get("hmac"))):
            raise MigrationCheckpointError(
                f"{self.ckpt_path}'s signature does not match the key {self.key_path}", fix
            )
        if not self.ckpt_path.exists() or _sha256(self.ckpt_path) != body.get("sha256"):
            raise MigrationCheckpointError(
                f"{self.ckpt_path} is missing or was altered since it was saved", fix
            )

    # -- loading -----------------------------------------------------------------------------
    def load_ckpt(self, map_location: Any = "cpu") -> None:
        """Load every registered object (register them all first) and reset the signal to `init`."""
        import torch

        from criuctl_hook import state

        if self._from_criuctl is not None:  # criuctl verified the whole bundle before the restart
            path, self._from_criuctl = self._from_criuctl, None
        else:
            self.verify()
            path = self.ckpt_path
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
        for k, v in self.migrations.items():
            if k not in ckpt["objects"]:
                warnings.warn(f"migrator: {k!r} is not in {self.ckpt_path}; it starts afresh", stacklevel=2)
            elif hasattr(v, "load_state_dict"):
                v.load_state_dict(ckpt["objects"][k])
            elif isinstance(v, dict):
                v.update(ckpt["objects"][k])
            else:
                warnings.warn(
                    f"migrator: {k!r} ({type(v).__name__}) cannot be restored in place", stacklevel=2
                )
        # The RNG as it was where the saved epoch's iterator was made, so the script's own
        # iterator draws the same; at its first training forward, as it was at the save.
        state.set_rng_state(ckpt["epoch_rng"] or ckpt["rng"])
        b = self._boundary()
        if b is not None:
            b.at_first_forward(lambda: state.set_rng_state(ckpt["rng"]))
            if ckpt.get("step") is not None:
                b.steps = int(ckpt["step"])
        self.write_signal(INIT)


migrator = Migrator()


_unnamed = 0


def MigratableVariable(obj: Any, key: str | None = None) -> Any:
    """Register `obj` with the migrator and return it, unchanged; usable from any module."""
    global _unnamed
    if key is None:
        _unnamed += 1
        key = f"var{_unnamed}"
    return migrator.register(key, obj)
