"""TESTING AID, not for production: make a fraction of the model's forwards fail with
``torch.OutOfMemoryError``, where a real out-of-memory error arises (a forward pre-hook on the model).

Used by ``benchmarks/soak.py`` through the hidden ``dice-fast serve --testing-inject-oom FRACTION`` flag,
so the soak can count what injected faults cost (with split-and-retry in the core, nothing but a retry).
"""

from __future__ import annotations

import logging
import random
import threading

log = logging.getLogger("dice_fast.serve")


def inject_oom(model, fraction: float, seed: int = 0):
    """Register a forward pre-hook on ``model`` that raises ``torch.OutOfMemoryError`` on about
    ``fraction`` (0..1] of its forwards (seeded, so a run is repeatable); returns the hook's handle."""
    import torch

    if not 0 < fraction <= 1:
        raise ValueError(f"the injected fault fraction must be in (0, 1], got {fraction}")
    rng, lock = random.Random(seed), threading.Lock()
    injected = [0]

    def hook(module, args):
        with lock:
            fail = rng.random() < fraction
            if fail:
                injected[0] += 1
                n = injected[0]
        if fail:
            log.warning("dice_fast testing: injected torch.OutOfMemoryError #%d into a forward", n)
            raise torch.OutOfMemoryError(f"dice_fast testing: injected out-of-memory error #{n}")

    log.warning("dice_fast testing: about %.1f %% of forwards will fail with an injected out-of-memory error",
                100 * fraction)
    return model.register_forward_pre_hook(hook)
