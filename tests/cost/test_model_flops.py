"""Model FLOPs by the common convention (cost/model_flops.py) and the MFU sx.estimate
predicts from them: never above what the compiled step executes allows."""

import jax
import jax.numpy as jnp
import pytest

from shardax.cost.estimation import analyse
from shardax.cost.model_flops import CONVENTION, batch_unit, default_model_flops, matmul_params


def test_batch_units():
    ids = jax.ShapeDtypeStruct((8, 128), jnp.int32)
    images = jax.ShapeDtypeStruct((8, 32, 32, 3), jnp.float32)
    rows = jax.ShapeDtypeStruct((8, 64), jnp.float32)
    assert batch_unit({"inputs": ids, "targets": ids}) == "tokens"
    assert batch_unit({"image": images, "label": jax.ShapeDtypeStruct((8,), jnp.int32)}) == "images"
    assert batch_unit((rows, jax.ShapeDtypeStruct((8,), jnp.int32))) == "rows"


def test_lookup_tables_are_left_out_unless_tied():
    untied = [("['embed']['embedding']", (1000, 64)), ("['pos']['embedding']", (128, 64)),
              ("['blocks']['mlp']", (2, 64, 256)), ("['head']", (64, 1000))]  # fmt: skip
    n, lookups = matmul_params(untied)
    assert n == 2 * 64 * 256 + 64 * 1000
    assert lookups == {"['embed']['embedding']": 64000, "['pos']['embedding']": 8192}
    tied = [p for p in untied if p[0] != "['head']"]
    assert matmul_params(tied) == (2 * 64 * 256 + 64 * 1000, {"['pos']['embedding']": 8192})


def test_images_get_no_6n_default():
    """6·N·images is ~150× too low for a CNN: the compiled count stands in, labelled."""
    images = {"image": jax.ShapeDtypeStruct((8, 224, 224, 3), jnp.float32)}
    flops, label, statement = default_model_flops([("w", (3, 3, 64, 64))], images, 8, "images",
                                                  7.6e11)  # fmt: skip
    assert flops == 7.6e11 and label.startswith("unknown for images")
    assert "pass model_flops=" in statement


@pytest.mark.compile_only("gpu")
def test_gpt_mfu_stays_within_what_the_compiled_step_executes(abstract_gpt_step):
    """Issue 41: a GPT with a large vocabulary (scaled down from 4 × 1024, 32k vocabulary,
    4k tokens per device) with fsdp on 8×H100. 6·N·tokens over every parameter counted
    the embedding table as matmul work, above the compiled step's FLOPs, and predicted an
    MFU above the 60% of peak compute is assumed at (79% at full size)."""
    from shardax.models import gpt

    cfg = gpt.GPTConfig(1, 128, 4, 256, vocab=4096, scan_layers=True)
    mesh, model, state, step = abstract_gpt_step("8xH100", cfg, data=8)
    tok = jax.ShapeDtypeStruct((8, 256), jnp.int32)  # 256 tokens per device
    batch = {"inputs": tok, "targets": tok}
    abstract = step.abstract(state)  # one compile, analysed with and without model_flops
    compiled = step.lower(abstract, batch).compile()
    shardings = compiled.input_shardings[0][0]

    def analysed(**kwargs):
        return analyse(compiled, mesh, state=abstract, shardings=shardings, batch=batch,
                       **kwargs)  # fmt: skip

    report = analysed()
    n = gpt.param_count(model, embeddings=False)
    assert report.model_flops == 6 * n * 8 * 256 and report.unit == "tokens"
    assert report.model_flops / 8 <= report.flops_hlo  # the LM head in, the lookup out
    assert report.roofline.mfu() <= 0.6
    assert any(CONVENTION in note for note in report.notes)
    assert any("without the embedding lookup" in note for note in report.notes)
    # The old default, given: above the executed FLOPs; MFU counts only those.
    everything = 6 * gpt.param_count(model) * 8 * 256
    assert everything / 8 > report.flops_hlo
    given = analysed(model_flops=everything)
    assert given.roofline.model_flops == 8 * report.flops_hlo
    assert given.roofline.mfu() <= 0.6
    assert any("MFU counts the executed" in note for note in given.notes)
