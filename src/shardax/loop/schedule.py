"""One predicate decides every periodic action of the loop: is it time at this step?

The hooks of [`shardax.loop`][shardax.loop] (saves, evaluations, logs, the progress bar's
text) each ask [`itstime`][shardax.loop.itstime] with their own interval, the way
big_vision's ``itstime`` does: every ``every`` steps, and at the last step when the run
knows it.

>>> [s for s in range(1, 11) if itstime(s, 4, total=10)]
[4, 8, 10]
>>> itstime(3, None), itstime(5, 0, total=5)
(False, True)
"""

from __future__ import annotations

from shardax.checks import as_count, public


@public("sx.loop.itstime")
def itstime(step: int, every: int | None, total: int | None = None) -> bool:
    """True when ``step`` (steps done, from 1) is a multiple of ``every``, or is the last
    step ``total``. ``every`` None or 0 means never, but at the last step."""
    step = as_count("step", step, minimum=0)
    last = total is not None and step == total
    return last or (bool(every) and step > 0 and step % as_count("every", every) == 0)
