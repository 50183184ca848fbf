"""``sx.verify``: the distributed step against one device, leaf by leaf, with the likely cause.

``verify(step, state, batch)`` runs the step on its mesh and, for the reference, on the
mesh's first device (a one-device mesh with the same axis names and types, so a model's
own sharding annotations still apply) over the whole batch in one go, from the same
state, and compares what distribution can change:

- the loss and the aux metrics, the gradients (unscaled, before the optimizer) and the
  non-trainable model state, each against one device's, at a tolerance for the order of
  floating-point sums;
- the update: the distributed params and optimizer state against one device's and,
  where they differ, against the optimizer applied, on one device, to the *distributed*
  gradients (a leaf passes when it matches either). The optimizer's normalisation (Adam,
  Lion, Adafactor) may turn a gradient of rounding noise (a bias before BatchNorm, ~1e-9,
  its sign set by the order of the sums) into a step of ±lr; judged this way that noise is
  no difference, while a wrong update still is: the update must be one device's or the
  optimizer's, and the gradients it is applied to must be one device's. The second
  program is built only when the first comparison fails.

Each step starts both sides from the same state (the distributed one), so a difference
is the step's own. For a [`TrainStep`][shardax.train.TrainStep] (or a ``plan="auto"``
step) both sides run the step's program (its loss function, plan, mode and precision),
built without donation; the reference never accumulates: one device, the whole batch.
For your own step function (the keep-your-loop path), ``verify(train_step, (model,
optimizer), batch)`` runs it on copies of the state, placed as given and on the first
device; an ``nnx.Optimizer`` among them hands verify the gradients (its transformation
records them). Otherwise (an optax transformation closed over, as Equinox's examples and
plain ``jax.jit`` steps write it) verify cannot see the gradients: where an updated leaf
differs, the one-device step runs again on row-permuted copies of the batch (reversed,
rolled): the same examples in another order of the sums. A leaf within twice its own
largest spread over those runs is reduction noise the optimizer amplified, not a
distribution difference. The floor is used only when the reorderings leave what the step
returns unchanged (they are a symmetry of the step) and the batch's leaves share one
leading size. A wrong update is still caught: a leaf with a real gradient (a weight)
barely moves between reorderings, so a doubled update, unreduced gradients or per-device
statistics exceed its floor. The state passed in is never changed or donated.

The package, one concept a module: the comparison (``comparison``) and the report
(``report``); the reference on one device and its memory fit (``reference``); the
two paths as sides of one algorithm (``side``, ``train_step``, ``function``,
with ``user_state`` and ``recording`` for your own state and its
``nnx.Optimizer``); the noise floor (``noise``); the causes (``causes``, with
``per_device`` and ``rows``); the algorithm and the entry, [`verify`][shardax.verify]
(``algorithm``).
"""

from shardax.train.verification.algorithm import verify, verify_first_batch
from shardax.train.verification.causes import CAUSES, LADDER
from shardax.train.verification.comparison import TOLERANCES, LeafDiff, compare, tolerance
from shardax.train.verification.noise import NOISE_MARGIN
from shardax.train.verification.reference import _out_of_memory as _out_of_memory
from shardax.train.verification.reference import _too_big as _too_big
from shardax.train.verification.reference import one_device_mesh
from shardax.train.verification.report import SHOWN, VerifyReport
from shardax.train.verification.train_step import _Probe as _Probe

__all__ = [
    "CAUSES",
    "LADDER",
    "NOISE_MARGIN",
    "SHOWN",
    "TOLERANCES",
    "LeafDiff",
    "VerifyReport",
    "compare",
    "one_device_mesh",
    "tolerance",
    "verify",
    "verify_first_batch",
]
