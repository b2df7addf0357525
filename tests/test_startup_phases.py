"""Start-up of a rank process (issue 31, cold start): the phases every rank reports, and what made them shorter.

- A multi-process run reports each rank's start-up phases (runtime/drivers/startup.py STARTUP_PHASES, plus "other" and
  "total") with its CTRL_DONE report; the run's metrics carry the slowest rank's per phase (startup_s) and each
  rank's (startup_s_by_rank). Seconds are checked for shape and sign only (no wall-clock assertions).
- Random weights are a counter-based draw (models/weights.py): its three implementations (numpy on the host, torch
  on any device, Triton on a GPU or in the interpreter) give the same integers, so a rank builds its weights on its
  GPU with the very values of the CPU reference. The CUDA comparison runs where a GPU is visible.
- A device-routed rank captures no host-routed expert graphs (CudaExecutor.prepare(host_experts=False)).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from graph_ir.spec import load_spec
from lowering.plan import compile_plan
from models.weights import _draw_numpy, _draw_torch, _stream_keys, random_weights
from runtime.drivers.cluster import RunOptions
from runtime.drivers.multiproc import run_workloads_multiprocess
from runtime.drivers.startup import STARTUP_PHASES
from test_runtime import make_requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPECS = os.path.join(ROOT, "models", "specs")
# (start, n) ranges of a stream: its start, an odd length, a chunk boundary, the last indices a stream may have
RANGES = [(0, 1), (0, 1000), (65530, 77), (12345, 4099), (2 ** 31 - 3000, 3000)]


def _tensors(w):
    out = {"embed": w.embed, "final_norm": w.final_norm, "head": w.head}
    for l, layer in enumerate(w.layers):
        out.update({f"{l}.{k}": v for k, v in layer.items()})
    return out


def test_a_two_rank_run_reports_every_start_up_phase():
    spec = load_spec(f"{SPECS}/tiny.yaml")
    plan = compile_plan(spec, 2)
    workloads = [(make_requests(spec.vocab_size, 3, seed=s, max_new=3), RunOptions(kv_blocks=64)) for s in (1, 2)]
    seen = []

    class Progress:  # what dataflow run's bar gets: (finished, total, tokens), and rank 0's start-up phase
        def __call__(self, done, total, tokens):
            pass

        def phase(self, text):
            seen.append(text)
    first, second = run_workloads_multiprocess(plan, workloads, timeout=240, progress=Progress())
    assert seen and seen[-1] == "serving", seen  # (the launcher polls: quick phases may pass unseen)
    want = set(STARTUP_PHASES) | {"other", "total"}
    for res in (first, second):
        st, by_rank = res.metrics["startup_s"], res.metrics["startup_s_by_rank"]
        assert set(st) == want and len(by_rank) == 2 and all(set(d) == want for d in by_rank)
        assert all(type(v) is float and v >= 0 for d in [st, *by_rank] for v in d.values()), by_rank
        assert st == {k: max(d[k] for d in by_rank) for k in want}  # the slowest rank's, per phase
        for d in by_rank:  # the phases and the rest add up to the total (each rounded to 1 us)
            assert sum(v for k, v in d.items() if k != "total") == pytest.approx(d["total"], abs=1e-4)
    assert first.metrics["startup_s"]["imports"] > 0
    # a later workload of the same launch counts its own start only: its KV pool, capture and barrier
    assert all(second.metrics["startup_s"][k] == 0 for k in ("spawn", "imports", "device_init", "rendezvous",
                                                            "weights", "executor"))


@pytest.mark.parametrize("start,n", RANGES)
def test_the_host_and_torch_draws_agree(start, n):
    k1, k2 = _stream_keys(5, "layers.3.q.w", start)
    assert torch.equal(_draw_numpy(start, n, k1, k2), _draw_torch(start, n, k1, k2, torch.device("cpu")))


def test_the_draw_is_odd_bounded_and_has_mean_0_std_1():
    t = _draw_numpy(0, 1 << 18, *_stream_keys(0, "embed"))
    assert t.dtype == torch.int32 and bool((t % 2 != 0).all()) and int(t.abs().max()) <= 131069
    z = t.double() * 2.6428997443872504e-05
    assert abs(float(z.mean())) < 0.01 and abs(float(z.std()) - 1) < 0.01
    assert abs(float(torch.corrcoef(torch.stack([z[:-1], z[1:]]))[0, 1])) < 0.01
    other = _draw_numpy(0, 1 << 18, *_stream_keys(0, "lm_head")).double()
    assert abs(float(torch.corrcoef(torch.stack([t.double(), other]))[0, 1])) < 0.01


def test_the_triton_draw_agrees_in_the_interpreter():
    """The Triton kernel (what a GPU rank runs) under Triton's CPU interpreter, in a fresh process (the interpreter
    is chosen when triton is imported)."""
    pytest.importorskip("triton")
    code = ("import torch\n"
            "from models.weights import _draw_numpy, _draw_triton, _stream_keys\n"
            f"for start, n in {RANGES!r}:\n"
            "    k1, k2 = _stream_keys(5, 'layers.3.q.w', start)\n"
            "    got = _draw_triton(start, n, k1, k2, torch.device('cpu'))\n"
            "    assert torch.equal(got, _draw_numpy(start, n, k1, k2)), (start, n)\n"
            "print('ok')\n")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


@pytest.mark.parametrize("backend", ["torch", "numpy"])
def test_random_weights_are_the_same_whatever_computes_the_draw(backend):
    spec = load_spec(f"{SPECS}/tiny-glm4-moe.yaml")  # dense layers, a shared expert, an fp32 correction bias
    want = _tensors(random_weights(spec))
    got = _tensors(random_weights(spec, backend=backend))
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("name", ["tiny-gpt-oss", "tiny-glm4-moe"])
def test_random_weights_built_on_the_gpu_equal_the_cpu_build(name):
    """Bit for bit: a GPU rank's weights are the CPU reference's (Triton's draw; torch's too), shard included."""
    spec = load_spec(f"{SPECS}/{name}.yaml")
    want = _tensors(random_weights(spec))
    for backend in (None, "torch"):
        got = _tensors(random_weights(spec, device="cuda", backend=backend))
        bad = [k for k in want if not (got[k].is_cuda and torch.equal(got[k].cpu(), want[k]))]
        assert not bad, (backend, bad[:5])
    E = spec.experts.num_experts
    held = [list(range(1, E, 3)) for _ in range(spec.num_layers)]
    shard = _tensors(random_weights(spec, device="cuda", experts=held))
    cpu = _tensors(random_weights(spec, experts=held))
    assert all(torch.equal(shard[k].cpu(), cpu[k]) for k in cpu)


def test_a_device_routed_prepare_captures_no_host_routed_expert_graph(monkeypatch, use_options):
    """Capture is faked on the CPU twin (a 'graph' that runs its body), as in test_executor_cuda; the keys are real."""
    from runtime.drivers.cluster import Cluster
    from runtime.executors.cuda_executor import CudaExecutor
    from test_executor_cuda import fake_capture
    fake_capture(monkeypatch)
    use_options(dispatch="device")
    spec = load_spec(f"{SPECS}/tiny-gpt-oss.yaml")
    plan = compile_plan(spec, 2)
    kinds = {}
    for host_experts in (False, True):
        ex = CudaExecutor(spec, random_weights(spec), plan, torch.device("cpu"))
        ex.graphs.capture = ex.expert_graphs = True
        cl = Cluster(plan, ex, RunOptions(policy="defrag", kv_blocks=64))
        e = cl.engines[0]
        assert e.device_routed
        ex.prepare(e.kv, owned=e.owned_experts, host_experts=host_experts)
        kinds[host_experts] = {k[0] for k in ex.graphs._graphs}
        assert ex.last_prepare["kv_alloc_s"] >= 0 and sum(n for n, _, _ in ex.last_prepare["kinds"].values()) == \
            len(ex.graphs._graphs)
    # (the twin's torch attention has no graphs to capture: attn_graphs is off)
    assert kinds[False] == {"expert_routed", "sample"} and kinds[True] == kinds[False] | {"expert"}
