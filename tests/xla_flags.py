"""The XLA flags the suite compiles with (set by ``tests/conftest.py`` before JAX starts).

- XLA:CPU's backend (LLVM) optimizes at level 0: the same HLO programs, shardings,
  collectives and buffer assignments, compiled in about half the time and run more
  slowly. The tests check what is computed and where it is placed, never how fast;
  ``benchmarks/`` keep the default level.
- On jaxlib 0.10 (CI leg 1), XLA:CPU can still emit fusions with its older elemental
  emitters, which compile the suite's small programs in about 60% of the fusion emitters'
  CPU time (the same HLO, fusions, shardings and collectives); later jaxlibs no longer
  have the switch. A test whose subject is the fusion emitters' own code (an
  out-of-memory error, rounding noise) runs without it: ``LEGACY_EMITTERS`` is what to
  drop, or skip on.
"""

import importlib.metadata

LEGACY_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
TEST_XLA_FLAGS = ["--xla_backend_optimization_level=0"]
if tuple(int(x) for x in importlib.metadata.version("jaxlib").split(".")[:2]) < (0, 11):
    TEST_XLA_FLAGS.append(LEGACY_EMITTERS)
