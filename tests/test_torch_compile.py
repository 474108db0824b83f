# rmsnorm.torch under torch.compile(fullgraph=True) (no graph break; forward and backward equal
# to eager, Inductor and AOT-eager backends, static and dynamic shapes) and torch.export (the
# graph holds the rmsnorm ops; the exported program runs and gives eager's results).
import importlib

import pytest

torch = pytest.importorskip("torch")
rt = importlib.import_module("rmsnorm.torch")

HIDDEN = 32


class Block(torch.nn.Module):
    """A pre-norm block touching every public entry point: RMSNorm with offset and both casts,
    a weightless norm over two axes, the fused residual add."""

    def __init__(self):
        super().__init__()
        self.norm1 = rt.RMSNorm(HIDDEN, eps=1e-5, cast="before_weight")
        self.proj = torch.nn.Linear(HIDDEN, HIDDEN)
        self.norm2 = rt.RMSNorm(HIDDEN, eps=None, offset=1.0)
        self.head = torch.nn.Linear(HIDDEN, 8)
        with torch.no_grad():
            self.norm1.weight.uniform_(0.5, 1.5)
            self.norm2.weight.uniform_(-0.5, 0.5)

    def forward(self, x, residual):
        h = self.proj(self.norm1(x))
        y, stream = rt.add_rms_norm(h, residual, HIDDEN, self.norm2.weight, 1e-6, offset=1.0)
        z = rt.rms_norm(stream.view(*stream.shape[:-1], 4, HIDDEN // 4), (4, HIDDEN // 4))
        return self.head(self.norm2(y) + z.flatten(-2))


def inputs(rows=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, rows, HIDDEN, generator=gen).requires_grad_()
    residual = torch.randn(2, rows, HIDDEN, generator=gen).requires_grad_()
    return x, residual


def run(model, x, residual, fn=None):
    """Output and every gradient (inputs and model's parameters) of a scalar loss, through fn
    (model compiled) or model itself."""
    model.zero_grad()
    x, residual = x.detach().requires_grad_(), residual.detach().requires_grad_()
    out = (model if fn is None else fn)(x, residual)
    out.pow(2).sum().backward()
    grads = {"x": x.grad, "residual": residual.grad}
    grads.update({n: p.grad for n, p in model.named_parameters()})
    return out.detach(), grads


def assert_same(got, want, exact):
    # aot_eager runs the same kernels on the same inputs as eager: bit-identical. Inductor
    # compiles the surrounding Linear/add/pow itself, so those may round differently.
    tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(got[0], want[0], **tol)
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], **tol, msg=name)


@pytest.mark.parametrize(
    "backend,dynamic", [("aot_eager", False), ("aot_eager", True), ("inductor", False)]
)
def test_compile_fullgraph_matches_eager(backend, dynamic):
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Block()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(model, fullgraph=True, backend=counter, dynamic=dynamic)
    frames = []
    for rows in (6, 9) if dynamic else (6,):
        x, residual = inputs(rows)
        got = run(model, x, residual, compiled)
        assert_same(got, run(model, x, residual), backend != "inductor")
        frames.append(counter.frame_count)
    assert frames[-1] == frames[0]  # fullgraph: no break; dynamic: no recompile for a new length
    assert any("rmsnorm.rms_norm" in g.code for g in counter.graphs)


def test_compiled_graph_calls_the_ops():
    from torch._dynamo.testing import EagerAndRecordGraphs

    torch._dynamo.reset()
    backend = EagerAndRecordGraphs()
    model = Block()
    torch.compile(model, fullgraph=True, backend=backend)(*inputs())
    (graph,) = backend.graphs
    targets = {str(n.target) for n in graph.graph.nodes if n.op == "call_function"}
    assert {"rmsnorm.rms_norm.default", "rmsnorm.add_rms_norm.default"} <= targets


def test_export_captures_and_runs():
    torch.manual_seed(0)
    model = Block()
    x, residual = inputs()
    batch = torch.export.Dim("batch", min=1, max=64)
    exported = torch.export.export(
        model,
        (x.detach(), residual.detach()),
        dynamic_shapes=({0: batch}, {0: batch}),
    )
    targets = {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}
    assert {"rmsnorm.rms_norm.default", "rmsnorm.add_rms_norm.default"} <= targets
    for batch_size in (2, 5):
        xb, rb = (torch.randn(batch_size, 6, HIDDEN) for _ in range(2))
        with torch.no_grad():
            torch.testing.assert_close(exported.module()(xb, rb), model(xb, rb), rtol=0, atol=0)
    # The training IR keeps the ops as they are (no decomposition of a custom op).
    decomposed = exported.run_decompositions()
    assert "rmsnorm.rms_norm.default" in {str(n.target) for n in decomposed.graph.nodes}


def test_export_backward_graph():
    """Joint forward+backward tracing (what AOTAutograd does for training) reaches the
    registered backward op."""
    from torch._functorch.aot_autograd import aot_function

    seen = []

    def compiler(gm, _):
        seen.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return gm

    w = torch.rand(HIDDEN, requires_grad=True)
    fn = aot_function(lambda x, w: rt.rms_norm(x, HIDDEN, w, 1e-6), compiler, compiler)
    x = torch.randn(3, HIDDEN, requires_grad=True)
    fn(x, w).sum().backward()
    assert "rmsnorm.rms_norm.default" in seen[0]
    assert "rmsnorm.rms_norm_backward.default" in seen[1]
    ref = x.detach().requires_grad_()
    rt.rms_norm(ref, HIDDEN, w.detach(), 1e-6).sum().backward()
    assert torch.equal(x.grad, ref.grad)
