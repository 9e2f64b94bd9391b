"""benchmarks/sim_published.py's fitted term for llm-foundry's sweep: it applies to that sweep's
rows only, it is what its documented procedure computes from the sweep's A100 rows, and no
held-out row enters that procedure."""

import importlib.util
import io
import math
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "sim_published.py"


@pytest.fixture(scope="module")
def sp():
    spec = importlib.util.spec_from_file_location("sim_published_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


def test_term_applies_to_the_sweeps_rows_only(sp):
    base = sp.hardware("A100_SXM").kernels
    for source in (sp.FOUNDRY, sp.FOUNDRY_SWEEP):
        k = sp.hardware("A100_SXM", source=source).kernels
        assert k.attention_efficiency == pytest.approx(base.attention_efficiency * sp.SWEEP_ATTENTION, rel=1e-12)
        assert (k.matmul_efficiency, k.memory_efficiency, k.sustained) == (
            base.matmul_efficiency,
            base.memory_efficiency,
            base.sustained,
        )
        off = sp.hardware("A100_SXM", source=source, sweep_term=False).kernels
        assert off.attention_efficiency == base.attention_efficiency
    for source in (sp.TT_A100, sp.TT_H100):
        assert sp.hardware("A100_SXM", source=source).kernels == base


def test_fit_reads_the_sweeps_a100_rows_and_no_held_out_row(sp):
    assert sp.SWEEP_A100 and all(r.source == sp.FOUNDRY_SWEEP and r.hardware == "A100_SXM" for r in sp.SWEEP_A100)
    assert all(r.source == sp.FOUNDRY and r.hardware == "H100_SXM" for r in sp.HELD_OUT)
    assert not {id(r) for r in sp.SWEEP_A100} & {id(r) for r in sp.HELD_OUT}


def test_constant_is_what_the_procedure_gives(sp):
    # The constant is printed to 3 decimals by the procedure and copied into the script: a stale
    # constant (the kernel model changed, the fit was not re-run) fails here.
    with redirect_stdout(io.StringIO()) as out:
        fitted = sp.fit_sweep(sp.SWEEP_A100)
    assert not math.isnan(fitted), out.getvalue()
    assert abs(fitted - sp.SWEEP_ATTENTION) <= 0.0005 + 1e-12, out.getvalue()[-400:]


def test_the_sweeps_a100_rows_run_llm_foundrys_code(sp):
    # Same configuration, same code on both parts: the same loss (llm-foundry's fused
    # cross-entropy, not torchtitan's float32 one), so the same predicted memory.
    a100 = next(r for r in sp.SWEEP_A100 if (r.model, r.seq, r.micro_batch, r.accum) == ("mpt-760m", 512, 96, 2))
    h100 = next(r for r in sp.HELD_OUT if (r.model, r.seq, r.micro_batch, r.accum) == ("mpt-760m", 512, 96, 2))
    mem = [sp.predict(r, sp.hardware(r.hardware, source=r.source))[0].memory for r in (a100, h100)]
    assert mem[0] == mem[1]
